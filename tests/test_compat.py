"""The compatibility matrix's CI subset, for real: flashinfer x DSL cells, a refusal, the wheel's pins.

Each cell is a venv of ``scripts/compat_matrix.py`` (that flashinfer and DSL over a shared base
with torch 2.13.0 CPU; under ``$CUTE_DISKCACHE_COMPAT_SCRATCH``, outside the checkout, built once)
running this checkout. ``run_cell`` is the same code the full matrix runs: a real compile per
covered site kind through flashinfer's own dispatch, then a fresh process that must make 0
compiles (counted at the DSL's ``CompileCallable._compile``) with the same digests and ABI text.

CI subset (about 4 minutes on 2 cores, venvs built from pip's cache included; the full matrix,
34 cells, is ``python scripts/compat_matrix.py``: 32 minutes on the same machine):

* 0.6.12 + DSL 4.5.0 [cu13]: the oldest release on the oldest DSL, the seed report's stack. DSL
  4.5.0 compiles take 20-40 s each here, so CI proves it with the micro kernel alone.
* 0.6.18.post1 + 4.8.1: the first release whose static/micro/dynamic kernels flashinfer caches
  natively (served from our cache), plus the direct micro kernel.
* 0.7.2.post1 + 4.8.0: beside vLLM 0.34's pin (0.7.3 is not on the index), with vLLM's DSL;
  also the release whose native-cache API lacks ``enable_tvm_ffi`` (regression test below).
* 0.6.12 + DSL 4.5.0 without its cu13 libraries: refused, with one log line.

``CUTE_DISKCACHE_COMPAT=off`` skips the module.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _compat, whatever pytest's import mode
from _compat import REPO, SCRATCH, matrix  # noqa: E402

pytestmark = [
    pytest.mark.skipif(os.environ.get("CUTE_DISKCACHE_COMPAT") == "off", reason="CUTE_DISKCACHE_COMPAT=off: matrix cells skipped"),
    pytest.mark.slow,
]
TARGET = "rtx-pro-6000"
#: Sites CI drives per cell when fewer than the full matrix (default: all the release has).
CI_SITES = {"fi0.6.12-dsl4.5.0-cu13": ["micro"]}
REFUSED_CELL = "fi0.6.12-dsl4.5.0"
_DROPPED_ENV = re.compile(r"^(CUTE_DISKCACHE_.*|FLASHINFER_B12X_DISK_CACHE|CUTE_DSL_ARCH|FLASHINFER_WORKSPACE_.*|PYTHONPATH)$")


def _cell(name: str) -> Any:
    return {c.name: c for c in matrix().CELLS}[name]


def _committed(name: str) -> dict[str, Any]:
    return json.loads((REPO / "compat" / "cells" / f"{name}.json").read_text())


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env.update(PYTHONPATH=str(REPO), CUTE_DISKCACHE_DIR=str(tmp_path / "root"), FLASHINFER_WORKSPACE_BASE=str(tmp_path / "workspace"))
    env.update(extra)
    return env


def _run(python: Path, args: list[str], tmp_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "cwd").mkdir(exist_ok=True)
    return subprocess.run([str(python), *args], env=_env(tmp_path, **extra), cwd=tmp_path / "cwd", capture_output=True,
                          text=True, timeout=900)


@pytest.mark.parametrize("name", matrix().CI_CELLS)
def test_ci_cell_is_proven(name: str, tmp_path: Path) -> None:
    committed = _committed(name)
    result = matrix().run_cell(_cell(name), SCRATCH, REPO, sites=CI_SITES.get(name), workdir=tmp_path / "run")
    assert result["status"] == "proven", result["reason"]
    assert committed["status"] == "proven", "the committed matrix disagrees with CI"
    assert result["sites_driven"] == CI_SITES.get(name, committed["sites_driven"])
    assert result["warm"]["real_compiles"] == 0 and result["cold"]["real_compiles"] == len(result["sites_driven"])
    # Same release, same DSL: the same coverage and the same prewarm plan as the committed run.
    assert result["doctor"]["covered"] == committed["doctor"]["covered"]
    assert result["doctor"]["verified"] is True
    assert result["doctor"]["rc_strict"] == committed["doctor"]["rc_strict"] == 0, "doctor --strict passes on a proven cell"
    assert result["prewarm"]["by_kind"] == committed["prewarm"]["by_kind"]


def test_refused_combination_attaches_nothing_and_says_so_once(tmp_path: Path) -> None:
    """DSL 4.5 without its cu13 libraries cannot assemble these kernels (the matrix records ptxas'
    error): the package refuses the combination in one log line instead of half-working."""
    python = matrix().cell_venv(_cell(REFUSED_CELL), SCRATCH)
    assert _committed(REFUSED_CELL)["status"] == "refused"
    code = ("import logging, sys, cute_diskcache\n"
            "cute_diskcache.install(target='rtx-pro-6000')\n"
            "from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch\n"
            "import cutlass.cute as cute\n"
            "from cute_diskcache.core import hook\n"
            "print(isinstance(cute.compile, hook._Dispatch))\n")
    proc = _run(python, ["-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False"], "the compile hook was attached although the combination is refused"
    assert "attached:" not in proc.stderr, proc.stderr[-3000:]  # no cache attached either (its warm-up line)
    lines = [ln for ln in proc.stderr.splitlines() if "refuses" in ln]
    assert lines == ["cute-diskcache refuses flashinfer 0.6.12 with nvidia-cutlass-dsl 4.5.0: nvidia-cutlass-dsl 4.5 without "
                     "its cu13 libraries cannot assemble the sm12x MoE kernels (ptxas: \"Unexpected instruction types specified "
                     "for '_mma'\"); install nvidia-cutlass-dsl[cu13]; flashinfer runs uncached"], proc.stderr[-3000:]
    doctor = _run(python, ["-m", "cute_diskcache.cli.doctor", "--strict"], tmp_path)
    assert doctor.returncode == 1 and "REFUSED: flashinfer 0.6.12 with nvidia-cutlass-dsl 4.5.0" in doctor.stdout
    prewarm = _run(python, ["-m", "cute_diskcache.prewarm", "--model", "qwen3-30b-a3b", "--target", TARGET, "--dry-run"], tmp_path)
    assert prewarm.returncode == 2 and "error: cute-diskcache refuses flashinfer 0.6.12" in prewarm.stderr


def test_native_kernels_on_0_7_2_post1_are_seen_as_cached(tmp_path: Path) -> None:
    """Regression: 0.7.2.post1's ``JitSpecCuteDsl`` takes no ``enable_tvm_ffi``; passing it raised a
    TypeError that was swallowed, so with flashinfer's own cache in charge every native kernel
    looked uncached (prewarm re-planned, and reported nothing as cached, forever)."""
    python = matrix().cell_venv(_cell("fi0.7.2.post1-dsl4.8.0"), SCRATCH)
    args = ["-m", "cute_diskcache.prewarm", "--model", "qwen3-30b-a3b", "--target", TARGET, "--max-num-tokens", "256",
            "--m", "1", "--no-dense", "--json"]  # the MoE layers' native kernel alone
    opt_out = {"CUTE_DISKCACHE_NATIVE_SITES": "flashinfer"}
    built = _run(python, args, tmp_path, **opt_out)
    assert built.returncode == 0, built.stderr[-3000:]
    done = json.loads(built.stdout)
    assert done["compiled"] == 1 and [k["kind"] for k in done["kernel_list"]] == ["native-micro"], done
    plan = _run(python, [*args, "--dry-run"], tmp_path, **opt_out)
    assert plan.returncode == 0, plan.stderr[-3000:]
    (kernel,) = json.loads(plan.stdout)["kernel_list"]
    assert kernel["native"] is True and kernel["status"] == "cached", kernel
    assert "cannot tell whether its native kernels are cached" not in plan.stderr + built.stderr


def _versions(python: Path, tmp_path: Path) -> dict[str, str]:
    """name -> version of every distribution the interpreter sees first (its effective stack)."""
    code = ("import importlib.metadata as m, json\nseen = {}\n"
            "for d in m.distributions():\n"
            "    seen.setdefault((d.metadata['Name'] or '').lower().replace('_', '-'), d.version)\n"
            "print(json.dumps(seen))")
    proc = _run(python, ["-c", code], tmp_path)
    return json.loads(proc.stdout)


def test_installing_the_wheel_moves_no_flashinfer_dsl_or_torch(tmp_path: Path) -> None:
    """``pip install cute-diskcache`` beside flashinfer 0.6.12 and DSL 4.5.0 (the oldest the
    matrix proves; the old ``nvidia-cutlass-dsl>=4.6`` upgraded it): nothing already there moves.

    The user's environment is the CI cell that holds exactly that stack (built once under its
    lock, shared by runs and workers), so it is only read: pip resolves the wheel with its
    dependencies against it (``--dry-run --report``, the resolution a real install carries
    out) and must want to install this package alone."""
    script = matrix()
    python = script.cell_venv(_cell("fi0.6.12-dsl4.5.0-cu13"), SCRATCH)
    before = _versions(python, tmp_path)
    assert before["flashinfer-python"] == "0.6.12" and before["nvidia-cutlass-dsl"] == "4.5.0", before
    assert before["torch"] == "2.13.0+cpu" and "cute-diskcache" not in before, before
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist),
                    str(REPO)], check=True, capture_output=True, timeout=600)
    (wheel,) = dist.glob("cute_diskcache-*.whl")
    report = tmp_path / "report.json"
    # With its dependencies, as a user installs it; the constraints hold torch to the CPU build
    # should the resolver reach for torch at all (it would then be listed, and fail the test).
    script._pip(python, "--dry-run", "--report", str(report), str(wheel), constraints=script._constraints(SCRATCH))
    wanted = {(item["metadata"]["name"].lower().replace("_", "-"), item["metadata"]["version"])
              for item in json.loads(report.read_text())["install"]}
    moved = {name: (before.get(name), version) for name, version in wanted if name != "cute-diskcache"}
    assert moved == {}, f"installing the wheel would change {moved}"
    assert [name for name, _ in wanted] == ["cute-diskcache"], wanted
