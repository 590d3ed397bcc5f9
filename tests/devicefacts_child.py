"""One fresh process compiling a tiny kernel that reads a device attribute, for test_devicefacts.

The kernel launches with ``min_blocks_per_mp=2``, so the DSL asks the driver for
MAX_SHARED_MEMORY_PER_MULTIPROCESSOR while compiling and bakes the answer into the IR: the
device fact issue 7 is about. The target profile may be altered (``--set NAME=VALUE``) or lose
an attribute (``--drop NAME``), standing in for a card whose facts differ from the build's.
Prints one JSON line: counters, or the error the compile raised.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--profile", default="rtx-pro-6000")
ap.add_argument("--set", action="append", default=[], help="DRIVER_ATTRIBUTE=value")
ap.add_argument("--drop", action="append", default=[], help="DRIVER_ATTRIBUTE")
ap.add_argument("--min-blocks", type=int, default=2)
args = ap.parse_args()

logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="LOG %(levelname)s %(message)s")

from cute_diskcache.keys import devicefacts, targets  # noqa: E402

base = targets.get(args.profile)
changes = tuple((k, int(v)) for k, v in (s.split("=", 1) for s in args.set)) + tuple((k, None) for k in args.drop)
profile = dataclasses.replace(base, attributes=changes)
targets.apply(profile)
devicefacts.install_hook()  # the DSL's driver attribute queries answered from the profile

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor  # noqa: E402

import cute_diskcache  # noqa: E402


@cute.kernel
def _add_one(x: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    x[tidx] = x[tidx] + cutlass.Float32(1.0)


@cute.jit
def add_one(x: cute.Tensor, min_blocks: cutlass.Constexpr):
    _add_one(x).launch(grid=(1, 1, 1), block=(32, 1, 1), min_blocks_per_mp=min_blocks)


out: dict = {"cache_dir": os.environ.get("CUTE_DISKCACHE_DIR")}
try:
    x = make_fake_compact_tensor(cutlass.Float32, (32,))
    cute_diskcache.cached_compile(add_one, x, args.min_blocks, key=("add_one", 32, args.min_blocks))
except Exception as exc:  # the test reads what a failed compile says
    out["error"] = f"{type(exc).__name__}: {exc}"
out["counters"] = cute_diskcache.counters()
print(json.dumps(out))
