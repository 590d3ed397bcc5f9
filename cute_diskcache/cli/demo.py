"""Cold vs warm engine start, without a GPU: what ``cute-diskcache demo`` shows.

Two fresh processes (:mod:`.._probe`) on one cache root drive flashinfer's MoE dispatch for a
target profile: the first compiles every kernel and writes it, the second must load them all
from disk (0 compiles) with the same kernel ABI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Sequence

#: Qwen3-30B-A3B's MoE layer, one GPU: 128 experts, top-8, hidden 2048, moe_intermediate 768.
DEMO_SHAPE = "128,8,2048,768"
#: One m per kernel kind on flashinfer 0.6.15: 1 -> micro, 16 -> static, 128 -> dynamic.
DEMO_MS = (1, 16, 128)


def run(root: Path, *, target: str, ms: Sequence[int] = DEMO_MS, shape: str = DEMO_SHAPE,
        on_phase: Any = None) -> dict[str, Any]:
    """Run the cold and the warm start; per kernel: (kind, cold outcome, cold s, warm outcome, warm s).

    ``ok`` is true when the warm process compiled nothing and every kernel's launch behaved the
    same (same error, or none) in both. ``on_phase("cold" | "warm")`` is told before each start.
    Raises ``RuntimeError`` when a probe process fails.
    """
    from .. import _probe as probe

    if on_phase:
        on_phase("cold")
    cold = probe.run(root, list(ms), target=target, shape=shape)
    if on_phase:
        on_phase("warm")
    warm = probe.run(root, list(ms), target=target, shape=shape)
    rows = [
        (site.rsplit(".", 1)[-1], kind_c, t_cold, kind_w, t_warm)
        for (site, _d, kind_c, t_cold, *_), (_s, _d2, kind_w, t_warm, *_) in zip(cold["events"], warm["events"], strict=False)
    ]
    ok = warm["counters"]["compiles"] == 0 and all(
        a["launch_error"] == b["launch_error"] for a, b in zip(cold["records"], warm["records"], strict=False)
    )
    return {"rows": rows, "cold": cold, "warm": warm, "ok": ok}
