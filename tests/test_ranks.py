"""An engine's ranks say the node's exit summary once, with everyone's totals (issue 28, item 4).

``ranks.report_once`` run by several real processes at once, leaving in every order: exactly one
of them gets the totals, and they add up every rank's counters; a rank that never reports is
named by the first local rank after it waited. (vLLM's own world set-up is driven in
``test_vllm.py``; here the ranks are given, so the race can be run many times.)
"""

from __future__ import annotations

import multiprocessing
import random
import time
from pathlib import Path
from typing import Any

import pytest

from cute_diskcache.core import ranks


def _leave(rank: int, size: int, group: str, delay: float, tmp: str, out: Any) -> None:
    import tempfile

    tempfile.tempdir = tmp
    time.sleep(delay)
    r = ranks.Ranks(rank=rank, local_rank=rank, world_size=size, local_size=size, group=group)
    out.put((rank, ranks.report_once(r, {"hits": rank + 1, "misses": 1, "compile_seconds": 0.5})))


@pytest.mark.parametrize("size", [2, 3])
def test_exactly_one_rank_says_the_totals_whatever_order_they_leave_in(tmp_path: Path, size: int) -> None:
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(size)
    for run in range(12):
        out = ctx.Queue()
        delays = [rng.choice([0.0, 0.0, 0.01, 0.05, 0.2]) for _ in range(size)]
        procs = [ctx.Process(target=_leave, args=(r, size, f"g{size}-{run}", delays[r], str(tmp_path), out)) for r in range(size)]
        for p in procs:
            p.start()
        got = dict(out.get(timeout=30) for _ in procs)
        for p in procs:
            p.join(30)
        said = {r: v for r, v in got.items() if v is not None}
        assert len(said) == 1, (run, delays, got)
        (totals, missing), = said.values()
        assert missing == [] and totals == {"hits": sum(range(1, size + 1)), "misses": size, "compile_seconds": 0.5 * size}
    assert not [p for p in (tmp_path / f"cute-diskcache-{__import__('os').getuid()}").iterdir()], "nothing left behind"


def test_the_first_rank_speaks_alone_after_waiting_for_a_rank_that_never_leaves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ranks, "WAIT_S", 0.2)
    first = ranks.Ranks(rank=0, local_rank=0, world_size=2, local_size=2, group="lonely")
    t0 = time.monotonic()
    totals, missing = ranks.report_once(first, {"hits": 3})  # type: ignore[misc]
    assert time.monotonic() - t0 >= 0.2 and totals == {"hits": 3} and missing == [1]
