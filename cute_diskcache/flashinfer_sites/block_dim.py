"""Owns the direct micro kernel's block-dim probe answer, stored beside the kernel as side data.

``moe_dispatch`` (0.6.17+) probes each direct micro kernel for the block size it can launch,
which a kernel loaded from disk cannot answer (the backend would turn off). So the answer is
stored beside the kernel and the probe, hooked in ``moe_dispatch``, reads it; offline it comes
from the cubin.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import ModuleType
from typing import Any

from ..storage import elf
from ..keys import targets
from ..core.patches import PATCHES
from ..core.through import planned
from .names import MOE_DISPATCH, SM12X

log = logging.getLogger("cute_diskcache")

DIRECT_MICRO = f"{SM12X}.moe_direct_micro_kernel"
PROBE = "compiled_direct_micro_accepts_block_dim"

#: id(kernel) -> (kernel, block_dim, accepts): answers moe_dispatch's probe for kernels we handed out.
_BLOCK_DIM: dict[int, tuple[Any, int, bool]] = {}
_BLOCK_DIM_LOCK = threading.Lock()


def extra(kernel: Any, kernel_object: Any) -> dict[str, Any]:
    """The probe's answer for a freshly compiled kernel, stored beside it."""
    return {"block_dim_probe": probe_block_dim(kernel, int(kernel_object.launch_block_dim))}


def extra_ok(extra: dict[str, Any]) -> bool:
    """Side data from disk is what :func:`extra` writes, or the entry is a miss."""
    probe = extra.get("block_dim_probe")
    return (isinstance(probe, dict) and isinstance(probe.get("block_dim"), int) and not isinstance(probe.get("block_dim"), bool)
            and isinstance(probe.get("accepts"), bool))


def deliver(kernel: Any, extra: dict[str, Any], kernel_object: Any) -> None:
    """Remember the stored answer for the kernel handed to flashinfer (hit or miss): its probe reads it."""
    dispatch = sys.modules.get(MOE_DISPATCH)
    if dispatch is not None:
        patch(dispatch)
    block_dim = int(kernel_object.launch_block_dim)
    stored = extra.get("block_dim_probe") if extra_ok(extra) else {}
    if stored.get("block_dim") == block_dim and isinstance(stored.get("accepts"), bool):
        accepts = stored["accepts"]
    elif planned(kernel):
        accepts = True  # planning with nothing on disk yet: the kernel's reqntid makes it the rule
    else:
        return  # an entry without the probe (should not happen): the hook probes
    with _BLOCK_DIM_LOCK:
        _BLOCK_DIM[id(kernel)] = (kernel, block_dim, accepts)


def accepts_block_dim(compiled: Any, block_dim: int) -> bool:
    """moe_dispatch's ``compiled_direct_micro_accepts_block_dim``, answered from side data.

    A kernel that came through the cache (hit or miss) carries its stored answer: a hit never
    probes again. Any other kernel is probed now (:func:`probe_block_dim`).
    """
    with _BLOCK_DIM_LOCK:
        found = _BLOCK_DIM.get(id(compiled))
    if found is not None and found[0] is compiled and found[1] == int(block_dim):
        return found[2]
    return bool(probe_block_dim(compiled, int(block_dim))["accepts"])


def probe_block_dim(compiled: Any, block_dim: int) -> dict[str, Any]:
    """Whether ``compiled`` can launch ``block_dim`` threads, and how we know.

    On the real card: flashinfer's own driver probe (``source: driver``). For a target profile
    the driver is absent (flashinfer's probe would say False and disable the backend): the
    answer comes from the cubin, as the driver computes it, from the kernel's register count
    and its ``reqntid``/``maxntid`` (``source: cubin``). Both record the cubin facts.
    """
    info: dict[str, Any] = {"block_dim": int(block_dim)}
    profile = targets.active()
    try:
        limits = cubin_thread_limits(compiled, profile)
    except Exception as exc:  # noqa: BLE001 - facts only; never fail the compile over them
        log.debug("cubin facts unavailable: %s", exc)
        limits = None
    info["cubin"] = limits
    if profile is None:
        real = sys.modules[DIRECT_MICRO].compiled_direct_micro_accepts_block_dim
        info.update(accepts=bool(real(compiled, block_dim)), source="driver")
        if limits is not None and (limits["max_threads"] >= block_dim) != info["accepts"]:
            log.warning("direct micro block-dim probe: driver says %s, cubin facts %s", info["accepts"], limits)
    elif limits is not None:
        info.update(accepts=limits["max_threads"] >= block_dim, source="cubin", target=profile.name)
    else:
        log.warning("direct micro block-dim probe: no driver and no cubin facts; assuming it launches")
        info.update(accepts=True, source="assumed", target=profile.name)
    return info


def cubin_thread_limits(compiled: Any, profile: targets.DeviceProfile | None = None) -> dict[str, Any] | None:
    """``CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK`` of a compiled kernel, from its cubin.

    The driver's answer is the least of the device's block limit (1024), the kernel's
    ``reqntid``/``maxntid`` and what its registers allow: ``regs * 32`` rounded up to the
    256-register allocation unit per warp, against the 64 Ki registers of one block.
    """

    obj = compiled.dump_to_object("cdc_probe")
    cubins = elf.cubins_in(obj)
    if not cubins:
        return None
    attrs = profile.driver_attributes() if profile else {"MAX_THREADS_PER_BLOCK": 1024, "MAX_REGISTERS_PER_BLOCK": 65536}
    regs = ntid = 0
    for cubin in cubins:
        facts = elf.kernel_facts(cubin)
        regs = max(regs, facts["regs"])
        ntid = max(ntid, facts["ntid"])
    per_warp = -(-regs * 32 // 256) * 256 if regs else 256
    by_regs = (attrs["MAX_REGISTERS_PER_BLOCK"] // per_warp) * 32
    limit = min(attrs["MAX_THREADS_PER_BLOCK"], by_regs, ntid or attrs["MAX_THREADS_PER_BLOCK"])
    return {"regs": regs, "ntid": ntid, "max_threads": limit}


def patch(md: ModuleType) -> None:
    """Answer ``moe_dispatch``'s probe from side data (idempotent; a release without it: nothing)."""
    if hasattr(md, PROBE) and not PATCHES.touched(md, PROBE):
        PATCHES.set(md, PROBE, accepts_block_dim)


def unpatch(md: ModuleType) -> None:
    if targets.active() is None:  # a profile still needs it: the driver is absent
        PATCHES.restore(md, (PROBE,))
