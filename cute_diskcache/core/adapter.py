"""Owns what the hook knows of a library: one :class:`Adapter` record per library, filled with data.

The hook (:mod:`.hook`), the describer and the path through the cache know no
library: everything that differs between flashinfer, b12x, SGLang and vLLM (where its code lies, which modules
are fingerprinted, its distribution, its table of compile sites, its own disk cache, the variables
and compile keywords that change no code, side data kept beside a kernel) is a field here, filled
by that library's adapter (``flashinfer_sites/adapter.py``, ``b12x_sites/adapter.py``, ...).
:func:`adapters` lists them; a library adds a record, never a branch in the hook.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
from typing import Any
from collections.abc import Callable, Mapping

#: How many frames above ``cute.compile`` a site may sit (compile -> lambda -> a native builder
#: -> helper -> site needs 4; 6 leaves room, and costs 6 dict lookups on a compile).
DEPTH = 6


@dataclasses.dataclass(frozen=True)
class Row:
    """One compile site: where it is (in its library's code root) and what its entries are called."""

    file: str  # relative to the library's code root
    function: str  # qualified name without ``<locals>`` ("launch_fwd._compile", "Cls.method")
    kind: str
    name: str  # stored in the manifest and the stats ("flashinfer.msa.msa_topk")
    namespace: str  # the Environment's kind: the cache's namespace prefix
    #: The directory, under the library's root, whose every ``.py`` file joins the fingerprint
    #: ("" is the whole root): code imported through a ``sys.path`` entry (not under the
    #: library's module name), or, with :attr:`Adapter.reach_by_tree`, the code the row's kernels
    #: come from, fingerprinted whole instead of through what its modules' globals reach.
    tree: str | None = None
    #: Side data kept beside the kernel besides its calling convention: a key of the adapter's
    #: :attr:`Adapter.side_data` ("block_dim": flashinfer's direct micro kernel's launch probe).
    side: str | None = None
    #: The library builds it through its own disk cache, which reads before it compiles: served
    #: by the adapter's stand-in for that builder (flashinfer's :mod:`..flashinfer_sites.native`).
    native: bool = False
    #: Its entries may serve another release whose kernel has the same traced IR
    #: (:mod:`cute_diskcache.storage.reuse`); docs/keys.md lists the rows left off and why.
    reuse: bool = False
    #: The row names its entries ``<name>.<compile target>`` (the class or function compiled):
    #: one row covers a library that funnels every compile through one wrapper (b12x).
    per_target: bool = False


@dataclasses.dataclass(frozen=True)
class SideData:
    """How a row's side data is made, judged when read back, and handed to the library."""

    extra: Callable[[Any, Any], dict[str, Any]]  # (kernel, the compiled object) -> side data
    extra_ok: Callable[[dict[str, Any]], bool]
    deliver: Callable[[Any, dict[str, Any], Any], None]  # (kernel, side data, the compiled object)


@dataclasses.dataclass(eq=False)
class Adapter:
    """One library's facts, as the hook and the describer read them (mostly data).

    Mutable only so that tests can point ``package_dir`` at a package they write.
    """

    name: str  # "flashinfer": what CUTE_DISKCACHE_NATIVE_SITES and doctor call it
    distribution: str  # the distribution whose version labels its entries ("flashinfer-python")
    module: str  # its top-level module name: ``module`` and ``module.*`` are fingerprinted
    package_dir: Callable[[], str | None]  # realpath of its code root, found without importing it
    version: Callable[[], str]  # the loaded code's version, as its entries' package label says
    by_where: dict[tuple[str, str], Row] = dataclasses.field(repr=False)  # (file under its root, function) -> row
    #: Files of its own disk cache: a compile with one of their frames between it and a site is
    #: the library's to keep (one kernel, one cache).
    own_disk_caches: frozenset[str] = frozenset()
    #: Variables its code reads that change no generated code (logging, cache locations...).
    not_codegen_env: frozenset[str] = frozenset()
    #: Its modules under a row's ``tree`` are fingerprinted by that tree alone, not also through
    #: what their globals reach. For a library whose kernels load their code lazily (SGLang's FA4:
    #: the SM12x forward host is imported on first use, and torch's fake mode takes other branches
    #: than real tensors), what the globals reach depends on what the process did before the
    #: compile, so a CPU prewarm and a GPU engine keyed the same kernel apart. ``tree=""`` (the
    #: whole root, b12x's) always works this way.
    reach_by_tree: bool = False
    #: Other distributions whose code builds its kernels (SGLang's FA4 calls quack's helpers while
    #: it traces): their versions join the key, as the library's own does.
    companions: tuple[str, ...] = ()
    #: Compile keywords that change no generated code, dropped from the key.
    not_codegen_kwargs: frozenset[str] = frozenset()
    side_data: Mapping[str, SideData] = dataclasses.field(default_factory=dict)

    def owns(self, module_name: str) -> bool:
        """A module named as this library's (``module`` or ``module.*``)."""
        return module_name == self.module or module_name.startswith(self.module + ".")


#: The adapters' modules, each defining ``ADAPTER``. Imported on first use, never at start-up.
_MODULES = ("cute_diskcache.flashinfer_sites.adapter", "cute_diskcache.b12x_sites.adapter", "cute_diskcache.sglang_sites.adapter",
            "cute_diskcache.vllm_sites.adapter")


@functools.lru_cache(maxsize=1)
def adapters() -> tuple[Adapter, ...]:
    """Every library's record, in :data:`_MODULES` order (read once per process)."""
    return tuple(importlib.import_module(name).ADAPTER for name in _MODULES)


def by_name(name: str) -> Adapter:
    """The adapter called ``name`` (KeyError if none)."""
    for adapter in adapters():
        if adapter.name == name:
            return adapter
    raise KeyError(name)


def of_row(row: Row) -> Adapter | None:
    """The adapter whose table holds ``row`` (None for a row no table holds)."""
    for adapter in adapters():
        if adapter.by_where.get((row.file, row.function)) is row:
            return adapter
    return None


def module_dir(module: str) -> str | None:
    """The realpath of ``module``'s package directory, from the loaded module or its spec (never
    importing it): an adapter's usual :attr:`Adapter.package_dir`."""
    path = getattr(sys.modules.get(module), "__file__", None)
    if path is None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        path = getattr(spec, "origin", None)
    return os.path.realpath(os.path.dirname(path)) if path else None


def located(module: str, distribution: str) -> tuple[Callable[[], str | None], Callable[[], str]]:
    """An adapter's ``package_dir`` and ``version`` where its code root is its module's directory:
    found without importing the library, each read once per process (a library is not
    reinstalled under a running engine)."""
    return (functools.lru_cache(maxsize=1)(functools.partial(module_dir, module)),
            functools.lru_cache(maxsize=1)(functools.partial(distribution_version, distribution, module)))


def distribution_version(distribution: str, module: str) -> str:
    """An installed distribution's version, else the loaded module's ``__version__``."""
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(sys.modules.get(module), "__version__", "0+unknown"))


__all__ = ["DEPTH", "Adapter", "Row", "SideData", "adapters", "by_name", "distribution_version", "located", "module_dir", "of_row"]
