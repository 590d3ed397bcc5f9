"""``prewarm --functional``: every key flashinfer >= 0.7.4's functional MoE path can request.

The functional ``b12x_fused_moe`` keys its micro and static kernels on a workspace that grows
with the largest batch a process has served; 0.7.4 grows it in power-of-two steps, so the keys
are a finite set that prewarm plans by driving flashinfer (``flashinfer_sites.functional``).
The proof is an engine-like process that calls flashinfer's *functional API* (prewarm planned
with the wrapper built without CUDA graphs, which shares its workspace cache) for batch sizes in
an arbitrary order, growing the workspace as it goes, and compiles nothing. The control: kernels
that process requested are missing from a CUDA-graph-mode plan of the same m (what such a
prewarm writes), so on that cache it would compile: the functional plan is what makes the difference.

Runs in the flashinfer 0.7.4 interpreter of tests/test_flashinfer_074.py
(``$CUTE_DISKCACHE_FI074_PYTHON``, built by scripts/make_fi074_venv.sh; ``off`` skips).
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

REPO = Path(__file__).resolve().parent.parent
FI074: str = os.environ.get("CUTE_DISKCACHE_FI074_PYTHON") or str(REPO / ".venv-fi074" / "bin" / "python")
DRIVER = Path(__file__).resolve().parent / "functional_driver.py"
TARGET = "rtx-pro-6000"
#: A small NVFP4 MoE layer (8 experts, top-2) so that the 22 kernels compile in about a minute.
CONFIG = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 768,
          "hidden_size": 1024, "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
SHAPE = "8,2,1024,768"
MAX_TOKENS = 70  # routed rows up to 140: workspace steps of 128 and 256 rows
#: An engine's batch history (top-2: routed rows = 2m): the workspace is 128 rows from m=3 and
#: 256 from m=70; small batches come after large ones and meet the larger workspace.
HISTORY = ["3", "40", "2", "70", "1", "9", "66", "5"]
_DROPPED_ENV = re.compile(r"^(CUTE_DISKCACHE_.*|FLASHINFER_B12X_DISK_CACHE|CUTE_DSL_ARCH|FLASHINFER_WORKSPACE_.*)$")
_COUNT_LINE = re.compile(r"^cdc-test real compiles: (\d+)$", re.M)
TIMEOUT_S = 900


def _env(root: Path, hook_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env.update(CUTE_DISKCACHE_DIR=str(root), FLASHINFER_WORKSPACE_BASE=str(root.parent / "workspace"),
               PYTHONPATH=os.pathsep.join(p for p in (str(hook_dir), str(REPO), env.get("PYTHONPATH", "")) if p))
    return env


def _run(python: str, args: list[str], root: Path, hook_dir: Path, ok: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([python, *args], env=_env(root, hook_dir), cwd=hook_dir, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if ok and proc.returncode != 0:
        pytest.fail(f"exited {proc.returncode}: {' '.join(args)}\n--- stderr ---\n{proc.stderr[-5000:]}")
    return proc


def _engine(python: str, root: Path, hook_dir: Path) -> dict[str, Any]:
    proc = _run(python, [str(DRIVER), "--target", TARGET, "--shape", SHAPE, "--m", *HISTORY], root, hook_dir)
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    counted = _COUNT_LINE.findall(proc.stderr)
    out["real_compiles"] = int(counted[-1]) if counted else None
    return out


@pytest.fixture(scope="module")
def fi074() -> str:
    if FI074 == "off":
        pytest.skip("CUTE_DISKCACHE_FI074_PYTHON=off: flashinfer 0.7.4 tests skipped")
    if not os.environ.get("CUTE_DISKCACHE_FI074_PYTHON"):
        build = subprocess.run(["bash", str(REPO / "scripts" / "make_fi074_venv.sh"), str(Path(FI074).parent.parent)],
                               capture_output=True, text=True, timeout=1200)
        assert build.returncode == 0, f"building the flashinfer 0.7.4 venv failed:\n{build.stderr[-4000:]}"
    return FI074


def _write_model(directory: Path) -> Path:
    (directory / "model").mkdir()
    (directory / "model" / "config.json").write_text(json.dumps(CONFIG))
    return directory / "model"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return _write_model(tmp_path)


def _prewarm(python: str, model: Path, root: Path, hook_dir: Path, *extra: str) -> dict[str, Any]:
    args = ["-m", "cute_diskcache.prewarm", "--model", str(model), "--target", TARGET, "--max-num-tokens", str(MAX_TOKENS),
            "--jobs", "2", "--json", *extra]
    return json.loads(_run(python, args, root, hook_dir).stdout)


@pytest.fixture(scope="module")
def functional(fi074: str, tmp_path_factory: pytest.TempPathFactory, compile_hook_dir: Path) -> dict[str, Any]:
    """The functional flow once per module: plan, prewarm, the engine's batch history, prewarm again."""
    base = tmp_path_factory.mktemp("functional")
    model, root = _write_model(base), base / "root"
    plan = _prewarm(fi074, model, root, compile_hook_dir, "--functional", "--dry-run")
    done = _prewarm(fi074, model, root, compile_hook_dir, "--functional")
    engine = _engine(fi074, root, compile_hook_dir)
    again = _prewarm(fi074, model, root, compile_hook_dir, "--functional")
    return {"model": model, "root": root, "plan": plan, "done": done, "engine": engine, "again": again}


@pytest.mark.slow
def test_functional_prewarm_covers_any_batch_history(functional: dict[str, Any]) -> None:
    plan, done, engine, again = functional["plan"], functional["done"], functional["engine"], functional["again"]
    assert plan["functional"] is True and set(plan["by_kind"]) <= {"micro", "static", "dynamic"}
    # Every recipe ends at an m its kernel lists; the same m at two workspace sizes is two
    # kernels, so there are more micro kernels than m values taking the micro kernel.
    assert all(k["recipe"] and k["recipe"][-1] in k["ms"] for k in plan["kernel_list"])
    micro = [k for k in plan["kernel_list"] if k["kind"] == "micro"]
    assert len(micro) > len({m for k in micro for m in k["ms"]})

    assert done["failed"] == 0 and done["compiled"] == plan["kernels"] and done["already_cached"] == 0, done

    assert engine["flashinfer"] == "0.7.4"
    assert engine["real_compiles"] == 0 and engine["counters"]["compiles"] == 0, engine
    assert engine["counters"]["hits"] == len(engine["events"]) > 0 and all(e[2] == "hit" for e in engine["events"])
    assert all(engine["launch_errors"]), "without a GPU every launch must fail after the kernel is found"
    assert again["already_cached"] == plan["kernels"] and again["compiled"] == 0


@pytest.mark.slow
def test_graph_mode_prewarm_leaves_functional_keys_uncovered(fi074: str, functional: dict[str, Any], tmp_path: Path,
                                                             compile_hook_dir: Path) -> None:
    """The control: a CUDA-graph prewarm of the same m does not cover the functional path.

    Prewarm writes exactly the kernels it plans (``done["compiled"] == plan["kernels"]`` above,
    and tests/test_prewarm.py), so the graph-mode plan is what its cache would hold: kernels the
    engine above requested that it lacks are kernels that engine would compile on it. (This
    compiled the graph-mode plan and ran the engine on it: ~100 s for the same answer.)"""
    graph = _prewarm(fi074, functional["model"], tmp_path / "root", compile_hook_dir, "--dry-run")
    assert graph["functional"] is False and graph["kernels"] > 0
    requested = {e[1] for e in functional["engine"]["events"]}
    uncovered = requested - {k["digest"] for k in graph["kernel_list"]}
    assert uncovered, "a graph-mode prewarm would cover the functional engine: the functional plan makes no difference"
    assert uncovered <= {k["digest"] for k in functional["plan"]["kernel_list"]}


def test_functional_is_refused_before_0_7_4(tmp_path: Path, model: Path) -> None:
    """0.6.x sizes the functional workspace exactly: exit 2 with the reason, nothing planned."""
    from cute_diskcache.flashinfer_sites import flashinfer_version

    if flashinfer_version() == "0.7.4":
        pytest.skip("needs a flashinfer before 0.7.4 in the test interpreter")
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env["CUTE_DISKCACHE_DIR"] = str(tmp_path / "root")
    proc = subprocess.run([sys.executable, "-m", "cute_diskcache.prewarm", "--model", str(model), "--target", TARGET,
                           "--max-num-tokens", "16", "--functional", "--dry-run"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "no --functional plan" in proc.stderr and "power-of-two buckets arrived in 0.7.4" in proc.stderr
