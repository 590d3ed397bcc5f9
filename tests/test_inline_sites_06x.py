"""flashinfer 0.6.12-0.6.17's sm12x sites that nobody persisted, now through the compile hook (issue 22).

The W4A16 MoE kernels (``moe_w4a16_kernel.compile_w4a16_*``) compile in place up to 0.6.16 and
through ``moe_w4a16_compiler.compile`` from 0.6.17 (the hook keys a compile under the nearest
site above it, so such a kernel gets one entry, not a second under its caller); 0.6.12/0.6.13
compile the b12x dense GEMM in ``_get_compiled_dense_gemm``; 0.6.17+ compile the direct micro
kernel in place (its block-dim probe answered from side data, :mod:`.block_dim`).

Which release names which site is tested on a stand-in package (the real releases are not all
installed here); the doctor and the real compiles run on the installed flashinfer (0.6.15.post1
here): flashinfer's own compile functions, driven on the CPU by the matrix's child
(``scripts/compat_child.py``) for the rtx-pro-6000 profile, cold and then in a fresh process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cute_diskcache.core import hook
from cute_diskcache.core import through
from cute_diskcache.flashinfer_sites import _common, scan, sites
from cute_diskcache.flashinfer_sites.adapter import ADAPTER as FLASHINFER

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import TARGET, child_env  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MOE = "fused_moe/cute_dsl/blackwell_sm12x"
W4A16 = ("compile_w4a16_gemm", "compile_w4a16_fused_moe", "compile_w4a16_activation", "compile_w4a16_topk_sum")
DENSE = ("gemm/kernels/dense_blockscaled_gemm_sm120_b12x.py", "_get_compiled_dense_gemm")
_COUNT_LINE = re.compile(r"^cdc-test real compiles: (\d+)$", re.M)


def _stand_in(root: Path) -> Path:
    """A package holding every function the 0.6.x sites name (what ``covered`` reads: the def)."""
    files = {
        f"{MOE}/moe_w4a16_kernel.py": "".join(f"def {fn}(*, size_m):\n    pass\n" for fn in W4A16),
        f"{MOE}/moe_w4a16_compiler.py": "def compile(func, *args, compile_spec=None):\n    pass\n",
        f"{MOE}/moe_direct_micro_kernel.py": "def compile_direct_micro_kernel(kernel):\n    pass\n",
        DENSE[0]: "def _get_compiled_dense_gemm(m, n, k):\n    pass\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_each_06x_site_is_covered_where_the_release_defines_it(tmp_path: Path) -> None:
    """Named as the site scan names them (MoE files relative to blackwell_sm12x/). The table has
    no version bounds: a row is listed on a release that defines its function, and only there."""
    package = _stand_in(tmp_path)
    kernels = {("moe_w4a16_kernel.py", fn) for fn in W4A16}
    wrapper = {("moe_w4a16_compiler.py", "compile"), ("moe_direct_micro_kernel.py", "compile_direct_micro_kernel")}
    assert set(sites.covered(package)) == kernels | wrapper | {DENSE}
    # 0.6.12-0.6.16 have no wrapper file and no direct micro compile: those rows are absent there
    (package / MOE / "moe_w4a16_compiler.py").unlink()
    (package / MOE / "moe_direct_micro_kernel.py").write_text("# compile_direct_micro_kernel( only mentioned\n")
    assert set(sites.covered(package)) == kernels | {DENSE}
    # what the doctor tables get: one kind per (file, function), the scan's names
    table = scan._table("0.6.16.post4", False, package)
    assert table[("moe_w4a16_kernel.py", "compile_w4a16_gemm")] == "w4a16" and table[DENSE] == "b12x_dense_gemm"
    assert scan._table("0.6.11", False, package) == {}  # before the first release we cover


def test_moe_dispatch_is_native_only_where_it_calls_flashinfers_builder(tmp_path: Path) -> None:
    """Up to 0.6.17 moe_dispatch compiles in memory (ours, always); from 0.6.18 it builds through
    flashinfer's disk cache, which ``CUTE_DISKCACHE_NATIVE_SITES=flashinfer`` leaves to flashinfer."""
    package = _stand_in(tmp_path)
    functions = ("_get_static_kernel", "_get_micro_kernel", "_get_dynamic_kernel")
    dispatch = package / MOE / "moe_dispatch.py"
    dispatch.write_text("".join(f"def {fn}(key):\n    return cute.compile(key)\n" for fn in functions))
    expected = {("moe_dispatch.py", fn) for fn in functions}
    assert expected <= set(sites.covered(package, native=False)) and expected <= set(sites.covered(package))
    dispatch.write_text("".join(f"def {fn}(key):\n    return build_and_load_cute_dsl_kernel(key)\n" for fn in functions))
    assert not expected & set(sites.covered(package, native=False)) and expected <= set(sites.covered(package))


def _frames(file: str, source: str) -> dict[str, types.FunctionType]:
    """Functions that say they are defined in ``file`` under the installed flashinfer (not written
    there: the hook reads a frame's code object only). ``compile_here()`` stands for
    ``cute.compile``: it answers which site the hook finds above it."""
    root = FLASHINFER.package_dir()
    assert root is not None
    ns: dict[str, object] = {"compile_here": lambda: hook._find_site(sys._getframe(1))}
    exec(compile(source, os.path.join(root, file), "exec"), ns)  # noqa: S102
    return {k: v for k, v in ns.items() if isinstance(v, types.FunctionType)}


def test_the_nearest_site_above_a_compile_is_the_one_it_is_keyed_under() -> None:
    """0.6.12-0.6.16 compile each W4A16 kernel in place; 0.6.17+ call the memoising wrapper,
    which compiles. The hook takes the nearest row, so the kernel gets one entry, under the
    function that compiles it, never a second under its caller."""
    in_place = _frames(f"{MOE}/moe_w4a16_kernel.py", "def compile_w4a16_gemm(wrapper=None):\n"
                       "    return wrapper() if wrapper else compile_here()\n")["compile_w4a16_gemm"]
    wrapper = _frames(f"{MOE}/moe_w4a16_compiler.py", "def compile():\n    return compile_here()\n")["compile"]
    row, _modules, compiled_in = in_place()
    assert (row.file, row.function, compiled_in) == (f"{MOE}/moe_w4a16_kernel.py", "compile_w4a16_gemm", "compile_w4a16_gemm")
    row, _modules, compiled_in = in_place(wrapper)
    assert (row.file, row.function, compiled_in) == (f"{MOE}/moe_w4a16_compiler.py", "compile", "compile")
    assert row.name == "flashinfer.moe_w4a16_compiler.w4a16"

    micro = _frames(f"{MOE}/moe_direct_micro_kernel.py", "def compile_direct_micro_kernel():\n"
                    "    return compile_here()\n")["compile_direct_micro_kernel"]
    found = micro()
    assert found is not None and found[0].name == "flashinfer.moe_direct_micro_kernel.direct_micro"
    site = hook.site(found[0])
    assert found[0].side == "block_dim" and site.deliver is not None  # the block-dim probe's answer travels with it
    assert site.extra_ok({"kwargs_wrapper": False, "calling_convention": None}) is False  # an entry without it is a miss
    dense = _frames(DENSE[0], "def _get_compiled_dense_gemm():\n    return compile_here()\n")["_get_compiled_dense_gemm"]
    assert dense()[0].kind == "b12x_dense_gemm"


def _installed_06x() -> str:
    version = _common.flashinfer_version()
    if not (0, 6, 12) <= _common.version_tuple(version)[:3] < (0, 6, 18):
        pytest.skip(f"flashinfer {version} installed, not a 0.6.12-0.6.17 release")
    return version


def test_doctor_finds_no_sm12x_site_nobody_persists_on_the_installed_06x() -> None:
    _installed_06x()
    pytest.importorskip("cutlass.cute")
    report = scan.sites_report()
    assert report["summary"][scan.NOTHING] == 0, [f"{s['file']}:{s['function']}" for s in report["sites"]
                                                  if s["status"] == scan.NOTHING and scan.group(s) == "sm12x"]
    found = {(s["file"], s["function"]): s for s in report["sites"]}
    for fn in W4A16:
        site = found[("moe_w4a16_kernel.py", fn)]
        assert site["status"] == scan.COVERED_BY_US and site["note"] == sites.NOTE, site
    assert report["missing_adapter_sites"] == []


def _child(root: Path, hook_dir: Path, *sites: str) -> dict:
    """One fresh process of the matrix's child, counted independently at the DSL's compile."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "compat_child.py"), "--target", TARGET, *sites],
                          env=child_env(root, None, hook_dir), capture_output=True, text=True, timeout=900, cwd=hook_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    counted = _COUNT_LINE.findall(proc.stderr)
    report["counted"] = int(counted[-1]) if counted else None
    report["stderr"] = proc.stderr
    return report


@pytest.mark.slow
def test_w4a16_kernels_compile_once_and_a_fresh_process_compiles_nothing(tmp_path: Path, compile_hook_dir: Path) -> None:
    """flashinfer's four W4A16 compile functions, cold then in a fresh process on the same cache:
    one entry each, all hits, 0 real compiles by both counters, and each loaded kernel takes the
    launch the compiled one took (CPU tensors of the compiled extents: the same driver error)."""
    _installed_06x()
    sites = ("w4a16_gemm", "w4a16_fused_moe", "w4a16_activation", "w4a16_topk_sum")
    cold = _child(tmp_path / "root", compile_hook_dir, *sites)
    warm = _child(tmp_path / "root", compile_hook_dir, *sites)
    name = "flashinfer.moe_w4a16_compiler.w4a16"
    for site in sites:
        c, w = cold["sites"][site], warm["sites"][site]
        assert [(e[0], e[2]) for e in c["events"]] == [(name, "miss")], (site, c)
        assert [(e[0], e[2]) for e in w["events"]] == [(name, "hit")], (site, w)
        assert w["events"][0][1] == c["events"][0][1]  # the same entry
        assert c["real_compiles"] == 1 and w["real_compiles"] == 0, (site, c["real_compiles"], w["real_compiles"])
        assert c["abi"] and c["abi"] == w["abi"], (site, c["abi"], w["abi"])
    assert len({cold["sites"][s]["events"][0][1] for s in sites}) == 4  # four kernels, four entries
    assert (cold["counted"], warm["counted"]) == (4, 0)
    assert "uncached" not in cold["stderr"] and "uncached" not in warm["stderr"]
