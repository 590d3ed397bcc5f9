"""``check``: a deploy gate. Does the cache hold, usable on this host, every kernel a model needs?

Plans the model exactly as ``prewarm --dry-run`` does (the same flags, the same code:
:func:`~cute_diskcache.prewarm.plan_model`), then asks for each planned kernel what a serving
process here would find (:func:`~cute_diskcache.cli.coverage.inspect`: trust, seal, signature, key,
arch, environment, host CPU, device facts, checksums, and the site's check of the entry's side
data, the one judgement a hit applies), reading only. Exit 0 when every kernel
would be a hit; 1 with a table of what is missing or unusable and why; 2 when the model or the
flags cannot be planned. The planning imports flashinfer and drives it in this process with the
cache read-only (``CUTE_DISKCACHE_READONLY``), so not even a statistics file is written.

``--linear-backend b12x`` (prewarm's flag) judges the b12x package's linear kernels instead, as
``prewarm --linear-backend b12x`` plans them (:func:`..prewarm.b12x.requests`), in the interpreter
that has b12x.

A target whose card is served from another machine (``--target dgx-spark`` on an x86 box) is
answered for that machine: the keys name its namespaces (:mod:`..keys.hostmachine`), so a CI job can
gate a Spark image without a Spark. The host CPU's extensions are then not compared (this CPU
is not the serving one); everything else is.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator

from .. import config, prewarm
from . import coverage
from ..keys import hostmachine
from .common import Add, CliError, root_of
from .output import print_json, table


@contextlib.contextmanager
def _read_only_settings(root: str) -> Iterator[None]:
    """The settings a serving process would read, pointed at ``root``, with writes off (the
    planning attaches the cache as an engine does: it must not make a statistics file)."""
    from ..core.cache import reset_default_cache

    names = ("CUTE_DISKCACHE_DIR", config.env_name("readonly"))
    saved = {n: os.environ.get(n) for n in names}
    os.environ.update({names[0]: root, names[1]: "1"})
    reset_default_cache()
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
        reset_default_cache()


def _where(k: prewarm.Kernel, dense: Any) -> str:
    """The batch sizes (MoE) or the layer call (dense, b12x) that request a kernel."""
    ms = sorted(set(k.ms))
    span = f"m {ms[0]}" if len(ms) == 1 else f"m {ms[0]}..{ms[-1]} ({len(ms)})"
    if k.group == "b12x" and k.call:  # b12x's job: a linear layer's shape and its row capacity
        return f"{span} {k.call['linear']} {k.call['n']}x{k.call['k']} rows {k.call['capacity']}"
    if k.group == "vllm-skinny" and k.call:  # vLLM's skinny GEMM: its configuration (m is its row count)
        c = k.call
        return f"{span} rows {c['num_rows']} block {c['block_size']} outputs {c['outputs_per_block']} k {c['static_k'] or 'any'}"
    if k.group == "dense" and k.call and dense is not None:
        lin = dense.linears[int(k.call["linear"])]
        tactic = k.call.get("tactic")
        return f"{span} {lin.name} {lin.n}x{lin.k}" + (f" tactic {''.join(str(tactic).split())}" if tactic is not None else "")
    return span


def judge(kernels: dict[str, prewarm.Kernel], dense: Any = None) -> list[dict[str, Any]]:
    """One row per planned kernel: what a serving process on this host would find."""
    from ..core.cache import default_cache

    store = default_cache().store
    rows = []
    for k in kernels.values():
        if k.native:  # flashinfer's own cache: planning asked it
            found = coverage.Finding(coverage.OK) if k.status == "cached" else coverage.Finding(
                coverage.MISSING, "not in flashinfer's own cache (native site)")
        elif k.key is None:
            found = coverage.Finding(coverage.MISSING, "planned without a key")
        else:
            found = coverage.inspect(store, k.key, extra_ok=k.extra_ok)
        rows.append({"kernel": k.kind, "group": k.group, "digest": k.digest, "site": getattr(k.key, "site", None),
                     "namespace": k.key.env.namespace if k.key is not None else None, "where": _where(k, dense),
                     "ms": sorted(set(k.ms)), "status": found.status, "why": found.why, "cpu_lacks": found.cpu_lacks,
                     "found_in": found.found_in})
    return rows


def _plan_flashinfer(args: argparse.Namespace, root: Path) -> tuple[str, list[str], list[dict[str, Any]]]:
    """(model, notes, judged rows) of a vLLM engine's plan: flashinfer's MoE and dense kernels, and
    vLLM's own skinny GEMM where the card has plans for the model's layers (alone for a BF16
    checkpoint, which flashinfer's kernels refuse)."""
    from ..prewarm import vllm as prewarm_vllm

    try:
        shape, dense, notes, ms = prewarm.resolve(args)
    except prewarm.PlanRefused as exc:
        skinny = prewarm_vllm.resolve(args)
        if skinny is None or not skinny.configs:
            raise CliError(str(exc)) from None
        return str(args.model), [f"flashinfer's kernels not planned: {exc}"], _skinny_rows(args, root, skinny)
    refusal = prewarm.stack_refusal()
    if refusal:
        raise CliError(refusal)
    from ..activation import install

    with _read_only_settings(str(root)):
        install(target=args.target)
        try:
            kernels = prewarm.plan_model(args, shape, dense, ms, quiet=args.json)
        except prewarm.PlanRefused as exc:
            raise CliError(str(exc)) from None
        rows = judge(kernels, dense)
    skinny = prewarm_vllm.resolve(args)
    return (shape or dense).model, notes, rows + (_skinny_rows(args, root, skinny) if skinny is not None and skinny.configs else [])


def _skinny_rows(args: argparse.Namespace, root: Path, skinny: Any) -> list[dict[str, Any]]:
    """The judged kernels of vLLM's skinny GEMM warm-up, as ``prewarm`` plans them (:func:`..prewarm.vllm.requests`)."""
    from ..prewarm import vllm as prewarm_vllm

    return _judged(root, lambda: prewarm_vllm.requests(args, skinny), lambda config, r: _kernel(r, "vllm", "vllm-skinny", config),
                   lambda config: [config["num_rows"]], f"vLLM's skinny GEMM requested no kernel for {args.model}; nothing to check")


def _kernel(request: dict[str, Any], library: str, group: str, call: dict[str, Any] | None = None) -> prewarm.Kernel:
    """The kernel one planned request names, as ``judge`` reads it (its site without the library's prefix)."""
    return prewarm.Kernel(request["digest"], request["site"].removeprefix(f"{library}."), key=request["key"], group=group,
                          call=call, extra_ok=request["extra_ok"])


def _judged(root: Path, plan: Callable[[], Iterable[tuple[Any, list[dict[str, Any]]]]],
            kernel: Callable[[Any, dict[str, Any]], prewarm.Kernel], ms: Callable[[Any], list[int]], none: str) -> list[dict[str, Any]]:
    """Judge every kernel a library's planned requests name, once each with every token count that
    asks for it. ``plan`` runs inside the read-only settings (planning must write nothing); ``none``
    is the error when it names no kernel."""
    kernels: dict[str, prewarm.Kernel] = {}
    with _read_only_settings(str(root)):
        for batch, requests in plan():
            for r in requests:
                kernels.setdefault(r["digest"], kernel(batch, r)).ms.extend(ms(batch))
        if not kernels:
            raise CliError(none)
        return judge(kernels)


def _resolved(resolve: Callable[[argparse.Namespace], Any], args: argparse.Namespace, library: str, own_cache: str) -> Any:
    """A library branch's plan for these flags, as its prewarm resolves it; a refusal, or the
    library keeping its kernels in its own cache (``CUTE_DISKCACHE_NATIVE_SITES``), is the CLI's error."""
    from ..prewarm import spawned

    try:
        resolved = resolve(args)
    except spawned.Refused as exc:
        raise CliError(str(exc)) from None
    if config.left_to_library(library):
        raise CliError(f"{config.env_name('native_sites')} names {library}: its kernels are kept by {own_cache}, which check does not judge")
    return resolved


def _plan_b12x(args: argparse.Namespace, root: Path) -> tuple[str, list[str], list[dict[str, Any]]]:
    """(model, notes, judged rows) of ``--linear-backend b12x``: the kernels of b12x's jobs as
    ``prewarm --linear-backend b12x`` plans them (:func:`..prewarm.b12x.requests`)."""
    from ..prewarm import b12x as prewarm_b12x

    dense, counts = _resolved(prewarm_b12x.resolve, args, "b12x", "b12x's own disk cache")
    rows = _judged(root, lambda: prewarm_b12x.requests(args, dense, counts),
                   lambda job, r: _kernel(r, "b12x", "b12x", {"linear": job.linear, "n": job.n, "k": job.k, "capacity": job.capacity}),
                   lambda job: job.ms, f"b12x requested no kernel cute-diskcache covers for {dense.model}; nothing to check")
    return dense.model, [], rows


def _plan_b12x_moe(args: argparse.Namespace, root: Path) -> tuple[str, list[str], list[dict[str, Any]]]:
    """(model, notes, judged rows) of ``--moe-backend b12x``: the kernels of the launches of vLLM's
    b12x MoE warm-up as ``prewarm --moe-backend b12x`` plans them (:func:`..prewarm.b12x_moe.requests`)."""
    from ..prewarm import b12x_moe

    layer, mode, counts = _resolved(b12x_moe.resolve, args, "b12x", "b12x's own disk cache")
    rows = _judged(root, lambda: b12x_moe.requests(args, layer, mode, counts),
                   lambda tokens, r: _kernel(r, "b12x", "b12x-moe", {"mode": mode, "tokens": tokens}),
                   lambda tokens: [tokens], f"b12x requested no MoE kernel cute-diskcache covers for {args.model}; nothing to check")
    return str(args.model), [], rows


def _plan_sglang(args: argparse.Namespace, root: Path) -> tuple[str, list[str], list[dict[str, Any]]]:
    """(model, notes, judged rows) of ``--engine sglang``: the FA4 kernels of SGLang's decode capture
    as ``prewarm --engine sglang`` plans them (:func:`..prewarm.sglang.requests`)."""
    from ..prewarm import sglang as prewarm_sglang

    att, sizes = _resolved(prewarm_sglang.resolve, args, "sglang", "SGLang's own cute_aot cache")
    rows = _judged(root, lambda: prewarm_sglang.requests(args, att, sizes), lambda bs, r: _kernel(r, "sglang", "sglang"),
                   lambda bs: [bs], f"SGLang requested no FA4 kernel for {args.model}; nothing to check")
    return str(args.model), ["SGLang's prefill kernels are not planned: the engine's first start compiles them"], rows


def cmd_check(args: argparse.Namespace) -> int:
    root, source = root_of(args)
    plan = _plan_b12x if getattr(args, "linear_backend", "flashinfer") == "b12x" else _plan_flashinfer
    plan = _plan_b12x_moe if getattr(args, "moe_backend", "flashinfer_b12x") == "b12x" else plan
    plan = _plan_sglang if getattr(args, "engine", "vllm") == "sglang" else plan
    model, notes, rows = plan(args, root)
    bad = [r for r in rows if r["status"] != coverage.OK]
    counts = {s: sum(1 for r in rows if r["status"] == s) for s in (coverage.OK, coverage.MISSING, coverage.UNUSABLE)}
    lacks = sorted({f for r in rows for f in r["cpu_lacks"]})
    if args.json:
        print_json({"root": str(root), "root_source": source, "model": model, "target": args.target,
                    "linear_backend": getattr(args, "linear_backend", "flashinfer"),
                    "moe_backend": getattr(args, "moe_backend", "flashinfer_b12x"), "notes": notes,
                    "host_machine": hostmachine.current(), "host_cpu_checked": not hostmachine.cross(),
                    "ok": not bad, "counts": counts, "host_cpu_lacks": lacks, "kernels": rows})
        return 1 if bad else 0
    on = f"target {args.target}" if args.target else "this host's GPU"
    if hostmachine.cross():
        on += f" (an {hostmachine.current()} host)"
        print(f"(answering for an {hostmachine.current()} host, as target {args.target}'s card is served from: its namespaces; "
              f"host CPU extensions are not compared from this {hostmachine.here()} machine)", file=sys.stderr)
    if not bad:
        print(f"ok: {'all ' if len(rows) > 1 else ''}{_n(len(rows), 'kernel')} {model} needs ({', '.join(_kinds(rows))}) "
              f"{'are' if len(rows) > 1 else 'is'} cached and usable on {on}, under {root}")
        return 0
    print(table(("kernel", "digest", "batch", "status", "why"),
                [(f"{r['group']}/{r['kernel']}", r["digest"][:12], r["where"], r["status"], r["why"]) for r in bad]))
    print(f"\nFAILED: {len(bad)} of {_n(len(rows), 'kernel')} {model} needs on {on} would compile when served from {root} "
          f"({counts[coverage.MISSING]} missing, {counts[coverage.UNUSABLE]} unusable)")
    if lacks:
        print(f"this host's CPU lacks {', '.join(lacks)}: prewarm on a CPU like this one (see prewarm's note on the build CPU)")
    if counts[coverage.MISSING]:
        print(f"fix: CUTE_DISKCACHE_DIR={shlex.quote(str(root))} cute-diskcache-prewarm {shlex.join(prewarm.argv_of_plan(args))}")
    for note in notes:
        print(f"({note})", file=sys.stderr)
    return 1


def _n(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _kinds(rows: list[dict[str, Any]]) -> list[str]:
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["kernel"]] = kinds.get(r["kernel"], 0) + 1
    return [f"{n} {kind}" for kind, n in kinds.items()]


def register(add: Add) -> None:
    p = add("check", cmd_check, "does the cache hold every kernel a model needs, usable on this host? (exit 0 / 1)")
    prewarm.add_plan_arguments(p)
