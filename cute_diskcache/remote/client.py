"""The remote tier as the cache uses it: fetch on a local miss, publish after a commit.

:class:`RemoteCache` wraps a :class:`~cute_diskcache.remote.Backend` with what makes a shared
store safe to put behind a serving process:

* every call runs against a deadline (:meth:`RemoteCache._bounded`) on top of the client's
  own socket timeouts, so no backend can hold a request longer than ``timeout``;
* a :class:`.breaker.Breaker` skips the remote while it keeps failing;
* fetched values are verified like any entry that arrives from outside
  (:func:`cute_diskcache.storage.ingest.adopt_staged`, then :meth:`Store.lookup_or_quarantine` with the key, which
  adds the arch, environment, host CPU and device checks), and only then stored and loaded. A hit
  first fetches the entry's ``.hit`` value (:mod:`.blob`: the manifest and the payload it loads),
  checks that once, in memory, with the key and loads it; the whole entry follows in the background into the
  local store (:meth:`RemoteCache._complete`), checked as an import;
* publishing is write-behind (:mod:`.publisher`), with ``SET``-if-absent semantics: the first
  publisher of an entry wins, later ones are no-ops. The one exception is a node holding the
  kernel's fleet lease (:mod:`.lease`, :meth:`RemoteCache.flight`): it publishes synchronously,
  bounded, before it lets the waiting nodes go. A remote value that failed verification
  here as damaged (or unsigned, where we sign) is overwritten by this node's own compile of it,
  so one bad object heals itself instead of costing every node a compile forever; one signed
  with another key is sound for the nodes that hold that key and stays, as on a local root (a
  node with a wrong key must not replace the fleet's entries). Bad remote objects are never
  deleted by a fetch.

Counters (this process) and statistics (the root's, per namespace) gain ``remote_*`` fields.

Fork: a worker forked while the client starts up (a thread importing the client library and
holding ``_init_lock``) would inherit a start-up that never finishes in it: every miss waiting
``SETUP_WAIT_S`` and its publisher blocked on the lock, for good. :func:`_after_fork_in_child`
gives the child fresh locks and start-up state (and no leases: those are the parent's).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Sequence

from .. import config
from ..storage import counting, entry, ingest, layout, reuse, stats
from ..keys.key import CacheKey, Environment
from ..storage.layout import LAYOUT
from ..storage.store import Store
from . import Backend, RemoteError, blob, from_url, lease, redact
from .breaker import Breaker
from .publisher import Publisher

log = logging.getLogger("cute_diskcache")

#: Consecutive failures that open the breaker.
BREAKER_THRESHOLD = 3
#: A publish carries a whole entry the other way and is off the request path: a longer deadline.
PUT_TIMEOUT_FACTOR = 5.0
#: A client library whose import takes longer than this is given up on for the process.
SETUP_WAIT_S = 10.0
#: A hit's whole entry is fetched this long after the hit, not while the caller loads its kernel.
COMPLETE_DELAY_S = 0.05
#: Listing and bulk transfers (``export --to-remote`` / ``import --from-remote``): operator commands.
BULK_TIMEOUT_MIN_S = 30.0


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
        use_lease: bool = True,
        lease_ttl: float = lease.DEFAULT_TTL_S,
    ) -> None:
        self.url = url
        self.label = f"remote cache {redact(url)}"
        self.prefix = prefix.strip("/") or "cute-diskcache"
        self.timeout = timeout
        self.readonly = readonly
        self.hmac_key = hmac_key or None  # our own entries are checked (signature included) before they leave
        self.breaker = Breaker(threshold=BREAKER_THRESHOLD, cooldown=cooldown, label=self.label)
        self.tally = counting.Tally(counting.RemoteCounters())  # :mod:`..storage.counting`: the one place we count
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
        self.use_lease = use_lease
        self.lease_ttl = lease_ttl
        self._held: dict[str, lease.Lease] = {}  # digest -> the lease this process compiles it under
        self._flights: dict[tuple[int, str], float] = {}  # (thread, digest) -> how long fetch() may wait for the fleet
        self._workers = _Workers()
        self._record_scopes: dict[str, bool] = {}  # second-stage scope -> another namespace published records there
        self._markers: set[str] = set()  # record markers this process has put
        _INSTANCES.add(self)
        # Whole entries fetched after a hit served from a ``.hit`` value, off the request path.
        self._completer: Publisher[tuple[str, CacheKey, Store]] | None = Publisher(self._complete, maxsize=queue_size)
        self._publisher: Publisher[tuple[str, str, Path | tuple[bytes, str]]] | None = (
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
            use_lease=config.flag("remote_lease"),
        )

    def _after_fork(self) -> None:
        """In a forked child: locks and start-up state of its own (see the module docstring)."""
        self._init_lock = threading.Lock()
        self._lock = threading.Lock()
        if not self._ready.is_set():  # start-up was under way in the parent: start it again here
            self._ready = threading.Event()
            self._init_started = False
        self._held = {}
        self._flights = {}
        self._workers = _Workers()  # the parent's threads do not exist here
        self.breaker._lock = threading.Lock()
        for worker in (self._publisher, self._completer):
            if worker is not None:
                worker._lock = threading.Lock()

    # -- plumbing -----------------------------------------------------------------------------

    def backend(self) -> Backend | None:
        """The backend, created on first use (its client library is imported then); None if it cannot be."""
        with self._init_lock:
            if self._backend is None and self._backend_error is None:
                try:
                    self._backend = from_url(self.url, timeout=self.timeout)
                except Exception as exc:  # noqa: BLE001 - RemoteError, or a client library that breaks on import
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
        The threads are reused (:class:`_Workers`): starting one per call cost 0.8 ms, eight
        times a loopback GET.
        """
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - carried to the caller
                box["error"] = exc
            finally:
                done.set()

        self._workers.submit(run)
        if not done.wait(seconds):
            raise RemoteError(f"no answer within {seconds:g} s")
        err = box.get("error")
        if err is not None:
            raise err if isinstance(err, RemoteError) else RemoteError(f"{type(err).__name__}: {err}")
        return box.get("value")

    @property
    def counters(self) -> counting.RemoteCounters:
        return self.tally.fields

    def _count(self, namespace: str, field: str, amount: float = 1) -> None:
        self.tally.add(namespace, **{field: amount})

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
        are all a miss (counted), and the caller compiles. Inside :meth:`flight` for ``key`` (on
        this thread) it also waits for another node's compile, or takes the kernel's lease.
        """
        with self._lock:
            wait = self._flights.pop((threading.get_ident(), key.digest), None)
        if wait is None:
            return self._fetch(key, store)[0]
        found, held = self.fetch_or_lease(key, store, wait)
        if held is not None:
            with self._lock:
                self._held[key.digest] = held
        return found

    def _fetch(self, key: CacheKey, store: Store) -> tuple[Any, str]:
        """``(found, outcome)``: outcome ``hit``, ``miss`` (the remote answered: no such entry),
        ``bad`` (there is one, refused here), ``error`` (no answer, breaker open, no backend)."""
        ns = key.env.namespace
        t0 = time.perf_counter()
        if not self._ready.is_set():
            self._backend_within(SETUP_WAIT_S)
            self.tally.add(None, remote_setup_seconds=time.perf_counter() - t0)
            t0 = time.perf_counter()
        ready, backend = self._backend_within(0)
        if ready and backend is None:  # no usable backend (warned once)
            return None, "error"
        if not ready or not self.breaker.allow():
            self._count(ns, "remote_skipped")
            self._count(ns, "remote_seconds", time.perf_counter() - t0)
            return None, "error"
        name = self.name(ns, key.digest)
        try:
            try:
                part = self._bounded(self.timeout, backend.get, blob.hit_object_name(self.prefix, ns, key.digest))
                if part is not None:
                    self._count(ns, "remote_bytes_in", len(part))
                    found = self._load_part(part, key, store)
                    if found is not None:
                        self.breaker.success()
                        self._count(ns, "remote_hits")
                        log.debug("remote hit %s %s (%d bytes) in %.2f ms", key.site, key.digest[:12], len(part), (time.perf_counter() - t0) * 1e3)
                        if self._completer is not None and store.writable:
                            self._completer.submit((name, key, store))
                        return found, "hit"
                raw = self._bounded(self.timeout, backend.get, name)
            except RemoteError as exc:
                self.breaker.failure(str(exc))
                self._count(ns, "remote_errors")
                self._warn_once("calls", "cute-diskcache: %s: get failed (%s); compiling instead", self.label, exc)
                return None, "error"
            self.breaker.success()
            if raw is None:
                self._count(ns, "remote_misses")
                return None, "miss"
            self._count(ns, "remote_bytes_in", len(raw))
            try:
                found = self._adopt(raw, key, store, name)
            except entry.EntryError as exc:
                self._count(ns, "remote_errors")
                if _another_key(exc):  # sound, for the nodes that hold that key: it stays, as on a local root
                    self._warn_once(
                        "key:" + name,
                        "cute-diskcache: %s: entry %s is signed with another key (%s); compiling it here, the remote "
                        "entry stays for the nodes that hold that key (is CUTE_DISKCACHE_HMAC_KEY the fleet's?)",
                        self.label, key.digest[:12], exc.detail,
                    )
                    return None, "bad"
                with self._lock:
                    self._bad.add(name)
                self._warn_once(
                    "bad:" + name,
                    "cute-diskcache: %s: entry %s rejected (%s); compiling it here, and this node's entry will replace it",
                    self.label, key.digest[:12], exc,
                )
                return None, "bad"
            except OSError as exc:  # local trouble while staging (disk full...): a miss, not the remote's fault
                self._count(ns, "remote_errors")
                self._warn_once("stage", "cute-diskcache: could not stage a remote entry locally (%s); compiling instead", exc)
                return None, "bad"
            except Exception as exc:  # noqa: BLE001 - a bug of ours must cost a compile, never the caller's kernel
                self._count(ns, "remote_errors")
                log.error("cute-diskcache: remote entry %s: %s: %s; compiling instead", key.digest[:12], type(exc).__name__, exc)
                return None, "bad"
            if found is None:  # verified as an entry, refused for this process (host CPU, device)
                self._count(ns, "remote_errors")
                return None, "bad"
            self._count(ns, "remote_hits")
            log.debug("remote hit %s %s (%d bytes) in %.2f ms", key.site, key.digest[:12], len(raw), (time.perf_counter() - t0) * 1e3)
            return found, "hit"
        finally:
            self._count(ns, "remote_seconds", time.perf_counter() - t0)

    def _load_part(self, raw: bytes, key: CacheKey, store: Store) -> Any:
        """The verified payload a hit loads, from a ``.hit`` value (:mod:`.blob`), checked in memory;
        None to fetch the whole entry instead.

        The store's own checks of a hit, made once and on the bytes that will be loaded: the
        manifest's seal, signature and types (:func:`entry.parse_manifest`), the key, environment,
        host CPU and device (:func:`entry.verify` with the key), the loaded payload's size and
        sha256. Nothing partial enters the local store: the whole entry follows in the background
        (:meth:`_complete`), checked as any import, so ``verify`` and exports never meet half an
        entry. None (the whole entry decides, and reports) when the value lacks the payload this
        process loads or anything about it does not check out.
        """
        from ..storage.store import Found, _role_to_load  # the rule a local lookup applies

        ns, digest = key.env.namespace, key.digest
        try:
            files = blob.unpack(raw, ns, digest)
            manifest = entry.parse_manifest(files[entry.MANIFEST], hmac_key=store.hmac_key)
            role = _role_to_load(manifest)
            data = entry.verify(Path(digest), manifest, key, role=role, held=files)
        except (entry.EntryError, KeyError, TypeError):
            return None
        return Found(manifest, data, role)

    def _complete(self, job: tuple[str, CacheKey, Store]) -> None:
        """After a hit from a ``.hit`` value: the whole entry into the local store, checked as an import."""
        name, key, store = job
        staged: Path | None = None
        ns, digest = key.env.namespace, key.digest
        time.sleep(COMPLETE_DELAY_S)  # the hit's load first: on a small box this thread would compete with it
        try:
            if not store.writable or (store.entry_dir(key) / entry.MANIFEST).exists() or not self.breaker.allow():
                return
            try:
                raw = self._bounded(self.timeout * PUT_TIMEOUT_FACTOR, self._require_backend().get, name)
            except RemoteError as exc:
                self.breaker.failure(str(exc))
                log.debug("completing %s locally: %s", digest[:12], exc)
                return
            self.breaker.success()
            if raw is None:
                return
            self._count(ns, "remote_bytes_in", len(raw))
            staged = store.scratch_dir("remote")
            edir = blob.stage(blob.unpack(raw, ns, digest), staged, ns, digest, durable=False, group=store.trust_group)
            report = ingest.ImportReport(f"remote:{name}")
            if not ingest.adopt_staged(store.root, store, edir, report, hmac_key=store.hmac_key):
                log.debug("completing %s locally: %s", digest[:12], report.bad[0]["reason"] if report.bad else "not merged")
        except (entry.EntryError, OSError) as exc:
            log.debug("completing %s locally: %s", digest[:12], exc)
        finally:
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)

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
            edir = blob.stage(files, base, ns, digest, durable=False, group=store.trust_group if writable else None)
            if writable:
                report = ingest.ImportReport(f"remote:{name}")
                if not ingest.adopt_staged(store.root, store, edir, report, hmac_key=store.hmac_key):
                    bad = report.bad[0]["reason"] if report.bad else "remote: check failed"
                    reason, _, detail = bad.partition(": ")  # the report keeps str(EntryError): "<reason>: <detail>"
                    raise entry.EntryError(reason, detail)
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

    # -- fleet-wide single-flight (:mod:`.lease`) ----------------------------------------------

    def fetch_or_lease(self, key: CacheKey, store: Store, wait: float) -> tuple[Any, lease.Lease | None]:
        """``(found, None)``: the entry (fetched now, or after waiting for the node compiling it);
        ``(None, lease)``: this node compiles it, holding the fleet's lease; ``(None, None)``:
        compile without one (no lease support, lease off, the remote failing, a refused value, or
        ``wait`` seconds spent waiting for another node). Never raises.
        """
        found, outcome = self._fetch(key, store)
        if found is not None or outcome != "miss" or not self.use_lease or self.readonly or not store.probe_writable():
            return found, None  # (a node that cannot store its compile cannot publish it: it must not hold the fleet up)
        backend = self._backend
        if backend is None or not lease.supports_lease(backend):
            return None, None
        ns = key.env.namespace
        name, lname = self.name(ns, key.digest), lease.lease_name(self.prefix, ns, key.digest)
        holder = lease.holder_id()
        t0 = time.monotonic()
        deadline = t0 + max(0.0, wait)
        delay = lease.POLL_MIN_S
        waited = False
        try:
            while True:
                if not self.breaker.allow():
                    raise RemoteError("breaker open")
                if self._bounded(self.timeout, backend.lease_acquire, lname, holder, self.lease_ttl):
                    taken = lease.Lease(backend, lname, holder, self.lease_ttl, call=self._bounded, timeout=self.timeout)
                    if not self._published_meanwhile(backend, name, ns):
                        self.tally.add(None, leases=1)
                        log.debug("lease %s taken: compiling %s for the fleet", lname, key.digest[:12])
                        return None, taken
                    taken.release()
                elif self._bounded(self.timeout, backend.exists, name):
                    pass  # published while we asked for the lease
                else:
                    self.breaker.success()
                    waited = True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._warn_once("lease-wait", "cute-diskcache: %s: another node is compiling %s %s and this miss has waited "
                                        "its bound (CUTE_DISKCACHE_LOCK_TIMEOUT, %.0f s left of it for the fleet after "
                                        "the local lock; waited %.1f s here); compiling it here too",
                                        self.label, key.site, key.digest[:12], wait, time.monotonic() - t0)
                        return None, None
                    time.sleep(min(delay, left))
                    delay = min(delay * lease.POLL_GROWTH, lease.POLL_MAX_S)
                    continue
                self.breaker.success()
                found, outcome = self._fetch(key, store)  # there now: fetched and verified as any remote entry
                if found is not None or outcome != "miss":
                    return found, None
        except RemoteError as exc:
            self.breaker.failure(str(exc))
            self._count(ns, "remote_errors")
            self._warn_once("calls", "cute-diskcache: %s: lease failed (%s); compiling without fleet coordination", self.label, exc)
            return None, None
        finally:
            if waited:
                self.tally.add(None, lease_waits=1, lease_wait_seconds=time.monotonic() - t0)

    def _published_meanwhile(self, backend: Backend, name: str, ns: str) -> bool:
        """Whether the entry is there now, asked right after this node took the lease (the
        holder before us may have published and released between our GET and our SET).

        Never raises: the lease is ours from the moment it was taken, and every way out of
        :meth:`fetch_or_lease` but returning it would leave its renewal thread keeping it alive
        for the life of the process, every other node waiting out its whole budget (issue 29).
        A failed check answers "not there": this node compiles for the fleet and releases the
        lease as any holder does (at worst, once, a kernel published a moment ago is compiled
        again)."""
        try:
            present = bool(self._bounded(self.timeout, backend.exists, name))
        except RemoteError as exc:
            self.breaker.failure(str(exc))
            self._count(ns, "remote_errors")
            log.debug("%s: checking %s after taking its lease failed (%s); compiling it for the fleet", self.label, name, exc)
            return False
        self.breaker.success()
        return present

    @contextlib.contextmanager
    def flight(self, key: CacheKey, wait: float) -> Iterator[None]:
        """The fleet-wide single-flight of ``key`` around a local miss's remote fetch and compile.

        Inside the block, the first :meth:`fetch` of ``key`` on this thread is
        :meth:`fetch_or_lease` (so the caller's timing of its remote hit includes any wait).
        With a lease taken, :meth:`publish` of ``key`` inside the block sends synchronously, and
        the lease is released on the way out whatever the compile did (an exception, an entry
        that could not be persisted): waiters then find either the entry or a free lease.
        """
        token = (threading.get_ident(), key.digest)
        with self._lock:
            self._flights[token] = wait
        try:
            yield
        finally:
            with self._lock:
                self._flights.pop(token, None)
                held = self._held.pop(key.digest, None)
            if held is not None:
                held.release()

    # -- write-behind -------------------------------------------------------------------------

    def publish(self, key: CacheKey, entry_dir: Path) -> None:
        """Queue a committed entry for publishing; returns at once (nothing if the remote is read-only)."""
        if self._publisher is None or self._backend_error is not None:
            return
        with self._lock:
            held = self._held.get(key.digest)
        if held is not None and not held.published:  # the fleet waits for this entry: send it now (bounded)
            held.published = True
            self._send((self.name(key.env.namespace, key.digest), key.env.namespace, entry_dir))
            return
        self._publisher.submit((self.name(key.env.namespace, key.digest), key.env.namespace, entry_dir))

    def _send(self, job: tuple[str, str, Path | tuple[bytes, str]]) -> None:
        name, ns, entry_dir = job
        if isinstance(entry_dir, tuple):  # a second-stage record and its release (:meth:`publish_record`)
            self._send_record(name, ns, *entry_dir)
            return
        try:
            value, part = blob.pack_both(entry_dir, hmac_key=self.hmac_key)
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
            # The hit value first: whoever sees the whole entry finds its hit value too.
            self._bounded(self.timeout * PUT_TIMEOUT_FACTOR, backend.put, blob.hit_object_name(self.prefix, ns, name.rsplit("/", 1)[-1]), part,
                          only_if_absent=not overwrite)
            written = self._bounded(self.timeout * PUT_TIMEOUT_FACTOR, backend.put, name, value, only_if_absent=not overwrite)
        except RemoteError as exc:
            self._publish_failed(ns, exc)
            return
        self.breaker.success()
        if written:
            with self._lock:
                self._bad.discard(name)
            self._count(ns, "published")
            self._count(ns, "remote_bytes_out", len(value) + len(part))
            log.debug("published %s (%d bytes)%s", name, len(value), " over a rejected copy" if overwrite else "")

    # -- second-stage records: reuse across releases (:mod:`..storage.reuse`, issue 31) ---------------
    #
    # A node of a fleet upgraded to a new flashinfer release finds, after its first-stage miss
    # (local, then remote), the kernel another release compiled with the same traced IR: the
    # record ``<prefix>/reuse/<scope>/<k2>`` names that entry, which is fetched, checked as any
    # import, and linked under the new key by :func:`..storage.reuse.link` as a local one is. One listing
    # per process tells whether the scope has another namespace's records at all (else no
    # trace); then one GET per traced miss, and one more for the entry when there is a record.

    def _publish_failed(self, ns: str, exc: RemoteError) -> None:
        self.breaker.failure(str(exc))
        self._count(ns, "remote_errors")
        self._warn_once("calls", "cute-diskcache: %s: publish failed (%s)", self.label, exc)

    def publish_record(self, key: CacheKey, k2: str) -> None:
        """Queue ``key``'s second-stage record behind its entry (the publishing thread keeps the
        order: a node that finds the record finds the entry); nothing if the remote is read-only."""
        if self._publisher is None or self._backend_error is not None:
            return
        self._publisher.submit((blob.record_name(self.prefix, reuse.scope(key.env), k2), key.env.namespace,
                                (reuse.sealed_record(key, k2, self.hmac_key), reuse.release(key.env))))

    def _send_record(self, name: str, ns: str, value: bytes, release: str) -> None:
        backend = self.backend()
        if backend is None or not self.breaker.allow():
            self._count(ns, "publish_dropped")
            return
        marker = blob.record_marker_prefix(self.prefix, name.rsplit("/", 2)[-2]) + release
        try:
            if marker not in self._markers:  # first: a record that exists is always found by the listing
                self._bounded(self.timeout * PUT_TIMEOUT_FACTOR, backend.put, marker, b"", only_if_absent=True)
                self._markers.add(marker)
            # replaced: the newest entry is the one an old release's deletion leaves (as locally)
            self._bounded(self.timeout * PUT_TIMEOUT_FACTOR, backend.put, name, value, only_if_absent=False)
        except RemoteError as exc:
            self._publish_failed(ns, exc)
            return
        self.breaker.success()
        self._count(ns, "remote_bytes_out", len(value))

    def reuse_possible(self, env: Environment) -> bool:
        """Whether another release published records in ``env``'s scope: one listing per process
        and scope (remembered), bounded by the timeout; False when the remote does not answer."""
        name = reuse.scope(env)
        with self._lock:
            known = self._record_scopes.get(name)
        if known is not None:
            return known
        t0 = time.perf_counter()
        _ready, backend = self._backend_within(SETUP_WAIT_S)
        if backend is None or not self.breaker.healthy() or not self.breaker.allow():
            return False
        prefix = blob.record_marker_prefix(self.prefix, name)
        try:
            names = self._bounded(self.timeout, lambda: list(backend.names(prefix)))
        except RemoteError as exc:
            self.breaker.failure(str(exc))
            self._count(env.namespace, "remote_errors")
            self._warn_once("calls", "cute-diskcache: %s: listing failed (%s)", self.label, exc)
            return False
        finally:
            self._count(env.namespace, "remote_seconds", time.perf_counter() - t0)
        self.breaker.success()
        found = any(n.startswith(prefix) and n[len(prefix):] not in ("", reuse.release(env)) for n in names)
        with self._lock:
            self._record_scopes[name] = found
        return found

    def reuse_source(self, env: Environment, k2: str, store: Store) -> tuple[Store, Path] | None:
        """The entry ``k2``'s remote record names, fetched into ``store`` (checked as any import)
        and returned as :func:`..storage.reuse.find` returns a local one; None for no record, a record
        that does not open (another ``k2``, a signature this process refuses), or no usable
        entry. Never raises: the caller compiles."""
        ns = env.namespace
        t0 = time.perf_counter()
        staged: Path | None = None
        try:
            _ready, backend = self._backend_within(0)
            if backend is None or not self.breaker.healthy() or not self.breaker.allow():
                return None
            try:
                record = blob.record_name(self.prefix, reuse.scope(env), k2)
                value = self._bounded(self.timeout, backend.get, record)
                named = reuse.open_sealed(value, k2, self.hmac_key, where=f"{self.label}:{record}") if value is not None else None
                if named is None:
                    self.breaker.success()
                    return None
                src = layout.entry_dir(store.root, *named)
                if (src / entry.MANIFEST).exists():  # here already (its local record was lost)
                    self.breaker.success()
                    return store, src
                raw = self._bounded(self.timeout, backend.get, self.name(*named))
            except RemoteError as exc:
                self.breaker.failure(str(exc))
                self._count(ns, "remote_errors")
                self._warn_once("calls", "cute-diskcache: %s: get failed (%s); compiling instead", self.label, exc)
                return None
            self.breaker.success()
            if raw is None:  # the record outlived its entry
                return None
            self._count(ns, "remote_bytes_in", len(raw))
            staged = store.scratch_dir("remote")
            edir = blob.stage(blob.unpack(raw, *named), staged, *named, durable=False, group=store.trust_group)
            report = ingest.ImportReport(f"remote:{self.name(*named)}")
            if not ingest.adopt_staged(store.root, store, edir, report, hmac_key=store.hmac_key):
                self._count(ns, "remote_errors")
                log.debug("second-stage entry %s refused: %s", named[1][:12], report.bad[0]["reason"] if report.bad else "not merged")
                return None
            return store, src
        except (entry.EntryError, OSError) as exc:
            self._count(ns, "remote_errors")
            log.debug("second-stage entry for %s not fetched: %s", k2[:12], exc)
            return None
        finally:
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)
            self._count(ns, "remote_seconds", time.perf_counter() - t0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued publishes and local completions of hits (tests, and short-lived tools that want them done now)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ok = True
        for worker in (self._publisher, self._completer):
            if worker is not None:
                ok = worker.flush(None if deadline is None else max(0.0, deadline - time.monotonic())) and ok
        return ok

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
                value, part = blob.pack_both(d, hmac_key=self.hmac_key)
            except entry.EntryError as exc:
                if exc.reason != "absent":
                    report["skipped"].append({"digest": d.name, "namespace": ns, "reason": str(exc)})
                continue
            self._bounded(self._bulk_timeout(), backend.put, blob.hit_object_name(self.prefix, ns, d.name), part, only_if_absent=True)
            if self._bounded(self._bulk_timeout(), backend.put, name, value, only_if_absent=True):
                report["pushed"] += 1
                report["bytes"] += len(value)
                stats.record(ns, "published")
                stats.record(ns, "remote_bytes_out", len(value))
            else:
                report["present"] += 1
        report["records"] = self._push_records(backend, Path(root), namespaces)
        return report

    def _push_records(self, backend: Backend, root: Path, namespaces: Sequence[str] | None) -> int:
        """The root's second-stage records of the selected namespaces, each with its scope's
        marker (what :meth:`publish_record` writes behind a compile): an upgraded node finds
        kernels a seeded remote holds."""
        pushed = 0
        for scope_name, k2, ns, value in reuse.sealed_local_records(root, self.hmac_key):
            if not layout.namespace_matches(ns, namespaces):
                continue
            for release in reuse.releases(root, scope_name):  # the scope's markers, once each
                marker = blob.record_marker_prefix(self.prefix, scope_name) + release
                if marker not in self._markers:
                    self._bounded(self._bulk_timeout(), backend.put, marker, b"", only_if_absent=True)
                    self._markers.add(marker)
            self._bounded(self._bulk_timeout(), backend.put, blob.record_name(self.prefix, scope_name, k2), value, only_if_absent=True)
            pushed += 1
        return pushed

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
                    edir = blob.stage(blob.unpack(raw, ns, digest), staging, ns, digest, group=store.trust_group)
                except entry.EntryError as exc:
                    report.bad.append({"digest": digest, "namespace": ns, "reason": str(exc)})
                    continue
                ingest.adopt_staged(root, store, edir, report, hmac_key=store.hmac_key)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return report


def _another_key(exc: entry.EntryError) -> bool:
    """A signature that does not match ours: the entry is sound for the nodes holding the key that
    signed it (a canary during a key rotation, another fleet on one store). The local rule
    (:data:`entry.CORRUPT`): such an entry is a miss and stays; only damage is replaced, and an
    unsigned entry is re-signed by the rewrite, as a local one is."""
    return exc.reason == "signature" and exc.detail != entry.UNSIGNED


class _Workers:
    """Daemon threads for :meth:`RemoteCache._bounded`, started only when none is idle.

    A worker whose call hangs past its deadline stays busy (until the client's own timeout),
    so the next call gets another thread: a hung remote never queues calls behind it.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._jobs.put(job)
        if spawn:
            threading.Thread(target=self._run, name="cute-diskcache-remote-call", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._jobs.get()()  # the job catches everything itself
            with self._lock:
                self._idle += 1


#: Every client of this process, for the fork hook (weakly: a client dropped is not kept alive).
_INSTANCES: weakref.WeakSet[RemoteCache] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_INSTANCES):
        client._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
