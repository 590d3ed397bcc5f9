"""Where locks fail or are abused (issue 21, defects 1, 3, 5, 6): network and FUSE volumes, planted links, forks.

The kernel's answers are simulated by replacing ``fcntl.flock``, the one call every lock of
the package goes through: ``ENOLCK`` is what NFSv3 without lockd answers, ``EOPNOTSUPP`` what
FUSE volumes without ``flock`` answer, and ``EBADF`` for a read-only descriptor is what NFS
answers an exclusive ``flock`` (emulated with POSIX locks) through one. Entries are synthetic
and go through the store's real commit path; nothing is compiled.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _helpers import make_artifact, make_key  # noqa: E402

from cute_diskcache.storage import eviction, housekeeping, layout, locking, stats  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402

DIGEST = "ab" + "cd" * 31
REPO = Path(__file__).resolve().parents[1]
_real_flock = fcntl.flock


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no root known to lack locks and no counter marked busy."""
    for module, name in ((locking, "_no_locks"), (eviction, "_busy_until"), (eviction, "_unwalked"),
                         (housekeeping, "_degraded_runs")):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, {})
    if hasattr(eviction, "_warned"):
        monkeypatch.setattr(eviction, "_warned", set())


def _flock_fails(monkeypatch: pytest.MonkeyPatch, err: int) -> list[int]:
    """Every ``flock`` answers ``err``; returns the list its calls are counted in."""
    calls: list[int] = []

    def flock(fd: int, op: int) -> None:
        calls.append(op)
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", flock)
    return calls


def _flock_refuses_read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """NFS: an exclusive ``flock`` through a descriptor not open for writing is EBADF."""

    def flock(fd: int, op: int) -> None:
        if op & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        _real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "cute_diskcache"]


def _commit(store: Store, i: int, timeout: float) -> tuple[locking.Flight, float]:
    """What a miss does around its compile: the key's lock, the commit, then upkeep.
    Returns the flight and the seconds spent getting into it."""
    key = make_key(site_key=("micro", i))
    t0 = time.monotonic()
    with store.single_flight(key, timeout) as flight:
        entered = time.monotonic() - t0
        assert store.commit(key, make_artifact((bytes([i % 250 + 1]) * 4000,))) is not None
    store.maintain()
    return flight, entered


def _files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []


# --------------------------------------------------------------------------------------------
# Defects 1 and 5: a filesystem without flock
# --------------------------------------------------------------------------------------------


@pytest.mark.serial
@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EOPNOTSUPP], ids=["ENOLCK-nfsv3-no-lockd", "EOPNOTSUPP-fuse"])
def test_no_flock_degrades_once_keeps_the_cap_and_never_waits(err: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Measured on 58211c8 (ENOLCK): 60 commits of 4 kB under a 20K cap kept all 60 (316 kB), no warning.

    "Never waits" is counted, not timed: a failing flock read as contention is asked again every
    poll until the lock's timeout (hundreds of calls); the root marked "without locks" is never
    asked again. The times are bounded only against that timeout, which the defect waits out
    whole, so a loaded machine (the commits fsync) cannot fail them."""
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "20K")
    root = tmp_path / "cache"
    store = Store(root)
    calls = _flock_fails(monkeypatch, err)
    timeout = 30.0
    with caplog.at_level(logging.INFO, logger="cute_diskcache"):
        for i in range(60):
            t0 = time.monotonic()
            flight, entered = _commit(store, i, timeout)
            took = time.monotonic() - t0
            assert flight.outcome == "unavailable" and not flight.held
            assert entered < timeout / 2, f"commit {i} waited {entered:.2f} s for its lock: a failing flock read as contention"
            assert took < timeout, f"commit {i} took {took:.2f} s"
    assert calls, "the test must reach flock"
    assert len(calls) <= 2, f"flock asked {len(calls)} times on a root known to have no locks"
    use = eviction.usage(root)
    assert use["bytes"] <= 20_000, f"cap not kept: {use['entries']} entries, {use['bytes']} bytes"
    assert use["entries"] >= 1
    assert store.lookup_or_quarantine(make_key(site_key=("micro", 59))) is not None, "the newest entry survives its commit"
    assert len(_files(root / layout.LOCKS_DIR)) <= 1, "lock files keep piling up where locks do not work"
    assert len(_files(root / layout.TRASH_DIR)) == 0 and len(_files(root / layout.TMP_DIR)) == 0
    name = errno.errorcode[err]
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert name in warned[0] and "single-flight is off" in warned[0] and "size cap" in warned[0]
    assert "NFSv3" in warned[0] and "FUSE" in warned[0]


def test_no_flock_walks_once_per_tenth_of_the_cap_not_per_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback cull is rate-limited: a 1 MB cap and 4 kB entries walk at the first commit
    and then once per 100 kB committed, not on each of the 60 commits."""
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "1M")
    store = Store(tmp_path / "cache")
    _flock_fails(monkeypatch, errno.ENOLCK)
    walks: list[int] = []
    real = eviction._exact

    def counted(*args: Any, **kwargs: Any) -> Any:
        walks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(eviction, "_exact", counted)
    for i in range(60):
        key = make_key(site_key=("micro", i))
        assert store.commit(key, make_artifact((bytes([i % 250 + 1]) * 4000,))) is not None
    assert 2 <= len(walks) <= 6, walks


@pytest.mark.serial
def test_no_flock_lock_is_no_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """ENOLCK is not contention: filelock 3.x polled it for the whole timeout (300 s by default).

    Counted (one flock, then the root is known to have none) and bounded by half the timeout
    the defect waits out, not by what two lock files cost on a quiet machine."""
    calls = _flock_fails(monkeypatch, errno.ENOLCK)
    timeout = 5.0
    t0 = time.monotonic()
    for digest in (DIGEST, "cd" * 32):
        with locking.single_flight(tmp_path, digest, timeout=timeout) as flight:
            assert flight.outcome == "unavailable"
    assert len(calls) == 1, f"flock asked {len(calls)} times: ENOLCK polled as if someone held the lock"
    assert time.monotonic() - t0 < timeout / 2
    [warning] = _warnings(caplog)
    assert "ENOLCK" in warning and str(tmp_path) in warning


# --------------------------------------------------------------------------------------------
# Defect 6: NFS refuses an exclusive flock through a read-only descriptor
# --------------------------------------------------------------------------------------------


def test_idle_lock_files_are_pruned_where_read_only_descriptors_cannot_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cache"
    Store(root)
    for i in range(12):
        with locking.single_flight(root, hashlib.sha256(str(i).encode()).hexdigest()) as flight:
            assert flight.held
    assert len(list((root / layout.LOCKS_DIR).rglob("*.lock"))) == 12
    _flock_refuses_read_only(monkeypatch)
    monkeypatch.setattr(housekeeping, "LOCKS_MAX", 4)
    housekeeping.maintain(root, force=True)
    left = [p.name for p in (root / layout.LOCKS_DIR).rglob("*.lock") if p.name != "maintenance.lock"]
    assert left == [], f"{len(left)} idle lock files kept: prune opened them read-only"


_STATS_WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from cute_diskcache.storage import stats
    stats.bind(Path(sys.argv[1]))
    stats.record("ns-a", "hits")
    """
)


def test_dead_processes_statistics_fold_where_read_only_descriptors_cannot_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for _ in range(4):
        subprocess.run([sys.executable, "-c", _STATS_WORKER, str(tmp_path)], check=True, timeout=120)
    before = stats.aggregate(tmp_path)
    assert before["ns-a"]["hits"] == 4
    _flock_refuses_read_only(monkeypatch)
    stats.fold(tmp_path)
    files = [p for p in (tmp_path / "stats").iterdir() if not p.name.startswith(".")]
    assert len(files) == 1, f"{len(files)} statistics files left: _gone opened them read-only"
    monkeypatch.setattr(fcntl, "flock", _real_flock)
    assert stats.aggregate(tmp_path)["ns-a"]["hits"] == 4


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_dead_processes_statistics_fold_where_flock_fails(err: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NFSv3 without lockd, FUSE: no flock at all. A finished process of this host is known by
    its pid; the fold is guarded by an exclusive create; the counts are kept exactly once."""
    for _ in range(4):
        subprocess.run([sys.executable, "-c", _STATS_WORKER, str(tmp_path)], check=True, timeout=120)
    alive = subprocess.Popen([sys.executable, "-c", _STATS_WORKER + "\nimport time; time.sleep(60)\n", str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while stats.aggregate(tmp_path).get("ns-a", {}).get("hits", 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        _flock_fails(monkeypatch, err)
        for _ in range(2):  # a second fold finds the first one's file and nothing dead: no change
            stats.fold(tmp_path)
        files = [p for p in (tmp_path / "stats").iterdir() if not p.name.startswith(".")]
        assert len(files) == 2, f"{len(files)} statistics files: the finished processes' were not folded"
        assert not (tmp_path / "stats" / ".fold.claim").exists()
        monkeypatch.setattr(fcntl, "flock", _real_flock)
        assert stats.aggregate(tmp_path)["ns-a"]["hits"] == 5
    finally:
        alive.kill()
        alive.wait()


# --------------------------------------------------------------------------------------------
# Defect 3: the size counter locked by someone else
# --------------------------------------------------------------------------------------------


_HOLD_READ_ONLY = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # allowed through a read-only descriptor on a local filesystem
    print("held", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def counter_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Store, subprocess.Popen[str]]]:
    """A store under a cap whose ``usage`` another process holds LOCK_EX through a read-only descriptor."""
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "20K")
    store = Store(tmp_path / "cache")
    assert store.commit(make_key(site_key=("micro", 0)), make_artifact((b"\x01" * 4000,))) is not None
    usage = store.root / layout.USAGE_FILE
    assert usage.exists()  # (the tests run as root, who opens it whatever its mode: the bound is what is tested)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_READ_ONLY, str(usage)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield store, holder
    finally:
        holder.kill()
        holder.wait()


def _within(seconds: float, fn: Callable[[], Any]) -> float:
    """Run ``fn`` in a thread; fail if it has not returned after ``seconds``. Returns its duration."""
    done: list[BaseException | None] = []
    t0 = time.monotonic()

    def run() -> None:
        try:
            fn()
            done.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            done.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    if done[0] is not None:
        raise done[0]
    return time.monotonic() - t0


@pytest.mark.serial
def test_counter_held_by_another_process_never_stalls_commits(counter_held: tuple[Store, subprocess.Popen[str]],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Measured on 58211c8: Store.commit hung (flock LOCK_EX with no timeout); maintain() too."""
    store, _holder = counter_held
    # The defect hung for good; the fix waits the counter's bound once. Each bound is stated
    # against those, not against what a commit (it fsyncs) costs on a quiet disk.
    wait = getattr(eviction, "COUNTER_WAIT_S", 2.0)
    bound = wait + 20
    first = _within(bound, lambda: _commit(store, 1, 5.0))
    later = sorted(_within(bound, lambda i=i: _commit(store, i, 5.0)) for i in range(2, 30))
    # Every later commit would wait the bound again: the median is immune to a slow fsync or two.
    assert later[len(later) // 2] < wait / 2, f"each commit waits again for the held counter: {later}"
    _within(bound, lambda: store.maintain())
    assert wait <= first < bound, f"the first commit took {first:.2f} s (the counter's bound is {wait} s)"
    use = eviction.usage(store.root)
    assert use["bytes"] <= 20_000, f"cap not kept while the counter is held: {use['bytes']} bytes"
    warned = _warnings(caplog)
    assert len(warned) == 1 and "size counter" in warned[0] and "locked by another process" in warned[0], warned


def test_private_root_counter_is_not_openable_by_others(tmp_path: Path) -> None:
    store = Store(tmp_path / "cache")
    assert store.commit(make_key(site_key=("micro", 0)), make_artifact()) is not None
    mode = (store.root / layout.USAGE_FILE).stat().st_mode & 0o777
    assert mode & 0o077 == 0, f"usage is {oct(mode)}: any local user can open it and flock it"


# --------------------------------------------------------------------------------------------
# Defect 1: planted links, and locks inherited across fork
# --------------------------------------------------------------------------------------------


def test_link_planted_at_the_lock_path_never_touches_its_target(tmp_path: Path) -> None:
    """filelock 3.x (admitted by 'filelock>=3.12') opened the lock with O_TRUNC following links
    and fchmod-ed what it opened: a TRUST_SHARED root's lock path planted with a link truncated
    a 100 kB file its victim could write."""
    victim = tmp_path / "victim.bin"
    data = os.urandom(100_000)
    victim.write_bytes(data)
    os.chmod(victim, 0o600)
    root = tmp_path / "cache"
    path = locking.lock_path(root, DIGEST)
    path.parent.mkdir(parents=True)
    os.symlink(victim, path)
    with locking.single_flight(root, DIGEST, timeout=1, shared=True) as flight:
        outcome = flight.outcome
    assert victim.stat().st_size == 100_000, f"the link's target was truncated to {victim.stat().st_size} bytes"
    assert victim.read_bytes() == data and victim.stat().st_mode & 0o777 == 0o600
    assert outcome == "unavailable", "a lock was taken through a link"


@pytest.mark.serial
def test_fifo_planted_at_the_lock_path_is_not_waited_on(tmp_path: Path) -> None:
    path = locking.lock_path(tmp_path, DIGEST)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    timeout = 10.0
    t0 = time.monotonic()
    with locking.single_flight(tmp_path, DIGEST, timeout=timeout) as flight:
        assert flight.outcome == "unavailable"
    # Waited on, it would take the whole timeout (or block in open(2) for good): half is well clear of both.
    assert time.monotonic() - t0 < timeout / 2


def test_locking_needs_no_filelock(tmp_path: Path) -> None:
    """The lock is flock taken by the package itself: no filelock release can change it."""
    code = (
        "import sys\nsys.modules['filelock'] = None\nfrom cute_diskcache.storage import locking\n"
        f"with locking.single_flight({str(tmp_path)!r}, {DIGEST!r}) as f:\n    print(f.outcome)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.stdout.strip() == "acquired", out.stderr[-2000:]


def test_package_admits_no_filelock_that_follows_links() -> None:
    """'filelock>=3.12' admitted 3.x (O_TRUNC through links, every flock error read as contention)."""
    from packaging.requirements import Requirement

    deps = [Requirement(d) for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]
    for req in deps:
        if req.name == "filelock":
            assert "3.20.0" not in req.specifier, f"{req} admits filelock 3.x"


_FORKING_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from cute_diskcache.storage import locking
    with locking.single_flight(sys.argv[1], sys.argv[2]) as f:
        assert f.outcome == "acquired"
        child = os.fork()
        if child == 0:  # a worker forked while the lock is held, outliving its parent
            os.write(1, b"worker\\n")  # one write: the lines of both processes never interleave (handlers have run)
            time.sleep(120)
            os._exit(0)
        os.write(1, f"{child}\\n".encode())
        time.sleep(600)
    """
)


@pytest.mark.serial
def test_lock_held_across_fork_is_free_once_its_holder_is_killed(tmp_path: Path) -> None:
    """Measured with filelock 4.3.2 on 58211c8: the forked child kept the lock (next process: timeout)."""
    holder = subprocess.Popen([sys.executable, "-c", _FORKING_HOLDER, str(tmp_path), DIGEST], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert holder.stdout is not None
        lines = {holder.stdout.readline().strip() for _ in range(2)}
        assert "worker" in lines
        child = int((lines - {"worker"}).pop())
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)  # the forked worker is still alive
        # "acquired" is the first non-blocking try succeeding: no wait at all, whatever the
        # machine's load. Held by the forked worker, it is "timeout" after these 2 s.
        with locking.single_flight(tmp_path, DIGEST, timeout=2) as flight:
            outcome = flight.outcome
        assert outcome == "acquired", outcome
    finally:
        holder.kill()
        holder.wait()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_lock_taken_in_a_forked_child_is_its_own(tmp_path: Path) -> None:
    """The at-fork handler must not take away locks the child takes after the fork, nor the parent's."""
    with locking.single_flight(tmp_path, DIGEST) as parent:
        assert parent.held
        pid = os.fork()
        if pid == 0:  # child: the parent's lock is still held (by the parent), the other key is free
            code = 1
            try:
                with locking.single_flight(tmp_path, DIGEST, timeout=0.2) as f1, locking.single_flight(tmp_path, "cd" * 32) as f2:
                    code = 0 if (f1.outcome, f2.outcome) == ("timeout", "acquired") else 2
            finally:
                os._exit(code)
        _pid, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        fd = os.open(locking.lock_path(tmp_path, DIGEST), os.O_RDWR)
        try:
            assert not locking.try_flock(fd), "the parent's lock went with the child"
        finally:
            os.close(fd)
