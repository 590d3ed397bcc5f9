"""Packaging: the license ships, the extras split what is optional, and the lower bounds hold.

The lower bounds in pyproject.toml are claims ("msgpack>=1.0 has what we import"): the slow test
proves them by installing exactly those versions (each ``>=X`` pinned to ``==X``, parsed from
pyproject.toml so the test follows any change there) into a fresh venv, with torch 2.13.0 (CPU),
flashinfer 0.6.15.post1 and DSL 4.8.1 as CI has them, then importing every module and running
the quick tests that exercise the dependencies (CLI, entries and statistics with msgpack, the
remote tier with fsspec and redis-py, models with huggingface_hub) against the installed wheel.
The venv lives outside the checkout (``$CUTE_DISKCACHE_COMPAT_SCRATCH``, as the compatibility
venvs), named by what it installs (an edit to pyproject.toml that moves no bound, a ruff rule
say, reuses it), built once under a file lock and never written afterwards: each test run
installs this checkout's wheel into a small venv of its own layered over it, so two runs (two
checkouts, two workers) never swap the code under each other's tests. ``--system-site-packages``
would hide the bounds, so nothing comes from the host's environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _compat, whatever pytest's import mode

from _compat import REPO, SCRATCH, matrix  # noqa: E402

PYPROJECT = REPO / "pyproject.toml"
#: CI's stack (the `test` extra's pins): the bounds under test are the other dependencies'.
STACK = ("torch==2.13.0", "flashinfer-python==0.6.15.post1", "nvidia-cutlass-dsl==4.8.1", "triton", "pytest", "pytest-timeout")
#: The extras whose lower bounds are claims about our imports (`demo` and `test` pin versions).
EXTRAS = ("prewarm", "remote", "s3")
#: Quick tests run in the lowest-bounds venv: the CLI, entries, statistics, the remote tier's
#: clients and models; the module import covers the rest.
QUICK_TESTS = ("test_cli.py", "test_cli_conventions.py", "test_entry.py", "test_stats.py", "test_remote_unit.py")
#: Quick tests left out there: they pay a real DSL compile or three prewarm planning processes
#: (about 90 of the 160 s those files take on 2 cores) and call no bounded library in a way the
#: others do not. A real kernel's entry is read with the same msgpack calls ``test_entry`` makes
#: (packb with use_bin_type, unpackb raw=False); planning keys with entry's packb call, and its
#: progress bar is tqdm's only on a terminal, which ``test_cli_conventions``' tty test drives.
#: torch, flashinfer and the DSL are CI's pins in that venv, so what these tests prove about
#: them the suite's own run of the same tests proves.
QUICK_DESELECTED = (
    "test_cli.py::test_show_cubin_of_a_real_kernel",
    "test_cli.py::test_verify_device_loads_a_real_kernel",
    "test_cli_conventions.py::test_prewarm_subcommand_plans_what_the_old_program_plans",
)


def _project() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(PYPROJECT.read_text())["project"]


def requirements() -> list[str]:
    """Every dependency of the core and of :data:`EXTRAS`, as pyproject.toml writes it."""
    project = _project()
    return list(project["dependencies"]) + [r for extra in EXTRAS for r in project["optional-dependencies"][extra]]


def lower_bounds(reqs: list[str]) -> dict[str, str]:
    """``{name: lowest allowed version}`` for every requirement with a ``>=`` bound."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    out: dict[str, str] = {}
    for text in reqs:
        req = Requirement(text)
        for spec in req.specifier:
            if spec.operator == ">=":
                out[canonicalize_name(req.name)] = spec.version
    return out


def test_license_is_the_apache_text() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert _project()["license"]["text"] == "Apache-2.0"


def test_changelog_has_the_released_version() -> None:
    from cute_diskcache._version import __version__

    text = (REPO / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text and f"## [{__version__}]" in text


def test_prewarm_only_dependencies_are_an_extra() -> None:
    """A serving install needs neither huggingface_hub nor tqdm; `[prewarm]` brings them."""
    project = _project()
    core = lower_bounds(project["dependencies"])
    assert "huggingface-hub" not in core and "tqdm" not in core
    prewarm = lower_bounds(project["optional-dependencies"]["prewarm"])
    assert prewarm["huggingface-hub"] == "0.25", "huggingface_hub.errors.LocalEntryNotFoundError is new in 0.25"
    assert "s3fs" in lower_bounds(project["optional-dependencies"]["s3"])
    test_extra = lower_bounds(project["optional-dependencies"]["test"])
    assert {"huggingface-hub", "tqdm", "redis", "fsspec", "s3fs"} <= set(test_extra), "test pulls every extra"


def test_bounds_are_parsed_from_pyproject() -> None:
    bounds = lower_bounds(requirements())
    assert bounds["msgpack"] == "1.0" and bounds["huggingface-hub"] == "0.25" and bounds["flashinfer-python"] == "0.6.12"


# --------------------------------------------------------------------------------------------
# The lowest-bounds install
# --------------------------------------------------------------------------------------------


def _constraint_lines() -> list[str]:
    """Each bounded dependency at its bound; CI's flashinfer / DSL / torch instead of theirs."""
    bounds = lower_bounds(requirements())
    for name in ("flashinfer-python", "nvidia-cutlass-dsl"):
        bounds.pop(name, None)  # the matrix proves those bounds (tests/test_compat.py)
    return [*(f"{name}=={version}" for name, version in sorted(bounds.items())), *(s for s in STACK if "==" in s)]


def _constraints(path: Path) -> Path:
    path.write_text("\n".join(_constraint_lines()) + "\n")
    return path


def lowest_venv(scratch: Path) -> Path:
    """A venv with the lowest allowed dependencies (not this package); returns its interpreter.

    Named by the constraints and requirements it installs, so it is rebuilt only when a bound or
    CI's stack moves. Built under ``<venv>.lock`` (another worker or run waits, then finds the
    stamp, written last) and read-only afterwards: the code under test goes into
    :func:`overlay_venv`, never here."""
    deps = [r for r in requirements() if not r.startswith(("flashinfer-python", "nvidia-cutlass-dsl", "torch"))]
    wanted = {"constraints": _constraint_lines(), "install": [*STACK, *deps]}
    digest = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:16]
    venv = scratch / "lowest-bounds" / digest
    python = venv / "bin" / "python"
    stamp = venv / "lowest-bounds.json"
    with matrix().building(venv):  # another worker or run on this machine may be building it
        if not (stamp.is_file() and json.loads(stamp.read_text()) == wanted):
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
            constraints = _constraints(venv / "constraints.txt")
            matrix()._pip(python, *STACK, *deps, constraints=constraints)
            stamp.write_text(json.dumps(wanted))
    return python


def overlay_venv(base: Path, where: Path) -> Path:
    """A venv of this test's own, layered over ``base``'s packages, holding this checkout's wheel
    (seconds; dependencies untouched). Its site-packages comes first, so the wheel is what the
    tests import; ``site.addsitedir`` processes the base's ``.pth`` files as its own venv would."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = matrix()._purelib(python)
    (purelib / "zz_lowest_bounds.pth").write_text(f"import site; site.addsitedir({str(matrix()._purelib(base))!r})\n")
    matrix().install_checkout_wheel(python, REPO, where)
    return python


def _installed(python: Path, *names: str) -> dict[str, str]:
    code = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    out = subprocess.run([str(python), "-c", code, *names], check=True, capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


#: Imports every module of the installed package (the CLI's, the remote tier's, prewarm's) and
#: the optional libraries through the modules that use them.
_IMPORT_ALL = """
import importlib, pkgutil, sys
import cute_diskcache
assert cute_diskcache.__file__.startswith(sys.argv[1]), (cute_diskcache.__file__, sys.argv[1])  # the overlay's wheel
names = [m.name for m in pkgutil.walk_packages(cute_diskcache.__path__, "cute_diskcache.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
import fsspec, redis, s3fs, tqdm
from huggingface_hub.errors import LocalEntryNotFoundError
fsspec.filesystem("s3", anon=True)
print(len(names))
"""


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_lowest_allowed_versions_pass_the_quick_tests(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    python = overlay_venv(lowest_venv(SCRATCH), tmp_path)
    built = time.perf_counter() - t0
    bounds = lower_bounds(requirements())
    wanted = {n: v for n, v in bounds.items() if n not in ("flashinfer-python", "nvidia-cutlass-dsl")}
    have = _installed(python, *wanted)
    from packaging.version import Version

    assert {n: Version(v) for n, v in have.items()} == {n: Version(v) for n, v in wanted.items()}, "each bound installed"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUTE_DISKCACHE_", "PYTHONPATH"))}
    overlay = str(python.parent.parent)
    proc = subprocess.run([str(python), "-c", _IMPORT_ALL, overlay], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) > 30, proc.stdout
    t1 = time.perf_counter()
    # From tmp_path: the checkout is not on sys.path, so the tests import the installed wheel.
    # In one process (addopts emptied: setup.cfg's -n 2 needs pytest-xdist, which this venv of
    # lowest bounds does not hold, and this test already runs on one of the suite's two workers).
    tests = [str(REPO / "tests" / name) for name in QUICK_TESTS]
    deselected = [arg for test in QUICK_DESELECTED for arg in ("--deselect", str(REPO / "tests" / test))]
    for test in QUICK_DESELECTED:  # pytest ignores a --deselect that names nothing: a renamed test would run again
        module, name = test.split("::")
        assert f"def {name}(" in (REPO / "tests" / module).read_text(), f"{test} is gone: update QUICK_DESELECTED"
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
                           "-c", str(REPO / "setup.cfg"), "-o", "addopts=", "--rootdir", str(REPO), *deselected, *tests],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    print(f"venv {built:.0f} s, quick tests {time.perf_counter() - t1:.0f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
