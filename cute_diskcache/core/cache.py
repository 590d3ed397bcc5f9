"""From a key to a kernel: look it up, wait for whoever compiles it (single-flight, here and across
a fleet), compile it, persist it, load it, and count what happened.

The last of a compile's three steps: :mod:`.hook` finds that a compile is a site and what its key
is made of, :mod:`.through` keys it and chooses between serving, planning and running it
uncached, and :class:`CompileCache` serves it. :func:`cute_diskcache.cached_compile` comes here
directly with a key its caller gives. Decisions and their order live here; the bytes and files
are storage's (:mod:`..storage.store` and :mod:`..storage.entry` for an entry, :mod:`..storage.loader`
to make a kernel of one, :mod:`..storage.layout` and :mod:`..storage.eviction` for its size).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator

from . import as_compiled, export, report
from .. import config
from ..keys import devicefacts, hostmachine, trace
from ..storage import counting, entry, eviction, explain, layout, loader, locking, reuse, stats
from ..errors import CacheMissError
from ..keys.key import CacheKey
from ..storage.store import Store, side_data_refusal

if TYPE_CHECKING:
    from ..remote import LazyRemote
    from ..remote.client import RemoteCache

log = logging.getLogger("cute_diskcache")

#: In the side data a hit returns (a copy, never stored): the entry it came from, read again only
#: when a caller asks the kernel for what the compile held (:class:`.as_compiled.Payloads`).
HIT_FROM = "_hit_from"
#: the counters a served kernel moves: (count, seconds), in the process and in stats
_HIT = ("hits", "load_seconds")
_REUSED = ("reused", "reuse_seconds")

#: CUTE_DISKCACHE_ON_MISS values; the first is the default. ``warn`` is ``compile`` under the name
#: vLLM's ``--jit-monitor-mode warn`` uses: both compile, with a WARNING saying why it missed.
ON_MISS_CHOICES = ("compile", "warn", "error")


def _kept(made: list[entry.Artifact], art: entry.Artifact) -> entry.Artifact:
    made.append(art)
    return art


def on_miss_setting() -> str:
    """``CUTE_DISKCACHE_ON_MISS``; a value we do not know is ``compile``, with a warning."""
    raw = (config.text("on_miss") or "").lower()
    if raw in ON_MISS_CHOICES:
        return raw
    if raw:
        log.warning("ignoring %s=%r (expected one of %s); using %s", config.env_name("on_miss"), raw,
                    "|".join(ON_MISS_CHOICES), ON_MISS_CHOICES[0])
    return ON_MISS_CHOICES[0]


class NotLoaded:
    """What a cross-building process (:func:`..keys.hostmachine.cross`: a prewarm worker for a DGX
    Spark on an x86 box) gets for an entry it hits or reuses: judged as every hit is (each check of
    the lookup, and its object's ELF header naming the machine its namespace is for), never
    mapped, since its host code cannot run on this machine. Nothing a cross-building process
    computes is served; calling it raises, as launching a fresh compile without the card does."""

    __slots__ = ("digest", "machine")

    def __init__(self, digest: str, machine: str) -> None:
        self.digest, self.machine = digest, machine

    def __call__(self, *_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(f"kernel {self.digest[:12]} holds {self.machine} host code: judged, not loaded in this "
                           f"{hostmachine.here()} process (a cross-build)")

    def __repr__(self) -> str:
        return f"NotLoaded({self.digest[:12]}, {self.machine})"


class CompileCache:
    """A store plus the process's counters.

    ``single_flight``: a miss takes the key's lock (:mod:`..storage.locking`) before compiling, so of N
    processes missing one kernel one compiles and the rest load its entry; ``lock_timeout``
    bounds the wait.
    """

    def __init__(
        self,
        store: Store,
        *,
        single_flight: bool = True,
        lock_timeout: float = locking.DEFAULT_TIMEOUT_S,
        remote: RemoteCache | LazyRemote | None = None,
    ) -> None:
        self.store = store
        # The remote tier (:mod:`..remote`), or None: asked after a local miss, under the key's
        # lock (so of N local processes one fetches), and fed each committed compile.
        self.remote = remote
        self.single_flight = single_flight
        self.lock_timeout = lock_timeout
        # What this process counts and every kernel's outcome, and the statistics file behind them
        # (:mod:`..storage.counting`: the one place the cache counts).
        self.tally = counting.Tally(counting.Counters())
        stats.bind(store.root if store.writable else None, shared=store.trust_shared, group=store.trust_group)
        # compile | warn | error: what a miss does (read once: a process's policy does not change under it)
        self.on_miss = on_miss_setting()
        self.miss_level = logging.WARNING  # of the line each compile logs (why it missed)
        self._announced = False
        # A rank of an engine whose ranks were not set up at attach says its attach line at its
        # first request (:func:`.report.attached`); which rank this process is, once known.
        self.attach_line_due = False
        self.ranks: Any = None
        # digest -> why a verified entry was refused at this process's last lookup (load, extra)
        self._refused: dict[str, BaseException] = {}

    def _announce(self) -> None:
        """The process-wide cache's attach line and exit summary (:mod:`.report`), once."""
        if self._announced:
            return
        self._announced = True
        if self is _default:
            report.attached(self)

    def for_prewarm(self) -> None:
        """A prewarm worker's cache: compiling is its job, whatever ``CUTE_DISKCACHE_ON_MISS``
        says; each compile is logged at DEBUG, and there is no attach line or exit summary
        (prewarm reports for itself). Its hits and compiles are counted as ``prewarm_*``
        statistics, apart from serving's hits and misses. Call before flashinfer is imported."""
        self.on_miss = "compile"
        self.miss_level = logging.DEBUG
        self.tally.prewarm = True
        self._announced = True
        self.store.rebuild_tuned_entries()

    def warm_up(self) -> float:
        """Do the once-per-process work now, at attach (engine start), not in the first request.

        The root's trust check, this process's statistics file (so a hit never waits on the
        disk), the host CPU's extensions, the DSL stack, ``dlopen`` of the DSL runtime, and the
        DSL's modules that define the classes a hit hands back (:func:`.as_compiled.preload`). The
        target arch is NOT resolved here: without ``CUTE_DSL_ARCH`` that asks the CUDA driver,
        and initialising CUDA in a process that forks workers later breaks CUDA in them.
        Returns the seconds it took; never raises.
        """
        from ..keys import hostcpu
        from ..storage import loader
        from ..keys.key import dsl_stack

        t0 = time.perf_counter()
        try:
            if self.store.trusted and self.store.writable:
                stats.ensure_file()
            hostcpu.isa_extensions()
            dsl_stack()
            loader.preload()
            as_compiled.preload()
        except Exception as exc:  # noqa: BLE001 - only an optimisation: the first lookup does it again
            log.debug("warm-up skipped: %s", exc)
        self._announce()
        return time.perf_counter() - t0

    def get_or_compile(
        self,
        key: CacheKey,
        compile_fn: Callable[[], Any],
        *,
        extra_fn: Callable[[Any], dict[str, Any]] | None = None,
        extra_ok: Callable[[dict[str, Any]], bool] | None = None,
        reuse: Callable[[], reuse.Plan | None] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Return ``(kernel, extra)``: loaded from disk when a verified entry exists, else compiled.

        ``extra`` is side data a site stores beside its artifact (``extra_fn(kernel)`` computes
        it after a compile); a hit returns the stored copy, if ``extra_ok`` accepts it (side data
        of another shape, e.g. from another writer version, is a miss, never handed on). A load
        that fails after verification (a DSL that cannot read the object) is a miss too: the
        caller always gets a kernel from one path or the other.

        A miss compiles under the key's single-flight lock when the store can write: once we
        hold it, whoever held it before us has finished, so the store is read again first.
        ``lock_timeout`` bounds the whole wait: the local lock's, then what is left of it for
        another node's fleet lease.
        Housekeeping that a commit made due runs after the lock is released.

        ``reuse`` (a site whose kernels may outlive a flashinfer release, :mod:`..storage.reuse`): asked
        only after a first-stage miss, for the plan of a second-stage lookup: the kernel is
        traced (when a record of this DSL stack exists) and an entry of another release with the
        same traced IR is linked under ``key`` and loaded as a hit (outcome ``reused``); the
        compile otherwise records the digest of what it lowered beside its entry. The hit path
        never calls it.

        ``CUTE_DISKCACHE_ON_MISS=error`` (:attr:`on_miss`): a local miss raises
        :class:`~..errors.CacheMissError` instead, before any lock, remote fetch or compile
        (after a second-stage lookup: a kernel another release compiled is served, not refused).
        """
        self._announce()
        if self.attach_line_due:
            report.first_request(self)
        hit = self._try_hit(key, extra_ok=extra_ok)
        if hit is not None:
            return hit
        if self.on_miss == "error":
            hit = self._try_reuse(key, self._plan(reuse), extra_ok) if reuse is not None else None
            if hit is not None:
                return hit
            self._refuse_to_compile(key)
        if not self.single_flight:
            hit = self._try_hit(key, remote=True, extra_ok=extra_ok) if self.remote is not None else None
            if hit is not None:
                return hit
            result = self._reuse_or_compile(key, compile_fn, extra_fn, extra_ok, reuse)
        else:
            with self.store.single_flight(key, self.lock_timeout) as flight:
                if flight.outcome in ("waited", "timeout"):
                    self.tally.add(None, lock_waits=1, lock_wait_seconds=flight.waited_seconds)
                if flight.held:
                    hit = self._try_hit(key, extra_ok=extra_ok)  # the process we waited for (or one just before) committed it
                    if hit is not None:
                        return hit
                if self.remote is not None:
                    # Fleet-wide single-flight (remote.lease): the entry, or this node's lease to compile it.
                    # One bound for the whole wait (docs/fleets.md): what the local lock took is
                    # not given again to the fleet's lease (a timed-out local wait waited twice).
                    left = max(0.0, self.lock_timeout - flight.waited_seconds)
                    with self.remote.flight(key, left):
                        hit = self._try_hit(key, remote=True, extra_ok=extra_ok)
                        if hit is not None:
                            return hit
                        result = self._reuse_or_compile(key, compile_fn, extra_fn, extra_ok, reuse)
                else:
                    result = self._reuse_or_compile(key, compile_fn, extra_fn, extra_ok, reuse)
        self.store.maintain()
        return result

    def _try_hit(self, key: CacheKey, *, remote: bool = False,
                 extra_ok: Callable[[dict[str, Any]], bool] | None = None,
                 reused_since: float | None = None) -> tuple[Any, dict[str, Any]] | None:
        """Load ``key``'s verified entry, or None (absent, refused, or the DSL could not load it).

        ``remote``: fetch it from the remote tier instead of the store (the fetch verifies and
        stores it locally, and never raises). ``reused_since``: the entry was just linked from
        another release's (:meth:`_try_reuse`, which began then): the same checks and load,
        counted as ``reused`` instead of a hit.
        """
        t0 = time.perf_counter()
        try:
            found = self.remote.fetch(key, self.store) if remote and self.remote is not None else self.store.lookup_or_quarantine(key, load=True)
        except Exception as exc:  # noqa: BLE001 - a bug of ours must cost a compile, never the caller's kernel
            log.error("cute-diskcache lookup failed unexpectedly (%s: %s); compiling", type(exc).__name__, exc)
            self.tally.add(None, errors=1)
            found = None
        if found is not None:
            manifest = found[0]
            why = side_data_refusal(manifest["extra"], extra_ok)
            if why is not None:
                self._refused[key.digest] = why
                self.store.note_refusal(self.store.entry_dir(key), why)
                return None
            try:
                kernel = self._load(key, found)
            except Exception as exc:  # noqa: BLE001 - the DSL refused bytes we verified: not for this process
                why = entry.EntryError("load", f"{type(exc).__name__}: {exc}")
                self._refused[key.digest] = why
                self.store.note_refusal(self.store.entry_dir(key), why)
            else:
                if reused_since is not None:
                    self._count_served(key, manifest, _REUSED, "reused", time.perf_counter() - reused_since)
                else:
                    dt = time.perf_counter() - t0
                    self._count_served(key, manifest, _HIT, "remote-hit" if remote else "hit", dt)
                    log.debug("hit %s %s in %.2f ms", key.site, key.digest[:12], dt * 1e3)
                return kernel, {**manifest["extra"], HIT_FROM: as_compiled.Payloads(functools.partial(self.store.read_role, key))}
        return None

    @staticmethod
    def _plan(reuse_fn: Callable[[], reuse.Plan | None] | None) -> reuse.Plan | None:
        """The site's second-stage plan, or None (no plan, or the site could not make one)."""
        if reuse_fn is None:
            return None
        try:
            return reuse_fn()
        except Exception as exc:  # noqa: BLE001 - only the second stage lost: the compile goes on
            log.debug("no second-stage plan: %s: %s", type(exc).__name__, exc)
            return None

    def _reuse_or_compile(self, key: CacheKey, compile_fn: Callable[[], Any], extra_fn: Callable[[Any], dict[str, Any]] | None,
                          extra_ok: Callable[[dict[str, Any]], bool] | None,
                          reuse_fn: Callable[[], reuse.Plan | None] | None) -> tuple[Any, dict[str, Any]]:
        """A first-stage miss: another release's entry with the same traced IR, else the compile."""
        plan = self._plan(reuse_fn)
        if plan is not None and plan.lower is not None and self._reuse_possible(key):
            return self._trace_then_lower(key, plan, compile_fn, extra_fn, extra_ok)
        if plan is not None:
            hit = self._try_reuse(key, plan, extra_ok)
            if hit is not None:
                return hit
        return self._compile_and_commit(key, compile_fn, extra_fn, plan)

    def _reuse_possible(self, key: CacheKey) -> bool:
        """Whether a second-stage lookup could find anything: the root can take the new entry
        and a record of another release of this DSL stack exists (here, in a layer, the fleet)."""
        if not self.store.probe_writable():
            return False
        try:
            return reuse.possible(self.store, key.env) or (self.remote is not None and self.remote.reuse_possible(key.env))
        except Exception as exc:  # noqa: BLE001 - only the second stage lost: the compile goes on
            log.debug("second-stage lookup skipped: %s: %s", type(exc).__name__, exc)
            return False

    def _trace_then_lower(self, key: CacheKey, plan: reuse.Plan, compile_fn: Callable[[], Any],
                          extra_fn: Callable[[Any], dict[str, Any]] | None,
                          extra_ok: Callable[[dict[str, Any]], bool] | None) -> tuple[Any, dict[str, Any]]:
        """The second stage and the compile in one trace: the kernel is traced, its traced IR looked
        up, and the DSL lowers that same module when nothing is found (an upgrade whose kernels
        changed cost a trace and then a compile that traced again: more than an empty cache).
        A linked entry is loaded exactly as a hit after the DSL has stopped."""
        assert plan.lower is not None
        lower = plan.lower
        found: list[tuple[dict[str, Any], str, float, int]] = []

        def decide(traced: trace.Traced) -> bool:
            self.tally.add(key.env.namespace, traces=1, trace_seconds=traced.seconds)
            k2 = trace.stage_two_key(key, traced, plan.context)
            before = layout.entry_bytes(self.store.entry_dir(key))
            manifest = self._link_first(key, k2)
            if manifest is not None:
                found.append((manifest, k2, traced.seconds, before))
                return True
            log.debug("%s %s: no usable entry of another release has its traced IR (traced in %.2f s); lowering that trace",
                      key.site, key.digest[:12], traced.seconds)
            if log.isEnabledFor(self.miss_level):
                log.log(self.miss_level, "compiling %s", report.describe_kernel(key, self._why(key)))
            return False

        def compile_once() -> Any:
            kernel = lower(decide)
            if kernel is trace.STOPPED:
                raise _Linked()
            return kernel

        t0 = time.perf_counter()
        try:
            return self._compile_and_commit(key, compile_once, extra_fn, plan, announce=False)
        except _Linked:  # the DSL stopped at the trace: load the linked entry outside its compile
            manifest, k2, traced_s, before = found[-1]
            hit = self._served_from_link(key, manifest, k2, traced_s, before, t0, extra_ok)
            if hit is not None:
                return hit
        # linked, but not for this process after all (host CPU, side data...): the compile rewrites it
        return self._compile_and_commit(key, compile_fn, extra_fn, plan)

    def _try_reuse(self, key: CacheKey, plan: reuse.Plan | None,
                   extra_ok: Callable[[dict[str, Any]], bool] | None) -> tuple[Any, dict[str, Any]] | None:
        """The second stage (:mod:`..storage.reuse`): trace, look the traced IR up, link the entry found
        under ``key`` and load it exactly as a hit; None when any step finds nothing.

        Only where a record of this DSL stack exists (else a trace could find nothing) and the
        root can take the new entry (a read-only root compiles in memory, as for any miss).
        """
        if plan is None or not self.store.probe_writable():
            return None
        try:
            if not reuse.possible(self.store, key.env) and not (self.remote is not None and self.remote.reuse_possible(key.env)):
                return None
        except Exception as exc:  # noqa: BLE001 - only the second stage lost: the compile goes on
            log.debug("second-stage lookup skipped: %s: %s", type(exc).__name__, exc)
            return None
        t0 = time.perf_counter()
        try:
            traced = plan.trace()
        except Exception as exc:  # noqa: BLE001 - a DSL without hooks, or arguments it refuses (the compile says so)
            log.debug("no trace of %s %s: %s: %s", key.site, key.digest[:12], type(exc).__name__, exc)
            return None
        traced_s = time.perf_counter() - t0
        self.tally.add(key.env.namespace, traces=1, trace_seconds=traced_s)
        k2 = trace.stage_two_key(key, traced, plan.context)
        dest = self.store.entry_dir(key)
        try:
            before = layout.entry_bytes(dest)
            manifest = self._link_first(key, k2)
        except Exception as exc:  # noqa: BLE001 - a bug of ours must cost a compile, never the caller's kernel
            log.error("cute-diskcache second-stage lookup failed unexpectedly (%s: %s); compiling", type(exc).__name__, exc)
            return None
        if manifest is None:
            log.debug("%s %s: no usable entry of another release has its traced IR (traced in %.2f s)", key.site, key.digest[:12],
                      traced_s)
            return None
        return self._served_from_link(key, manifest, k2, traced_s, before, t0, extra_ok)

    def _served_from_link(self, key: CacheKey, manifest: dict[str, Any], k2: str, traced_s: float, before: int, t0: float,
                          extra_ok: Callable[[dict[str, Any]], bool] | None) -> tuple[Any, dict[str, Any]] | None:
        """An entry just linked under ``key`` from ``k2``'s record, loaded exactly as a hit (None
        when it does not serve this process after all)."""
        dest = self.store.entry_dir(key)
        try:  # what the link added: its manifest, and payloads it had to copy (a hard link adds no disk)
            eviction.note_commit(self.store.root, layout.entry_bytes(dest) - before, entry_dir=dest, shared=self.store.bookkeeping_shared)
        except OSError as exc:
            log.debug("size cap not updated for a reused entry: %s", exc)
        hit = self._try_hit(key, extra_ok=extra_ok, reused_since=t0)
        if hit is None:  # linked, but not for this process after all (host CPU, side data...): the compile rewrites it
            return None
        self._publish(key, k2)  # the newest entry: an old release's prune leaves it
        level = logging.DEBUG if self.tally.prewarm else logging.INFO
        why = (f"from {reuse.reused_from(manifest)}: same traced IR (traced in {traced_s:.2f} s instead of a "
               f"{float(manifest['compile_seconds']):.1f} s compile)")
        log.log(level, "reused %s", report.describe_kernel(key, why))
        return hit

    def _link_first(self, key: CacheKey, k2: str) -> dict[str, Any] | None:
        """Link ``key``'s entry from the first record for ``k2`` that serves: this root's, each
        layer's, then the fleet's (fetched into this root first). A record whose entry is gone or
        does not fit is passed over, so a stale record here never hides a sound one in a layer."""
        sources = reuse.candidates(self.store, key.env, k2)
        if self.remote is not None:
            sources = itertools.chain(sources, self._remote_source(key, k2))
        for found in sources:
            try:
                return reuse.link(self.store, key, *found)
            except (reuse.NotReusable, OSError) as exc:
                log.info("cute-diskcache: not reusing an entry for %s: %s", key.site, exc)
        return None

    def _remote_source(self, key: CacheKey, k2: str) -> Iterator[tuple[Store, Any]]:
        assert self.remote is not None
        found = self.remote.reuse_source(key.env, k2, self.store)
        if found is not None:
            yield found

    @property
    def counters(self) -> counting.Counters:
        """This process's counts (``cute_diskcache.counters()`` returns a copy with the remote's)."""
        return self.tally.fields

    @property
    def events(self) -> list[counting.Event]:
        """Every kernel asked of this cache, in order (what the benches and tests read)."""
        return self.tally.events

    def _count_served(self, key: CacheKey, manifest: dict[str, Any], names: tuple[str, str], event: str,
                      seconds: float) -> None:
        """Count a kernel served from an entry (a hit, or a reuse: ``names`` says which counters),
        in this process and in the statistics file, and mark the entry used for eviction."""
        count, seconds_name = names
        self.tally.add(key.env.namespace, **{count: 1, seconds_name: seconds, "saved_seconds": float(manifest["compile_seconds"])})
        self.tally.event(key.site, key.digest, event, seconds)
        if self.store.writable:
            eviction.touch(self.store.entry_dir(key))

    def _load(self, key: CacheKey, found: Any) -> Any:
        """The kernel from verified bytes: the shared object when that is what was verified, and
        if this process cannot load it after all, the object (checked on its own first). A
        cross-building process loads nothing: :class:`NotLoaded`, once the bytes are the host
        code of the machine it builds for."""
        manifest, data = found
        if hostmachine.cross():  # another machine's code: judged, never mapped (loader.refuse_foreign says why not)
            loader.refuse_foreign(data, hostmachine.current())
            return NotLoaded(key.digest, hostmachine.current())
        role = getattr(found, "role", "object")
        if role == "shared":
            try:
                kernel = loader.load_shared(data, manifest["symbol"])
                self.tally.add(None, shared_loads=1)
                return kernel
            except Exception as exc:  # noqa: BLE001 - an unexpected runtime: never the entry's fault
                log.debug("shared object of %s not loadable here (%s: %s); loading the object", key.digest[:12], type(exc).__name__, exc)
            found = self.store.lookup_or_quarantine(key)
            if found is None:
                raise RuntimeError("the entry went away while falling back to its object")
            manifest, data = found
        return loader.load_object(data, manifest["symbol"], manifest["tvm_ffi"])

    def _compile_and_commit(
        self,
        key: CacheKey,
        compile_fn: Callable[[], Any],
        extra_fn: Callable[[Any], dict[str, Any]] | None,
        plan: reuse.Plan | None = None,
        announce: bool = True,
    ) -> tuple[Any, dict[str, Any]]:
        """Compile, count and persist; ``announce=False`` where ``compile_fn`` says "compiling"
        itself, once it knows (:meth:`_trace_then_lower`: after the lookup, or not at all when an
        entry was linked instead: then :class:`_Linked` passes through, counted as nothing)."""
        # Ask the root once, before the compile: a read-only root warns now, and the root is
        # created with a private mode before the statistics write into it.
        self.store.probe_writable()
        if announce and log.isEnabledFor(self.miss_level):
            log.log(self.miss_level, "compiling %s", report.describe_kernel(key, self._why(key)))
        t0 = time.perf_counter()
        ns = key.env.namespace
        try:
            with devicefacts.recording() as device, export.capturing() as objects, trace.recording() as lowered:
                kernel = compile_fn()
        except _Linked:  # not a compile: the caller loads what was linked
            raise
        except BaseException as exc:
            # The compile failed, or whatever it goes through refused it (vLLM's JIT monitor in
            # `error` mode): a miss with nothing compiled, and the caller gets the exception. The
            # "compiling" line above said what was tried; this one says it did not happen.
            self.tally.add(ns, misses=1)
            self.tally.event(key.site, key.digest, "failed", time.perf_counter() - t0)
            if log.isEnabledFor(self.miss_level) and isinstance(exc, Exception):
                first = (str(exc).splitlines() or [""])[0][:200]
                log.log(self.miss_level, "not compiled: %s %s raised %s: %s; nothing written", key.site, key.digest[:12],
                        type(exc).__name__, first)
            raise
        seconds = time.perf_counter() - t0
        extra = extra_fn(kernel) if extra_fn is not None else {}
        self.tally.add(ns, misses=1, compiles=1, compile_seconds=seconds)
        wrote = False
        t_persist = time.perf_counter()
        made: list[entry.Artifact] = []
        if self.store.probe_writable():
            try:
                manifest = self.store.persist(
                    key, lambda work: _kept(made, export.export(kernel, key.digest, seconds, extra, device, workdir=work,
                                                                  captured=objects)))
                wrote = manifest is not None
                if manifest is not None:
                    self.tally.add(ns, writes=1, bytes_written=sum(p["size"] for items in manifest["payloads"].values() for p in items))
            except Exception as exc:  # noqa: BLE001 - never let persistence break a kernel the caller already has
                self.tally.add(ns, errors=1)
                log.warning("could not persist %s kernel: %s: %s", key.site, type(exc).__name__, exc)
            if wrote:
                # what this compile lowered: the next release's trace finds it
                self._publish(key, trace.stage_two_key(key, lowered[-1], plan.context) if plan is not None and lowered else None)
        if wrote and made and not made[-1].in_process:
            kernel, extra = self._as_written(key, kernel, extra)
        self.tally.event(key.site, key.digest, "miss", seconds, time.perf_counter() - t_persist)
        log.debug(  # the WARNING before the compile said why; the exit summary adds up the seconds
            "miss %s %s: compiled in %.2f s%s",
            key.site,
            key.digest[:12],
            seconds,
            "" if wrote else " (not persisted)",
        )
        return kernel, extra

    def _as_written(self, key: CacheKey, kernel: Any, extra: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The entry just written, loaded as a hit loads it: its host code is the baseline's, not
        the natively tuned code the DSL runs in this process, and the caller must get what every
        later hit gets. Uncounted (the compile was counted); the compiled kernel if it cannot be."""
        try:
            found = self.store.lookup_or_quarantine(key, load=True)
            if found is not None:
                return self._load(key, found), {**found[0]["extra"], HIT_FROM: as_compiled.Payloads(functools.partial(self.store.read_role, key))}
        except Exception as exc:  # noqa: BLE001 - the kernel in hand still works: never lose it
            log.debug("%s %s: the written entry did not load (%s: %s); handing over the compiled kernel", key.site,
                      key.digest[:12], type(exc).__name__, exc)
        return kernel, extra

    def _publish(self, key: CacheKey, k2: str | None) -> None:
        """A committed entry and its second-stage record (``k2``, when there is one) here, then
        on the remote tier behind it (write-behind: returns at once)."""
        if k2 is not None:
            reuse.write_record(self.store, key, k2)
        if self.remote is not None:
            self.remote.publish(key, self.store.entry_dir(key))
            if k2 is not None:
                self.remote.publish_record(key, k2)

    def _why(self, key: CacheKey) -> str:
        return explain.why_missed(self.store, key, refused=self._refused.pop(key.digest, None))

    def _refuse_to_compile(self, key: CacheKey) -> None:
        """``CUTE_DISKCACHE_ON_MISS=error``: count the miss, say why, raise; nothing compiled, locked or written."""
        why = self._why(key)
        self.tally.add(key.env.namespace, misses=1)
        self.tally.event(key.site, key.digest, "refused")
        message = (f"CUTE_DISKCACHE_ON_MISS=error: not compiling {report.describe_kernel(key, why)} "
                   f"(cache {self.store.root}; prewarm it, or set CUTE_DISKCACHE_ON_MISS=compile)")
        log.error("%s", message)
        raise CacheMissError(message, site=key.site, digest=key.digest, reason=why)


_default: CompileCache | None = None
_default_lock = threading.Lock()


class _Linked(Exception):
    """Raised out of a compile that stopped at its trace because another release's entry with the
    same traced IR was linked under the key: the caller loads it (never reaches a caller's caller)."""


def default_cache() -> CompileCache:
    """The process-wide cache for the current settings (built on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            settings = config.load()
            store = Store.for_settings(settings)
            remote: LazyRemote | None = None
            if settings.remote:
                from .. import remote as remote_tier  # cheap: the client and its library load at the first local miss

                why = remote_tier.refusal(settings)
                if why is not None:
                    log.warning("cute-diskcache: remote cache %s is off: %s", remote_tier.redact(settings.remote), why)
                else:
                    note = remote_tier.unsigned_warning(settings)
                    if note:
                        log.warning(note)
                    remote = remote_tier.LazyRemote(settings)
            _default = CompileCache(store, single_flight=settings.single_flight, lock_timeout=settings.lock_timeout, remote=remote)
        return _default


def reset_default_cache() -> None:
    """Forget the process-wide cache so the next use re-reads the environment."""
    global _default
    with _default_lock:
        _default = None
