"""The fleet lease under faults (issue 29): a matrix of what goes wrong, on Redis and moto's S3.

For each store and each fault, N cold nodes (fresh interpreters, separate empty roots, one
signing key) ask for one real kernel at once (``cute_diskcache.cached_compile`` of bench/fleet.py's
small kernel, compiled by the real DSL for the rtx-pro-6000 profile), and a fault is dealt while
they coordinate:

* ``none``: the baseline;
* ``holder-killed``: the node that took the lease is SIGKILLed while it compiles;
* ``holder-stalled``: that node is SIGSTOPped for the lease's TTL plus 2 s (a GC pause, a
  throttled container), then resumed: it finishes its compile and publishes;
* ``remote-killed`` / ``remote-paused``: the store itself is SIGKILLed, or SIGSTOPped for
  :data:`PAUSE_S` seconds, while the other nodes wait for the holder;
* ``409``: every node's first :data:`CONFLICTS` conditional writes of the lease are answered
  409 ConditionalRequestConflict, as AWS answers conditional writes that race (S3 only: moto
  never sends it, so the nodes' S3 client injects it; Redis has no such answer);
* ``stale-race``: a holder is killed before anyone else starts; the others start once its lease
  is stale and race to take it over.

For each: compiles in the fleet (compiles started, the killed one's included), wall time from the
start signal to every surviving node having its kernel, whether anything wrong was loaded (every
surviving node's entry is checked against the fleet's key and signature, and every node got the
same kernel: same class, same object bytes as a compiling node's), the longest a node waited
before it compiled or loaded, against the documented bound (``CUTE_DISKCACHE_LOCK_TIMEOUT``: one
bound for the local lock and the lease together), and for the faults the time from the fault to
the first node acting on it, against the bound the docs give for it (a dead holder: the TTL plus
one poll and one call; a dead or hung store: one remote timeout plus one poll and one call).

Each compile is stretched by ``--stretch`` seconds (the DSL compile of the small kernel is about
a second here; flashinfer's MoE kernels take 2-6 s), so that a fault lands while the holder
compiles. The lease's TTL is a constructor argument, not a setting (20 s in production): the
nodes take ``--ttl`` so that a dead holder costs seconds here.

Run:  python bench/fleet_faults.py [--nodes 3] [--stores redis s3] [--faults ...]
Writes bench/results/fleet_faults.json and bench/results/fleet_faults.txt (unless --no-write).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet import KERNEL, _aws  # noqa: E402  (the kernel and the moto credentials bench/fleet.py uses)
from loopback import free_port, stack_meta, start_redis  # noqa: E402

RESULTS = Path(__file__).parent / "results"
BUCKET = "cdc-bench-faults"
FAULTS = ("none", "holder-killed", "holder-stalled", "remote-killed", "remote-paused", "409", "stale-race")
#: Seconds the store is stopped in ``remote-paused``.
PAUSE_S = 6.0
#: Conditional lease writes each node's S3 client answers with 409 in ``409``.
CONFLICTS = 3
#: Remote timeouts, as bench/fleet.py sets them (an object store over HTTP gets more).
TIMEOUTS = {"redis": 1.0, "s3": 2.0}
LOCK_TIMEOUT_S = 30.0
POLL_MAX_S = 1.0  # cute_diskcache.remote.lease.POLL_MAX_S

# argv: code dir, ready file, go file, marks dir. Env: the node's CUTE_DISKCACHE_* settings, and
# BENCH_TTL, BENCH_STRETCH_S, BENCH_409 (conditional writes to answer 409, S3 only).
NODE = textwrap.dedent(
    """
    import json, logging, os, sys, time
    from pathlib import Path
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from cute_diskcache.keys import targets
    targets.apply("rtx-pro-6000")
    import cute_diskcache, cutlass, cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cute_diskcache.core import cache as cache_mod
    from cute_diskcache import config
    from cute_diskcache.core.cache import CompileCache
    from cute_diskcache.remote.client import RemoteCache
    from cute_diskcache.storage.store import Store
    sys.path.insert(0, sys.argv[1])
    import cdc_fleet_kernel as kern
    import redis, s3fs
    ready, go, marks = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    stretch, ttl, conflicts = float(os.environ["BENCH_STRETCH_S"]), float(os.environ["BENCH_TTL"]), int(os.environ["BENCH_409"])
    settings = config.load()
    # The process-wide cache with the bench's lease TTL (a constructor argument, not a setting).
    remote = RemoteCache(settings.remote, timeout=settings.remote_timeout, hmac_key=settings.hmac_key,
                         cooldown=settings.remote_cooldown, lease_ttl=ttl)
    cache_mod._default = CompileCache(Store.for_settings(settings), lock_timeout=settings.lock_timeout, remote=remote)
    injected = [0]
    if conflicts:  # AWS's answer to conditional writes that race; moto never gives it
        from botocore.exceptions import ClientError
        from s3fs.errors import translate_boto_error
        fs = s3fs.S3FileSystem()  # fsspec hands the remote tier this same instance
        real_call = fs.call_s3
        def call_s3(method, *a, **kw):
            if method == "put_object" and ("IfNoneMatch" in kw or "IfMatch" in kw) and injected[0] < conflicts:
                injected[0] += 1
                raise translate_boto_error(ClientError({"Error": {"Code": "ConditionalRequestConflict", "Message": "conflict"},
                                                        "ResponseMetadata": {"HTTPStatusCode": 409}}, "PutObject"))
            return real_call(method, *a, **kw)
        fs.call_s3 = call_s3
    real_compile = cute.compile
    started = []
    def compile_(*a, **kw):
        started.append(time.time())
        (marks / f"compiling-{os.getpid()}").write_text(str(started[-1]))
        time.sleep(stretch)
        return real_compile(*a, **kw)
    cute.compile = compile_
    x = make_fake_compact_tensor(cutlass.Float32, (32,))
    ready.touch()
    while not go.exists():
        time.sleep(0.002)
    kernel = cute_diskcache.cached_compile(kern.scale, x, key=("scale", 32))
    done = time.time()
    remote.flush(10)
    c = cute_diskcache.counters()
    print(json.dumps({"pid": os.getpid(), "ready": done, "compile_started": started[0] if started else None,
                      "kernel": type(kernel).__name__, "injected_409": injected[0], "events": [e[2] for e in cache_mod._default.events],
                      **{k: c.get(k) for k in ("compiles", "hits", "remote_hits", "remote_errors", "leases", "lease_waits")}}))
    """
)


# --------------------------------------------------------------------------------------------
# Stores: a fresh one per fleet, in its own process (so that it can be killed or stopped)
# --------------------------------------------------------------------------------------------


class _Store:
    def __init__(self, kind: str, workdir: Path) -> None:
        self.kind = kind
        if kind == "redis":
            self.proc, self.url = start_redis(workdir)
            self.env: dict[str, str] = {}
            return
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.env = _aws(self.endpoint)
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"s3://{BUCKET}/fleet"
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                              aws_secret_access_key="testing")
        for _ in range(300):
            try:
                client.create_bucket(Bucket=BUCKET)
                return
            except Exception:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise SystemExit("moto's server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


# --------------------------------------------------------------------------------------------
# One fleet under one fault
# --------------------------------------------------------------------------------------------


def _node_env(store: _Store, root: Path, fleet_key: str, ttl: float, stretch: float, conflicts: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}
    env.update(store.env)
    env.update(CUTE_DISKCACHE_DIR=str(root), CUTE_DSL_ARCH="sm_120a", CUTE_DISKCACHE_REMOTE=store.url,
               CUTE_DISKCACHE_REMOTE_TIMEOUT=str(TIMEOUTS[store.kind]), CUTE_DISKCACHE_HMAC_KEY=fleet_key,
               CUTE_DISKCACHE_LOCK_TIMEOUT=str(LOCK_TIMEOUT_S), BENCH_TTL=str(ttl), BENCH_STRETCH_S=str(stretch),
               BENCH_409=str(conflicts))
    return env


def _start(tmp: Path, code: Path, names: list[str], store: _Store, fleet_key: str, ttl: float, stretch: float,
           conflicts: int) -> dict[str, subprocess.Popen[str]]:
    procs = {}
    for name in names:
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", NODE, str(code), str(tmp / f"ready-{name}"), str(tmp / "go"), str(tmp / "marks")],
            env=_node_env(store, tmp / name, fleet_key, ttl, stretch, conflicts), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not all((tmp / f"ready-{n}").exists() for n in names):
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            for p in procs.values():
                p.kill()
            raise SystemExit(f"node {dead} did not start: " + "".join(procs[n].communicate()[1][-2000:] for n in dead))
        time.sleep(0.02)
    return procs


def _first_compiler(marks: Path, procs: dict[str, subprocess.Popen[str]], timeout: float = 120) -> tuple[str, float]:
    """The node that started compiling first (the lease's holder), and when (wall clock)."""
    deadline = time.monotonic() + timeout
    by_pid = {p.pid: n for n, p in procs.items()}
    while time.monotonic() < deadline:
        found = sorted((float(f.read_text() or 0), int(f.name.split("-")[1])) for f in marks.glob("compiling-*") if f.read_text())
        if found:
            return by_pid[found[0][1]], found[0][0]
        time.sleep(0.01)
    raise SystemExit("nobody started compiling")


def _entry_check(root: Path, fleet_key: str) -> tuple[bool, str | None]:
    """Whether ``root`` holds exactly one entry that passes the import checks under the fleet's
    key, and the sha256 of its object (None when there is none)."""
    from cute_diskcache.storage import entry, ingest, layout

    dirs = list(layout.entry_dirs(root))
    if len(dirs) != 1:
        return len(dirs) == 0, None
    try:
        manifest, obj = ingest.check(dirs[0], hmac_key=fleet_key.encode())
    except entry.EntryError:
        return False, None
    return True, hashlib.sha256(obj).hexdigest()


def run_fleet(kind: str, fault: str, nodes: int, tmp: Path, code: Path, *, ttl: float, stretch: float) -> dict[str, Any]:
    """One fleet of ``nodes`` on a fresh ``kind`` store under ``fault``; the row of the matrix."""
    fleet_key = os.urandom(16).hex()
    (tmp / "marks").mkdir(parents=True)
    store = _Store(kind, tmp)
    conflicts = CONFLICTS if fault == "409" else 0
    names = [f"node-{i}" for i in range(nodes)]
    killed: list[str] = []
    fault_at: float | None = None
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        if fault == "stale-race":  # a holder that dies with the lease, before anyone else asks
            first = _start(tmp, code, ["node-dead"], store, fleet_key, ttl, stretch, 0)
            (tmp / "go").touch()
            _first_compiler(tmp / "marks", first)
            first["node-dead"].kill()
            first["node-dead"].wait()
            killed.append("node-dead")
            fault_at = time.time()
            (tmp / "go").unlink()
            procs = _start(tmp, code, names, store, fleet_key, ttl, stretch, conflicts)
            time.sleep(max(0.0, fault_at + ttl + 0.3 - time.time()))  # its lease is stale now: they race for it
            fault_at = time.time()  # what is measured: how soon one of them takes it over
        else:
            procs = _start(tmp, code, names, store, fleet_key, ttl, stretch, conflicts)
        go = time.time()
        (tmp / "go").touch()
        if fault in ("holder-killed", "holder-stalled", "remote-killed", "remote-paused"):
            holder, _ = _first_compiler(tmp / "marks", procs)
            time.sleep(0.5)  # the others are waiting on the lease now
            fault_at = time.time()
            if fault == "holder-killed":
                procs[holder].kill()
                killed.append(holder)
            elif fault == "holder-stalled":
                procs[holder].send_signal(signal.SIGSTOP)
                time.sleep(ttl + 2.0)
                procs[holder].send_signal(signal.SIGCONT)
            elif fault == "remote-killed":
                store.proc.kill()
            else:
                store.proc.send_signal(signal.SIGSTOP)
                time.sleep(PAUSE_S)
                store.proc.send_signal(signal.SIGCONT)
        reports: dict[str, dict[str, Any]] = {}
        for name, p in procs.items():
            out, err = p.communicate(timeout=600)
            if name in killed:
                continue
            if p.returncode != 0:
                raise SystemExit(f"{name} failed under {kind}/{fault}:\n{err[-3000:]}")
            reports[name] = json.loads(out.strip().splitlines()[-1])
            # the remote tier's warnings (each compile's own "compiling ..." line aside)
            reports[name]["warnings"] = [ln for ln in err.splitlines() if ln.startswith("WARNING") and not ln.startswith("WARNING compiling")]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        store.stop()
    compiles = len(list((tmp / "marks").glob("compiling-*")))
    checks = {n: _entry_check(tmp / n, fleet_key) for n in reports}
    compiled_objects = {checks[n][1] for n, r in reports.items() if r["compile_started"] is not None}
    wrong = [n for n, (ok, sha) in checks.items() if not ok or (sha is not None and compiled_objects and sha not in compiled_objects)]
    wrong += [n for n, r in reports.items() if r["kernel"] != next(iter(reports.values()))["kernel"]]
    waits = {n: (r["compile_started"] or r["ready"]) - go for n, r in reports.items()}
    acted = [r["compile_started"] for r in reports.values() if r["compile_started"] is not None and fault_at is not None
             and r["compile_started"] >= fault_at]
    timeout = TIMEOUTS[kind]
    fault_bound = {"holder-killed": ttl + POLL_MAX_S + timeout, "holder-stalled": ttl + POLL_MAX_S + timeout,
                   "stale-race": 2 * timeout, "remote-killed": POLL_MAX_S + 2 * timeout,
                   "remote-paused": POLL_MAX_S + 2 * timeout}.get(fault)
    return {
        "store": kind, "fault": fault, "nodes": nodes, "compiles": compiles, "killed": len(killed),
        "ready_nodes": len(reports), "wall_s": max(r["ready"] for r in reports.values()) - go,
        "wrong_loaded": sorted(set(wrong)), "distinct_objects": len({sha for _ok, sha in checks.values() if sha}),
        "max_wait_s": max(waits.values()), "bound_s": LOCK_TIMEOUT_S,
        "after_fault_s": (min(acted) - fault_at) if acted and fault_at is not None else None, "fault_bound_s": fault_bound,
        "remote_hits": sum(r["remote_hits"] or 0 for r in reports.values()),
        "warnings": sum(len(r["warnings"]) for r in reports.values()),
        "warning_lines": sorted({w for r in reports.values() for w in r["warnings"]})[:6],
        "injected_409": sum(r["injected_409"] for r in reports.values()),
    }


def matrix(stores: list[str], faults: list[str], nodes: int, *, ttl: float, stretch: float) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="cdc-bench-faults-") as tmp_s:
        tmp = Path(tmp_s)
        code = tmp / "code"
        code.mkdir()
        (code / "cdc_fleet_kernel.py").write_text(KERNEL)
        for kind in stores:
            for fault in faults:
                if fault == "409" and kind != "s3":
                    continue  # Redis answers SET NX with yes or no: there is no conflict to inject
                d = tmp / f"{kind}-{fault}"
                row = run_fleet(kind, fault, nodes, d, code, ttl=ttl, stretch=stretch)
                print(json.dumps(row), flush=True)
                rows.append(row)
                shutil.rmtree(d, ignore_errors=True)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'store':<6}{'fault':<16}{'nodes':>6}{'compiles':>9}{'wall':>9}{'wrong':>7}{'max wait':>10}"
             f"{'bound':>8}{'after fault':>13}{'bound':>8}{'warnings':>10}"]
    for r in rows:
        after = "-" if r["after_fault_s"] is None else f"{r['after_fault_s']:.2f} s"
        fbound = "-" if r["fault_bound_s"] is None else f"{r['fault_bound_s']:.1f} s"
        nodes = f"{r['nodes']}" + (f"+{r['killed']}" if r["fault"] == "stale-race" else "")
        lines.append(f"{r['store']:<6}{r['fault']:<16}{nodes:>6}{r['compiles']:>9}{r['wall_s']:>7.2f} s{len(r['wrong_loaded']):>7}"
                     f"{r['max_wait_s']:>8.2f} s{r['bound_s']:>6.0f} s{after:>13}{fbound:>8}{r['warnings']:>10}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--stores", nargs="+", default=["redis", "s3"], choices=["redis", "s3"])
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    ap.add_argument("--ttl", type=float, default=3.0, help="the lease's time-to-live in the nodes (production: 20 s)")
    ap.add_argument("--stretch", type=float, default=3.0, help="seconds added to each compile, so a fault lands during it")
    ap.add_argument("--no-write", action="store_true", help="print only (the test's small run)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = matrix(args.stores, args.faults, args.nodes, ttl=args.ttl, stretch=args.stretch)
    total = time.perf_counter() - t0
    meta = dict(
        **stack_meta(),
        nodes=args.nodes, ttl_s=args.ttl, stretch_s=args.stretch, lock_timeout_s=LOCK_TIMEOUT_S, remote_timeouts=TIMEOUTS,
        pause_s=PAUSE_S, conflicts=CONFLICTS, bench_seconds=total,
    )
    lines = [
        f"# cute-diskcache fleet lease under faults  {meta['date']}  DSL {meta['dsl']}  redis-server {meta['redis_server']}  "
        f"moto {meta['moto']} (own processes, loopback)",
        f"# machine: {meta['machine']}",
        f"# {args.nodes} cold nodes ask for one real kernel at once (bench/fleet.py's small kernel, compiled by the DSL, "
        f"+{args.stretch:g} s per compile); lease TTL {args.ttl:g} s; LOCK_TIMEOUT {LOCK_TIMEOUT_S:g} s; remote timeout "
        f"redis {TIMEOUTS['redis']:g} s, s3 {TIMEOUTS['s3']:g} s",
        "# compiles: started in the fleet (a killed holder's included); wall: start signal to every surviving node ready;",
        "# wrong: nodes whose entry failed the fleet's checks, or whose kernel or object differs from a compiling node's;",
        "# max wait: longest a node waited before compiling or loading, against LOCK_TIMEOUT; after fault: from the fault to the",
        "# first node compiling because of it, against the documented bound (dead holder: TTL + 1 s poll + 1 call; dead or",
        "# hung store: 1 s poll + 2 calls; a stale lease when they start: 2 calls, the fetch and the takeover)",
        *table(rows),
        f"# stale-race: N+1 = one holder killed first, then N nodes racing its stale lease; 409: {CONFLICTS} conditional lease "
        "writes answered 409 per node (S3 only); remote-paused: the store SIGSTOPped for "
        f"{PAUSE_S:g} s",
        f"# bench wall {total / 60:.1f} min",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "fleet_faults.txt").write_text(text + "\n")
        (RESULTS / "fleet_faults.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
        print(f"wrote {RESULTS / 'fleet_faults.json'} and fleet_faults.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
