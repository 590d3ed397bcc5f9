"""Trust: the cache holds native code that gets loaded into the serving process.

Three defences, each a refusal that costs a compile, never a request:

* **Who can write the root, and every level below it.** A root (or its ``v1/``) that another
  user owns, or that group or others may write, lets them plant an object we would load:
  refused unless the operator says every such writer is trusted
  (``CUTE_DISKCACHE_TRUST_SHARED=1``). A sticky bit does not help: it stops others deleting our
  files, not adding their own. The same holds one level down, so a lookup checks owner and mode
  of every directory from the root to the entry and of every file it reads
  (:func:`first_untrusted`, :func:`file_refusal`), and every level we create gets an explicit
  mode whatever the umask (:func:`make_dirs`).
* **No links out of the root.** A symbolic link anywhere between the root and a payload could
  point at bytes nobody checked in: directories are checked with ``lstat`` and files are opened
  with ``O_NOFOLLOW`` (:mod:`.entry`), so a link is an :class:`~.entry.EntryError` ("link").
* **Signatures.** With ``CUTE_DISKCACHE_HMAC_KEY`` set, every manifest we write carries an
  HMAC-SHA256 over its sealed body's sha256 (the body lists every payload's sha256, so the
  signature covers all the bytes of the entry); an unsigned or badly signed entry is a miss.

Stdlib only: :mod:`.entry` imports this on the hit path.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat
from pathlib import Path

#: Domain separation: a signature of ours is never a valid MAC of anything else under the key.
_SIGNING_CONTEXT = b"cute-diskcache manifest v1\n"


def sign(key: bytes, body_sha256: str) -> str:
    """The ``hmac`` field of a sealed manifest whose body hashes to ``body_sha256`` (hex)."""
    return hmac.new(key, _SIGNING_CONTEXT + body_sha256.encode("ascii"), hashlib.sha256).hexdigest()


def signature_ok(key: bytes, body_sha256: str, signature: object) -> bool:
    """Constant-time check of a manifest's ``hmac`` field; any other value is simply "no".

    Compared as bytes: ``compare_digest`` raises ``TypeError`` for a ``str`` holding non-ASCII
    characters, and a hostile manifest must be a miss, never an exception.
    """
    if not isinstance(signature, str):
        return False
    given = signature.encode("utf-8", "surrogatepass")
    return hmac.compare_digest(sign(key, body_sha256).encode("ascii"), given)


def _describe_mode(mode: int) -> str:
    who = [name for bit, name in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if mode & bit]
    return f"writable by {' and '.join(who)} (mode {stat.S_IMODE(mode):04o})"


def _untrusted(path: Path, st: os.stat_result, euid: int) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return None  # not a directory: the write side's problem (one "cannot write" warning)
    if st.st_uid != euid:
        return f"{path} is owned by uid {st.st_uid}, not by this process's uid {euid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is {_describe_mode(st.st_mode)}"
    return None


def root_refusal(root: Path, *, subdirs: tuple[str, ...] = ("v1",)) -> str | None:
    """Why ``root`` must not be used, or None when only this user can write it.

    The root itself may be reached through a link (that is the operator's own setting); the
    directories under it may not. A root that does not exist yet is fine: we create it.
    """
    euid = os.geteuid()
    try:
        st = os.stat(root)
    except OSError:
        return None
    why = _untrusted(root, st, euid)
    if why is not None:
        return why
    for name in subdirs:
        path = root / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        why = _untrusted(path, st, euid)
        if why is not None:
            return why
    return None


def first_link(root: Path, path: Path) -> Path | None:
    """The first component of ``path`` below ``root`` that is a symbolic link, else None.

    Stops at the first component that does not exist (nothing below it can be a link).
    """
    found = first_untrusted(root, path, owner=None)
    return found[0] if found is not None else None


def first_untrusted(root: Path, path: Path, *, owner: int | None) -> tuple[Path, str] | None:
    """The first directory between ``root`` and ``path`` (both included) we must not read through.

    Returns ``(component, why)`` or None. A component below the root that is a symbolic link is
    always refused. With ``owner`` (an euid: the root is private, ``TRUST_SHARED`` is off) every
    level must also be owned by ``owner`` and not writable by group or others: one level that
    someone else can write lets them swap in the levels below it, so the check the first use made
    of the root is not enough for the namespace, shard and entry directories under it. The root
    itself is ``stat``-ed (the operator may point at it through a link) and checked every time,
    so a root deleted and recreated by someone else under a running engine is refused too.
    Stops at the first component that does not exist (nothing below it can be read).
    """
    try:
        st = os.stat(root)
    except OSError:
        return None
    if owner is not None:
        why = _untrusted(root, st, owner)
        if why is not None:
            return root, why
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        try:
            st = os.lstat(current)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return current, f"{current} is a symbolic link"
        if owner is not None:
            why = _untrusted(current, st, owner)
            if why is not None:
                return current, why
    return None


def file_refusal(path: Path, st: os.stat_result, owner: int | None) -> str | None:
    """Why a payload or manifest file (already opened, ``fstat``-ed) must not be trusted, or None.

    Directory checks stop at the entry; a file inside it that another user owns, or that group
    or others may write, could have been changed after the directory's owner wrote it.
    """
    if owner is None:
        return None
    if st.st_uid != owner:
        return f"{path.name} is owned by uid {st.st_uid}, not by this process's uid {owner}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path.name} is {_describe_mode(st.st_mode)}"
    return None


def private_dir_mode(trust_shared: bool) -> int:
    """Mode for the directories the trust check looks at, when we create them.

    Without ``TRUST_SHARED`` never group/other-writable, whatever the umask (a umask of 002
    would otherwise make the next process refuse the root we just made); with it, the umask
    decides, so a fleet sharing one volume through a group can write it.
    """
    return 0o777 if trust_shared else 0o755


def make_dirs(root: Path, path: Path, *, shared: bool) -> None:
    """Create ``root`` and every level down to ``path`` with an explicit mode (see :func:`private_dir_mode`).

    ``mkdir(parents=True)`` gives intermediate levels the umask's mode (0775 under a umask of
    002), which :func:`first_untrusted` then refuses, or worse, which lets a group member replace
    an entry. Levels that already exist are checked: a link or another user's directory raises
    ``OSError``; a directory of ours that group or others can write (made by an older version
    under a loose umask) is tightened, since anything another user planted in it is owned by
    them and refused file by file. With ``shared`` the umask decides and nothing is tightened.
    """
    mode = private_dir_mode(shared)
    root.mkdir(mode=mode, parents=True, exist_ok=True)  # levels above the root are the operator's
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        try:
            os.mkdir(current, mode)
            continue
        except FileExistsError:
            pass
        st = os.lstat(current)
        if stat.S_ISLNK(st.st_mode):
            raise OSError(errno.ELOOP, "a symbolic link inside the cache root is never followed", str(current))
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(current))
        if shared:
            continue
        if st.st_uid != os.geteuid():
            raise PermissionError(errno.EPERM, f"owned by uid {st.st_uid}, not by this process", str(current))
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.chmod(current, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
