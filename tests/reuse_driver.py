"""A fresh process that asks flashinfer for W4A16 kernels through the cache (tests/test_reuse.py).

Run by whichever release's interpreter a test names (this checkout on ``PYTHONPATH``), with
``CUTE_DISKCACHE_DIR`` set: prints one JSON line with the flashinfer release, this process's
counters and the cache's events (site, digest, outcome).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    import cute_diskcache

    cute_diskcache.install(target="rtx-pro-6000")
    sys.path.insert(0, str(REPO / "scripts"))
    import compat_child
    import flashinfer

    from cute_diskcache.cache import default_cache

    kernels = {}
    for name in sys.argv[1:]:
        kernel = compat_child._w4a16_compile(name)
        # what flashinfer got (issue 28): its class, by name up the MRO, and its public attributes
        kernels[name] = {"classes": [c.__name__ for c in type(kernel).__mro__][:4],
                         "public": sorted(n for n in dir(kernel) if not n.startswith("_"))}
    cache = default_cache()
    print(json.dumps({"flashinfer": flashinfer.__version__, "counters": cache.counters.as_dict(), "kernels": kernels,
                      "events": [{"site": e[0], "digest": e[1], "outcome": e[2]} for e in cache.events]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
