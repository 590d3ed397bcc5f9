"""Child process for tests/test_inline_sites_more.py and bench/inline_sites_cpu.py: flashinfer 0.7.4's
inline sm12x sites that tests/fi074_dense_driver.py does not reach, driven through flashinfer's own
functions on a CPU box for a target profile.

Run with the 0.7.4 interpreter, never imported by pytest. Same report as fi074_dense_driver.py:
one JSON line with each call's error (the launch after a compile or load, where there is one,
fails without a GPU), the cache's events and counters.

flashinfer documents torch's fake tensor mode as a way to pre-compile its block-sparse attention
(``bsa_utils.testing.maybe_fake_tensor_mode``): under ``FakeTensorMode`` its SM120 forwards take
a fake stream and skip the launch. Fake tensors on ``cuda:0`` export DLPack as CUDA (global
memory, address 0), so the compile sees what a real card's tensors give it. Two stand-ins for
what a CPU-only torch lacks, both about the current device and neither read by the compile
(the target profile fixes the arch and answers the capability queries):
``torch.cuda.current_device()`` answers 0 (torch's ``__dlpack__`` of a CUDA tensor and the Sage
forward's device check ask it) and ``torch.cuda.device(...)`` is a no-op context.

Sites (each one call):
    bsa_fwd       ``bsa_attn_sm120_blk64_fwd``: bf16, 1 x 128 tokens, 8 heads (GQA 4), d=128, top-2 blocks
    bsa_sage_fwd  ``bsa_attn_sm120_blk64_sage_fwd(backend="cute_dsl")``: INT8 Q/K, FP8 V, 4 heads, d=128
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Callable


def _cpu_torch_stand_ins() -> None:
    """What a CPU-only torch cannot answer about the current CUDA device (see the module docstring)."""
    import torch

    if torch.cuda.is_available():  # a real device answers for itself
        return
    torch.cuda.current_device = lambda: 0
    torch.cuda.device = lambda _device=None: contextlib.nullcontext()


def bsa(kind: str) -> Any:
    """The SM120 block-sparse attention forwards on CUDA stand-in tensors, on their live path.

    The tensors are made under torch's ``FakeTensorMode`` (metadata only, on ``cuda:0``) and the
    forward is called outside it, with its outputs passed in (it would allocate them on the
    device): flashinfer then takes its live path (a ``CUstream`` from
    ``torch.cuda.current_stream()``, which the profile answers), the one a serving process
    compiles, rather than its fake-mode pre-compile path (a fake TVM-FFI stream: another
    signature, another key). The launch after the compile fails without a GPU.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashinfer.cute_dsl.sparse import bsa_attn_sm120 as bsa_mod

    i32, f32 = torch.int32, torch.float32
    with FakeTensorMode():
        def empty(*shape: int, dtype: Any) -> Any:
            return torch.empty(shape, dtype=dtype, device="cuda")

        if kind == "fwd":  # bf16, 1 x 128 tokens, 8 query heads over 2 KV heads, d=128, 2 blocks per query block
            b, s, h, hkv, d = 1, 128, 8, 2, 128
            args = (empty(b, s, h, d, dtype=torch.bfloat16), empty(b, s, hkv, d, dtype=torch.bfloat16),
                    empty(b, s, hkv, d, dtype=torch.bfloat16), empty(b, h, s // 64, 2, dtype=i32), 2)
            out = {"out": empty(b, s, h, d, dtype=torch.bfloat16), "lse": empty(b, h, s, dtype=f32)}
        else:  # Sage: INT8 Q/K, FP8 V in HDS layout, FP32 scales; 4 heads (MHA), d=128
            b, h, s, d = 1, 4, 128, 128
            blocks = s // 64
            args = (empty(b, h, s, d, dtype=torch.int8), empty(b, h, s, d, dtype=torch.int8),
                    empty(b, h, d, blocks * 64, dtype=torch.float8_e4m3fn), empty(b, h, -(-s // 128) * 4, dtype=f32),
                    empty(b, h, blocks, dtype=f32), empty(b, h, d, dtype=f32), empty(b, h, blocks, 2, dtype=i32), 2)
            out = {"out": empty(b, h, s, d, dtype=torch.bfloat16)}
    if kind == "fwd":
        return bsa_mod.bsa_attn_sm120_blk64_fwd(*args, **out)
    return bsa_mod.bsa_attn_sm120_blk64_sage_fwd(*args, backend="cute_dsl", **out)


def frost(kind: str) -> Any:
    """The frost low-latency MoE's SM120 grouped tensor-core decode (``warp_mma`` tactics), through
    the backend's ``runtime.execute`` as its runner's ``forward`` calls it, with the inputs its
    ``pack_inputs`` builds: 4 tokens, 8 experts, top-2, hidden 256, intermediate 128, SwiGLU,
    BF16 weights (``grouped``) or DeepSeek block-scaled FP8 weights (``deepseek_fp8``)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashinfer.fused_moe.api import ExpertConfig, MoEConfig, QuantConfig, QuantFormat, RoutingConfig
    from flashinfer.fused_moe.backends.frost_low_latency import runtime

    t, e, k, h, i = 4, 8, 2, 256, 128
    bf16, f32, fp8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
    weight = QuantFormat.BF16 if kind == "grouped" else QuantFormat.DeepSeekFp8
    config = MoEConfig(RoutingConfig(num_experts=e, top_k=k), QuantConfig(weight=weight), ExpertConfig(intermediate_size=i))
    with FakeTensorMode():
        def empty(*shape: int, dtype: Any = bf16) -> Any:
            return torch.empty(shape, dtype=dtype, device="cuda")

        x, ids, scores = empty(t, h), empty(t, k, dtype=torch.int32), empty(t, k, dtype=f32)
        if kind == "grouped":  # the runner's _pack_float16
            inputs = [x, ids, scores, empty(e, 2 * i, h), empty(e, h, i), empty(t * k, i), empty(t * k, h), empty(t, h),
                      False]
            return runtime.execute(inputs, config, ("warp_mma", 2, 2, 64))
        inputs = [x, empty(t, h, dtype=fp8), empty(h // 128, t, dtype=f32),  # deepseek_fp8.pack_inputs, BF16 input
                  empty(e, 2 * i, h, dtype=fp8), empty(e, 2 * i // 128, h // 128, dtype=f32),
                  empty(e, h, i, dtype=fp8), empty(e, h // 128, i // 128, dtype=f32), ids, scores,
                  empty(t * k, i, dtype=f32), empty(t * k, i, dtype=fp8), empty(i // 128, t * k, dtype=f32),
                  empty(t * k, h), empty(t, h), False]
        return runtime.execute(inputs, config, ("warp_mma", 2, 2, 64))


SITES: dict[str, Callable[[argparse.Namespace], Any]] = {
    "frost_grouped": lambda a: frost("grouped"),
    "frost_deepseek_fp8": lambda a: frost("deepseek_fp8"),
    "bsa_fwd": lambda a: bsa("fwd"),
    "bsa_sage_fwd": lambda a: bsa("sage"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="rtx-pro-6000")
    ap.add_argument("sites", nargs="*")
    args = ap.parse_args(argv)

    import cute_diskcache

    cute_diskcache.install(target=args.target)
    _cpu_torch_stand_ins()
    from cute_diskcache.core.cache import default_cache
    from fi074_dense_driver import drive_sites  # this script's directory is first on sys.path

    sites = drive_sites(SITES, args)
    print(json.dumps({"sites": sites, "events": default_cache().events, "counters": cute_diskcache.counters()}),
          flush=True)
    return 0


if __name__ == "__main__":
    from cute_diskcache import fast_exit

    fast_exit.end(main())  # as our own commands end: after the exit handlers, without the teardown's collections
