"""Size cap and LRU eviction: units, order by our own recency mark, cap on write, full disk."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _helpers import make_artifact, make_key  # noqa: E402

from cute_diskcache import config  # noqa: E402
from cute_diskcache.storage import eviction, housekeeping  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402


@pytest.mark.parametrize(
    "text, expected",
    [("1048576", 1048576), ("500M", 500 * 10**6), ("5G", 5 * 10**9), ("2GiB", 2 * 2**30), ("1.5G", 1_500_000_000),
     ("10k", 10_000), ("3 MiB", 3 * 2**20), ("0", 0), ("7GB", 7 * 10**9)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert config.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "G", "5X", "-1G", "five"])
def test_parse_size_refuses_nonsense(bad: str) -> None:
    with pytest.raises(ValueError):
        config.parse_size(bad)


def _fill(root: Path, n: int) -> list[Path]:
    """n committed synthetic entries, each with its own key, oldest first by their mtime."""
    store = Store(root)
    dirs = []
    for i in range(n):
        key = make_key(site_key=("micro", i))
        assert store.commit(key, make_artifact((bytes([i % 250 + 1]) * 4000,))) is not None
        d = store.entry_dir(key)
        t = time.time() - 10_000 + i * 100  # entry i was last used at t
        os.utime(d, (t, t))
        dirs.append(d)
    return dirs


def test_evict_removes_least_recently_used_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "0")  # no cap while filling
    dirs = _fill(tmp_path, 6)
    # Mark the oldest as just used: it must survive, the next-oldest go.
    os.utime(dirs[0], None)
    before = eviction.usage(tmp_path)
    assert before["entries"] == 6
    per_entry = before["bytes"] // 6
    removed = eviction.evict(tmp_path, per_entry * 3 + per_entry // 2)
    assert [p.name for p in removed] == [d.name for d in dirs[1:4]]
    assert dirs[0].exists() and all(not d.exists() for d in dirs[1:4]) and all(d.exists() for d in dirs[4:])
    after = eviction.usage(tmp_path)
    assert after["entries"] == 3 and after["bytes"] <= per_entry * 3 + per_entry // 2
    assert not list((tmp_path / "trash").iterdir()), "evicted entries are deleted, not left in trash"


def test_dry_run_removes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "0")
    dirs = _fill(tmp_path, 3)
    removed = eviction.evict(tmp_path, 1, dry_run=True)
    assert len(removed) == 3 and all(d.exists() for d in dirs)


def test_touch_marks_use_without_atime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recency is our mtime mark, so noatime mounts keep LRU order; hot entries are not rewritten."""
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "0")
    (old,) = _fill(tmp_path, 1)
    eviction.touch(old)
    first = old.stat().st_mtime
    assert time.time() - first < 5
    os.utime(old, (first - 60, first - 60))  # used a minute ago: within the hour, no write
    eviction.touch(old)
    assert old.stat().st_mtime == pytest.approx(first - 60)


def test_cap_is_enforced_on_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "0")
    _fill(tmp_path, 1)
    one = eviction.usage(tmp_path)["bytes"]
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", str(one * 4))
    store = Store(tmp_path)
    for i in range(10, 20):
        store.commit(make_key(site_key=("micro", i)), make_artifact((bytes([i]) * 4000,)))
        assert eviction.usage(tmp_path)["bytes"] <= one * 4
    # The newest entry always survives its own write.
    assert store.lookup_or_quarantine(make_key(site_key=("micro", 19))) is not None


def test_bad_cap_falls_back_to_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "lots")
    assert eviction.max_size() == config.parse_size(config.DEFAULT_MAX_SIZE)


_FULL_DISK = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from pathlib import Path
    from _helpers import make_artifact, make_key
    from cute_diskcache.storage import entry, eviction
    root = Path(sys.argv[1])
    written = 0
    for i in range(1000):  # fill the tmpfs to ENOSPC with entries
        key = make_key(site_key=("micro", i))
        try:
            entry.write(root / "v1" / key.env.namespace / key.digest[:2] / key.digest, key, make_artifact((os.urandom(20000),)))
            written += 1
        except OSError:
            break
    assert written > 2, written
    removed = eviction.evict(root, 0)  # must work with zero bytes free
    assert len(removed) >= written, (len(removed), written)
    assert eviction.usage(root)["entries"] == 0
    key = make_key(site_key=("micro", "after"))
    entry.write(root / "v1" / key.env.namespace / key.digest[:2] / key.digest, key, make_artifact())
    print("ok", written, len(removed))
    """
)


def test_eviction_on_a_full_disk(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare not available")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "full.py"
    script.write_text(_FULL_DISK)
    tests_dir = str(Path(__file__).resolve().parent)
    cmd = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs "{mnt}" && exec "{sys.executable}" "{script}" "{mnt}" "{tests_dir}"']
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs "{mnt}"'], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.decode()[-200:]}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "CUTE_DISKCACHE_MAX_SIZE": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


# --------------------------------------------------------------------------------------------
# Size as a counter, bounded culls, bounded leftovers (issue 15, items 7 and 9)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "fsync", lambda fd: None)


def _count_scandirs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = os.scandir

    def counting(path: str = ".") -> object:
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", counting)
    return calls


def test_a_commit_never_walks_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_fsync: None) -> None:
    """Old code walked and stat-ed all of v1/ after every commit, inside the compile lock:
    416-473 ms per commit at 3,000 entries on our box. Now a counter, and bounded culls."""
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "0")
    store = Store(tmp_path)
    for i in range(400):
        assert store.commit(make_key(site_key=("micro", i)), make_artifact((bytes([i % 250 + 1]) * 2000,))) is not None
    walked = housekeeping.reconcile(tmp_path)
    assert walked.entries == 400 and walked.bytes == eviction.usage(tmp_path)["bytes"]

    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "1G")  # a cap far away: a commit reads the counter, nothing more
    calls = _count_scandirs(monkeypatch)
    assert store.commit(make_key(site_key=("micro", "under")), make_artifact()) is not None
    assert len(calls) <= 2, calls  # the new entry's own directory, before and after

    # Over the cap: the cull looks at the quarantine and SAMPLE_SHARDS shards, however big the cache.
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", str(int(walked.bytes * 0.95)))
    calls.clear()
    newest = make_key(site_key=("micro", "over"))
    assert store.commit(newest, make_artifact()) is not None
    shards = sum(1 for c in calls if Path(c).parent.parent.name == "v1")
    assert shards <= eviction.SAMPLE_SHARDS and len(calls) < 200, len(calls)
    assert 0 < 401 - eviction.read_usage(tmp_path).entries <= eviction.CULL_LIMIT
    assert store.lookup_or_quarantine(newest) is not None, "the entry just written survives its own commit"


def test_counter_follows_commits_and_evictions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_fsync: None) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "0")
    _fill(tmp_path, 5)
    u = eviction.read_usage(tmp_path)
    assert u is not None and u.entries == 5 and u.bytes == eviction.usage(tmp_path)["entry_bytes"]
    eviction.evict(tmp_path, u.bytes // 2)
    after = eviction.read_usage(tmp_path)
    assert after is not None and after.bytes == eviction.usage(tmp_path)["bytes"] and after.reconciled_at > 0


def test_quarantine_is_bounded(tmp_path: Path, no_fsync: None) -> None:
    """Old code: quarantine/ emptied only by 'clear', invisible to eviction."""
    from cute_diskcache.storage import entry

    store = Store(tmp_path)
    for i in range(housekeeping.QUARANTINE_MAX_ITEMS + 8):
        key = make_key(site_key=("micro", i))
        assert store.commit(key, make_artifact()) is not None
        store.quarantine(store.entry_dir(key), entry.EntryError("checksum", "test"))
    left = list(store.quarantine_dir.iterdir())
    assert len(left) == housekeeping.QUARANTINE_MAX_ITEMS
    assert f"-{make_key(site_key=('micro', 0)).digest}-" not in " ".join(p.name for p in left), "oldest first"


def test_housekeeping_bounds_every_leftover(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_fsync: None) -> None:
    """tmp/, trash/, a killed writer's .tmp.* and payloads, entries that never got a manifest,
    idle lock files and dead processes' statistics: all of it went unbounded before."""
    from cute_diskcache.storage import entry, locking

    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "0")
    (kept,) = _fill(tmp_path, 1)
    old = time.time() - 2 * housekeeping.GRACE_S

    def leftover(path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (old, old))
        return path

    scratch = leftover(tmp_path / "tmp" / "import-host-1-dead" / "leftover.o", b"x" * 5000).parent
    trash = leftover(tmp_path / "trash" / "abc-1-000000" / "f", b"y" * 3000).parent
    stray = leftover(kept / ".tmp.object-1234.o.host.1.abcdef", b"z" * 100)
    orphan = leftover(kept / "object-0123456789abcdef.o", b"w" * 2000)
    headless = leftover(tmp_path / "v1" / kept.parent.parent.name / "ab" / ("ab" + "0" * 62) / "object-1.o", b"v").parent
    for d in (scratch, trash, headless):
        os.utime(d, (old, old))
    young = kept / ".tmp.manifest.msgpack.host.2.fedcba"  # a writer at work right now: kept
    young.write_bytes(b"u")
    locks = tmp_path / "locks" / "00"
    locks.mkdir(parents=True)
    for i in range(housekeeping.LOCKS_MAX + 10):
        (locks / f"{i:064x}.lock").touch()

    done = housekeeping.maintain(tmp_path, force=True)
    assert done is not None
    assert not scratch.exists() and not trash.exists()
    assert not stray.exists() and not orphan.exists() and not headless.exists() and young.exists()
    assert entry.read_manifest(kept) and Store(tmp_path).lookup_or_quarantine(make_key(site_key=("micro", 0))) is not None
    assert done["housekeeping"]["locks"] == housekeeping.LOCKS_MAX + 10 and not list(locks.iterdir())
    assert locking.prune(tmp_path) == 0
    assert eviction.read_usage(tmp_path).bytes == eviction.usage(tmp_path)["bytes"], "the walk sets the counter"
    assert housekeeping.maintain(tmp_path) is None, "not due again for an hour"
