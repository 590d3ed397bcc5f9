"""The remote tier as the cache uses it: fetch on a local miss, publish after a commit.

:class:`RemoteCache` wraps a :class:`~cute_diskcache.remote.Backend` with what makes a shared
store safe to put behind a serving process:

* every call runs against a deadline (:meth:`RemoteCache._bounded`) on top of the client's
  own socket timeouts, so no backend can hold a request longer than ``timeout``;
* a :class:`.breaker.Breaker` skips the remote while it keeps failing;
* fetched values are verified like any entry that arrives from outside
  (:func:`cute_diskcache.ingest.adopt_staged`, then :meth:`Store.lookup_or_quarantine` with the key, which
  adds the arch, environment, host CPU and device checks), and only then stored and loaded;
* publishing is write-behind (:mod:`.publisher`), with ``SET``-if-absent semantics: the first
  publisher of an entry wins, later ones are no-ops. A remote value that failed verification
  here is overwritten by this node's own compile of it, so one bad object heals itself instead
  of costing every node a compile forever. Bad remote objects are never deleted by a fetch.

Counters (this process) and statistics (the root's, per namespace) gain ``remote_*`` fields.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from .. import entry, ingest, layout, stats
from ..key import CacheKey
from ..layout import LAYOUT
from ..store import Store
from . import Backend, RemoteError, blob, from_url, redact
from .breaker import Breaker
from .publisher import Publisher

log = logging.getLogger("cute_diskcache")

#: Consecutive failures that open the breaker.
BREAKER_THRESHOLD = 3
#: A publish carries a whole entry the other way and is off the request path: a longer deadline.
PUT_TIMEOUT_FACTOR = 5.0
#: A client library whose import takes longer than this is given up on for the process.
SETUP_WAIT_S = 10.0
#: Listing and bulk transfers (``export --to-remote`` / ``import --from-remote``): operator commands.
BULK_TIMEOUT_MIN_S = 30.0


@dataclasses.dataclass
class RemoteCounters:
    """This process's remote activity; ``cute_diskcache.counters()`` includes a copy."""

    remote_hits: int = 0  # local misses served by the remote (fetched, verified, stored, loaded)
    remote_misses: int = 0  # the remote had no such entry
    remote_errors: int = 0  # failed or timed-out calls, and fetched values that did not verify
    remote_skipped: int = 0  # local misses the breaker did not let through
    remote_bytes_in: int = 0
    remote_bytes_out: int = 0
    remote_seconds: float = 0.0  # request-path time spent on the remote (fetch + verify + store)
    published: int = 0  # entries written to the remote by the write-behind thread
    publish_dropped: int = 0  # publishes not attempted (queue full, breaker open, entry gone)
    remote_setup_seconds: float = 0.0  # once per process, at its first local miss: importing the remote tier and its client library

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class RemoteCache:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "cute-diskcache",
        timeout: float = 1.0,
        readonly: bool = False,
        cooldown: float = 30.0,
        hmac_key: bytes | None = None,
        backend: Backend | None = None,
        queue_size: int = 256,
    ) -> None:
        self.url = url
        self.label = f"remote cache {redact(url)}"
        self.prefix = prefix.strip("/") or "cute-diskcache"
        self.timeout = timeout
        self.readonly = readonly
        self.hmac_key = hmac_key or None  # our own entries are checked (signature included) before they leave
        self.breaker = Breaker(threshold=BREAKER_THRESHOLD, cooldown=cooldown, label=self.label)
        self.counters = RemoteCounters()
        self._backend = backend
        self._backend_error: str | None = None
        self._init_lock = threading.Lock()
        self._init_started = backend is not None
        self._ready = threading.Event()  # the backend exists, or cannot
        if backend is not None:
            self._ready.set()
        self._lock = threading.Lock()
        self._bad: set[str] = set()  # names whose value failed verification here: our publish replaces it
        self._warned: set[str] = set()
        self._publisher: Publisher[tuple[str, str, Path]] | None = (
            None if readonly else Publisher(self._send, maxsize=queue_size, on_drop=lambda job: self._count(job[1], "publish_dropped"))
        )

    @classmethod
    def from_settings(cls, settings: Any) -> RemoteCache:
        return cls(
            settings.remote,
            prefix=settings.remote_prefix,
            timeout=settings.remote_timeout,
            readonly=settings.remote_readonly,
            cooldown=settings.remote_cooldown,
            hmac_key=settings.hmac_key,
        )

    # -- plumbing -----------------------------------------------------------------------------

    def backend(self) -> Backend | None:
        """The backend, created on first use (its client library is imported then); None if it cannot be."""
        with self._init_lock:
            if self._backend is None and self._backend_error is None:
                try:
                    self._backend = from_url(self.url, timeout=self.timeout)
                except Exception as exc:  # RemoteError, or a client library that breaks on import
                    self._backend_error = str(exc)
                    log.warning("cute-diskcache: %s disabled: %s", self.label, exc)
            self._ready.set()
            return self._backend

    def _backend_within(self, seconds: float) -> tuple[bool, Backend | None]:
        """``(ready, backend)``, waiting at most ``seconds`` for it to be created.

        Creating it imports the client library (redis-py: 0.1-0.6 s on our loaded 2-core box),
        once per process, at its first local miss: never at start-up or on a hit. That is
        local work, not a remote call, and a remote hit saves seconds of compiling, so the
        first miss waits for it (on a daemon thread, capped by ``seconds``) rather than skip
        the remote; the wait is counted apart, in ``remote_setup_seconds``.
        """
        if not self._ready.is_set():
            with self._lock:
                start, self._init_started = not self._init_started, True
            if start:
                threading.Thread(target=self.backend, name="cute-diskcache-remote-init", daemon=True).start()
            if not self._ready.wait(seconds):
                return False, None
        return True, self._backend

    def _bounded(self, seconds: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on a daemon thread; RemoteError if it fails or takes longer than ``seconds``.

        A call past its deadline is abandoned, not waited for: its thread ends when the
        client's own timeout fires, and being a daemon it never holds the interpreter's exit.
        """
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # carried to the caller
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name="cute-diskcache-remote-call", daemon=True).start()
        if not done.wait(seconds):
            raise RemoteError(f"no answer within {seconds:g} s")
        err = box.get("error")
        if err is not None:
            raise err if isinstance(err, RemoteError) else RemoteError(f"{type(err).__name__}: {err}")
        return box.get("value")

    def _count(self, namespace: str, field: str, amount: float = 1) -> None:
        with self._lock:
            setattr(self.counters, field, getattr(self.counters, field) + amount)
        stats.record(namespace, field, amount)

    def _warn_once(self, topic: str, msg: str, *args: Any) -> None:
        with self._lock:
            first = topic not in self._warned
            self._warned.add(topic)
        log.log(logging.WARNING if first else logging.DEBUG, msg, *args)

    def name(self, namespace: str, digest: str) -> str:
        return blob.object_name(self.prefix, namespace, digest)

    # -- read-through -------------------------------------------------------------------------

    def fetch(self, key: CacheKey, store: Store) -> tuple[dict[str, Any], bytes] | None:
        """``key``'s entry from the remote, verified and stored locally, as ``store.lookup_or_quarantine`` returns it; or None.

        Never raises: a failed call, a timeout, an open breaker or a value that does not verify
        are all a miss (counted), and the caller compiles.
        """
        ns = key.env.namespace
        t0 = time.perf_counter()
        if not self._ready.is_set():
            self._backend_within(SETUP_WAIT_S)
            with self._lock:
                self.counters.remote_setup_seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
        ready, backend = self._backend_within(0)
        if ready and backend is None:  # no usable backend (warned once)
            return None
        if not ready or not self.breaker.allow():
            self._count(ns, "remote_skipped")
            self._count(ns, "remote_seconds", time.perf_counter() - t0)
            return None
        name = self.name(ns, key.digest)
        try:
            try:
                raw = self._bounded(self.timeout, backend.get, name)
            except RemoteError as exc:
                self.breaker.failure(str(exc))
                self._count(ns, "remote_errors")
                self._warn_once("get", "cute-diskcache: %s: get failed (%s); compiling instead", self.label, exc)
                return None
            self.breaker.success()
            if raw is None:
                self._count(ns, "remote_misses")
                return None
            self._count(ns, "remote_bytes_in", len(raw))
            try:
                found = self._adopt(raw, key, store, name)
            except entry.EntryError as exc:
                with self._lock:
                    self._bad.add(name)
                self._count(ns, "remote_errors")
                self._warn_once(
                    "bad:" + name,
                    "cute-diskcache: %s: entry %s rejected (%s); compiling it here, and this node's entry will replace it",
                    self.label, key.digest[:12], exc,
                )
                return None
            except OSError as exc:  # local trouble while staging (disk full...): a miss, not the remote's fault
                self._count(ns, "remote_errors")
                self._warn_once("stage", "cute-diskcache: could not stage a remote entry locally (%s); compiling instead", exc)
                return None
            except Exception as exc:  # a bug of ours must cost a compile, never the caller's kernel
                self._count(ns, "remote_errors")
                log.error("cute-diskcache: remote entry %s: %s: %s; compiling instead", key.digest[:12], type(exc).__name__, exc)
                return None
            if found is None:  # verified as an entry, refused for this process (host CPU, device)
                self._count(ns, "remote_errors")
                return None
            self._count(ns, "remote_hits")
            log.debug("remote hit %s %s (%d bytes) in %.2f ms", key.site, key.digest[:12], len(raw), (time.perf_counter() - t0) * 1e3)
            return found
        finally:
            self._count(ns, "remote_seconds", time.perf_counter() - t0)

    def _adopt(self, raw: bytes, key: CacheKey, store: Store, name: str) -> tuple[dict[str, Any], bytes] | None:
        """Stage ``raw`` as an entry, check it as an import does, merge it, then look it up with the key.

        A store that cannot write gets the same checks on a private temporary copy, which is
        loaded from there and deleted: the remote hit still saves the compile.
        """
        ns, digest = key.env.namespace, key.digest
        files = blob.unpack(raw, ns, digest)
        writable = store.probe_writable()
        base: Path | None = None
        if writable:
            try:
                base = store.scratch_dir("remote")
            except OSError:
                writable = False
        if base is None:
            base = Path(tempfile.mkdtemp(prefix="cute_diskcache-remote-"))
        try:
            edir = blob.stage(files, base, ns, digest, durable=False)
            if writable:
                report = ingest.ImportReport(f"remote:{name}")
                if not ingest.adopt_staged(store.root, store, edir, report, hmac_key=store.hmac_key):
                    bad = report.bad[0]["reason"] if report.bad else "check failed"
                    raise entry.EntryError("remote", bad)
                found = store.lookup_or_quarantine(key)
                if found is not None or not edir.exists():
                    return found
            else:
                ingest.check(edir, hmac_key=store.hmac_key)
            # Not merged (another writer is filling that entry) or no local writes: load the
            # verified staged copy. trust_shared: a private directory we just made ourselves.
            return Store(base, readonly=True, trust_shared=True, hmac_key=store.hmac_key).lookup_or_quarantine(key)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    # -- write-behind -------------------------------------------------------------------------

    def publish(self, key: CacheKey, entry_dir: Path) -> None:
        """Queue a committed entry for publishing; returns at once (nothing if the remote is read-only)."""
        if self._publisher is None or self._backend_error is not None:
            return
        self._publisher.submit((self.name(key.env.namespace, key.digest), key.env.namespace, entry_dir))

    def _send(self, job: tuple[str, str, Path]) -> None:
        name, ns, entry_dir = job
        try:
            _ns, _digest, value = blob.pack(entry_dir, hmac_key=self.hmac_key)
        except entry.EntryError as exc:  # evicted, quarantined or rewritten since the commit
            log.debug("not publishing %s: %s", entry_dir.name[:12], exc)
            self._count(ns, "publish_dropped")
            return
        backend = self.backend()
        if backend is None:
            return
        if not self.breaker.allow():
            self._count(ns, "publish_dropped")
            return
        with self._lock:
            overwrite = name in self._bad
        try:
            written = self._bounded(self.timeout * PUT_TIMEOUT_FACTOR, backend.put, name, value, only_if_absent=not overwrite)
        except RemoteError as exc:
            self.breaker.failure(str(exc))
            self._count(ns, "remote_errors")
            self._warn_once("put", "cute-diskcache: %s: publish failed (%s)", self.label, exc)
            return
        self.breaker.success()
        if written:
            with self._lock:
                self._bad.discard(name)
            self._count(ns, "published")
            self._count(ns, "remote_bytes_out", len(value))
            log.debug("published %s (%d bytes)%s", name, len(value), " over a rejected copy" if overwrite else "")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued publishes (tests, and short-lived tools that want them out now)."""
        return True if self._publisher is None else self._publisher.flush(timeout)

    # -- bulk: export --to-remote / import --from-remote --------------------------------------

    def _bulk_timeout(self) -> float:
        return max(BULK_TIMEOUT_MIN_S, self.timeout * 10)

    def _require_backend(self) -> Backend:
        backend = self.backend()
        if backend is None:
            raise RemoteError(self._backend_error or "no backend")
        return backend

    def list_entries(self, namespaces: Sequence[str] | None = None) -> list[tuple[str, str, str]]:
        """``(name, namespace, digest)`` of every remote entry (of the selected namespaces)."""
        backend = self._require_backend()
        names = self._bounded(self._bulk_timeout(), lambda: list(backend.names(f"{self.prefix}/{LAYOUT}/")))
        out = []
        for name in sorted(names):
            parsed = blob.parse_name(self.prefix, name)
            if parsed is not None and layout.namespace_matches(parsed[0], namespaces):
                out.append((name, *parsed))
        return out

    def push(self, root: Path, namespaces: Sequence[str] | None = None) -> dict[str, Any]:
        """Publish every verified local entry the remote lacks, now (not write-behind). Raises RemoteError."""
        backend = self._require_backend()
        present = {name for name, _ns, _d in self.list_entries(namespaces)}
        report: dict[str, Any] = {"remote": redact(self.url), "pushed": 0, "present": 0, "bytes": 0, "skipped": []}
        for d in layout.entry_dirs(Path(root), namespaces):
            ns = d.parent.parent.name
            name = self.name(ns, d.name)
            if name in present:
                report["present"] += 1
                continue
            try:
                _ns, _digest, value = blob.pack(d, hmac_key=self.hmac_key)
            except entry.EntryError as exc:
                if exc.reason != "absent":
                    report["skipped"].append({"digest": d.name, "namespace": ns, "reason": str(exc)})
                continue
            if self._bounded(self._bulk_timeout(), backend.put, name, value, only_if_absent=True):
                report["pushed"] += 1
                report["bytes"] += len(value)
                stats.record(ns, "published")
                stats.record(ns, "remote_bytes_out", len(value))
            else:
                report["present"] += 1
        return report

    def pull(self, store: Store, namespaces: Sequence[str] | None = None) -> ingest.ImportReport:
        """Fetch every remote entry (of the selected namespaces), verify it and merge it into ``store``'s root.

        The import path of a bundle, entry by entry: the same report, the same guarantees (a
        valid local entry is never replaced, a bad one never comes in). Raises RemoteError.
        """
        backend = self._require_backend()
        root = store.root
        report = ingest.ImportReport(f"remote {redact(self.url)}")
        entries = self.list_entries(namespaces)
        report.header = {"entries": len(entries), "remote": redact(self.url), "prefix": self.prefix}
        staging = store.scratch_dir("remote-pull")
        try:
            for name, ns, digest in entries:
                raw = self._bounded(self._bulk_timeout(), backend.get, name)
                if raw is None:
                    continue  # deleted since the listing
                stats.record(ns, "remote_bytes_in", len(raw))
                try:
                    edir = blob.stage(blob.unpack(raw, ns, digest), staging, ns, digest)
                except entry.EntryError as exc:
                    report.bad.append({"digest": digest, "namespace": ns, "reason": str(exc)})
                    continue
                ingest.adopt_staged(root, store, edir, report, hmac_key=store.hmac_key)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return report
