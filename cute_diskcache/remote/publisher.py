"""Write-behind: publishing happens on a daemon thread, never on the request path.

A compile's result goes back to the caller as soon as it is committed locally; the entry is
then queued here and sent by one background thread. The queue is bounded: when it is full (a
remote slower than the compiles feeding it) the job is dropped and counted, never waited for.
At interpreter exit the queue gets a bounded time to drain (a prewarm job or a short-lived
worker that exits right after its last compile still publishes it), then the process exits
regardless; the thread is a daemon, so a hung call cannot hold the exit either.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from typing import Generic, TypeVar
from collections.abc import Callable

log = logging.getLogger("cute_diskcache")

Job = TypeVar("Job")

#: Seconds the exit hook waits for queued publishes.
FLUSH_AT_EXIT_S = 10.0


class Publisher(Generic[Job]):
    """``send(job)`` for each submitted job, in order, on one daemon thread (started on first use).

    ``on_drop(job)`` is called (on the caller's thread) for a job the full queue refused.
    ``send`` must not raise; if it does, the error is logged and the thread carries on.
    """

    def __init__(self, send: Callable[[Job], None], *, maxsize: int = 256, on_drop: Callable[[Job], None] | None = None,
                 flush_at_exit: float = FLUSH_AT_EXIT_S) -> None:
        self._send = send
        self._maxsize = maxsize
        self._on_drop = on_drop
        self._flush_at_exit = flush_at_exit
        self._lock = threading.Lock()
        self._queue: queue.Queue[Job] | None = None
        self._pid = -1
        self._atexit = False

    def _started(self) -> queue.Queue[Job]:
        """The queue of this process's worker thread (a forked child starts its own)."""
        with self._lock:
            if self._queue is None or self._pid != os.getpid():
                self._queue = queue.Queue(self._maxsize)
                self._pid = os.getpid()
                threading.Thread(target=self._run, args=(self._queue,), name="cute-diskcache-publish", daemon=True).start()
                if not self._atexit:
                    atexit.register(self.flush, self._flush_at_exit)
                    self._atexit = True
            return self._queue

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (and ``on_drop``) when the queue is full. Never blocks."""
        try:
            self._started().put_nowait(job)
            return True
        except queue.Full:
            if self._on_drop is not None:
                self._on_drop(job)
            return False

    def _run(self, q: queue.Queue[Job]) -> None:
        while True:
            job = q.get()
            try:
                self._send(job)
            except Exception as exc:  # noqa: BLE001 - a bug of ours must not end publishing for the process
                log.error("cute-diskcache publisher: %s: %s", type(exc).__name__, exc)
            finally:
                q.task_done()

    def pending(self) -> int:
        q = self._queue
        return 0 if q is None or self._pid != os.getpid() else q.unfinished_tasks

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job was sent, at most ``timeout`` seconds; True if drained."""
        q = self._queue
        if q is None or self._pid != os.getpid():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with q.all_tasks_done:
            while q.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    log.warning("cute-diskcache: %d entries not published to the remote before exit", q.unfinished_tasks)
                    return False
                q.all_tasks_done.wait(left)
        return True
