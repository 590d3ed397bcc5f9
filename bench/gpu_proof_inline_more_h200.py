"""flashinfer 0.7.4's inline sm12x sites that need a live CUDA device, compiled for sm_120a on the H200.

GDN's SM120 fused decode zeroes its GEMV partials with a driver memset (``cuMemsetD32Async``)
before it compiles, and the SM120 KDA prefill encodes TMA descriptors (``cuTensorMapEncodeTiled``)
and uploads them, under ``torch.cuda.device``: neither gets to its compile without the NVIDIA
driver, so no CPU box drives them. Here they get live CUDA tensors and compile for sm_120a
(``CUTE_DSL_ARCH``); the launch after the compile or load fails on this sm_90 GPU
(``cudaErrorNoKernelImageForDevice``), the same way cold and warm.

Sites, each through the flashinfer function that holds the compile or its caller:

* ``gdn_decode``: ``gdn_fused_decode_cutedsl_sm120_pdl.execute`` with the registry's second
  geometry (hidden 2048, 16 qk / 32 v heads, d 128, conv width 4, SD pool), batch 1. Its public
  op routes by the device's compute capability, so on this GPU it would never pick the kernel.
* ``kda_fwd``, ``kda_fused``: ``run_kda_prefill_sm120(variant="decomp" | "fused")`` (1 x 64
  tokens, 2 heads); ``kda_prepare``, ``kda_recurrence``: ``decomp.launch_prepare`` and
  ``decomp.launch_recurrence``, the only callers of the two device launchers (``run`` hands both
  kernels to the one fused entry of ``kda_fwd``). KDA refuses any device but compute capability
  12.0, so for these sites the capability torch reports is stood in (12.0; everything else is
  the H200's); each process gets its own flashinfer workspace, so flashinfer's own disk cache
  (KDA's fused entries are built through it) cannot answer first.

Per site a cold process (empty cache) then a fresh one; compiles are counted at the DSL's compile
entry. Run on the device machine after ``../shared/device/stage.sh`` with FLASHINFER_VERSION=0.7.4:
``python3 bench/gpu_proof_inline_more_h200.py --out bench/results/gpu_proof_inline_more_h200.json``.
flashinfer 0.7.4's wheel is 101 MB, over the 64 MiB one device call carries: repack it without
``flashinfer/data/{csrc,cccl,cutlass}`` and every ``*/csrc/`` (CUDA sources for its JIT, which
these sites do not use; 40 MB for the whole second part then).

Run on 2026-12-05 on the lent H200 (Python 3.12, torch 2.11+cu130, DSL 4.8.1), twice:

* on b1ac64c (``bench/results/gpu_proof_inline_more_h200_b1ac64c.json``): GDN's decode compiled in
  0.91 s, was persisted, and a fresh process hit it (0 compiles, the same launch error). The four
  KDA compiles were reached, compiled (0.8-2.4 s) and persisted, but a fresh process missed each
  again: their keys hold the TMA descriptors' device addresses, passed as ``cutlass.Int64``;
* with those keyed by type (3a7b116, reverted; ``..._3a7b116.json``): all five hit in a fresh
  process, but KDA's fwd and fused entries then failed: flashinfer's KDA requires a TVM-FFI
  callable and a hit hands it the calling-convention wrapper. Both fixes belong together.

Run on 2026-12-05 on the lent H100 (Python 3.12, torch 2.11+cu130, DSL 4.8.1) on 6311e54, with both
fixes in (issue 28: DSL integers keyed by type, and a hit is an instance of the compile's class):
``bench/results/gpu_proof_inline_more_h100_issue28.json``. All five sites compiled cold (GDN 0.52 s,
KDA fwd 2.40 s, fused 2.21 s, prepare 1.73 s, recurrence 0.50 s), and each fresh process made 0
compiles, hit in 0.8-2.8 ms and got the same launch result (``cudaErrorNoKernelImageForDevice``:
an sm_120a kernel on an sm_90 GPU) as the cold one.
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
from gpu_proof_inline_sm90 import _count_compiles, _try  # noqa: E402

SITES = ("gdn_decode", "kda_fwd", "kda_fused", "kda_prepare", "kda_recurrence")
#: the inline table's site names (flashinfer.<family>.<kind>)
NAMES = {"gdn_decode": "flashinfer.gdn.gdn_decode", "kda_fwd": "flashinfer.kda.kda_fwd",
         "kda_fused": "flashinfer.kda.kda_fused", "kda_prepare": "flashinfer.kda.kda_prepare",
         "kda_recurrence": "flashinfer.kda.kda_recurrence"}


def _stand_in_sm120() -> None:
    """torch answers compute capability 12.0 for the device (KDA's gate); the rest is the H200's."""
    import torch

    real = torch.cuda.get_device_properties

    class Props:
        def __init__(self, props: Any) -> None:
            self._props = props
            self.major, self.minor = 12, 0

        def __getattr__(self, name: str) -> Any:
            return getattr(self._props, name)

    torch.cuda.get_device_properties = lambda device=None: Props(real(device))
    torch.cuda.get_device_capability = lambda device=None: (12, 0)


def gdn_decode() -> Any:
    import torch
    from flashinfer.gdn_kernels.experimental.kernel import gdn_fused_decode_cutedsl_sm120_pdl as gdn

    b, hidden, h_q, hv, d, width, state_len, pool = 1, 2048, 16, 32, 128, 4, 3, 4
    qkv, n_ba, bf16, dev = (2 * h_q + hv) * d, 2 * hv, torch.bfloat16, "cuda"
    conv_pool = torch.zeros(pool, state_len, qkv, dtype=bf16, device=dev)  # SD: passed as its transposed view
    return lambda: gdn.execute(
        torch.randn(b, hidden, dtype=bf16, device=dev), torch.randn(hidden, n_ba, dtype=bf16, device=dev) * 0.02,
        torch.randn(b, qkv, dtype=bf16, device=dev), torch.randn(qkv, width, dtype=bf16, device=dev),
        torch.zeros(qkv, dtype=bf16, device=dev), conv_pool.transpose(1, 2), torch.zeros(hv, device=dev),
        torch.zeros(hv, dtype=bf16, device=dev), d ** -0.5, torch.zeros(pool, hv, d, d, device=dev),
        torch.arange(b, dtype=torch.int32, device=dev))


def _kda_inputs(t: int = 64, h: int = 2) -> dict[str, Any]:
    import torch

    bf16, dev = torch.bfloat16, "cuda"
    return {"q": torch.randn(1, t, h, 128, dtype=bf16, device=dev), "k": torch.randn(1, t, h, 128, dtype=bf16, device=dev),
            "v": torch.randn(1, t, h, 128, dtype=bf16, device=dev), "g": -torch.rand(1, t, h, 128, device=dev),
            "beta": torch.rand(1, t, h, dtype=bf16, device=dev), "A_log": torch.zeros(h, device=dev),
            "dt_bias": torch.zeros(h, 128, device=dev)}


def kda(kind: str) -> Any:
    import torch
    from flashinfer.kda_kernels import sm120_prefill as kda_mod
    from flashinfer.kda_kernels.sm120_prefill import decomp

    x = _kda_inputs()
    t, h = x["q"].shape[1], x["q"].shape[2]
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    if kind in ("kda_fwd", "kda_fused"):
        return lambda: kda_mod.run_kda_prefill_sm120(**x, lower_bound=-5.0, cu_seqlens=cu,
                                                     variant="decomp" if kind == "kda_fwd" else "fused")
    workspace = decomp.allocate_prepare_workspace(h, 1, "cuda")
    if kind == "kda_prepare":
        return lambda: decomp.launch_prepare(q=x["q"], k=x["k"], g=x["g"], beta=x["beta"], scale=128 ** -0.5,
                                             A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0,
                                             workspace=workspace, cu_seqlens=cu)
    return lambda: decomp.launch_recurrence(workspace=workspace, v=x["v"], out=torch.empty_like(x["v"]), cu_seqlens_i32=cu,
                                            cu_chunks_i32=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                                            cu_seqlens_host=[0, t], cu_chunks_host=[0, 1], heads=h, total_tokens=t,
                                            total_chunks=1)


def child(site: str) -> None:
    if site.startswith("kda"):
        _stand_in_sm120()
    import cute_diskcache

    cute_diskcache.install()
    import flashinfer  # noqa: F401  (the hook attaches as flashinfer imports)

    compiles = _count_compiles()
    res: dict[str, Any] = {"site": site, "arch": os.environ.get("CUTE_DSL_ARCH")}
    try:
        call = gdn_decode() if site == "gdn_decode" else kda(site)
        t0 = time.perf_counter()
        res["launch_error"] = _try(call)  # the compile or load, then the launch (which fails on sm_90)
        res["call_s"] = round(time.perf_counter() - t0, 4)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
    H.emit_with_cache(res, compiles[0])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--out")
    ap.add_argument("--sites", default=",".join(SITES))
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return 0
    report: dict[str, Any] = {"versions": H.versions(), "device": H.device_info(), "sites": {}}
    for site in args.sites.split(","):
        root = Path(tempfile.mkdtemp(prefix="cdc-inline-more-"))
        env = dict(os.environ, CUTE_DISKCACHE_DIR=str(root), CUTE_DSL_ARCH="sm_120a")
        runs = []
        for _ in ("cold", "warm"):  # each with its own flashinfer workspace: its disk cache never answers
            env["FLASHINFER_WORKSPACE_BASE"] = tempfile.mkdtemp(prefix="cdc-fi-ws-")
            runs.append(H.spawn(__file__, ["--child", site], env=env, timeout=280))
        cold, warm = runs
        mine = NAMES[site]
        verdict = {
            "cold_compiled_and_persisted": bool(cold.get("dsl_compiles")) and
            [e[1] for e in cold.get("events", []) if e[0] == mine][:1] == ["miss"] and cold.get("counters", {}).get("writes", 0) >= 1,
            "warm_compiled_nothing": warm.get("dsl_compiles") == 0 and bool([e for e in warm.get("events", []) if e[0] == mine])
            and all(e[1] == "hit" for e in warm.get("events", [])),
            "same_launch_result": bool(cold.get("launch_error")) and cold.get("launch_error") == warm.get("launch_error"),
            "no_other_error": not cold.get("error") and not warm.get("error"),
        }
        report["sites"][site] = {"cold": cold, "warm": warm, "verdict": verdict}
        print(site, json.dumps(verdict), "cold", cold.get("events"), cold.get("dsl_compiles"), "warm", warm.get("events"),
              warm.get("dsl_compiles"), "|", (cold.get("error") or cold.get("launch_error") or "")[:300], "|",
              (warm.get("error") or warm.get("launch_error") or "")[:300], flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
