"""The first of a compile's three steps: the interception on ``cutlass.cute.compile``, which decides
whether a compile is a site and what its key is made of (then :mod:`.through` keys and routes it,
and :mod:`.cache` serves it).

Every covered compile of every library with an adapter (:mod:`.adapter`: flashinfer's, b12x's),
on every release, goes through this hook, put in place once as the DSL is imported. It knows no
library: it reads the adapters' records. It looks at the frames above a compile: the nearest
function listed in an adapter's site table (within :data:`~.adapter.DEPTH` frames) makes the
compile a site, which goes through the cache; any other compile reaches the real one after a few
dict lookups. A frame of a library's own disk cache in between leaves the compile to that cache
(one kernel, one cache) unless the adapter serves that build (flashinfer's :mod:`..flashinfer_sites.native`). The
libraries memoise what we return in their own dicts, so a repeat never reaches us.

The key is everything the compile receives (:class:`~cute_diskcache.core.describe.Describer`, with
the adapters' modules as the fingerprinted ones), never a hand-written one (knowledge of what a
library's own key leaves out, which a release adding a compile argument would outgrow); a value
bound to a parameter declared as a DSL integer is a runtime argument, keyed by type. The sources of
the site's module, of the modules on the way and those the arguments come from (and the whole
kernel tree for code imported from a ``sys.path`` entry or resolved lazily) join the fingerprint, with every
environment variable that code reads; device facts are checked (:mod:`..keys.devicefacts`). What
cannot be described, or options asking for artifacts a loaded kernel cannot carry, leave that
compile in memory, with one warning.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import importlib.metadata
import inspect
import logging
import os
import sys
import threading
import types
from pathlib import Path
from typing import Any

from . import front
from ..keys import trace
from .adapter import DEPTH, Adapter, Row, SideData, adapters, of_row
from .convention import as_compiled_hit, packed_ptx, side_data, side_data_ok, with_ptx
from .patches import PATCHES
from .describe import Describer, evaluated_annotations
from . import through
from .through import Call, Site, options_text
from .cache import HIT_FROM
from ..keys.key import Environment, Plain, UnkeyableError, codegen_env, current_arch, env_reads, keyed_env
from ..storage.reuse import Plan

log = logging.getLogger("cute_diskcache")


def _ours(module_name: str) -> bool:
    """A module of a library with an adapter: named as one (``flashinfer.*``, ``b12x.*``), or
    loaded from one's code root under another name (flashinfer's expert-parallel kernels'
    ``sys.path`` entries). Remembered per module name: a key describes many objects of the same
    few modules, so the answer is one dict lookup after the first."""
    known = _OURS.get(module_name)
    if known is not None:
        return known
    if module_name.startswith(_prefixes()) or module_name in _names():
        _OURS[module_name] = True
        return True
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    ours = bool(path) and _located(os.path.realpath(path)) is not None
    if module is not None:
        _OURS[module_name] = ours
    return ours


_OURS: dict[str, bool] = {}


@functools.lru_cache(maxsize=1)
def _prefixes() -> tuple[str, ...]:
    return tuple(a.module + "." for a in adapters())


@functools.lru_cache(maxsize=1)
def _names() -> frozenset[str]:
    return frozenset(a.module for a in adapters())


def _located(path: str) -> tuple[Adapter, str] | None:
    """(adapter, its root) of a real path under an adapter's code root; the deepest root wins,
    so a library vendored inside another's package is the vendored library's when it has an
    adapter root there."""
    best: tuple[Adapter, str] | None = None
    for adapter in adapters():
        root = adapter.package_dir()
        if root and path.startswith(root + os.sep) and (best is None or len(root) > len(best[1])):
            best = adapter, root
    return best


#: Options that ask the compile for artifacts beside the kernel that a loaded kernel does not carry.
_ARTIFACT_OPTIONS = ("KeepCUBIN", "keep-ptx", "keep-cubin", "dump-dir")
#: Options that change no generated code: where PTX is dumped, and asking to keep it. A compile
#: that keeps its PTX gets it back on a hit (GDN's compile cache checks the PTX of every SM12x
#: kernel it compiles, in a fresh temporary directory each time).
_PTX_OPTIONS = ("KeepPTX", "DumpDir")


def _dsl_options(options: Any) -> tuple[Any, ...]:
    return options if isinstance(options, tuple) else () if options is None else (options,)


def wants_ptx(options: Any) -> bool:
    """Whether ``cute.compile[options]`` keeps the PTX (``KeepPTX(True)``)."""
    return any(type(o).__name__ == "KeepPTX" and getattr(o, "value", None) is True for o in _dsl_options(options))


def _options(call: Call) -> Any:
    codegen = tuple(o for o in _dsl_options(call.dsl_options) if type(o).__name__ not in _PTX_OPTIONS)
    text = (repr(call.kwargs.get("options")), options_text(codegen) if call.dsl_options is not None else "None")
    if any(word in part for part in text for word in _ARTIFACT_OPTIONS):
        raise UnkeyableError("the compile asks for artifacts (CUBIN, a dump directory) a loaded kernel does not carry")
    return (*text, "keep-ptx") if wants_ptx(call.dsl_options) else text  # such entries carry their PTX


# --------------------------------------------------------------------------------------------
# The key, its environment, and side data
# --------------------------------------------------------------------------------------------


def _dynamic_parameters(fn: Any, args: tuple[Any, ...]) -> set[int]:
    """Positions in ``args`` bound to parameters ``fn`` declares as dynamic DSL integers.

    The DSL compiles a value passed for a ``cutlass.Int32``-annotated parameter as a runtime
    argument (only ``Constexpr`` and unannotated values are baked in), so the value does not
    change the kernel: flashinfer's b12x GEMM passes each layer's scale extents that way (Python
    ints) and compiles one kernel for every layer; 0.7.4's KDA prefill passes its TMA descriptors'
    device addresses that way (``cutlass.Int64(address)``), new in every process. A bool stays a
    value, and anything we cannot read keeps the value in the key.
    """
    if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType):
        declared = _integer_parameters(fn.__func__, True)
    elif isinstance(fn, types.FunctionType):
        declared = _integer_parameters(fn, False)
    else:  # a kernel object's __call__, a partial...: its values stay in the key
        return set()
    if not declared:
        return set()
    import cutlass

    return {i for i in declared if i < len(args) and (type(args[i]) is int or isinstance(args[i], cutlass.Integer))}


@functools.lru_cache(maxsize=4096)
def _integer_parameters(fn: Any, bound: bool) -> frozenset[int]:
    """Positional indices (after ``self`` when ``bound``) of ``fn``'s parameters annotated with a
    DSL integer type; read once per function."""
    out: set[int] = set()
    try:
        import cutlass

        params = list(inspect.signature(fn).parameters.values())[1 if bound else 0:]
        annotations = evaluated_annotations(fn)
        for i, param in enumerate(params):
            if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                break
            ann = annotations.get(param.name)
            if isinstance(ann, type) and issubclass(ann, cutlass.Integer):
                out.add(i)
    except Exception:  # noqa: BLE001 - unreadable: every value stays in the key
        return frozenset()
    return frozenset(out)


def _key(call: Call, dropped: frozenset[str] = frozenset()) -> Any:
    """The compile's arguments and keywords described (less ``dropped``: keywords that change no code)."""
    describe: Describer = call.locals["describer"]
    args = call.args
    dynamic = _dynamic_parameters(args[0], args[1:]) if args and callable(args[0]) else set()
    described = tuple(("dynamic", type(a).__name__) if i - 1 in dynamic else describe(a) for i, a in enumerate(args))
    extra = {k: v for k, v in call.kwargs.items() if k != "options" and k not in dropped}
    return Plain(("compile", call.locals["site"], call.locals["compiled_in"], ("args", described), ("kwargs", describe(extra))))


@functools.cache
def _tree_facts(package: str, tree: str) -> tuple[str, tuple[str, ...]]:
    """sha256 over every ``.py`` file under ``package``/``tree`` (names relative to it) and the variables they read."""
    root = Path(package) / tree
    h = hashlib.sha256()
    reads: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\n")
        reads.update(env_reads(data))
    return h.hexdigest(), tuple(sorted(reads))


def fingerprint_tree(library: Adapter, tree: str) -> None:
    """Fingerprint one of a library's trees now (once per process), so that its first compile or
    hit does not pay for it; an adapter calls it as the library's code is imported. Never raises."""
    try:
        _tree_facts(library.package_dir() or "", tree)
    except OSError as exc:  # the first compile reads it again, and says what failed
        log.debug("fingerprinting %s's %s deferred: %s", library.name, tree or "tree", exc)


def _environment(call: Call, library: Adapter | None = None) -> Environment:
    """The site's module, the compile's, the libraries' modules its arguments come from, its kernel tree.

    Built once per (site, modules) in a process, as every source fingerprint is: a library is
    not reloaded under an engine, and the variables its code reads are process settings.
    """
    if library is None:
        raise UnkeyableError(f"no adapter's site table holds {call.locals['site']}")
    prefixes = _prefixes()
    modules = tuple(m for m in dict.fromkeys((*call.locals["modules"], *call.locals["describer"].modules))
                    if m.startswith(prefixes) and m in sys.modules)
    return _environment_of(call.locals["row"], modules, library)


@functools.lru_cache(maxsize=1024)
def _environment_of(row: Row, modules: tuple[str, ...], library: Adapter) -> Environment:
    facts, reached = [], set()
    # A module of the library inside the row's tree is covered by the tree's fingerprint, where
    # the adapter says so (Adapter.reach_by_tree) or the tree is the whole root (b12x's):
    # fingerprinting it again through what its globals reach would make the key depend on what
    # else the process imported (b12x's compiler reaches its compile pool only in a process that
    # set one up; SGLang's FA4 its forward host only once a real-tensor call loaded it: each made
    # a CPU prewarm's keys miss on the lent H100, bench/gpu_proof_b12x.py, bench/gpu_proof_sglang.py).
    covered = _tree_module(row, library)
    for name in modules:  # a module another one already reaches is in that one's fingerprint
        if covered is not None and (name == covered or name.startswith(covered + ".")):
            continue
        if name not in reached:
            package = next((a.module for a in adapters() if a.owns(name)), library.module)
            facts.append(through.site_sources(name, package))
            reached.update(item[0] for item in facts[-1].stamp)
    prints = [f.fingerprint for f in facts]
    reads = {name for f in facts for name in f.env_reads}
    if row.tree is not None:
        tree_print, tree_reads = _tree_facts(library.package_dir() or "", row.tree)
        prints.append(f"tree:{row.tree}:{tree_print}")
        reads.update(tree_reads)
    prints += [f"dist:{name}=={_version_or_absent(name)}" for name in library.companions]
    if not prints:
        raise UnkeyableError(f"no source to fingerprint for {row.file}:{row.function}")
    return _environment_for(row.namespace, hashlib.sha256("".join(prints).encode()).hexdigest(), frozenset(reads), library)


def _tree_module(row: Row, library: Adapter) -> str | None:
    """The module name under which the library's modules are the row's tree's, or None (each
    module is fingerprinted with what it reaches)."""
    if row.tree == "":
        return library.module
    if row.tree is None or not library.reach_by_tree:
        return None
    return ".".join((library.module, *row.tree.strip("/").split("/")))


@functools.cache
def _version_or_absent(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=256)
def _environment_for(namespace: str, sources: str, reads: frozenset[str], library: Adapter) -> Environment:
    """One Environment (and one digest) per distinct environment: the sites of one kernel family
    (moe_dispatch's micro, static and dynamic) reach the same sources, so the first request of
    each after the first finds it built."""
    not_codegen = frozenset().union(*(a.not_codegen_env for a in adapters()))
    switches = {**codegen_env(), **keyed_env(reads, not_codegen=not_codegen)}
    return Environment(
        kind=namespace,
        package=f"{library.distribution}=={library.version()}",
        sources=sources,
        arch=current_arch(),
        codegen_env=tuple(sorted(switches.items())),
    )


@functools.cache
def _side(row: Row) -> SideData | None:
    """The handlers of a row's side data (its adapter's :attr:`~.adapter.Adapter.side_data`)."""
    library = of_row(row)
    return None if row.side is None or library is None else library.side_data.get(row.side)


def _extra(kernel: Any, call: Call) -> dict[str, Any]:
    extra = side_data(kernel)
    if call.locals.get("wants_ptx"):
        extra["ptx_z"] = packed_ptx(kernel)
    row = call.locals["row"]
    if row.side is not None and (handlers := _side(row)) is not None:
        extra.update(handlers.extra(kernel, call.args[0]))
    return extra


def _extra_ok(extra: dict[str, Any], row: Row) -> bool:
    """Side data from disk has the shape this writer stores (else the entry is a miss): the
    compile's calling convention and class (:func:`.convention.side_data_ok`), PTX as bytes, the
    row's own side data (flashinfer's direct micro kernel's block-dim probe)."""
    if not side_data_ok(extra) or ("ptx_z" in extra and not isinstance(extra["ptx_z"], bytes)):
        return False
    handlers = _side(row) if row.side is not None else None
    return handlers is None or handlers.extra_ok(extra)


def _deliver(kernel: Any, extra: dict[str, Any], call: Call) -> None:
    row = call.locals["row"]
    if row.side is not None and (handlers := _side(row)) is not None:
        handlers.deliver(kernel, extra, call.args[0])


def _adapt(kernel: Any, extra: dict[str, Any], call: Call) -> Any:
    payloads = extra.get(HIT_FROM)
    if payloads is not None:  # a hit: what the compile handed flashinfer, around the loaded function
        kernel = as_compiled_hit(kernel, extra, payloads)
    if not call.locals.get("wants_ptx"):
        return kernel
    return with_ptx(kernel, extra.get("ptx_z"), call.locals["site"])


_PLAIN_DEFAULTS = (type(None), bool, int, float, str)


def signature_context(fn: Any) -> str | None:
    """What the compiled function's Python signature decides that its traced IR does not: the
    parameters' names, kinds and plain defaults (the calling convention a hit puts back, and the
    argument names the compile's records hold). None when it cannot be read: no reuse then."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    parts = [(p.name, p.kind.name, repr(p.default) if isinstance(p.default, _PLAIN_DEFAULTS) else type(p.default).__qualname__)
             for p in params]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _plan(call: Call) -> Plan | None:
    """A second-stage plan (a row with ``reuse``): trace with the DSL's own compile and exactly
    the compile's arguments (never through a wrapper of it: a JIT monitor would count a compile)."""
    if trace.unsupported() is not None or not call.args:
        return None
    context = signature_context(call.args[0])
    if context is None:
        return None
    real = call.locals["compile"]
    # Without a wrapper in front, the compile itself is the DSL's own call: a lookup that finds
    # nothing lowers from its trace (one trace, not two). With one (vLLM's JIT monitor), the
    # compile must go through it, so the lookup traces on its own as before.
    lower = None if front.wrapped() else (
        lambda decide: trace.trace_then_lower(real, *call.args, decide=decide, **call.kwargs))
    return Plan(trace=functools.partial(trace.traced_ir, real, *call.args, **call.kwargs), context=context, lower=lower)


def _compile_recording(real: Any, options: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The compile of a row with ``reuse``: it records the digest of the module it lowers
    (:func:`..keys.trace.recorder`), so its entry gets a second-stage record at no second trace."""
    return front.through_wrappers(real, options, args, trace.recorder(kwargs))


def _target_name(target: Any) -> str:
    """A per-target row's entry name suffix: the compiled function or class (a kernel launch
    object's), as ``<module's last part>.<qualified name>`` (``dense_gemm._DenseGemmLaunch``)."""
    fn = getattr(target, "__func__", target)
    owner = fn if hasattr(fn, "__qualname__") else type(fn)
    module = (getattr(owner, "__module__", None) or "").rpartition(".")[2]
    return f"{module}.{owner.__qualname__.replace('.<locals>', '')}"


@functools.cache
def site(row: Row, target: str | None = None) -> Site:
    """The :class:`~.through.Site` record :func:`~.through.through_cache` takes for a row (for a
    per-target row, for one compile target: its entries are named after it)."""
    library = of_row(row)
    dropped = library.not_codegen_kwargs if library is not None else frozenset()
    key = functools.partial(_key, dropped=dropped) if dropped else _key
    return Site(row.file, row.function, row.kind, key, functools.partial(_environment, library=library), options=_options,
                extra=_extra,
                extra_ok=functools.partial(_extra_ok, row=row), deliver=_deliver, adapt=_adapt,
                site_name=f"{row.name}.{target}" if target else row.name,
                reuse=_plan if row.reuse else None)


# --------------------------------------------------------------------------------------------
# The one hook: cutlass.cute.compile
# --------------------------------------------------------------------------------------------


def _where(code: types.CodeType) -> tuple[Adapter, str, str] | None:
    """(adapter, file relative to its code root, qualified name as the scan spells it) of a code object."""
    path = _realpath(code.co_filename)
    found = _located(path)
    if found is None:
        return None
    qualname = getattr(code, "co_qualname", code.co_name).replace(".<locals>", "")
    return found[0], path[len(found[1]) + 1:].replace(os.sep, "/"), qualname


@functools.lru_cache(maxsize=1024)
def _realpath(filename: str) -> str:
    """Once per source file: every code object of a module met above a compile asks."""
    return os.path.realpath(filename)


#: A frame of a library's own disk cache: the compile is that cache's.
HANDED_BACK = "the library's own cache"


#: A frame of a library's code that is no site.
_LIBRARY = "the library's code"


def _classify(code: types.CodeType) -> Row | str | None:
    """A code object's row, :data:`HANDED_BACK`, :data:`_LIBRARY`, or None (no adapter's code)."""
    where = _where(code)
    if where is None:
        return None
    library, file, qualname = where
    if file in library.own_disk_caches:
        return HANDED_BACK
    return library.by_where.get((file, qualname), _LIBRARY)


class HandBack(Exception):
    """Raised inside a build an adapter serves (:mod:`..flashinfer_sites.native`), for a compile we cannot key:
    the library's own builder (and its disk cache) then builds it, as if we were not there."""


#: Set while :mod:`..flashinfer_sites.native` runs a build it serves (the rows whose compiles the hook saw are added):
#: a compile we cannot key is then handed back.
SERVING_NATIVE: contextvars.ContextVar[list[Row] | None] = contextvars.ContextVar("cdc_serving_native", default=None)


class _Dispatch:
    """``cutlass.cute.compile`` for the whole process: sites through the cache."""

    def __init__(self, real: Any, dsl_options: Any = None) -> None:
        self._real = real
        self._dsl_options = dsl_options

    def __getitem__(self, options: Any) -> _Dispatch:
        return _Dispatch(self._real[options], options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if front.returning():  # a wrapper assigned after us (vLLM's JIT monitor) hands back a compile we passed it
            return self._real(*args, **kwargs)
        found = _find_site(sys._getframe(1)) if _ENABLED else None
        if found is None:
            return front.through_wrappers(self._real, self._dsl_options, args, kwargs)
        row, modules, compiled_in = found
        compile_fn = functools.partial(_compile_recording if row.reuse else front.through_wrappers, self._real, self._dsl_options,
                                       args, kwargs)
        call = Call({"row": row, "site": f"{row.file}:{row.function}", "compiled_in": compiled_in, "modules": modules,
                     "describer": describer(), "wants_ptx": wants_ptx(self._dsl_options), "compile": self._real},
                    args, kwargs, self._dsl_options)
        serving = SERVING_NATIVE.get()
        if serving is not None:
            serving.append(row)
        uncached = _hand_back if serving is not None else None
        target = _target_name(args[0]) if row.per_target and args else None
        return through.through_cache(site(row, target), call, compile_fn, uncached=uncached)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _hand_back() -> Any:
    raise HandBack


def _find_site(frame: types.FrameType | None) -> tuple[Row, tuple[str, ...], str] | None:
    """The nearest site above a compile: (row, modules of the frames up to it, where the compile is).

    Only the adapters' frames count: where the compile is means the nearest frame of code under
    an adapter's root, so a frame of anyone else's between it and the compile (a profiler's or
    tracer's decorator, a wrapper of ``cute.compile`` that is not behind :mod:`.front`) changes
    no key.
    """
    modules: list[str] = []
    compiled_in = ""
    for _depth in range(DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        try:
            found = _CODES[code]
        except KeyError:
            found = _CODES[code] = _classify(code)
        if found is HANDED_BACK:
            return None
        module = frame.f_globals.get("__name__", "")
        if _ours(module):
            modules.append(module)
        if found is not None and not compiled_in:
            compiled_in = getattr(code, "co_qualname", code.co_name)
        if isinstance(found, Row):
            return found, tuple(modules), compiled_in
        frame = frame.f_back
    return None


_CODES: dict[types.CodeType, Row | str | None] = {}
_ENABLED = False
_LOCK = threading.Lock()
_MARKER = "_cdc_inline"
setattr(_Dispatch, _MARKER, True)


def patch() -> bool:
    """Put the dispatcher in ``cutlass.cute.compile`` (idempotent); True when it is there."""
    global _ENABLED
    with _LOCK:
        try:
            import cutlass.cute as cute
        except ImportError:
            return False
        _ENABLED = True
        if not PATCHES.replace(cute, "compile", _MARKER, lambda real: _Dispatch(real)):
            return False
        front.install(cute, cute.__dict__["compile"])  # later wrappers of cute.compile go behind it
        return True


def unpatch() -> None:
    """Stop routing sites through the cache (the real compile is put back)."""
    global _ENABLED
    with _LOCK:
        _ENABLED = False
        try:
            import cutlass.cute as cute
        except ImportError:
            return
        kept = front.uninstall(cute)
        PATCHES.restore(cute, ("compile",))
        if kept is not None:  # a wrapper assigned after us (vLLM's monitor) goes on watching
            cute.compile = kept
        _CODES.clear()


def describer() -> Describer:
    """A describer for one compile: the adapters' modules are the fingerprinted ones."""
    return Describer(_ours)


def describe(*args: Any) -> tuple[Any, ...]:
    """What :func:`_key` makes of compile arguments (for tests and ``doctor``)."""
    d = describer()
    return tuple(d(a) for a in args)


__all__ = ["HandBack", "SERVING_NATIVE", "describe", "patch", "site", "unpatch"]
