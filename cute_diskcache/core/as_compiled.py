"""Owns what a hit hands the caller: an object of the class the compile returned, not a look-alike.

``cute.compile`` returns one of the DSL's ``JitCompiledFunction`` classes (with tvm-ffi,
``TVMFFIJitCompiledFunctionWithKwargs`` or ``TVMFFIJitCompiledFunction``); a kernel loaded from
disk is a bare tvm-ffi function. Callers check what they got: flashinfer 0.7.4's KDA refuses
anything whose class is not the DSL's tvm-ffi one, flashinfer's own disk cache (0.6.18+) and
several backends call ``export_to_c`` on it, GDN reads its ``__ptx__``. So a hit is rebuilt as an
instance of a subclass of the compile's own class (same name, so a check by name passes too),
made without running the DSL's constructor (which needs the compile):

* at a miss, :func:`describe` keeps the compiled object's state that is plain data (function
  name, kernel info, C-header arguments, host target, flags...) and its runtime signature in the
  DSL's own serialised form (its export signature processor, what ``dump_to_object`` embeds);
* at a hit, :func:`rebuild` sets that state on the new object with the loaded function inside,
  called through the light calling convention (:class:`~.convention.Convention`, measured: tvm-ffi's
  generated keyword wrapper cost more than the rest of a hit);
* what only the compile held is made again on first use, from the entry's own verified payloads:
  ``ir_module`` from the stored MLIR (so ``export_to_c`` works, byte for byte), ``engine`` and
  ``capi_func`` from the stored object (loaded as the DSL loads one), ``execution_args`` from the
  stored signature. A hit that nobody inspects pays for none of it.

The serialised signature is the DSL's own format (DSL 4.5's is a pickle): it is read only from an
entry that passed every check a hit makes, whose native code is loaded anyway. The rest of the
side data is plain data and objects of an allow-list of the DSL's classes (:data:`_RECORDS` and
the compiled-function classes): a name in an entry only picks one of them.

An attribute of a DSL release this module does not know (not plain data, not one of those) is
recorded at the miss and said by name if a caller asks for it. Nothing here knows a library.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import importlib
import logging
import threading
import zlib
from typing import Any
from collections.abc import Callable

import msgpack

log = logging.getLogger("cute_diskcache")

#: Runtime state a new object starts afresh (locks, executors) or that the hit supplies (the function).
_FRESH: dict[str, Callable[[], Any]] = {
    "_executor_lock": threading.RLock,
    "_default_executor": lambda: None,
    "jit_module": lambda: None,
    "_pyir_spec": lambda: None,
}
_SUPPLIED = frozenset({"_tvm_ffi_function", "_kwargs_wrapper"})
#: What only the compile held, made again on first use from the entry (see :class:`_Lazy`).
_REMADE = frozenset({"ir_module", "engine", "capi_func", "execution_args"})
#: The DSL's packages: the compiled-function classes side data may name are defined there.
_OWNERS = ("cutlass.base_dsl.", "cutlass.cutlass_dsl.", "cutlass.cute.")
#: The DSL's plain records a compiled function holds whose state side data carries, as (module,
#: qualified name): its artifacts, C-header arguments and host target. An allow-list: a record of
#: any other class is "not plain" at the miss (named if a caller asks for it), and side data that
#: names one is never decoded. Side data names classes by these strings only to pick one of this
#: list (or one of the DSL's compiled-function classes, :func:`_compiled_classes`); nothing is
#: ever imported or looked up by a name an entry chose, so no entry can make a decoder build
#: another class (a ``subprocess.Popen``, a ``tempfile`` closer that deletes a file).
_RECORDS = frozenset({
    ("cutlass.base_dsl.jit_executor", "JitFunctionArtifacts"),
    ("cutlass.base_dsl.export.c_header_generator", "CHeaderArguments"),
    ("cutlass.base_dsl.compiler", "HostTarget"),
})
#: The DSL's modules that define its compiled-function classes (imported before they are listed).
_PROVIDERS = ("cutlass.cutlass_dsl.cuda_jit_executor", "cutlass.cutlass_dsl.tvm_ffi_provider")
#: A CuTe-ABI kernel (no tvm-ffi) is loaded by the DSL's own loader, which sets these to say how
#: it is launched from the loaded object: they stay the loader's.
_LOADERS = frozenset({"load_from_binary", "prefix"})
#: What a caller can see differ between such a kernel loaded and one the DSL's JIT holds (the
#: loader's engine is the DSL's binary engine). A compiling process is handed its entry as loaded
#: (core/cache.py, host code written for a baseline), so a caller sees it only where no entry
#: could be written or with CUTE_DISKCACHE_HOST_CPU=native.
LOADER_FACTS = frozenset({*_LOADERS, "engine"})


class NotPlain(Exception):
    pass


def _encode(value: Any) -> Any:
    """``value`` as msgpack-safe data that :func:`_decode` turns back into an equal value of the
    same types (tuples, ordered dicts and the DSL's plain records survive); raises :class:`NotPlain`."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value if type(value) in (type(None), bool, int, float, str, bytes) else _raise(value)
    if type(value) is list:
        return {"t": "list", "v": [_encode(v) for v in value]}
    if type(value) is tuple:
        return {"t": "tuple", "v": [_encode(v) for v in value]}
    if type(value) in (dict, collections.OrderedDict):
        return {"t": type(value).__name__, "v": [[_encode(k), _encode(v)] for k, v in value.items()]}
    cls = type(value)
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict) and (cls.__module__, cls.__qualname__) in _RECORDS and not hasattr(cls, "__slots__"):
        return {"t": "obj", "c": [cls.__module__, cls.__qualname__], "v": {k: _encode(v) for k, v in state.items()}}
    return _raise(value)


def _raise(value: Any) -> Any:
    raise NotPlain(type(value).__qualname__)


def _decode(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    kind, v = data["t"], data["v"]
    if kind == "list":
        return [_decode(x) for x in v]
    if kind == "tuple":
        return tuple(_decode(x) for x in v)
    if kind in ("dict", "OrderedDict"):
        pairs = [(_decode(k), _decode(x)) for k, x in v]
        return collections.OrderedDict(pairs) if kind == "OrderedDict" else dict(pairs)
    if kind == "obj":
        cls = _record_class(data["c"])
        obj = object.__new__(cls)
        obj.__dict__.update({k: _decode(x) for k, x in v.items()})
        return obj
    raise ValueError(f"unknown encoded kind {kind!r}")


class NotAllowed(ValueError):
    """Side data naming a class it may not (not one of the DSL's compiled functions or records)."""


def _compiled_classes() -> dict[tuple[str, str], type]:
    """The DSL's compiled-function classes loaded in this process, by (module, qualified name):
    its ``JitCompiledFunction`` and every subclass the DSL's own packages define (the classes
    ``cute.compile`` returns: tvm-ffi's two, the CUDA dialect's)."""
    from cutlass.base_dsl.jit_executor import JitCompiledFunction

    for module in _PROVIDERS:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a DSL laid out otherwise: the classes it did load
            pass
    found: dict[tuple[str, str], type] = {}
    stack: list[type] = [JitCompiledFunction]
    while stack:
        cls = stack.pop()
        if cls.__module__.startswith(_OWNERS) and "<locals>" not in cls.__qualname__:
            found.setdefault((cls.__module__, cls.__qualname__), cls)
        stack.extend(cls.__subclasses__())
    return found


def preload() -> None:
    """Import the DSL's modules that define its compiled-function classes, at attach.

    A hit must hand back the compile's own class, and tvm-ffi's lives in a module (with its
    ``tvm_ffi_builder``) that a process serving only hits has no other reason to load: importing it
    cost the first hit of every fresh process ~7 ms (three times the rest of that hit). At attach it
    is paid once, off the first request, and :func:`_compiled_classes` then finds it loaded.
    """
    for module in _PROVIDERS:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a DSL laid out otherwise: the first hit finds what it has
            pass


@functools.lru_cache(maxsize=64)
def _class_of(module: str, qualname: str) -> type:
    """The allowed class side data names by ``(module, qualname)``: a record of :data:`_RECORDS`
    (its module, from that list, imported and the one name read), else one of the DSL's
    compiled-function classes; :class:`NotAllowed` for anything else."""
    if (module, qualname) in _RECORDS:
        cls = getattr(importlib.import_module(module), qualname, None)
        if isinstance(cls, type) and cls.__module__ == module and cls.__qualname__ == qualname:
            return cls
        raise NotAllowed(f"{module}.{qualname} is not defined by this DSL")
    cls = _compiled_classes().get((module, qualname))
    if cls is None:
        raise NotAllowed(f"{module}.{qualname} is not a class side data may name")
    return cls


def _class(path: Any) -> type:
    return _class_of(str(path[0]), str(path[1]))


def _record_class(path: Any) -> type:
    """A record's class: one of :data:`_RECORDS` only (never a compiled function inside a record)."""
    if (str(path[0]), str(path[1])) not in _RECORDS:
        raise NotAllowed(f"{path[0]}.{path[1]} is not a record side data may hold")
    return _class(path)


def _compiled_class(path: Any) -> type:
    """The class a hit rebuilds: one of the DSL's compiled-function classes only."""
    if (str(path[0]), str(path[1])) in _RECORDS:
        raise NotAllowed(f"{path[0]}.{path[1]} is not a compiled function")
    return _class(path)


def _is_compiled(kernel: Any) -> bool:
    """Whether ``kernel`` is of the DSL's compiled-function family (the only results rebuilt)."""
    try:
        from cutlass.base_dsl.jit_executor import JitCompiledFunction
    except Exception:  # noqa: BLE001 - a DSL laid out otherwise: hand back what we load, as before
        return False
    return isinstance(kernel, JitCompiledFunction)


def describe(kernel: Any) -> dict[str, Any] | None:
    """What a hit needs to hand back an object like ``kernel`` (side data), or None when it is
    not a DSL compiled function (then a hit hands back the loaded kernel as it is)."""
    if not _is_compiled(kernel):
        return None
    cls = type(kernel)
    state: dict[str, Any] = {}
    unknown: list[str] = []
    for name, value in vars(kernel).items():
        if name in _FRESH or name in _SUPPLIED or name in _REMADE:
            continue
        try:
            state[name] = _encode(value)
        except NotPlain:
            unknown.append(name)
    mode = "function" if _is_tvm_ffi_function(cls) else "keywords" if "_kwargs_wrapper" in vars(kernel) else "cute-abi"
    scalars = {k: v for k, v in state.items() if not isinstance(v, dict)}
    records = {k: v for k, v in state.items() if isinstance(v, dict)}
    return {"class": [cls.__module__, cls.__qualname__], "state": scalars, "unknown": sorted(unknown),
            "records": sorted(records), "records_z": zlib.compress(msgpack.packb(records, use_bin_type=True), 6),
            "signature": _signature_bytes(kernel), "remade": sorted(n for n in _REMADE if n in vars(kernel)), "mode": mode}


def _signature_bytes(kernel: Any) -> bytes | None:
    """The runtime signature, serialised by the DSL's own export signature processor (None if it cannot)."""
    try:
        _export_provider()
        return bytes(kernel.export_provider.signature_processor.dumps(kernel.execution_args.signature))
    except Exception as exc:  # noqa: BLE001 - private DSL API: a DSL that lays it out otherwise keeps no signature
        log.debug("no signature kept (%s: %s)", type(exc).__name__, exc)
        return None


def _export_provider() -> None:
    """The DSL sets its compiled functions' export provider (and so its signature processor) when
    ``cutlass.cute.export`` is imported, which a process that only compiles may never do."""
    import cutlass.cute.export  # noqa: F401 - imported for its side effect (above)


def _is_tvm_ffi_function(cls: type) -> bool:
    try:
        import tvm_ffi
    except Exception:  # noqa: BLE001 - no tvm-ffi, or one that fails to load its library: not its function class
        return False
    return issubclass(cls, tvm_ffi.Function)


def valid(result: Any) -> bool:
    """Side data from disk has the shape :func:`describe` writes, and names one of the DSL's
    compiled-function classes (the records inside are checked when first read: most never are)."""
    shaped = (isinstance(result, dict) and isinstance(result.get("class"), list) and len(result["class"]) == 2
              and all(isinstance(p, str) for p in result["class"]) and isinstance(result.get("state"), dict)
              and isinstance(result.get("records"), list) and isinstance(result.get("records_z"), bytes)
              and isinstance(result.get("unknown"), list) and isinstance(result.get("remade"), list)
              and result.get("mode") in _MODES and isinstance(result.get("signature"), (bytes, type(None))))
    if not shaped:
        return False
    try:
        _compiled_class(result["class"])
    except Exception:  # noqa: BLE001 - NotAllowed, or no DSL here to say: not side data a hit can hand back
        return False
    return True


# --------------------------------------------------------------------------------------------
# At a hit
# --------------------------------------------------------------------------------------------


class Payloads:
    """The entry a hit came from, read again (and verified) only when a caller asks for what the
    compile held: its MLIR, its object."""

    def __init__(self, read: Callable[[str], tuple[bytes, str] | None]) -> None:
        self._read = read

    def get(self, role: str) -> tuple[bytes, str]:
        found = self._read(role)
        if found is None:
            raise AttributeError(f"the cache entry this kernel was loaded from holds no {role} any more")
        return found


def _ir_module(obj: Any) -> Any:
    from cutlass._mlir import ir

    data, name = obj._cdc_payloads.get("mlir")
    raw = zlib.decompress(data)
    with ir.Context():
        return ir.Module.parse(raw if name.endswith(".mlirbc.zz") else raw.decode())


def _engine(obj: Any) -> Any:
    from ..storage import loader

    data, _ = obj._cdc_payloads.get("object")
    return loader.object_module(data, tvm_ffi=obj.__dict__.get("_tvm_ffi_function") is not None or _is_tvm_ffi_function(type(obj))).engine


def _capi_func(obj: Any) -> Any:
    ptr = obj.engine.lookup(obj.function_name)
    return ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)(ptr) if ptr else None


def _execution_args(obj: Any) -> Any:
    from cutlass.base_dsl.jit_executor import ExecutionArgs

    if obj._cdc_signature is None:
        raise AttributeError("execution_args: the compile's signature could not be kept")
    _export_provider()
    signature = obj.export_provider.signature_processor.loads(obj._cdc_signature)
    scope = getattr(type(obj), "_jit_arg_adapter_scope", None)  # DSL 4.6+; 4.5's takes two arguments
    return ExecutionArgs(signature, obj.function_name, **({"adapter_scope": scope} if scope is not None else {}))


_MAKERS: dict[str, Callable[[Any], Any]] = {
    "ir_module": _ir_module, "engine": _engine, "capi_func": _capi_func, "execution_args": _execution_args,
}


_MODES = ("function", "keywords", "cute-abi")


class _Lazy:
    """Mixed into the rebuilt class: what only the compile held is made on first use."""

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.__dict__.get("_cdc_remade", ()), *self.__dict__.get("_cdc_pending", ())})

    def __getattr__(self, name: str) -> Any:  # only for names the instance does not have
        state = self.__dict__
        if name in state.get("_cdc_pending", ()):  # the compile's records, unpacked when one is first read
            refused: dict[str, str] = {}
            for key, encoded in msgpack.unpackb(zlib.decompress(state["_cdc_records_z"]), raw=False).items():
                try:
                    state.setdefault(key, _decode(encoded))  # a thread that got here first keeps its objects
                except NotAllowed as exc:  # never built; said by name, as an attribute we could not keep
                    refused[key] = str(exc)
            state["_cdc_refused"] = {**state.get("_cdc_refused", {}), **refused}
            state["_cdc_pending"] = frozenset()
            if name in state:
                return state[name]
        if name in state.get("_cdc_refused", ()):
            raise AttributeError(f"{name}: not rebuilt from the cache entry ({state['_cdc_refused'][name]})")
        if name in _MAKERS and name in self.__dict__.get("_cdc_remade", ()):
            value = _MAKERS[name](self)
            self.__dict__[name] = value
            return value
        if name in self.__dict__.get("_cdc_unknown", ()):
            raise AttributeError(f"{name}: this DSL's compiled kernels hold it, and a kernel loaded from cute-diskcache "
                                 f"cannot carry it (not plain data)")
        raise AttributeError(f"{type(self).__qualname__!r} object has no attribute {name!r}")


@functools.lru_cache(maxsize=64)
def _loaded_class(cls: type, mode: str) -> type:
    """A subclass of ``cls`` named like it; the keyword class calls the loaded function directly."""
    body: dict[str, Any] = {"__module__": __name__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                            "_cdc_loaded": True}
    if mode == "keywords":
        # The DSL's keyword class checks its pointer-address specs on every call; a kernel with
        # such specs is never stored (convention.calling_convention), so call the wrapper directly.
        body["__call__"] = lambda self, *args, **kwargs: self._kwargs_wrapper(*args, **kwargs)
    return type(cls.__name__, (_Lazy, cls), body)


def rebuild(loaded: Any, result: dict[str, Any], wrapper: Callable[..., Any] | None, payloads: Payloads) -> Any:
    """What the compile handed its caller, around ``loaded``.

    tvm-ffi kernels (``loaded`` is the bare function): a new instance of the compile's class,
    calling the function itself (positional class) or through ``wrapper`` (the keyword class: a
    :class:`~.convention.Convention`). CuTe-ABI kernels (``loaded`` is the DSL's own reloaded
    object, already of that family and launched from the loaded object): that object, given the
    compile's class and its plain state but for how the loader launches it (:data:`_LOADERS`).
    """
    mode = result["mode"]
    cls = _loaded_class(_compiled_class(result["class"]), mode)
    if mode == "cute-abi":
        if not isinstance(loaded, cls.__mro__[2]):  # [0] ours, [1] _Lazy, [2] the compile's class
            return loaded
        obj = loaded
        obj.__class__ = cls
        state = obj.__dict__
        if state.get("ir_module") is None:
            state.pop("ir_module", None)  # made on first use from the stored MLIR, as for tvm-ffi kernels
        remade = [n for n in result["remade"] if n not in state]
    else:
        obj = cls.__new__(cls)
        if mode == "function":
            obj.__move_handle_from__(loaded)
        else:
            obj._tvm_ffi_function = loaded
            obj._kwargs_wrapper = wrapper if wrapper is not None else loaded
        state = obj.__dict__
        for name, make in _FRESH.items():
            state[name] = make()
        remade = result["remade"]
    for name, value in result["state"].items():
        if mode != "cute-abi" or name not in _LOADERS:
            state[name] = value
    pending = frozenset(n for n in result["records"] if mode != "cute-abi" or n not in _LOADERS)
    for name in pending:  # containers and records: unpacked when one is first read (most never are)
        state.pop(name, None)
    state["_cdc_pending"] = pending
    state["_cdc_records_z"] = result["records_z"]
    state["_cdc_payloads"] = payloads
    state["_cdc_signature"] = result["signature"]
    state["_cdc_remade"] = frozenset(remade)
    state["_cdc_unknown"] = frozenset(result["unknown"])
    return obj


def set_ptx(obj: Any, text: str) -> bool:
    """Make a rebuilt object's ``__ptx__`` (its artifacts' PTX) the kept text; False if it has no artifacts."""
    artifacts = obj.__dict__.get("artifacts")
    if artifacts is None or not hasattr(artifacts, "PTX"):
        return False
    artifacts.PTX = text
    return True


def loaded(kernel: Any) -> bool:
    """Whether ``kernel`` was rebuilt by :func:`rebuild` (a hit), not compiled in this process."""
    return getattr(type(kernel), "_cdc_loaded", False)


__all__ = ["LOADER_FACTS", "Payloads", "describe", "loaded", "rebuild", "set_ptx", "valid"]
