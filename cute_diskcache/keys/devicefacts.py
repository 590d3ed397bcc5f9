"""Device facts: what a compile learned about the GPU, recorded with the kernel and checked at load.

A kernel is a product of more than its key. The DSL asks the driver for attributes while it
compiles and bakes the answers into the IR (``smem.max_smem_per_mp`` for kernels with
``min_blocks_per_mp > 1``; flashinfer 0.7.4 sites read the shared-memory limits too), and
flashinfer's dispatch reads the SM count and capability. flashinfer's in-process keys hold some
of these, not all. An offline prewarm answers them from a target profile, and a fleet of
different cards may share one cache volume, so an entry must say which answers it was built
with, and a process must refuse an entry whose answers are not its device's.

Three pieces:

* :func:`device_class` - capability and SM count of the device this process compiles for
  (the target profile's, else the live device's). It is part of the key's environment, so
  different card models never share an entry.
* :func:`recording` - while a compile runs, every driver attribute the DSL queries is recorded
  (through one hook on ``cutlass.base_dsl.runtime.cuda.get_device_attribute``). With a target
  profile the hook answers from the profile, and an attribute the profile lacks raises
  :class:`MissingDeviceFact`: a compile never silently reads a guess, nor the attributes of a
  different card that happens to be in the machine.
* :func:`mismatch` - at load, compares each recorded fact with the profile's or live device's
  value; the first difference is named, and the caller treats the entry as a miss.

Nothing here imports the DSL or touches the driver until a compile or a load asks, and the live
values are read once per process: the hit path pays a dict comparison.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any
from collections.abc import Iterator

from . import targets

log = logging.getLogger("cute_diskcache")

# Always recorded (flashinfer's dispatch reads them outside the compile itself); everything
# else only when the compile asked for it.
BASELINE = ("compute_capability_major", "compute_capability_minor", "multiprocessor_count")


class MissingDeviceFact(RuntimeError):
    """A compile for a target profile read a device fact the profile does not carry."""


def fact_name(attribute: Any) -> str:
    """``CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR`` -> the
    profile-and-manifest spelling ``max_shared_memory_per_multiprocessor``."""
    name = getattr(attribute, "name", None) or str(attribute).rsplit(".", 1)[-1]
    return name.removeprefix("CU_DEVICE_ATTRIBUTE_").lower()


def _profile_facts(profile: targets.DeviceProfile) -> dict[str, int]:
    return {name.lower(): value for name, value in profile.driver_attributes().items()}


# -- the one hook on the DSL's attribute query ------------------------------------------------

_local = threading.local()
_hook_lock = threading.Lock()


def _recorders() -> list[dict[str, int]]:
    stack: list[dict[str, int]] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def install_hook() -> bool:
    """Route the DSL's device attribute queries through :func:`_answer` (idempotent).

    False when the DSL is not installed (nothing to record; nothing can compile either).
    """
    try:
        import cutlass.base_dsl.runtime.cuda as dsl_cuda
    except ImportError:
        return False
    with _hook_lock:
        current = dsl_cuda.get_device_attribute
        if getattr(current, "_cdc_real", None) is not None:
            return True
        real = current

        def get_device_attribute(attribute: Any, device_id: int = 0) -> Any:
            value = _answer(real, attribute, device_id)
            for seen in _recorders():
                seen[fact_name(attribute)] = value
            return value

        get_device_attribute._cdc_real = real  # type: ignore[attr-defined]
        dsl_cuda.get_device_attribute = get_device_attribute
    return True


def _answer(real: Any, attribute: Any, device_id: int) -> Any:
    profile = targets.active()
    if profile is None:
        return real(attribute, device_id)
    name = fact_name(attribute)
    known = _profile_facts(profile)
    if name not in known:
        raise MissingDeviceFact(
            f"target profile {profile.name} has no value for device attribute {name.upper()}, which this "
            f"compile reads; add the card's real value to the profile (cute_diskcache/keys/targets.py)"
        )
    return known[name]


@contextlib.contextmanager
def recording() -> Iterator[dict[str, Any]]:
    """Record the device facts one compile reads, in this thread; yields the manifest record.

    The record is filled in when the block exits: ``{"source", "name", "facts"}`` where
    ``facts`` maps each attribute read (plus :data:`BASELINE`) to its value. Nested compiles
    each get their own record and also count toward the enclosing one.
    """
    install_hook()
    seen: dict[str, int] = {}
    record: dict[str, Any] = {}
    stack = _recorders()
    stack.append(seen)
    try:
        yield record
    finally:
        stack.remove(seen)
        record.update(_record(seen))


def _record(seen: dict[str, int]) -> dict[str, Any]:
    source = current_source()
    facts = dict(seen)
    for name in BASELINE:
        if name not in facts:
            value = source.value(name)
            if value is not None:
                facts[name] = value
    return {"source": source.label, "name": source.device_name, "facts": {k: int(v) for k, v in sorted(facts.items())}}


# -- where the comparison values come from ----------------------------------------------------


class _Source:
    """The device this process compiles for and runs on: a target profile, a live GPU, or none."""

    def __init__(self, label: str, device_name: str, profile: targets.DeviceProfile | None, device_id: int | None) -> None:
        self.label = label
        self.device_name = device_name
        self.profile = profile
        self.device_id = device_id
        self._values: dict[str, int | None] = {}
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self.profile is not None or self.device_id is not None

    def value(self, name: str) -> int | None:
        """The fact's value, or None when this source cannot tell (no device, unknown attribute)."""
        with self._lock:
            if name in self._values:
                return self._values[name]
        if self.profile is not None:
            value = _profile_facts(self.profile).get(name)
        elif self.device_id is not None:
            value = _live_attribute(name, self.device_id)
        else:
            value = None
        with self._lock:
            self._values[name] = value
        return value


def _live_attribute(name: str, device_id: int) -> int | None:
    try:
        import cutlass.base_dsl.runtime.cuda as dsl_cuda

        attribute = getattr(dsl_cuda.cuda.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name.upper())
        dsl_cuda.checkCudaErrors(dsl_cuda.cuda.cuInit(0))  # torch may not have touched the driver yet
        real = getattr(dsl_cuda.get_device_attribute, "_cdc_real", dsl_cuda.get_device_attribute)
        return int(real(attribute, device_id))
    except Exception as exc:  # noqa: BLE001 - no driver, no device, an attribute this driver does not know
        log.debug("device attribute %s unreadable: %s", name, exc)
        return None


def _current_device_index() -> int:
    """The CUDA device this process works on: torch's current one once torch has set it up."""
    import sys

    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - torch's CUDA state unreadable: the first device, as the DSL assumes
        pass
    return 0


@functools.cache
def _source_for(profile: targets.DeviceProfile | None, device_id: int) -> _Source:
    if profile is not None:
        return _Source(f"profile:{profile.name}", profile.device_name, profile, None)
    probe = _Source("device", "", None, device_id)
    if probe.value("compute_capability_major") is None:
        return _Source("none", "", None, None)
    probe.device_name = _live_device_name(device_id)
    return probe


def _live_device_name(device_id: int) -> str:
    try:
        import cutlass.base_dsl.runtime.cuda as dsl_cuda

        device = dsl_cuda.checkCudaErrors(dsl_cuda.cuda.cuDeviceGet(device_id))  # raises with the driver's error code
        raw = dsl_cuda.checkCudaErrors(dsl_cuda.cuda.cuDeviceGetName(256, device))
        return bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
    except Exception as exc:  # noqa: BLE001 - no driver, no device: the facts carry no name, and the log says why
        log.debug("device %d name unreadable: %s", device_id, exc)
        return ""


def current_source() -> _Source:
    return _source_for(targets.active(), _current_device_index())


def device_class() -> str:
    """``cc12.0-188sm`` for the device this process compiles for; ``""`` when there is none.

    Part of the key's environment: two card models of one arch (an RTX 5090 and an RTX PRO 6000)
    never share an entry, so a shared volume holds each card's kernels side by side instead of
    one card's kernels failing the other's fact check on every start.
    """
    source = current_source()
    if not source.available:
        return ""
    major, minor, sms = (source.value(n) for n in BASELINE)
    if major is None or minor is None or sms is None:
        return ""
    return f"cc{major}.{minor}-{sms}sm"


def mismatch(record: Any) -> str | None:
    """Why ``record`` (a manifest's ``device``) does not fit this process's device, or None.

    Each recorded fact is compared with the target profile's value, else the live device's; a
    fact the current source cannot answer is a mismatch too (nothing proves the kernel fits).
    With no profile and no device there is nothing to compare against and nothing will launch
    the kernel here: None.
    """
    source = current_source()
    if not source.available:
        return None
    facts = record.get("facts", {}) if isinstance(record, dict) else {}
    for name, built in sorted(facts.items()):
        here = source.value(name)
        if here is None:
            return f"{name}: built against {built}, {source.label} cannot tell this device's value"
        if here != built:
            return f"{name}: built against {built} ({record.get('source')}), this device has {here} ({source.label})"
    return None


def validate(record: Any) -> bool:
    """Whether a manifest's ``device`` field has the shape :func:`recording` writes."""
    if not isinstance(record, dict):
        return False
    facts = record.get("facts")
    return (
        isinstance(record.get("source"), str)
        and isinstance(record.get("name"), str)
        and isinstance(facts, dict)
        and len(facts) <= 256
        and all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in facts.items())
    )
