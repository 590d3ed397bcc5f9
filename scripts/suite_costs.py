"""Sum a test run's timeline (tests/timeline.py) by module, by fixture and by worker.

Usage: ``CUTE_DISKCACHE_TEST_TIMELINE=run.jsonl python -m pytest`` then
``python scripts/suite_costs.py run.jsonl [--top N]``. Prints Markdown tables, the form
docs/development.md keeps them in: where the workers' time went, and how much of the run's
wall time each worker sat idle (what better balancing could still win).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def _load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _table(title: str, head: tuple[str, ...], rows: list[tuple]) -> str:
    out = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def summarize(records: list[dict], top: int) -> str:
    """The Markdown report; separate from main so a test can feed it records."""
    phases = [r for r in records if r["kind"] == "phase"]
    fixtures = [r for r in records if r["kind"] == "fixture"]
    if not phases:
        return "no test phases recorded\n"
    start = min(r["start"] for r in phases)
    stop = max(r["stop"] for r in phases)
    wall = stop - start

    by_module: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for r in phases:
        row = by_module[r["nodeid"].split("::", 1)[0]]
        took = r["stop"] - r["start"]
        row[{"setup": 0, "call": 1, "teardown": 2}[r["when"]]] += took
        row[3] += r["when"] == "call"
    modules = sorted(by_module.items(), key=lambda kv: -sum(kv[1][:3]))
    total = sum(sum(v[:3]) for v in by_module.values())

    by_fixture: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for r in fixtures:
        row = by_fixture[(r["fixture"], r["scope"])]
        row[0] += r["duration"]
        row[1] += 1
    fixture_rows = sorted(by_fixture.items(), key=lambda kv: -kv[1][0])

    busy: dict[str, float] = collections.defaultdict(float)
    for r in phases:
        busy[r["worker"]] += r["stop"] - r["start"]

    out = [
        f"{sum(1 for r in phases if r['when'] == 'call')} tests, wall {wall / 60:.1f} min, "
        f"worker time {total / 60:.1f} min\n",
        _table(
            "Workers",
            ("worker", "busy min", "idle min"),
            [(w, f"{b / 60:.1f}", f"{(wall - b) / 60:.1f}") for w, b in sorted(busy.items())],
        ),
        _table(
            f"Modules (top {top} of {len(modules)}, by set-up + call + teardown)",
            ("module", "tests", "set-up s", "call s", "teardown s", "total s", "share"),
            [
                (m, v[3], f"{v[0]:.0f}", f"{v[1]:.0f}", f"{v[2]:.0f}", f"{sum(v[:3]):.0f}", f"{sum(v[:3]) / total:.1%}")
                for m, v in modules[:top]
            ],
        ),
        _table(
            f"Fixtures (top {top}, set-ups of at least 50 ms)",
            ("fixture", "scope", "set-ups", "total s"),
            [(f, s, v[1], f"{v[0]:.0f}") for (f, s), v in fixture_rows[:top]],
        ),
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    print(summarize(_load(args.timeline), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
