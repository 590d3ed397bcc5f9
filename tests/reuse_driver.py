"""A fresh process that asks flashinfer for W4A16 kernels through the cache (tests/test_reuse.py).

Run by whichever release's interpreter a test names (this checkout on ``PYTHONPATH``), with
``CUTE_DISKCACHE_DIR`` set: prints one JSON line with the flashinfer release, this process's
counters and the cache's events (site, digest, outcome).

``--engine MODEL`` (flashinfer >= 0.7.4) first serves MODEL's kernels the way vLLM does, through
``tests/fi074_dense_driver.py``'s engine (for ``--ms`` and ``--max-num-tokens``), in this process:
one engine start asks for both kinds of kernel. The engine goes first so that in an empty root
its kernels compile without a trace, as prewarm's do (a trace needs another release's records).

    python reuse_driver.py w4a16_activation w4a16_topk_sum --engine llama-3.1-8b-nvfp4 --ms 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("w4a16", nargs="*", help="W4A16 kernels (scripts/compat_child.py's W4A16_SITES)")
    ap.add_argument("--engine", help="first serve this model as vLLM would (flashinfer >= 0.7.4)")
    ap.add_argument("--ms", default="1", help="--engine: the batch sizes to serve")
    ap.add_argument("--max-num-tokens", type=int, default=64)
    args = ap.parse_args()
    import cute_diskcache

    cute_diskcache.install(target="rtx-pro-6000")
    sys.path.insert(0, str(REPO / "scripts"))
    import compat_child
    import flashinfer

    from cute_diskcache.core.cache import default_cache

    engine = None
    if args.engine:
        sys.path.insert(0, str(REPO / "tests"))
        import fi074_dense_driver

        engine = fi074_dense_driver.engine(args.engine, [int(v) for v in args.ms.split(",")], args.max_num_tokens)
    kernels = {}
    for name in args.w4a16:
        kernel = compat_child._w4a16_compile(name)
        # what flashinfer got (issue 28): its class, by name up the MRO, and its public attributes
        kernels[name] = {"classes": [c.__name__ for c in type(kernel).__mro__][:4],
                         "public": sorted(n for n in dir(kernel) if not n.startswith("_"))}
    cache = default_cache()
    print(json.dumps({"flashinfer": flashinfer.__version__, "counters": cache.counters.as_dict(), "kernels": kernels, "engine": engine,
                      "events": [{"site": e[0], "digest": e[1], "outcome": e[2]} for e in cache.events]}))
    return 0


if __name__ == "__main__":
    from cute_diskcache import fast_exit

    fast_exit.end(main())  # as our own commands end: after the exit handlers, without the teardown's collections
