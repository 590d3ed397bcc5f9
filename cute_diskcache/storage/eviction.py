"""Size cap and least-recently-used eviction, ccache style; housekeeping is :mod:`.housekeeping`.

**Size is a counter, not a walk.** ``<root>/usage`` holds the bytes the cache takes; every
commit adds its bytes and every removal subtracts them, under an ``flock`` on that file (tens
of microseconds). Walking the tree after each commit cost 416-473 ms per commit at 3,000
entries on our 2-core box, inside the single-flight lock; the 5G default holds ~14k entries.
The counter is reconciled with one full walk when it is missing (a new root, ``rm -rf``), when
it is a day old, or when a cull finds it cannot be right, always outside any compile lock
(:func:`.housekeeping.maintain`). Drift in between (a crash between a write and its count, a
hand-deleted entry) is bounded by that.

**The counter's lock is bounded** (issue 21). ``flock(LOCK_EX)`` is allowed on a read-only
descriptor, so anyone who can open ``usage`` could once stop every commit; and a holder
stopped with SIGSTOP on a shared volume did the same. The file is 0600 in a private root (a
shared root's group must update it: there the bound is the defence), and a commit tries the
lock without blocking for at most :data:`COUNTER_WAIT_S`, then leaves the counter alone for
:data:`COUNTER_RETRY_S` with one warning. Where ``flock`` does not work at all (``ENOLCK``:
NFSv3 without lockd; ``EOPNOTSUPP``/``ENOSYS``: FUSE volumes without ``flock``; see
:mod:`.locking`, which warns once for the root) the counter is not used.

**Without the counter the cap still holds**: a commit that could not count walks the cache
(exact LRU, as ``cute-diskcache evict``) and culls it to 90% of the cap, but only once this
process has committed 10% of the cap since its last walk (and at its first such commit): one
process alone never passes the cap, N processes at most by N x 10%, and a walk costs one per
tenth of the cap written, not one per commit.

**Culling is bounded per commit.** Over the cap, a commit removes at most :data:`CULL_LIMIT`
entries: first quarantined ones, then the least recently used among the entries of
:data:`SAMPLE_SHARDS` randomly chosen shard directories (an approximate LRU, as Redis does:
the oldest of a random sample is almost always among the oldest overall, and no commit pays
for the whole cache). ``cute-diskcache evict`` and a full disk use the exact, walking LRU.

**Recency** is the entry directory's mtime, which a hit sets (:func:`touch`): access times are
useless on the ``noatime``/``relatime`` mounts most servers use. A touch is skipped when the
entry was marked within the hour, so a hot entry costs one ``stat`` per hit.

**Removal** (:func:`discard`, the one way anything under the root is deleted) is one
``rename`` into ``trash/`` (atomic for readers, and it needs no free space on a full disk),
then a delete.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from .. import config
from . import layout
from ..config import format_size

log = logging.getLogger("cute_diskcache")

_TOUCH_EVERY_S = 3600.0
_LOW_WATER = 0.9
#: Entries a commit may remove when the cache is over its cap.
CULL_LIMIT = 10
#: Shard directories sampled for the approximate LRU of a commit's cull.
SAMPLE_SHARDS = 16
#: What was touched this recently may be work in flight (an entry being filled, trash being
#: deleted): a full disk's cull and housekeeping leave it alone.
IN_FLIGHT_S = 60.0


def max_size() -> int:
    """The cap in bytes now (0: none); the setting is :func:`..config.max_size`'s to read."""
    return config.max_size()


def touch(entry_dir: Path) -> None:
    """Mark an entry as used now (skipped if marked within the hour)."""
    try:
        if time.time() - os.stat(entry_dir).st_mtime > _TOUCH_EVERY_S:
            os.utime(entry_dir)
    except OSError:
        pass  # read-only or vanished: recency is advisory


# --------------------------------------------------------------------------------------------
# The counter
# --------------------------------------------------------------------------------------------

_USAGE = struct.Struct("<8sqqdd")  # magic, bytes, entries, reconciled at, housekept at
_MAGIC = b"CDCUSE1\0"


@dataclass
class Usage:
    bytes: int = 0
    entries: int = 0
    reconciled_at: float = 0.0  # 0: never (the counter is a guess until a walk)
    housekept_at: float = 0.0


def file_mode(shared: bool) -> int:
    """Bookkeeping files: private roots get 0600 (nobody else can open them, so nobody else can
    lock them); a shared root's group must update them too."""
    return 0o666 if shared else 0o600


#: The longest a commit waits for the counter's lock (held for microseconds by a healthy holder).
COUNTER_WAIT_S = 2.0
#: After a wait ran out, the counter is left alone this long (no commit waits for it again).
COUNTER_RETRY_S = 60.0
_COUNTER_POLL_S = 0.005


class CounterUnavailable(OSError):
    """The counter's lock could not be had: held too long by someone, or no locks here."""


_busy_until: dict[str, float] = {}  # root -> monotonic time before which the counter is not tried
_warned: set[str] = set()  # roots whose degraded counter has had its one warning
_state_guard = threading.Lock()


def _warn_once(root: Path, message: str, *args: Any) -> None:
    key = str(Path(root))
    with _state_guard:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message, *args)


def counter_degraded(root: Path) -> bool:
    """Whether commits under ``root`` cannot use the counter now (no locks, or it is held too long)."""
    from . import locking

    return locking.without_locks(root) or time.monotonic() < _busy_until.get(str(Path(root)), 0.0)


def _read(fd: int) -> Usage | None:
    raw = os.pread(fd, _USAGE.size, 0)
    if len(raw) == _USAGE.size:
        magic, nbytes, entries, reconciled, housekept = _USAGE.unpack(raw)
        if magic == _MAGIC:
            return Usage(nbytes, entries, reconciled, housekept)
    return None


def _lock_counter(root: Path, fd: int, path: Path, wait: float) -> None:
    """``LOCK_EX`` on the counter within ``wait`` seconds, or :class:`CounterUnavailable`."""
    from . import locking

    deadline = time.monotonic() + wait
    while True:
        try:
            if locking.try_flock(fd):
                return
        except OSError as exc:
            if locking.no_locks_here(root, exc, str(path)):
                raise CounterUnavailable(exc.errno, f"no locks under {root}") from exc
            raise
        now = time.monotonic()
        if now >= deadline:
            with _state_guard:
                _busy_until[str(Path(root))] = now + COUNTER_RETRY_S
            _warn_once(
                root,
                "cute-diskcache: the size counter %s stayed locked by another process for %.1f s (a stopped process, "
                "or another user holding it); commits leave it alone for %.0f s at a time and keep the size cap by "
                "walking the cache instead",
                path,
                wait,
                COUNTER_RETRY_S,
            )
            raise CounterUnavailable(errno.EAGAIN, f"{path} is held by another process")
        time.sleep(_COUNTER_POLL_S)


@contextlib.contextmanager
def _counter(root: Path, *, create: bool = True, shared: bool = False,
             wait: float = COUNTER_WAIT_S) -> Iterator[tuple[int, Usage | None]]:
    """The counter file, locked; yields (fd, current value or None when missing or unreadable).

    Raises :class:`CounterUnavailable` (an OSError) when its lock is not had within ``wait``
    seconds, or is known not to work or to be held by someone who would not let go.
    """
    from . import locking

    if locking.without_locks(root):
        raise CounterUnavailable(errno.ENOLCK, f"no locks under {root}")
    if time.monotonic() < _busy_until.get(str(Path(root)), 0.0):
        raise CounterUnavailable(errno.EAGAIN, "the size counter was held too long a moment ago")
    path = Path(root) / layout.USAGE_FILE
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, file_mode(shared))
    token = locking.hold(fd)  # a child forked while we hold it must not keep it locked
    try:
        if not shared:  # a private root's counter made 0644 by an older version: nobody else's to open
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                if st.st_mode & 0o077 and st.st_uid == os.geteuid():
                    os.fchmod(fd, 0o600)
        _lock_counter(root, fd, path, wait)
        yield fd, _read(fd)
    finally:
        locking.release(fd, token)  # closing drops the flock


def _store(fd: int, u: Usage) -> None:
    os.pwrite(fd, _USAGE.pack(_MAGIC, max(0, int(u.bytes)), max(0, int(u.entries)), u.reconciled_at, u.housekept_at), 0)


def read_usage(root: Path) -> Usage | None:
    """The counter as it stands (None: no counter yet, or unreadable).

    When its lock cannot be had, the value is read without it (a read of 40 bytes that a
    ``pwrite`` replaces whole; at worst a stale value, which decides only whether upkeep is due).
    """
    try:
        with _counter(root, create=False) as (_fd, value):
            return value
    except CounterUnavailable:
        pass
    except OSError:
        return None
    try:
        fd = os.open(Path(root) / layout.USAGE_FILE, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        return _read(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def adjust(root: Path, delta_bytes: int, delta_entries: int = 0, *, shared: bool = False) -> Usage | None:
    """Add to the counter (creating it, due for a reconcile, when missing); the new value."""
    try:
        with _counter(root, shared=shared) as (fd, value):
            u = value or Usage()
            u.bytes += delta_bytes
            u.entries += delta_entries
            _store(fd, u)
            return u
    except OSError as exc:  # the counter is bookkeeping: never fail the operation over it
        log.debug("size counter not updated: %s", exc)
        return None


def mark(root: Path, *, shared: bool = False, **fields: Any) -> None:
    with contextlib.suppress(OSError):
        with _counter(root, shared=shared) as (fd, value):
            u = value or Usage()
            for name, v in fields.items():
                setattr(u, name, v)
            _store(fd, u)


# --------------------------------------------------------------------------------------------
# Removing things
# --------------------------------------------------------------------------------------------


def discard(root: Path, path: Path) -> int:
    """Remove ``path`` (an entry, namespace or leftover) so readers see it vanish at once.

    One rename into ``trash/`` (it needs no free space on a full disk), then the delete; a path
    that cannot be renamed (another filesystem) is deleted in place. Returns the bytes freed;
    0 when someone else removed it first.
    """
    from . import trust

    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not os.path.isdir(path) or os.path.islink(path):
        size = st.st_size
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return size
    trash = Path(root) / layout.TRASH_DIR
    dest = trash / f"{path.name[:80]}-{os.getpid()}-{os.urandom(3).hex()}"
    try:
        trust.make_dirs(Path(root), trash, shared=True)  # tightness of trash/ does not matter: nothing is read there
        os.rename(path, dest)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.debug("rename before removal failed (%s); deleting %s in place", exc, path)
        dest = path
    size = layout.tree_bytes(dest)[0]
    shutil.rmtree(dest, ignore_errors=True)
    return size


def remove(root: Path, path: Path) -> int:
    """:func:`discard` for an operator's removal (``prune``, an import replacing a bad entry):
    the size counter learns what went. Returns the bytes freed."""
    freed = discard(root, path)
    if freed:
        adjust(root, -freed)
    return freed


def _entries(root: Path, seen: set[tuple[int, int]] | None = None) -> list[tuple[float, int, str, Path]]:
    """(last use, bytes, namespace, dir) of every entry directory: the full walk. A payload
    several entries share (hard links) counts once, in the first entry met (``du``'s way)."""
    seen = set() if seen is None else seen
    out = []
    for d in layout.entry_dirs(root):
        size = layout.entry_bytes(d, seen)
        used = layout.last_used(d)
        if used:
            out.append((used, size, d.parent.parent.name, d))
    return out


def _sample(root: Path, shards: int, per_shard: int = 8) -> list[tuple[float, int, str | None, Path]]:
    """Candidates of the approximate LRU: up to ``per_shard`` random entries from each of up to
    ``shards`` random shard directories, with their last use (one ``stat`` each).

    Bounded whatever the cache holds: a few ``scandir`` calls and at most ``shards * per_shard``
    stats. Sizes are not read here (the removal measures what it frees).
    """
    base = Path(root) / layout.LAYOUT
    all_shards = [(ns.name, Path(s.path)) for ns in layout.subdirs(base) for s in layout.subdirs(Path(ns.path))]
    picked = all_shards if len(all_shards) <= shards else random.sample(all_shards, shards)
    out: list[tuple[float, int, str | None, Path]] = []
    for ns, shard in picked:
        names = [d for d in layout.subdirs(shard) if layout.DIGEST_RE.fullmatch(d.name)]
        for d in names if len(names) <= per_shard else random.sample(names, per_shard):
            try:
                out.append((d.stat(follow_symlinks=False).st_mtime, 0, ns, Path(d.path)))
            except OSError:
                continue
    return out


def quarantined(root: Path) -> list[tuple[float, Path]]:
    return sorted((layout.last_used(Path(d.path)), Path(d.path)) for d in layout.subdirs(Path(root) / layout.QUARANTINE_DIR))


def _remove(root: Path, candidates: list[tuple[float, int, str | None, Path]], *, over: int, limit: int | None,
            keep: Path | None = None, dry_run: bool = False) -> tuple[list[Path], int]:
    """Remove the oldest candidates until ``over`` bytes are gone (or ``limit`` of them).

    Returns (removed, bytes). A candidate's namespace (None for a quarantined entry) is where
    its eviction is counted.
    """
    from . import stats

    removed: list[Path] = []
    freed = 0
    for _used, size, ns, path in sorted(candidates):
        if freed >= over or (limit is not None and len(removed) >= limit):
            break
        if keep is not None and path == keep:
            continue
        got = size if dry_run else discard(root, path)
        if not dry_run and got == 0 and os.path.lexists(path):
            log.warning("eviction stopped: cannot remove %s", path)
            break
        if not dry_run and ns is not None:
            stats.record(ns, "evictions")
        removed.append(path)
        freed += got
    return removed, freed


# --------------------------------------------------------------------------------------------
# What the store and the CLI call
# --------------------------------------------------------------------------------------------


def note_commit(root: Path, added_bytes: int, *, entry_dir: Path | None = None, shared: bool = False) -> list[Path]:
    """After a commit: count its bytes; over the cap, cull at most :data:`CULL_LIMIT` entries.

    Bounded work whatever the cache holds: one counter update, and only over the cap a scan of
    the quarantine and of :data:`SAMPLE_SHARDS` shard directories. ``entry_dir`` (the entry
    just written) is never culled by its own commit.
    """
    cap = max_size()
    u = adjust(root, added_bytes, 1 if added_bytes > 0 else 0, shared=shared)
    if cap > 0 and u is None:
        return _cull_without_counter(root, added_bytes, cap, entry_dir)
    if cap <= 0 or u is None or u.bytes <= cap:
        return []
    goal = int(cap * _LOW_WATER)
    over = u.bytes - goal
    removed: list[Path] = []
    freed = 0
    for _used, q in quarantined(root):  # garbage kept for post-mortems goes first
        if freed >= over or len(removed) >= CULL_LIMIT:
            break
        freed += discard(root, q)
        removed.append(q)
    if freed < over and len(removed) < CULL_LIMIT:
        more, got = _remove(root, _sample(root, SAMPLE_SHARDS), over=over - freed, limit=CULL_LIMIT - len(removed), keep=entry_dir)
        removed += more
        freed += got
    adjust(root, -freed, -len(removed), shared=shared)
    if not removed:  # over the cap with nothing to take: the counter drifted; the next maintain walks
        mark(root, reconciled_at=0.0)
    else:
        log.info("culled %d entries from %s (%s over its cap)", len(removed), root, format_size(over))
    return removed


_unwalked: dict[str, int] = {}  # root -> bytes this process committed uncounted since its last walk


def _cull_without_counter(root: Path, added: int, cap: int, entry_dir: Path | None) -> list[Path]:
    """The commit could not be counted: keep the cap by an exact walk, at this process's first
    uncounted commit and then once per ``(1 - low water) x cap`` bytes it commits."""
    from . import locking

    if not locking.without_locks(root):  # those roots had their warning from .locking
        _warn_once(root, "cute-diskcache: the size counter under %s cannot be updated; the %s cap is kept by walking "
                         "the cache once per %s committed", root, format_size(cap), format_size(cap * (1 - _LOW_WATER)))
    key = str(Path(root))
    with _state_guard:
        pending = _unwalked.get(key)
        due = pending is None or pending + max(0, added) >= cap * (1 - _LOW_WATER)
        _unwalked[key] = 0 if due else (pending or 0) + max(0, added)
    if not due:
        return []
    gone, total, freed, _n = _exact(root, int(cap * _LOW_WATER), trigger=cap, keep=entry_dir)
    if gone:
        log.info("culled %d entries from %s by a walk (%s, cap %s)", len(gone), root, format_size(total - freed), format_size(cap))
    return gone


def _exact(root: Path, max_bytes: int, *, trigger: int | None = None, keep: Path | None = None,
           dry_run: bool = False) -> tuple[list[Path], int, int, int]:
    """Walk everything; if it takes more than ``trigger`` (default ``max_bytes``), remove the least
    recently used until at most ``max_bytes`` remain. Returns (removed entries, bytes found,
    bytes freed, entries found)."""
    from . import stats

    stats.ensure_file()
    seen: set[tuple[int, int]] = set()
    entries: list[tuple[float, int, str | None, Path]] = list(_entries(root, seen))
    quarantine: list[tuple[float, int, str | None, Path]] = [(used, layout.tree_bytes(q, seen)[0], None, q) for used, q in quarantined(root)]
    total = sum(e[1] for e in entries) + sum(q[1] for q in quarantine) + _overhead_bytes(root)
    over = total - max_bytes
    gone, freed_q, freed_e = [], 0, 0
    if total > (max_bytes if trigger is None else trigger) and over > 0:
        # Quarantined entries (kept only for post-mortems) first, then entries by recency.
        _q, freed_q = _remove(root, quarantine, over=over, limit=None, keep=keep, dry_run=dry_run)
        gone, freed_e = _remove(root, entries, over=over - freed_q, limit=None, keep=keep, dry_run=dry_run)
    return gone, total, freed_q + freed_e, len(entries)


def evict(root: Path, max_bytes: int, *, dry_run: bool = False) -> list[Path]:
    """Exact LRU: walk everything and remove the least recently used until at most ``max_bytes`` remain.

    For ``cute-diskcache evict`` (an operator command may walk). Sets the counter from the walk.
    Everything under the root counts, this process's own statistics file included (made first).
    """
    gone, total, freed, found = _exact(root, max_bytes, dry_run=dry_run)
    if not dry_run:
        mark(root, bytes=max(0, total - freed), entries=found - len(gone), reconciled_at=time.time())
        if gone:
            log.info("evicted %d entries from %s (down to %s)", len(gone), root, format_size(max_bytes))
    return gone


def enforce(root: Path) -> list[Path]:
    """If the cache is over its cap, evict down to 90% of it (exact; operator commands and imports)."""
    cap = max_size()
    if cap <= 0:
        return []
    use = usage(root)
    if use["bytes"] <= cap:
        return []
    return evict(root, int(cap * _LOW_WATER))


def make_room(root: Path, need: int, *, keep: Path | None = None) -> int:
    """The disk is full: free at least ``need`` bytes of least recently used entries. Bytes freed.

    A full volume is rare and every later write fails until something goes, so this walks (exact
    LRU) rather than sample; quarantined entries go first.
    """
    freed = sum(discard(root, q) for _u, q in quarantined(root))
    if freed < need:
        # Not what was touched in the last minute: those are writes in flight (other threads or
        # processes filling their entry directories right now) and the kernels just loaded.
        settled = [e for e in _entries(root) if time.time() - e[0] > IN_FLIGHT_S]
        _gone, got = _remove(root, settled, over=need - freed, limit=None, keep=keep)
        freed += got
    if freed:
        adjust(root, -freed)
        log.warning("cute-diskcache: the disk under %s was full; freed %s of least recently used entries", root, format_size(freed))
    return freed


# --------------------------------------------------------------------------------------------
# The full walk
# --------------------------------------------------------------------------------------------


def _overhead(root: Path, seen: set[tuple[int, int]] | None = None) -> dict[str, dict[str, int]]:
    """Bytes and items of what is not an entry: quarantine, tmp, trash, stats, locks (``seen``:
    the inodes a walk of the entries counted already, see :func:`.layout.tree_bytes`)."""
    root = Path(root)
    out: dict[str, dict[str, int]] = {}
    for name in (layout.QUARANTINE_DIR, layout.TMP_DIR, layout.TRASH_DIR):
        items = layout.subdirs(root / name)
        nbytes, _files = layout.tree_bytes(root / name, seen)
        out[name] = {"bytes": nbytes, "items": len(items)}
    nbytes, files = layout.tree_bytes(root / layout.STATS_DIR)
    out[layout.STATS_DIR] = {"bytes": nbytes, "items": files}
    _b, locks = layout.tree_bytes(root / layout.LOCKS_DIR)
    out[layout.LOCKS_DIR] = {"bytes": 0, "items": locks}
    return out


def _overhead_bytes(root: Path) -> int:
    return sum(v["bytes"] for k, v in _overhead(root).items() if k != layout.QUARANTINE_DIR)


def usage(root: Path) -> dict[str, Any]:
    """Bytes and entries, total and per namespace, plus what the rest of the root holds (a walk).

    ``bytes`` is everything the cap counts: entries, quarantine, staging, trash, statistics.
    """
    namespaces: dict[str, dict[str, int]] = {}
    total = count = 0
    seen: set[tuple[int, int]] = set()
    for _used, size, ns, _path in _entries(root, seen):
        rec = namespaces.setdefault(ns, {"bytes": 0, "entries": 0})
        rec["bytes"] += size
        rec["entries"] += 1
        total += size
        count += 1
    overhead = _overhead(root, seen)
    return {"bytes": total + sum(v["bytes"] for v in overhead.values()), "entry_bytes": total, "entries": count,
            "namespaces": namespaces, "overhead": overhead}
