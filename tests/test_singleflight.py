"""Single-flight: N processes missing one kernel cost one compile, and nothing can wedge them.

The races pinned down here, each with real processes:

* 16 cold engines on one key: one real compile among them all (counted by conftest's
  independent hook, not by us), every engine gets the kernel with the cold start's ABI;
* with ``CUTE_DISKCACHE_SINGLE_FLIGHT=0`` the lock is ignored and engines compile side by side;
* a holder SIGKILLed while holding the lock: the kernel drops its ``flock``, waiters go on;
* a holder that never lets go: after ``CUTE_DISKCACHE_LOCK_TIMEOUT`` one warning, then compile;
* a store that cannot write never takes a lock.

The module-level unit tests drive :mod:`cute_diskcache.storage.locking` directly (no flashinfer).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import filelock
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers / conftest, whatever pytest's import mode

from _helpers import make_artifact, make_key  # noqa: E402
from conftest import PROBE_TIMEOUT_S, TARGET, child_env, split_stderr  # noqa: E402

from cute_diskcache.storage import locking  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402

if TYPE_CHECKING:
    from conftest import Warm

Probe = Callable[..., dict[str, Any]]
_TIMEOUT_LINE = re.compile(r"^cute-diskcache waited .* compiling it here too.*$", re.M)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cute_diskcache" and r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------------------------
# Real processes
# --------------------------------------------------------------------------------------------


def _spawn(hook_dir: Path, root: Path, *ms: int, extra_env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """A probe started now, not waited for (conftest's ``probe`` runs one to completion)."""
    cmd = [sys.executable, "-m", "cute_diskcache._probe", "--target", TARGET, "--m", *map(str, ms or (1,))]
    return subprocess.Popen(
        cmd, env=child_env(root, extra_env, hook_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=hook_dir
    )


def _report(proc: subprocess.Popen[str], timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"probe exited {proc.returncode}\n{err[-4000:]}"
    report: dict[str, Any] = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    report["stderr"], report["cache_log"], report["real_compiles"] = split_stderr(err)
    return report


def _run_all(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    try:
        return [_report(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_until_idle(procs: list[subprocess.Popen[str]], timeout: float = 240.0) -> None:
    """Until every process burns (almost) no CPU for two seconds: asleep between lock polls.

    A waiter polls its lock 20 times a second and sleeps otherwise, so this is how a test sees
    "every one of them is waiting" without instrumenting the code under test.
    """
    deadline = time.monotonic() + timeout
    quiet = 0
    last = [_cpu_seconds(p.pid) for p in procs]
    while time.monotonic() < deadline:
        time.sleep(1.0)
        assert all(p.poll() is None for p in procs), "a waiter finished while the lock was held"
        now = [_cpu_seconds(p.pid) for p in procs]
        quiet = quiet + 1 if max(b - a for a, b in zip(last, now)) < 0.05 else 0
        last = now
        if quiet >= 2:
            return
    pytest.fail("the probes never settled into waiting for the lock")


@pytest.fixture
def micro_digest(warm_micro_root: Warm) -> str:
    """The digest of the m=1 micro kernel (the same key in every root)."""
    [event] = warm_micro_root.cold["events"]
    return str(event[1])


@pytest.fixture
def held_lock(tmp_path: Path, micro_digest: str) -> Iterator[tuple[Path, filelock.BaseFileLock]]:
    """An empty root whose m=1 key's lock this test process holds, with the same library."""
    root = tmp_path / "root"
    path = locking.lock_path(root, micro_digest)
    path.parent.mkdir(parents=True)
    lock = filelock.UnixFileLock(str(path))
    lock.acquire(timeout=0)
    try:
        yield root, lock
    finally:
        if lock.is_locked:
            lock.release()


def _assert_same_kernel(report: dict[str, Any], cold: dict[str, Any]) -> None:
    assert report["kernels"] == cold["kernels"]
    assert report["records"][0]["launch_error"] == cold["records"][0]["launch_error"]


@pytest.mark.serial
@pytest.mark.slow
def test_sixteen_cold_processes_compile_once(compile_hook_dir: Path, warm_micro_root: Warm, tmp_path: Path) -> None:
    root = tmp_path / "root"
    t0 = time.monotonic()
    reports = _run_all([_spawn(compile_hook_dir, root, 1) for _ in range(16)])
    wall = time.monotonic() - t0
    compiles = [r["real_compiles"] for r in reports]
    assert sum(compiles) == 1, compiles
    assert sum(r["counters"]["compiles"] for r in reports) == 1
    assert sum(r["counters"]["hits"] for r in reports) == 15
    assert sum(r["counters"]["writes"] for r in reports) == 1
    for r in reports:
        _assert_same_kernel(r, warm_micro_root.cold)
        assert r["counters"]["rejected"] == 0 and r["counters"]["errors"] == 0
        assert r["stderr"] == "", r["stderr"]
    assert len(list(root.glob("v1/*/*/*/manifest.msgpack"))) == 1
    waits = [r["counters"]["lock_wait_seconds"] for r in reports if r["counters"]["lock_waits"]]
    print(f"\n16 processes: wall {wall:.1f} s, {len(waits)} waited (max {max(waits, default=0):.1f} s)")


@pytest.mark.serial
def test_single_flight_off_ignores_the_lock(compile_hook_dir: Path, warm_micro_root: Warm, held_lock: tuple[Path, Any]) -> None:
    """With the key's lock held all along, engines still finish: they never asked for it."""
    root, lock = held_lock
    env = {"CUTE_DISKCACHE_SINGLE_FLIGHT": "0"}
    reports = _run_all([_spawn(compile_hook_dir, root, 1, extra_env=env) for _ in range(3)])
    assert lock.is_locked
    compiles = [r["real_compiles"] for r in reports]
    # Three engines started together all miss before the first commit (a compile is ~2 s): they
    # do the same work side by side, so a loaded machine slows them alike and none gets a
    # compile ahead of the others. Asking for the lock shows apart from time: lock_waits below.
    assert sum(compiles) >= 2, compiles
    for r in reports:
        _assert_same_kernel(r, warm_micro_root.cold)
        assert r["counters"]["lock_waits"] == 0 and r["stderr"] == ""
    assert len(list(root.glob("v1/*/*/*/manifest.msgpack"))) == 1
    assert [p.name for p in root.glob("locks/*/*")] == [f"{lock.lock_file.rsplit('/', 1)[-1]}"]


def test_holder_killed_while_holding_does_not_wedge_waiters(
    compile_hook_dir: Path, warm_micro_root: Warm, tmp_path: Path, micro_digest: str
) -> None:
    root = tmp_path / "root"
    holder = _holder(root, micro_digest)
    waiters: list[subprocess.Popen[str]] = []
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "acquired"
        waiters = [_spawn(compile_hook_dir, root, 1) for _ in range(2)]
        _wait_until_idle(waiters)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        killed_at = time.monotonic()
        reports = _run_all(waiters)
        after_kill = time.monotonic() - killed_at
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        for w in waiters:
            if w.poll() is None:
                w.kill()
                w.wait()
    assert [r["real_compiles"] for r in reports] in ([1, 0], [0, 1])  # still single-flight after the kill
    for r in reports:
        _assert_same_kernel(r, warm_micro_root.cold)
        assert r["counters"]["lock_waits"] == 1 and r["stderr"] == ""
    # Promptly: one compile (~2 s) plus one load, nowhere near the 300 s lock timeout.
    assert after_kill < 60, after_kill
    print(f"\nwaiters done {after_kill:.1f} s after the holder was killed")


@pytest.mark.serial
def test_lock_timeout_warns_once_and_compiles(compile_hook_dir: Path, warm_micro_root: Warm, held_lock: tuple[Path, Any]) -> None:
    root, lock = held_lock
    timeout = 2.0
    [report] = _run_all([_spawn(compile_hook_dir, root, 1, extra_env={"CUTE_DISKCACHE_LOCK_TIMEOUT": f"{timeout:g}"})])
    assert lock.is_locked
    assert report["real_compiles"] == 1
    c = report["counters"]
    assert (c["compiles"], c["writes"], c["lock_waits"]) == (1, 1, 1)
    # At least the timeout, past it by one 50 ms poll and a wake-up however loaded the machine:
    # under twice it. Not honoured, the wait is the 300 s default (the probe's own timeout).
    assert timeout <= c["lock_wait_seconds"] < 2 * timeout, c["lock_wait_seconds"]
    _assert_same_kernel(report, warm_micro_root.cold)
    lines = report["stderr"].splitlines()
    assert len(lines) == 1 and _TIMEOUT_LINE.match(lines[0]) and "LOCK_TIMEOUT=2" in lines[0], report["stderr"]


def test_readonly_store_takes_no_lock(compile_hook_dir: Path, warm_micro_root: Warm, held_lock: tuple[Path, Any]) -> None:
    """READONLY=1 with the key's lock held elsewhere: it never waits, compiles in memory, writes nothing."""
    root, lock = held_lock
    before = sorted(root.rglob("*"))
    [report] = _run_all([_spawn(compile_hook_dir, root, 1, extra_env={"CUTE_DISKCACHE_READONLY": "1"})])
    assert report["real_compiles"] == 1
    c = report["counters"]
    assert (c["compiles"], c["writes"], c["lock_waits"], c["writable"]) == (1, 0, 0, False)
    assert report["stderr"] == ""
    _assert_same_kernel(report, warm_micro_root.cold)
    assert sorted(root.rglob("*")) == before


def test_detected_read_only_root_takes_no_lock(tmp_path: Path) -> None:
    """A read-only mount (made real in a private mount namespace): no lock, one warning, no files."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    root = tmp_path / "ro"
    root.mkdir()
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from _helpers import make_artifact, make_key
        from cute_diskcache.storage.store import Store
        store = Store({str(root)!r})
        key = make_key("micro")
        assert store.lookup_or_quarantine(key) is None and store.writable  # reading warns about nothing
        with store.single_flight(key) as flight:
            print(flight.outcome, store.writable, store.commit(key, make_artifact()))
        """
    )
    q = shlex.quote(str(root))
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-ec", f'mount --bind {q} {q} && mount -o remount,bind,ro {q} && exec "$0" -c "$1"', sys.executable, code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0 and "mount" in proc.stderr and "Traceback" not in proc.stderr:
        pytest.skip(f"private mount namespaces are not permitted here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["off", "False", "None"]
    warnings = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1 and "read-only filesystem" in warnings[0], proc.stderr
    assert list(root.iterdir()) == []


# --------------------------------------------------------------------------------------------
# The lock on its own (no flashinfer): fast
# --------------------------------------------------------------------------------------------

DIGEST = "ab" * 32


def test_uncontended_lock_is_acquired_at_once(tmp_path: Path) -> None:
    with locking.single_flight(tmp_path, DIGEST) as flight:
        assert (flight.held, flight.outcome, flight.waited_seconds) == (True, "acquired", 0.0)
        assert locking.lock_path(tmp_path, DIGEST).is_file()
    with locking.single_flight(tmp_path, DIGEST) as again:  # released: free again
        assert again.outcome == "acquired"


def test_threads_of_one_process_are_serialised(tmp_path: Path) -> None:
    inside = threading.Semaphore(0)
    order: list[str] = []

    def worker(name: str) -> None:
        with locking.single_flight(tmp_path, DIGEST, timeout=30) as flight:
            order.append(f"{name}:{flight.outcome}:in")
            inside.release()
            time.sleep(0.3)
            order.append(f"{name}:out")

    first = threading.Thread(target=worker, args=("a",))
    first.start()
    inside.acquire(timeout=10)
    second = threading.Thread(target=worker, args=("b",))
    second.start()
    first.join(10)
    second.join(10)
    assert order == ["a:acquired:in", "a:out", "b:waited:in", "b:out"]


@pytest.mark.serial
def test_timeout_warns_once_and_gives_up_the_wait(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = locking.lock_path(tmp_path, DIGEST)
    path.parent.mkdir(parents=True)
    other = filelock.UnixFileLock(str(path))
    other.acquire(timeout=0)
    try:
        timeout = 1.0
        t0 = time.monotonic()
        with locking.single_flight(tmp_path, DIGEST, timeout=timeout, label="micro abab") as flight:
            assert (flight.held, flight.outcome) == (False, "timeout")
        # At least the timeout, and given up within one poll and a wake-up: under twice it,
        # however loaded the machine. Ignored, the wait lasts as long as ``other`` is held (for
        # good: this thread holds it).
        assert timeout <= flight.waited_seconds < 2 * timeout and time.monotonic() - t0 < 2 * timeout, flight
    finally:
        other.release()
    [warning] = _warnings(caplog)
    assert "micro abab" in warning and "compiling it here too" in warning


@pytest.mark.parametrize("blocker", ["locks-is-a-file", "shard-is-a-file", "root-under-a-file"])
def test_lock_that_cannot_be_created_means_no_lock(tmp_path: Path, caplog: pytest.LogCaptureFixture, blocker: str) -> None:
    root = tmp_path / "root"
    if blocker == "root-under-a-file":
        (tmp_path / "file").write_text("x")
        root = tmp_path / "file" / "root"
    else:
        target = root / "locks" if blocker == "locks-is-a-file" else locking.lock_path(root, DIGEST).parent
        target.parent.mkdir(parents=True)
        target.write_text("not a directory")
    with locking.single_flight(root, DIGEST) as flight:
        assert (flight.held, flight.outcome) == (False, "unavailable")
    assert _warnings(caplog) == []


def test_full_disk_lock_means_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def enospc(*args: Any, **kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    locking.lock_path(tmp_path, DIGEST).parent.mkdir(parents=True)
    monkeypatch.setattr(os, "open", enospc)
    with locking.single_flight(tmp_path, DIGEST) as flight:
        assert flight.outcome == "unavailable"


def _holder(root: Path, digest: str) -> subprocess.Popen[str]:
    """A process that takes ``digest``'s lock, says so, and sleeps holding it."""
    code = (
        "import time\nfrom cute_diskcache.storage import locking\n"
        f"with locking.single_flight({str(root)!r}, {digest!r}) as f:\n    print(f.outcome, flush=True)\n    time.sleep(600)"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


@pytest.mark.serial
def test_lock_of_a_killed_holder_is_free_at_once(tmp_path: Path) -> None:
    holder = _holder(tmp_path, DIGEST)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "acquired"
        results: list[locking.Flight] = []

        def wait() -> None:
            with locking.single_flight(tmp_path, DIGEST, timeout=60) as flight:
                results.append(flight)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.5)
        assert not results, "the lock must be held while the holder lives"
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        t_kill = time.monotonic()
        waiter.join(10)
        # A lock the kernel did not drop with its holder would hold the waiter to its 60 s
        # timeout ("timeout", or no result within the join). The waiter polls every 50 ms: 5 s is
        # a hundred polls, whatever else the machine runs.
        assert results and results[0].outcome == "waited", results
        assert time.monotonic() - t_kill < 5.0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_store_that_cannot_write_takes_no_lock(tmp_path: Path) -> None:
    key = make_key("micro")
    for store in (Store(tmp_path / "ro", readonly=True), _disabled(tmp_path / "full")):
        with store.single_flight(key) as flight:
            assert (flight.held, flight.outcome) == (False, "off")
        assert not (store.root / "locks").exists()


def _disabled(root: Path) -> Store:
    store = Store(root)
    store.disable_writes(OSError(errno.ENOSPC, "No space left on device"))
    return store


def test_prune_removes_only_locks_nobody_holds(tmp_path: Path) -> None:
    free, held = "cd" * 32, "ef" * 32
    with locking.single_flight(tmp_path, free):
        pass
    holder = _holder(tmp_path, held)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "acquired"
        assert locking.prune(tmp_path) == 1
        assert not locking.lock_path(tmp_path, free).exists()
        assert locking.lock_path(tmp_path, held).exists()
    finally:
        holder.kill()
        holder.wait()
    assert locking.prune(tmp_path) == 1  # the holder died: its lock is free now
    assert not any((tmp_path / "locks").rglob("*.lock"))


def test_commit_under_the_lock_then_waiter_finds_the_entry(tmp_path: Path) -> None:
    """The protocol in one process: holder commits inside the lock; whoever gets it next must see the entry."""
    store, key, art = Store(tmp_path / "cache"), make_key("static"), make_artifact()
    with store.single_flight(key) as flight:
        assert flight.held and store.lookup_or_quarantine(key) is None
        assert store.commit(key, art) is not None
    with store.single_flight(key) as flight:
        assert flight.held and store.lookup_or_quarantine(key) is not None
