"""Entries that arrive from outside the store: checked on their own, staged, merged atomically.

The one path for a bundle's entries and the remote tier's alike: each file is written new
(``O_EXCL``, never through a link) into a private staging directory inside the root (same
filesystem), the entry is checked without its key (:func:`check`: format, seal, payload
checksums, and that its place, environment record and digest agree), files no manifest names are
dropped, and the entry moves into ``v1/`` with one ``rename``: readers see no entry or a whole
checked one, and a valid entry already there is never replaced. Leaving the store the other way,
:func:`read_checked` hands out only bytes held to a checked manifest.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from . import entry, eviction, layout, trust
from ..keys.key import encode
from .layout import LAYOUT
from .store import Store

#: No file we write comes near this (objects are a few MiB); anything bigger is hostile.
MAX_FILE_BYTES = 256 << 20
#: An entry directory without a manifest younger than this may be a writer at work.
_INCOMPLETE_GRACE_S = 600.0


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
    except Exception as exc:  # noqa: BLE001 - a hostile env record: deep nesting, odd types
        raise entry.EntryError("manifest", f"environment record not encodable: {type(exc).__name__}") from None
    if env_digest != manifest["env_digest"] or not manifest["namespace"].endswith("-" + env_digest[:12]):
        raise entry.EntryError("foreign", "environment record does not match its digest or namespace")
    if hashlib.sha256(bytes.fromhex(env_digest) + manifest["key_bytes"]).hexdigest() != digest:
        raise entry.EntryError("foreign", "digest is not the hash of the entry's environment and key")
    return manifest, obj


def read_checked(entry_dir: Path, *, hmac_key: bytes | None = None) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """A verified entry's manifest and its files' bytes (manifest first), for sending elsewhere.

    :func:`check`, then every file read again and held to the checked manifest, so only
    checked bytes leave (what a bundle export writes; :mod:`..remote` publishes the same).
    Raises :class:`entry.EntryError`.
    """
    manifest, _ = check(entry_dir, hmac_key=hmac_key)
    try:
        files = checked_files(entry_dir, manifest, hmac_key)
    except OSError as exc:
        raise entry.EntryError("unreadable", f"{entry_dir.name}: {exc}") from None
    return manifest, [(name, data) for name, data, _mtime in files]


def checked_files(d: Path, manifest: dict[str, Any], hmac_key: bytes | None) -> list[tuple[str, bytes, float]]:
    """The files of a checked entry, read again and held to the checked manifest.

    Bounded reads that never follow a link; a payload or manifest that changed since the
    check (rewritten, evicted) raises :class:`entry.EntryError`, so only checked bytes travel.
    """
    items = {item["file"]: item for records in manifest["payloads"].values() for item in records}
    out = []
    for name, item in items.items():
        data = entry.read_payload(d, item)  # raises if it changed since the check
        out.append((name, data, (d / name).lstat().st_mtime))
    raw = entry.read_manifest_bytes(d)
    if entry.unpack_manifest(raw, hmac_key=hmac_key) != manifest:
        raise entry.EntryError("manifest", "changed during export")
    # First: an importer learns every file's name and size before it stages any byte.
    out.insert(0, (entry.MANIFEST, raw, (d / entry.MANIFEST).lstat().st_mtime))
    return out


def stage_file(dest: Path, chunks: Iterable[bytes], *, staging: Path, shared: bool = False, durable: bool = True,
               group: int | None = None) -> None:
    """Write ``chunks`` to ``dest``, a new file under ``staging`` (never an existing one, never
    through a link), making the directories with their modes. ``durable`` fsyncs it. ``group``
    (``CUTE_DISKCACHE_TRUST_GROUP``): the directories get it and mode 2775, as a commit's do."""
    # The entry directory moves into v1/ as made here.
    trust.make_dirs(staging, dest.parent, shared=shared, **({"group": group} if group is not None else {}))
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


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


def _incomplete_is_stale(entry_dir: Path) -> bool:
    newest = max((p.lstat().st_mtime for p in layout.entry_files(entry_dir)), default=layout.last_used(entry_dir))
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
    store.make_dirs(dest.parent)  # the store's modes: under a trusted group, the group's 2775 (issue 29)
    try:
        os.rename(staged, dest)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            report.kept.append(digest)  # another writer put a whole entry there first
            return
        raise
    entry._fsync_dir(dest.parent)
    eviction.adjust(root, layout.entry_bytes(dest), 1, shared=store.bookkeeping_shared)
    if digest in report.replaced:
        return
    report.imported.append(digest)


def adopt_staged(root: Path, store: Store, edir: Path, report: ImportReport, *, hmac_key: bytes | None = None) -> bool:
    """Check one staged entry (``<staging>/v1/<ns>/<xx>/<digest>``) and merge it into ``root``.

    The one import path for entries that arrive from outside (a bundle, the remote tier of
    :mod:`..remote`): :func:`check`, stowaway files dropped, :func:`_merge`. The outcome is
    recorded in ``report``; returns False when the entry failed its check.
    """
    ns, digest = edir.parent.parent.name, edir.name
    try:
        manifest, _ = check(edir, hmac_key=hmac_key)
    except entry.EntryError as exc:
        report.bad.append({"digest": digest, "namespace": ns, "reason": str(exc)})
        return False
    keep = {entry.MANIFEST} | {item["file"] for items in manifest["payloads"].values() for item in items}
    for p in layout.entry_files(edir):
        if p.name not in keep:
            p.unlink()  # a stowaway file no manifest names: never loaded, not kept
    _merge(root, store, edir, root / LAYOUT / ns / digest[:2] / digest, report, hmac_key)
    return True
