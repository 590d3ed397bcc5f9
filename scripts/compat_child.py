"""One fresh "engine start" inside a compatibility-matrix venv (run by scripts/compat_matrix.py).

Run with the cell's interpreter, this checkout on ``PYTHONPATH``; never imported by the runner.
It attaches cute-diskcache for a target profile before flashinfer is imported, drives each
named site once through flashinfer's own entry points on CPU tensors (the launch that follows
a compile fails without a GPU; that error spells the kernel's signature, its "ABI text"), and
prints one JSON line: per site the kernels flashinfer added, the cache events, the ABI text or
the error, plus the package's counters and an independent count of the DSL's real compiles.

    python scripts/compat_child.py --target rtx-pro-6000 micro static dynamic direct_micro fp8_gemm w4a4

Real compiles are counted at the DSL's ``CompileCallable._compile`` (every ``cute.compile`` goes
through it), hooked when the DSL is first imported, so "zero compiles" never rests on the
counters of the code under test. A DSL without that method reports ``real_compiles: null``.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

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
                COMPILES["depth"] += 1
                try:
                    if COMPILES["depth"] == 1:
                        COMPILES["count"] += 1
                    return real(self, *args, **kwargs)
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
        except Exception as exc:  # the launch without a GPU: expected, recorded
            error = f"{type(exc).__name__}: {str(exc)[:6000]}"
        after = flashinfer_sites.kernel_cache_sizes()
        return {"kinds": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}, "error": error}

    return go


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="rtx-pro-6000")
    ap.add_argument("sites", nargs="+")
    args = ap.parse_args(argv)

    sys.meta_path.insert(0, _CountCompiles())
    import cute_diskcache

    cute_diskcache.install(target=args.target)
    t0 = time.perf_counter()
    import flashinfer  # noqa: F401

    import_s = time.perf_counter() - t0
    from cute_diskcache import flashinfer_sites
    from cute_diskcache.cache import default_cache
    from cute_diskcache.key import dsl_stack_string

    dispatchers: dict[tuple[int, ...], Any] = {}
    drivers: dict[str, Callable[[], dict[str, Any]]] = {
        **{kind: _dispatcher_site(dispatchers, DISPATCH_SHAPE, m) for kind, m in DISPATCH_M.items()},
        "direct_micro": _dispatcher_site(dispatchers, DIRECT_MICRO_SHAPE, 1),
    }
    cache = default_cache()
    sites: dict[str, Any] = {}
    for name in args.sites:
        driver = drivers.get(name) or _fi074_site(name)
        before, compiles_before, t = len(cache.events), COMPILES["count"], time.perf_counter()
        try:
            out = driver()
        except Exception as exc:  # a refusal or a break in flashinfer's API: recorded, never hidden
            out = {"kinds": {}, "error": f"{type(exc).__name__}: {str(exc)[:6000]}", "raised": True}
        out["seconds"] = round(time.perf_counter() - t, 3)
        out["events"] = [[e[0], e[1], e[2]] for e in cache.events[before:]]
        out["abi"] = abi_text(out["error"])
        if compiles_before is not None:
            out["real_compiles"] = COMPILES["count"] - compiles_before
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
