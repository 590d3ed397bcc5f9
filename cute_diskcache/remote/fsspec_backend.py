"""Object stores and directories through fsspec: ``s3://``, ``gs://``, ``az://`` (with s3fs,
gcsfs, adlfs installed), ``file://`` and ``memory://`` (what the tests can run here).

One object per entry at ``<url path>/<name>``. An object store's PUT is atomic, so a reader
sees a whole object or none. A local or mounted directory (``file://``) is not: there the
bytes go to a temporary name first and are renamed into place. "Only if absent" is a check
before the write: two publishers racing on one name may both write, which is harmless, as any
valid copy of an entry is as good as another (entries are verified on fetch, not trusted).
fsspec gives no portable socket timeout; the caller's deadline bounds every call.

Leases (:mod:`.lease`) only where the store has conditional writes, which fsspec does not
abstract: S3 through s3fs (``If-None-Match: *`` to create, ``If-Match: <etag>`` to renew or
take over, a conditional delete to release; AWS has honoured them since 2024, MinIO and moto
5.2 too). AWS answers a conditional write that races another on the same key with 409
``ConditionalRequestConflict`` and asks for a retry: for a lease that means "someone is writing
it now", so it reads as held (the waiter polls again), never as a failed remote. Every write of
the lease carries its expiry in the body, so each renewal changes the ETag a takeover's
``If-Match`` names. Other schemes say ``supports_lease = False`` and nodes compile as before.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Any
from collections.abc import Iterator

from . import RemoteError, redact


class FsspecBackend:
    def __init__(self, url: str, *, timeout: float) -> None:
        try:
            import fsspec
        except ImportError as exc:
            raise RemoteError(f"remote URL needs fsspec ({exc}); pip install 'cute-diskcache[remote]'") from None
        try:
            fs, path = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:  # an unknown scheme, or its package missing
            raise RemoteError(f"cannot open remote {redact(url)!r}: {exc}") from None
        self._fs: Any = fs
        self._base = str(path).rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self._local = "file" in protocol or "local" in protocol
        self._timeout = timeout
        self.supports_lease = ("s3" in protocol or "s3a" in protocol) and hasattr(fs, "call_s3")

    def _path(self, name: str) -> str:
        return f"{self._base}/{name}"

    def get(self, name: str) -> bytes | None:
        try:
            return bytes(self._fs.cat_file(self._path(name)))
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - each filesystem raises its own kinds
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None

    def put(self, name: str, data: bytes, *, only_if_absent: bool) -> bool:
        path = self._path(name)
        try:
            if only_if_absent and self._fs.exists(path):
                return False
            if self._local:
                parent = path.rsplit("/", 1)[0]
                self._fs.makedirs(parent, exist_ok=True)
                tmp = f"{parent}/.tmp.{name.rsplit('/', 1)[-1]}.{os.getpid()}.{os.urandom(4).hex()}"
                self._fs.pipe_file(tmp, data)
                self._fs.mv(tmp, path)
            else:
                self._fs.pipe_file(path, data)
            return True
        except Exception as exc:  # noqa: BLE001 - each filesystem raises its own kinds; callers handle one RemoteError
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None

    def exists(self, name: str) -> bool:
        try:
            if self.supports_lease:  # ask the store, not s3fs's listing cache
                self._head(name)
                return True
            return bool(self._fs.exists(self._path(name)))
        except FileNotFoundError:
            return False
        except Exception as exc:  # noqa: BLE001 - each filesystem raises its own kinds; callers handle one RemoteError
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None

    # -- leases (S3 only) ---------------------------------------------------------------------

    def _bucket_key(self, name: str) -> tuple[str, str]:
        bucket, key, _version = self._fs.split_path(self._path(name))
        return bucket, key

    def _head(self, name: str) -> dict[str, Any]:
        bucket, key = self._bucket_key(name)
        return dict(self._fs.call_s3("head_object", Bucket=bucket, Key=key))

    def _put_lease(self, name: str, holder: str, ttl: float, condition: dict[str, str]) -> bool | None:
        """Write the lease under ``condition``: True written, False the store says the condition
        did not hold, None a conflict (409: another conditional write raced ours; try again).

        The body carries the expiry, so every renewal is a new object with a new ETag: a node
        that read the lease as expired and then tries ``If-Match`` with the ETag it read loses to
        the holder's renewal in between (with the holder alone in the body, renewals kept the
        ETag and such a takeover won: two nodes compiled).
        """
        bucket, key = self._bucket_key(name)
        expires = f"{time.time() + ttl:.3f}"
        try:
            self._fs.call_s3("put_object", Bucket=bucket, Key=key, Body=f"{holder}\n{expires}\n".encode(),
                             Metadata={"holder": holder, "expires": expires}, **condition)
            return True
        except FileExistsError:  # If-None-Match: the object exists
            return False
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # s3fs's reading of 412 PreconditionFailed (If-Match)
                return False
            if _conflict(exc):
                return None
            raise

    def _current(self, name: str) -> tuple[str, float, str] | None:
        """``(holder, expires, etag)`` of the lease object, or None if there is none."""
        try:
            head = self._head(name)
        except FileNotFoundError:
            return None
        meta = head.get("Metadata") or {}
        try:
            expires = float(meta.get("expires", "0"))
        except ValueError:
            expires = 0.0
        return str(meta.get("holder", "")), expires, str(head.get("ETag", ""))

    def lease_acquire(self, name: str, holder: str, ttl: float) -> bool:
        """Create the lease, or take over an expired one; False while someone holds it.

        A 409 conflict (AWS answers concurrent conditional writes of one key with
        ``ConditionalRequestConflict`` and asks for a retry) means another node is writing the
        lease right now: "held", and the caller polls again, never "the remote failed".
        """
        try:
            for _attempt in range(2):
                created = self._put_lease(name, holder, ttl, {"IfNoneMatch": "*"})
                if created is None:
                    return False
                if created:
                    return True
                current = self._current(name)
                if current is None:  # released between our two calls: try to create it again
                    continue
                _holder, expires, etag = current
                if expires > time.time():
                    return False
                # Stale (its holder died): replace exactly that version, so one taker wins.
                return bool(self._put_lease(name, holder, ttl, {"IfMatch": etag}))
            return False
        except Exception as exc:  # noqa: BLE001 - each filesystem raises its own kinds; callers handle one RemoteError
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None

    def lease_renew(self, name: str, holder: str, ttl: float) -> bool:
        """Extend the lease if it is still ``holder``'s; a 409 conflict is tried again once, then
        raised (the renewal loop tries again a third of the TTL later), never read as "lost"."""
        try:
            for _attempt in range(2):
                current = self._current(name)
                if current is None or current[0] != holder:
                    return False
                renewed = self._put_lease(name, holder, ttl, {"IfMatch": current[2]})
                if renewed is not None:
                    return renewed
            raise RemoteError("lease renewal conflicted twice (409)")
        except RemoteError:
            raise
        except Exception as exc:  # noqa: BLE001 - each filesystem raises its own kinds; callers handle one RemoteError
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None

    def lease_release(self, name: str, holder: str) -> None:
        try:
            current = self._current(name)
            if current is None or current[0] != holder:
                return
            bucket, key = self._bucket_key(name)
            try:
                self._fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=current[2])
            except OSError as exc:
                # EINVAL: renewed or taken over since we read it, not ours to delete; a 409: a
                # write raced the delete, and the lease ends within its TTL anyway.
                if exc.errno != errno.EINVAL and not _conflict(exc):
                    raise
        except Exception as exc:  # noqa: BLE001 - each filesystem raises its own kinds; callers handle one RemoteError
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None

    def delete(self, name: str) -> None:
        try:
            self._fs.rm_file(self._path(name))
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001 - each filesystem raises its own kinds; callers handle one RemoteError
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None

    def names(self, prefix: str) -> Iterator[str]:
        base = self._path(prefix.rsplit("/", 1)[0]) if "/" in prefix else self._base
        try:
            found = self._fs.find(base)
        except FileNotFoundError:
            return
        except Exception as exc:  # noqa: BLE001 - each filesystem raises its own kinds; callers handle one RemoteError
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None
        strip = self._base.lstrip("/") + "/"
        for path in found:
            rel = str(path).lstrip("/")
            rel = rel[len(strip):] if rel.startswith(strip) else rel
            if rel.startswith(prefix) and not rel.rsplit("/", 1)[-1].startswith(".tmp."):
                yield rel


#: S3's answers that a conditional write raced another one on the same key: retry, not failure.
_CONFLICT_CODES = frozenset({"ConditionalRequestConflict", "OperationAborted", "409"})


def _conflict(exc: BaseException) -> bool:
    """Whether s3fs's ``exc`` is S3's 409 Conflict (s3fs translates an error code it does not
    know, such as ``ConditionalRequestConflict``, to ``OSError(EIO)`` and keeps botocore's
    ``ClientError`` as its cause, whose response has the code and the HTTP status)."""
    seen = 0
    cause: BaseException | None = exc
    while cause is not None and seen < 4:
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            code = str((response.get("Error") or {}).get("Code", ""))
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in _CONFLICT_CODES or status == 409:
                return True
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return isinstance(exc, OSError) and exc.errno == errno.EBUSY  # s3fs's reading of a bare "409" code
