"""Keeping the root tidy: everything under it that is not a live entry stays bounded.

:func:`maintain` runs at most hourly per root, in a process that just committed, outside its
compile lock, and only one process per root at a time (a non-blocking lock): the quarantine
keeps its newest :data:`QUARANTINE_MAX_ITEMS` entries within :data:`QUARANTINE_SHARE` of the
cap; ``tmp/`` scratch older than an hour and ``trash/`` leftovers go; idle lock files are pruned
past :data:`LOCKS_MAX`; dead processes' statistics are folded. Daily (or when the size counter
is missing) :func:`reconcile` walks the tree once: it removes a killed writer's ``.tmp.*``
files, payloads no manifest names and entry directories that never got a manifest, once they
are an hour old, and sets the size counter of :mod:`.eviction` to what it found. All of it
counts toward ``CUTE_DISKCACHE_MAX_SIZE``.

Where ``flock`` does not work (``ENOLCK`` on NFSv3 without lockd, ``EOPNOTSUPP``/``ENOSYS`` on
FUSE volumes without it; :mod:`.locking` warns once) the maintenance lock cannot be had by
anyone: each process then does the upkeep itself, without the lock, at most hourly (every
step is safe beside another process doing it: removals are renames into ``trash/`` of what has
been idle an hour), so ``tmp/``, ``trash/``, ``locks/`` and the quarantine stay bounded there too.

:func:`clear` is the operator's reset. Removal itself is :func:`.eviction.discard`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from . import entry, eviction, layout

log = logging.getLogger("cute_diskcache")

#: The quarantine keeps at most this many entries, within this share of the cap.
QUARANTINE_MAX_ITEMS = 32
QUARANTINE_SHARE = 0.05
#: Idle lock files are pruned once there are more than this many.
LOCKS_MAX = 4096
#: Leftovers younger than this may belong to a writer still at work.
GRACE_S = 3600.0
_HOUSEKEEP_EVERY_S = 3600.0
_RECONCILE_EVERY_S = 86400.0


def _stray_files(entry_dir: Path, now: float) -> list[Path]:
    """Files in an entry older than :data:`GRACE_S` that its manifest does not name (a killed
    writer's temp files, payloads a rewrite left behind); the whole directory if it never got a
    manifest."""
    try:
        with os.scandir(entry_dir) as it:
            files = [(Path(f.path), f.stat(follow_symlinks=False).st_mtime) for f in it if not f.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    if not files or all(now - m < GRACE_S for _p, m in files):
        return []
    try:
        manifest = entry.read_manifest(entry_dir)
    except entry.EntryError as exc:
        if exc.reason == "absent":
            return [entry_dir] if all(now - m >= GRACE_S for _p, m in files) else []
        return []  # a bad entry is the lookup's to quarantine, not ours to pick apart
    named = {entry.MANIFEST} | {item["file"] for items in manifest["payloads"].values() for item in items}
    return [p for p, m in files if p.name not in named and now - m >= GRACE_S]


def reconcile(root: Path, *, shared: bool = False) -> eviction.Usage:
    """Walk everything once: drop stale leftovers, then set the counter to what is there."""
    now = time.time()
    for d in layout.entry_dirs(root):
        for stray in _stray_files(d, now):
            if stray.is_dir():
                eviction.discard(root, stray)
            else:
                stray.unlink(missing_ok=True)
    use = eviction.usage(root)
    done = time.time()
    eviction.mark(root, shared=shared, bytes=use["bytes"], entries=use["entries"], reconciled_at=done)
    return eviction.read_usage(root) or eviction.Usage(use["bytes"], use["entries"], done, 0.0)


def housekeep(root: Path, *, now: float | None = None) -> dict[str, int]:
    """Bound what is not an entry: quarantine, tmp/, trash/, lock files, dead processes' statistics."""
    from . import locking, stats

    root = Path(root)
    now = time.time() if now is None else now
    done = {"quarantine": 0, "tmp": 0, "trash": 0, "locks": 0, "stats": 0}
    freed = 0
    got, n = trim_quarantine(root)
    freed += got
    done["quarantine"] = n
    for name, grace in ((layout.TMP_DIR, GRACE_S), (layout.TRASH_DIR, eviction.IN_FLIGHT_S)):
        base = root / name
        try:
            items = list(os.scandir(base))
        except OSError:
            continue
        for d in items:
            try:
                if now - d.stat(follow_symlinks=False).st_mtime < grace:
                    continue
                if d.is_dir(follow_symlinks=False):
                    size = layout.tree_bytes(Path(d.path))[0]
                    shutil.rmtree(d.path, ignore_errors=True)
                else:
                    size = d.stat(follow_symlinks=False).st_size
                    os.unlink(d.path)
            except OSError:
                continue
            done[name] += 1
            freed += size
    _b, nlocks = layout.tree_bytes(root / layout.LOCKS_DIR)
    if nlocks > LOCKS_MAX:
        done["locks"] = locking.prune(root)
    done["stats"] = stats.fold(root)
    if freed:
        eviction.adjust(root, -freed)
    return done


def trim_quarantine(root: Path) -> tuple[int, int]:
    """Keep the newest :data:`QUARANTINE_MAX_ITEMS` quarantined entries within their share of the cap."""
    items = eviction.quarantined(root)
    cap = eviction.max_size()
    budget = int(cap * QUARANTINE_SHARE) if cap > 0 else None
    total = sum(layout.tree_bytes(p)[0] for _u, p in items)
    freed = removed = 0
    for _used, path in items:  # oldest first
        if len(items) - removed <= QUARANTINE_MAX_ITEMS and (budget is None or total - freed <= budget):
            break
        freed += eviction.discard(root, path)
        removed += 1
    return freed, removed


_degraded_runs: dict[str, float] = {}  # root -> monotonic time of this process's last upkeep without the counter


def _degraded_turn(root: Path) -> bool:
    """Where the counter cannot be had (no locks, or held by someone), the times it would record
    are not recorded either: whether this process may do the upkeep now (at most hourly)."""
    key = str(Path(root))
    now = time.monotonic()
    last = _degraded_runs.get(key)
    if last is not None and now - last < _HOUSEKEEP_EVERY_S:
        return False
    _degraded_runs[key] = now
    return True


@contextlib.contextmanager
def _maintenance_lock(root: Path, shared: bool, *, turn_taken: bool = False, group: int | None = None) -> Iterator[bool]:
    """Whether we got the root's maintenance lock (never waited for: someone else is doing it).

    On a root whose filesystem gives no locks, True at most hourly per process (see above);
    ``turn_taken``: the caller has had that turn already.
    """
    from . import locking, trust

    if locking.without_locks(root):
        yield turn_taken or _degraded_turn(root)
        return
    path = Path(root) / layout.LOCKS_DIR / "maintenance.lock"
    try:
        if group is not None:  # locks/ is a level the trust check reads: the group's, 2775 (see locking._make_dirs)
            trust.make_dirs(Path(root), path.parent, shared=False, group=group)
        else:
            trust.make_dirs(Path(root), path.parent, shared=shared)
        fd = locking.open_lock_file(path, eviction.file_mode(shared))
    except OSError:
        yield False
        return
    token = locking.hold(fd)
    try:
        try:
            got = locking.try_flock(fd)
        except OSError as exc:
            if locking.no_locks_here(root, exc, str(path)):
                got = turn_taken or _degraded_turn(root)
            else:
                log.debug("maintenance lock: %s", exc)
                got = False
        yield got
    finally:
        locking.release(fd, token)


def maintain(root: Path, *, force: bool = False, shared: bool = False, group: int | None = None) -> dict[str, Any] | None:
    """Reconcile the counter (daily, or when missing) and housekeep (hourly); None if not due.

    Called by a process after a commit, outside its compile lock, so a miss never waits on it;
    only one process per root does it at a time.
    """
    u = eviction.read_usage(root)
    now = time.time()
    walk = force or u is None or now - u.reconciled_at > _RECONCILE_EVERY_S
    keep = force or u is None or now - u.housekept_at > _HOUSEKEEP_EVERY_S
    if not (walk or keep):
        return None
    degraded = eviction.counter_degraded(root)
    if degraded and not force and not _degraded_turn(root):
        return None
    with _maintenance_lock(root, shared, turn_taken=degraded, group=group) as mine:
        if not mine:
            return None
        out: dict[str, Any] = {}
        if keep:
            eviction.mark(root, shared=shared, housekept_at=now)
            out["housekeeping"] = housekeep(root, now=now)
        if walk:
            out["usage"] = reconcile(root, shared=shared)
        return out


def clear(root: Path) -> tuple[int, list[str]]:
    """Delete everything the cache keeps under ``root`` (entries, quarantine, locks, statistics,
    scratch); other files there are left alone. Returns (entries removed, directories removed)."""
    removed = 0
    dirs: list[str] = []
    root = Path(root)
    if not root.exists():
        return 0, dirs
    for name in layout.ROOT_DIRS:
        p = root / name
        if not os.path.lexists(p):
            continue
        if name == layout.LAYOUT:
            removed += sum(1 for d in layout.entry_dirs(root) if os.path.lexists(d / entry.MANIFEST))
        dirs.append(name)
        if p.is_symlink() or not p.is_dir():
            p.unlink()
        else:
            shutil.rmtree(p)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / layout.USAGE_FILE)
    return removed, dirs
