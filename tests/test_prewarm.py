"""Prewarm end to end: real flashinfer 0.6.15.post1 and the real DSL on the CPU, rtx-pro-6000 profile.

What a prewarm promises: the keys it compiles are exactly the keys serving asks for, so an engine
that starts after it compiles nothing. These tests check that promise with the real dispatch
path in fresh processes, plus the refusals an operator must be able to read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TARGET = "rtx-pro-6000"


def prewarm(root: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    child = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k not in ("FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH")}
    child["CUTE_DISKCACHE_DIR"] = str(root)
    child.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "cute_diskcache.prewarm", *args],
        env=child, capture_output=True, text=True, timeout=timeout, cwd=root.parent,
    )


def summary(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def digests(root: Path) -> dict[str, bytes]:
    """digest -> object bytes of every committed entry."""
    out = {}
    for manifest in root.glob("v1/*/*/*/manifest.msgpack"):
        (obj,) = manifest.parent.glob("object-*.o")
        out[manifest.parent.name] = obj.read_bytes()
    return out


def test_dry_run_lists_the_three_kinds(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = summary(prewarm(root, "--model", "qwen3-30b-a3b", "--target", TARGET, "--max-num-tokens", "160", "--dry-run", "--json",
                          "--no-dense"))
    kinds = out["by_kind"]
    # flashinfer 0.6.15.post1, E128 top-8 k2048 n768: m 1-5 micro (one each), 6-80 static (one
    # each), > 80 one dynamic kernel. "Plausible" bounds so a flashinfer tweak reads as a diff.
    assert 1 <= kinds.get("micro", 0) <= 8, kinds
    assert 40 <= kinds.get("static", 0) <= 120, kinds
    assert kinds.get("dynamic", 0) == 1, kinds
    assert out["kernels"] == sum(kinds.values())
    assert out["compiled"] == 0
    assert not list(root.glob("v1/*/*/*/manifest.msgpack")), "a dry run writes no entry"
    first_ms = sorted(k["ms"][0] for k in out["kernel_list"])
    assert first_ms[0] == 1 and len(set(first_ms)) == len(first_ms), "each kernel is first needed at its own m"


#: The prewarm the two tests below read: three kernels of qwen3-30b-a3b (micro m 1 and 2, static m 7).
SERVED = ("--model", "qwen3-30b-a3b", "--target", TARGET, "--max-num-tokens", "4096", "--m", "1,2,7", "--json", "--no-dense")


@pytest.fixture(scope="module")
def prewarmed_by_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One cold prewarm by two workers, once per module: what serving reads and what one worker's
    prewarm is compared with. Read it, never change it (copy it)."""
    root = tmp_path_factory.mktemp("prewarm-two-jobs") / "root"
    out = summary(prewarm(root, *SERVED, "--jobs", "2"))
    assert out["failed"] == 0 and out["compiled"] == out["kernels"] == 3, out
    assert out["bytes"] > 0
    return root, out


def test_prewarm_then_serving_compiles_nothing(prewarmed_by_two: tuple[Path, dict[str, Any]], tmp_path: Path, probe: Any) -> None:
    root = tmp_path / "root"
    shutil.copytree(prewarmed_by_two[0], root)
    ms = [1, 2, 7]
    # A fresh "engine": flashinfer's real dispatch for exactly those m, as the probe runs it
    # (same wrapper configuration: use_cuda_graph=True, max_num_tokens=4096).
    served = probe(root, *ms)
    assert served["real_compiles"] == 0, served["stderr"][-2000:]
    assert served["counters"]["compiles"] == 0 and served["counters"]["hits"] == 3
    # A second prewarm finds everything cached and compiles nothing.
    again = summary(prewarm(root, *SERVED))
    assert again["already_cached"] == 3 and again["compiled"] == 0


def test_jobs_do_not_change_the_entries(prewarmed_by_two: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """One worker compiles the kernels the module's two-worker prewarm compiled, into a root of its own."""
    one = tmp_path / "one" / "root"
    one.parent.mkdir()
    a = summary(prewarm(one, *SERVED, "--jobs", "1"))
    assert a["compiled"] == prewarmed_by_two[1]["compiled"] == 3
    da, db = digests(one), digests(prewarmed_by_two[0])
    assert set(da) == set(db) and len(da) == 3
    assert da == db, "the same kernels, byte for byte, however many workers compiled them"


def test_unservable_checkpoint_is_refused_with_a_reason(tmp_path: Path) -> None:
    proc = prewarm(tmp_path / "root", "--model", "qwen3-30b-a3b-bf16", "--target", TARGET, "--dry-run")
    assert proc.returncode == 2
    assert "NVFP4" in proc.stderr and "bfloat16" in proc.stderr


def test_expert_parallel_refusal_comes_from_flashinfer(tmp_path: Path) -> None:
    proc = prewarm(tmp_path / "root", "--model", "qwen3-30b-a3b", "--ep", "2", "--target", TARGET, "--max-num-tokens", "64", "--dry-run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Expert Parallelism" in proc.stderr  # flashinfer 0.6.15's own words


def test_missing_field_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "model"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"},
    }))
    proc = prewarm(tmp_path / "root", "--model", str(cfg), "--target", TARGET, "--dry-run")
    assert proc.returncode == 2
    assert "hidden_size" in proc.stderr


def test_hf_repo_id_resolves_from_the_local_cache_offline(tmp_path: Path) -> None:
    from cute_diskcache.prewarm import models

    bundled = json.loads((Path(models.__file__).parent / "model_configs" / "qwen3-30b-a3b.json").read_text())
    hub = tmp_path / "hub"
    snap = hub / "models--acme--moe-nvfp4" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(bundled))
    (hub / "models--acme--moe-nvfp4" / "refs").mkdir()
    (hub / "models--acme--moe-nvfp4" / "refs" / "main").write_text("0" * 40)
    code = (
        "from cute_diskcache.prewarm import models; import json; "
        "print(json.dumps(models.moe_shape('acme/moe-nvfp4', tp=2).as_dict()))"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shape = json.loads(proc.stdout)
    assert shape["model"] == "hf:acme/moe-nvfp4"
    assert (shape["num_experts"], shape["top_k"], shape["hidden_size"], shape["intermediate_size"]) == (128, 8, 2048, 384)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("qwen3-30b-a3b", (128, 8, 2048, 768, "silu", None)),
        ("gpt-oss-120b", (128, 4, 2880, 2880, "swigluoai_uninterleave", 7.0)),
    ],
)
def test_bundled_shapes(name: str, expected: tuple[Any, ...]) -> None:
    from cute_diskcache.prewarm import models

    s = models.moe_shape(name)
    assert (s.num_experts, s.top_k, s.hidden_size, s.intermediate_size, s.activation, s.swiglu_limit) == expected
    assert s.quant_mode == "nvfp4"


def test_parse_ms() -> None:
    from cute_diskcache.prewarm import parse_ms

    assert parse_ms("1-3,8,5,2") == [1, 2, 3, 5, 8]
    with pytest.raises(Exception):
        parse_ms("4-2")


def test_dense_layers_are_planned_apart_from_the_moe_kernels(tmp_path: Path) -> None:
    """0.6.15.post1 has the b12x dense GEMM too: qwen3-30b-a3b's attention projections plan b12x
    kernels, reported apart; a config without attention fields plans its MoE kernels and says why
    its dense layers were not planned."""
    out = summary(prewarm(tmp_path / "root", "--model", "qwen3-30b-a3b", "--target", TARGET, "--max-num-tokens", "64",
                          "--m", "1,2", "--dry-run", "--json"))
    assert out["groups"]["moe"]["kernels"] == 2 and out["groups"]["dense"]["kernels"] > 0, out["groups"]
    assert set(out["groups"]["dense"]["by_kind"]) == {"b12x_fp4"}
    assert [lin["name"] for lin in out["dense_layers"]["linears"]] == ["qkv_proj", "o_proj"]
    cfg = tmp_path / "model"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "hidden_size": 2048, "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"},
    }))
    moe_only = summary(prewarm(tmp_path / "root", "--model", str(cfg), "--target", TARGET, "--max-num-tokens", "64",
                               "--m", "1", "--dry-run", "--json"))
    assert moe_only["groups"]["dense"]["kernels"] == 0 and "num_attention_heads" in moe_only["notes"][0]


@pytest.mark.parametrize("name, tp, expected", [
    ("llama-3.1-8b-nvfp4", 1, [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096), ("down_proj", 4096, 14336)]),
    ("llama-3.1-8b-nvfp4", 8, [("qkv_proj", 768, 4096), ("o_proj", 4096, 512), ("gate_up_proj", 3584, 4096), ("down_proj", 4096, 1792)]),
    # 4 KV heads over 8 ranks: each rank holds one (replicated), as vLLM shards them
    ("qwen3-30b-a3b", 8, [("qkv_proj", 768, 2048), ("o_proj", 2048, 512)]),
])
def test_dense_shapes_per_rank(name: str, tp: int, expected: list[tuple[str, int, int]]) -> None:
    from cute_diskcache.prewarm import models

    shape = models.dense_shape(name, tp=tp)
    assert [(lin.name, lin.n, lin.k) for lin in shape.linears] == expected
    assert shape.out_dtype == "bfloat16" and shape.quant_mode == "nvfp4"


def test_dense_shapes_pad_to_32_and_skip_what_the_checkpoint_excludes(tmp_path: Path) -> None:
    from cute_diskcache.prewarm import models

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 1000, "intermediate_size": 3000, "num_attention_heads": 10,
        "num_key_value_heads": 2, "head_dim": 100, "torch_dtype": "float16",
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["lm_head", "*.self_attn.o_proj"]},
    }))
    shape = models.dense_shape(str(cfg))
    assert [(lin.name, lin.n, lin.k) for lin in shape.linears] == [
        ("qkv_proj", 1408, 1024), ("gate_up_proj", 6016, 1024), ("down_proj", 1024, 3008)]
    assert shape.out_dtype == "float16" and "o_proj" in shape.notes[0]
    with pytest.raises(models.UnsupportedModelError, match="NVFP4"):
        models.dense_shape("qwen3-30b-a3b-bf16")
