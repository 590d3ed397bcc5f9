"""Single-flight: when N processes miss the same key, one compiles and the others load its entry.

One lock file per key, ``<root>/locks/<digest[:2]>/<digest>.lock``, outside ``v1/`` so a
read-only cache never needs them (a store that cannot write takes no lock at all). The lock
is ``flock(2)``, taken here directly rather than through ``filelock`` (issue 21): filelock 3.x
opens the file with ``O_TRUNC`` following links (a symlink planted in a shared root truncated
and ``fchmod``-ed its target) and reads every ``flock`` error but ``ENOSYS`` as contention;
no release up to 4.3.2 gives up a lock that a forked child inherited. So:

* **The file is opened with** ``O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK``,
  never truncated, never ``chmod``-ed, and refused unless it is a regular file: a link or a
  FIFO planted at the path is never followed, written or waited on. Mode 0600 in a private
  root (nobody else can open it to block us), 0664 in a ``TRUST_SHARED`` one.
* **A holder that dies releases its lock.** The kernel drops an ``flock`` when the last
  descriptor of its open file closes, SIGKILL included, so the next waiter gets it at once.
  A child ``fork``-ed while we hold a lock would keep that file open (and the lock held after
  we die): an at-fork handler closes the child's copies (never ``LOCK_UN``, which would
  release the parent's lock too), and ``O_CLOEXEC`` covers ``exec``.
* **Network filesystems.** On Linux NFS (v3 through lockd, v4 natively) ``flock`` is emulated
  with byte-range locks the server arbitrates across clients; a client that dies loses its
  locks when its lease expires (NFSv4: about 90 s). A mount with ``nolock``/``local_lock=flock``
  makes locks per client: single-flight then holds per host only (harmless duplicate compiles).
* **No locks at all** (``ENOLCK``: NFSv3 without a running lockd/statd; ``EOPNOTSUPP``/``ENOSYS``:
  FUSE volumes that do not implement ``flock``, some object-store mounts; ``EBADF``: an NFS
  lock on a descriptor not open for writing) is not contention: no wait. The root is marked
  "without locks" for the rest of the process and :func:`without_locks` reports one warning
  naming everything that degrades (single-flight off, the size cap kept by a walk instead of
  the counter of :mod:`.eviction`, housekeeping run without its lock). Nothing waits on a lock
  there again.
* **Bounded wait.** ``CUTE_DISKCACHE_LOCK_TIMEOUT`` seconds (its default: :data:`..config.SETTINGS`), then one warning and
  we compile anyway: a hung holder costs a duplicate compile, never a wedged engine.
* **A lock we cannot create** (permissions, full disk, odd filesystem) is no lock: we compile.

Lock files are left in place on release (every waiter must lock the same inode; deleting a
file someone may hold would let a newcomer lock a fresh inode beside them). They are empty;
:func:`prune` removes the ones nobody holds, and ``clear`` removes the whole directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator

from .. import config

log = logging.getLogger("cute_diskcache")

LOCKS_DIR = "locks"
DEFAULT_TIMEOUT_S = float(config.SETTINGS["lock_timeout"][1])  # CUTE_DISKCACHE_LOCK_TIMEOUT's default
_POLL_S = 0.05

#: ``flock`` errors that mean "someone holds it" (some filesystems answer EACCES).
CONTENTION = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES})
#: ``flock`` errors that mean "this filesystem gives no locks", never contention.
NO_LOCKS = frozenset(
    {errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.ENOSYS, errno.EBADF, errno.EINVAL}
)
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


@dataclass(frozen=True)
class Flight:
    """How this process entered the compile of one key.

    ``held``: we hold the key's lock, so whoever held it before us has finished: re-check the
    store before compiling. ``outcome`` is one of ``acquired`` (no wait), ``waited``,
    ``timeout``, ``unavailable`` (no lock could be made, or the root has no working locks),
    ``off`` (not asked for).
    """

    held: bool
    outcome: str
    waited_seconds: float = 0.0


def lock_path(root: Path, digest: str) -> Path:
    return Path(root) / LOCKS_DIR / digest[:2] / f"{digest}.lock"


# --------------------------------------------------------------------------------------------
# Roots whose filesystem gives no locks
# --------------------------------------------------------------------------------------------

_no_locks: dict[str, str] = {}  # root -> errno name, for the process's life
_no_locks_guard = threading.Lock()


def without_locks(root: Path | str) -> bool:
    """Whether ``flock`` has been found not to work under ``root`` in this process."""
    return str(Path(root)) in _no_locks


def no_locks_here(root: Path | str, exc: OSError, what: str) -> bool:
    """``exc`` came from ``flock`` under ``root``: if it means "no locks on this filesystem",
    mark the root (one warning per root and process, naming what degrades) and return True."""
    if exc.errno not in NO_LOCKS:
        return False
    key = str(Path(root))
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    with _no_locks_guard:
        first = key not in _no_locks
        _no_locks.setdefault(key, name)
    if first:
        log.warning(
            "cute-diskcache: file locks do not work under %s (flock on %s failed with %s: %s), as on NFSv3 without "
            "lockd or a FUSE volume without flock; degraded for this process: single-flight is off (processes that "
            "miss the same kernel each compile it), the size cap is kept by walking the cache instead of its "
            "counter, and housekeeping runs without its lock",
            key,
            what,
            name,
            exc.strerror or exc,
        )
    return True


# --------------------------------------------------------------------------------------------
# Descriptors we hold locks through, and fork
# --------------------------------------------------------------------------------------------

_held: dict[int, object] = {}  # fd -> token of the acquisition that owns it


def _close_inherited_locks() -> None:
    """At-fork handler (child): close our copies of the parent's locked descriptors.

    Only ``close``: ``flock(LOCK_UN)`` acts on the open file both processes share and would
    release the parent's lock. No Python lock is taken here (one may be held by a thread that
    did not follow us into the child).
    """
    fds = list(_held)
    _held.clear()
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


def hold(fd: int) -> object:
    """Register ``fd`` as one we lock through: a child forked from now on closes its copy.
    Returns the token :func:`release` needs."""
    token = object()
    _held[fd] = token
    return token


def release(fd: int, token: object) -> None:
    """Close ``fd`` if this acquisition still owns it (a forked child's copy was closed at fork)."""
    if _held.get(fd) is token:
        del _held[fd]
        os.close(fd)  # drops the flock


def open_lock_file(path: Path, mode: int) -> int:
    """Open (creating) a lock file without following links or truncating; a regular file only."""
    fd = os.open(path, _OPEN_FLAGS, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_flock(fd: int) -> bool:
    """One non-blocking ``LOCK_EX``: True when taken, False on contention; other errors raise."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno in CONTENTION:
                return False
            raise


def _make_dirs(root: Path, shard: Path, shared: bool, group: int | None) -> None:
    """``locks/`` and its shard. Under a trusted group with :func:`.trust.make_dirs`: that group
    and mode 2775 (setgid), as every level the trust check reads must be; made with the umask's
    mode and this process's own group, ``locks/`` read "writable by group" to the next process,
    which then refused the whole root (issue 29). Otherwise private, or the umask's under
    ``TRUST_SHARED``."""
    if group is not None:
        from . import trust

        trust.make_dirs(root, shard, shared=False, group=group)
        return
    dir_mode = 0o777 if shared else 0o755
    root.mkdir(mode=dir_mode, parents=True, exist_ok=True)
    for d in (root / LOCKS_DIR, shard):
        try:
            d.mkdir(mode=dir_mode)
        except FileExistsError:
            pass


def _acquire(root: Path, digest: str, timeout: float, label: str, shared: bool,
             group: int | None = None) -> tuple[tuple[int, object] | None, Flight]:
    if without_locks(root):
        return None, Flight(False, "unavailable")
    path = lock_path(root, digest)
    try:
        _make_dirs(Path(root), path.parent, shared, group)
        fd = open_lock_file(path, 0o664 if shared else 0o600)
    except Exception as exc:  # noqa: BLE001 - OSError (EACCES, ENOSPC, EROFS, a link at the path...)
        log.debug("no single-flight lock for %s (%s: %s); compiling without it", label, type(exc).__name__, exc)
        return None, Flight(False, "unavailable")
    token = hold(fd)
    t0 = time.monotonic()
    waiting = False
    try:
        while True:
            if try_flock(fd):
                return (fd, token), Flight(True, "waited" if waiting else "acquired", time.monotonic() - t0 if waiting else 0.0)
            waited = time.monotonic() - t0
            if waited >= timeout:
                break
            if not waiting:
                waiting = True
                log.info("another process is compiling %s; waiting for it (up to %.0f s)", label, timeout)
            time.sleep(min(_POLL_S, max(0.0, timeout - waited)))
    except OSError as exc:
        release(fd, token)
        if not no_locks_here(root, exc, str(path)):
            log.debug("no single-flight lock for %s (%s); compiling without it", label, exc)
        return None, Flight(False, "unavailable")
    except BaseException:
        release(fd, token)
        raise
    release(fd, token)
    log.warning(
        "cute-diskcache waited %.0f s for another process compiling %s (lock %s); compiling it here too "
        "(CUTE_DISKCACHE_LOCK_TIMEOUT=%g)",
        waited,
        label,
        path,
        timeout,
    )
    return None, Flight(False, "timeout", waited)


@contextlib.contextmanager
def single_flight(root: Path, digest: str, *, timeout: float = DEFAULT_TIMEOUT_S, label: str = "", shared: bool = False,
                  group: int | None = None) -> Iterator[Flight]:
    """Hold ``digest``'s lock for the body (compile + commit), or yield a lock-less :class:`Flight`.

    ``shared`` (``CUTE_DISKCACHE_TRUST_SHARED``, or a trusted group): lock files follow the umask
    and are group-writable, so a fleet of users sharing the volume can all lock; the directories
    follow the umask too, or with ``group`` (``CUTE_DISKCACHE_TRUST_GROUP``) get that group and
    mode 2775. Never raises on account of the lock: every failure degrades to compiling without it.
    """
    held, flight = _acquire(Path(root), digest, max(0.0, timeout), label or digest[:12], shared, group)
    try:
        yield flight
    finally:
        if held is not None:
            try:
                release(*held)
            except OSError as exc:  # the kernel drops the lock with the descriptor anyway
                log.debug("releasing %s failed: %s", lock_path(root, digest), exc)


def open_to_lock(path: Path | str) -> int:
    """Open an existing file to take an exclusive ``flock`` on it: for writing where we may,
    since NFS emulates ``flock`` with POSIX locks that refuse (EBADF) a read-only descriptor;
    read-only where we may not write it (a local filesystem locks that too)."""
    flags = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        return os.open(path, os.O_RDWR | flags)
    except PermissionError:
        return os.open(path, os.O_RDONLY | flags)


def prune(root: Path) -> int:
    """Delete lock files nobody holds now; returns how many. Safe beside running processes.

    A file is removed only while we hold its ``flock`` ourselves and only if the name still
    points at the inode we locked. A process that opened it just before can then lock an
    unlinked inode beside a newcomer's fresh one: both compile, the commits are atomic, and the
    loser's entry is identical. Never a wrong kernel, at worst one duplicate compile.

    Where the filesystem gives no locks at all, nobody can hold one: every lock file goes.
    """
    removed = 0
    base = Path(root) / LOCKS_DIR
    if not base.is_dir() or base.is_symlink():
        return 0
    for shard in base.iterdir():
        if shard.is_symlink() or not shard.is_dir():
            continue
        for path in shard.glob("*.lock"):
            try:
                fd = open_to_lock(path)
            except OSError:
                continue
            try:
                if not try_flock(fd):
                    os.close(fd)
                    continue
            except OSError as exc:
                # EBADF through a read-only descriptor (someone else's file on NFS) says nothing
                # about the filesystem: that file is just not ours to test.
                read_only = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
                if (exc.errno == errno.EBADF and read_only) or not no_locks_here(root, exc, str(path)):
                    log.debug("cannot test %s: %s", path, exc)
                    os.close(fd)
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
