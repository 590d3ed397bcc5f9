"""The middle of a compile's three steps: what happens to a site's compile once :mod:`.hook` has
found it. Key it (:func:`_key_of`), then serve it through :mod:`.cache`, record it as a planned
request, or run it uncached (a compile that cannot be described, a broken setting).

Library-neutral: :class:`Site` says how one compile site is keyed, described and handed back,
:class:`Call` is what one compile brought, :func:`through_cache` runs it through the cache, and
:func:`planning` turns every compile into a recorded request instead (prewarm and ``check`` plan in
a process of their own). The adapters (:mod:`..flashinfer_sites`, :mod:`..b12x_sites`) supply rows;
:mod:`.hook` makes a :class:`Site` of a row and calls :func:`through_cache`, so a script that wants
to watch every cached compile replaces ``through.through_cache``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import sys
from typing import Any
from collections.abc import Callable, Iterable, Iterator

from ..keys.key import CacheKey, Environment, SourceFacts, UnkeyableError, source_facts
from .cache import CompileCache, NotLoaded, default_cache
from .describe import ADDRESS as _ADDRESS

log = logging.getLogger("cute_diskcache")


def options_text(options: Any) -> str:
    """DSL compile options (``OptLevel(3)`` ...) as stable text; their repr holds an address."""
    if isinstance(options, (str, int, float, bool)) or options is None:
        return repr(options)
    if isinstance(options, (tuple, list)):  # cute.compile[opt_a, opt_b] (GDN's compile cache)
        return "(" + ", ".join(options_text(o) for o in options) + ")"
    cls = type(options)
    state = getattr(options, "__dict__", None)
    if state is None:
        text = repr(options)
        if _ADDRESS.search(text):
            raise UnkeyableError(f"compile options {cls.__qualname__} have no stable text")
        return f"{cls.__module__}.{cls.__qualname__}:{text}"
    return f"{cls.__module__}.{cls.__qualname__}:{sorted((k, options_text(v)) for k, v in state.items())!r}"


@functools.cache
def site_sources(module_name: str, package: str) -> SourceFacts:
    """The fingerprint of a site module's code and what it reaches (once per process: a library
    is not reloaded under a serving engine), so the first hit does not pay for it."""
    return source_facts(sys.modules[module_name], package)


@dataclasses.dataclass(frozen=True)
class Call:
    """One intercepted compile: what the site's frame and arguments tell us."""

    locals: dict[str, Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    dsl_options: Any = None  # the ``cute.compile[...]`` subscript, if that form was used


@dataclasses.dataclass(frozen=True)
class Site:
    """A function of a library that compiles, and how to key, describe and hand back its kernel.

    ``key(call)`` and ``env(call)`` make the key (:mod:`..core.hook`: everything the compile receives,
    and the sources it comes from). ``extra(kernel, call)`` computes side data stored beside the
    artifact; ``deliver(kernel, extra, call)`` hands that side data to the library on a hit and a
    miss alike, and ``extra_ok(extra)`` says whether side data read from disk has the shape
    ``deliver`` expects (another writer version may have stored another; such an entry is a miss).
    """

    module: str
    function: str
    kind: str
    key: Callable[[Call], Any]
    env: Callable[[Call], Environment]
    options: Callable[[Call], Any] = lambda call: call.kwargs.get("options")
    extra: Callable[[Any, Call], dict[str, Any]] | None = None
    deliver: Callable[[Any, dict[str, Any], Call], None] | None = None
    extra_ok: Callable[[dict[str, Any]], bool] | None = None
    site_name: str | None = None  # stored in the manifest (the adapter's row name); default <module>.<kind>
    #: What the library gets: ``adapt(kernel, extra, call)`` (default: the kernel as the cache gave it).
    adapt: Callable[[Any, dict[str, Any], Call], Any] | None = None
    #: ``reuse(call)``: the second-stage plan (:class:`~..storage.reuse.Plan`) of a site whose entries may
    #: serve another release with the same traced IR; asked only on a first-stage miss.
    reuse: Callable[[Call], Any] | None = None

    @property
    def name(self) -> str:
        return self.site_name or f"{self.module.rsplit('.', 1)[-1]}.{self.kind}"


#: While planning (see :func:`planning`), sites record their key here instead of compiling.
PLAN: list[dict[str, Any]] | None = None
#: Set by :func:`launching_nothing`: a compile goes through the cache as when serving, but the
#: library gets a kernel that launches nothing.
INERT = False


class PlannedKernel:
    """What a site gets while planning: a kernel that launches nothing, one per planned key, so
    the library's memo dicts say which of our keys each of its kernels got (the key-completeness
    test reads them back: no two of its kernels may share one of ours)."""

    __slots__ = ("digest",)

    def __init__(self, digest: str) -> None:
        self.digest = digest

    def __call__(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def __repr__(self) -> str:
        return f"PlannedKernel({self.digest[:12]})"


def planned(kernel: Any) -> bool:
    """Whether ``kernel`` is a stand-in that launches nothing: planning's (:class:`PlannedKernel`),
    or a cross-build's hit (:class:`.cache.NotLoaded`), which nothing adapts either."""
    return isinstance(kernel, (PlannedKernel, NotLoaded))


@contextlib.contextmanager
def planning() -> Iterator[list[dict[str, Any]]]:
    """Record every kernel the libraries ask for, without compiling or launching any.

    A library keeps what a site returns in its in-process caches, so a process that planned
    must not serve: prewarm plans in a process of its own.
    """
    global PLAN
    PLAN = []
    try:
        yield PLAN
    finally:
        PLAN = None


@contextlib.contextmanager
def launching_nothing() -> Iterator[None]:
    """Compile (or hit) every kernel the libraries ask for, and hand each back as one that launches
    nothing: for an offline driver that reaches a library's compiles only through its launch path
    (b12x's MoE compiles inside its run), with no card to launch on. As with :func:`planning`, the
    library memoises the stand-ins, so the process must not serve afterwards."""
    global INERT
    INERT = True
    try:
        yield
    finally:
        INERT = False


def planned_requests(requested: list[dict[str, Any]], calls: Iterable[tuple[Any, int]],
                     after_call: Callable[[], None] | None = None) -> Iterator[tuple[dict[str, Any], Any, int]]:
    """``(request, recipe, m)`` for each kernel request a planning call made, call by call.

    A library memoises what a site returned, so a call whose kernel an earlier call already
    asked for requests nothing new: only the requests a call added are its own.
    ``after_call`` runs once per call (a progress bar's tick), new requests or not.
    """
    before = 0
    for recipe, m in calls:
        for request in requested[before:]:
            yield request, recipe, m
        before = len(requested)
        if after_call is not None:
            after_call()


def _key_of(site: Site, call: Call) -> CacheKey:
    site_key = site.key(call)  # first: describing the arguments names the modules env() fingerprints
    key = CacheKey(site.env(call), site.name, site_key, site.options(call))
    key.digest  # noqa: B018 - encode now, so an unkeyable element is caught here
    return key


def through_cache(site: Site, call: Call, compile_fn: Callable[[], Any],
                  cache_fn: Callable[[], CompileCache] = default_cache,
                  uncached: Callable[[], Any] | None = None) -> Any:
    """The one path every intercepted compile takes: key it, then hit, compile, or plan.

    ``uncached`` is what runs when the compile cannot be keyed (default: ``compile_fn``, an
    in-memory compile); a library's native sites hand back to its own cache instead.

    The collector is paused for the way to a hit and resumed for any compile: a key is a few
    hundred tuples, alive until the kernel is returned, and a collection that came due while they
    lived had them to walk and promote; a full one (~1-240 ms, with an engine's heap) landed in
    hits. They are freed before the collector resumes, so it finds the count where the call found it.
    """
    uncached = uncached or compile_fn
    if not gc.isenabled():
        return _through_cache(site, call, compile_fn, cache_fn, uncached, False)
    gc.disable()
    try:
        return _through_cache(site, call, _collecting(compile_fn), cache_fn, _collecting(uncached), True)
    finally:
        gc.enable()


def _collecting(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with the collector running: a compile allocates for seconds."""
    def run() -> Any:
        gc.enable()
        try:
            return fn()
        finally:
            gc.disable()
    return run


def _plan(site: Site, call: Call, collecting: bool) -> Any:
    """The site's second-stage plan, its trace run with the collector on like a compile (a trace
    is the first half of one)."""
    assert site.reuse is not None
    plan = site.reuse(call)
    return dataclasses.replace(plan, trace=_collecting(plan.trace)) if plan is not None and collecting else plan


def _through_cache(site: Site, call: Call, compile_fn: Callable[[], Any], cache_fn: Callable[[], CompileCache],
                   uncached: Callable[[], Any], collecting: bool) -> Any:
    try:
        key = _key_of(site, call)
        cache = cache_fn()
    except UnkeyableError as exc:
        log.warning("not caching %s kernel: %s", site.name, exc)
        return uncached()
    except Exception as exc:  # noqa: BLE001 - environment or settings trouble: run uncached, say why
        log.error("cute-diskcache disabled for this %s compile: %s: %s", site.name, type(exc).__name__, exc)
        return uncached()
    if PLAN is not None:
        # extra_ok: the judgement a hit applies to the entry's side data, for check and prewarm's "cached"
        PLAN.append({"kind": site.kind, "digest": key.digest, "key": key, "site": site.name, "extra_ok": site.extra_ok})
        kernel, extra = PlannedKernel(key.digest), _planned_extra(cache, key)
    else:
        extra_fn = (lambda kernel: site.extra(kernel, call)) if site.extra else None
        reuse = (lambda: _plan(site, call, collecting)) if site.reuse is not None else None
        kernel, extra = cache.get_or_compile(key, compile_fn, extra_fn=extra_fn, extra_ok=site.extra_ok, reuse=reuse)
        if INERT:
            return PlannedKernel(key.digest)
    if site.adapt is not None and not planned(kernel):
        kernel = site.adapt(kernel, extra, call)
    if site.deliver is not None:  # after adapt: side data answers for the object the library gets
        try:
            site.deliver(kernel, extra, call)
        except Exception as exc:  # noqa: BLE001 - side data is an optimisation: the library then asks for itself
            log.error("cute-diskcache: %s side data not delivered (%s: %s)", site.name, type(exc).__name__, exc)
    return kernel


def _planned_extra(cache: CompileCache, key: CacheKey) -> dict[str, Any]:
    """While planning: the side data of an entry already on disk (manifest only, no load)."""
    from ..storage import entry

    try:
        return dict(entry.read_manifest(cache.store.entry_dir(key)).get("extra") or {})
    except Exception:  # noqa: BLE001 - planning only: an entry that cannot be read has no side data to hand over
        return {}
