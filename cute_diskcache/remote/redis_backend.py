"""Redis (redis-py): one string value per entry, ``SET NX`` so the first publisher wins.

Leases (:mod:`.lease`): ``SET NX PX``, renewed and released only by their holder (Lua scripts
that compare the value first, so a holder whose lease expired never extends or deletes the
lease a waiter took over).

Timeouts are the client's own (connect and every socket read or write), and retries are off:
redis-py retries three times with backoff by default, which would turn a one-second bound into
several. A failed call is the breaker's to count, not the client's to repeat.
"""

from __future__ import annotations

import re
from typing import Any
from collections.abc import Iterator

from . import RemoteError, redact

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisBackend:
    """A ``redis://`` / ``rediss://`` / ``unix://`` URL, as redis-py's ``from_url`` reads it."""

    supports_lease = True

    def __init__(self, url: str, *, timeout: float) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise RemoteError(f"CUTE_DISKCACHE_REMOTE is a Redis URL but redis-py is not installed ({exc}); pip install 'cute-diskcache[remote]'") from None
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        try:
            self._client: Any = redis.Redis.from_url(
                url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
        except (ValueError, redis.RedisError) as exc:
            raise RemoteError(f"bad Redis URL {redact(url)!r}: {exc}") from None

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._errors as exc:
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None

    def get(self, name: str) -> bytes | None:
        value = self._call(self._client.get, name)
        return None if value is None else bytes(value)

    def put(self, name: str, data: bytes, *, only_if_absent: bool) -> bool:
        return bool(self._call(self._client.set, name, data, nx=only_if_absent))

    def exists(self, name: str) -> bool:
        return bool(self._call(self._client.exists, name))

    def lease_acquire(self, name: str, holder: str, ttl: float) -> bool:
        return bool(self._call(self._client.set, name, holder.encode(), nx=True, px=_ms(ttl)))

    def lease_renew(self, name: str, holder: str, ttl: float) -> bool:
        return bool(self._call(self._client.eval, _RENEW, 1, name, holder.encode(), _ms(ttl)))

    def lease_release(self, name: str, holder: str) -> None:
        self._call(self._client.eval, _RELEASE, 1, name, holder.encode())

    def delete(self, name: str) -> None:
        self._call(self._client.delete, name)

    def names(self, prefix: str) -> Iterator[str]:
        match = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "*"
        for raw in self._call(lambda: list(self._client.scan_iter(match=match, count=1000))):
            yield raw.decode() if isinstance(raw, bytes) else str(raw)
