"""``prewarm MODEL --moe-backend b12x``: the b12x package's fused-MoE kernels, compiled before the engine starts.

The operator's side of :mod:`..b12x_sites.moe`: the model's per-rank MoE layer (``-tp`` x ``-dp``
shard the intermediate size, as vLLM does without expert parallelism, which ``B12xExperts`` does not
support), vLLM's warm-up token counts (``b12x_warmup_token_counts``: 1, the CUDA-graph capture
sizes, ``--max-num-batched-tokens``; ``--m`` narrows them) and the mode vLLM selects (NVFP4, W4A16
with ``VLLM_B12X_MOE_FP4_FORCE_A16=1``). One job per launch ``warmup_launches`` makes; each compiles
in a spawned worker set up as b12x's GPU-less compile workers, into our cache. ``check
--moe-backend b12x`` plans with the same :func:`resolve` and :func:`requests`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from . import spawned
from .b12x import Refused


def mode_of(args: argparse.Namespace, quant_mode: str) -> str:
    """The b12x MoE mode vLLM selects for the checkpoint (``oracle/nvfp4.py::_use_a16``: the
    environment variable forces A16 on the b12x backend)."""
    if quant_mode != "nvfp4":
        return "mxfp4-a16" if os.environ.get("VLLM_B12X_MOE_FP4_FORCE_A16", "0") not in ("", "0") else "mxfp4-a8"
    return "nvfp4-a16" if os.environ.get("VLLM_B12X_MOE_FP4_FORCE_A16", "0") not in ("", "0") else "nvfp4"


def resolve(args: argparse.Namespace) -> tuple[Any, str, tuple[int, ...]]:
    """(the per-rank MoE layer, the mode, the token counts) prewarm and ``check`` plan; :class:`Refused` otherwise."""
    from . import models
    from .. import prewarm
    from ..keys import targets
    from ..b12x_sites import adapter, moe, planning

    if adapter.package_dir() is None:
        raise Refused("--moe-backend b12x needs the b12x package in this interpreter (pip install vllm[b12x], or b12x==1.5.1)")
    if not args.target:
        raise Refused("--moe-backend b12x compiles for a named card: pass --target (e.g. rtx-pro-6000)")
    if getattr(args, "enable_expert_parallel", False) or args.ep != 1:
        raise Refused("vLLM's b12x MoE backend does not support expert parallelism (B12xExperts: ep_size 1 only)")
    try:
        targets.get(args.target)
        if not models.is_moe(models.load_config(args.model)[0]):
            raise models.UnsupportedModelError(f"{args.model} has no MoE layers (--moe-backend b12x plans MoE kernels only)")
        shape = models.moe_shape(args.model, tp=args.tp * getattr(args, "dp", 1))
        dtype = "float16" if getattr(args, "dtype", "auto") in ("float16", "half") else "bfloat16"
        prewarm.choose_host_machine(args)
    except (ValueError, KeyError, prewarm.PlanRefused) as exc:
        raise Refused(str(exc)) from None
    mode = mode_of(args, shape.quant_mode)
    if mode not in moe.OFFLINE_MODES:
        raise Refused(f"b12x MoE mode {mode} is not planned offline: b12x prepares its weights with a kernel on the "
                      "card (prepare_w4a16_packed_weights); the engine's first start compiles these, into our cache")
    counts = tuple(args.m) if args.m else planning.token_counts(args.max_num_tokens)
    return moe.layer_of(shape, dtype), mode, counts


def requests(args: argparse.Namespace, layer: Any, mode: str, counts: tuple[int, ...]) -> list[tuple[int, list[dict[str, Any]]]]:
    """Each launch's token count with the keys its compiles ask our cache for (nothing compiles,
    nothing launches). b12x memoises a kernel in-process: a launch whose kernel an earlier one
    asked for adds none. This process must not serve afterwards."""
    from ..core import through
    from ..keys import hostmachine, targets
    from ..b12x_sites import moe, planning

    planning.init_worker(args.target, hostmachine.current())
    sm_count = targets.get(args.target).sm_count
    out = []
    with through.planning() as requested:
        prepared = moe.prepare(layer, mode, moe.placeholders(layer))
        with moe.card_answers(sm_count):
            for tokens in sorted(moe.launch_counts(prepared, layer, mode, counts).values()):
                before = len(requested)
                moe.launch(prepared, layer, mode, tokens)
                out.append((tokens, requested[before:]))
    return out


def _job(layer: Any, mode: str, tokens: int, sm_count: int) -> dict[str, Any]:
    """A worker's job: one launch, its compiles through our cache, nothing launched."""
    from ..core import through
    from ..core.cache import default_cache
    from ..b12x_sites import moe

    t0, error = time.perf_counter(), None
    with default_cache().tally.watch("compiles", "hits", "errors") as seen:
        try:
            with through.launching_nothing():
                moe.drive(layer, mode, (tokens,), sm_count)
        except Exception as exc:  # noqa: BLE001 - reported per job; the others carry on
            error = f"{type(exc).__name__}: {exc}"
    return {"tokens": tokens, "seconds": time.perf_counter() - t0, "digests": seen.digests, "error": error, **seen.counts}


def run(args: argparse.Namespace) -> int:
    """Prewarm's b12x MoE branch: refusals, JSON and exit status as :mod:`.prewarm`'s."""
    from .. import prewarm
    from ..activation import install
    from ..core.cache import default_cache
    from ..keys import hostmachine, targets
    from ..b12x_sites import planning
    from .b12x import _written

    try:
        layer, mode, counts = resolve(args)
    except Refused as exc:
        return prewarm.refuse(args, str(exc))
    install(target=args.target)
    default_cache().for_prewarm()
    cannot = prewarm.cross_refusal(args, str(default_cache().store.root))
    if cannot:
        return prewarm.refuse(args, cannot)
    t0 = time.perf_counter()
    planned = requests(args, layer, mode, counts)
    results: list[dict[str, Any]] = []
    if not args.dry_run:
        todo = []
        for tokens, reqs in planned:
            kernels = {r["digest"]: prewarm.Kernel(r["digest"], r["site"], key=r["key"], extra_ok=r["extra_ok"]) for r in reqs}
            prewarm.mark_cached(kernels)
            if all(k.status == "cached" for k in kernels.values()):
                results.append({"tokens": tokens, "status": "cached", "seconds": 0.0, "digests": sorted(kernels),
                                "compiles": 0, "hits": len(kernels), "errors": 0, "error": None})
            else:
                todo.append(tokens)
        sm_count = targets.get(args.target).sm_count
        results += spawned.starmap(_job, [(layer, mode, t, sm_count) for t in todo], args.jobs,
                                   planning.compile_worker, (args.target, hostmachine.current()))
        results.sort(key=lambda r: r["tokens"])
    rows = [{"tokens": t, "kernels": [r["site"] for r in reqs], **next((r for r in results if r["tokens"] == t),
                                                                         {"status": "planned"})} for t, reqs in planned]
    errors = sum(r.get("errors", 0) + (1 if r.get("error") else 0) for r in rows)
    summary = {"backend": "b12x", "moe_backend": "b12x", "mode": mode, "layer": vars(layer) | {"padded_intermediate": layer.padded_intermediate},
               "model": args.model, "target": args.target, "dry_run": bool(args.dry_run), "jobs": len(rows),
               "kernels_compiled": sum(r.get("compiles", 0) for r in rows), "kernels_cached": sum(r.get("hits", 0) for r in rows),
               "errors": errors, "seconds": round(time.perf_counter() - t0, 1), "job_list": rows,
               "host_machine": hostmachine.current()}
    if not args.dry_run:
        summary["written"] = _written(results)
    if args.json:
        print(json.dumps({"schema": prewarm.JSON_SCHEMA, **summary}, indent=1, default=str))
    else:
        print(f"b12x MoE kernels for {args.model} ({mode}, {layer.num_experts} experts, hidden {layer.hidden_size}, "
              f"intermediate {layer.padded_intermediate} per rank) on {args.target}: {len(rows)} launches of vLLM's b12x warm-up")
        for r in rows:
            print(f"  {r['tokens']:>6} tokens  {', '.join(r['kernels']) or '(no new kernel)'}"
                  + ("" if args.dry_run else f"  compiled {r.get('compiles', 0)}, cached {r.get('hits', 0)}"
                     + (f"  ERROR {r['error']}" if r.get("error") else "")))
        if not args.dry_run:
            print(f"{summary['kernels_compiled']} kernels compiled, {summary['kernels_cached']} already cached, "
                  f"{errors} errors, in {summary['seconds']} s")
            prewarm.print_next_steps(summary["written"], [], prewarm.argv_of_plan(args), summary["host_machine"])
    return prewarm.EXIT_FAILED if errors else 0
