"""Storage: where entries live, how they are committed, and what happens when the disk says no.

Layout under the root::

    v1/<namespace>/<digest[:2]>/<digest>/manifest.msgpack   (+ payloads)
    quarantine/<time>-<reason>-<digest>/                    (entries that failed a check)

The store knows nothing of flashinfer or of kernels: it maps a :class:`~.key.CacheKey` to a
verified entry, or commits a new one. Every filesystem failure on the write side turns the
store read-only-in-memory for the rest of the process with one warning; a failure on the read
side is a miss. Nothing here raises into the caller's compile path.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from . import entry, eviction, stats
from .key import CacheKey

log = logging.getLogger("cute_diskcache")

LAYOUT = "v1"


class Store:
    """One cache root."""

    def __init__(self, root: Path, *, readonly: bool = False) -> None:
        self.root = Path(root)
        self.readonly = readonly
        self._write_disabled_reason: str | None = None
        self.rejected = 0  # entries found but refused by a check, this process
        self._lock = threading.Lock()

    # -- paths --------------------------------------------------------------------------------

    def entry_dir(self, key: CacheKey) -> Path:
        return self.root / LAYOUT / key.env.namespace / key.digest[:2] / key.digest

    @property
    def quarantine_dir(self) -> Path:
        return self.root / "quarantine"

    @property
    def writable(self) -> bool:
        return not self.readonly and self._write_disabled_reason is None

    # -- read side ----------------------------------------------------------------------------

    def lookup(self, key: CacheKey) -> tuple[dict[str, Any], bytes] | None:
        """A verified (manifest, object bytes) for ``key``, or None.

        A present but bad entry is quarantined (when we may write) and reported as a miss.
        """
        path = self.entry_dir(key)
        try:
            manifest = entry.read_manifest(path)
            obj = entry.verify(path, manifest, key)
        except entry.EntryError as exc:
            if exc.reason != "absent":
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
            os.replace(path, dest)
        except FileNotFoundError:
            pass  # another process quarantined it first
        except OSError as move_err:
            # Cross-device or permission trouble: deleting still unblocks the rewrite.
            log.debug("quarantine move failed (%s); removing %s", move_err, path)
            shutil.rmtree(path, ignore_errors=True)

    # -- write side ---------------------------------------------------------------------------

    def commit(self, key: CacheKey, art: entry.Artifact) -> dict[str, Any] | None:
        """Persist ``art``; returns its manifest, or None if the disk refused (then warns once)."""
        if not self.writable:
            return None
        try:
            manifest = entry.write(self.entry_dir(key), key, art)
        except OSError as exc:
            self.disable_writes(exc)
            return None
        try:
            eviction.enforce(self.root)
        except OSError as exc:  # a cap we cannot enforce never costs the kernel just written
            log.warning("size cap not enforced: %s", exc)
        return manifest

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
