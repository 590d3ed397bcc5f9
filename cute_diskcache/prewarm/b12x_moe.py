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
import functools
import os
import time
from typing import Any

from . import spawned
from .spawned import Refused


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
    from ..keys import hostmachine, targets
    from ..b12x_sites import moe, planning

    planning.init_worker(args.target, hostmachine.current())
    sm_count = targets.get(args.target).sm_count

    def launches() -> Any:  # the layer prepared and the card faked inside the planning, as before each launch
        prepared = moe.prepare(layer, mode, moe.placeholders(layer))
        with moe.card_answers(sm_count):
            for tokens in sorted(moe.launch_counts(prepared, layer, mode, counts).values()):
                yield tokens, functools.partial(moe.launch, prepared, layer, mode, tokens)

    return spawned.requests(launches())


def _launch(layer: Any, mode: str, tokens: int, sm_count: int) -> None:
    """A worker's launch: its compiles through our cache, nothing launched."""
    from ..core import through
    from ..b12x_sites import moe

    with through.launching_nothing():
        moe.drive(layer, mode, (tokens,), sm_count)


def run(args: argparse.Namespace) -> int:
    """Prewarm's b12x MoE branch: refusals, JSON and exit status as :mod:`.prewarm`'s."""
    from .. import prewarm
    from ..keys import hostmachine, targets
    from ..b12x_sites import planning

    try:
        layer, mode, counts = resolve(args)
        spawned.set_up(args)
    except Refused as exc:
        return prewarm.refuse(args, str(exc))
    t0 = time.perf_counter()
    planned = requests(args, layer, mode, counts)
    results: list[dict[str, Any]] = []
    if not args.dry_run:
        sm_count = targets.get(args.target).sm_count
        results = spawned.compile_missing(planned, lambda todo: spawned.starmap(
            spawned.watched, [({"tokens": t}, _launch, layer, mode, t, sm_count) for t in todo], args.jobs,
            planning.compile_worker, (args.target, hostmachine.current())), error=None)
    rows = [{"tokens": t, "kernels": [r["site"] for r in reqs], **(results[i] if results else {"status": "planned"})}
            for i, (t, reqs) in enumerate(planned)]
    summary = {"backend": "b12x", "moe_backend": "b12x", "mode": mode, "layer": vars(layer) | {"padded_intermediate": layer.padded_intermediate},
               "model": args.model, "target": args.target, "dry_run": bool(args.dry_run), "jobs": len(rows),
               **spawned.totals(rows, t0), "host_machine": hostmachine.current()}
    lines = [f"b12x MoE kernels for {args.model} ({mode}, {layer.num_experts} experts, hidden {layer.hidden_size}, "
             f"intermediate {layer.padded_intermediate} per rank) on {args.target}: {len(rows)} launches of vLLM's b12x warm-up"]
    lines += [f"  {r['tokens']:>6} tokens  {', '.join(r['kernels']) or '(no new kernel)'}" + spawned.outcome(r, args.dry_run) for r in rows]
    return spawned.finish(args, summary, results, lines)
