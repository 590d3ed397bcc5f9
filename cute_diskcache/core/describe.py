"""Owns what a CuTe DSL compile receives, as key data: a tree :class:`~..keys.key.Plain` can encode.

A compile hook keys a compile by everything it is given, never by a hand-written key: the kernel
object's class and every attribute; a ``cute.jit`` function's code as written, evaluated
annotations, defaults and closure; each tensor's element type, layout, alignment and memory space,
symbolic extents numbered by identity across the call; pointers without their address; scalars
and their DSL type; the stream's type. Nothing here knows a library that calls the DSL: which
modules' sources a key fingerprints (so their objects are keyed by state and their functions by
code) is the caller's rule, ``fingerprinted``. What cannot be described raises
:class:`~..keys.key.UnkeyableError`: that compile stays in memory, never keyed by a guess.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import re
import types
import weakref
from typing import Any
from collections.abc import Callable

from ..keys.key import UnkeyableError, code_digest

#: An object's address in a text (a runtime tensor's, an options object's repr).
ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


class Describer:
    """One call's arguments as key data; collects the modules the code comes from.

    Symbolic extents (``cute.sym_int()``) are numbered in order of first appearance across the
    whole call: the same symbol in two tensors ties their extents in the compiled signature.
    """

    def __init__(self, fingerprinted: Callable[[str], bool]) -> None:
        self.fingerprinted = fingerprinted  # whether a module's source is in the key's environment
        # One per compile: the caches of this rule are found, not copied (built once per rule).
        categories, constants = _CATEGORIES.get(fingerprinted), _CONSTANTS.get(fingerprinted)
        if categories is None or constants is None:
            categories = _CATEGORIES.setdefault(fingerprinted, dict(_BUILTIN_CATEGORIES))
            constants = _CONSTANTS.setdefault(fingerprinted, {})
        self.categories, self.constants = categories, constants
        self.modules: dict[str, None] = {}
        self._symbols: dict[int, int] = {}
        self._keep: list[Any] = []  # keeps described symbols alive so ids stay unique for this call

    def _module(self, name: Any) -> None:
        if isinstance(name, str) and self.fingerprinted(name):
            self.modules[name] = None

    def __call__(self, value: Any, depth: int = 0) -> Any:
        """``value`` as a tree of exact tuples, strings, ints, floats, bools, None and bytes: what
        :class:`~cute_diskcache.keys.key.Plain` encodes (it refuses anything else, so a description
        that let another type through is unkeyable, never a lossy key). Plain values and tuples of
        them, most of a key, are taken as they are without a call per element."""
        if depth > 32:
            raise UnkeyableError("compile argument nested deeper than 32 levels")
        cls = type(value)
        kind = self.categories.get(cls) or _categorize(cls, value, self.fingerprinted, self.categories)
        if kind == "plain":
            return value
        depth += 1
        if kind == "fake_tensor":
            shape, stride = tuple(value.shape), tuple(value.stride)
            align, narrow = getattr(value, "_assumed_align", None), getattr(value, "_use_32bit_stride", None)
            return ("fake_tensor", _text(value.element_type),
                    ("tuple", shape) if _PLAIN.issuperset(map(type, shape)) else self(shape, depth),
                    ("tuple", stride) if _PLAIN.issuperset(map(type, stride)) else self(stride, depth),
                    align if type(align) in _PLAIN else self(align, depth), _text(getattr(value, "memspace", None)),
                    narrow if type(narrow) in _PLAIN else self(narrow, depth))
        if kind == "seq":
            if cls is tuple or cls is list:
                tag = cls.__name__
            else:
                tag = ("namedtuple:" if hasattr(value, "_fields") else "sequence:") + _qualname(cls)
            if _PLAIN.issuperset(map(type, value)):
                return (tag, value if cls is tuple else tuple(value))
            return (tag, tuple([v if type(v) in _PLAIN else self(v, depth) for v in value]))
        if kind == "object":  # a kernel object: its class and its whole state, by attribute name
            self._module(cls.__module__)
            constants, state = self.constants, []
            for k, v in sorted(vars(value).items()):
                if type(v) in _PLAIN:
                    state.append((k, v))
                    continue
                held = constants.get(id(v))  # a class or enum member met before, without a call
                if held is not None and held[0] is v:
                    if held[2] is not None:
                        self.modules[held[2]] = None
                    state.append((k, held[1]))
                else:
                    state.append((k, self(v, depth)))
            return ("object", _qualname(cls), tuple(state))
        if kind == "class" or kind == "enum":  # the same few types and members in every key: by identity
            held = self.constants.get(id(value))
            if held is None or held[0] is not value:
                held = _constant(value, kind, self.fingerprinted, self.constants)
            if held[2] is not None:
                self.modules[held[2]] = None
            return held[1]
        if kind == "cast":  # a subclass of a plain type: its plain value (an int subclass keys as its int)
            return _CASTS[cls](value)
        if kind == "dict":
            items = [(self(k, depth), self(v, depth)) for k, v in value.items()]
            return ("dict", tuple(sorted(items, key=repr)))
        if kind == "torch":
            return ("torch." + cls.__name__, str(value) if cls.__name__ != "device" else value.type)
        if kind == "dataclass":
            self._module(cls.__module__)
            fields = tuple((f.name, self(getattr(value, f.name), depth)) for f in dataclasses.fields(value))
            return ("dataclass", _qualname(cls), fields)
        if kind == "partial":
            return ("partial", self(value.func, depth), self(value.args, depth), self(value.keywords, depth))
        if kind == "method":
            func = value.__func__
            return ("method", self(value.__self__, depth),
                    self._function(func, depth - 1) if isinstance(func, types.FunctionType) else self(func, depth))
        if kind == "function":
            return self._function(value, depth - 1)
        if kind == "symbol":
            return self._symbol(value, depth)
        if kind == "dsl":  # runtime tensors, streams, DSL numerics; arg_signature refuses the rest
            signature = arg_signature(value)  # a tuple of its own shape: its items described, no "tuple" tag
            if type(signature) is not tuple:
                return self(signature, depth)
            return tuple([v if type(v) in _PLAIN else self(v, depth) for v in signature])
        raise UnkeyableError(f"no description for compile argument of type {_qualname(cls)}")

    def _function(self, fn: types.FunctionType, depth: int) -> Any:
        """A function by what it runs: its code, annotations, defaults and closure.

        Its module and qualified name alone would let two lambdas of one module, or two
        closures of one factory with other annotations, share an entry. A function from a
        module whose source no key fingerprints (neither one of the caller's ``fingerprinted``
        modules nor the DSL's, which the DSL stack versions) is refused: an edit there would not
        change the key.
        """
        while isinstance(getattr(fn, "__wrapped__", None), types.FunctionType):
            fn = fn.__wrapped__
        module = fn.__module__ or ""
        if not (self.fingerprinted(module) or module.startswith(DSL_MODULES)):
            raise UnkeyableError(f"function {module}.{fn.__qualname__} comes from a module whose source is not "
                                 "fingerprinted (not the caller's, not the DSL's)")
        self._module(module)
        cells = []
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                cells.append((name, self(cell.cell_contents, depth + 1)))
            except ValueError:  # an empty cell
                cells.append((name, ("empty",)))
        return ("function", module, fn.__qualname__, code_digest(original_code(fn)), self._annotations(fn, depth),
                self(fn.__defaults__, depth + 1), self(fn.__kwdefaults__, depth + 1), tuple(cells))

    def _annotations(self, fn: types.FunctionType, depth: int) -> Any:
        """Evaluated annotations (the DSL reads them: ``Constexpr``, tensor types), in order; one that
        cannot be evaluated or described (``Constexpr[int]``) is keyed by its text, which names it fully."""
        annotations = evaluated_annotations(fn)
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

    def _symbol(self, sym: Any, depth: int) -> Any:
        index = self._symbols.setdefault(id(sym), len(self._symbols))
        self._keep.append(sym)
        return ("sym", index, self(getattr(sym, "width", None), depth), self(getattr(sym, "divisibility", None), depth))


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


#: The exact types a description holds as they are (and :class:`~cute_diskcache.keys.key.Plain` writes).
_PLAIN = frozenset({type(None), bool, int, float, str, bytes})

#: class -> how a :class:`Describer` describes its instances, per fingerprint rule (one per caller;
#: decided once per class: a key has ~200 arguments and attributes, of a few dozen classes).
_BUILTIN_CATEGORIES: dict[type, str] = {**{t: "plain" for t in _PLAIN}, tuple: "seq", list: "seq"}
_CATEGORIES: dict[Callable[[str], bool], dict[type, str]] = {}

#: A subclass of a plain type -> its plain value (the base type's own conversion, not an override).
_CASTS: dict[type, Any] = {}


def _categorize(cls: type, value: Any, fingerprinted: Callable[[str], bool], categories: dict[type, str]) -> str:
    """The description a class's instances get; an enum before the plain type it may derive from."""
    mod = cls.__module__
    if issubclass(cls, enum.Enum):
        kind = "enum"
    elif issubclass(cls, (int, float, str, bytes)):  # bool cannot be subclassed
        kind = "cast"
        _CASTS[cls] = next(cast for base, cast in ((int, int.__int__), (float, float.__float__), (str, str.__str__),
                                                   (bytes, lambda b: bytes(memoryview(b)))) if issubclass(cls, base))
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
    elif dsl_pointer(cls):  # before "object": a library's subclass of the DSL's Pointer (b12x's _Pointer)
        kind = "dsl"
    elif fingerprinted(mod) and hasattr(value, "__dict__"):
        kind = "object"
    elif mod.startswith(DSL_MODULES) or (mod.startswith("torch.") and "stream" in cls.__qualname__.lower()):
        kind = "dsl"
    else:
        kind = "none"
    categories[cls] = kind
    return kind


def _text(value: Any) -> str:
    """``str()`` of a fake tensor's element type or memory space, once per object (the DSL's numeric
    classes spell their names in Python, and every tensor of a key asks). By identity, holding the
    object, so an id is never reused and no ``__eq__`` of the DSL's can mix two types up."""
    held = _TEXTS.get(id(value))
    if held is not None and held[0] is value:
        return held[1]
    if len(_TEXTS) > 256:  # element types and spaces are few; anything else is not worth holding
        _TEXTS.clear()
    text = str(value)
    _TEXTS[id(value)] = (value, text)
    return text


_TEXTS: dict[int, tuple[Any, str]] = {}


def _constant(value: Any, kind: str, fingerprinted: Callable[[str], bool],
              constants: dict[int, tuple[Any, Any, str | None]]) -> tuple[Any, Any, str | None]:
    """(value, its description, the module it names when that one is fingerprinted) of a class or an
    enum member, remembered by identity while held (an ``__eq__`` of theirs never mixes two up)."""
    if kind == "class":
        module = value.__module__ if isinstance(value.__module__, str) and fingerprinted(value.__module__) else None
        held = (value, ("class", _qualname(value)), module)
    else:
        name = value.name  # a flag combination may have none: then its raw value
        if type(name) is not str:
            name = ("value", value._value_)
            if type(name[1]) not in _PLAIN:
                raise UnkeyableError(f"enum member of {_qualname(type(value))} with neither a name nor a plain value")
        held = (value, ("enum", _qualname(type(value)), name), None)
    if len(constants) > 1024:
        constants.clear()
    constants[id(value)] = held
    return held


#: Per fingerprint rule: id -> (class or enum member, its description, its fingerprinted module).
_CONSTANTS: dict[Callable[[str], bool], dict[int, tuple[Any, Any, str | None]]] = {}


@functools.lru_cache(maxsize=4096)
def evaluated_annotations(fn: Any) -> dict[str, Any]:
    """A function's evaluated annotations, once per function: evaluating string annotations costs
    more than the rest of a key, and a kernel's functions are met again by every request."""
    try:
        return inspect.get_annotations(fn, eval_str=True)
    except Exception:  # noqa: BLE001 - evaluating a string annotation runs the module's code: any error keeps the raw ones
        return dict(getattr(fn, "__annotations__", None) or {})


#: function -> its code as we first met it (DSLs before 4.8 keep no copy of what they rewrite).
_FIRST_CODE: weakref.WeakKeyDictionary[Any, types.CodeType] = weakref.WeakKeyDictionary()


def original_code(fn: types.FunctionType) -> types.CodeType:
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
DSL_MODULES = ("cutlass", "cuda.")


def dsl_pointer(cls: type) -> bool:
    """A runtime pointer of the DSL's: its ``_Pointer``, or any subclass of its ``Pointer`` type
    (b12x passes its own copy of ``_Pointer``, holding a placeholder address). Knowledge of the
    DSL, not of a library: by base class, so no library's class is named here."""
    if cls.__name__ == "_Pointer" and cls.__module__.startswith("cutlass"):
        return True
    return any(base.__name__ == "Pointer" and base.__module__.startswith("cutlass") for base in cls.__mro__[1:])


def arg_signature(arg: Any) -> Any:
    """What the compiler sees of one ``cute.compile`` argument, with no address in it.

    Sites that compile against real tensors (``from_dlpack``) specialise on each tensor's
    element type, layout (static extents, dynamic marks, divisibility), alignment and memory
    space; the DSL's own text of a tensor shows all but the element type and alignment, which
    are added. Streams only matter by type. An argument we cannot describe is refused
    (:class:`UnkeyableError`): that compile runs uncached.
    """
    if arg is None or isinstance(arg, (bool, int, float, str, bytes, enum.Enum)):
        return arg
    cls = type(arg)
    name = f"{cls.__module__}.{cls.__qualname__}"
    # Class attributes only: a runtime tensor's ``layout`` property raises NotImplementedError.
    if hasattr(cls, "element_type") and hasattr(cls, "mark_layout_dynamic"):
        return (
            "tensor",
            name,
            ADDRESS.sub("0x", str(arg)),
            arg.element_type,
            getattr(arg, "_assumed_align", None),
            str(getattr(arg, "memspace", None)),
            getattr(arg, "_use_32bit_stride", None),
        )
    if dsl_pointer(cls):  # make_ptr(dtype, address, space, align), or a library's subclass of the DSL's Pointer
        # The address is a runtime argument; the element type, space and assumed alignment are compiled in.
        dtype = getattr(arg, "_dtype", None)
        if not isinstance(dtype, type) or not hasattr(arg, "_addr_space") or not isinstance(getattr(arg, "_assumed_align", None), int):
            raise UnkeyableError(f"pointer argument {name} without the element type, space and alignment we key")
        return ("pointer", name, f"{dtype.__module__}.{dtype.__qualname__}", str(arg._addr_space), arg._assumed_align)
    if "stream" in cls.__qualname__.lower():
        return ("stream", name)
    value = getattr(arg, "value", None)
    if cls.__module__.startswith("cutlass") and isinstance(value, (bool, int, float)):
        return ("numeric", name, value)
    raise UnkeyableError(f"no signature for compile argument of type {name}")
