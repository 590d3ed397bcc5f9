"""Child of tests/test_b12x.py, run in the b12x venv: compiles through b12x's own ``compile()``.

b12x's MXFP8 row quantizer (``_lib/quant/mxfp8_rows.py``, the quantizer of its MXFP8 linear path)
is compiled through b12x's real path (its getter, ``compile()``'s memory cache and disk layer, the
wrapper ``_call_cute_compile``, ``cute.compile``) with the real DSL, in seconds, for an RTX PRO 6000
in a process set up as b12x's own GPU-less compile workers are (``compile_pool._initialize_worker``:
torch.cuda's answers, and the offline target that turns b12x's disk cache on on a CPU host).

Prints one JSON line: our counters, what b12x counted, the files in b12x's cache directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import cute_diskcache

cute_diskcache.install(target="rtx-pro-6000")

import b12x._lib.compiler as compiler  # noqa: E402


def main() -> None:
    import multiprocessing

    import torch
    from b12x._lib import compile_pool
    from b12x._lib.quant import mxfp8_rows

    from cute_diskcache.b12x_sites import native

    # This process stands in for an engine on a GPU, which never runs b12x's worker set-up: it is
    # not one of b12x's pool workers, so b12x's disk stays aside (the set-up below marks it as one).
    native.keep_store_aside()
    compile_pool._initialize_worker(0, (12, 0), "GPU-00000000-0000-0000-0000-000000000000",
                                    "NVIDIA RTX PRO 6000 Blackwell Server Edition", 188, 101376, 102400,
                                    multiprocessing.Array("q", (0, 0)))
    for k in (int(v) for v in os.environ.get("B12X_DRIVER_K", "256").split(",")):
        compiled = mxfp8_rows._get_compiled_mxfp8_rows_quant(k, torch.float16, 8, 128, "linear", device_ordinal=0, sm_count=188)
        assert callable(compiled)
    b12x_dir = compiler._cute_compile_cache_dir()
    print(json.dumps({
        "counters": cute_diskcache.counters(),
        "b12x": compiler.compile_cache_info(),
        "b12x_objects": sorted(p.name for p in Path(b12x_dir).rglob("*.o")) if b12x_dir.is_dir() else [],
        "standing_aside": native.standing_aside(compiler),
        "compiler_file": compiler.__file__,
    }))


if __name__ == "__main__":
    from cute_diskcache import fast_exit

    fast_exit.end(main())  # as our own commands end: after the exit handlers, without the teardown's collections
