"""bench/hit_path.py's before/after comparison (issue 22): it measures the tree it was given, and
its ratios are new over old.

An A/B whose child silently imported the installed package instead of ``--code TREE`` would
compare a tree with itself and report "no worse"; the child's check is what prevents that.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "hit_path.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hit_path_bench", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_child_refuses_code_from_another_tree(tmp_path: Path) -> None:
    """PYTHONPATH names this repository, --expect-tree another one: the child stops before measuring."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUTE_DISKCACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, str(BENCH), "--child", "--expect-tree", str(tmp_path), "--m", "1", "--repeat", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert f"imported from {REPO / 'cute_diskcache' / '__init__.py'}, not from {tmp_path}" in proc.stderr
    assert not (tmp_path / "cache").exists()  # nothing was measured


def _row(kernel: str, compile_s: float, first: float, later: float) -> dict:
    return {"kernel": kernel, "compile_s": compile_s, "first": {"so": [first, first * 3]},
            "later": {"so": [later, later, later * 5]}, "first_served": {"so": [4 * first]}, "later_served": {"so": [4 * later]},
            "first_call": {"so": [2 * first]},
            "later_call": {"so": [2 * later]}, "memo_call": {"so": [0.1]}}


def test_ratios_are_each_tree_over_the_first() -> None:
    """p50 of the new tree over p50 of the base, per kernel and figure (< 1: the new tree is faster)."""
    bench = _bench()
    old = [_row("micro", 2.0, 1.0, 0.5), _row("static", 1.0, 1.0, 0.4)]
    new = [_row("micro", 1.0, 0.5, 1.0), _row("static", 1.0, 2.0, 0.2)]
    r = bench._ratios(old, new, ["so"])
    assert r["micro"]["compile"] == 0.5 and r["micro"]["cache later .so"] == 2.0 and r["micro"]["cache first .so"] == 0.5
    assert r["static"]["call later .so"] == 0.5 and r["static"]["call first .so"] == 2.0 and r["static"]["call memo .so"] == 1.0
    assert r["micro"]["served first .so"] == 0.5 and r["static"]["served later .so"] == 0.5
