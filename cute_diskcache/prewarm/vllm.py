"""``prewarm MODEL --target dgx-spark``: vLLM's own skinny GEMM kernels, compiled before the engine starts.

The operator's side of :mod:`..vllm_sites.planning`. vLLM 0.34 hands an unquantized, bias-free
BF16 linear (or LM head) to its own CuTe-DSL skinny GEMM when the card's capability has a plan
for the layer's per-rank weight shape (only (12, 1): DGX Spark), and its warm-up compiles every
configuration of those plans at each engine start (vLLM keeps them in memory only). This group
plans the same configurations from the model's config (``--tp`` shards the layers as vLLM does)
and compiles them with vLLM's own ``_compile`` in spawned workers, into our cache. It joins the
flashinfer plan of a vLLM prewarm (and is the whole plan of a BF16 checkpoint, which flashinfer's
sm12x kernels do not run); ``check`` plans it with the same :func:`resolve` and :func:`requests`.

It does not apply, silently, where vLLM would not compile it: vLLM not installed, no ``--target``,
a card vLLM has no plan for, ``VLLM_BATCH_INVARIANT``, FP16 activations, or
``CUTE_DISKCACHE_NATIVE_SITES`` naming vllm.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any

from . import spawned


@dataclass(frozen=True)
class Group:
    """What vLLM's skinny GEMM warm-up compiles for this model on this card."""

    capability: tuple[int, int]
    layers: tuple[Any, ...]  # :class:`.models.Linear`: the layers whose shape has a plan
    configs: list[dict[str, Any]] = field(default_factory=list)  # SkinnyGemmConfig's fields
    notes: tuple[str, ...] = ()


def resolve(args: argparse.Namespace) -> Group | None:
    """The group for these flags, or None where vLLM would compile none of it (module docstring).
    Reads vLLM's plan table in this process (:mod:`..vllm_sites.planning`: it must not serve afterwards)."""
    from . import models
    from ..keys import targets
    from pathlib import Path

    from ..vllm_sites import adapter, planning, scan

    if getattr(args, "engine", "vllm") != "vllm" or not args.target or adapter.package_dir() is None or adapter.left_to_vllm():
        return None
    if scan.planning_gap(Path(adapter.package_dir() or ".")):  # a vLLM without the plan table compiles none of this
        return None
    if os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0") or targets.refusal(args.target) is not None:
        return None
    capability = tuple(targets.get(args.target).capability)
    try:
        cfg = models.load_config(args.model)[0]
        cfg = cfg.get("text_config") or cfg
        layers, notes = models.unquantized_linears(args.model, tp=args.tp)
    except (ValueError, KeyError):
        return None  # the flashinfer plan says what is wrong with the model
    dtype = getattr(args, "dtype", "auto")
    if (str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16") if dtype in (None, "auto") else dtype) != "bfloat16":
        return None  # vLLM's skinny GEMM takes BF16 weights only
    table = planning.plans(capability)  # type: ignore[arg-type]
    planned = tuple(lin for lin in layers if (lin.n, lin.k) in table)
    return Group(capability, planned, planning.configs(capability, [(lin.n, lin.k) for lin in planned]), notes)  # type: ignore[arg-type]


def requests(args: argparse.Namespace, group: Group) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each configuration with the key its compile asks our cache for (nothing compiles): vLLM's
    own ``_compile`` with compiles intercepted. This process must not serve afterwards."""
    from ..keys import hostmachine
    from ..vllm_sites import planning

    planning.init_worker(args.target, hostmachine.current())
    return spawned.requests((config, functools.partial(planning.compile_config, config, group.capability)) for config in group.configs)


def _worker(target: str, host_machine: str) -> None:
    from ..core.cache import default_cache
    from ..vllm_sites import planning

    planning.init_worker(target, host_machine)
    default_cache().for_prewarm()


def run(args: argparse.Namespace, group: Group) -> dict[str, Any]:
    """Compile the group's missing kernels (``--dry-run``: list them) and say what was done: a
    configuration every kernel of which the store serves is reported cached without a worker."""
    from ..keys import hostmachine
    from ..vllm_sites import planning

    t0 = time.perf_counter()
    planned = requests(args, group)
    if args.dry_run:
        rows = [{"config": config, "status": "planned", "digests": sorted({r["digest"] for r in reqs})} for config, reqs in planned]
    else:
        rows = spawned.compile_missing(planned, lambda todo: spawned.starmap(
            spawned.watched, [({"config": c}, planning.compile_config, c, group.capability) for c in todo], args.jobs,
            _worker, (args.target, hostmachine.current())))
        rows = [{"config": config, **row} for (config, _), row in zip(planned, rows, strict=True)]
    return {"capability": list(group.capability), "layers": [lin.as_dict() for lin in group.layers], "notes": list(group.notes),
            "configs": len(group.configs), **spawned.totals(rows, t0)}


def with_written(written: dict[str, Any], summary: dict[str, Any] | None) -> dict[str, Any]:
    """flashinfer's ``written`` (:func:`..prewarm.where_written`) with the group's entries added."""
    if summary is None:
        return written
    ours = spawned.written(summary["job_list"])
    for ns, n in ours["namespaces"].items():
        written["namespaces"][ns] = written["namespaces"].get(ns, 0) + n
    return {**written, "entries": written["entries"] + ours["entries"], "bytes": written["bytes"] + ours["bytes"]}


def lines(summary: dict[str, Any], model: str, target: str, dry: bool, totals: bool = True) -> list[str]:
    """The group's part of prewarm's table (with its totals, unless the caller closes with them)."""
    layers = ", ".join(f"{lin['name']} {lin['n']}x{lin['k']}" for lin in summary["layers"])
    out = [f"vLLM skinny GEMM for {model} on {target} (capability {tuple(summary['capability'])} plans): "
           f"{summary['configs']} configurations for {layers}"]
    for r in summary["job_list"]:
        c = r["config"]
        name = (f"rows {c['num_rows']} block {c['block_size']} outputs {c['outputs_per_block']} unroll {c['k_unroll']} "
                f"vector {c['vector_width']}" + (f" k {c['static_k']}" if c["static_k"] is not None else ""))
        out.append(f"  {name:<58}{spawned.outcome(r, dry)}".rstrip())
    if totals and not dry:
        out.append(f"{summary['kernels_compiled']} skinny GEMM kernels compiled, {summary['kernels_cached']} already cached, "
                   f"{summary['errors']} errors, in {summary['seconds']} s")
    return out


def run_alone(args: argparse.Namespace, group: Group, why_no_flashinfer: str) -> int:
    """Prewarm of a model whose only CuTe-DSL kernels on this card are vLLM's skinny GEMM (a BF16
    checkpoint: flashinfer's sm12x kernels refuse it, ``why_no_flashinfer``): refusals, JSON and
    exit status as :mod:`.prewarm`'s."""
    from .. import prewarm
    from ..keys import hostmachine
    from ..vllm_sites import planning

    planning.init_worker(args.target, hostmachine.current())
    try:
        spawned.set_up(args)
    except spawned.Refused as exc:
        return prewarm.refuse(args, str(exc))
    summary = run(args, group)
    note = f"flashinfer's kernels not planned: {why_no_flashinfer}"
    out = {"engine": "vllm", "model": args.model, "target": args.target, "dry_run": bool(args.dry_run),
           "host_machine": hostmachine.current(), "notes": [note], "vllm_skinny_gemm": summary,
           **{k: summary[k] for k in ("kernels_compiled", "kernels_cached", "errors", "seconds")}}
    return spawned.finish(args, out, summary["job_list"], [*lines(summary, args.model, args.target, args.dry_run, totals=False), f"({note})"])
