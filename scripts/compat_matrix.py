#!/usr/bin/env python3
"""The flashinfer x nvidia-cutlass-dsl compatibility matrix: which releases cute-diskcache is proven on.

For each cell (one flashinfer release, one DSL release) a venv is built under a scratch
directory (outside the checkout), holding that flashinfer and DSL on top of a shared base venv
(torch 2.13.0 CPU, triton, numpy: installed once, found through a ``.pth`` file, so no CUDA
torch is ever downloaded). This checkout is put on the cell's ``PYTHONPATH``. Then, each in a
fresh process of the cell's interpreter, for the ``rtx-pro-6000`` profile (sm_120a, no GPU):

1. ``doctor --json`` and ``doctor --strict``: the site table of that release, who covers what;
2. a cold "engine start" (``scripts/compat_child.py``): one real compile through flashinfer's own
   dispatch for each covered site kind the release has (micro, static, dynamic; on >= 0.6.18
   the direct micro kernel; where present an fp8 op and the nvfp4 W4A4 runner);
3. a warm start, fresh process, same cache: it must make 0 compiles (counted at the DSL's
   ``CompileCallable._compile``), hit every site with the cold run's digests, and present the
   same ABI text (the kernel signature a CPU launch spells out);
4. ``prewarm --dry-run`` for ``qwen3-30b-a3b --max-num-tokens 256``: how many kernels per kind.

A cell is **proven** when 3 holds for every site; **refused** when cute-diskcache declines the
combination (one log line, see ``cute_diskcache/flashinfer_sites/compat.py``) because the DSL
cannot compile that release's kernels (the DSL's own error is recorded); anything else is
**failed**, a bug. One JSON per cell goes to ``compat/cells/``, the table to ``compat/README.md``,
and the versions table of docs/versions.md is generated from them (``--readme``).

    python scripts/compat_matrix.py                       # every cell (hours on 2 cores)
    python scripts/compat_matrix.py --cells ci            # the subset CI runs
    python scripts/compat_matrix.py --cells fi0.7.4-dsl4.8.0 --scratch /tmp/compat
    python scripts/compat_matrix.py --table-only --readme # regenerate tables from compat/cells/
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Iterator

log = logging.getLogger("compat_matrix")

REPO = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "compat_child.py"
RESULTS = REPO / "compat"
TARGET = "rtx-pro-6000"
#: torch is pinned in every pip call: any other spec makes pip download a multi-GB CUDA build.
TORCH = "torch==2.13.0"
#: What every cell shares, installed once into the base venv.
BASE_PACKAGES = (TORCH, "triton", "numpy", "msgpack", "platformdirs", "tqdm", "huggingface_hub", "filelock")
STEP_TIMEOUT_S = 1800
#: Where venvs go unless told otherwise; tests/_compat.py uses the same, so CI and a full run share them.
DEFAULT_SCRATCH = Path(os.environ.get("CUTE_DISKCACHE_COMPAT_SCRATCH") or Path.home() / ".cache" / "cute-diskcache" / "compat")
#: Variables of ours (or the DSL's arch) in the caller's environment that would steer a child.
_DROPPED_ENV = re.compile(r"^(CUTE_DISKCACHE_.*|FLASHINFER_B12X_DISK_CACHE|CUTE_DSL_ARCH|FLASHINFER_CUTE_DSL_DISABLE_CACHE|"
                          r"PYTHONPATH|PYTHONHOME|PYTHONSTARTUP|FLASHINFER_WORKSPACE_.*)$")

#: doctor's (file, function) of a covered site -> the child's site name, its manifest site name
#: and the kernel kind flashinfer's in-memory cache gains (None: not tracked there).
CHILD_SITES = {
    "moe_dispatch.py:_get_micro_kernel": ("micro", "flashinfer.moe_dispatch.micro", "micro"),
    "moe_dispatch.py:_get_static_kernel": ("static", "flashinfer.moe_dispatch.static", "static"),
    "moe_dispatch.py:_get_dynamic_kernel": ("dynamic", "flashinfer.moe_dispatch.dynamic", "dynamic"),
    "moe_direct_micro_kernel.py:compile_direct_micro_kernel": ("direct_micro", "flashinfer.moe_direct_micro_kernel.direct_micro", "direct_micro"),
    "moe_fp8_gemm.py:compiled_kernel": ("fp8_gemm", "flashinfer.moe_fp8_gemm.fp8_gemm", None),
    "moe_nvfp4_w4a4.py:run_moe_w4a4": ("w4a4", "flashinfer.moe_nvfp4_w4a4.w4a4", None),
    # Inline sites of 0.6.12-0.6.17 (issue 22): driven through flashinfer's own compile functions.
    "moe_w4a16_kernel.py:compile_w4a16_gemm": ("w4a16_gemm", "flashinfer.moe_w4a16_compiler.w4a16", None),
    "moe_w4a16_kernel.py:compile_w4a16_fused_moe": ("w4a16_fused_moe", "flashinfer.moe_w4a16_compiler.w4a16", None),
    "moe_w4a16_kernel.py:compile_w4a16_activation": ("w4a16_activation", "flashinfer.moe_w4a16_compiler.w4a16", None),
    "moe_w4a16_kernel.py:compile_w4a16_topk_sum": ("w4a16_topk_sum", "flashinfer.moe_w4a16_compiler.w4a16", None),
    "gemm/kernels/dense_blockscaled_gemm_sm120_b12x.py:_get_compiled_dense_gemm": ("b12x_dense_gemm", "flashinfer.gemm.b12x_dense_gemm", None),
}
SITE_ORDER = [v[0] for v in CHILD_SITES.values()]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One flashinfer release with one DSL release (``cu13``: the DSL's ``[cu13]`` extra)."""

    flashinfer: str
    dsl: str
    cu13: bool = False
    roles: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"fi{self.flashinfer}-dsl{self.dsl}{'-cu13' if self.cu13 else ''}"

    @property
    def dsl_label(self) -> str:
        return f"{self.dsl}{' [cu13]' if self.cu13 else ''}"

    def requirements(self) -> list[str]:
        return [f"flashinfer-python=={self.flashinfer}", f"nvidia-cutlass-dsl{'[cu13]' if self.cu13 else ''}=={self.dsl}"]


OLDEST, WORKING, NEWEST, SEED, SGLANG, VLLM = ("oldest DSL allowed", "oldest DSL that works", "DSL 4.8.1", "seed stack",
                                               "SGLang 0.5.23 pin", "vLLM 0.34.0 pin (0.7.3)")
#: Releases on the package index that carry the sm12x MoE code, and the lowest DSL each one's
#: metadata allows (0.6.12-0.6.17: >=4.5.0; 0.6.18-0.7.2.post1: >=4.6.2a0; 0.7.4: >=4.8.0).
RELEASES = {
    "0.6.12": "4.5.0", "0.6.13": "4.5.0", "0.6.14": "4.5.0", "0.6.15.post1": "4.5.0", "0.6.16.post4": "4.5.0",
    "0.6.17": "4.5.0", "0.6.18.post1": "4.6.2", "0.7.0.post1": "4.6.2", "0.7.1": "4.6.2", "0.7.2.post1": "4.6.2",
    "0.7.4": "4.8.0",
}
#: Where the lowest DSL the metadata allows cannot work (a refused cell), the oldest that does.
#: 0.7.1 and later import cutlass.experimental (DSL 4.7+); 4.5 needs its cu13 libs (added below).
OLDEST_WORKING = {"0.7.1": "4.7.0", "0.7.2.post1": "4.7.0"}


def _cells() -> list[Cell]:
    cells: dict[str, Cell] = {}

    def add(fi: str, dsl: str, cu13: bool = False, *roles: str) -> None:
        cell = Cell(fi, dsl, cu13)
        old = cells.get(cell.name)
        cells[cell.name] = dataclasses.replace(cell, roles=tuple(dict.fromkeys((old.roles if old else ()) + roles)))

    for fi, lowest in RELEASES.items():
        if lowest == "4.5.0":
            # DSL 4.5.0 as its metadata installs it (libs-base only), and with its cu13 libs.
            add(fi, lowest, False, OLDEST)
            add(fi, lowest, True, OLDEST)
        else:
            add(fi, lowest, False, OLDEST)
        if fi in OLDEST_WORKING:
            add(fi, OLDEST_WORKING[fi], False, WORKING)
        add(fi, "4.8.1", False, NEWEST)
    for fi in ("0.6.12", "0.6.13"):  # the stacks the report this project answers was measured on
        add(fi, "4.5.0", False, SEED)
        add(fi, "4.5.0", True, SEED)
        add(fi, "4.6.0", False, SEED)
    add("0.7.2", "4.8.0", False, SGLANG)
    add("0.7.2.post1", "4.8.0", False, VLLM)  # 0.7.3 is not on the index: the two releases around it
    add("0.7.4", "4.8.0", False, VLLM)
    return sorted(cells.values(), key=lambda c: (_vkey(c.flashinfer), _vkey(c.dsl), c.cu13))


def _vkey(version: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.]", version.replace("post", "")))


CELLS = _cells()
#: What CI runs (tests/test_compat.py): the oldest generation on the seed stack's cu13 DSL
#: (one micro compile: DSL 4.5.0 compiles take ~20-40 s each here), the first release whose
#: static/micro/dynamic kernels flashinfer caches natively, and the release beside vLLM's 0.7.3
#: with vLLM's DSL.
CI_CELLS = ("fi0.6.12-dsl4.5.0-cu13", "fi0.6.18.post1-dsl4.8.1", "fi0.7.2.post1-dsl4.8.0")


# --------------------------------------------------------------------------------------------
# Venvs
# --------------------------------------------------------------------------------------------


def _purelib(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         check=True, capture_output=True, text=True, timeout=120)
    return Path(out.stdout.strip())


def _pip(python: Path, *args: str, constraints: Path) -> None:
    """Run this interpreter's pip against ``python``'s environment, torch pinned."""
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-input", "--disable-pip-version-check",
           "-c", str(constraints), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"pip failed ({' '.join(args)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _constraints(scratch: Path) -> Path:
    """The torch pin as a constraints file, replaced atomically: a pip reading it while another
    process rewrites it must never see it empty (an open torch spec pulls a multi-GB CUDA build)."""
    path = scratch / "constraints.txt"
    if not path.is_file() or path.read_text() != f"{TORCH}\n":
        scratch.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".constraints.{os.getpid()}.tmp")
        tmp.write_text(f"{TORCH}\n")
        os.replace(tmp, path)
    return path


@contextlib.contextmanager
def building(venv: Path) -> Iterator[None]:
    """Hold ``<venv>.lock`` (flock) while a venv is checked and built.

    The test suite runs on two workers and several test modules want the same venvs: one
    builds, the other waits and then finds the stamp. flock, so the shell scripts
    (make_b12x_venv.sh reads a cell) take the same lock with flock(1). Not reentrant: never
    nest two calls for one venv.
    """
    venv.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{venv}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def base_venv(scratch: Path) -> Path:
    """The shared venv with torch 2.13.0 (CPU), triton and the small deps; built once."""
    venv = scratch / "base"
    stamp = venv / "compat-base.json"
    with building(venv):
        if stamp.is_file() and json.loads(stamp.read_text()) == list(BASE_PACKAGES):
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
        _pip(venv / "bin" / "python", *BASE_PACKAGES, constraints=_constraints(scratch))
        stamp.write_text(json.dumps(list(BASE_PACKAGES)))
        return venv


def cell_venv(cell: Cell, scratch: Path) -> Path:
    """The cell's interpreter: its flashinfer and DSL over the base venv (reused when complete)."""
    base = base_venv(scratch)
    venv = scratch / "cells" / cell.name
    python = venv / "bin" / "python"
    stamp = venv / "compat-cell.json"
    with building(venv):
        if stamp.is_file() and json.loads(stamp.read_text()) == cell.requirements():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
        # Lowest priority on sys.path: the cell's own packages shadow the base's.
        (_purelib(python) / "zz_compat_base.pth").write_text(f"{_purelib(base / 'bin' / 'python')}\n")
        _pip(python, *cell.requirements(), constraints=_constraints(scratch))
        stamp.write_text(json.dumps(cell.requirements()))
        return python


#: vLLM as its newest release ships it. Its wheel requires torch==2.14.0 (a CUDA build here), so
#: it goes in with --no-deps, plus what its plugin loader and its fused-MoE experts module import
#: on a CPU box (found by importing them), at the versions vLLM itself requires; quack-kernels
#: builds the fake tensors of vLLM's own skinny GEMM compile (:mod:`cute_diskcache.vllm_sites`).
VLLM = "vllm==0.34.0"
VLLM_IMPORTS = ("numpy", "packaging", "msgspec", "huggingface-hub", "psutil", "pyzmq", "regex", "pydantic", "transformers",
                "aiohttp", "requests", "pillow", "pybase64", "cachetools", "cbor2", "cloudpickle", "uvloop", "py-cpuinfo",
                "prometheus-client", "llguidance", "xgrammar", "quack-kernels")
#: The flashinfer its b12x experts build the wrapper from (vLLM pins 0.7.3, not on the index;
#: 0.7.4 is the release after it) and the DSL vLLM pins.
VLLM_FLASHINFER = ("flashinfer-python==0.7.4", "nvidia-cutlass-dsl[cu13]==4.8.0")


def _vllm_requirements(python: Path) -> list[str]:
    """``VLLM_IMPORTS`` with the specifiers from vLLM's own metadata (markers evaluated here)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    out = subprocess.run([str(python), "-c", "import importlib.metadata as m, json; print(json.dumps(m.requires('vllm')))"],
                         check=True, capture_output=True, text=True, timeout=120)
    declared: dict[str, str] = {}
    for text in json.loads(out.stdout):
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            declared[canonicalize_name(req.name)] = f"{req.name}{req.specifier}"
    return [declared.get(canonicalize_name(name), name) for name in VLLM_IMPORTS]


def vllm_venv(scratch: Path) -> Path:
    """A venv with real vLLM 0.34.0 code (no CUDA torch), flashinfer 0.7.4 and vLLM's DSL pin."""
    base = base_venv(scratch)
    venv = scratch / "vllm"
    python = venv / "bin" / "python"
    stamp = venv / "compat-vllm.json"
    wanted = [VLLM, *VLLM_IMPORTS, *VLLM_FLASHINFER]
    with building(venv):
        if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
            return python
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
        (_purelib(python) / "zz_compat_base.pth").write_text(f"{_purelib(base / 'bin' / 'python')}\n")
        constraints = _constraints(scratch)
        _pip(python, "--no-deps", VLLM, constraints=constraints)
        _pip(python, *_vllm_requirements(python), *VLLM_FLASHINFER, constraints=constraints)
        stamp.write_text(json.dumps(wanted))
        return python


def install_checkout_wheel(python: Path, code: Path, workdir: Path) -> Path:
    """Build this checkout's wheel (as ``pip install .`` would) and install it, deps untouched."""
    dist = workdir / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist),
                    str(code)], check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = dist.glob("cute_diskcache-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--force-reinstall",
                    "--no-index", str(wheel)], check=True, capture_output=True, text=True, timeout=600)
    return wheel


def installed_versions(python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json\n"
            "names = sorted({(d.metadata['Name'] or '').lower().replace('_', '-') for d in m.distributions()})\n"
            "keep = [n for n in names if n.startswith(('flashinfer', 'nvidia-cutlass-dsl', 'apache-tvm-ffi', 'torch', 'triton', 'cuda-python'))]\n"
            "print(json.dumps({n: m.version(n) for n in keep}))")
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout)


# --------------------------------------------------------------------------------------------
# Running a cell
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """Where one cell runs: its interpreter, the code under test, a cache root and a workspace."""

    python: Path
    code: Path
    workdir: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
        env.update(PYTHONPATH=str(self.code), CUTE_DISKCACHE_DIR=str(self.workdir / "root"),
                   FLASHINFER_WORKSPACE_BASE=str(self.workdir / "workspace"), **extra)
        return env

    def run(self, *args: str, timeout: float = STEP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        cwd = self.workdir / "cwd"  # neutral: nothing there shadows an import
        cwd.mkdir(parents=True, exist_ok=True)
        return subprocess.run([str(self.python), *args], env=self.env(), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _json_line(proc: subprocess.CompletedProcess[str]) -> dict[str, Any] | None:
    text = proc.stdout.strip()
    if text.startswith("{") and text.endswith("}"):
        try:
            return json.loads(text)  # pretty-printed (prewarm --json, doctor --json)
        except ValueError:
            pass
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def _first_error_line(text: str) -> str:
    """The line of a DSL failure worth quoting (ptxas, a DSL error class), else the last one."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pattern in (r"ptxas.*error", r"ptxas", r"(DSL|Compilation|Runtime)Error", r"Error"):
        for ln in lines:
            if re.search(pattern, ln):
                return ln[:400]
    return lines[-1][:400] if lines else ""


def run_doctor(run: Run) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], int]:
    """``doctor --json`` in a cell (the process, its report) and ``doctor --strict``'s exit code."""
    proc = run.run("-m", "cute_diskcache.cli.doctor", "--json", timeout=300)
    strict = run.run("-m", "cute_diskcache.cli.doctor", "--strict", timeout=300)
    return proc, _json_line(proc) or {}, strict.returncode


def doctor(run: Run) -> dict[str, Any]:
    t = time.perf_counter()
    proc, report, rc_strict = run_doctor(run)
    return {
        "rc_strict": rc_strict,
        "refused": report.get("refused"),
        "refused_evidence": report.get("refused_evidence"),
        "summary": report.get("summary"),
        "verified": report.get("verified"),
        "generation": report.get("generation"),
        "site_checks_failed": sorted(site for site, problems in (report.get("site_checks") or {}).items() if problems),
        "missing_adapter_sites": report.get("missing_adapter_sites"),
        "covered": sorted(f"{s['file']}:{s['function']}" for s in report.get("sites", []) if s["status"] == "cute-diskcache"),
        # What --strict judges: the sm12x sites (test code shipped in the wheel apart) nobody persists.
        "nothing": sorted(f"{s['file']}:{s['function']}" for s in report.get("sites", [])
                          if s["status"] == "nothing" and s.get("arch", "sm12x") == "sm12x" and not s.get("harness")),
        "error": None if report else (proc.stderr[-2000:] or "no report"),
        "seconds": round(time.perf_counter() - t, 1),
    }


def sites_to_drive(doctor_report: dict[str, Any]) -> list[str]:
    covered = set(doctor_report.get("covered") or [])
    return [site for key, (site, _, _) in CHILD_SITES.items() if key in covered]


def child(run: Run, sites: list[str]) -> dict[str, Any]:
    t = time.perf_counter()
    proc = run.run(str(CHILD), "--target", TARGET, "--results", *sites)
    out = _json_line(proc) or {"error": f"exit {proc.returncode}: {_first_error_line(proc.stderr)}", "sites": {}}
    out["rc"] = proc.returncode
    out["wall_seconds"] = round(time.perf_counter() - t, 1)
    # Our one-line messages (refusals, unverified sites), as the operator would see them.
    out["log"] = [ln for ln in proc.stderr.splitlines() if "cute-diskcache" in ln or "cute_diskcache" in ln][-20:]
    return out


def prewarm_plan(run: Run) -> dict[str, Any]:
    t = time.perf_counter()
    proc = run.run("-m", "cute_diskcache.prewarm", "--model", "qwen3-30b-a3b", "--max-num-tokens", "256",
                   "--target", TARGET, "--dry-run", "--json")
    plan = _json_line(proc) or {}
    return {
        "rc": proc.returncode,
        "kernels": plan.get("kernels"),
        "by_kind": plan.get("by_kind"),
        "already_cached": plan.get("already_cached"),
        "error": None if proc.returncode == 0 else _first_error_line(proc.stderr),
        "seconds": round(time.perf_counter() - t, 1),
    }


#: Attributes in which the DSL's own reloaded CuTe-ABI kernel may differ from the compiled one
#: (``cute_diskcache.core.as_compiled.LOADER_FACTS``: how it was loaded), spelled here so the matrix
#: runs against checkouts that predate it.
LOADER_FACTS = ("engine", "load_from_binary", "prefix")


def result_differences(cold: list[dict[str, Any]] | None, warm: list[dict[str, Any]] | None) -> list[str]:
    """How what a warm process's flashinfer got differs from what a cold compile gave it
    (``compat_child.result_summary``, per kernel in order); [] when it is the same. A CuTe-ABI
    kernel (no tvm-ffi) may differ in :data:`LOADER_FACTS` alone."""
    if cold is None or warm is None:
        return [] if cold == warm else ["no result summary"]
    if len(cold) != len(warm):
        return [f"{len(cold)} kernels cold, {len(warm)} warm"]
    out = []
    for c, w in zip(cold, warm, strict=True):
        if c["classes"] != w["classes"]:
            out.append(f"classes {c['classes'][:1]} -> {w['classes'][:1]}")
        tvm_ffi = any("TVMFFI" in cls for cls in c["classes"])
        for name in sorted(set(c["public"]) | set(w["public"])):
            if c["public"].get(name) != w["public"].get(name) and (tvm_ffi or name not in LOADER_FACTS):
                out.append(f"{name}: {str(c['public'].get(name))[:80]} -> {str(w['public'].get(name))[:80]}")
        for part in ("signature", "export", "keywords"):
            if c.get(part) != w.get(part):
                out.append(f"{part}: {str(c.get(part))[:80]} -> {str(w.get(part))[:80]}")
    return out


def judge(sites: list[str], cold: dict[str, Any], warm: dict[str, Any] | None) -> tuple[str, str, dict[str, Any]]:
    """(status, reason, per-site verdicts) from a cold and a warm child report."""
    manifest_site = {v[0]: v[1] for v in CHILD_SITES.values()}
    kind_of = {v[0]: v[2] for v in CHILD_SITES.values()}
    refusal = next((ln for ln in cold.get("log", []) if "refuses" in ln), None)
    per: dict[str, Any] = {}
    problems: list[str] = []
    compile_errors: list[str] = []
    for site in sites:
        c = cold.get("sites", {}).get(site, {})
        w = (warm or {}).get("sites", {}).get(site, {})
        cold_events = [e for e in c.get("events", []) if e[0] == manifest_site[site]]
        verdict: dict[str, Any] = {
            "cold_seconds": c.get("seconds"),
            "kinds": c.get("kinds"),
            "cold": [e[2] for e in cold_events],
            "warm": [e[2] for e in w.get("events", []) if e[0] == manifest_site[site]],
            "warm_real_compiles": w.get("real_compiles"),
            "abi_same": bool(c.get("abi")) and c.get("abi") == w.get("abi"),
            "same_result": not result_differences(c.get("results"), w.get("results")) if warm is not None else None,
            "abi": (c.get("abi") or "")[:300],
        }
        if not cold_events:
            error = c.get("error") or "no cache event"
            if c.get("raised") or "when calling" not in error:
                compile_errors.append(f"{site}: {_first_error_line(error)}")
            verdict["error"] = _first_error_line(error)
            problems.append(f"{site}: not compiled through the cache ({verdict['error']})")
        elif kind_of[site] and (c.get("kinds") or {}).get(kind_of[site]) != 1:
            problems.append(f"{site}: flashinfer built {c.get('kinds')}, not one {kind_of[site]} kernel")
        elif warm is None:
            problems.append(f"{site}: no warm run")
        elif verdict["warm"] != ["hit"] * len(cold_events) or verdict["warm_real_compiles"] != 0:
            problems.append(f"{site}: warm start {verdict['warm']} with {verdict['warm_real_compiles']} compiles")
        elif [e[1] for e in w["events"] if e[0] == manifest_site[site]] != [e[1] for e in cold_events]:
            problems.append(f"{site}: warm digests differ from cold")
        elif not verdict["abi_same"]:
            problems.append(f"{site}: ABI text differs (cold {c.get('abi')!r:.120} warm {w.get('abi')!r:.120})")
        elif result_differences(c.get("results"), w.get("results")):
            problems.append(f"{site}: a hit hands flashinfer another object: {'; '.join(result_differences(c.get('results'), w.get('results'))[:3])}")
        per[site] = verdict
    if refusal is not None:
        return "refused", refusal.split("cute-diskcache", 1)[-1].strip(" :") + (f" [{compile_errors[0]}]" if compile_errors else ""), per
    if not problems and warm is not None and warm.get("real_compiles") == 0:
        return "proven", f"{len(sites)} sites: fresh process 0 compiles, same digests and ABI", per
    if not problems:
        problems.append(f"warm start made {warm and warm.get('real_compiles')} real compiles")
    return "failed", "; ".join(problems), per


def run_cell(cell: Cell, scratch: Path, code: Path = REPO, *, prewarm: bool = True, sites: list[str] | None = None,
             workdir: Path | None = None) -> dict[str, Any]:
    """Build (or reuse) the cell's venv and prove it; returns the cell's result record.

    ``sites``: drive only these (default: every covered site kind the release has).
    ``workdir``: where the cache root and flashinfer's workspace go (default under ``scratch``).
    """
    t0 = time.perf_counter()
    python = cell_venv(cell, scratch)
    venv_s = time.perf_counter() - t0
    workdir = workdir or scratch / "runs" / cell.name
    shutil.rmtree(workdir, ignore_errors=True)
    run = Run(python, code, workdir)
    result: dict[str, Any] = {
        "cell": cell.name, "flashinfer": cell.flashinfer, "dsl": cell.dsl, "cu13": cell.cu13, "roles": list(cell.roles),
        "installed": installed_versions(python),
    }
    result["doctor"] = doctor(run)
    sites = sites if sites is not None else sites_to_drive(result["doctor"])
    if result["doctor"].get("refused"):
        # flashinfer runs it uncached; the site the refusal names records the DSL's own error
        evidence = result["doctor"].get("refused_evidence")
        sites = [evidence] if evidence in sites else sites[:1]
    result["sites_driven"] = sites
    cold = child(run, sites)
    refused = any("refuses" in ln for ln in cold.get("log", []))
    compiled = any(v.get("events") for v in cold.get("sites", {}).values())
    warm = child(run, sites) if compiled and not refused and not cold.get("rc") else None
    status, reason, per_site = judge(sites, cold, warm)
    result.update(status=status, reason=reason, sites=per_site)
    result["cold"] = {k: cold.get(k) for k in ("real_compiles", "counters", "wall_seconds", "import_seconds", "dsl", "log", "error", "rc")}
    result["warm"] = None if warm is None else {k: warm.get(k) for k in ("real_compiles", "counters", "wall_seconds", "import_seconds", "log", "rc")}
    result["prewarm"] = prewarm_plan(run) if prewarm else None
    result["seconds"] = {"venv": round(venv_s, 1), "total": round(time.perf_counter() - t0, 1)}
    result["machine"] = machine()
    result["code"] = code_version(code)
    result["date"] = datetime.date.today().isoformat()
    return result


def machine() -> str:
    model = ""
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"{os.cpu_count()} cores {model} {platform.machine()}, no GPU".replace("  ", " ")


def code_version(code: Path) -> str:
    proc = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    rev = proc.stdout.strip() if proc.returncode == 0 else (code / "COMMIT").read_text().strip() if (code / "COMMIT").is_file() else "?"
    return rev


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def load_results(results: Path = RESULTS) -> list[dict[str, Any]]:
    out = [json.loads(p.read_text()) for p in sorted((results / "cells").glob("*.json"))]
    order = {c.name: i for i, c in enumerate(CELLS)}
    return sorted(out, key=lambda r: order.get(r["cell"], len(order)))


def _dsl_label(r: dict[str, Any]) -> str:
    """``4.5.0 [cu13]``; a DSL installed without any CUDA libs flavour says so."""
    installed = r.get("installed") or {}
    bare = not any(name in installed for name in ("nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13"))
    return f"{r['dsl']}{' [cu13]' if r['cu13'] else ''}{' (libs-base only)' if installed and bare else ''}"


def _plan_text(plan: dict[str, Any] | None, refused: bool) -> str:
    if not plan or plan.get("by_kind") is None:
        return "-" if not plan else f"exit {plan.get('rc')}" + (" (refused)" if refused else f": {plan.get('error')}")
    return f"{plan['kernels']} (" + ", ".join(f"{n} {k}" for k, n in plan["by_kind"].items()) + ")"


def _sites_text(r: dict[str, Any]) -> str:
    parts = []
    for site in SITE_ORDER:
        v = r.get("sites", {}).get(site)
        if v is None:
            continue
        ok = v.get("warm") and set(v["warm"]) == {"hit"} and v.get("warm_real_compiles") == 0 and v.get("abi_same")
        seconds = f" {v['cold_seconds']:.0f}s" if isinstance(v.get("cold_seconds"), (int, float)) and ok else ""
        parts.append(f"{site}{seconds}" if ok else f"~~{site}~~")
    return ", ".join(parts) or "-"


def table(results: list[dict[str, Any]]) -> str:
    """The matrix as markdown: one row per cell."""
    rows = ["| flashinfer | DSL | why this cell | status | sites (cold compile; fresh process: 0 compiles, same ABI) | "
            "prewarm plan, qwen3-30b-a3b, 256 tokens | doctor --strict | note |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        d = r.get("doctor") or {}
        listed = d.get("nothing") or []
        nothing = (", ".join(s.split(":", 1)[1] for s in listed) if len(listed) <= 6
                   else f"{len(listed)} sm12x sites (listed in cells/{r['cell']}.json)")
        strict = "pass" if d.get("rc_strict") == 0 else f"exit {d.get('rc_strict')}" + (
            " (refused)" if d.get("refused") else f": nothing persists {nothing}" if nothing else "")
        note = r["reason"] if r["status"] != "proven" else ""
        rows.append(f"| {r['flashinfer']} | {_dsl_label(r)} | {', '.join(r['roles'])} | **{r['status']}** | "
                    f"{_sites_text(r)} | {_plan_text(r.get('prewarm'), bool(d.get('refused')))} | {strict} | {note.replace('|', '/')} |")
    return "\n".join(rows)


def write_markdown(results: list[dict[str, Any]], path: Path, run_info: dict[str, Any] | None,
                   b12x_section: list[str] | None = None) -> None:
    """compat/README.md: the flashinfer axis's table, then the b12x axis's section.

    The b12x section is compat_b12x.py's to render (``b12x_section``, passed by its ``main``);
    without one, the section the file already holds is kept as it is, so this script never
    imports compat_b12x.py (which imports this one: data flows one way).
    """
    info = run_info or (json.loads((path.parent / "run.json").read_text()) if (path.parent / "run.json").is_file() else {})
    head = [
        "# flashinfer x nvidia-cutlass-dsl compatibility matrix",
        "",
        "Generated by `python scripts/compat_matrix.py` (do not edit by hand; one JSON per cell in `cells/`).",
        "Every cell is a venv holding that flashinfer and DSL (torch 2.13.0 CPU), compiling for the `rtx-pro-6000`",
        "profile (sm_120a) without a GPU: one real compile per covered site kind through flashinfer's own",
        "dispatch, then a fresh process that must make **0 compiles** (counted at the DSL's",
        "`CompileCallable._compile`), hit the same digests and present the same ABI text.",
        "A struck-through site did not pass. `prewarm plan` is `prewarm --dry-run` for qwen3-30b-a3b,",
        "`--max-num-tokens 256`; `doctor --strict` names the sites nothing persists.",
        "",
    ]
    if info:
        head += [f"Last full run: {info.get('date')}, {info.get('cells')} cells in {info.get('minutes')} min on {info.get('machine')}"
                 f" (code {info.get('code')}; {info.get('venvs', 'venvs built from pip cache')}).", ""]
        head += [f"Rerun since: {note}" for note in info.get("reruns", [])] + ([""] if info.get("reruns") else [])
    counts = {status: sum(r["status"] == status for r in results) for status in ("proven", "refused", "failed")}
    head += [", ".join(f"{n} {status}" for status, n in counts.items()) + ".", ""]
    # The b12x axis (scripts/compat_b12x.py): its own cells, its own table, below.
    if b12x_section is None:
        kept = path.read_text().partition(B12X_HEADING)[2] if path.is_file() else ""
        b12x = [B12X_HEADING.lstrip("\n") + kept.rstrip("\n")] if kept else []
    else:
        b12x = b12x_section
    path.write_text("\n".join(head) + "\n" + table(results) + "\n" + ("\n" + "\n".join(b12x) + "\n" if b12x else ""))


#: Where compat/README.md's b12x section starts (compat_b12x.markdown's first line).
B12X_HEADING = "\n## b12x x nvidia-cutlass-dsl"


README_BEGIN = "<!-- compat-matrix:begin (generated by scripts/compat_matrix.py --readme) -->"
README_END = "<!-- compat-matrix:end -->"


def readme_section(results: list[dict[str, Any]]) -> str:
    """docs/versions.md's "which releases" table, from the matrix results."""
    by_fi: dict[str, dict[str, list[str]]] = {}
    for r in results:
        by_fi.setdefault(r["flashinfer"], {}).setdefault(r["status"], []).append(_dsl_label(r))
    lines = ["| flashinfer | proven with DSL | refused with DSL (reason in compat/README.md) |", "|---|---|---|"]
    for fi in sorted(by_fi, key=_vkey):
        s = by_fi[fi]
        lines.append(f"| {fi} | {', '.join(s.get('proven', [])) or '-'} | {', '.join(s.get('refused', []) + s.get('failed', [])) or '-'} |")
    return "\n".join(lines)


def update_readme(results: list[dict[str, Any]], readme: Path = REPO / "docs" / "versions.md") -> bool:
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise SystemExit(f"{readme}: markers {README_BEGIN!r} / {README_END!r} not found")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    new = f"{head}{README_BEGIN}\n{readme_section(results)}\n{README_END}{tail}"
    if new != text:
        readme.write_text(new)
    return new != text


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def select(names: Iterable[str]) -> list[Cell]:
    by_name = {c.name: c for c in CELLS}
    out: list[Cell] = []
    for name in names:
        if name == "all":
            out += CELLS
        elif name == "ci":
            out += [by_name[n] for n in CI_CELLS]
        elif name in by_name:
            out.append(by_name[name])
        else:
            matching = [c for c in CELLS if c.flashinfer == name]
            if not matching:
                raise SystemExit(f"unknown cell {name!r}; cells: {', '.join(by_name)}")
            out += matching
    return list(dict.fromkeys(out))


def run_cells(chosen: list[Any], run_one: Any, out_dir: Path, identity: Any, after: Any = None) -> None:
    """Run each cell and write its JSON to ``out_dir``, one at a time with a log line before and
    after; a cell whose venv could not be built is recorded as failed (``identity(cell)`` plus the
    reason), never skipped. Shared by the flashinfer axis and the b12x axis (compat_b12x.py)."""
    for i, cell in enumerate(chosen, 1):
        log.info("[%d/%d] %s (%s)", i, len(chosen), cell.name, ", ".join(cell.roles))
        try:
            result = run_one(cell)
        except Exception as exc:  # noqa: BLE001 - the venv could not be built: recorded as such, never skipped
            result = {**identity(cell), "status": "failed", "reason": f"{type(exc).__name__}: {str(exc)[-600:]}",
                      "machine": machine(), "date": datetime.date.today().isoformat()}
        (out_dir / f"{cell.name}.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        log.info("    %s in %.0f s: %s", result["status"], result.get("seconds", {}).get("total", 0), result["reason"][:300])
        if after is not None:
            after(cell)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", nargs="+", default=["all"], help="cell names, flashinfer versions, 'ci' or 'all'")
    ap.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH,
                    help="where the venvs go (outside the checkout; reused between runs and by the tests)")
    ap.add_argument("--code", type=Path, default=REPO, help="the cute-diskcache source tree under test (default: this checkout)")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where cells/*.json and README.md go")
    ap.add_argument("--table-only", action="store_true", help="only regenerate the tables from the results")
    ap.add_argument("--readme", action="store_true", help="also regenerate the versions table in docs/versions.md")
    ap.add_argument("--list", action="store_true", help="list the cells and exit")
    ap.add_argument("--drop-venvs", action="store_true", help="delete each cell's venv after its run (disk)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.list:
        for c in CELLS:
            print(f"{c.name:<32} {', '.join(c.roles)}{'  [ci]' if c.name in CI_CELLS else ''}")
        return 0
    cells_dir = args.results / "cells"
    run_info = None
    if not args.table_only:
        cells_dir.mkdir(parents=True, exist_ok=True)
        chosen = select(args.cells)
        t0 = time.perf_counter()
        def after(cell: Any) -> None:
            if args.drop_venvs:
                shutil.rmtree(args.scratch / "cells" / cell.name, ignore_errors=True)

        run_cells(chosen, lambda cell: run_cell(cell, args.scratch, args.code), cells_dir,
                  lambda cell: {"cell": cell.name, "flashinfer": cell.flashinfer, "dsl": cell.dsl, "cu13": cell.cu13,
                                "roles": list(cell.roles)}, after)
        if len(chosen) == len(CELLS):
            venv_s = sum(r.get("seconds", {}).get("venv", 0) for r in load_results(args.results))
            run_info = {"date": datetime.date.today().isoformat(), "cells": len(chosen),
                        "minutes": round((time.perf_counter() - t0) / 60), "machine": machine(), "code": code_version(args.code),
                        "venvs": (f"venvs built from pip's cache in {venv_s / 60:.0f} of those minutes" if venv_s > 60
                                  else "venvs of an earlier run reused") + ", torch from the shared base venv"}
            old = json.loads((args.results / "run.json").read_text()) if (args.results / "run.json").is_file() else {}
            if "b12x" in old:  # the b12x axis's run (scripts/compat_b12x.py) stays recorded
                run_info["b12x"] = old["b12x"]
            (args.results / "run.json").write_text(json.dumps(run_info, indent=1) + "\n")
    results = load_results(args.results)
    write_markdown(results, args.results / "README.md", run_info)
    if args.readme:
        update_readme(results)
    failed = [r["cell"] for r in results if r["status"] == "failed"]
    print(table(results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
