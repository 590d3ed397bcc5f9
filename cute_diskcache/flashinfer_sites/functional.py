"""Every kernel key flashinfer's functional MoE path can request, by driving flashinfer itself.

The functional ``b12x_fused_moe`` and ``B12xMoEWrapper(use_cuda_graph=False)`` both size their
static workspace per call through one module-level cache (``moe_dispatch._WORKSPACE_CACHE``)
that only grows, and the micro and static kernel keys contain that workspace's ``max_rows``.
So a kernel key depends on m *and* on the largest batch the process served before it.

From flashinfer 0.7.4 the workspace grows on a power-of-two ladder (``_bucket_workspace_rows``,
floor 128): ``max_rows`` takes O(log) values, and the keys are a finite set. For each m, the
workspace it meets is any ladder step from the one m itself needs up to the highest one the
path ever reaches (reached only by m that run the static backend). :func:`walk` meets every
one of those (state, m) pairs with two passes over the m values, observing the workspace
flashinfer holds rather than recomputing its arithmetic:

1. from an empty cache, every m in ascending order: each step of the ladder is reached at the
   first m that needs it (``first[B]``), and every m meets the state left by the ones before;
2. for each step B: clear the caches, run ``first[B]`` (the workspace is B again), then every
   smaller m, which meets B without growing it.

Each call is reported with its *recipe*: the m values to run, from cleared caches, to make that
call request the same kernels again (how prewarm's workers reproduce a planned key).
Releases before 0.7.4 size the workspace exactly to the largest batch so far: one key per
(m, high-water batch), which no prewarm can sensibly cover (:func:`unsupported`).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any
from collections.abc import Callable, Iterator

from ._common import flashinfer_version
from .names import MOE_DISPATCH


def unsupported() -> str | None:
    """Why this flashinfer's functional-path keys cannot be enumerated (None: they can)."""
    md = _md()
    missing = [name for name in ("_bucket_workspace_rows", "_WORKSPACE_CACHE", "clear_sm120_moe_caches") if not hasattr(md, name)]
    if missing:
        return (f"flashinfer {flashinfer_version()} sizes the functional path's workspace exactly to the largest batch so far "
                f"(no {missing[0]}; power-of-two buckets arrived in 0.7.4): its kernel keys follow every batch history")
    return None


def _md() -> Any:
    return sys.modules.get(MOE_DISPATCH) or importlib.import_module(MOE_DISPATCH)


def reset() -> None:
    """Drop flashinfer's module-level workspaces (its compiled kernels stay in memory)."""
    _md().clear_sm120_moe_caches()


def static_rows() -> int | None:
    """``max_rows`` of the static workspace the functional path holds now (None: none yet).

    Dynamic and W4A16 workspaces (``routed_rows_capacity``) are not keyed into kernels.
    """
    rows = [ws.max_rows for ws in list(_md()._WORKSPACE_CACHE.values())
            if hasattr(ws, "max_rows") and not hasattr(ws, "routed_rows_capacity")]
    if len(set(rows)) > 1:
        raise NotImplementedError(f"several static workspaces for one layer shape ({sorted(set(rows))}); "
                                  "flashinfer's functional path changed")
    return rows[0] if rows else None


def walk(run: Callable[[int], Any], ms: list[int]) -> Iterator[tuple[tuple[int, ...], int]]:
    """Drive ``run(m)`` through every (workspace state, m) pair; yield ``(recipe, m)`` after each call.

    ``run`` dispatches one batch of m tokens through the functional path of one layer shape
    (a :class:`~.driving.Dispatcher` built with ``use_cuda_graph=False``).
    """
    ms = sorted(set(ms))
    first: dict[int, int] = {}  # workspace rows -> the first m (ascending) that grew it there
    reset()
    for m in ms:
        before = static_rows()
        run(m)
        yield ((first[before], m) if before is not None else (m,)), m
        after = static_rows()
        if after is not None and after != before:
            first.setdefault(after, m)
    for rows, grower in sorted(first.items()):
        smaller = [m for m in ms if m < grower]
        if not smaller:
            continue
        reset()
        run(grower)
        yield (grower,), grower
        if static_rows() != rows:
            raise NotImplementedError(f"m={grower} sized the workspace to {static_rows()} rows, not {rows} as before")
        for m in smaller:
            run(m)
            yield (grower, m), m
            if static_rows() != rows:
                raise NotImplementedError(f"m={m} grew a {rows}-row workspace it should fit in; flashinfer's functional path changed")


def replay(run: Callable[[int], Any], recipe: tuple[int, ...]) -> list[Any]:
    """Run a recipe from cleared caches: the last call requests what the planned one did."""
    reset()
    return [run(m) for m in recipe]
