"""Single-flight: when N processes miss the same key, one compiles and the others load its entry.

One lock file per key, ``<root>/locks/<digest[:2]>/<digest>.lock``, outside ``v1/`` so a
read-only cache never needs them (a store that cannot write takes no lock at all). The lock
is ``flock(2)`` through the ``filelock`` library:

* **A holder that dies releases its lock.** The kernel drops an ``flock`` when the last
  descriptor of its holder closes, SIGKILL included, so there is no stale-lock protocol to
  get wrong: the next waiter gets the lock at once, finds no entry, and compiles.
* **Network filesystems.** On Linux NFS (v3 through lockd, v4 natively) ``flock`` is emulated
  with byte-range locks the server arbitrates across clients; a client that dies loses its
  locks when its lease expires (NFSv4: about 90 s), so there recovery takes that long, not an
  instant. A mount with ``nolock``/``local_lock=flock`` makes locks per client: single-flight
  then holds per host only and hosts may compile the same kernel (harmless: commits are
  atomic). A filesystem without ``flock`` at all gets no lock: we never fall back to
  filelock's "soft" marker files, which a killed holder leaves behind for everyone to wait on.
* **Bounded wait.** ``CUTE_DISKCACHE_LOCK_TIMEOUT`` seconds (default 300), then one warning and
  we compile anyway: a hung holder costs a duplicate compile, never a wedged engine.
* **A lock we cannot create** (permissions, full disk, odd filesystem) is no lock: we compile.

Lock files are left in place on release (every waiter must lock the same inode; deleting a
file someone may hold would let a newcomer lock a fresh inode beside them). They are empty;
:func:`prune` removes the ones nobody holds, and ``clear`` removes the whole directory.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("cute_diskcache")

LOCKS_DIR = "locks"
DEFAULT_TIMEOUT_S = 300.0
_POLL_S = 0.05


@dataclass(frozen=True)
class Flight:
    """How this process entered the compile of one key.

    ``held``: we hold the key's lock, so whoever held it before us has finished: re-check the
    store before compiling. ``outcome`` is one of ``acquired`` (no wait), ``waited``,
    ``timeout``, ``unavailable`` (no lock could be made), ``off`` (not asked for).
    """

    held: bool
    outcome: str
    waited_seconds: float = 0.0


def lock_path(root: Path, digest: str) -> Path:
    return Path(root) / LOCKS_DIR / digest[:2] / f"{digest}.lock"


_lock_kwargs: dict[str, Any] | None = None


def _new_lock(path: Path, shared: bool) -> Any:
    """A fresh ``flock`` lock object (one per acquisition: threads of one process each get one).

    ``fallback_to_soft=False`` where filelock has it (4.x): a filesystem without ``flock``
    must mean "no lock", not marker files a killed holder leaves behind. filelock 3.x raises
    instead of falling back, which we also read as "no lock".
    """
    global _lock_kwargs
    import filelock

    cls = filelock.UnixFileLock if os.name == "posix" else filelock.FileLock
    mode = 0o664 if shared else 0o644
    if _lock_kwargs is None:
        try:
            lock = cls(str(path), mode=mode, fallback_to_soft=False)
        except TypeError:
            _lock_kwargs = {}
        else:
            _lock_kwargs = {"fallback_to_soft": False}
            return lock
    return cls(str(path), mode=mode, **_lock_kwargs)


def _make_dirs(root: Path, shard: Path, dir_mode: int) -> None:
    root.mkdir(mode=dir_mode, parents=True, exist_ok=True)
    for d in (root / LOCKS_DIR, shard):
        try:
            d.mkdir(mode=dir_mode)
        except FileExistsError:
            pass


def _acquire(root: Path, digest: str, timeout: float, label: str, shared: bool) -> tuple[Any, Flight]:
    import filelock

    path = lock_path(root, digest)
    try:
        _make_dirs(Path(root), path.parent, 0o777 if shared else 0o755)
        lock = _new_lock(path, shared)
        try:
            lock.acquire(timeout=0)
            return lock, Flight(True, "acquired")
        except filelock.Timeout:
            pass
        log.info("another process is compiling %s; waiting for it (up to %.0f s)", label, timeout)
        t0 = time.monotonic()
        try:
            lock.acquire(timeout=timeout, poll_interval=_POLL_S)
        except filelock.Timeout:
            waited = time.monotonic() - t0
            log.warning(
                "cute-diskcache waited %.0f s for another process compiling %s (lock %s); compiling it here too "
                "(CUTE_DISKCACHE_LOCK_TIMEOUT=%g)",
                waited,
                label,
                path,
                timeout,
            )
            return None, Flight(False, "timeout", waited)
        return lock, Flight(True, "waited", time.monotonic() - t0)
    except Exception as exc:  # OSError (EACCES, ENOSPC, EROFS...), NotImplementedError (no flock)
        log.debug("no single-flight lock for %s (%s: %s); compiling without it", label, type(exc).__name__, exc)
        return None, Flight(False, "unavailable")


@contextlib.contextmanager
def single_flight(root: Path, digest: str, *, timeout: float = DEFAULT_TIMEOUT_S, label: str = "", shared: bool = False) -> Iterator[Flight]:
    """Hold ``digest``'s lock for the body (compile + commit), or yield a lock-less :class:`Flight`.

    ``shared`` (``CUTE_DISKCACHE_TRUST_SHARED``): lock directories and files follow the umask
    and are group-writable, so a fleet of users sharing the volume can all lock. Never raises
    on account of the lock: every failure degrades to compiling without it.
    """
    lock, flight = _acquire(Path(root), digest, max(0.0, timeout), label or digest[:12], shared)
    try:
        yield flight
    finally:
        if lock is not None:
            try:
                lock.release()
            except Exception as exc:  # the kernel drops the lock with the descriptor anyway
                log.debug("releasing %s failed: %s", lock_path(root, digest), exc)


def prune(root: Path) -> int:
    """Delete lock files nobody holds now; returns how many. Safe beside running processes.

    A file is removed only while we hold its ``flock`` ourselves and only if the name still
    points at the inode we locked. A process that opened it just before can then lock an
    unlinked inode beside a newcomer's fresh one: both compile, the commits are atomic, and the
    loser's entry is identical. Never a wrong kernel, at worst one duplicate compile.
    """
    import fcntl

    removed = 0
    base = Path(root) / LOCKS_DIR
    if not base.is_dir() or base.is_symlink():
        return 0
    for shard in base.iterdir():
        if shard.is_symlink() or not shard.is_dir():
            continue
        for path in shard.glob("*.lock"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    log.debug("cannot test %s: %s", path, exc)
                continue
            try:
                if os.path.samestat(os.lstat(path), os.fstat(fd)):
                    os.unlink(path)
                    removed += 1
            except OSError:
                pass
            finally:
                os.close(fd)  # closing drops the flock
    return removed
