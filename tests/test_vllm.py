"""Real vLLM 0.34.0: its plugin loader runs our entry point, and its b12x experts build the wrapper
prewarm plans with.

vLLM is installed into a venv of its own (``--no-deps``: its wheel requires a CUDA torch 2.14;
plus what its plugin loader and fused-MoE experts import, at vLLM's own versions, flashinfer 0.7.4
and vLLM's DSL pin), with this checkout as a built wheel, so the entry point is what ``pip install``
registers. Nothing of vLLM is imitated: ``tests/vllm_driver.py`` calls vLLM's functions and
classes, and the source checks read the installed vLLM files, so a vLLM release that changes how
it builds ``B12xMoEWrapper`` (and so the kernel keys) fails here instead of silently missing.

The venv lives under ``$CUTE_DISKCACHE_COMPAT_SCRATCH`` (default ``~/.cache/cute-diskcache/compat``,
outside the checkout; built once, ~2 min, then reused). ``CUTE_DISKCACHE_VLLM=off`` skips.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cute_diskcache.prewarm import models

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _compat, whatever pytest's import mode
from _compat import REPO, SCRATCH, matrix  # noqa: E402
from conftest import once_per_run, split_stderr  # noqa: E402

DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
pytestmark = [
    pytest.mark.skipif(os.environ.get("CUTE_DISKCACHE_VLLM") == "off", reason="CUTE_DISKCACHE_VLLM=off: vLLM tests skipped"),
    pytest.mark.slow,
]
_DROPPED_ENV = re.compile(r"^(CUTE_DISKCACHE_.*|FLASHINFER_B12X_DISK_CACHE|CUTE_DSL_ARCH|FLASHINFER_WORKSPACE_.*|PYTHONPATH)$")
#: What prewarm assumes of vLLM's B12xMoEWrapper construction (README, "Prewarm"): keyword ->
#: the expression vLLM passes, in FlashInferB12xExperts._ensure_wrapper.
WRAPPER_CALL = {
    "num_experts": "self.global_num_experts",
    "top_k": "self.topk",
    "hidden_size": "self.hidden_dim",
    "intermediate_size": "self.intermediate_size_per_partition",
    "use_cuda_graph": "True",
    "max_num_tokens": "self.max_num_tokens",
    "num_local_experts": "self.num_local_experts",
    "activation": "self._activation_str",
}
#: ... and where those attributes come from, in FlashInferB12xExperts.__init__.
FROM_MOE_CONFIG = {
    "self.global_num_experts": "moe_config.num_experts",
    "self.topk": "moe_config.experts_per_token",
    "self.hidden_dim": "moe_config.hidden_dim",
    "self.intermediate_size_per_partition": "moe_config.intermediate_size_per_partition",
    "self.max_num_tokens": "moe_config.max_num_tokens",
    "self.num_local_experts": "moe_config.num_local_experts",
}
#: Activations prewarm's model reader produces (cute_diskcache.prewarm.models.moe_shape).
PREWARM_ACTIVATIONS = {"silu", "gelu_tanh", "relu2", "swigluoai_uninterleave"}


@pytest.fixture(scope="module")
def vllm_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    script = matrix()
    python = script.vllm_venv(SCRATCH)
    script.install_checkout_wheel(python, REPO, tmp_path_factory.mktemp("vllm-wheel"))
    return python


def _child(python: Path, *args: str, cwd: Path) -> Any:
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env["CUTE_DISKCACHE_DIR"] = str(cwd / "root")
    proc = subprocess.run([str(python), str(DRIVER), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _serve(python: Path, root: Path, hook_dir: Path | None) -> dict[str, Any]:
    """One vLLM process (``serve``) on ``root``: what it printed, our lines, the real compiles it made.

    No PYTHONPATH but the compile counter's (``hook_dir``): cute_diskcache comes from the wheel."""
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env["CUTE_DISKCACHE_DIR"] = str(root)
    if hook_dir is not None:
        env["PYTHONPATH"] = str(hook_dir)
    proc = subprocess.run([str(python), str(DRIVER), "serve"], env=env, cwd=root.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert re.search(r"^\(MainProcess pid=\d+\) INFO \d\d-\d\d [\d:]+ \[vllm_driver.py:\d+\] vLLM logging configured$", proc.stdout, re.M), proc.stdout
    return {"counters": json.loads(proc.stdout.strip().splitlines()[-1]), "real_compiles": split_stderr(proc.stderr)[2],
            "lines": [ln for ln in proc.stderr.splitlines() if ln.startswith("[cute-diskcache]")]}


@pytest.fixture(scope="module")
def served_cold(vllm_python: Path, compile_hook_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One vLLM process on an empty cache, once per run: it compiles the m=1 micro kernel its
    warm-up asks for. test_vllm_jit_monitor.py starts from this root too (a root that warm-up, with
    no monitor, filled). Copy the root, never change it."""
    shared, cold = once_per_run(tmp_path_factory, "vllm-serve-cold", lambda d: _serve(vllm_python, d / "root", compile_hook_dir))
    return shared / "root", cold


def test_vllm_process_shows_the_attach_line_and_the_miss_warning(vllm_python: Path, served_cold: tuple[Path, dict[str, Any]],
                                                                tmp_path: Path) -> None:
    """vLLM's logging as vLLM configures it (a handler on ``vllm`` only): our lines still show, once each.
    The cold process is the run's one (:func:`served_cold`); the warm one reads a copy of its root."""
    cold_root, cold_run = served_cold
    root = tmp_path / "root"
    shutil.copytree(cold_root, root, symlinks=True)
    warm_run = _serve(vllm_python, root, None)
    (cold, cold_lines), (warm, warm_lines) = ((r["counters"], r["lines"]) for r in (cold_run, warm_run))
    assert cold["compiles"] >= 1 and warm["compiles"] == 0 and warm["hits"] == cold["compiles"]
    # vLLM's own version is in the stack too: its skinny GEMM is one of our sites (vllm_sites/).
    attach = "[cute-diskcache] INFO attached: cache {} (writable), {} for this stack (flashinfer 0.7.4, vllm 0.34.0, DSL "
    assert cold_lines[0].startswith(attach.format(cold_root, "0 entries")), cold_lines
    warnings = [ln for ln in cold_lines if ln.startswith("[cute-diskcache] WARNING compiling ")]
    assert len(warnings) == cold["compiles"] and all(": no entry for this kernel; key " in ln for ln in warnings), cold_lines
    assert cold_lines[-1].startswith(f"[cute-diskcache] INFO this process: {cold['misses']} miss"), cold_lines
    n = cold["compiles"]
    assert warm_lines[0].startswith(attach.format(root, f"{n} {'entry' if n == 1 else 'entries'}")), warm_lines
    assert not [ln for ln in warm_lines if " WARNING " in ln], warm_lines
    assert warm_lines[-1].startswith(f"[cute-diskcache] INFO this process: {n} hit"), warm_lines
    print("\n--- vLLM process, cold ---\n" + "\n".join(cold_lines) + "\n--- warm ---\n" + "\n".join(warm_lines))


def test_vllm_is_the_release_under_test(vllm_python: Path, tmp_path: Path) -> None:
    out = subprocess.run([str(vllm_python), "-c", "import importlib.metadata as m, cute_diskcache, json; print(json.dumps("
                          "[m.version('vllm'), m.version('flashinfer-python'), m.version('torch'), cute_diskcache.__file__]))"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    vllm, flashinfer, torch, ours = json.loads(out.stdout)
    assert (vllm, flashinfer, torch) == ("0.34.0", "0.7.4", "2.13.0+cpu")
    assert "site-packages" in ours, "cute_diskcache must come from the installed wheel (entry points)"


def test_load_general_plugins_runs_our_entry_point_and_attaches_only_when_enabled(vllm_python: Path, tmp_path: Path) -> None:
    off = _child(vllm_python, "plugins", cwd=tmp_path)
    assert off == {"entry_point_ran": True, "installed": False, "import_hooks": 0, "flashinfer_imported": False}
    on = _child(vllm_python, "plugins", "--enable", cwd=tmp_path)
    assert on == {"entry_point_ran": True, "installed": True, "import_hooks": 1, "flashinfer_imported": False}


#: (model, TP) pairs the experts check runs for.
EXPERTS = [("qwen3-30b-a3b", 2), ("qwen3-235b-a22b", 4)]


@pytest.fixture(scope="module")
def experts_built(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict[str, Any]]:
    """vLLM's experts and prewarm's dispatcher for each of :data:`EXPERTS`, one after the other in
    one vLLM process (a vLLM + flashinfer import is most of a child's ~15 s; the driver gives
    flashinfer's wrapper class back after each model, so nothing of one reaches the next)."""
    argv = [a for model, tp in EXPERTS for a in (model, str(tp), "8192")]
    out = _child(vllm_python, "experts", *argv, cwd=tmp_path_factory.mktemp("experts"))
    assert isinstance(out, list) and len(out) == len(EXPERTS), out
    return dict(zip(EXPERTS, out, strict=True))


@pytest.mark.parametrize("model, tp", EXPERTS)
def test_vllm_b12x_experts_build_the_wrapper_prewarm_builds(experts_built: dict[tuple[str, int], dict[str, Any]],
                                                            model: str, tp: int) -> None:
    """vLLM's own experts class and config build a wrapper identical to prewarm's for that model."""
    out = experts_built[(model, tp)]
    (call,) = out["vllm_passed"]
    assert call["args"] == [] and set(call["kwargs"]) == set(WRAPPER_CALL)
    assert call["kwargs"]["use_cuda_graph"] is True
    assert call["kwargs"]["max_num_tokens"] == 8192  # FusedMoEConfig.max_num_tokens, unchanged
    shape = models.moe_shape(model, tp=tp)
    assert call["kwargs"]["intermediate_size"] == shape.intermediate_size == out["vllm_moe_config"]["intermediate_size_per_partition"]
    assert {k: out["prewarm_passed"][k] for k in call["kwargs"] if k != "num_local_experts"} == \
        {k: v for k, v in call["kwargs"].items() if k != "num_local_experts"}
    # Every scalar flashinfer derived (defaults, quant mode, swiglu, local experts) is the same.
    assert out["vllm_wrapper"] == out["prewarm_wrapper"]


# --------------------------------------------------------------------------------------------
# The installed vLLM source: how FlashInferB12xExperts gets its arguments
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_source(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = subprocess.run([str(vllm_python), "-c", "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path_factory.mktemp("cwd"))
    return Path(out.stdout.strip())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _assignments(fn: ast.AST) -> dict[str, str]:
    return {ast.unparse(t): ast.unparse(n.value) for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets}


def test_vllm_source_builds_b12x_wrapper_as_prewarm_assumes(vllm_source: Path) -> None:
    tree = ast.parse((vllm_source / "model_executor/layers/fused_moe/experts/flashinfer_b12x_moe.py").read_text())
    experts = _class(tree, "FlashInferB12xExperts")
    calls = [n for n in ast.walk(_method(experts, "_ensure_wrapper"))
             if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("B12xMoEWrapper")]
    assert len(calls) == 1 and not calls[0].args
    assert {k.arg: ast.unparse(k.value) for k in calls[0].keywords} == WRAPPER_CALL
    init = _assignments(_method(experts, "__init__"))
    assert {attr: init.get(attr) for attr in FROM_MOE_CONFIG} == FROM_MOE_CONFIG
    activation_map = next(n for n in experts.body if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "_ACTIVATION_MAP")
    assert isinstance(activation_map.value, ast.Dict)
    assert {ast.literal_eval(v) for v in activation_map.value.values} <= PREWARM_ACTIVATIONS


def test_vllm_sizes_the_wrapper_from_max_num_batched_tokens_and_splits_by_tp(vllm_source: Path) -> None:
    layer = ast.parse((vllm_source / "model_executor/layers/fused_moe/layer.py").read_text())
    enclosing: dict[ast.Call, ast.FunctionDef] = {}
    for fn in ast.walk(layer):  # outer functions first: the innermost one wins
        if isinstance(fn, ast.FunctionDef):
            enclosing.update((n, fn) for n in ast.walk(fn) if isinstance(n, ast.Call) and "FusedMoEConfig" in ast.unparse(n.func))
    assert enclosing, "layer.py builds no FusedMoEConfig"
    found = []
    for call, fn in enclosing.items():
        keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
        if "max_num_tokens" in keywords:
            found.append((keywords["max_num_tokens"], _assignments(fn).get(keywords["max_num_tokens"])))
    assert found == [("max_num_batched_tokens", "vllm_config.scheduler_config.max_num_batched_tokens")], found
    config = ast.parse((vllm_source / "model_executor/layers/fused_moe/config.py").read_text())
    post_init = _assignments(_method(_class(config, "FusedMoEConfig"), "__post_init__"))
    assert post_init["tp_size"] == "self.moe_parallel_config.tp_size"
    assert post_init["self.intermediate_size_per_partition"] == "self.intermediate_size // tp_size"


def test_a_tp2_engine_says_one_attach_line_and_one_summary_with_totals(vllm_python: Path, tmp_path: Path) -> None:
    """Two ranks on one node (issue 28, item 4): the attach line once, naming the ranks; the exit
    summary once, adding up both ranks' hits and compiles; each rank's own lines at DEBUG."""
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env["CUTE_DISKCACHE_DIR"] = str(tmp_path / "root")
    said = []
    for _ in ("cold", "warm"):
        proc = subprocess.run([str(vllm_python), str(DRIVER), "tp", "2"], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0 and json.loads(proc.stdout.strip().splitlines()[-1]) == {"exitcodes": [0, 0]}, proc.stderr[-5000:]
        said.append([ln for ln in proc.stderr.splitlines() if ln.startswith("[cute-diskcache] INFO")])
    cold, warm = said
    for lines in said:
        attach = [ln for ln in lines if " attached: " in ln]
        assert len(attach) == 1 and "; 2 ranks on this node (rank 0 of 2 says this)" in attach[0], lines
        assert not [ln for ln in lines if " this process: " in ln], lines
    (cold_summary,) = [ln for ln in cold if " this engine (" in ln]
    # the ranks ask for the same kernel: one compiles it, the other loads it (after waiting for the
    # compile, or after it, as the two processes happen to run)
    assert cold_summary.startswith("[cute-diskcache] INFO this engine (2 ranks on this node): 1 hit, "), cold
    assert "; 1 miss, 1 compiled in " in cold_summary, cold_summary
    (warm_summary,) = [ln for ln in warm if " this engine (" in ln]
    assert warm_summary.startswith("[cute-diskcache] INFO this engine (2 ranks on this node): 2 hits, "), warm
    assert " miss" not in warm_summary, warm_summary
