"""Statistics under faults: a volume that fills under a running process, a fold killed half-way
(issue 21, items 2 and 8).

Both run the code under test in a child process: on the old code the full volume was a SIGBUS
(rc -7) and a killed fold is an ``os._exit`` at a chosen system call, and neither may take
pytest down with it.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

from cute_diskcache.storage import stats

# -- a volume that fills (item 2) ---------------------------------------------------------------

_RECORDER = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    from cute_diskcache.storage import stats
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    stats.bind(Path(sys.argv[1]))
    n = int(sys.argv[2])
    for i in range(n):  # a new namespace each: every few of them the file needs a new page
        stats.record(f"ns-{i:03d}", "hits")
        stats.record(f"ns-{i:03d}", "compile_seconds", 0.5)
    got = stats.totals(stats.snapshot())
    assert got["hits"] == n and got["compile_seconds"] == 0.5 * n, got
    print("alive", int(got["hits"]), flush=True)
    """
)


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB tmpfs (the size the defect was measured on), unmounted afterwards."""
    vol = tmp_path / "vol"
    vol.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(vol)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 64 KiB tmpfs here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield vol
    finally:
        subprocess.run(["umount", "-l", str(vol)], check=False)


def _fill(vol: Path, leave: int) -> None:
    """Fill ``vol`` with one file until ``leave`` bytes stay free."""
    st = os.statvfs(vol)
    free = st.f_bavail * st.f_frsize
    (vol / "filler").write_bytes(b"\0" * max(0, free - leave))
    st = os.statvfs(vol)
    assert st.f_bavail * st.f_frsize <= leave


@pytest.mark.parametrize("leave", [4096, 0], ids=["one-page-left", "nothing-left"])
def test_a_volume_that_fills_never_kills_the_process(small_volume: Path, leave: int) -> None:
    """Measured on the old code: the file was sparse and the 12th namespace's page a SIGBUS (rc 135)."""
    root = small_volume / "cache"
    root.mkdir(mode=0o700)
    _fill(small_volume, leave)
    proc = subprocess.run([sys.executable, "-c", _RECORDER, str(root), "200"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"rc {proc.returncode} (-7: SIGBUS): {proc.stderr[-2000:]}"
    assert proc.stdout.split() == ["alive", "200"], "every count kept, in the file or in memory"
    lines = [ln for ln in proc.stderr.splitlines() if "statistics kept in memory" in ln]
    assert len(lines) == 1 and f"{root} is full" in lines[0], proc.stderr
    assert proc.stderr.count("WARNING") == 1, proc.stderr


def test_a_volume_with_room_keeps_every_count_in_the_file(tmp_path: Path) -> None:
    """The allocation does not change the ordinary case: one file, every namespace in it, silent."""
    proc = subprocess.run([sys.executable, "-c", _RECORDER, str(tmp_path), "200"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "WARNING" not in proc.stderr, proc.stderr
    (only,) = (tmp_path / "stats").glob("*.stats")
    assert os.stat(only).st_blocks * 512 >= os.stat(only).st_size, "allocated, not sparse"
    agg = stats.aggregate(tmp_path)
    assert len(agg) == 200 and stats.totals(agg)["hits"] == 200


def test_without_fallocate_written_zeros_allocate_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem without fallocate (EOPNOTSUPP: some FUSE volumes) gets its blocks by writes."""
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    path = tmp_path / "h-1-1.stats"
    m = stats._Mapped(path)
    try:
        for i in range(20):  # 8 -> 16 -> 32 slots: the last page is never touched by a count
            assert m.add(f"ns-{i}", stats._INDEX["hits"], 1)
        st = os.stat(path)
        assert st.st_blocks * 512 >= st.st_size, "every page has its blocks before it is mapped"
    finally:
        m.close()
    assert len(stats._read(path)) == 20


def test_a_full_volume_is_one_warning_and_counts_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a mount: the volume fills after the file's first page (ENOSPC from the allocation)."""
    real = os.posix_fallocate
    calls = {"n": 0}

    def fills(fd: int, offset: int, length: int) -> None:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fills)
    monkeypatch.setattr(stats, "_warned_full", False, raising=False)
    stats.reset_for_tests()
    stats.bind(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="cute_diskcache"):
            for i in range(30):
                stats.record(f"ns-{i}", "hits")
                stats.record(f"ns-{i}", "hits")
        assert stats.totals(stats.snapshot())["hits"] == 60
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert warned == [f"statistics kept in memory: {tmp_path} is full (No space left on device)"]
        assert calls["n"] == 2, "no allocation is retried per count once the volume said it is full"
        stats.flush()  # the volume has room again: memory counts go to a file of their own
        assert stats.totals(stats.aggregate(tmp_path))["hits"] == 60
    finally:
        stats.bind(None)
        stats.reset_for_tests()


# -- a fold killed at each step (item 8) --------------------------------------------------------

_FOLDER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from cute_diskcache.storage import stats
    root, kill_at = Path(sys.argv[1]), int(sys.argv[2])
    calls = 0

    def killing(fn):
        def wrapped(*args, **kwargs):
            global calls
            calls += 1
            if calls == kill_at:
                os._exit(77)  # killed just before this change reaches the filesystem
            return fn(*args, **kwargs)
        return wrapped

    for name in ("write", "fsync", "replace", "rename", "unlink", "remove", "truncate", "ftruncate"):
        setattr(os, name, killing(getattr(os, name)))
    folded = stats.fold(root)
    print(calls, folded)
    """
)


def _finished(folder: Path, name: str, hits: float) -> None:
    """A finished process's counter file, in the real format (its lock is dropped on close)."""
    m = stats._Mapped(folder / name)
    m.add("ns", stats._INDEX["hits"], hits)
    m.add("other", stats._INDEX["compile_seconds"], hits / 10)
    m.close()


def _hits(root: Path) -> float:
    return stats.aggregate(root).get("ns", {}).get("hits", 0.0)


def _kill_fold_at(root: Path, kill_at: int) -> tuple[bool, list[str]]:
    """Run a fold killed before its ``kill_at``-th filesystem call; (finished unkilled, what went wrong)."""
    folder = root / "stats"
    folder.mkdir(parents=True)
    for i, hits in enumerate((10, 13, 17)):
        _finished(folder, f"host-a-{i}-1.stats", hits)
    assert stats.fold(root) == 3  # an earlier, complete fold: the killed one absorbs it too
    for i, hits in enumerate((5, 7)):
        _finished(folder, f"host-b-{i}-2.stats", hits)
    live = stats._Mapped(folder / "host-c-9-3.stats")  # a live process (this one holds its lock)
    wrong: list[str] = []
    try:
        live.add("ns", stats._INDEX["hits"], 3)
        expected = 10 + 13 + 17 + 5 + 7 + 3
        assert _hits(root) == expected
        proc = subprocess.run([sys.executable, "-c", _FOLDER, str(root), str(kill_at)], capture_output=True, text=True, timeout=120)
        assert proc.returncode in (0, 77), proc.stderr
        where = f"killed before filesystem call {kill_at}" if proc.returncode else "not killed"
        for when in ("a reader right after it", "after the next fold", "after a third fold"):
            if when != "a reader right after it":
                stats.fold(root)  # a later housekeeping run repairs without adding anything twice
            if _hits(root) != expected:
                wrong.append(f"{where}, {when}: {_hits(root)} hits, expected {expected}")
        if stats.aggregate(root).get("other", {}).get("compile_seconds") != pytest.approx((expected - 3) / 10):
            wrong.append(f"{where}: compile_seconds {stats.aggregate(root).get('other')}")
        left = sorted(p.name for p in folder.iterdir() if p.name != ".fold.lock")
        if not (len(left) == 2 and left[0].startswith("compacted-") and left[1] == "host-c-9-3.stats"):
            wrong.append(f"{where}: left {left}")
    finally:
        live.close()
    return proc.returncode == 0, wrong


def test_a_fold_killed_at_any_step_neither_double_counts_nor_loses(tmp_path: Path) -> None:
    """Measured on the old code: a fold killed after writing its merged file counted 40 hits as 80, for good."""
    stats.reset_for_tests()
    stats.bind(None)
    wrong: list[str] = []
    kill_at, completed = 0, False
    while not completed:
        kill_at += 1
        assert kill_at < 60, "the fold should finish in a few dozen filesystem calls"
        completed, errors = _kill_fold_at(tmp_path / f"kill-{kill_at}", kill_at)
        wrong += errors
    print(f"fold killed before each of its {kill_at - 1} filesystem calls")
    assert kill_at > 4, "kills were injected between the fold's steps (publish, each removal)"
    assert not wrong, "\n".join(wrong)


def test_a_reader_during_a_fold_sees_it_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files a fold removed between a reader's listing and its reads make the reader look again."""
    folder = tmp_path / "stats"
    folder.mkdir()
    for i in range(4):
        _finished(folder, f"h-{i}-1.stats", 10)
    listed = stats._files(folder)
    real_files = stats._files
    calls = {"n": 0}

    def stale_then_real(f: Path) -> list[Path]:
        calls["n"] += 1
        return listed if calls["n"] == 1 else real_files(f)

    assert stats.fold(tmp_path) == 4  # the listing above is now stale: every file in it is gone
    monkeypatch.setattr(stats, "_files", stale_then_real)
    assert stats.aggregate(tmp_path)["ns"]["hits"] == 40
    assert calls["n"] == 2
