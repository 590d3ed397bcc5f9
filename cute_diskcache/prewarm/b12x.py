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
import functools
import time
from typing import Any

from . import spawned
from .spawned import Refused


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
    from .. import prewarm
    from ..keys import hostmachine, targets

    try:
        dense, counts = resolve(args)
        spawned.set_up(args)
    except Refused as exc:
        return prewarm.refuse(args, str(exc))
    from ..b12x_sites import adapter, planning

    def compile_(todo: list[Any]) -> list[dict[str, Any]]:  # in ``--jobs`` workers set up for the target and this host machine
        return spawned.starmap(planning.run_job, [(p.job,) for p in todo], args.jobs, planning.compile_worker,
                               (args.target, hostmachine.current()))

    t0 = time.perf_counter()
    jobs = planning.plan(dense, counts, targets.get(args.target))
    results: list[dict[str, Any]] = []
    if not args.dry_run:  # every job when b12x's own cache keeps its kernels (nothing of ours to judge)
        results = compile_(jobs) if adapter.left_to_b12x() else spawned.compile_missing(requests(args, dense, counts, jobs), compile_, programs=0)
    summary = _summary(jobs, results, t0, args, dense)
    return spawned.finish(args, summary, results, _table(summary, args.dry_run), host_cpu=True)


def requests(args: argparse.Namespace, dense: Any, counts: tuple[int, ...], jobs: list[Any] | None = None) -> list[tuple[Any, list[dict[str, Any]]]]:
    """``check``'s plan (and prewarm's, of its ``jobs``): each of b12x's jobs with the keys its
    compiles ask our cache for, found by running the job's factory in this process, set up as
    prewarm's workers are, with compiles intercepted (each reports its key and gets a kernel that
    launches nothing: nothing compiles). This process must not serve afterwards (b12x keeps the stand-ins)."""
    from ..keys import hostmachine, targets
    from ..b12x_sites import planning

    jobs = planning.plan(dense, counts, targets.get(args.target)) if jobs is None else jobs
    planning.init_worker(args.target, hostmachine.current())
    return spawned.requests((job, functools.partial(planning.run_job, job.job)) for job in jobs)


def _summary(jobs: list[Any], results: list[dict[str, Any]], t0: float, args: argparse.Namespace, dense: Any) -> dict[str, Any]:
    from ..keys import hostmachine

    rows = [{"linear": j.linear, "n": j.n, "k": j.k, "capacity": j.capacity, "factory": j.factory, "ms": j.ms,
             **(results[i] if results else {"status": "planned"})} for i, j in enumerate(jobs)]
    return {"backend": "b12x", "model": dense.as_dict(), "target": args.target, "dry_run": bool(args.dry_run), "jobs": len(jobs),
            **spawned.totals(rows, t0), "host_machine": hostmachine.current()}


def _table(summary: dict[str, Any], dry: bool) -> list[str]:
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
    return lines
