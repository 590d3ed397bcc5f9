"""A shared store behind the local cache, so a fleet compiles each kernel once.

Operators who have no shared volume (or a slow one) point ``CUTE_DISKCACHE_REMOTE`` at a
key-value or object store they already run, as sccache, Triton and Inductor do for their own
artifacts. We use that store; we do not build one. The local cache stays the first tier:

* **read-through**: a local miss asks the remote; what comes back is verified exactly like a
  local entry (the bundle importer's checks, then the store's own lookup with the key), stored
  locally and loaded. A node that cannot write locally loads the verified copy from a private
  temporary directory instead.
* **write-behind**: after a compile is committed locally, the entry is queued for a background
  thread; a slow or dead remote never delays a hit or a compile's result.
* **bounded**: every remote call has a deadline, and a circuit breaker stops asking a remote
  that keeps failing for a cool-down.
* **one compile per fleet** (:mod:`.lease`): a node that misses locally and on the remote takes
  the kernel's lease in the remote store before compiling (Redis ``SET NX PX``, S3 conditional
  create); the other nodes wait for its entry. Stores without conditional writes (``file://``,
  ``memory://``, gs, azure) keep read-through and write-behind only: nodes that miss together
  each compile. ``CUTE_DISKCACHE_REMOTE_LEASE=0`` turns leases off.

One remote object per entry, named ``<prefix>/v1/<namespace>/<digest>`` (:mod:`.blob`).
Backends are one small file each behind :class:`Backend`; :func:`from_url` picks one by URL
scheme and imports its client library only then, so a process with no remote set (or one that
only ever hits locally) never imports redis or fsspec.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Iterator
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from ..keys.key import CacheKey, Environment
    from ..storage.store import Store
    from .client import RemoteCache

__all__ = ["Backend", "LazyRemote", "RemoteError", "from_url", "redact", "refusal", "unsigned_warning"]


class RemoteError(Exception):
    """A remote call failed or ran past its deadline (the breaker counts these)."""


class Backend(Protocol):
    """What a store must offer: four calls on opaque names and byte strings.

    Implementations set their client's own socket timeouts from ``timeout``; the caller
    (:class:`.client.RemoteCache`) also enforces a deadline around every call, so a client
    library without usable timeouts still cannot hold a request.
    """

    def get(self, name: str) -> bytes | None:
        """The object's bytes, or None when there is none."""

    def put(self, name: str, data: bytes, *, only_if_absent: bool) -> bool:
        """Store ``data``; with ``only_if_absent`` an existing object wins. True if written."""

    def delete(self, name: str) -> None:
        """Remove the object if present."""

    def names(self, prefix: str) -> Iterator[str]:
        """Every object name that starts with ``prefix``."""

    # Optional, for fleet leases (:mod:`.lease`): a backend with ``supports_lease = True`` also
    # offers ``exists(name)``, ``lease_acquire(name, holder, ttl) -> bool`` (create, or take over
    # an expired lease), ``lease_renew(name, holder, ttl) -> bool`` and
    # ``lease_release(name, holder)`` (both only while the lease is still ``holder``'s).


def redact(url: str) -> str:
    """``url`` without its password, for logs and ``stats``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{netloc}").geturl()


#: Why a remote without a signing key stays off (the local root fails closed the same way).
UNSIGNED_REFUSAL = (
    "CUTE_DISKCACHE_HMAC_KEY is not set, and without it whoever can write the remote store could ship native "
    "code to every node; set the same key on every node (entries are then signed and checked), or "
    "CUTE_DISKCACHE_REMOTE_UNSIGNED=1 if only trusted writers can reach the store"
)


def refusal(settings: Any) -> str | None:
    """Why the remote tier must stay off under ``settings`` (None: it may run).

    Fail closed: a remote entry is native code that every node loads, so it must carry the
    fleet's signature, unless the operator opts in to unsigned entries explicitly
    (``CUTE_DISKCACHE_REMOTE_UNSIGNED=1``; then :func:`unsigned_warning` says so once).
    """
    if not settings.remote:
        return "CUTE_DISKCACHE_REMOTE is not set"
    if settings.hmac_key is None and not settings.remote_unsigned:
        return UNSIGNED_REFUSAL
    return None


def unsigned_warning(settings: Any) -> str | None:
    """The one warning a process logs when it accepts unsigned remote entries by opt-in."""
    if settings.remote and settings.hmac_key is None and settings.remote_unsigned:
        return (f"cute-diskcache: accepting unsigned entries from remote cache {redact(settings.remote)} "
                "(CUTE_DISKCACHE_REMOTE_UNSIGNED=1): whoever can write it can run code in this process")
    return None


class RemoteRefused(RemoteError):
    """The operator asked for the remote tier where it cannot run (not configured, read-only, unsigned)."""


def open_client(settings: Any, *, publishing: bool) -> RemoteCache:
    """The remote tier for an operator command (``export --to-remote``, ``import --from-remote``),
    under the same rules as a serving process; raises :class:`RemoteRefused` with the reason."""
    if not settings.remote:
        raise RemoteRefused("CUTE_DISKCACHE_REMOTE is not set (e.g. redis://cache-host:6379/0)")
    if publishing and settings.remote_readonly:
        raise RemoteRefused("CUTE_DISKCACHE_REMOTE_READONLY is set: this node does not publish to the remote")
    why = refusal(settings)
    if why is not None:
        raise RemoteRefused(f"the remote tier is off: {why}")
    from .client import RemoteCache

    return RemoteCache.from_settings(settings)


class LazyRemote:
    """What :func:`cute_diskcache.core.cache.default_cache` holds: the :class:`.client.RemoteCache`,
    built at the first local miss. A process that only ever hits locally imports none of the
    remote tier (client, value format, bundle code: ~13 ms) and certainly no client library.
    """

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self._real: RemoteCache | None = None
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, str], tuple[float, contextlib.ExitStack]] = {}
        if hasattr(os, "register_at_fork"):  # a child forked while we built the client gets a free lock
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: (lambda me: me._after_fork() if me is not None else None)(ref()))

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def get(self) -> RemoteCache:
        with self._lock:
            if self._real is None:
                t0 = time.perf_counter()
                from .client import RemoteCache

                self._real = RemoteCache.from_settings(self.settings)
                self._real.tally.add(None, remote_setup_seconds=time.perf_counter() - t0)
            return self._real

    def fetch(self, key: CacheKey, store: Store) -> Any:
        with self._lock:
            pending = self._pending.pop((threading.get_ident(), key.digest), None)
        real = self.get()
        if pending is not None:  # inside flight(): the real client's flight, entered now, left with ours
            wait, stack = pending
            stack.enter_context(real.flight(key, wait))
        return real.fetch(key, store)

    def publish(self, key: CacheKey, entry_dir: Path) -> None:
        self.get().publish(key, entry_dir)

    def publish_record(self, key: CacheKey, k2: str) -> None:
        self.get().publish_record(key, k2)

    def reuse_possible(self, env: Environment) -> bool:
        return self.get().reuse_possible(env)

    def reuse_source(self, env: Environment, k2: str, store: Store) -> tuple[Store, Path] | None:
        return self.get().reuse_source(env, k2, store)

    @contextlib.contextmanager
    def flight(self, key: CacheKey, wait: float) -> Iterator[None]:
        """:meth:`.client.RemoteCache.flight`, the client built at the first :meth:`fetch` inside
        it: the caller's timing of that fetch then includes building it, as without a flight
        (``remote_setup_seconds`` counts it; bench/remote.py takes it out of the first hit)."""
        token = (threading.get_ident(), key.digest)
        with contextlib.ExitStack() as stack:
            with self._lock:
                self._pending[token] = (wait, stack)
            try:
                yield
            finally:
                with self._lock:
                    self._pending.pop(token, None)

    @property
    def counters(self) -> Any:
        return self.get().counters

    @property
    def tally(self) -> Any:
        return self.get().tally


def from_url(url: str, *, timeout: float) -> Backend:
    """The backend for ``url``'s scheme; raises :class:`RemoteError` for one we cannot serve.

    ``redis://``, ``rediss://``, ``unix://``: :mod:`.redis_backend` (redis-py).
    Anything fsspec knows (``file://``, ``memory://``, and ``s3://``, ``gs://``... when their
    fsspec package is installed): :mod:`.fsspec_backend`.
    """
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("redis", "rediss", "unix"):
        from .redis_backend import RedisBackend

        return RedisBackend(url, timeout=timeout)
    if scheme:
        from .fsspec_backend import FsspecBackend

        return FsspecBackend(url, timeout=timeout)
    raise RemoteError(f"remote URL {redact(url)!r} has no scheme (redis://host:6379/0, s3://bucket/path, file:///path)")
