"""Child of tests/test_b12x_moe.py: vLLM 0.34's b12x MoE warm-up for a model, in a fresh process.

``B12xExperts.warmup_launches``'s b12x calls (plan_execution per token count, then plan(Caps) ->
bind -> run for the first count of each execution signature; :func:`cute_diskcache.b12x_sites.moe.drive`)
with our cache serving, in b12x's GPU-less compile environment for the target (its disk layer on,
so a kernel goes through b12x's load / miss / compile / store path as on a card). There is no card
to launch on: kernels are handed back launching nothing (``launching_nothing``), after the cache
served or compiled them. b12x's miss lines (``B12X_LOG_CUTE_COMPILES``) go to stdout; the last
line is JSON: our counters and b12x's.
"""

from __future__ import annotations

import json
import sys

from cute_diskcache.b12x_sites import moe, planning
from cute_diskcache.core import through
from cute_diskcache.keys import targets
from cute_diskcache.prewarm import models

model, target, counts = sys.argv[1], sys.argv[2], tuple(int(m) for m in sys.argv[3].split(","))
planning.init_worker(target)
import b12x._lib.compiler as compiler  # noqa: E402

import cute_diskcache  # noqa: E402

with through.launching_nothing():
    launched = moe.drive(moe.layer_of(models.moe_shape(model), "bfloat16"), "nvfp4", counts, targets.get(target).sm_count)
print(json.dumps({"launched": launched, "counters": cute_diskcache.counters(), "b12x": compiler.compile_cache_info()}))
