"""flashinfer 0.6.12-0.6.17's sm12x sites that nobody persisted, now through the inline hook (issue 22).

The W4A16 MoE kernels (``moe_w4a16_kernel.compile_w4a16_*``) compile in place up to 0.6.16 and
through ``moe_w4a16_compiler.compile`` on 0.6.17 (from 0.6.18 :mod:`.v0_7` wraps that function:
the hook must then leave it alone, or one kernel would get two entries); 0.6.12/0.6.13 compile
the b12x dense GEMM in ``_get_compiled_dense_gemm``; 0.6.17 compiles the direct micro kernel in
place (its block-dim probe answered from side data, as v0_7 does from 0.6.18).

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

from cute_diskcache.flashinfer_sites import _common, inline, scan

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


def test_each_06x_site_is_inline_on_the_releases_that_compile_there(tmp_path: Path) -> None:
    """Named as the site scan names them (MoE files relative to blackwell_sm12x/), per release."""
    package = _stand_in(tmp_path)
    kernels = {("moe_w4a16_kernel.py", fn) for fn in W4A16}
    wrapper = {("moe_w4a16_compiler.py", "compile"), ("moe_direct_micro_kernel.py", "compile_direct_micro_kernel")}
    for version in ("0.6.12", "0.6.13", "0.6.15.post1", "0.6.16.post4"):  # (these have no wrapper file)
        assert set(inline.covered(package, version)) == kernels | wrapper | {DENSE}, version
    assert set(inline.covered(package, "0.6.17")) == wrapper | {DENSE}
    for version in ("0.6.18.post1", "0.7.4"):  # v0_7 serves the wrapper and direct micro there
        assert set(inline.covered(package, version)) == {DENSE}, version
    # what the doctor tables get: one kind per (file, function), the scan's names
    table = scan._table("0.6.17", False, package)
    assert table[("moe_w4a16_compiler.py", "compile")] == "w4a16"
    assert table[("moe_direct_micro_kernel.py", "compile_direct_micro_kernel")] == "direct_micro"
    assert ("moe_w4a16_compiler.py", "compile") in scan._table("0.7.4", False, package)  # v0_7's, as before


def _code_at(file: str, function: str) -> types.CodeType:
    """A code object that says it is ``function`` in ``file`` under the installed flashinfer."""
    root = inline._package_dir()
    assert root is not None
    module = compile(f"def {function}():\n    pass\n", os.path.join(root, file), "exec")
    return next(c for c in module.co_consts if isinstance(c, types.CodeType))


def test_the_hook_takes_a_caller_only_on_the_releases_where_it_compiles_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """From 0.6.17 the W4A16 functions call the wrapper (no compile of their own); from 0.6.18
    v0_7 replaces the wrapper and proxies direct micro's ``cute``: the hook must not take them
    too, or a cold compile would be stored twice under two keys."""
    gemm = _code_at(f"{MOE}/moe_w4a16_kernel.py", "compile_w4a16_gemm")
    wrapper = _code_at(f"{MOE}/moe_w4a16_compiler.py", "compile")
    micro = _code_at(f"{MOE}/moe_direct_micro_kernel.py", "compile_direct_micro_kernel")
    dense = _code_at(*DENSE)
    # (0.6.13 and 0.6.16 have neither the wrapper nor direct micro's compile: nothing calls from there)
    expect = {"0.6.13": (True, True, True, True), "0.6.16.post4": (True, True, True, True),
              "0.6.17": (False, True, True, True), "0.7.4": (False, False, False, True)}
    for version, taken in expect.items():
        monkeypatch.setattr(_common, "flashinfer_version", lambda v=version: v)
        got = tuple(inline._lookup(code) is not None for code in (gemm, wrapper, micro, dense))
        assert got == taken, version
    monkeypatch.setattr(_common, "flashinfer_version", lambda: "0.6.17")
    site = inline._lookup(micro)
    assert site is not None and inline._SITE_RECORDS[site].name == "flashinfer.moe_direct_micro_kernel.direct_micro"
    assert inline._SITE_RECORDS[site].deliver is not None  # the block-dim probe's answer travels with it


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
    sites = {(s["file"], s["function"]): s for s in report["sites"]}
    for fn in W4A16:
        site = sites[("moe_w4a16_kernel.py", fn)]
        assert site["status"] == scan.COVERED_BY_US, site
        assert inline.NOTE in site["note"] or "moe_w4a16_compiler.py:compile" in site["note"], site
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
