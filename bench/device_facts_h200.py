#!/usr/bin/env python3
"""Device facts on a live GPU (issue 7): an offline-built entry is checked against the real card.

Why: an entry built offline through a target profile records the device facts its compile
read (``cute_diskcache.keys.devicefacts``); on the GPU box, with no profile, the same facts are read
from the driver and compared. This script shows both outcomes on the lent H200 with a kernel
that makes the DSL read a driver attribute while compiling (``min_blocks_per_mp=2`` ->
``MAX_SHARED_MEMORY_PER_MULTIPROCESSOR``, baked into the IR):

* built offline through the ``h200`` profile: the H200 hits it with 0 compiles and the
  output is bitwise equal to a build made on the H200 itself;
* built offline through an ``h200`` profile with a wrong shared-memory value (an SM120 card's
  102400): the H200 refuses it with one warning naming the fact, and recompiles;
* every fact the ``h200`` profile carries, against the value the driver reports.

Modes::

    python bench/device_facts_h200.py offline --out DIR      # CPU box: build both entries
    python3 bench/device_facts_h200.py device --out OUT --offline DIR   # GPU box
    python bench/device_facts_h200.py child ...              # one fresh process (internal)

Results and their reading: ``bench/results/device_facts_h200.json`` and the "Device facts"
section of ``bench/results/gpu_proof_sm90.md``.
"""


import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_harness as harness  # noqa: E402

N = 4096
THREADS = 128
WRONG_SMEM = 102400  # an SM120 card's MAX_SHARED_MEMORY_PER_MULTIPROCESSOR; the H200 has 233472


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Compile (or hit) the kernel through cached_compile in this fresh process; optionally run it."""
    import logging

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="LOG %(levelname)s %(message)s")
    os.environ["CUTE_DISKCACHE_DIR"] = args.cache
    from cute_diskcache.keys import targets

    if args.profile != "none":
        changes = tuple((k, int(v)) for k, v in (s.split("=", 1) for s in args.set))
        targets.apply(dataclasses.replace(targets.get(args.profile), attributes=changes))
        from cute_diskcache.keys import devicefacts

        devicefacts.install_hook()  # the DSL's driver attribute queries answered from the profile

    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor

    import cute_diskcache

    @cute.kernel
    def _scale_add(x: cute.Tensor):
        bidx, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        i = bidx * THREADS + tidx
        x[i] = x[i] * cutlass.Float32(1.5) + cutlass.Float32(0.25)

    @cute.jit
    def scale_add(x: cute.Tensor):
        _scale_add(x).launch(grid=(N // THREADS, 1, 1), block=(THREADS, 1, 1), min_blocks_per_mp=2)

    t0 = time.perf_counter()
    kernel = cute_diskcache.cached_compile(scale_add, make_fake_compact_tensor(cutlass.Float32, (N,)), key=("scale_add", N, THREADS, 2))
    out: dict[str, Any] = {"first_call_s": round(time.perf_counter() - t0, 4), "counters": cute_diskcache.counters()}
    from cute_diskcache.storage import entry

    manifests = [entry.read_manifest(p.parent) for p in Path(args.cache, "v1").glob("*/*/*/manifest.msgpack")]
    out["entries"] = [
        {"digest": m["digest"], "device": m["device"], "env_device": m["env"]["device"],
         "cubins": [p["sha256"] for p in m["payloads"]["cubin"]], "object": m["payloads"]["object"][0]["sha256"]}
        for m in manifests
    ]
    if args.run:
        import torch

        x = torch.arange(N, dtype=torch.float32, device="cuda") / 7.0
        kernel(from_dlpack(x))
        torch.cuda.synchronize()
        out["output_sha256"] = hashlib.sha256(x.cpu().numpy().tobytes()).hexdigest()
        expected = (torch.arange(N, dtype=torch.float32) / 7.0) * 1.5 + 0.25
        # torch computes x * 1.5 then + 0.25 (two roundings); the kernel may contract them into
        # one FMA (one rounding), so the reference is compared within an ulp, builds bitwise.
        out["max_abs_diff_vs_reference"] = float((x.cpu() - expected).abs().max())
        out["output_matches_reference"] = bool(torch.allclose(x.cpu(), expected, rtol=2**-22, atol=0))
    return out


def run_child(cache: Path, *extra: str) -> tuple[dict[str, Any], list[str]]:
    env = dict(os.environ)
    env.pop("CUTE_DISKCACHE_TARGET", None)
    res = harness.spawn(__file__, ["child", "--cache", str(cache), *extra], env=env, timeout=600, stderr_tail=1 << 20)
    if "error" in res or res["exit_code"] != 0:
        raise SystemExit(f"child failed ({res.get('error') or res['exit_code']}): {res['stderr_tail'][-4000:]}")
    warnings = [ln for ln in res.pop("stderr_tail").splitlines() if ln.startswith("LOG WARNING")]
    for k in ("wall_s", "exit_code"):
        res.pop(k)
    return res, warnings


def offline(args: argparse.Namespace) -> None:
    out = Path(args.out)
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    record = {}
    for name, extra in (("true", ()), ("wrong", ("--set", f"MAX_SHARED_MEMORY_PER_MULTIPROCESSOR={WRONG_SMEM}"))):
        shutil.rmtree(out / name, ignore_errors=True)
        result, warnings = run_child(out / name / "cache", "--profile", "h200", *extra)
        record[name] = {"result": result, "warnings": warnings}
        print(name, json.dumps(result["entries"][0]["device"]))
    (out / "offline_build.json").write_text(json.dumps(record, indent=1))


def live_profile_comparison() -> list[dict[str, Any]]:
    """Every driver attribute the h200 profile carries, against the driver's answer."""
    import cutlass.base_dsl.runtime.cuda as dsl_cuda

    from cute_diskcache.keys import targets

    dsl_cuda.checkCudaErrors(dsl_cuda.cuda.cuInit(0))
    rows = []
    for name, value in targets.get("h200").driver_attributes().items():
        attr = getattr(dsl_cuda.cuda.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
        live = int(dsl_cuda.get_device_attribute(attr, 0))
        rows.append({"attribute": name, "profile": value, "device": live, "equal": value == live})
    return rows


def device(args: argparse.Namespace) -> None:
    out, offline_dir = Path(args.out), Path(args.offline)
    os.environ.pop("CUTE_DSL_ARCH", None)
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    report: dict[str, Any] = {"offline_build": json.loads((offline_dir / "offline_build.json").read_text())}
    cold, _ = run_child(work / "device", "--profile", "none", "--run")
    warm, _ = run_child(work / "device", "--profile", "none", "--run")
    report["device_cold"], report["device_warm"] = cold, warm
    for name in ("true", "wrong"):
        shutil.copytree(offline_dir / name / "cache", work / name)
        result, warnings = run_child(work / name, "--profile", "none", "--run")
        report[f"offline_{name}_on_device"] = {"result": result, "warnings": warnings}
    report["profile_vs_live"] = live_profile_comparison()
    dev = cold["entries"][0]
    off = report["offline_build"]["true"]["result"]["entries"][0]
    true_run = report["offline_true_on_device"]["result"]
    wrong = report["offline_wrong_on_device"]
    report["verdict"] = {
        "same_key": dev["digest"] == off["digest"],
        "same_facts": dev["device"]["facts"] == off["device"]["facts"],
        "same_cubins": dev["cubins"] == off["cubins"],
        "same_object": dev["object"] == off["object"],
        "offline_true_hit_zero_compiles": true_run["counters"]["hits"] == 1 and true_run["counters"]["compiles"] == 0,
        "offline_true_output_bitwise_equal": true_run["output_sha256"] == cold["output_sha256"],
        "outputs_match_reference": cold["output_matches_reference"] and true_run["output_matches_reference"],
        "offline_wrong_refused_with_named_fact": wrong["result"]["counters"]["compiles"] == 1
        and any("max_shared_memory_per_multiprocessor" in w for w in wrong["warnings"]),
        "profile_equals_live": all(r["equal"] for r in report["profile_vs_live"]),
    }
    (out / "device_facts_h200.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report["verdict"], indent=1))
    print(json.dumps({"device_facts": dev["device"], "wrong_warnings": wrong["warnings"]}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("child")
    c.add_argument("--cache", required=True)
    c.add_argument("--profile", default="none")
    c.add_argument("--set", action="append", default=[])
    c.add_argument("--run", action="store_true")
    o = sub.add_parser("offline")
    o.add_argument("--out", required=True)
    d = sub.add_parser("device")
    d.add_argument("--out", required=True)
    d.add_argument("--offline", required=True)
    args = ap.parse_args()
    if args.mode == "child":
        harness.emit(child(args))
    elif args.mode == "offline":
        offline(args)
    else:
        device(args)


if __name__ == "__main__":
    main()
