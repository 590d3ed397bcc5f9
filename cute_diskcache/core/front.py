"""Owns keeping the cache in front of whatever wraps ``cutlass.cute.compile`` after it attached.

Engines wrap ``cutlass.cute.compile`` to watch for compiles while serving: vLLM 0.34's JIT
monitor does ``cute.compile = _MonitoredCuteCompile(cute.compile)`` at the end of every worker's
warm-up, and reports each call before passing it on. Put on top of our dispatcher, such a wrapper
saw every request, hits included: in ``warn`` mode a disk hit was reported as a latency spike, and
its frame, standing between the site and us, changed the key, so the prewarmed entry missed and
compiled again; in ``error`` mode (the mode of exactly the users who prewarm) a hit raised.

So the name stays ours. The module's class becomes a subclass of its own class with ``compile``
as a property (assigning ``__class__`` is how Python gives a module a descriptor): reading
``cute.compile`` always gives our dispatcher, and assigning to it records the new value as the
wrapper. The dispatcher serves what it can; a compile it cannot serve (a miss, or a compile that
is no site of ours) goes to the wrapper, which sees a real compile, reports it as it always
would, and calls what it wrapped: us, once more. That re-entry is marked (:func:`through_wrappers`)
and goes straight to the real compile. A wrapper that never calls what it wrapped is simply the
compile for misses. Nothing here knows a library: only the DSL's module.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any
from collections.abc import Callable

#: What was assigned to ``cutlass.cute.compile`` after us (vLLM's monitor), or None.
_wrapper: Any = None
#: Per thread: ``passing`` is set while a wrapper we called is on its way back to us; ``inside``
#: while any such call runs (a wrapper that compiles something else first must not loop).
_state = threading.local()
_NAME = "compile"
_FLAG = "_cdc_front"
_DISPATCHER = "_cdc_front_dispatcher"


def _get(module: ModuleType) -> Any:
    return module.__dict__[_DISPATCHER]


def _set(module: ModuleType, value: Any) -> None:
    global _wrapper
    _wrapper = None if value is module.__dict__[_DISPATCHER] else value


def install(module: ModuleType, dispatcher: Any) -> None:
    """Make ``module.compile`` read as ``dispatcher`` from now on, whatever is assigned later."""
    cls = type(module)
    if not getattr(cls, _FLAG, False):
        front = type(cls.__name__, (cls,), {_NAME: property(_get, _set), _FLAG: True, "__module__": __name__,
                                            "__doc__": cls.__doc__})
        module.__dict__[_DISPATCHER] = dispatcher
        module.__class__ = front
    module.__dict__[_DISPATCHER] = dispatcher


def uninstall(module: ModuleType) -> Any:
    """Give the module its own class back; returns what ``compile`` should hold afterwards: the
    wrapper assigned after us if any (vLLM's monitor keeps watching), else None."""
    global _wrapper
    cls = type(module)
    if getattr(cls, _FLAG, False):
        module.__class__ = cls.__bases__[0]
    module.__dict__.pop(_DISPATCHER, None)
    kept, _wrapper = _wrapper, None
    return kept


def wrapped() -> bool:
    """Whether something wrapped ``cutlass.cute.compile`` after us."""
    return _wrapper is not None


def returning() -> bool:
    """Whether this call is a wrapper handing a compile back to us: it goes to the real compile.

    Consumes the mark, so the wrapper's one call is the only one that bypasses the cache.
    """
    if getattr(_state, "passing", False):
        _state.passing = False
        return True
    return False


def through_wrappers(real: Callable[..., Any], options: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A compile we do not serve: through the wrapper assigned after us (so it sees a real
    compile), which hands it back to us and so to ``real``; straight to ``real`` when there is none."""
    wrapper = _wrapper
    if wrapper is None or getattr(_state, "inside", False):
        return real(*args, **kwargs)
    target = wrapper if options is None else wrapper[options]
    _state.inside = _state.passing = True
    try:
        return target(*args, **kwargs)
    finally:
        _state.inside = _state.passing = False


__all__ = ["install", "returning", "through_wrappers", "uninstall", "wrapped"]
