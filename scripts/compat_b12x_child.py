#!/usr/bin/env python3
"""Child of ``scripts/compat_b12x.py``: one b12x process, counting real compiles.

``plan`` is the fresh process after a b12x prewarm: it makes, in this one process, the calls
vLLM 0.34's b12x warm-up resolves to for a model's NVFP4 linears (``tests/b12x_linear_driver.py``:
b12x's own planning, then every ``CompileJob`` factory in b12x's GPU-less compile environment for
the target), with the DSL's ``CompileCallable._compile``
counted from the moment the DSL is imported (``compat_child._CountCompiles``): a compile our
cache did not see is counted too. ``runtime`` compiles (cold) or loads (warm) one kernel the
way a serving process does, through b12x's own getter: the path every b12x release takes, with or
without the planning API. Prints one JSON line: our counters, the DSL's real compiles and every
cache event (site, digest, event) so the matrix can compare them with the entries written before.

    python scripts/compat_b12x_child.py plan MODEL TARGET 1,8     # the prewarm's kernels, after it
    python scripts/compat_b12x_child.py runtime TARGET [--offline]  # one kernel through b12x's getter
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compat_child  # the DSL compile counter; imports nothing of the DSL's


def planned(model: str, target: str, ms: tuple[int, ...]) -> dict[str, Any]:
    """vLLM's NVFP4 linear warm-up as b12x plans it (>= 1.5.0): every job's factory, in this process."""
    from cute_diskcache.keys import targets
    from cute_diskcache.prewarm import models
    from cute_diskcache.b12x_sites import planning

    planning.init_worker(target)
    jobs = planning.plan(models.dense_shape(model), ms, targets.get(target))
    results = [planning.run_job(j.job) for j in jobs]
    return {"jobs": len(jobs), "factories": sorted({j.factory for j in jobs}),
            "compiles": sum(r["compiles"] for r in results), "hits": sum(r["hits"] for r in results),
            "errors": sum(r["errors"] for r in results)}


def runtime(target: str, workdir: Path, offline: bool) -> dict[str, Any]:
    """One kernel through b12x's own getter, as a serving process compiles it: b12x's MXFP8 row
    quantizer (``_lib/quant/mxfp8_rows.py``, in every b12x release here; the quantizer of its MXFP8
    linear path), through ``compile()`` and the wrapper, in a process set up as a serving one (the
    target profile standing in for the card), or with ``offline`` as b12x's offline compile worker
    (``no_jit_engine`` compiles, as prewarm's). What the cache handed b12x is summarised
    (``compat_child.result_summary``)."""
    import inspect

    import cute_diskcache
    from cute_diskcache.keys import targets

    from cute_diskcache.b12x_sites import adapter, sites
    from cute_diskcache.core import sitescan

    # Read from b12x's source: importing b12x before install() would let it see no target profile.
    if not sitescan.missing_definitions(Path(adapter.package_dir() or "."), sites.PLANNING_API):
        # b12x >= 1.5.0 asks torch.cuda for the device as it compiles: only its GPU-less compile
        # worker set-up answers on a CPU box. That set-up also makes every compile an offline one
        # (``no_jit_engine``); a serving process's compile is not, unless ``offline``.
        from b12x._lib import compiler

        from cute_diskcache.b12x_sites import planning

        planning.init_worker(target)
        compiler._OFFLINE_CUTE_NO_JIT = offline
    elif offline:
        raise SystemExit("this b12x has no offline compile workers")
    else:
        cute_diskcache.install(target=target)
    import torch
    from b12x._lib.quant import mxfp8_rows

    returned = compat_child._returned_kernels()
    getter = mxfp8_rows._get_compiled_mxfp8_rows_quant
    kwargs = {"device_ordinal": 0, "sm_count": targets.get(target).sm_count}
    accepted = inspect.signature(getter).parameters
    kernel = getter(256, torch.float16, 8, 128, "linear", **{k: v for k, v in kwargs.items() if k in accepted})
    counters = cute_diskcache.counters()
    workdir.mkdir(parents=True, exist_ok=True)
    return {"callable": callable(kernel), "compiles": counters["compiles"], "hits": counters["hits"],
            "errors": counters["errors"], "results": [compat_child.result_summary(k, workdir) for k in returned]}


def main(argv: list[str]) -> int:
    sys.meta_path.insert(0, compat_child._CountCompiles())
    if argv[0] == "plan":
        out = planned(argv[1], argv[2], tuple(int(m) for m in argv[3].split(",")))
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            out = runtime(argv[1], Path(tmp), offline="--offline" in argv)
    import cute_diskcache
    from cute_diskcache.core.cache import default_cache

    print(json.dumps({
        **out,
        "real_compiles": compat_child.COMPILES["count"],
        "counters": cute_diskcache.counters(),
        "events": [[e[0], e[1], e[2]] for e in default_cache().events],
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
