"""Fleet-wide single-flight: a lease in the remote store says which node compiles a kernel.

Read-through plus write-behind alone lets N nodes that miss one kernel together compile it N
times (measured before this module: 6 cold nodes, 6 compiles). So a node that misses locally
and on the remote first takes the kernel's lease, ``<prefix>/lease/<namespace>/<digest>``:

* **Redis**: ``SET <lease> <holder> NX PX <ttl>``; renewed while compiling (``PEXPIRE`` only
  if the value is still ours: a Lua script), released with delete-if-ours.
* **S3** (s3fs): a conditional create (``If-None-Match: *``) of a small object whose metadata
  carries its expiry; renewed and taken over with ``If-Match: <etag>``, so of two nodes that
  both find a stale lease exactly one replaces it; released with a conditional delete. Expiry
  is the holder's wall clock: nodes' clocks must agree to well within the TTL.
* **Anything else** (``file://``, ``memory://``, gs, azure): no lease, today's behaviour:
  nodes that miss together each compile, and the first publish wins.

The holder publishes its entry synchronously (bounded) *before* releasing the lease, so a node
that waits sees the entry the moment the lease is gone. Waiters poll with backoff: entry there
-> fetch, verify and load it like any remote entry; lease gone and entry absent (the holder
died, or its compile could not be persisted) -> take the lease and compile. A holder that dies
stops renewing, so its lease ends within one TTL and a waiter takes over. The wait is bounded
by the caller's lock timeout, one bound for the local lock and the lease together (what the
local wait took is not given again). A remote that fails any of this is a plain miss (each node
compiles: availability first), warned about once. It runs inside the local single-flight lock,
so one process per node talks to the remote about a given kernel.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any
from collections.abc import Callable

log = logging.getLogger("cute_diskcache")

#: Seconds a lease lives without renewal: how long a dead holder can delay the fleet.
DEFAULT_TTL_S = 20.0
#: Waiters poll the remote this often at first, backing off by ``POLL_GROWTH`` up to ``POLL_MAX_S``.
POLL_MIN_S = 0.05
POLL_GROWTH = 1.5
POLL_MAX_S = 1.0


def lease_name(prefix: str, namespace: str, digest: str) -> str:
    """Outside ``<prefix>/v1/``: listing and pulling entries never meet a lease."""
    return f"{prefix.strip('/')}/lease/{namespace}/{digest}"


def holder_id() -> str:
    """Unique per lease taken: host, pid and a random part (a pid is reused; hosts share pids)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(6).hex()}"


def supports_lease(backend: Any) -> bool:
    return bool(getattr(backend, "supports_lease", False))


class Lease:
    """A lease this process holds, renewed by a daemon thread every third of its TTL until released.

    ``call(seconds, fn, *args)`` is the client's bounded call (it raises ``RemoteError``).
    Renewal that fails or finds the lease gone is logged at debug level and stops renewing: the
    compile carries on regardless (at worst another node compiles the same kernel too).
    """

    def __init__(self, backend: Any, name: str, holder: str, ttl: float, *,
                 call: Callable[..., Any], timeout: float) -> None:
        self.backend = backend
        self.name = name
        self.holder = holder
        self.ttl = ttl
        self._call = call
        self._timeout = timeout
        self._done = threading.Event()
        self.published = False
        self._thread = threading.Thread(target=self._renew_loop, name="cute-diskcache-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._done.wait(self.ttl / 3):
            try:
                still = self._call(self._timeout, self.backend.lease_renew, self.name, self.holder, self.ttl)
            except Exception as exc:  # noqa: BLE001 - a failed renewal is retried; the lease is lost only when the backend says so
                log.debug("lease %s: renewal failed (%s)", self.name, exc)
                continue
            if not still:
                log.debug("lease %s: lost (expired and taken over); compiling on regardless", self.name)
                return

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours (never raises)."""
        if self._done.is_set():
            return
        self._done.set()
        try:
            self._call(self._timeout, self.backend.lease_release, self.name, self.holder)
        except Exception as exc:  # noqa: BLE001 - it expires on its own within one TTL
            log.debug("lease %s: release failed (%s); it expires within %.0f s", self.name, exc, self.ttl)
