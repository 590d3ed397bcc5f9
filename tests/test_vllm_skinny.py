"""vLLM's own CuTe-DSL kernel on sm12x, its skinny GEMM (issue 44 item 5): planned from a config,
compiled offline with vLLM's code, gated by ``check``, and served to vLLM's own warm-up.

vLLM 0.34 hands an unquantized, bias-free BF16 layer to ``ShapeDynamicSkinnyGemm`` where its card's
capability has a plan for the layer's per-rank weight shape (only (12, 1), DGX Spark), and its
warm-up compiles every configuration of those plans at each start. The slow tests run real vLLM
0.34.0 in the compat venv (``scripts/compat_matrix.py``, with this checkout on ``PYTHONPATH``):
``tests/vllm_skinny_driver.py`` drives vLLM's own ``_warmup_skinny_gemm`` and ``cutedsl_warmup``,
with vLLM's ``maybe_use_skinny_gemm`` marking the layers, so a vLLM that changes its plans, its
marking or its compile's arguments fails here. Prewarm writes the Spark's kernels with x86_64 host
code (``--host-machine x86_64``) so that the driver, on this x86 box, can load them; the aarch64
namespace a Spark reads is ``check``'s and ``tests/test_b12x.py``'s subject.
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

from cute_diskcache.prewarm import models

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _compat, whatever pytest's import mode
from _compat import REPO, SCRATCH, matrix
from conftest import split_stderr

DRIVER = Path(__file__).resolve().parent / "vllm_skinny_driver.py"
MODEL = "qwen3-30b-a3b-bf16"
#: Qwen3-30B-A3B's attention output at TP 1, by hand from its public config: 32 heads of 128 in, hidden 2048 out.
O_PROJ = (2048, 32 * 128)
SPARK = ("--target", "dgx-spark", "--host-machine", "x86_64")
_DROPPED_ENV = re.compile(r"^(CUTE_DISKCACHE_.*|FLASHINFER_B12X_DISK_CACHE|CUTE_DSL_ARCH|FLASHINFER_WORKSPACE_.*|PYTHONPATH)$")


def test_the_layers_vllm_may_hand_its_skinny_gemm() -> None:
    """Unquantized, bias-free layers, per rank, unpadded: a BF16 checkpoint's every linear, its
    router (replicated) and LM head (vocabulary padded to 64, split over the ranks); an NVFP4
    checkpoint's only those it leaves in BF16; a model with attention biases loses those layers."""
    layers, notes = models.unquantized_linears(MODEL)
    assert {(lin.name, lin.n, lin.k) for lin in layers} == {
        ("qkv_proj", (32 + 2 * 4) * 128, 2048), ("o_proj", *O_PROJ), ("router", 128, 2048), ("lm_head", 151936, 2048)}, layers
    assert notes == ()
    half = {lin.name: (lin.n, lin.k) for lin in models.unquantized_linears(MODEL, tp=2)[0]}
    assert half == {"qkv_proj": ((16 + 2 * 2) * 128, 2048), "o_proj": (2048, 2048), "router": (128, 2048), "lm_head": (75968, 2048)}
    nvfp4, notes = models.unquantized_linears("qwen3-30b-a3b")  # ModelOpt keeps the router and lm_head in BF16
    assert [lin.name for lin in nvfp4] == ["router"] and "LM head" in notes[0], (nvfp4, notes)
    assert models.unquantized_linears("llama-3.1-8b-nvfp4")[0] == ()


def test_the_layers_with_a_bias_are_not_candidates(tmp_path: Path) -> None:
    cfg = json.loads((Path(models.__file__).parent / "model_configs" / f"{MODEL}.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    layers, notes = models.unquantized_linears(str(tmp_path))
    assert [lin.name for lin in layers] == ["router", "lm_head"], layers
    assert notes == ("qkv_proj has a bias (not a skinny GEMM)", "o_proj has a bias (not a skinny GEMM)")


def test_without_vllm_a_bf16_checkpoint_is_refused_as_before(tmp_path: Path) -> None:
    """vLLM not in this interpreter: nothing of its group is planned, and flashinfer's refusal of a
    BF16 checkpoint stands (exit 2, its words)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this interpreter")
    proc = subprocess.run([sys.executable, "-m", "cute_diskcache.prewarm", MODEL, "--target", "dgx-spark", "--dry-run"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CUTE_DISKCACHE_DIR": str(tmp_path / "root")})
    assert proc.returncode == 2 and "flashinfer's sm12x fused-MoE kernels run NVFP4" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return matrix().vllm_venv(SCRATCH)


def _env(root: Path, hook_dir: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env["CUTE_DISKCACHE_DIR"] = str(root)
    env["PYTHONPATH"] = os.pathsep.join([*([str(hook_dir)] if hook_dir else []), str(REPO)])
    return env


def _prewarm(python: Path, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "cute_diskcache.prewarm", MODEL, *args], env=_env(root), cwd=root.parent,
                          capture_output=True, text=True, timeout=600)


def _check(python: Path, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "cute_diskcache", "--root", str(root), "check", MODEL, *args], env=_env(root),
                          cwd=root.parent, capture_output=True, text=True, timeout=600)


def _warmup(python: Path, root: Path, hook_dir: Path, *shapes: tuple[int, int]) -> dict[str, Any]:
    proc = subprocess.run([str(python), str(DRIVER), *(f"{n}x{k}" for n, k in shapes)], env=_env(root, hook_dir), cwd=root.parent,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "real_compiles": split_stderr(proc.stderr)[2]}


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CUTE_DISKCACHE_VLLM") == "off", reason="CUTE_DISKCACHE_VLLM=off: vLLM tests skipped")
def test_the_plan_is_the_cards_plans_for_the_models_shapes(vllm_python: Path, tmp_path: Path) -> None:
    """On a Spark at TP 1 the attention output's (2048, 4096) has a plan of three configurations
    (token counts 1, 2, 4); at TP 2 its shape has none, and an RTX PRO 6000 (12, 0) has no table:
    nothing to plan, so flashinfer's refusal of the BF16 checkpoint stands."""
    root = tmp_path / "root"
    dry = _prewarm(vllm_python, root, *SPARK, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr[-3000:]
    group = json.loads(dry.stdout)["vllm_skinny_gemm"]
    assert group["capability"] == [12, 1] and group["layers"] == [{"name": "o_proj", "n": O_PROJ[0], "k": O_PROJ[1]}], group
    assert sorted(r["config"]["num_rows"] for r in group["job_list"]) == [1, 2, 4], group["job_list"]
    assert all(r["status"] == "planned" and len(r["digests"]) == 1 for r in group["job_list"]), group["job_list"]
    assert not root.exists() or not list(root.rglob("manifest*")), "a dry run writes nothing"
    for other in (("--tp", "2", *SPARK), ("--target", "rtx-pro-6000")):
        refused = _prewarm(vllm_python, root, *other, "--dry-run")
        assert refused.returncode == 2 and "fused-MoE kernels run NVFP4" in refused.stderr, (other, refused.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CUTE_DISKCACHE_VLLM") == "off", reason="CUTE_DISKCACHE_VLLM=off: vLLM tests skipped")
def test_the_group_joins_flashinfers_plan_of_an_nvfp4_model(vllm_python: Path, tmp_path: Path) -> None:
    """An NVFP4 dense model whose BF16 LM head has a plan (Llama-3.1-8B's layers with a 154,880-token
    vocabulary: 77,440 x 4,096 per rank at TP 2, the table's LM head): flashinfer's dense kernels and
    the skinny GEMM's three configurations in one plan, both in the JSON and the table."""
    cfg = json.loads((Path(models.__file__).parent / "model_configs" / "llama-3.1-8b-nvfp4.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 154880}))
    root = tmp_path / "root"
    dry = subprocess.run([str(vllm_python), "-m", "cute_diskcache.prewarm", str(tmp_path), "--tp", "2", *SPARK, "--dry-run", "--json"],
                         env=_env(root), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert dry.returncode == 0, dry.stderr[-3000:]
    plan = json.loads(dry.stdout)
    assert plan["dense_layers"] is not None and plan["by_kind"], plan.keys()
    group = plan["vllm_skinny_gemm"]
    assert group["layers"] == [{"name": "lm_head", "n": 77440, "k": 4096}] and group["configs"] == 3, group


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CUTE_DISKCACHE_VLLM") == "off", reason="CUTE_DISKCACHE_VLLM=off: vLLM tests skipped")
def test_after_prewarm_vllms_own_warmup_compiles_nothing(vllm_python: Path, compile_hook_dir: Path, tmp_path: Path) -> None:
    """Prewarm, then ``check`` exits 0, then vLLM's own warm-up in a fresh process makes 0 DSL
    compiles (the independent counter) and our cache serves its 3 units; on an empty root the
    same warm-up compiles all 3 (so this can fail), and ``check`` there exits 1 naming the fix."""
    root, empty = tmp_path / "root", tmp_path / "empty"
    empty.mkdir()
    assert _check(vllm_python, empty, *SPARK).returncode == 1
    cold = _warmup(vllm_python, empty, compile_hook_dir, O_PROJ, (5120, 2048))
    assert cold["units"] == 3 and cold["marked"] == 1 and cold["counters"]["compiles"] == 3 and cold["real_compiles"] == 3, cold

    done = _prewarm(vllm_python, root, *SPARK, "--json", "--jobs", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    group = json.loads(done.stdout)["vllm_skinny_gemm"]
    assert group["kernels_compiled"] == 3 and group["errors"] == 0, group
    manifests = list(root.rglob("manifest.msgpack"))
    assert len(manifests) == 3 and all("vllm-0.34.0-sm_121a-x86_64-" in m.parent.parent.parent.name for m in manifests), manifests
    gate = _check(vllm_python, root, *SPARK)
    assert gate.returncode == 0 and "3 kernels" in gate.stdout, gate.stdout + gate.stderr[-2000:]

    warm = _warmup(vllm_python, root, compile_hook_dir, O_PROJ, (5120, 2048))
    assert warm["units"] == 3 and warm["counters"]["hits"] == 3, warm
    assert warm["counters"]["compiles"] == 0 and warm["real_compiles"] == 0, warm

    again = _prewarm(vllm_python, root, *SPARK, "--json")
    assert [r["status"] for r in json.loads(again.stdout)["vllm_skinny_gemm"]["job_list"]] == ["cached"] * 3, again.stdout[-2000:]


def _fake_vllm(root: Path, with_table: bool = True) -> Path:
    """A vLLM-shaped tree: the skinny GEMM's compile site, its plan table, and one other site."""
    pkg = root / "vllm"
    linear = pkg / "model_executor" / "kernels" / "linear" / "cute_dsl"
    linear.mkdir(parents=True)
    (linear / "skinny_gemm.py").write_text(
        "import cutlass.cute as cute\n\nclass SkinnyGemmConfig:\n    pass\n\nclass ShapeDynamicSkinnyGemm:\n"
        "    def _compile(self, dtype, config, has_residual):\n        self.k = cute.compile(object())\n")
    (linear / "skinny_gemm_plans.py").write_text("SKINNY_GEMM_PLANS_BY_CAPABILITY = {}\n" if with_table else "PLANS = {}\n")
    (pkg / "model_executor" / "other.py").write_text("import cutlass.cute as cute\n\ndef build():\n    return cute.compile[1](object())\n")
    return pkg


@pytest.mark.parametrize("with_table", [True, False])
def test_doctor_names_vllms_sites_who_keeps_them_and_what_prewarm_plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       with_table: bool) -> None:
    """Read from the source, never imported: the skinny GEMM's site is ours and planned for a Spark,
    any other site vLLM's; a vLLM without the plan table (older than 0.34) is said to be unplannable."""
    from cute_diskcache.core import sitescan
    from cute_diskcache.vllm_sites import scan

    sitescan.functions.cache_clear()
    monkeypatch.setattr(scan.adapter, "package_dir", lambda: str(_fake_vllm(tmp_path, with_table)))
    monkeypatch.setattr(scan.adapter, "version", lambda: "0.34.0")
    rep = scan.report()
    assert {(s["function"], s["status"], s["planned"]) for s in rep["sites"]} == {
        ("ShapeDynamicSkinnyGemm._compile", scan.OURS, "--target dgx-spark (vLLM's (12, 1) skinny GEMM plans)"), ("build", scan.VLLMS, "")}
    assert rep["missing_adapter_sites"] == [] and not scan.strict_failure(rep)
    gap = "model_executor/kernels/linear/cute_dsl/skinny_gemm_plans.py:SKINNY_GEMM_PLANS_BY_CAPABILITY"
    assert rep["planning_gap"] == ([] if with_table else [gap])
    text = "\n".join(scan.render(rep, show_all=True))
    assert "vllm compile sites: 2  cute-diskcache 1  vllm 1" in text and ("prewarm plans nothing" in text) is not with_table, text


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CUTE_DISKCACHE_VLLM") == "off", reason="CUTE_DISKCACHE_VLLM=off: vLLM tests skipped")
def test_vllm_0_34_has_the_row_and_the_planning_api(vllm_python: Path) -> None:
    """vLLM 0.34.0's own source (read, not imported): the row's function calls ``cute.compile``, and
    the plan table and classes planning reads are there."""
    from cute_diskcache.vllm_sites import scan, sites

    out = subprocess.run([str(vllm_python), "-c", "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"],
                         capture_output=True, text=True, timeout=120, check=True)
    root = Path(out.stdout.strip())
    found = scan.scan(root)
    assert {"file": sites.SKINNY_FILE, "function": sites.SKINNY_FUNCTION} in found
    assert scan.planning_gap(root) == []


@pytest.mark.parametrize(("native", "rows"), [("", 1), ("vllm", 0), ("b12x,vllm", 0), ("sglang", 1)])
def test_native_sites_naming_vllm_leaves_its_kernels_to_it(tmp_path: Path, native: str, rows: int) -> None:
    """``CUTE_DISKCACHE_NATIVE_SITES=vllm`` (alone or in a list): vLLM's table is empty, so its skinny
    GEMM compiles as vLLM alone would; read as an engine reads it, at the adapter's import."""
    code = "from cute_diskcache.vllm_sites import adapter; print(len(adapter.ADAPTER.by_where), adapter.left_to_vllm())"
    env = {**os.environ, "CUTE_DISKCACHE_NATIVE_SITES": native}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.split() == [str(rows), str(rows == 0)], out.stdout + out.stderr
    assert "ignoring CUTE_DISKCACHE_NATIVE_SITES" not in out.stderr, out.stderr
