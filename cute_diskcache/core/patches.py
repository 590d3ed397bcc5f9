"""Owns undoable replacement of module attributes: what we change in flashinfer or the DSL, and what was there.

The cache never edits flashinfer's code; it replaces a few names (the DSL's ``compile``,
flashinfer's native builder where its sm12x callers find it, device queries under a target
profile). Each replacement is recorded per module, so uninstalling puts back exactly what was
there, and a second activation does not wrap our own replacement again.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any
from collections.abc import Callable

class Patches:
    """Per flashinfer module: every global we replaced and what it held before."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._saved: dict[str, dict[str, Any]] = {}

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def set(self, module: ModuleType, name: str, value: Any, *, original: Any = None) -> None:
        """``module.name = value``, remembering the first original.

        ``original`` names what to restore when the module already holds something of ours
        (a module that imported our replacement from another one by name).
        """
        with self._lock:
            saved = self._saved.setdefault(module.__name__, {})
            if name not in saved:
                saved[name] = module.__dict__.get(name, _ABSENT) if original is None else original
            setattr(module, name, value)

    def original(self, module: ModuleType, name: str) -> Any:
        """What ``module.name`` held before we changed it (its current value if untouched)."""
        with self._lock:
            value = self._saved.get(module.__name__, {}).get(name, _ABSENT)
        return module.__dict__.get(name) if value is _ABSENT else value

    def replace(self, module: ModuleType, name: str, marker: str, make: Callable[[Any], Any]) -> bool:
        """``module.name = make(original)`` unless our replacement (it carries ``marker``) is there.

        Idempotent, for the import hook calls ``patch`` once per import of a module and again
        on re-activation. ``make`` returns None to decline (what it would wrap is not what we
        know); True when ours is in place afterwards.
        """
        with self._lock:
            if getattr(module.__dict__.get(name), marker, False):
                return True
            real = self.original(module, name)
            value = None if real is None else make(real)
            if value is None:
                return False
            self.set(module, name, value)
            return True

    def touched(self, module: ModuleType, name: str) -> bool:
        with self._lock:
            return name in self._saved.get(module.__name__, {})

    def restore(self, module: ModuleType, names: tuple[str, ...] | None = None) -> None:
        with self._lock:
            saved = self._saved.get(module.__name__, {})
            for name in list(saved if names is None else names):
                if name not in saved:
                    continue
                value = saved.pop(name)
                if value is _ABSENT:
                    module.__dict__.pop(name, None)
                else:
                    setattr(module, name, value)


_ABSENT = object()
PATCHES = Patches()
