"""flashinfer's module names that the rest of the package needs, and nothing else.

Imported at interpreter start by the activation hook (which watches these modules being
imported), so it imports nothing: every other fact about flashinfer stays in this package.
"""

FLASHINFER = "flashinfer"
#: The DSL module whose ``compile`` the inline sites go through (:mod:`.inline`): hooked as it is imported.
DSL_CUTE = "cutlass.cute"
SM12X = "flashinfer.fused_moe.cute_dsl.blackwell_sm12x"
MOE_DISPATCH = f"{SM12X}.moe_dispatch"
FLASHINFER_UTILS = "flashinfer.cute_dsl.utils"
#: The sm12x sites outside the MoE package (:mod:`.gemm`, :mod:`.native`, :mod:`.gemm_offline`):
#: the dense GEMMs (flashinfer's b12x-named runners), the kernel getters (BF16 x FP4 GEMM, MSA), flashinfer's native builder, and what the GEMM API asks of the device
#: (``flashinfer.utils``; ``flashinfer.cute_dsl.utils`` answers max active clusters).
GEMM_BASE = "flashinfer.gemm.gemm_base"
GEMM_MXFP8 = "flashinfer.gemm.gemm_mm_mxfp8_cute_dsl"
GEMM_BF16_FP4 = "flashinfer.gemm.gemm_bf16_fp4_cute_dsl"
MSA_TOPK = "flashinfer.msa_ops.sparse_topk_select"
MSA_DECODE = "flashinfer.msa_ops.sparse_decode"
MSA_PREFILL = "flashinfer.msa_ops.sparse_prefill"
MSA_PROXY = "flashinfer.msa_ops.proxy_score"  # imports flashinfer.utils' SM12x gate by name (offline stand-in)
CUTE_DSL_CORE = "flashinfer.jit.cute_dsl_core"
UTILS = "flashinfer.utils"
SM12X_CUTE = "flashinfer.gemm.kernels.sm12x_cute."
#: Every module under these prefixes is offered to the adapter as it is imported; the adapter
#: decides, per flashinfer version, which ones hold compile sites (exact module names are
#: prefixes too: nothing else in flashinfer extends them).
SITE_PACKAGES = (SM12X + ".", GEMM_BASE, GEMM_MXFP8, GEMM_BF16_FP4, MSA_TOPK, MSA_DECODE, MSA_PREFILL, MSA_PROXY, CUTE_DSL_CORE, UTILS, FLASHINFER_UTILS, SM12X_CUTE)

#: flashinfer's sm12x MoE package, relative to its package directory: the adapter's tables name
#: its files relative to it, as since 0.6.x.
MOE_BASE = "fused_moe/cute_dsl/blackwell_sm12x"


def table_name(path: str) -> str:
    """The name our adapter tables (and doctor's consumers) give a file: MoE-package files relative
    to ``blackwell_sm12x/`` (as since 0.6.x), every other file relative to flashinfer's package."""
    if path.startswith(MOE_BASE + "/"):
        return path[len(MOE_BASE) + 1:]
    if path == "fused_moe/cute_dsl/b12x_moe.py":
        return "../b12x_moe.py"
    return path


def package_path(file: str) -> str:
    """The package-relative path of an adapter table's file name (the inverse of :func:`table_name`)."""
    if file.startswith("../"):
        from posixpath import normpath  # loaded at interpreter start already

        return normpath(f"{MOE_BASE}/{file}")
    return file if "/" in file else f"{MOE_BASE}/{file}"  # the MoE tables name flat files
