"""Owns the second-stage records: an entry another flashinfer release compiled, found by what the
kernel *is* (its traced IR, keyed by :func:`..keys.trace.stage_two_key`), and linked under this
release's key (issue 31).

The first-stage key (:mod:`..keys.key`) names the flashinfer release and the sources a compile reached:
cheap to make (no tracing) and right, but every release starts with an empty cache, also for
kernels whose generated code did not change (docs/performance.md: a patch release kept every
kernel's traced IR, cubin and host object). After a first-stage miss, for a site whose row allows
it, the cache traces the kernel (:func:`..keys.trace.traced_ir`, 20-35% of a compile) and looks up
:func:`..keys.trace.stage_two_key`: the traced-IR digest with everything it does not determine. A record found
there names an entry; :func:`link` writes this release's first-stage entry from it (its payload
files hard-linked, copied where a link cannot be made) and the cache then loads that entry
exactly as a hit, every check included. The next process hits the first stage.

Records: ``<root>/reuse/<scope>/<k2[:2]>/<k2>``, a small msgpack map naming an entry (namespace,
digest), sealed as the remote tier seals its records (:func:`sealed_record`): bound to the ``k2``
it was written for and, where an HMAC key is set, signed with it (:func:`.trust.sign_record`).
A record is only a pointer, but one that chooses which native code a kernel gets: a record that
does not open (another ``k2``'s, unsigned or badly signed under a key, damaged, or of the
unbound format of older versions) is ignored with one warning and never exported; whatever a
record names is then read, verified (its manifest must be the entry the record names) and
checked against this process's environment before anything is linked; a record whose entry is
gone or does not fit is a miss, and the next record for that ``k2`` (a read-only layer's) is tried. Records are written by the compile path from the digest of what the compile itself
lowered (:func:`..keys.trace.recorder`), never from an earlier trace, and rewritten to name the newest
entry after each link (an old release's namespace may be pruned). ``<scope>`` is the DSL stack,
arch, host machine and device class: a miss traces only when its scope has records (here or in a
read-only layer), so a cache no other release of this stack filled never pays for a trace.

Why the payloads are linked rather than referred to: the new entry then stands alone (``prune``
of the old namespace, eviction, bundles and the remote tier see an ordinary entry), and a hard
link takes no disk. Nothing here knows a library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator

import msgpack

from . import entry, layout, trust
from ..keys.key import FORMAT_VERSION, CacheKey, Environment, encode

if TYPE_CHECKING:
    from .store import Store
    from ..keys.trace import Traced

log = logging.getLogger("cute_diskcache")

#: ``<root>/reuse/``: the second-stage records (``clear`` removes them with the rest).
REUSE_DIR = layout.REUSE_DIR
_MAX_RECORD_BYTES = 4096
#: A sealed record: the record, its k2 and its signature around it.
_MAX_SEALED_BYTES = _MAX_RECORD_BYTES + 512
#: Fields of the environment a reused entry must share with this process (the rest, the
#: flashinfer release and its sources, are what a second-stage key leaves out).
_SHARED_ENV = ("arch", "dsl", "codegen_env", "machine", "device")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a site hands the cache for a second-stage lookup, made only on a first-stage miss.

    ``trace`` traces the kernel without lowering it (the DSL's own compile callable and the
    compile's exact arguments: :func:`..keys.trace.traced_ir`); ``context`` is what else the site
    knows decides the entry's side data that the IR does not carry (the compiled function's
    Python signature: parameter names and defaults make the calling convention and the
    compile's recorded argument names).
    """

    trace: Callable[[], Traced]
    context: str
    #: ``lower(decide)``: the same compile, traced once (:func:`..keys.trace.trace_then_lower`): stopped
    #: before lowering when ``decide(traced)`` finds the kernel, else lowered from that trace. None
    #: where the compile must go through someone else's wrapper of ``cute.compile`` (a JIT monitor
    #: must see it): there a lookup traces and a compile traces again.
    lower: Callable[[Callable[[Traced], bool]], Any] | None = None


def scope(env: Environment) -> str:
    """The records' directory for an environment: arch, host machine, and a digest of the DSL
    stack and device class (``sm_120a-x86_64-<hash12>``). Records of another scope never match."""
    digest = hashlib.sha256(encode(["cute-diskcache reuse scope", FORMAT_VERSION, [list(p) for p in env.dsl], env.device])).hexdigest()
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{env.arch}-{env.machine}")
    return f"{safe}-{digest[:12]}"


def _record_path(root: Path, scope_name: str, k2: str) -> Path:
    return Path(os.path.join(root, REUSE_DIR, scope_name, k2[:2], k2))


#: ``<scope>/from/<release>``: an empty file per library release whose entries have records in the scope.
_FROM = "from"


def release(env: Environment) -> str:
    """The marker's name for ``env``'s library release (``flashinfer-python__0.7.4``): not its
    namespace, which also tells the adapter's kinds of one release apart (a model's MoE and
    dense GEMM rows): a first prewarm of one release must not trace because its other kind
    wrote records."""
    return _release_of(env.package)


def _release_of(package: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in package)


def releases(root: Path, scope_name: str) -> list[str]:
    """The releases whose records ``root`` holds in a scope (its markers' names)."""
    try:
        return sorted(os.listdir(os.path.join(root, REUSE_DIR, scope_name, _FROM)))
    except OSError:
        return []


def possible(store: Store, env: Environment) -> bool:
    """Whether a second-stage record of another release of this environment's scope could
    exist, here or in a layer: one directory listing per root, on a miss only. Without one a
    miss does not trace: a cache filled by this release alone (its first prewarm) never pays for
    a trace."""
    name, ours = scope(env), release(env)
    for s in (store, *store.layers):
        if not s.trusted:
            continue
        if any(n != ours for n in releases(s.root, name)):
            return True
    return False


def candidates(store: Store, env: Environment, k2: str) -> Iterator[tuple[Store, Path]]:
    """The roots (this one, then each layer) and entry directories that records for ``k2`` name,
    in order: the caller links the first that serves (a stale record here must not hide a
    sound one in a layer). A record that does not open is skipped with one warning."""
    name = scope(env)
    for s in (store, *store.layers):
        if not s.trusted:
            continue
        path = _record_path(s.root, name, k2)
        try:
            raw = entry.read_bounded(path, _MAX_SEALED_BYTES, s.owner)
        except FileNotFoundError:
            continue
        except Exception as exc:  # noqa: BLE001 - unreadable (a link, another uid's file): ignored, the next commit rewrites it
            _ignored(path, f"{type(exc).__name__}: {exc}")
            continue
        named = _opened(raw, k2, s.hmac_key)
        if isinstance(named, str):
            _ignored(path, named)
            continue
        yield s, layout.entry_dir(s.root, *named)


def find(store: Store, env: Environment, k2: str) -> tuple[Store, Path] | None:
    """The first of :func:`candidates`, or None."""
    return next(candidates(store, env, k2), None)


def _record_value(key: CacheKey) -> bytes:
    return msgpack.packb({"namespace": key.env.namespace, "digest": key.digest, "site": key.site, "written": time.time()},
                         use_bin_type=True)


def _named(raw: bytes) -> tuple[str, str] | None:
    """``(namespace, digest)`` a record names, or None when it names nothing an entry could be."""
    record = msgpack.unpackb(raw, raw=False)
    ns, digest = record["namespace"], record["digest"]
    if isinstance(ns, str) and isinstance(digest, str) and layout.valid_namespace(ns) and layout.DIGEST_RE.fullmatch(digest):
        return ns, digest
    return None


#: Records already warned about in this process (path, or a remote record's name): one warning each.
_WARNED: set[str] = set()
_warned_lock = threading.Lock()


def _ignored(where: Path | str, why: str) -> None:
    """One warning per record that is not followed (and so never linked or exported)."""
    with _warned_lock:
        first = str(where) not in _WARNED
        _WARNED.add(str(where))
    if first:
        log.warning("cute-diskcache ignores second-stage record %s: %s", where, why)


def sealed_record(key: CacheKey, k2: str, hmac_key: bytes | None) -> bytes:
    """``key``'s record, as a root and the remote tier store it: bound to ``k2`` and, where the
    entries are signed, signed with that key. A copied record under another ``k2`` or a forged
    one would otherwise point a kernel at another verified entry."""
    return _seal(_record_value(key), k2, hmac_key)


def _seal(raw: bytes, k2: str, hmac_key: bytes | None) -> bytes:
    sig = trust.sign_record(hmac_key, k2, raw) if hmac_key else ""
    return msgpack.packb({"record": raw, "k2": k2, "sig": sig}, use_bin_type=True)


def _opened(value: bytes, k2: str, hmac_key: bytes | None) -> tuple[str, str] | str:
    """``(namespace, digest)`` a sealed record for ``k2`` names, or why it is refused."""
    try:
        sealed = msgpack.unpackb(value, raw=False)
        if not isinstance(sealed, dict) or "k2" not in sealed:
            return "not bound to a second-stage key (written by an older version, or not a record)"
        raw, bound, sig = sealed["record"], sealed["k2"], sealed.get("sig")
        if bound != k2:
            return "written for another second-stage key"
        if not isinstance(raw, bytes) or len(raw) > _MAX_RECORD_BYTES:
            return "damaged"
        if hmac_key is not None:
            if not sig:
                return "not signed and CUTE_DISKCACHE_HMAC_KEY is set"
            if not trust.record_signature_ok(hmac_key, k2, raw, sig):
                return "signature does not match (another key, or the record was altered)"
        named = _named(raw)
    except Exception as exc:  # noqa: BLE001 - damaged
        return f"undecodable: {type(exc).__name__}"
    return named if named is not None else "names nothing an entry could be"


def sealed_local_records(root: Path, hmac_key: bytes | None) -> Iterator[tuple[str, str, str, bytes]]:
    """``(scope, k2, namespace named, sealed value)`` of every record under ``root`` that opens
    with ``hmac_key`` (bound to its ``k2``, signed where there is a key): what ``export
    --to-remote`` publishes beside the entries, as stored. One that does not open is never
    published (one warning)."""
    base = Path(root) / REUSE_DIR
    for path in sorted(base.glob("*/??/*")):
        scope_name, k2 = path.parent.parent.name, path.name
        if not layout.DIGEST_RE.fullmatch(k2):
            continue
        try:
            value = entry.read_bounded(path, _MAX_SEALED_BYTES, None)
        except Exception as exc:  # noqa: BLE001 - damaged: not published
            _ignored(path, f"{type(exc).__name__}: {exc}")
            continue
        named = _opened(value, k2, hmac_key)
        if isinstance(named, str):
            _ignored(path, named)
            continue
        yield scope_name, k2, named[0], value


def open_sealed(value: bytes, k2: str, hmac_key: bytes | None, where: str | None = None) -> tuple[str, str] | None:
    """``(namespace, digest)`` of a :func:`sealed_record` for ``k2``; None for anything else (a
    record of another ``k2``, or unsigned or badly signed where this process holds a key), with
    one warning naming ``where`` when given. The entry it names is verified as any import
    before it is linked."""
    named = _opened(value, k2, hmac_key)
    if isinstance(named, str):
        if where is not None:
            _ignored(where, named)
        return None
    return named


def write_record(store: Store, key: CacheKey, k2: str) -> bool:
    """Record that ``k2`` is ``key``'s entry (atomic; an existing record is replaced: the newest
    entry is the one an old release's prune leaves), sealed for ``k2`` and signed with the
    store's key (:func:`sealed_record`). False when the root refused."""
    if not store.writable:
        return False
    path = _record_path(store.root, scope(key.env), k2)
    marker = path.parent.parent / _FROM / release(key.env)
    try:
        if not marker.exists():
            store.make_dirs(marker.parent)
            entry.atomic_write(marker, b"")
        store.make_dirs(path.parent)
        entry.atomic_write(path, sealed_record(key, k2, store.hmac_key))
    except OSError as exc:
        log.debug("second-stage record for %s not written: %s", key.digest[:12], exc)
        return False
    return True


def prune(root: Path, *, dry_run: bool = False) -> int:
    """Remove the records under ``root`` that name no entry here any more (its namespace pruned,
    the entry evicted or quarantined) or that do not open, and each scope's ``from/<release>``
    marker of a release no remaining record names an entry of: without it an old release's
    marker outlives its entries, and every first-stage miss of the next release traces for
    nothing. Returns how many records went. An engine that reads a record while it goes, or
    links an entry that goes, compiles (:func:`link` verifies what it links).

    A marker written between this walk and its removal (a writer of that release, now) can be
    taken: that release's next record puts it back; until then a miss compiles instead of
    tracing, never a wrong kernel."""
    base = Path(root) / REUSE_DIR
    removed = 0
    for scope_dir in sorted(p for p in base.glob("*") if p.is_dir() and not p.is_symlink()):
        live: set[str] = set()
        for path in sorted(scope_dir.glob("??/*")):
            if not layout.DIGEST_RE.fullmatch(path.name):
                continue
            named = None
            try:
                named = _opened(entry.read_bounded(path, _MAX_SEALED_BYTES, None), path.name, None)
                if not isinstance(named, str):
                    package = entry.read_manifest(layout.entry_dir(Path(root), *named))["env"].get("package", "")
                    live.add(_release_of(str(package)))
                    continue
            except (OSError, entry.EntryError):
                pass  # no entry there (or the record is unreadable): the record goes
            removed += 1
            if not dry_run:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        for marker in sorted((scope_dir / _FROM).glob("*")):
            if marker.name not in live and not dry_run:
                with contextlib.suppress(FileNotFoundError):
                    marker.unlink()
    return removed


class NotReusable(Exception):
    """The entry a record names cannot serve this key (gone, damaged, another environment)."""


def link(store: Store, key: CacheKey, source_store: Store, source: Path) -> dict[str, Any]:
    """Write ``key``'s entry in ``store`` from the entry at ``source`` (in ``source_store``: this
    root or a layer) and return its manifest; raises :class:`NotReusable` or ``OSError``.

    The source is read and every payload verified first (its seal, signature, checksums, its
    own key's consistency) and its environment must equal this key's in everything but the
    flashinfer release and sources (:data:`_SHARED_ENV`). The new manifest is the source's with
    this key's identity (digest, namespace, environment, site, key) and ``reused_from`` naming
    the source; its payload files are hard links of the source's (a copy across filesystems or
    where the filesystem refuses links). What the source recorded of its compile (symbol,
    compile seconds, host CPU, device facts, side data) is kept: the IR, the DSL stack and
    ``Plan.context`` decide them, and the hit that follows checks host CPU and device facts.
    """
    bad = trust.first_untrusted(source_store.root, source, owner=source_store.owner)
    if bad is not None:
        raise NotReusable(f"{bad[0]}: {bad[1]}")
    try:
        manifest = entry.read_manifest(source, hmac_key=source_store.hmac_key, owner=source_store.owner)
        entry.verify(source, manifest, None, owner=source_store.owner)
    except entry.EntryError as exc:
        raise NotReusable(f"{source.name[:12]}: {exc}") from None
    if manifest["namespace"] != source.parent.parent.name:  # the digest is checked against its directory by verify
        raise NotReusable(f"{source.name[:12]}: its manifest is another namespace's entry")
    ours = key.env.as_dict()
    differ = [f for f in _SHARED_ENV if manifest["env"].get(f) != ours[f]]
    if manifest.get("format") != FORMAT_VERSION or differ:
        raise NotReusable(f"{source.name[:12]} was built for another {', '.join(differ) or 'format'}")
    if manifest["digest"] == key.digest:
        raise NotReusable("the record names this key's own entry")
    dest = store.entry_dir(key)
    store.make_layout()
    store.make_dirs(dest)
    for items in manifest["payloads"].values():
        for item in items:
            _place(source / item["file"], dest / item["file"], item)
    new = entry.build_manifest(key, _artifact_of(manifest), manifest["payloads"])
    for field in ("symbol", "tvm_ffi", "compile_seconds", "export_seconds", "host_isa", "device", "extra"):
        new[field] = manifest[field]
    new["host_cpu"] = manifest.get("host_cpu", "native")  # the same object: what it was written for
    if "host_cpu_asked" in manifest:
        new["host_cpu_asked"] = manifest["host_cpu_asked"]
    else:
        new.pop("host_cpu_asked", None)
    new["reused_from"] = {"namespace": manifest["namespace"], "digest": manifest["digest"],
                          "package": manifest["env"].get("package", ""), "site": manifest["site"]}
    entry.atomic_write(dest / entry.MANIFEST, entry.pack_manifest(new, hmac_key=store.hmac_key))
    entry.fsync_dir(dest)
    return new


def _place(src: Path, dst: Path, item: dict[str, Any]) -> None:
    """``dst`` holds ``src``'s verified bytes: a hard link, else a copy (atomic either way; the
    copy is checked again, as the link is, since ``src`` may have changed since it was verified)."""
    if dst.exists() and entry.holds(dst, item["size"], item["sha256"]):
        return
    tmp = dst.with_name(f".tmp.{dst.name}.{os.getpid()}.{os.urandom(6).hex()}")
    try:
        os.link(src, tmp, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES, errno.EROFS):
            raise
        _copy(src, tmp)
    try:
        if not entry.holds(tmp, item["size"], item["sha256"]):  # changed since it was verified
            raise NotReusable(f"{src.name} changed under the link")
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()


def _copy(src: Path, dst: Path) -> None:
    """``src``'s bytes into a new ``dst`` with the mode every payload file gets (0644, as
    :func:`.entry.atomic_write` makes them), not ``shutil``'s 0666 less the umask: under a umask
    of 002 that copy is group-writable, and the hit that follows refuses it as untrusted."""
    flags = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    with open(os.open(src, os.O_RDONLY | flags), "rb") as fin, \
            open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o644), "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
        fout.flush()
        os.fsync(fout.fileno())


def _artifact_of(manifest: dict[str, Any]) -> entry.Artifact:
    """An :class:`.entry.Artifact` carrying the source manifest's records (no bytes: the payloads
    are placed by :func:`link`), for :func:`.entry.build_manifest`."""
    return entry.Artifact(object_bytes=b"", symbol=manifest["symbol"], tvm_ffi=manifest["tvm_ffi"], cubins=[], mlir_text=None,
                          compile_seconds=float(manifest["compile_seconds"]),
                          export_seconds=float(manifest.get("export_seconds", 0.0)), extra=manifest["extra"],
                          device=manifest["device"])


def reused_from(manifest: dict[str, Any]) -> str:
    """``flashinfer 0.7.2.post1`` (what the log line says an entry was reused from)."""
    source = manifest.get("reused_from") or {}
    package = str(source.get("package", ""))
    name, _, version = package.partition("==")
    return f"{name.removesuffix('-python')} {version}" if version else (source.get("namespace") or "another release")


__all__ = ["NotReusable", "Plan", "REUSE_DIR", "candidates", "find", "link", "open_sealed", "possible", "prune", "release", "releases", "reused_from", "scope", "sealed_local_records",
           "sealed_record", "write_record"]
