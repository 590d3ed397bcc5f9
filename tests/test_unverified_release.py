"""An unverified flashinfer release (a 0.7.3, a 0.8), inside a real flashinfer: the written policy.

A release outside the verified list (``flashinfer_sites.compat.VERIFIED``, the releases the
matrix proved) is served as a verified one: every covered compile goes through one hook keyed by
everything it receives (issue 22), so there is nothing per site to vet and nothing a site's body
does (a renamed local) can make its key fall short. The process says once, at INFO, that the
release is unverified; no site is passed through, nothing is warned. What a release can still do
is move a site's compile to a function the site table does not name: such a site is not ours,
and ``doctor`` says whose it is.

The "release" is flashinfer 0.7.2.post1 (the venv of the CI matrix cell beside vLLM's 0.7.3 pin)
presented as 0.7.3: a ``flashinfer_python-0.7.3.dist-info`` first on the child's path. For a site
that changed, a link tree of that flashinfer with one edit to ``moe_dispatch.py`` goes first too.
``CUTE_DISKCACHE_COMPAT=off`` skips the module.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _compat, whatever pytest's import mode
from _compat import REPO, SCRATCH, matrix  # noqa: E402

pytestmark = [
    pytest.mark.skipif(os.environ.get("CUTE_DISKCACHE_COMPAT") == "off", reason="CUTE_DISKCACHE_COMPAT=off: matrix cells skipped"),
    pytest.mark.slow,
]
CELL = "fi0.7.2.post1-dsl4.8.0"
CHILD = REPO / "scripts" / "compat_child.py"
MICRO, STATIC = "flashinfer.moe_dispatch.micro", "flashinfer.moe_dispatch.static"
_DROPPED_ENV = re.compile(r"^(CUTE_DISKCACHE_.*|FLASHINFER_B12X_DISK_CACHE|CUTE_DSL_ARCH|FLASHINFER_WORKSPACE_.*|PYTHONPATH)$")


@pytest.fixture(scope="module")
def python() -> Path:
    cell = {c.name: c for c in matrix().CELLS}[CELL]
    return matrix().cell_venv(cell, SCRATCH)


@pytest.fixture
def as_073(tmp_path: Path) -> Path:
    """A directory that makes ``importlib.metadata`` report flashinfer-python 0.7.3."""
    front = tmp_path / "front"
    dist = front / "flashinfer_python-0.7.3.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flashinfer-python\nVersion: 0.7.3\n")
    return front


def _run(python: Path, args: list[str], tmp_path: Path, front: Path, rc: int = 0,
         **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env.update(PYTHONPATH=os.pathsep.join([str(front), str(REPO)]), CUTE_DISKCACHE_DIR=str(tmp_path / "root"),
               FLASHINFER_WORKSPACE_BASE=str(tmp_path / "workspace"), **extra_env)
    (tmp_path / "cwd").mkdir(exist_ok=True)
    proc = subprocess.run([str(python), *args], env=env, cwd=tmp_path / "cwd", capture_output=True, text=True, timeout=900)
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def _start(python: Path, tmp_path: Path, front: Path) -> tuple[dict[str, Any], str, list[str]]:
    """One engine start: the child's report, its stderr as tests read it, and our log lines."""
    proc = _run(python, [str(CHILD), "--target", "rtx-pro-6000", "micro", "static"], tmp_path, front)
    from conftest import split_stderr

    stderr, ours, _ = split_stderr(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1]), stderr, ours


def _outcomes(report: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for site in report["sites"].values():
        for name, _digest, outcome in site["events"]:
            out.setdefault(name, []).append(outcome)
    return out


def _package(python: Path, cwd: Path) -> Path:
    """The venv's flashinfer package directory (found, not imported)."""
    out = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('flashinfer').submodule_search_locations[0])"],
                         capture_output=True, text=True, timeout=120, check=True, cwd=cwd)
    return Path(out.stdout.strip())


def _doctor(python: Path, tmp_path: Path, front: Path, *args: str) -> dict[str, Any]:
    return json.loads(_run(python, ["-m", "cute_diskcache.cli.doctor", "--json", *args], tmp_path, front).stdout)


UNVERIFIED_LINE = "flashinfer 0.7.3 is not a release the compatibility matrix proved"
#: An engine start that compiles nothing: the DSL and moe_dispatch imported, the cache attached.
_IMPORT_ONLY = ("import logging, sys\n"
                "if sys.argv[1] == 'app': logging.basicConfig(level=logging.INFO, format='app %(levelname)s %(message)s')\n"
                "import cute_diskcache\ncute_diskcache.install(target='rtx-pro-6000')\n"
                "import flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_dispatch\n")


@pytest.mark.parametrize("logging_setup", ["none", "app"])
def test_unverified_release_is_said_once_at_info(logging_setup: str, python: Path, as_073: Path, tmp_path: Path) -> None:
    """Whether the engine configured logging ("app") or not ("none", where our own stderr handler
    shows what no other would), the one line that says the release is unverified is seen, once."""
    proc = _run(python, ["-c", _IMPORT_ONLY, logging_setup], tmp_path, as_073)
    said = [ln for ln in proc.stderr.splitlines() if UNVERIFIED_LINE in ln]
    prefix = "app INFO " if logging_setup == "app" else "[cute-diskcache] INFO "
    assert len(said) == 1 and said[0].startswith(prefix), proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]


def test_unverified_release_is_cached_like_a_verified_one(python: Path, as_073: Path, tmp_path: Path) -> None:
    cold, stderr, ours = _start(python, tmp_path, as_073)
    assert cold["flashinfer"] == "0.7.3"
    assert _outcomes(cold) == {MICRO: ["miss"], STATIC: ["miss"]}
    # No per-site verdict, no warning but the per-compile report lines (split_stderr sets them apart).
    assert not [ln for ln in ours if "WARNING" in ln and "compiling" not in ln], ours
    assert not [ln for ln in stderr.splitlines() if "verified" in ln or "passed through" in ln], stderr[-3000:]
    warm, _, _ = _start(python, tmp_path, as_073)
    assert _outcomes(warm) == {MICRO: ["hit"], STATIC: ["hit"]} and warm["real_compiles"] == 0
    report = _doctor(python, tmp_path, as_073)
    assert report["verified"] is False and report["flashinfer"] == "0.7.3" and "site_checks" not in report
    # Every row of the site table this release defines is persisted by us (the scan also lists
    # sm12x sites elsewhere in flashinfer; those are no business of this release check).
    from cute_diskcache.flashinfer_sites import sites

    rows = sites.covered(_package(python, tmp_path / "cwd"))
    assert len(rows) == 49, sorted(rows)  # 0.7.2.post1 defines 49 of the table's rows (0.7.4: 51)
    status = {(s["file"], s["function"]): s["status"] for s in report["sites"]}
    assert report["missing_adapter_sites"] == []
    assert {where: status.get(where) for where in rows} == dict.fromkeys(rows, "cute-diskcache")
    text = _run(python, ["-m", "cute_diskcache.cli.doctor"], tmp_path, as_073).stdout
    assert f"NOT verified (verified: {', '.join(report['verified_releases'])}); its sites are served all the same" in text


def _link_tree(python: Path, front: Path) -> Path:
    """``front/flashinfer``: links to the venv's flashinfer files, moe_dispatch.py a real copy."""
    src = _package(python, front)
    subprocess.run(["cp", "-rs", str(src), str(front / "flashinfer")], check=True, timeout=300)
    md = front / "flashinfer" / "fused_moe" / "cute_dsl" / "blackwell_sm12x" / "moe_dispatch.py"
    text = md.read_text()
    md.unlink()
    md.write_text(text)
    return md


def _edit_function(md: Path, name: str, edit: Any) -> None:
    text = md.read_text()
    fn = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
    lines = text.splitlines(keepends=True)
    body = "".join(lines[fn.lineno - 1:fn.end_lineno])
    changed = edit(body)
    assert changed != body
    md.write_text("".join(lines[:fn.lineno - 1]) + changed + "".join(lines[fn.end_lineno:]))


def test_a_site_whose_body_changed_is_still_cached(python: Path, as_073: Path, tmp_path: Path) -> None:
    """0.7.3's ``_get_micro_kernel`` renames its ``cache_key`` (a consistent rename: flashinfer still
    works). That once passed the site through uncached with a warning; the key no longer reads the
    site's frame, so the site is cached and hit like the rest, and nothing is warned."""
    md = _link_tree(python, as_073)
    _edit_function(md, "_get_micro_kernel", lambda body: re.sub(r"\bcache_key\b", "micro_key", body))
    cold, stderr, _ = _start(python, tmp_path, as_073)
    assert _outcomes(cold) == {MICRO: ["miss"], STATIC: ["miss"]}
    assert not [ln for ln in stderr.splitlines() if "passed through" in ln or "changed" in ln], stderr[-3000:]
    warm, _, _ = _start(python, tmp_path, as_073)
    assert _outcomes(warm) == {MICRO: ["hit"], STATIC: ["hit"]} and warm["real_compiles"] == 0


def test_a_site_moved_where_no_row_looks_is_left_to_flashinfer_and_doctor_says_so(
        python: Path, as_073: Path, tmp_path: Path) -> None:
    """0.7.3 renames ``_get_micro_kernel`` (and its caller): no row names it, so our stand-in for
    flashinfer's builder lets flashinfer build it, in flashinfer's own disk cache; the doctor shows
    the new function as flashinfer's, and as nothing's once that cache is off (--strict fails)."""
    md = _link_tree(python, as_073)
    md.write_text(re.sub(r"\b_get_micro_kernel\b", "_get_micro_kernel_v2", md.read_text()))
    cold, _, _ = _start(python, tmp_path, as_073)
    assert _outcomes(cold) == {STATIC: ["miss"]}, "the micro kernel must not be cached by us"
    assert cold["sites"]["micro"]["kinds"] == {"micro": 1}, cold["sites"]["micro"]
    assert cold["real_compiles"] == 2  # flashinfer compiled the micro kernel itself
    report = _doctor(python, tmp_path, as_073)
    status = {s["function"]: s["status"] for s in report["sites"] if s["file"] == "moe_dispatch.py"}
    assert status == {"_get_static_kernel": "cute-diskcache", "_get_dynamic_kernel": "cute-diskcache",
                      "_get_micro_kernel_v2": "flashinfer"}
    assert report["missing_adapter_sites"] == []
    proc = _run(python, ["-m", "cute_diskcache.cli.doctor", "--strict"], tmp_path, as_073, rc=1,
                FLASHINFER_CUTE_DSL_DISABLE_CACHE="1")
    assert re.search(r"nothing +fused_moe/cute_dsl/blackwell_sm12x/moe_dispatch.py:_get_micro_kernel_v2", proc.stdout)
