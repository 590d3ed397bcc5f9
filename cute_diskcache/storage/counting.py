"""The one place the cache counts: in this process and in the root's statistics file.

Counting used to be written four times (the cache's counters, again through ``stats.record``, the
remote tier's own counters with their own lock, and callers slicing the cache's event list by
hand), so a field could move in one place and not the other, and a reader had to find all four to
know what a number meant. Now the cache and its remote tier each own a :class:`Tally`; everything
that counts goes through :meth:`Tally.add` (which moves the process's field and the statistics
file's together, under one lock), every kernel's outcome through :meth:`Tally.event`, and every
reader asks the tally (``cute_diskcache.counters()``, the exit summary, prewarm's workers through
:meth:`Tally.watch`, b12x's counters through :meth:`Tally.mark` / :meth:`Tally.since`).

What is counted in the statistics file only (``storage``'s quarantines and evictions, the bulk
transfers' bytes) is written by :mod:`.stats` directly: it happens where no cache is in
hand (a store opened by a CLI command, a sweep in another process) and has no field in a process.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Generic, NamedTuple, TypeVar

from . import stats

#: A prewarm worker's counts in the statistics file: these under ``prewarm_<name>``, and the
#: misses and seconds of serving not at all (a fresh prewarm is no serving miss; see stats.FIELDS).
PREWARM_APART = frozenset({"hits", "reused", "compiles", "compile_seconds"})
SERVING_ONLY = frozenset({"misses", "load_seconds", "reuse_seconds", "saved_seconds"})
#: Outcomes of a kernel that was asked for and not handed over (its compile raised, or
#: ``CUTE_DISKCACHE_ON_MISS=error`` refused it): no digest of them is in the cache.
NOT_SERVED = frozenset({"failed", "refused"})


class Event(NamedTuple):
    """One kernel asked of the cache, in order. A tuple on purpose: tests and benches print events
    as JSON lists and index them."""

    site: str
    digest: str
    outcome: str  # hit | remote-hit | reused | miss | failed | refused
    seconds: float  # the load (hit, reused) or the compile (miss)
    persist_seconds: float  # the export and write a miss added on top of its compile


@dataclasses.dataclass
class Counters:
    """The cache's activity in this process; ``cute_diskcache.counters()`` returns a copy."""

    hits: int = 0
    misses: int = 0
    compiles: int = 0
    writes: int = 0
    errors: int = 0  # export/load failures that fell back to the plain compile
    compile_seconds: float = 0.0
    load_seconds: float = 0.0
    saved_seconds: float = 0.0  # compile seconds recorded in the entries we loaded
    lock_waits: int = 0  # misses that waited for another process compiling the same kernel
    lock_wait_seconds: float = 0.0
    shared_loads: int = 0  # hits loaded from the linked shared object (the rest: the DSL's object loader)
    # second-stage reuse: misses served by another release's entry with the same traced IR (not
    # in hits or misses), with their seconds (trace + link + load); traces made on misses to look for one
    reused: int = 0
    reuse_seconds: float = 0.0
    traces: int = 0
    trace_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class RemoteCounters:
    """The remote tier's activity in this process; ``cute_diskcache.counters()`` includes a copy."""

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
    leases: int = 0  # fleet leases this process took to compile a kernel (the rest of the fleet waited)
    lease_waits: int = 0  # misses that waited for another node's lease (then loaded its entry, or took over)
    lease_wait_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


F = TypeVar("F", Counters, RemoteCounters)


@dataclasses.dataclass
class Watched:
    """What a stretch of work asked of the cache (:meth:`Tally.watch`): filled in when it ends."""

    events: list[Event] = dataclasses.field(default_factory=list)
    counts: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def digests(self) -> list[str]:
        """The kernels compiled or served in the stretch, sorted, once each."""
        return sorted({e.digest for e in self.events if e.outcome not in NOT_SERVED})


class Tally(Generic[F]):
    """A process's counters (``fields``), its kernels' outcomes (``events``) and the statistics
    file behind them, moved together under one lock.

    ``prewarm``: whose work this is. A prewarm's compiles are its job, not misses: in the
    statistics file its hits and compiles go under ``prewarm_*`` and serving's misses and seconds
    are not written, so a fresh prewarm never reads as a 5% hit rate. The process's own fields
    count everything either way.
    """

    def __init__(self, fields: F) -> None:
        self.fields = fields
        self.events: list[Event] = []
        self.prewarm = False
        self._lock = threading.Lock()

    def add(self, namespace: str | None, **amounts: float) -> None:
        """Count ``amounts`` in this process and, under ``namespace``, in the statistics file.
        A name the process has no field for is the file's only (``bytes_written``); None: the
        process only (what the file has no field for)."""
        with self._lock:
            for field, amount in amounts.items():
                if hasattr(self.fields, field):
                    setattr(self.fields, field, getattr(self.fields, field) + amount)
        if namespace is None:
            return
        for field, amount in amounts.items():
            if self.prewarm and field in SERVING_ONLY:
                continue
            stats.record(namespace, f"prewarm_{field}" if self.prewarm and field in PREWARM_APART else field, amount)

    def snapshot(self) -> dict[str, Any]:
        """A copy of the fields, taken under the lock (no half-counted hit: its count without its seconds)."""
        with self._lock:
            return self.fields.as_dict()

    def event(self, site: str, digest: str, outcome: str, seconds: float = 0.0, persist_seconds: float = 0.0) -> None:
        with self._lock:
            self.events.append(Event(site, digest, outcome, seconds, persist_seconds))

    def mark(self) -> int:
        """A place in the events, for :meth:`since` (a stretch that starts in one call and ends in another)."""
        return len(self.events)

    def since(self, mark: int) -> list[Event]:
        with self._lock:
            return self.events[mark:]

    @contextmanager
    def watch(self, *names: str) -> Iterator[Watched]:
        """The events of the ``with`` block and how much each of ``names`` moved in it, in the
        :class:`Watched` it yields (filled when the block ends, also when it raises). The events
        are the process's: another thread's kernels in the same stretch are in them too."""
        seen = Watched()
        mark, before = self.mark(), {n: getattr(self.fields, n) for n in names}
        try:
            yield seen
        finally:
            seen.events = self.since(mark)
            seen.counts = {n: getattr(self.fields, n) - before[n] for n in names}
