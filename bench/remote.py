"""Remote hit vs local hit vs compile, and what a dead or hung remote adds to a miss, side by side.

Every number comes from fresh interpreters (``cute_diskcache._probe``: a new engine start each),
on a redis-server this script starts on a free loopback port, every node signing with one fleet
key (``CUTE_DISKCACHE_HMAC_KEY``; without one the remote tier stays off), in one run:

1. cold: empty local root, remote empty: compile + persist, then publish at exit (write-behind);
2. local hit: the same root again (``--runs`` processes), with the remote configured, then without;
3. remote hit: ``--runs`` processes, each on a fresh empty root: fetch + verify + store + load;
4. dead remote (a closed port) and hung remote (a socket server that accepts and never answers),
   each on a fresh empty root: every kernel compiles; the added latency is the time spent on the
   remote before the compile.

The first local miss of a process imports the remote tier and redis-py; that one-time cost is
reported apart (``remote_setup_seconds``) and taken out of the first kernel's remote-hit time.
The first fetch still includes opening the connection.

Run:  python bench/remote.py [--m 1 16 128] [--runs 5] [--timeout 1.0]
Writes bench/results/remote.json and bench/results/remote.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from cute_diskcache import _probe

from loopback import free_port, start_redis  # noqa: E402  (bench/, beside this script)

RESULTS = Path(__file__).parent / "results"


def _hung_server() -> tuple[socket.socket, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                held.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    return sock, f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


def _run(root: Path, ms: list[int], target: str, env: dict[str, str]) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    report = _probe.run(root, ms, target=target, env=env)
    return report, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="rtx-pro-6000")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 128], help="1 -> micro, 16 -> static, 128 -> dynamic")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1.0, help="CUTE_DISKCACHE_REMOTE_TIMEOUT (default: the default, 1 s)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="cdc-bench-remote-") as tmp_s:
        tmp = Path(tmp_s)
        redis_proc, url = start_redis(tmp)
        hung_sock, hung_url = _hung_server()
        dead_url = f"redis://127.0.0.1:{free_port()}/0"
        # A fleet shares one signing key: without it the remote tier stays off (fail-closed).
        fleet = {"CUTE_DISKCACHE_HMAC_KEY": os.urandom(16).hex()}
        remote = {**fleet, "CUTE_DISKCACHE_REMOTE": url, "CUTE_DISKCACHE_REMOTE_TIMEOUT": str(args.timeout)}
        try:
            root = tmp / "node-a"
            cold, cold_wall = _run(root, args.m, args.target, remote)
            local = [_run(root, args.m, args.target, remote)[0] for _ in range(args.runs)]
            local_plain = [_run(root, args.m, args.target, fleet)[0] for _ in range(args.runs)]
            fetched = [_run(tmp / f"node-b{i}", args.m, args.target, remote)[0] for i in range(args.runs)]
            dead, dead_wall = _run(tmp / "node-dead", args.m, args.target, {**remote, "CUTE_DISKCACHE_REMOTE": dead_url})
            hung, hung_wall = _run(tmp / "node-hung", args.m, args.target, {**remote, "CUTE_DISKCACHE_REMOTE": hung_url})
        finally:
            redis_proc.terminate()
            redis_proc.wait(10)
            hung_sock.close()

    kinds = [e[0].rsplit(".", 1)[-1] for e in cold["events"]]
    assert all(e[2] == "miss" for e in cold["events"]), cold["events"]
    assert all(e[2] == "hit" for r in local + local_plain for e in r["events"]), "a local run missed"
    assert all(e[2] == "remote-hit" for r in fetched for e in r["events"]), [r["events"] for r in fetched]
    assert all(r["counters"]["compiles"] == 0 for r in local + local_plain + fetched)
    assert all(e[2] == "miss" for r in (dead, hung) for e in r["events"])

    def remote_hit(r: dict[str, Any], i: int) -> float:
        # The first fetch of a process also imported the remote tier and redis-py: counted apart.
        return r["events"][i][3] - (r["counters"]["remote_setup_seconds"] if i == 0 else 0.0)

    rows = []
    for i, kind in enumerate(kinds):
        compile_s = cold["events"][i][3]
        lh = statistics.median(r["events"][i][3] for r in local)
        lp = statistics.median(r["events"][i][3] for r in local_plain)
        rh_all = [remote_hit(r, i) for r in fetched]
        rh = statistics.median(rh_all)
        rows.append(dict(kernel=kind, compile_s=compile_s, persist_s=cold["events"][i][4], local_hit_ms=lh * 1e3,
                         local_hit_no_remote_ms=lp * 1e3, remote_hit_ms=rh * 1e3, remote_hit_min_ms=min(rh_all) * 1e3,
                         remote_hit_max_ms=max(rh_all) * 1e3, remote_over_local=rh / lh, compile_over_remote=compile_s / rh))
    setup = [r["counters"]["remote_setup_seconds"] for r in fetched]
    bytes_in = statistics.median(r["counters"]["remote_bytes_in"] for r in fetched)
    fail = {}
    for label, r, wall in (("dead", dead, dead_wall), ("hung", hung, hung_wall)):
        c = r["counters"]
        fail[label] = dict(added_per_miss_ms=1e3 * c["remote_seconds"] / len(kinds), added_total_ms=1e3 * c["remote_seconds"],
                           setup_ms=1e3 * c["remote_setup_seconds"], errors=c["remote_errors"], skipped=c["remote_skipped"],
                           compiles=c["compiles"], process_wall_s=wall, compile_s=sum(e[3] for e in r["events"]))
    meta = dict(
        date=time.strftime("%Y-%m-%d"),
        machine=f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, no GPU",
        flashinfer=version("flashinfer-python"), dsl=version("nvidia-cutlass-dsl"), redis_py=version("redis"),
        redis_server=subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2],
        target=args.target, ms=args.m, runs=args.runs, timeout_s=args.timeout,
        cold_process_wall_s=cold_wall,
    )
    lines = [
        f"# cute-diskcache remote tier  {meta['date']}  flashinfer {meta['flashinfer']}  DSL {meta['dsl']}  redis-py {meta['redis_py']}  "
        f"redis-server {meta['redis_server']} (loopback)",
        f"# machine: {meta['machine']}; target {args.target}; hits = p50 of {args.runs} fresh processes; remote timeout {args.timeout:g} s",
        f"{'kernel':<9}{'compile':>9}{'local hit':>11}{'(no remote set)':>17}{'remote hit':>12}{'(min-max)':>18}{'remote/local':>14}{'compile/remote':>16}",
    ]
    for r in rows:
        lines.append(
            f"{r['kernel']:<9}{r['compile_s']:>7.2f} s{r['local_hit_ms']:>8.2f} ms{r['local_hit_no_remote_ms']:>14.2f} ms"
            f"{r['remote_hit_ms']:>9.2f} ms{r['remote_hit_min_ms']:>9.2f}-{r['remote_hit_max_ms']:.2f} ms"
            f"{r['remote_over_local']:>13.1f}x{r['compile_over_remote']:>15.0f}x"
        )
    lines.append(
        f"remote hit = fetch ({bytes_in / len(kinds) / 1e3:.0f} kB per entry) + verify + store locally + load; once per process the first "
        f"local miss also imports the remote tier and redis-py: p50 {statistics.median(setup) * 1e3:.0f} ms "
        f"(min {min(setup) * 1e3:.0f}, max {max(setup) * 1e3:.0f})"
    )
    for label, f in fail.items():
        lines.append(
            f"{label} remote: {f['added_per_miss_ms']:.1f} ms added per miss ({f['added_total_ms']:.0f} ms over {len(kinds)} misses; "
            f"{f['errors']} failed calls incl. publishes, {f['skipped']} skipped by the breaker; + {f['setup_ms']:.0f} ms import once); "
            f"compiles {f['compiles']} ({f['compile_s']:.1f} s); process wall {f['process_wall_s']:.1f} s"
        )
    lines.append(f"cold process (compile + persist + publish at exit): wall {cold_wall:.1f} s")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "remote.txt").write_text(text + "\n")
    (RESULTS / "remote.json").write_text(json.dumps(dict(meta=meta, rows=rows, failures=fail), indent=1) + "\n")
    print(f"wrote {RESULTS / 'remote.json'} and remote.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
