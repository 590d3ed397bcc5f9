"""What a commit costs as the cache grows: the size counter against the full walk it replaced.

Issue 15, item 9: the size cap used to be enforced by walking and stat-ing all of ``v1/`` after
every commit, inside the single-flight lock (416-473 ms per commit at 3,000 entries, measured on
our 2-core box; the 5G default holds ~14k entries). A commit now updates a counter and, over the
cap, culls at most CULL_LIMIT entries from SAMPLE_SHARDS sampled shards.

For each cache size, side by side in one run on synthetic entries (real layout, fsync on):
  walk    what the old commit added: ``eviction.usage(root)``, the full walk;
  commit  a whole commit now, under the cap (write + counter);
  culling a whole commit now, over the cap (write + counter + a bounded cull);
  cull    the bookkeeping alone, over the cap: ``eviction.note_commit`` (counter + bounded cull).
The whole commits are dominated by their fsyncs (a few ms, noisy); the walk grows with the cache.

Run:  python bench/commit_latency.py [--sizes 100 1000 3000] [--commits 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _helpers import make_artifact, make_key  # noqa: E402

from cute_diskcache.storage import eviction, housekeeping  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402


def _fill(root: Path, n: int) -> Store:
    real_fsync = os.fsync
    os.fsync = lambda fd: None  # filling is setup, not what is measured
    try:
        store = Store(root)
        for i in range(n):
            store.commit(make_key(site_key=("fill", i)), make_artifact((bytes([i % 250 + 1]) * 20_000,)))
    finally:
        os.fsync = real_fsync
    housekeeping.reconcile(root)
    os.sync()  # the fill's dirty pages must not be flushed by the first measured fsyncs
    return store


def _ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:7.2f} ms (min {min(samples) * 1e3:.2f})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 3000])
    ap.add_argument("--commits", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "commit_latency.json"))
    args = ap.parse_args()
    rows = []
    print(f"# commit cost vs cache size; {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores; p50 (min) of {args.commits}")
    print(f"{'entries':>8}  {'old: walk added per commit':>30}  {'now: commit under cap':>26}  {'now: commit over cap':>26}  {'now: counter + cull':>26}")
    for n in args.sizes:
        with tempfile.TemporaryDirectory(prefix="cdc-commit-") as tmp:
            root = Path(tmp)
            os.environ["CUTE_DISKCACHE_MAX_SIZE"] = "0"
            store = _fill(root, n)
            walks, under, over, cull = [], [], [], []
            for i in range(args.commits):
                t0 = time.perf_counter()
                eviction.usage(root)
                walks.append(time.perf_counter() - t0)
            os.environ["CUTE_DISKCACHE_MAX_SIZE"] = str(10 * eviction.read_usage(root).bytes)
            for i in range(args.commits):
                t0 = time.perf_counter()
                store.commit(make_key(site_key=("under", n, i)), make_artifact((b"\x01" * 20_000,)))
                under.append(time.perf_counter() - t0)
            os.environ["CUTE_DISKCACHE_MAX_SIZE"] = str(int(eviction.read_usage(root).bytes * 0.98))
            for i in range(args.commits):
                t0 = time.perf_counter()
                store.commit(make_key(site_key=("over", n, i)), make_artifact((b"\x02" * 20_000,)))
                over.append(time.perf_counter() - t0)
            os.environ["CUTE_DISKCACHE_MAX_SIZE"] = str(int(eviction.read_usage(root).bytes * 0.5))  # every call culls
            for i in range(args.commits):
                t0 = time.perf_counter()
                eviction.note_commit(root, 20_000)
                cull.append(time.perf_counter() - t0)
        rows.append({"entries": n, "walk_ms": [w * 1e3 for w in walks], "commit_under_ms": [u * 1e3 for u in under],
                     "commit_over_ms": [o * 1e3 for o in over], "cull_ms": [c * 1e3 for c in cull]})
        print(f"{n:>8}  {_ms(walks):>30}  {_ms(under):>26}  {_ms(over):>26}  {_ms(cull):>26}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
