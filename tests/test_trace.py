"""cute_diskcache.keys.trace: a kernel's traced IR without lowering it (issue 31, groundwork).

Real DSL, real flashinfer, each case in a fresh process (tests/trace_driver.py). What must hold
for a second-stage key to be sound:

* the digest is blind to where the source lies (path, line) but not to what it traces, and keeps
  locations when the compile emits line info (they reach the cubin then);
* a trace lowers nothing and leaves the DSL's per-compile state and JIT cache as it found them;
  the caller's own finalize hooks still run, first;
* the digest a compile records of what it lowered equals the trace's, and a compile after a trace
  produces the same cubin and object as a compile alone (tracing stores traced values on
  flashinfer's kernel objects: the compile that follows must not see a difference).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

DRIVER = Path(__file__).resolve().parent / "trace_driver.py"
REPO = DRIVER.parent.parent

TINY = '''import cutlass
import cutlass.cute as cute


@cute.kernel
def body(x: cute.Tensor, k: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    x[tidx] = x[tidx] + k


@cute.jit
def launch(x: cute.Tensor, k: cutlass.Constexpr):
    body(x, k).launch(grid=(1, 1, 1), block=(32, 1, 1))
'''


def _drive(*args: str, cwd: Path, python: str = sys.executable) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k != "CUTE_DSL_ARCH"}
    env["CUTE_DISKCACHE_DIR"] = str(cwd / "root")
    if python != sys.executable:  # a matrix cell's interpreter: this checkout on its path
        env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([python, str(DRIVER), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tiny(base: Path, python: str = sys.executable) -> dict[str, Any]:
    """The same kernel source in two places, the second three lines further down."""
    (base / "a").mkdir()
    (base / "elsewhere" / "b").mkdir(parents=True)
    (base / "a" / "tiny_kernel.py").write_text(TINY)
    (base / "elsewhere" / "b" / "tiny_kernel.py").write_text("# moved\n\n\n" + TINY)
    return _drive("tiny", str(base / "a"), str(base / "elsewhere" / "b"), cwd=base, python=python)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _tiny(tmp_path_factory.mktemp("trace-tiny"))


def test_digest_ignores_where_the_source_lies(tiny: dict[str, Any]) -> None:
    assert tiny["unsupported"] is None
    assert tiny["stripped"] is True
    assert tiny["a"] == tiny["b"]
    # The DSL's own hash keeps the locations: it differs for the same code moved.
    assert tiny["dsl_hash_a"] != tiny["dsl_hash_b"]


def test_settings_leave_out_the_install_prefix(tiny: dict[str, Any]) -> None:
    """The DSL renders its runtime library's absolute path into its settings; the same DSL in
    another venv or image must not make every digest differ (the library's flavour stays)."""
    assert tiny["dsl_root"].endswith("nvidia_cutlass_dsl")
    assert tiny["dsl_root"] in tiny["raw_settings"]
    assert tiny["dsl_root"] not in tiny["settings"]
    assert tiny["settings"] == tiny["raw_settings"].replace(tiny["dsl_root"], "<nvidia_cutlass_dsl>")


def test_digest_follows_what_is_traced(tiny: dict[str, Any]) -> None:
    assert tiny["other_constant"] != tiny["a"]  # a Constexpr of 2 instead of 1: other IR


def test_line_info_keeps_locations(tiny: dict[str, Any]) -> None:
    assert tiny["line_info_stripped"] is False
    assert tiny["line_info_a"] != tiny["line_info_b"]  # the locations reach the cubin's line table
    assert tiny["line_info_a"] != tiny["a"]  # and the option itself is in the digest


def test_trace_lowers_nothing_and_leaves_the_dsl_as_it_was(tiny: dict[str, Any]) -> None:
    assert tiny["lowered_by_traces"] == 0
    assert tiny["lowered_before_compile"] == 0
    assert tiny["state_kept"] is True
    assert tiny["lowered_after_compile"] == 1


def test_caller_hooks_run_first_and_change_nothing(tiny: dict[str, Any]) -> None:
    assert tiny["hook_order"] == [f"theirs:{tiny['function_name']}:True"]
    assert tiny["hooked"] == tiny["a"]


def test_compile_records_the_digest_of_what_it_lowered(tiny: dict[str, Any]) -> None:
    assert tiny["compiled_digest"] == tiny["a"]
    assert tiny["compiled_type"]


def test_what_the_dsl_refuses_raises_the_dsl_error(tiny: dict[str, Any]) -> None:
    assert tiny["refused"] not in (None, "TraceUnavailable", "_Stop")


def _compare(kernels: list[str], tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    (tmp_path / "t").mkdir()
    (tmp_path / "c").mkdir()
    traced_first = _drive("flashinfer", "--order", "trace,compile,trace", *kernels, cwd=tmp_path / "t")
    alone = _drive("flashinfer", "--order", "compile", *kernels, cwd=tmp_path / "c")
    return traced_first, alone


def _check(traced_first: dict[str, Any], alone: dict[str, Any], kernels: list[str]) -> None:
    assert sorted(traced_first) == sorted(alone) == sorted(kernels)
    for name in kernels:
        t, c = traced_first[name], alone[name]
        assert t["traced"][0] == t["traced"][1] == t["compiled_digest"] == c["compiled_digest"], name
        assert t["cubins"] and t["cubins"] == c["cubins"], name
        assert t["object"] == c["object"], name


def test_compile_after_trace_equals_compile_alone_w4a16(tmp_path: Path) -> None:
    kernels = ["w4a16_activation", "w4a16_topk_sum"]
    _check(*_compare(kernels, tmp_path), kernels)


@pytest.mark.slow
def test_compile_after_trace_equals_compile_alone_moe(tmp_path: Path) -> None:
    """flashinfer's MoE kernels keep traced values on the kernel object: a trace, then the compile
    on the same object, must give the cubin a compile alone gives."""
    kernels = ["micro", "static", "dynamic"]
    _check(*_compare(kernels, tmp_path), kernels)


#: One cell per DSL generation: 4.5 (no finalize hooks), 4.6 and 4.7 (settings rendered from the
#: environment manager's attributes), 4.8.0 (``cache_key_str``); 4.8.1 is this venv's.
DSL_CELLS = ("fi0.6.12-dsl4.5.0-cu13", "fi0.6.18.post1-dsl4.6.2", "fi0.7.1-dsl4.7.0", "fi0.7.2.post1-dsl4.8.0")


@pytest.mark.slow
@pytest.mark.parametrize("cell", DSL_CELLS)
def test_each_dsl_generation(cell: str, tmp_path: Path) -> None:
    """The same entry points on every DSL release the matrix proves (venvs built as it builds them)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _compat import SCRATCH, matrix

    m = matrix()
    (found,) = [c for c in m.CELLS if c.name == cell]
    out = _tiny(tmp_path, str(m.cell_venv(found, SCRATCH)))
    assert out["compiled_type"] and out["lowered_after_compile"] == 1
    if found.dsl.startswith("4.5"):
        assert out["unsupported"] and "trace_finalize_hooks" in out["unsupported"]
        assert out["raised"] == "TraceUnavailable" and out["compiled_digest"] is None
        return
    assert out["unsupported"] is None and out["lowered_by_traces"] == 0 and out["state_kept"] is True
    assert out["a"] == out["b"] == out["compiled_digest"] != out["other_constant"]
    assert out["dsl_hash_a"] != out["dsl_hash_b"] and out["line_info_a"] != out["line_info_b"]
    assert out["dsl_root"] not in out["settings"] and out["dsl_root"] in out["raw_settings"]
