"""Our own processes end once their exit handlers have run (cute_diskcache/fast_exit.py).

What the trade must keep: the non-daemon threads are joined and every exit handler runs, in
Python's order (the statistics flush, the remote publisher's drain, a temporary directory's
removal), the output is flushed, the exit code is the command's, an exception still exits as
Python does, and nothing is printed at exit (the first design, ``gc.freeze``, made nanobind print
"leaked N instances" in every process that loaded the DSL: tests/test_faults.py's empty-stderr
checks caught it). What is skipped is the module teardown: a module-level object's finalizer
stands for it here. What it is for (1-3 s less exit a process) is measured side by side in
``bench/exit_cost.py``, not here. Which processes end this way: our entry points, never the
library in an engine's process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Two exit handlers (they must run, the later-registered first), a non-daemon thread (joined
#: first), and a module-level object whose finalizer runs only in the interpreter's teardown.
_SETUP = """
import atexit, sys, threading, time
atexit.register(lambda: print("first handler ran", flush=True))
class Torn:
    def __del__(self):
        print("teardown ran", flush=True)
torn = Torn()
threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
atexit.register(lambda: print("second handler ran", flush=True))
"""
_RAN = ["thread done", "second handler ran", "first handler ran"]


def _child(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k != "CUTE_DSL_ARCH"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


def _ran(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.endswith((" ran", " done"))]


def test_a_plain_exit_runs_everything_including_the_teardown() -> None:
    """The control: without :func:`end`, the module-level finalizer runs (so the next test can fail)."""
    proc = _child(_SETUP + "sys.exit(0)")
    assert proc.returncode == 0, proc.stderr
    assert _ran(proc.stdout) == [*_RAN, "teardown ran"], proc.stdout


def test_end_joins_threads_runs_the_exit_handlers_flushes_and_keeps_the_code() -> None:
    proc = _child(_SETUP + "import logging\nlogging.getLogger('x').addHandler(logging.StreamHandler())\n"
                           "logging.getLogger('x').warning('logged')\n"
                           "sys.stdout.write('unflushed output\\n')\n"
                           "from cute_diskcache.fast_exit import end\nend(3)")
    assert proc.returncode == 3, proc.stderr
    assert _ran(proc.stdout) == _RAN, proc.stdout
    assert "unflushed output" in proc.stdout.splitlines()
    assert proc.stderr == "logged\n"


def test_an_exception_exits_as_python_does() -> None:
    proc = _child(_SETUP + "from cute_diskcache.fast_exit import end\nraise KeyError('boom')\nend(0)")
    assert proc.returncode == 1 and "KeyError: 'boom'" in proc.stderr
    assert _ran(proc.stdout) == [*_RAN, "teardown ran"], proc.stdout


def test_a_process_that_loaded_the_dsl_ends_silently() -> None:
    """The MLIR and Triton bindings' objects: no leak report on stderr (what ``gc.freeze`` caused)."""
    proc = _child("import sys\nfrom cute_diskcache.keys import targets\ntargets.apply('rtx-pro-6000')\n"
                  "import torch, cutlass.cute, importlib\n"
                  "importlib.import_module('flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_dispatch')\n"
                  "from cute_diskcache.fast_exit import end\nend(0)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]


def test_the_library_in_an_engine_s_process_leaves_the_exit_alone() -> None:
    proc = _child(_SETUP + "import cute_diskcache\ncute_diskcache.install()\nsys.exit(0)")
    assert proc.returncode == 0, proc.stderr
    assert _ran(proc.stdout) == [*_RAN, "teardown ran"], proc.stdout


@pytest.mark.parametrize("entry, argv", [("cute_diskcache.cli:console", ["stats"]), ("cute_diskcache.prewarm:console", ["--list-models"])])
def test_the_console_scripts_end_early_and_main_does_not(entry: str, argv: list[str], tmp_path: Path) -> None:
    """pyproject's scripts name the functions that end early; ``main`` (which runs inside other
    programs and tests too) returns."""
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry in scripts.values(), scripts
    module, func = entry.split(":")
    for called, teardown in (("main", True), (func, False)):
        proc = _child(_SETUP + f"import os\nos.environ['CUTE_DISKCACHE_DIR'] = {str(tmp_path / 'root')!r}\n"
                               f"sys.argv = ['x', *{argv!r}]\nfrom {module} import {called}\nsys.exit({called}())")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert _ran(proc.stdout) == _RAN + (["teardown ran"] if teardown else []), (called, proc.stdout[-1500:])


@pytest.mark.parametrize("module, argv", [("cute_diskcache", ["stats"]), ("cute_diskcache.prewarm", ["--list-models"])])
def test_python_dash_m_entry_points_end_early(module: str, argv: list[str], tmp_path: Path) -> None:
    """``python -m`` of each, run as ``__main__``. (The probe ends the same way; a probe that returns
    compiles or loads a kernel, too slow for this.)"""
    proc = _child(_SETUP + f"import os, runpy\nos.environ['CUTE_DISKCACHE_DIR'] = {str(tmp_path / 'root')!r}\n"
                           f"sys.argv = [{module!r}, *{argv!r}]\nrunpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _ran(proc.stdout) == _RAN, proc.stdout[-2000:]
