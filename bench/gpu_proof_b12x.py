#!/usr/bin/env python3
"""The b12x package's NVFP4 linear kernels on a real GPU against the CPU prewarm (issue 32 item 4b).

``prewarm MODEL --target CARD --linear-backend b12x`` plans and compiles on a box without a GPU,
from meta tensors and b12x's own planning (``b12x_sites/planning.py``). The question this script
answers: does an engine on a GPU, calling what vLLM 0.34's b12x warm-up calls with real CUDA
tensors, ask for the same kernels (the same keys) and get the same code (the same cubins)?

On the lent GPU (an H100 or H200, sm_90), for llama-3.1-8b-nvfp4's four linear shapes and the
token counts given, each child calls ``b12x.gemm.blockscaled.mm_nvfp4`` exactly as vLLM's
``_apply_b12x_nvfp4_linear`` does (activation and weight as packed FP4 with swizzled FP8 block
scales, ``intrinsics.swizzle_block_scale``; zeros: only shapes and dtypes reach a compile), with
the arch forced to sm_120a and torch's device answers standing in for the target card (compute
capability, SM count, name and shared memory of ``targets.get(CARD)``; streams, memory and the
driver stay the real GPU's). The compile goes through our hook; the launch that follows fails on
this sm_90 GPU (an sm_120a kernel), the same way every time.

``all`` (GPU): a cold child on an empty root (compiles, persists), a fresh child on that root (must
compile nothing), a fresh child on a copy of the CPU prewarm's root (``--cpu-root``: must compile
nothing either), then every device-built entry compared byte for byte with the CPU-built entry of
the same key (``gpu_harness.compare_entries``). Writes one JSON report.

Run (device, after ``../shared/device/stage.sh`` with ``DSL_VERSION=4.8.0`` and the b12x 1.5.1
wheel added to ``.dev/s2``; the CPU root prewarmed here with the same token counts)::

    python3 bench/gpu_proof_b12x.py all --cpu-root .dev/cpu_root --ms 1,8 --out $OUT/gpu_proof_b12x.json

Run on 2026-12-06 on the lent H100 (Python 3.12, torch 2.11+cu130, DSL 4.8.0, b12x 1.5.1 installed
``--no-deps``), the CPU root prewarmed on the 2-core x86_64 VM (Python 3.11, torch 2.13.0+cpu) with
``--m 1,8`` (8 jobs, 7 kernels: gate_up's 8-row call reuses its 1-row kernel):

* first (``bench/results/gpu_proof_b12x_h100_before.json``): the GPU compiled the same 7 kernels
  but under 7 other keys: every CPU-built entry missed. The miss explainer named why: the device
  fact (this script then stood in only for torch's answers; it now applies the profile as a GPU box
  does), ``NVIDIA_VISIBLE_DEVICES`` (set by the container runtime, read by b12x's code, keyed), and
  the source fingerprint (b12x's worker swaps ``compiler._call_cute_compile`` for a wrapper of
  ``compile_pool``'s, so what the compiler's globals reach differed). Both defects fixed in the key;
  tests: ``test_key.py::test_what_a_gpu_container_runtime_sets_is_no_key``,
  ``test_b12x.py::test_a_b12x_key_does_not_depend_on_what_else_the_process_set_up``.
* after (``bench/results/gpu_proof_b12x_h100.json``): cold 7 compiles (8.2 s of compile), a fresh
  process 0, and a fresh process on the CPU prewarm's root 0 compiles, 7 hits (22 ms of loads); the
  same 7 keys on both sides, every cubin and MLIR byte-identical (the host objects differ: each
  machine's host code), the same launch result (an sm_120a kernel on an sm_90 GPU) cold and warm.
* rerun on the code of stop 36 (``bench/results/gpu_proof_b12x_h100_rerun.json``, the lent H100,
  the same versions, the CPU root prewarmed on this code on the 2-core x86_64 EPYC VM): cold 7
  compiles (5.2 s of compile), warm 0, the CPU prewarm's root 0 compiles and 7 hits (16 ms of
  loads); the same 7 keys, cubins byte-identical, the same launch result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_harness as H  # noqa: E402
from gpu_proof_inline_sm90 import _count_compiles  # noqa: E402

MODEL = "llama-3.1-8b-nvfp4"
CARD = "rtx-pro-6000"


def _stand_in(card: str) -> None:
    """The card's profile applied as a GPU box applies one (``targets.apply(force=True)``: the arch,
    and the device facts our key and b12x's planning read), then torch's answers made to delegate
    to the real GPU for what the profile does not say, and the real streams given back, so the
    tensors, streams and driver stay the real GPU's."""
    import torch

    from cute_diskcache.keys import targets

    real = torch.cuda.get_device_properties
    real_stream = torch.cuda.current_stream
    p = targets.apply(card, force=True)
    torch.cuda.current_stream = real_stream

    class Props:
        def __init__(self, props: Any) -> None:
            self._props = props
            self.major, self.minor = p.capability
            self.multi_processor_count = p.sm_count
            self.name = p.device_name
            self.shared_memory_per_block_optin = p.max_shared_memory_per_block_optin
            self.shared_memory_per_multiprocessor = p.max_shared_memory_per_multiprocessor

        def __getattr__(self, name: str) -> Any:
            return getattr(self._props, name)

    torch.cuda.get_device_properties = lambda device=None: Props(real(device))
    torch.cuda.get_device_capability = lambda device=None: tuple(p.capability)
    torch.cuda.get_device_name = lambda device=None: p.device_name


def _call(blockscaled: Any, intrinsics: Any, n: int, k: int, m: int) -> str | None:
    """vLLM 0.34's ``_apply_b12x_nvfp4_linear`` on zeros: the compile (or load), then the launch."""
    import torch

    dev = "cuda"
    x = torch.zeros((m, k // 2), dtype=torch.uint8, device=dev)
    x_scale = intrinsics.swizzle_block_scale(torch.zeros((m, k // 16), dtype=torch.float8_e4m3fn, device=dev))
    w = torch.zeros((n, k // 2), dtype=torch.uint8, device=dev)
    w_scale = intrinsics.swizzle_block_scale(torch.zeros((n, k // 16), dtype=torch.float8_e4m3fn, device=dev))
    alpha = torch.ones((), dtype=torch.float32, device=dev)
    try:
        blockscaled.mm_nvfp4(x, x_scale, w, w_scale, alpha, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # the launch of an sm_120a kernel on this GPU
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _record_sources() -> list[Any]:
    """What each compile's source fingerprint was made of (module, digest, file sizes), to say
    why a key differs from the CPU's when it does."""
    from cute_diskcache.core import through

    seen: list[Any] = []
    real = through.site_sources

    def recording(name: str, package: str) -> Any:
        facts = real(name, package)
        seen.append([name, facts.fingerprint, [[s[0], s[2]] for s in facts.stamp if len(s) > 2], list(facts.env_reads)])
        return facts

    through.site_sources = recording
    return seen


def child(ms: tuple[int, ...], card: str) -> None:
    _stand_in(card)
    import cute_diskcache

    cute_diskcache.install()
    from b12x._lib import intrinsics
    from b12x.gemm import blockscaled

    from cute_diskcache.prewarm import models

    compiles = _count_compiles()
    res: dict[str, Any] = {"arch": os.environ.get("CUTE_DSL_ARCH"), "card": card, "ms": list(ms), "calls": []}
    res["sources"] = _record_sources()
    t0 = time.perf_counter()
    try:
        for lin in models.dense_shape(MODEL).linears:
            for m in ms:
                t = time.perf_counter()
                err = _call(blockscaled, intrinsics, lin.n, lin.k, m)
                res["calls"].append({"linear": lin.name, "n": lin.n, "k": lin.k, "m": m, "s": round(time.perf_counter() - t, 3),
                                     "launch_error": err})
    except Exception as exc:
        import traceback

        res["error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
        res["traceback"] = traceback.format_exc()[-3000:]
    res["calls_s"] = round(time.perf_counter() - t0, 3)
    H.emit_with_cache(res, compiles[0])


def _entries(root: Path) -> dict[str, Any]:
    return {H.read_entry(d)["manifest"]["digest"]: H.read_entry(d) for d in H.entry_dirs(root)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("all", "child"))
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--card", default=CARD)
    ap.add_argument("--cpu-root", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ms = tuple(int(x) for x in args.ms.split(","))
    if args.mode == "child":
        child(ms, args.card)
        return 0
    report: dict[str, Any] = {"versions": H.versions(), "device": H.device_info(), "model": MODEL, "card": args.card,
                              "ms": list(ms)}
    base = Path(tempfile.mkdtemp(prefix="cdc-b12x-gpu-"))
    dev_root = base / "device"
    env = dict(os.environ, CUTE_DISKCACHE_DIR=str(dev_root), B12X_COMPILE_CACHE_DIR=str(base / "b12x-own"))
    argv = ["child", "--ms", args.ms, "--card", args.card]
    report["cold"] = H.spawn(__file__, argv, env=env, timeout=500)
    report["warm"] = H.spawn(__file__, argv, env=env, timeout=300)
    if args.cpu_root:
        cpu_copy = base / "cpu"
        shutil.copytree(args.cpu_root, cpu_copy)
        report["on_cpu_root"] = H.spawn(__file__, argv, env=dict(env, CUTE_DISKCACHE_DIR=str(cpu_copy)), timeout=300)
        dev, cpu = _entries(dev_root), _entries(Path(args.cpu_root))
        report["entries"] = {"device": len(dev), "cpu": len(cpu), "common_keys": len(set(dev) & set(cpu)),
                             "device_only": sorted(dev.keys() - cpu.keys()), "cpu_only": sorted(cpu.keys() - dev.keys())}
        report["compare"] = {d: H.compare_entries(dev[d], cpu[d]) for d in sorted(set(dev) & set(cpu))}
    cold, warm, on_cpu = report["cold"], report["warm"], report.get("on_cpu_root", {})
    cmp = report.get("compare", {})
    report["verdict"] = {
        "cold_compiled": bool(cold.get("dsl_compiles")) and not cold.get("error"),
        "warm_compiled_nothing": warm.get("dsl_compiles") == 0 and not warm.get("error"),
        "cpu_root_compiled_nothing": on_cpu.get("dsl_compiles") == 0 and not on_cpu.get("error"),
        "same_keys": bool(cmp) and not report["entries"]["device_only"] and not report["entries"]["cpu_only"],
        "cubins_identical": bool(cmp) and all(c["cubins_identical"] is not False and all(c["cubins_identical"]) for c in cmp.values()),
        "same_launch_result": [c.get("launch_error") for c in cold.get("calls", [])] == [c.get("launch_error") for c in warm.get("calls", [])],
    }
    print(json.dumps(report["verdict"]), "| cold", cold.get("dsl_compiles"), cold.get("counters"), "| warm", warm.get("dsl_compiles"),
          "| cpu root", on_cpu.get("dsl_compiles"), on_cpu.get("counters"), "| entries", report.get("entries", {}).get("device"),
          report.get("entries", {}).get("cpu"), flush=True)
    for k in ("cold", "warm", "on_cpu_root"):
        r = report.get(k, {})
        if r.get("error"):
            print(k, "ERROR", r["error"][:800], r.get("traceback", "")[-1500:], r.get("stderr_tail", "")[-1500:], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
