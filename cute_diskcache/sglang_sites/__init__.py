"""The SGLang adapter: the only code that knows how SGLang's own CuTe-DSL kernels compile.

SGLang 0.5.23 calls ``cute.compile`` itself; the sites an sm12x engine start reaches are rows of
:mod:`.sites`, keyed and served by the library-neutral hook on ``cutlass.cute.compile`` with
SGLang's record (:mod:`.adapter`). The one thing attached to SGLang itself is :mod:`.native`:
its persistent FA4 cache stands aside while ours serves. The activation hook hands us the FA4
interface as it is imported (:data:`.names.SITE_PACKAGES`): :func:`patch`. Nothing of SGLang
is a dependency: without it, nothing here is imported.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the hook loads this at start-up)
if TYPE_CHECKING:
    from types import ModuleType


def patch(module: ModuleType) -> bool:
    """Attach to one SGLang module as it is imported (idempotent). True if we stand in it.

    While ours serves FA4, its code tree is fingerprinted now, as SGLang imports the interface at
    engine start, not in the first FA4 request (0.4 s here for ``kernels/ops/attention``)."""
    from . import native

    standing = native.patch(module)
    if standing:
        from ..core.hook import fingerprint_tree
        from .adapter import ADAPTER
        from .sites import FA4_TREE

        fingerprint_tree(ADAPTER, FA4_TREE)
    return standing


def unpatch(module: ModuleType) -> None:
    """Put back what :func:`patch` replaced in ``module``."""
    from . import native

    native.unpatch(module)


def apply_profile(module: ModuleType) -> None:
    """A target profile on a CPU torch: SGLang's JIT arch detection sees the profile's card.

    The profile is applied before ``sglang`` is imported (the FA4 interface reads torch's stream
    getter at import; the profile answers it). But SGLang's detection
    (``kernels/jit/utils/arch.py``, run once, at the first kernel that asks) starts with
    ``torch.cuda.current_device()``, which a CPU torch cannot answer: it logged "Cannot detect CUDA
    architecture", took capability 0.0, and ``is_arch_support_pdl()`` said no, so the prewarm
    compiled FA4's split-KV combine without PDL, a kernel no sm12x GPU asks for (the lent H100 run
    of ``bench/gpu_proof_sglang.py``, forced to sm_120a, asked for the PDL one: 2 of its 3 keys
    were the CPU prewarm's). Here the detection runs with the profile's card as device 0; a CUDA
    torch names its own device (a forced profile answers its capability), so it is left alone."""
    import sys

    from .names import FA4_INTERFACE, JIT_ARCH

    if module.__name__ != FA4_INTERFACE:
        return
    from ..keys import targets

    arch = sys.modules.get(JIT_ARCH)
    detect = getattr(arch, "_init_jit_cuda_arch_once", None)
    if targets.active() is None or detect is None or getattr(detect, "on_profile", False):
        return
    import torch

    if torch.version.cuda is not None:
        return

    def detect_on_profile() -> None:
        current_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            detect()
        finally:
            torch.cuda.current_device = current_device

    detect_on_profile.on_profile = True  # type: ignore[attr-defined]
    arch._init_jit_cuda_arch_once = detect_on_profile  # type: ignore[union-attr]
