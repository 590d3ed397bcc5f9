"""Our own command-line processes end as soon as their exit handlers have run.

A process that imported torch, the CuTe DSL and flashinfer tracks about 355,000 objects, and
CPython collects them several times while it tears its modules down at exit: 1.5 s on the quiet
2-core AMD EPYC VM, 2.2-2.5 s under load (``bench/exit_cost.py``). ``check`` in a deploy gate,
each ``prewarm`` worker and each probe pays that after its work is done and its answer printed.

Freezing the heap first (``gc.freeze``) skips the collections but leaves the MLIR and Triton
bindings' objects unfreed, and nanobind then prints "leaked N instances" on stderr at every
exit. So :func:`end` does what the interpreter's exit does up to its teardown, in its order (join
the non-daemon threads, run every exit handler last-registered first: the statistics flush and
the remote publisher's drain among them), flushes the standard streams, and ends with
``os._exit``, as the standard library ends a ``multiprocessing`` child. What is skipped is the
module teardown and its collections, and with them finalizers of objects still alive at exit,
which Python never promised to run. An exception in the command never gets here: that exit stays
Python's own, traceback and all. Without the two interpreter hooks it uses (another Python), the
exit is Python's own too.

That trade is ours to make for our own processes only: the library never ends an engine's
process (its exit is the engine's business); only the entry points of ``python -m
cute_diskcache``, ``cute-diskcache``, prewarm (and its workers) and the probe call :func:`end`;
so do the test suite's drivers (``tests/*_driver.py``), once they have printed their answer,
except vLLM's, whose teardown is what some of its tests watch.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def end(code: int | None) -> NoReturn:
    """End the process with the command's exit ``code`` (``sys.exit``'s meaning of None and ints)."""
    shutdown = getattr(threading, "_shutdown", None)
    run_handlers = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_handlers is None:
        sys.exit(code)
    shutdown()
    run_handlers()
    status = 0 if code is None else code
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, a stream closed: Python's own exit says 120
            status = status or 120
    os._exit(status)
