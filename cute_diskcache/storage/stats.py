"""Statistics that outlive processes without making them wait for each other.

Every process counts in its own file, ``<root>/stats/<host>-<pid>-<start>.stats``, mapped into
memory (``mmap``, shared): a hit adds to a float in the mapping (about a microsecond, no system
call), and the kernel keeps the file's pages, so the counts survive however the process ends:
``exit``, ``os._exit`` (a multiprocessing or engine worker), a signal. Nobody writes another
process's file, so there is no lock between processes and no lost update.

* **Forks** (``os.register_at_fork``): the child drops the parent's mapping and starts its own
  file at its first count, so forked workers never add to, or overwrite, one shared file; the
  module lock is replaced in the child, so a lock some thread held at the fork is not held
  forever there.
* **Liveness** is an ``flock`` each process holds on its own file for its whole life (fork and
  exec children do not keep it). A file whose lock can be taken belongs to a process that is
  gone, on any host that shares the volume, whatever its pid or hostname (every Kubernetes pod
  has a new one). :func:`fold` merges the files of gone processes, and earlier folds, into one
  ``compacted-*`` file, so ``stats/`` holds one file per live process plus one. ``stats``, a
  commit's housekeeping, and a process making its file in a crowded ``stats/`` fold
  (:data:`FOLD_AT`), so a deployment that only hits stays bounded too. The merged file
  names what it absorbed, so a fold killed at any step neither counts twice nor loses counts.
* A volume that fills: the file's blocks are allocated before they are mapped, so a full disk
  is an error we catch (counts stay in memory, one warning), not a SIGBUS that kills the process.
* A root whose filesystem cannot map files falls back to counting in memory, written at exit.

``cute-diskcache stats`` sums the files (:func:`aggregate`), ``zero`` zeroes them (live
processes' files in place). Files of the previous format (``*.msgpack``) are still read.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any
from collections.abc import Iterable

import msgpack

from .locking import NO_LOCKS

FIELDS = (
    "hits",
    "misses",
    "compiles",
    "compile_seconds",
    "saved_seconds",
    "load_seconds",
    "errors",
    "quarantined",
    "writes",
    "bytes_written",
    "evictions",
    # the remote tier (cute_diskcache.remote): remote_hits are also counted in hits
    "remote_hits",
    "remote_misses",
    "remote_errors",
    "remote_skipped",
    "remote_bytes_in",
    "remote_bytes_out",
    "remote_seconds",
    "published",
    "publish_dropped",
    # prewarm's workers (issue 28, item 5): counted apart, so a fresh prewarm is no serving miss
    # and a hit-rate alert does not fire after every image build
    "prewarm_compiles",
    "prewarm_compile_seconds",
    "prewarm_hits",
    # second-stage reuse (issue 31): first-stage misses served by another release's entry with the same traced IR
    # (neither hits nor misses), the traces a miss made to look, and prewarm's reuses apart
    "reused",
    "reuse_seconds",
    "traces",
    "trace_seconds",
    "prewarm_reused",
)
_INDEX = {f: i for i, f in enumerate(FIELDS)}
_DIR = "stats"
_SUFFIX = ".stats"
_LEGACY_SUFFIX = ".msgpack"
_COMPACTED = "compacted-"
#: A previous-format file not rewritten for this long belongs to a process that stopped counting.
_LEGACY_IDLE_S = 600.0
#: A process that makes its file folds the finished ones when ``stats/`` holds more than this
#: many: a deployment that only hits (no commit runs housekeeping) and nobody running ``stats``
#: kept one file per process ever started (40 processes, 40 files), without bound.
FOLD_AT = 16

# File format: header, then slots of (namespace, NUL-padded utf-8) + one float64 per field.
_HEADER = struct.Struct("<8sII")  # magic, fields per slot, slots
_MAGIC = b"CDCSTAT2"
_NAME_BYTES = 200
_FIRST_SLOTS = 8


def _slot_size(nfields: int) -> int:
    return _NAME_BYTES + 8 * nfields


def _allocate(fd: int, start: int, end: int) -> None:
    """Give ``fd``'s bytes ``start..end`` real blocks (zeros), or raise OSError (ENOSPC, EDQUOT...).

    ``posix_fallocate`` where the filesystem has it; else zeros written, which allocate too.
    """
    if end <= start:
        return
    try:
        os.posix_fallocate(fd, start, end - start)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            raise
    except AttributeError:  # no posix_fallocate on this platform
        pass
    zeros = bytes(min(end - start, 1 << 16))
    at = start
    while at < end:
        at += os.pwrite(fd, zeros[: end - at], at)


class _Mapped:
    """This process's counter file: an ``flock``-ed descriptor and a shared mapping of it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        self.fd = os.open(path, flags, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held for life: "this process is alive"
            self.slots: dict[str, int] = {}
            self.nslots = 0
            self.map: mmap.mmap | None = None
            self.full = False  # the file could not grow: new namespaces count in memory
            self._grow(_FIRST_SLOTS)
        except BaseException:
            os.close(self.fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise

    def _grow(self, nslots: int) -> None:
        """Make room for ``nslots`` slots: the blocks are allocated before any page is mapped.

        A sparse file (``ftruncate``) has no blocks behind its new pages; on a full volume the
        first store to such a page is a SIGBUS that kills the process (measured: a 64 KiB tmpfs,
        the 12th namespace, rc 135). Allocating first makes a full disk an OSError here.
        """
        size = _HEADER.size + nslots * _slot_size(len(FIELDS))
        _allocate(self.fd, os.fstat(self.fd).st_size, size)
        os.pwrite(self.fd, _HEADER.pack(_MAGIC, len(FIELDS), nslots), 0)
        grown = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if self.map is not None:  # closed only once the new one exists: a failure keeps the slots we have
            self.map.close()
        self.map = grown
        self.nslots = nslots

    def add(self, namespace: str, index: int, amount: float) -> bool:
        """Count into the mapping; False: ``namespace`` has no slot and the file cannot grow."""
        slot = self.slots.get(namespace)
        if slot is None:
            if self.full:
                return False
            try:
                slot = self._claim(namespace)
            except (OSError, ValueError):
                self.full = True  # no retry per count: a syscall on the hit path of every new namespace
                raise
        assert self.map is not None
        at = _HEADER.size + slot * _slot_size(len(FIELDS)) + _NAME_BYTES + 8 * index
        (value,) = struct.unpack_from("<d", self.map, at)
        struct.pack_into("<d", self.map, at, value + amount)
        return True

    def _claim(self, namespace: str) -> int:
        if len(self.slots) >= self.nslots:
            self._grow(self.nslots * 2)
        slot = len(self.slots)
        name = namespace.encode("utf-8", "replace")[:_NAME_BYTES - 1]
        assert self.map is not None
        at = _HEADER.size + slot * _slot_size(len(FIELDS))
        self.map[at:at + _NAME_BYTES] = name.ljust(_NAME_BYTES, b"\0")
        self.slots[namespace] = slot
        return slot

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
            self.map = None
        os.close(self.fd)  # drops the flock: the file now reads as a finished process's


_lock = threading.Lock()
_root: Path | None = None
_file: _Mapped | None = None
_file_failed = False  # this root cannot hold a mapped file: count in memory, write at exit
_shared = False  # the root is shared (CUTE_DISKCACHE_TRUST_SHARED): stats/ follows the umask
_group: int | None = None  # CUTE_DISKCACHE_TRUST_GROUP: stats/ is that group's, 2775, so every member's process adds its file
#: Counts not (yet) in a file: recorded while unbound, or where mapping failed.
_memory: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
_file_name = ""
_warned_full = False  # "statistics kept in memory: <root> is full" said (once per process)
#: errnos of a volume that has no room left for our file
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
log = logging.getLogger("cute_diskcache")


def _new_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}{_SUFFIX}"


def bind(root: Path | None, *, shared: bool = False, group: int | None = None) -> None:
    """Where this process's counters go (None: memory only, e.g. a read-only root).

    Counts made before the first bind move into the file when it is created. ``shared``: the
    root is shared (``CUTE_DISKCACHE_TRUST_SHARED``), so ``stats/`` is made with the umask's
    mode rather than a private one; ``group`` (``CUTE_DISKCACHE_TRUST_GROUP``): with that group
    and mode 2775, so the other members' processes (other pods' uids) can add their files.
    """
    global _root, _file, _file_failed, _shared, _group
    with _lock:
        _shared = shared
        _group = group
        if root is not None and _root is not None and Path(root) == Path(_root):
            return
        if _file is not None:
            _file.close()
            _file = None
        _root = Path(root) if root is not None else None
        _file_failed = False


def _open() -> _Mapped | None:
    """This process's file under the bound root, created now (called with the lock held)."""
    global _file, _file_failed, _file_name
    if _root is None or _file_failed:
        return None
    from . import trust

    folder = _root / _DIR
    try:
        trust.make_dirs(_root, folder, shared=_shared, **({"group": _group} if _group is not None and not _shared else {}))
        _file_name = _new_name()
        _file = _Mapped(folder / _file_name)
    except (OSError, ValueError) as exc:
        _file_failed = True
        _degraded(exc)
        return None
    _fold_if_crowded(folder)
    for ns in list(_memory):  # what was counted before the file existed; what does not fit stays here
        try:
            placed = all(_file.add(ns, _INDEX[f], v) for f, v in _memory[ns].items())  # False at the first field or never
        except (OSError, ValueError) as exc:
            _degraded(exc)
            placed = False
        if placed:
            del _memory[ns]
    return _file


def _fold_if_crowded(folder: Path) -> None:
    """Fold finished processes' files once ``folder`` holds more than :data:`FOLD_AT` (once per
    process, as its own file is made: at attach, off the hit path). Never raises."""
    try:
        with os.scandir(folder) as it:
            crowded = sum(1 for e in it if e.name.endswith((_SUFFIX, _LEGACY_SUFFIX)) and not e.name.startswith(".")) > FOLD_AT
        if crowded:
            fold(folder.parent)
    except OSError as exc:
        log.debug("statistics not folded: %s", exc)


def record(namespace: str, field: str, amount: float = 1) -> None:
    """Count ``amount`` of ``field`` for ``namespace``."""
    index = _INDEX[field]
    with _lock:
        f = _file if _file is not None else _open()
        if f is not None:
            try:
                if f.add(namespace, index, amount):
                    return
            except (OSError, ValueError) as exc:  # the file could not grow (disk full): memory from here on
                _degraded(exc)
        _memory[namespace][field] += amount


def _degraded(exc: BaseException) -> None:
    """Say once per process that counts stay in memory because the volume is full (with the lock held)."""
    global _warned_full
    if isinstance(exc, OSError) and exc.errno in _FULL and not _warned_full:
        _warned_full = True
        log.warning("statistics kept in memory: %s is full (%s)", _root, exc.strerror or exc)
    else:
        log.debug("statistics kept in memory: %s", exc)


def ensure_file() -> bool:
    """Create this process's file now, if bound and not yet made (before measuring the root's size)."""
    with _lock:
        return (_file if _file is not None else _open()) is not None


def snapshot() -> dict[str, dict[str, float]]:
    """This process's counters not yet summed with anyone's (nor written to a memory file)."""
    with _lock:
        out = {ns: dict(c) for ns, c in _memory.items()}
        if _file is not None and _file.map is not None:
            for ns, counts in _parse(bytes(_file.map)).items():
                rec = out.setdefault(ns, {})
                for f, v in counts.items():
                    rec[f] = rec.get(f, 0.0) + v
        return out


def flush() -> None:
    """Make this process's counts readable by others now.

    A mapped file needs nothing (its pages are the file's). Counts held in memory (a root that
    cannot map files, a full volume) move to a file of their own, written atomically under a
    name used once: a fold that absorbs it can never meet a later version of it.
    """
    with _lock:
        if _root is None or not _memory:
            return
        if _file is None and not _file_failed:
            _open()  # moves what fits into the new file
        if not _memory:
            return
        counts = {ns: dict(c) for ns, c in _memory.items()}
        _memory.clear()
        folder = _root / _DIR
        name = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}-memory{_LEGACY_SUFFIX}"
    data = msgpack.packb({"host": socket.gethostname(), "pid": os.getpid(), "counts": counts})
    tmp = folder / f".tmp.{name}.{os.urandom(4).hex()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, folder / name)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        with _lock:  # not written: they stay ours, for the next flush
            for ns, c in counts.items():
                for f, v in c.items():
                    _memory[ns][f] += v


atexit.register(flush)


# -- fork safety --------------------------------------------------------------------------------


def _before_fork() -> None:
    _lock.acquire()  # no thread is half-way through an update when the child is made


def _after_fork_in_parent() -> None:
    _lock.release()


def _after_fork_in_child() -> None:
    """The child counts for itself: a fresh lock, no counts, its own file at its first count."""
    global _lock, _file, _file_failed
    _lock = threading.Lock()
    if _file is not None:
        # Our copy of the parent's mapping and descriptor; closing them leaves the parent's flock
        # (held through the parent's own descriptor) and its counts alone.
        with contextlib.suppress(Exception):
            _file.close()
        _file = None
    _file_failed = False
    _memory.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


# -- reading, folding, zeroing ------------------------------------------------------------------


def _parse(raw: bytes) -> dict[str, dict[str, float]]:
    """Counts in a ``.stats`` file's bytes; anything malformed counts as nothing."""
    if len(raw) < _HEADER.size:
        return {}
    magic, nfields, nslots = _HEADER.unpack_from(raw, 0)
    if magic != _MAGIC or not 0 < nfields <= 4096:
        return {}
    size = _slot_size(nfields)
    out: dict[str, dict[str, float]] = {}
    for slot in range(min(nslots, (len(raw) - _HEADER.size) // size)):
        at = _HEADER.size + slot * size
        name = raw[at:at + _NAME_BYTES].split(b"\0", 1)[0]
        if not name:
            continue
        values = struct.unpack_from(f"<{nfields}d", raw, at + _NAME_BYTES)
        rec = out.setdefault(name.decode("utf-8", "replace"), {})
        for f, v in zip(FIELDS, values, strict=False):  # a newer writer may hold more fields; these are the ones known here
            if v == v and v:  # skip NaN and zeros
                rec[f] = rec.get(f, 0.0) + v
    return out


#: What a file holds: its counts and, for a compacted file, the names of the files whose counts
#: it already holds (they count as nothing while it exists).
_Loaded = tuple[dict[str, dict[str, float]], frozenset[str]]


def _load(path: Path) -> _Loaded | None:
    """``path``'s counts and absorbed names; None if it vanished (a fold or zero removed it).

    A damaged or foreign file counts as nothing. Only ``compacted-*`` files absorb others.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError:
        return {}, frozenset()
    if path.name.endswith(_SUFFIX):
        return _parse(raw), frozenset()
    try:  # the msgpack format: compacted files, memory files, and files of earlier versions
        doc = msgpack.unpackb(raw, raw=False)
        counts = {str(ns): {str(f): float(v) for f, v in c.items() if f in FIELDS} for ns, c in doc["counts"].items()}
    except Exception:  # noqa: BLE001 - a foreign or damaged file counts as nothing
        return {}, frozenset()
    absorbed = doc.get("absorbed") if path.name.startswith(_COMPACTED) else None
    if not isinstance(absorbed, list):
        return counts, frozenset()
    return counts, frozenset(n for n in absorbed if isinstance(n, str) and n != path.name)


def _read(path: Path) -> dict[str, dict[str, float]]:
    """``path``'s own counts (what it absorbed aside); nothing if unreadable."""
    loaded = _load(path)
    return loaded[0] if loaded is not None else {}


def _files(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.name.endswith((_SUFFIX, _LEGACY_SUFFIX)) and not p.name.startswith("."))
    except OSError:
        return []


def _gone(path: Path) -> int | None:
    """A locked descriptor of ``path`` if the process that wrote it is gone, else None."""
    if path.name.startswith(_COMPACTED):
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    if path.name.endswith(_LEGACY_SUFFIX):
        if time.time() - path.stat().st_mtime < _LEGACY_IDLE_S:
            return None
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    from .locking import open_to_lock

    # For writing where we may: NFS emulates flock with POSIX locks, which refuse (EBADF) an
    # exclusive lock through a read-only descriptor, and the file would never be folded.
    fd = open_to_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in NO_LOCKS and _finished_without_locks(path):
            return fd
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            return None  # its process holds it: alive
        raise
    return fd


def _finished_without_locks(path: Path) -> bool:
    """Whether a counter file's process is gone, on a volume where ``flock`` does not work
    (NFSv3 without lockd, FUSE): a process of this host that no longer exists, or a file idle
    as long as the legacy files' grace. Without this every process would leave its file for
    good. An idle live process folded this way loses its later counts (its file is unlinked
    under it); it never counts twice."""
    host, _, rest = path.name.partition("-")
    pid = rest.split("-", 1)[0]
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass  # another user's process: alive
        else:
            return False
    return time.time() - path.stat().st_mtime >= _LEGACY_IDLE_S


def fold(root: Path) -> int:
    """Merge the files of finished processes (and earlier folds) into one; returns how many went.

    Crash-safe at every step: the merged ``compacted-*`` file names every file whose counts it
    holds (``absorbed``) and is published by one rename; from that instant readers count those
    files as nothing, before and after they are removed. A fold killed after publishing leaves
    files that count as nothing and that the next fold removes without adding them again (on
    the old scheme 40 hits became 80, for good); one killed before publishing changed nothing
    that is read. One folder at a time (a lock in ``stats/``); a second caller returns 0 at once.
    """
    folder = Path(root) / _DIR
    try:
        guard = os.open(folder / ".fold.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:
        return 0
    held: list[tuple[Path, int]] = []
    claimed = False
    try:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            # No locks on this volume (NFSv3 without lockd, FUSE): an exclusive create guards
            # the fold instead, as NFS has honoured O_EXCL since v3. Two unguarded folds could
            # each absorb the same file and count it twice.
            if exc.errno not in NO_LOCKS or not _claim_by_create(folder):
                return 0
            claimed = True
        _sweep_unpublished(folder)
        listing = _liveness(folder)
        present = {path.name for path, _fd in listing}
        held = [(path, fd) for path, fd in listing if fd is not None]
        if len(held) < 2 and not any(not p.name.startswith(_COMPACTED) for p, _fd in held):
            return 0
        loaded = {path: _load(path) or ({}, frozenset()) for path, _fd in held}
        # Names whose counts a compacted file already holds: carried into the new file's list
        # while they exist (a fold killed before removing them), never added again.
        already = frozenset().union(*(absorbed for _counts, absorbed in loaded.values())) & present
        merged = _add_up(counts for path, (counts, _a) in loaded.items() if path.name not in already)
        absorbed = sorted({path.name for path, _fd in held} | already)
        name = f"{_COMPACTED}{socket.gethostname()}-{os.getpid()}-{time.time_ns()}{_LEGACY_SUFFIX}"
        body = msgpack.packb({"host": "compacted", "pid": 0, "counts": merged, "absorbed": absorbed})
        if not _publish(folder, name, body):
            return 0
        for path, _fd in held:  # each already counts as nothing: any order, any interruption
            with contextlib.suppress(OSError):
                path.unlink()
        return len(held)
    finally:
        for _path, fd in held:
            os.close(fd)
        os.close(guard)
        if claimed:
            with contextlib.suppress(OSError):
                os.unlink(folder / _FOLD_CLAIM)


#: A fold's claim where ``flock`` does not work; one older than this is a dead folder's.
_FOLD_CLAIM = ".fold.claim"
_FOLD_CLAIM_STALE_S = 600.0


def _claim_by_create(folder: Path) -> bool:
    """Take the fold by creating ``.fold.claim`` exclusively; a claim left by a fold that died
    (older than :data:`_FOLD_CLAIM_STALE_S`) is removed and taken once more."""
    path = folder / _FOLD_CLAIM
    for _attempt in range(2):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600))
            return True
        except FileExistsError:
            try:
                if time.time() - os.lstat(path).st_mtime < _FOLD_CLAIM_STALE_S:
                    return False
                os.unlink(path)
            except OSError:
                return False
        except OSError:
            return False
    return False


_UNPUBLISHED = f".tmp.{_COMPACTED}"


def _publish(folder: Path, name: str, body: bytes) -> bool:
    """Write ``body`` as ``folder/name`` in one rename, its bytes on disk first (False: not written)."""
    tmp = folder / f"{_UNPUBLISHED}{name[len(_COMPACTED):]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)  # a rename that reaches the disk before the bytes would publish an empty fold
        finally:
            os.close(fd)
        os.replace(tmp, folder / name)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False


def _sweep_unpublished(folder: Path) -> None:
    """Remove what folds killed before publishing left (called with the fold lock held)."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith(_UNPUBLISHED)]
    except OSError:
        return
    for n in names:
        with contextlib.suppress(OSError):
            os.unlink(folder / n)


def aggregate(root: Path, *, compact: bool = False) -> dict[str, dict[str, float]]:
    """namespace -> field -> total over every process that used ``root`` (this one included)."""
    flush()
    if compact:
        fold(root)
    return _total(Path(root) / _DIR)


def _total(folder: Path, *, retries: int = 8) -> dict[str, dict[str, float]]:
    """The sum of ``folder``'s files, counting nothing that a compacted file there already holds.

    A file that vanished between listing and reading (a fold published and removed it) makes
    the sum list the folder again, so a fold running meanwhile is not seen half-way.
    """
    for attempt in range(retries + 1):
        loaded = {path: _load(path) for path in _files(folder)}
        absorbed = frozenset().union(*(got[1] for got in loaded.values() if got is not None))
        if attempt < retries and any(got is None and p.name not in absorbed for p, got in loaded.items()):
            continue
        return _add_up(got[0] for p, got in loaded.items() if got is not None and p.name not in absorbed)
    return {}


def _add_up(parts: Iterable[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    total: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for counts in parts:
        for ns, fields in counts.items():
            for f, v in fields.items():
                total[ns][f] += v
    return {ns: dict(c) for ns, c in total.items()}


def _liveness(folder: Path) -> list[tuple[Path, int | None]]:
    """Every statistics file under ``folder`` with, for a finished process's, a descriptor holding
    its lock (the caller closes it; None: its process is alive). Unreadable files are left out."""
    out: list[tuple[Path, int | None]] = []
    for path in _files(folder):
        try:
            out.append((path, _gone(path)))
        except OSError:
            continue
    return out


def files(root: Path) -> dict[str, int]:
    """How many statistics files ``root`` holds, and their bytes (what ``stats`` reports)."""
    paths = _files(Path(root) / _DIR)
    size = 0
    for p in paths:
        with contextlib.suppress(OSError):
            size += p.stat().st_size
    return {"files": len(paths), "bytes": size}


def zero(root: Path) -> None:
    """Forget every statistic under ``root``: finished processes' files go, live ones are zeroed in place."""
    folder = Path(root) / _DIR
    with _lock:
        if _root is not None and Path(_root) == Path(root):
            _memory.clear()
    # Compacted files go last: until then, what they absorbed (a fold killed half-way) counts as nothing.
    for path, fd in sorted(_liveness(folder), key=lambda got: got[0].name.startswith(_COMPACTED)):
        if fd is not None:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        if path.name.endswith(_SUFFIX):  # a live process's mapped file: zero its values, keep its names
            with contextlib.suppress(OSError):
                _zero_in_place(path)


def _zero_in_place(path: Path) -> None:
    fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        raw = os.pread(fd, _HEADER.size, 0)
        magic, nfields, nslots = _HEADER.unpack(raw)
        if magic != _MAGIC:
            return
        size = _slot_size(nfields)
        for slot in range(nslots):
            os.pwrite(fd, b"\0" * 8 * nfields, _HEADER.size + slot * size + _NAME_BYTES)
    finally:
        os.close(fd)


def totals(per_namespace: dict[str, dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {f: 0.0 for f in FIELDS}
    for counts in per_namespace.values():
        for f, v in counts.items():
            out[f] = out.get(f, 0.0) + v
    return out


def reset_for_tests() -> None:
    """Detach from this process's file (its counts stay on disk) and forget counts in memory."""
    global _file, _file_failed
    with _lock:
        if _file is not None:
            _file.close()
            _file = None
        _file_failed = False
        _memory.clear()


def describe() -> dict[str, Any]:
    return {"file": _file_name or None, "root": str(_root) if _root else None, "mapped": _file is not None}
