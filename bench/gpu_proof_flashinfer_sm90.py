#!/usr/bin/env python3
"""GPU proof on an H200 (sm_90), part two: a *flashinfer* CuTe-DSL kernel built offline.

Why: ``bench/gpu_proof_sm90.py`` showed that the CUTLASS Hopper GEMM example compiles to the
same cubin on a CPU box (``h200`` target profile) as on the H200. flashinfer's own kernels are
the product's real customers, and their compile sites differ from the example in ways that
matter offline: they build the compile-time description of their arguments from *real*
tensors (``from_dlpack``), read the current CUDA stream, and export through tvm-ffi. This
script proves the offline path for one of them: flashinfer 0.6.15.post1's gated-delta-rule
decode kernel, pretranspose layout (``flashinfer/gdn_kernels/gdn_decode_pretranspose.py``,
"Requires SM90+"), the kernel behind ``gated_delta_rule_decode_pretranspose`` for fp32 state.

The compile arguments are flashinfer's own: we call flashinfer's ``run_pretranspose_decode``
and route the one ``cute.compile`` it makes through ``cute_diskcache.cached_compile`` (same
function, same arguments, same ``--enable-tvm-ffi`` options); nothing of flashinfer is copied.
The module is loaded from the installed flashinfer by file, under its real name, because it
needs only torch and the DSL, while importing the ``flashinfer`` package would need its whole
dependency set on the GPU box (which cannot install anything).

Modes:

``offline-build`` (CPU box, no GPU)
    ``targets.apply("h200")`` before the module is loaded, the profile's driver attributes,
    ``flashinfer_sites.offline.cuda_presenting`` on the module's ``from_dlpack`` (CPU tensors go in as CUDA
    ones), then flashinfer's call with CPU tensors; the compile is persisted and the launch
    skipped. ``--no-present`` leaves ``from_dlpack`` alone: the control that shows why the
    presenting is needed. ``--variant plain-pinned`` pins the host target (see
    ``VARIANT_OPTIONS``). Records every device query the compile made.
``all`` (GPU)
    A cold child (compile + persist + run, output bytes saved), a warm child (must hit with
    zero compiles, output compared bitwise), then for each offline build: entry comparison
    (key, namespace, environment, object, cubins, MLIR), a child that runs the *offline
    object* through flashinfer's call, and a warm child on a copy of the offline cache. An
    offline build of another variant (``plain-pinned``, see ``VARIANT_OPTIONS``) is compared
    with the same variant compiled here (compile only: that variant is not flashinfer's).
    Writes ``gpu_proof_flashinfer_sm90.json`` and a tarball of the device's entries.
``child`` (GPU)
    One fresh process of the above.
``explain`` (CPU box, after the GPU run)
    Object differences between the device's and the offline entries, section by section,
    and the host code's instruction multisets (``objdump``); writes
    ``h200_flashinfer_offline_vs_device.json``.

Reproduce (results and their reading: ``bench/results/gpu_proof_sm90.md``, section 5)::

    F=bench/gpu_proof_flashinfer_sm90.py
    python $F offline-build --cache .dev/gdn/offline/A/cache --record .dev/gdn/offline/A/offline_build.json
    python $F offline-build --variant plain-pinned --cache .dev/gdn/offline/A_plain_pinned/cache \
        --record .dev/gdn/offline/A_plain_pinned/offline_build.json
    python $F offline-build --cache .dev/gdn/repeat/A_again/cache --record .dev/gdn/repeat/A_again/offline_build.json
    python $F offline-build --no-present --cache .dev/gdn/control/cache --record .dev/gdn/control/offline_build.json
    # on the GPU box (DSL wheels as ../shared/device/README.md says; carry .dev/gdn/offline):
    python3 $F all --out OUT --offline .dev/gdn/offline
    # back here, with OUT fetched:
    python $F explain --device-json OUT/gpu_proof_flashinfer_sm90.json \
        --device-entries OUT/device_entries_flashinfer.tar.gz --offline .dev/gdn/offline \
        --extra .dev/gdn/repeat/A_again .dev/gdn/control --out bench/results
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_harness as g  # noqa: E402  (entry comparison, ELF sections, device facts, versions; cold means cold)

log = logging.getLogger("gpu_proof_flashinfer_sm90")

KERNEL_MODULE = "flashinfer.gdn_kernels.gdn_decode_pretranspose"
KERNEL_FILE = "gdn_kernels/gdn_decode_pretranspose.py"
#: Qwen3-Next-like GDN decode: 16 q/k heads, 32 v heads, head dims 128, one token, fp32 state.
B, T, H, HV, K, V = 64, 1, 16, 32, 128, 128
SEED = 20261203
PROFILE = "h200"
#: ``tvm``: flashinfer's own options (``--enable-tvm-ffi``). ``plain-pinned``: the same call with
#: flashinfer's options replaced by a pinned host target, exported through ``dump_to_object``.
#: Not what flashinfer runs (the DSL refuses ``--host-target`` with tvm-ffi, and the plain
#: kernel takes other launch arguments), only there to show which bytes the host CPU decides.
VARIANT_OPTIONS = {"tvm": None, "plain-pinned": "--host-target 'llvm -mtriple=x86_64-unknown-linux-gnu -mcpu=x86-64-v2'"}


# --------------------------------------------------------------------------------------------
# The kernel: flashinfer's module and flashinfer's own call
# --------------------------------------------------------------------------------------------


def kernel_path() -> Path:
    spec = importlib.util.find_spec("flashinfer")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("flashinfer is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / KERNEL_FILE


def load_kernel_module() -> Any:
    """flashinfer's GDN decode module under its real name (the cache key hashes its source by name)."""
    return g.import_file_as(KERNEL_MODULE, kernel_path())


def problem_key() -> dict[str, Any]:
    """What the compile depends on besides the module's source (cached_compile adds that):
    flashinfer keys the same call on (T, H, HV, K, V, q.dtype, scale, l2norm, pool...)."""
    return {"fn": "run_pretranspose_decode", "B": B, "T": T, "H": H, "HV": HV, "K": K, "V": V, "qkv_dtype": "bf16", "ab_dtype": "bf16", "state_dtype": "f32", "A_log_dt_bias_dtype": "f32", "scale": K**-0.5, "use_qk_l2norm": True, "use_pool_indexing": False}


class CompileOnly(Exception):
    """Raised after the offline compile persisted: a CPU box cannot launch the kernel."""


class CompileRoute:
    """While active, flashinfer's ``cute.compile`` goes through ``cached_compile`` (``cache``
    mode) or returns a given object's kernel (``inject`` mode: run an offline-built object
    through flashinfer's own launch). Everything flashinfer passes is passed on unchanged."""

    def __init__(self, mode: str, *, compile_only: bool = False, inject: Any = None, options: str | None = None) -> None:
        self.mode = mode
        self.options = options  # replaces flashinfer's options (the plain-pinned variant only)
        self.compile_only = compile_only
        self.inject = inject
        self.calls: list[dict[str, Any]] = []
        self.active = False  # True while inside the routed compile (the spies tag queries with it)
        self._inside = False

    def __enter__(self) -> "CompileRoute":
        import cutlass.cute as cute

        import cute_diskcache

        self._cute = cute
        self._real = real = cute.compile

        def routed(fn: Any, *args: Any, **kwargs: Any) -> Any:
            if self._inside:  # cached_compile's own cute.compile call
                return real(fn, *args, **kwargs)
            options = kwargs.pop("options", None)
            if self.options is not None:
                options = self.options
            rec: dict[str, Any] = {"fn": getattr(fn, "__qualname__", repr(fn)), "options": options, "n_args": len(args), "kwargs": {k: (v if isinstance(v, (int, float, bool, str)) else type(v).__name__) for k, v in kwargs.items()}}
            self._inside = self.active = True
            t0 = time.perf_counter()
            try:
                if self.mode == "inject":
                    kernel = self.inject()
                else:
                    kernel = cute_diskcache.cached_compile(fn, *args, key=problem_key(), options=options, **kwargs)
            finally:
                self._inside = self.active = False
            rec["seconds"] = round(time.perf_counter() - t0, 5)
            self.calls.append(rec)
            if self.compile_only:
                raise CompileOnly
            return kernel

        cute.compile = routed
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cute.compile = self._real


class DeviceSpy:
    """Record every device fact read while active, without answering anything itself.

    Driver attributes through the DSL's ``get_device_attribute`` (on the CPU box the product's
    hook answers them from the profile; here only recorded), the DSL's compute-capability
    query, and torch's device queries (``get_device_properties`` fields as they are read).
    Each record says whether it happened inside the compile or in flashinfer's launch code.
    """

    TORCH_FNS = ("get_device_properties", "get_device_capability", "get_device_name", "current_stream", "current_device", "device_count", "is_current_stream_capturing")

    def __init__(self, route: CompileRoute) -> None:
        self.route = route
        self.calls: list[dict[str, Any]] = []
        self._undo: list[Callable[[], None]] = []

    def _add(self, **rec: Any) -> None:
        rec["in_compile"] = self.route.active
        self.calls.append(rec)

    def _patch(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        orig = getattr(owner, name, None)
        if orig is None:
            return
        setattr(owner, name, make(orig))
        self._undo.append(lambda: setattr(owner, name, orig))

    def __enter__(self) -> "DeviceSpy":
        import cutlass.base_dsl.env_manager as envm
        import cutlass.base_dsl.runtime.cuda as rc
        import torch

        try:  # the product's attribute hook goes in first; the spy wraps it (and keeps it)
            from cute_diskcache.keys import devicefacts

            devicefacts.install_hook()
        except ImportError:
            pass

        def wrap_attr(orig: Callable[..., Any]) -> Callable[..., Any]:
            def get_device_attribute(attribute: Any, device_id: int = 0) -> Any:
                value = orig(attribute, device_id)
                self._add(fn="get_device_attribute", attribute=getattr(attribute, "name", str(attribute)), value=int(value))
                return value

            # The product's hook installs itself once, recognising itself by this attribute.
            get_device_attribute._cdc_real = getattr(orig, "_cdc_real", orig)  # type: ignore[attr-defined]
            return get_device_attribute

        def wrap_cc(orig: Callable[..., Any]) -> Callable[..., Any]:
            def get_compute_capability_major_minor(*a: Any, **kw: Any) -> Any:
                value = orig(*a, **kw)
                self._add(fn="get_compute_capability_major_minor", value=list(value))
                return value

            return get_compute_capability_major_minor

        spy = self

        class PropsView:
            def __init__(self, props: Any) -> None:
                object.__setattr__(self, "_p", props)

            def __getattr__(self, name: str) -> Any:
                value = getattr(object.__getattribute__(self, "_p"), name)
                spy._add(fn="get_device_properties()." + name, value=value if isinstance(value, (int, str, bool)) else repr(value)[:80])
                return value

        def wrap_torch(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
            def make(orig: Callable[..., Any]) -> Callable[..., Any]:
                def wrapped(*a: Any, **kw: Any) -> Any:
                    value = orig(*a, **kw)
                    if name == "get_device_properties":
                        self._add(fn="torch.cuda.get_device_properties")
                        return PropsView(value)
                    shown = getattr(value, "cuda_stream", value) if name == "current_stream" else value
                    self._add(fn=f"torch.cuda.{name}", value=shown if isinstance(shown, (int, str, bool, tuple)) else repr(shown)[:80])
                    return value

                return wrapped

            return make

        self._patch(rc, "get_device_attribute", wrap_attr)
        self._patch(rc, "get_compute_capability_major_minor", wrap_cc)
        self._patch(envm, "get_compute_capability_major_minor", wrap_cc)
        for name in self.TORCH_FNS:
            self._patch(torch.cuda, name, wrap_torch(name))
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in reversed(self._undo):
            undo()

    def summary(self) -> dict[str, Any]:
        """Distinct facts read, with their values, split by compile vs launch code."""
        out: dict[str, dict[str, Any]] = {"inside_cute_compile": {}, "flashinfer_code_around_it": {}}
        for c in self.calls:
            where = "inside_cute_compile" if c["in_compile"] else "flashinfer_code_around_it"
            name = c["fn"] + (f"({c['attribute']})" if "attribute" in c else "")
            slot = out[where].setdefault(name, {"count": 0, "values": []})
            slot["count"] += 1
            if c.get("value") not in slot["values"]:
                slot["values"].append(c.get("value"))
        return out


class Problem:
    """flashinfer's arguments for ``gated_delta_rule_decode_pretranspose`` with fp32 state,
    made as ``gdn_decode.py`` makes them before it calls ``run_pretranspose_decode``."""

    def __init__(self, device: str) -> None:
        import torch

        self.device = device
        gen = torch.Generator(device=device).manual_seed(SEED)

        def rnd(*shape: int, dtype: Any, scale: float = 1.0) -> Any:
            return (torch.randn(*shape, device=device, dtype=torch.float32, generator=gen) * scale).to(dtype)

        bf = torch.bfloat16
        self.q = rnd(B, T, H, K, dtype=bf)
        self.k = rnd(B, T, H, K, dtype=bf)
        self.v = rnd(B, T, HV, V, dtype=bf)
        self.a = rnd(B, T, HV, dtype=bf)
        self.b = rnd(B, T, HV, dtype=bf)
        self.A_log = rnd(HV, dtype=torch.float32, scale=0.5)
        self.dt_bias = rnd(HV, dtype=torch.float32, scale=0.5)
        self.state0 = rnd(B, HV, V, K, dtype=torch.float32, scale=0.1)
        self.state = self.state0.clone()
        self.output = torch.zeros((B, T, HV, V), dtype=bf, device=device)

    def reset(self) -> None:
        self.state.copy_(self.state0)
        self.output.zero_()

    def call(self, mod: Any) -> None:
        """flashinfer's call, exactly as ``gated_delta_rule_decode_pretranspose`` makes it."""
        mod.run_pretranspose_decode(self.state.reshape(B * HV, V, K), self.A_log, self.a, self.dt_bias, self.q, self.k, self.v, self.b, self.output, B, T, H, HV, K, V, K**-0.5, True, use_pool_indexing=False, initial_state_indices=None, output_state_indices=None)

    def result_bytes(self) -> tuple[bytes, bytes]:
        import torch

        def raw(t: Any) -> bytes:
            return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()

        return raw(self.output), raw(self.state)

    def sanity(self) -> dict[str, Any]:
        import torch

        o = self.output.float()
        return {"output_finite": bool(torch.isfinite(o).all()), "output_absmax": float(o.abs().max()), "output_nonzero": int((o != 0).sum()), "state_finite": bool(torch.isfinite(self.state).all()), "state_changed_elems": int((self.state != self.state0).sum())}


def time_calls(fn: Callable[[], Any], reps: int = 10, inner: int = 20, warmup: int = 10) -> dict[str, Any]:
    """Median per-call GPU time over batches of back-to-back calls of flashinfer's function
    (CUDA events), and the host-side time per call (flashinfer's Python wrapper + launch)."""
    per, host = g.gpu_batches(fn, reps, inner, warmup)
    ms = statistics.median(per)
    state_bytes = 2 * B * HV * V * K * 4  # read + write of the fp32 state dominates the traffic
    return {"call_ms": round(ms, 5), "call_ms_batches": [round(x, 5) for x in per], "host_ms_per_call_p50": round(statistics.median(host), 5),
            "state_traffic_TBps": round(state_bytes / (ms * 1e-3) / 1e12, 2)}


# --------------------------------------------------------------------------------------------
# child: one fresh process on the GPU
# --------------------------------------------------------------------------------------------


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["CUTE_DISKCACHE_DIR"] = args.cache
    t_start = time.perf_counter()
    import torch

    import cute_diskcache  # noqa: F401
    from cute_diskcache.keys import hostcpu
    from cute_diskcache.storage import entry, loader
    from cute_diskcache.core.cache import default_cache  # noqa: F401  (import cost kept out of the measured call)

    res: dict[str, Any] = {"phase": args.phase, "cache": args.cache}
    problem = Problem("cuda")  # CUDA context first: compile/load times exclude its creation
    mod = load_kernel_module()
    res["startup_s"] = round(time.perf_counter() - t_start, 3)
    res["runtime_preload_ms"] = round(loader.preload() * 1e3, 3)  # what install() does at attach

    inject = None
    if args.phase == "inject":
        edir = Path(args.inject)
        manifest = entry.read_manifest(edir)
        obj = entry.verify(edir, manifest, None)  # checksums only: the key is not ours to check
        res["injected"] = {"dir": str(edir), "digest": manifest["digest"], "symbol": manifest["symbol"], "object_sha256": g.sha(obj)}
        inject = lambda: loader.load_object(obj, manifest["symbol"], manifest["tvm_ffi"])  # noqa: E731
    compile_only = args.phase == "compile"  # the plain-pinned variant: compile + persist, no launch
    route = CompileRoute("inject" if inject else "cache", inject=inject, compile_only=compile_only, options=VARIANT_OPTIONS[args.variant])
    with route, DeviceSpy(route) as spy:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            problem.call(mod)  # compile (or hit, or inject) + first launch
        except CompileOnly:
            pass
        torch.cuda.synchronize()
        res["first_call_s"] = round(time.perf_counter() - t0, 5)
    res["compile_calls"] = route.calls
    res["device_reads"] = spy.summary()
    g.record_cache_outcome(res)
    if compile_only:
        return res

    out, state = problem.result_bytes()
    res["output_sha256"], res["state_sha256"] = g.sha(out), g.sha(state)
    res.update(problem.sanity())
    # Same inputs again in this process: the kernel is deterministic, so any difference across
    # builds below is the build's, not the run's.
    problem.reset()
    problem.call(mod)
    torch.cuda.synchronize()
    res["rerun_bitwise_equal"] = problem.result_bytes() == (out, state)
    if args.save:
        Path(args.save + ".out").write_bytes(out)
        Path(args.save + ".state").write_bytes(state)
    if args.ref:
        ref_out, ref_state = Path(args.ref + ".out").read_bytes(), Path(args.ref + ".state").read_bytes()
        res["bitwise_equal_to_ref"] = {"output": out == ref_out, "state": state == ref_state}
    res.update(time_calls(lambda: problem.call(mod)))
    if args.phase == "cold":
        facts = g.live_device_facts()
        prof = __import__("cute_diskcache.keys.targets", fromlist=["get"]).get(PROFILE).facts()
        res["h200_profile_vs_live"] = {k: {"profile": prof.get(k), "live": facts.get(k), "equal": prof.get(k) == facts.get(k)} for k in ("device_name", "capability", "sm_count", "max_shared_memory_per_multiprocessor", "max_shared_memory_per_block_optin", "total_memory", "max_active_clusters_1")}
        res["host_isa"] = list(hostcpu.isa_extensions())
    res["process_s"] = round(time.perf_counter() - t_start, 3)
    return res


def child_argv(phase: str, cache: Path, *, save: Path | None = None, ref: Path | None = None, inject: Path | None = None, variant: str = "tvm") -> list[str]:
    argv = ["child", "--phase", phase, "--cache", str(cache), "--variant", variant]
    for flag, value in (("--save", save), ("--ref", ref), ("--inject", inject)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


# --------------------------------------------------------------------------------------------
# all: the parent on the GPU
# --------------------------------------------------------------------------------------------


def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    result: dict[str, Any] = {
        "what": f"flashinfer {KERNEL_FILE} (GDN decode, pretranspose, fp32 state) through cute_diskcache.cached_compile, driven by flashinfer's run_pretranspose_decode",
        "problem": {"B": B, "T": T, "H": H, "HV": HV, "K": K, "V": V, "seed": SEED, "key": problem_key()},
        "kernel_file_sha256": g.sha(kernel_path().read_bytes()),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host_cpu": g.host_cpu(),
        "device": g.device_info(),
        "versions": g.versions(),
    }
    dev_cache, ref = work / "cache-dev", work / "ref"
    result["cold"] = cold = g.spawn(__file__, child_argv("cold", dev_cache, save=ref))
    result["warm"] = warm = g.spawn(__file__, child_argv("warm", dev_cache, ref=ref))
    if "error" not in cold and "error" not in warm:
        wc = warm["counters"]
        result["verdict"] = {
            "warm_zero_compiles": wc["compiles"] == 0 and wc["hits"] >= 1 and wc["misses"] == 0,
            "warm_bitwise_equal": warm.get("bitwise_equal_to_ref"),
            "compile_s": cold.get("compile_s"),
            "persist_s": cold.get("persist_s"),
            "warm_load_ms": warm.get("load_ms"),
            "compile_over_load": round(cold["compile_s"] * 1e3 / warm["load_ms"], 1) if warm.get("load_ms") and cold.get("compile_s") else None,
            "call_ms_cold_warm": [cold.get("call_ms"), warm.get("call_ms")],
        }

    from cute_diskcache.storage import entry  # noqa: F401  (the comparison reads entries through it)

    device_caches = {"tvm": dev_cache}
    result["device_compiles"] = {}
    result["offline"] = {}
    if args.offline and Path(args.offline).is_dir() and g.entry_dirs(dev_cache):
        for build_dir in sorted(p for p in Path(args.offline).iterdir() if (p / "cache").is_dir()):
            info: dict[str, Any] = {}
            rec = build_dir / "offline_build.json"
            if rec.exists():
                info["build_record"] = json.loads(rec.read_text())
            variant = info.get("build_record", {}).get("variant", "tvm")
            if variant not in device_caches:  # compile the same variant here (no launch)
                device_caches[variant] = work / f"cache-dev-{variant}"
                result["device_compiles"][variant] = g.spawn(__file__, child_argv("compile", device_caches[variant], variant=variant))
            dirs = g.entry_dirs(build_dir / "cache")
            dev_dirs = g.entry_dirs(device_caches[variant])
            if not dirs or not dev_dirs:
                info["error"] = "no offline entry" if not dirs else "no device entry"
                result["offline"][build_dir.name] = info
                continue
            dev = g.read_entry(dev_dirs[0])
            off = g.read_entry(dirs[0])
            try:
                info["compare"] = g.compare_entries(dev, off)
            except Exception as exc:
                info["compare"] = {"error": f"{type(exc).__name__}: {exc}"}
            info["host_isa_offline_minus_device"] = sorted(set(off["manifest"].get("host_isa") or []) - set(cold.get("host_isa") or []))
            if variant != "tvm":
                result["offline"][build_dir.name] = info
                continue
            # The offline object, run through flashinfer's own launch on this GPU, whatever its key says.
            info["run_offline_object"] = g.spawn(__file__, child_argv("inject", work / f"cache-inject-{build_dir.name}", ref=ref, inject=dirs[0]))
            # And the cache's own verdict on a copy of that root: hit, or a miss and why.
            copy = work / f"offline-{build_dir.name}"
            shutil.copytree(build_dir / "cache", copy)
            info["warm_on_offline_cache"] = g.spawn(__file__, child_argv("warm", copy, ref=ref))
            result["offline"][build_dir.name] = info

    (out / "gpu_proof_flashinfer_sm90.json").write_text(json.dumps(result, indent=1, default=str))
    with tarfile.open(out / "device_entries_flashinfer.tar.gz", "w:gz") as tar:
        for variant, root in device_caches.items():
            if (root / "v1").is_dir():
                tar.add(root / "v1", arcname=("cache-dev" if variant == "tvm" else f"cache-dev-{variant}") + "/v1")
    brief = {"verdict": result.get("verdict"), "errors": {k: result[k].get("error") for k in ("cold", "warm") if "error" in result[k]}}
    for name, info in result["offline"].items():
        c = info.get("compare", {})
        r = info.get("run_offline_object", {})
        w = info.get("warm_on_offline_cache", {})
        brief[name] = {"digest_equal": c.get("digest_equal"), "cubins_identical": c.get("cubins_identical"), "mlir_identical": c.get("mlir_identical"), "object_identical": c.get("object", {}).get("identical"), "run_bitwise": r.get("bitwise_equal_to_ref"), "run_error": r.get("error"), "warm_counters": w.get("counters"), "warm_bitwise": w.get("bitwise_equal_to_ref")}
    print(json.dumps(brief, indent=1, default=str))
    return 0


# --------------------------------------------------------------------------------------------
# offline-build (CPU box)
# --------------------------------------------------------------------------------------------


def run_offline_build(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["CUTE_DISKCACHE_DIR"] = args.cache
    from cute_diskcache.keys import targets

    profile = targets.apply(PROFILE)  # before flashinfer's module: CUTE_DSL_ARCH and torch's device queries
    import cute_diskcache
    from cute_diskcache.keys import hostcpu
    from cute_diskcache.keys import key as keymod
    from cute_diskcache.core.cache import default_cache

    mod = load_kernel_module()
    from cute_diskcache.keys import devicefacts
    from cute_diskcache.flashinfer_sites.offline import cuda_presenting

    devicefacts.install_hook()  # the DSL's driver attribute queries answered from the profile
    if not args.no_present:
        mod.from_dlpack = cuda_presenting(mod.from_dlpack)
    res: dict[str, Any] = {
        "profile": profile.facts(),
        "cuda_presenting": not args.no_present,
        "variant": args.variant,
        "options": VARIANT_OPTIONS[args.variant] or "flashinfer's own",
        "python": platform.python_version(),
        "host_cpu": g.host_cpu(),
        "host_isa": list(hostcpu.isa_extensions()),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "kernel_file_sha256": g.sha(kernel_path().read_bytes()),
        "dsl_stack": keymod.dsl_stack_string(),
        "arch": keymod.current_arch(),
    }
    problem = Problem("cpu")
    route = CompileRoute("cache", compile_only=True, options=VARIANT_OPTIONS[args.variant])
    with route, DeviceSpy(route) as spy:
        t0 = time.perf_counter()
        try:
            problem.call(mod)
            res["error"] = "flashinfer's call returned without compiling"
        except CompileOnly:
            pass
        except Exception as exc:  # the --no-present control: the DSL refuses the CPU tensors
            res["error"] = f"{type(exc).__name__}: " + " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).split())[:600]
        res["call_s"] = round(time.perf_counter() - t0, 4)
    if default_cache().events:
        ev = default_cache().events[-1]
        res.update({"digest": ev[1], "kind": ev[2], "compile_s": round(ev[3], 4), "persist_s": round(ev[4], 4)})
    res["compile_calls"] = route.calls
    res["device_reads"] = spy.summary()
    res["counters"] = cute_diskcache.counters()
    return res


# --------------------------------------------------------------------------------------------
# explain (CPU box, after the GPU run): where the objects differ and why
# --------------------------------------------------------------------------------------------


def _host_code(obj: bytes) -> list[str]:
    """The host code's instructions, in order (``objdump`` of ``.ltext``), operands included."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".o") as fh:
        fh.write(obj)
        fh.flush()
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-j", ".ltext", fh.name], capture_output=True, text=True, check=True).stdout
    seq = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 2 and parts[0].strip().endswith(":"):
            seq.append(" ".join(parts[1].split()))
    return seq


def host_code_compare(a: bytes, b: bytes) -> dict[str, Any]:
    """How two objects' host code differs: same instructions in another order, or other ones."""
    sa, sb = _host_code(a), _host_code(b)
    ma, mb = Counter(x.split()[0] for x in sa), Counter(x.split()[0] for x in sb)
    return {
        "instructions": [len(sa), len(sb)],
        "same_sequence": sa == sb,
        "same_instruction_multiset": Counter(sa) == Counter(sb),
        "same_mnemonic_multiset": ma == mb,
        "mnemonics_only_device": dict((ma - mb).most_common(25)),
        "mnemonics_only_offline": dict((mb - ma).most_common(25)),
    }


def section_table(a: bytes, b: bytes) -> dict[str, Any]:
    """Per ELF section: size in each object and whether the contents are equal."""
    sa = {n: a[o : o + z] for n, o, z in g.elf_sections(a) if n}
    sb = {n: b[o : o + z] for n, o, z in g.elf_sections(b) if n}
    return {n: {"device": len(sa.get(n, b"")), "offline": len(sb.get(n, b"")), "equal": sa.get(n) == sb.get(n)} for n in sorted(set(sa) | set(sb))}


def run_explain(args: argparse.Namespace) -> dict[str, Any]:
    device_json = json.loads(Path(args.device_json).read_text())
    tmp = Path(args.work)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(args.device_entries) as tar:
        tar.extractall(tmp, filter="data")
    res: dict[str, Any] = {"device_run": {k: device_json.get(k) for k in ("date_utc", "host_cpu", "device", "versions", "verdict")}, "builds": {}}
    builds = [p for p in sorted(Path(args.offline).iterdir()) if (p / "cache").is_dir()] + [Path(p) for p in args.extra]
    for build in builds:
        rec = build / "offline_build.json"
        record = json.loads(rec.read_text()) if rec.exists() else {}
        entries = g.entry_dirs(build / "cache")
        if not entries:
            res["builds"][build.name] = {"build_record": record, "error": "no offline entry"}
            continue
        variant = record.get("variant", "tvm")
        dev_root = tmp / ("cache-dev" if variant == "tvm" else f"cache-dev-{variant}")
        dev_entries = g.entry_dirs(dev_root)
        if not dev_entries:
            res["builds"][build.name] = {"build_record": record, "error": f"no device entry for {variant}"}
            continue
        dev, off = g.read_entry(dev_entries[0]), g.read_entry(entries[0])
        cmp = g.compare_entries(dev, off)
        cmp["variant"] = variant
        if dev["object"] != off["object"]:
            cmp["sections_by_content"] = section_table(dev["object"], off["object"])
            cmp["host_code"] = host_code_compare(dev["object"], off["object"])
        if not cmp.get("mlir_identical") and dev["mlir"] and off["mlir"]:
            import difflib

            cmp["mlir_diff_head"] = list(difflib.unified_diff(dev["mlir"].splitlines(), off["mlir"].splitlines(), "device", build.name, n=0, lineterm=""))[:40]
        cmp["build_record"] = record
        res["builds"][build.name] = cmp
    return res


# --------------------------------------------------------------------------------------------


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("all", help="on the GPU: cold, warm, offline checks in fresh processes")
    a.add_argument("--out", required=True)
    a.add_argument("--work", default="/tmp/gpu_proof_flashinfer_sm90")
    a.add_argument("--offline", help="folder of offline builds (<name>/cache + <name>/offline_build.json)")
    c = sub.add_parser("child", help="one fresh process on the GPU")
    c.add_argument("--phase", choices=("cold", "warm", "inject", "compile"), required=True)
    c.add_argument("--variant", choices=tuple(VARIANT_OPTIONS), default="tvm")
    c.add_argument("--cache", required=True)
    c.add_argument("--save")
    c.add_argument("--ref")
    c.add_argument("--inject", help="entry folder whose object is run instead of compiling")
    b = sub.add_parser("offline-build", help="on a CPU box: compile for the h200 profile")
    b.add_argument("--cache", required=True)
    b.add_argument("--record", required=True)
    b.add_argument("--no-present", action="store_true", help="control: CPU tensors reach from_dlpack as CPU tensors")
    b.add_argument("--variant", choices=tuple(VARIANT_OPTIONS), default="tvm")
    e = sub.add_parser("explain", help="on the CPU box: object differences, host code")
    e.add_argument("--device-json", required=True)
    e.add_argument("--device-entries", required=True)
    e.add_argument("--offline", required=True)
    e.add_argument("--extra", nargs="*", default=[], help="more build folders (a repeat, the --no-present control)")
    e.add_argument("--work", default="/tmp/gpu_proof_flashinfer_explain")
    e.add_argument("--out", required=True)
    args = ap.parse_args()

    if args.mode == "all":
        return run_all(args)
    if args.mode == "child":
        g.emit(run_child(args))
        return 0
    if args.mode == "offline-build":
        res = run_offline_build(args)
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(res, indent=1, default=str))
        print(json.dumps({k: res[k] for k in ("digest", "kind", "compile_s", "error", "device_reads", "host_cpu") if k in res}, indent=1, default=str))
        return 0
    if args.mode == "explain":
        res = run_explain(args)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "h200_flashinfer_offline_vs_device.json").write_text(json.dumps(res, indent=1, default=str))
        print(json.dumps({n: {k: b.get(k) for k in ("variant", "error", "digest_equal", "env_differences", "cubins_identical", "mlir_identical", "object", "object_sha256", "host_code")} for n, b in res["builds"].items()}, indent=1, default=str))
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
