"""Bundles: one gzip-compressed tar file that carries verified entries between cache roots.

Baked into an image, copied to a network volume. The first member is ``bundle.json`` (format,
version, when, which namespaces, how many entries); every other member is one file of one entry,
at the path it has under a root (``v1/<namespace>/<xx>/<digest>/<file>``), each entry's manifest
first so an importer knows every file's name and size before it stages a byte.

Import treats the file as hostile: members that are links, devices, absolute, hold ``..`` or
fall outside that layout are refused; sizes are capped per member, per entry and per import;
what is left goes through :mod:`.ingest` like every entry that arrives from outside.
"""

from __future__ import annotations

import dataclasses
import gzip
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
from typing import Any
from collections.abc import Sequence

from .. import _version
from . import entry, ingest, layout, trust
from .ingest import ImportReport
from ..keys.key import FORMAT_VERSION
from .layout import LAYOUT
from .store import Store

__all__ = ["BundleError", "ExportReport", "ImportReport", "export_bundle", "import_bundle"]

log = logging.getLogger("cute_diskcache")

BUNDLE_FORMAT = "cute-diskcache-bundle"
BUNDLE_VERSION = 1
BUNDLE_MANIFEST = "bundle.json"

MAX_MEMBER_BYTES = ingest.MAX_FILE_BYTES
#: An entry has a manifest, one object, a cubin or a few, one MLIR file.
MAX_ENTRY_FILES = 64
MAX_ENTRY_BYTES = 512 << 20
_MAX_BUNDLE_MANIFEST_BYTES = 1 << 20
_MAX_MEMBERS = 1_000_000
_CHUNK = 1 << 20


def max_import_bytes() -> int:
    """What one import may stage in all: the cache's size cap (nothing bigger could stay), 64 GiB without one."""
    from .. import config

    cap = config.max_size()
    return cap if cap > 0 else 64 << 30


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
    for d in layout.entry_dirs(root, namespace):
        try:
            manifest, _ = ingest.check(d, hmac_key=hmac_key)
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
                    files = ingest.checked_files(d, manifest, hmac_key)
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


def member_problem(member: tarfile.TarInfo) -> str | None:
    """Why a tar member may not be extracted, or None; the path is parsed by :func:`.layout.entry_file`."""
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
    if layout.entry_file(name) is None:
        return f"outside {LAYOUT}/<namespace>/<xx>/<digest>/<file>"
    return None


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


def _member_chunks(tar: tarfile.TarFile, member: tarfile.TarInfo) -> Any:
    """A member's bytes in chunks; a member that ends early is an :class:`entry.EntryError`."""
    src = tar.extractfile(member)
    assert src is not None
    left = member.size
    while left > 0:
        chunk = src.read(min(_CHUNK, left))
        if not chunk:
            raise entry.EntryError("truncated", f"member {member.name} ends early")
        left -= len(chunk)
        yield chunk


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
            manifest = entry.read_manifest(self.dir)
        except (entry.EntryError, OSError) as exc:
            return f"manifest: {exc}"
        self.expected = {item["file"]: item["size"] for items in manifest["payloads"].values() for item in items}
        for name, size in self.seen.items():  # payloads that came before it (an older bundle)
            if name in self.expected and self.expected[name] != size:
                return f"member {name} has {size} bytes, its manifest says {self.expected[name]}"
        return None


def import_bundle(root: Path, bundle: Path, *, hmac_key: bytes | None = None, trust_shared: bool = False,
                  trust_group: int | None = None) -> ImportReport:
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
        found = trust.refused_level(root, subdirs=(LAYOUT, layout.LOCKS_DIR), group=trust_group)
        if found is not None:
            raise BundleError(f"refusing to import into {root}: {found[1]} ({trust.remedy(found[0], trust_group)})")
    store = Store(root, trust_shared=trust_shared, hmac_key=hmac_key, trust_group=trust_group)
    store.make_layout()
    staging = store.scratch_dir("import")
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
                    parsed = layout.entry_file(member.name) if problem is None else None
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
                        ingest.stage_file(ent.dir / name, _member_chunks(tar, member), staging=staging, shared=trust_shared,
                                          group=trust_group)
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
                ingest.adopt_staged(root, store, ent.dir, report, hmac_key=hmac_key)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for bad in report.bad:
        log.warning("bundle entry %s rejected: %s", bad["digest"][:12], bad["reason"])
    for rej in report.rejected:
        log.warning("bundle member %s refused: %s", rej["member"], rej["reason"])
    return report
