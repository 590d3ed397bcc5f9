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
  ``compacted-*`` file, so ``stats/`` holds one file per live process plus one.
* A root whose filesystem cannot map files falls back to counting in memory, written at exit.

``cute-diskcache stats`` sums the files (:func:`aggregate`), ``zero`` zeroes them (live
processes' files in place). Files of the previous format (``*.msgpack``) are still read.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import mmap
import os
import socket
import struct
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import msgpack

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
)
_INDEX = {f: i for i, f in enumerate(FIELDS)}
_DIR = "stats"
_SUFFIX = ".stats"
_LEGACY_SUFFIX = ".msgpack"
_COMPACTED = "compacted-"
#: A previous-format file not rewritten for this long belongs to a process that stopped counting.
_LEGACY_IDLE_S = 600.0

# File format: header, then slots of (namespace, NUL-padded utf-8) + one float64 per field.
_HEADER = struct.Struct("<8sII")  # magic, fields per slot, slots
_MAGIC = b"CDCSTAT2"
_NAME_BYTES = 200
_FIRST_SLOTS = 8


def _slot_size(nfields: int) -> int:
    return _NAME_BYTES + 8 * nfields


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
            self._grow(_FIRST_SLOTS)
        except BaseException:
            os.close(self.fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise

    def _grow(self, nslots: int) -> None:
        size = _HEADER.size + nslots * _slot_size(len(FIELDS))
        os.ftruncate(self.fd, size)
        os.pwrite(self.fd, _HEADER.pack(_MAGIC, len(FIELDS), nslots), 0)
        if self.map is not None:
            self.map.close()
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.nslots = nslots

    def add(self, namespace: str, index: int, amount: float) -> None:
        slot = self.slots.get(namespace)
        if slot is None:
            slot = self._claim(namespace)
        assert self.map is not None
        at = _HEADER.size + slot * _slot_size(len(FIELDS)) + _NAME_BYTES + 8 * index
        (value,) = struct.unpack_from("<d", self.map, at)
        struct.pack_into("<d", self.map, at, value + amount)

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
#: Counts not (yet) in a file: recorded while unbound, or where mapping failed.
_memory: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
_file_name = ""


def _new_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}{_SUFFIX}"


def bind(root: Path | None, *, shared: bool = False) -> None:
    """Where this process's counters go (None: memory only, e.g. a read-only root).

    Counts made before the first bind move into the file when it is created. ``shared``: the
    root is shared by a group (``CUTE_DISKCACHE_TRUST_SHARED``), so ``stats/`` is made with the
    umask's mode rather than a private one.
    """
    global _root, _file, _file_failed, _shared
    with _lock:
        _shared = shared
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
        trust.make_dirs(_root, folder, shared=_shared)
        _file_name = _new_name()
        _file = _Mapped(folder / _file_name)
    except (OSError, ValueError):
        _file_failed = True
        return None
    for ns, counts in _memory.items():  # what was counted before the file existed
        for f, v in counts.items():
            _file.add(ns, _INDEX[f], v)
    _memory.clear()
    return _file


def record(namespace: str, field: str, amount: float = 1) -> None:
    """Count ``amount`` of ``field`` for ``namespace``."""
    index = _INDEX[field]
    with _lock:
        f = _file if _file is not None else _open()
        if f is not None:
            try:
                f.add(namespace, index, amount)
                return
            except (OSError, ValueError):  # the mapping could not grow (disk full): memory from here on
                pass
        _memory[namespace][field] += amount


def ensure_file() -> bool:
    """Create this process's file now, if bound and not yet made (before measuring the root's size)."""
    with _lock:
        return (_file if _file is not None else _open()) is not None


def snapshot() -> dict[str, dict[str, float]]:
    """This process's counters, not yet summed with anyone's."""
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

    A mapped file needs nothing (its pages are the file's); counts held in memory (a root that
    cannot map files) are written to a file of their own, atomically.
    """
    with _lock:
        if _root is None or not _memory:
            return
        if _file is None and not _file_failed and _open() is not None:
            return  # the counts moved into the new file
        data = msgpack.packb({"host": socket.gethostname(), "pid": os.getpid(), "counts": {ns: dict(c) for ns, c in _memory.items()}})
        folder = _root / _DIR
        name = f"{socket.gethostname()}-{os.getpid()}-memory{_LEGACY_SUFFIX}"
    tmp = folder / f".tmp.{name}.{os.urandom(4).hex()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, folder / name)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


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
        for f, v in zip(FIELDS, values):
            if v == v and v:  # skip NaN and zeros
                rec[f] = rec.get(f, 0.0) + v
    return out


def _read(path: Path) -> dict[str, dict[str, float]]:
    try:
        raw = path.read_bytes()
    except OSError:
        return {}
    if path.name.endswith(_SUFFIX):
        return _parse(raw)
    try:  # the msgpack format: compacted files, and files of earlier versions
        counts = msgpack.unpackb(raw, raw=False)["counts"]
        return {str(ns): {str(f): float(v) for f, v in c.items() if f in FIELDS} for ns, c in counts.items()}
    except Exception:  # a foreign or damaged file counts as nothing
        return {}


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
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            return None  # its process holds it: alive
        raise
    return fd


def fold(root: Path) -> int:
    """Merge the files of finished processes (and earlier folds) into one; returns how many went.

    The merged file is written before the originals are removed: a reader at that instant may
    count them twice, never lose them. One folder at a time (a lock in ``stats/``); a second
    caller returns 0 at once.
    """
    folder = Path(root) / _DIR
    try:
        guard = os.open(folder / ".fold.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:
        return 0
    held: list[tuple[Path, int]] = []
    try:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 0
        held = [(path, fd) for path, fd in _liveness(folder) if fd is not None]
        if len(held) < 2 and not any(not p.name.startswith(_COMPACTED) for p, _fd in held):
            return 0
        merged = _sum(path for path, _fd in held)
        name = f"{_COMPACTED}{socket.gethostname()}-{os.getpid()}-{time.time_ns()}{_LEGACY_SUFFIX}"
        tmp = folder / f".tmp.{name}"
        try:
            tmp.write_bytes(msgpack.packb({"host": "compacted", "pid": 0, "counts": merged}))
            os.replace(tmp, folder / name)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return 0
        for path, _fd in held:
            with contextlib.suppress(OSError):
                path.unlink()
        return len(held)
    finally:
        for _path, fd in held:
            os.close(fd)
        os.close(guard)


def aggregate(root: Path, *, compact: bool = False) -> dict[str, dict[str, float]]:
    """namespace -> field -> total over every process that used ``root`` (this one included)."""
    flush()
    if compact:
        fold(root)
    return _sum(_files(Path(root) / _DIR))


def _sum(paths: Iterable[Path]) -> dict[str, dict[str, float]]:
    total: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for path in paths:
        for ns, counts in _read(path).items():
            for f, v in counts.items():
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
    for path, fd in _liveness(folder):
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
