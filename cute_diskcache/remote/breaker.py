"""Circuit breaker: stop asking a remote that keeps failing, then probe it now and then.

Without it a dead or hung remote would cost every local miss a full timeout. Closed, calls go
through; ``threshold`` consecutive failures open it for ``cooldown`` seconds, during which no
call is made (the caller treats that as a remote miss); after the cool-down exactly one caller
is let through as a probe: success closes the breaker, failure opens it for another cool-down.
The state changes are logged (one line each), not every refused call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("cute_diskcache")


class Breaker:
    def __init__(self, *, threshold: int = 3, cooldown: float = 30.0, label: str = "remote", clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = max(1, threshold)
        self.cooldown = cooldown
        self.label = label
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None  # None: closed
        self._probing = False

    @property
    def state(self) -> str:
        """``closed``, ``open`` (refusing calls) or ``half-open`` (the next call is a probe)."""
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "open" if self._clock() < self._open_until or self._probing else "half-open"

    def healthy(self) -> bool:
        """No failure since the last success: what optional calls (the second-stage listing and
        record lookup) ask first, so a hung or dead remote costs a miss one timeout, not two."""
        with self._lock:
            return self._failures == 0 and self._open_until is None

    def allow(self) -> bool:
        """Whether a call may be made now. A True must be followed by :meth:`success` or :meth:`failure`."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or self._clock() < self._open_until:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            reopened = self._open_until is not None
            self._failures = 0
            self._open_until = None
            self._probing = False
        if reopened:
            log.warning("%s answers again; using it", self.label)

    def failure(self, why: str = "") -> None:
        with self._lock:
            self._failures += 1
            was_open = self._open_until is not None
            if not (was_open or self._failures >= self.threshold):
                return
            self._open_until = self._clock() + self.cooldown
            self._probing = False
        if not was_open:
            log.warning(
                "%s failed %d times in a row (%s); not asking it for %.0f s (local cache and compiles carry on)",
                self.label, self.threshold, why or "error", self.cooldown,
            )
