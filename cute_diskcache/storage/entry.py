"""The artifact: what one cache entry holds on disk, how it is written and how it is checked.

An entry is a directory ``<digest>/`` with content-addressed payload files and a msgpack
manifest. The manifest is written last and is the commit marker: payload names carry their own
sha256 prefix, so two writers racing on one key never overwrite each other's bytes under a name
a manifest already points to, and a reader that found a manifest finds every payload it names.

Payloads:
  ``object``  the exported object (host launch code + embedded cubin), loadable by every DSL
              process (``load_module``);
  ``shared``  (tvm-ffi kernels, when the writer could link) the object linked into a shared
              object exporting only ``__tvm_ffi_<symbol>``: what a hit loads when it can, ~10x
              faster (see :mod:`.loader`). Only present when there is one, so entries without it
              stay readable by versions that do not know the role;
  ``cubin``   each embedded cubin on its own, for ``cuobjdump`` and the driver-floor benchmark;
  ``mlir``    the kernel's MLIR, zlib-compressed, for ``cute-diskcache show --mlir``: MLIR
              bytecode (``.mlirbc.zz``; writing it costs ~3 ms where printing the text cost ~30,
              1.5% of a compile), or text (``.mlir.zz``) from DSLs without a bytecode writer and
              from earlier versions. :func:`mlir_text` turns either back into text.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket
import stat
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from .. import _version
from ..keys import devicefacts, hostcpu
from . import trust
from .elf import cubins_in  # noqa: F401  (what an entry stores; tests and benches read it here)
from ..keys.key import FORMAT_VERSION, CacheKey

log = logging.getLogger("cute_diskcache")

MANIFEST = "manifest.msgpack"
_MAX_MANIFEST_BYTES = 1 << 20
_MAX_PAYLOAD_BYTES = 1 << 30
_ROLES = ("object", "shared", "cubin", "mlir")
#: Roles every manifest lists (maybe empty); the others only when they hold a payload.
_ALWAYS = ("object", "cubin", "mlir")
#: EntryError("signature", UNSIGNED): no signature where one is required. A miss, never a
#: quarantine: the rewrite signs the entry (a bad signature is quarantined).
UNSIGNED = "entry is not signed and CUTE_DISKCACHE_HMAC_KEY is set"
#: Refusals that mean the entry itself is damaged or inconsistent (its bytes, seal, format, or
#: a manifest that contradicts its own place and key): quarantined, so the rewrite can go in.
#: Every other refusal (``host-cpu``, ``device``, ``signature``, ``unreadable``, a ``load`` the
#: local DSL refused) says the entry does not fit *this* process: a miss here, and the entry
#: stays for the hosts it fits (on a shared volume, one odd node must not clear everyone's).
CORRUPT = frozenset({"manifest", "checksum", "truncated", "foreign", "stale", "arch", "link", "untrusted"})
#: What ``open`` says for a link it was told not to follow (Linux ELOOP, BSDs EMLINK).
_LINK_ERRNOS = (errno.ELOOP, errno.EMLINK)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class EntryError(Exception):
    """An entry on disk is unusable; ``reason`` is a short word for logs and quarantine names."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class Artifact:
    """What a compile produced, in memory, before it is written."""

    object_bytes: bytes
    symbol: str
    tvm_ffi: bool
    cubins: list[bytes]
    mlir_text: str | None
    compile_seconds: float
    export_seconds: float
    extra: dict[str, Any]
    # the device facts the compile read (.devicefacts.recording's record)
    device: dict[str, Any] = field(default_factory=lambda: {"source": "none", "name": "", "facts": {}})
    # the object linked into a shared object (tvm-ffi kernels, when a toolchain was there)
    shared_bytes: bytes | None = None
    # the kernel's MLIR as bytecode (preferred to mlir_text when both are there)
    mlir_bytecode: bytes | None = None
    # what the host code was written for (.hostcpu.HostCode): a baseline's name or "native", and
    # the extensions a loading CPU must have; None: the DSL's own export, tuned for this CPU
    host_cpu: str | None = None
    host_isa: tuple[str, ...] | None = None
    # whether the compiling process runs these very bytes (else the cache hands it the entry as
    # a hit loads it, so the caller and every later hit run the same code)
    in_process: bool = True


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _temp_name(final: Path) -> Path:
    # pid alone collides across containers sharing a volume; host + random does not.
    return final.with_name(f".tmp.{final.name}.{socket.gethostname()}.{os.getpid()}.{os.urandom(6).hex()}")


def atomic_write(path: Path, data: bytes) -> None:
    """Write-to-temp, fsync, ``os.replace``: the name either holds all the bytes or none."""
    tmp = _temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def fsync_dir(path: Path) -> None:
    """Make a directory's new names durable (after the manifest, the commit marker, is in)."""
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def build_manifest(key: CacheKey, art: Artifact, payloads: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "digest": key.digest,
        "namespace": key.env.namespace,
        "env": key.env.as_dict(),
        "env_digest": key.env.digest,
        "site": key.site,
        "key_bytes": key.key_bytes,
        "key_repr": repr(key.site_key)[:4000],
        "options": repr(key.options),
        "symbol": art.symbol,
        "tvm_ffi": art.tvm_ffi,
        "payloads": payloads,
        "compile_seconds": round(art.compile_seconds, 4),
        "export_seconds": round(art.export_seconds, 4),
        "created": time.time(),
        "host": socket.gethostname(),
        "writer": f"cute-diskcache {_version.__version__}",
        "host_cpu": art.host_cpu or hostcpu.NATIVE,
        # what the writer was asked for: a prewarm rebuilds a tuned entry only when asked for
        # something else than its writer was (a DSL that can only write native code stays so)
        "host_cpu_asked": hostcpu.host_code().name,
        "host_isa": list(art.host_isa if art.host_isa is not None else hostcpu.native().extensions),
        "device": art.device,
        "extra": art.extra,
    }


def _holds(path: Path, size: int, digest: str) -> bool:
    """Whether ``path`` already holds exactly these bytes (a regular file, not a link)."""
    try:
        return _sha(_read_regular(path, size)) == digest
    except (OSError, EntryError):
        return False


def holds(path: Path, size: int, digest: str) -> bool:
    """Whether ``path`` is a regular file holding exactly ``size`` bytes of sha256 ``digest``."""
    return _holds(path, size, digest)


def read_bounded(path: Path, limit: int, owner: int | None = None) -> bytes:
    """A small file of ours (a second-stage record) as a payload is read: regular, never through a
    link, owned as :func:`_read_regular` requires; at most ``limit`` bytes, else ``EntryError``."""
    data = _read_regular(path, limit, owner)
    if len(data) > limit:
        raise EntryError("manifest", f"{path.name} is larger than {limit} bytes")
    return data


def write(entry_dir: Path, key: CacheKey, art: Artifact, *, hmac_key: bytes | None = None) -> dict[str, Any]:
    """Write payloads then the manifest into ``entry_dir``; returns the manifest.

    A payload already under its content-addressed name is kept only if its bytes are really
    the ones named (a file a killed writer or a tamperer left there is replaced), so a rewrite
    always yields an entry that verifies. ``hmac_key`` signs the manifest (see :mod:`.trust`).
    """
    if not entry_dir.is_dir():  # the store makes every level with its mode (trust.make_dirs) first
        entry_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    blobs: list[tuple[str, str, bytes]] = [("object", "o", art.object_bytes)]
    if art.shared_bytes is not None:
        blobs.append(("shared", "so", art.shared_bytes))
    blobs += [("cubin", "cubin", c) for c in art.cubins]
    if art.mlir_bytecode is not None:
        blobs.append(("mlir", "mlirbc.zz", zlib.compress(art.mlir_bytecode, 1)))
    elif art.mlir_text is not None:
        blobs.append(("mlir", "mlir.zz", zlib.compress(art.mlir_text.encode(), 6)))
    payloads: dict[str, list[dict[str, Any]]] = {role: [] for role in _ALWAYS}
    payloads.update({"shared": []} if art.shared_bytes is not None else {})
    for role, ext, data in blobs:
        digest = _sha(data)
        name = f"{role}-{digest[:16]}.{ext}"
        path = entry_dir / name
        if not _holds(path, len(data), digest):
            atomic_write(path, data)
        payloads[role].append({"file": name, "size": len(data), "sha256": digest})
    manifest = build_manifest(key, art, payloads)
    atomic_write(entry_dir / MANIFEST, pack_manifest(manifest, hmac_key=hmac_key))
    _fsync_dir(entry_dir)
    return manifest


# --------------------------------------------------------------------------------------------
# Reading and verifying
# --------------------------------------------------------------------------------------------


def mlir_text(data: bytes, file_name: str) -> str:
    """The MLIR text of a stored ``mlir`` payload (bytecode is parsed with the DSL's MLIR bindings)."""
    raw = zlib.decompress(data)
    if not file_name.endswith(".mlirbc.zz"):
        return raw.decode()
    from cutlass._mlir import ir

    ctx = ir.Context()
    ctx.allow_unregistered_dialects = True
    return str(ir.Module.parse(raw, ctx))


def pack_manifest(manifest: dict[str, Any], *, hmac_key: bytes | None = None) -> bytes:
    """The manifest file's bytes: the msgpack body, sealed with its own sha256.

    Every field is then covered: payload records by their checksums, and the rest (symbol,
    site, extra...) by the seal, so one flipped bit anywhere in the file is a miss. The seal
    catches accidents; anyone can recompute it. ``hmac_key`` adds an ``hmac`` field that only
    holders of the key can compute (over the seal, hence over every payload's sha256).
    """
    body = msgpack.packb(manifest, use_bin_type=True)
    outer: dict[str, Any] = {"seal": "sha256", "sha256": _sha(body), "body": body}
    if hmac_key:
        outer["hmac"] = trust.sign(hmac_key, outer["sha256"])
    return msgpack.packb(outer, use_bin_type=True)


def unpack_manifest(raw: bytes, *, hmac_key: bytes | None = None) -> dict[str, Any]:
    """Inverse of :func:`pack_manifest`; any deviation is an :class:`EntryError`.

    With ``hmac_key``, a missing signature is ``EntryError("signature", UNSIGNED)`` and a wrong
    one ``EntryError("signature", ...)``; without it the ``hmac`` field is not looked at.
    """
    try:
        outer = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds for damaged bytes; all mean a damaged manifest
        raise EntryError("manifest", f"undecodable: {type(exc).__name__}") from None
    if not (isinstance(outer, dict) and outer.get("seal") == "sha256" and isinstance(outer.get("body"), bytes)
            and isinstance(outer.get("sha256"), str)):
        raise EntryError("manifest", "not a sealed manifest")
    if _sha(outer["body"]) != outer["sha256"]:
        raise EntryError("manifest", "seal does not match its body")
    if hmac_key:
        if "hmac" not in outer:
            raise EntryError("signature", UNSIGNED)
        if not trust.signature_ok(hmac_key, outer["sha256"], outer["hmac"]):
            raise EntryError("signature", "signature does not match (another key, or the entry was altered)")
    try:
        manifest = msgpack.unpackb(outer["body"], raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds for damaged bytes; all mean a damaged manifest
        raise EntryError("manifest", f"undecodable body: {type(exc).__name__}") from None
    if not isinstance(manifest, dict):
        raise EntryError("manifest", "not a map")
    return manifest


def _read_regular(path: Path, limit: int, owner: int | None = None) -> bytes:
    """Up to ``limit + 1`` bytes of a regular file, never through a link (the last component's:
    the directories above are the store's to check) and never blocking on a FIFO.

    ``owner``: the file must belong to that uid and be writable by nobody else (see
    :func:`.trust.file_refusal`), else ``EntryError("untrusted")``.
    """
    fd = os.open(path, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EntryError("unreadable", f"{path.name} is not a regular file")
        why = trust.file_refusal(path, st, owner, fd)
        if why is not None:
            raise EntryError("untrusted", why)
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_manifest(entry_dir: Path, *, hmac_key: bytes | None = None, owner: int | None = None) -> dict[str, Any]:
    """Parse a manifest with hard limits; anything odd is an :class:`EntryError`, never a crash.

    ``owner``: see :func:`_read_regular` (the store passes its uid unless the root is shared).
    """
    return parse_manifest(read_manifest_bytes(entry_dir, owner=owner), hmac_key=hmac_key)


def parse_manifest(raw: bytes, *, hmac_key: bytes | None = None) -> dict[str, Any]:
    """:func:`read_manifest` of bytes already in memory (a remote hit's)."""
    manifest = unpack_manifest(raw, hmac_key=hmac_key)
    _check_types(manifest)
    return manifest


def read_manifest_bytes(entry_dir: Path, *, owner: int | None = None) -> bytes:
    """The manifest file as stored (bounded, never through a link), for :func:`read_manifest`
    and for whoever must pass it on byte for byte (exports)."""
    path = entry_dir / MANIFEST
    try:
        raw = _read_regular(path, _MAX_MANIFEST_BYTES, owner)
    except FileNotFoundError:
        raise EntryError("absent", str(path)) from None
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS:
            raise EntryError("link", f"{path} is a symbolic link") from None
        if not os.path.lexists(entry_dir):
            # A parent is a file or cannot be searched: no entry here to reject; a root that
            # cannot exist is the write side's one warning, not one warning per lookup.
            raise EntryError("absent", f"{path}: {exc}") from None
        raise EntryError("unreadable", f"{path}: {exc}") from None
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise EntryError("manifest", "larger than 1 MiB")
    return raw


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "format": int,
    "digest": str,
    "namespace": str,
    "env": dict,
    "env_digest": str,
    "site": str,
    "key_bytes": bytes,
    "symbol": str,
    "tvm_ffi": bool,
    "payloads": dict,
    "compile_seconds": (int, float),
    "created": (int, float),
    "extra": dict,
}


def _check_types(manifest: dict[str, Any]) -> None:
    for name, typ in _FIELD_TYPES.items():
        if not isinstance(manifest.get(name), typ):
            raise EntryError("manifest", f"field {name!r} missing or of the wrong type")
    if not devicefacts.validate(manifest.get("device")):
        raise EntryError("manifest", "field 'device' missing or malformed")
    isa = manifest.get("host_isa", [])
    if not (isinstance(isa, list) and len(isa) <= 512 and all(isinstance(f, str) for f in isa)):
        raise EntryError("manifest", "field 'host_isa' is not a list of strings")
    for role, items in manifest["payloads"].items():
        if role not in _ROLES or not isinstance(items, list):
            raise EntryError("manifest", f"unknown payload role {role!r}")
        for item in items:
            if not (
                isinstance(item, dict)
                and isinstance(item.get("file"), str)
                and isinstance(item.get("size"), int)
                and isinstance(item.get("sha256"), str)
            ):
                raise EntryError("manifest", f"malformed {role} payload record")
            name = item["file"]
            # Names are ours (role-sha.ext): anything path-like is hostile.
            if "/" in name or "\\" in name or "\0" in name or name.startswith(".") or name in ("", MANIFEST):
                raise EntryError("manifest", f"payload name {name!r} is not a plain file name")
            if not 0 <= item["size"] <= _MAX_PAYLOAD_BYTES:
                raise EntryError("manifest", f"payload size {item['size']} out of range")
    if len(manifest["payloads"].get("object", [])) != 1:
        raise EntryError("manifest", "exactly one object payload expected")
    if len(manifest["payloads"].get("shared", [])) > 1:
        raise EntryError("manifest", "at most one shared payload expected")


def verify(entry_dir: Path, manifest: dict[str, Any], key: CacheKey | None, *, owner: int | None = None,
           role: str | None = None, held: dict[str, bytes] | None = None) -> bytes:
    """Check the manifest against the expected key, and payloads against their checksums.

    ``role`` None checks every payload (``cute-diskcache verify``, imports) and returns the
    object; a role checks (and returns) that payload only: a hit hashes what it loads, not the
    cubin and MLIR it never uses. What gets loaded is exactly what was checked.
    ``key`` None (the CLI's ``verify``) checks internal consistency only. ``held``: the payload
    files' bytes in memory (a remote hit's), held to the same sizes and checksums instead of
    being read from ``entry_dir`` (then only its name, the digest, is looked at).
    """
    if manifest["format"] != FORMAT_VERSION:
        raise EntryError("stale", f"format {manifest['format']} != {FORMAT_VERSION}")
    if manifest["digest"] != entry_dir.name:
        raise EntryError("foreign", "manifest digest does not match its directory")
    if key is not None:
        # Arch first: it is part of the environment digest too, and "arch" is the reason an
        # operator needs to read (a cache copied between sm_120a and sm_121a boxes).
        if manifest["env"].get("arch") != key.env.arch:
            raise EntryError("arch", f"built for {manifest['env'].get('arch')}, target is {key.env.arch}")
        theirs, ours = manifest["env"], key.env.as_dict()
        # Both: a manifest whose env fields were damaged (or forged) keeps the right digest.
        if manifest["env_digest"] != key.env.digest or theirs != ours:
            diff = sorted(k for k in ours if theirs.get(k) != ours.get(k))
            raise EntryError("stale", f"environment differs in {', '.join(diff) or 'digest'}")
        if manifest["key_bytes"] != key.key_bytes or manifest["digest"] != key.digest:
            raise EntryError("foreign", "entry holds another key")
        lacking = hostcpu.missing(manifest.get("host_isa") or [], machine=theirs.get("machine"))
        if lacking:
            raise EntryError("host-cpu", f"built on a CPU with {', '.join(lacking[:6])}, which this CPU lacks")
        why = devicefacts.mismatch(manifest["device"])
        if why is not None:
            raise EntryError("device", why)
    wanted = role or "object"
    if not manifest["payloads"].get(wanted):
        raise EntryError("absent", f"no {wanted} payload")
    out: bytes | None = None
    for kind, items in manifest["payloads"].items():
        if role is not None and kind != role:
            continue
        for item in items:
            data = read_payload(entry_dir, item, owner, role=kind) if held is None else _held_payload(held, item, kind)
            if kind == wanted:
                out = data
    assert out is not None  # _check_types guarantees one object payload; the role was checked above
    return out


def read_payload(entry_dir: Path, item: dict[str, Any], owner: int | None = None, *, role: str = "payload") -> bytes:
    """One payload's bytes, read as a manifest record says and held to its size and sha256.

    The one reader every consumer of payloads goes through (a hit, ``verify``, ``show``, the
    device check, exports): bounded, never through a link, never blocking on a FIFO, and only
    bytes that match their checksum come back; anything else is an :class:`EntryError`.
    """
    data = _read_payload(entry_dir / item["file"], item["size"], owner)
    if _sha(data) != item["sha256"]:
        raise EntryError("checksum", f"{role} payload {item['file']} does not match its sha256")
    return data


def _held_payload(held: dict[str, bytes], item: dict[str, Any], role: str) -> bytes:
    data = held.get(item["file"])
    if data is None:
        raise EntryError("truncated", f"payload {item['file']} is missing")
    if len(data) != item["size"]:
        raise EntryError("truncated", f"payload {item['file']} has {len(data)} bytes, manifest says {item['size']}")
    if _sha(data) != item["sha256"]:
        raise EntryError("checksum", f"{role} payload {item['file']} does not match its sha256")
    return data


def _read_payload(path: Path, size: int, owner: int | None = None) -> bytes:
    try:
        data = _read_regular(path, size, owner)
    except FileNotFoundError:
        raise EntryError("truncated", f"payload {path.name} is missing") from None
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS:
            raise EntryError("link", f"payload {path.name} is a symbolic link") from None
        raise EntryError("unreadable", f"{path.name}: {exc}") from None
    if len(data) != size:
        raise EntryError("truncated", f"payload {path.name} has {len(data)} bytes, manifest says {size}")
    return data
