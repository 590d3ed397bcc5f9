"""Turning verified bytes into a callable kernel, and building the fast form at a miss.

Two forms of one kernel:

* the DSL's exported **object** (``.o``), loaded with ``cutlass.cute.runtime.load_module``:
  works for every kernel, costs 3.7-4.8 ms a load here (tvm-ffi's runtime-library scan on every
  call, then a JITLink of the object);
* a **shared object** linked from it at the miss with the DSL's documented recipe
  (``cutlass/cute/export/aot_config.py``: ``cc -shared k.o -lcute_dsl_runtime -ltvm_ffi``),
  loaded with ``dlopen`` and wrapped by tvm-ffi's ``Function.__from_extern_c__`` (what the DSL's
  own loader does with its JIT's pointer): 0.3-0.7 ms. tvm-ffi kernels only.

Conditions for the shared object, each checked, each falling back to the object when unmet:

* ``libcute_dsl_runtime.so`` and ``libtvm_ffi.so`` are loaded first (:func:`preload`, at attach):
  the linked object names them without an rpath, and ``dlopen`` binds them to the copies
  already mapped (one of each);
* every symbol is bound at load (``ctypes`` passes ``RTLD_NOW``): a missing one fails the load
  here, never the first call; the link itself used ``-z defs``;
* only ``__tvm_ffi_*`` is exported (a version script), so kernels never bind to each other;
* the bytes loaded are the bytes verified: they go through a ``memfd`` that stays open for the
  library's life (glibc reuses a loaded library by path, so a closed and reused
  ``/proc/self/fd/N`` would hand back the previous kernel);
* a miss needs a C toolchain (``cc``, or ``$CC``); without one (slim serving images) the entry
  holds the object alone and hits load it as before.

Whatever the form, nothing is mapped whose ELF header names another machine or class than this
process's own (:func:`refuse_foreign`, the first step of :func:`load_shared` and
:func:`object_module`, which every load goes through): a key's namespace names the machine its
host code is for, but a cross-building process keys another machine's namespace, and a planted
or mislabelled object must be a refusal, never a SIGILL in the engine.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from . import elf

log = logging.getLogger("cute_diskcache")


class ForeignObject(RuntimeError):
    """Verified bytes whose host code is not for this process's machine: never mapped."""


def refuse_foreign(data: bytes, machine: str | None = None) -> None:
    """Raise :class:`ForeignObject` unless ``data`` is an ELF image of ``machine``'s host code
    (default: this machine's, the only code this process may run)."""
    from ..keys import hostmachine

    want = machine or hostmachine.here()
    holds = elf.host_machine(data)
    if holds != want:
        raise ForeignObject(f"the object holds {holds or 'no known host'} code, not {want}'s: not loaded")

#: memfds holding loaded shared objects: never closed while the process lives (see module doc).
_FDS: list[int] = []
_RUNTIME: list[ctypes.CDLL] = []
_lock = threading.Lock()
_preloaded: bool | None = None
#: What a link may take before it is abandoned (a miss then stores the object alone).
LINK_TIMEOUT_S = 60.0
_VERSION_SCRIPT = "{ global: __tvm_ffi_*; local: *; };\n"


@functools.lru_cache(maxsize=1)
def runtime_libraries() -> tuple[str, ...]:
    """The DSL's runtime and tvm-ffi's library, as the DSL finds them (asked once per process)."""
    try:
        from cutlass.cute.runtime import find_runtime_libraries

        return tuple(p for p in find_runtime_libraries(enable_tvm_ffi=True) if os.path.exists(p))
    except Exception as exc:  # noqa: BLE001 - no DSL, or one laid out differently: the object path only
        log.debug("runtime libraries unknown: %s", exc)
        return ()


def preload() -> float:
    """``dlopen`` the runtime libraries once per process (at attach, off the first request).

    Returns the seconds it took. Whether the shared-object path is usable afterwards is
    :func:`shared_supported`.
    """
    global _preloaded
    t0 = time.perf_counter()
    with _lock:
        if _preloaded is None:
            libs = runtime_libraries()
            try:
                _RUNTIME.extend(ctypes.CDLL(p) for p in libs)
                import tvm_ffi  # noqa: F401  (wraps the function pointer)

                _preloaded = len(libs) == 2
            except Exception as exc:  # noqa: BLE001 - only a preload: the first load does it again and reports its own failure
                log.debug("runtime preload failed: %s", exc)
                _preloaded = False
    return time.perf_counter() - t0


def enabled() -> bool:
    """``CUTE_DISKCACHE_SHARED_OBJECTS`` (default on): link at a miss, load the shared object on a hit."""
    from .. import config

    return config.flag("shared_objects")


def shared_supported() -> bool:
    """Whether this process loads the shared-object form (enabled; Linux, memfd, runtime loaded)."""
    if _preloaded is None:
        preload()
    return bool(_preloaded) and sys.platform.startswith("linux") and hasattr(os, "memfd_create") and enabled()


def _memfd(data: bytes, name: str) -> int:
    fd = os.memfd_create(name, getattr(os, "MFD_CLOEXEC", 0))
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    return fd


def load_shared(data: bytes, symbol: str) -> Any:
    """A tvm-ffi kernel from verified shared-object bytes; raises if this process cannot load it."""
    import tvm_ffi

    refuse_foreign(data)
    fd = _memfd(data, "cute_diskcache_so")
    try:
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")  # RTLD_NOW: every symbol bound here or an error now
        ptr = ctypes.cast(getattr(lib, "__tvm_ffi_" + symbol), ctypes.c_void_p).value
        if not ptr:
            raise RuntimeError(f"__tvm_ffi_{symbol} not found in the shared object")
        function = tvm_ffi.Function.__from_extern_c__(ptr, keep_alive_object=lib)
    except BaseException:
        os.close(fd)  # never loaded (or not kept): its path may be reused safely
        raise
    with _lock:
        _FDS.append(fd)  # the library lives as long as the process: so does its fd
    return function


def load_object(data: bytes, symbol: str, tvm_ffi: bool) -> Any:
    """A kernel from verified object bytes, through the DSL's loader (every kind of kernel)."""
    return getattr(object_module(data, tvm_ffi), symbol)


def object_module(data: bytes, tvm_ffi: bool) -> Any:
    """Verified object bytes loaded as the DSL loads an exported object (its ``ExternalBinaryModule``).

    The bytes go through an anonymous in-memory file where the OS has one, so the code that
    runs is the code whose checksum was verified, not whatever a path holds a moment later.
    """
    from cutlass.cute.runtime import load_module

    refuse_foreign(data)
    if hasattr(os, "memfd_create"):
        fd = _memfd(data, "cute_diskcache_obj")
        try:
            return load_module(f"/proc/self/fd/{fd}", enable_tvm_ffi=tvm_ffi)
        finally:
            os.close(fd)  # load_module read the bytes; nothing maps this path
    with tempfile.NamedTemporaryFile(suffix=".o", delete=False) as tmp:  # pragma: no cover - non-Linux
        tmp.write(data)
    try:
        return load_module(tmp.name, enable_tvm_ffi=tvm_ffi)
    finally:
        os.unlink(tmp.name)


# --------------------------------------------------------------------------------------------
# At a miss: link the object into a shared object
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def toolchain() -> str | None:
    """The C compiler driver that links (``$CC``, else ``cc``), or None."""
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc.split()[0]) if cc else None


def link(object_bytes: bytes, symbol: str, workdir: Path | None) -> bytes | None:
    """The object linked into a shared object exporting only ``__tvm_ffi_<symbol>``; None if it cannot be.

    ``-z defs``: every symbol must resolve against the DSL runtime and tvm-ffi at link time, so
    a library that links also loads. Deterministic: the same object gives the same bytes (the
    build id is a hash of the content).
    """
    cc = toolchain()
    libs = runtime_libraries()
    if cc is None or len(libs) != 2 or not enabled():
        return None
    with tempfile.TemporaryDirectory(prefix="link-", dir=workdir) as tmp:
        obj, out, script = Path(tmp) / "k.o", Path(tmp) / "k.so", Path(tmp) / "exports.map"
        obj.write_bytes(object_bytes)
        script.write_text(_VERSION_SCRIPT)
        cmd = [cc, "-shared", "-o", str(out), str(obj)]
        for lib in libs:
            name = Path(lib).name
            cmd += [f"-L{Path(lib).parent}", f"-l{name[3:-3] if name.startswith('lib') and name.endswith('.so') else name}"]
        cmd += ["-Wl,-z,defs", f"-Wl,--version-script={script}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LINK_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.debug("linking %s failed: %s", symbol, exc)
            return None
        if proc.returncode != 0 or not out.is_file():
            log.debug("linking %s failed (%s): %s", symbol, proc.returncode, proc.stderr[-2000:])
            return None
        data = out.read_bytes()
    if b"__tvm_ffi_" + symbol.encode() not in data:
        return None
    return data
