"""Child process for tests/test_flashinfer_074.py: one fresh "engine start" on flashinfer 0.7.4.

Run with the 0.7.4 interpreter (``$CUTE_DISKCACHE_FI074_PYTHON``), never imported by pytest.
It attaches the cache for a target profile before flashinfer is imported, drives each named
site once through flashinfer's own entry points on CPU tensors (the launch after the compile
fails without a GPU; its error is recorded), and prints one JSON line: the cache's events and
counters, per-site errors, the block-dim answers flashinfer holds, and how often we probed.

    python fi074_driver.py --target rtx-pro-6000 direct_micro w4a16 w4a4 fp8_gemm ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

SM12X = "flashinfer.fused_moe.cute_dsl.blackwell_sm12x"
E, K, M = 8, 1024, 16  # op and runner sites: experts, hidden, routed rows (intermediate: --n)
# Direct micro: E128 top-8 hidden 2048 intermediate 512 (n <= 512 takes the direct micro kernel).
# W4A16: 8 experts, top-4: flashinfer repacks W4A16 weights on the host, ~0.1 s per expert on CPU.
# native_micro: intermediate 768 > 512 takes moe_dispatch's MMA micro kernel, one of the three
# flashinfer caches natively (build_and_load_cute_dsl_kernel).
WRAPPER_SHAPES = {"nvfp4": (128, 8, 2048, 512), "w4a16": (8, 4, 1024, 256), "native_micro": (8, 2, 1024, 768)}
#: flashinfer's native-cache records (opt-out mode) of every wrapper run, in order.
NATIVE_EVENTS: list[dict[str, Any]] = []


def _ops(N: int) -> dict[str, Callable[[], Any]]:  # noqa: N803 - the intermediate size
    import importlib

    import torch

    f8, u8, i32 = torch.float8_e4m3fn, torch.uint8, torch.int32
    ind = torch.tensor([0] + [M // E * (i + 1) for i in range(E)], dtype=i32)
    z = torch.zeros

    def op(module: str, fn: str, *args: Any) -> Callable[[], Any]:
        return lambda: getattr(importlib.import_module(f"{SM12X}.{module}"), fn)(*args)

    a, a_sf, mx_a_sf = z(M, K, dtype=f8), z(K // 128, M), z(K // 512, M, dtype=i32)  # fp8 rows, blockwise / mx scales
    w13, w13_sf = z(E, 2 * N, K, dtype=f8), z(E, K // 128, 2 * N // 128)
    mx_w13, mx_w13_sf = z(E, 2 * N, K // 2, dtype=u8), z(E, K // 128, 2 * N, dtype=i32)
    fc2_tail = (ind, z(M, dtype=i32), z(M), M)  # m_indptr, src_token, pair_scales, num_tokens
    return {
        "fp8_fc1_act": op("moe_fp8_fc1_act", "cute_dsl_sm12x_fc1_act_fp8", a, a_sf, w13, w13_sf, ind),
        "fp8_fc1_act_q1": op("moe_fp8_fc1_act_q1", "cute_dsl_sm12x_fc1_act_q1_fp8", a, a_sf, w13, w13_sf, ind),
        "fp8_gemm": op("moe_fp8_gemm", "cute_dsl_sm12x_moe_gemm_fp8", a, a_sf, z(E, N, K, dtype=f8), z(E, K // 128, N // 128), ind),
        "fp8_fc2_finalize": op("moe_fp8_fc2_finalize", "cute_dsl_sm12x_fc2_finalize_fp8",
                               z(M, N, dtype=f8), z(N // 128, M), z(E, K, N, dtype=f8), z(E, N // 128, K // 128), *fc2_tail),
        "mxfp8_mxfp4_gemm": op("moe_mxfp8_mxfp4_gemm", "cute_dsl_sm12x_moe_gemm_mxfp8_mxfp4",
                               a, mx_a_sf, z(E, N, K // 2, dtype=u8), z(E, K // 128, N, dtype=i32), ind),
        "mxfp8_mxfp4_fc1_act": op("moe_mxfp8_mxfp4_fc1_act", "cute_dsl_sm12x_fc1_act_mxfp8_mxfp4", a, mx_a_sf, mx_w13, mx_w13_sf, ind),
        "mxfp8_mxfp4_fc1_act_q1": op("moe_mxfp8_mxfp4_fc1_act_q1", "cute_dsl_sm12x_fc1_act_q1_mxfp8_mxfp4", a, mx_a_sf, mx_w13, mx_w13_sf, ind),
        "mxfp8_mxfp4_fc2_finalize": op("moe_mxfp8_mxfp4_fc2_finalize", "cute_dsl_sm12x_fc2_finalize_mxfp8_mxfp4",
                                       z(M, N, dtype=f8), z(N // 512, M, dtype=i32), z(E, K, N // 2, dtype=u8), z(E, N // 128, K, dtype=i32),
                                       *fc2_tail),
    }


def _run_moe(module: str, fn: str, extra_scales: int, N: int) -> Callable[[], Any]:  # noqa: N803
    """run_moe_w4a4 / run_moe_w4a16 with T=4 tokens, top-4 of 8 experts, H=1024, I=N."""

    def go() -> Any:
        import importlib

        import torch

        T, H, I, TOPK = 4, K, N, 4  # noqa: E741
        pad = lambda a, b: (a + b - 1) // b * b  # noqa: E731
        u8 = torch.uint8
        args = [
            torch.zeros(T, H, dtype=torch.bfloat16),
            (torch.arange(T * TOPK, dtype=torch.int32) % E).view(T, TOPK),
            torch.zeros(T, TOPK),
            torch.zeros(E, 2 * I, H // 2, dtype=u8),
            torch.zeros(E, pad(2 * I, 128), pad(H // 16, 4), dtype=u8).view(torch.float8_e4m3fn),
            torch.ones(E),
            torch.zeros(E, H, I // 2, dtype=u8),
            torch.zeros(E, pad(H, 128), pad(I // 16, 4), dtype=u8).view(torch.float8_e4m3fn),
            torch.ones(E),
            *[torch.ones(1) for _ in range(extra_scales)],
            torch.zeros(T, H, dtype=torch.bfloat16),
        ]
        return getattr(importlib.import_module(f"{SM12X}.{module}"), fn)(*args)

    return go


def _wrapper(quant_mode: str, shape: str | None = None) -> Callable[[], Any]:
    def go() -> Any:
        from cute_diskcache import flashinfer_sites

        record = flashinfer_sites.Dispatcher(*WRAPPER_SHAPES[shape or quant_mode], max_num_tokens=256, quant_mode=quant_mode).run(1)
        NATIVE_EVENTS.extend(record["native"])
        if record["launch_error"] is None:
            return None
        raise RuntimeError(record["launch_error"])

    return go


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="rtx-pro-6000")
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--n", type=int, default=512, help="intermediate size of the op and runner sites")
    ap.add_argument("sites", nargs="*")
    args = ap.parse_args(argv)

    import cute_diskcache
    from cute_diskcache import activation

    if args.no_cache:
        activation.set_target(args.target)
    else:
        cute_diskcache.install(target=args.target)
    t0 = time.perf_counter()
    import flashinfer  # noqa: F401
    from flashinfer.cute_dsl.utils import current_cuda_stream

    current_cuda_stream()  # pays flashinfer's one-off torch._dynamo import outside the timings
    import_s = time.perf_counter() - t0

    from cute_diskcache import flashinfer_sites
    from cute_diskcache.core.cache import default_cache
    from cute_diskcache.flashinfer_sites import block_dim, native

    probes: list[int] = []
    real_probe = block_dim.probe_block_dim

    def counting_probe(compiled: Any, block_dim: int) -> Any:
        probes.append(block_dim)
        return real_probe(compiled, block_dim)

    block_dim.probe_block_dim = counting_probe
    drivers: dict[str, Callable[[], Any]] = {
        "direct_micro": _wrapper("nvfp4"),
        "w4a16": _wrapper("w4a16"),
        "native_micro": _wrapper("nvfp4", "native_micro"),
        "w4a4": _run_moe("moe_nvfp4_w4a4", "run_moe_w4a4", 2, args.n),
        "nvfp4_w4a16": _run_moe("moe_nvfp4_w4a16", "run_moe_w4a16", 0, args.n),
        **_ops(args.n),
    }
    sites: dict[str, Any] = {}
    for name in args.sites:
        t = time.perf_counter()
        try:
            drivers[name]()
            error = None
        except Exception as exc:  # the launch without a GPU: expected, recorded
            error = f"{type(exc).__name__}: {str(exc)[:6000]}"
        sites[name] = {"seconds": time.perf_counter() - t, "error": error}
    md = sys.modules.get(f"{SM12X}.moe_dispatch")
    direct = getattr(md, "_DIRECT_MICRO_KERNEL_CACHE", {}) if md else {}
    cache = default_cache()
    from flashinfer.jit.cute_dsl_core import _get_cute_dsl_version

    out = {
        "cute_diskcache_file": cute_diskcache.__file__,
        "flashinfer": flashinfer_sites.flashinfer_version(),
        "import_seconds": import_s,
        "sites": sites,
        "events": cache.events,
        "counters": cute_diskcache.counters() if not args.no_cache else None,
        "kernels": flashinfer_sites.kernel_cache_sizes(),
        "block_dim_accepts": [bool(v[1]) for v in direct.values()],
        "probes": probes,
        "native_events": NATIVE_EVENTS,
        "serving_native": native.serving(),
        # What flashinfer's native cache keys on of torch (its meta.json fingerprint).
        "native_torch_fingerprint": [p for p in _get_cute_dsl_version().split(";") if p.startswith("torch")],
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    from cute_diskcache import fast_exit

    fast_exit.end(main())  # as our own commands end: after the exit handlers, without the teardown's collections
