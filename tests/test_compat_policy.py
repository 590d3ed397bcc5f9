"""The version policy: refused flashinfer + DSL combinations, and what an unverified release gets
(``cute_diskcache.flashinfer_sites.compat``, with the site table ``flashinfer_sites.sites``).

Every covered compile goes through one hook keyed by everything it receives (issue 22), so an
unverified release is served like a verified one: nothing per site is vetted, and nothing a site
does inside (a renamed local, a new compile keyword) can make its key fall short. What a release
can change is *where* it compiles, which the site scan reads from flashinfer's source: these
tests run it on the installed release's real files (every table row it defines must be ours), on
0.7.4's (the venv tests/test_flashinfer_074.py uses), and on copies of the installed files with
one thing changed, as a later release might change it. The same policy inside a real flashinfer
is in tests/test_unverified_release.py; the data is tied to the committed matrix results
(compat/cells/*.json).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cute_diskcache.cli import doctor
from cute_diskcache.core import hook
from cute_diskcache.flashinfer_sites import compat, scan, sites
from cute_diskcache.core.through import Call
from cute_diskcache.flashinfer_sites.names import table_name

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _compat, whatever pytest's import mode
from test_flashinfer_074 import fi074  # noqa: E402,F401  (builds the 0.7.4 venv on a fresh checkout)
from _compat import matrix  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CELLS = REPO / "compat" / "cells"
UNVERIFIED_06 = "0.6.17.post9"  # a post-release the matrix never ran
FI074 = Path(os.environ.get("CUTE_DISKCACHE_FI074_PYTHON") or REPO / ".venv-fi074" / "bin" / "python")


@pytest.fixture(scope="module")
def installed() -> Path:
    package = scan.flashinfer_dir()
    if package is None:
        pytest.skip("flashinfer is not installed")
    return package


@pytest.fixture(scope="module")
def fi074_package(fi074: str) -> Path:  # noqa: F811
    """flashinfer 0.7.4's package directory in its venv (built by test_flashinfer_074's fixture on a
    fresh checkout; found, not imported: the scan reads source)."""
    code = ("import importlib.util as u, importlib.metadata as m; "
            "print(m.version('flashinfer-python')); print(u.find_spec('flashinfer').submodule_search_locations[0])")
    out = subprocess.run([fi074, "-c", code], capture_output=True, text=True, timeout=120, check=True, cwd="/")
    version, package = out.stdout.split()
    assert version == "0.7.4", f"{FI074} has flashinfer {version}"
    return Path(package)


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


def _status(report: dict) -> dict[str, str]:
    return {f"{s['file']}:{s['function']}": s["status"] for s in report["sites"]}


def _rows(package: Path) -> dict[str, sites.Row]:
    """The table rows a release defines, by the scan's name of them."""
    return {f"{table_name(r.file)}:{r.function}": r for r in sites.ROWS if sites.defined(package, r)}


# --------------------------------------------------------------------------------------------
# The site table on real releases
# --------------------------------------------------------------------------------------------


def test_every_table_row_the_installed_release_defines_is_ours(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cute_diskcache.flashinfer_sites import flashinfer_version

    if flashinfer_version() != "0.6.15.post1":
        pytest.skip(f"counts are 0.6.15.post1's; installed: {flashinfer_version()}")
    monkeypatch.delenv("CUTE_DISKCACHE_NATIVE_SITES", raising=False)
    report = scan.sites_report(installed, "0.6.15.post1")
    rows = _rows(installed)
    # moe_dispatch x3, the W4A16 kernels x4, the b12x FP4 runner, the BF16 x FP4 GEMM getter, GDN
    assert len(rows) == 10, sorted(rows)
    status = _status(report)
    assert {name: status.get(name) for name in rows} == dict.fromkeys(rows, "cute-diskcache")
    assert report["missing_adapter_sites"] == [] and not doctor.strict_failure(report)


def test_every_table_row_0_7_4_defines_is_ours_and_native_rows_can_be_left_to_flashinfer(
        fi074_package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUTE_DISKCACHE_NATIVE_SITES", raising=False)
    monkeypatch.delenv("FLASHINFER_CUTE_DSL_DISABLE_CACHE", raising=False)
    rows = _rows(fi074_package)
    assert len(rows) == 51 and sum(r.native for r in rows.values()) == 6, sorted(rows)
    report = scan.sites_report(fi074_package, "0.7.4")
    status = _status(report)
    assert {name: status.get(name) for name in rows} == dict.fromkeys(rows, "cute-diskcache")
    assert report["missing_adapter_sites"] == [] and report["summary"]["nothing"] == 0
    # Left to flashinfer, the rows it builds through its own disk cache are its; the rest stay ours.
    monkeypatch.setenv("CUTE_DISKCACHE_NATIVE_SITES", "flashinfer")
    status = _status(scan.sites_report(fi074_package, "0.7.4"))
    assert {name: status.get(name) for name in rows} == {
        name: "flashinfer" if row.native else "cute-diskcache" for name, row in rows.items()}


def test_table_rows_name_one_site_each_and_a_known_namespace() -> None:
    """The hook finds a row by (file, function): two rows there would make one of them unreachable."""
    assert len(sites.BY_WHERE) == len(sites.ROWS)
    assert {r.namespace for r in sites.ROWS} <= {"flashinfer-moe", "flashinfer-gemm", "flashinfer-attention",
                                                 "flashinfer-msa", "flashinfer-bsa", "flashinfer-kda",
                                                 "flashinfer-gdn", "flashinfer-frost", "flashinfer-moe-ep"}
    assert all(r.name.startswith("flashinfer.") and r.name.endswith(r.kind) for r in sites.ROWS)


# --------------------------------------------------------------------------------------------
# An unverified release: served as it is; a moved site shows up in doctor --strict
# --------------------------------------------------------------------------------------------


def test_an_unverified_release_is_served_exactly_as_a_verified_one(installed: Path, tmp_path: Path) -> None:
    """The matrix's verdict changes what doctor says of the release, never which sites are ours."""
    pkg = _copy(installed, tmp_path)
    unverified = scan.sites_report(pkg, UNVERIFIED_06)
    assert unverified["verified"] is False and compat.VERIFIED[0] in unverified["verified_releases"]
    verified = scan.sites_report(pkg, "0.6.15.post1")
    assert verified["verified"] is True
    assert _status(unverified) == _status(verified)
    micro = _site(unverified, "_get_micro_kernel")
    assert micro["status"] == "cute-diskcache" and micro["note"] == sites.NOTE
    assert unverified["missing_adapter_sites"] == [] and not doctor.strict_failure(unverified)
    text = doctor.render(unverified)
    assert "NOT verified" in text and "its sites are served all the same" in text
    assert "check" not in text  # no per-site vetting left to report


def test_what_a_site_does_inside_its_function_no_longer_matters(installed: Path, tmp_path: Path) -> None:
    """A renamed local and a new compile keyword (each once passed the site through uncached on an
    unverified release): the key is what the compile receives, so the site stays ours."""
    body = _micro_source(installed)
    assert "cache_key" in body and "options=" in body
    changed = re.sub(r"\bcache_key\b", "micro_key", body).replace("options=", "pipeline=\"fast\", options=", 1)
    report = scan.sites_report(_copy(installed, tmp_path, body, changed), UNVERIFIED_06)
    micro = _site(report, "_get_micro_kernel")
    assert micro["status"] == "cute-diskcache" and micro["calls"] == ["cute.compile"]
    assert not doctor.strict_failure(report)


def test_a_compile_keyword_joins_the_key() -> None:
    """What made a site "unkeyable" before (a keyword the hand-written key did not name) now keys it."""
    def key(**kwargs: object) -> object:
        return hook._key(Call({"describer": hook.describer(), "site": "f.py:site", "compiled_in": "site"}, (1, "k"), kwargs))

    assert key() == key()
    assert key(pipeline="fast") != key() and key(pipeline="fast") != key(pipeline="slow")
    assert key(options="--opt-level 2") == key(options="--opt-level 3")  # options: keyed apart (Site.options)


def test_a_site_moved_to_a_function_the_table_does_not_name_is_nothing(installed: Path, tmp_path: Path) -> None:
    """The one thing a release can do to escape the hook: compile where no row looks. The row is
    then simply absent on that release (not "missing"), and the new function is nobody's."""
    pkg = _copy(installed, tmp_path, "def _get_micro_kernel(", "def _get_micro_kernel_v2(")
    for version in (UNVERIFIED_06, "0.6.15.post1"):
        report = scan.sites_report(pkg, version)
        status = _status(report)
        assert status["moe_dispatch.py:_get_micro_kernel_v2"] == "nothing"
        assert "moe_dispatch.py:_get_micro_kernel" not in status
        assert report["summary"]["nothing"] == 1 and report["missing_adapter_sites"] == []
        assert doctor.strict_failure(report)
        assert "nothing        fused_moe/cute_dsl/blackwell_sm12x/moe_dispatch.py:_get_micro_kernel_v2" in doctor.render(report)


def test_a_row_the_release_defines_but_no_longer_compiles_in_is_missing(installed: Path, tmp_path: Path) -> None:
    """_get_micro_kernel kept as a name whose compile moved elsewhere: the hook would not meet it there."""
    pkg = _copy(installed, tmp_path, "def _get_micro_kernel(",
                "def _get_micro_kernel(*args, **kwargs):\n    return None\n\n\ndef _build_micro_kernel(")
    report = scan.sites_report(pkg, UNVERIFIED_06)
    assert report["missing_adapter_sites"] == ["moe_dispatch.py:_get_micro_kernel"]
    assert _status(report)["moe_dispatch.py:_build_micro_kernel"] == "nothing"
    assert doctor.strict_failure(report)
    assert "adapter sites not found" in doctor.render(report)


def test_note_unverified_says_one_info_line_and_warns_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(compat, "_UNVERIFIED_LOGGED", [])
    monkeypatch.setattr(compat, "flashinfer_version", lambda: compat.VERIFIED[-1])
    with caplog.at_level(logging.DEBUG, logger="cute_diskcache"):
        compat.note_unverified()
    assert caplog.records == []
    monkeypatch.setattr(compat, "flashinfer_version", lambda: "0.7.3")
    with caplog.at_level(logging.DEBUG, logger="cute_diskcache"):
        compat.note_unverified()
        compat.note_unverified()
    assert [(r.levelname, r.getMessage().split(";")[0]) for r in caplog.records] == [
        ("INFO", "flashinfer 0.7.3 is not a release the compatibility matrix proved")]


def test_report_says_verified_or_not_and_the_refusal() -> None:
    from cute_diskcache.flashinfer_sites import flashinfer_version

    assert compat.report(UNVERIFIED_06) == {"verified": False, "verified_releases": list(compat.VERIFIED),
                                            "refused": None, "refused_evidence": None}
    mine = compat.report(flashinfer_version())
    assert mine["verified"] == (flashinfer_version() in compat.VERIFIED)
    assert mine["refused"] == compat.refusal()


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
    flashinfer, _, b12x = (REPO / "compat" / "README.md").read_text().partition("\n## b12x")
    assert flashinfer.count("\n| ") == len(_results()) + 1
    b12x_cells = sorted((REPO / "compat" / "b12x").glob("*.json"))  # scripts/compat_b12x.py's section
    assert b12x.count("\n| ") == (len(b12x_cells) + 1 if b12x_cells else 0)
