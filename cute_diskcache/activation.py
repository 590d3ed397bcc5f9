"""Activation: put the cache under every CuTe-DSL compile of the libraries we know (flashinfer,
b12x, SGLang, vLLM's own) with no change to the serving engine. vLLM's own sites need no import
hook of their own: the one on ``cutlass.cute.compile`` serves them by their rows.

Three doors lead here, all idempotent: the ``.pth`` bootstrap (``FLASHINFER_B12X_DISK_CACHE=1``),
vLLM's ``vllm.general_plugins`` entry point, and ``cute_diskcache.install()``. A library may
already be imported, or be imported later (often much later, inside an engine's worker), so we
attach to what is loaded now and put an import hook in place for what is not.
"""

from __future__ import annotations

# Imported at interpreter start when the switch is on: stdlib only, and only what is already
# loaded at start-up (no importlib.abc, logging or typing at run time), so every Python process
# of an engine pays next to nothing for the hook.
import sys
from _thread import RLock

# The adapters' names modules import nothing: naming a library loads none of it.
from .b12x_sites.names import B12X
from .b12x_sites.names import SITE_PACKAGES as B12X_SITE_PACKAGES
from .flashinfer_sites.names import DSL_CUTE, FLASHINFER, MOE_DISPATCH
from .flashinfer_sites.names import SITE_PACKAGES as FLASHINFER_SITE_PACKAGES
from .sglang_sites.names import SGLANG
from .sglang_sites.names import SITE_PACKAGES as SGLANG_SITE_PACKAGES

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at start-up

if TYPE_CHECKING:
    import importlib.machinery
    from collections.abc import Sequence
    from types import ModuleType
    from typing import Any

#: Each adapter package (under ``cute_diskcache.``) and the modules it is handed as they are imported.
_ADAPTERS = (("flashinfer_sites", FLASHINFER_SITE_PACKAGES), ("b12x_sites", B12X_SITE_PACKAGES),
             ("sglang_sites", SGLANG_SITE_PACKAGES))
SITE_PACKAGES = FLASHINFER_SITE_PACKAGES + B12X_SITE_PACKAGES + SGLANG_SITE_PACKAGES

#: flashinfer's, b12x's and SGLang's own imports (a profile must be in place before they query the device), the DSL's
#: ``cutlass.cute`` (the inline sites' one hook goes on its ``compile``, whatever imports it
#: first), and every module of the adapters' site packages as it is imported (each adapter
#: decides which hold sites).
_WATCHED = (FLASHINFER, B12X, SGLANG, MOE_DISPATCH, DSL_CUTE)
_QUERY_ON_IMPORT = (FLASHINFER, B12X, SGLANG)


def _watched(fullname: str) -> bool:
    return fullname in _WATCHED or fullname.startswith(SITE_PACKAGES)


def _site_modules() -> list[ModuleType]:
    """The adapters' candidate modules already imported, in import order."""
    return [m for name, m in list(sys.modules.items()) if name.startswith(SITE_PACKAGES) and m is not None]


def _adapter_of(module_name: str) -> Any:
    """The adapter package handed ``module_name`` (imported on first use)."""
    import importlib

    package = next(pkg for pkg, prefixes in _ADAPTERS if module_name.startswith(prefixes))
    return importlib.import_module(f"{__package__}.{package}")


_lock = RLock()
_finder: _Finder | None = None
_profile_name: str | None = None
_cache_on = False
_attach_failure_said = False  # the attach failure is a WARNING once per process


def _log() -> Any:
    import logging

    return logging.getLogger("cute_diskcache")


class _Loader:
    """Wraps the real loader of a watched module to run our hook around its execution.

    Duck-typed (create_module / exec_module) rather than an importlib.abc subclass: importing
    importlib.abc at start-up would cost every interpreter several milliseconds.
    """

    def __init__(self, real: Any, fullname: str) -> None:
        self._real = real
        self._fullname = fullname

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if self._fullname in _QUERY_ON_IMPORT:
            _apply_profile()  # flashinfer queries the device while it imports; b12x's code as it runs
        self._real.exec_module(module)
        if self._fullname == DSL_CUTE:
            _attach_dsl()
        elif self._fullname.startswith(SITE_PACKAGES):
            _attach(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, resource readers...
        return getattr(self._real, name)


class _Finder:
    """Finds watched modules through the other finders and wraps their loaders."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not _watched(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _Loader):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


def _apply_profile() -> None:
    """Apply the chosen profile; refused (a real GPU is visible) means: one warning, the real device."""
    global _profile_name
    if _profile_name is None:
        return
    from .keys import targets

    try:
        targets.apply(_profile_name)
    except targets.ProfileRefused as exc:
        _profile_name = None
        _log().warning("cute-diskcache: %s", exc)


def _attach(module: ModuleType) -> None:
    try:
        adapter = _adapter_of(module.__name__)
        adapter.apply_profile(module)
        if _cache_on:
            adapter.patch(module)
    except Exception as exc:  # noqa: BLE001 - never break flashinfer's import because of the cache
        # Attaching runs once per flashinfer module imported: a broken install would say it dozens of times.
        global _attach_failure_said
        level = 10 if _attach_failure_said else 30  # DEBUG, WARNING (logging is not imported at start-up)
        _attach_failure_said = True
        _log().log(level, "cute-diskcache could not attach to %s (%s); running uncached", module.__name__.partition(".")[0], exc)


def _attach_dsl() -> None:
    """The one hook on ``cutlass.cute.compile`` (when the cache is on). It knows no library, so it is
    put there here; an adapter may withhold it for its own library (``admits_dsl``: flashinfer's
    refused combinations), and serves its sites through it by the rows it registers (:mod:`.core.adapter`)."""
    if not _cache_on:
        return
    try:
        import importlib

        from .core import hook

        packages = [importlib.import_module(f"{__package__}.{package}") for package, *_prefixes in _ADAPTERS]
        if all(getattr(package, "admits_dsl", lambda: True)() for package in packages):
            hook.patch()
    except Exception as exc:  # noqa: BLE001 - never break the DSL's import because of the cache
        _log().warning("cute-diskcache could not attach to the DSL (%s); inline sites run uncached", exc)


def _ensure_finder() -> None:
    global _finder
    if _finder is None:
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)


def set_target(name: str | None) -> None:
    """Compile for the device profile ``name`` (no cache implied); must precede flashinfer's import."""
    global _profile_name
    if name is None:
        return
    from .keys import targets

    with _lock:
        targets.get(name)  # unknown names fail here, loudly
        _profile_name = name
        # A library already imported gets the profile now: flashinfer's import-time queries are
        # past (one warning); b12x queries as its code runs, so for it nothing was missed (prewarm
        # and check import b12x to plan before they install).
        if any(m in sys.modules for m in _QUERY_ON_IMPORT):
            if FLASHINFER in sys.modules and targets.active() is None:
                _log().warning("target profile %s applied after flashinfer was imported; import-time queries saw the real device", name)
            _apply_profile()
        _ensure_finder()
        for module in _site_modules():
            _attach(module)


def install(target: str | None = None) -> None:
    """Attach the disk cache to flashinfer's and b12x's CuTe-DSL compiles, now and on later import.

    ``target`` (or ``CUTE_DISKCACHE_TARGET``) names a device profile to compile for when the
    card is not present; it must be chosen before flashinfer or b12x is imported.
    """
    import os  # not config: this runs at interpreter start, where its imports (dataclasses...) would cost every process

    global _cache_on
    with _lock:
        _cache_on = True
        try:
            set_target(target or os.environ.get("CUTE_DISKCACHE_TARGET", "").strip() or None)
        except ValueError as exc:  # targets.UnknownProfileError
            if target is not None:
                raise
            # A typo in the serving environment must not turn the cache off (the .pth door
            # would swallow the error): the real device is used, with one warning.
            _log().warning("cute-diskcache: ignoring CUTE_DISKCACHE_TARGET: %s", exc)
        _ensure_finder()
        for module in _site_modules():
            _attach(module)
        if DSL_CUTE in sys.modules:
            _attach_dsl()


def uninstall() -> None:
    """Detach: remove the import hook, put back what each adapter replaced, and take the hook off ``cute.compile``."""
    global _finder, _cache_on
    with _lock:
        _cache_on = False
        if _finder is not None and _profile_name is None:
            try:
                sys.meta_path.remove(_finder)
            except ValueError:
                pass
            _finder = None
        for module in _site_modules():
            _adapter_of(module.__name__).unpatch(module)
        if DSL_CUTE in sys.modules:
            from .core import hook

            hook.unpatch()


def installed() -> bool:
    return _cache_on
