"""Prewarm's dense half: flashinfer's dense FP4 GEMM kernels a model's NVFP4 linear layers need
(``mm_fp4(backend="b12x")``: flashinfer's code; the b12x package's linear kernels are :mod:`.b12x`).

Planned like the MoE kernels, by flashinfer's own code (:mod:`..flashinfer_sites.dense`): for
every m the engine can see, ``mm_fp4`` as vLLM 0.34 calls it (flashinfer's default tactic for
that m); and, unless the engine does not autotune, every tactic flashinfer's tuner runs at
vLLM's tuning buckets. Each site reports the key it would compile; the plan is the set of keys.
A worker compiles a kernel by making the same call again (:func:`run`).

The dense kernel's key has no n, k or m (they are runtime arguments of one kernel), so a model
needs a handful of dense kernels however many layer shapes and batch sizes it has.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable


def dispatcher(shape: Any) -> Any:
    """A :class:`~..flashinfer_sites.dense.DenseDispatcher` for a :class:`~.models.DenseShape`."""
    from ..flashinfer_sites.dense import DenseDispatcher

    return DenseDispatcher([(lin.n, lin.k) for lin in shape.linears], out_dtype=shape.out_dtype)


def calls(d: Any, ms: list[int], max_num_tokens: int, autotune: bool) -> Any:
    """Every call planning makes, as ``(recipe, m)``: the recipe makes that call again."""
    from ..flashinfer_sites.dense import tactic_text, tuning_buckets

    for m in ms:
        for index in range(len(d.linears)):
            d.run(m, index)
            yield {"m": m, "linear": index}, m
    if not autotune:
        return
    for bucket in tuning_buckets(max_num_tokens):
        for index in range(len(d.linears)):
            for tactic in d.candidates(bucket, index):
                d.run(bucket, index, tactic)
                yield {"m": bucket, "linear": index, "tactic": tactic_text(tactic)}, bucket


def run(d: Any, recipe: dict[str, Any]) -> dict[str, Any]:
    """Make a planned call again (in a worker, with the cache on)."""
    from ..flashinfer_sites.dense import tactic_from_text

    tactic = recipe.get("tactic")
    return d.run(int(recipe["m"]), int(recipe["linear"]), None if tactic is None else tactic_from_text(tactic))


def plan(shape: Any, ms: list[int], max_num_tokens: int, autotune: bool, new_kernel: Callable[..., Any],
         kernels: dict[str, Any], after_call: Callable[[], None] | None = None) -> dict[str, Any]:
    """Every dense kernel flashinfer would compile for these m, into ``kernels`` by digest (this process only).

    ``new_kernel(digest, kind, key, recipe)`` makes prewarm's record of a kernel; ``after_call``
    runs after each planning call (a progress bar's tick, told about ``kernels``).
    """
    from ..core import through

    with through.planning() as requested:
        d = dispatcher(shape)
        for req, recipe, m in through.planned_requests(requested, calls(d, ms, max_num_tokens, autotune), after_call):
            k = kernels.get(req["digest"])
            if k is None:
                k = kernels[req["digest"]] = new_kernel(req["digest"], req["kind"], req.get("key"), recipe)
                k.extra_ok = req.get("extra_ok")  # the site's side-data check, as a hit applies it
            k.ms.append(m)
    return kernels
