"""Where the suite's time goes: every phase of every test and every fixture set-up, as JSON lines.

``--durations`` prints the slowest items but not which worker ran them, when, or which fixture
a long set-up was paying for; balancing two workers needs all three. Set
``CUTE_DISKCACHE_TEST_TIMELINE=/path/file.jsonl`` and each worker appends one line per test
phase (``kind: "phase"``) and per fixture set-up (``kind: "fixture"``); ``scripts/suite_costs.py``
sums them by module, fixture and worker. Lines are short single ``write``s to an ``O_APPEND``
descriptor, so two workers appending at once do not interleave.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

import pytest

ENV = "CUTE_DISKCACHE_TEST_TIMELINE"
#: Bound at import: tests replace ``os.open`` and ``os.write`` (a full disk, a failing write), and
#: a report made while one is replaced must still be recorded, never crash the worker.
_open, _write, _close = os.open, os.write, os.close


def _append(record: dict[str, Any]) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    record["worker"] = os.environ.get("PYTEST_XDIST_WORKER", "main")
    fd = _open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        _write(fd, (json.dumps(record) + "\n").encode())
    finally:
        _close(fd)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One line per set-up, call and teardown, with wall-clock start and stop."""
    if hasattr(report, "node"):
        return  # xdist's controller, seeing a worker's report again
    _append(
        {
            "kind": "phase",
            "nodeid": report.nodeid,
            "when": report.when,
            "start": report.start,
            "stop": report.stop,
            "outcome": report.outcome,
        }
    )


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Iterator[Any]:
    """One line per fixture set-up that took at least 50 ms (the rest are noise)."""
    start = time.time()
    try:
        return (yield)
    finally:
        took = time.time() - start
        if took >= 0.05:
            _append(
                {
                    "kind": "fixture",
                    "fixture": fixturedef.argname,
                    "scope": fixturedef.scope,
                    "nodeid": request.node.nodeid,
                    "start": start,
                    "duration": took,
                }
            )
