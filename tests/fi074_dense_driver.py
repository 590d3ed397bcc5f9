"""Child process for tests/test_flashinfer_074_dense.py: one fresh "engine start" on flashinfer 0.7.4.

Run with the 0.7.4 interpreter, never imported by pytest. It attaches the cache for a target
profile before flashinfer is imported, then calls flashinfer's own entry points on CPU tensors
(each launch after a compile or load fails without a GPU; its error is recorded) and prints one
JSON line: the cache's events and counters and each call's error.

Sites (each one call):
    b12x_fp4     flashinfer.mm_fp4(..., backend="b12x") with vLLM 0.34's arguments
    b12x_mxfp8   flashinfer.mm_mxfp8(..., backend="b12x")
    sm12x_cute   the SM12x CuTe FP4 GEMM runner's compile (flashinfer's natively cached kernel)
    fmha_ragged  the SM120 FP8 FMHA's compiles (natively cached too), ragged and paged
    fmha_paged
    bf16_fp4_gemm  the BF16 x FP4 GEMM (W4A16 NVFP4 linear layers), its runner's untuned choice
    bf16_fp4_gemv  its m=1 GEMV
    msa_topk, msa_combine, msa_union
                 MSA's SM12x top-k select, sparse-decode combine and sparse-prefill union kernels
    msa_decode, msa_proxy, msa_proxy_fp4, msa_prefill
                 MSA's ops whose kernels are compiled inline (sparse decode over a paged NVFP4 KV
                 cache, the bf16 and NVFP4 proxy scores, sparse prefill), through their public entry points
    gdn_prefill  GDN's SM12x chunked prefill, compiled through its delta-rule compile cache (PTX kept and checked)

``--engine MODEL`` instead serves MODEL the way vLLM 0.34 would, written here independently of
prewarm: its B12xMoEWrapper (use_cuda_graph=True) for every ``--m``, and for each NVFP4 linear
layer ``flashinfer.mm_fp4(a, b.t(), a_scale, b_scale.t(), alpha, bf16, use_8x4_sf_layout=False,
backend="b12x", block_size=16, use_nvfp4=True)`` for every m, plus flashinfer's tuner candidates
at vLLM's tuning buckets (the b12x runner's valid tactics, each run as the tuner runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable


def _fp4_operands(m: int, n: int, k: int) -> tuple[Any, ...]:
    import torch

    pad = lambda v, to: -(-v // to) * to  # noqa: E731
    fp8 = torch.float8_e4m3fn
    a = torch.zeros(m, k // 2, dtype=torch.uint8)
    a_sf = torch.zeros(pad(m, 128), pad(k // 16, 4), dtype=torch.uint8).view(fp8)
    b = torch.zeros(n, k // 2, dtype=torch.uint8)  # vLLM's layer.weight (n, k/2)
    b_sf = torch.zeros(pad(n, 128), pad(k // 16, 4), dtype=torch.uint8).view(fp8)
    return a, b, a_sf, b_sf, torch.ones(1, dtype=torch.float32)


def mm_fp4_as_vllm(m: int, n: int, k: int, out_dtype: Any = None) -> Any:
    """vLLM's flashinfer_scaled_fp4_mm(x_fp4, weight, x_scale, weight_scale, alpha, x.dtype, backend="b12x")."""
    import flashinfer
    import torch

    a, b, a_sf, b_sf, alpha = _fp4_operands(m, n, k)
    return flashinfer.mm_fp4(a, b.t(), a_sf, b_sf.t(), alpha, out_dtype or torch.bfloat16, use_8x4_sf_layout=False,
                             backend="b12x", block_size=16, use_nvfp4=True)


def tuner_candidates(m: int, n: int, k: int) -> int:
    """What flashinfer's tuner does for one bucket: ask the b12x runner its valid tactics and run each."""
    import torch
    from flashinfer.gemm import gemm_base

    a, b, a_sf, b_sf, alpha = _fp4_operands(m, n, k)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    workspace = gemm_base._get_stream_cache_buf("mm_fp4_workspace", gemm_base.DEFAULT_WORKSPACE_SIZE, a.device)
    inputs = [a, b.t(), a_sf, b_sf.t(), alpha, torch.bfloat16, out, 16, True, workspace]
    runner = gemm_base._b12x_gemm_fp4_runner(12, 0, True, torch.bfloat16, True)
    tactics = runner.get_valid_tactics(inputs, None)
    for tactic in tactics:
        try:
            runner(inputs=inputs, tactic=tactic)
        except Exception:  # the launch, without a GPU
            pass
    return len(tactics)


def mm_mxfp8(m: int, n: int, k: int) -> Any:
    import flashinfer
    import torch

    pad = lambda v: -(-v // 128) * 128  # noqa: E731
    a = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
    b = torch.zeros(n, k, dtype=torch.float8_e4m3fn).t()
    return flashinfer.mm_mxfp8(a, b, torch.zeros(pad(m) * (k // 32), dtype=torch.uint8),
                               torch.zeros(pad(n) * (k // 32), dtype=torch.uint8), out_dtype=torch.bfloat16, backend="b12x")


def sm12x_cute(m: int, n: int, k: int) -> Any:
    from flashinfer.gemm.kernels.sm12x_cute import policy, runner

    tactic = policy.default_tactic(m, n, k, compute_capability=(12, 0))
    return runner._compile(m, n, k, tactic, compute_capability=(12, 0))


def bf16_fp4(kind: str, m: int, n: int, k: int) -> Any:
    """The BF16 x FP4 GEMM's kernels as its runner picks them without a tuned tactic (the
    rtx-pro-6000's 188 SMs): the GEMV for m=1, else the GEMM with flashinfer's tile heuristic."""
    import torch
    from flashinfer.gemm import gemm_bf16_fp4_cute_dsl as g

    if kind == "gemv":
        compiled = g._get_cute_dsl_bf16_fp4_gemv(g._select_bf16_fp4_gemv_split(n, k, 12, 188) or 1, torch.bfloat16,
                                                 torch.bfloat16, enable_pdl=True)
    else:
        tile, atom = g._select_bf16_fp4_tile_shape(m, n, k)
        compiled = g._get_cute_dsl_bf16_fp4_gemm(tile, torch.bfloat16, torch.bfloat16, atom, 1, 1, enable_pdl=True,
                                                 tile_swizzle=1, k_splits=g._select_bf16_fp4_k_splits(m, n, k, tile, 188),
                                                 occupancy=1)
    # The runner's launch: compiled(a, b, b_sf_u8, out, partial, alpha) (fails without a GPU).
    compiled(torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(k // 16, n, dtype=torch.int32),
             torch.zeros(k // 16, n, dtype=torch.uint8), torch.empty(m, n, dtype=torch.bfloat16),
             torch.zeros(4, dtype=torch.float32), torch.ones(1, dtype=torch.float32))


def msa(kind: str) -> Any:
    """MSA's SM12x kernels, built by their getters with the arguments its ops pass (top-k 16,
    per-token valid-page count; bf16 combine, head dim 128; union over 32-token tiles)."""
    import torch

    if kind == "topk":
        from flashinfer.msa_ops import sparse_topk_select as m

        return m._get_compiled_topk(16, True, True)
    if kind == "combine":
        from flashinfer.msa_ops import sparse_decode as m

        return m._get_compiled_combine(torch.float32, torch.bfloat16, 16, 128, False, False)
    from flashinfer.msa_ops import sparse_prefill as m

    return m._get_compiled_union(16, 32)


def msa_op(kind: str, batch: int = 2, heads: int = 8) -> Any:
    """MSA's public ops on a paged KV cache (4 pages of 128 tokens, one KV head, head dim 128),
    one query token per request, with explicit offsets (the default ones are CUDA dummies)."""
    import torch
    from flashinfer.msa_ops.proxy_score import msa_proxy_score, msa_proxy_score_fp4
    from flashinfer.msa_ops.sparse_decode import msa_sparse_decode_attention

    b, h, d, pages, i32 = batch, heads, 128, 4, torch.int32
    paged = {"page_table": torch.zeros(b, pages, dtype=i32), "seqused_k": torch.full((b,), 256, dtype=i32),
             "q_offset": torch.zeros(b, dtype=i32)}
    if kind == "decode":
        k = torch.zeros(pages, 1, 128, d // 2, dtype=torch.uint8)
        sf = torch.zeros(pages * 128 * (d // 16), dtype=torch.uint8)
        return msa_sparse_decode_attention(torch.zeros(b, h, d, dtype=torch.bfloat16), k, k.clone(),
                                           torch.zeros(1, b, 16, dtype=i32), k_scale=sf, v_scale=sf.clone(),
                                           force_fused=True, **paged)
    cu_q = torch.arange(b + 1, dtype=i32)
    if kind == "proxy":
        return msa_proxy_score(torch.zeros(b, h, d, dtype=torch.bfloat16), torch.zeros(pages, 1, 128, d, dtype=torch.bfloat16),
                               cu_q, max_seqlen_q=1, max_k_tiles=4, **paged)
    q_sf = torch.zeros(b * h * (d // 16), dtype=torch.uint8)
    k_sf = torch.zeros(pages * 128 * (d // 16), dtype=torch.uint8)
    return msa_proxy_score_fp4(torch.zeros(b, h, d // 2, dtype=torch.uint8), torch.zeros(pages, 1, 128, d // 2, dtype=torch.uint8),
                               q_sf, k_sf, 1.0, 1.0, cu_q, max_seqlen_q=1, max_k_tiles=4, **paged)


def msa_prefill(heads: int = 8) -> Any:
    """MSA's sparse prefill through ``msa_sparse_attention`` on an empty batch: its union-metadata
    builder returns before launching anything, and the prefill kernel (fake tensors with symbolic
    extents: the batch is not in it) compiles as for a real batch. Paged NVFP4 KV, top-k 16."""
    import torch
    from flashinfer.msa_ops.sparse_prefill import msa_sparse_attention

    d, pages, i32 = 128, 4, torch.int32
    k = torch.zeros(pages, 1, 128, d // 2, dtype=torch.uint8)
    sf = torch.zeros(pages * 128 * (d // 16), dtype=torch.uint8)
    return msa_sparse_attention(torch.zeros(0, heads, d, dtype=torch.bfloat16), k, k.clone(), torch.zeros(1, 0, 16, dtype=i32),
                                torch.zeros(1, dtype=i32), None, page_table=torch.zeros(0, pages, dtype=i32),
                                seqused_k=torch.zeros(0, dtype=i32), k_scale=sf, v_scale=sf.clone(), q_offset=torch.zeros(0, dtype=i32))


def _aligned(shape: tuple[int, ...], dtype: Any, align: int = 128) -> Any:
    """A zero CPU tensor at an ``align``-byte address (a CUDA allocation always is; CPU torch's only 64)."""
    import math

    import torch

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = torch.zeros(nbytes + align, dtype=torch.uint8)
    off = -buf.data_ptr() % align
    return buf[off:off + nbytes].view(dtype).view(shape)


def gdn_prefill(heads: int = 4, tokens: int = 64) -> Any:
    """GDN's SM12x chunked prefill (``chunk_gated_delta_rule_sm120``): its kernel compiles through
    the delta-rule compile cache, which keeps the PTX and checks it (cluster-scoped TMA loads)."""
    import torch
    from flashinfer.gdn_kernels import chunk_gated_delta_rule_sm120
    from flashinfer.utils import _get_cache_buf

    buf = _get_cache_buf("gdn_prefill_tensormaps", 188 * 128, torch.device("cpu"))  # its TMA descriptor scratch
    while buf.data_ptr() % 128:  # grown until aligned, as a CUDA allocation would be
        buf = _get_cache_buf("gdn_prefill_tensormaps", buf.numel() + 64, torch.device("cpu"))
    q, k, v, o = (_aligned((tokens, heads, 128), torch.bfloat16) for _ in range(4))
    state = _aligned((1, heads, 128, 128), torch.float32)
    return chunk_gated_delta_rule_sm120(o, state, q, k, v, None, None, None, torch.tensor([0, tokens]), 128 ** -0.5)


def engine(model: str, ms: list[int], max_num_tokens: int) -> dict[str, Any]:
    """Serve ``model`` for these m the way vLLM 0.34 does: MoE layers, then dense layers."""
    from flashinfer.fused_moe.utils import get_hybrid_num_tokens_buckets

    from cute_diskcache.prewarm import models
    from cute_diskcache.flashinfer_sites import Dispatcher

    out: dict[str, Any] = {"moe_m": 0, "dense_calls": 0, "tuner_tactics": 0}
    if models.is_moe(models.load_config(model)[0]):
        s = models.moe_shape(model)
        d = Dispatcher(s.num_experts, s.top_k, s.hidden_size, s.intermediate_size, max_num_tokens=max_num_tokens,
                       num_local_experts=s.num_local_experts, activation=s.activation, quant_mode=s.quant_mode)
        for m in ms:
            d.run(m)
            out["moe_m"] += 1
    dense = models.dense_shape(model)
    for lin in dense.linears:
        for m in ms:
            try:
                mm_fp4_as_vllm(m, lin.n, lin.k)
            except Exception:  # the launch, without a GPU
                pass
            out["dense_calls"] += 1
        for bucket in get_hybrid_num_tokens_buckets(max_num_tokens):
            out["tuner_tactics"] += tuner_candidates(bucket, lin.n, lin.k)
    return out


def fmha(kind: str) -> Any:
    """The SM120 FP8 FMHA's compile (flashinfer's natively cached kernel): 32 q / 8 kv heads, d=128, causal."""
    import torch
    from flashinfer.cute_dsl.attention.fmha.sm120 import compile as fmha_compile

    args = (torch.float8_e4m3fn, torch.bfloat16, 32, 8, 128, True, 64, 128)
    if kind == "ragged":
        return fmha_compile.compile_sm120_fmha_fp8_ragged_kernel(*args, torch.device("cpu"))
    return fmha_compile.compile_sm120_fmha_fp8_paged_kernel(*args, 16, torch.device("cpu"))


SITES: dict[str, Callable[[argparse.Namespace], Any]] = {
    "b12x_fp4": lambda a: mm_fp4_as_vllm(a.m, a.n, a.k),
    "b12x_fp4_f16": lambda a: mm_fp4_as_vllm(a.m, a.n, a.k, __import__("torch").float16),
    "b12x_mxfp8": lambda a: mm_mxfp8(a.m, a.n, a.k),
    "sm12x_cute": lambda a: sm12x_cute(a.m, a.n, a.k),
    "fmha_ragged": lambda a: fmha("ragged"),
    "fmha_paged": lambda a: fmha("paged"),
    "bf16_fp4_gemm": lambda a: bf16_fp4("gemm", a.m, a.n, a.k),
    "bf16_fp4_gemv": lambda a: bf16_fp4("gemv", 1, a.n, a.k),
    "msa_topk": lambda a: msa("topk"),
    "msa_combine": lambda a: msa("combine"),
    "msa_union": lambda a: msa("union"),
    "msa_decode": lambda a: msa_op("decode"),
    "msa_decode_b3": lambda a: msa_op("decode", batch=3),
    "msa_decode_h16": lambda a: msa_op("decode", heads=16),
    "msa_proxy": lambda a: msa_op("proxy"),
    "msa_proxy_fp4": lambda a: msa_op("proxy_fp4"),
    "msa_prefill": lambda a: msa_prefill(),
    "gdn_prefill": lambda a: gdn_prefill(),
}


def drive_sites(drivers: dict[str, Callable[[Any], Any]], args: Any) -> dict[str, Any]:
    """Import flashinfer (its one-off torch._dynamo import outside the timings), then run each site
    named in ``args.sites``: seconds and the error its launch raised (without a GPU: expected)."""
    import flashinfer  # noqa: F401
    from flashinfer.cute_dsl.utils import current_cuda_stream

    current_cuda_stream()
    sites: dict[str, Any] = {}
    for name in args.sites:
        t = time.perf_counter()
        try:
            drivers[name](args)
            error = None
        except Exception as exc:  # the launch without a GPU: expected, recorded
            error = f"{type(exc).__name__}: {str(exc)[:4000]}"
        sites[name] = {"seconds": time.perf_counter() - t, "error": error}
    return sites


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="rtx-pro-6000")
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--engine", help="serve this model (bundled name or config path) as vLLM would")
    ap.add_argument("--ms", default="1,2,3", help="--engine: the batch sizes to serve")
    ap.add_argument("--max-num-tokens", type=int, default=64)
    ap.add_argument("sites", nargs="*")
    args = ap.parse_args(argv)

    import cute_diskcache

    cute_diskcache.install(target=args.target)
    from cute_diskcache.core.cache import default_cache

    sites = drive_sites(SITES, args)
    served = engine(args.engine, [int(v) for v in args.ms.split(",")], args.max_num_tokens) if args.engine else None
    print(json.dumps({"sites": sites, "engine": served, "events": default_cache().events,
                      "counters": cute_diskcache.counters()}), flush=True)
    return 0


if __name__ == "__main__":
    from cute_diskcache import fast_exit

    fast_exit.end(main())  # as our own commands end: after the exit handlers, without the teardown's collections
