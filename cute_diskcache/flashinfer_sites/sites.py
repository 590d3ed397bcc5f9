"""Owns the table of flashinfer's sm12x compile sites we cover: where each is, nothing about keys.

Per-release knowledge is data here. A *site* is a function in flashinfer's package (file relative
to the package, qualified name as the site scan spells it) from which a ``cute.compile`` is
reached: the compile call itself, or up to :data:`DEPTH` frames below it (a shared helper, a
``lambda`` handed to flashinfer's native builder). :mod:`..core.hook` finds the nearest row above each
compile and keys the compile by everything it receives; no row holds a key. A row says only what
the key cannot see: the site's name and namespace, a ``sys.path`` kernel tree whose files join the
fingerprint, side data stored beside the kernel, and whether flashinfer's own disk cache sits
between the site and its compile (``native``: see :mod:`.native`, the one exception). The row's
shape (:class:`~..core.adapter.Row`) is every library's; this table is flashinfer's
(:mod:`.adapter` hands it to the hook).

A function a release does not define is simply absent on that release: no version bounds.
"""

from __future__ import annotations

from pathlib import Path

from ..core.adapter import DEPTH, Row
from .names import MOE_BASE, table_name

__all__ = ["BY_WHERE", "DEPTH", "NOTE", "OWN_DISK_CACHES", "ROWS", "Row", "covered", "defined"]


def _moe(file: str, function: str, kind: str, module: str | None = None, **kw: object) -> Row:
    module = module or file.removesuffix(".py")
    return Row(f"{MOE_BASE}/{file}", function, kind, f"flashinfer.{module}.{kind}", "flashinfer-moe", **kw)  # type: ignore[arg-type]


def _family(family: str, file: str, function: str, kind: str, **kw: object) -> Row:
    return Row(file, function, kind, f"flashinfer.{family}.{kind}", f"flashinfer-{family}", **kw)  # type: ignore[arg-type]


_EP = "moe_ep/kernel_src/sm120"
_SPLIT = f"{_EP}/split_cutedsl_megakernel"
_SWAPAB = f"{_EP}/swapab_cutedsl_megakernel"
_SPLIT_SRC = f"{_SPLIT}/src/moe_sm120_mxfp4mxfp8_split"
_KDA = "kda_kernels/sm120_prefill"
_W4A16 = "moe_w4a16_compiler"

ROWS: tuple[Row, ...] = (
    # moe_dispatch's static, micro and dynamic kernels: compiled in memory up to 0.6.17; from 0.6.18
    # through flashinfer's native builder (keyed with torch's build), which :mod:`.native` serves.
    _moe("moe_dispatch.py", "_get_static_kernel", "static", native=True, reuse=True),
    _moe("moe_dispatch.py", "_get_micro_kernel", "micro", native=True, reuse=True),
    _moe("moe_dispatch.py", "_get_dynamic_kernel", "dynamic", native=True, reuse=True),
    # 0.6.17+: the direct micro kernel, with moe_dispatch's block-dim probe answer beside it.
    _moe("moe_direct_micro_kernel.py", "compile_direct_micro_kernel", "direct_micro", side="block_dim"),
    # W4A16 MoE: each kernel compiles in place up to 0.6.16, through the memoising wrapper from 0.6.17.
    *(_moe("moe_w4a16_kernel.py", f"compile_w4a16_{k}", "w4a16", _W4A16, reuse=True)
      for k in ("gemm", "fused_moe", "activation", "topk_sum")),
    _moe(f"{_W4A16}.py", "compile", "w4a16", reuse=True),
    # 0.7.x: nvfp4 W4A4/W4A16 runners, and the fp8 / mxfp8 x mxfp4 op modules.
    _moe("moe_nvfp4_w4a4.py", "run_moe_w4a4", "w4a4"),
    _moe("moe_nvfp4_w4a16.py", "run_moe_w4a16", "nvfp4_w4a16"),
    *(_moe(f"moe_{fmt}_{op}.py", "compiled_kernel", f"{fmt}_{op}")
      for fmt in ("fp8", "mxfp8_mxfp4") for op in ("fc1_act", "fc1_act_q1", "fc2_finalize", "gemm")),
    # Dense GEMMs (flashinfer's own code, which it names b12x; not the b12x package): the FP4 and
    # MXFP8 runners (through flashinfer's shared block-scaled helper, which its SM100 runners also
    # use: only the sm12x runners' compiles are sites), the BF16 x FP4
    # GEMM and GEMV getters, 0.6.12/0.6.13's dense GEMM getter, and the SM12x CuTe FP4 runner (native).
    _family("gemm", "gemm/gemm_base.py", "_b12x_gemm_fp4_runner.B12xFp4GemmRunner.forward", "b12x_fp4", reuse=True),
    _family("gemm", "gemm/gemm_mm_mxfp8_cute_dsl.py", "_b12x_gemm_mxfp8_runner.B12xMxfp8GemmRunner.forward", "b12x_mxfp8"),
    _family("gemm", "gemm/gemm_bf16_fp4_cute_dsl.py", "_get_cute_dsl_bf16_fp4_gemm", "bf16_fp4_gemm"),
    _family("gemm", "gemm/gemm_bf16_fp4_cute_dsl.py", "_get_cute_dsl_bf16_fp4_gemv", "bf16_fp4_gemv"),
    _family("gemm", "gemm/kernels/dense_blockscaled_gemm_sm120_b12x.py", "_get_compiled_dense_gemm", "b12x_dense_gemm"),
    Row("gemm/kernels/sm12x_cute/runner.py", "_compile", "sm12x_cute", "flashinfer.native.sm12x_cute", "flashinfer-gemm",
        native=True),
    # Attention: the SM120 FP8 FMHA (native), MSA, block-sparse attention.
    *(Row("cute_dsl/attention/fmha/sm120/compile.py", f"compile_sm120_fmha_fp8_{kind}_kernel", f"fmha_sm120_{kind}",
          f"flashinfer.native.fmha_sm120_{kind}", "flashinfer-attention", native=True) for kind in ("ragged", "paged")),
    _family("msa", "msa_ops/sparse_topk_select.py", "_get_compiled_topk", "msa_topk"),
    _family("msa", "msa_ops/sparse_decode.py", "_get_compiled_combine", "msa_combine"),
    _family("msa", "msa_ops/sparse_prefill.py", "_get_compiled_union", "msa_union"),
    _family("msa", "msa_ops/proxy_score.py", "msa_proxy_score", "msa_proxy_score"),
    _family("msa", "msa_ops/proxy_score.py", "msa_proxy_score_fp4", "msa_proxy_score_fp4"),
    _family("msa", "msa_ops/sparse_decode.py", "msa_sparse_decode_attention", "msa_sparse_decode"),
    _family("msa", "msa_ops/sparse_prefill.py", "_msa_sparse_prefill", "msa_sparse_prefill"),
    _family("bsa", "cute_dsl/sparse/bsa_attn_sm120.py", "bsa_attn_sm120_blk64_fwd", "bsa_fwd"),
    _family("bsa", "cute_dsl/sparse/bsa_attn_sm120.py", "bsa_attn_sm120_blk64_sage_fwd", "bsa_sage_fwd"),
    # Linear attention: KDA prefill, GDN.
    _family("kda", f"{_KDA}/decomp.py", "launch_prepare_device", "kda_prepare"),
    _family("kda", f"{_KDA}/decomp.py", "launch_recurrence_device", "kda_recurrence"),
    _family("kda", f"{_KDA}/decomp.py", "launch_fwd._compile", "kda_fwd"),
    _family("kda", f"{_KDA}/fused.py", "prepare_launch._compile", "kda_fused"),
    _family("gdn", "gdn_kernels/delta_rule_dsl/custom_compile_cache.py", "cached_compile", "gdn_delta_rule"),
    _family("gdn", "gdn_kernels/experimental/kernel/gdn_fused_decode_cutedsl_sm120_pdl.py", "execute", "gdn_decode"),
    # Other MoE backends: frost low-latency, expert-parallel reduce and megakernels (a sys.path tree).
    _family("frost", "fused_moe/backends/frost_low_latency/tc/deepseek_fp8.py", "execute", "frost_deepseek_fp8"),
    _family("frost", "fused_moe/backends/frost_low_latency/tc/runtime.py", "execute", "frost_grouped"),
    _family("moe-ep", f"{_SPLIT}/shim/runtime.py", "MegaMoESm120W4A8Frontend._ensure_compiled", "ep_w4a8_mega", tree=_SPLIT),
    *(_family("moe-ep", f"{_SPLIT_SRC}/kernel_combine_reduce.py", f"compile_{k}", f"ep_{k}", tree=_SPLIT)
      for k in ("topk_reduce", "gated_topk_reduce", "persistent_topk_reduce")),
    _family("moe-ep", f"{_SPLIT_SRC}/kernel_rank_local_combine.py", "compile_rank_local_combine", "ep_rank_local_combine",
            tree=_SPLIT),
    _family("moe-ep", f"{_SWAPAB}/shim/mxfp8.py", "MegaMoESm120Mxfp8Frontend._ensure_mega_compiled", "ep_mxfp8_mega",
            tree=_SWAPAB),
    _family("moe-ep", f"{_SWAPAB}/src/moe_nvfp4_swapab/megamoe_kernel.py", "Sm100MegaMoEKernel.aot_compile", "ep_swapab_aot",
            tree=_SWAPAB),
    _family("moe-ep", f"{_SWAPAB}/src/moe_sm120_mxfp8_swapab/topk_reduce.py", "compile_topk_reduce", "ep_mxfp8_topk_reduce",
            tree=_SWAPAB),
)
BY_WHERE: dict[tuple[str, str], Row] = {(r.file, r.function): r for r in ROWS}
#: flashinfer's own disk caches: a compile with one of these files' frames between it and a site
#: is flashinfer's to keep (one kernel, one cache), unless :mod:`.native` serves that build.
OWN_DISK_CACHES = frozenset({"jit/cute_dsl_core.py", "experimental/b12x/_lib/compiler.py"})
#: What ``doctor`` says of sites compiled in memory by flashinfer.
NOTE = "keyed by everything the compile receives (an argument it cannot describe: uncached, one warning)"


def defined(package_dir: Path, row: Row) -> bool:
    """Whether the installed release defines a row's function (by name, in its file)."""
    try:
        text = (package_dir / row.file).read_text(errors="replace")
    except OSError:
        return False
    name = row.function.rpartition(".")[2]
    return f"def {name}(" in text


def covered(package_dir: Path, *, native: bool = True) -> dict[tuple[str, str], str]:
    """(file as the site scan names it, function) -> kind, for the rows the release defines.

    ``native``: include the rows flashinfer builds through its own disk cache (we serve them
    unless ``CUTE_DISKCACHE_NATIVE_SITES=flashinfer``). A moe_dispatch row is native only from
    0.6.18, where its file calls the builder; before that it compiles in memory and is ours always.
    """
    out = {}
    for row in ROWS:
        if not defined(package_dir, row):
            continue
        if row.native and not native and _builds_natively(package_dir, row):
            continue
        out[(table_name(row.file), row.function)] = row.kind
    return out


def _builds_natively(package_dir: Path, row: Row) -> bool:
    try:
        return "build_and_load_cute_dsl_kernel" in (package_dir / row.file).read_text(errors="replace")
    except OSError:
        return False
