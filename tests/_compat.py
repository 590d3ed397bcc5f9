"""What the compatibility tests share: the matrix script (and the other scripts) as modules, and where its venvs live.

``scripts/compat_matrix.py`` builds the venvs (one per flashinfer x DSL cell, plus vLLM's) and
proves cells; the tests call it rather than keeping a second copy of that logic. The venvs go
under ``$CUTE_DISKCACHE_COMPAT_SCRATCH`` (default ``~/.cache/cute-diskcache/compat``): outside
the checkout, built once and reused by later runs (pip's cache makes a rebuild cheap too).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported once as a module (scripts are not part of the package)."""
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return module


def matrix() -> ModuleType:
    """scripts/compat_matrix.py."""
    return script("compat_matrix")


SCRATCH: Path = matrix().DEFAULT_SCRATCH
