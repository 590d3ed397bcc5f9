"""cute-diskcache: a persistent, verified on-disk cache for CuTe-DSL kernels.

Public API (everything else is internal):

* :func:`install` / :func:`uninstall` attach the cache to flashinfer's, b12x's, SGLang's and vLLM's own CuTe-DSL compiles;
* :func:`cached_compile` persists any explicit ``cute.compile`` under a key you give;
* :func:`counters` reports this process's hits, misses and compile seconds;
* :class:`CacheMissError` is what a miss raises under ``CUTE_DISKCACHE_ON_MISS=error``.

Importing the package is cheap on purpose (the .pth bootstrap imports it at interpreter
start): torch, the DSL and msgpack load only when a cache is actually used.
"""

from __future__ import annotations

import sys

from ._version import __version__
from .activation import install, uninstall

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at start-up

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["__version__", "install", "uninstall", "cached_compile", "counters", "CacheMissError"]


def __getattr__(name: str) -> Any:
    """``CacheMissError`` on first use: nothing more is imported at interpreter start."""
    if name == "CacheMissError":
        from .errors import CacheMissError

        return CacheMissError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cached_compile(fn: Callable[..., Any], *args: Any, key: Any, options: Any = None, **kwargs: Any) -> Any:
    """``cute.compile(fn, *args, options=options, **kwargs)`` through the disk cache.

    ``key`` must determine everything the compile depends on besides the code of ``fn``'s
    package, the DSL stack, the target arch and the environment switches that code reads, which
    are added for you: typically the shapes, dtypes and tunables you built the fake arguments
    from. It is encoded canonically (ints, floats by their bits, str, bytes, bool, None,
    tuples, lists, dicts, torch dtypes, cutlass types); anything else raises ``TypeError``.

    The code is looked at on every call (one ``stat`` per module file), so a module edited and
    reloaded (``importlib.reload``, a notebook's autoreload) gets its new kernel, never the one
    compiled from its old body. Code that has no file or loader source to read (a function
    defined in a notebook cell, ``__main__`` of ``python -c``) raises
    :class:`~cute_diskcache.keys.key.UnkeyableError`: a key never rests on nothing.

    Returns the loaded kernel on a hit and the freshly compiled one on a miss; both are called
    the same way. Repeated calls with the same key and code return the same object.
    """
    from .keys import key as keymod
    from .core.cache import default_cache

    import cutlass.cute as cute

    owner = getattr(fn, "__module__", None) or type(fn).__module__
    module = sys.modules.get(owner)
    if module is None:
        raise keymod.UnkeyableError(f"the module of {fn!r} ({owner}) is not imported: its code cannot be fingerprinted")
    package = owner.split(".")[0]
    env = _generic_env(owner, package, module)
    ck = keymod.CacheKey(env, f"cached_compile:{owner}.{getattr(fn, '__qualname__', type(fn).__qualname__)}", key, options)
    memo = _MEMO.get(ck.digest)
    if memo is not None:
        return memo
    compile_kwargs = dict(kwargs)
    if options is not None:
        compile_kwargs["options"] = options
    kernel, _ = default_cache().get_or_compile(ck, lambda: cute.compile(fn, *args, **compile_kwargs))
    _MEMO[ck.digest] = kernel
    return kernel


#: digest -> kernel. The digest covers the code (see _generic_env), so a reloaded module's
#: kernels get new digests and never meet their old bodies' entries here.
_MEMO: dict[str, Any] = {}
#: owner module -> (stamp of the code it reaches, its Environment): reused while the stamp holds.
_ENVS: dict[str, tuple[tuple[Any, ...], int, Any]] = {}


def _generic_env(owner: str, package: str, module: Any) -> Any:
    """The Environment of a ``cached_compile`` kernel defined in ``owner``, for its code as it is now."""
    from .keys import key as keymod

    cached = _ENVS.get(owner)
    if cached is not None and cached[1] == id(module.__dict__) and keymod.code_stamp(cached[0]):
        return cached[2]
    import importlib.metadata

    # The package's own __version__ first: a distribution need not be named after its
    # import package (flashinfer is "flashinfer-python"), and the key should say the version.
    version = getattr(sys.modules.get(package), "__version__", None)
    if not isinstance(version, str):
        try:
            version = importlib.metadata.version(package)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            version = "0"
    facts = keymod.source_facts(module, package)
    switches = {**keymod.codegen_env(), **keymod.keyed_env(facts.env_reads)}
    env = keymod.Environment(kind="generic", package=f"{package}=={version}", sources=facts.fingerprint,
                             arch=keymod.current_arch(), codegen_env=tuple(sorted(switches.items())))
    _ENVS[owner] = (facts.stamp, id(module.__dict__), env)
    return env


def counters() -> dict[str, Any]:
    """This process's cache activity (hits, misses, compiles, seconds, rejected entries)."""
    from .core.cache import default_cache

    cache = default_cache()
    out = cache.tally.snapshot()
    out["rejected"] = cache.store.rejected
    out["root"] = str(cache.store.root)
    out["writable"] = cache.store.writable
    if cache.remote is not None:
        out.update(cache.remote.tally.snapshot())
    return out
