"""``prewarm MODEL --linear-backend b12x``: the b12x package's linear kernels, compiled before the engine starts.

The operator's side of :mod:`..b12x_sites.planning`: resolve the model's NVFP4 linear shapes
(:func:`.models.dense_shape`) and vLLM's warm-up token counts, let b12x plan its jobs for the
target card, list them (``--dry-run``) or compile them in ``--jobs`` workers into the cache. Runs
in the interpreter the engine uses (b12x installed: ``pip install vllm[b12x]``). ``check
--linear-backend b12x`` plans with the same :func:`resolve` and :func:`requests`.

The flags mean what they mean for flashinfer's kernels: ``--dtype`` is the linears' output dtype
(another kernel), and a target served from another host machine (``--target dgx-spark`` on an
x86 box) gets that machine's host code in that machine's namespace, written by the same
library-neutral cross-build (:mod:`..core.crossbuild`, through the hook's export) in every worker, or
a refusal naming the way that works (:func:`.cross_refusal`) before anything compiles.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


class Refused(Exception):
    """The model or flags cannot be planned for b12x (exit 2): one line that says why."""


def resolve(args: argparse.Namespace) -> tuple[Any, tuple[int, ...]]:
    """(the model's NVFP4 linear layers, vLLM's warm-up token counts) for prewarm's and ``check``'s
    b12x plan (the same flags, the same answer); :class:`Refused` when they cannot be planned."""
    from . import models
    from .. import prewarm
    from ..keys import targets
    from ..b12x_sites import adapter

    if adapter.package_dir() is None:
        raise Refused("--linear-backend b12x needs the b12x package in this interpreter "
                      "(pip install vllm[b12x], or b12x==1.5.1)")
    from pathlib import Path

    from ..b12x_sites import scan

    refusal = scan.prewarm_refusal(Path(adapter.package_dir() or "."), adapter.version())
    if refusal:  # a b12x older than the planning API (1.3.0 and before): no traceback, doctor's reason
        raise Refused(refusal)
    if not args.target:
        raise Refused("--linear-backend b12x compiles for a named card: pass --target (e.g. rtx-pro-6000)")
    try:
        targets.get(args.target)
        if models.is_moe(models.load_config(args.model)[0]):
            raise models.UnsupportedModelError(f"{args.model} is a MoE model: b12x's MoE kernels are not planned yet "
                                               "(--linear-backend b12x covers dense NVFP4 linears)")
        dense = models.dense_shape(args.model, tp=args.tp).with_dtype(getattr(args, "dtype", "auto"))
        prewarm.choose_host_machine(args)  # before the first key: the namespace the target's engine reads
    except (ValueError, KeyError, prewarm.PlanRefused) as exc:
        raise Refused(str(exc)) from None
    from ..b12x_sites import planning

    return dense, tuple(args.m) if args.m else planning.token_counts(args.max_num_tokens)


def run(args: argparse.Namespace) -> int:
    """Prewarm's b12x branch: its refusals, JSON and exit status are :mod:`.prewarm`'s, and so are
    its closing lines (where it wrote, how to serve, the ``check`` that gates a deploy)."""
    from ..keys import hostcpu, hostmachine, targets
    from .. import prewarm

    try:
        dense, counts = resolve(args)
    except Refused as exc:
        return prewarm.refuse(args, str(exc))
    profile = targets.get(args.target)
    from ..activation import install

    install(target=args.target)
    from ..b12x_sites import planning
    from ..core.cache import default_cache

    default_cache().for_prewarm()
    cannot = prewarm.cross_refusal(args, str(default_cache().store.root))
    if cannot:
        return prewarm.refuse(args, cannot)
    t0 = time.perf_counter()
    jobs = planning.plan(dense, counts, profile)
    results = [] if args.dry_run else _compile_missing(args, jobs)
    summary = _summary(jobs, results, time.perf_counter() - t0, args, dense)
    summary["host_machine"] = hostmachine.current()
    if not args.dry_run:
        summary["written"] = _written(results)
        summary["host_cpu_beyond_baseline"] = hostcpu.written_beyond_baseline()
    if args.json:
        print(json.dumps({"schema": prewarm.JSON_SCHEMA, **summary}, indent=1))
    else:
        print(_table(summary, args.dry_run))
        if not args.dry_run:
            prewarm.print_next_steps(summary["written"], summary["host_cpu_beyond_baseline"], prewarm.argv_of_plan(args),
                                     summary["host_machine"])
    return prewarm.EXIT_FAILED if summary["errors"] else 0


def _written(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the jobs' kernels are now (:func:`.where_written`'s shape): the root, entries
    per namespace, bytes; b12x keeps none in its own cache while ours serves."""
    from ..storage import entry, layout
    from ..core.cache import default_cache

    root = default_cache().store.root
    digests = {d for r in results for d in r.get("digests", ())}
    namespaces: dict[str, int] = {}
    size = 0
    for ns in layout.namespaces(root):
        for digest in digests:
            path = layout.entry_dir(root, ns, digest)
            if (path / entry.MANIFEST).is_file():
                namespaces[ns] = namespaces.get(ns, 0) + 1
                size += layout.entry_bytes(path)
    return {"root": str(root), "namespaces": namespaces, "entries": sum(namespaces.values()), "bytes": size, "native": 0}


def _compile_missing(args: argparse.Namespace, jobs: list[Any]) -> list[dict[str, Any]]:
    """Compile, in workers, only the jobs some of whose kernels the store cannot serve; a job whose
    every kernel is there is reported ``cached`` without a worker loading it (as flashinfer's
    prewarm skips its cached kernels: a rerun over a filled root, or a second Spark cross-build, costs
    the plan alone). Judged by :func:`..prewarm.mark_cached`, the checks serving applies."""
    from .. import prewarm
    from ..b12x_sites import adapter

    if adapter.left_to_b12x():  # b12x's own cache keeps them: nothing of ours to judge
        return _compile(jobs, args)
    planned = _requests_of(args, jobs)
    cached: list[dict[str, Any] | None] = []
    for _job, reqs in planned:
        kernels = {r["digest"]: prewarm.Kernel(r["digest"], r["site"], key=r["key"], extra_ok=r["extra_ok"]) for r in reqs}
        prewarm.mark_cached(kernels)
        whole = all(k.status == "cached" for k in kernels.values())
        cached.append({"status": "cached", "seconds": 0.0, "programs": 0, "digests": sorted(kernels), "compiles": 0,
                       "hits": len(kernels), "errors": 0} if whole else None)
    todo = [job for job, done in zip(jobs, cached, strict=True) if done is None]
    compiled = iter(_compile(todo, args))
    return [done if done is not None else next(compiled) for done in cached]


def _compile(jobs: list[Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each job in one of ``--jobs`` spawned workers, set up for the target and this host machine."""
    from . import spawned
    from ..keys import hostmachine
    from ..b12x_sites import planning

    return spawned.starmap(planning.run_job, [(p.job,) for p in jobs], args.jobs, planning.compile_worker,
                           (args.target, hostmachine.current()))


def requests(args: argparse.Namespace, dense: Any, counts: tuple[int, ...]) -> list[tuple[Any, list[dict[str, Any]]]]:
    """``check``'s plan: each of b12x's jobs with the keys its compiles ask our cache for, found by
    running the job's factory in this process, set up as prewarm's workers are, with compiles
    intercepted (each reports its key and gets a kernel that launches nothing: nothing compiles).
    b12x memoises a kernel in-process, so a job whose kernel an earlier job asked for adds none.
    This process must not serve afterwards (b12x keeps the stand-ins)."""
    from ..keys import targets
    from ..b12x_sites import planning

    return _requests_of(args, planning.plan(dense, counts, targets.get(args.target)))


def _requests_of(args: argparse.Namespace, jobs: list[Any]) -> list[tuple[Any, list[dict[str, Any]]]]:
    from ..core import through
    from ..keys import hostmachine
    from ..b12x_sites import planning

    planning.init_worker(args.target, hostmachine.current())
    out = []
    with through.planning() as requested:
        for job in jobs:
            before = len(requested)
            planning.run_job(job.job)
            out.append((job, requested[before:]))
    return out


def _summary(jobs: list[Any], results: list[dict[str, Any]], wall: float, args: argparse.Namespace, dense: Any) -> dict[str, Any]:
    rows = [{"linear": j.linear, "n": j.n, "k": j.k, "capacity": j.capacity, "factory": j.factory, "ms": j.ms,
             **(results[i] if results else {"status": "planned"})} for i, j in enumerate(jobs)]
    return {
        "backend": "b12x", "model": dense.as_dict(), "target": args.target, "dry_run": bool(args.dry_run),
        "jobs": len(jobs), "kernels_compiled": sum(r.get("compiles", 0) for r in rows),
        "kernels_cached": sum(r.get("hits", 0) for r in rows), "errors": sum(r.get("errors", 0) for r in rows),
        "seconds": round(wall, 1), "job_list": rows,
    }


def _table(summary: dict[str, Any], dry: bool) -> str:
    lines = [f"b12x linear kernels for {summary['model']['model']} (out {summary['model']['out_dtype']}) on "
             f"{summary['target']} ({summary['host_machine']} host code): {summary['jobs']} jobs "
             f"(vLLM's b12x warm-up: one per linear shape and row capacity)"]
    lines.append(f"  {'linear':<14}{'n x k':>14}  {'rows':>5}  {'token counts':<18}" + ("" if dry else "  compiled  cached"))
    for r in summary["job_list"]:
        ms = r["ms"]
        span = f"{ms[0]}" if len(ms) == 1 else f"{ms[0]}-{ms[-1]} ({len(ms)})"
        shape = f"{r['n']} x {r['k']}"
        line = f"  {r['linear']:<14}{shape:>14}  {r['capacity']:>5}  {span:<18}"
        lines.append(line + ("" if dry else f"  {r['compiles']:>8}  {r['hits']:>6}"))
    if not dry:
        lines.append(f"{summary['kernels_compiled']} kernels compiled, {summary['kernels_cached']} already cached, "
                     f"{summary['errors']} errors, in {summary['seconds']} s")
    return "\n".join(lines)
