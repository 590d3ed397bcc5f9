"""Statistics that outlive processes without making them wait for each other.

Every process counts in memory (a dict increment: the hit path stays in microseconds) and
writes its own file, ``<root>/stats/<host>-<pid>-<start>.msgpack``, atomically, at most every
few seconds and at exit. Nobody ever writes another process's file, so there is no lock and no
lost update; ``cute-diskcache stats`` sums the files, ``zero`` deletes them. One file per
process lifetime is small (a few hundred bytes); ``aggregate(compact=True)`` folds the files
of finished processes on this host into one.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

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
_FLUSH_EVERY_S = 5.0
_DIR = "stats"

_lock = threading.Lock()
_counts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
_root: Path | None = None
_dirty = False
_last_flush = 0.0
_file_name = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}.msgpack"


def bind(root: Path | None) -> None:
    """Where this process's counters go (None: memory only, e.g. a read-only root)."""
    global _root
    with _lock:
        _root = root


def record(namespace: str, field: str, amount: float = 1) -> None:
    """Count ``amount`` of ``field`` for ``namespace``; writes to disk at most every few seconds."""
    global _dirty
    with _lock:
        _counts[namespace][field] += amount
        _dirty = True
        due = _root is not None and time.monotonic() - _last_flush > _FLUSH_EVERY_S
    if due:
        flush()


def snapshot() -> dict[str, dict[str, float]]:
    """This process's counters, not yet summed with anyone's."""
    with _lock:
        return {ns: dict(c) for ns, c in _counts.items()}


def flush() -> None:
    """Write this process's file now (atomic replace; no fsync: statistics are not worth one)."""
    global _dirty, _last_flush
    with _lock:
        if _root is None or not _dirty:
            return
        data = msgpack.packb({"host": socket.gethostname(), "pid": os.getpid(), "counts": {ns: dict(c) for ns, c in _counts.items()}})
        root = _root
        _dirty = False
        _last_flush = time.monotonic()
    folder = root / _DIR
    tmp = folder / f".tmp.{_file_name}.{os.urandom(4).hex()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, folder / _file_name)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


atexit.register(flush)


def _read(path: Path) -> dict[str, dict[str, float]]:
    try:
        doc = msgpack.unpackb(path.read_bytes(), raw=False)
        counts = doc["counts"]
        return {str(ns): {str(f): float(v) for f, v in c.items() if f in FIELDS} for ns, c in counts.items()}
    except Exception:  # a foreign or damaged file counts as nothing
        return {}


def _alive(host: str, pid: int) -> bool:
    if host != socket.gethostname():
        return True  # cannot tell: leave it alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def aggregate(root: Path, *, compact: bool = False) -> dict[str, dict[str, float]]:
    """namespace -> field -> total over every process that used ``root`` (this one included)."""
    flush()
    total: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    folder = Path(root) / _DIR
    files = sorted(folder.glob("*.msgpack")) if folder.is_dir() else []
    finished: list[Path] = []
    for path in files:
        for ns, counts in _read(path).items():
            for f, v in counts.items():
                total[ns][f] += v
        parts = path.stem.split("-")
        if compact and len(parts) >= 3 and not path.name.startswith("compacted-") and parts[-2].isdigit():
            if not _alive("-".join(parts[:-2]), int(parts[-2])):
                finished.append(path)
    if compact and len(finished) > 1:
        _compact(folder, finished)
    return {ns: dict(c) for ns, c in total.items()}


def _compact(folder: Path, finished: list[Path]) -> None:
    """Fold finished processes' files into one; the sum is unchanged at every instant.

    The folded file is written first under a fresh name, then the originals are removed: a
    concurrent reader may briefly count them twice, never lose them.
    """
    merged: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for path in finished:
        for ns, counts in _read(path).items():
            for f, v in counts.items():
                merged[ns][f] += v
    name = f"compacted-{socket.gethostname()}-{os.getpid()}-{time.time_ns()}.msgpack"
    try:
        tmp = folder / f".tmp.{name}"
        tmp.write_bytes(msgpack.packb({"host": "compacted", "pid": 0, "counts": {ns: dict(c) for ns, c in merged.items()}}))
        os.replace(tmp, folder / name)
        for path in finished:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def zero(root: Path) -> None:
    """Forget every statistic under ``root`` (and this process's, if it counts there)."""
    import shutil

    with _lock:
        if _root is not None and Path(_root) == Path(root):
            _counts.clear()
    shutil.rmtree(Path(root) / _DIR, ignore_errors=True)


def totals(per_namespace: dict[str, dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {f: 0.0 for f in FIELDS}
    for counts in per_namespace.values():
        for f, v in counts.items():
            out[f] = out.get(f, 0.0) + v
    return out


def reset_for_tests() -> None:
    """Forget this process's in-memory counters (tests that build several caches in one process)."""
    global _dirty
    with _lock:
        _counts.clear()
        _dirty = False


def describe() -> dict[str, Any]:
    return {"file": _file_name, "root": str(_root) if _root else None, "flush_every_s": _FLUSH_EVERY_S}
