"""Turning a compile's result into an :class:`~..storage.entry.Artifact`: the bytes an entry will hold.

What the DSL gives us, and the cheapest way to get it: the object a tvm-ffi compile emitted
anyway (kept by :func:`capturing`), else the DSL's own exporters; the shared object linked from
it (:func:`..storage.loader.link`); the cubins cut out of it (:mod:`..storage.elf`); the MLIR as bytecode. The
artifact's format on disk is :mod:`..storage.entry`'s business, loading it :mod:`..storage.loader`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import types
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

from ..keys import hostcpu
from ..storage.elf import cubins_in
from ..storage.entry import Artifact

log = logging.getLogger("cute_diskcache")


def symbol_for(digest: str) -> str:
    """A C identifier unique to the entry, so many objects can live in one process."""
    return f"cdc_{digest[:24]}"


def export(
    compiled: Any,
    digest: str,
    compile_seconds: float,
    extra: dict[str, Any] | None = None,
    device: dict[str, Any] | None = None,
    *,
    workdir: Path | None = None,
    captured: list[bytes] | None = None,
    link: bool = True,
) -> Artifact:
    """Turn a ``cute.compile`` result into bytes, and link the fast form when it can.

    A ``--enable-tvm-ffi`` compile already emitted an object for its own JIT load
    (:func:`capturing` kept it): the same code, data and relocations ``export_to_c`` would
    produce again by re-running LLVM (measured: persistence then costs 2% of a compile, not 11%).
    It is used when it is there and exports ``__tvm_ffi_<function name>``; otherwise
    ``export_to_c`` writes one, into ``workdir`` (the store's scratch space inside the cache root,
    so a read-only or full ``/tmp`` does not turn persistence off). Other compiles go through
    ``dump_to_object``. A tvm-ffi object is then linked into a shared object where a toolchain
    exists (:func:`..storage.loader.link`); a link that fails only leaves the entry without one.

    In a process that writes another machine's host code (:mod:`..keys.hostmachine`: a prewarm on
    x86 for a DGX Spark) the object is written for that machine (:mod:`.crossbuild`) and never
    linked here; a DSL that cannot write it raises, and nothing is persisted.
    """
    import tempfile

    from ..keys import hostmachine
    from ..storage import loader

    t0 = time.perf_counter()
    symbol = symbol_for(digest)
    tvm_ffi = hasattr(compiled, "__tvm_ffi_object__") or "TVMFFI" in type(compiled).__name__
    host = hostcpu.native()  # what the DSL's own exporters write
    code = hostcpu.host_code()
    in_process = True
    if hostmachine.cross():
        from . import crossbuild

        obj = crossbuild.host_object(compiled, hostmachine.current(), symbol)
        host = code  # the other machine's baseline: hostcpu.host_code() knows whose code this process writes
        if tvm_ffi:
            symbol = str(compiled.function_name)  # it exports __tvm_ffi_<function name>, as a captured object does
        link = False  # another machine's object: its toolchain, not ours
    elif (obj := _compile_time_object(compiled, captured) if tvm_ffi else None) is not None:
        symbol = str(compiled.function_name)
        host = getattr(obj, "host", host)
        obj = bytes(obj)
    elif code.portable and _writes_baseline(code):
        # The DSL's own ABI (b12x's kernels), or a tvm-ffi compile whose object was not captured:
        # the process runs the DSL's natively tuned code, so the entry gets the baseline's and the
        # cache hands the caller the entry as a hit loads it (Artifact.in_process False).
        from . import crossbuild

        obj = _with_usable_temp(lambda: crossbuild.host_object(compiled, code.machine, symbol), workdir)
        host, in_process = code, False
        if tvm_ffi:
            symbol = str(compiled.function_name)
    else:
        def run() -> bytes:
            if not tvm_ffi:
                return bytes(compiled.dump_to_object(symbol))
            with tempfile.TemporaryDirectory(prefix="export-", dir=workdir) as tmp:
                path = os.path.join(tmp, "kernel.o")
                compiled.export_to_c(path, function_name=symbol)
                with open(path, "rb") as fh:
                    return fh.read()

        obj = _with_usable_temp(run, workdir)
    shared = loader.link(obj, symbol, workdir) if tvm_ffi and link else None
    ir_module = getattr(compiled, "ir_module", None)
    cubins = cubins_in(obj)
    mlir_bytecode = _bytecode(ir_module) if ir_module is not None else None
    mlir_text = str(ir_module) if ir_module is not None and mlir_bytecode is None else None
    return Artifact(
        object_bytes=obj, symbol=symbol, tvm_ffi=tvm_ffi, cubins=cubins, shared_bytes=shared,
        mlir_text=mlir_text, mlir_bytecode=mlir_bytecode,
        compile_seconds=compile_seconds, export_seconds=time.perf_counter() - t0,
        extra=dict(extra or {}), **({"device": dict(device)} if device else {}),
        host_cpu=host.name, host_isa=host.extensions, in_process=in_process,
    )


def _writes_baseline(code: hostcpu.HostCode) -> bool:
    """Whether this DSL writes host objects for a named CPU (feature-tested once per process)."""
    from . import crossbuild

    return crossbuild.refusal(code.machine) is None


def _bytecode(ir_module: Any) -> bytes | None:
    """The module as MLIR bytecode, or None where the bindings cannot write it."""
    import io

    try:
        buf = io.BytesIO()
        ir_module.operation.write_bytecode(buf)
        return buf.getvalue()
    except Exception as exc:  # noqa: BLE001 - private MLIR binding: without bytecode the text is kept
        log.debug("no MLIR bytecode (%s); keeping the text", exc)
        return None


# --------------------------------------------------------------------------------------------
# The object the compile emitted anyway
# --------------------------------------------------------------------------------------------

_tap = threading.local()
_tap_lock = threading.Lock()


class _AotTap(types.ModuleType):
    """Stands in for ``_aot_support`` inside the DSL's tvm-ffi provider only: passes every call
    through, and while :func:`capturing` is active in this thread keeps what
    ``export_module_to_bytes`` returned."""

    def __init__(self, real: Any) -> None:
        super().__init__(getattr(real, "__name__", "_aot_support"))
        self.__dict__["_cdc_real"] = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_cdc_real"], name)

    def export_module_to_bytes(self, *args: Any, **kwargs: Any) -> Any:
        sink = getattr(_tap, "sink", None)
        if sink is not None and kwargs.get("format", "o") == "o":
            portable = _portable_object(*args)
            if portable is not None:  # what the DSL loads and runs is what the entry will hold
                sink.append(portable)
                return portable
        out = self.__dict__["_cdc_real"].export_module_to_bytes(*args, **kwargs)
        if sink is not None and kwargs.get("format", "o") == "o" and isinstance(out, (bytes, bytearray)):
            sink.append(HostObject(out, hostcpu.native()))
        return out


class HostObject(bytes):
    """An object the compile emitted, and the CPU its host code was written for."""

    host: hostcpu.HostCode

    def __new__(cls, data: bytes, host: hostcpu.HostCode) -> HostObject:
        obj = super().__new__(cls, data)
        obj.host = host
        return obj


def _portable_object(module: Any = None, *_rest: Any) -> HostObject | None:
    """The compile's own object written for this process's baseline (:func:`..keys.hostcpu.host_code`)
    instead of for this CPU, or None (``native``, another machine's build, or a writer that
    failed: the DSL's own object is used and recorded as native, never a wrong record)."""
    from ..keys import hostmachine
    from . import crossbuild

    code = hostcpu.host_code()
    if not code.portable or hostmachine.cross() or module is None:
        return None
    try:
        return HostObject(crossbuild.write_object(module, code.machine, code.llvm_cpu or ""), code)
    except Exception as exc:  # noqa: BLE001 - private DSL API: a DSL that lays it out otherwise keeps its own object
        log.debug("no %s host object (%s: %s); keeping the DSL's own", code.name, type(exc).__name__, exc)
        return None


def _install_tap() -> bool:
    """Put :class:`_AotTap` into the DSL's tvm-ffi provider (idempotent); False if its layout is unexpected."""
    try:
        from cutlass.cutlass_dsl import tvm_ffi_provider as provider
    except Exception:  # noqa: BLE001 - private DSL module: a DSL laid out otherwise gets no tap
        return False
    with _tap_lock:
        current = provider.__dict__.get("_aot_support")
        if isinstance(current, _AotTap):
            return True
        if current is None or not hasattr(current, "export_module_to_bytes"):
            return False
        provider._aot_support = _AotTap(current)
        return True


@contextlib.contextmanager
def capturing() -> Iterator[list[bytes]]:
    """Keep the objects the DSL emits while the body (one compile) runs in this thread.

    Private DSL API, contained: a DSL without the function (or laid out otherwise) yields an
    empty list and :func:`export` re-exports as before.
    """
    sink: list[bytes] = []
    if not _install_tap():
        yield sink
        return
    previous = getattr(_tap, "sink", None)
    _tap.sink = sink
    try:
        yield sink
    finally:
        _tap.sink = previous


def _compile_time_object(compiled: Any, captured: list[bytes] | None) -> bytes | None:
    """The captured object that holds this compile's ``__tvm_ffi_<function name>``, or None."""
    name = getattr(compiled, "function_name", None)
    if not captured or not isinstance(name, str) or not name:
        return None
    wanted = b"__tvm_ffi_" + name.encode() + b"\0"
    found = [obj for obj in captured if wanted in obj and obj.startswith(b"\x7fELF")]
    return found[-1] if found else None


_TEMP_LOCK = threading.Lock()


def _with_usable_temp(run: Callable[[], bytes], workdir: Path | None) -> bytes:
    """``run()``; if it fails, once more with the DSL's temporary files in ``workdir`` (the
    store's scratch inside the cache root).

    The DSL writes the object through ``tempfile`` itself, so a small, full or read-only
    ``/tmp`` (read-only root filesystem pods, a tiny emptyDir) made every export fail, blamed on
    the cache root. The redirect is process-wide while it lasts, so it is taken only after a
    failure (when the default was not usable for this export anyway), under a lock; an export
    that fails for another reason fails the same way again and raises.
    """
    import tempfile

    try:
        return run()
    except Exception as exc:
        if workdir is None:
            raise
        log.debug("export failed (%s: %s); again with temporary files under %s", type(exc).__name__, exc, workdir)
    with _TEMP_LOCK:
        saved = tempfile.tempdir
        tempfile.tempdir = str(workdir)
        try:
            return run()
        finally:
            tempfile.tempdir = saved
