"""Device profiles: compile for a card that is not in the machine.

An image build box, a CI runner or a laptop has no RTX PRO 6000 but must produce exactly the
kernels one would. The DSL itself compiles for any arch named in ``CUTE_DSL_ARCH``; what is
missing is the handful of device queries the compile sites make (SM count, capability, max
active clusters, the current stream). A profile answers them with the card's real values.

With a GPU present and no profile asked for, nothing here runs: real queries, real answers.

A card that is not here has three homes, by who asks: this module holds the profiles and answers
``torch.cuda``'s queries, which every library makes; what one library asks beyond them is its
adapter's (flashinfer: :mod:`..flashinfer_sites.offline` and :mod:`..flashinfer_sites.gemm_offline`;
b12x is handed the profile's device identity by :mod:`..b12x_sites.planning`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("cute_diskcache")


@dataclass(frozen=True)
class DeviceProfile:
    """The facts a compile may read from a device, for one named card."""

    name: str
    device_name: str
    arch: str  # CUTE_DSL_ARCH
    capability: tuple[int, int]
    sm_count: int
    # cudaOccupancyMaxActiveClusters for cluster size 1 with max opt-in shared memory: one
    # cluster per SM on these parts, which is what flashinfer's dispatch reads.
    max_active_clusters_1: int
    max_shared_memory_per_multiprocessor: int
    max_shared_memory_per_block_optin: int
    total_memory: int
    # Driver attributes that differ from (or are missing in) the defaults below: for a card we
    # do not list, or a card variant; ``None`` removes an attribute, so a compile reading it fails.
    attributes: tuple[tuple[str, int | None], ...] = ()
    # shares memory with the host (torch's ``is_integrated``): the DGX Spark's GB10
    integrated: bool = False
    # The host CPUs this card is served from, as a key names them (.hostmachine): the machine
    # whose host code its entries must hold. The first is the default when the building
    # machine is none of them. A JSON profile overrides it (an RTX card in an Arm server).
    host_machines: tuple[str, ...] = ("x86_64",)

    def max_active_clusters(self, cluster_size: int) -> int:
        return max(1, self.max_active_clusters_1 // max(1, cluster_size))

    def facts(self) -> dict[str, Any]:
        """What gets recorded in a manifest as the device a kernel was built against."""
        d = asdict(self)
        d["capability"] = list(self.capability)
        d["attributes"] = dict(self.attributes)
        d["host_machines"] = list(self.host_machines)
        return d

    def driver_attributes(self) -> dict[str, int]:
        """``CU_DEVICE_ATTRIBUTE_*`` (without the prefix) -> value, as the card's driver answers.

        The DSL reads some of these while it compiles and bakes them into the IR (e.g.
        ``smem.max_smem_per_mp`` for kernels with ``min_blocks_per_mp > 1``), so an offline
        compile must be given the card's values, not a guess.
        """
        attrs: dict[str, int | None] = {
            "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": self.max_shared_memory_per_multiprocessor,
            "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": self.max_shared_memory_per_block_optin,
            "MULTIPROCESSOR_COUNT": self.sm_count,
            "COMPUTE_CAPABILITY_MAJOR": self.capability[0],
            "COMPUTE_CAPABILITY_MINOR": self.capability[1],
            "MAX_THREADS_PER_BLOCK": 1024,
            "MAX_REGISTERS_PER_BLOCK": 65536,
            "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536,
            "WARP_SIZE": 32,
        }
        attrs.update((name.upper(), value) for name, value in self.attributes)
        return {name: value for name, value in attrs.items() if value is not None}


_SM120_SMEM = dict(max_shared_memory_per_multiprocessor=102400, max_shared_memory_per_block_optin=101376)
_GiB = 1 << 30

PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile("rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell Server Edition", "sm_120a", (12, 0), 188, 188, total_memory=96 * _GiB, **_SM120_SMEM),
        DeviceProfile("rtx-5090", "NVIDIA GeForce RTX 5090", "sm_120a", (12, 0), 170, 170, total_memory=32 * _GiB, **_SM120_SMEM),
        DeviceProfile("rtx-5080", "NVIDIA GeForce RTX 5080", "sm_120a", (12, 0), 84, 84, total_memory=16 * _GiB, **_SM120_SMEM),
        DeviceProfile("rtx-5070-ti", "NVIDIA GeForce RTX 5070 Ti", "sm_120a", (12, 0), 70, 70, total_memory=16 * _GiB, **_SM120_SMEM),
        # The GB10 superchip's CPU is a 20-core Arm (Cortex-X925 + Cortex-A725) running aarch64 Linux.
        DeviceProfile("dgx-spark", "NVIDIA GB10", "sm_121a", (12, 1), 48, 48, total_memory=128 * _GiB, integrated=True,
                      host_machines=("aarch64",), **_SM120_SMEM),
        DeviceProfile(
            "h200",
            "NVIDIA H200",
            "sm_90a",
            (9, 0),
            132,
            132,
            max_shared_memory_per_multiprocessor=233472,
            max_shared_memory_per_block_optin=232448,
            total_memory=150_109_880_320,  # read on the H200 here (bench/results/h200_offline_vs_device.json)
        ),
    )
}

DEFAULT_PROFILE = "rtx-pro-6000"


class UnknownProfileError(ValueError):
    pass


def get(name: str) -> DeviceProfile:
    """A bundled profile by name, or one read from a JSON file (a path ending in ``.json``)."""
    if name.endswith(".json"):
        return load(name)
    try:
        return PROFILES[name.lower().replace("_", "-")]
    except KeyError:
        raise UnknownProfileError(f"unknown target profile {name!r}; known: {', '.join(PROFILES)}, or a .json file") from None


def load(path: str | os.PathLike[str]) -> DeviceProfile:
    """A profile from JSON: ``{"base": "rtx-5090", "name": ..., "sm_count": ..., "attributes": {...}}``.

    For a card the bundled table lacks: start from the closest ``base`` and give the values
    read on the card (``nvidia-smi -q``, ``cudaGetDeviceProperties``). Unknown fields are an
    error, not ignored: a misspelt fact must not silently compile against the base's value.
    """
    import dataclasses
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            spec = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UnknownProfileError(f"cannot read target profile {path}: {exc}") from None
    if not isinstance(spec, dict):
        raise UnknownProfileError(f"target profile {path}: expected a JSON object")
    base = get(str(spec.pop("base", DEFAULT_PROFILE)))
    fields = {f.name for f in dataclasses.fields(DeviceProfile)}
    unknown = sorted(set(spec) - fields)
    if unknown:
        raise UnknownProfileError(f"target profile {path}: unknown fields {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    if "capability" in spec:
        spec["capability"] = tuple(spec["capability"])
    if "attributes" in spec:
        spec["attributes"] = tuple(sorted((str(k).upper(), v) for k, v in dict(spec["attributes"]).items()))
    if "host_machines" in spec:
        from . import hostmachine

        machines = spec["host_machines"]
        try:
            spec["host_machines"] = tuple(hostmachine.normalize(m) for m in ([machines] if isinstance(machines, str) else machines))
        except (hostmachine.UnknownMachineError, TypeError) as exc:
            raise UnknownProfileError(f"target profile {path}: host_machines: {exc}") from None
        if not spec["host_machines"]:
            raise UnknownProfileError(f"target profile {path}: host_machines is empty")
    spec.setdefault("name", Path(path).stem)
    return dataclasses.replace(base, **spec)


#: Memory bus width (bits), memory clock and boost clock (kHz, as torch reports them) of the
#: sm12x cards, from NVIDIA's published specifications (bandwidth = clock x width x 2 / 8 for
#: GDDR7, x 1 for the GB10's LPDDR5x, whose clock CUDA reports as the effective rate); not read
#: from a card. Planning code reads them, not the DSL: SGLang's SM12x FA4 decode picks its
#: split-KV count from them (``fa4_sm120/runtime.py::_get_decode_hardware``). A wrong value can
#: only make an offline plan name another kernel (a miss on the card), never a wrong one: the
#: key is what the compile receives. Profiles without an entry leave the attributes absent.
_MEMORY_SPECS: dict[str, tuple[int, int, int]] = {
    "rtx-pro-6000": (512, 14_000_000, 2_617_000),  # 1792 GB/s
    "rtx-5090": (512, 14_000_000, 2_407_000),  # 1792 GB/s
    "rtx-5080": (256, 15_000_000, 2_617_000),  # 960 GB/s
    "rtx-5070-ti": (256, 14_000_000, 2_452_000),  # 896 GB/s
    "dgx-spark": (256, 8_531_250, 2_418_000),  # 273 GB/s
}


class _Props:
    """Stands in for ``torch.cuda.get_device_properties``'s result."""

    def __init__(self, p: DeviceProfile) -> None:
        self.name = p.device_name
        self.major, self.minor = p.capability
        self.multi_processor_count = p.sm_count
        self.total_memory = p.total_memory
        self.shared_memory_per_multiprocessor = p.max_shared_memory_per_multiprocessor
        self.shared_memory_per_block_optin = p.max_shared_memory_per_block_optin
        self.max_shared_memory_per_block_optin = p.max_shared_memory_per_block_optin
        self.warp_size = 32
        self.is_integrated = p.integrated
        self.is_multi_gpu_board = False
        if p.name in _MEMORY_SPECS:
            self.memory_bus_width, self.memory_clock_rate, self.clock_rate = _MEMORY_SPECS[p.name]

    def __repr__(self) -> str:
        return f"_CudaDeviceProperties(name={self.name!r}, major={self.major}, minor={self.minor}, multi_processor_count={self.multi_processor_count}, profile=True)"


class _Stream:
    cuda_stream = 0  # the legacy default stream; compile-time only, never launched on
    device = None

    def synchronize(self) -> None:
        pass

    def wait_stream(self, *_: Any, **__: Any) -> None:
        pass


_active: DeviceProfile | None = None


class ProfileRefused(RuntimeError):
    """A target profile asked for in a process that sees a real CUDA device."""


def _nvml_device_count() -> int | None:
    """GPUs the NVIDIA driver reports, through NVML (no CUDA context: safe before a fork); None if unknown."""
    try:
        import pynvml  # nvidia-ml-py, a flashinfer dependency
    except Exception:  # noqa: BLE001 - nvidia-ml-py missing or broken: the GPU count is unknown
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0  # no driver loaded: no NVIDIA device here
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def refusal(name: str | None) -> str | None:
    """Why profile ``name`` cannot be used here (one line, for exit status 2), or None.

    Checked before anything is planned or compiled: an unknown name or unreadable JSON profile,
    or a profile on a machine that sees a real CUDA device (see :func:`apply`), must not surface
    as a traceback and exit 1, which a build script would read as "kernels failed".
    """
    if not name:
        return None
    from .. import config

    try:
        profile = get(name)
    except UnknownProfileError as exc:
        return str(exc)
    if cuda_device_visible() and not config.flag("target_force"):
        return (f"target profile {profile.name} refused: a CUDA device is visible here; run without --target to "
                f"build for this card, or set CUTE_DISKCACHE_TARGET_FORCE=1 to build for {profile.name} anyway")
    return None


def cuda_device_visible() -> bool:
    """Whether this process can see a CUDA device (without creating a CUDA context).

    ``CUDA_VISIBLE_DEVICES`` set to nothing (or ``-1``) hides every device; otherwise the
    driver is asked through NVML, and without NVML the driver's ``/proc`` entries tell.
    """
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None and mask.strip() in ("", "-1", "NoDevFiles", "none"):
        return False
    count = _nvml_device_count()
    if count is not None:
        return count > 0
    try:
        return any(os.scandir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


def active() -> DeviceProfile | None:
    """The profile this process compiles for, if one was applied."""
    return _active


def apply(profile: DeviceProfile | str, *, force: bool = False) -> DeviceProfile:
    """Make this process compile for ``profile``: set the arch and answer torch's device queries.

    Must run before flashinfer is imported (it queries the device at import time). Applying
    a second, different profile is refused: half the kernels would be built for one card and
    half for another.

    A profile replaces ``torch.cuda``'s device queries and ``current_stream`` for the whole
    process, so with a real CUDA device visible it is refused (:class:`ProfileRefused`): a
    prewarm image's ``CUTE_DISKCACHE_TARGET`` left in a serving environment would otherwise hand
    every ``torch.cuda.current_stream()`` of the engine a fake stream. ``force``
    (``CUTE_DISKCACHE_TARGET_FORCE=1``) applies it anyway, for compiling for another card on a
    box that has a GPU and serves nothing.
    """
    global _active
    p = get(profile) if isinstance(profile, str) else profile
    if _active is not None:
        if _active != p:
            raise RuntimeError(f"target profile {_active.name} already applied; cannot switch to {p.name}")
        return p
    from .. import config

    if not (force or config.flag("target_force")) and cuda_device_visible():
        raise ProfileRefused(
            f"target profile {p.name} refused: a CUDA device is visible, and a profile would stand in for it in the whole "
            f"process (torch.cuda's device queries and streams); unset CUTE_DISKCACHE_TARGET to use the real device, "
            f"or set CUTE_DISKCACHE_TARGET_FORCE=1 to compile for {p.name} on this machine anyway"
        )
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch and arch != p.arch:
        raise RuntimeError(f"CUTE_DSL_ARCH={arch} contradicts target profile {p.name} ({p.arch})")
    os.environ["CUTE_DSL_ARCH"] = p.arch

    import torch

    props = _Props(p)
    tc = torch.cuda
    tc.get_device_properties = lambda device=None: props
    tc.get_device_capability = lambda device=None: p.capability
    tc.get_device_name = lambda device=None: p.device_name
    tc.current_stream = lambda device=None: _Stream()
    tc.is_current_stream_capturing = lambda: False
    if not hasattr(torch._C, "_cuda_getCurrentRawStream"):  # a CPU torch: SGLang's FA4 reads it at import
        torch._C._cuda_getCurrentRawStream = lambda device=None: 0
    if torch.version.cuda is None:  # a CPU torch: ``with torch.cuda.device(i)`` (SGLang's Qwen3.x GEMM compiles under it)
        tc._exchange_device = tc._maybe_exchange_device = lambda device: 0
    _active = p
    log.info("compiling for target profile %s (%s, %d SMs)", p.name, p.arch, p.sm_count)
    return p
