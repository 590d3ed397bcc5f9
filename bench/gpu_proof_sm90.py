#!/usr/bin/env python3
"""GPU proof on an H200 (sm_90): a real CuTe-DSL kernel through ``cute_diskcache.cached_compile``.

Why: a cache is only worth adopting if the kernel it serves in a fresh process is *the same
kernel*: same bits out, same speed, no compile. This script shows that on real hardware with
the Hopper dense GEMM that flashinfer ships in ``data/cutlass/examples`` (bf16, 4096^3,
tile 128x128, cluster 1x1), once exported through tvm-ffi (as flashinfer's kernels are) and
once through ``dump_to_object``.

Modes (every measured number comes from a fresh interpreter):

``all`` (on the GPU)
    For each variant: ``child --phase cold`` on an empty cache (compile + persist, run, save
    the output bytes), then ``child --phase warm`` (must hit with zero compiles; output
    compared bitwise with the cold one; load and kernel times). With ``--offline`` also checks
    entries compiled on a CPU box (``offline-check`` plus warm children on copies of those
    caches). With ``--floor-bin`` runs the driver-API load floor on the cubins. Writes
    ``gpu_proof_sm90.json`` and ``h200_offline_vs_device.json``.
``child``
    One fresh process of the above.
``offline-build`` (on a CPU box)
    Compiles both variants for the ``h200`` target profile into a cache root, recording every
    device query the compile made (answered from the profile; a query the profile cannot
    answer fails loudly).
``offline-check`` (on the GPU)
    Compares offline-built entries with the device-built ones (key, environment, object
    bytes, each cubin, MLIR) and runs each offline object on the GPU.

Reproduce (results and their reading: ``bench/results/gpu_proof_sm90.md``)::

    # CPU box, once per build environment (A: the project venv; B: Python 3.12 with exactly
    # the wheels the GPU box gets); GPU_PROOF_HOST_TARGET=... and --variants plain for pinned
    python bench/gpu_proof_sm90.py offline-build --cache .dev/offline/B/cache \
        --record .dev/offline/B/offline_build.json
    scripts/build_csrc.sh build/csrc                      # on the GPU box
    python3 bench/gpu_proof_sm90.py all --out OUT --offline .dev/offline \
        --floor-bin build/csrc/cubin_load_floor --sm120-cubins DIR --first-call-probes 3

On the lent H200, the DSL wheels travel as ``../shared/device/README.md`` says (park the
libs, then ``. .dev/s2/env.sh && ...``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import glob
import importlib.util
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("gpu_proof_sm90")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_harness import (  # noqa: E402  (shared with the other GPU proofs; sets CUTE_DSL_DISABLE_FILE_CACHING)
    compare_entries, device_info, emit, entry_dirs, gpu_batches, host_cpu, import_file_as, live_device_facts,
    read_entry, record_cache_outcome, sha, spawn, versions,
)

M = N = K = 4096
L = 1
TILE_MN = (128, 128)
CLUSTER_MN = (1, 1)
VARIANTS = ("tvm", "plain")
VARIANTS_ENV = "GPU_PROOF_VARIANTS"  # comma list; children inherit it


def active_variants() -> tuple[str, ...]:
    """The variants this run covers (``--variants``; both by default)."""
    raw = os.environ.get(VARIANTS_ENV)
    return tuple(v for v in raw.split(",") if v in VARIANTS) if raw else VARIANTS


EXAMPLE_REL = "hopper/dense_gemm.py"
MODULE_NAME = "hopper_dense_gemm"  # the cache key's "package": the example file, hashed by content
SEED = 20261202


# --------------------------------------------------------------------------------------------
# The kernel: how it is found, keyed and compiled (the same on the CPU box and on the GPU)
# --------------------------------------------------------------------------------------------


def example_path() -> Path:
    """flashinfer's copy of the CUTLASS Hopper dense GEMM, without importing flashinfer."""
    base = os.environ.get("CUTLASS_EXAMPLES")
    if base:
        return Path(base) / EXAMPLE_REL
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("flashinfer is not installed and CUTLASS_EXAMPLES is unset")
    root = Path(list(spec.submodule_search_locations)[0])
    return root / "data" / "cutlass" / "examples" / "python" / "CuTeDSL" / EXAMPLE_REL


def load_example() -> Any:
    """Import the example under a fixed module name, so its cache key does not depend on paths."""
    return import_file_as(MODULE_NAME, example_path())


def cache_key(variant: str) -> dict[str, Any]:
    """Everything the compile depends on besides the example's source and the DSL stack."""
    return {
        "example": EXAMPLE_REL,
        "mnkl": (M, N, K, L),
        "ab_dtype": "bf16",
        "c_dtype": "bf16",
        "acc_dtype": "f32",
        "majors": "a:k,b:k,c:n",
        "tile_mn": TILE_MN,
        "cluster_mn": CLUSTER_MN,
        "stream": "tvm-ffi-env" if variant == "tvm" else "argument",
    }


#: Optional ``--host-target`` for the host launch code. Unset, the DSL tunes that code for the
#: build machine's CPU (LLVM's native auto-detect), so objects built on two machines differ in
#: host instruction scheduling (measured: identical instructions, another order); pinned, e.g.
#: to ``llvm -mtriple=x86_64-unknown-linux-gnu -mcpu=x86-64-v2``, they need not.
HOST_TARGET_ENV = "GPU_PROOF_HOST_TARGET"


def compile_options(variant: str) -> str | None:
    opts = ["--enable-tvm-ffi"] if variant == "tvm" else []
    host = os.environ.get(HOST_TARGET_ENV)
    if host:
        opts.append(f"--host-target '{host}'")
    return " ".join(opts) or None


def compile_args(variant: str) -> tuple[Any, ...]:
    """Fake (device-free) compile arguments: identical on a CPU box and on the GPU.

    Static 4096^3 layouts matching torch tensors made as (l, rows, cols) then permuted to
    (rows, cols, l), i.e. the example's k-major A/B and n-major C.
    """
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    def fake(rows: int, cols: int) -> Any:
        return make_fake_compact_tensor(cutlass.BFloat16, (rows, cols, L), stride_order=(1, 0, 2), assumed_align=16)

    stream = make_fake_stream(use_tvm_ffi_env_stream=(variant == "tvm"))
    return fake(M, K), fake(N, K), fake(M, N), stream


def build(variant: str) -> tuple[Any, float]:
    """``cached_compile`` the GEMM; returns (kernel, seconds of the whole call)."""
    import cutlass

    import cute_diskcache

    mod = load_example()
    gemm = mod.HopperWgmmaGemmKernel(cutlass.Float32, TILE_MN, CLUSTER_MN)
    args = compile_args(variant)
    t0 = time.perf_counter()
    kernel = cute_diskcache.cached_compile(gemm, *args, key=cache_key(variant), options=compile_options(variant))
    return kernel, time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# Device facts: what a compile reads from the driver (issue 7)
# --------------------------------------------------------------------------------------------


class DeviceQuerySpy:
    """Record every driver query the DSL makes while active.

    With ``answers`` (an offline compile through a target profile) the queries are answered
    from it and a query it cannot answer raises: a profile that lacks a fact the compile reads
    must fail loudly, never fall back to a guess. Without, the real driver answers and the
    values are recorded.
    """

    def __init__(self, answers: dict[str, int] | None = None) -> None:
        self.answers = answers
        self.calls: list[dict[str, Any]] = []
        self._undo: list[Callable[[], None]] = []

    def _patch(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        orig = getattr(owner, name, None)
        if orig is None:
            return
        try:
            setattr(owner, name, make(orig))
        except (AttributeError, TypeError):
            return
        self._undo.append(lambda: setattr(owner, name, orig))

    def __enter__(self) -> "DeviceQuerySpy":
        import cutlass.base_dsl.env_manager as envm
        import cutlass.base_dsl.runtime.cuda as rc

        def wrap_attr(orig: Callable[..., Any]) -> Callable[..., Any]:
            def get_device_attribute(attribute: Any, device_id: int = 0) -> Any:
                name = getattr(attribute, "name", str(attribute))
                if self.answers is not None:
                    if name not in self.answers:
                        self.calls.append({"fn": "get_device_attribute", "attribute": name, "value": None, "error": "not in profile"})
                        raise RuntimeError(f"target profile has no value for device attribute {name}")
                    value = self.answers[name]
                else:
                    value = orig(attribute, device_id)
                self.calls.append({"fn": "get_device_attribute", "attribute": name, "value": int(value)})
                return value

            return get_device_attribute

        def wrap_cc(orig: Callable[..., Any]) -> Callable[..., Any]:
            def get_compute_capability_major_minor(*a: Any, **kw: Any) -> Any:
                if self.answers is not None:
                    value = (self.answers["CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"], self.answers["CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"])
                else:
                    value = orig(*a, **kw)
                self.calls.append({"fn": "get_compute_capability_major_minor", "value": list(value)})
                return value

            return get_compute_capability_major_minor

        def wrap_driver(orig: Callable[..., Any]) -> Callable[..., Any]:
            def cuDeviceGetAttribute(attribute: Any, device: Any) -> Any:
                result = orig(attribute, device)
                self.calls.append({"fn": "cuDeviceGetAttribute", "attribute": getattr(attribute, "name", str(attribute)), "value": repr(result[-1])[:40]})
                return result

            return cuDeviceGetAttribute

        self._patch(rc, "get_device_attribute", wrap_attr)
        self._patch(rc, "get_compute_capability_major_minor", wrap_cc)
        self._patch(envm, "get_compute_capability_major_minor", wrap_cc)
        if self.answers is None:
            import cuda.bindings.driver as drv

            self._patch(drv, "cuDeviceGetAttribute", wrap_driver)
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in reversed(self._undo):
            undo()


def profile_answers(profile: Any) -> dict[str, int]:
    """The driver attributes a target profile can answer."""
    return {
        "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT": profile.sm_count,
        "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": profile.capability[0],
        "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": profile.capability[1],
        "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": profile.max_shared_memory_per_multiprocessor,
        "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": profile.max_shared_memory_per_block_optin,
    }


# --------------------------------------------------------------------------------------------
# Running and timing on the GPU
# --------------------------------------------------------------------------------------------


class Problem:
    """Fixed-seed inputs and an output buffer, laid out as the kernel was compiled for."""

    def __init__(self) -> None:
        import torch

        gen = torch.Generator(device="cuda").manual_seed(SEED)
        self.a_store = torch.randn(L, M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.b_store = torch.randn(L, N, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.c_store = torch.empty(L, M, N, device="cuda", dtype=torch.bfloat16)
        self.a = self.a_store.permute(1, 2, 0)
        self.b = self.b_store.permute(1, 2, 0)
        self.c = self.c_store.permute(1, 2, 0)
        torch.cuda.synchronize()

    def launcher(self, kernel: Any, variant: str) -> Callable[[], Any]:
        """A zero-argument launch, with any argument conversion done once, up front."""
        if variant == "tvm":
            a, b, c = self.a, self.b, self.c
            return lambda: kernel(a, b, c)
        import cuda.bindings.driver as cuda
        import torch
        from cutlass.cute.runtime import from_dlpack

        ta, tb, tc = (from_dlpack(t, assumed_align=16) for t in (self.a, self.b, self.c))
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        return lambda: kernel(ta, tb, tc, stream)

    def output_bytes(self) -> bytes:
        import torch

        return self.c_store.contiguous().view(torch.int16).cpu().numpy().tobytes()

    def error_vs_fp32(self) -> dict[str, float]:
        ref = self.a_store[0].float() @ self.b_store[0].float().T
        diff = (self.c_store[0].float() - ref).abs()
        return {"max_abs_err": float(diff.max()), "mean_abs_err": float(diff.mean()), "ref_max_abs": float(ref.abs().max())}


def time_kernel(launch: Callable[[], Any], reps: int = 10, inner: int = 20, warmup: int = 10) -> dict[str, Any]:
    """Median per-launch time over ``reps`` batches of ``inner`` back-to-back launches (CUDA events)."""
    per, host = gpu_batches(launch, reps, inner, warmup)
    ms = statistics.median(per)
    return {"kernel_ms": round(ms, 5), "kernel_ms_batches": [round(x, 5) for x in per], "tflops": round(2 * M * N * K / (ms * 1e-3) / 1e12, 1),
            "host_ms_per_launch": round(statistics.median(host), 5)}


def repeat_hits(variant: str, n: int) -> dict[str, Any]:
    """``n`` more disk hits in this process (the in-process memo cleared each time), plus the
    split between reading+verifying the entry and loading its object."""
    import cute_diskcache
    from cute_diskcache.storage import entry, loader
    from cute_diskcache.core.cache import default_cache

    calls: list[float] = []
    loads: list[float] = []
    for _ in range(n):
        cute_diskcache._MEMO.clear()
        before = len(default_cache().events)
        _, dt = build(variant)
        calls.append(dt * 1e3)
        loads.extend(ev[3] * 1e3 for ev in default_cache().events[before:] if ev[2] == "hit")
    digest = default_cache().events[-1][1]
    edir = next(d for d in entry_dirs(default_cache().store.root) if d.name == digest)
    verify_ms: list[float] = []
    load_only_ms: list[float] = []
    manifest: dict[str, Any] = {}
    for _ in range(n):
        t0 = time.perf_counter()
        manifest = entry.read_manifest(edir)
        obj = entry.verify(edir, manifest, None)
        t1 = time.perf_counter()
        loader.load_object(obj, manifest["symbol"], manifest["tvm_ffi"])
        t2 = time.perf_counter()
        verify_ms.append((t1 - t0) * 1e3)
        load_only_ms.append((t2 - t1) * 1e3)
    med = lambda xs: round(statistics.median(xs), 4) if xs else None  # noqa: E731
    return {
        "n": n,
        "cached_compile_ms_p50": med(calls),
        "hit_ms_p50": med(loads),
        "hit_ms_min": round(min(loads), 4) if loads else None,
        "read_verify_ms_p50": med(verify_ms),
        "dsl_load_ms_p50": med(load_only_ms),
        "entry_bytes": sum(f.stat().st_size for f in edir.iterdir()),
        "object_bytes": manifest["payloads"]["object"][0]["size"] if manifest else None,
    }


# --------------------------------------------------------------------------------------------
# child: one fresh process
# --------------------------------------------------------------------------------------------


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["CUTE_DISKCACHE_DIR"] = args.cache
    t_start = time.perf_counter()
    import torch

    import cute_diskcache  # noqa: F401
    from cute_diskcache.core.cache import default_cache  # noqa: F401  (import cost kept out of the measured call)

    res: dict[str, Any] = {"phase": args.phase, "variant": args.variant, "cache": args.cache}
    problem = Problem()  # CUDA context first: load times below exclude its creation
    load_example()
    import cutlass  # noqa: F401  (DSL import cost kept out of the measured call)

    res["startup_s"] = round(time.perf_counter() - t_start, 3)
    # What install() does when it attaches: dlopen the DSL runtime once per process. Timed on
    # its own so the first hit below measures the cache, not a one-time library load.
    from cute_diskcache.storage import loader

    res["runtime_preload_ms"] = round(loader.preload() * 1e3, 3)
    with DeviceQuerySpy() as spy:
        kernel, call_s = build(args.variant)
    res["cached_compile_s"] = round(call_s, 5)
    res["device_queries_during_call"] = spy.calls
    record_cache_outcome(res)

    launch = problem.launcher(kernel, args.variant)
    problem.c_store.fill_(float("nan"))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    launch()
    torch.cuda.synchronize()
    res["first_launch_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    out = problem.output_bytes()
    res["output_sha256"] = sha(out)
    res.update(problem.error_vs_fp32())
    if args.save:
        Path(args.save).write_bytes(out)
    if args.ref:
        ref = Path(args.ref).read_bytes()
        res["bitwise_equal_to_ref"] = ref == out
        res["ref"] = args.ref
        if ref != out and len(ref) == len(out):
            import numpy as np

            a = np.frombuffer(ref, dtype=np.int16)
            b = np.frombuffer(out, dtype=np.int16)
            res["differing_elements"] = int((a != b).sum())
    res.update(time_kernel(launch))
    if args.repeat_hits and res.get("load_ms") is not None:
        try:
            res["repeat_hits"] = repeat_hits(args.variant, args.repeat_hits)
        except Exception as exc:
            res["repeat_hits"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    res["process_s"] = round(time.perf_counter() - t_start, 3)
    return res


def run_first_call_probe(args: argparse.Namespace) -> dict[str, Any]:
    """Where a fresh process's first ``cached_compile`` hit spends its time.

    The cache computes its environment once per process (the DSL stack from installed
    distributions, the arch, a source fingerprint); this times each piece cold, then the call
    itself (whose environment pieces are then warm), in a fresh interpreter.
    """
    import importlib.metadata as md

    os.environ["CUTE_DISKCACHE_DIR"] = args.cache
    problem = Problem()  # noqa: F841  (CUDA context, as in the warm child)
    mod = load_example()
    import cutlass  # noqa: F401

    from cute_diskcache.storage import loader
    from cute_diskcache.keys import key as keymod
    from cute_diskcache.core.cache import default_cache

    res: dict[str, Any] = {"variant": args.variant, "sys_path_entries": len(sys.path)}
    res["runtime_preload_ms"] = round(loader.preload() * 1e3, 3)

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        value = fn()
        res[f"{name}_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        return value

    timed("dsl_stack_first", keymod.dsl_stack)
    res["distributions"] = timed("distributions_rescan", lambda: len(list(md.distributions())))
    timed("current_arch", keymod.current_arch)
    timed("source_fingerprint_first", lambda: keymod.source_fingerprint(mod, MODULE_NAME))
    timed("codegen_env", keymod.codegen_env)
    _, call_s = build(args.variant)
    res["first_cached_compile_ms_after_env_warm"] = round(call_s * 1e3, 3)
    ev = default_cache().events
    res["hit_ms"] = round(ev[-1][3] * 1e3, 3) if ev and ev[-1][2] == "hit" else None
    res["kind"] = ev[-1][2] if ev else None
    return res


def spawn_child(phase: str, variant: str, cache: Path, *, save: Path | None = None, ref: Path | None = None, repeat_hits: int = 0) -> dict[str, Any]:
    argv = ["child", "--phase", phase, "--variant", variant, "--cache", str(cache), "--repeat-hits", str(repeat_hits)]
    if save:
        argv += ["--save", str(save)]
    if ref:
        argv += ["--ref", str(ref)]
    # The result is printed before the interpreter exits: a loaded shared object's unload hook
    # (its CUDA module) runs after that; a crash there shows only in the exit code.
    return {"phase": phase, "variant": variant, **spawn(__file__, argv)}


# --------------------------------------------------------------------------------------------
# Offline build (CPU box) and its check (GPU)
# --------------------------------------------------------------------------------------------


def run_offline_build(args: argparse.Namespace) -> dict[str, Any]:
    """Compile both variants for the h200 profile into ``--cache`` on a machine with no GPU."""
    os.environ["CUTE_DISKCACHE_DIR"] = args.cache
    from cute_diskcache.keys import targets

    profile = targets.get("h200")
    res: dict[str, Any] = {"profile": profile.facts(), "python": platform.python_version(), "host_cpu": host_cpu(), "host_target": os.environ.get(HOST_TARGET_ENV), "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        targets.apply(profile)  # sets CUTE_DSL_ARCH and torch's device queries
        res["profile_applied"] = "targets.apply (CUTE_DSL_ARCH + torch.cuda stand-ins)"
    except ImportError as exc:
        # No torch in this interpreter: nothing torch-side to stand in for; the arch is
        # what the DSL compiles for, and driver queries are answered by the spy below.
        os.environ["CUTE_DSL_ARCH"] = profile.arch
        res["profile_applied"] = f"CUTE_DSL_ARCH={profile.arch} only ({exc})"
    import cute_diskcache
    from cute_diskcache.keys import key as keymod
    from cute_diskcache.core.cache import default_cache

    res["dsl_stack"] = keymod.dsl_stack_string()
    res["arch"] = keymod.current_arch()
    res["variants"] = {}
    for variant in active_variants():
        with DeviceQuerySpy(profile_answers(profile)) as spy:
            _, call_s = build(variant)
        ev = default_cache().events[-1]
        res["variants"][variant] = {"digest": ev[1], "kind": ev[2], "compile_s": round(ev[3], 4), "call_s": round(call_s, 4), "device_queries": spy.calls}
    res["counters"] = cute_diskcache.counters()
    return res


def run_offline_check(args: argparse.Namespace) -> dict[str, Any]:
    """Compare each offline root's entries with the device-built ones and run the offline objects."""
    import torch

    from cute_diskcache.storage import loader

    res: dict[str, Any] = {"live_device_facts": {}, "builds": {}}
    problem = Problem()  # also makes the CUDA context current, which HardwareInfo needs
    try:
        res["live_device_facts"] = live_device_facts()
    except Exception as exc:
        res["live_device_facts"] = {"error": f"{type(exc).__name__}: {exc}"}
    from cute_diskcache.keys import targets

    prof = targets.get("h200").facts()
    live = res["live_device_facts"]
    res["h200_profile_vs_live"] = {k: {"profile": prof.get(k), "live": live.get(k), "equal": prof.get(k) == live.get(k)} for k in ("device_name", "capability", "sm_count", "max_shared_memory_per_multiprocessor", "max_shared_memory_per_block_optin", "total_memory", "max_active_clusters_1")}
    device = {v: read_entry(entry_dirs(Path(args.work) / f"cache-{v}")[0]) for v in active_variants()}
    for build_dir in sorted(Path(args.offline).iterdir()):
        root = build_dir / "cache"
        if not root.is_dir():
            continue
        info: dict[str, Any] = {}
        rec = build_dir / "offline_build.json"
        if rec.exists():
            info["build_record"] = json.loads(rec.read_text())
        by_digest = {d.name: d for d in entry_dirs(root)}
        digests = {v: info.get("build_record", {}).get("variants", {}).get(v, {}).get("digest") for v in active_variants()}
        for v in active_variants():
            d = by_digest.get(digests[v]) if digests[v] else None
            if d is None:
                info[v] = {"error": "offline entry not found"}
                continue
            off = read_entry(d)
            cmp = compare_entries(device[v], off)
            # Run the offline-built object on this GPU, whatever its key says.
            try:
                kernel = loader.load_object(off["object"], off["manifest"]["symbol"], off["manifest"]["tvm_ffi"])
                launch = problem.launcher(kernel, v)
                problem.c_store.fill_(float("nan"))
                launch()
                torch.cuda.synchronize()
                out = problem.output_bytes()
                ref = (Path(args.work) / f"out-{v}.bin").read_bytes()
                cmp["run_on_device"] = {"output_sha256": sha(out), "bitwise_equal_to_device_build": out == ref, **time_kernel(launch, reps=5)}
            except Exception as exc:
                cmp["run_on_device"] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            info[v] = cmp
        res["builds"][build_dir.name] = info
    return res


# --------------------------------------------------------------------------------------------
# all: the parent on the GPU
# --------------------------------------------------------------------------------------------


def run_floor(floor_bin: str, cubins: list[Path], reps: int = 200) -> tuple[str, dict[str, float]]:
    """Run the driver-API floor program; returns its text and the median load us per cubin."""
    proc = subprocess.run([floor_bin, "-n", str(reps), *map(str, cubins)], capture_output=True, text=True, timeout=300)
    text = proc.stdout + (f"\n[stderr]\n{proc.stderr}" if proc.stderr else "") + f"\n[exit status {proc.returncode}]\n"
    medians: dict[str, float] = {}
    current = None
    for line in proc.stdout.splitlines():
        if line.startswith("cubin "):
            current = line.split()[1]
        elif line.strip().startswith("load_us median=") and current:
            medians[current] = float(line.split("median=")[1].split()[0])
    return text, medians


def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"_{args.tag}" if args.tag else ""
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    import torch

    result: dict[str, Any] = {
        "what": "Hopper dense GEMM (flashinfer data/cutlass/examples, CuTeDSL/hopper/dense_gemm.py) through cute_diskcache.cached_compile",
        "problem": {"mnkl": [M, N, K, L], "dtype": "bf16 in/out, fp32 acc", "tile_mn": TILE_MN, "cluster_mn": CLUSTER_MN, "seed": SEED},
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "host_cpu": host_cpu(),
        "host_target": os.environ.get(HOST_TARGET_ENV),
        "device": device_info(),
        "versions": versions(),
        "variants": {},
    }
    torch.cuda.empty_cache()
    for v in active_variants():
        cache = work / f"cache-{v}"
        ref = work / f"out-{v}.bin"
        cold = spawn_child("cold", v, cache, save=ref)
        warm = spawn_child("warm", v, cache, ref=ref, repeat_hits=args.repeat_hits)
        summary: dict[str, Any] = {"cold": cold, "warm": warm}
        if args.first_call_probes:
            summary["first_call_probes"] = [spawn_child("first-call", v, cache) for _ in range(args.first_call_probes)]
        if "error" not in cold and "error" not in warm:
            wc = warm["counters"]
            summary["verdict"] = {
                "warm_zero_compiles": wc["compiles"] == 0 and wc["hits"] >= 1 and wc["misses"] == 0,
                "bitwise_equal": bool(warm.get("bitwise_equal_to_ref")),
                "same_digest": cold["digest"] == warm["digest"],
                "compile_s": cold.get("compile_s"),
                "persist_s": cold.get("persist_s"),
                "warm_load_ms_first": warm.get("load_ms"),
                "warm_cached_compile_ms_first": round(warm["cached_compile_s"] * 1e3, 3),
                "warm_hit_ms_p50": warm.get("repeat_hits", {}).get("hit_ms_p50"),
                "warm_loaded_from": "shared object" if wc.get("shared_loads") else "object",
                "object_load_ms_p50_same_process": warm.get("repeat_hits", {}).get("dsl_load_ms_p50"),
                "exit_codes_cold_warm": [cold.get("exit_code"), warm.get("exit_code")],
                "speedup_compile_over_first_hit": round(cold["compile_s"] * 1e3 / warm["load_ms"], 1) if warm.get("load_ms") else None,
                "kernel_ms_cold": cold["kernel_ms"],
                "kernel_ms_warm": warm["kernel_ms"],
                "kernel_time_ratio_warm_over_cold": round(warm["kernel_ms"] / cold["kernel_ms"], 4),
                "tflops_cold_warm": [cold["tflops"], warm["tflops"]],
                "max_abs_err_vs_fp32": [cold["max_abs_err"], warm["max_abs_err"]],
            }
        result["variants"][v] = summary
    outs = {v: (work / f"out-{v}.bin") for v in active_variants()}
    if len(outs) == 2 and all(p.exists() for p in outs.values()):
        result["tvm_and_plain_outputs_bitwise_equal"] = outs["tvm"].read_bytes() == outs["plain"].read_bytes()

    cubins = [Path(c) for v in active_variants() for d in entry_dirs(work / f"cache-{v}") for c in sorted(glob.glob(str(d / "cubin-*.cubin")))]
    result["device_cubins"] = {str(c.relative_to(work)): sha(c.read_bytes()) for c in cubins}

    if args.offline and Path(args.offline).is_dir():
        check = spawn(__file__, ["offline-check", "--offline", args.offline, "--work", str(work)])
        # Warm children on copies of the offline roots: does the GPU box hit what the CPU box built?
        check["warm_on_offline_cache"] = {}
        for build_dir in sorted(Path(args.offline).iterdir()):
            if not (build_dir / "cache").is_dir():
                continue
            per: dict[str, Any] = {}
            for v in active_variants():
                copy = work / f"offline-{build_dir.name}-{v}"
                shutil.copytree(build_dir / "cache", copy)
                r = spawn_child("warm", v, copy, ref=work / f"out-{v}.bin")
                per[v] = {k: r.get(k) for k in ("counters", "events", "digest", "load_ms", "compile_s", "bitwise_equal_to_ref", "kernel_ms", "tflops", "error",
                                                "stderr_tail", "exit_code")}
            check["warm_on_offline_cache"][build_dir.name] = per
        check["date_utc"] = result["date_utc"]
        check["device"] = result["device"]
        check["versions"] = result["versions"]
        (out / f"h200_offline_vs_device{tag}.json").write_text(json.dumps(check, indent=1, default=str))
        extra = [Path(c) for c in glob.glob(str(Path(args.offline) / "*" / "cache" / "v1" / "*" / "*" / "*" / "cubin-*.cubin"))]
        cubins += extra
    if args.sm120_cubins:
        cubins += sorted(Path(p) for p in glob.glob(os.path.join(args.sm120_cubins, "*.cubin")))

    if args.floor_bin and Path(args.floor_bin).exists() and cubins:
        text, medians = run_floor(args.floor_bin, cubins)
        (out / f"driver_floor_sm90{tag}.txt").write_text(text)
        result["driver_floor_us"] = medians
        for v in active_variants():
            own = [medians[str(c)] for c in cubins if f"cache-{v}" in str(c) and str(c) in medians]
            verdict = result["variants"][v].get("verdict")
            if own and verdict and verdict.get("warm_hit_ms_p50"):
                verdict["driver_floor_load_us"] = own[0]
                verdict["warm_hit_over_floor"] = round(verdict["warm_hit_ms_p50"] * 1e3 / own[0], 2)

    (out / f"gpu_proof_sm90{tag}.json").write_text(json.dumps(result, indent=1, default=str))
    if args.tar_entries:  # at most 8 files come back from the device: one archive of all entries
        import tarfile

        with tarfile.open(out / f"device_entries{tag}.tar.gz", "w:gz") as tar:
            for d in sorted(work.glob("cache-*")):
                tar.add(d, arcname=d.name)
    print(json.dumps({v: result["variants"][v].get("verdict", result["variants"][v]) for v in active_variants()}, indent=1, default=str))
    return 0


# --------------------------------------------------------------------------------------------


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("all", help="on the GPU: cold and warm in fresh processes, both exports")
    a.add_argument("--out", required=True, help="where the JSON results go")
    a.add_argument("--work", default="/tmp/gpu_proof_sm90", help="scratch: caches and output bytes (wiped)")
    a.add_argument("--offline", help="folder of offline builds (<name>/cache + <name>/offline_build.json)")
    a.add_argument("--floor-bin", help="csrc/cubin_load_floor binary")
    a.add_argument("--sm120-cubins", help="folder of sm_120 cubins, to show they cannot load here")
    a.add_argument("--repeat-hits", type=int, default=20)
    a.add_argument("--tar-entries", action="store_true")
    a.add_argument("--tag", help="suffix for the result file names (e.g. pinned_host)")
    a.add_argument("--variants", help="comma list of tvm,plain (default both)")
    a.add_argument("--first-call-probes", type=int, default=0, help="fresh processes timing the first hit's pieces")
    c = sub.add_parser("child", help="one fresh process")
    c.add_argument("--phase", choices=("cold", "warm", "first-call"), required=True)
    c.add_argument("--variant", choices=VARIANTS, required=True)
    c.add_argument("--cache", required=True)
    c.add_argument("--save")
    c.add_argument("--ref")
    c.add_argument("--repeat-hits", type=int, default=0)
    b = sub.add_parser("offline-build", help="on a CPU box: compile for the h200 profile")
    b.add_argument("--cache", required=True)
    b.add_argument("--record", required=True, help="JSON file describing the build")
    b.add_argument("--variants", help="comma list of tvm,plain (default both)")
    k = sub.add_parser("offline-check", help="on the GPU: compare offline entries with device ones")
    k.add_argument("--offline", required=True)
    k.add_argument("--work", required=True)
    args = ap.parse_args()
    if getattr(args, "variants", None):
        os.environ[VARIANTS_ENV] = args.variants

    if args.mode == "all":
        return run_all(args)
    if args.mode == "child":
        fn = run_first_call_probe if args.phase == "first-call" else run_child
        emit(fn(args))
        return 0
    if args.mode == "offline-build":
        res = run_offline_build(args)
        Path(args.record).write_text(json.dumps(res, indent=1, default=str))
        print(json.dumps(res, indent=1, default=str))
        return 0
    if args.mode == "offline-check":
        emit(run_offline_check(args))
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
