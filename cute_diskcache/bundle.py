"""Entries as a set: walking a root, checking each entry on its own, and bundles.

A bundle is one gzip-compressed tar file that carries verified entries from one cache root to
another (baked into an image, copied to a network volume). Its first member is ``bundle.json``
(format, version, when, which namespaces, how many entries); every other member is one file
of one entry, at the path it has under a root: ``v1/<namespace>/<xx>/<digest>/<file>``.

Import treats the file as hostile: members that are links, devices, absolute, hold ``..`` or
fall outside that layout are refused; every entry is re-verified in a staging directory inside
the root (same filesystem) and moved into place with one ``os.rename``, so readers see either
no entry or a whole verified one; a valid entry already present is never replaced.
"""

from __future__ import annotations

import dataclasses
import errno
import gzip
import hashlib
import io
import json
import logging
import os
import re
import shutil
import socket
import tarfile
import time
import zlib
from pathlib import Path
from typing import Any, Sequence

from . import _version, entry, eviction, layout, locking, trust
from .key import FORMAT_VERSION, encode
from .store import LAYOUT, Store

log = logging.getLogger("cute_diskcache")

BUNDLE_FORMAT = "cute-diskcache-bundle"
BUNDLE_VERSION = 1
BUNDLE_MANIFEST = "bundle.json"
TMP_DIR = layout.TMP_DIR
TRASH_DIR = layout.TRASH_DIR

#: No payload we write comes near this (objects are a few MiB); anything bigger is hostile.
MAX_MEMBER_BYTES = 256 << 20
#: An entry has a manifest, one object, a cubin or a few, one MLIR file.
MAX_ENTRY_FILES = 64
MAX_ENTRY_BYTES = 512 << 20
_MAX_BUNDLE_MANIFEST_BYTES = 1 << 20
_MAX_MEMBERS = 1_000_000
#: An entry directory without a manifest younger than this may be a writer at work.
_INCOMPLETE_GRACE_S = 600.0
_CHUNK = 1 << 20

_MEMBER = re.compile(rf"{LAYOUT}/([^/]+)/([^/]+)/([^/]+)/([^/]+)")

# The walk is layout's (one definition of an entry for stats, list, verify, eviction, bundles).
valid_namespace = layout.valid_namespace
namespace_matches = layout.namespace_matches
namespaces = layout.namespaces
entry_dirs = layout.entry_dirs
entry_files = layout.entry_files
entry_bytes = layout.entry_bytes
last_used = layout.last_used
_DIGEST = layout.DIGEST_RE
_FILE = layout.FILE_RE


def max_import_bytes() -> int:
    """What one import may stage in all: the cache's size cap (nothing bigger could stay), 64 GiB without one."""
    from . import config

    cap = config.max_size()
    return cap if cap > 0 else 64 << 30


def check(entry_dir: Path, *, hmac_key: bytes | None = None) -> tuple[dict[str, Any], bytes]:
    """Verify one entry without knowing its key: the checks a key-less reader can make.

    :func:`entry.verify` with no key checks the format, the directory name and every payload
    checksum. On top: the entry sits in the namespace and shard its manifest names, its
    environment record hashes to its ``env_digest``, and its digest is the hash of that
    environment and its key bytes, so an entry copied or renamed to a place it does not belong
    is caught here and not only when a lookup with the real key misses on it. With
    ``hmac_key`` (``CUTE_DISKCACHE_HMAC_KEY``) the entry must also carry our signature.
    Returns ``(manifest, object bytes)``; raises :class:`entry.EntryError`.
    """
    manifest = entry.read_manifest(entry_dir, hmac_key=hmac_key)
    obj = entry.verify(entry_dir, manifest, None)
    digest = manifest["digest"]
    if entry_dir.parent.name != digest[:2] or entry_dir.parent.parent.name != manifest["namespace"]:
        raise entry.EntryError("foreign", f"entry of namespace {manifest['namespace']!r} found at {entry_dir.parent.parent.name}/{entry_dir.parent.name}")
    try:
        env_digest = hashlib.sha256(encode(manifest["env"])).hexdigest()
    except Exception as exc:  # a hostile env record: deep nesting, odd types
        raise entry.EntryError("manifest", f"environment record not encodable: {type(exc).__name__}") from None
    if env_digest != manifest["env_digest"] or not manifest["namespace"].endswith("-" + env_digest[:12]):
        raise entry.EntryError("foreign", "environment record does not match its digest or namespace")
    if hashlib.sha256(bytes.fromhex(env_digest) + manifest["key_bytes"]).hexdigest() != digest:
        raise entry.EntryError("foreign", "digest is not the hash of the entry's environment and key")
    return manifest, obj


def scratch_dir(root: Path, purpose: str, *, shared: bool = False) -> Path:
    """A fresh private directory under ``<root>/tmp``, on the same filesystem as the entries."""
    base = Path(root) / TMP_DIR
    trust.make_dirs(Path(root), base, shared=shared)
    path = base / f"{purpose}-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
    path.mkdir(mode=0o700)
    return path


def remove_tree(root: Path, path: Path) -> None:
    """Remove an entry or namespace so readers see it vanish at once (see :func:`.eviction.discard`)."""
    freed = eviction.discard(root, path)
    if freed:
        eviction.adjust(root, -freed)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ExportReport:
    bundle: str
    entries: int = 0
    bytes: int = 0
    namespaces: dict[str, int] = dataclasses.field(default_factory=dict)
    skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)  # bad entries left out

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _tarinfo(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = size, int(mtime), 0o644, tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _entry_bytes_as_checked(d: Path, manifest: dict[str, Any], hmac_key: bytes | None) -> list[tuple[str, bytes, float]]:
    """The files of a checked entry, read again and held to the checked manifest.

    Bounded reads that never follow a link; a payload or manifest that changed since the
    check (rewritten, evicted) raises :class:`entry.EntryError`, so only checked bytes travel.
    """
    items = {item["file"]: item for records in manifest["payloads"].values() for item in records}
    out = []
    for name, item in items.items():
        data = entry._read_payload(d / name, item["size"])
        if hashlib.sha256(data).hexdigest() != item["sha256"]:
            raise entry.EntryError("checksum", f"{name} changed during export")
        out.append((name, data, (d / name).lstat().st_mtime))
    path = d / entry.MANIFEST
    raw = entry._read_payload(path, path.lstat().st_size)
    if entry.unpack_manifest(raw, hmac_key=hmac_key) != manifest:
        raise entry.EntryError("manifest", "changed during export")
    # First: an importer learns every file's name and size before it stages any byte.
    out.insert(0, (entry.MANIFEST, raw, path.lstat().st_mtime))
    return out


def read_checked(entry_dir: Path, *, hmac_key: bytes | None = None) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """A verified entry's manifest and its files' bytes (manifest first), for sending elsewhere.

    :func:`check`, then every file read again and held to the checked manifest, so only
    checked bytes leave (what :func:`export_bundle` writes; :mod:`.remote` publishes the same).
    Raises :class:`entry.EntryError`.
    """
    manifest, _ = check(entry_dir, hmac_key=hmac_key)
    try:
        files = _entry_bytes_as_checked(entry_dir, manifest, hmac_key)
    except OSError as exc:
        raise entry.EntryError("unreadable", f"{entry_dir.name}: {exc}") from None
    return manifest, [(name, data) for name, data, _mtime in files]


def export_bundle(root: Path, bundle: Path, namespace: Sequence[str] | None = None, *, hmac_key: bytes | None = None) -> ExportReport:
    """Write every verified entry under ``root`` (of the selected namespaces) into ``bundle``.

    Entries that fail :func:`check` are left out and listed in the report. Signatures travel
    inside the manifests: a bundle of signed entries imports as signed entries. Two passes
    (check everything, then stream the checked bytes) keep one entry in memory at a time while
    ``bundle.json`` still comes first. The bundle appears under its name only once complete
    (written beside it, then renamed).
    """
    root, bundle = Path(root), Path(bundle)
    report = ExportReport(str(bundle))
    checked: list[tuple[Path, dict[str, Any]]] = []
    for d in entry_dirs(root, namespace):
        try:
            manifest, _ = check(d, hmac_key=hmac_key)
        except entry.EntryError as exc:
            if exc.reason != "absent":  # a writer at work or a leftover: not an entry yet
                report.skipped.append({"digest": d.name, "namespace": d.parent.parent.name, "reason": str(exc)})
            continue
        checked.append((d, manifest))
    namespaces: dict[str, int] = {}
    for _d, manifest in checked:
        namespaces[manifest["namespace"]] = namespaces.get(manifest["namespace"], 0) + 1
    header = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "entry_format": FORMAT_VERSION,
        "layout": LAYOUT,
        "created": time.time(),
        "writer": f"cute-diskcache {_version.__version__}",
        "host": socket.gethostname(),
        "namespaces": namespaces,
        "entries": len(checked),
        "bytes": sum(item["size"] for _d, m in checked for records in m["payloads"].values() for item in records),
    }
    tmp = bundle.with_name(f".{bundle.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with tarfile.open(tmp, "w:gz", compresslevel=6, format=tarfile.PAX_FORMAT) as tar:
            raw = json.dumps(header, indent=1, sort_keys=True).encode()
            tar.addfile(_tarinfo(BUNDLE_MANIFEST, len(raw), header["created"]), io.BytesIO(raw))
            for d, manifest in checked:
                try:
                    files = _entry_bytes_as_checked(d, manifest, hmac_key)
                except (OSError, entry.EntryError) as exc:
                    report.skipped.append({"digest": d.name, "namespace": d.parent.parent.name, "reason": f"{exc}"})
                    continue
                rel = d.relative_to(root).as_posix()
                for name, data, mtime in files:
                    tar.addfile(_tarinfo(f"{rel}/{name}", len(data), mtime), io.BytesIO(data))
                report.entries += 1
                report.bytes += sum(len(b) for _, b, _ in files)
                report.namespaces[manifest["namespace"]] = report.namespaces.get(manifest["namespace"], 0) + 1
        os.replace(tmp, bundle)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("exported %d entries (%d bytes) to %s", report.entries, report.bytes, bundle)
    return report


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------


class BundleError(Exception):
    """The file is not a bundle we can read at all (nothing was imported)."""


@dataclasses.dataclass
class ImportReport:
    bundle: str
    header: dict[str, Any] = dataclasses.field(default_factory=dict)
    imported: list[str] = dataclasses.field(default_factory=list)  # digests now in place
    kept: list[str] = dataclasses.field(default_factory=list)  # a valid entry was already there
    replaced: list[str] = dataclasses.field(default_factory=list)  # a bad one was there: quarantined
    busy: list[str] = dataclasses.field(default_factory=list)  # a writer is filling that entry now
    bad: list[dict[str, str]] = dataclasses.field(default_factory=list)  # entries that failed the check
    rejected: list[dict[str, str]] = dataclasses.field(default_factory=list)  # members refused unread

    @property
    def ok(self) -> bool:
        return not self.bad and not self.rejected

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        return out


def member_problem(member: tarfile.TarInfo) -> str | None:
    """Why a tar member may not be extracted, or None; the path is parsed by :func:`_member_path`."""
    name = member.name
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return "absolute path"
    if ".." in name.split("/") or "\\" in name or "\0" in name:
        return "'..', backslash or NUL in the path"
    if member.issym():
        return "symbolic link"
    if member.islnk():
        return "hard link"
    if member.ischr() or member.isblk() or member.isfifo():
        return "device or fifo"
    if not member.isreg():
        return "not a regular file"
    if member.size > MAX_MEMBER_BYTES:
        return f"larger than {MAX_MEMBER_BYTES} bytes"
    if name == BUNDLE_MANIFEST:
        return None
    if _member_path(name) is None:
        return f"outside {LAYOUT}/<namespace>/<xx>/<digest>/<file>"
    return None


def _member_path(name: str) -> tuple[str, str, str] | None:
    """``(namespace, digest, file)`` of a member that fits the layout exactly, else None."""
    m = _MEMBER.fullmatch(name)
    if not m:
        return None
    ns, shard, digest, file = m.groups()
    if not (valid_namespace(ns) and _DIGEST.fullmatch(digest) and shard == digest[:2] and _FILE.fullmatch(file)):
        return None
    return ns, digest, file


def _read_header(tar: tarfile.TarFile, member: tarfile.TarInfo | None) -> dict[str, Any]:
    if member is None or member.name != BUNDLE_MANIFEST or not member.isreg():
        raise BundleError(f"not a cute-diskcache bundle (first member is not {BUNDLE_MANIFEST})")
    if member.size > _MAX_BUNDLE_MANIFEST_BYTES:
        raise BundleError(f"{BUNDLE_MANIFEST} larger than 1 MiB")
    fh = tar.extractfile(member)
    assert fh is not None
    try:
        header = json.loads(fh.read(_MAX_BUNDLE_MANIFEST_BYTES + 1))
    except ValueError as exc:
        raise BundleError(f"{BUNDLE_MANIFEST} is not JSON: {exc}") from None
    except RecursionError:
        raise BundleError(f"{BUNDLE_MANIFEST} is nested too deeply to be a bundle header") from None
    if not isinstance(header, dict) or header.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{BUNDLE_MANIFEST} does not name format {BUNDLE_FORMAT!r}")
    if header.get("version") != BUNDLE_VERSION:
        raise BundleError(f"bundle version {header.get('version')!r} is not {BUNDLE_VERSION}")
    if header.get("layout", LAYOUT) != LAYOUT:
        raise BundleError(f"bundle layout {header.get('layout')!r} is not {LAYOUT}")
    return header


def _stage_member(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, staging: Path, shared: bool) -> None:
    """Copy one member's bytes to a new file (never an existing one, never through a link)."""
    src = tar.extractfile(member)
    assert src is not None
    trust.make_dirs(staging, dest.parent, shared=shared)  # the entry directory moves into v1/ as made here
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        left = member.size
        while left > 0:
            chunk = src.read(min(_CHUNK, left))
            if not chunk:
                raise entry.EntryError("truncated", f"member {member.name} ends early")
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
            left -= len(chunk)
        os.fsync(fd)
    finally:
        os.close(fd)


class _Staged:
    """One entry of a bundle being staged, and what its manifest (when it came first) allows.

    Bundles written by this version carry each entry's manifest before its payloads, so every
    payload member is held to the name and size the manifest gives before a byte is staged:
    a member no manifest names, or of another size, refuses the entry unread. Older bundles
    (manifest last) are held to :data:`MAX_ENTRY_FILES` and :data:`MAX_ENTRY_BYTES`, then checked
    as a whole. Either way the import as a whole stops at :func:`max_import_bytes`.
    """

    def __init__(self, path: Path) -> None:
        self.dir = path
        self.files = 0
        self.bytes = 0
        self.expected: dict[str, int] | None = None
        self.seen: dict[str, int] = {}

    def admit(self, name: str, size: int) -> str | None:
        """Why the member ``name`` of ``size`` bytes must not be staged, or None."""
        self.files += 1
        self.bytes += size
        if self.files > MAX_ENTRY_FILES:
            return f"more than {MAX_ENTRY_FILES} files in one entry"
        if self.bytes > MAX_ENTRY_BYTES:
            return f"more than {MAX_ENTRY_BYTES} bytes in one entry"
        if name == entry.MANIFEST:
            return None
        if self.expected is not None and self.expected.get(name) != size:
            return f"member {name} has {size} bytes, its manifest says {self.expected[name]}"
        self.seen[name] = size
        return None

    def stowaway(self, name: str) -> bool:
        """A member the manifest (already read) does not name: skipped unread, never kept."""
        return self.expected is not None and name != entry.MANIFEST and name not in self.expected

    def read_manifest(self) -> str | None:
        """The staged manifest's payload list becomes the rule for the members after it."""
        try:
            raw = entry._read_regular(self.dir / entry.MANIFEST, 1 << 20)
            manifest = entry.unpack_manifest(raw)
            entry._check_types(manifest)
        except (entry.EntryError, OSError) as exc:
            return f"manifest: {exc}"
        self.expected = {item["file"]: item["size"] for items in manifest["payloads"].values() for item in items}
        for name, size in self.seen.items():  # payloads that came before it (an older bundle)
            if name in self.expected and self.expected[name] != size:
                return f"member {name} has {size} bytes, its manifest says {self.expected[name]}"
        return None


def _incomplete_is_stale(entry_dir: Path) -> bool:
    newest = max((p.lstat().st_mtime for p in entry_files(entry_dir)), default=last_used(entry_dir))
    return time.time() - newest > _INCOMPLETE_GRACE_S


def _merge(root: Path, store: Store, staged: Path, dest: Path, report: ImportReport, hmac_key: bytes | None) -> None:
    """Move one verified staged entry into place, keeping a valid entry that is already there."""
    digest = dest.name
    link = trust.first_link(root, dest.parent)
    if link is not None:  # moving in through it would put the entry wherever the link points
        report.bad.append({"digest": digest, "namespace": dest.parent.parent.name, "reason": f"link: {link} is a symbolic link in the root; not followed"})
        return
    if os.path.lexists(dest):
        if dest.is_symlink() or not dest.is_dir():
            store.quarantine(dest, entry.EntryError("foreign", "not a directory"))
            report.replaced.append(digest)
        else:
            try:
                check(dest, hmac_key=hmac_key)
            except entry.EntryError as exc:
                if exc.reason == "absent" and not _incomplete_is_stale(dest):
                    report.busy.append(digest)
                    return
                store.quarantine(dest, exc)
                report.replaced.append(digest)
            else:
                report.kept.append(digest)
                return
    trust.make_dirs(root, dest.parent, shared=store.trust_shared)
    try:
        os.rename(staged, dest)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            report.kept.append(digest)  # another writer put a whole entry there first
            return
        raise
    entry._fsync_dir(dest.parent)
    eviction.adjust(root, entry_bytes(dest), 1, shared=store.trust_shared)
    if digest in report.replaced:
        return
    report.imported.append(digest)


def adopt_staged(root: Path, store: Store, edir: Path, report: ImportReport, *, hmac_key: bytes | None = None) -> bool:
    """Check one staged entry (``<staging>/v1/<ns>/<xx>/<digest>``) and merge it into ``root``.

    The one import path for entries that arrive from outside (a bundle, the remote tier of
    :mod:`.remote`): :func:`check`, stowaway files dropped, :func:`_merge`. The outcome is
    recorded in ``report``; returns False when the entry failed its check.
    """
    ns, digest = edir.parent.parent.name, edir.name
    try:
        manifest, _ = check(edir, hmac_key=hmac_key)
    except entry.EntryError as exc:
        report.bad.append({"digest": digest, "namespace": ns, "reason": str(exc)})
        return False
    keep = {entry.MANIFEST} | {item["file"] for items in manifest["payloads"].values() for item in items}
    for p in entry_files(edir):
        if p.name not in keep:
            p.unlink()  # a stowaway file no manifest names: never loaded, not kept
    _merge(root, store, edir, root / LAYOUT / ns / digest[:2] / digest, report, hmac_key)
    return True


def import_bundle(root: Path, bundle: Path, *, hmac_key: bytes | None = None, trust_shared: bool = False) -> ImportReport:
    """Verify every entry of ``bundle`` in a staging directory and merge the good ones into ``root``.

    With ``hmac_key`` only entries signed with it come in (a bundle from elsewhere cannot
    plant code in a signing fleet's cache). A root the serving processes would refuse (see
    :mod:`.trust`) is refused here too. Raises :class:`BundleError` when the file is no bundle
    or the root is refused; everything else (refused members, entries failing their check) is
    listed in the report while the rest is imported.
    """
    root, bundle = Path(root), Path(bundle)
    report = ImportReport(str(bundle))
    if not trust_shared:
        why = trust.root_refusal(root, subdirs=(LAYOUT, locking.LOCKS_DIR))
        if why is not None:
            raise BundleError(f"refusing to import into {root}: {why} (CUTE_DISKCACHE_TRUST_SHARED=1 overrides)")
    store = Store(root, trust_shared=trust_shared, hmac_key=hmac_key)
    trust.make_dirs(root, root / LAYOUT, shared=trust_shared)
    staging = scratch_dir(root, "import", shared=trust_shared)
    staged: dict[tuple[str, str], _Staged] = {}
    broken: dict[tuple[str, str], str] = {}
    budget = max_import_bytes()
    total = 0
    try:
        try:
            tar = tarfile.open(bundle, "r|*")
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise BundleError(f"cannot read {bundle}: {exc}") from None
        with tar:
            try:
                members = iter(tar)
                report.header = _read_header(tar, next(members, None))
                for count, member in enumerate(members):
                    if count >= _MAX_MEMBERS:
                        report.rejected.append({"member": "...", "reason": f"more than {_MAX_MEMBERS} members"})
                        break
                    problem = member_problem(member)
                    parsed = _member_path(member.name) if problem is None else None
                    if parsed is None:
                        report.rejected.append({"member": member.name[:300], "reason": problem or f"second {BUNDLE_MANIFEST}"})
                        continue
                    ns, digest, name = parsed
                    ent = staged.setdefault((ns, digest), _Staged(staging / LAYOUT / ns / digest[:2] / digest))
                    if (ns, digest) in broken or ent.stowaway(name):
                        continue  # skipped unread: an entry already refused, a file its manifest does not name
                    why = ent.admit(name, member.size)
                    if why is None and total + member.size > budget:
                        report.rejected.append({"member": member.name[:300], "reason":
                                                f"the bundle holds more than {budget} bytes (CUTE_DISKCACHE_MAX_SIZE); the rest is not read"})
                        break
                    if why is not None:
                        broken[(ns, digest)] = why
                        shutil.rmtree(ent.dir, ignore_errors=True)  # give its staged bytes back now
                        continue
                    total += member.size
                    try:
                        _stage_member(tar, member, ent.dir / name, staging, trust_shared)
                        if name == entry.MANIFEST:
                            why = ent.read_manifest()
                    except FileExistsError:
                        why = f"member {name} appears twice"
                    except entry.EntryError as exc:
                        why = str(exc)
                    if why is not None:
                        broken[(ns, digest)] = why
                        shutil.rmtree(ent.dir, ignore_errors=True)
            except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
                # A damaged stream: what came before it is staged and still gets checked.
                report.rejected.append({"member": "(stream)", "reason": f"bundle is damaged: {type(exc).__name__}: {exc}"})
        for (ns, digest), ent in sorted(staged.items()):
            if (ns, digest) in broken:
                report.bad.append({"digest": digest, "namespace": ns, "reason": broken[(ns, digest)]})
                continue
            if ent.dir.is_dir():
                adopt_staged(root, store, ent.dir, report, hmac_key=hmac_key)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for bad in report.bad:
        log.warning("bundle entry %s rejected: %s", bad["digest"][:12], bad["reason"])
    for rej in report.rejected:
        log.warning("bundle member %s refused: %s", rej["member"], rej["reason"])
    return report
