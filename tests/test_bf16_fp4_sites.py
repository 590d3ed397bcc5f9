"""The BF16 x FP4 getters' source check: what a getter reads beyond its arguments is keyed, or
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

from cute_diskcache.flashinfer_sites import bf16_fp4
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


def _module(tmp_path: Path, source: str) -> ModuleType:
    """A module named like flashinfer's, from a file (the check reads the getters' source)."""
    path = tmp_path / "gemm_bf16_fp4_cute_dsl.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(GEMM_BF16_FP4, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_keyable_getter_names_its_imports_and_literal_device_queries(tmp_path: Path) -> None:
    module = _module(tmp_path, KEYABLE)
    imports, sizes = bf16_fp4.read_getter(module._get_cute_dsl_bf16_fp4_gemm)
    assert imports == (("flashinfer.cute_dsl.utils", "get_max_active_clusters"),
                       ("flashinfer.gemm.kernels.cute_dsl.dense_gemm_bf16_fp4_sm12x", "Sm12xDenseGemmBf16Fp4Kernel"),
                       ("flashinfer.cute_dsl.utils", "torch_to_cutlass_dtype"))
    assert sizes == (1, 2)
    imports, sizes = bf16_fp4.read_getter(module._get_cute_dsl_bf16_fp4_gemv)
    assert imports == (("flashinfer.gemm.kernels.cute_dsl", "gemv_bf16_fp4_sm12x"),) and sizes == ()


@pytest.mark.parametrize("source, getter, reason", [
    (COMPUTED_QUERY, "_get_cute_dsl_bf16_fp4_gemm", "get_max_active_clusters(cluster) is not keyed (not one integer literal)"),
    (OTHER_QUERY, "_get_cute_dsl_bf16_fp4_gemv", "get_device_sm_count(device) asks the device something the key does not carry"),
])
def test_a_getter_reading_what_we_cannot_key_stays_flashinfers(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                               source: str, getter: str, reason: str) -> None:
    module = _module(tmp_path, source)
    original = getattr(module, getter)
    with pytest.raises(bf16_fp4._Unsupported, match=reason.replace("(", r"\(").replace(")", r"\)")):
        bf16_fp4.read_getter(original)
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"):
        assert bf16_fp4.patch(module) is False
    assert getattr(module, getter) is original, "an unkeyable getter was replaced"
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [f"{GEMM_BF16_FP4}.{getter} stays uncached: {reason}"]


def test_a_keyable_getter_is_replaced_once_and_put_back(tmp_path: Path) -> None:
    module = _module(tmp_path, KEYABLE)
    originals = {name: getattr(module, name) for name in bf16_fp4.GETTERS}
    assert bf16_fp4.patch(module) is True and bf16_fp4.patch(module) is True
    replaced = {name: getattr(module, name) for name in bf16_fp4.GETTERS}
    assert all(replaced[n] is not originals[n] and replaced[n].__wrapped__ is originals[n] for n in originals)
    bf16_fp4.patch(module)
    assert {name: getattr(module, name) for name in bf16_fp4.GETTERS} == replaced, "patched twice"
    bf16_fp4.unpatch(module)
    assert {name: getattr(module, name) for name in bf16_fp4.GETTERS} == originals
