"""The b12x adapter: the only code that knows how the b12x package (vLLM's ``vllm[b12x]``) compiles.

Every b12x kernel is compiled through one wrapper (:mod:`.sites`: one row), so the library-neutral
hook on ``cutlass.cute.compile`` keys and serves it as it does flashinfer's sites, with b12x's record
(:mod:`.adapter`). The one thing attached to b12x itself is :mod:`.native`: its disk layer stands
aside while ours serves (one kernel, one cache). The activation hook hands us ``b12x._lib.compiler``
as it is imported (:data:`.names.SITE_PACKAGES`): :func:`patch`.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the hook loads this at start-up)
if TYPE_CHECKING:
    from types import ModuleType


def patch(module: ModuleType) -> bool:
    """Attach to one b12x module as it is imported (idempotent). True if we stand in it."""
    from . import native

    return native.patch(module)


def unpatch(module: ModuleType) -> None:
    """Put back what :func:`patch` replaced in ``module``."""
    from . import native

    native.unpatch(module)


def apply_profile(module: ModuleType) -> None:
    """Nothing to stand in for: under a target profile, b12x's compiles are driven by :mod:`.planning`
    (``prewarm --linear-backend b12x``), which hands b12x the target's device identity itself."""
    return None
