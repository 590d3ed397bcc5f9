"""An unverified flashinfer release (a 0.7.3, a 0.8), inside a real flashinfer: the written policy.

A release outside the verified list (``flashinfer_sites.compat.VERIFIED``, the releases the
matrix proved) has each adapter site checked against its own source before the site is cached:
the function exists, the frame locals the key reads exist, the compile call passes nothing the
key does not capture. Passing sites are cached as on a verified release; a failing one is passed
through to flashinfer, uncached, with one warning that names it.

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


def _run(python: Path, args: list[str], tmp_path: Path, front: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env.update(PYTHONPATH=os.pathsep.join([str(front), str(REPO)]), CUTE_DISKCACHE_DIR=str(tmp_path / "root"),
               FLASHINFER_WORKSPACE_BASE=str(tmp_path / "workspace"))
    (tmp_path / "cwd").mkdir(exist_ok=True)
    proc = subprocess.run([str(python), *args], env=env, cwd=tmp_path / "cwd", capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _start(python: Path, tmp_path: Path, front: Path) -> tuple[dict[str, Any], str]:
    proc = _run(python, [str(CHILD), "--target", "rtx-pro-6000", "micro", "static"], tmp_path, front)
    from conftest import split_stderr

    return json.loads(proc.stdout.strip().splitlines()[-1]), split_stderr(proc.stderr)[0]


def _outcomes(report: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for site in report["sites"].values():
        for name, _digest, outcome in site["events"]:
            out.setdefault(name, []).append(outcome)
    return out


def test_unverified_release_whose_sites_pass_their_checks_is_cached(python: Path, as_073: Path, tmp_path: Path) -> None:
    cold, _ = _start(python, tmp_path, as_073)
    assert cold["flashinfer"] == "0.7.3"
    assert _outcomes(cold) == {MICRO: ["miss"], STATIC: ["miss"]}
    warm, _ = _start(python, tmp_path, as_073)
    assert _outcomes(warm) == {MICRO: ["hit"], STATIC: ["hit"]} and warm["real_compiles"] == 0
    report = json.loads(_run(python, ["-m", "cute_diskcache.doctor", "--json"], tmp_path, as_073).stdout)
    assert report["verified"] is False and report["flashinfer"] == "0.7.3"
    assert report["site_checks"] and all(p == [] for p in report["site_checks"].values())
    # Every adapter site is persisted (the scan also lists sm12x sites elsewhere in flashinfer
    # that nobody persists; those are no business of this release check).
    status = {f"{s['file']}:{s['function']}": s["status"] for s in report["sites"]}
    assert report["missing_adapter_sites"] == []
    assert {site: status.get(site) for site in report["site_checks"]} == dict.fromkeys(report["site_checks"], "cute-diskcache")
    text = _run(python, ["-m", "cute_diskcache.doctor"], tmp_path, as_073).stdout
    assert f"NOT verified (verified: {', '.join(report['verified_releases'])}); 15 of 15 adapter sites pass their checks" in text


def _link_tree(python: Path, front: Path) -> Path:
    """``front/flashinfer``: links to the venv's flashinfer files, moe_dispatch.py a real copy."""
    out = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('flashinfer').submodule_search_locations[0])"],
                         capture_output=True, text=True, timeout=120, check=True, cwd=front)
    src = Path(out.stdout.strip())
    subprocess.run(["cp", "-rs", str(src), str(front / "flashinfer")], check=True, timeout=300)
    md = front / "flashinfer" / "fused_moe" / "cute_dsl" / "blackwell_sm12x" / "moe_dispatch.py"
    text = md.read_text()
    md.unlink()
    md.write_text(text)
    return md


def test_a_changed_site_is_passed_through_with_one_warning(python: Path, as_073: Path, tmp_path: Path) -> None:
    """0.7.3's ``_get_micro_kernel`` renames its ``cache_key`` (flashinfer still works: the rename is
    consistent): the key we read from its frame is gone, so that site alone is left to flashinfer."""
    md = _link_tree(python, as_073)
    text = md.read_text()
    fn = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "_get_micro_kernel")
    lines = text.splitlines(keepends=True)
    body = "".join(lines[fn.lineno - 1:fn.end_lineno])
    assert "cache_key" in body
    renamed = re.sub(r"\bcache_key\b", "micro_key", body)
    md.write_text("".join(lines[:fn.lineno - 1]) + renamed + "".join(lines[fn.end_lineno:]))

    cold, stderr = _start(python, tmp_path, as_073)
    assert _outcomes(cold) == {STATIC: ["miss"]}, "the micro kernel must not be cached by us"
    assert cold["sites"]["micro"]["kinds"] == {"micro": 1}, cold["sites"]["micro"]
    assert cold["real_compiles"] == 2  # flashinfer compiled the micro kernel itself
    warnings = [ln for ln in stderr.splitlines() if "not a verified release" in ln]
    assert warnings == ["flashinfer 0.7.3 is not a verified release and moe_dispatch._get_micro_kernel changed (locals the key "
                        "reads are gone: cache_key): that site is passed through uncached"], stderr[-3000:]
    report = json.loads(_run(python, ["-m", "cute_diskcache.doctor", "--json"], tmp_path, as_073).stdout)
    micro = next(s for s in report["sites"] if s["function"] == "_get_micro_kernel")
    assert micro["status"] == "flashinfer" and "passed through uncached: locals the key reads are gone: cache_key" in micro["note"]
    assert next(s for s in report["sites"] if s["function"] == "_get_static_kernel")["status"] == "cute-diskcache"
