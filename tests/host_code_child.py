"""A serving process for one tiny kernel (tests/tiny_kernel.py): hit it through ``cached_compile``
and call it as far as a machine without a GPU can go, the CUDA driver. Prints one JSON line.

Run as ``python host_code_child.py build`` it compiles the kernel into the cache instead (the
prewarm of the tests), printing the compile count. ``--dsl-abi``: the DSL's own ABI (no
``--enable-tvm-ffi``; b12x compiles so). ``CUTE_DISKCACHE_*`` come from the parent.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_120a")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy  # noqa: E402  (after the arch is set: the DSL reads it at import)
from cutlass.cute.runtime import from_dlpack  # noqa: E402

import cute_diskcache  # noqa: E402
from tiny_kernel import add_one  # noqa: E402

cute_diskcache.install()
out: dict[str, object] = {}
a = numpy.zeros(128, dtype=numpy.float32)
dsl_abi = "--dsl-abi" in sys.argv
options = None if dsl_abi else "--enable-tvm-ffi"
try:
    kernel = cute_diskcache.cached_compile(add_one, from_dlpack(a), 5, key=("tiny", 128, dsl_abi), options=options)
except cute_diskcache.CacheMissError as exc:
    out["refused"] = str(exc)
else:
    out["type"] = f"{type(kernel).__module__}.{type(kernel).__qualname__}"
    # where its host code came from: the DSL's JIT of this compile, or an object loaded from bytes
    out["engine"] = type(getattr(kernel, "engine", None)).__name__
    if "build" not in sys.argv[1:]:
        try:
            kernel(a, 5)
            out["returned"] = True
        except Exception as exc:  # the driver call is as far as a CPU-only machine goes
            out["raised"] = f"{type(exc).__name__}: {exc}"
counters = cute_diskcache.counters()
out.update(hits=counters["hits"], compiles=counters["compiles"])
print(json.dumps(out))
