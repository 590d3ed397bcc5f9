"""vLLM 0.34's JIT monitor over the cache: it sees the compiles the cache could not serve, never a hit.

vLLM wraps ``cutlass.cute.compile`` at the end of every worker's warm-up
(``vllm.utils.jit_monitor.activate``: ``cute.compile = _MonitoredCuteCompile(cute.compile)``) and
reports every call it sees: a WARNING in ``warn`` mode, a RuntimeError in ``error`` mode. Each
check runs vLLM's own module in a fresh process of the vLLM venv (``tests/vllm_driver.py
monitor``), after a cold process (``serve``, what warm-up or a prewarm does) filled the cache with
flashinfer's micro kernel for m=1; m=2 is never prewarmed. Real compiles are counted
independently of our counters (``conftest``'s ``sitecustomize``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cute_diskcache.storage import layout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import child_env, split_stderr  # noqa: E402
from test_vllm import DRIVER, pytestmark, served_cold, vllm_python  # noqa: E402,F401  (the venv and cold root fixtures; the same skips and marks)

#: vLLM's own report of a CuTe-DSL compile after warm-up (jit_monitor._handle_jit_event).
JIT_EVENT = "CuTeDSL JIT compilation during inference: MoEMicroKernel"


def _driver(python: Path, hook_dir: Path, root: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run([str(python), str(DRIVER), *args], env=child_env(root, env, hook_dir), cwd=root.parent,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    _, ours, real = split_stderr(proc.stderr)
    out.update(stdout=proc.stdout, cache_log=ours, real_compiles=real,
               jit_events=[ln for ln in (proc.stdout + proc.stderr).splitlines() if JIT_EVENT in ln])
    return out


@pytest.fixture(scope="module")
def prewarmed(served_cold: tuple[Path, dict[str, Any]]) -> Path:
    """A root holding the m=1 micro kernel, compiled by a process without the monitor (warm-up):
    the run's cold vLLM process (test_vllm's ``served_cold``). Copy it (:func:`_copy`)."""
    root, cold = served_cold
    assert cold["counters"]["compiles"] == 1 and cold["real_compiles"] == 1, cold
    return root


def _copy(prewarmed: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(prewarmed, root, symlinks=True)
    return root


def _entries(root: Path) -> int:
    return sum(1 for _ in layout.entry_dirs(root))


def test_error_mode_serves_a_prewarmed_kernel_and_raises_for_a_real_compile(vllm_python: Path, compile_hook_dir: Path,
                                                                           prewarmed: Path, tmp_path: Path) -> None:
    root = _copy(prewarmed, tmp_path)
    before = _entries(root)
    # One process, as an engine serves: the prewarmed m=1, then m=2, which nobody prewarmed.
    run = _driver(vllm_python, compile_hook_dir, root, "monitor", "error", "1", "2")
    # m=1 is a hit the monitor never sees: in error mode it would have raised its RuntimeError
    assert not run["raised"]["1"].startswith("RuntimeError"), run["raised"]  # the launch fails only for want of a GPU
    assert run["raised"]["2"].startswith(f"RuntimeError: {JIT_EVENT}"), run["raised"]
    assert run["hits"] == 1 and run["misses"] == 1 and run["compiles"] == 0 and run["real_compiles"] == 0, run
    # vLLM's words for m=2 are in what it raised (the JSON line) and in our "not compiled" line; it
    # said nothing else, and nothing of m=1's hit
    said = [ln for ln in run["jit_events"] if not ln.startswith("{") and " WARNING not compiled: " not in ln]
    assert said == [] and len(run["jit_events"]) == 2, run["jit_events"]
    last = run["cache_log"][-1]
    assert last.startswith("[cute-diskcache] INFO this process: 1 hit, ") and "; 1 miss, none compiled" in last, run["cache_log"]
    # m=2's "compiling" line said what was tried; one line says it did not happen, in vLLM's words;
    # m=1 (the hit) says nothing
    warnings = [ln for ln in run["cache_log"] if " WARNING " in ln]
    assert len(warnings) == 2 and " WARNING compiling " in warnings[0], warnings
    [refused] = [ln for ln in warnings if "not compiled:" in ln]
    assert refused.startswith("[cute-diskcache] WARNING not compiled: flashinfer.moe_dispatch.micro ") and f"RuntimeError: {JIT_EVENT}" in refused
    assert _entries(root) == before  # nothing written under anyone's name


def test_warn_mode_warns_once_for_the_real_compile_and_never_for_the_hit(vllm_python: Path, compile_hook_dir: Path,
                                                                         prewarmed: Path, tmp_path: Path) -> None:
    root = _copy(prewarmed, tmp_path)
    before = _entries(root)
    run = _driver(vllm_python, compile_hook_dir, root, "monitor", "warn", "1", "2")
    assert run["hits"] == 1 and run["compiles"] == 1 and run["real_compiles"] == 1, run
    assert len(run["jit_events"]) == 1, run["jit_events"]  # m=2's compile; m=1's hit is no JIT event
    compiling = [ln for ln in run["cache_log"] if " WARNING compiling " in ln]
    assert len(compiling) == 1 and "_MonitoredCuteCompile" not in compiling[0], compiling
    assert _entries(root) == before + 1  # m=2's entry; m=1's was found, not written again under the wrapper's name
    again = _driver(vllm_python, compile_hook_dir, root, "monitor", "warn", "1", "2")
    assert again["hits"] == 2 and again["real_compiles"] == 0 and again["jit_events"] == [], again


def test_on_miss_error_raises_ours_before_the_monitor_sees_anything(vllm_python: Path, compile_hook_dir: Path,
                                                                   prewarmed: Path, tmp_path: Path) -> None:
    root = _copy(prewarmed, tmp_path)
    run = _driver(vllm_python, compile_hook_dir, root, "monitor", "warn", "1", "2", env={"CUTE_DISKCACHE_ON_MISS": "error"})
    assert run["hits"] == 1 and run["real_compiles"] == 0 and run["jit_events"] == [], run
    assert run["raised"]["2"].startswith("CacheMissError: CUTE_DISKCACHE_ON_MISS=error: not compiling "), run["raised"]


def test_a_wrapper_keeps_watching_after_the_cache_detaches(vllm_python: Path, compile_hook_dir: Path, tmp_path: Path) -> None:
    """``uninstall()`` gives ``cute.compile`` back to the wrapper that wrapped us, not to the bare compile."""
    code = ("import os; os.environ['CUTE_DISKCACHE_TARGET'] = 'rtx-pro-6000'\n"
            "import cute_diskcache; cute_diskcache.install()\n"
            "import cutlass.cute as cute\n"
            "from vllm.utils import jit_monitor; jit_monitor.activate(mode='warn')\n"
            "ours = cute.compile\n"
            "cute_diskcache.uninstall()\n"
            "print(type(ours).__name__, type(cute.compile).__name__, type(cute.compile._inner).__name__, type(cute).__name__)\n")
    out = subprocess.run([str(vllm_python), "-c", code], env=child_env(tmp_path / "root", None, compile_hook_dir), cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-4:] == ["_Dispatch", "_MonitoredCuteCompile", "_Dispatch", "module"], out.stdout


def test_jit_monitor_source_still_wraps_cute_compile_as_front_assumes(vllm_python: Path) -> None:
    """What :mod:`cute_diskcache.core.front` relies on: vLLM assigns a wrapper that calls what it wrapped."""
    code = "import inspect, vllm.utils.jit_monitor as j; print(inspect.getsource(j._setup_cutedsl_jit_hook)); print(inspect.getsource(j._MonitoredCuteCompile))"
    src = subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True, timeout=300, cwd="/").stdout
    assert "cute.compile = _MonitoredCuteCompile(cute.compile)" in src
    assert re.search(r"return self\._inner\(\*args, \*\*kwargs\)", src) and "self._inner[options]" in src
    assert os.path.basename(str(DRIVER)) == "vllm_driver.py"
