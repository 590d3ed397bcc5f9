"""``prewarm MODEL --engine sglang --attention-backend fa4``: SGLang's FA4 decode kernels, compiled before the engine starts.

The operator's side of :mod:`..sglang_sites.planning`, with SGLang's own flag names: the model's
per-rank attention (``--tp-size`` splits the heads), ``--page-size``, ``--context-length`` (the
static ``max_seqlen_k`` SGLang's SM12x decode uses; default the model's ``max_position_embeddings``)
and the decode CUDA-graph batch sizes (``--cuda-graph-bs``, else SGLang's list up to
``--cuda-graph-max-bs``, else up to SGLang's default for the target's memory and TP size, no more
than ``--max-running-requests``). One job per batch size; SGLang plans each call's kernels, and a
call whose kernels an earlier one asked for adds none. Prefill (extend) kernels are not planned:
the engine's first start compiles them into our cache. ``check --engine sglang`` plans with the
same :func:`resolve` and :func:`requests`.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

from . import spawned
from .spawned import Refused


def resolve(args: argparse.Namespace) -> tuple[Any, list[int]]:
    """(the per-rank attention, the decode batch sizes) prewarm and ``check`` plan; :class:`Refused` otherwise."""
    from . import models
    from ..keys import targets
    from ..sglang_sites import adapter, planning

    if adapter.package_dir() is None:
        raise Refused("--engine sglang needs SGLang in this interpreter (pip install sglang==0.5.23)")
    if getattr(args, "attention_backend", None) != "fa4":
        raise Refused("--engine sglang plans SGLang's FA4 kernels: pass --attention-backend fa4 (SGLang's default "
                      "attention on sm12x, flashinfer or triton, compiles no CuTe-DSL kernel)")
    if not args.target:
        raise Refused("--engine sglang compiles for a named card: pass --target (e.g. rtx-pro-6000)")
    try:
        profile = targets.get(args.target)
        config = models.load_config(args.model)[0]
        config = config.get("text_config") or config
        if config.get("sliding_window") or "sinks" in json.dumps(config).lower():
            raise Refused(f"{args.model} has sliding-window or sink attention: its FA4 variants are not planned "
                          "offline (the engine's first start compiles them into our cache)")
        att = planning.attention_of(config, args.tp, args.page_size, args.context_length)
    except (ValueError, KeyError) as exc:
        raise Refused(str(exc)) from None
    if profile.capability[0] != 12:
        raise Refused(f"target {args.target} is not a capability-12 card: SGLang's FA4 SM12x path is not taken")
    if args.cuda_graph_bs:
        sizes = sorted(set(args.cuda_graph_bs))
    else:
        max_bs = args.cuda_graph_max_bs or planning.default_max_bs(profile.total_memory, args.tp, args.max_running_requests)
        sizes = planning.capture_sizes(max_bs, args.max_running_requests)
    return att, sizes


def requests(args: argparse.Namespace, att: Any, sizes: list[int]) -> list[tuple[int, list[dict[str, Any]]]]:
    """Each batch size with the keys its compiles ask our cache for (nothing compiles): SGLang
    memoises a kernel in-process, so this process must not serve afterwards."""
    from ..activation import install
    from ..sglang_sites import planning

    install(target=args.target)
    return spawned.requests((bs, functools.partial(planning.decode, att, bs)) for bs in sizes)


def run(args: argparse.Namespace) -> int:
    """Prewarm's SGLang branch: refusals, JSON and exit status as :mod:`.prewarm`'s. Planning runs in
    a spawned process of its own (it leaves SGLang holding stand-ins), compiles in spawned workers."""
    from .. import prewarm
    from ..sglang_sites import adapter, planning

    try:
        att, sizes = resolve(args)
        if adapter.left_to_sglang():
            raise Refused("CUTE_DISKCACHE_NATIVE_SITES names sglang: SGLang's FA4 kernels are kept by SGLang's "
                          "own cute_aot cache, which cannot be filled for another card")
        spawned.set_up(args)  # its cross-build check passes: SGLang's plan names no other host machine
    except Refused as exc:
        return prewarm.refuse(args, str(exc))
    t0 = time.perf_counter()
    [planned] = spawned.starmap(_planned, [(args,)], 1)
    jobs: list[int] = []
    seen: set[str] = set()
    for bs, reqs in planned:
        new = {r["digest"] for r in reqs} - seen
        if new:
            jobs.append(bs)
            seen |= new
    results: list[dict[str, Any]] = []
    if not args.dry_run:
        results = spawned.starmap(spawned.watched, [({"bs": bs}, planning.decode, att, bs) for bs in jobs], args.jobs, spawned.worker, (args.target,))
    rows = [{"bs": bs, "kernels": [r["site"] for r in reqs], **next((r for r in results if r["bs"] == bs), {"status": "planned"})}
            for bs, reqs in planned if reqs]
    summary = {"engine": "sglang", "attention_backend": "fa4", "attention": vars(att), "model": args.model,
               "target": args.target, "dry_run": bool(args.dry_run), "batch_sizes": sizes, "jobs": len(rows),
               "kernels": len(seen), **spawned.totals(rows, t0)}
    lines = [f"SGLang FA4 decode kernels for {args.model} ({att.heads} heads, {att.kv_heads} KV heads, head dim "
             f"{att.head_dim} per rank, page size {att.page_size}, context {att.context_length}) on {args.target}: "
             f"{len(seen)} kernels for {len(sizes)} CUDA-graph batch sizes"]
    lines += [f"  bs {r['bs']:>4}  {', '.join(r['kernels'])}" + spawned.outcome(r, args.dry_run) for r in rows]
    return spawned.finish(args, summary, results, lines, says_cached=False)


def _planned(args: argparse.Namespace) -> list[tuple[int, list[dict[str, Any]]]]:
    """:func:`requests` in a process of its own; what crosses back is the requests' plain fields."""
    att, sizes = resolve(args)
    return [(bs, [{"digest": r["digest"], "site": r["site"]} for r in reqs]) for bs, reqs in requests(args, att, sizes)]
