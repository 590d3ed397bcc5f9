"""Per-site compile seconds and hit milliseconds of flashinfer 0.7.4's inline sites on this CPU.

MSA's decode, proxy-score and prefill ops and GDN's SM12x prefill compile their sm12x kernel
inline (GDN's through its delta-rule compile cache, PTX kept); so do block-sparse attention's
SM120 forwards (bf16 and Sage) and the frost low-latency MoE's SM120 grouped decode (BF16 and
DeepSeek FP8 weights). Driven through flashinfer's own functions for the rtx-pro-6000 profile by
``tests/fi074_dense_driver.py`` (CPU tensors) and ``tests/fi074_inline_driver.py`` (torch fake
tensors standing in for CUDA ones); the launch after each compile or load fails without a GPU,
the same way cold and warm. One cold process per driver into an empty cache, then ``--warm``
fresh processes each.
Printed per site: compile and persist seconds (cold), and the p50 of the hit (the cache layer's
whole lookup, checks and load) over the warm processes.

    CUTE_DISKCACHE_FI074_PYTHON=.venv-fi074/bin/python python bench/inline_sites_cpu.py [--warm 5]
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
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
#: driver -> the inline sites it drives
DRIVERS = {
    TESTS / "fi074_dense_driver.py": ("msa_decode", "msa_proxy", "msa_proxy_fp4", "msa_prefill", "gdn_prefill"),
    TESTS / "fi074_inline_driver.py": ("bsa_fwd", "bsa_sage_fwd", "frost_grouped", "frost_deepseek_fp8"),
}


def run(python: str, root: str) -> dict:
    """One fresh process per driver against ``root``: their events, in order."""
    events = []
    for driver, sites in DRIVERS.items():
        events += run_driver(python, root, driver, sites)["events"]
    return {"events": events}


def run_driver(python: str, root: str, driver: Path, sites: tuple[str, ...]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k != "CUTE_DSL_ARCH"}
    env.update(CUTE_DISKCACHE_DIR=root, FLASHINFER_B12X_DISK_CACHE="1", CUTE_DSL_DISABLE_FILE_CACHING="1")
    proc = subprocess.run([python, str(driver), "--target", "rtx-pro-6000", *sites], env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    python = os.environ.get("CUTE_DISKCACHE_FI074_PYTHON") or sys.executable
    root = tempfile.mkdtemp(prefix="cdc-inline-bench-")
    cold = run(python, root)
    warm = [run(python, root) for _ in range(args.warm)]
    rows = {}
    for site, _digest, outcome, seconds, persist in cold["events"]:
        assert outcome == "miss", cold["events"]
        rows[site] = {"compile_s": round(seconds, 3), "persist_ms": round(persist * 1e3, 1)}
    for site in rows:
        hits = [e[3] for w in warm for e in w["events"] if e[0] == site]
        assert len(hits) == args.warm and all(e[2] == "hit" for w in warm for e in w["events"]), [w["events"] for w in warm]
        rows[site]["hit_ms_p50"] = round(statistics.median(hits) * 1e3, 2)
        rows[site]["hit_ms_max"] = round(max(hits) * 1e3, 2)
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor() or "cpu") if Path("/proc/cpuinfo").exists() else "cpu"
    machine = f"{model}, {platform.machine()}, {os.cpu_count()} cores, no GPU"
    print(f"inline sites, flashinfer 0.7.4, rtx-pro-6000 profile, {machine}; cold once, {args.warm} warm processes")
    for site, row in rows.items():
        print(f"  {site:40s} compile {row['compile_s']:6.2f} s  persist {row['persist_ms']:6.1f} ms  "
              f"hit p50 {row['hit_ms_p50']:5.2f} ms (max {row['hit_ms_max']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "warm": args.warm, "sites": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
