"""Owns the one interception: ``cutlass.cute.compile``, and the key of every compile it serves.

Every covered sm12x compile, on every release, goes through this hook, put in place once as the
DSL is imported. It looks at the frames above a compile: the nearest function listed in
:data:`.sites.ROWS` (within :data:`.sites.DEPTH` frames) makes the compile a site, which goes
through the cache; any other compile reaches the real one after a few dict lookups. A frame of
flashinfer's own disk caches in between leaves the compile to flashinfer (one kernel, one cache)
unless :mod:`.native` serves that build. flashinfer memoises what we return in its own dicts, so
a repeat never reaches us.

The key is everything the compile receives, as the DSL sees it (:class:`_Describer`), never a
hand-written one (knowledge of what flashinfer's own key leaves out, which a release adding a
compile argument would outgrow): the kernel object's class and every attribute; a ``cute.jit``
function's code as written, evaluated annotations, defaults and closure; each tensor's element
type, layout, alignment and memory space, symbolic extents numbered by identity across the call;
pointers without their address; scalars and their DSL type (a value bound to a parameter declared
as a DSL integer is a runtime argument: keyed by type); the stream's type; the compile options.
The sources of the site's module, of the modules on the way and those the arguments come from
(and the whole kernel tree for code imported from a ``sys.path`` entry) join the fingerprint,
with every environment variable that code reads; device facts are checked (:mod:`..devicefacts`).
What cannot be described, a function whose module no key fingerprints, or options asking for
artifacts a loaded kernel cannot carry leave that compile in memory, with one warning.
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import functools
import hashlib
import importlib.util
import inspect
import logging
import os
import sys
import threading
import types
import weakref
from pathlib import Path
from typing import Any

from ..convention import calling_convention, convention_ok, packed_ptx, with_calling_convention, with_ptx
from ..patches import PATCHES
from ..key import Environment, UnkeyableError, code_digest, codegen_env, current_arch, env_reads, keyed_env
from . import _common, block_dim, sites
from ._common import NOT_CODEGEN_ENV, Call, Site, arg_signature, options_text
from .sites import Row

log = logging.getLogger("cute_diskcache")


class _Describer:
    """One call's arguments as key data; collects the modules the code comes from.

    Symbolic extents (``cute.sym_int()``) are numbered in order of first appearance across the
    whole call: the same symbol in two tensors ties their extents in the compiled signature.
    """

    def __init__(self) -> None:
        self.modules: dict[str, None] = {}
        self._symbols: dict[int, int] = {}
        self._keep: list[Any] = []  # keeps described symbols alive so ids stay unique for this call

    def _module(self, name: Any) -> None:
        if isinstance(name, str) and _ours(name):
            self.modules[name] = None

    def __call__(self, value: Any, depth: int = 0) -> Any:
        if depth > 32:
            raise UnkeyableError("compile argument nested deeper than 32 levels")
        cls = type(value)
        kind = _CATEGORY.get(cls) or _categorize(cls, value)
        if kind == "plain":
            return value
        if kind == "seq":
            tag = "namedtuple:" + _qualname(cls) if hasattr(value, "_fields") else cls.__name__
            return (tag, tuple([self(v, depth + 1) for v in value]))
        if kind == "fake_tensor":
            return ("fake_tensor", str(value.element_type), self(tuple(value.shape), depth + 1),
                    self(tuple(value.stride), depth + 1), getattr(value, "_assumed_align", None),
                    str(getattr(value, "memspace", None)), getattr(value, "_use_32bit_stride", None))
        if kind == "object":  # a kernel object: its class and its whole state
            self._module(cls.__module__)
            state = tuple(sorted([(k, self(v, depth + 1)) for k, v in vars(value).items()]))
            return ("object", _qualname(cls), state)
        if kind == "enum":
            return ("enum", _qualname(cls), value.name)
        if kind == "dict":
            items = [(self(k, depth + 1), self(v, depth + 1)) for k, v in value.items()]
            return ("dict", tuple(sorted(items, key=repr)))
        if kind == "class":
            self._module(value.__module__)
            return ("class", _qualname(value))
        if kind == "torch":
            return ("torch." + cls.__name__, str(value) if cls.__name__ != "device" else value.type)
        if kind == "dataclass":
            self._module(cls.__module__)
            fields = tuple((f.name, self(getattr(value, f.name), depth + 1)) for f in dataclasses.fields(value))
            return ("dataclass", _qualname(cls), fields)
        if kind == "partial":
            return ("partial", self(value.func, depth + 1), self(value.args, depth + 1), self(value.keywords, depth + 1))
        if kind == "method":
            func = value.__func__
            return ("method", self(value.__self__, depth + 1),
                    self._function(func, depth) if isinstance(func, types.FunctionType) else self(func, depth + 1))
        if kind == "function":
            return self._function(value, depth)
        if kind == "symbol":
            return self._symbol(value)
        if kind == "dsl":
            return arg_signature(value)  # runtime tensors, streams, DSL numerics; refuses the rest
        raise UnkeyableError(f"no description for compile argument of type {_qualname(cls)}")

    def _function(self, fn: types.FunctionType, depth: int) -> Any:
        """A function by what it runs: its code, annotations, defaults and closure.

        Its module and qualified name alone would let two lambdas of one module, or two
        closures of one factory with other annotations, share an entry. A function from a
        module whose source no key fingerprints (neither flashinfer's nor the DSL's, which the
        DSL stack versions) is refused: an edit there would not change the key.
        """
        while isinstance(getattr(fn, "__wrapped__", None), types.FunctionType):
            fn = fn.__wrapped__
        module = fn.__module__ or ""
        if not (_ours(module) or module.startswith(_DSL_MODULES)):
            raise UnkeyableError(f"function {module}.{fn.__qualname__} comes from a module whose source is not "
                                 "fingerprinted (not flashinfer's, not the DSL's)")
        self._module(module)
        cells = []
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                cells.append((name, self(cell.cell_contents, depth + 1)))
            except ValueError:  # an empty cell
                cells.append((name, ("empty",)))
        return ("function", module, fn.__qualname__, code_digest(_original_code(fn)), self._annotations(fn, depth),
                self(fn.__defaults__, depth + 1), self(fn.__kwdefaults__, depth + 1), tuple(cells))

    def _annotations(self, fn: types.FunctionType, depth: int) -> Any:
        """Evaluated annotations (the DSL reads them: ``Constexpr``, tensor types), in order; one that
        cannot be evaluated or described (``Constexpr[int]``) is keyed by its text, which names it fully."""
        annotations = _evaluated_annotations(fn)
        out = []
        for name, value in annotations.items():
            try:
                out.append((name, self(value, depth + 1)))
            except UnkeyableError:
                text = repr(value)
                if " at 0x" in text:  # an object's identity, not a description
                    raise
                out.append((name, ("repr", _qualname(type(value)), text)))
        return tuple(out)

    def _symbol(self, sym: Any) -> Any:
        index = self._symbols.setdefault(id(sym), len(self._symbols))
        self._keep.append(sym)
        return ("sym", index, getattr(sym, "width", None), getattr(sym, "divisibility", None))


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


#: class -> how :class:`_Describer` describes its instances (decided once per class: a key has
#: ~200 arguments and attributes, of a few dozen classes).
_CATEGORY: dict[type, str] = {type(None): "plain", bool: "plain", int: "plain", float: "plain", str: "plain",
                              bytes: "plain", tuple: "seq", list: "seq"}


def _categorize(cls: type, value: Any) -> str:
    """The description a class's instances get; in the order of precedence the key has always had."""
    mod = cls.__module__
    if issubclass(cls, (bool, int, float, str, bytes)):
        kind = "plain"
    elif issubclass(cls, enum.Enum):
        kind = "enum"
    elif issubclass(cls, (tuple, list)):
        kind = "seq"
    elif issubclass(cls, dict):
        kind = "dict"
    elif issubclass(cls, type):
        kind = "class"
    elif mod == "torch" and cls.__name__ in ("dtype", "device", "Size"):
        kind = "torch"
    elif dataclasses.is_dataclass(cls):
        kind = "dataclass"
    elif issubclass(cls, functools.partial):
        kind = "partial"
    elif issubclass(cls, types.MethodType):
        kind = "method"
    elif issubclass(cls, types.FunctionType):
        kind = "function"
    elif cls.__name__ == "SymInt" and mod.startswith("cutlass"):
        kind = "symbol"
    elif cls.__name__ == "_FakeTensor" and mod.startswith("cutlass"):
        kind = "fake_tensor"
    elif _ours(mod) and hasattr(value, "__dict__"):
        kind = "object"
    elif mod.startswith(_DSL_MODULES) or (mod.startswith("torch.") and "stream" in cls.__qualname__.lower()):
        kind = "dsl"
    else:
        kind = "none"
    _CATEGORY[cls] = kind
    return kind


@functools.lru_cache(maxsize=4096)
def _evaluated_annotations(fn: Any) -> dict[str, Any]:
    """A function's evaluated annotations, once per function: evaluating string annotations costs
    more than the rest of a key, and a kernel's functions are met again by every request."""
    try:
        return inspect.get_annotations(fn, eval_str=True)
    except Exception:
        return dict(getattr(fn, "__annotations__", None) or {})


#: function -> its code as we first met it (DSLs before 4.8 keep no copy of what they rewrite).
_FIRST_CODE: "weakref.WeakKeyDictionary[Any, types.CodeType]" = weakref.WeakKeyDictionary()


def _original_code(fn: types.FunctionType) -> types.CodeType:
    """A function's code as written: compiling a ``cute.jit`` function leaves the preprocessor's
    rewrite in ``__code__``, which an engine (whose hits compile nothing) never sees, so the second
    kernel of a prewarm would never be hit. The DSL (4.8+) keeps the original as ``_original_code``;
    before that, the code as this process first met it stands in."""
    code = fn.__dict__.get("_original_code")
    if isinstance(code, types.CodeType):
        return code
    try:
        return _FIRST_CODE.setdefault(fn, fn.__code__)
    except TypeError:
        return fn.__code__


#: Modules of the DSL: its version (the DSL stack) is in every key, so its code is fingerprinted.
_DSL_MODULES = ("cutlass", "cuda.")


def _ours(module_name: str) -> bool:
    """A module of flashinfer's code: ``flashinfer.*``, or one loaded from its package directory
    under another name (the expert-parallel kernels' ``sys.path`` entries). Remembered per
    loaded module: a key describes many objects of the same few modules."""
    if module_name == "flashinfer" or module_name.startswith("flashinfer."):
        return True
    known = _OURS.get(module_name)
    if known is not None:
        return known
    module = sys.modules.get(module_name)
    root = _package_dir()
    path = getattr(module, "__file__", None)
    ours = bool(root and path and os.path.realpath(path).startswith(root + os.sep))
    if module is not None:
        _OURS[module_name] = ours
    return ours


_OURS: dict[str, bool] = {}


@functools.lru_cache(maxsize=1)
def _package_dir() -> str | None:
    """flashinfer's package directory (found without importing it)."""
    path = getattr(sys.modules.get("flashinfer"), "__file__", None)
    if path is None:
        try:
            spec = importlib.util.find_spec("flashinfer")
        except (ImportError, ValueError):
            spec = None
        path = getattr(spec, "origin", None)
    return os.path.realpath(os.path.dirname(path)) if path else None


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
    change the kernel: flashinfer's b12x GEMM passes each layer's scale extents that way and
    compiles one kernel for every layer. Anything we cannot read keeps the value in the key.
    """
    if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType):
        declared = _integer_parameters(fn.__func__, True)
    elif isinstance(fn, types.FunctionType):
        declared = _integer_parameters(fn, False)
    else:  # a kernel object's __call__, a partial...: its values stay in the key
        return set()
    return {i for i in declared if i < len(args) and type(args[i]) is int}


@functools.lru_cache(maxsize=4096)
def _integer_parameters(fn: Any, bound: bool) -> frozenset[int]:
    """Positional indices (after ``self`` when ``bound``) of ``fn``'s parameters annotated with a
    DSL integer type; read once per function."""
    out: set[int] = set()
    try:
        import cutlass

        params = list(inspect.signature(fn).parameters.values())[1 if bound else 0:]
        annotations = _evaluated_annotations(fn)
        for i, param in enumerate(params):
            if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                break
            ann = annotations.get(param.name)
            if isinstance(ann, type) and issubclass(ann, cutlass.Integer):
                out.add(i)
    except Exception:  # unreadable: every value stays in the key
        return frozenset()
    return frozenset(out)


def _key(call: Call) -> Any:
    describe: _Describer = call.locals["describer"]
    args = call.args
    dynamic = _dynamic_parameters(args[0], args[1:]) if args and callable(args[0]) else set()
    described = tuple(("dynamic", type(a).__name__) if i - 1 in dynamic else describe(a) for i, a in enumerate(args))
    extra = {k: v for k, v in call.kwargs.items() if k != "options"}
    return ("compile", call.locals["site"], call.locals["compiled_in"], ("args", described), ("kwargs", describe(extra)))


@functools.lru_cache(maxsize=None)
def _tree_facts(tree: str) -> tuple[str, tuple[str, ...]]:
    """sha256 over every ``.py`` file under ``tree`` (names relative to it) and the variables they read."""
    root = Path(_package_dir() or "") / tree
    h = hashlib.sha256()
    reads: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\n")
        reads.update(env_reads(data))
    return h.hexdigest(), tuple(sorted(reads))


def _environment(call: Call) -> Environment:
    """The site's module, the compile's, the flashinfer modules its arguments come from, its kernel tree.

    Built once per (site, modules) in a process, as every source fingerprint is: flashinfer is
    not reloaded under an engine, and the variables its code reads are process settings.
    """
    modules = tuple(m for m in dict.fromkeys((*call.locals["modules"], *call.locals["describer"].modules))
                    if m.startswith("flashinfer.") and m in sys.modules)
    return _environment_of(call.locals["row"], modules)


@functools.lru_cache(maxsize=1024)
def _environment_of(row: Row, modules: tuple[str, ...]) -> Environment:
    facts, reached = [], set()
    for name in modules:  # a module another one already reaches is in that one's fingerprint
        if name not in reached:
            facts.append(_common.site_sources(name))
            reached.update(item[0] for item in facts[-1].stamp)
    prints = [f.fingerprint for f in facts]
    reads = {name for f in facts for name in f.env_reads}
    if row.tree is not None:
        tree_print, tree_reads = _tree_facts(row.tree)
        prints.append(f"tree:{row.tree}:{tree_print}")
        reads.update(tree_reads)
    if not prints:
        raise UnkeyableError(f"no source to fingerprint for {row.file}:{row.function}")
    switches = {**codegen_env(), **keyed_env(reads, not_codegen=NOT_CODEGEN_ENV)}
    return Environment(
        kind=row.namespace,
        package=f"flashinfer-python=={_common.flashinfer_version()}",
        sources=hashlib.sha256("".join(prints).encode()).hexdigest(),
        arch=current_arch(),
        codegen_env=tuple(sorted(switches.items())),
    )


def _extra(kernel: Any, call: Call) -> dict[str, Any]:
    extra = {"calling_convention": calling_convention(kernel),
             "kwargs_wrapper": getattr(kernel, "_kwargs_wrapper", None) is not None}
    if call.locals.get("wants_ptx"):
        extra["ptx_z"] = packed_ptx(kernel)
    if call.locals["row"].side == "block_dim":
        extra.update(block_dim.extra(kernel, call.args[0]))
    return extra


def _extra_ok(extra: dict[str, Any], row: Row) -> bool:
    """Side data from disk has the shape this writer stores (else the entry is a miss): a calling
    convention for a tvm-ffi kernel only, PTX as bytes, a direct micro kernel's block-dim probe."""
    wrapped = extra.get("kwargs_wrapper")
    if not isinstance(wrapped, bool) or ("ptx_z" in extra and not isinstance(extra["ptx_z"], bytes)):
        return False
    if row.side == "block_dim" and not block_dim.extra_ok(extra):
        return False
    return convention_ok(extra.get("calling_convention")) if wrapped else extra.get("calling_convention") is None


def _deliver(kernel: Any, extra: dict[str, Any], call: Call) -> None:
    if call.locals["row"].side == "block_dim":
        block_dim.deliver(kernel, extra, call.args[0])


def _adapt(kernel: Any, extra: dict[str, Any], call: Call) -> Any:
    if convention_ok(extra.get("calling_convention")):
        kernel = with_calling_convention(kernel, extra["calling_convention"])
    if not call.locals.get("wants_ptx"):
        return kernel
    return with_ptx(kernel, extra.get("ptx_z"), call.locals["site"])


@functools.lru_cache(maxsize=None)
def site(row: Row) -> Site:
    """The :class:`~._common.Site` record :func:`~._common.through_cache` takes for a row."""
    return Site(row.file, row.function, row.kind, _key, _environment, options=_options, extra=_extra,
                extra_ok=functools.partial(_extra_ok, row=row), deliver=_deliver, adapt=_adapt, site_name=row.name)


# --------------------------------------------------------------------------------------------
# The one hook: cutlass.cute.compile
# --------------------------------------------------------------------------------------------


def _where(code: types.CodeType) -> tuple[str, str] | None:
    """(file relative to flashinfer's package, qualified name as the scan spells it) of a code object."""
    root = _package_dir()
    if root is None:
        return None
    path = os.path.realpath(code.co_filename)
    if not path.startswith(root + os.sep):
        return None
    qualname = getattr(code, "co_qualname", code.co_name).replace(".<locals>", "")
    return path[len(root) + 1:].replace(os.sep, "/"), qualname


#: A frame of flashinfer's own disk caches: the compile is flashinfer's.
_FLASHINFERS = "flashinfer's own cache"


def _classify(code: types.CodeType) -> Row | str | None:
    where = _where(code)
    if where is None:
        return None
    if where[0] in sites.OWN_DISK_CACHES:
        return _FLASHINFERS
    return sites.BY_WHERE.get(where)


class HandBack(Exception):
    """Raised inside a build :mod:`.native` serves, for a compile we cannot key: flashinfer's
    own builder (and its disk cache) then builds it, as if we were not there."""


#: Set while :mod:`.native` runs a build it serves (the rows whose compiles the hook saw are added):
#: a compile we cannot key is then handed back.
SERVING_NATIVE: contextvars.ContextVar[list[Row] | None] = contextvars.ContextVar("cdc_serving_native", default=None)


class _Dispatch:
    """``cutlass.cute.compile`` for the whole process: sites through the cache."""

    def __init__(self, real: Any, dsl_options: Any = None) -> None:
        self._real = real
        self._dsl_options = dsl_options

    def __getitem__(self, options: Any) -> "_Dispatch":
        return _Dispatch(self._real[options], options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        found = _find_site(sys._getframe(1)) if _ENABLED else None
        if found is None:
            return self._real(*args, **kwargs)
        row, modules, compiled_in = found
        call = Call({"row": row, "site": f"{row.file}:{row.function}", "compiled_in": compiled_in, "modules": modules,
                     "describer": _Describer(), "wants_ptx": wants_ptx(self._dsl_options)}, args, kwargs, self._dsl_options)
        serving = SERVING_NATIVE.get()
        if serving is not None:
            serving.append(row)
        uncached = _hand_back if serving is not None else None
        return _common.through_cache(site(row), call, lambda: self._real(*args, **kwargs), uncached=uncached)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _hand_back() -> Any:
    raise HandBack


def _find_site(frame: types.FrameType | None) -> tuple[Row, tuple[str, ...], str] | None:
    """The nearest site above a compile: (row, modules of the frames up to it, where the compile is)."""
    modules: list[str] = []
    compiled_in = ""
    for depth in range(sites.DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        try:
            found = _CODES[code]
        except KeyError:
            found = _CODES[code] = _classify(code)
        if found is _FLASHINFERS:
            return None
        module = frame.f_globals.get("__name__", "")
        if _ours(module):
            modules.append(module)
        if depth == 0:
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
        return PATCHES.replace(cute, "compile", _MARKER, lambda real: _Dispatch(real))


def unpatch() -> None:
    """Stop routing sites through the cache (the real compile is put back)."""
    global _ENABLED
    with _LOCK:
        _ENABLED = False
        try:
            import cutlass.cute as cute
        except ImportError:
            return
        PATCHES.restore(cute, ("compile",))
        _CODES.clear()


def describe(*args: Any) -> tuple[Any, ...]:
    """What :func:`_key` makes of compile arguments (for tests and ``doctor``)."""
    d = _Describer()
    return tuple(d(a) for a in args)


__all__ = ["HandBack", "SERVING_NATIVE", "describe", "patch", "site", "unpatch"]
