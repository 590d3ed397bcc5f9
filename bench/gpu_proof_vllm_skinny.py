#!/usr/bin/env python3
"""vLLM's own skinny GEMM on a real GPU against the CPU prewarm (issue 44 item 5; design-vllm-sites.md 4.5).

``prewarm MODEL --target dgx-spark`` compiles vLLM 0.34's ``ShapeDynamicSkinnyGemm._compile`` on a
box without a GPU, answering vLLM's two device questions itself (``vllm_sites/planning.py``: PDL
from capability major >= 9, the stream a driver ``CUstream(0)``). The question this script answers:
does a GPU engine, where vLLM's platform is the real CUDA platform (its ``current_stream()``, its
``CudaPlatform.is_arch_support_pdl()``), ask for the same keys and get the same code?

On the lent GPU (an H100 or H200, sm_90), each child applies the ``dgx-spark`` profile as
``gpu_proof_b12x.py``'s ``_stand_in`` does (``targets.apply(force=True)``: the arch forced to
sm_121a, torch's capability, SM count, name and shared memory answered from the profile; tensors,
streams, memory and the driver stay the real GPU's), then runs vLLM's own warm-up as an engine
start on a Spark reaches it: ``maybe_use_skinny_gemm`` on ``torch.nn.Linear`` layers on CUDA (BF16,
no bias: Qwen3-30B-A3B's o_proj 2048 x 4096, which has a plan, and its qkv_proj 5120 x 2048, which
has none), ``kernel_warmup._warmup_skinny_gemm(model)``, then ``cutedsl_warmup.cutedsl_warmup()``,
which compiles the units through our hook; then vLLM's serving op
(``cuda_skinny_unquantized_gemm_impl``) at 1, 2 and 4 tokens, whose launch of an sm_121a kernel
fails on this GPU, the same way each time, and is recorded.

vLLM's platform is left real: ``current_platform`` is resolved by vLLM itself. What cannot be real
here, and is recorded in each child's ``platform``: vLLM's CUDA platform module imports its C
extension ``vllm._C_stable_libtorch`` (built for torch 2.14; this box has torch 2.11, so it is not
carried): where that import fails, an empty module stands in for it (custom-op registrations,
which the warm-up never calls) and the platform is resolved again; and NVML reports this card's
capability (9, 0), so ``get_device_capability`` alone is answered (12, 1) on the platform's class
(vLLM's plan table is keyed by it). ``is_arch_support_pdl`` (vLLM's, reading torch's stood-in
capability) and ``current_stream`` (vLLM's: a dedicated ``torch.cuda.Stream`` it creates) are vLLM's.

``all`` (GPU): a cold child on an empty root (compiles, persists), a fresh child on that root
(must compile nothing), a fresh child on a copy of the CPU prewarm's root (``--cpu-root``: must
compile nothing either), then every device-built entry compared byte for byte with the CPU-built
entry of the same key (``gpu_harness.compare_entries``). Writes one JSON report; where a key
differs, the cache's miss warnings (its explainer) are in the child's ``stderr_tail``.

Run (CPU side, the compat venv with vLLM 0.34.0, DSL 4.8.0, tvm-ffi 0.1.15.post2, quack-kernels 0.6.5;
device side, the same DSL, tvm-ffi and quack carried as wheels, vLLM's Python source without its
``*.so`` and its dist-info extracted onto ``PYTHONPATH``)::

    python -m cute_diskcache.prewarm qwen3-30b-a3b-bf16 --target dgx-spark --host-machine x86_64 --root CPU_ROOT --json
    python3 bench/gpu_proof_vllm_skinny.py all --cpu-root CPU_ROOT [--cpu-side CPU_JSON] --out $OUT/gpu_proof_vllm_skinny.json

The device lacks, of what vLLM's import reaches, pydantic (with pydantic-core, annotated-types,
typing-inspection), cachetools, cbor2, msgspec, pybase64 and pyzmq: they travel as wheels with the
DSL's. Not yet run on a GPU: on 2026-12-08 no device machine came in 17 minutes of asking (only
refusals); the CPU side (3 kernels, 10.5 s on the 2-core x86_64 VM) is staged for the next try.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_harness as H
from gpu_proof_b12x import _record_sources, _stand_in
from gpu_proof_inline_sm90 import _count_compiles

CARD = "dgx-spark"
#: Qwen3-30B-A3B at TP 1: o_proj (N, K) has a (12, 1) plan (token counts 1, 2, 4), qkv_proj has none.
SHAPES = ((2048, 4096), (5120, 2048))
TOKENS = (1, 2, 4)
_C_EXT = "vllm._C_stable_libtorch"


def _platform() -> tuple[Any, dict[str, Any]]:
    """vLLM's ``current_platform`` as vLLM resolves it, and what had to stand in (see the docstring)."""
    info: dict[str, Any] = {"stubbed_modules": [], "patched": []}
    try:
        import vllm.platforms as platforms

        current = platforms.current_platform
        info["resolved_first_try"] = True
    except ImportError as exc:
        info["resolved_first_try"] = False
        info["first_try_error"] = f"{type(exc).__name__}: {exc}"
        import traceback

        if _C_EXT not in "".join(traceback.format_exception(exc)):
            raise
        sys.modules[_C_EXT] = types.ModuleType(_C_EXT)
        info["stubbed_modules"].append(_C_EXT)
        import vllm.platforms as platforms

        current = platforms.current_platform
    info["class"] = f"{type(current).__module__}.{type(current).__qualname__}"
    info["is_cuda"] = current.is_cuda()
    real = current.get_device_capability()
    info["vllm_capability_real"] = None if real is None else [real.major, real.minor]
    if real is None or tuple(real) != (12, 1):
        from vllm.platforms.interface import DeviceCapability

        spark = DeviceCapability(12, 1)
        type(current).get_device_capability = classmethod(lambda cls, device_id=0: spark)  # type: ignore[method-assign,assignment]
        info["patched"].append(f"{type(current).__qualname__}.get_device_capability -> (12, 1)")
    info["is_arch_support_pdl"] = current.is_arch_support_pdl()
    info["is_arch_support_pdl_is_vllms"] = getattr(type(current).is_arch_support_pdl, "__module__", "").startswith("vllm.")
    return current, info


def child() -> None:
    _stand_in(CARD)
    import cute_diskcache

    cute_diskcache.install(target=CARD)
    import torch

    compiles = _count_compiles()
    res: dict[str, Any] = {"arch": os.environ.get("CUTE_DSL_ARCH"), "card": CARD, "torch_capability": list(torch.cuda.get_device_capability()),
                           "real_device": torch.cuda.get_device_properties(0)._props.name}
    res["sources"] = _record_sources()
    t0 = time.perf_counter()
    try:
        _, res["platform"] = _platform()
        from vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm import shape_dynamic_skinny_gemm
        from vllm.model_executor.layers.utils import cuda_skinny_unquantized_gemm_impl, maybe_use_skinny_gemm
        from vllm.model_executor.warmup import cutedsl_warmup, kernel_warmup
        import vllm.utils.torch_utils as torch_utils

        res["import_s"] = round(time.perf_counter() - t0, 3)
        model = torch.nn.Module()
        for i, (n, k) in enumerate(SHAPES):
            layer = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda")
            maybe_use_skinny_gemm(layer)
            model.add_module(f"layer{i}", layer)
        res["marked"] = [[n, k, bool(getattr(m, "use_skinny_gemm", False))] for (n, k), m in zip(SHAPES, model.children(), strict=True)]
        kernel_warmup._warmup_skinny_gemm(model)
        units = cutedsl_warmup._collect_unique_compile_units(cutedsl_warmup._iter_cutedsl_warmup_compile_units())
        res["units"] = [[u.name, str(u.key[1]), repr(u.key[2]), u.key[3]] for u in units]
        t = time.perf_counter()
        cutedsl_warmup.cutedsl_warmup()
        res["warmup_s"] = round(time.perf_counter() - t, 3)
        stream = torch_utils.current_stream()
        res["stream"] = {"type": f"{type(stream).__module__}.{type(stream).__qualname__}", "cuda_stream": int(stream.cuda_stream),
                         "vllms_current_stream": torch_utils.current_stream.__module__, "skinny_stream_type": type(shape_dynamic_skinny_gemm._stream()).__name__}
        res["use_pdl"] = shape_dynamic_skinny_gemm._use_pdl()
        res["compiled_in_vllms_dict"] = len(shape_dynamic_skinny_gemm._compiled)
        res["dsl_compiles_after_warmup"] = compiles[0]
        res["calls_s"] = round(time.perf_counter() - t0, 3)
        H.emit_with_cache(res, compiles[0])  # what the warm-up did, in case a launch takes the process down
        weight = next(model.children()).weight
        res["launches"] = []
        for m in TOKENS:
            x = torch.randn(m, weight.shape[1], dtype=torch.bfloat16, device="cuda")
            err = None
            try:
                out = cuda_skinny_unquantized_gemm_impl(x, weight)
                torch.cuda.synchronize()
                res["launches"].append({"tokens": m, "max_abs_err_vs_torch": float((out.float() - (x @ weight.T).float()).abs().max())})
                continue
            except Exception as exc:  # noqa: BLE001 - an sm_121a kernel on this sm_90 GPU
                err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            res["launches"].append({"tokens": m, "launch_error": err})
        res["compiled_in_vllms_dict_after_launches"] = len(shape_dynamic_skinny_gemm._compiled)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON; the parent compares what it has
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
    ap.add_argument("--cpu-root", type=Path)
    ap.add_argument("--cpu-side", type=Path, help="JSON the CPU side wrote beside its root (prewarm's --json, versions)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.mode == "child":
        child()
        return 0
    import importlib.metadata as md

    extra = {d: md.version(d) for d in ("vllm", "quack-kernels", "apache-tvm-ffi", "nvidia-cutlass-dsl", "transformers")}
    report: dict[str, Any] = {"versions": H.versions() | extra, "device": H.device_info(), "card": CARD, "shapes": SHAPES}
    if args.cpu_side:
        report["cpu_side"] = json.loads(args.cpu_side.read_text())
    base = Path(tempfile.mkdtemp(prefix="cdc-vllm-skinny-gpu-"))
    dev_root = base / "device"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}
    env["CUTE_DISKCACHE_DIR"] = str(dev_root)
    report["cold"] = H.spawn(__file__, ["child"], env=env, timeout=400, stderr_tail=4000)
    report["warm"] = H.spawn(__file__, ["child"], env=env, timeout=300, stderr_tail=4000)
    if args.cpu_root:
        cpu_copy = base / "cpu"
        shutil.copytree(args.cpu_root, cpu_copy)
        report["on_cpu_root"] = H.spawn(__file__, ["child"], env=dict(env, CUTE_DISKCACHE_DIR=str(cpu_copy)), timeout=300, stderr_tail=8000)
        dev, cpu = _entries(dev_root), _entries(Path(args.cpu_root))
        report["digests"] = {"device": sorted(dev), "cpu": sorted(cpu),
                             "namespace": {d: e["manifest"].get("namespace") for d, e in {**cpu, **dev}.items()}}
        report["entries"] = {"device": len(dev), "cpu": len(cpu), "common_keys": len(set(dev) & set(cpu)),
                             "device_only": sorted(dev.keys() - cpu.keys()), "cpu_only": sorted(cpu.keys() - dev.keys())}
        report["compare"] = {d: H.compare_entries(dev[d], cpu[d]) for d in sorted(set(dev) & set(cpu))}
    cold, warm, on_cpu = report["cold"], report["warm"], report.get("on_cpu_root", {})
    cmp = report.get("compare", {})

    def launch_errors(r: dict[str, Any]) -> list[Any]:
        return [c.get("launch_error") for c in r.get("launches", [])]

    report["verdict"] = {
        "cold_compiled_3": cold.get("dsl_compiles") == 3 and not cold.get("error"),
        "warm_compiled_nothing": warm.get("dsl_compiles") == 0 and (warm.get("counters") or {}).get("hits") == 3 and not warm.get("error"),
        "cpu_root_compiled_nothing": on_cpu.get("dsl_compiles") == 0 and (on_cpu.get("counters") or {}).get("hits") == 3 and not on_cpu.get("error"),
        "same_keys": bool(cmp) and not report["entries"]["device_only"] and not report["entries"]["cpu_only"],
        "cubins_identical": bool(cmp) and all(c["cubins_identical"] is not False and all(c["cubins_identical"]) for c in cmp.values()),
        "mlir_identical": bool(cmp) and all(c["mlir_identical"] is not False for c in cmp.values()),
        "same_units": cold.get("units") == warm.get("units") == on_cpu.get("units"),
        "same_launch_result": launch_errors(cold) == launch_errors(warm) == launch_errors(on_cpu),
        "vllm_platform": cold.get("platform"),
    }
    print(json.dumps(report["verdict"]), "| cold", cold.get("dsl_compiles"), cold.get("counters"), "| warm", warm.get("dsl_compiles"),
          warm.get("counters"), "| cpu root", on_cpu.get("dsl_compiles"), on_cpu.get("counters"), "| entries", report.get("entries"), flush=True)
    for k in ("cold", "warm", "on_cpu_root"):
        r = report.get(k, {})
        print(k, "units", r.get("units"), "stream", r.get("stream"), "pdl", r.get("use_pdl"), "launches", r.get("launches"), flush=True)
        if r.get("error"):
            print(k, "ERROR", r["error"][:800], r.get("traceback", "")[-1500:], r.get("stderr_tail", "")[-2500:], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
