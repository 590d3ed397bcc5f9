"""flashinfer 0.7.4's sm12x kernels outside the MoE package, for real, in fresh child processes.

* The b12x dense GEMMs (``mm_fp4``/``mm_mxfp8`` with ``backend="b12x"``), which flashinfer
  compiles in memory only, and the SM12x CuTe FP4 GEMM, which flashinfer caches natively keyed
  on torch's build: a cold process compiles each once into our cache, a fresh one compiles
  nothing (counted independently by conftest's ``sitecustomize``) and its kernels take
  flashinfer's arguments as the compiled ones did.
* Dense prewarm: ``prewarm`` of qwen3-30b-a3b (MoE + attention) and of the bundled dense
  llama-3.1-8b-nvfp4, then an "engine" child serving the same batch sizes the way vLLM 0.34 does
  (``tests/fi074_dense_driver.py --engine``, written independently of prewarm): zero compiles.
* ``doctor`` on the real 0.7.4: every sm12x site and who persists it.
* vLLM 0.34's own source still calls flashinfer the way the dense planning assumes.

Same interpreter and conventions as tests/test_flashinfer_074.py (``CUTE_DISKCACHE_FI074_PYTHON``,
``rtx-pro-6000`` profile). About two and a half minutes on two cores.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_flashinfer_074 import FI074, OPT_OUT, TARGET, Child, _by_site as by_site, _json_report, _manifests, _native_objects, _run, doctor_074, fi074  # noqa: E402,F401

pytestmark = [
    pytest.mark.skipif(FI074 == "off", reason="CUTE_DISKCACHE_FI074_PYTHON=off: flashinfer 0.7.4 tests skipped"),
    pytest.mark.slow,
]
DRIVER = Path(__file__).resolve().parent / "fi074_dense_driver.py"
SITES = {"b12x_fp4": "flashinfer.gemm.b12x_fp4", "b12x_mxfp8": "flashinfer.gemm.b12x_mxfp8",
         "sm12x_cute": "flashinfer.native.sm12x_cute", "fmha_ragged": "flashinfer.native.fmha_sm120_ragged",
         "fmha_paged": "flashinfer.native.fmha_sm120_paged", "bf16_fp4_gemm": "flashinfer.gemm.bf16_fp4_gemm",
         "bf16_fp4_gemv": "flashinfer.gemm.bf16_fp4_gemv", "msa_topk": "flashinfer.msa.msa_topk",
         "msa_combine": "flashinfer.msa.msa_combine", "msa_union": "flashinfer.msa.msa_union",
         "msa_decode": "flashinfer.msa.msa_sparse_decode", "msa_proxy": "flashinfer.msa.msa_proxy_score",
         "msa_proxy_fp4": "flashinfer.msa.msa_proxy_score_fp4", "msa_prefill": "flashinfer.msa.msa_sparse_prefill",
         "gdn_prefill": "flashinfer.gdn.gdn_delta_rule"}
NATIVE = ("sm12x_cute", "fmha_ragged", "fmha_paged")
B12X = ("b12x_fp4", "b12x_mxfp8")
BF16_FP4 = ("bf16_fp4_gemm", "bf16_fp4_gemv")
MSA = ("msa_topk", "msa_combine", "msa_union")
INLINE = ("msa_decode", "msa_proxy", "msa_proxy_fp4", "msa_prefill")  # compiled inside MSA's public ops (flashinfer_sites/sites.py)


def drive(child: Child, *sites: str, args: tuple[str, ...] = ()) -> dict[str, Any]:
    cmd = [str(FI074), str(DRIVER), "--target", TARGET, *args, *sites]
    return _json_report(_run(cmd, child.env(), child.hook_dir))


@pytest.fixture(scope="module")
def shared(fi074: str, tmp_path_factory: pytest.TempPathFactory, compile_hook_dir: Path) -> dict[str, Any]:  # noqa: F811
    base = tmp_path_factory.mktemp("fi074-dense")
    child = Child(base / "root", base / "workspace", compile_hook_dir)
    cold = drive(child, *SITES)
    warm = drive(child, *SITES)
    return {"child": child, "cold": cold, "warm": warm}


def test_each_site_compiles_once_cold_and_nothing_in_a_fresh_process(shared: dict[str, Any]) -> None:
    cold, warm = shared["cold"], shared["warm"]
    assert by_site(cold) == {site: ["miss"] for site in SITES.values()}, cold["events"]
    assert cold["real_compiles"] == len(SITES) and cold["counters"]["writes"] == len(SITES)
    assert by_site(warm) == {site: ["hit"] for site in SITES.values()}, warm["events"]
    assert warm["real_compiles"] == 0 and warm["counters"]["compiles"] == 0, warm["stderr"][-3000:]
    # flashinfer's own cache was neither read nor written for its natively cached sm12x kernels.
    assert not [p for p in shared["child"].workspace.rglob("cached_ops/*/*") if p.is_file()]


def test_warm_kernels_take_flashinfers_arguments_like_the_compiled_ones(shared: dict[str, Any]) -> None:
    """flashinfer calls the b12x kernel without its three optional trailing arguments; a kernel
    loaded from disk is positional-only unless we give it the compiled one's calling convention.
    Without a GPU the launch fails in the kernel's argument check, after binding: the same error
    cold and warm says the loaded kernel accepted the call as the compiled one did."""
    cold, warm = shared["cold"]["sites"], shared["warm"]["sites"]
    for name in B12X + BF16_FP4 + INLINE:
        assert "expected device_type=cuda" in cold[name]["error"], cold[name]["error"]
        assert warm[name]["error"] == cold[name]["error"], (name, warm[name]["error"])
    # GDN's prefill checks the PTX of what it compiled before launching: a hit must hand it the
    # compiled kernel's PTX, or flashinfer raises "Unable to inspect generated PTX" instead.
    assert "cudaErrorInsufficientDriver" in cold["gdn_prefill"]["error"], cold["gdn_prefill"]["error"]
    assert warm["gdn_prefill"]["error"] == cold["gdn_prefill"]["error"], warm["gdn_prefill"]["error"]
    for name in NATIVE + MSA:  # compile only, no launch
        assert cold[name]["error"] is None and warm[name]["error"] is None, (cold[name], warm[name])


_SITE_FILES = {
    "b12x_fp4": "gemm/gemm_base.py:_b12x_gemm_fp4_runner.B12xFp4GemmRunner.forward",
    "b12x_mxfp8": "gemm/gemm_mm_mxfp8_cute_dsl.py:_b12x_gemm_mxfp8_runner.B12xMxfp8GemmRunner.forward",
}


def test_b12x_key_is_what_the_compile_receives(shared: dict[str, Any]) -> None:
    """The b12x GEMMs compile in flashinfer's shared block-scaled helper; the key names the b12x
    runner above it (issue 22: no hand-written key), then what the compile received: the kernel
    object's state and its ``wrapper``, the scale extents ``sf_m/sf_n/sf_k`` by type only (the
    wrapper declares them DSL integers: runtime arguments), ``max_active_clusters`` by value (a
    ``Constexpr``: 188 on the rtx-pro-6000 profile), the scale pointers without their address."""
    manifests = _manifests(shared["child"].root)
    for name in B12X:
        m = manifests[SITES[name]]
        assert m["namespace"].startswith("flashinfer-gemm-0.7.4-sm_120a-"), m["namespace"]
        key = m["key_repr"]
        assert key.startswith(f"('compile', '{_SITE_FILES[name]}', '_make_blockscaled_gemm_compile_fn.<locals>.compile_kernel', "
                              "('args', (('method', ('object', 'flashinfer.gemm.kernels.dense_blockscaled_gemm_sm120_b12x."), key[:400]
        assert "'DenseGemmKernel.wrapper'" in key and "('dynamic', 'int'), ('dynamic', 'int'), ('dynamic', 'int'), 1, " in key, key
        assert "False), 188, (" in key and "('pointer', 'cutlass.cute.runtime._Pointer', " in key, key
        assert m["extra"]["calling_convention"]["arg_defaults"] == [None, None, None], m["extra"]
    for name in NATIVE:
        native = manifests[SITES[name]]
        assert native["key_repr"].startswith("('compile', ") and "torch" not in json.dumps(native["env"]), native["key_repr"]
    ragged = manifests[SITES["fmha_ragged"]]["key_repr"]
    assert ragged.startswith("('compile', 'cute_dsl/attention/fmha/sm120/compile.py:compile_sm120_fmha_fp8_ragged_kernel', "), ragged
    assert "SM120FusedMultiHeadAttentionFP8ForwardTMA" in ragged, ragged


def test_getter_keys_are_what_their_compile_receives(shared: dict[str, Any]) -> None:
    """The BF16 x FP4 getters and MSA's: the kernel object the getter built from its arguments
    (its class and state) and the compile's arguments, including, for the GEMM, the device answer
    it passes (``get_max_active_clusters(1)``: 188 on the rtx-pro-6000 profile); the GEMV passes none."""
    manifests = _manifests(shared["child"].root)
    gemm, gemv = manifests[SITES["bf16_fp4_gemm"]], manifests[SITES["bf16_fp4_gemv"]]
    assert gemm["namespace"].startswith("flashinfer-gemm-0.7.4-sm_120a-"), gemm["namespace"]
    assert gemm["key_repr"].startswith("('compile', 'gemm/gemm_bf16_fp4_cute_dsl.py:_get_cute_dsl_bf16_fp4_gemm', "
                                       "'_get_cute_dsl_bf16_fp4_gemm', ('args', (('method', ('object', 'flashinfer.gemm.kernels."
                                       "cute_dsl.dense_gemm_bf16_fp4_sm12x.Sm12xDenseGemmBf16Fp4Kernel', "), gemm["key_repr"][:400]
    for attr in ("atom_layout", "enable_pdl", "cluster_shape_mnk"):
        assert f"('{attr}', " in gemm["key_repr"], (attr, gemm["key_repr"])
    assert gemm["key_repr"].endswith(", 1, 188, ('stream', 'cutlass.runtime._FakeStream'))), ('kwargs', ('dict', ())))"), gemm["key_repr"][-300:]
    assert "('object', 'flashinfer.gemm.kernels.cute_dsl.gemv_bf16_fp4_sm12x.GemvBf16Fp4Sm12x', (('_enable_pdl', True), " in gemv["key_repr"]
    assert ", 188" not in gemv["key_repr"]
    assert gemm["namespace"] != gemv["namespace"]  # each getter's kernel module is in its sources fingerprint
    topk = manifests[SITES["msa_topk"]]
    assert topk["namespace"].startswith("flashinfer-msa-0.7.4-sm_120a-"), topk["namespace"]
    assert topk["key_repr"].startswith("('compile', 'msa_ops/sparse_topk_select.py:_get_compiled_topk', '_get_compiled_topk', "
                                       "('args', (('object', 'flashinfer.msa_ops.cute_dsl.topk_select_countrank_sm12x."
                                       "TopKSelectCountRankSm12x', (('_per_token_nvp', True), ('_topk', 16))), "), topk["key_repr"][:400]


def test_inline_key_is_everything_the_compile_receives(shared: dict[str, Any]) -> None:
    """MSA's ops compile inline: the key is the kernel object's class and state, each fake
    tensor's element type, extents (symbols numbered by identity: the query's token count is
    shared with the output's) and alignment, the scalars and the options; not flashinfer's
    in-process key, which has no head dim."""
    manifests = _manifests(shared["child"].root)
    decode = manifests[SITES["msa_decode"]]
    assert decode["namespace"].startswith("flashinfer-msa-0.7.4-sm_120a-"), decode["namespace"]
    key = decode["key_repr"]
    assert key.startswith("('compile', 'msa_ops/sparse_decode.py:msa_sparse_decode_attention', 'msa_sparse_decode_attention', "
                          "('args', (('object', 'flashinfer.msa_ops.cute_dsl.sparse_decode_sm12x.SparseDecodeForwardSm12x', ("), key
    for part in ("('_head_dim', 128)", "('_group_size', 8)", "('_kv_nvfp4', True)", "('_paged', True)",
                 "('fake_tensor', 'BFloat16', ('tuple', (('sym', 0, 32, 1), ('sym', 1, 32, 1), 128))",
                 "('stream', 'cutlass.runtime._FakeStream')"):
        assert part in key, (part, key)
    assert "--enable-tvm-ffi" in decode["options"], decode["options"]
    # The streaming proxy score's kernel object is described by its state (it is not a stream).
    proxy = manifests[SITES["msa_proxy"]]["key_repr"]
    assert "('object', 'flashinfer.msa_ops.cute_dsl.proxy_score_sm12x.MsaProxyScoreDecodeStreamSm12x', (" in proxy, proxy
    for name in INLINE:  # a loaded tvm-ffi kernel gets the compiled one's calling convention
        extra = manifests[SITES[name]]["extra"]
        assert extra["kwargs_wrapper"] is True and extra["calling_convention"]["arg_names"][0] == "mQ", extra


def test_inline_kernels_follow_the_compile_not_flashinfers_memo(shared: dict[str, Any]) -> None:
    """Another batch size is the same kernel (dynamic extents): a fresh process hits it. Another
    head count is another group size, another kernel: a miss, then a hit in the next process."""
    child: Child = shared["child"]
    # One fresh process asks for both, the batch of 3 first: its hit comes before anything else
    # of the process, then the head count's miss is a compile of its own (one, counted at the DSL).
    first = drive(child, "msa_decode_b3", "msa_decode_h16")
    assert by_site(first) == {SITES["msa_decode"]: ["hit", "miss"]} and first["real_compiles"] == 1, first["events"]
    decode = next(e[1] for e in shared["warm"]["events"] if e[0] == SITES["msa_decode"])
    assert first["events"][0][1] == decode != first["events"][1][1]  # the batch of 3 is that kernel, 16 heads another
    again = drive(child, "msa_decode_h16")
    assert by_site(again) == {SITES["msa_decode"]: ["hit"]} and again["real_compiles"] == 0, again["events"]


def test_other_layer_shapes_share_the_kernel_and_another_dtype_does_not(shared: dict[str, Any]) -> None:
    """n and k are runtime arguments of one b12x kernel (flashinfer's in-process key has neither):
    another layer's shape hits it; the output dtype is in the key: a miss."""
    child: Child = shared["child"]
    # One fresh process: the other layer's shape first (a hit before anything else of the process),
    # then the float16 output at that shape (n and k do not key it): a compile of its own.
    other = drive(child, "b12x_fp4", "b12x_fp4_f16", args=("--n", "6144", "--k", "2048", "--m", "16"))
    assert by_site(other) == {SITES["b12x_fp4"]: ["hit", "miss"]} and other["real_compiles"] == 1, other["events"]
    assert other["events"][1][1] != other["events"][0][1]


def test_natively_cached_sm12x_kernels_are_flashinfers_with_the_opt_out(fi074: str, tmp_path: Path, compile_hook_dir: Path) -> None:  # noqa: F811
    child = Child(tmp_path / "root", tmp_path / "workspace", compile_hook_dir, extra_env=OPT_OUT)
    left = drive(child, "sm12x_cute", "fmha_ragged")
    assert left["events"] == [] and left["real_compiles"] == 2
    written = [p.name for p in child.workspace.rglob("cached_ops/*/*") if p.suffix == ".o"]
    assert any(n.startswith("m16_") for n in written) and any(n.startswith("ragged_") for n in written), written
    assert not list(child.root.glob("v1/*/*/*/manifest.msgpack"))


# --------------------------------------------------------------------------------------------
# Prewarm, then an engine start that compiles nothing
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_child(fi074: str, tmp_path_factory: pytest.TempPathFactory, compile_hook_dir: Path) -> Child:  # noqa: F811
    """One root for both models: qwen3's dense layers use the dense model's GEMM kernels (n and k
    are runtime arguments), so the dense model's prewarm finds them there instead of compiling
    them a second time in CI; run alone, its prewarm compiles them."""
    base = tmp_path_factory.mktemp("fi074-engine")
    return Child(base / "root", base / "workspace", compile_hook_dir)


@pytest.mark.parametrize("model, groups", [("qwen3-30b-a3b", ("moe", "dense")), ("llama-3.1-8b-nvfp4", ("dense",))])
def test_prewarm_then_the_engine_compiles_nothing(engine_child: Child, model: str, groups: tuple[str, ...]) -> None:
    child = engine_child
    ms, max_tokens = "1,2,3", "64"
    plan = ("cute_diskcache.prewarm", "--model", model, "--target", TARGET, "--m", ms, "--max-num-tokens", max_tokens, "--json")
    # One worker: prewarm starts its workers (fresh interpreters importing flashinfer) before it
    # plans, whatever is missing, and llama's kernels are all cached when qwen3's prewarm ran first.
    done = json.loads(child.module(*plan, "--jobs", "1").stdout)
    assert done["failed"] == 0 and done["kernels"] > 0 and done["compiled"] + done["already_cached"] == done["kernels"], done
    for group in ("moe", "dense"):  # reported apart
        assert (done["groups"][group]["kernels"] > 0) == (group in groups), done["groups"]
    assert set(done["groups"]["dense"]["by_kind"]) == {"b12x_fp4"}
    served = drive(child, args=("--engine", model, "--ms", ms, "--max-num-tokens", max_tokens))
    engine = served["engine"]
    assert engine["dense_calls"] > 0 and engine["tuner_tactics"] > 0 and (engine["moe_m"] > 0) == ("moe" in groups)
    assert served["real_compiles"] == 0, served["stderr"][-3000:]
    assert served["counters"]["compiles"] == 0 and served["counters"]["hits"] == done["kernels"], served["counters"]
    # What a prewarm would compile now: nothing (its dry run marks what is cached; real re-runs:
    # tests/test_prewarm.py, tests/test_prewarm_functional.py).
    again = json.loads(child.module(*plan, "--dry-run").stdout)
    assert again["already_cached"] == done["kernels"] and again["compiled"] == 0


def test_prewarm_without_autotune_plans_the_default_tactics_only(fi074: str, tmp_path: Path, compile_hook_dir: Path) -> None:  # noqa: F811
    child = Child(tmp_path / "root", tmp_path / "workspace", compile_hook_dir)
    args = ("cute_diskcache.prewarm", "--model", "llama-3.1-8b-nvfp4", "--target", TARGET, "--m", "1,2,3",
            "--max-num-tokens", "64", "--dry-run", "--json")
    tuned = json.loads(child.module(*args).stdout)
    plain = json.loads(child.module(*args, "--no-autotune").stdout)
    assert 0 < plain["kernels"] < tuned["kernels"], (plain["kernels"], tuned["kernels"])
    assert {k["digest"] for k in plain["kernel_list"]} < {k["digest"] for k in tuned["kernel_list"]}


# --------------------------------------------------------------------------------------------
# doctor on the real 0.7.4
# --------------------------------------------------------------------------------------------

#: sm12x sites compiled inline in 0.7.4 (flashinfer_sites/sites.py), nobody's before issue 13.
INLINE_074 = {
    "cute_dsl/sparse/bsa_attn_sm120.py:bsa_attn_sm120_blk64_fwd",
    "cute_dsl/sparse/bsa_attn_sm120.py:bsa_attn_sm120_blk64_sage_fwd",
    "fused_moe/backends/frost_low_latency/tc/deepseek_fp8.py:execute",
    "fused_moe/backends/frost_low_latency/tc/runtime.py:execute",
    "gdn_kernels/delta_rule_dsl/custom_compile_cache.py:cached_compile",
    "gdn_kernels/experimental/kernel/gdn_fused_decode_cutedsl_sm120_pdl.py:execute",
    "kda_kernels/sm120_prefill/decomp.py:launch_prepare_device",
    "kda_kernels/sm120_prefill/decomp.py:launch_recurrence_device",
    "kda_kernels/sm120_prefill/decomp.py:launch_fwd._compile",
    "kda_kernels/sm120_prefill/fused.py:prepare_launch._compile",
    "moe_ep/kernel_src/sm120/split_cutedsl_megakernel/shim/runtime.py:MegaMoESm120W4A8Frontend._ensure_compiled",
    *(f"moe_ep/kernel_src/sm120/split_cutedsl_megakernel/src/moe_sm120_mxfp4mxfp8_split/kernel_combine_reduce.py:compile_{k}"
      for k in ("topk_reduce", "gated_topk_reduce", "persistent_topk_reduce")),
    "moe_ep/kernel_src/sm120/split_cutedsl_megakernel/src/moe_sm120_mxfp4mxfp8_split/kernel_rank_local_combine.py:compile_rank_local_combine",
    "moe_ep/kernel_src/sm120/swapab_cutedsl_megakernel/shim/mxfp8.py:MegaMoESm120Mxfp8Frontend._ensure_mega_compiled",
    "moe_ep/kernel_src/sm120/swapab_cutedsl_megakernel/src/moe_nvfp4_swapab/megamoe_kernel.py:Sm100MegaMoEKernel.aot_compile",
    "moe_ep/kernel_src/sm120/swapab_cutedsl_megakernel/src/moe_sm120_mxfp8_swapab/topk_reduce.py:compile_topk_reduce",
    "msa_ops/proxy_score.py:msa_proxy_score",
    "msa_ops/proxy_score.py:msa_proxy_score_fp4",
    "msa_ops/sparse_decode.py:msa_sparse_decode_attention",
    "msa_ops/sparse_prefill.py:_msa_sparse_prefill",
}


def test_doctor_lists_every_sm12x_site_of_074(fi074: str, doctor_074: dict[str, Any], tmp_path: Path,  # noqa: F811
                                              compile_hook_dir: Path) -> None:
    child = Child(tmp_path / "root", tmp_path / "workspace", compile_hook_dir)
    report = doctor_074["served"]  # the same report tests/test_flashinfer_074.py reads (once per run)
    sm12x = {f"{s['path']}:{s['function']}": s["status"] for s in report["sites"] if s["arch"] == "sm12x" and not s["harness"]}
    ours = {site for site, st in sm12x.items() if st == "cute-diskcache"}
    assert {"gemm/gemm_base.py:_b12x_gemm_fp4_runner.B12xFp4GemmRunner.forward",
            "gemm/gemm_mm_mxfp8_cute_dsl.py:_b12x_gemm_mxfp8_runner.B12xMxfp8GemmRunner.forward",
            "gemm/kernels/sm12x_cute/runner.py:_compile",
            "cute_dsl/attention/fmha/sm120/compile.py:compile_sm120_fmha_fp8_ragged_kernel",
            "cute_dsl/attention/fmha/sm120/compile.py:compile_sm120_fmha_fp8_paged_kernel",
            "gemm/gemm_bf16_fp4_cute_dsl.py:_get_cute_dsl_bf16_fp4_gemm",
            "gemm/gemm_bf16_fp4_cute_dsl.py:_get_cute_dsl_bf16_fp4_gemv",
            "msa_ops/sparse_topk_select.py:_get_compiled_topk", "msa_ops/sparse_decode.py:_get_compiled_combine",
            "msa_ops/sparse_prefill.py:_get_compiled_union"} <= ours
    frost = {site for site in sm12x if "/cudnn_frost/artifacts/" in site}
    # compiled through the runtime's native builder, which flashinfer's cache keeps (not yet ours)
    assert len(frost) == 18 and {sm12x[site] for site in frost} == {"flashinfer"}
    assert sm12x["kda_kernels/sm120_prefill/runtime.py:build_kernel"] == "flashinfer"
    assert INLINE_074 <= ours
    notes = {f"{s['path']}:{s['function']}": s["note"] for s in report["sites"]}
    assert all(notes[site].startswith("keyed by everything the compile receives") for site in INLINE_074)
    assert {site for site, st in sm12x.items() if st == "nothing"} == set()
    assert report["summary"] == {"cute-diskcache": len(ours), "flashinfer": sum(st == "flashinfer" for st in sm12x.values()),
                                 "nothing": 0}
    assert report["missing_adapter_sites"] == [] and report["groups"]["other"]["nothing"] > 0
    strict = subprocess.run([fi074, "-m", "cute_diskcache.cli.doctor", "--strict"], env=child.env(),
                            capture_output=True, text=True, timeout=120, cwd=compile_hook_dir)
    assert strict.returncode == 0 and "nothing 0" in strict.stdout, strict.stdout[-3000:]
    left = doctor_074["opt_out"]
    left_status = {f"{s['path']}:{s['function']}": s["status"] for s in left["sites"]}
    assert left_status["gemm/kernels/sm12x_cute/runner.py:_compile"] == "flashinfer"
    assert left_status["gemm/gemm_base.py:_b12x_gemm_fp4_runner.B12xFp4GemmRunner.forward"] == "cute-diskcache"


# --------------------------------------------------------------------------------------------
# vLLM 0.34's source: the calls dense planning reproduces
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_src() -> Path:
    if os.environ.get("CUTE_DISKCACHE_VLLM") == "off":
        pytest.skip("CUTE_DISKCACHE_VLLM=off: vLLM tests skipped")
    from _compat import SCRATCH, matrix

    python = matrix().vllm_venv(SCRATCH)
    proc = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return Path(proc.stdout.strip())


def _function(path: Path, name: str) -> ast.FunctionDef:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{name} not in {path}")


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


def test_vllm_034_calls_flashinfer_as_dense_planning_assumes(vllm_src: Path) -> None:
    linear = vllm_src / "model_executor" / "kernels" / "linear" / "nvfp4" / "flashinfer.py"
    tree = ast.parse(linear.read_text())
    b12x = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "FlashInferB12xNvFp4LinearKernel")
    apply = next(n for n in b12x.body if isinstance(n, ast.FunctionDef) and n.name == "apply_weights")
    (mm,) = _calls(apply, "flashinfer_scaled_fp4_mm")
    assert [ast.unparse(a) for a in mm.args] == ["x_fp4", "layer.weight", "x_blockscale", "layer.weight_scale",
                                                 "layer.alpha", "output_dtype"]
    assert {k.arg: ast.unparse(k.value) for k in mm.keywords} == {"backend": "'b12x'"}
    prepare = next(n for n in b12x.body if isinstance(n, ast.FunctionDef) and n.name == "process_weights_after_loading")
    assert [ast.unparse(c) for c in _calls(prepare, "pad_nvfp4_weight_for_cutlass")] == ["pad_nvfp4_weight_for_cutlass(layer.weight.data)"]
    utils = vllm_src / "utils" / "flashinfer.py"
    scaled = _function(utils, "flashinfer_scaled_fp4_mm")
    (call,) = _calls(scaled, "flashinfer_mm_fp4")
    assert [ast.unparse(a) for a in call.args] == ["a", "b.t()", "block_scale_a", "block_scale_b.t()", "alpha", "out_dtype"]
    assert {k.arg: ast.unparse(k.value) for k in call.keywords} == {
        "use_8x4_sf_layout": "use_8x4_sf_layout", "backend": "backend", "block_size": "block_size", "use_nvfp4": "use_nvfp4"}
    # ... which is vLLM's custom op around flashinfer.mm_fp4: no out, flashinfer's default enable_pdl.
    inner = _function(utils, "_flashinfer_mm_fp4")
    assert any(isinstance(n, ast.ImportFrom) and n.module == "flashinfer" and [(a.name, a.asname) for a in n.names]
               == [("mm_fp4", "flashinfer_mm_fp4_")] for n in ast.walk(inner))
    (fi,) = _calls(inner, "flashinfer_mm_fp4_")
    assert [ast.unparse(a) for a in fi.args] == ["A", "B", "A_scale", "B_scale", "g_scale", "dtype"]
    assert sorted(k.arg for k in fi.keywords) == ["backend", "block_size", "use_8x4_sf_layout", "use_nvfp4"]
    text = utils.read_text()
    assert '"flashinfer.fused_moe.utils", "get_hybrid_num_tokens_buckets"' in text
    pad = _function(vllm_src / "model_executor" / "layers" / "quantization" / "utils" / "nvfp4_utils.py", "pad_nvfp4_weight_for_cutlass")
    assert ast.unparse(pad.args.defaults[-1]) == "32"
    warmup = (vllm_src / "model_executor" / "warmup" / "kernel_warmup.py").read_text()
    assert "flashinfer_get_hybrid_num_tokens_buckets(" in warmup and "has_device_capability(90)" in warmup
