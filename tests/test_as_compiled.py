"""A hit hands the caller what a compile hands it (issue 28, item 2), on every site kind of both releases.

``scripts/compat_child.py --results`` drives every covered site kind through flashinfer's own
entry points and summarises each kernel flashinfer got: the classes it is an instance of,
every public attribute (plain value, type, method, or the exception reading it raises), the
object ``export_to_c`` writes, and what a call with every argument by keyword raises. A cold
process (compiles) and a fresh warm one (hits) must give the same summaries: flashinfer
0.6.15.post1 in this interpreter, 0.7.4 in the second venv (``test_flashinfer_074``'s fixture).
Nothing may differ. A CuTe-ABI kernel (no tvm-ffi) used to differ in how it was loaded
(``as_compiled.LOADER_FACTS``: the compile's was the DSL's JIT, a hit's its loader); since host code
is written for a baseline, the compiling process is handed its entry as a hit loads it, so that
difference is gone wherever the entry was written (docs/keys.md).

Without the fix a hit was a ``Convention`` (tvm-ffi kernels) of no DSL class, with no
``export_to_c``: flashinfer 0.7.4's KDA refused it, flashinfer's own disk cache could not export it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compat import REPO, matrix  # noqa: E402
from test_flashinfer_074 import fi074  # noqa: E402,F401  (the 0.7.4 interpreter fixture)


pytestmark = pytest.mark.slow
CHILD = REPO / "scripts" / "compat_child.py"
SITES_0615 = ["micro", "static", "dynamic", "w4a16_gemm", "w4a16_fused_moe", "w4a16_activation", "w4a16_topk_sum"]
SITES_074 = ["micro", "static", "dynamic", "direct_micro", "fp8_gemm", "w4a4", "w4a16_gemm", "w4a16_fused_moe",
             "w4a16_activation", "w4a16_topk_sum"]
_DROPPED = ("CUTE_DISKCACHE_", "FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH", "FLASHINFER_WORKSPACE_", "PYTHONPATH")


def _child(python: str, root: Path, sites: list[str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED)}
    env.update(PYTHONPATH=str(REPO), CUTE_DISKCACHE_DIR=str(root), FLASHINFER_WORKSPACE_BASE=str(root.parent / "workspace"))
    proc = subprocess.run([python, str(CHILD), "--target", "rtx-pro-6000", "--results", *sites], env=env, cwd=root.parent,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cold_and_warm(python: str, tmp_path: Path, sites: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    root = tmp_path / "root"
    cold = _child(python, root, sites)
    warm = _child(python, root, sites)
    assert cold["real_compiles"] == len(sites) and warm["real_compiles"] == 0, (cold["counters"], warm["counters"])
    return cold, warm


def _check(cold: dict[str, Any], warm: dict[str, Any], sites: list[str]) -> None:
    differences = {s: matrix().result_differences(cold["sites"][s].get("results"), warm["sites"][s].get("results")) for s in sites}
    assert differences == {s: [] for s in sites}, differences
    for site in sites:
        (c,), (w,) = cold["sites"][site]["results"], warm["sites"][site]["results"]
        assert "cutlass.base_dsl.jit_executor.JitCompiledFunction" in c["classes"], (site, c["classes"])
        tvm_ffi = any("TVMFFI" in cls for cls in c["classes"])
        # the same bytes exported; a CuTe-ABI export the DSL itself cannot write (0.7.4's direct
        # micro kernel: "Error generating c header arguments") fails alike on both
        assert c["export"] == w["export"] and (isinstance(c["export"], dict) or not tvm_ffi), (site, c["export"], w["export"])
        assert c["keywords"] is not None and c["keywords"] == w["keywords"], (site, c["keywords"], w["keywords"])
        differ = {n for n in c["public"] if c["public"][n] != w["public"].get(n)}
        # tvm-ffi kernels run the captured baseline object in both; a CuTe-ABI compile is handed its entry
        assert differ == set(), (site, tvm_ffi, differ)


def test_hits_on_0_6_15_post1_are_what_compiles_return(tmp_path: Path) -> None:
    cold, warm = _cold_and_warm(sys.executable, tmp_path, SITES_0615)
    assert cold["flashinfer"] == "0.6.15.post1"
    _check(cold, warm, SITES_0615)


def test_hits_on_0_7_4_are_what_compiles_return(fi074: str, tmp_path: Path) -> None:  # noqa: F811
    cold, warm = _cold_and_warm(fi074, tmp_path, SITES_074)
    assert cold["flashinfer"] == "0.7.4"
    _check(cold, warm, SITES_074)


def test_an_entry_without_the_compiles_class_is_a_miss_not_a_look_alike() -> None:
    """Side data written before the class was kept (or of another shape) is refused: a hit never
    hands back an object of another class than the compile's."""
    from cute_diskcache.core.convention import side_data_ok

    good = {"kwargs_wrapper": False, "calling_convention": None, "result": None}
    assert side_data_ok(good)
    assert not side_data_ok({"kwargs_wrapper": False, "calling_convention": None})  # older writer: no "result"
    assert not side_data_ok({**good, "result": {"class": ["cutlass.x", "Y"]}})  # not the shape describe() writes
