"""Owns the table of SGLang's compile sites that cute-diskcache serves: data only.

SGLang 0.5.23 calls ``cute.compile`` itself at 38 sites outside its multimodal tree
(``docs/versions.md`` lists each, with the flag that selects it on sm12x). The rows here are
those an sm12x engine start reaches: the two SGLang picks with no flag on a capability-12 card
(the DeepSeek-V3-family fused QKV-A GEMM at decode batches of 1-16, BF16, and the Qwen3.x NVFP4
decode GEMM, sm_120 only), each kept in memory by SGLang (every start compiles it again), and
the FlashAttention-4 SM12x forward and its split-KV combine (``--attention-backend fa4``), which
SGLang persists in its own ``cute_aot`` cache: that cache stands aside for them while ours
serves (:mod:`.native`; one kernel, one cache). Each row's key is what the compile receives, as
for flashinfer's and b12x's sites; SGLang's own keys are never used.
"""

from __future__ import annotations

from ..core.adapter import Row

FA4_INTERFACE_FILE = "kernels/ops/attention/flash_attn/cute/interface.py"
#: The code each row's kernels come from, fingerprinted whole (the adapter's ``reach_by_tree``):
#: FA4's interface and kernels (``flash_attn/cute``), its SM12x forward host (``fa4_sm120``) and
#: the entry points above them; each GEMM's package.
FA4_TREE = "kernels/ops/attention"

ROWS: tuple[Row, ...] = (
    # The forward compiles the kernel object the SM12x forward host builds (make_kernel), one class
    # per specialisation: entries are named after it (per_target).
    Row(FA4_INTERFACE_FILE, "_flash_attn_fwd", "fa4", "sglang.fa4", "sglang", tree=FA4_TREE, per_target=True),
    Row(FA4_INTERFACE_FILE, "_compile_fwd_combine", "fa4", "sglang.fa4", "sglang", tree=FA4_TREE, per_target=True),
    Row("kernels/ops/gemm/cutedsl_dsv3_fused_a_gemm.py", "_compiled_kernel", "gemm", "sglang.dsv3_fused_a_gemm", "sglang",
        tree="kernels/ops/gemm"),
    Row("kernels/kda_kernels/qwen3x_nvfp4_gemm_sm120.py", "_compile_decode_kernel", "gemm", "sglang.qwen3x_nvfp4_gemm",
        "sglang", tree="kernels/kda_kernels"),
)
BY_WHERE: dict[tuple[str, str], Row] = {(r.file, r.function): r for r in ROWS}

#: SGLang's persistent caches of the FA4 interface, by the function that holds them and the
#: attribute: replaced by SGLang's own in-memory cache while ours serves (:mod:`.native`). The
#: shear-bias kernels (a relative-position bias) compile inside ``_flash_attn_fwd`` too, so its
#: row serves them and their caches stand aside with the others.
AOT_CACHES: tuple[tuple[str, str], ...] = (
    ("_flash_attn_fwd", "compile_cache"), ("_flash_attn_fwd", "compile_cache_shear_bias"),
    ("_flash_attn_fwd", "compile_cache_prepare_shear_bias"), ("_flash_attn_fwd_combine", "compile_cache"),
)
#: SGLang functions whose compiles its ``cute_aot`` cache persists when no row of ours serves them
#: (for ``doctor``): the FA4 hd-512 GQA forward (SM100) and the KDA DSPARK verify (SM10x).
SGLANG_PERSISTED: frozenset[tuple[str, str]] = frozenset({
    ("kernels/ops/attention/flash_attention_v4.py", "flash_attn_gqa_512"),
    ("kernels/ops/attention/kda_decode_mtp.py", "fused_kda_decode_mtp_dspark"),
})

#: Distributions SGLang's kernels are traced with besides the DSL: FA4 calls quack's helpers.
COMPANIONS = ("quack-kernels",)
#: Variables SGLang's code reads that change no generated code: where its caches live and its logs.
NOT_CODEGEN_ENV = frozenset({"SGLANG_CUTE_AOT_CACHE_DIR", "SGLANG_CACHE_DIR", "SGLANG_LOGGING_CONFIG_PATH"})
#: What ``doctor`` says of the rows.
NOTE = "keyed by everything the compile receives"
