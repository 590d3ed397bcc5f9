"""``prewarm --moe-backend b12x`` (issue 44 items 1 and 6): vLLM 0.34's b12x MoE warm-up planned from
the config, gated by ``check``, and b12x's own books agreeing with ours after a hit.

Everything that imports b12x runs in the b12x venv (``scripts/make_b12x_venv.sh``, see test_b12x.py).
The real compiles (slow) are one kernel each: qwen3-30b-a3b's micro kernel at one token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_b12x import B12X_PY, REPO, TIMEOUT_S, _env, b12x_python  # noqa: E402,F401

pytestmark = pytest.mark.skipif(B12X_PY == "off", reason="CUTE_DISKCACHE_B12X_PYTHON=off: b12x tests skipped")

MODEL = "qwen3-30b-a3b"
CARD = ("--target", "rtx-pro-6000", "--moe-backend", "b12x")

_KEYS = """
    import json, sys, torch
    from cute_diskcache.b12x_sites import moe, planning
    from cute_diskcache.core import through
    planning.init_worker("rtx-pro-6000")

    def keys(layer, tensors):
        with through.planning() as requested:
            launched = moe.drive(layer, "nvfp4", (1, 64), 188, tensors)
        return [launched, [r["digest"] for r in requested]]

    def random_weights(layer):
        g = torch.Generator().manual_seed(0)
        out = {}
        for name, (shape, dtype) in layer.tensor_shapes().items():
            if dtype == "uint8":
                out[name] = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
            elif dtype == "float8_e4m3fn":
                out[name] = (torch.rand(shape, generator=g) * 4).to(torch.float8_e4m3fn)
            else:
                out[name] = torch.rand(shape, generator=g) + 0.5
        return out

    # one preparation per process: b12x memoises its kernels, so a second drive would ask for none
    which = sys.argv[-1]
    layer = moe.Layer(16 if which == "wider" else 8, 512, 256, 2, "silu", "bfloat16")
    print(json.dumps(keys(layer, random_weights(layer) if which == "random" else None)))
"""


def _run(python: str, code: str, root: Path, *argv: str) -> Any:
    # ``python -c`` puts its working directory first on sys.path: the test's own folder, never the
    # checkout's tests/ (a module another engineer adds there would shadow the child's imports).
    proc = subprocess.run([python, "-c", textwrap.dedent(code), *argv], env=_env(root, {}), capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=str(root.parent))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_placeholder_experts_give_the_keys_real_weights_give(b12x_python: str, tmp_path: Path) -> None:
    """The MoE compile depends on shapes, dtypes, modes and the plan, never on weight values: b12x's
    experts prepared from uninitialised tensors ask for the keys experts prepared from random
    checkpoint-shaped weights ask for (a micro and a dynamic launch); another expert count asks for
    others, so the comparison can fail."""
    out = {which: _run(b12x_python, _KEYS, tmp_path / "root", which) for which in ("placeholder", "random", "wider")}
    assert out["placeholder"][0] == [["micro", 1], ["dynamic", 64]], out
    assert out["placeholder"] == out["random"] and len(set(out["placeholder"][1])) == 2, out
    assert not set(out["wider"][1]) & set(out["placeholder"][1]), out
    assert not (tmp_path / "root").exists(), "planning compiles and writes nothing"


def _prewarm(python: str, root: Path, *flags: str, hook_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "cute_diskcache.prewarm", MODEL, *CARD, "--json", "--root", str(root), *flags],
                          env=_env(root, {}, hook_dir), capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=str(hook_dir or root.parent))


def test_moe_dry_run_lists_the_launches_of_vllms_b12x_warmup(b12x_python: str, tmp_path: Path) -> None:
    """At vLLM's default token counts (1, the capture sizes, 8192) warmup_launches launches once per
    b12x execution signature: the micro kernel at 1 token, then the dynamic one's regimes."""
    proc = _prewarm(b12x_python, tmp_path / "root", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["mode"] == "nvfp4" and out["layer"]["num_experts"] == 128 and out["layer"]["padded_intermediate"] == 768
    assert [r["tokens"] for r in out["job_list"]][0] == 1 and out["job_list"][-1]["tokens"] == 8192, out["job_list"]
    assert out["job_list"][0]["kernels"] == ["b12x.silu.MoEMicroKernelSilu"], out["job_list"]
    assert out["kernels_compiled"] == 0 and not (tmp_path / "root").exists()


@pytest.mark.parametrize("model, extra, why", [
    (MODEL, {"VLLM_B12X_MOE_FP4_FORCE_A16": "1"}, "nvfp4-a16 is not planned offline"),
    ("llama-3.1-8b-nvfp4", {}, "has no MoE layers"),
])
def test_moe_prewarm_and_check_refuse_what_they_cannot_plan(b12x_python: str, tmp_path: Path, model: str,
                                                           extra: dict[str, str], why: str) -> None:
    root = tmp_path / "root"
    for cmd in (["-m", "cute_diskcache.prewarm", model, *CARD, "--dry-run"],
                ["-m", "cute_diskcache", "--root", str(root), "check", model, *CARD]):
        proc = subprocess.run([b12x_python, *cmd], env=_env(root, extra), capture_output=True, text=True,
                              timeout=TIMEOUT_S, cwd=str(tmp_path))
        assert proc.returncode == 2 and why in proc.stderr, (cmd, proc.stdout[-2000:], proc.stderr[-2000:])
    assert not root.exists()


def _driver(python: str, root: Path, hook_dir: Path) -> dict[str, Any]:
    from conftest import split_stderr

    proc = subprocess.run([python, str(REPO / "tests" / "b12x_moe_driver.py"), MODEL, "rtx-pro-6000", "1"],
                          env=_env(root, {"B12X_LOG_CUTE_COMPILES": "1"}, hook_dir), capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=hook_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    out: dict[str, Any] = json.loads(lines[-1])
    out["miss_lines"] = [ln for ln in lines[:-1] if "status=disk-cache-miss" in ln]
    out["real_compiles"] = split_stderr(proc.stderr)[2]
    return out


@pytest.mark.slow
def test_after_moe_prewarm_vllms_warmup_compiles_nothing_and_b12x_says_so(b12x_python: str, tmp_path: Path,
                                                                         compile_hook_dir: Path) -> None:
    """Items 1 and 6 on the CPU: on an empty root the warm-up's b12x path compiles (b12x counts the
    miss and logs it, as we do); after ``prewarm --moe-backend b12x`` and a passing ``check`` with the
    same flags, a fresh process making the same b12x calls makes 0 DSL compiles, and b12x's own
    counters and late-compile log agree: no compile miss, no "disk-cache-miss" line, one disk hit."""
    cold = _driver(b12x_python, tmp_path / "empty", compile_hook_dir)
    assert cold["real_compiles"] == 1 and cold["counters"]["compiles"] == 1, cold
    assert cold["b12x"]["compile_misses"] == 1 and len(cold["miss_lines"]) == 1, cold
    root = tmp_path / "root"
    proc = _prewarm(b12x_python, root, "--m", "1", "--jobs", "1", hook_dir=compile_hook_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert json.loads(proc.stdout)["kernels_compiled"] == 1
    gate = subprocess.run([b12x_python, "-m", "cute_diskcache", "--root", str(root), "check", MODEL, *CARD, "--m", "1"],
                          env=_env(root, {}, compile_hook_dir), capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=compile_hook_dir)
    assert gate.returncode == 0, gate.stdout[-2000:] + gate.stderr[-3000:]
    warm = _driver(b12x_python, root, compile_hook_dir)
    assert warm["launched"] == [["micro", 1]] and warm["real_compiles"] == 0, warm
    assert warm["counters"]["hits"] == 1 and warm["counters"]["compiles"] == 0, warm["counters"]
    assert warm["b12x"]["compile_misses"] == 0 and warm["b12x"]["disk_cache_hits"] == 1, warm["b12x"]
    assert warm["miss_lines"] == [], warm["miss_lines"]
