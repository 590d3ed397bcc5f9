"""One fresh "engine start" inside a compatibility-matrix venv (run by scripts/compat_matrix.py).

Run with the cell's interpreter, this checkout on ``PYTHONPATH``; never imported by the runner.
It attaches cute-diskcache for a target profile before flashinfer is imported, drives each
named site once through flashinfer's own entry points on CPU tensors (the launch that follows
a compile fails without a GPU; that error spells the kernel's signature, its "ABI text"), and
prints one JSON line: per site the kernels flashinfer added, the cache events, the ABI text or
the error, plus the package's counters and an independent count of the DSL's real compiles.

    python scripts/compat_child.py --target rtx-pro-6000 micro static dynamic direct_micro fp8_gemm w4a4

Real compiles are counted at the DSL's ``CompileCallable._compile`` (every ``cute.compile`` goes
through it) when it returns (a call that raises, like the second-stage key's trace, lowered nothing), hooked when the DSL is first imported, so "zero compiles" never rests on the
counters of the code under test. A DSL without that method reports ``real_compiles: null``.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

REPO = Path(__file__).resolve().parent.parent
_COMPILER = "cutlass.base_dsl.compiler"
COMPILES: dict[str, Any] = {"count": None, "depth": 0}

#: Qwen3-30B-A3B's MoE layer (E128, top-8, hidden 2048, intermediate 768) with
#: max_num_tokens 256: m=1 takes the micro kernel, m=16 a static one and m=256 the dynamic one
#: on every release (0.6.x switches to dynamic above m=80, 0.7.4 only near the top). Intermediate
#: <= 512 takes the direct micro kernel on flashinfer >= 0.6.18 (E128 top-8 hidden 2048 n 512).
DISPATCH_SHAPE = (128, 8, 2048, 768)
DIRECT_MICRO_SHAPE = (128, 8, 2048, 512)
MAX_NUM_TOKENS = 256
DISPATCH_M = {"micro": 1, "static": 16, "dynamic": 256}
_ABI = re.compile(r"when calling: `([^`]*)`")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _CountCompiles(importlib.abc.MetaPathFinder):
    """Wraps ``CompileCallable._compile`` of the DSL the moment it is imported (outermost calls)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _COMPILER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            real_exec(module)
            cls = getattr(module, "CompileCallable", None)
            real = getattr(cls, "_compile", None)
            if real is None:
                return
            COMPILES["count"] = 0

            def _compile(self: Any, *args: Any, **kwargs: Any) -> Any:
                # Counted when it returns: a call that raises lowered nothing (the second-stage
                # key's trace enters here and stops by raising once the kernel is traced).
                COMPILES["depth"] += 1
                try:
                    result = real(self, *args, **kwargs)
                    if COMPILES["depth"] == 1:
                        COMPILES["count"] += 1
                    return result
                finally:
                    COMPILES["depth"] -= 1

            cls._compile = _compile

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def abi_text(error: str | None) -> str | None:
    """The kernel signature a CPU launch error spells out (tvm-ffi kernels), else the error.

    A kernel without tvm-ffi (direct micro, the fp8 ops) converts its arguments against its
    signature and then launches: without a driver the launch fails, and that failure (rather
    than an argument error) is what a compiled and a loaded kernel must both reach.
    """
    if error is None:
        return None
    found = _ABI.search(error)
    return found.group(1) if found else " ".join(_ANSI.sub("", error).split())[:2000]


def _dispatcher_site(dispatchers: dict[tuple[int, ...], Any], shape: tuple[int, ...], m: int) -> Callable[[], dict[str, Any]]:
    def go() -> dict[str, Any]:
        from cute_diskcache import flashinfer_sites

        if shape not in dispatchers:  # one wrapper per shape, as an engine holds one per layer
            dispatchers[shape] = flashinfer_sites.Dispatcher(*shape, max_num_tokens=MAX_NUM_TOKENS)
        record = dispatchers[shape].run(m)
        return {"kinds": record["new_kernels"], "error": record["launch_error"]}

    return go


def _fi074_site(name: str) -> Callable[[], dict[str, Any]]:
    """An fp8 op or nvfp4 runner site, driven as tests/fi074_driver.py drives it on 0.7.4."""

    def go() -> dict[str, Any]:
        sys.path.insert(0, str(REPO / "tests"))
        import fi074_driver

        from cute_diskcache import flashinfer_sites

        sites = {**fi074_driver._ops(512),
                 "w4a4": fi074_driver._run_moe("moe_nvfp4_w4a4", "run_moe_w4a4", 2, 512),
                 "nvfp4_w4a16": fi074_driver._run_moe("moe_nvfp4_w4a16", "run_moe_w4a16", 0, 512)}
        before = flashinfer_sites.kernel_cache_sizes()
        try:
            sites[name]()
            error = None
        except Exception as exc:  # noqa: BLE001 - the launch without a GPU: expected, recorded
            error = f"{type(exc).__name__}: {str(exc)[:6000]}"
        after = flashinfer_sites.kernel_cache_sizes()
        return {"kinds": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}, "error": error}

    return go


#: The W4A16 MoE kernels (``moe_w4a16_kernel.compile_w4a16_*``) for Qwen3-30B-A3B's layer at m=4,
#: with the arguments ``run_w4a16_moe`` derives. That op asks ``torch.cuda`` for the card before
#: it compiles, so the CPU drives flashinfer's compile functions themselves (fake tensors, as
#: flashinfer compiles them); up to 0.6.16 they compile in place, on 0.6.17 through
#: ``moe_w4a16_compiler.compile`` (both sites of ``cute_diskcache/flashinfer_sites/sites.py``).
W4A16_SITES = ("w4a16_gemm", "w4a16_fused_moe", "w4a16_activation", "w4a16_topk_sum")
W4A16_M = 4


def _w4a16_site(name: str) -> Callable[[], dict[str, Any]]:
    def go() -> dict[str, Any]:
        result, seen = _recorded_compile(lambda: _w4a16_compile(name))
        error = _launch_like_compile(result.compiled, seen[-1]) if seen else "no compile reached the cache"
        return {"kinds": {}, "error": error}

    return go


def _w4a16_compile(name: str) -> Any:
    """One of ``moe_w4a16_kernel``'s compile functions, with the arguments ``run_w4a16_moe`` gives it."""
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_w4a16_host as host
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_w4a16_kernel as k

    from cute_diskcache.keys import targets

    profile = targets.active()
    sms, smem = profile.sm_count, profile.max_shared_memory_per_block_optin
    experts, topk, hidden, inter = DISPATCH_SHAPE
    m = W4A16_M
    block = host.select_route_block_size_m(m, topk, experts)
    # the most route blocks m*topk routes pack into when every expert's run is padded to a block
    max_m_blocks = -(-(m * topk + experts * (block - 1)) // block)
    if name == "w4a16_gemm":
        tile_k, tile_n, _, _ = k._select_tile_config(problem_m=m, problem_n=2 * inter, problem_k=hidden, top_k=topk,
                                                     moe_block_size=block, sms=sms, max_shared_mem=smem)
        return k.compile_w4a16_gemm(size_m=m, size_n=2 * inter, size_k=hidden, num_experts=experts, top_k=topk,
                                    mul_topk_weights=False, tile_n=tile_n, tile_k=tile_k, moe_block_size=block,
                                    max_m_blocks=max_m_blocks)
    if name == "w4a16_fused_moe":
        return k.compile_w4a16_fused_moe(size_m=m, hidden_size=hidden, intermediate_size=inter, num_experts=experts,
                                         top_k=topk, activation="silu", apply_router_weight_on_input=False,
                                         zero_fc2_output=False, moe_block_size=block, max_m_blocks=max_m_blocks,
                                         sms=sms, max_shared_mem=smem)
    if name == "w4a16_activation":
        return k.compile_w4a16_activation(rows=m * topk, intermediate_size=inter, activation="silu")
    return k.compile_w4a16_topk_sum(m=m, topk=topk, hidden_size=hidden)


def _recorded_compile(run: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """``run()``, and the arguments of the compile it sent through the cache (hit or miss)."""
    from cute_diskcache.core import through

    seen: list[Any] = []
    real = through.through_cache

    def recording(site: Any, call: Any, compile_fn: Any, **kwargs: Any) -> Any:
        seen.append(call.args)
        return real(site, call, compile_fn, **kwargs)

    through.through_cache = recording
    try:
        return run(), seen
    finally:
        through.through_cache = real


def _launch_like_compile(compiled: Any, compile_args: tuple[Any, ...]) -> str | None:
    """Launch ``compiled`` with what it was compiled against: CPU tensors (uninitialised) of
    each fake tensor's type and extents, the scalars as they were, the current stream. Without
    a GPU the launch fails; the error is what a compiled and a loaded kernel must both reach."""
    import torch
    from flashinfer.cute_dsl.utils import current_cuda_stream, cutlass_to_torch_dtype

    args: list[Any] = []
    for a in compile_args[1:]:  # [0] is the kernel object
        if type(a).__name__ == "_FakeTensor":
            args.append(torch.empty(tuple(int(x) for x in a.shape), dtype=cutlass_to_torch_dtype(a.element_type)))
        elif "stream" in type(a).__name__.lower():
            args.append(current_cuda_stream())
        else:
            args.append(a)
    try:
        compiled(*args)
    except Exception as exc:  # noqa: BLE001 - no GPU: expected, recorded
        return f"{type(exc).__name__}: {str(exc)[:6000]}"
    return None


def _dense_gemm_site() -> dict[str, Any]:
    """0.6.12/0.6.13's b12x dense FP4 GEMM (``dense_gemm``, exported by ``flashinfer.gemm``) on CPU
    tensors: it compiles against fake pointers, then the launch fails without a GPU."""
    import torch
    from flashinfer.gemm.kernels.dense_blockscaled_gemm_sm120_b12x import dense_gemm

    from cute_diskcache.keys import targets

    m, n, k = 16, 1024, 2048  # one decode batch through a 2048 -> 1024 NVFP4 layer
    a, b = torch.zeros((m, k // 2, 1), dtype=torch.uint8), torch.zeros((n, k // 2, 1), dtype=torch.uint8)
    sfa, sfb = torch.zeros((m, k // 16, 1), dtype=torch.uint8), torch.zeros((n, k // 16, 1), dtype=torch.uint8)
    try:
        dense_gemm((a, sfa), (b, sfb), ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn", c_dtype="bfloat16",
                   sf_vec_size=16, sm_count=targets.active().sm_count)
        error = None
    except Exception as exc:  # noqa: BLE001 - the launch without a GPU: expected, recorded
        error = f"{type(exc).__name__}: {str(exc)[:6000]}"
    return {"kinds": {}, "error": error}


def result_summary(kernel: Any, workdir: Path) -> dict[str, Any]:
    """What a caller can see of a kernel flashinfer got: the classes it is an instance of (ours
    left out), every public attribute (its plain value, its type, the method, or the exception
    reading it raises) and the object its ``export_to_c`` writes. A hit must give a cold
    compile's summary exactly (issue 28: a hit hands the caller what a compile hands it)."""
    import hashlib
    import inspect

    from cute_diskcache.core import as_compiled

    def seen(value: Any) -> list[Any]:
        if inspect.ismethod(value):
            return ["method", value.__func__.__qualname__]
        try:
            return ["value", json.loads(json.dumps(as_compiled._encode(value), default=lambda b: b.hex()))]
        except (as_compiled.NotPlain, TypeError, ValueError):
            return ["type", f"{type(value).__module__}.{type(value).__qualname__}"]

    public: dict[str, Any] = {}
    # id_: tvm-ffi's handle address (DSL 4.5's compiled class is a tvm-ffi Function); no two objects share it
    for name in sorted(n for n in dir(kernel) if not n.startswith("_") and n != "id_"):
        try:
            public[name] = seen(getattr(kernel, name))
        except Exception as exc:  # noqa: BLE001 - no GPU here: a CUDA query raises, for the compiled one too
            public[name] = ["raises", type(exc).__name__]
    signature = getattr(getattr(kernel, "execution_args", None), "signature", None)
    export: Any = None
    if hasattr(kernel, "export_to_c"):
        try:
            if hasattr(kernel, "__tvm_ffi_object__") or "TVMFFI" in type(kernel).__name__:
                kernel.export_to_c(str(workdir / "k.o"), function_name="cdc_result_summary")
            else:  # the CuTe ABI's form: a header and an object
                kernel.export_to_c(str(workdir), "k", "cdc_result_summary")
            export = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(workdir.iterdir())}
        except Exception as exc:  # noqa: BLE001 - a result that cannot export: recorded, it is part of the summary
            export = ["raises", type(exc).__name__, str(exc)[:300]]
    keywords: Any = None
    if signature is not None:  # every argument by name (None each): how the call binds shows in what it raises
        try:
            kernel(**{name: None for name in signature.parameters})
            keywords = "returned"
        except Exception as exc:  # noqa: BLE001 - how the call refuses is the fact recorded
            keywords = [type(exc).__name__, _ANSI.sub("", str(exc)).strip().splitlines()[0][:300] if str(exc).strip() else ""]
    return {"classes": [f"{c.__module__}.{c.__qualname__}" for c in type(kernel).__mro__ if not c.__module__.startswith("cute_diskcache")],
            "public": public, "signature": None if signature is None else str(signature), "export": export, "keywords": keywords}


def _returned_kernels() -> list[Any]:
    """Every kernel the cache hands flashinfer from now on, in order (hit or compile)."""
    from cute_diskcache.core import through

    out: list[Any] = []
    real = through.through_cache

    def recording(*args: Any, **kwargs: Any) -> Any:
        kernel = real(*args, **kwargs)
        out.append(kernel)
        return kernel

    through.through_cache = recording
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="rtx-pro-6000")
    ap.add_argument("--results", action="store_true", help="summarise every kernel flashinfer got (result_summary)")
    ap.add_argument("sites", nargs="+")
    args = ap.parse_args(argv)

    sys.meta_path.insert(0, _CountCompiles())
    import cute_diskcache

    cute_diskcache.install(target=args.target)
    t0 = time.perf_counter()
    import flashinfer  # noqa: F401 - timed: the import is what is measured

    import_s = time.perf_counter() - t0
    from cute_diskcache import flashinfer_sites
    from cute_diskcache.core.cache import default_cache
    from cute_diskcache.keys.key import dsl_stack_string

    dispatchers: dict[tuple[int, ...], Any] = {}
    drivers: dict[str, Callable[[], dict[str, Any]]] = {
        **{kind: _dispatcher_site(dispatchers, DISPATCH_SHAPE, m) for kind, m in DISPATCH_M.items()},
        "direct_micro": _dispatcher_site(dispatchers, DIRECT_MICRO_SHAPE, 1),
        **{name: _w4a16_site(name) for name in W4A16_SITES},
        "b12x_dense_gemm": _dense_gemm_site,
    }
    cache = default_cache()
    returned = _returned_kernels()
    sites: dict[str, Any] = {}
    for name in args.sites:
        driver = drivers.get(name) or _fi074_site(name)
        before, compiles_before, t = len(cache.events), COMPILES["count"], time.perf_counter()
        returned_before = len(returned)
        try:
            out = driver()
        except Exception as exc:  # noqa: BLE001 - a refusal or a break in flashinfer's API: recorded, never hidden
            out = {"kinds": {}, "error": f"{type(exc).__name__}: {str(exc)[:6000]}", "raised": True}
        out["seconds"] = round(time.perf_counter() - t, 3)
        out["events"] = [[e[0], e[1], e[2]] for e in cache.events[before:]]
        out["abi"] = abi_text(out["error"])
        if compiles_before is not None:
            out["real_compiles"] = COMPILES["count"] - compiles_before
        if args.results:
            with tempfile.TemporaryDirectory() as tmp:
                out["results"] = [result_summary(k, Path(tmp)) for k in returned[returned_before:]]
        sites[name] = out
    print(json.dumps({
        "flashinfer": flashinfer_sites.flashinfer_version(),
        "dsl": dsl_stack_string(),
        "import_seconds": round(import_s, 3),
        "sites": sites,
        "counters": cute_diskcache.counters(),
        "real_compiles": COMPILES["count"],
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
