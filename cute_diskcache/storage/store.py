"""Storage: where entries live, how they are committed, and what happens when the disk says no.

Layout: see :mod:`.layout`. The store knows nothing of flashinfer or of kernels: it maps a
:class:`~..keys.key.CacheKey` to a verified entry, or commits a new one. Every filesystem failure
on the write side turns the store read-only-in-memory for the rest of the process with one
warning, except two that pass: a directory removed under us (eviction, ``rm -rf``) is retried,
and a full disk first evicts least recently used entries and retries once. A failure on the
read side is a miss. Nothing here raises into the caller's compile path.

Trust (see :mod:`.trust`): the root is checked at first use (one log line when refused); every
lookup then checks each level from the root to the entry (owner, mode, links) and every file it
reads, and every level a commit creates gets an explicit mode. A root that root (or a trusted
group's member) owns and this uid cannot write is trusted and read-only: one INFO line at
first use, hits served, misses compiled in memory.

Layers (``CUTE_DISKCACHE_READ_DIRS``): read-only roots looked up after this one, in order, the
way ``XDG_DATA_DIRS`` is searched after ``XDG_DATA_HOME`` and overlayfs reads its lower layers
under the upper: an image-baked cache under a volume or node-local root that takes the new
entries. A hit from a layer is loaded from there, not copied up: reading it costs what reading
our own copy would (the same verify, the same page cache), a copy would double the disk a baked
cache takes on every node's volume and make a hit write, and on a full or read-only volume it
could not be made anyway. A layer is never written, locked or quarantined (a damaged entry there
is a miss with one warning). ``stats``, ``list``, ``verify`` and eviction see the writable root
only.

Quarantine is for entries that are damaged (:data:`.entry.CORRUPT`); an entry that is sound
but not for this process (another CPU, device or signing key) is a miss and stays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Sequence

from . import entry, eviction, housekeeping, layout, locking, stats, trust
from ..keys import hostcpu
from ..keys.key import CacheKey
from .layout import LAYOUT

log = logging.getLogger("cute_diskcache")

__all__ = ["LAYOUT", "Store"]

#: A commit whose directory vanishes under it (eviction, ``rm -rf``) is tried this many times.
_COMMIT_TRIES = 3
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class Store:
    """One cache root, and the read-only layers looked up after it (``read_dirs``)."""

    def __init__(
        self,
        root: Path,
        *,
        readonly: bool = False,
        trust_shared: bool = False,
        hmac_key: bytes | None = None,
        trust_group: int | None = None,
        read_dirs: Sequence[Path] = (),
    ) -> None:
        self.root = Path(root)
        self._entry_dirs: dict[str, Path] = {}
        self.readonly = readonly
        self.trust_shared = trust_shared
        self.trust_group = trust_group
        self.hmac_key = hmac_key or None
        # Whose files and directories we accept: ours and root's, plus a trusted group's members,
        # or anyone's when the operator trusts everyone who can write the root.
        self.owner: int | None = None if trust_shared else trust.Owner(os.geteuid(), trust_group)
        self.layers: tuple[Store, ...] = tuple(
            Store(Path(d), readonly=True, trust_shared=trust_shared, hmac_key=hmac_key, trust_group=trust_group)
            for d in read_dirs
            if Path(d) != self.root
        )
        self._write_disabled_reason: str | None = None
        self._refusal: str | None = None  # why the root is not trusted, once checked
        self._trust_checked = False
        self._root_probed = False
        self._foreign_owner: int | None = None  # who owns the root we trust but cannot write, until said once
        self._reported: set[tuple[str, str]] = set()  # (path, reason) already warned about
        self.rejected = 0  # entries found but refused by a check, this process
        # A prewarm's store: an entry whose host code is tuned beyond what this process writes
        # (a native one from an earlier release) is a miss, so the prewarm rebuilds it portable.
        self.rebuild_tuned = False
        self._lock = threading.Lock()

    # -- paths --------------------------------------------------------------------------------

    @classmethod
    def for_settings(cls, settings: Any, root: Path | None = None, *, layers: bool = True) -> Store:
        """The store the settings describe (``root``: another root, e.g. a CLI's ``--root``).

        Every door builds its store here, so the engine, ``stats``, ``verify`` and ``import``
        trust the same writers and read the same layers.
        """
        return cls(settings.root if root is None else Path(root), readonly=settings.readonly,
                   trust_shared=settings.trust_shared, hmac_key=settings.hmac_key, trust_group=settings.trust_group,
                   read_dirs=settings.read_dirs if layers else ())

    def entry_dir(self, key: CacheKey) -> Path:
        # Asked three times on every hit; the path of one key under one root never changes.
        found = self._entry_dirs.get(key.digest)
        if found is None:
            found = self._entry_dirs[key.digest] = layout.entry_dir(self.root, key.env.namespace, key.digest)
            if len(self._entry_dirs) > 4096:
                self._entry_dirs.clear()
        return found

    @property
    def quarantine_dir(self) -> Path:
        return self.root / layout.QUARANTINE_DIR

    @property
    def trusted(self) -> bool:
        """Whether only this user and root can write the root (or the operator trusts who else can).

        Checked once, at first use; a refusal is logged once, with the reason. Each lookup also
        checks every level down to its entry (:func:`.trust.first_untrusted`).
        """
        if not self._trust_checked:
            self._check_trust()
        return self._refusal is None

    def _check_trust(self) -> None:
        bad = None if self.trust_shared else trust.refused_level(self.root, subdirs=(LAYOUT, locking.LOCKS_DIR), group=self.trust_group)
        foreign = None if bad is not None or self.readonly else _foreign_read_only(self.root)
        with self._lock:
            if self._trust_checked:
                return
            self._refusal = bad[1] if bad is not None else None
            if foreign is not None and self._write_disabled_reason is None:
                self._write_disabled_reason = "read-only for this uid"
                self._foreign_owner = foreign
            self._trust_checked = True
        if bad is not None:
            log.warning(
                "cute-diskcache refuses cache root %s: %s; nothing is read from or written to it and kernels compile "
                "in memory (%s)",
                self.root,
                bad[1],
                trust.remedy(bad[0], self.trust_group),
            )

    def _say_foreign_read_only(self) -> None:
        """The one line for a root baked by someone else that we cannot write, at the first miss:
        when it matters (the compile stays in memory), and after the attach line set up logging."""
        with self._lock:
            owner, self._foreign_owner = self._foreign_owner, None
        if owner is not None:
            log.info(
                "cache root %s is owned by %s and read-only for uid %d: serving its entries, new kernels stay in memory",
                self.root,
                "root" if owner == 0 else f"uid {owner}",
                os.geteuid(),
            )

    @property
    def writable(self) -> bool:
        return not self.readonly and self._write_disabled_reason is None and self.trusted

    def probe_writable(self) -> bool:
        """:attr:`writable`, after asking the filesystem once (the first time a write is wanted).

        A root on a read-only mount or without write permission becomes read-only-in-memory
        here, with the same single warning a failed write gives, before any compile is spent
        on an export that could not be stored. Not done at construction: a process that only
        hits a read-only cache must not warn.
        """
        if not self.writable:
            if self._foreign_owner is not None:
                self._say_foreign_read_only()
            return False
        if not self._root_probed:
            self._root_probed = True
            try:
                self.make_layout()  # before anything else creates the root with the umask's mode
            except OSError as exc:
                self.disable_writes(exc)
                return False
            if not os.access(self.root, os.W_OK | os.X_OK):
                try:
                    read_only_fs = bool(os.statvfs(self.root).f_flag & os.ST_RDONLY)
                except OSError:
                    read_only_fs = False
                code = errno.EROFS if read_only_fs else errno.EACCES
                self.disable_writes(OSError(code, os.strerror(code), str(self.root)))
        return self.writable

    def make_layout(self) -> None:
        """The root and ``v1/``, with our mode. Every commit asks again (two ``mkdir``s that find
        the directory there): a root deleted under a running engine is remade private, not with
        the umask's mode that would make every later process refuse it."""
        self.make_dirs(self.root / LAYOUT)

    @property
    def bookkeeping_shared(self) -> bool:
        """Whether the size counter, lock files and their directories are made for others to
        update too: under ``TRUST_SHARED``, and under a trusted group (other members' processes
        commit into the same root). Their modes then follow the umask (0666/0777 less it): a pod
        sharing a volume with other uids runs with umask 002; under 022 the other uids compile
        without the lock and keep the size cap by walking, with one warning. Nothing is ever
        loaded from these files, so their modes are no trust question."""
        return self.trust_shared or self.trust_group is not None

    def make_dirs(self, path: Path) -> None:
        """:func:`.trust.make_dirs` down to ``path`` with this root's modes (the group only when one is
        trusted: the plain form stays the one every other caller uses). Every directory made under
        the root goes through here or passes :attr:`trust_group` on (locks, statistics, imports):
        one made with the umask's mode and this process's own group is one the next process's
        trust check refuses, or one the group's other uids cannot write (issue 29)."""
        trust.make_dirs(self.root, path, shared=self.trust_shared, **({"group": self.trust_group} if self.trust_group is not None else {}))

    def _warn_once(self, path: Path, reason: str, message: str, *args: Any) -> bool:
        """Log ``message`` once per (path, reason) in this process; True the first time."""
        with self._lock:
            first = (str(path), reason) not in self._reported
            self._reported.add((str(path), reason))
        if first:
            log.warning(message, *args)
        return first

    # -- read side ----------------------------------------------------------------------------

    def lookup_or_quarantine(self, key: CacheKey, *, load: bool = False) -> Found | None:
        """A verified ``(manifest, bytes)`` for ``key`` (a :class:`Found`), or None.

        Without ``load`` every payload is checked and the bytes are the object's. With ``load``
        (a hit about to load it) only the payload that will be loaded is read and hashed: the
        linked shared object when the entry has one and this process can load it
        (:func:`.loader.shared_supported`), else the object; ``Found.role`` says which.

        A damaged entry is quarantined (when we may write); a sound one that does not fit this
        process (host CPU, device facts, signature) is a miss and stays. A payload that vanishes
        between reading the manifest and reading the payload is a writer or an eviction at work:
        read again once, and never quarantine what may by then be someone's fresh entry.

        Then each read-only layer, in order, when this root has no usable entry.
        """
        found = self._lookup(key, load) if self.trusted else None
        if found is None and self.layers:
            for layer in self.layers:
                found = layer.lookup_or_quarantine(key, load=load)
                if found is not None:
                    return found
        return found

    def _lookup(self, key: CacheKey, load: bool) -> Found | None:
        """:meth:`lookup_or_quarantine` in this root alone: :meth:`judge`, then act on a refusal."""
        path = self.entry_dir(key)
        for attempt in range(2):
            before = _manifest_stat(path)
            verdict = self.judge(key, load=load)
            if not isinstance(verdict, Refusal):
                return verdict
            exc = verdict.error
            if verdict.where != path:  # a directory above the entry: every entry under it is a miss
                if self._warn_once(verdict.where, "path", "cute-diskcache refuses %s: %s; entries under it are misses", verdict.where, exc.detail):
                    self.rejected += 1
                return None
            if exc.reason in ("link", "untrusted"):  # the entry itself (a link, a directory we did not make): set it aside
                self.quarantine(path, exc)
                return None
            if not verdict.corrupt:
                self.note_refusal(path, exc)
                return None
            if _manifest_stat(path) != before:  # rewritten, evicted or quarantined while we read
                if attempt == 0:
                    continue
                return None
            self.quarantine(path, exc, expect=before)
            return None
        return None

    def judge(self, key: CacheKey, *, load: bool = False) -> Found | Refusal | None:
        """What this root holds for ``key``, judged and never acted on: a verified entry, why it
        would be refused, or None (no entry).

        The one place the checks of a lookup live (trust of every level, seal, signature, key,
        environment, host CPU, device facts, checksums): a lookup acts on the verdict (quarantine,
        one warning), ``cute-diskcache check`` reports it without touching anything.
        """
        path = self.entry_dir(key)
        bad = trust.first_untrusted(self.root, path, owner=self.owner)
        if bad is not None:
            where, why = bad
            reason = "link" if where == path and os.path.islink(path) else "untrusted"
            return Refusal(entry.EntryError(reason, why), where, corrupt=where == path)
        manifest: dict[str, Any] | None = None
        try:
            manifest = entry.read_manifest(path, hmac_key=self.hmac_key, owner=self.owner)
            role = _role_to_load(manifest) if load else None
            data = entry.verify(path, manifest, key, owner=self.owner, role=role)
        except entry.EntryError as exc:
            if exc.reason == "absent":
                return None
            # A file where the entry's directory should be is as foreign as a bad manifest.
            corrupt = exc.reason in entry.CORRUPT or (exc.reason == "unreadable" and os.path.lexists(path) and not os.path.isdir(path))
            return Refusal(exc, path, corrupt, manifest)
        if self.rebuild_tuned and (beyond := _tuned_beyond_asked(manifest)):
            why = (f"its host code needs {', '.join(beyond[:6])}, beyond {hostcpu.host_code().name}; "
                   "rebuilt for every serving CPU")
            return Refusal(entry.EntryError("tuned", why), path, False, manifest)
        return Found(manifest, data, role or "object")

    def rebuild_tuned_entries(self) -> None:
        """Make every lookup of this store and its layers treat a tuned entry as a miss (prewarm)."""
        for store in (self, *self.layers):
            store.rebuild_tuned = True

    def read_role(self, key: CacheKey, role: str) -> tuple[bytes, str] | None:
        """A verified payload of ``key``'s entry other than the one a hit loaded, and its file
        name (the MLIR or the object a caller asks a loaded kernel for), from this root or a
        layer; None when none holds it. Judged like a lookup; never acts on a refusal."""
        for store in (self, *self.layers):
            path = store.entry_dir(key)
            if not store.trusted or trust.first_untrusted(store.root, path, owner=store.owner) is not None:
                continue
            try:
                manifest = entry.read_manifest(path, hmac_key=store.hmac_key, owner=store.owner)
                data = entry.verify(path, manifest, key, owner=store.owner, role=role)
            except entry.EntryError:
                continue
            return data, manifest["payloads"][role][0]["file"]
        return None

    def note_refusal(self, path: Path, exc: entry.EntryError) -> None:
        """A sound entry this process cannot use: a miss, counted and reported once; it stays."""
        if exc.reason == "tuned":  # a prewarm rebuilding it portable: its own summary says so
            log.debug("cache entry %s: %s", path.name, exc.detail)
            self.rejected += 1
            return
        if exc.reason == "signature" and exc.detail == entry.UNSIGNED:
            message = "cache entry %s is not signed (CUTE_DISKCACHE_HMAC_KEY is set); recompiling and signing it"
            args: tuple[Any, ...] = (path.name,)
        else:
            message = "cache entry %s does not fit this process (%s); compiling here, the entry stays for the hosts it fits"
            args = (path.name, exc)
        if self._warn_once(path, exc.reason, message, *args):  # a miss re-reads the store under its lock
            self.rejected += 1

    def quarantine(self, path: Path, exc: entry.EntryError, *, expect: tuple[int, int, int] | None = None) -> None:
        """Move a bad entry aside (kept for post-mortems, within bounds), so the next compile can rewrite it.

        ``expect``: the manifest's identity when the entry was judged; if it changed since (a
        writer replaced it), the path now holds someone else's entry and is left alone.
        """
        self.rejected += 1
        stats.record(path.parent.parent.name, "quarantined")
        if not self.writable:  # a read-only root or layer: the entry stays, so say so once, not at every lookup
            self._warn_once(path, exc.reason, "cache entry %s under read-only %s rejected (%s); a miss, the entry stays",
                            path.name, self.root, exc)
            return
        log.warning("cache entry %s rejected (%s); recompiling", path.name, exc)
        dest = self.quarantine_dir / f"{time.strftime('%Y%m%dT%H%M%S')}-{exc.reason}-{path.name}-{os.urandom(3).hex()}"
        try:
            self.make_dirs(self.quarantine_dir)
            if expect is not None and _manifest_stat(path) != expect:
                return
            os.replace(path, dest)  # a link moves as a link: its target is never touched
        except FileNotFoundError:
            return  # another process quarantined it first
        except OSError as move_err:
            # Cross-device or permission trouble: deleting still unblocks the rewrite.
            log.debug("quarantine move failed (%s); removing %s", move_err, path)
            if os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
            return
        with contextlib.suppress(OSError):
            housekeeping.trim_quarantine(self.root)

    # -- write side ---------------------------------------------------------------------------

    def commit(self, key: CacheKey, art: entry.Artifact) -> dict[str, Any] | None:
        """Persist ``art``; returns its manifest, or None if the disk refused (then warns once)."""
        if not self.probe_writable():
            return None
        try:
            return self._commit_retrying(key, art)
        except OSError as exc:
            self.disable_writes(exc)
            return None

    def persist(self, key: CacheKey, make_artifact: Callable[[Path], entry.Artifact]) -> dict[str, Any] | None:
        """Export and commit: ``make_artifact(workdir)`` builds the artifact in scratch space inside
        the root (never ``/tmp``), then it is committed. A full disk during either step evicts and
        retries once. Returns the manifest, or None (the disk refused: one warning, as :meth:`commit`).
        Exceptions of ``make_artifact`` other than ``OSError`` propagate (the caller counts them).
        """
        if not self.probe_writable():
            return None
        for attempt in range(2):
            try:
                with self.scratch("export") as work:
                    art = make_artifact(work)
                return self._commit_retrying(key, art, full_disk_retry=False)
            except OSError as exc:
                if attempt == 0 and exc.errno in _DISK_FULL and self._make_room(key, 0):
                    continue
                if exc.errno == errno.ENOENT:  # our scratch or entry vanished under us (rm -rf): a miss, not a broken disk
                    log.debug("persisting %s: %s", key.digest[:12], exc)
                    return None
                self.disable_writes(exc)
                return None
        return None

    def _commit_retrying(self, key: CacheKey, art: entry.Artifact, *, full_disk_retry: bool = True) -> dict[str, Any] | None:
        """Write the entry; raises OSError when the disk refuses. None: never write through a link."""
        path = self.entry_dir(key)
        full_tried = not full_disk_retry
        tries = 0
        while True:
            tries += 1
            try:
                link = trust.first_link(self.root, path)
                if link == path:
                    self.quarantine(path, entry.EntryError("link", f"{path.name} is a symbolic link"))
                elif link is not None:
                    if self._warn_once(link, "path", "cute-diskcache refuses %s: a symbolic link inside the cache root is never followed", link):
                        self.rejected += 1
                    return None  # never write through a link
                self.make_layout()
                self.make_dirs(path)
                before = layout.entry_bytes(path)
                # hmac_key only when set: entry.write's three-argument form stays the plain one.
                manifest = entry.write(path, key, art, **({"hmac_key": self.hmac_key} if self.hmac_key else {}))
            except FileNotFoundError:
                if tries < _COMMIT_TRIES:  # a directory vanished between mkdir and write: make it again
                    continue
                raise
            except OSError as exc:
                if exc.errno in _DISK_FULL and not full_tried:
                    full_tried = True
                    if self._make_room(key, len(art.object_bytes)):
                        continue
                raise
            break
        added = layout.entry_bytes(path) - before
        try:
            eviction.note_commit(self.root, added, entry_dir=path, shared=self.bookkeeping_shared)
        except OSError as exc:  # a cap we cannot enforce never costs the kernel just written
            log.warning("size cap not enforced: %s", exc)
        return manifest

    def _make_room(self, key: CacheKey, need: int) -> bool:
        """The disk is full: evict least recently used entries (at least twice what is needed)."""
        try:
            freed = eviction.make_room(self.root, max(2 * need, 4 << 20), keep=self.entry_dir(key))
        except OSError as exc:
            log.debug("could not make room under %s: %s", self.root, exc)
            return False
        return freed > 0

    def scratch_dir(self, purpose: str) -> Path:
        """A fresh private directory under ``<root>/tmp``: on the entries' filesystem, so what is
        staged there moves into ``v1/`` with one rename. The caller removes it (housekeeping
        takes what a killed process left, after an hour)."""
        base = self.root / layout.TMP_DIR
        self.make_dirs(base)
        path = base / f"{purpose}-{_host()}-{os.getpid()}-{os.urandom(4).hex()}"
        path.mkdir(mode=0o700)
        return path

    @contextlib.contextmanager
    def scratch(self, purpose: str) -> Iterator[Path]:
        """:meth:`scratch_dir`, removed after."""
        path = self.scratch_dir(purpose)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def maintain(self) -> None:
        """Hourly housekeeping and the daily size reconcile (:func:`.housekeeping.maintain`), if due.

        The cache calls it after a commit, once the compile lock is released; never raises.
        """
        if not self.writable:
            return
        try:
            housekeeping.maintain(self.root, shared=self.bookkeeping_shared, group=self.trust_group)
        except Exception as exc:  # noqa: BLE001 - bookkeeping must never cost a kernel
            log.debug("maintenance of %s skipped: %s", self.root, exc)

    @contextlib.contextmanager
    def single_flight(self, key: CacheKey, timeout: float = locking.DEFAULT_TIMEOUT_S) -> Iterator[locking.Flight]:
        """Hold ``key``'s compile lock for the body, when this store may write (see :mod:`.locking`).

        A store that cannot write takes no lock: nobody could load what its compile produces.
        """
        if not self.probe_writable():
            yield locking.Flight(False, "off")
            return
        with locking.single_flight(
            self.root, key.digest, timeout=timeout, label=f"{key.site} {key.digest[:12]}", shared=self.bookkeeping_shared,
            group=self.trust_group,
        ) as flight:
            yield flight

    def disable_writes(self, exc: OSError) -> None:
        """Stop writing for the rest of the process, with one warning saying why."""
        with self._lock:
            if self._write_disabled_reason is not None:
                return
            kind = {
                errno.EROFS: "read-only filesystem",
                errno.EACCES: "permission denied",
                errno.EPERM: "permission denied",
                errno.ENOSPC: "disk full",
                errno.EDQUOT: "over quota",
                errno.EFBIG: "file size limit",
            }.get(exc.errno or 0, exc.strerror or type(exc).__name__)
            self._write_disabled_reason = kind
        log.warning(
            "cute-diskcache cannot write to %s (%s: %s); kernels keep working from memory for this process",
            self.root,
            kind,
            exc,
        )


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a root's entry for a key would not be loaded (:meth:`Store.judge`)."""

    error: entry.EntryError
    #: the level refused: the entry's directory, or a directory above it
    where: Path
    #: damaged (a lookup quarantines it), as against sound but not for this process
    corrupt: bool
    #: the entry's manifest when it was read before the refusal (e.g. host CPU: what it needs)
    manifest: dict[str, Any] | None = None


class Found(tuple):  # type: ignore[type-arg]
    """``(manifest, bytes)`` of a verified entry, and which payload the bytes are (``role``)."""

    role: str

    def __new__(cls, manifest: dict[str, Any], data: bytes, role: str = "object") -> Found:
        found = super().__new__(cls, (manifest, data))
        found.role = role
        return found


def side_data_refusal(extra: Any, extra_ok: Callable[[dict[str, Any]], bool] | None) -> entry.EntryError | None:
    """Why an entry's side data (its manifest's ``extra``) is refused by its site's check, or None.

    The one judgement a hit (:meth:`..core.cache.CompileCache.get_or_compile`) and the deploy gate
    (:func:`..cli.coverage.inspect`, ``check``) both apply, so the gate never says "ok" of an entry
    the engine then misses. A checker that trips over odd data has answered "no".
    """
    if extra_ok is None:
        return None
    try:
        accepted = bool(extra_ok(extra))
    except Exception:  # noqa: BLE001 - the adapter's checker tripping over odd data has answered no
        accepted = False
    return None if accepted else entry.EntryError("extra", "its side data is not of the shape this version stores")


def _role_to_load(manifest: dict[str, Any]) -> str:
    """The payload a hit loads: the linked shared object when there is one and it can be loaded here."""
    if manifest["payloads"].get("shared") and manifest.get("tvm_ffi"):
        from . import loader

        if loader.shared_supported():
            return "shared"
    return "object"


def _tuned_beyond_asked(manifest: dict[str, Any]) -> list[str]:
    """What an entry's host code needs beyond what this process writes, when its writer was asked
    for something else (an earlier release's entry, or a ``native`` one): a prewarm rebuilds it.
    An entry whose writer was asked for the same and could not do better (a DSL that writes
    only native code) stays: rebuilding it would write the same again, at every prewarm."""
    if manifest.get("host_cpu_asked") == hostcpu.host_code().name:
        return []
    return hostcpu.tuned_beyond(manifest.get("host_isa") or [])


def _foreign_read_only(root: Path) -> int | None:
    """The owner of the root (or its ``v1/``) when someone else owns it and this uid cannot write
    it (a cache baked as root, served as a user), else None. Trust is decided before: here only
    whether to write."""
    euid = os.geteuid()
    for path in (root, root / LAYOUT):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid != euid and not os.access(path, os.W_OK | os.X_OK, effective_ids=True):
            return st.st_uid
    return None


def _manifest_stat(entry_dir: Path) -> tuple[int, int, int] | None:
    """The manifest's identity (inode, size, mtime): a commit replaces it, a removal takes it."""
    try:
        st = os.lstat(entry_dir / entry.MANIFEST)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _host() -> str:
    import socket

    return socket.gethostname()
