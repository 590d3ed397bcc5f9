"""Prewarm wall time versus --jobs, against the sum of the individual compile times.

For each --jobs value, a prewarm into an empty cache root, then the ratio
    wall / (sum of compile seconds / jobs)
(target from issue 3: <= 1.2). The sum comes from the same run, so contention between workers
on a small box shows up in both numbers. The wall includes planning (one flashinfer dispatch
per m, no compiles) and each worker's interpreter + flashinfer import.

Run:  python bench/prewarm_scaling.py [--model qwen3-30b-a3b] [--m 1-128] [--jobs 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--target", default="rtx-pro-6000")
    ap.add_argument("--m", default="1-128")
    ap.add_argument("--max-num-tokens", default="4096")
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "prewarm_scaling.json"))
    args = ap.parse_args()
    rows = []
    for jobs in args.jobs:
        with tempfile.TemporaryDirectory(prefix="cdc-prewarm-") as tmp:
            env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}
            env["CUTE_DISKCACHE_DIR"] = tmp
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "cute_diskcache.prewarm", "--model", args.model, "--target", args.target,
                 "--m", args.m, "--max-num-tokens", args.max_num_tokens, "--jobs", str(jobs), "--json"],
                env=env, capture_output=True, text=True,
            )
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-3000:])
                return 1
            s = json.loads(proc.stdout)
            ideal = s["compile_seconds"] / jobs
            rows.append(dict(jobs=jobs, kernels=s["kernels"], compiled=s["compiled"], wall_s=wall,
                             compile_sum_s=s["compile_seconds"], ideal_s=ideal, ratio=wall / ideal if ideal else None,
                             mb=s["bytes"] / 1e6))
            r = rows[-1]
            print(f"jobs={jobs}: {r['compiled']}/{r['kernels']} kernels, wall {wall:.1f} s, sum of compiles "
                  f"{r['compile_sum_s']:.1f} s, sum/jobs {ideal:.1f} s, ratio {r['ratio']:.2f}, {r['mb']:.1f} MB", flush=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), cores=os.cpu_count(), flashinfer=version("flashinfer-python"),
                dsl=version("nvidia-cutlass-dsl"), model=args.model, target=args.target, m=args.m)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
