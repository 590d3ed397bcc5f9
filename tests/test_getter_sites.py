"""The kernel getters' source check (flashinfer_sites/getters.py, BF16 x FP4 shown): what a getter reads beyond its arguments is keyed, or
the getter stays uncached.

The getters are read from source when the module is patched (flashinfer 0.7.4's real ones are
driven in tests/test_flashinfer_074_dense.py). Here, modules written to disk under the getters'
module name stand in for releases that change them: one that keys, one that asks the device
with a computed argument, one that asks something else of the device.
"""

from __future__ import annotations

import importlib.util
import logging
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from cute_diskcache.flashinfer_sites import getters
from cute_diskcache.flashinfer_sites.names import GEMM_BF16_FP4

KEYABLE = '''
def _get_cute_dsl_bf16_fp4_gemm(tile_shape_mnk, a_dtype, c_dtype, occupancy=1):
    import cutlass.cute as cute
    from flashinfer.cute_dsl.utils import get_max_active_clusters
    from .kernels.cute_dsl.dense_gemm_bf16_fp4_sm12x import Sm12xDenseGemmBf16Fp4Kernel
    from ..cute_dsl.utils import torch_to_cutlass_dtype
    return cute.compile(Sm12xDenseGemmBf16Fp4Kernel(), get_max_active_clusters(1) * occupancy, get_max_active_clusters(2))


def _get_cute_dsl_bf16_fp4_gemv(splits, a_dtype, c_dtype, enable_pdl=True):
    import cutlass.cute as cute
    from .kernels.cute_dsl import gemv_bf16_fp4_sm12x
    return cute.compile(gemv_bf16_fp4_sm12x.GemvBf16Fp4Sm12x(splits=splits))
'''
COMPUTED_QUERY = '''
def _get_cute_dsl_bf16_fp4_gemm(tile_shape_mnk, a_dtype, c_dtype, cluster=2):
    from flashinfer.cute_dsl.utils import get_max_active_clusters
    return get_max_active_clusters(cluster)
'''
OTHER_QUERY = '''
def _get_cute_dsl_bf16_fp4_gemv(splits, a_dtype, c_dtype, device=None):
    from ..utils import get_device_sm_count
    return get_device_sm_count(device) * splits
'''


def _module(tmp_path: Path, source: str, name: str = GEMM_BF16_FP4) -> ModuleType:
    """A module named like flashinfer's, from a file (the check reads the getters' source)."""
    path = tmp_path / f"{name.rsplit('.', 1)[-1]}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_keyable_getter_names_its_imports_and_literal_device_queries(tmp_path: Path) -> None:
    module = _module(tmp_path, KEYABLE)
    imports, sizes = getters.read_getter(module._get_cute_dsl_bf16_fp4_gemm)
    assert imports == (("flashinfer.cute_dsl.utils", "get_max_active_clusters"),
                       ("flashinfer.gemm.kernels.cute_dsl.dense_gemm_bf16_fp4_sm12x", "Sm12xDenseGemmBf16Fp4Kernel"),
                       ("flashinfer.cute_dsl.utils", "torch_to_cutlass_dtype"))
    assert sizes == (1, 2)
    imports, sizes = getters.read_getter(module._get_cute_dsl_bf16_fp4_gemv)
    assert imports == (("flashinfer.gemm.kernels.cute_dsl", "gemv_bf16_fp4_sm12x"),) and sizes == ()


@pytest.mark.parametrize("source, getter, reason", [
    (COMPUTED_QUERY, "_get_cute_dsl_bf16_fp4_gemm", "get_max_active_clusters(cluster) is not keyed (not one integer literal)"),
    (OTHER_QUERY, "_get_cute_dsl_bf16_fp4_gemv", "get_device_sm_count(device) asks the device something the key does not carry"),
])
def test_a_getter_reading_what_we_cannot_key_stays_flashinfers(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                               source: str, getter: str, reason: str) -> None:
    module = _module(tmp_path, source)
    original = getattr(module, getter)
    with pytest.raises(getters._Unsupported, match=reason.replace("(", r"\(").replace(")", r"\)")):
        getters.read_getter(original)
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"):
        assert getters.patch(module) is False
    assert getattr(module, getter) is original, "an unkeyable getter was replaced"
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [f"{GEMM_BF16_FP4}.{getter} stays uncached: {reason}"]


NAMES = [g.function for g in getters.GETTERS if g.module == GEMM_BF16_FP4]


def test_a_keyable_getter_is_replaced_once_and_put_back(tmp_path: Path) -> None:
    module = _module(tmp_path, KEYABLE)
    originals = {name: getattr(module, name) for name in NAMES}
    assert getters.patch(module) is True and getters.patch(module) is True
    replaced = {name: getattr(module, name) for name in NAMES}
    assert all(replaced[n] is not originals[n] and replaced[n].__wrapped__ is originals[n] for n in originals)
    getters.patch(module)
    assert {name: getattr(module, name) for name in NAMES} == replaced, "patched twice"
    getters.unpatch(module)
    assert {name: getattr(module, name) for name in NAMES} == originals


def test_coverage_names_only_the_getters_a_release_defines(tmp_path: Path) -> None:
    """0.6.14-0.6.17 have the BF16 x FP4 GEMM getter and neither its GEMV nor MSA: the report
    must not claim (or list as missing) what the release does not have."""
    (tmp_path / "gemm").mkdir()
    (tmp_path / "gemm" / "gemm_bf16_fp4_cute_dsl.py").write_text(
        "def _get_cute_dsl_bf16_fp4_gemm(tile_shape_mnk, a_dtype, c_dtype):\n    pass\n"
        "# _get_cute_dsl_bf16_fp4_gemv( is only mentioned here\n")
    assert getters.covered(tmp_path) == {("gemm/gemm_bf16_fp4_cute_dsl.py", "_get_cute_dsl_bf16_fp4_gemm"): "bf16_fp4_gemm"}
    (tmp_path / "msa_ops").mkdir()
    (tmp_path / "msa_ops" / "sparse_topk_select.py").write_text(
        "import functools\n\n\n@functools.cache\ndef _get_compiled_topk(topk, small, per_token_nvp):\n    pass\n")
    assert getters.covered(tmp_path)[("msa_ops/sparse_topk_select.py", "_get_compiled_topk")] == "msa_topk"


BROKEN_BRANCH = '''
def _get_compiled_topk(topk, small, per_token_nvp):
    if not small:
        from .cute_dsl.no_such_kernel_module import Kernel
    return ("flashinfer's own result", topk, small)
'''


def test_a_getter_whose_key_cannot_be_read_runs_as_flashinfers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keying imports every module the getter might import; when one fails (a branch this
    release or DSL cannot import, not taken by this call), the call is flashinfer's, uncached,
    never our error. (The import is made to fail here without importing flashinfer.)"""
    from cute_diskcache.flashinfer_sites.names import MSA_TOPK

    def failing_import(imports: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
        assert imports == (("flashinfer.msa_ops.cute_dsl.no_such_kernel_module", "Kernel"),)
        raise ModuleNotFoundError("No module named 'flashinfer.msa_ops.cute_dsl.no_such_kernel_module'")

    monkeypatch.setattr(getters, "kernel_modules", failing_import)
    module = _module(tmp_path, BROKEN_BRANCH, MSA_TOPK)
    assert getters.patch(module) is True
    try:
        assert module._get_compiled_topk(16, True, True) == ("flashinfer's own result", 16, True)
    finally:
        getters.unpatch(module)
