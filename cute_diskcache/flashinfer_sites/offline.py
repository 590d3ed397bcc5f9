"""Stand-ins for a card that is not in the machine, for flashinfer sites that look at tensors.

Some sites build the compile-time description of their arguments from real tensors
(``from_dlpack``): a CPU tensor there compiles a *different* kernel (generic instead of global
memory). For an offline compile only, such a site's ``from_dlpack`` sees CPU tensors presented
as CUDA ones (see :func:`.v0_7.apply_profile`).
"""

from __future__ import annotations

from typing import Any


class CudaPresented:
    """A CPU tensor presented to DLPack consumers as a ``cuda:<index>`` tensor: its DLPack
    capsule says CUDA; nothing ever reads or writes through its pointer at compile time."""

    _KDL_CUDA = 2

    def __init__(self, tensor: Any, index: int = 0) -> None:
        self.tensor = tensor
        self.index = index

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self._KDL_CUDA, self.index)

    def __dlpack__(self, *_args: Any, **_kwargs: Any) -> Any:
        import ctypes

        capsule = self.tensor.__dlpack__()  # the legacy DLManagedTensor capsule
        get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
        get_pointer.restype = ctypes.c_void_p
        get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        managed = get_pointer(capsule, b"dltensor")
        # DLTensor starts with `void* data`, then `DLDevice device` {int32 type, int32 id}.
        device = (ctypes.c_int32 * 2).from_address(managed + ctypes.sizeof(ctypes.c_void_p))
        device[0], device[1] = self._KDL_CUDA, self.index
        return capsule


def cuda_presenting(from_dlpack: Any) -> Any:
    """Wrap a ``from_dlpack``: CPU torch tensors go in as :class:`CudaPresented` ones."""
    if getattr(from_dlpack, "_cdc_real", None) is not None:
        return from_dlpack

    def wrapped(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(getattr(tensor, "device", None), "type", None) == "cpu" and hasattr(tensor, "__dlpack__"):
            tensor = CudaPresented(tensor)
        return from_dlpack(tensor, *args, **kwargs)

    wrapped._cdc_real = from_dlpack  # type: ignore[attr-defined]
    return wrapped
