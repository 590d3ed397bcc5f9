"""Statistics: per-process files summed across processes, zeroing, compaction, hit-path cost."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest

from cute_diskcache.storage import stats

_WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from cute_diskcache.storage import stats
    stats.bind(Path(sys.argv[1]))
    for _ in range(int(sys.argv[2])):
        stats.record("ns-a", "hits")
    stats.record("ns-b", "compile_seconds", 2.5)
    """  # no explicit flush: the atexit hook must write the file
)


def _run_worker(root: Path, hits: int) -> None:
    subprocess.run([sys.executable, "-c", _WORKER, str(root), str(hits)], check=True, timeout=60)


def test_processes_sum_without_sharing_a_file(tmp_path: Path) -> None:
    for hits in (3, 4, 5):
        _run_worker(tmp_path, hits)
    files = list((tmp_path / "stats").glob("*.stats"))
    assert len(files) == 3, "one file per process: nobody waits for anybody"
    agg = stats.aggregate(tmp_path)
    assert agg["ns-a"]["hits"] == 12
    assert agg["ns-b"]["compile_seconds"] == pytest.approx(7.5)
    assert stats.totals(agg)["hits"] == 12


def test_zero_forgets_everything(tmp_path: Path) -> None:
    _run_worker(tmp_path, 2)
    assert stats.aggregate(tmp_path)
    stats.zero(tmp_path)
    assert stats.aggregate(tmp_path) == {}


def test_compaction_keeps_the_sum(tmp_path: Path) -> None:
    for hits in (1, 2, 3, 4):
        _run_worker(tmp_path, hits)  # all finished: their pids are gone
    before = stats.aggregate(tmp_path)
    after = stats.aggregate(tmp_path, compact=True)
    assert after == before
    files = [p for p in (tmp_path / "stats").iterdir() if not p.name.startswith(".")]
    assert len(files) == 1 and files[0].name.startswith("compacted-")
    assert stats.aggregate(tmp_path) == before


def test_damaged_file_counts_as_nothing(tmp_path: Path) -> None:
    _run_worker(tmp_path, 2)
    (tmp_path / "stats" / "junk-1-1.msgpack").write_bytes(b"\xc1 not msgpack")
    (tmp_path / "stats" / "odd-2-2.msgpack").write_bytes(msgpack.packb({"counts": {"ns-a": {"hits": 1, "rm -rf": 9}}}))
    agg = stats.aggregate(tmp_path)
    assert agg["ns-a"]["hits"] == 3 and "rm -rf" not in agg["ns-a"]


@pytest.mark.serial
def test_hit_path_recording_is_cheap(tmp_path: Path) -> None:
    """Issue 4 target: < 0.2 ms per hit for statistics. Measured here as a bound, printed.

    The best of 20 batches: a batch the scheduler gave to another process (the other worker's
    compile, a busy loop) is not the recording's cost, while a cost paid on every hit (a write
    or an fsync per record) is in every batch, the best one included."""
    stats.reset_for_tests()
    stats.bind(tmp_path)
    batches, n = 20, 1_000
    best = float("inf")
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            stats.record("ns", "hits")
            stats.record("ns", "load_seconds", 0.002)
            stats.record("ns", "saved_seconds", 2.0)
        best = min(best, time.perf_counter() - t0)
    per_hit_us = best / n * 1e6
    print(f"stats cost per hit: {per_hit_us:.2f} us (best of {batches} batches of {n})")
    stats.bind(None)
    stats.reset_for_tests()
    assert per_hit_us < 200


def test_unbound_process_writes_nothing(tmp_path: Path) -> None:
    code = "from cute_diskcache.storage import stats; stats.record('ns', 'hits')"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


# --------------------------------------------------------------------------------------------
# Forks, os._exit, liveness, bounded folding (issue 15, item 6 and 7)
# --------------------------------------------------------------------------------------------

_FORKING = textwrap.dedent(
    """
    import os, sys, threading
    from pathlib import Path
    from cute_diskcache.storage import stats
    stats.bind(Path(sys.argv[1]))
    for _ in range(5):
        stats.record("ns", "hits")
    pids = []
    for w in range(3):
        pid = os.fork()
        if pid == 0:  # a worker: counts, then leaves the way multiprocessing workers do
            for _ in range(10):
                stats.record("ns", "hits")
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        assert os.waitpid(pid, 0)[1] == 0
    # A lock some thread holds at fork time must not stay held in the child.
    held = threading.Event(); release = threading.Event()
    def hold():
        with stats._lock:
            held.set(); release.wait(5)
    t = threading.Thread(target=hold); t.start(); held.wait(5)
    pid = os.fork()
    if pid == 0:
        stats.record("ns", "hits")  # would deadlock on the parent's lock
        os._exit(0)
    release.set(); t.join()
    assert os.waitpid(pid, 0)[1] == 0
    os._exit(0)  # the parent leaves without atexit too
    """
)


def test_forked_workers_leaving_by_os_exit_lose_nothing(tmp_path: Path) -> None:
    """Measured on the old code: parent 5 hits + 3 forked workers x 10 hits -> 15 counted."""
    proc = subprocess.run([sys.executable, "-c", _FORKING, str(tmp_path)], timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert stats.aggregate(tmp_path)["ns"]["hits"] == 5 + 3 * 10 + 1
    assert len(list((tmp_path / "stats").glob("*.stats"))) == 5, "one file per process, forks included"


def test_liveness_is_the_files_lock_not_the_pid_or_host(tmp_path: Path) -> None:
    """A file whose process is alive is never folded, whatever its name says; one that is gone
    always is, from any host name (every Kubernetes pod has a new one)."""
    code = textwrap.dedent(
        """
        import sys, time
        from pathlib import Path
        from cute_diskcache.storage import stats
        stats.bind(Path(sys.argv[1])); stats.record("ns", "hits", 3)
        print("ready", flush=True); sys.stdin.readline()
        """
    )
    alive = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert alive.stdout is not None and alive.stdout.readline().strip() == "ready"
        _run_worker(tmp_path, 4)
        (mine,) = [p for p in (tmp_path / "stats").glob("*.stats") if f"-{alive.pid}-" in p.name]
        other_host = mine.with_name("some-other-pod-1-1.stats")  # a dead process's file under another host name
        other_host.write_bytes(next(p for p in (tmp_path / "stats").glob("*.stats") if p != mine).read_bytes())
        assert stats.fold(tmp_path) == 2 + 0, "the finished worker and the renamed copy; never the live one"
        assert mine.exists() and not other_host.exists()
        assert stats.totals(stats.aggregate(tmp_path))["hits"] == 3 + 4 + 4
    finally:
        alive.communicate("\n", timeout=60)
    assert stats.fold(tmp_path) == 2, "once it is gone its file folds, with the earlier fold"
    files = [p for p in (tmp_path / "stats").iterdir() if not p.name.startswith(".")]
    assert len(files) == 1 and files[0].name.startswith("compacted-"), "compacted files fold again: stats/ stays bounded"
    assert stats.totals(stats.aggregate(tmp_path))["hits"] == 11


def test_zero_zeroes_a_live_process_in_place(tmp_path: Path) -> None:
    stats.reset_for_tests()
    stats.bind(tmp_path)
    try:
        stats.record("ns", "hits", 4)
        _run_worker(tmp_path, 2)
        stats.zero(tmp_path)
        assert stats.aggregate(tmp_path) == {}
        stats.record("ns", "hits")  # this process keeps counting into its (zeroed) file
        assert stats.aggregate(tmp_path) == {"ns": {"hits": 1.0}}
    finally:
        stats.bind(None)
        stats.reset_for_tests()


def test_a_deployment_that_only_hits_keeps_stats_bounded(tmp_path: Path) -> None:
    """Issue 29, finding 12: 40 processes that only hit (no commit, so no housekeeping, and nobody
    ran ``stats``) left 40 files. A process making its file in a crowded ``stats/`` folds the
    finished ones: at most FOLD_AT + 1 files, and no count lost."""
    n = 24
    for _ in range(n):
        _run_worker(tmp_path, 1)
    files = [p for p in (tmp_path / "stats").iterdir() if not p.name.startswith(".")]
    assert len(files) <= getattr(stats, "FOLD_AT", 16) + 1, f"{len(files)} files after {n} processes"
    assert stats.aggregate(tmp_path)["ns-a"]["hits"] == n
