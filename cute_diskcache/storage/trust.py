"""Trust: the cache holds native code that gets loaded into the serving process.

Three defences, each a refusal that costs a compile, never a request:

* **Who can write the root, and every level below it.** The rule is OpenSSH's StrictModes: a
  level owned by this euid *or by root*, and writable by nobody else, is trusted. Root can
  replace anything anyway, so a tree only root can write (an image baked by ``docker build``) is
  as safe to load from as our own; a non-root process serves it read-only. A root (or its
  ``v1/``) that another user owns, or that group or others may write, lets them plant an object
  we would load: refused unless the operator names who else is trusted. Two ways, narrowest
  first: ``CUTE_DISKCACHE_TRUST_GROUP=<gid or name>`` trusts the members of one group (a
  Kubernetes ``fsGroup`` volume: group-owned, setgid, mode 2775), so a level that group may
  write, or that a member owns and gave that group, is trusted, while a level others may write,
  or another group, is still refused; ``CUTE_DISKCACHE_TRUST_SHARED=1`` trusts everyone who can
  write the root. A sticky bit does not help: it stops others deleting our files, not adding
  their own. The same holds one level down, so a lookup checks owner and mode of every
  directory from the root to the entry and of every file it reads (:func:`first_untrusted`,
  :func:`file_refusal`), and every level we create gets an explicit mode whatever the umask
  (:func:`make_dirs`).

  A POSIX ACL changes what the mode says: with named entries (``setfacl -m u:3000:rwx``) the
  group bits show the ACL's *mask*, the most any named user or group may do, not the owning
  group's rights. So where the mode lets the group write, the ACL is read too
  (:func:`acl_writers`), and a level an ACL lets someone write who is not this euid, root or the
  trusted group is refused like a level others may write. A non-member owner is never trusted
  either: we cannot list another uid's groups (a pod's uid is in no ``/etc/passwd``), so a level
  owned by another uid is accepted only through its group, which stands for membership because
  the kernel lets only members (and root) give something that group: ``chgrp`` needs membership,
  and a setgid directory hands its group to whoever can write it. Every level below the root is
  checked for exactly that (no write for others, none through an ACL); above a root owned by
  another uid, every directory up to the first one owned by root or this euid is checked the
  same way (:func:`foreign_root_refusal`), since whoever can write them could have put that
  root there.
* **No links out of the root.** A symbolic link anywhere between the root and a payload could
  point at bytes nobody checked in: directories are checked with ``lstat`` and files are opened
  with ``O_NOFOLLOW`` (:mod:`.entry`), so a link is an :class:`~.entry.EntryError` ("link").
* **Signatures.** With ``CUTE_DISKCACHE_HMAC_KEY`` set, every manifest we write carries an
  HMAC-SHA256 over its sealed body's sha256 (the body lists every payload's sha256, so the
  signature covers all the bytes of the entry); an unsigned or badly signed entry is a miss.
  A second-stage record (a pointer from a traced IR to an entry, :mod:`.reuse`) is signed the
  same way over what it names and the key it was written for (:func:`sign_record`): a member
  of a trusted group without the key can no more point a kernel at another entry than write one.

Stdlib only: :mod:`.entry` imports this on the hit path.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat
import struct
from pathlib import Path
from typing import Union

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


#: Domain separation of a second-stage record's signature (the remote tier's records have always
#: been signed this way: the same bytes, so records a fleet already holds keep verifying).
_RECORD_CONTEXT = b"cute-diskcache second-stage record\0"


def sign_record(key: bytes, k2: str, record: bytes) -> str:
    """The signature of a second-stage record (:mod:`.reuse`) bound to the second-stage key
    ``k2`` it was written for: a record copied under another key, or edited, no longer verifies."""
    return hmac.new(key, _RECORD_CONTEXT + k2.encode() + b"\0" + record, hashlib.sha256).hexdigest()


def record_signature_ok(key: bytes, k2: str, record: bytes, signature: object) -> bool:
    """Constant-time check of a record's signature, as :func:`signature_ok` checks a manifest's."""
    if not isinstance(signature, str):
        return False
    return hmac.compare_digest(sign_record(key, k2, record).encode("ascii"), signature.encode("utf-8", "surrogatepass"))


#: Where a level's ACL is read from: its path, or the descriptor it was opened as.
AclSource = Union[str, "os.PathLike[str]", int]

#: The kernel's POSIX access ACL (``acl(5)``): a version word, then 8-byte entries (tag, perm, id).
_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_ACL_ENTRY = struct.Struct("<HHI")
_ACL_USER, _ACL_GROUP, _ACL_MASK = 0x02, 0x08, 0x10
_ACL_WRITE = 0x02
#: "No ACL here": none set, or a filesystem without ACLs or extended attributes.
_NO_ACL = frozenset({errno.ENODATA, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.ENOSYS})


def acl_writers(where: AclSource) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(uids, gids)`` that named entries of ``where``'s POSIX access ACL let write, after the mask.

    ``((), ())`` without an ACL. Raises ``OSError`` when the ACL cannot be read or parsed: the
    caller refuses the level (a right it cannot read is a right it cannot rule out).
    """
    try:
        raw = os.getxattr(where, _ACL_XATTR)
    except OSError as exc:
        if exc.errno in _NO_ACL:
            return (), ()
        raise
    if len(raw) < 4 or (len(raw) - 4) % _ACL_ENTRY.size or struct.unpack_from("<I", raw)[0] != _ACL_VERSION:
        raise OSError(errno.EINVAL, "unreadable POSIX ACL")
    entries = [_ACL_ENTRY.unpack_from(raw, at) for at in range(4, len(raw), _ACL_ENTRY.size)]
    mask = next((perm for tag, perm, _id in entries if tag == _ACL_MASK), 0o7)
    users = tuple(i for tag, perm, i in entries if tag == _ACL_USER and perm & mask & _ACL_WRITE)
    groups = tuple(i for tag, perm, i in entries if tag == _ACL_GROUP and perm & mask & _ACL_WRITE)
    return users, groups


def _acl_refusal(name: object, where: AclSource | None, owner: int) -> str | None:
    """Why ``where``'s ACL lets someone write it that ``owner`` does not trust, or None.

    Only asked when the mode's group bits allow writing: they are the ACL's mask when one is
    set, and no named entry can do more than the mask, so a level without group write needs no
    extended-attribute read (a private root's hit path reads none).
    """
    if where is None:
        return None
    group = getattr(owner, "group", None)
    try:
        users, groups = acl_writers(where)
    except OSError as exc:
        return f"{name} has a POSIX ACL that cannot be read ({exc.strerror or exc}): who may write it is unknown"
    users = tuple(u for u in users if u not in (int(owner), 0))
    groups = tuple(g for g in groups if g != group)
    if not users and not groups:
        return None
    who = ", ".join([f"uid {u}" for u in users] + [f"group {g}" for g in groups])
    return f"{name} is writable through a POSIX ACL entry for {who} (the mode's group bits show the ACL mask)"


def _describe_mode(mode: int) -> str:
    who = [name for bit, name in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if mode & bit]
    return f"writable by {' and '.join(who)} (mode {stat.S_IMODE(mode):04o})"


class Owner(int):
    """Whose levels a lookup accepts: this euid (the int's value), root, and with ``group`` the
    members of that one group (``CUTE_DISKCACHE_TRUST_GROUP``).

    An ``int`` so that every ``owner=`` parameter down the read path (:mod:`.entry`) takes it
    unchanged; :func:`level_refusal` reads the group from it.
    """

    group: int | None

    def __new__(cls, euid: int, group: int | None = None) -> Owner:
        obj = super().__new__(cls, euid)
        obj.group = group
        return obj


def level_refusal(name: object, st: os.stat_result, owner: int, *, acl: AclSource | None = None) -> str | None:
    """Why one level (directory or file) must not be trusted by ``owner``, or None.

    Who can write a level: its owner (who may ``chmod`` it), root, its group when the group
    write bit is set, everyone when the others bit is, and anyone a POSIX ACL entry names.
    All of them must be trusted:

    * the owner is this euid or root (OpenSSH's StrictModes), or, with a trusted group, any uid
      when the level's group is that group: the kernel lets only root and the group's members
      give a file that group (``chgrp``), or a setgid directory of that group whose writers a
      lookup has already checked; we cannot list a group's members (a pod's uid is in no
      ``/etc/passwd``), so the level's group stands for its owner's membership;
    * never writable by others;
    * writable by its group only when that group is the trusted one, and then by nobody else
      through an ACL (``acl``: the level's path or descriptor, read only when the mode's group
      bits, the ACL's mask, allow writing; see :func:`acl_writers`).
    """
    group = getattr(owner, "group", None)
    mode = st.st_mode
    if st.st_uid not in (int(owner), 0) and not (group is not None and st.st_gid == group):
        also = "" if int(owner) == 0 else " or root"
        return f"{name} is owned by uid {st.st_uid}, not by this process's uid {int(owner)}{also}"
    if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and (group is None or st.st_gid != group)):
        return f"{name} is {_describe_mode(mode)}"
    if mode & stat.S_IWGRP:
        return _acl_refusal(name, acl, owner)
    return None


def foreign_root_refusal(root: Path, st: os.stat_result, owner: int) -> str | None:
    """Why a root that another uid owns (accepted through the trusted group) must not be used, or None.

    Its group stands for its owner's membership (:func:`level_refusal`) only if nobody outside
    the trusted writers could have put it there: whoever can write the directory it sits in can
    move in a directory of their own, and a setgid directory of the group (anywhere on that
    filesystem) that an outsider can write gives their directories the group. Below the root
    every level is checked for exactly that; above it, each directory up to and including the
    first one owned by root or this euid is held to the same rule (owner trusted or of the group,
    no write for others, sticky or not, group write for the trusted group only, nobody else
    through an ACL). A root owned by this euid or root needs none of this: the walk is taken only
    for a foreign owner, a few ``stat`` calls.
    """
    if getattr(owner, "group", None) is None or st.st_uid in (int(owner), 0):
        return None
    current, level = os.path.realpath(root), st
    while level.st_uid not in (int(owner), 0):
        parent = os.path.dirname(current)
        if parent == current:
            return None
        try:
            pst = os.stat(parent)
        except OSError as exc:
            return f"{root} is owned by uid {st.st_uid} and {parent} above it cannot be checked ({exc.strerror or exc})"
        why = level_refusal(parent, pst, owner, acl=parent)
        if why is not None:
            return f"{root} is owned by uid {st.st_uid}, so the directories above it must be trusted too, and {why}"
        current, level = parent, pst
    return None


def remedy(path: Path, group: int | None = None) -> str:
    """The way out a refusal names: the narrowest setting that would trust ``path``'s writers.

    A level only its group can write (besides owner and root) is what a Kubernetes ``fsGroup``
    volume looks like: ``CUTE_DISKCACHE_TRUST_GROUP`` names that group; anything else only
    ``CUTE_DISKCACHE_TRUST_SHARED`` can accept.
    """
    shared = "CUTE_DISKCACHE_TRUST_SHARED=1 if everyone who can write it is trusted"
    try:
        st = os.lstat(path)
    except OSError:
        return f"set {shared}"
    if stat.S_ISLNK(st.st_mode) or st.st_mode & stat.S_IWOTH:
        return f"set {shared}"
    if st.st_gid == group:
        if st.st_mode & stat.S_IWGRP and _acl_refusal(path, path, Owner(os.geteuid(), group)) is not None:
            return (f"remove the POSIX ACL entries that let users outside group {group} write it (setfacl -x u:<uid> {path}; "
                    f"an entry without w, such as u:<uid>:r-x, is fine), or set {shared}")
        return f"set {shared}"
    if group is not None and (st.st_mode & stat.S_IWGRP or st.st_uid not in (os.geteuid(), 0)):
        return (f"give it group {group} (chgrp {group} {path}): CUTE_DISKCACHE_TRUST_GROUP={group} trusts that group, "
                f"not {_group_name(st.st_gid)}; or set {shared}")
    if st.st_mode & stat.S_IWGRP or st.st_uid not in (os.geteuid(), 0):
        return f"set CUTE_DISKCACHE_TRUST_GROUP={st.st_gid} if every member of group {_group_name(st.st_gid)} is trusted, or {shared}"
    return f"set {shared}"


def _group_name(gid: int) -> str:
    try:
        import grp

        return f"{grp.getgrgid(gid).gr_name} ({gid})"
    except (KeyError, ImportError):
        return str(gid)


def _untrusted(path: Path, st: os.stat_result, owner: int, *, is_root: bool = False) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return None  # not a directory: the write side's problem (one "cannot write" warning)
    why = level_refusal(path, st, owner, acl=path)
    if why is None and is_root:
        why = foreign_root_refusal(path, st, owner)
    return why


def root_refusal(root: Path, *, subdirs: tuple[str, ...] = ("v1",), group: int | None = None) -> str | None:
    """Why ``root`` must not be used, or None when only this user, root (and ``group``) can write it."""
    found = refused_level(root, subdirs=subdirs, group=group)
    return found[1] if found is not None else None


def refused_level(root: Path, *, subdirs: tuple[str, ...] = ("v1",), group: int | None = None) -> tuple[Path, str] | None:
    """``(level, why)`` for the first of ``root`` and its ``subdirs`` that must not be used, or None.

    The root itself may be reached through a link (that is the operator's own setting); the
    directories under it may not. A root that does not exist yet is fine: we create it.
    """
    owner = Owner(os.geteuid(), group)
    try:
        st = os.stat(root)
    except OSError:
        return None
    why = _untrusted(root, st, owner, is_root=True)
    if why is not None:
        return root, why
    for name in subdirs:
        path = root / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        why = _untrusted(path, st, owner)
        if why is not None:
            return path, why
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
        why = _untrusted(root, st, owner, is_root=True)
        if why is not None:
            return root, why
    # Walked as text (every hit walks four levels; pathlib's joins cost more than the lstat calls).
    current = os.fspath(root)
    for part in path.relative_to(root).parts:
        current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return Path(current), f"{current} is a symbolic link"
        if owner is not None and stat.S_ISDIR(st.st_mode):
            why = level_refusal(current, st, owner, acl=current)
            if why is not None:
                return Path(current), why
    return None


def file_refusal(path: Path, st: os.stat_result, owner: int | None, fd: int | None = None) -> str | None:
    """Why a payload or manifest file (already opened as ``fd``, ``fstat``-ed) must not be trusted, or None.

    Directory checks stop at the entry; a file inside it that another user owns, or that group
    or others may write, could have been changed after the directory's owner wrote it. The rule
    is the directories' (:func:`level_refusal`): this euid, root, or the trusted group, and no
    one else through an ACL (read from the open descriptor: the file checked is the file read).
    """
    if owner is None:
        return None
    return level_refusal(path.name, st, owner, acl=fd if fd is not None else path)


def private_dir_mode(trust_shared: bool) -> int:
    """Mode for the directories the trust check looks at, when we create them.

    Without ``TRUST_SHARED`` never group/other-writable, whatever the umask (a umask of 002
    would otherwise make the next process refuse the root we just made); with it, the umask
    decides, so a fleet sharing one volume through a group can write it. With a trusted group
    see :func:`make_dirs`.
    """
    return 0o777 if trust_shared else 0o755


#: Directories we create under a trusted group: its members write them (setgid: what they
#: create inherits the group), others never.
GROUP_DIR_MODE = 0o2775


def make_dirs(root: Path, path: Path, *, shared: bool, group: int | None = None) -> None:
    """Create ``root`` and every level down to ``path`` with an explicit mode (see :func:`private_dir_mode`).

    ``mkdir(parents=True)`` gives intermediate levels the umask's mode (0775 under a umask of
    002), which :func:`first_untrusted` then refuses, or worse, which lets a group member replace
    an entry. Levels that already exist are checked: a link, or a directory a lookup would
    refuse (another user's; root's and this user's are fine), raises ``OSError``; a directory of
    ours that others can write, or a group other than the trusted one (made by an older version
    under a loose umask) is tightened, since anything another user planted in it is owned by
    them and refused file by file. With ``shared`` the umask decides and nothing is tightened.

    ``group`` (``CUTE_DISKCACHE_TRUST_GROUP``): what we create gets that group and mode
    :data:`GROUP_DIR_MODE` whatever the umask, so the other members' processes (other pods'
    uids on one ``fsGroup`` volume) can add entries; where we cannot give it that group (we are
    not a member) it stays private.
    """
    mode = private_dir_mode(shared)
    if not shared and group is not None and not root.exists():
        root.mkdir(mode=mode, parents=True, exist_ok=True)
        _share_with(root, group)
    root.mkdir(mode=mode, parents=True, exist_ok=True)  # levels above the root are the operator's
    owner = Owner(os.geteuid(), group)
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        try:
            os.mkdir(current, mode)
            if not shared and group is not None:
                _share_with(current, group)
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
            why = level_refusal(current, st, owner, acl=current)
            if why is not None:
                raise PermissionError(errno.EPERM, why, str(current))
            continue  # root's (or a trusted member's): trusted; whether we can write it is the write's business
        loose = stat.S_IWOTH | (0 if group is not None and st.st_gid == group else stat.S_IWGRP)
        if st.st_mode & loose:
            os.chmod(current, stat.S_IMODE(st.st_mode) & ~loose)
        elif st.st_mode & stat.S_IWGRP:  # ours and the group's: an ACL may still let someone else in
            why = _acl_refusal(current, current, owner)
            if why is not None:
                raise PermissionError(errno.EPERM, why, str(current))


def _share_with(path: Path, group: int) -> None:
    """Give a directory we just made the trusted group and :data:`GROUP_DIR_MODE`; private if we cannot."""
    try:
        if os.lstat(path).st_gid != group:
            os.chown(path, -1, group)  # allowed when we are a member (or root)
        os.chmod(path, GROUP_DIR_MODE)
    except OSError:
        os.chmod(path, 0o755)
