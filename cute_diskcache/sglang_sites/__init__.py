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
    """A target profile needs nothing per SGLang module: it is applied before ``sglang`` is
    imported (the FA4 interface reads torch's stream getter at import; the profile answers it)."""
    return None
