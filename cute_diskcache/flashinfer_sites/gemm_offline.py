"""Stand-ins that let flashinfer's public GEMM API compile for a card that is not in the machine.

Prewarm drives ``mm_fp4`` / ``mm_mxfp8`` exactly as an engine calls them, on CPU tensors, with
a target profile. Those entry points ask a few things of the device before they reach a
compile; with a profile active (and only then) they are answered as the card would:

* ``get_compute_capability(device)``: flashinfer refuses a non-CUDA device outright; a CPU
  device is answered with the profile's capability (a CUDA device still asks the driver).
* ``torch.cuda.current_device()``: index 0 when torch has no CUDA device (a CPU build).
* ``_get_stream_cache_buf``: the per-stream workspace; for a CPU device a plain host buffer of
  the size asked (the kernel never runs on it: its launch refuses CPU tensors after compiling).
* ``get_cuda_version()``: flashinfer asks ``nvcc`` or a CUDA torch, neither of which an offline
  build box has; then the CUDA version of this process's CUDA bindings (what the DSL compiles
  with) answers. It only gates which backend flashinfer offers, never the generated code.

The kernels compiled this way are the card's: everything that reaches codegen (arch, SM count,
driver attributes) comes from the profile, and each entry records what it was built against.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import sys
from types import ModuleType
from typing import Any
from collections.abc import Callable

from ..keys import targets
from ..core.patches import PATCHES
from .names import MSA_PROXY

log = logging.getLogger("cute_diskcache")

UTILS = "flashinfer.utils"
GEMM_BASE = "flashinfer.gemm.gemm_base"
MXFP8 = "flashinfer.gemm.gemm_mm_mxfp8_cute_dsl"
SM12X_RUNNER = "flashinfer.gemm.kernels.sm12x_cute.runner"
#: module -> the names in it that get a stand-in.
STANDS_IN = {
    UTILS: ("get_compute_capability", "is_sm12x_supported"),
    GEMM_BASE: ("get_compute_capability", "get_cuda_version", "_get_stream_cache_buf"),
    MXFP8: ("get_cuda_version",),
    SM12X_RUNNER: ("get_compute_capability",),
    MSA_PROXY: ("is_sm12x_supported",),
}


def _capability(real: Callable[..., Any], profile: targets.DeviceProfile) -> Callable[..., Any]:
    @functools.wraps(real)
    def get_compute_capability(device: Any) -> tuple[int, int]:
        if getattr(device, "type", None) == "cpu":
            return tuple(profile.capability)  # type: ignore[return-value]
        return real(device)

    return get_compute_capability


def bindings_cuda_version() -> str | None:
    """``major.minor`` of the installed CUDA Python bindings (``cuda-bindings``), or None."""
    for dist in ("cuda-bindings", "cuda-python"):
        try:
            parts = importlib.metadata.version(dist).split(".")
        except importlib.metadata.PackageNotFoundError:
            continue
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            return f"{parts[0]}.{parts[1]}"
    return None


def _cuda_version(real: Callable[[], Any]) -> Callable[[], Any]:
    @functools.wraps(real)
    def get_cuda_version() -> Any:
        try:
            return real()
        except RuntimeError:  # no nvcc, CPU torch: answer with what the DSL compiles with
            found = bindings_cuda_version()
            if found is None:
                raise
            from packaging.version import Version

            return Version(found)

    return get_cuda_version


def _sm12x_supported(real: Callable[..., Any], profile: targets.DeviceProfile) -> Callable[..., Any]:
    """flashinfer's SM12x gate (MSA's ops ask it) reads ``torch.version.cuda``, None in a CPU
    torch: for a CPU tensor, answer for the profile's card and the CUDA the DSL compiles with."""
    @functools.wraps(real)
    def is_sm12x_supported(device: Any) -> bool:
        if getattr(device, "type", None) != "cpu":
            return bool(real(device))
        major, minor = tuple(profile.capability)
        found = bindings_cuda_version()
        if major != 12 or found is None:
            return False
        from packaging.version import Version

        return Version(found) >= Version("12.9" if minor >= 1 else "12.8")

    return is_sm12x_supported


def _stream_buffer(real: Callable[..., Any]) -> Callable[..., Any]:
    held: dict[str, Any] = {}  # one host buffer per name, grown as asked (as flashinfer keeps one per stream)

    @functools.wraps(real)
    def _get_stream_cache_buf(name: str, num_bytes: int, device: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(device, "type", None) == "cpu":
            import torch

            buf = held.get(name)
            if buf is None or buf.numel() < num_bytes:
                buf = held[name] = torch.zeros(num_bytes, dtype=torch.uint8)
            return buf
        return real(name, num_bytes, device, *args, **kwargs)

    return _get_stream_cache_buf


_MAKERS: dict[str, Callable[..., Callable[..., Any]]] = {
    "get_compute_capability": _capability,
    "get_cuda_version": lambda real, _profile: _cuda_version(real),
    "is_sm12x_supported": _sm12x_supported,
    "_get_stream_cache_buf": lambda real, _profile: _stream_buffer(real),
}


def apply(module: ModuleType, profile: targets.DeviceProfile) -> None:
    """Give ``module`` the stand-ins it needs for ``profile`` (idempotent; a no-op for others)."""
    names = STANDS_IN.get(module.__name__)
    if not names:
        return
    with PATCHES.lock:
        for name in names:
            current = module.__dict__.get(name)
            if current is None or getattr(current, "_cdc_offline", False):
                continue  # absent, or imported by name from a module that already has the stand-in
            stand_in = _MAKERS[name](current, profile)
            stand_in._cdc_offline = True  # type: ignore[attr-defined]
            PATCHES.set(module, name, stand_in)
    _cpu_current_device()


def _cpu_current_device() -> None:
    """``torch.cuda.current_device()`` is 0 in a torch without a CUDA device (flashinfer asks it)."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(torch.cuda.current_device, "_cdc_offline", False) or torch.cuda.is_available():
        return

    def current_device() -> int:
        return 0

    current_device._cdc_offline = True  # type: ignore[attr-defined]
    torch.cuda.current_device = current_device
