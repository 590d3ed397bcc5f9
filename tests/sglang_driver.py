"""Child of tests/test_sglang.py, run in the SGLang venv: SGLang 0.5.23's own FA4 path on sm12x.

Drives the calls SGLang's FlashAttention backend makes with ``--attention-backend fa4`` on a
capability-12 card (``srt/layers/attention/flashattention_backend.py``: the SM12x module
``kernels/ops/attention/flash_attention_v4_sm120``, its runtime policy, ``flash_attn_with_kvcache``
on a paged KV cache for decode), under torch's fake tensor mode, SGLang's own way of compiling
FA4 without running it (``flash_attn/cute/testing.py::maybe_fake_tensor_mode``), for an RTX PRO
6000 (target profile). Everything below the call is SGLang's: its SM120 forward host plans the
kernel (tiles, split-KV), its interface builds the kernel object and calls ``cute.compile``.

Prints one JSON line: our counters, whether SGLang's persistent FA4 cache stands aside, how many
object files SGLang's own cache loaded into the process, and the files in SGLang's directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import cute_diskcache

cute_diskcache.install(target="rtx-pro-6000")


def main() -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sglang.kernels.jit import cute_aot_cache
    from sglang.kernels.ops.attention import flash_attention_v4_sm120 as fa4
    from sglang.kernels.ops.attention.flash_attn.cute import interface

    try:
        from cute_diskcache.sglang_sites import native
    except ImportError:  # a checkout without the SGLang adapter (the tests' old-code runs)
        native = None

    policy = fa4.get_flash_attention_v4_sm120_runtime_policy(device_capability=torch.cuda.get_device_capability(),
                                                             deterministic=False)
    batch, heads, kv_heads, head_dim, page, pages = (int(v) for v in os.environ.get("SGLANG_DRIVER_SHAPE", "4,32,8,128,64,64").split(","))
    with FakeTensorMode():
        q = torch.empty(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        k_cache = torch.empty(pages, page, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.empty(pages, page, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        page_table = torch.empty(batch, pages // batch, dtype=torch.int32, device="cuda")
        cache_seqlens = torch.empty(batch, dtype=torch.int32, device="cuda")
        cu_seqlens_q = torch.empty(batch + 1, dtype=torch.int32, device="cuda")
        fa4.flash_attn_with_kvcache(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, cache_seqlens=cache_seqlens,
                                    cu_seqlens_q=cu_seqlens_q, max_seqlen_q=1, max_seqlen_k=page * (pages // batch),
                                    softmax_scale=head_dim ** -0.5, causal=True, num_splits=policy.decode_num_splits)
    aot = Path(os.environ["SGLANG_CUTE_AOT_CACHE_DIR"])
    print(json.dumps({
        "counters": cute_diskcache.counters(),
        "standing_aside": native.standing_aside(interface) if native else None,
        "sglang_loaded": len(cute_aot_cache._loaded_modules),
        "sglang_files": sorted(p.relative_to(aot).as_posix() for p in aot.rglob("*.o")) if aot.is_dir() else [],
        "num_splits": policy.decode_num_splits,
    }))


if __name__ == "__main__":
    from cute_diskcache import fast_exit

    fast_exit.end(main())  # as our own commands end: after the exit handlers, without the teardown's collections
