"""Child process for tests/test_trace.py: traces and compiles real kernels, prints one JSON line.

    python tests/trace_driver.py tiny DIR_A DIR_B
        a small @cute.jit kernel (``tiny_kernel.py`` in each directory: the same code at another
        path and line) traced and compiled with the real DSL: digests, the DSL's own hashes,
        how often the DSL lowered, its per-compile state, the order finalize hooks ran in.
    python tests/trace_driver.py flashinfer --order trace,compile KERNEL...
        flashinfer kernels (``micro``/``static``/``dynamic`` through moe_dispatch for Qwen3-30B-A3B's
        layer, ``w4a16_*`` through flashinfer's compile functions) captured as the hook hands them
        to the cache, then traced and/or compiled in ``--order``: digests, cubin and object hashes.

A fresh interpreter each time: the DSL reads its target arch once, and a kernel object a trace
touched must not be what another case compiles.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _count_lowering() -> dict[str, int]:
    """Count the DSL's ``compile_and_cache`` (the step after tracing: passes, ptxas, JIT)."""
    from cutlass.cutlass_dsl import CuTeDSL

    counts = {"lowered": 0}
    real = CuTeDSL.compile_and_cache

    def compile_and_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["lowered"] += 1
        return real(self, *args, **kwargs)

    CuTeDSL.compile_and_cache = compile_and_cache  # type: ignore[method-assign]
    return counts


def _dsl_state() -> list[Any]:
    from cutlass.cutlass_dsl import CuTeDSL

    dsl = CuTeDSL._get_dsl()
    return [len(dsl.jit_cache), len(dsl.kernel_info), dsl.num_kernels, dsl.compile_options.to_str()]


def _raw_settings() -> str:
    from cutlass.cutlass_dsl import CuTeDSL

    from cute_diskcache.keys import trace

    return trace._raw_settings(CuTeDSL._get_dsl())


def tiny(dir_a: Path, dir_b: Path) -> dict[str, Any]:
    os.environ["CUTE_DSL_ARCH"] = "sm_120a"
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    from cute_diskcache.keys import trace

    a, b = _load(dir_a / "tiny_kernel.py", "tiny_a"), _load(dir_b / "tiny_kernel.py", "tiny_b")
    x = make_fake_compact_tensor(cutlass.Float32, (32,))
    lowering = _count_lowering()
    out: dict[str, Any] = {"unsupported": trace.unsupported()}
    if out["unsupported"] is not None:  # DSL 4.5: no trace; a compile still compiles, with no digest
        try:
            trace.traced_ir(cute.compile, a.launch, x, 1)
        except Exception as exc:
            out["raised"] = type(exc).__name__
        compiled, lowered = trace.compile_traced(cute.compile, a.launch, x, 1)
        out.update(compiled_type=type(compiled).__name__, compiled_digest=lowered, lowered_after_compile=lowering["lowered"])
        return out
    state = _dsl_state()
    ta = trace.traced_ir(cute.compile, a.launch, x, 1)
    tb = trace.traced_ir(cute.compile, b.launch, x, 1)
    other = trace.traced_ir(cute.compile, a.launch, x, 2)
    out.update(a=ta.ir_digest, b=tb.ir_digest, other_constant=other.ir_digest, dsl_hash_a=ta.dsl_hash, dsl_hash_b=tb.dsl_hash,
               stripped=ta.locations_stripped, function_name=ta.function_name, lowered_by_traces=lowering["lowered"],
               state_kept=_dsl_state() == state, settings=ta.settings, raw_settings=_raw_settings(),
               dsl_root=str(Path(cutlass.__file__).resolve().parents[2]))
    la = trace.traced_ir(cute.compile[cute.GenerateLineInfo], a.launch, x, 1)
    lb = trace.traced_ir(cute.compile[cute.GenerateLineInfo], b.launch, x, 1)
    out.update(line_info_a=la.ir_digest, line_info_b=lb.ir_digest, line_info_stripped=la.locations_stripped)
    order: list[str] = []

    def theirs(dsl: Any, module: Any, function_name: str) -> None:
        order.append(f"theirs:{function_name}:{'gpu.module' in str(module)}")

    hooked = trace.traced_ir(cute.compile, a.launch, x, 1, trace_finalize_hooks=theirs)
    out.update(hooked=hooked.ir_digest, hook_order=order, lowered_before_compile=lowering["lowered"])
    compiled, lowered = trace.compile_traced(cute.compile, a.launch, x, 1)
    out.update(compiled_type=type(compiled).__name__, compiled_digest=lowered.ir_digest if lowered else None,
               lowered_after_compile=lowering["lowered"])
    try:  # what a trace of something the DSL refuses raises: the DSL's own error, not ours
        trace.traced_ir(cute.compile, lambda: None)
        out["refused"] = None
    except Exception as exc:
        out["refused"] = type(exc).__name__
    return out


# --------------------------------------------------------------------------------------------
# flashinfer kernels
# --------------------------------------------------------------------------------------------

#: Qwen3-30B-A3B's MoE layer; m=1 micro, m=16 static, m=256 dynamic (max_num_tokens 256).
MOE = {"micro": 1, "static": 16, "dynamic": 256}


def _capture(kernels: list[str]) -> list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]]:
    """(name, real compile, args, kwargs) of each kernel, as the hook hands it to the cache
    (planning: the cache compiles nothing; the first-stage key is built before we look)."""
    from cute_diskcache.core import through

    captured: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]] = []
    current = {"name": ""}
    real_tc = through.through_cache

    def through_cache(site: Any, call: Any, compile_fn: Any, **kwargs: Any) -> Any:
        out = real_tc(site, call, compile_fn, **kwargs)
        real, _options, args, kw = compile_fn.args
        captured.append((current["name"], real, args, kw))
        return out

    through.through_cache = through_cache
    try:
        with through.planning():
            moe = None
            for name in kernels:
                current["name"] = name
                if name in MOE:
                    from cute_diskcache import flashinfer_sites

                    moe = moe or flashinfer_sites.Dispatcher(128, 8, 2048, 768, max_num_tokens=256)
                    moe.run(MOE[name])
                else:
                    sys.path.insert(0, str(REPO / "scripts"))
                    import compat_child

                    try:
                        compat_child._w4a16_compile(name)
                    except Exception:  # flashinfer handling the planned stand-in after the compile
                        pass
    finally:
        through.through_cache = real_tc
    return captured


def flashinfer_kernels(kernels: list[str], order: list[str]) -> dict[str, Any]:
    import cute_diskcache

    cute_diskcache.install(target="rtx-pro-6000")
    from cute_diskcache.core import export
    from cute_diskcache.keys import trace

    out: dict[str, Any] = {}
    for name, real, args, kwargs in _capture(kernels):
        rec: dict[str, Any] = {}
        for step in order:
            if step == "trace":
                t = trace.traced_ir(real, *args, **kwargs)
                rec.setdefault("traced", []).append(t.ir_digest)
                rec["trace_s"] = t.seconds
            else:
                with export.capturing() as objects:
                    t0 = time.perf_counter()
                    compiled, lowered = trace.compile_traced(real, *args, **kwargs)
                    seconds = time.perf_counter() - t0
                art = export.export(compiled, "0" * 64, seconds, captured=objects, link=False)
                rec.update(compiled_digest=lowered.ir_digest if lowered else None, compile_s=seconds,
                           object=hashlib.sha256(art.object_bytes).hexdigest(),
                           cubins=[hashlib.sha256(c).hexdigest() for c in art.cubins])
        out[name] = rec
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("tiny", "flashinfer"))
    ap.add_argument("rest", nargs="+")
    ap.add_argument("--order", default="trace,compile")
    args = ap.parse_args()
    if args.mode == "tiny":
        result = tiny(Path(args.rest[0]), Path(args.rest[1]))
    else:
        result = flashinfer_kernels(args.rest, args.order.split(","))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    from cute_diskcache import fast_exit

    fast_exit.end(main())  # as our own commands end: after the exit handlers, without the teardown's collections
