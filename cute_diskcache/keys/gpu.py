"""The GPU in this machine, if any, as the CUDA driver sees it.

Device access lives in keys/ beside :mod:`.devicefacts` (which reads the same driver for the facts
a compile records); the operator's side (``verify --device``, ``cleanup``'s host arch) only asks.
cuda-python's driver bindings ship with the DSL; nothing here needs torch or flashinfer, and the
bindings are imported only when :meth:`Gpu.find` is called.
"""

from __future__ import annotations

import logging
from typing import Any


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
    def find(cls) -> Gpu | None:
        try:
            from cuda.bindings import driver as cu

            def value(result: tuple[Any, ...]) -> Any:
                """A driver call's value; its error code raised, so the log says which call failed and how."""
                if result[0] != cu.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"CUDA driver error {getattr(result[0], 'name', result[0])}")
                return result[1] if len(result) > 1 else None

            value(cu.cuInit(0))
            if value(cu.cuDeviceGetCount()) < 1:
                return None
            dev = value(cu.cuDeviceGet(0))
            attr = cu.CUdevice_attribute
            major = value(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
            minor = value(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
            name = value(cu.cuDeviceGetName(256, dev)).split(b"\0", 1)[0].decode(errors="replace")
            return cls(cu, dev, name, (int(major), int(minor)))
        except Exception as exc:  # noqa: BLE001 - no driver, no device, no cuda-python: no GPU to check on
            logging.getLogger(__name__).debug("no GPU found: %s", exc)
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
