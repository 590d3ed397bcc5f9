"""Child of tests/test_b12x.py: what vLLM 0.34's b12x warm-up compiles for a model's NVFP4 linears,
in a fresh process, counting real compiles.

vLLM's warm-up calls ``blockscaled.mm_nvfp4`` per linear shape and token count; b12x resolves each
call to a declaration and materialises it by running its ``CompileJob`` factories (the lazy path's
``_materialize`` calls the same factory with the same arguments). On a CPU box the call itself
cannot run (it launches), so this child makes b12x's own planning calls
(:func:`cute_diskcache.b12x_sites.planning.plan`: ``query_from_call`` -> ``heuristic_plan`` ->
the default configuration -> ``_compile_jobs``) and runs every factory in-process, in b12x's GPU-less
compile environment for the target. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys

from cute_diskcache.keys import targets
from cute_diskcache.prewarm import models
from cute_diskcache.b12x_sites import planning

model, target, ms = sys.argv[1], sys.argv[2], tuple(int(m) for m in sys.argv[3].split(","))
planning.init_worker(target)
jobs = planning.plan(models.dense_shape(model), ms, targets.get(target))
results = [planning.run_job(j.job) for j in jobs]
import cute_diskcache  # noqa: E402

print(json.dumps({"jobs": len(jobs), "counters": cute_diskcache.counters(),
                  "compiles": sum(r["compiles"] for r in results), "hits": sum(r["hits"] for r in results)}))
