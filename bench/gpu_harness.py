"""What every GPU-proof script shares: fresh child processes that report one JSON line, GPU
timing, what the machine and the build were, and byte-level comparison of two cache entries.

``gpu_proof_sm90.py`` (the CUTLASS Hopper GEMM), ``gpu_proof_flashinfer_sm90.py`` (a flashinfer
kernel) and ``device_facts_h200.py`` (device facts in the key) each keep only their kernel,
their phases and their verdicts; everything here is imported from them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

#: A child prints its report as one line with this prefix (its other output is noise).
RESULT_PREFIX = "RESULT "

# The DSL keeps its own IR cache under $TMPDIR/<user>/cutlass_python_cache: left on, a "cold"
# compile would be partly served from it. It changes no generated code (cute_diskcache does
# not key it), so turning it off only makes cold mean cold.
os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")


# --------------------------------------------------------------------------------------------
# Child processes
# --------------------------------------------------------------------------------------------


def emit(res: dict[str, Any]) -> None:
    """A child's report, for :func:`spawn`."""
    print(RESULT_PREFIX + json.dumps(res, default=str), flush=True)


def emit_with_cache(res: dict[str, Any], dsl_compiles: int) -> None:
    """:func:`emit` a child's result with what the cache did: the DSL's compile count, our counters
    and each event (site, outcome, seconds)."""
    import cute_diskcache
    from cute_diskcache.core.cache import default_cache

    res["dsl_compiles"] = dsl_compiles
    res["counters"] = cute_diskcache.counters()
    res["events"] = [(e[0], e[2], round(e[3], 4)) for e in default_cache().events]
    emit(res)


def spawn(script: str, argv: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None,
          stderr_tail: int = 1500) -> dict[str, Any]:
    """Run ``script argv`` in a fresh interpreter; its report, with ``wall_s`` and the tail of its
    stderr (the cache's warnings say why a miss), or ``{"error": ...}`` when it printed none."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            res = json.loads(line[len(RESULT_PREFIX):])
            res["wall_s"] = round(time.perf_counter() - t0, 3)
            res["exit_code"] = proc.returncode
            res["stderr_tail"] = proc.stderr[-stderr_tail:]
            return res
    return {"argv": argv, "error": f"rc={proc.returncode}", "stderr_tail": proc.stderr[-4000:], "stdout_tail": proc.stdout[-1500:]}


def import_file_as(name: str, path: Path) -> Any:
    """Import ``path`` as module ``name`` (once): the cache key hashes a source by module name,
    so a fixed name keeps the key independent of where the file lies."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def record_cache_outcome(res: dict[str, Any]) -> None:
    """This process's cache counters and events into ``res``, and what the last event cost."""
    import cute_diskcache
    from cute_diskcache.keys import key as keymod
    from cute_diskcache.core.cache import default_cache

    res["counters"] = cute_diskcache.counters()
    ev = default_cache().events
    res["events"] = [{"site": e[0], "digest": e[1], "kind": e[2], "seconds": round(e[3], 6), "persist_s": round(e[4], 6)} for e in ev]
    res["digest"] = ev[-1][1] if ev else None
    res["arch"] = keymod.current_arch()
    if ev and ev[-1][2] == "hit":
        res["load_ms"] = round(ev[-1][3] * 1e3, 4)
    else:
        res["compile_s"] = round(ev[-1][3], 4) if ev else None
        res["persist_s"] = round(ev[-1][4], 4) if ev else None


# --------------------------------------------------------------------------------------------
# Timing on the GPU
# --------------------------------------------------------------------------------------------


def gpu_batches(fn: Callable[[], Any], reps: int = 10, inner: int = 20, warmup: int = 10) -> tuple[list[float], list[float]]:
    """Per-call GPU milliseconds over ``reps`` batches of ``inner`` back-to-back calls (CUDA
    events), and host milliseconds per call of each batch. Batches keep host launch overhead
    off the GPU timeline: the queue stays full."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per: list[float] = []
    host: list[float] = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        host.append((time.perf_counter() - t0) / inner * 1e3)
        end.record()
        end.synchronize()
        per.append(start.elapsed_time(end) / inner)
    return per, host


def median(values: list[float]) -> float:
    return statistics.median(values)


# --------------------------------------------------------------------------------------------
# The machine and the build
# --------------------------------------------------------------------------------------------


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def host_cpu() -> str:
    """The build machine's CPU model: the DSL tunes host code for it unless a host target is pinned."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def versions() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    from cute_diskcache import __version__
    from cute_diskcache.keys import key as keymod

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "cute_diskcache": __version__, "dsl_stack": keymod.dsl_stack_string()}
    # The package moves fast: pin which sources produced these numbers.
    pkg = Path(__import__("cute_diskcache").__file__).parent
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes())
    out["cute_diskcache_sources_sha256"] = h.hexdigest()
    for dist in ("flashinfer-python", "cuda-bindings"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def device_info() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {"name": props.name, "capability": f"{props.major}.{props.minor}", "sm_count": props.multi_processor_count,
                            "total_memory_gib": round(props.total_memory / 2**30, 1)}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = q.stdout.strip()
    except Exception as exc:
        info["nvidia_smi"] = f"unavailable: {exc}"
    return info


def live_device_facts() -> dict[str, Any]:
    """The facts an ``h200`` profile claims, read from the live device (to check the profile)."""
    import cuda.bindings.driver as drv
    import torch

    A = drv.CUdevice_attribute
    facts: dict[str, Any] = {}
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    facts["device_name"] = props.name
    facts["capability"] = [props.major, props.minor]
    facts["sm_count"] = props.multi_processor_count
    facts["total_memory"] = props.total_memory
    for key, attr in (
        ("max_shared_memory_per_multiprocessor", A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
        ("max_shared_memory_per_block_optin", A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
    ):
        err, value = drv.cuDeviceGetAttribute(attr, dev)
        facts[key] = int(value) if int(err) == 0 else f"error {err}"
    try:
        from cutlass.utils import HardwareInfo

        facts["max_active_clusters_1"] = int(HardwareInfo().get_max_active_clusters(1))
    except Exception as exc:  # informative only
        facts["max_active_clusters_1"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return facts


# --------------------------------------------------------------------------------------------
# Comparing two entries, byte by byte
# --------------------------------------------------------------------------------------------


def entry_dirs(root: Path) -> list[Path]:
    from cute_diskcache.storage import layout

    return sorted(layout.entry_dirs(root))


def elf_sections(buf: bytes) -> list[tuple[str, int, int]]:
    """(name, file offset, bytes in the file) of each section of an ELF image; [] if unparsable."""
    from cute_diskcache.storage import elf

    try:
        return [(s.name, s.offset, s.size) for s in elf.sections(buf)]
    except Exception:
        return []


def _symbols(buf: bytes, rename: tuple[str, str] | None = None) -> list[tuple[Any, ...]] | None:
    """Sorted ``.symtab`` entries, names renamed; None if unparsable."""
    from cute_diskcache.storage import elf

    try:
        syms = elf.symbols(buf)
    except Exception:
        return None
    if not syms:
        return None
    return sorted((name.replace(*rename) if rename else name, *rest) for name, *rest in syms)


def section_compare(a: bytes, b: bytes, rename_b: tuple[str, str] | None = None) -> dict[str, Any]:
    """Section by section: which sections of two objects differ, and whether their symbol
    tables are the same once ``rename_b`` (old, new) is applied to ``b``'s names. Explains
    differences that only move strings around (a digest-derived symbol name)."""
    sa = {n: a[o : o + s] for n, o, s in elf_sections(a)}
    sb = {n: b[o : o + s] for n, o, s in elf_sections(b)}
    differing = sorted(n for n in set(sa) | set(sb) if sa.get(n) != sb.get(n))
    syms_a, syms_b = _symbols(a), _symbols(b, rename_b)
    return {
        "sections": len(sa),
        # Same names, offsets and sizes: the header table can then differ only in sh_name
        # (offsets into .strtab), i.e. where the strings landed.
        "section_layout_equal": elf_sections(a) == elf_sections(b),
        "differing_sections": differing,
        "symbol_tables_equal_after_rename": syms_a == syms_b if syms_a is not None else None,
        "symbols": len(syms_a or []),
    }


def diff_summary(a: bytes, b: bytes) -> dict[str, Any]:
    """Where two byte strings differ, by ELF section of ``a`` when they are ELF images."""
    if a == b:
        return {"identical": True, "bytes": len(a)}
    n = min(len(a), len(b))
    diffs = [i for i in range(n) if a[i] != b[i]]
    sections = elf_sections(a)
    by_section: dict[str, int] = {}
    for i in diffs:
        name = next((s for s, off, size in sections if off <= i < off + size), "<outside sections>")
        by_section[name] = by_section.get(name, 0) + 1
    return {
        "identical": False,
        "sizes": [len(a), len(b)],
        "differing_bytes": len(diffs),
        "first_diff_at": diffs[0] if diffs else n,
        "by_section": by_section,
    }


def read_entry(edir: Path) -> dict[str, Any]:
    """A verified entry's manifest, object, cubins and MLIR text."""
    from cute_diskcache.storage import entry

    manifest = entry.read_manifest(edir)
    obj = entry.verify(edir, manifest, None)
    cubins = [entry.read_payload(edir, c, role="cubin") for c in manifest["payloads"]["cubin"]]
    mlir = None
    if manifest["payloads"]["mlir"]:
        item = manifest["payloads"]["mlir"][0]
        mlir = entry.mlir_text(entry.read_payload(edir, item, role="mlir"), item["file"])
    return {"dir": edir, "manifest": manifest, "object": obj, "cubins": cubins, "mlir": mlir}


def compare_entries(dev: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Byte-level comparison of an offline-built entry with the device-built one."""
    from cute_diskcache.storage import elf

    md, mo = dev["manifest"], off["manifest"]
    env_diff = {k: {"device": md["env"].get(k), "offline": mo["env"].get(k)} for k in sorted(set(md["env"]) | set(mo["env"]))
                if md["env"].get(k) != mo["env"].get(k)}
    # The symbol is derived from the digest: normalise it away to see what else differs.
    same_length = mo["symbol"] != md["symbol"] and len(mo["symbol"]) == len(md["symbol"])
    obj_off_renamed = off["object"].replace(mo["symbol"].encode(), md["symbol"].encode()) if same_length else off["object"]
    same_count = len(dev["cubins"]) == len(off["cubins"])
    out: dict[str, Any] = {
        "digest_equal": md["digest"] == mo["digest"],
        "namespace_equal": md["namespace"] == mo["namespace"],
        "env_digest_equal": md["env_digest"] == mo["env_digest"],
        "env_differences": env_diff,
        "key_bytes_equal": md["key_bytes"] == mo["key_bytes"],
        "object": diff_summary(dev["object"], off["object"]),
        "object_sha256": {"device": sha(dev["object"]), "offline": sha(off["object"])},
        "cubin_count": [len(dev["cubins"]), len(off["cubins"])],
        "cubins_identical": [a == b for a, b in zip(dev["cubins"], off["cubins"])] if same_count else False,
        "cubin_sha256": {"device": [sha(c) for c in dev["cubins"]], "offline": [sha(c) for c in off["cubins"]]},
        "cubins_extracted_from_object_match_payloads": elf.cubins_in(off["object"]) == off["cubins"] and elf.cubins_in(dev["object"]) == dev["cubins"],
        "mlir_identical": dev["mlir"] == off["mlir"] if dev["mlir"] is not None and off["mlir"] is not None else None,
        "symbol": {"device": md["symbol"], "offline": mo["symbol"]},
        "tvm_ffi": [md["tvm_ffi"], mo["tvm_ffi"]],
    }
    if obj_off_renamed is not off["object"]:
        out["object_with_symbol_normalised"] = diff_summary(dev["object"], obj_off_renamed)
    if dev["object"] != off["object"]:
        out["object_sections"] = section_compare(dev["object"], off["object"], (mo["symbol"], md["symbol"]))
    if not out["cubins_identical"] or out["cubins_identical"] is False:
        out["cubin_diffs"] = [diff_summary(a, b) for a, b in zip(dev["cubins"], off["cubins"])]
    if dev["mlir"] != off["mlir"] and dev["mlir"] and off["mlir"]:
        la, lb = dev["mlir"].splitlines(), off["mlir"].splitlines()
        first = [(i, x, y) for i, (x, y) in enumerate(zip(la, lb)) if x != y][:5]
        out["mlir_first_diffs"] = [{"line": i, "device": x[:300], "offline": y[:300]} for i, x, y in first]
        out["mlir_lines"] = [len(la), len(lb)]
    return out
