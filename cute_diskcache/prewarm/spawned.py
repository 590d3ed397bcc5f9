"""Prewarm's pool of spawned workers for the libraries whose kernels it drives through Python calls
(b12x's jobs, b12x's MoE launches, SGLang's decode calls): one place that says how they start and
how work is handed out, so the three branches cannot drift apart.

Spawned, not forked: the parent has imported torch and the DSL (their threads and locks do not
survive a fork), and each worker applies the target card's profile (its ``initializer``) before
the library is imported. One call at a time (``chunksize=1``): a call is a kernel's compile,
seconds long, so a slow one never holds finished work behind it. flashinfer's prewarm has its own
long-lived workers (:mod:`..prewarm`), which stream each kernel's outcome back as it lands.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any


def starmap(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], workers: int,
            initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()) -> list[Any]:
    """``fn(*call)`` for each call, in order, in at most ``workers`` spawned processes (never more
    processes than calls)."""
    if not calls:
        return []
    context = multiprocessing.get_context("spawn")
    with context.Pool(max(1, min(workers, len(calls))), initializer=initializer, initargs=initargs) as pool:
        return pool.starmap(fn, calls, chunksize=1)
