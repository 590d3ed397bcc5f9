"""The version policy: refused flashinfer + DSL combinations, and the checks an unverified release's
sites pass before they are cached (``cute_diskcache.flashinfer_sites.compat``).

The checks read flashinfer's source, so these tests run on the installed release's real files
(every adapter site must pass: a check that fails on a good release would disable the cache)
and on copies of them with one thing changed, as a later release might change it. The same
policy running inside a real flashinfer is in tests/test_unverified_release.py; the data here
is tied to the committed matrix results (compat/cells/*.json).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from cute_diskcache import doctor
from cute_diskcache.flashinfer_sites import compat, scan, v0_6, v0_7
from cute_diskcache.flashinfer_sites._common import MOE_DISPATCH, Call, compile_options
from cute_diskcache.key import UnkeyableError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _compat, whatever pytest's import mode
from _compat import matrix  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CELLS = REPO / "compat" / "cells"
UNVERIFIED_06 = "0.6.17.post9"  # a post-release the matrix never ran: the 0.6 adapter, unverified


@pytest.fixture(scope="module")
def installed() -> Path:
    package = scan.flashinfer_dir()
    if package is None:
        pytest.skip("flashinfer is not installed")
    return package


def _copy(installed: Path, tmp_path: Path, edit: str = "", new: str = "") -> Path:
    """The installed flashinfer's sm12x sources in a tree of their own, moe_dispatch.py edited."""
    pkg = tmp_path / "flashinfer"
    shutil.copytree(installed / "fused_moe" / "cute_dsl", pkg / "fused_moe" / "cute_dsl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    md = pkg / "fused_moe" / "cute_dsl" / "blackwell_sm12x" / "moe_dispatch.py"
    text = md.read_text()
    if edit:
        assert edit in text, edit
        md.write_text(text.replace(edit, new, 1))
    return pkg


def _micro_source(installed: Path) -> str:
    text = (installed / "fused_moe" / "cute_dsl" / "blackwell_sm12x" / "moe_dispatch.py").read_text()
    start = text.index("def _get_micro_kernel(")
    return text[start:text.index("\ndef ", start + 1)]


def _site(report: dict, function: str) -> dict:
    return next(s for s in report["sites"] if s["function"] == function)


# --------------------------------------------------------------------------------------------
# Site checks
# --------------------------------------------------------------------------------------------


def test_every_adapter_site_of_the_installed_release_passes_its_checks(installed: Path) -> None:
    from cute_diskcache.flashinfer_sites import flashinfer_version

    version = flashinfer_version()
    tables = v0_6.SHAPES if v0_6.applies(version) else {**v0_7.SHAPES, **v0_7.NATIVE_SHAPES}
    checked = compat.report(installed, version, tables)["site_checks"]
    assert checked and all(problems == [] for problems in checked.values()), checked


def test_unverified_release_whose_sites_pass_keeps_them_cached(installed: Path, tmp_path: Path) -> None:
    report = scan.sites_report(_copy(installed, tmp_path), UNVERIFIED_06)
    assert report["verified"] is False
    micro = _site(report, "_get_micro_kernel")
    assert micro["status"] == "cute-diskcache" and micro["note"] == "unverified release, checks passed"
    assert "3 of 3 adapter sites pass their checks" in doctor.render(report)


def test_a_renamed_key_local_passes_the_site_through(installed: Path, tmp_path: Path) -> None:
    """The key reads ``cache_key`` from the site's frame: a release that renames it gets no key."""
    body = _micro_source(installed)
    pkg = _copy(installed, tmp_path, body, body.replace("cache_key", "micro_key"))
    report = scan.sites_report(pkg, UNVERIFIED_06)
    micro = _site(report, "_get_micro_kernel")
    assert micro["status"] == "nothing"
    assert micro["note"] == "unverified release, passed through uncached: locals the key reads are gone: cache_key"
    assert _site(report, "_get_static_kernel")["status"] == "cute-diskcache"
    assert doctor.strict_failure(report)
    assert "passed through uncached: moe_dispatch.py:_get_micro_kernel" in doctor.render(report)
    # On a verified release the same source is trusted (the matrix proved the release as shipped).
    assert _site(scan.sites_report(pkg, compat.VERIFIED[0]), "_get_micro_kernel")["status"] == "cute-diskcache"


def test_an_unkeyed_compile_keyword_passes_the_site_through(installed: Path, tmp_path: Path) -> None:
    body = _micro_source(installed)
    changed = re.sub(r"options=", "pipeline=\"fast\", options=", body, count=1)
    assert changed != body
    micro = _site(scan.sites_report(_copy(installed, tmp_path, body, changed), UNVERIFIED_06), "_get_micro_kernel")
    assert micro["status"] == "nothing"
    assert "cute.compile passes pipeline, which the key does not capture" in micro["note"]


def test_a_vanished_site_function_is_reported(installed: Path, tmp_path: Path) -> None:
    pkg = _copy(installed, tmp_path, "def _get_micro_kernel(", "def _get_micro_kernel_v2(")
    checked = compat.report(pkg, UNVERIFIED_06, v0_6.SHAPES)["site_checks"]
    assert checked["moe_dispatch.py:_get_micro_kernel"] == ["function _get_micro_kernel is gone"]
    assert scan.sites_report(pkg, UNVERIFIED_06)["missing_adapter_sites"] == ["moe_dispatch.py:_get_micro_kernel"]


def test_site_checks_on_synthetic_sources() -> None:
    """Each check on its own: locals (not nested-scope names), callee, keywords, module state."""
    import ast

    tree = ast.parse("import threading\n_CACHE = {}\n"
                     "def site(a, *, b=None):\n"
                     "    key = (a, b)\n"
                     "    def inner():\n        hidden = 1\n        return cute.compile(a, options='x', **kw)\n"
                     "    return build_and_load_cute_dsl_kernel('m', 'k', inner, extra_key_files=())\n")
    ok = compat.shape(("a", "b", "key"), ("_CACHE",), cute_compile={"options", "**"},
                      build_and_load_cute_dsl_kernel={"extra_key_files"})
    assert compat.site_problems(tree, "site", ok) == []
    assert compat.site_problems(tree, "site", compat.shape(("hidden",))) == ["locals the key reads are gone: hidden"]
    assert compat.site_problems(tree, "site", compat.shape(cute_compile={"options"})) == [
        "cute.compile passes **, which the key does not capture"]
    assert compat.site_problems(tree, "other", ok) == ["function other is gone"]
    assert compat.site_problems(tree, "site", compat.shape(module_globals=("_LOCK",))) == ["module state gone: _LOCK"]
    no_builder = ast.parse("def site():\n    return cute.compile(1)\n")
    assert compat.site_problems(no_builder, "site", compat.shape(build_and_load_cute_dsl_kernel=())) == [
        "no build_and_load_cute_dsl_kernel call any more"]


def test_compile_keywords_the_key_does_not_capture_make_the_compile_uncached() -> None:
    """Direct micro passes ``**compile_kwargs``: at run time only ``options`` may be in it."""
    assert compile_options(Call({}, (), {"options": "--opt-level 2"})) == "--opt-level 2"
    with pytest.raises(UnkeyableError, match="pipeline"):
        compile_options(Call({}, (), {"options": "--opt-level 2", "pipeline": "fast"}))


def test_every_site_the_adapters_serve_has_a_shape() -> None:
    """A site added to an adapter without its shape would be passed through on every unverified release."""
    assert set(v0_6.SITES) == set(v0_6.SHAPES[MOE_DISPATCH])
    assert set(v0_7.NATIVE_FUNCTIONS) == set(v0_7.NATIVE_SHAPES[MOE_DISPATCH])
    covered = {(f"{m.rsplit('.', 1)[-1]}.py", fn) for m, fns in v0_7.SHAPES.items() for fn in fns}
    assert covered == set(v0_7.COVERED)


# --------------------------------------------------------------------------------------------
# Refusals and the verified list, against the matrix results
# --------------------------------------------------------------------------------------------


def test_refusal_rule_for_dsl_4_5_without_cu13_libs() -> None:
    rule = compat.REFUSED[0]
    base_only = {"nvidia-cutlass-dsl": "4.5.0", "nvidia-cutlass-dsl-libs-base": "4.5.0"}
    assert rule.matches("0.6.12", "4.5.0", base_only)
    assert rule.matches("0.6.17", "4.5.0", base_only)
    assert not rule.matches("0.6.12", "4.5.0", {**base_only, "nvidia-cutlass-dsl-libs-cu13": "4.5.0"})
    assert not rule.matches("0.6.12", "4.6.0", base_only)
    assert not rule.matches("0.6.18.post1", "4.5.0", base_only)


def test_refusal_rule_for_dsl_4_6_from_0_7_1() -> None:
    """0.7.1 added nvfp4 runners that import cutlass.experimental (DSL 4.7+)."""
    rule = compat.REFUSED[1]
    assert rule.evidence == "w4a4"
    assert rule.matches("0.7.1", "4.6.2", {}) and rule.matches("0.7.2.post1", "4.6.3", {}) and rule.matches("0.8.0", "4.6.0", {})
    assert not rule.matches("0.7.0.post1", "4.6.2", {}) and not rule.matches("0.7.1", "4.7.0", {})


def _results() -> list[dict]:
    results = [json.loads(p.read_text()) for p in sorted(CELLS.glob("*.json"))]
    if not results:
        pytest.skip("no matrix results in compat/cells")
    return results


def test_verified_releases_are_the_proven_matrix_cells() -> None:
    proven = {r["flashinfer"] for r in _results() if r["status"] == "proven"}
    assert set(compat.VERIFIED) == proven


def test_refusals_are_exactly_the_refused_matrix_cells() -> None:
    """Every refused cell matches a rule (with that cell's installed DSL dists); no proven cell does."""
    for r in _results():
        dsl = r["installed"]["nvidia-cutlass-dsl"]
        matched = [rule for rule in compat.REFUSED if rule.matches(r["flashinfer"], dsl, r["installed"])]
        assert bool(matched) == (r["status"] == "refused"), (r["cell"], r["status"], r["reason"])
    assert not [r["cell"] for r in _results() if r["status"] == "failed"]


def test_wheel_lower_bounds_are_the_oldest_proven_releases() -> None:
    import tomllib

    from cute_diskcache.flashinfer_sites._common import version_tuple

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    proven = [r for r in _results() if r["status"] == "proven"]
    oldest_fi = min((r["flashinfer"] for r in proven), key=version_tuple)
    oldest_dsl = min((r["dsl"] for r in proven), key=version_tuple)
    assert f"flashinfer-python>={oldest_fi}" in deps and f"nvidia-cutlass-dsl>={oldest_dsl}" in deps
    # No upper bound or pin on what the user owns.
    owned = [d for d in deps if re.match(r"(flashinfer-python|nvidia-cutlass-dsl|torch)\b", d)]
    assert owned == [f"flashinfer-python>={oldest_fi}", f"nvidia-cutlass-dsl>={oldest_dsl}", "torch"]


def test_versions_page_is_generated_from_the_matrix() -> None:
    _results()
    script = matrix()
    readme = (REPO / "docs" / "versions.md").read_text()
    section = readme.split(script.README_BEGIN, 1)[1].split(script.README_END, 1)[0]
    assert section.strip() == script.readme_section(script.load_results()).strip(), \
        "docs/versions.md's table is stale: python scripts/compat_matrix.py --table-only --readme"
    assert (REPO / "compat" / "README.md").read_text().count("\n| ") == len(_results()) + 1
