"""flashinfer's stand-ins for a card that is not in the machine (a target profile): what flashinfer
asks beyond ``torch.cuda``'s queries, which :mod:`..keys.targets` answers for every library.

With a profile active, flashinfer's device queries are answered from it, so an offline compile
takes the decisions the card would (:func:`apply_profile`, for every site module as it is
imported): max active clusters (an occupancy query the box cannot answer), the DSL's driver
attribute queries (:mod:`..keys.devicefacts`), what the GEMM API asks (:mod:`.gemm_offline`), from
0.6.18 moe_dispatch's ``_is_sm120_nvfp4`` (asked of the *tensors*) and the direct micro block-dim
probe (:mod:`.block_dim`); and sites that describe their arguments from real tensors
(``from_dlpack``, where a CPU tensor compiles for generic instead of global memory) see CPU
tensors presented as CUDA ones (:class:`CudaPresented`).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from .names import FLASHINFER_UTILS, MOE_DISPATCH, SM12X

#: Modules whose sites compile against ``from_dlpack`` tensors (0.7.x nvfp4 runners, and the
#: kernel modules of the fp8 / mxfp8 x mxfp4 op modules).
_DLPACK_USERS = (f"{SM12X}.moe_nvfp4_w4a4", f"{SM12X}.moe_nvfp4_w4a16")
_OP_MODULES = tuple(f"{SM12X}.moe_{fmt}_{op}" for fmt in ("fp8", "mxfp8_mxfp4")
                    for op in ("fc1_act", "fc1_act_q1", "fc2_finalize", "gemm"))


def apply_profile(module: ModuleType) -> None:
    """With a target profile active, answer ``module``'s device queries from the profile."""
    from ..keys import devicefacts, targets
    from . import block_dim, gemm_offline

    profile = targets.active()
    if profile is None:
        return

    def get_max_active_clusters(cluster_size: int) -> int:
        return profile.max_active_clusters(cluster_size)

    for mod in (sys.modules.get(FLASHINFER_UTILS), module):
        if mod is not None and hasattr(mod, "get_max_active_clusters"):
            mod.get_max_active_clusters = get_max_active_clusters
    devicefacts.install_hook()
    gemm_offline.apply(module, profile)
    name = module.__name__
    if name == MOE_DISPATCH and hasattr(module, "_is_sm120_nvfp4"):
        sm120 = tuple(profile.capability) == (12, 0)
        module._is_sm120_nvfp4 = lambda device, quant_mode: sm120 and quant_mode == "nvfp4"
        block_dim.patch(module)
    users = [module] if name in _DLPACK_USERS else []
    if name in _OP_MODULES:
        kernel_mod = sys.modules.get(name.replace(".moe_", ".kernel_moe_", 1))
        if kernel_mod is not None:
            users.append(kernel_mod)
    for mod in users:
        if hasattr(mod, "from_dlpack"):
            mod.from_dlpack = cuda_presenting(mod.from_dlpack)


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
