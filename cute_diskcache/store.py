"""Storage: where entries live, how they are committed, and what happens when the disk says no.

Layout under the root::

    v1/<namespace>/<digest[:2]>/<digest>/manifest.msgpack   (+ payloads)
    quarantine/<time>-<reason>-<digest>/                    (entries that failed a check)
    locks/<digest[:2]>/<digest>.lock                        (single-flight, see .locking)

The store knows nothing of flashinfer or of kernels: it maps a :class:`~.key.CacheKey` to a
verified entry, or commits a new one. Every filesystem failure on the write side turns the
store read-only-in-memory for the rest of the process with one warning; a failure on the read
side is a miss. Nothing here raises into the caller's compile path.

Trust (see :mod:`.trust`) is checked at first use: a root that other users can write is
refused with one log line and then serves nothing and writes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from . import entry, eviction, locking, stats, trust
from .key import CacheKey

log = logging.getLogger("cute_diskcache")

LAYOUT = "v1"


class Store:
    """One cache root."""

    def __init__(
        self,
        root: Path,
        *,
        readonly: bool = False,
        trust_shared: bool = False,
        hmac_key: bytes | None = None,
    ) -> None:
        self.root = Path(root)
        self.readonly = readonly
        self.trust_shared = trust_shared
        self.hmac_key = hmac_key or None
        self._write_disabled_reason: str | None = None
        self._refusal: str | None = None  # why the root is not trusted, once checked
        self._trust_checked = False
        self._root_probed = False
        self._layout_made = False
        self._links_reported: set[Path] = set()
        self._unsigned_reported: set[Path] = set()
        self.rejected = 0  # entries found but refused by a check, this process
        self._lock = threading.Lock()

    # -- paths --------------------------------------------------------------------------------

    def entry_dir(self, key: CacheKey) -> Path:
        return self.root / LAYOUT / key.env.namespace / key.digest[:2] / key.digest

    @property
    def quarantine_dir(self) -> Path:
        return self.root / "quarantine"

    @property
    def trusted(self) -> bool:
        """Whether only this user can write the root (or the operator trusts who else can).

        Checked once, at first use; a refusal is logged once, with the reason.
        """
        if not self._trust_checked:
            self._check_trust()
        return self._refusal is None

    def _check_trust(self) -> None:
        why = None if self.trust_shared else trust.root_refusal(self.root, subdirs=(LAYOUT, locking.LOCKS_DIR))
        with self._lock:
            if self._trust_checked:
                return
            self._refusal = why
            self._trust_checked = True
        if why is not None:
            log.warning(
                "cute-diskcache refuses cache root %s: %s; nothing is read from or written to it and kernels compile "
                "in memory (set CUTE_DISKCACHE_TRUST_SHARED=1 if everyone who can write it is trusted)",
                self.root,
                why,
            )

    @property
    def writable(self) -> bool:
        return not self.readonly and self._write_disabled_reason is None and self.trusted

    def can_write(self) -> bool:
        """:attr:`writable`, after asking the filesystem once (the first time a write is wanted).

        A root on a read-only mount or without write permission becomes read-only-in-memory
        here, with the same single warning a failed write gives, before any compile is spent
        on an export that could not be stored. Not done at construction: a process that only
        hits a read-only cache must not warn.
        """
        if not self.writable:
            return False
        if not self._root_probed:
            self._root_probed = True
            try:
                self._make_layout()  # before anything else creates the root with the umask's mode
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

    def _make_layout(self) -> None:
        """Create the root and ``v1/`` ourselves, never group/other-writable unless trusted shared."""
        if self._layout_made:
            return
        mode = trust.private_dir_mode(self.trust_shared)
        self.root.mkdir(mode=mode, parents=True, exist_ok=True)
        (self.root / LAYOUT).mkdir(mode=mode, exist_ok=True)
        self._layout_made = True

    def _link_in(self, path: Path) -> Path | None:
        """The first symbolic link between the root and ``path``.

        A link above the entry (namespace or shard directory) is reported and counted once per
        link; an entry directory that is a link is the caller's to quarantine (which reports it).
        """
        link = trust.first_link(self.root, path)
        if link is not None and link != path and link not in self._links_reported:
            self._links_reported.add(link)
            self.rejected += 1
            log.warning("cute-diskcache refuses %s: a symbolic link inside the cache root is never followed", link)
        return link

    # -- read side ----------------------------------------------------------------------------

    def lookup(self, key: CacheKey) -> tuple[dict[str, Any], bytes] | None:
        """A verified (manifest, object bytes) for ``key``, or None.

        A present but bad entry is quarantined (when we may write) and reported as a miss.
        """
        if not self.trusted:
            return None
        path = self.entry_dir(key)
        link = self._link_in(path)
        if link is not None:
            # The entry itself: moving the link aside is safe and lets the rewrite in. A namespace
            # or shard directory stays: moving it would move its target's contents.
            if link == path:
                self.quarantine(path, entry.EntryError("link", f"{path.name} is a symbolic link"))
            return None
        try:
            manifest = entry.read_manifest(path, hmac_key=self.hmac_key)
            obj = entry.verify(path, manifest, key)
        except entry.EntryError as exc:
            if exc.reason == "signature" and exc.detail == entry.UNSIGNED:
                if path not in self._unsigned_reported:  # a miss re-reads the store under its lock
                    self._unsigned_reported.add(path)
                    self.rejected += 1
                    log.warning("cache entry %s is not signed (CUTE_DISKCACHE_HMAC_KEY is set); recompiling and signing it", path.name)
            elif exc.reason != "absent":
                self.quarantine(path, exc)
            return None
        return manifest, obj

    def quarantine(self, path: Path, exc: entry.EntryError) -> None:
        """Move a bad entry aside (kept for post-mortems), so the next compile can rewrite it."""
        log.warning("cache entry %s rejected (%s); recompiling", path.name, exc)
        self.rejected += 1
        stats.record(path.parent.parent.name, "quarantined")
        if not self.writable:
            return
        dest = self.quarantine_dir / f"{time.strftime('%Y%m%dT%H%M%S')}-{exc.reason}-{path.name}-{os.urandom(3).hex()}"
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest)  # a link moves as a link: its target is never touched
        except FileNotFoundError:
            pass  # another process quarantined it first
        except OSError as move_err:
            # Cross-device or permission trouble: deleting still unblocks the rewrite.
            log.debug("quarantine move failed (%s); removing %s", move_err, path)
            if os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            else:
                shutil.rmtree(path, ignore_errors=True)

    # -- write side ---------------------------------------------------------------------------

    def commit(self, key: CacheKey, art: entry.Artifact) -> dict[str, Any] | None:
        """Persist ``art``; returns its manifest, or None if the disk refused (then warns once)."""
        if not self.can_write():
            return None
        path = self.entry_dir(key)
        try:
            self._make_layout()
            link = self._link_in(path)
            if link == path:
                self.quarantine(path, entry.EntryError("link", f"{path.name} is a symbolic link"))
                link = self._link_in(path)
            if link is not None:
                return None  # never write through a link
            # hmac_key only when set: entry.write's three-argument form stays the plain one.
            manifest = entry.write(path, key, art, **({"hmac_key": self.hmac_key} if self.hmac_key else {}))
        except OSError as exc:
            self.disable_writes(exc)
            return None
        try:
            eviction.enforce(self.root)
        except OSError as exc:  # a cap we cannot enforce never costs the kernel just written
            log.warning("size cap not enforced: %s", exc)
        return manifest

    @contextlib.contextmanager
    def single_flight(self, key: CacheKey, timeout: float = locking.DEFAULT_TIMEOUT_S) -> Iterator[locking.Flight]:
        """Hold ``key``'s compile lock for the body, when this store may write (see :mod:`.locking`).

        A store that cannot write takes no lock: nobody could load what its compile produces.
        """
        if not self.can_write():
            yield locking.Flight(False, "off")
            return
        with locking.single_flight(
            self.root, key.digest, timeout=timeout, label=f"{key.site} {key.digest[:12]}", shared=self.trust_shared
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
