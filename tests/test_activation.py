"""Activation after a real ``pip install``: the three doors, each in a fresh interpreter.

An editable install and the test process itself prove nothing about what a user gets: the
.pth must land at the site-packages root, the entry points must be in the installed metadata,
and interpreter start must stay cheap. So the module builds the wheel once, installs it into
throwaway venvs, and asks every question in a new interpreter of one of them:

* ``full``: our wheel, plus the test environment (flashinfer, torch, the DSL) seen *behind* it;
* ``isolated``: our wheel and its pure-python dependencies only (no flashinfer, no torch);
* ``bare``: nothing at all, the baseline for the start-up cost of our .pth.

``full`` does not use ``--system-site-packages``: when pytest itself runs in a venv, that flag
points at the base interpreter's site-packages, not at the venv holding flashinfer. Instead a
``zz_outer_env.pth`` calls ``site.addsitedir`` on the test interpreter's site directories,
after our own site-packages (so our installed copy wins over any editable one, which every
test checks through ``cute_diskcache.__file__``), and with their .pth files processed
(nvidia-cutlass-dsl needs its own).
"""

from __future__ import annotations

import dataclasses
import json
import os
import site
import statistics
import subprocess
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENABLE_ENV = "FLASHINFER_B12X_DISK_CACHE"
TARGET = "rtx-pro-6000"
MOE_DISPATCH = "flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_dispatch"

#: Pure-python runtime dependencies the isolated venv gets (flashinfer, torch, the DSL do not).
LIGHT_DEPS = ("msgpack", "platformdirs", "filelock")

#: Start-up cost of an installed-but-unset cache we call "nothing measurable", per interpreter.
PTH_BUDGET_S = 0.005
PTH_RUNS = 25


@dataclasses.dataclass(frozen=True)
class Venv:
    """A throwaway virtual environment and the paths the tests look at."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def purelib(self) -> Path:
        return Path(sysconfig.get_path("purelib", vars={"base": str(self.root), "platbase": str(self.root)}))

    def owns(self, path: str) -> bool:
        return Path(path).resolve().is_relative_to(self.root.resolve())


@dataclasses.dataclass(frozen=True)
class Venvs:
    full: Venv
    isolated: Venv
    bare: Venv
    workdir: Path  # cwd of every child: never the repo, or ``-c`` would import the source tree


def _pip(target: Venv, *args: str) -> None:
    """Run the test interpreter's pip against ``target`` (venvs are made without pip: faster)."""
    cmd = [sys.executable, "-m", "pip", "--python", str(target.python), "install", "--no-deps", "--no-input", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)


def _make_venv(root: Path) -> Venv:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    return Venv(root)


def _outer_site_dirs() -> list[str]:
    """The test interpreter's site directories, in sys.path order."""
    candidates = [*site.getsitepackages(), site.getusersitepackages()]
    return [p for p in sys.path if p in candidates and os.path.isdir(p)]


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> Venvs:
    """Build the wheel once (exactly what ``pip install .`` does first) and install it twice."""
    base = tmp_path_factory.mktemp("activation")
    dist = base / "dist"
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(REPO)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (wheel,) = dist.glob("cute_diskcache-*.whl")

    full = _make_venv(base / "full")
    _pip(full, "--no-index", str(wheel))
    outer = _outer_site_dirs()
    assert outer, "cannot find the test interpreter's site-packages"
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in outer)
    (full.purelib / "zz_outer_env.pth").write_text(lines)

    isolated = _make_venv(base / "isolated")
    pins = [f"{name}=={metadata.version(name)}" for name in LIGHT_DEPS]
    _pip(isolated, str(wheel), *pins)

    bare = _make_venv(base / "bare")
    workdir = base / "cwd"
    workdir.mkdir()
    print(f"\nbuilt and installed {wheel.name} into 2 venvs in {time.perf_counter() - t0:.1f} s")
    return Venvs(full, isolated, bare, workdir)


def _env(workdir: Path, **extra: str) -> dict[str, str]:
    """The caller's environment minus anything that could turn the cache on or steer imports."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != ENABLE_ENV and not k.startswith("CUTE_DISKCACHE_") and k not in ("CUTE_DSL_ARCH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")
    }
    env["CUTE_DISKCACHE_DIR"] = str(workdir / "cache")  # nothing should write; if it did, not to ~
    env.update(extra)
    return env


def _run(venv: Venv, workdir: Path, code: str, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(venv.python), "-c", code], cwd=workdir, env=_env(workdir, **extra), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


def _report(venv: Venv, workdir: Path, code: str, **extra: str) -> dict:
    """Run ``code`` (which must end by printing one JSON object) and return that object."""
    proc = _run(venv, workdir, code, **extra)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# What the children run. Each starts by recording the interpreter's state before it imports
# anything itself, so the .pth's effect (or absence of effect) is what gets observed.
_STARTUP_STATE = """
import json, os, sys
loaded_at_start = sorted(m for m in sys.modules if m.split(".")[0] in ("cute_diskcache", "flashinfer", "torch", "cutlass"))
finders_at_start = [type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith("cute_diskcache")]
"""

_FINDERS = """
from cute_diskcache import activation
def finders():
    return sum(isinstance(f, activation._Finder) for f in sys.meta_path)
"""


def test_installed_layout(venvs: Venvs) -> None:
    """The .pth sits at the site-packages root (else it never runs) and matches the source."""
    for venv in (venvs.full, venvs.isolated):
        pth = venv.purelib / "cute_diskcache.pth"
        assert pth.is_file(), f"{pth} missing: the bootstrap would never run"
        assert pth.read_text() == (REPO / "cute_diskcache.pth").read_text()
        assert (venv.purelib / "cute_diskcache" / "_bootstrap.py").is_file()


def test_unset_variable_never_imports_the_package(venvs: Venvs) -> None:
    out = _report(
        venvs.full,
        venvs.workdir,
        _STARTUP_STATE
        + """
import cute_diskcache
print(json.dumps({"loaded": loaded_at_start, "finders": finders_at_start, "file": cute_diskcache.__file__}))
""",
    )
    assert venvs.full.owns(out["file"]), f"imported {out['file']}, not the installed copy"
    assert out["loaded"] == [], f"imported at start with {ENABLE_ENV} unset: {out['loaded']}"
    assert out["finders"] == []


def test_unset_variable_costs_nothing_measurable(venvs: Venvs) -> None:
    """``python -c pass`` with the package installed vs without, interleaved to share the noise."""
    state = _report(venvs.isolated, venvs.workdir, _STARTUP_STATE + "print(json.dumps(loaded_at_start))")
    assert state == []
    env = _env(venvs.workdir)

    def once(venv: Venv) -> float:
        t0 = time.perf_counter()
        subprocess.run([str(venv.python), "-c", "pass"], cwd=venvs.workdir, env=env, check=True, timeout=60)
        return time.perf_counter() - t0

    once(venvs.bare), once(venvs.isolated)  # warm the page cache and the pyc files
    bare, installed = [], []
    for _ in range(PTH_RUNS):
        bare.append(once(venvs.bare))
        installed.append(once(venvs.isolated))
    med_bare, med_installed = statistics.median(bare), statistics.median(installed)
    # Median of paired differences: each pair ran back to back, so load from other processes
    # on this 2-core box hits both sides of a pair alike.
    delta = statistics.median(i - b for i, b in zip(installed, bare))
    print(
        f"\npython -c pass, median of {PTH_RUNS}: without package {med_bare * 1e3:.2f} ms, "
        f"installed ({ENABLE_ENV} unset) {med_installed * 1e3:.2f} ms, paired difference {delta * 1e3:+.2f} ms"
    )
    assert delta < PTH_BUDGET_S, f"installed-but-unset start-up costs {delta * 1e3:.1f} ms more"


def test_variable_set_hooks_the_dsls_compile_on_import(venvs: Venvs) -> None:
    """The .pth registers only an import hook; importing moe_dispatch later (which imports the DSL)
    puts the one dispatcher on ``cutlass.cute.compile``, and the hook takes moe_dispatch's
    three compile functions, as installed, for sites."""
    out = _report(
        venvs.full,
        venvs.workdir,
        _STARTUP_STATE
        + _FINDERS
        + """
out = {"loaded": loaded_at_start, "finders_at_start": finders()}
from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch
import torch
import cute_diskcache
from cute_diskcache import flashinfer_sites
from cute_diskcache.core import hook
real_cute = sys.modules["cutlass.cute"]
rows = {}
for name in ("_get_static_kernel", "_get_micro_kernel", "_get_dynamic_kernel"):
    found = hook._classify(getattr(moe_dispatch, name).__code__)
    rows[name] = getattr(found, "name", None)
out.update(
    file=cute_diskcache.__file__,
    dispatcher=type(real_cute.compile).__name__,
    real=type(real_cute.compile._real).__module__,
    module_untouched=moe_dispatch.__dict__["cute"] is real_cute,
    rows=rows,
    sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
    arch=os.environ.get("CUTE_DSL_ARCH"),
    finders=finders(),
    compiled=flashinfer_sites.kernel_cache_sizes(),
)
print(json.dumps(out))
""",
        **{ENABLE_ENV: "1", "CUTE_DISKCACHE_TARGET": TARGET},
    )
    assert venvs.full.owns(out["file"])
    # Only our own package at start: flashinfer, torch and the DSL wait for the program.
    assert out["loaded"] and all(m.startswith("cute_diskcache") for m in out["loaded"]), out["loaded"]
    assert out["finders_at_start"] == 1
    assert out["dispatcher"] == "_Dispatch"
    assert out["real"].startswith("cutlass."), out["real"]  # over the DSL's own compile
    assert out["module_untouched"] is True  # one hook in the DSL, nothing in flashinfer's module
    assert out["rows"] == {f"_get_{k}_kernel": f"flashinfer.moe_dispatch.{k}" for k in ("static", "micro", "dynamic")}
    assert out["sm_count"] == 188 and out["arch"] == "sm_120a"  # the profile answered, before import
    assert out["finders"] == 1
    assert sum(out["compiled"].values()) == 0  # attaching compiles nothing


def test_install_after_flashinfer_import_is_idempotent_and_reversible(venvs: Venvs) -> None:
    """flashinfer imported first with no hook anywhere; install() must hook the DSL already loaded."""
    out = _report(
        venvs.full,
        venvs.workdir,
        _STARTUP_STATE
        + f"""
from cute_diskcache.keys import targets
targets.apply({TARGET!r})  # device stand-ins only: no import hook exists yet
from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch
import cute_diskcache
"""
        + _FINDERS
        + """
cute = sys.modules["cutlass.cute"]
real = cute.compile
out = {"loaded": loaded_at_start, "finders_before": finders(), "before": type(real).__name__}
cute_diskcache.install()
first = cute.compile
out["after_install"] = type(first).__name__
cute_diskcache.install()
out["same_dispatcher"] = cute.compile is first
out["wraps_real"] = getattr(first, "_real", None) is real
out["finders_after_two_installs"] = finders()
cute_diskcache.uninstall()
out["restored"] = cute.compile is real
cute_diskcache.uninstall()
out["restored_twice"] = cute.compile is real
out["finders_after_uninstall"] = finders()
cute_diskcache.install()
out["reinstalled"] = type(cute.compile).__name__ == "_Dispatch" and cute.compile._real is real
out["module_untouched"] = moe_dispatch.__dict__["cute"] is cute
out["file"] = cute_diskcache.__file__
print(json.dumps(out))
""",
    )
    assert venvs.full.owns(out["file"])
    assert out["loaded"] == []
    assert out["finders_before"] == 0 and out["before"] != "_Dispatch"
    assert out["after_install"] == "_Dispatch"
    assert out["same_dispatcher"] is True and out["wraps_real"] is True  # not double-wrapped
    assert out["finders_after_two_installs"] == 1
    assert out["restored"] is True and out["restored_twice"] is True
    assert out["finders_after_uninstall"] == 0
    assert out["reinstalled"] is True and out["module_untouched"] is True


def test_vllm_plugin_entry_point_honours_the_variable(venvs: Venvs) -> None:
    out = _report(
        venvs.full,
        venvs.workdir,
        _STARTUP_STATE
        + """
from importlib import metadata
eps = [ep for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == "cute_diskcache"]
out = {"n": len(eps), "value": eps[0].value, "dist": str(eps[0].dist.locate_file(""))}
register = eps[0].load()
"""
        + _FINDERS
        + """
register()
out["unset"] = [finders(), activation.installed()]
os.environ["FLASHINFER_B12X_DISK_CACHE"] = "0"
register()
out["zero"] = [finders(), activation.installed()]
os.environ["FLASHINFER_B12X_DISK_CACHE"] = "1"
register()
register()
out["set_twice"] = [finders(), activation.installed()]
out["flashinfer_imported"] = "flashinfer" in sys.modules
print(json.dumps(out))
""",
    )
    assert out["n"] == 1
    assert out["value"] == "cute_diskcache.vllm_plugin:register"
    assert venvs.full.owns(out["dist"]), f"entry point came from {out['dist']}"
    assert out["unset"] == [0, False]
    assert out["zero"] == [0, False]
    assert out["set_twice"] == [1, True]
    assert out["flashinfer_imported"] is False  # the plugin must not drag flashinfer in


def test_without_flashinfer_every_door_is_a_silent_no_op(venvs: Venvs) -> None:
    """Installed beside no flashinfer (and no torch): start-up, install(), the plugin all stay quiet."""
    proc = _run(
        venvs.isolated,
        venvs.workdir,
        _STARTUP_STATE
        + """
import importlib.util
import cute_diskcache
from cute_diskcache import vllm_plugin
out = {"loaded": loaded_at_start, "file": cute_diskcache.__file__, "has_flashinfer": importlib.util.find_spec("flashinfer") is not None}
cute_diskcache.install()
cute_diskcache.install()
vllm_plugin.register()
try:
    import flashinfer
except ModuleNotFoundError:
    out["import_error"] = "ModuleNotFoundError"
cute_diskcache.uninstall()
out["heavy"] = [m for m in ("torch", "flashinfer", "cutlass") if m in sys.modules]
print(json.dumps(out))
""",
        **{ENABLE_ENV: "1"},
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert venvs.isolated.owns(out["file"])
    assert out["has_flashinfer"] is False
    assert "cute_diskcache._bootstrap" in out["loaded"]  # the .pth did run...
    assert proc.stderr == ""  # ...and said nothing
    assert out["import_error"] == "ModuleNotFoundError"  # our finder does not mask the real error
    assert out["heavy"] == []
    quiet = _run(venvs.isolated, venvs.workdir, "pass", **{ENABLE_ENV: "1"})
    assert quiet.stderr == "" and quiet.stdout == ""


def test_console_script_is_installed(venvs: Venvs) -> None:
    script = venvs.full.root / "bin" / "cute-diskcache"
    assert script.is_file() and os.access(script, os.X_OK)
    assert "cute_diskcache.cli" in script.read_text()
    out = _report(
        venvs.full,
        venvs.workdir,
        """
import json
from importlib import metadata
eps = [ep for ep in metadata.entry_points(group="console_scripts") if ep.name == "cute-diskcache"]
print(json.dumps([[ep.value, str(ep.dist.locate_file(""))] for ep in eps]))
""",
    )
    assert len(out) == 1
    value, dist = out[0]
    assert value == "cute_diskcache.cli:console"
    assert venvs.full.owns(dist)


def test_a_failed_attach_is_said_once_per_process(monkeypatch: "pytest.MonkeyPatch", caplog: "pytest.LogCaptureFixture") -> None:
    """Attaching runs once per flashinfer module imported: a broken install (a module of ours
    missing) said "could not attach" for every one of them, 15 lines in one engine start."""
    import logging
    import types

    from cute_diskcache import activation, flashinfer_sites

    def broken(module: object) -> None:
        raise ModuleNotFoundError("No module named 'cute_diskcache.flashinfer_sites.offline'")

    monkeypatch.setattr(flashinfer_sites, "apply_profile", broken)
    monkeypatch.setattr(activation, "_attach_failure_said", False)
    with caplog.at_level(logging.DEBUG, logger="cute_diskcache"):
        for name in ("flashinfer", "flashinfer.fused_moe", "flashinfer.gemm"):
            activation._attach(types.ModuleType(name))
    said = [r for r in caplog.records if "could not attach to flashinfer" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
