"""``doctor`` over all of flashinfer: every site that can build an sm12x kernel, and who persists it.

Synthetic source trees stand in for what a release can contain outside the MoE package: the
b12x dense GEMM behind ``_compile_block_scaled_gemm`` (ours), the SM100 runner that hands the
same helper a ``cache_module_name`` (flashinfer's), a natively cached sm12x kernel compiled in a
function only the builder calls, cuDNN-Frost sources compiled through its runtime, kernels for
other archs (counted, not parsed), kernels of any arch, test code, and a file large enough to be
parsed by blocks. The real 0.7.4 report is checked in tests/test_flashinfer_074_dense.py.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from cute_diskcache.cli import doctor
from cute_diskcache.flashinfer_sites import known, scan
from cute_diskcache.flashinfer_sites import sites as site_table

FILES = {
    # 0.7.x layout: the helper lives here and is imported by the runners.
    "gemm/gemm_mm_fp4_cute_dsl.py": """
        def _compile_block_scaled_gemm(cache, cache_key, make_gemm_kernel, cache_module_name=None):
            from ..jit.cute_dsl_core import build_and_load_cute_dsl_kernel
            if cache_module_name is None:
                return _make_blockscaled_gemm_compile_fn()()
            return build_and_load_cute_dsl_kernel(cache_module_name, "k", _make_blockscaled_gemm_compile_fn())

        def _make_blockscaled_gemm_compile_fn():
            import cutlass.cute as cute

            def compile_kernel():
                return cute.compile(1, options="--enable-tvm-ffi")
            return compile_kernel
    """,
    "gemm/gemm_base.py": """
        from .gemm_mm_fp4_cute_dsl import _compile_block_scaled_gemm
        _B12X_MM_FP4_KERNEL_CACHE = {}

        def _b12x_gemm_fp4_runner():
            from .kernels.dense_blockscaled_gemm_sm120_b12x import Sm120B12xBlockScaledDenseGemmKernel

            class B12xFp4GemmRunner:
                def forward(self):
                    return _compile_block_scaled_gemm(_B12X_MM_FP4_KERNEL_CACHE, (), Sm120B12xBlockScaledDenseGemmKernel)
            return B12xFp4GemmRunner()

        def _cute_dsl_gemm_fp4_runner():
            from .kernels.dense_blockscaled_gemm_sm100 import Sm100BlockScaledPersistentDenseGemmKernel

            class CuteDSLFp4GemmRunner:
                def forward(self):
                    return _compile_block_scaled_gemm({}, (), Sm100BlockScaledPersistentDenseGemmKernel, cache_module_name="mm_fp4")
            return CuteDSLFp4GemmRunner()

        def _low_latency_runner():
            import cutlass.cute as cute
            return cute.compile(Sm100LowLatency)
    """,
    "cute_dsl/attention/fmha/sm120/compile.py": """
        import cutlass.cute as cute

        def _compile_sm120_fmha(q):
            return cute.compile(q)

        def compile_sm120_fmha_fp8_ragged_kernel(q):
            from flashinfer.jit.cute_dsl_core import build_and_load_cute_dsl_kernel
            return build_and_load_cute_dsl_kernel("sm120_fmha", "k", lambda: _compile_sm120_fmha(q))

        def compile_sm120_fmha_fp8_paged_kernel(q):
            from flashinfer.jit.cute_dsl_core import build_and_load_cute_dsl_kernel
            return build_and_load_cute_dsl_kernel("sm120_fmha", "p", lambda: _compile_sm120_fmha(q))
    """,
    "cute_dsl/sparse/bsa_attn_sm120.py": """
        import cutlass.cute as cute

        def bsa_attn_sm120_fwd(q):
            return cute.compile(q)
    """,
    "norm/kernels/rmsnorm.py": """
        import cutlass.cute as cute

        def rmsnorm(x):
            '''Tuned on sm_120 and sm_100: a docstring names no arch for the code.'''
            return cute.compile(x)
    """,
    "msa_ops/proxy_score.py": """
        import cutlass.cute as cute
        from ..utils import is_sm12x_supported

        def msa_proxy_score(q):
            if is_sm12x_supported(q.device):
                return cute.compile(q)
    """,
    "moe_ep/kernel_src/sm100/shim/nvfp4.py": """
        import cutlass.cute as cute

        def a(x):
            return cute.compile(x)

        def b(x):
            return cute.compile(x)
    """,
    "fused_moe/cute_dsl/blackwell/moe_w4a16.py": """
        import cutlass.cute as cute

        def compile_it(x):
            return cute.compile(x)
    """,
    "moe_ep/kernel_src/sm120/src/mega_runner.py": """
        import cutlass.cute as cute

        class MegaMoETester:
            def run_kernel(self, k):
                return cute.compile(k)
    """,
    "fused_moe/backends/cudnn_frost/runtime.py": """
        import functools

        @functools.lru_cache(maxsize=None)
        def _load_source_cached(path, digest, arch, device_index, compiler_key):
            from ....jit.cute_dsl_core import build_and_load_cute_dsl_kernel
            return build_and_load_cute_dsl_kernel("cudnn_frost", "kernel", lambda: None)
    """,
    "fused_moe/backends/cudnn_frost/artifacts/nvfp4/sources/sm120_fc1_stg.py": """
        import cutlass.cute as cute

        def compile():
            return cute.compile(1)
    """,
    "fused_moe/backends/cudnn_frost/artifacts/nvfp4/sources/sm107_fc1_stg.py": '''
        """Helpers shared by the SM100 and SM120 templates (a docstring: no arch for the code)."""
        import cutlass.cute as cute

        def compile():
            return cute.compile(1)
    ''',
}


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "flashinfer"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return pkg


def _sites(report: dict) -> dict[str, dict]:
    return {f"{s['file']}:{s['function']}": s for s in report["sites"]}


@pytest.fixture
def report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.delenv("CUTE_DISKCACHE_NATIVE_SITES", raising=False)
    monkeypatch.delenv("FLASHINFER_CUTE_DSL_DISABLE_CACHE", raising=False)
    return scan.sites_report(_tree(tmp_path, FILES), "0.7.4")


def test_every_site_gets_an_arch_and_who_persists_it(report: dict) -> None:
    sites = _sites(report)
    view = {name: (scan.group(s), s["status"]) for name, s in sites.items()}
    assert view == {
        # sm12x, ours: the b12x dense GEMM behind flashinfer's helper; a native sm12x site we serve.
        "gemm/gemm_base.py:_b12x_gemm_fp4_runner.B12xFp4GemmRunner.forward": ("sm12x", "cute-diskcache"),
        **{f"cute_dsl/attention/fmha/sm120/compile.py:compile_sm120_fmha_fp8_{k}_kernel": ("sm12x", "cute-diskcache")
           for k in ("ragged", "paged")},
        # compiled only inside the builders' lambdas: persisted with them
        "cute_dsl/attention/fmha/sm120/compile.py:_compile_sm120_fmha": ("sm12x", "flashinfer"),
        "cute_dsl/sparse/bsa_attn_sm120.py:bsa_attn_sm120_fwd": ("sm12x", "nothing"),
        # the code names sm12x (an SM120 branch) in a file whose path names no arch; a row of the
        # site table (flashinfer_sites/sites.py) by its exact file and qualified name: ours;
        # bsa_attn_sm120_fwd above is not one (0.7.4's rows name its blk64 variants): nobody's
        "msa_ops/proxy_score.py:msa_proxy_score": ("sm12x", "cute-diskcache"),
        # compiled only through Frost's runtime, whose native builder flashinfer's cache keeps
        "fused_moe/backends/cudnn_frost/artifacts/nvfp4/sources/sm120_fc1_stg.py:compile": ("sm12x", "flashinfer"),
        # the SM100 runner hands the helper a cache_module_name: flashinfer persists it
        "gemm/gemm_base.py:_cute_dsl_gemm_fp4_runner.CuteDSLFp4GemmRunner.forward": ("other", "flashinfer"),
        "gemm/gemm_base.py:_low_latency_runner": ("other", "nothing"),
        # another arch's tree: counted per file, not parsed
        "moe_ep/kernel_src/sm100/shim/nvfp4.py:<file>": ("other", "nothing"),
        "fused_moe/cute_dsl/blackwell/moe_w4a16.py:<file>": ("other", "nothing"),
        # another arch's source naming SM120 in a docstring only: parsed, still other
        "fused_moe/backends/cudnn_frost/artifacts/nvfp4/sources/sm107_fc1_stg.py:compile": ("other", "flashinfer"),
        "norm/kernels/rmsnorm.py:rmsnorm": ("any", "nothing"),
        "fused_moe/backends/cudnn_frost/runtime.py:_load_source_cached": ("any", "flashinfer"),
        "gemm/gemm_mm_fp4_cute_dsl.py:_compile_block_scaled_gemm": ("any", "per caller"),
        "gemm/gemm_mm_fp4_cute_dsl.py:_make_blockscaled_gemm_compile_fn.compile_kernel": ("any", "per caller"),
        "moe_ep/kernel_src/sm120/src/mega_runner.py:MegaMoETester.run_kernel": ("harness", "nothing"),
    }
    assert sites["moe_ep/kernel_src/sm100/shim/nvfp4.py:<file>"]["calls"] == ["2 compile calls"]
    assert sites["msa_ops/proxy_score.py:msa_proxy_score"]["arch_reason"] == "code"
    assert report["summary"] == {"cute-diskcache": 4, "flashinfer": 2, "nothing": 1}
    assert sites["msa_ops/proxy_score.py:msa_proxy_score"]["note"] == site_table.NOTE  # keyed by what it receives
    assert "not served from ours" in sites["fused_moe/backends/cudnn_frost/runtime.py:_load_source_cached"]["note"]
    assert report["groups"]["harness"]["nothing"] == 1


def test_strict_judges_the_sm12x_sites_only(report: dict) -> None:
    assert report["missing_adapter_sites"] == [] and not report["refused"]
    assert doctor.strict_failure(report)  # bsa_attn_sm120_fwd: nobody's
    rest = dict(report, summary=dict(report["summary"], nothing=0))
    assert not doctor.strict_failure(rest)  # any-arch, other-arch and test sites never fail it


def test_render_lists_sm12x_sites_and_counts_the_rest(report: dict) -> None:
    text = doctor.render(dict(report, flashinfer="0.7.4"))
    assert "sm12x compile sites: 7  cute-diskcache 4  flashinfer 2  nothing 1" in text
    assert "cute_dsl/sparse/bsa_attn_sm120.py:bsa_attn_sm120_fwd" in text
    assert "norm/kernels/rmsnorm.py:rmsnorm" not in text  # counted, not listed
    assert "any-arch sites" in text and "other-arch sites" in text and "test and benchmark code" in text
    full = doctor.render(dict(report, flashinfer="0.7.4"), show_all=True)
    assert "norm/kernels/rmsnorm.py:rmsnorm" in full
    assert json.loads(doctor.render(report, json=True))["groups"] == report["groups"]


def test_native_sm12x_sites_are_flashinfers_when_left_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_NATIVE_SITES", "flashinfer")
    sites = _sites(scan.sites_report(_tree(tmp_path, FILES), "0.7.4"))
    assert sites["fused_moe/backends/cudnn_frost/runtime.py:_load_source_cached"]["status"] == "flashinfer"
    assert sites["fused_moe/backends/cudnn_frost/artifacts/nvfp4/sources/sm120_fc1_stg.py:compile"]["status"] == "flashinfer"
    # the b12x GEMM is not a native site: ours either way
    assert sites["gemm/gemm_base.py:_b12x_gemm_fp4_runner.B12xFp4GemmRunner.forward"]["status"] == "cute-diskcache"


def test_a_large_file_is_parsed_by_blocks_and_strings_at_column_0_fall_back(tmp_path: Path) -> None:
    filler = "".join(f"def f{i}(x):\n    return x + {i}\n\n\n" for i in range(3000))
    template = 'TEMPLATE = """\ndef not_code():\n    cute.compile(1)\n"""\n\n\n'
    site = "import cutlass.cute as cute\n\n\ndef b12x_site(k):\n    return cute.compile(k)\n"
    files = {"gemm/big.py": filler + site, "gemm/big_template.py": filler + template + site}
    report = scan.sites_report(_tree(tmp_path, files), "0.7.4")
    sites = _sites(report)
    for name in ("gemm/big.py", "gemm/big_template.py"):
        assert len((tmp_path / "flashinfer" / name).read_text()) > 90_000
        assert sites[f"{name}:b12x_site"]["arch"] == "sm12x"
    assert sites["gemm/big.py:b12x_site"]["line"] == filler.count("\n") + 5
    assert set(sites) == {"gemm/big.py:b12x_site", "gemm/big_template.py:b12x_site"}


@pytest.mark.parametrize("path, words, expected", [
    ("fused_moe/cute_dsl/blackwell_sm12x/moe_dispatch.py", set(), "sm12x"),
    ("moe_ep/kernel_src/sm120/x/megamoe_kernel.py", {"Sm100MegaMoEKernel"}, "sm12x"),  # the tree decides
    ("gemm/gemm_base.py", {"Sm120B12xBlockScaledDenseGemmKernel"}, "sm12x"),
    ("gemm/gemm_base.py", {"Sm100BlockScaledPersistentDenseGemmKernel"}, "other"),
    ("gdn_kernels/blackwell/gdn_prefill.py", set(), "other"),
    ("data/csrc/cake/cute/sm_103a/k.py", set(), "other"),
    ("norm/kernels/rmsnorm.py", {"RMSNorm", "sm_count"}, "any"),
    ("moe_ep/kernel_src/sm90/x.py", {"is_sm12x_supported"}, "sm12x"),  # code widens, never narrows
])
def test_site_arch(path: str, words: set[str], expected: str) -> None:
    assert known.site_arch(path, words)[0] == expected
