"""The GPU in this machine, if any, as the CUDA driver sees it; and which code can run on it.

Used by ``verify --device`` to hand cubins to the driver, which checks them as a launch would.
cuda-python's driver bindings ship with the DSL; nothing here needs torch or flashinfer.
"""

from __future__ import annotations

import re
from typing import Any

_ARCH = re.compile(r"sm_(\d+)(\d)([af]?)")


def _arch_number(arch: str) -> tuple[int, int, str] | None:
    m = _ARCH.fullmatch(arch or "")
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def arch_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Can code built for ``arch`` (``sm_120a``, ``sm_100f``, ``sm_90``) run on a device of ``capability``?

    ``a`` (arch-specific) code runs on exactly that capability, ``f`` (family) code on the same
    major with an equal or newer minor, plain code on the same major too.
    """
    parsed = _arch_number(arch)
    if parsed is None:
        return False
    major, minor, suffix = parsed
    if suffix == "a":
        return (major, minor) == tuple(capability)
    return major == capability[0] and capability[1] >= minor


class Gpu:
    """The first visible CUDA device, through the driver API."""

    def __init__(self, cu: Any, dev: Any, name: str, capability: tuple[int, int]) -> None:
        self._cu, self._dev = cu, dev
        self.name, self.capability = name, capability
        self._ctx: Any = None

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @classmethod
    def find(cls) -> "Gpu | None":
        try:
            from cuda.bindings import driver as cu

            (err,) = cu.cuInit(0)
            if err != cu.CUresult.CUDA_SUCCESS:
                return None
            err, count = cu.cuDeviceGetCount()
            if err != cu.CUresult.CUDA_SUCCESS or count < 1:
                return None
            err, dev = cu.cuDeviceGet(0)
            attr = cu.CUdevice_attribute
            _, major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
            _, minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
            _, raw = cu.cuDeviceGetName(256, dev)
            name = raw.split(b"\0", 1)[0].decode(errors="replace")
            return cls(cu, dev, name, (int(major), int(minor)))
        except Exception:  # no driver, no device, no cuda-python: no GPU to check on
            return None

    def load_cubin(self, cubin: bytes) -> None:
        """Hand one cubin to the driver, which checks its arch and image; raises on refusal."""
        cu = self._cu
        if self._ctx is None:
            err, self._ctx = cu.cuDevicePrimaryCtxRetain(self._dev)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuDevicePrimaryCtxRetain: {err}")
            (err,) = cu.cuCtxSetCurrent(self._ctx)
        err, module = cu.cuModuleLoadData(cubin)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"the driver refused the cubin: {err.name if hasattr(err, 'name') else err}")
        cu.cuModuleUnload(module)
