"""Owns the table of vLLM's own compile sites that cute-diskcache serves: data only.

vLLM 0.34.0 calls ``cute.compile`` itself at about 160 places, nearly all model-specific or for
SM90 / SM100 (``docs/design-vllm-sites.md`` section 3). The one an sm12x engine start reaches
is its shape-dynamic skinny GEMM (``ShapeDynamicSkinnyGemm._compile``), planned for capability
(12, 1) only (DGX Spark), for the unquantized, bias-free BF16 linears and LM heads whose shapes
its table names; vLLM keeps it in a dict, so every start compiles it again. Its key is what the
compile receives, as for the other libraries' sites; vLLM's own dict key is never used.
"""

from __future__ import annotations

from ..core.adapter import Row

SKINNY_FILE = "model_executor/kernels/linear/cute_dsl/skinny_gemm.py"
SKINNY_FUNCTION = "ShapeDynamicSkinnyGemm._compile"
PLANS_FILE = "model_executor/kernels/linear/cute_dsl/skinny_gemm_plans.py"
#: The code the row's kernels come from, fingerprinted whole (the adapter's ``reach_by_tree``): the
#: vllm package is about 3,600 files and must not be; the kernel is ``_skinny_gemm.py`` beside
#: its host, and this directory (11 files) holds both.
SKINNY_TREE = "model_executor/kernels/linear/cute_dsl"

ROWS: tuple[Row, ...] = (
    Row(SKINNY_FILE, SKINNY_FUNCTION, "gemm", "vllm.skinny_gemm", "vllm", tree=SKINNY_TREE),
)
BY_WHERE: dict[tuple[str, str], Row] = {(r.file, r.function): r for r in ROWS}

#: The functions (``doctor``'s vLLM sites) whose compiles ``prewarm`` plans, with the flags that plan them.
PLANNED: dict[tuple[str, str], str] = {
    (SKINNY_FILE, SKINNY_FUNCTION): "--target dgx-spark (vLLM's (12, 1) skinny GEMM plans)",
}
#: What prewarm's planning (:mod:`.planning`) reads from vLLM, by file: a vLLM without them (older
#: than 0.34) is not planned offline, and ``doctor`` says why; the row still serves its compiles.
PLANNING_API: dict[str, tuple[str, ...]] = {
    PLANS_FILE: ("SKINNY_GEMM_PLANS_BY_CAPABILITY",),
    SKINNY_FILE: ("ShapeDynamicSkinnyGemm", "SkinnyGemmConfig"),
}

#: Distributions vLLM's kernel is traced with besides the DSL: quack builds its fake tensors.
COMPANIONS = ("quack-kernels",)
#: Variables vLLM's code reads that change no generated code: where its caches live and its logs.
NOT_CODEGEN_ENV = frozenset({"VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH",
                             "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_PREFIX"})
#: What ``doctor`` says of the rows.
NOTE = "keyed by everything the compile receives"
