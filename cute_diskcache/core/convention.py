"""Owns what a kernel loaded from disk needs to be used as the compiled one was: calling convention, PTX.

``cute.compile`` wraps a tvm-ffi kernel in the DSL's keyword wrapper (parameter names, trailing
defaults, keyword-only parameters); a kernel loaded from disk is the bare, positional tvm-ffi
function. The convention is read from the compiled kernel (:func:`calling_convention`), stored
beside the artifact as side data, and put back around the loaded one (:class:`Convention`),
inside an object of the compile's own class (:mod:`.as_compiled`). :func:`side_data` is what a
miss stores, :func:`side_data_ok` what a hit accepts, :func:`as_compiled_hit` what it hands back.
A caller that compiled with ``KeepPTX`` reads the kernel's PTX (flashinfer's GDN checks it):
kept compressed beside the artifact (:func:`packed_ptx`) and answered on a hit (:func:`with_ptx`).
Nothing here knows flashinfer.
"""

from __future__ import annotations

import logging
import os
import zlib
from pathlib import Path
from typing import Any

from . import as_compiled

log = logging.getLogger("cute_diskcache")

#: Compressed PTX above this is not stored (the manifest holds it); such an entry is never served.
_MAX_PTX_BYTES = 768 << 10

_PLAIN_DEFAULT = (type(None), bool, int, float, str)


def calling_convention(kernel: Any) -> dict[str, Any] | None:
    """How a freshly compiled tvm-ffi kernel takes its arguments, as side data (or None).

    ``cute.compile`` wraps a tvm-ffi kernel in the DSL's keyword wrapper: parameter names,
    trailing defaults (the b12x GEMM's three optional SVDQuant tensors default to ``None``, and
    flashinfer omits them), keyword-only parameters. A kernel loaded from disk is the bare,
    positional tvm-ffi function, so a caller that relies on a default would fail on a hit. The
    wrapper's own signature is the DSL's spec; None when there is no wrapper or it does more
    than names and defaults (dataclass unpacking, pointer conversion): such an entry is then
    never handed out (:func:`convention_ok`). A default that is not a plain value (SGLang's FA4
    forward defaults ``aux_data`` to an ``AuxData`` tuple and a flag to ``Int32(0)``) cannot be
    stored: that parameter, and every positional one before it, is required on a hit, so a call
    that leaned on the default fails there with the binding's TypeError, never with a wrong
    value (SGLang passes every argument).
    """
    import inspect

    wrapper = getattr(kernel, "_kwargs_wrapper", None)
    if wrapper is None or "__i_unpack" in getattr(wrapper, "__globals__", {}):
        return None
    if getattr(getattr(kernel, "execution_args", None), "has_pointer_address_arg_specs", False):
        return None
    names, defaults, kwonly, kwdefaults = [], [], [], {}
    for p in inspect.signature(wrapper).parameters.values():
        has_default = p.default is not inspect.Parameter.empty
        plain = has_default and isinstance(p.default, _PLAIN_DEFAULT)
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            kwonly.append(p.name)
            if plain:
                kwdefaults[p.name] = p.default
        elif p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            names.append(p.name)
            if plain:
                defaults.append(p.default)
            elif has_default:  # required from here on: only trailing defaults are kept
                defaults.clear()
        else:
            return None
    return {"arg_names": names, "arg_defaults": defaults, "kwonly_names": kwonly, "kwonly_defaults": kwdefaults}


def convention_ok(conv: Any) -> bool:
    """Side data from disk has the shape :func:`calling_convention` writes."""
    return (isinstance(conv, dict) and isinstance(conv.get("arg_names"), list) and isinstance(conv.get("arg_defaults"), list)
            and isinstance(conv.get("kwonly_names"), list) and isinstance(conv.get("kwonly_defaults"), dict)
            and all(isinstance(n, str) for n in conv["arg_names"] + conv["kwonly_names"])
            and len(conv["arg_defaults"]) <= len(conv["arg_names"]))


def side_data(kernel: Any) -> dict[str, Any]:
    """What a miss stores beside the artifact so a hit can hand back what the compile did: how it
    takes its arguments, and the compile's class and plain state (:func:`.as_compiled.describe`)."""
    return {"calling_convention": calling_convention(kernel),
            "kwargs_wrapper": getattr(kernel, "_kwargs_wrapper", None) is not None,
            "result": as_compiled.describe(kernel)}


def side_data_ok(extra: dict[str, Any]) -> bool:
    """Side data from disk has the shape :func:`side_data` writes (else the entry is a miss: one
    written before the compile's class was kept would hand back a bare function)."""
    wrapped, result = extra.get("kwargs_wrapper"), extra.get("result", False)
    if not isinstance(wrapped, bool) or not (result is None or as_compiled.valid(result)):
        return False
    return convention_ok(extra.get("calling_convention")) if wrapped else extra.get("calling_convention") is None


def as_compiled_hit(loaded: Any, extra: dict[str, Any], payloads: as_compiled.Payloads) -> Any:
    """A hit's loaded kernel as the compile handed it (:func:`.as_compiled.rebuild`); as loaded,
    with its calling convention, where the compile's result was not the DSL's compiled function."""
    conv = extra.get("calling_convention")
    wrapper = Convention(loaded, conv) if extra.get("kwargs_wrapper") and convention_ok(conv) else None
    result = extra.get("result")
    if result is None:
        return wrapper if wrapper is not None else loaded
    return as_compiled.rebuild(loaded, result, wrapper, payloads)


class Convention:
    """The compiled kernel's calling convention around a loaded, positional-only tvm-ffi kernel.

    tvm-ffi's ``make_kwargs_wrapper`` generates code and executes it for each kernel, which cost
    more than the rest of a hit; this one is built from the stored convention in microseconds.
    A call that passes every positional argument, or leaves out trailing defaults (the b12x
    GEMM's optional tensors), goes straight through; any other is bound to the compiled one's
    signature, whose errors it raises.
    """

    __slots__ = ("_kernel", "_conv", "_n", "_first_default", "_defaults", "_kwonly", "_signature")

    def __init__(self, kernel: Any, conv: dict[str, Any]) -> None:
        self._kernel, self._conv = kernel, conv
        defaults = tuple(conv["arg_defaults"])
        self._n, self._defaults = len(conv["arg_names"]), defaults
        self._first_default = self._n - len(defaults)
        self._kwonly = tuple(conv["kwonly_names"])
        self._signature: Any = None  # built on the first call that needs binding

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        import inspect

        if self._signature is None:
            P, first = inspect.Parameter, self._first_default
            params = [P(n, P.POSITIONAL_OR_KEYWORD, default=self._defaults[i - first] if i >= first else P.empty)
                      for i, n in enumerate(self._conv["arg_names"])]
            params += [P(n, P.KEYWORD_ONLY, default=self._conv["kwonly_defaults"].get(n, P.empty)) for n in self._kwonly]
            self._signature = inspect.Signature(params)
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:  # said as the DSL's keyword wrapper (tvm-ffi's generated ``wrapper``) says it
            raise TypeError(f"wrapper() {exc}") from None
        bound.apply_defaults()
        return tuple(bound.arguments[p] for p in self._signature.parameters)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and not self._kwonly:
            n = len(args)
            if n == self._n:
                return self._kernel(*args)
            if self._first_default <= n < self._n:
                return self._kernel(*args, *self._defaults[n - self._first_default:])
        return self._kernel(*self._bind(args, kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)


def packed_ptx(kernel: Any) -> bytes | None:
    """The compiled kernel's PTX, zlib-compressed (None: none, or too large to keep)."""
    try:
        ptx = kernel.__ptx__
        if isinstance(ptx, str) and os.path.isfile(ptx):
            ptx = Path(ptx).read_text()
    except Exception:  # noqa: BLE001 - no PTX after all: the entry is never served to a caller asking for it
        return None
    if not isinstance(ptx, str):
        return None
    packed = zlib.compress(ptx.encode(), 6)
    if len(packed) > _MAX_PTX_BYTES:
        log.warning("cute-diskcache: PTX of %d bytes not kept; this kernel compiles in every process", len(ptx))
        return None
    return packed


class WithPtx:
    """A loaded kernel that also answers ``__ptx__`` (the compiled one's), for callers that read it."""

    def __init__(self, kernel: Any, ptx: str) -> None:
        self._kernel = kernel
        self.__ptx__ = ptx

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._kernel(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)


def with_ptx(kernel: Any, packed: Any, site: str) -> Any:
    """A loaded kernel that answers ``__ptx__`` like the compiled one (a compiled one already does)."""
    if as_compiled.loaded(kernel):
        have = None  # its artifacts name the compile's PTX file, long gone
    else:
        try:
            have = kernel.__ptx__
        except Exception:  # noqa: BLE001 - a kernel that cannot say its PTX is one without it
            have = None
    if have:
        return kernel  # compiled in this process
    if not isinstance(packed, bytes):  # not reached: the key says "keep-ptx" and such entries hold it
        log.error("cute-diskcache: %s entry holds no PTX for a caller that reads it", site)
        return kernel
    text = zlib.decompress(packed).decode()
    if as_compiled.loaded(kernel) and as_compiled.set_ptx(kernel, text):
        return kernel
    return WithPtx(kernel, text)
