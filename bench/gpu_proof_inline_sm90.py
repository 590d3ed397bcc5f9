"""flashinfer 0.7.4's inline sm12x compile sites on a real GPU: reloaded kernels run and agree.

The expert-parallel MoE's combine kernels (``moe_ep/kernel_src/sm120``: top-k reduce, gated and
persistent top-k reduce, rank-local combine, and the swap-AB drop's top-k reduce) are compiled
inline, from live CUDA tensors, inside functions flashinfer imports under ``sys.path`` names; no
CPU box can drive them (they refuse non-CUDA tensors). They are CUDA-core kernels, so on the
lent H200 they compile for its sm_90a and run. Per site:

1. a cold process (empty cache) calls flashinfer's own compile function with CUDA tensors,
   launches the kernel the way flashinfer's launcher does and keeps the output;
2. a fresh process does the same: the cache must hit (0 compiles, counted by the cache and by the
   DSL's compile entry point) and the output must be bitwise equal to the cold one's, and close
   to a torch reference (bf16 top-k weighted sum).

Run on the device machine after ``../shared/device/stage.sh`` with flashinfer 0.7.4 staged:
``python3 bench/gpu_proof_inline_sm90.py --out bench/results/gpu_proof_inline_sm90.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_harness as H  # noqa: E402

SITES = ("split_topk_reduce", "split_gated_topk_reduce", "split_persistent_topk_reduce", "split_rank_local_combine",
         "swapab_topk_reduce")
T, K, HIDDEN = 8, 4, 2048


def _count_compiles() -> list[int]:
    """Count the DSL's real compiles (below any cache), as tests/conftest.py does."""
    from cutlass.base_dsl.compiler import CompileCallable

    seen = [0]
    real = CompileCallable._compile

    def _compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        return real(self, *args, **kwargs)

    CompileCallable._compile = _compile
    return seen


def _inputs(torch: Any, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    combine = torch.randn(T, K, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    score = torch.rand(T, K, device="cuda", generator=g, dtype=torch.float32)
    return {"combine": combine, "score": score}


def _reference(torch: Any, x: dict[str, Any]) -> Any:
    return (x["combine"].float() * x["score"][:, :, None]).sum(1)


def _run_site(name: str) -> dict[str, Any]:
    import torch
    import cuda.bindings.driver as cuda

    from flashinfer.moe_ep.kernel_src.sm120.split_cutedsl_megakernel.shim._paths import bootstrap_paths

    x = _inputs(torch)
    out = torch.zeros(T, HIDDEN, device="cuda", dtype=torch.bfloat16)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    ready = torch.ones(T, K, device="cuda", dtype=torch.int32)
    t0 = time.perf_counter()
    if name.startswith("split_"):
        bootstrap_paths()
        from moe_sm120_mxfp4mxfp8_split import kernel_combine_reduce as cr

        if name == "split_topk_reduce":
            plan = cr.compile_topk_reduce(x["combine"], out, x["score"], stream=stream)
            seconds = time.perf_counter() - t0
            launch_error = _try(lambda: cr.launch_compiled_topk_reduce(*plan, synchronize=True))
        elif name == "split_gated_topk_reduce":
            compiled = cr.compile_gated_topk_reduce(x["combine"], out, ready, x["score"], stream=stream)
            seconds = time.perf_counter() - t0
            launch_error = _try(lambda: _launch_all(compiled))
        elif name == "split_persistent_topk_reduce":
            counter = torch.zeros(1, device="cuda", dtype=torch.int32)
            compiled = cr.compile_persistent_topk_reduce(x["combine"], out, ready, counter, x["score"], blocks=4, stream=stream)
            seconds = time.perf_counter() - t0
            launch_error = _try(lambda: _launch_all(compiled))
        else:
            from moe_sm120_mxfp4mxfp8_split import kernel_rank_local_combine as rl

            ids = torch.arange(T * K, device="cuda", dtype=torch.int32).reshape(T, K) % 8
            flags = torch.ones(T + 1, 2, device="cuda", dtype=torch.int32)
            compiled, runtime = rl.compile_rank_local_combine(x["combine"], flags, out, ids, world_size=2,
                                                              num_experts_per_rank=4, stream=stream)
            seconds = time.perf_counter() - t0
            launch_error = _try(lambda: (compiled(**runtime), torch.cuda.synchronize()))
            return {"compile_or_load_s": seconds, "out": out, "reference": None, "launch_error": launch_error}
    else:
        from flashinfer.moe_ep.kernel_src.sm120.swapab_cutedsl_megakernel.shim import _paths as swap_paths

        swap_paths.bootstrap_paths() if hasattr(swap_paths, "bootstrap_paths") else None
        from moe_sm120_mxfp8_swapab import topk_reduce as tr

        plan = tr.compile_topk_reduce(x["combine"], out, x["score"], stream=stream)
        seconds = time.perf_counter() - t0
        launch_error = _try(lambda: tr.launch_compiled_topk_reduce(*plan, synchronize=True))
    return {"compile_or_load_s": seconds, "out": out, "reference": _reference(torch, x), "launch_error": launch_error}


def _try(launch: Any) -> str | None:
    """Launch as flashinfer does; on a GPU the kernel has no image for, the error (same cold and warm)."""
    try:
        launch()
        __import__("torch").cuda.synchronize()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:600]}"


def _launch_all(compiled: Any) -> None:
    """flashinfer's gated/persistent reduce return (compiled, *cute args, stream)."""
    import torch

    if isinstance(compiled, tuple):
        compiled[0](*compiled[1:])
    else:
        raise TypeError(f"unexpected compile result {type(compiled).__name__}")
    torch.cuda.synchronize()


def child(site: str) -> None:
    import cute_diskcache

    cute_diskcache.install()
    import flashinfer  # noqa: F401  (the hook attaches as flashinfer imports)

    compiles = _count_compiles()
    res: dict[str, Any] = {"site": site}
    res["arch"] = os.environ.get("CUTE_DSL_ARCH")
    try:
        ran = _run_site(site)
        out = ran["out"]
        res["compile_or_load_s"] = round(ran["compile_or_load_s"], 4)
        res["launch_error"] = ran["launch_error"]
        if ran["launch_error"] is None:
            res["out_sha256"] = H.sha(out.cpu().view(-1).view(dtype=__import__("torch").int16).numpy().tobytes())
        if ran["reference"] is not None and ran["launch_error"] is None:
            res["max_abs_err_vs_torch"] = float((out.float() - ran["reference"]).abs().max())
        res["out_nonzero"] = bool(out.abs().sum() > 0)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
    H.emit_with_cache(res, compiles[0])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--out")
    ap.add_argument("--sites", default=",".join(SITES))
    ap.add_argument("--arch", default="sm_120a")
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return 0
    root = Path(tempfile.mkdtemp(prefix="cdc-inline-"))
    env = dict(os.environ, CUTE_DISKCACHE_DIR=str(root), FLASHINFER_B12X_DISK_CACHE="1")
    # sm120 kernels (F32x2 intrinsics): NVVM refuses them for the H200's sm_90a, so they are
    # compiled for sm_120a here, from live CUDA tensors, and their launch fails on this GPU.
    env["CUTE_DSL_ARCH"] = args.arch
    report: dict[str, Any] = {"versions": H.versions(), "device": H.device_info(), "sites": {}}
    for site in args.sites.split(","):
        cold = H.spawn(__file__, ["--child", site], env=env, timeout=150)
        warm = H.spawn(__file__, ["--child", site], env=env, timeout=150)
        verdict = {
            "cold_compiled_once": cold.get("dsl_compiles") == 1 and [e[1] for e in cold.get("events", [])] == ["miss"],
            "warm_compiled_nothing": warm.get("dsl_compiles") == 0 and [e[1] for e in warm.get("events", [])] == ["hit"],
            # ran (sm_90a): the outputs are bitwise equal; sm_120a on this GPU: the launch of the
            # loaded kernel fails exactly as the compiled one's did (it was bound and called alike)
            "same_result": (cold.get("out_sha256") == warm.get("out_sha256") if cold.get("out_sha256")
                            else bool(cold.get("launch_error")) and cold.get("launch_error") == warm.get("launch_error")),
            "no_other_error": not cold.get("error") and not warm.get("error"),
        }
        report["sites"][site] = {"cold": cold, "warm": warm, "verdict": verdict}
        print(site, json.dumps(verdict), "cold", cold.get("compile_or_load_s"), "warm", warm.get("compile_or_load_s"),
              "err", cold.get("max_abs_err_vs_torch"), (cold.get("error") or cold.get("launch_error") or "")[:200],
              (warm.get("error") or warm.get("launch_error") or "")[:200], flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
