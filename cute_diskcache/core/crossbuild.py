"""Host objects for another machine from one ``cute.compile``: the DSL knowledge of cross-building.

The GPU half of an entry (the cubins) does not depend on the build machine; the host half is
LLVM output for the build machine's triple. The DSL documents cross-compiling that host object
(CUTLASS 4.8, "Host Cross-Compilation for AArch64": ``--host-target linux-aarch64``), but only
for its own ABI: a ``--enable-tvm-ffi`` compile, which is how flashinfer compiles its sm12x
kernels, refuses it. Measured on nvidia-cutlass-dsl 4.6.3, 4.7.1, 4.8.0 and 4.8.1:

* ``TVMFFIJitCompiledFunctionBase.export_to_c`` raises ``CONFIG_INCOMPATIBLE_FLAGS`` ("TVM-FFI
  export (--enable-tvm-ffi) and host-target export (--host-target) cannot be used together")
  when the compile had ``--host-target``;
* the object a tvm-ffi compile emits for its own JIT load, and ``export_to_c`` without a host
  target, come from ``_aot_support.export_module_to_bytes``, which has no triple parameter and
  always writes the build machine's code (an ``llvm.target_triple`` attribute is ignored);
* DSL 4.5.x has no host target at all.

What the DSL's own ``dump_to_object`` uses underneath does take a triple: the execution
engine's ``dump_object_file_pic(module, path, function, opt_level, host_triple, host_cpu,
host_features)``. Fed the tvm-ffi module (``get_export_module`` keeping ``__tvm_ffi_<name>``),
it writes an aarch64 object that exports the same tvm-ffi entry point, and the same call made
on an aarch64 machine writes the same bytes. The cubins in it are the native build's, byte for
byte, and an aarch64 process loads it and runs its host code (scripts/emulated_aarch64.py
proves both under qemu). It is private API, used by the DSL's public exporter, so it is
feature-tested here (:func:`refusal`) and every object it writes is checked (:func:`host_object`):
a DSL that lays it out otherwise makes prewarm refuse before compiling, never write a wrong entry.

The aarch64 build of the DSL has no x86_64 backend (measured: "No available targets are
compatible with triple x86_64-unknown-linux-gnu"), so the other direction is refused by the
same test.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from typing import Any

from ..keys import hostcpu
from ..storage import elf

log = logging.getLogger("cute_diskcache")

#: LLVM triple of each host machine an entry can be written for.
TRIPLES = {"x86_64": "x86_64-unknown-linux-gnu", "aarch64": "aarch64-unknown-linux-gnu"}
#: The ``--host-target`` preset the DSL's own ABI (dump_to_object) takes for each machine.
_PRESETS = {"aarch64": "linux-aarch64"}
#: ELF ``e_machine`` of each.
ELF_MACHINES = {"x86_64": 62, "aarch64": 183}
#: Optimisation level of the host object: what the DSL's tvm-ffi export uses.
_OPT_LEVEL = 3


class CrossBuildError(RuntimeError):
    """The DSL did not write a host object for the machine asked for (never persisted)."""


def _engine() -> Any:
    from cutlass._mlir._mlir_libs._cutlass_ir import _mlirExecutionEngine

    return _mlirExecutionEngine


@functools.cache
def refusal(machine: str) -> str | None:
    """Why this DSL cannot write host code for ``machine`` here (one clause), or None.

    Feature-tested, not looked up by version: the entry point must take ``host_triple``, and a
    one-function module written for that triple must come out as an ELF object of that machine
    (the DSL's LLVM must have the backend: the aarch64 DSL has no x86_64 one).
    """
    triple = TRIPLES.get(machine)
    if triple is None:
        return f"no LLVM triple known for {machine}"
    limit = _file_size_limit()
    if limit is not None and limit < _WRITE_BOUND:
        return f"a file size limit of {limit} bytes is set (RLIMIT_FSIZE): LLVM would abort the process on a short write"
    try:
        from cutlass._mlir import ir

        engine = _engine()
    except Exception as exc:  # noqa: BLE001 - private DSL API: whatever the import raises is the refusal's reason
        return f"the DSL's execution engine cannot be imported ({type(exc).__name__}: {exc})"
    dump = getattr(engine, "dump_object_file_pic", None)
    if dump is None or "host_triple" not in (getattr(dump, "__doc__", "") or ""):
        return "this DSL's object writer takes no host triple (DSL 4.5.x has no host cross-compilation)"
    try:
        with ir.Context(), ir.Location.unknown(), tempfile.TemporaryDirectory(prefix="cdc-cross-") as tmp:
            module = ir.Module.parse("llvm.func @cdc_cross_probe() { llvm.return }")
            path = os.path.join(tmp, "probe.o")
            dump(module, path, "cdc_cross_probe", opt_level=0, host_triple=triple)
            with open(path, "rb") as fh:
                got = elf.machine(fh.read(64))
    except Exception as exc:  # noqa: BLE001 - LLVM's failure, whatever its kind, is the refusal's reason
        return f"its LLVM cannot write {triple} objects ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if got != ELF_MACHINES[machine]:
        return f"its LLVM wrote an object of ELF machine {got} for {triple}"
    return None


def host_object(compiled: Any, machine: str, symbol: str) -> bytes:
    """``compiled``'s host object for ``machine``, with its cubins, as the export path would
    write it on that machine; :class:`CrossBuildError` when the result is not such an object.

    A tvm-ffi kernel keeps its entry point ``__tvm_ffi_<function name>`` (what a hit looks up);
    its other symbols are prefixed with ``symbol`` so that several entries never clash. A kernel
    of the DSL's own ABI is written by its ``dump_to_object(symbol)`` with the host target set.
    """
    tvm_ffi = hasattr(compiled, "__tvm_ffi_object__") or "TVMFFI" in type(compiled).__name__
    try:
        obj = _tvm_ffi_object(compiled, machine, symbol) if tvm_ffi else _cutlass_call_object(compiled, machine, symbol)
    except CrossBuildError:
        raise
    except Exception as exc:
        raise CrossBuildError(f"the DSL could not write a {machine} host object: {type(exc).__name__}: {exc}") from exc
    got = elf.machine(obj)
    if got != ELF_MACHINES[machine]:
        raise CrossBuildError(f"the DSL wrote an object of ELF machine {got}, not {machine} ({ELF_MACHINES[machine]})")
    wanted = (f"__tvm_ffi_{compiled.function_name}" if tvm_ffi else f"{symbol}_{compiled.function_name}").encode() + b"\0"
    if wanted not in obj:
        raise CrossBuildError(f"the {machine} object lacks its entry point {wanted[:-1].decode()}")
    return obj


def _tvm_ffi_object(compiled: Any, machine: str, symbol: str) -> bytes:
    from cutlass.base_dsl.export import get_export_module

    entry = f"__tvm_ffi_{compiled.function_name}"
    module = get_export_module(compiled.ir_module, f"__cute_internal_{symbol}", preserve_symbols={entry})
    return write_object(module, machine, hostcpu.host_code().llvm_cpu or "", entry)


def write_object(module: Any, machine: str, cpu: str, function: str | None = None) -> bytes:
    """``module`` (lowered to the LLVM dialect) as a PIC object for ``machine``, its host code for
    LLVM CPU ``cpu`` ("": the machine's generic CPU) at the DSL's export optimisation level.

    The same writer serves another machine's object and this machine's baseline object: the
    DSL's ``export_module_to_bytes`` takes no CPU and always tunes for the build CPU. The writer
    needs the name of a function the module defines (it does not change the bytes, measured);
    without one, the first ``__tvm_ffi_`` function is taken.
    """
    function = function or _entry_function(module)
    limit = _file_size_limit()
    if limit is not None and limit < _WRITE_BOUND:
        # LLVM aborts the whole process on a short write ("LLVM ERROR: IO failure on output
        # stream: File too large"), and a memfd is a file: refuse here, where it is an exception
        raise CrossBuildError(f"a file size limit of {limit} bytes is set (RLIMIT_FSIZE): LLVM would abort the process")
    if hasattr(os, "memfd_create"):  # no file system at all: a read-only or full /tmp changes nothing
        fd = os.memfd_create("cdc-host-object", getattr(os, "MFD_CLOEXEC", 0))
        try:
            _engine().dump_object_file_pic(module, f"/proc/self/fd/{fd}", function, opt_level=_OPT_LEVEL,
                                           host_triple=TRIPLES[machine], host_cpu=cpu)
            size = os.fstat(fd).st_size
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)
    with tempfile.TemporaryDirectory(prefix="cdc-host-") as tmp:  # pragma: no cover - non-Linux
        path = os.path.join(tmp, "kernel.o")
        _engine().dump_object_file_pic(module, path, function, opt_level=_OPT_LEVEL, host_triple=TRIPLES[machine],
                                       host_cpu=cpu)
        with open(path, "rb") as fh:
            return fh.read()


#: The largest file a host object could need, with room: a file size limit below it refuses.
_WRITE_BOUND = 1 << 28


def _file_size_limit() -> int | None:
    """The process's RLIMIT_FSIZE soft limit in bytes, None when unlimited or unknown."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _entry_function(module: Any) -> str:
    """The first function ``module`` defines, a tvm-ffi entry point preferred."""
    defined = [str(op.attributes["sym_name"]).strip('"') for op in module.body.operations
               if op.operation.name == "llvm.func" and len(op.operation.regions) and len(op.operation.regions[0].blocks)]
    entries = [name for name in defined if name.startswith("__tvm_ffi_")]
    if not (entries or defined):
        raise CrossBuildError("the module defines no function")
    return (entries or defined)[0]


def _cutlass_call_object(compiled: Any, machine: str, symbol: str) -> bytes:
    """The DSL's public cross-export: its ``host_target`` for the duration of one ``dump_to_object``
    (the machine's preset for its generic CPU, else the long form naming the baseline's CPU)."""
    from cutlass.base_dsl.compiler import HostTarget

    cpu = hostcpu.host_code().llvm_cpu or ""
    preset = _PRESETS.get(machine) if cpu in ("", "generic") else None
    spec = preset or (f"llvm -mtriple={TRIPLES[machine]} -mcpu={cpu}" if cpu else None)
    if spec is None:
        raise CrossBuildError(f"the DSL has no host-target preset for {machine}")
    saved = compiled.host_target
    compiled.host_target = HostTarget(spec)
    try:
        return bytes(compiled.dump_to_object(symbol))
    finally:
        compiled.host_target = saved
