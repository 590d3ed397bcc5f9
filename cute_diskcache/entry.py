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

import contextlib
import errno
import hashlib
import logging
import os
import socket
import stat
import struct
import threading
import time
import types
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack

from . import _version, devicefacts, hostcpu, trust
from .key import FORMAT_VERSION, CacheKey

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


def symbol_for(digest: str) -> str:
    """A C identifier unique to the entry, so many objects can live in one process."""
    return f"cdc_{digest[:24]}"


def export(
    compiled: Any,
    digest: str,
    compile_seconds: float,
    extra: dict[str, Any] | None = None,
    device: dict[str, Any] | None = None,
    *,
    workdir: Path | None = None,
    captured: list[bytes] | None = None,
    link: bool = True,
) -> Artifact:
    """Turn a ``cute.compile`` result into bytes, and link the fast form when it can.

    A ``--enable-tvm-ffi`` compile already emitted an object for its own JIT load
    (:func:`capturing` kept it): the same code, data and relocations ``export_to_c`` would
    produce again by re-running LLVM (measured: persistence then costs 2% of a compile, not 11%).
    It is used when it is there and exports ``__tvm_ffi_<function name>``; otherwise
    ``export_to_c`` writes one, into ``workdir`` (the store's scratch space inside the cache root,
    so a read-only or full ``/tmp`` does not turn persistence off). Other compiles go through
    ``dump_to_object``. A tvm-ffi object is then linked into a shared object where a toolchain
    exists (:func:`.loader.link`); a link that fails only leaves the entry without one.
    """
    import tempfile

    from . import loader

    t0 = time.perf_counter()
    symbol = symbol_for(digest)
    tvm_ffi = hasattr(compiled, "__tvm_ffi_object__") or "TVMFFI" in type(compiled).__name__
    obj = _compile_time_object(compiled, captured) if tvm_ffi else None
    if obj is not None:
        symbol = str(compiled.function_name)
    else:
        def run() -> bytes:
            if not tvm_ffi:
                return bytes(compiled.dump_to_object(symbol))
            with tempfile.TemporaryDirectory(prefix="export-", dir=workdir) as tmp:
                path = os.path.join(tmp, "kernel.o")
                compiled.export_to_c(path, function_name=symbol)
                with open(path, "rb") as fh:
                    return fh.read()

        obj = _with_usable_temp(run, workdir)
    shared = loader.link(obj, symbol, workdir) if tvm_ffi and link else None
    ir_module = getattr(compiled, "ir_module", None)
    cubins = cubins_in(obj)
    mlir_bytecode = _bytecode(ir_module) if ir_module is not None else None
    mlir_text = str(ir_module) if ir_module is not None and mlir_bytecode is None else None
    return Artifact(
        object_bytes=obj,
        symbol=symbol,
        tvm_ffi=tvm_ffi,
        cubins=cubins,
        mlir_text=mlir_text,
        compile_seconds=compile_seconds,
        export_seconds=time.perf_counter() - t0,
        extra=dict(extra or {}),
        shared_bytes=shared,
        mlir_bytecode=mlir_bytecode,
        **({"device": dict(device)} if device else {}),
    )


def _bytecode(ir_module: Any) -> bytes | None:
    """The module as MLIR bytecode, or None where the bindings cannot write it."""
    import io

    try:
        buf = io.BytesIO()
        ir_module.operation.write_bytecode(buf)
        return buf.getvalue()
    except Exception as exc:
        log.debug("no MLIR bytecode (%s); keeping the text", exc)
        return None


def mlir_text(data: bytes, file_name: str) -> str:
    """The MLIR text of a stored ``mlir`` payload (bytecode is parsed with the DSL's MLIR bindings)."""
    raw = zlib.decompress(data)
    if not file_name.endswith(".mlirbc.zz"):
        return raw.decode()
    from cutlass._mlir import ir

    ctx = ir.Context()
    ctx.allow_unregistered_dialects = True
    return str(ir.Module.parse(raw, ctx))


# --------------------------------------------------------------------------------------------
# The object the compile emitted anyway
# --------------------------------------------------------------------------------------------

_tap = threading.local()
_tap_lock = threading.Lock()


class _AotTap(types.ModuleType):
    """Stands in for ``_aot_support`` inside the DSL's tvm-ffi provider only: passes every call
    through, and while :func:`capturing` is active in this thread keeps what
    ``export_module_to_bytes`` returned."""

    def __init__(self, real: Any) -> None:
        super().__init__(getattr(real, "__name__", "_aot_support"))
        self.__dict__["_cdc_real"] = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_cdc_real"], name)

    def export_module_to_bytes(self, *args: Any, **kwargs: Any) -> Any:
        out = self.__dict__["_cdc_real"].export_module_to_bytes(*args, **kwargs)
        sink = getattr(_tap, "sink", None)
        if sink is not None and kwargs.get("format", "o") == "o" and isinstance(out, (bytes, bytearray)):
            sink.append(bytes(out))
        return out


def _install_tap() -> bool:
    """Put :class:`_AotTap` into the DSL's tvm-ffi provider (idempotent); False if its layout is unexpected."""
    try:
        from cutlass.cutlass_dsl import tvm_ffi_provider as provider
    except Exception:
        return False
    with _tap_lock:
        current = provider.__dict__.get("_aot_support")
        if isinstance(current, _AotTap):
            return True
        if current is None or not hasattr(current, "export_module_to_bytes"):
            return False
        provider._aot_support = _AotTap(current)
        return True


@contextlib.contextmanager
def capturing() -> Iterator[list[bytes]]:
    """Keep the objects the DSL emits while the body (one compile) runs in this thread.

    Private DSL API, contained: a DSL without the function (or laid out otherwise) yields an
    empty list and :func:`export` re-exports as before.
    """
    sink: list[bytes] = []
    if not _install_tap():
        yield sink
        return
    previous = getattr(_tap, "sink", None)
    _tap.sink = sink
    try:
        yield sink
    finally:
        _tap.sink = previous


def _compile_time_object(compiled: Any, captured: list[bytes] | None) -> bytes | None:
    """The captured object that holds this compile's ``__tvm_ffi_<function name>``, or None."""
    name = getattr(compiled, "function_name", None)
    if not captured or not isinstance(name, str) or not name:
        return None
    wanted = b"__tvm_ffi_" + name.encode() + b"\0"
    found = [obj for obj in captured if wanted in obj and obj.startswith(b"\x7fELF")]
    return found[-1] if found else None


_TEMP_LOCK = threading.Lock()


def _with_usable_temp(run: Callable[[], bytes], workdir: Path | None) -> bytes:
    """``run()``; if it fails, once more with the DSL's temporary files in ``workdir`` (the
    store's scratch inside the cache root).

    The DSL writes the object through ``tempfile`` itself, so a small, full or read-only
    ``/tmp`` (read-only root filesystem pods, a tiny emptyDir) made every export fail, blamed on
    the cache root. The redirect is process-wide while it lasts, so it is taken only after a
    failure (when the default was not usable for this export anyway), under a lock; an export
    that fails for another reason fails the same way again and raises.
    """
    import tempfile

    try:
        return run()
    except Exception as exc:
        if workdir is None:
            raise
        log.debug("export failed (%s: %s); again with temporary files under %s", type(exc).__name__, exc, workdir)
    with _TEMP_LOCK:
        saved = tempfile.tempdir
        tempfile.tempdir = str(workdir)
        try:
            return run()
        finally:
            tempfile.tempdir = saved


_EM_CUDA = 190


def _elf_end(buf: bytes, at: int) -> int | None:
    """End offset of a CUDA ELF image starting at ``at`` (headers and every section), or None."""
    try:
        machine = struct.unpack_from("<H", buf, at + 18)[0]
        phoff, shoff = struct.unpack_from("<QQ", buf, at + 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", buf, at + 54)
        if machine != _EM_CUDA or shnum == 0 or shentsize < 64:
            return None
        end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
        for i in range(shnum):
            sh = at + shoff + i * shentsize
            sh_type = struct.unpack_from("<I", buf, sh + 4)[0]
            sh_offset, sh_size = struct.unpack_from("<QQ", buf, sh + 24)
            if sh_type != 8:  # SHT_NOBITS occupies no file bytes
                end = max(end, sh_offset + sh_size)
    except struct.error:
        return None
    return at + end if at + end <= len(buf) else None


def cubins_in(obj: bytes) -> list[bytes]:
    """The cubins embedded in an exported object: ELF images whose machine is EM_CUDA.

    The DSL lowers ``gpu.binary`` into an LLVM global before we see the module, so the object
    is the one place every DSL version leaves the cubin; reading it back from there needs
    nothing but the ELF header.
    """
    found: list[bytes] = []
    start = 1  # the object itself is the host ELF at offset 0
    while True:
        at = obj.find(b"\x7fELF\x02\x01", start)
        if at < 0 or at + 64 > len(obj):
            return found
        end = _elf_end(obj, at)
        if end is not None:
            found.append(obj[at:end])
            start = end
        else:
            start = at + 1


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
        "host_isa": list(hostcpu.isa_extensions()),
        "device": art.device,
        "extra": art.extra,
    }


def _holds(path: Path, size: int, digest: str) -> bool:
    """Whether ``path`` already holds exactly these bytes (a regular file, not a link)."""
    try:
        return _sha(_read_regular(path, size)) == digest
    except (OSError, EntryError):
        return False


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
    except Exception as exc:
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
    except Exception as exc:
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
        why = trust.file_refusal(path, st, owner)
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
    manifest = unpack_manifest(raw, hmac_key=hmac_key)
    _check_types(manifest)
    return manifest


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
           role: str | None = None) -> bytes:
    """Check the manifest against the expected key, and payloads against their checksums.

    ``role`` None checks every payload (``cute-diskcache verify``, imports) and returns the
    object; a role checks (and returns) that payload only: a hit hashes what it loads, not the
    cubin and MLIR it never uses. What gets loaded is exactly what was checked.
    ``key`` None (the CLI's ``verify``) checks internal consistency only.
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
        lacking = hostcpu.missing(manifest.get("host_isa") or [])
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
            data = _read_payload(entry_dir / item["file"], item["size"], owner)
            if _sha(data) != item["sha256"]:
                raise EntryError("checksum", f"{kind} payload {item['file']} does not match its sha256")
            if kind == wanted:
                out = data
    assert out is not None  # _check_types guarantees one object payload; the role was checked above
    return out


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


def preload_runtime() -> float:
    """dlopen the DSL runtime libraries once per process (see :func:`.loader.preload`)."""
    from . import loader

    return loader.preload()


def load(data: bytes, symbol: str, tvm_ffi: bool, *, role: str = "object") -> Any:
    """Load verified bytes of ``role`` and return the callable (see :mod:`.loader`)."""
    from . import loader

    if role == "shared":
        return loader.load_shared(data, symbol)
    return loader.load_object(data, symbol, tvm_ffi)
