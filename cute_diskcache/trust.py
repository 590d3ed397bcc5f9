"""Trust: the cache holds native code that gets loaded into the serving process.

Three defences, each a refusal that costs a compile, never a request:

* **Who can write the root.** A root (or its ``v1/``) that another user owns, or that group or
  others may write, lets them plant an object we would load: refused unless the operator says
  every such writer is trusted (``CUTE_DISKCACHE_TRUST_SHARED=1``). A sticky bit does not
  help: it stops others deleting our files, not adding their own.
* **No links out of the root.** A symbolic link anywhere between the root and a payload could
  point at bytes nobody checked in: directories are checked with ``lstat`` and files are opened
  with ``O_NOFOLLOW`` (:mod:`.entry`), so a link is an :class:`~.entry.EntryError` ("link").
* **Signatures.** With ``CUTE_DISKCACHE_HMAC_KEY`` set, every manifest we write carries an
  HMAC-SHA256 over its sealed body's sha256 (the body lists every payload's sha256, so the
  signature covers all the bytes of the entry); an unsigned or badly signed entry is a miss.

Stdlib only: :mod:`.entry` imports this on the hit path.
"""

from __future__ import annotations

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
    """Constant-time check of a manifest's ``hmac`` field."""
    return isinstance(signature, str) and hmac.compare_digest(sign(key, body_sha256), signature)


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
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        try:
            st = os.lstat(current)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return current
    return None


def private_dir_mode(trust_shared: bool) -> int:
    """Mode for the directories the trust check looks at, when we create them.

    Without ``TRUST_SHARED`` never group/other-writable, whatever the umask (a umask of 002
    would otherwise make the next process refuse the root we just made); with it, the umask
    decides, so a fleet sharing one volume through a group can write it.
    """
    return 0o777 if trust_shared else 0o755
