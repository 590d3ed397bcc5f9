#!/usr/bin/env python3
"""Host code on the GPU: an entry whose launch glue is x86-64-v2 against one tuned for this CPU.

Why: entries now carry host code written for a baseline, not for the build CPU
(``CUTE_DISKCACHE_HOST_CPU``, docs/keys.md). That is only acceptable if the kernel gives the same
bits and launches and loads as fast. On the lent GPU, for the Hopper dense GEMM of
``gpu_proof_sm90.py`` (a real CuTe-DSL kernel exported through tvm-ffi, as flashinfer's are):

1. one cold process per setting (``x86-64-v2``, ``native``) compiles, persists, runs, saves its
   output;
2. warm processes of the two settings alternate (``--rounds`` each), each hitting its entry with
   zero compiles, comparing its output bitwise with the x86-64-v2 cold output, and timing the
   hit (load) and the launch (host milliseconds per back-to-back launch, GPU time per kernel).

Prints medians and the native / v2 ratios, and writes ``--out`` (JSON). Run on the device
machine after ``. .dev/s2/env.sh`` (see ../shared/device/README.md)::

    python3 bench/host_code_gpu.py --out bench/results/host_code_gpu_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_harness import device_info, host_cpu, spawn, versions  # noqa: E402

PROOF = str(HERE / "gpu_proof_sm90.py")
SETTINGS = ("x86-64-v2", "native")


def child(phase: str, setting: str, cache: Path, *, save: Path | None = None, ref: Path | None = None) -> dict[str, Any]:
    env = {**os.environ, "CUTE_DISKCACHE_HOST_CPU": setting, "FLASHINFER_B12X_DISK_CACHE": "1"}
    argv = ["child", "--phase", phase, "--variant", "tvm", "--cache", str(cache), "--repeat-hits", "10" if phase == "warm" else "0"]
    argv += ["--save", str(save)] if save else []
    argv += ["--ref", str(ref)] if ref else []
    return {"setting": setting, **spawn(PROOF, argv, env=env, timeout=600)}


def manifest_host(cache: Path) -> dict[str, Any]:
    from cute_diskcache.storage import entry

    (mpath,) = cache.glob("v1/*/*/*/manifest.msgpack")
    m = entry.read_manifest(mpath.parent)
    return {"host_cpu": m.get("host_cpu"), "host_isa": m.get("host_isa"), "digest": m["digest"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/host_code_gpu")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res: dict[str, Any] = {"device": device_info(), "host_cpu_model": host_cpu(), "versions": versions(), "cold": {}, "warm": []}
    for setting in SETTINGS:
        cache = work / setting
        res["cold"][setting] = {**child("cold", setting, cache, save=work / f"{setting}.out"), "entry": manifest_host(cache)}
    ref = work / "x86-64-v2.out"
    res["cold_outputs_bitwise_equal"] = ref.read_bytes() == (work / "native.out").read_bytes()
    for _ in range(args.rounds):
        for setting in SETTINGS:
            res["warm"].append(child("warm", setting, work / setting, ref=ref))
    summary: dict[str, Any] = {}
    for setting in SETTINGS:
        runs = [r for r in res["warm"] if r["setting"] == setting]
        med = lambda key, rs=runs: statistics.median(r[key] for r in rs if r.get(key) is not None)  # noqa: E731
        summary[setting] = {
            "warm_processes": len(runs),
            "all_hits_zero_compiles": all(r.get("counters", {}).get("compiles") == 0 and r.get("load_ms") is not None for r in runs),
            "bitwise_equal_to_v2_cold": all(r.get("bitwise_equal_to_ref") for r in runs),
            "first_hit_ms_p50": med("load_ms"),
            "later_hit_ms_p50": statistics.median(r["repeat_hits"]["hit_ms_p50"] for r in runs if isinstance(r.get("repeat_hits"), dict) and r["repeat_hits"].get("hit_ms_p50")),
            "host_ms_per_launch_p50": med("host_ms_per_launch"),
            "kernel_ms_p50": med("kernel_ms"),
        }
    v2, nat = summary["x86-64-v2"], summary["native"]
    summary["native_over_v2"] = {k: round(nat[k] / v2[k], 3) for k in ("first_hit_ms_p50", "later_hit_ms_p50", "host_ms_per_launch_p50", "kernel_ms_p50")}
    res["summary"] = summary
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({"cold_outputs_bitwise_equal": res["cold_outputs_bitwise_equal"],
                      "entries": {s: res["cold"][s]["entry"]["host_cpu"] for s in SETTINGS}, **summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
