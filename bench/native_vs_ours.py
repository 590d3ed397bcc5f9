"""flashinfer >= 0.6.18's natively cached MoE kernels: its own cache vs ours, side by side.

flashinfer 0.7.4 persists moe_dispatch's micro, static and dynamic kernels itself
(``build_and_load_cute_dsl_kernel``); cute-diskcache serves them from its own cache by default
(``CUTE_DISKCACHE_NATIVE_SITES``). For each kernel, every number comes from fresh interpreters:

* the cold compile, through each layer (ours: compile + export + write; flashinfer's:
  compile + export + reload);
* a warm hit: the cache layer's whole call for that kernel, from request to callable, p50 of
  ``--warm-runs`` fresh processes. flashinfer's: its ``build_and_load_cute_dsl_kernel`` (source
  hash, meta.json check, load). Ours: ``through_cache`` (key with source fingerprint, lookup,
  manifest + sha256 checks, load). The rest of flashinfer's first call is the same either way;
* flashinfer's own cache again, in a process that sees another torch build (a
  ``torch-2.13.0+cu130`` distribution record, as on a GPU box): its fingerprint changes, so it
  compiles again. Our warm runs all see that other build.

Run with the flashinfer 0.7.4 interpreter (``scripts/make_fi074_venv.sh``):
    .venv-fi074/bin/python bench/native_vs_ours.py [--warm-runs 5] [--m 1 16 128]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

_OURS_ENV = ("CUTE_DISKCACHE_", "FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH", "FLASHINFER_CUTE_DSL_DISABLE_CACHE")


def child(args: argparse.Namespace) -> int:
    """One fresh engine start: dispatch each m once, time the cache layer's call per kernel."""
    import cute_diskcache
    from cute_diskcache import activation

    if args.mode == "ours":
        cute_diskcache.install(target=args.target)
    else:  # flashinfer alone: cute-diskcache not installed at all
        activation.set_target(args.target)
    import flashinfer  # noqa: F401
    from flashinfer.cute_dsl.utils import current_cuda_stream
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch as md

    current_cuda_stream()  # flashinfer's one-off torch._dynamo import, outside the timings
    from cute_diskcache import flashinfer_sites
    from cute_diskcache.core.cache import default_cache
    from cute_diskcache.core import through
    from cute_diskcache.flashinfer_sites import native
    from cute_diskcache.core.patches import PATCHES

    calls: list[dict[str, Any]] = []
    now = {"m": 0}

    if args.mode == "ours":
        real_through = through.through_cache

        def through(site: Any, *a: Any, **k: Any) -> Any:  # our native sites call it via the module
            t0 = time.perf_counter()
            cache = default_cache()  # built on first use, inside the timing: a start pays for it
            before = len(cache.events)
            try:
                return real_through(site, *a, **k)
            finally:
                outcome = cache.events[before][2] if len(cache.events) > before else "?"
                calls.append({"kernel": site.kind, "m": now["m"], "seconds": time.perf_counter() - t0, "outcome": outcome})

        through.through_cache = through
    else:
        # flashinfer's own builder, not our stand-in (which, left to flashinfer, first computes each
        # kernel's native identity for the dispatcher: flashinfer's one-off fingerprint outside our timer).
        real_build = PATCHES.original(md, native.BUILDER)

        def build(module_name: str, kernel_name: str, compile_fn: Any, *a: Any, **k: Any) -> Any:
            ran: list[bool] = []

            def counted() -> Any:
                ran.append(True)
                return compile_fn()

            t0 = time.perf_counter()
            try:
                return real_build(module_name, kernel_name, counted, *a, **k)
            finally:
                calls.append({"kernel": kernel_name.split("_", 1)[0], "m": now["m"], "seconds": time.perf_counter() - t0,
                              "outcome": "miss" if ran else "hit"})

        md.build_and_load_cute_dsl_kernel = build
    E, topk, k, n = (int(v) for v in args.shape.split(","))
    d = flashinfer_sites.Dispatcher(E, topk, k, n, max_num_tokens=args.max_num_tokens)
    for m in args.m:
        now["m"] = m
        d.run(m)
    print(json.dumps({"calls": calls}))
    return 0


def run(mode: str, root: Path, workspace: Path, args: argparse.Namespace, front: Path | None = None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_OURS_ENV)}
    env.update(CUTE_DISKCACHE_DIR=str(root), FLASHINFER_WORKSPACE_BASE=str(workspace))
    if front is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(front), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--target", args.target, "--shape", args.shape,
           "--max-num-tokens", str(args.max_num_tokens), "--m", *map(str, args.m)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} child exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gpu_torch(tmp: Path) -> Path:
    dist = tmp / "gpu-torch" / "torch-2.13.0+cu130.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cu130\n")
    (dist / "RECORD").write_text("torch/__init__.py,sha256=not-the-cpu-build,1\n")
    return dist.parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="rtx-pro-6000")
    ap.add_argument("--shape", default="128,8,2048,768", help="experts,top_k,hidden,intermediate (Qwen3-30B-A3B)")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 128], help="0.7.4: 1 -> micro, 16 -> static, 128 -> dynamic")
    ap.add_argument("--max-num-tokens", type=int, default=4096)
    ap.add_argument("--warm-runs", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "native_vs_ours.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("ours", "native"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    with tempfile.TemporaryDirectory(prefix="cdc-native-") as tmp_s:
        tmp = Path(tmp_s)
        gpu = _gpu_torch(tmp)
        native_ws, ours_root = tmp / "native-ws", tmp / "ours-root"
        native_cold = run("native", tmp / "unused", native_ws, args)
        native_warm = [run("native", tmp / "unused", native_ws, args) for _ in range(args.warm_runs)]
        native_other_torch = run("native", tmp / "unused", native_ws, args, front=gpu)
        ours_cold = run("ours", ours_root, tmp / "ours-ws", args)
        ours_warm = [run("ours", ours_root, tmp / "ours-ws-gpu", args, front=gpu) for _ in range(args.warm_runs)]
        leaked = sorted(str(p.relative_to(tmp)) for p in tmp.glob("ours-ws*/**/cached_ops/*"))

    outcomes = lambda run: [c["outcome"] for c in run["calls"]]  # noqa: E731
    assert set(outcomes(native_cold) + outcomes(ours_cold)) == {"miss"}, (native_cold, ours_cold)
    assert {o for w in native_warm + ours_warm for o in outcomes(w)} == {"hit"}, "a warm run compiled"
    kinds = [(c["kernel"], c["m"]) for c in ours_cold["calls"]]
    assert kinds == [(c["kernel"], c["m"]) for c in native_cold["calls"]], (kinds, native_cold["calls"])
    rows = []
    for i, (kind, m) in enumerate(kinds):
        native_hits = [w["calls"][i]["seconds"] for w in native_warm]
        ours_hits = [w["calls"][i]["seconds"] for w in ours_warm]
        rows.append(dict(
            kernel=kind,
            m=m,
            native_cold_s=native_cold["calls"][i]["seconds"],
            ours_cold_s=ours_cold["calls"][i]["seconds"],
            native_hit_p50_ms=statistics.median(native_hits) * 1e3,
            ours_hit_p50_ms=statistics.median(ours_hits) * 1e3,
            native_hit_range_ms=[min(native_hits) * 1e3, max(native_hits) * 1e3],
            ours_hit_range_ms=[min(ours_hits) * 1e3, max(ours_hits) * 1e3],
            native_other_torch=native_other_torch["calls"][i]["outcome"],
            native_other_torch_s=native_other_torch["calls"][i]["seconds"],
        ))
    meta = dict(
        date=time.strftime("%Y-%m-%d"),
        machine=f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, no GPU" if hasattr(os, "sched_getaffinity") else platform.machine(),
        python=platform.python_version(), flashinfer=version("flashinfer-python"), dsl=version("nvidia-cutlass-dsl"),
        torch=version("torch"), target=args.target, shape=args.shape, ms=args.m, warm_runs=args.warm_runs,
        ours_warm_runs_saw="torch-2.13.0+cu130 (simulated GPU-box torch build)",
        flashinfer_cached_ops_written_while_ours_served=leaked,
    )
    print(f"# flashinfer native cache vs cute-diskcache  {meta['date']}  flashinfer {meta['flashinfer']}  DSL {meta['dsl']}  "
          f"target {args.target}  shape {args.shape}\n# machine: {meta['machine']}; hit = the cache layer's call, "
          f"p50 of {args.warm_runs} fresh processes; ours hit under another torch build")
    print(f"{'kernel':<14}{'cold: native':>13}{'ours':>9}{'hit: native':>13}{'ours':>10}{'native/ours':>13}   native, other torch build")
    for r in rows:
        print(f"{r['kernel'] + ' m=' + str(r['m']):<14}{r['native_cold_s']:>11.2f} s{r['ours_cold_s']:>7.2f} s{r['native_hit_p50_ms']:>10.2f} ms"
              f"{r['ours_hit_p50_ms']:>7.2f} ms{r['native_hit_p50_ms'] / r['ours_hit_p50_ms']:>12.1f}x   "
              f"{r['native_other_torch']} ({r['native_other_torch_s']:.2f} s)")
    print(f"flashinfer cached_ops files written while ours served: {len(leaked)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
