"""One fresh engine start, as a child process: attach the cache, drive flashinfer, report JSON.

The demo, the benchmark and the tests all need "a new process that knows nothing" to prove a
warm start; they run this module rather than each writing their own driver.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


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
    from cute_diskcache import activation, targets

    if args.no_cache:
        activation.set_target(args.target)
    else:
        cute_diskcache.install(target=args.target)
    t0 = time.perf_counter()
    import flashinfer  # noqa: F401
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch  # noqa: F401

    import_s = time.perf_counter() - t0
    from cute_diskcache import flashinfer_sites
    from cute_diskcache.cache import default_cache

    E, topk, k, n = (int(v) for v in args.shape.split(","))
    records = flashinfer_sites.dispatch(E, topk, k, n, args.m, max_num_tokens=args.max_num_tokens, activation=args.activation)
    cache = default_cache()
    out = {
        "target": targets.active().name if targets.active() else None,
        "import_seconds": import_s,
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
    sys.exit(main())
