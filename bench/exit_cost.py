#!/usr/bin/env python3
"""How long our own processes take to end, with and without :mod:`cute_diskcache.fast_exit`.

Each child imports what a prewarm worker, a ``check`` or a probe imports (torch, the CuTe DSL,
flashinfer's MoE dispatch under a target profile), prints the time, and ends; the parent notes
when the child is gone. Plain and armed children alternate, so load on the machine falls on both
alike. Prints each side's min/median/max exit seconds and their ratio, and writes the JSON with
``--out``. No GPU needed::

    python bench/exit_cost.py [--runs 5] [--out bench/results/exit_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import sys, time
from cute_diskcache import fast_exit
from cute_diskcache.keys import targets
targets.apply("rtx-pro-6000")
import torch, cutlass.cute
import importlib
importlib.import_module("flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_dispatch")
import gc
sys.stdout.write("%r %d" % (time.time(), len(gc.get_objects())))
sys.stdout.flush()
{end}
"""
END = "fast_exit.end(0)"


def _one(armed: bool) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k != "CUTE_DSL_ARCH"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", CHILD.format(end=END if armed else "sys.exit(0)")], env=env, capture_output=True, text=True,
                          check=True, cwd=REPO)
    gone = time.time()
    printed, objects = proc.stdout.split()
    return gone - float(printed), int(objects)


def _stats(xs: list[float]) -> dict[str, float]:
    return {"min": round(min(xs), 3), "median": round(statistics.median(xs), 3), "max": round(max(xs), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    plain: list[float] = []
    armed: list[float] = []
    objects = 0
    for _ in range(args.runs):
        s, objects = _one(False)
        plain.append(s)
        armed.append(_one(True)[0])
    report: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(), "runs": args.runs, "tracked_objects": objects,
        "exit_s_plain": _stats(plain), "exit_s_armed": _stats(armed),
        "median_ratio_plain_over_armed": round(statistics.median(plain) / statistics.median(armed), 2),
    }
    print(f"exit of a process with torch, the DSL and flashinfer's MoE dispatch loaded ({objects} tracked objects), {args.runs} runs each:")
    for name in ("plain", "armed"):
        st = report[f"exit_s_{name}"]
        print(f"  {name:5s}  min {st['min']:.2f} s  median {st['median']:.2f} s  max {st['max']:.2f} s")
    print(f"  plain / armed (medians): {report['median_ratio_plain_over_armed']}x")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
