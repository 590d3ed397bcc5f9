"""Shared fixtures for the integration tests: fresh probe processes and one warm cache per session.

Every integration test drives real flashinfer and the real CuTe DSL on the CPU, through the
``rtx-pro-6000`` target profile, in a fresh interpreter (``python -m cute_diskcache._probe``):
a warm start is only a warm start in a process that knows nothing. A real compile costs seconds,
so the run pays for one cold micro compile (:func:`warm_micro_root`) and tests that need a
populated cache copy that root into their own directory.

The suite runs on two pytest-xdist workers (setup.cfg). Session fixtures run once per worker
there, so the expensive ones build under a file lock in the run's shared directory
(:func:`once_per_run`) and the second worker reads what the first built. Tests that time
themselves against a bound (a lock's timeout, a remote's deadline, a lease) are marked
``serial``: they share one xdist group, so they run one after another, never beside each other,
while the other worker goes on with the rest. Their bounds are stated against the timeout and
what the defect would cost, not against a quiet machine, so they hold beside a compile or a
busy loop on every core. Modules with module-scoped fixtures stay on one worker, so a module's
set-up is paid once.

Real compiles are counted twice: by the package's own counters (what the probe prints) and,
independently, by a ``sitecustomize`` that this file puts on the child's ``PYTHONPATH``. It
counts calls of the DSL's ``CompileCallable._compile``, which every ``cute.compile`` goes
through, so "zero compiles" does not rest on the code under test counting itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import pytest
from timeline import pytest_fixture_setup, pytest_runtest_logreport  # noqa: F401  (hooks: CUTE_DISKCACHE_TEST_TIMELINE)

TARGET = "rtx-pro-6000"
#: One probe: interpreter + flashinfer import (~3 s) + compiles (~2 s micro, ~4.5 s dynamic).
PROBE_TIMEOUT_S = 300
#: Variables of ours in the parent that would leak into the child's behaviour.
_DROPPED_ENV = re.compile(r"^(CUTE_DISKCACHE_.*|FLASHINFER_B12X_DISK_CACHE|CUTE_DSL_ARCH)$")
_COUNT_LINE = re.compile(r"^cdc-test real compiles: (\d+)$", re.M)
#: What every serving process now says on its own (cute_diskcache.core.report): the attach line, one
#: WARNING per compile and the exit summary. run_probe hands them over apart (``cache_log``), so
#: ``stderr == ""`` keeps meaning "nothing unexpected was said".
REPORT_LINE = re.compile(r"^\[cute-diskcache\] (?:INFO attached: |WARNING compiling |INFO this process: |INFO this engine \().*$", re.M)
_OUR_LINE = re.compile(r"^\[cute-diskcache\] (DEBUG|INFO|WARNING|ERROR|CRITICAL) (.*)$")


def split_stderr(raw: str) -> tuple[str, list[str], int | None]:
    """A child's stderr as tests read it before the package had a handler of its own, its log
    lines, and the real compile count (None when the counter did not report).

    The first is stderr minus the counter line, minus our INFO/DEBUG lines and the report lines
    (:data:`REPORT_LINE`), with our WARNING/ERROR lines as bare messages (what Python's
    ``lastResort`` printed): ``stderr == ""`` keeps meaning "nothing unexpected was said", and
    a warning is matched by its text. The second holds every ``[cute-diskcache]`` line.
    """
    counted = _COUNT_LINE.findall(raw)
    kept: list[str] = []
    ours: list[str] = []
    for line in _COUNT_LINE.sub("", raw).splitlines():
        m = _OUR_LINE.match(line)
        if m is None:
            kept.append(line)
            continue
        ours.append(line)
        if m.group(1) in ("WARNING", "ERROR", "CRITICAL") and not REPORT_LINE.match(line):
            kept.append(m.group(2))
    return "\n".join(kept).strip(), ours, int(counted[-1]) if counted else None


#: The child-side counter. The DSL is imported late (by flashinfer, after the target profile
#: set CUTE_DSL_ARCH), so patch its compiler class when it gets imported, never earlier.
_SITECUSTOMIZE = '''
import atexit, importlib.abc, importlib.util, sys

_MODULE = "cutlass.base_dsl.compiler"
_state = {"count": 0, "depth": 0}


def _instrument(module):
    cls = getattr(module, "CompileCallable", None)
    real = getattr(cls, "_compile", None)
    if real is None:  # another DSL layout: report nothing, and the tests say "None != 0"
        return
    atexit.register(lambda: sys.stderr.write("cdc-test real compiles: %d\\n" % _state["count"]))

    def _compile(self, *args, **kwargs):
        # Counted when it returns: a call that raises lowered nothing. The second-stage key's
        # trace (cute_diskcache.keys.trace) enters here too and stops by raising after tracing.
        _state["depth"] += 1
        try:
            result = real(self, *args, **kwargs)
            if _state["depth"] == 1:
                _state["count"] += 1
            return result
        finally:
            _state["depth"] -= 1

    cls._compile = _compile


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _instrument(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


@pytest.fixture
def isolated_stats(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No setting of ours from the parent's environment, and this process's statistics unbound
    and zeroed before and after (the files that count them use it with ``usefixtures``)."""
    from cute_diskcache.storage import stats

    for name in list(os.environ):
        if name.startswith("CUTE_DISKCACHE_"):
            monkeypatch.delenv(name)
    stats.reset_for_tests()
    stats.bind(None)
    yield
    stats.reset_for_tests()
    stats.bind(None)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "slow: compiles static/dynamic kernels for real (seconds each); CI still runs them, "
        "deselect with -m 'not slow' for a quick loop",
    )
    config.addinivalue_line(
        "markers",
        "serial: times itself against a bound (lock timeout, remote deadline, lease): one xdist group, so these run "
        "one after another, never beside each other; the other worker keeps running, so the bounds must hold under load",
    )


# --------------------------------------------------------------------------------------------
# Two workers (pytest-xdist, --dist loadgroup in setup.cfg)
# --------------------------------------------------------------------------------------------

#: The xdist group of the tests marked ``serial``.
SERIAL_GROUP = "serial"


def _module_scoped(item: pytest.Item) -> bool:
    """Whether the test uses a fixture set up once per module or class (its module's set-up)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope in ("module", "class", "package") for seq in defs for d in seq)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One xdist group per test: ``serial`` ones together; a module with module-scoped set-up on one worker.

    Under loadgroup every other test goes wherever a worker is free. xdist joins the names of
    several ``xdist_group`` marks into a new group, so the group is set here, once, and
    nowhere else (runs before xdist turns the mark into the node id's ``@group``).
    """
    for item in items:
        if item.get_closest_marker("serial") is not None:
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))
        elif _module_scoped(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def _run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory every worker of this run shares (the session's basetemp without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]) -> tuple[Path, Any]:
    """``build(directory)`` once per test run, whatever the number of workers; its JSON result.

    Session fixtures run once per xdist worker: the first worker to get here builds, under a
    file lock in the run's shared directory; the other waits and reads the result. A build that
    raises leaves nothing marked done, so the next caller tries again (and fails the same way).
    """
    from filelock import FileLock

    shared = _run_dir(tmp_path_factory) / f"once-{name}"
    done = shared / "once-done.json"
    with FileLock(f"{shared}.lock"):
        if not done.is_file():
            shutil.rmtree(shared, ignore_errors=True)
            shared.mkdir(parents=True)
            done.write_text(json.dumps(build(shared)))
    return shared, json.loads(done.read_text())


class Warm(NamedTuple):
    """A cache root populated by one cold probe, and what that probe printed."""

    root: Path
    cold: dict[str, Any]


ProbeFn = Callable[..., dict[str, Any]]


def child_env(root: Path | str, extra_env: Mapping[str, str] | None, hook_dir: Path) -> dict[str, str]:
    """The parent's environment minus our knobs, pointed at ``root``, with the compile counter."""
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env["CUTE_DISKCACHE_DIR"] = str(root)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook_dir), env.get("PYTHONPATH", "")) if p)
    env.update(extra_env or {})
    return env


def run_probe(
    hook_dir: Path,
    root: Path | str,
    *ms: int,
    extra_env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    prefix: Sequence[str] = (),
    preexec_fn: Callable[[], None] | None = None,
    timeout: float = PROBE_TIMEOUT_S,
) -> dict[str, Any]:
    """Run one fresh probe process and return its JSON report.

    Three keys are added to what the probe prints: ``stderr`` (the child's log output: its
    warnings land there; see :func:`split_stderr`), ``cache_log`` (every ``[cute-diskcache]``
    line) and ``real_compiles`` (the independent count, None if the child died
    before reporting it). ``prefix`` runs the probe under another command (``unshare ...``).
    A non-zero exit fails the test with the child's stderr: a crash is never an expected result.
    """
    cmd = [*prefix, sys.executable, "-m", "cute_diskcache._probe", "--target", TARGET, "--m", *map(str, ms or (1,)), *args]
    proc = subprocess.run(
        cmd,
        env=child_env(root, extra_env, hook_dir),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
        cwd=hook_dir,  # a neutral cwd: nothing in the working directory shadows an import
    )
    if proc.returncode != 0:
        pytest.fail(f"probe exited {proc.returncode}: {' '.join(cmd)}\n--- stderr ---\n{proc.stderr[-6000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        pytest.fail(f"probe printed no JSON\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    out["stderr"], out["cache_log"], out["real_compiles"] = split_stderr(proc.stderr)
    return out


@pytest.fixture(scope="session")
def compile_hook_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the compile-counting ``sitecustomize`` for the children."""
    d = tmp_path_factory.mktemp("compile-hook")
    (d / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return d


@pytest.fixture(scope="session")
def probe(compile_hook_dir: Path) -> ProbeFn:
    """``probe(root, *ms, extra_env=None, args=(), prefix=(), preexec_fn=None)`` -> report dict."""

    def _probe(root: Path | str, *ms: int, **kwargs: Any) -> dict[str, Any]:
        return run_probe(compile_hook_dir, root, *ms, **kwargs)

    return _probe


@pytest.fixture(scope="session")
def warm_micro_root(tmp_path_factory: pytest.TempPathFactory, probe: ProbeFn) -> Warm:
    """One real cold micro compile (m=1) for the whole run, both workers. Never modify it: copy it."""
    shared, cold = once_per_run(tmp_path_factory, "warm-micro", lambda d: probe(d / "root", 1))
    return Warm(shared / "root", cold)


@pytest.fixture(scope="session")
def warm_large_root(tmp_path_factory: pytest.TempPathFactory, probe: ProbeFn) -> Warm:
    """One cold probe compiling a static (m=16) and the dynamic (m=128) kernel, once per run. Copy, don't modify."""
    shared, cold = once_per_run(tmp_path_factory, "warm-large", lambda d: probe(d / "root", 16, 128))
    return Warm(shared / "root", cold)


@pytest.fixture
def micro_copy(warm_micro_root: Warm, tmp_path: Path) -> Iterator[Warm]:
    """A private copy of the warm micro root, for tests that damage or observe it."""
    root = tmp_path / "copied-root"
    shutil.copytree(warm_micro_root.root, root)
    yield Warm(root, warm_micro_root.cold)


def manifests(root: Path) -> list[Path]:
    """Every committed entry's manifest under ``root`` (layout v1/<ns>/<xx>/<digest>/)."""
    return sorted(Path(root).glob("v1/*/*/*/manifest.msgpack"))


@pytest.fixture(scope="session")
def list_manifests() -> Callable[[Path], list[Path]]:
    """:func:`manifests` for test modules (conftest is not importable under every import mode)."""
    return manifests
