#!/usr/bin/env python3
"""The b12x package's fused MoE on a real GPU against the CPU prewarm (issue 44 item 8b).

``prewarm MODEL --target CARD --moe-backend b12x`` compiles on a box without a GPU: vLLM 0.34's
``B12xExperts.warmup_launches`` b12x calls, driven on experts b12x's ``prepare_weights`` prepared
from placeholder CPU tensors (``b12x_sites/moe.py``). The question this script answers: does the
same warm-up on a GPU, on experts prepared from real CUDA tensors, ask for the same kernels (the
same keys) and get the same code (the same cubins)?

On the lent GPU (an H100 or H200, sm_90), each child applies the card's profile as
``gpu_proof_b12x.py`` does (``targets.apply(force=True)``: the arch forced to sm_120a, the
capability, SM count, name and shared memory of ``targets.get(CARD)``; tensors, streams and the
driver stay the real GPU's), builds qwen3-30b-a3b's per-rank MoE layer (NVFP4, 128 experts,
hidden 2048, intermediate 768, top-k 8) from random CUDA tensors of the checkpoint's shapes (what
vLLM hands ``prepare_weights``: ``moe.Layer.tensor_shapes``), prepares the experts with b12x's
``plan_weights``/``prepare_weights`` as ``B12xExperts._prepare_experts`` does, then makes
``warmup_launches``' calls: per token count b12x's ``plan_execution``, and for the first count of
each (implementation, execution) ``plan``, ``bind``, ``run`` (``moe.launch_counts``, ``moe.launch``).
None of the offline stand-ins of ``moe.card_answers`` is used: b12x's SM count comes from torch's
(stood-in) device properties and its direct-micro launch probe asks the real driver. b12x compiles
inside ``run``, through our hook; what follows the compile fails on this sm_90 GPU (an sm_120a
kernel: the micro path's launch probe refuses it, the dynamic path's launch cannot load it), the
same way cold and warm, and is caught and recorded per launch.

``all`` (GPU): a cold child on an empty root (compiles, persists), a fresh child on that root (must
compile nothing), a fresh child on a copy of the CPU prewarm's root (``--cpu-root``: must compile
nothing either; b12x's own compile-cache folder fresh too), then every device-built entry compared
byte for byte with the CPU-built entry of the same key (``gpu_harness.compare_entries``). Writes one
JSON report with the digests on each side.

Run (device; DSL 4.8.0, apache-tvm-ffi 0.1.15.post2 and b12x 1.5.1 carried as wheels, as the CPU
prewarm's interpreter has them: the DSL stack is in the key; the CPU root prewarmed here with the
same token counts)::

    python -m cute_diskcache.prewarm qwen3-30b-a3b --target rtx-pro-6000 --moe-backend b12x --m 1,8,512 --root CPU_ROOT
    python3 bench/gpu_proof_b12x_moe.py all --cpu-root CPU_ROOT --ms 1,8,512 [--cpu-side CPU_JSON] --out $OUT/gpu_proof_b12x_moe.json

Both sides ran the package as committed at 4767ddd (``git archive`` into the carried folder, first
on ``PYTHONPATH``: the report's ``cute_diskcache_sources_sha256`` is the CPU side's). Staging: the
DSL's cu13 libraries parked in two calls (``.dev/s1a``, ``.dev/s1b``), then one call carrying the
wheels of ``.dev/s2`` with SGLang's tvm-ffi 0.1.11 swapped for 0.1.15.post2, plus b12x 1.5.1, rich,
markdown-it-py, mdurl, the CPU root and ``cpu_side.json`` (prewarm's ``--json`` and the CPU side's
versions, embedded in the report as ``cpu_side``).

Run on 2026-12-08 on the lent H100 (Python 3.12, torch 2.11+cu130, DSL 4.8.0, tvm-ffi 0.1.15.post2,
b12x 1.5.1 ``--no-deps``), the CPU root prewarmed on the 2-core x86_64 EPYC VM (Python 3.11, torch
2.13.0+cpu, the same DSL, tvm-ffi and b12x) with ``--m 1,8,512``: 3 launches (micro at 1 token, dynamic
at 8 and at 512: two execution plans, tile_m 16 and 32), 3 kernels, 21.4 s on the VM
(``bench/results/gpu_proof_b12x_moe_h100.json``): cold 3 DSL compiles (14.0 s of compile), a fresh
process 0 compiles and 3 hits (0.21 s of loads), a fresh process on the CPU prewarm's root 0 compiles
and 3 hits (0.14 s of loads); the same 3 keys on both sides (abbdbca9ea75 ``MoEMicroKernelSilu``,
be7a9feeb2a5 and f9fc8fa3ae3f ``_DynamicMoELaunch``), cubins, MLIR and the host objects too
byte-identical (the CPU entries' host code is built for x86-64-v2); the same plan and the same launch
result cold, warm and on the CPU root (the micro kernel's launch probe refuses it, the dynamic
launches raise ``DSLCudaRuntimeError``); b12x's own compile-cache folder stayed empty.
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
import gpu_harness as H
from gpu_proof_b12x import _record_sources, _stand_in
from gpu_proof_inline_sm90 import _count_compiles

MODEL = "qwen3-30b-a3b"
CARD = "rtx-pro-6000"
MODE = "nvfp4"  # what vLLM selects for a ModelOpt NVFP4 checkpoint without VLLM_B12X_MOE_FP4_FORCE_A16


def _random_cuda_tensors(layer: Any, seed: int = 0) -> dict[str, Any]:
    """Random CUDA tensors of the shapes and dtypes vLLM hands ``prepare_weights`` (packed FP4
    bytes, FP8 block scales, positive FP32 global scales)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    out: dict[str, Any] = {}
    for name, (shape, dtype) in layer.tensor_shapes().items():
        if dtype == "uint8":
            out[name] = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g)
        elif dtype == "float8_e4m3fn":
            out[name] = (torch.rand(shape, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn)
        else:
            out[name] = torch.rand(shape, device="cuda", generator=g) + 0.5
    torch.cuda.synchronize()
    return out


def child(ms: tuple[int, ...], card: str) -> None:
    _stand_in(card)
    import cute_diskcache

    cute_diskcache.install()
    import torch

    from cute_diskcache.b12x_sites import moe
    from cute_diskcache.core.cache import default_cache
    from cute_diskcache.prewarm import models

    compiles = _count_compiles()
    layer = moe.layer_of(models.moe_shape(MODEL, tp=1), "bfloat16")
    res: dict[str, Any] = {"arch": os.environ.get("CUTE_DSL_ARCH"), "card": card, "ms": list(ms), "mode": MODE,
                           "layer": vars(layer) | {"padded_intermediate": layer.padded_intermediate}, "launches": []}
    res["sources"] = _record_sources()
    t0 = time.perf_counter()
    try:
        tensors = _random_cuda_tensors(layer)
        t = time.perf_counter()
        prepared = moe.prepare(layer, MODE, tensors)
        res["prepare_s"] = round(time.perf_counter() - t, 3)
        res["prepared_device"] = str(prepared.w1_fp4.device)
        chosen = moe.launch_counts(prepared, layer, MODE, ms)
        res["plan"] = [[str(impl), str(execution), tokens] for (impl, execution), tokens in chosen.items()]
        for (impl, _execution), tokens in chosen.items():
            events, t = len(default_cache().events), time.perf_counter()
            err = None
            try:
                moe.launch(prepared, layer, MODE, tokens)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - after the compile: an sm_120a kernel on this GPU
                err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            res["launches"].append({"implementation": str(impl), "tokens": tokens, "s": round(time.perf_counter() - t, 3),
                                    "events": [[e[0], e[1], e[2]] for e in default_cache().events[events:]],
                                    "launch_error": err})
    except Exception as exc:  # noqa: BLE001 - reported in the JSON; the parent compares what it has
        import traceback

        res["error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
        res["traceback"] = traceback.format_exc()[-3000:]
    res["calls_s"] = round(time.perf_counter() - t0, 3)
    H.emit_with_cache(res, compiles[0])


def _entries(root: Path) -> dict[str, Any]:
    return {H.read_entry(d)["manifest"]["digest"]: H.read_entry(d) for d in H.entry_dirs(root)}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("all", "child"))
    ap.add_argument("--ms", default="1,8,512")
    ap.add_argument("--card", default=CARD)
    ap.add_argument("--cpu-root", type=Path)
    ap.add_argument("--cpu-side", type=Path, help="JSON the CPU side wrote beside its root (prewarm's --json, versions)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ms = tuple(int(x) for x in args.ms.split(","))
    if args.mode == "child":
        child(ms, args.card)
        return 0
    import importlib.metadata as md

    report: dict[str, Any] = {"versions": H.versions() | {"b12x": md.version("b12x")}, "device": H.device_info(),
                              "model": MODEL, "card": args.card, "mode": MODE, "ms": list(ms)}
    if args.cpu_side:
        report["cpu_side"] = json.loads(args.cpu_side.read_text())
    base = Path(tempfile.mkdtemp(prefix="cdc-b12x-moe-gpu-"))
    dev_root = base / "device"
    env = dict(os.environ, CUTE_DISKCACHE_DIR=str(dev_root), B12X_COMPILE_CACHE_DIR=str(base / "b12x-own"))
    argv = ["child", "--ms", args.ms, "--card", args.card]
    report["cold"] = H.spawn(__file__, argv, env=env, timeout=500)
    report["warm"] = H.spawn(__file__, argv, env=env, timeout=300)
    if args.cpu_root:
        cpu_copy = base / "cpu"
        shutil.copytree(args.cpu_root, cpu_copy)
        report["on_cpu_root"] = H.spawn(__file__, argv, timeout=300, env=dict(
            env, CUTE_DISKCACHE_DIR=str(cpu_copy), B12X_COMPILE_CACHE_DIR=str(base / "b12x-own-cpu")))
        dev, cpu = _entries(dev_root), _entries(Path(args.cpu_root))
        report["digests"] = {"device": sorted(dev), "cpu": sorted(cpu),
                             "site": {d: e["manifest"].get("site") for d, e in {**cpu, **dev}.items()}}
        report["entries"] = {"device": len(dev), "cpu": len(cpu), "common_keys": len(set(dev) & set(cpu)),
                             "device_only": sorted(dev.keys() - cpu.keys()), "cpu_only": sorted(cpu.keys() - dev.keys())}
        report["compare"] = {d: H.compare_entries(dev[d], cpu[d]) for d in sorted(set(dev) & set(cpu))}
    report["b12x_own_cache_files"] = {d: _files(base / d) for d in ("b12x-own", "b12x-own-cpu")}
    cold, warm, on_cpu = report["cold"], report["warm"], report.get("on_cpu_root", {})
    cmp = report.get("compare", {})

    def launch_errors(r: dict[str, Any]) -> list[Any]:
        return [c.get("launch_error") for c in r.get("launches", [])]

    report["verdict"] = {
        "cold_compiled": bool(cold.get("dsl_compiles")) and not cold.get("error"),
        "warm_compiled_nothing": warm.get("dsl_compiles") == 0 and not warm.get("error"),
        "cpu_root_compiled_nothing": on_cpu.get("dsl_compiles") == 0 and not on_cpu.get("error"),
        "same_keys": bool(cmp) and not report["entries"]["device_only"] and not report["entries"]["cpu_only"],
        "cubins_identical": bool(cmp) and all(c["cubins_identical"] is not False and all(c["cubins_identical"]) for c in cmp.values()),
        "mlir_identical": bool(cmp) and all(c["mlir_identical"] is not False for c in cmp.values()),
        "same_plan": cold.get("plan") == warm.get("plan") == on_cpu.get("plan"),
        "same_launch_result": launch_errors(cold) == launch_errors(warm) == launch_errors(on_cpu),
    }
    print(json.dumps(report["verdict"]), "| cold", cold.get("dsl_compiles"), cold.get("counters"), "| warm", warm.get("dsl_compiles"),
          warm.get("counters"), "| cpu root", on_cpu.get("dsl_compiles"), on_cpu.get("counters"), "| entries",
          report.get("entries"), flush=True)
    for k in ("cold", "warm", "on_cpu_root"):
        r = report.get(k, {})
        print(k, "plan", r.get("plan"), "launches", [(c["tokens"], c["events"], c["launch_error"]) for c in r.get("launches", [])], flush=True)
        if r.get("error"):
            print(k, "ERROR", r["error"][:800], r.get("traceback", "")[-1500:], r.get("stderr_tail", "")[-1500:], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
