"""What our wrappers add to a call flashinfer answers from its own in-process memo.

flashinfer's dense GEMM runners call their kernel getter or compile helper on every GEMM (for a
serving engine: every linear layer of every step); once the kernel is in memory, flashinfer
answers from a dict. Replacing those functions must keep that cheap. For the BF16 x FP4 getter
and the b12x FP4 compile helper, after one call has put the kernel in memory, this times
``--calls`` repeat calls through our wrapper and through flashinfer's function, side by side.

Run with the flashinfer 0.7.4 interpreter (``scripts/make_fi074_venv.sh``), no GPU needed:
    .venv-fi074/bin/python bench/memo_hit_overhead.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


def _per_call_us(f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], calls: int) -> float:
    f(*args, **kwargs)
    t = time.perf_counter()
    for _ in range(calls):
        f(*args, **kwargs)
    return (time.perf_counter() - t) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    os.environ.setdefault("CUTE_DISKCACHE_DIR", tempfile.mkdtemp(prefix="cdc-memo-bench-"))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import cute_diskcache

    cute_diskcache.install(target="rtx-pro-6000")
    import fi074_dense_driver as driver
    import torch
    from flashinfer.gemm import gemm_base
    from flashinfer.gemm import gemm_bf16_fp4_cute_dsl as bf16

    getter = bf16._get_cute_dsl_bf16_fp4_gemm
    g_args = ((16, 64, 128), torch.bfloat16, torch.bfloat16, (1, 2, 1), 1, 1)
    g_kwargs = dict(enable_pdl=True, tile_swizzle=1, k_splits=4, occupancy=1)

    helper = gemm_base._compile_block_scaled_gemm
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def spy(*a: Any, **k: Any) -> Any:
        captured.append((a, k))
        return helper(*a, **k)

    gemm_base._compile_block_scaled_gemm = spy
    try:
        driver.mm_fp4_as_vllm(16, 2048, 4096)  # compiles (or loads) one b12x kernel; the launch fails without a GPU
    except Exception:
        pass
    gemm_base._compile_block_scaled_gemm = helper
    h_args, h_kwargs = captured[0]

    print(f"# repeat calls answered from memory, us per call (mean of {args.calls}); flashinfer 0.7.4, rtx-pro-6000 profile")
    print(f"{'function':<46} {'ours':>8} {'flashinfer':>11} {'added':>8}")
    for name, ours, theirs, a, k in (("_get_cute_dsl_bf16_fp4_gemm (BF16 x FP4)", getter, getter.__wrapped__, g_args, g_kwargs),
                                     ("_compile_block_scaled_gemm (b12x FP4)", helper, helper.__wrapped__, h_args, h_kwargs)):
        o, t = _per_call_us(ours, a, k, args.calls), _per_call_us(theirs, a, k, args.calls)
        print(f"{name:<46} {o:>8.2f} {t:>11.2f} {o - t:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
