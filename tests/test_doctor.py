"""``doctor``: every CuTe-DSL compile site of the installed flashinfer, and who persists it.

The site table comes from flashinfer's source text, so these tests read the real installed
0.6.15.post1 (no import of flashinfer needed) and small synthetic source trees standing in for
releases we do not have: a new site, the ``cute.compile[...]`` form, a native site, a site
behind a compile wrapper. The 0.7.4 report is checked in tests/test_flashinfer_074.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cute_diskcache.cli import doctor
from cute_diskcache.flashinfer_sites import scan, sites

FI_VERSION = "0.6.15.post1"
M = ""  # MoE-package sites keep their name relative to blackwell_sm12x/ (what compat_matrix keys on)
W4A16_SITES = {f"{M}moe_w4a16_kernel.py:compile_w4a16_{k}" for k in ("gemm", "fused_moe", "activation", "topk_sum")}
MOE_DISPATCH_SITES = {f"{M}moe_dispatch.py:_get_{k}_kernel" for k in ("static", "micro", "dynamic")}
B12X_FP4 = "gemm/gemm_base.py:_b12x_gemm_fp4_runner.B12xFp4GemmRunner.forward"


def _status(report: dict, group: str | None = None) -> dict[str, str]:
    return {f"{s['file']}:{s['function']}": s["status"] for s in report["sites"] if group is None or scan.group(s) == group}


@pytest.fixture(scope="module")
def installed_report() -> dict:
    from cute_diskcache.flashinfer_sites import flashinfer_version

    if flashinfer_version() != FI_VERSION:
        pytest.skip(f"this file checks flashinfer {FI_VERSION}; installed: {flashinfer_version()}")
    return scan.sites_report()


def test_0_6_15_moe_dispatch_b12x_gemm_and_w4a16_sites_are_ours(installed_report: dict) -> None:
    status = _status(installed_report, "sm12x")
    gdn = "gdn_kernels/delta_rule_dsl/custom_compile_cache.py:cached_compile"
    # every one a row of the site table (flashinfer_sites/sites.py), through the one compile hook (issue 22)
    assert {s for s, st in status.items() if st == "cute-diskcache"} == MOE_DISPATCH_SITES | {B12X_FP4, gdn} | W4A16_SITES
    assert {s for s, st in status.items() if st == "nothing"} == set()
    paths = {s["path"] for s in installed_report["sites"] if s["file"] == "moe_dispatch.py"}
    assert paths == {f"{scan.MOE_BASE}/moe_dispatch.py"}  # and the package-relative path beside it
    assert installed_report["summary"] == {"cute-diskcache": 9, "flashinfer": 0, "nothing": 0}
    assert installed_report["missing_adapter_sites"] == []
    assert installed_report["generation"].startswith("0.6.12-0.6.17")
    # The whole package is scanned; what is not sm12x is counted apart, never judged.
    groups = installed_report["groups"]
    assert groups["any"]["nothing"] > 0 and groups["other"]["nothing"] > 0
    assert "data/cutlass/examples/python/CuTeDSL/blackwell_geforce/dense_gemm.py:run" in _status(installed_report, "harness")


def test_doctor_cli_prints_the_table_and_strict_fails_on_uncovered(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}
    env.update(CUTE_DISKCACHE_DIR=str(tmp_path / "root"), CUTE_DISKCACHE_TARGET="rtx-pro-6000")
    run = lambda *a: subprocess.run([sys.executable, "-m", "cute_diskcache.cli.doctor", *a], env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=120, cwd=tmp_path)
    text = run()
    assert text.returncode == 0, text.stderr
    from cute_diskcache.flashinfer_sites import flashinfer_version

    assert f"flashinfer       {flashinfer_version()}" in text.stdout
    assert f"cache root       {tmp_path / 'root'}  (CUTE_DISKCACHE_DIR)" in text.stdout
    assert "target profile   rtx-pro-6000  arch sm_120a" in text.stdout
    report = json.loads(run("--json").stdout)
    assert report["root"] == str(tmp_path / "root") and report["target"] == "rtx-pro-6000"
    assert report["dsl"].startswith("apache-tvm-ffi==") or "nvidia-cutlass-dsl==" in report["dsl"]
    strict = run("--strict")
    assert strict.returncode == (1 if report["summary"]["nothing"] else 0)


# --------------------------------------------------------------------------------------------
# Synthetic releases: the scanner must find what a real release could contain
# --------------------------------------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "flashinfer"
    base = pkg / "fused_moe" / "cute_dsl" / "blackwell_sm12x"
    base.mkdir(parents=True)
    (pkg / "fused_moe" / "cute_dsl" / "b12x_moe.py").write_text("def run():\n    return None\n")
    for name, text in files.items():
        path = base / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return pkg


# Sites of the table (flashinfer_sites/sites.py) by file and function, on an unverified "0.7.9":
# served as on a verified release (tests/test_compat_policy.py), whatever their bodies hold.
NEW_RELEASE = {
    "moe_dispatch.py": """
        import cutlass.cute as cute
        from flashinfer.jit.cute_dsl_core import build_and_load_cute_dsl_kernel

        def _get_static_kernel(key):
            cache_key = ("static", key)
            return build_and_load_cute_dsl_kernel("m", "static_x", lambda: cute.compile(key, options="o"))

        def _get_micro_kernel(key):
            cache_key = ("micro", key)
            return build_and_load_cute_dsl_kernel("m", "micro_x", lambda: cute.compile(key, options="o"))

        def _get_dynamic_kernel(key):
            cache_key = ("dynamic", key)
            return build_and_load_cute_dsl_kernel("m", "dynamic_x", lambda: cute.compile(key, options="o"))
    """,
    "moe_direct_micro_kernel.py": """
        import cutlass.cute as cute

        def compile_direct_micro_kernel(kernel, *, topk_ids_dtype=None):
            return cute.compile(kernel)
    """,
    "moe_new_thing.py": """
        import cutlass.cute as ct

        class Op:
            def compile_it(self, k):
                '''cute.compile in a docstring is not a call.'''
                return ct.compile[3](k)
    """,
    "moe_w4a16_compiler.py": """
        import threading

        _COMPILE_CACHE = {}
        _COMPILE_CACHE_LOCK = threading.Lock()

        def _options_cache_key(options):
            return options

        def compile(func, *args, compile_spec=None, dsl_compile_options=None):
            import cutlass.cute as cute
            fn = cute.compile
            return fn(func, *args)
    """,
    "moe_w4a16_kernel.py": """
        from .moe_w4a16_compiler import compile as cached_compile

        def compile_w4a16_gemm(k):
            return cached_compile(k)

        def helper():
            return "cute.compile"
    """,
    "_sub/deep.py": """
        from cutlass import cute

        def nested():
            def inner():
                return cute.compile(1)
            return inner
    """,
}


def test_scanner_classifies_a_release_it_has_never_seen(tmp_path: Path) -> None:
    report = scan.sites_report(_tree(tmp_path, NEW_RELEASE), "0.7.9")
    status = _status(report)
    assert status == {
        # flashinfer's natively cached sites: ours by default (CUTE_DISKCACHE_NATIVE_SITES).
        **{f"{M}moe_dispatch.py:_get_{k}_kernel": "cute-diskcache" for k in ("static", "micro", "dynamic")},
        f"{M}moe_direct_micro_kernel.py:compile_direct_micro_kernel": "cute-diskcache",
        f"{M}moe_new_thing.py:Op.compile_it": "nothing",  # the unknown site shows up, as nothing
        f"{M}moe_w4a16_compiler.py:compile": "cute-diskcache",
        f"{M}moe_w4a16_kernel.py:compile_w4a16_gemm": "cute-diskcache",  # through the covered wrapper
        f"{M}_sub/deep.py:nested.inner": "nothing",
    }
    calls = {f"{s['file']}:{s['function']}": s["calls"] for s in report["sites"]}
    assert calls[f"{M}moe_new_thing.py:Op.compile_it"] == ["cute.compile[...]"]
    assert "build_and_load_cute_dsl_kernel" in calls[f"{M}moe_dispatch.py:_get_static_kernel"]
    # Adapter sites whose file exists but whose function no longer compiles: reported.
    assert f"{M}moe_nvfp4_w4a4.py:run_moe_w4a4" not in report["missing_adapter_sites"]  # no such file here
    assert report["verified"] is False


def test_a_renamed_site_is_nothing_and_strict_fails(tmp_path: Path) -> None:
    """A release that moves a site's compile to a function no row names: the hook would not meet
    it, so doctor --strict says so (the old row is simply absent on that release)."""
    files = dict(NEW_RELEASE)
    files["moe_direct_micro_kernel.py"] = "import cutlass.cute as cute\n\ndef compile_v2(k):\n    return cute.compile(k)\n"
    report = scan.sites_report(_tree(tmp_path, files), "0.7.9")
    status = _status(report)
    assert status[f"{M}moe_direct_micro_kernel.py:compile_v2"] == "nothing"
    assert f"{M}moe_direct_micro_kernel.py:compile_direct_micro_kernel" not in status
    assert report["missing_adapter_sites"] == []
    assert report["summary"]["nothing"] == 3  # compile_v2 beside NEW_RELEASE's two unknown sites
    assert doctor.strict_failure(report)
    assert "moe_direct_micro_kernel.py:compile_v2" in doctor.render(report)


def test_a_row_defined_but_no_longer_compiling_is_reported_missing(tmp_path: Path) -> None:
    files = dict(NEW_RELEASE)
    files["moe_direct_micro_kernel.py"] = ("import cutlass.cute as cute\n\ndef compile_direct_micro_kernel(k):\n    return None\n"
                                           "\ndef compile_v2(k):\n    return cute.compile(k)\n")
    report = scan.sites_report(_tree(tmp_path, files), "0.7.9")
    assert report["missing_adapter_sites"] == [f"{M}moe_direct_micro_kernel.py:compile_direct_micro_kernel"]
    assert _status(report)[f"{M}moe_direct_micro_kernel.py:compile_v2"] == "nothing"
    assert doctor.strict_failure(dict(report, summary=dict(report["summary"], nothing=0)))  # missing alone fails it
    assert "adapter sites not found" in doctor.render(report)


def test_native_sites_are_flashinfers_when_left_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_NATIVE_SITES", "flashinfer")
    report = scan.sites_report(_tree(tmp_path, NEW_RELEASE), "0.7.9")
    assert {f"{s['file']}:{s['function']}" for s in report["sites"] if s["status"] == "flashinfer"} == {
        f"{M}moe_dispatch.py:_get_{k}_kernel" for k in ("static", "micro", "dynamic")}
    assert report["native_sites"] == "flashinfer" and report["missing_adapter_sites"] == []
    assert "CUTE_DISKCACHE_NATIVE_SITES=flashinfer" in report["generation"]


@pytest.mark.parametrize("raw, expected", [(None, "cute-diskcache"), ("", "cute-diskcache"), ("flashinfer", "flashinfer"),
                                           (" FlashInfer ", "flashinfer"), ("cute-diskcache", "cute-diskcache"),
                                           ("native", "cute-diskcache"), ("0", "cute-diskcache")])
def test_native_sites_setting(raw: str | None, expected: str, monkeypatch: pytest.MonkeyPatch,
                              caplog: pytest.LogCaptureFixture) -> None:
    """Bad input is never a crash: an unknown value keeps the default, with a warning naming it."""
    from cute_diskcache import config

    if raw is None:
        monkeypatch.delenv("CUTE_DISKCACHE_NATIVE_SITES", raising=False)
    else:
        monkeypatch.setenv("CUTE_DISKCACHE_NATIVE_SITES", raw)
    with caplog.at_level("WARNING", logger="cute_diskcache"):
        assert config.load().native_sites == expected
    warned = [r for r in caplog.records if "CUTE_DISKCACHE_NATIVE_SITES" in r.getMessage()]
    assert bool(warned) == (raw is not None and raw.strip().lower() not in ("", "flashinfer", "cute-diskcache"))


def test_native_sites_count_as_nothing_when_flashinfer_cache_is_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHINFER_CUTE_DSL_DISABLE_CACHE", "1")
    monkeypatch.setenv("CUTE_DISKCACHE_NATIVE_SITES", "flashinfer")
    report = scan.sites_report(_tree(tmp_path, NEW_RELEASE), "0.7.9")
    site = next(s for s in report["sites"] if s["function"] == "_get_static_kernel")
    assert site["status"] == "nothing" and "FLASHINFER_CUTE_DSL_DISABLE_CACHE" in site["note"]
    # Served by us, they do not depend on flashinfer's cache being on.
    monkeypatch.delenv("CUTE_DISKCACHE_NATIVE_SITES")
    site = next(s for s in scan.sites_report(_tree(tmp_path / "ours", NEW_RELEASE), "0.7.9")["sites"]
                if s["function"] == "_get_static_kernel")
    assert site["status"] == "cute-diskcache" and "CUTE_DISKCACHE_NATIVE_SITES" in site["note"]


@pytest.mark.parametrize("native_sites", [None, "flashinfer"])
def test_the_same_tree_on_a_0_6_version_uses_that_generation(native_sites: str | None, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Before 0.6.18 moe_dispatch compiles in memory: its rows are ours whatever
    CUTE_DISKCACHE_NATIVE_SITES says, through the same hook as the direct micro kernel."""
    if native_sites is None:
        monkeypatch.delenv("CUTE_DISKCACHE_NATIVE_SITES", raising=False)
    else:
        monkeypatch.setenv("CUTE_DISKCACHE_NATIVE_SITES", native_sites)
    files = {"moe_dispatch.py": "import cutlass.cute as cute\n\ndef _get_micro_kernel(k):\n    cache_key = k\n    return cute.compile(k)\n",
             "moe_direct_micro_kernel.py": NEW_RELEASE["moe_direct_micro_kernel.py"]}
    report = scan.sites_report(_tree(tmp_path, files), "0.6.15.post1")
    assert _status(report) == {f"{M}moe_dispatch.py:_get_micro_kernel": "cute-diskcache",
                               f"{M}moe_direct_micro_kernel.py:compile_direct_micro_kernel": "cute-diskcache"}
    assert {s["note"] for s in report["sites"]} == {sites.NOTE}
    assert report["generation"].startswith("0.6.12-0.6.17") and report["native_sites"] is None


def test_render_json_round_trips(installed_report: dict) -> None:
    """The report as it is, under the CLI's JSON schema version."""
    assert json.loads(doctor.render(installed_report, json=True)) == {"schema": 1, **json.loads(json.dumps(installed_report))}
