#!/usr/bin/env python3
"""Measure what ``cute_diskcache.pth`` costs every Python start-up, with the switch off and on.

The .pth runs in *every* interpreter of an environment that has the package (pip, every vLLM
worker, every shell tool), so "installed but off" must cost nothing, and "on" should cost
little. This builds the wheel from this checkout, installs it into a throwaway venv (with its
pure-python dependencies, without flashinfer, so only our own code is timed), and compares
``python -c pass`` there against an empty venv, interleaved so machine noise hits both alike.

    python scripts/pth_overhead.py [--runs 50] [--json]

tests/test_activation.py asserts the "off" number; this prints the whole picture.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENABLE_ENV = "FLASHINFER_B12X_DISK_CACHE"
LIGHT_DEPS = ("msgpack", "platformdirs", "filelock")


def _venv(root: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    return root / "bin" / "python"


def _install(python: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", *args]
    subprocess.run(cmd, check=True)


def build(tmp: Path) -> tuple[Path, Path]:
    """Return (empty venv python, venv python with our wheel and its light dependencies)."""
    dist = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(REPO)],
        check=True,
    )
    (wheel,) = dist.glob("cute_diskcache-*.whl")
    bare = _venv(tmp / "bare")
    installed = _venv(tmp / "installed")
    _install(installed, str(wheel), *(f"{d}=={metadata.version(d)}" for d in LIGHT_DEPS))
    return bare, installed


def _once(python: Path, env: dict[str, str], cwd: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=env, cwd=cwd, check=True)
    return time.perf_counter() - t0


def measure(bare: Path, installed: Path, runs: int, cwd: Path) -> dict[str, dict[str, float]]:
    """Median and p90 start-up per configuration, plus the median paired difference to bare."""
    off = {k: v for k, v in os.environ.items() if k != ENABLE_ENV and not k.startswith("CUTE_DISKCACHE_")}
    on = dict(off, **{ENABLE_ENV: "1"})
    configs = {"bare venv": (bare, off), f"installed, {ENABLE_ENV} unset": (installed, off), f"installed, {ENABLE_ENV}=1": (installed, on)}
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for python, env in configs.values():
        _once(python, env, cwd)  # warm pyc files and the page cache
    for _ in range(runs):
        for name, (python, env) in configs.items():
            samples[name].append(_once(python, env, cwd))
    base = samples["bare venv"]
    out = {}
    for name, xs in samples.items():
        out[name] = {
            "median_ms": statistics.median(xs) * 1e3,
            "p90_ms": statistics.quantiles(xs, n=10)[-1] * 1e3,
            "delta_ms": statistics.median(x - b for x, b in zip(xs, base, strict=True)) * 1e3,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cdc-pth-") as tmp:
        bare, installed = build(Path(tmp))
        result = measure(bare, installed, args.runs, Path(tmp))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"python -c pass, {args.runs} interleaved runs each ({sys.version.split()[0]})")
    print(f"{'configuration':<44}{'median':>10}{'p90':>10}{'vs bare':>10}")
    for name, r in result.items():
        print(f"{name:<44}{r['median_ms']:>8.2f}ms{r['p90_ms']:>8.2f}ms{r['delta_ms']:>+8.2f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
