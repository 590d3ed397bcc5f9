"""First-call latency of flashinfer's sm12x fused MoE with and without a warm cute-diskcache.

On a real SM120/SM121 card (RTX 50xx, RTX PRO 6000, DGX Spark), for each m, in fresh processes:

* cold: empty cache root; the first ``B12xMoEWrapper.run`` compiles its kernel;
* warm: a new process on the same root; the first call loads it from disk;
* steady state: median of later calls in each process (must match: same kernel);
* the outputs of the cold and the warm process are compared bit for bit.

Weights are random NVFP4 (fixed seed), so the comparison exercises real data. Without such a
card the script says which device it found and runs the offline mode instead: the same
cold/warm comparison of compile vs load on a target profile (bench/cold_vs_warm.py).

    python bench/b12x_first_call.py [--model qwen3-30b-a3b] [--m 1 4 16 128] [--iters 20]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _sm12x_device() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            name = torch.cuda.get_device_name()
            return name if major == 12 else f"!{name} (sm_{major}{minor})"
    except Exception:
        pass
    return None


def child(args: argparse.Namespace) -> int:
    """One fresh engine start: build the wrapper, time the first and the steady calls for one m."""
    import cute_diskcache

    cute_diskcache.install()
    import torch
    from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout
    from flashinfer.fused_moe.cute_dsl.b12x_moe import B12xMoEWrapper

    from cute_diskcache.prewarm import models

    shape = models.moe_shape(args.model, tp=args.tp)
    E, k, n, top_k, m = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k, args.m
    gen = torch.Generator(device="cuda").manual_seed(1234)
    dev = "cuda"
    w1_rows = 2 * n if shape.activation != "relu2" else n

    def fp4(*size: int) -> torch.Tensor:
        return torch.randint(0, 256, size, dtype=torch.uint8, device=dev, generator=gen)

    def scales(rows: int, cols: int) -> torch.Tensor:
        m_pad = (rows + 127) // 128 * 128
        kb = ((cols // 16) + 3) // 4 * 4
        # e4m3 scale factors around 1.0 (0x30-0x40): finite, no overflow in the GEMMs.
        raw = torch.randint(0x30, 0x40, (E * m_pad * kb,), dtype=torch.uint8, device=dev, generator=gen)
        return convert_sf_to_mma_layout(raw.view(torch.float8_e4m3fn), m=rows, k=cols, num_groups=E)

    w1, w2 = fp4(E, w1_rows, k // 2), fp4(E, k, n // 2)
    w1_sf, w2_sf = scales(w1_rows, k), scales(k, n)
    alpha = torch.full((E,), 1e-2, dtype=torch.float32, device=dev)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev, generator=gen)
    ids = torch.randint(0, E, (m, top_k), dtype=torch.int32, device=dev, generator=gen)
    weights = torch.softmax(torch.randn(m, top_k, device=dev, generator=gen), dim=-1)
    wrapper = B12xMoEWrapper(
        num_experts=E, top_k=top_k, hidden_size=k, intermediate_size=n, use_cuda_graph=True,
        max_num_tokens=args.max_num_tokens, activation=shape.activation, swiglu_limit=shape.swiglu_limit,
    )

    def call() -> torch.Tensor:
        return wrapper.run(x, w1, w1_sf, w2, w2_sf, ids, weights, w1_alpha=alpha, w2_alpha=alpha, fc2_input_scale=torch.ones_like(alpha))

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    steady = []
    for _ in range(args.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        steady.append(start.elapsed_time(end))
    print(json.dumps({
        "m": m,
        "first_call_ms": first * 1e3,
        "steady_ms": statistics.median(steady),
        "output_sha256": hashlib.sha256(out.float().cpu().numpy().tobytes()).hexdigest(),
        "counters": cute_diskcache.counters(),
    }))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 128])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-num-tokens", type=int, default=4096)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "b12x_first_call.json"))
    args = ap.parse_args()
    if args.child:
        return child(args)
    device = _sm12x_device()
    if device is None or device.startswith("!"):
        found = "no CUDA device" if device is None else device[1:]
        print(f"found {found}: not an SM120/SM121 card; running the offline mode (target profile, compile vs load)")
        return subprocess.call([sys.executable, str(Path(__file__).parent / "cold_vs_warm.py"), "--m", *map(str, args.m)])
    print(f"device: {device}; model {args.model} tp={args.tp}")
    rows = []
    for m in args.m:
        with tempfile.TemporaryDirectory(prefix="cdc-first-call-") as root:
            env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}
            env["CUTE_DISKCACHE_DIR"] = root
            cmd = [sys.executable, __file__, "--child", "--model", args.model, "--tp", str(args.tp), "--m", str(m),
                   "--iters", str(args.iters), "--max-num-tokens", str(args.max_num_tokens)]
            runs = []
            for _ in ("cold", "warm"):
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.stderr.write(proc.stderr[-3000:])
                    return 1
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        cold, warm = runs
        row = dict(m=m, cold_first_ms=cold["first_call_ms"], warm_first_ms=warm["first_call_ms"],
                   cold_steady_ms=cold["steady_ms"], warm_steady_ms=warm["steady_ms"],
                   bitwise_equal=cold["output_sha256"] == warm["output_sha256"],
                   warm_compiles=warm["counters"]["compiles"])
        rows.append(row)
        print(f"m={m:<5} first call cold {row['cold_first_ms']:9.1f} ms  warm {row['warm_first_ms']:7.1f} ms  "
              f"steady {row['cold_steady_ms']:.3f} / {row['warm_steady_ms']:.3f} ms  bitwise equal: {row['bitwise_equal']}  "
              f"warm compiles: {row['warm_compiles']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=device, model=args.model, rows=rows), indent=1))
    return 0 if all(r["bitwise_equal"] and r["warm_compiles"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
