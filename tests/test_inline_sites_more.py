"""flashinfer 0.7.4's inline sites that no other test drives, through flashinfer's own functions (issue 22, item 4).

Block-sparse attention SM120 (the bf16 forward and the Sage INT8/FP8 forward) and the frost
low-latency MoE's SM120 grouped tensor-core decode (BF16 and DeepSeek FP8 weights) compile their
sm12x kernel inline (``flashinfer_sites`` intercepts ``cutlass.cute.compile`` there). Driven on
CPU for the rtx-pro-6000 profile by ``tests/fi074_inline_driver.py`` (CUDA tensors stood in by
torch fake tensors, see its docstring): a cold process compiles each kernel once and persists
it, a fresh process compiles nothing (counted independently, at the DSL's compile entry, by
conftest's ``sitecustomize``) and hits every entry. About 25 s on two cores.

Which of the 22 inline sites are driven where, and why the rest cannot be here:
docs/versions.md, "Limits".
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_flashinfer_074 import FI074, TARGET, Child, _by_site as outcomes, _json_report, _manifests, _run, fi074  # noqa: E402,F401

pytestmark = [
    pytest.mark.skipif(FI074 == "off", reason="CUTE_DISKCACHE_FI074_PYTHON=off: flashinfer 0.7.4 tests skipped"),
    pytest.mark.slow,
]
DRIVER = Path(__file__).resolve().parent / "fi074_inline_driver.py"
#: driver site -> the site name our entries carry (flashinfer.<family>.<kind> of the inline table)
SITES = {"bsa_fwd": "flashinfer.bsa.bsa_fwd", "bsa_sage_fwd": "flashinfer.bsa.bsa_sage_fwd",
         "frost_grouped": "flashinfer.frost.frost_grouped", "frost_deepseek_fp8": "flashinfer.frost.frost_deepseek_fp8"}


def drive(child: Child, *sites: str) -> dict[str, Any]:
    return _json_report(_run([str(FI074), str(DRIVER), "--target", TARGET, *sites], child.env(), child.hook_dir))


@pytest.fixture(scope="module")
def runs(fi074: str, tmp_path_factory: pytest.TempPathFactory, compile_hook_dir: Path) -> dict[str, Any]:  # noqa: F811
    base = tmp_path_factory.mktemp("fi074-inline-more")
    child = Child(base / "root", base / "workspace", compile_hook_dir)
    cold = drive(child, *SITES)
    warm = drive(child, *SITES)
    return {"root": child.root, "cold": cold, "warm": warm}


def test_each_site_compiles_once_cold_and_nothing_in_a_fresh_process(runs: dict[str, Any]) -> None:
    cold, warm = runs["cold"], runs["warm"]
    assert outcomes(cold) == {site: ["miss"] for site in SITES.values()}, cold["events"]
    assert cold["real_compiles"] == len(SITES) and cold["counters"]["writes"] == len(SITES), cold["counters"]
    assert outcomes(warm) == {site: ["hit"] for site in SITES.values()}, warm["events"]
    assert warm["real_compiles"] == 0 and warm["counters"]["compiles"] == 0, warm["counters"]
    # the same kernels: each fresh-process hit is the entry the cold process wrote
    assert [e[1] for e in warm["events"]] == [e[1] for e in cold["events"]]


def test_the_call_after_the_kernel_fails_alike_cold_and_warm(runs: dict[str, Any]) -> None:
    """Without a GPU the step after the compile (or the load) fails: the same way in both processes,
    so the loaded kernel reached the point the compiled one did."""
    cold, warm = runs["cold"]["sites"], runs["warm"]["sites"]
    for name in SITES:
        assert cold[name]["error"] and warm[name]["error"] == cold[name]["error"], (name, cold[name], warm[name])
        assert "cute-diskcache" not in cold[name]["error"], cold[name]


def test_the_keys_name_the_kernel_objects_and_the_live_call(runs: dict[str, Any]) -> None:
    """The key holds what the compile received: BSA's kernel object with its whole state and the
    CUDA stream of its live path (not the fake TVM-FFI stream of its fake-mode pre-compile path:
    another signature); frost's launcher by its code, its tactic constants and its architecture,
    compiled for sm_120a as a TVM-FFI function."""
    manifests = _manifests(runs["root"])
    assert set(manifests) == set(SITES.values()), sorted(manifests)
    bsa = manifests["flashinfer.bsa.bsa_fwd"]["key_repr"]
    assert "BlockSparseAttnForwardSm120Blk64'" in bsa and "('gqa_ratio', 4)" in bsa, bsa[:3000]
    sage = manifests["flashinfer.bsa.bsa_sage_fwd"]["key_repr"]
    assert "BlockSparseAttnForwardSageSm120Blk64'" in sage and "('qk_acc_dtype', ('class', 'cutlass.base_dsl.typing.Int32'))" in sage
    for key in (bsa, sage):
        assert key.endswith("('stream', 'cuda.bindings.driver.CUstream'))), ('kwargs', ('dict', ())))"), key[-300:]
    for name, module in (("frost_grouped", "tc.runtime"), ("frost_deepseek_fp8", "tc.deepseek_fp8")):
        m = manifests[SITES[name]]
        assert f"'flashinfer.fused_moe.backends.frost_low_latency.{module}', 'launch'" in m["key_repr"], m["key_repr"][:600]
        assert "2, 2, 64, 'swiglu', True" in m["key_repr"] and ", 120" in m["key_repr"], m["key_repr"][-600:]
        assert "--gpu-arch sm_120a --enable-tvm-ffi" in m["options"] and m["tvm_ffi"], m["options"]
