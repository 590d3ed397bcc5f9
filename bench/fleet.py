"""A cold fleet on one shared store: compiles and wall time until every node has its kernel,
with and without the fleet lease; then a remote hit against a local hit and a raw GET.

Nodes are fresh interpreters with separate empty roots, one signing key, one store: a
redis-server on a free loopback port and moto's S3 server (``ThreadedMotoServer``), both started
here. Each node imports everything, says it is ready, waits for a common start signal, then asks
``cute_diskcache.cached_compile`` for the same small kernel (a real DSL compile for the
rtx-pro-6000 profile, ``CUTE_DSL_ARCH=sm_120a``). "ready" is when its call returned a kernel;
wall = the last node's ready minus the start signal. Compiles are the nodes' own counters.
``CUTE_DISKCACHE_REMOTE_LEASE=0`` is the behaviour before the lease (read-through, write-behind).

Hits (Redis and S3): one process, after the fleet populated the store; ``--runs`` remote hits on
fresh empty roots through one client (the first of the process reported apart: it imports the
client library and connects), local hits on a root holding the entry, and raw GETs (the client
library's, no cache code) of the bytes a hit moves (the ``.hit`` value) and of the whole entry.

Run:  python bench/fleet.py [--nodes 1 4 8] [--runs 15]
Writes bench/results/fleet.json and bench/results/fleet.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from loopback import free_port, stack_meta, start_redis  # noqa: E402  (bench/, beside this script)

RESULTS = Path(__file__).parent / "results"
BUCKET = "cdc-bench-fleet"

KERNEL = textwrap.dedent(
    """
    import cutlass
    import cutlass.cute as cute


    @cute.kernel
    def _scale(x: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        x[tidx] = x[tidx] * cutlass.Float32(3.0) + cutlass.Float32(1.0)


    @cute.jit
    def scale(x: cute.Tensor):
        _scale(x).launch(grid=(1, 1, 1), block=(32, 1, 1))
    """
)

# argv: code_dir, ready file, go file
NODE = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from cute_diskcache.keys import targets
    targets.apply("rtx-pro-6000")
    import cute_diskcache, cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor
    sys.path.insert(0, sys.argv[1])
    import cdc_fleet_kernel as kern
    import cute_diskcache.remote.client, redis, s3fs  # the remote tier's imports, before the clock starts
    x = make_fake_compact_tensor(cutlass.Float32, (32,))
    Path(sys.argv[2]).touch()
    go = Path(sys.argv[3])
    while not go.exists():
        time.sleep(0.002)
    kernel = cute_diskcache.cached_compile(kern.scale, x, key=("scale", 32))
    ready = time.time()
    c = cute_diskcache.counters()
    print(json.dumps({"ready": ready, "kernel": type(kernel).__name__, **{k: c.get(k) for k in (
        "compiles", "hits", "remote_hits", "remote_errors", "leases", "lease_waits", "lease_wait_seconds")}}))
    """
)

# argv: code_dir (unused), ready file, go file. flashinfer 0.6.15.post1's MoE micro kernel, m=1, as _probe runs it.
NODE_MICRO = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import cute_diskcache
    cute_diskcache.install(target="rtx-pro-6000")
    from cute_diskcache import flashinfer_sites
    flashinfer_sites.import_dispatch()
    import cute_diskcache.remote.client, redis, s3fs  # the remote tier's imports, before the clock starts
    Path(sys.argv[2]).touch()
    go = Path(sys.argv[3])
    while not go.exists():
        time.sleep(0.002)
    records = flashinfer_sites.dispatch(128, 8, 2048, 768, [1], max_num_tokens=4096, activation="silu")
    ready = time.time()
    c = cute_diskcache.counters()
    print(json.dumps({"ready": ready, "kernel": json.dumps([r["launch_error"] for r in records]), **{k: c.get(k) for k in (
        "compiles", "hits", "remote_hits", "remote_errors", "leases", "lease_waits", "lease_wait_seconds")}}))
    """
)

# argv: code_dir, url, work dir, runs
HITS = textwrap.dedent(
    """
    import json, statistics, sys, time
    from pathlib import Path
    from cute_diskcache.keys import targets
    targets.apply("rtx-pro-6000")
    import cute_diskcache, cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cute_diskcache.core.cache import CompileCache, default_cache
    from cute_diskcache.remote import blob
    from cute_diskcache.storage.store import Store
    sys.path.insert(0, sys.argv[1])
    import cdc_fleet_kernel as kern
    url, work, runs = sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    keys = []
    real = CompileCache.get_or_compile
    def spy(self, key, *a, **kw):
        keys.append(key)
        return real(self, key, *a, **kw)
    CompileCache.get_or_compile = spy
    x = make_fake_compact_tensor(cutlass.Float32, (32,))
    t0 = time.perf_counter()
    cute_diskcache.cached_compile(kern.scale, x, key=("scale", 32))  # the first remote hit of this process
    first_wall = time.perf_counter() - t0
    cache = default_cache()
    assert cache.events[-1][2] == "remote-hit", cache.events
    first = cache.events[-1][3]
    rc = cache.remote.get()
    setup = rc.counters.remote_setup_seconds
    key = keys[0]

    def never():
        raise AssertionError("compiled: not a hit")

    hk = cache.store.hmac_key
    remote, local, bytes_in = [], [], []
    for i in range(runs):
        before = rc.counters.remote_bytes_in
        c = CompileCache(Store(work / f"r{i}", hmac_key=hk), remote=rc)
        c.get_or_compile(key, never)
        assert c.events[-1][2] == "remote-hit", c.events
        remote.append(c.events[-1][3])
        bytes_in.append(rc.counters.remote_bytes_in - before)
        assert rc.flush(30)  # the whole entry into the local store, off the request path
    for i in range(runs):
        c = CompileCache(Store(work / f"r{i}", hmac_key=hk), remote=rc)
        c.get_or_compile(key, never)
        assert c.events[-1][2] == "hit", c.events
        local.append(c.events[-1][3])
    backend = rc.backend()
    ns = key.env.namespace
    names = {"hit": blob.hit_object_name(rc.prefix, ns, key.digest), "whole": rc.name(ns, key.digest)}
    raw = {}
    for label, name in names.items():
        times, size = [], 0
        for _ in range(runs):
            t = time.perf_counter()
            size = len(backend.get(name))
            times.append(time.perf_counter() - t)
        raw[label] = {"p50_ms": statistics.median(times) * 1e3, "bytes": size}
    p50 = lambda v: statistics.median(v) * 1e3
    print(json.dumps({"first_remote_hit_ms": first * 1e3, "first_setup_ms": setup * 1e3, "first_call_wall_ms": first_wall * 1e3,
                      "remote_hit_p50_ms": p50(remote), "remote_hit_min_ms": min(remote) * 1e3, "remote_hit_max_ms": max(remote) * 1e3,
                      "local_hit_p50_ms": p50(local), "raw_get": raw, "bytes_per_hit": statistics.median(bytes_in)}))
    """
)


def _aws(endpoint: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}


def _env(base: dict[str, str], root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}
    env.update(base)
    env["CUTE_DISKCACHE_DIR"] = str(root)
    env["CUTE_DSL_ARCH"] = "sm_120a"
    return env


def _fleet(tmp: Path, code: Path, n: int, base: dict[str, str], node: str) -> dict[str, Any]:
    go = tmp / "go"
    procs = []
    for i in range(n):
        procs.append(subprocess.Popen([sys.executable, "-c", node, str(code), str(tmp / f"ready-{i}"), str(go)],
                                      env=_env(base, tmp / f"node-{i}"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 600
    while not all((tmp / f"ready-{i}").exists() for i in range(n)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise SystemExit("a node did not start: " + "".join(p.communicate()[1][-2000:] for p in procs))
        time.sleep(0.02)
    start = time.time()
    go.touch()
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"a node failed:\n{err[-3000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    ready = sorted(r["ready"] - start for r in reports)
    return {"nodes": n, "compiles": sum(r["compiles"] for r in reports), "remote_hits": sum(r["remote_hits"] or 0 for r in reports),
            "remote_errors": sum(r["remote_errors"] or 0 for r in reports), "leases": sum(r.get("leases") or 0 for r in reports),
            "kernels_alike": len({r["kernel"] for r in reports}) == 1, "wall_s": ready[-1], "first_ready_s": ready[0], "median_ready_s": statistics.median(ready)}


def _hits(tmp: Path, code: Path, base: dict[str, str], runs: int) -> dict[str, Any]:
    seed = tmp / "seed"
    seed.mkdir()
    _fleet(seed, code, 1, base, NODE)  # the small kernel into the store (the fleets may have run another)
    proc = subprocess.run([sys.executable, "-c", HITS, str(code), base["CUTE_DISKCACHE_REMOTE"], str(tmp / "hits"), str(runs)],
                          env=_env(base, tmp / "hits-first"), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"the hit process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _micro_hits(tmp: Path, url: str, fleet_key: str, runs: int) -> dict[str, Any]:
    """flashinfer's MoE micro kernel (~500 kB entry) as bench/remote.py measures it: fresh
    processes (engine starts) on fresh roots; the remote tier's one-time import taken out."""
    from cute_diskcache import _probe

    env = {"CUTE_DISKCACHE_REMOTE": url, "CUTE_DISKCACHE_REMOTE_TIMEOUT": "2", "CUTE_DISKCACHE_HMAC_KEY": fleet_key}
    cold = _probe.run(tmp / "micro-cold", [1], env=env)
    assert cold["events"][0][2] == "miss", cold["events"]
    remote, local = [], []
    for i in range(runs):
        r = _probe.run(tmp / f"micro-{i}", [1], env=env)
        assert r["events"][0][2] == "remote-hit", r["events"]
        remote.append(r["events"][0][3] - r["counters"]["remote_setup_seconds"])
    for i in range(runs):
        r = _probe.run(tmp / f"micro-{i}", [1], env=env)  # completed in the background by the run before
        assert r["events"][0][2] == "hit", r["events"]
        local.append(r["events"][0][3])
    import redis

    client = redis.Redis.from_url(url)
    digest = cold["events"][0][1]
    names = [k.decode() for k in client.keys(f"cute-diskcache/v1/*/{digest}*")]
    raw = {}
    for name in names:
        times, size = [], 0
        for _ in range(runs * 3):
            t = time.perf_counter()
            size = len(client.get(name))
            times.append(time.perf_counter() - t)
        raw["hit" if name.endswith(".hit") else "whole"] = {"p50_ms": statistics.median(times) * 1e3, "bytes": size}
    return {"compile_s": cold["events"][0][3], "remote_hit_p50_ms": statistics.median(remote) * 1e3, "remote_hit_min_ms": min(remote) * 1e3,
            "remote_hit_max_ms": max(remote) * 1e3, "local_hit_p50_ms": statistics.median(local) * 1e3, "raw_get": raw}


def _flush_store(kind: str, url: str) -> None:
    if kind == "redis":
        import redis

        redis.Redis.from_url(url).flushdb()
    else:
        import boto3

        s3 = boto3.resource("s3")
        s3.Bucket(BUCKET).objects.all().delete()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--backends", nargs="+", default=["redis", "s3"])
    ap.add_argument("--kernel", choices=["micro", "small"], default="micro",
                    help="the fleet's kernel: flashinfer's MoE micro kernel (m=1), or a small cached_compile kernel")
    ap.add_argument("--micro-runs", type=int, default=5, help="engine starts per figure for flashinfer's micro kernel (0: skip)")
    args = ap.parse_args()
    from moto.server import ThreadedMotoServer

    fleets: list[dict[str, Any]] = []
    micro: dict[str, Any] | None = None
    hits: dict[str, Any] = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cdc-bench-fleet-") as tmp_s:
        tmp = Path(tmp_s)
        code = tmp / "code"
        code.mkdir()
        (code / "cdc_fleet_kernel.py").write_text(KERNEL)
        redis_proc, redis_url = start_redis(tmp)
        port = free_port()
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        moto.start()
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(_aws(endpoint))
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        fleet_key = os.urandom(16).hex()
        stores = {"redis": {"CUTE_DISKCACHE_REMOTE": redis_url, "CUTE_DISKCACHE_REMOTE_TIMEOUT": "2"},
                  "s3": {"CUTE_DISKCACHE_REMOTE": f"s3://{BUCKET}/fleet", "CUTE_DISKCACHE_REMOTE_TIMEOUT": "4", **_aws(endpoint)}}
        try:
            run = 0
            for kind in args.backends:
                for n in args.nodes:
                    for lease in ("0", "1"):
                        _flush_store(kind, stores[kind]["CUTE_DISKCACHE_REMOTE"])
                        run += 1
                        d = tmp / f"run-{run}"
                        d.mkdir()
                        base = {**stores[kind], "CUTE_DISKCACHE_HMAC_KEY": fleet_key, "CUTE_DISKCACHE_REMOTE_LEASE": lease}
                        row = {"store": kind, "lease": lease == "1", **_fleet(d, code, n, base, NODE_MICRO if args.kernel == "micro" else NODE)}
                        print(json.dumps(row), flush=True)
                        fleets.append(row)
                # The store now holds the kernel (the last fleet published it): hits against it.
                d = tmp / f"hits-{kind}"
                d.mkdir()
                hits[kind] = _hits(d, code, {**stores[kind], "CUTE_DISKCACHE_HMAC_KEY": fleet_key}, args.runs)
                print(json.dumps({kind: hits[kind]}), flush=True)
            if args.micro_runs and "redis" in args.backends:
                _flush_store("redis", redis_url)
                d = tmp / "micro"
                d.mkdir()
                micro = _micro_hits(d, redis_url, fleet_key, args.micro_runs)
                print(json.dumps({"micro": micro}), flush=True)
        finally:
            redis_proc.terminate()
            redis_proc.wait(10)
            moto.stop()
    total = time.perf_counter() - t_all
    meta = dict(
        **stack_meta("shared with other work"),
        nodes=args.nodes, runs=args.runs, bench_seconds=total,
    )
    kernel_words = ("flashinfer's MoE micro kernel, m=1" if args.kernel == "micro" else "a small cached_compile kernel")
    lines = [
        f"# cute-diskcache fleet  {meta['date']}  flashinfer {meta['flashinfer']}  DSL {meta['dsl']}  redis-server {meta['redis_server']}  "
        f"moto {meta['moto']} (both loopback)",
        f"# machine: {meta['machine']}",
        f"# N cold nodes (processes, separate roots) ask for one kernel at once ({kernel_words}; rtx-pro-6000 profile, sm_120a);",
        "# wall = until the last node has it; lease off = CUTE_DISKCACHE_REMOTE_LEASE=0 (read-through + write-behind, as before)",
        f"{'store':<7}{'nodes':>6}{'lease':>7}{'compiles':>10}{'remote hits':>13}{'wall':>9}{'first ready':>13}{'median':>9}",
    ]
    for r in fleets:
        lines.append(f"{r['store']:<7}{r['nodes']:>6}{'on' if r['lease'] else 'off':>7}{r['compiles']:>10}{r['remote_hits']:>13}"
                     f"{r['wall_s']:>7.2f} s{r['first_ready_s']:>11.2f} s{r['median_ready_s']:>7.2f} s")
    lines.append("# every fleet: each node got a kernel; same launch result on every node (the ABI check on a GPU-less box): "
                 + ("yes" if all(r["kernels_alike"] for r in fleets) else "NO"))
    lines.append(f"# hits: small cached_compile kernel, p50 of {args.runs} in one process (fresh empty root each; the process's first remote hit apart)")
    lines.append(f"{'store':<7}{'remote hit':>12}{'(min-max)':>18}{'local hit':>11}{'raw GET .hit':>14}{'raw GET whole':>15}"
                 f"{'bytes/hit':>11}{'whole':>9}{'ratio*':>8}{'first remote hit':>18}")
    for kind, h in hits.items():
        ratio = h["remote_hit_p50_ms"] / (h["local_hit_p50_ms"] + h["raw_get"]["hit"]["p50_ms"])
        h["ratio_to_local_plus_get"] = ratio
        lines.append(
            f"{kind:<7}{h['remote_hit_p50_ms']:>9.2f} ms{h['remote_hit_min_ms']:>9.2f}-{h['remote_hit_max_ms']:.2f} ms{h['local_hit_p50_ms']:>8.2f} ms"
            f"{h['raw_get']['hit']['p50_ms']:>11.2f} ms{h['raw_get']['whole']['p50_ms']:>12.2f} ms{h['bytes_per_hit'] / 1e3:>8.0f} kB"
            f"{h['raw_get']['whole']['bytes'] / 1e3:>6.0f} kB{ratio:>7.2f}x{h['first_remote_hit_ms']:>12.1f} ms"
        )
    if micro is not None:
        ratio = micro["remote_hit_p50_ms"] / (micro["local_hit_p50_ms"] + micro["raw_get"]["hit"]["p50_ms"])
        micro["ratio_to_local_plus_get"] = ratio
        lines.append(
            f"{'micro*':<7}{micro['remote_hit_p50_ms']:>9.2f} ms{micro['remote_hit_min_ms']:>9.2f}-{micro['remote_hit_max_ms']:.2f} ms"
            f"{micro['local_hit_p50_ms']:>8.2f} ms{micro['raw_get']['hit']['p50_ms']:>11.2f} ms{micro['raw_get']['whole']['p50_ms']:>12.2f} ms"
            f"{micro['raw_get']['hit']['bytes'] / 1e3:>8.0f} kB{micro['raw_get']['whole']['bytes'] / 1e3:>6.0f} kB{ratio:>7.2f}x{'':>18}"
        )
        lines.append(f"# micro* = flashinfer 0.6.15.post1's MoE micro kernel on redis, p50 of {args.micro_runs} fresh engine starts each "
                     f"(as bench/remote.py: remote hit there 10.67 ms before this change); compile {micro['compile_s']:.2f} s")
    imports = ", ".join(f"{k} {h['first_setup_ms']:.0f} ms" for k, h in hits.items())
    lines.append("# ratio* = remote hit / (local hit + raw GET of the .hit value); target <= 2. bytes/hit: what the hit moved "
                 "(the whole entry follows in the background). first remote hit: includes importing the client library and "
                 f"connecting (import alone: {imports})")
    lines.append(f"# bench wall {total / 60:.1f} min; 2 cores shared with other engineers' tests: wall times are loaded-box figures")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fleet.txt").write_text(text + "\n")
    (RESULTS / "fleet.json").write_text(json.dumps(dict(meta=meta, fleets=fleets, hits=hits, micro=micro), indent=1) + "\n")
    print(f"wrote {RESULTS / 'fleet.json'} and fleet.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
