"""Owns prewarm's SGLang side: which FA4 kernels SGLang's decode on sm12x compiles, planned by SGLang.

With ``--attention-backend fa4`` on a capability-12 card, SGLang's FlashAttention backend captures a
CUDA graph per decode batch size and calls ``flash_attn_v4_sm120.flash_attn_with_kvcache`` in each
(``flashattention_backend.py::forward_decode``): q of ``(bs, heads, head_dim)``, the paged KV cache,
``cu_seqlens_q`` of ``bs + 1``, ``max_seqlen_q=1`` and, because the SM12x runtime policy decodes
with a static bound (``decode_uses_static_max_seqlen_k``), ``max_seqlen_k`` = the context length;
``num_splits`` is the policy's ``decode_num_splits``. SGLang's SM120 forward host then plans the
kernel (tiles, split-KV from the card's SM count and memory) and compiles it and, when it splits,
the combine kernel. This module makes those calls under torch's fake tensor mode (SGLang's own way
to compile FA4 without running it), for a target profile: every kernel the engine's decode capture
compiles, by SGLang's own planning. The batch sizes are SGLang's too
(``arg_groups/cuda_graph_hook.py::generate_decode_cuda_graph_batch_sizes``).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any


@dataclasses.dataclass(frozen=True)
class Attention:
    """One rank's attention layer as SGLang's FA4 decode sees it."""

    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    context_length: int


def attention_of(config: dict[str, Any], tp: int, page_size: int, context_length: int | None) -> Attention:
    """A model config's per-rank attention (heads split over ``tp``, KV heads replicated below one per rank)."""
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    if heads % tp:
        raise ValueError(f"{heads} attention heads do not split over --tp-size {tp}")
    context = int(context_length or config.get("max_position_embeddings") or 0)
    if context <= 0:
        raise ValueError("the model config has no max_position_embeddings: pass --context-length")
    return Attention(heads // tp, max(1, kv // tp), head_dim, page_size, context)


def default_max_bs(total_memory: int, tp: int, max_running_requests: int | None) -> int:
    """SGLang's default decode capture bound for a card of ``total_memory`` bytes
    (``arg_groups/memory_hook.py::handle_gpu_memory_settings``: by GPU memory and TP size, then
    no more than ``--max-running-requests``)."""
    gib = total_memory / (1 << 30)
    bounds = ((20, 8, 8), (35, 48, 160), (60, 32, 160), (90, 256, 512), (160, 256, 512))
    max_bs = next((small if tp < 4 else large for limit, small, large in bounds if gib < limit), 512)
    return min(max_bs, max_running_requests) if max_running_requests else max_bs


def capture_sizes(max_bs: int, max_running_requests: int | None = None) -> list[int]:
    """SGLang's decode CUDA-graph batch sizes up to ``max_bs`` (no speculative decoding, padding on),
    from SGLang's own generator, then no more than ``--max-running-requests`` (``get_batch_sizes_to_capture``)."""
    from sglang.srt.arg_groups.cuda_graph_hook import generate_decode_cuda_graph_batch_sizes

    view = types.SimpleNamespace(disable_cuda_graph_padding=False, speculative_algorithm=None, _resolved_overrides=())
    sizes = generate_decode_cuda_graph_batch_sizes(view, max_bs)
    if max_running_requests:
        sizes = [bs for bs in sizes if bs <= max_running_requests] + ([max_running_requests] if max_bs > max_running_requests else [])
    return sorted(set(sizes))


def decode(att: Attention, bs: int, fake: bool = True) -> None:
    """SGLang's FA4 decode call for one captured batch size: on fake tensors (compiles, never
    launches), or on real CUDA zeros (``fake=False``: a GPU box checking what the CPU planned)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sglang.kernels.ops.attention import flash_attention_v4_sm120 as fa4

    policy = fa4.get_flash_attention_v4_sm120_runtime_policy(device_capability=torch.cuda.get_device_capability(),
                                                             deterministic=False)
    pages_per_seq = math.ceil(att.context_length / att.page_size)
    with FakeTensorMode() if fake else contextlib.nullcontext():
        def empty(*shape: int, dtype: Any = torch.int32) -> Any:
            return (torch.empty if fake else torch.zeros)(*shape, dtype=dtype, device="cuda")

        cache = (bs * pages_per_seq, att.page_size, att.kv_heads, att.head_dim)
        fa4.flash_attn_with_kvcache(q=empty(bs, att.heads, att.head_dim, dtype=torch.bfloat16),
                                    k_cache=empty(*cache, dtype=torch.bfloat16), v_cache=empty(*cache, dtype=torch.bfloat16),
                                    page_table=empty(bs, pages_per_seq), cache_seqlens=empty(bs), cu_seqlens_q=empty(bs + 1),
                                    max_seqlen_q=1, max_seqlen_k=att.context_length, softmax_scale=att.head_dim ** -0.5,
                                    causal=True, window_size=(-1, -1), softcap=0.0, num_splits=policy.decode_num_splits)
