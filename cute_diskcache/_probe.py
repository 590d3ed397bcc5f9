"""One fresh engine start, as a child process: attach the cache, drive flashinfer, report JSON.

The demo, the benchmark and the tests all need "a new process that knows nothing" to prove a
warm start; they run this module rather than each writing their own driver.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run(
    root: Path | str,
    ms: list[int] | tuple[int, ...],
    *,
    target: str | None = "rtx-pro-6000",
    shape: str | None = None,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 900,
) -> dict[str, Any]:
    """Run one probe in a fresh interpreter on cache root ``root``; return its JSON report.

    The child gets the parent's environment minus every cute-diskcache variable, so an
    operator's settings never leak into a measurement.
    """
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k != "FLASHINFER_B12X_DISK_CACHE"}
    child_env["CUTE_DISKCACHE_DIR"] = str(root)
    child_env.update(env or {})
    cmd = [sys.executable, "-m", "cute_diskcache._probe", "--m", *map(str, ms), *args]
    if target:
        cmd += ["--target", target]
    if shape:
        cmd += ["--shape", shape]
    proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"probe exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    report["stderr"] = proc.stderr
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cute_diskcache._probe")
    ap.add_argument("--target", default=None)
    ap.add_argument("--shape", default="128,8,2048,768", help="experts,top_k,hidden,intermediate")
    ap.add_argument("--m", type=int, nargs="+", default=[1])
    ap.add_argument("--max-num-tokens", type=int, default=4096)
    ap.add_argument("--activation", default="silu")
    ap.add_argument("--no-cache", action="store_true", help="run flashinfer without cute-diskcache")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    import cute_diskcache
    from cute_diskcache import activation
    from cute_diskcache.keys import targets

    if args.no_cache:
        activation.set_target(args.target)
    else:
        cute_diskcache.install(target=args.target)
    from cute_diskcache import flashinfer_sites
    from cute_diskcache.core.cache import default_cache

    import_s, warmup_s = flashinfer_sites.import_dispatch()
    E, topk, k, n = (int(v) for v in args.shape.split(","))
    records = flashinfer_sites.dispatch(E, topk, k, n, args.m, max_num_tokens=args.max_num_tokens, activation=args.activation)
    cache = default_cache()
    out = {
        "target": targets.active().name if targets.active() else None,
        "import_seconds": import_s,
        "warmup_seconds": warmup_s,
        "records": records,
        "kernels": flashinfer_sites.kernel_cache_sizes(),
        "counters": cute_diskcache.counters(),
        "events": cache.events,
        "total_seconds": time.perf_counter() - t_start,
    }
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    from cute_diskcache.fast_exit import end

    end(main())
