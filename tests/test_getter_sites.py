"""The kernel getters (BF16 x FP4 GEMM and GEMV, MSA's top-k, combine and union) through the one hook (issue 22).

The getter wrappers and their hand-written keys are gone: a getter is a row of the site table
like every other site, and its compile is keyed by what the compile receives. What the getter
read to build it (the device's answers, its own arguments) reaches the key through that, not
through a list of what the getter's source is known to read. Shown here on stand-in getters
under the getters' own file and function names (no compile), and for real on flashinfer 0.7.4
(``tests/fi074_dense_driver.py`` in ``$CUTE_DISKCACHE_FI074_PYTHON``, CPU tensors for the
``rtx-pro-6000`` profile): each getter compiles once, persists, and a fresh process hits with
zero compiles, counted independently at the DSL's compile.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hook import Package, package  # noqa: E402,F401

from cute_diskcache.core import through  # noqa: E402
from cute_diskcache.flashinfer_sites import sites  # noqa: E402

GEMM_FILE, GEMM_GETTER, GEMV_GETTER = "gemm/gemm_bf16_fp4_cute_dsl.py", "_get_cute_dsl_bf16_fp4_gemm", "_get_cute_dsl_bf16_fp4_gemv"
TOPK_FILE, TOPK_GETTER = "msa_ops/sparse_topk_select.py", "_get_compiled_topk"


def test_coverage_names_only_the_getters_a_release_defines(tmp_path: Path) -> None:
    """0.6.14-0.6.17 have the BF16 x FP4 GEMM getter and neither its GEMV nor MSA: the report
    must not claim (or list as missing) what the release does not have."""
    (tmp_path / "gemm").mkdir()
    (tmp_path / GEMM_FILE).write_text(
        f"def {GEMM_GETTER}(tile_shape_mnk, a_dtype, c_dtype):\n    pass\n"
        f"# {GEMV_GETTER}( is only mentioned here\n")
    assert sites.covered(tmp_path) == {(GEMM_FILE, GEMM_GETTER): "bf16_fp4_gemm"}
    (tmp_path / "msa_ops").mkdir()
    (tmp_path / TOPK_FILE).write_text(
        f"import functools\n\n\n@functools.cache\ndef {TOPK_GETTER}(topk, small, per_token_nvp):\n    pass\n")
    assert sites.covered(tmp_path)[(TOPK_FILE, TOPK_GETTER)] == "msa_topk"


#: The BF16 x FP4 getter's shape: it asks the device (max active clusters) and builds a kernel
#: object holding the answer, then compiles it; flashinfer memoises the result (functools.cache).
GETTER = f"""
    import functools

    ANSWER = {{"clusters": 188}}

    def get_max_active_clusters(cluster_size):
        return ANSWER["clusters"] // cluster_size

    class Sm12xDenseGemmBf16Fp4Kernel:
        def __init__(self, tile, max_active_clusters):
            self.tile, self.max_active_clusters = tile, max_active_clusters

    @functools.cache
    def {GEMM_GETTER}(tile_shape_mnk, occupancy=1):
        kernel = Sm12xDenseGemmBf16Fp4Kernel(tile_shape_mnk, get_max_active_clusters(1) * occupancy)
        return cute.compile(kernel, get_max_active_clusters(2))
"""


def test_what_a_getter_reads_from_the_device_reaches_the_key_through_its_compile(package: Package) -> None:
    """The old wrapper keyed a getter's device queries only where its source spelled them as
    ``get_max_active_clusters(<literal>)``, and refused every other getter. The hook keys the
    answer wherever it ends up in the compile: another device, another entry."""
    mod = package.module(GEMM_FILE, GETTER)
    row = sites.BY_WHERE[(GEMM_FILE, GEMM_GETTER)]
    with through.planning() as plan:
        mod._get_cute_dsl_bf16_fp4_gemm((128, 128, 64))
        mod._get_cute_dsl_bf16_fp4_gemm((128, 128, 64))  # flashinfer's memo: not asked again
        mod._get_cute_dsl_bf16_fp4_gemm((128, 64, 64))
        mod._get_cute_dsl_bf16_fp4_gemm((128, 128, 64), 2)
        mod._get_cute_dsl_bf16_fp4_gemm.cache_clear()
        mod._get_cute_dsl_bf16_fp4_gemm((128, 128, 64))  # a fresh process on the same device
        mod.ANSWER["clusters"] = 94  # another card
        mod._get_cute_dsl_bf16_fp4_gemm.cache_clear()
        mod._get_cute_dsl_bf16_fp4_gemm((128, 128, 64))
    assert [p["site"] for p in plan] == [row.name] * 5 == ["flashinfer.gemm.bf16_fp4_gemm"] * 5
    digests = [p["digest"] for p in plan]
    assert digests[3] == digests[0] and len(set(digests)) == 4, digests
    assert package.real.calls == []


def test_a_getter_whose_compile_cannot_be_described_runs_as_flashinfers(package: Package,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """An argument the hook cannot describe: the getter's own in-memory compile, one warning,
    never our error and never a guessed key."""
    mod = package.module(TOPK_FILE, f"""
        import functools

        @functools.cache
        def {TOPK_GETTER}(topk, small, per_token_nvp):
            return cute.compile(object(), topk, small)
    """)
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"), through.planning() as plan:
        assert mod._get_compiled_topk(16, True, True) == "compiled in memory"
    assert plan == [] and [c[1][1:] for c in package.real.calls] == [(16, True)]
    assert [r.getMessage() for r in caplog.records] == [
        "not caching flashinfer.msa.msa_topk kernel: no description for compile argument of type builtins.object"]


# --------------------------------------------------------------------------------------------
# flashinfer 0.7.4's real getters
# --------------------------------------------------------------------------------------------

GETTERS = {"bf16_fp4_gemm": "flashinfer.gemm.bf16_fp4_gemm", "bf16_fp4_gemv": "flashinfer.gemm.bf16_fp4_gemv",
           "msa_topk": "flashinfer.msa.msa_topk", "msa_combine": "flashinfer.msa.msa_combine",
           "msa_union": "flashinfer.msa.msa_union"}


@pytest.mark.slow
def test_each_getter_compiles_once_persists_and_a_fresh_process_compiles_nothing(tmp_path: Path,
                                                                                 compile_hook_dir: Path) -> None:
    from test_flashinfer_074 import FI074, TARGET, Child, _json_report, _manifests, _run

    if FI074 == "off" or not Path(str(FI074)).exists():
        pytest.skip("no flashinfer 0.7.4 interpreter (CUTE_DISKCACHE_FI074_PYTHON)")
    driver = Path(__file__).resolve().parent / "fi074_dense_driver.py"
    child = Child(tmp_path / "root", tmp_path / "workspace", compile_hook_dir)

    def drive() -> dict[str, Any]:
        return _json_report(_run([str(FI074), str(driver), "--target", TARGET, *GETTERS], child.env(), child.hook_dir))

    cold, warm = drive(), drive()
    for report, outcome in ((cold, "miss"), (warm, "hit")):
        got: dict[str, list[str]] = {}
        for site, _digest, result, *_ in report["events"]:
            got.setdefault(site, []).append(result)
        assert got == {name: [outcome] for name in GETTERS.values()}, report["events"]
    assert cold["real_compiles"] == len(GETTERS) and cold["counters"]["writes"] == len(GETTERS)
    assert warm["real_compiles"] == 0 and warm["counters"]["compiles"] == 0, warm["stderr"][-3000:]
    assert {e[0]: e[1] for e in cold["events"]} == {e[0]: e[1] for e in warm["events"]}  # the same entries
    assert set(_manifests(child.root)) == set(GETTERS.values())
    for name, report in warm["sites"].items():  # what the getters returned served as the compiled ones did
        assert report["error"] == cold["sites"][name]["error"], (name, report["error"], cold["sites"][name]["error"])
    for name in ("bf16_fp4_gemm", "bf16_fp4_gemv"):  # launched: bound flashinfer's arguments, then no GPU
        assert "expected device_type=cuda" in (cold["sites"][name]["error"] or ""), cold["sites"][name]
