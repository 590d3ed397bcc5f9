"""What prewarm's branches for the libraries whose kernels it drives through Python calls share
(b12x's jobs, b12x's MoE launches, SGLang's decode calls): their set-up, planning, skipping what
is cached, workers and closing, in one place so that the branches cannot drift apart.

Spawned, not forked: the parent has imported torch and the DSL (their threads and locks do not
survive a fork), and each worker applies the target card's profile (its ``initializer``) before
the library is imported. One call at a time (``chunksize=1``): a call is a kernel's compile,
seconds long, so a slow one never holds finished work behind it. flashinfer's prewarm has its own
long-lived workers (:mod:`..prewarm`), which stream each kernel's outcome back as it lands.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any


class Refused(Exception):
    """The model or flags cannot be planned for the library (exit 2): one line that says why."""


def starmap(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], workers: int,
            initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()) -> list[Any]:
    """``fn(*call)`` for each call, in order, in at most ``workers`` spawned processes (never more
    processes than calls)."""
    if not calls:
        return []
    context = multiprocessing.get_context("spawn")
    with context.Pool(max(1, min(workers, len(calls))), initializer=initializer, initargs=initargs) as pool:
        return pool.starmap(fn, calls, chunksize=1)


def requests(calls: Iterable[tuple[Any, Callable[[], object]]]) -> list[tuple[Any, list[dict[str, Any]]]]:
    """Each ``(label, call)``'s label with the requests its call made of our cache, nothing compiled
    (a library memoises a kernel in-process: this process must not serve afterwards). A generator's
    own set-up between calls runs inside the planning too, its requests no call's."""
    from ..core import through

    out = []
    with through.planning() as requested:
        for label, call in calls:
            before = len(requested)
            call()
            out.append((label, requested[before:]))
    return out


def compile_missing(planned: Sequence[tuple[Any, list[dict[str, Any]]]], compile_: Callable[[list[Any]], list[dict[str, Any]]],
                    **fields: Any) -> list[dict[str, Any]]:
    """Each planned call's result, in order: a ``cached`` row (``fields`` added) for a call whose
    every kernel the store serves (:func:`..prewarm.mark_cached`, the checks serving applies), so a
    rerun over a filled root costs the plan alone; ``compile_``'s, in one call, for the others."""
    from .. import prewarm

    cached: list[dict[str, Any] | None] = []
    for _, reqs in planned:
        kernels = {r["digest"]: prewarm.Kernel(r["digest"], r["site"], key=r["key"], extra_ok=r["extra_ok"]) for r in reqs}
        prewarm.mark_cached(kernels)
        whole = all(k.status == "cached" for k in kernels.values())
        cached.append({"status": "cached", "seconds": 0.0, "digests": sorted(kernels), "compiles": 0, "hits": len(kernels),
                       "errors": 0, **fields} if whole else None)
    compiled = iter(compile_([item for (item, _), done in zip(planned, cached, strict=True) if done is None]))
    return [done if done is not None else next(compiled) for done in cached]


def watched(fields: dict[str, Any], fn: Callable[..., object], *args: Any) -> dict[str, Any]:
    """A worker's job: ``fn(*args)``, its compiles through our cache; ``fields``, what it cost, the
    digests it compiled or found and its counts, and an error it raised as one line (reported per
    job: the other jobs carry on, and the branch exits 1)."""
    from ..core.cache import default_cache

    t0, error = time.perf_counter(), None
    with default_cache().tally.watch("compiles", "hits", "errors") as seen:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported per job; the others carry on
            error = f"{type(exc).__name__}: {exc}"
    return {**fields, "seconds": time.perf_counter() - t0, "digests": seen.digests, "error": error, **seen.counts}


def set_up(args: argparse.Namespace) -> None:
    """This process's cache on for ``--target`` (:func:`worker`); :class:`Refused` when this machine
    cannot write the host code the target needs (:func:`..prewarm.cross_refusal`), before anything compiles."""
    from .. import prewarm
    from ..core.cache import default_cache

    worker(args.target)
    cannot = prewarm.cross_refusal(args, str(default_cache().store.root))
    if cannot:
        raise Refused(cannot)


def worker(target: str) -> None:
    """A prewarm process: our cache on for ``target``, a prewarm's (no attach line or exit summary,
    compiles at DEBUG, counted as prewarm statistics)."""
    from ..activation import install
    from ..core.cache import default_cache

    install(target=target)
    default_cache().for_prewarm()


def totals(rows: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """The summary's closing fields: kernels compiled and found, errors (a job's failed compiles,
    and a job that raised), the seconds since ``t0``, the rows."""
    return {"kernels_compiled": sum(r.get("compiles", 0) for r in rows), "kernels_cached": sum(r.get("hits", 0) for r in rows),
            "errors": sum(r.get("errors", 0) + (1 if r.get("error") else 0) for r in rows),
            "seconds": round(time.perf_counter() - t0, 1), "job_list": rows}


def outcome(row: dict[str, Any], dry: bool) -> str:
    """A row's tail in the text table: what compiled and was cached, its error; nothing on a dry run."""
    return "" if dry else f"  compiled {row.get('compiles', 0)}, cached {row.get('hits', 0)}" + (f"  ERROR {row['error']}" if row.get("error") else "")


def finish(args: argparse.Namespace, summary: dict[str, Any], results: list[dict[str, Any]], lines: list[str],
           host_cpu: bool = False, says_cached: bool = True) -> int:
    """The branch's end: after a compile, where the kernels are (``written``; with ``host_cpu``,
    what the host code needs beyond the baseline); ``summary`` as prewarm's JSON, or ``lines``, the
    totals and prewarm's closing lines (how to serve, the ``check`` that gates a deploy); exit 1 on an error."""
    from .. import prewarm
    from ..keys import hostcpu

    if not args.dry_run:
        summary["written"] = written(results)
        if host_cpu:
            summary["host_cpu_beyond_baseline"] = hostcpu.written_beyond_baseline()
        lines = [*lines, f"{summary['kernels_compiled']} kernels compiled, " + (f"{summary['kernels_cached']} already cached, " if says_cached else "")
                 + f"{summary['errors']} errors, in {summary['seconds']} s"]
    if args.json:
        print(json.dumps({"schema": prewarm.JSON_SCHEMA, **summary}, indent=1, default=str))
    else:
        print("\n".join(lines))
        if not args.dry_run:
            prewarm.print_next_steps(summary["written"], summary.get("host_cpu_beyond_baseline", []), prewarm.argv_of_plan(args),
                                     summary.get("host_machine"))
    return prewarm.EXIT_FAILED if summary["errors"] else 0


def written(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the results' kernels are now (:func:`..prewarm.where_written`'s shape): the root,
    entries per namespace, bytes; the library keeps none in its own cache while ours serves."""
    from ..core.cache import default_cache
    from ..storage import entry, layout

    root = default_cache().store.root
    digests = {d for r in results for d in r.get("digests", ())}
    namespaces: dict[str, int] = {}
    size = 0
    for ns, digest in itertools.product(layout.namespaces(root), digests):
        path = layout.entry_dir(root, ns, digest)
        if (path / entry.MANIFEST).is_file():
            namespaces[ns] = namespaces.get(ns, 0) + 1
            size += layout.entry_bytes(path)
    return {"root": str(root), "namespaces": namespaces, "entries": sum(namespaces.values()), "bytes": size, "native": 0}
