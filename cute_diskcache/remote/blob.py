"""The unit on the remote: one object per entry, its files in one msgpack map.

Name: ``<prefix>/v1/<namespace>/<digest>``, the local layout minus the shard directory, so a
fleet's namespaces (flashinfer version, DSL stack, arch, machine) never mix and a stale
generation can be deleted by prefix. Value::

    {"format": "cute-diskcache-remote-entry", "version": 1,
     "namespace": ..., "digest": ..., "files": {"manifest.msgpack": b"...", "object-<sha16>.o": b"...", ...}}

Beside it, ``<prefix>/v1/<namespace>/<digest>.hit``: the same format holding only the manifest
and the payload a hit loads (the linked shared object when there is one, else the object), so a
remote hit moves ~a third of the bytes (:meth:`.client.RemoteCache.fetch`; the whole entry
follows in the background, for the local store). It is written before the whole entry, so an
entry that exists has its hit object too; entries published before it existed have none, and a
reader falls back to the whole one. Neither name is ever read as the other: ``.hit`` is not a
digest, so :func:`parse_name` (listing, pulling) skips it.

The files are the entry's own, byte for byte (the sealed, possibly signed manifest included),
so what a node fetches is checked by exactly the code that checks a local entry or a bundle
member: nothing in this module decides whether an entry is good. It only refuses what cannot
be laid out safely (a name or size a bundle member could not have, a value that names another
entry than the object it was stored under) before anything touches the disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack

from ..storage import entry, ingest, layout
from ..storage.layout import LAYOUT

FORMAT = "cute-diskcache-remote-entry"
VERSION = 1
#: An entry has a manifest, one object, a few cubins and one MLIR file.
MAX_FILES = 64


def object_name(prefix: str, namespace: str, digest: str) -> str:
    return f"{prefix.strip('/')}/{LAYOUT}/{namespace}/{digest}"


def hit_object_name(prefix: str, namespace: str, digest: str) -> str:
    return object_name(prefix, namespace, digest) + ".hit"


def record_name(prefix: str, scope: str, k2: str) -> str:
    """A second-stage record (:func:`..storage.reuse.sealed_record`): ``<prefix>/reuse/<scope>/<k2>``."""
    return f"{prefix.strip('/')}/{layout.REUSE_DIR}/{scope}/{k2}"


def record_marker_prefix(prefix: str, scope: str) -> str:
    """Where an empty object per namespace says that namespace published records in ``scope``
    (one listing tells a node whether a trace could find anything)."""
    return f"{prefix.strip('/')}/{layout.REUSE_DIR}/{scope}/from/"


def parse_name(prefix: str, name: str) -> tuple[str, str] | None:
    """``(namespace, digest)`` of an object name under ``prefix``, or None for anything else."""
    head = f"{prefix.strip('/')}/{LAYOUT}/"
    if not name.startswith(head):
        return None
    parts = name[len(head):].split("/")
    if len(parts) != 2:
        return None
    ns, digest = parts
    if layout.entry_file(f"{LAYOUT}/{ns}/{digest[:2]}/{digest}/{entry.MANIFEST}") is None:
        return None
    return ns, digest


def pack(entry_dir: Path, *, hmac_key: bytes | None = None) -> tuple[str, str, bytes]:
    """``(namespace, digest, value)`` of a verified local entry; raises :class:`entry.EntryError`."""
    manifest, files = ingest.read_checked(entry_dir, hmac_key=hmac_key)
    value = msgpack.packb(
        {"format": FORMAT, "version": VERSION, "namespace": manifest["namespace"], "digest": manifest["digest"], "files": dict(files)},
        use_bin_type=True,
    )
    return manifest["namespace"], manifest["digest"], value


def pack_both(entry_dir: Path, *, hmac_key: bytes | None = None) -> tuple[bytes, bytes]:
    """``(whole value, hit value)`` of a verified local entry, read and checked once."""
    manifest, files = ingest.read_checked(entry_dir, hmac_key=hmac_key)
    whole = dict(files)
    hit = {entry.MANIFEST: whole[entry.MANIFEST]}
    role = "shared" if manifest["payloads"].get("shared") and manifest.get("tvm_ffi") else "object"
    for item in manifest["payloads"][role]:
        hit[item["file"]] = whole[item["file"]]

    def value(files: dict[str, bytes]) -> bytes:
        return msgpack.packb(
            {"format": FORMAT, "version": VERSION, "namespace": manifest["namespace"], "digest": manifest["digest"], "files": files},
            use_bin_type=True,
        )

    return value(whole), value(hit)


def unpack(raw: bytes, namespace: str, digest: str) -> dict[str, bytes]:
    """The files of a value fetched under ``(namespace, digest)``; anything odd is an :class:`entry.EntryError`."""
    try:
        doc: Any = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True,
            max_bin_len=ingest.MAX_FILE_BYTES, max_str_len=1 << 16, max_map_len=MAX_FILES + 8, max_array_len=0, max_ext_len=0,
        )
    except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds; all mean the same here
        raise entry.EntryError("remote", f"undecodable remote value: {type(exc).__name__}") from None
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT):
        raise entry.EntryError("remote", "not a cute-diskcache remote entry")
    if doc.get("version") != VERSION:
        raise entry.EntryError("remote", f"remote entry version {doc.get('version')!r} is not {VERSION}")
    if doc.get("namespace") != namespace or doc.get("digest") != digest:
        raise entry.EntryError("foreign", "remote value names another entry than the object it is stored under")
    files = doc.get("files")
    if not (isinstance(files, dict) and entry.MANIFEST in files and len(files) <= MAX_FILES):
        raise entry.EntryError("remote", "remote entry has no manifest or too many files")
    for name, data in files.items():
        if not isinstance(data, bytes) or layout.entry_file(f"{LAYOUT}/{namespace}/{digest[:2]}/{digest}/{name}") is None:
            raise entry.EntryError("remote", f"remote entry file {str(name)[:80]!r} is not a plain entry file")
    return files


def stage(files: dict[str, bytes], staging_root: Path, namespace: str, digest: str, *, durable: bool = True,
          group: int | None = None) -> Path:
    """Write ``files`` as an entry directory under ``staging_root`` (layout ``v1/<ns>/<xx>/<digest>``).

    New private files only (``O_EXCL``, no links followed), the manifest last. Returns the
    entry directory, ready for :func:`.ingest.check`. ``durable`` fsyncs each file, as a bundle
    import does. The read-through path passes False: there the fsyncs were three quarters of
    a remote hit (~12 ms of ~16 ms here), and durability buys nothing, because the local copy
    of a remote entry is a cache of a cache: a file torn by a power cut fails its checksum at
    the next lookup like any damaged entry, and is fetched again. ``group``: the store's trusted
    group, which the entry directory gets (see :func:`.ingest.stage_file`).
    """
    edir = staging_root / LAYOUT / namespace / digest[:2] / digest
    for name in sorted(files, key=lambda n: n == entry.MANIFEST):
        ingest.stage_file(edir / name, (files[name],), staging=staging_root, durable=durable, group=group)
    return edir
