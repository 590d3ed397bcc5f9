"""Child for tests/test_prewarm_functional.py: flashinfer's functional ``b12x_fused_moe``, cache on.

Run with a flashinfer >= 0.7.4 interpreter, never imported by pytest. It attaches the cache for a
target profile before flashinfer is imported, then calls the functional API (not the wrapper
prewarm planned with) once per m, in the order given, so the workspace grows with that batch
history as it would in an engine, and prints one JSON line: the cache's events and counters.

    python functional_driver.py --target rtx-pro-6000 --shape 8,2,1024,768 --m 3 40 2 70 1
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="rtx-pro-6000")
    ap.add_argument("--shape", required=True, help="experts,top_k,hidden,intermediate")
    ap.add_argument("--m", type=int, nargs="+", required=True)
    args = ap.parse_args(argv)

    import cute_diskcache

    cute_diskcache.install(target=args.target)
    from cute_diskcache import flashinfer_sites
    from cute_diskcache.core.cache import default_cache

    d = flashinfer_sites.Dispatcher(*(int(v) for v in args.shape.split(",")), use_cuda_graph=False)
    records = [d.run(m, functional=True) for m in args.m]
    print(json.dumps({
        "flashinfer": flashinfer_sites.flashinfer_version(),
        "events": default_cache().events,
        "counters": cute_diskcache.counters(),
        "launch_errors": [r["launch_error"] is not None for r in records],
    }), flush=True)
    return 0


if __name__ == "__main__":
    from cute_diskcache import fast_exit

    fast_exit.end(main())  # as our own commands end: after the exit handlers, without the teardown's collections
