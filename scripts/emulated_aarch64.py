#!/usr/bin/env python3
"""A DGX Spark's host, emulated: an aarch64 CPython + the flashinfer stack under qemu user mode.

Builds (once, under a scratch directory outside the checkout, reused afterwards) an aarch64
environment on this x86_64 machine, with no binfmt registration and no container:

* a sysroot: Debian's arm64 ``python3.11`` and the libraries it and the DSL need, downloaded by
  this machine's apt (its own sources, a private state directory: the system's dpkg is not
  touched) and unpacked with ``dpkg -x``;
* a venv whose ``bin/python`` is a shell script running that interpreter under
  ``qemu-aarch64-static -L <sysroot>`` (a script, so the workers prewarm starts with
  ``sys.executable`` run under qemu too);
* the stack's aarch64 wheels, installed by this machine's pip (``--platform``, so pip itself
  is not emulated): flashinfer, nvidia-cutlass-dsl and its libs, apache-tvm-ffi at exactly the
  versions this interpreter has (they are part of every key), and torch 2.10.0, the newest
  release that is a CPU build on aarch64 and whose DLPack exports float4 (2.9.1 cannot: every
  launch then fails in DLPack before the kernel's host code runs, unlike on x86);
* this checkout, on the venv's path (a ``.pth`` file).

Then ``prove`` runs the whole proof of issue 30, for ``--target dgx-spark``:

1. prewarm in the aarch64 Python (native aarch64 host code);
2. prewarm on this x86_64 machine (cross-built: aarch64 host code written by x86);
3. prewarm on this machine for an x86_64 host (``--host-machine x86_64``: native compile times);
4. a fresh aarch64 "engine" process (``cute_diskcache._probe``) on 1's cache and one on 2's: 0
   compiles, a hit for every kernel, the launch failing only in the kernel's own device check
   (no GPU), with the same words as an x86 engine on 3's cache;
5. 1 and 2 hold the same keys and the same cubins, byte for byte; every object is aarch64.

    python scripts/emulated_aarch64.py build          # the environment only
    python scripts/emulated_aarch64.py prove          # build if needed, then the proof (JSON on stdout)
    python scripts/emulated_aarch64.py prove --m 1,16,128 --out bench/results/spark_emulated.json

``prove-b12x`` does the same for the b12x package's NVFP4 linear kernels (issue 32): b12x goes beside
each interpreter (``--target`` directories under the scratch, on ``PYTHONPATH``; the venv itself stays
the flashinfer proof's), ``prewarm llama-3.1-8b-nvfp4 --target dgx-spark --linear-backend b12x`` runs
on this x86_64 machine (cross-built) and, unless ``--no-native``, in the aarch64 Python, and a fresh
aarch64 process drives b12x's own planning and compile factories (``tests/b12x_linear_driver.py``,
what vLLM's b12x warm-up reaches) on the cross-built cache: 0 compiles, a hit per kernel.

    python scripts/emulated_aarch64.py prove-b12x --m 1,8 --out bench/results/spark_emulated_b12x.json

``prove --b12x-m 1`` does both at once (what ``tests/test_spark_emulated.py`` runs): b12x's kernels are
cross-built too, and the aarch64 engine on the cross-built caches drives flashinfer's MoE, then b12x's
linears, in one process (``tests/spark_engine_driver.py``): one emulated engine start, not two.

Emulation is CPU heavy: run it under ``nice -n 10`` where others share the machine.
``tests/test_spark_emulated.py`` runs the same proof on one small kernel set.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
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
from collections.abc import Iterable, Iterator, Mapping, Sequence

log = logging.getLogger("emulated_aarch64")

REPO = Path(__file__).resolve().parent.parent
#: Where the environment goes unless told otherwise (the test uses the same, so CI and a manual run share it).
DEFAULT_SCRATCH = Path(os.environ.get("CUTE_DISKCACHE_AARCH64_SCRATCH") or Path.home() / ".cache" / "cute-diskcache" / "aarch64")
TARGET = "dgx-spark"
MODEL = "qwen3-30b-a3b"
#: The probe's wrapper configuration (use_cuda_graph=True, max_num_tokens=4096): prewarm plans the same keys.
MAX_NUM_TOKENS = 4096
#: micro (m 1-5), static (6-80: one per m), dynamic (> 80): one of each by default.
DEFAULT_MS = (1, 16, 128)
PYTHON_MINOR = "3.11"
#: Debian arm64 packages: the interpreter, its standard library's shared libraries, and what the
#: DSL's and torch's extension modules link (libstdc++, libgomp).
DEBS = (
    f"python{PYTHON_MINOR}-minimal", f"libpython{PYTHON_MINOR}-minimal", f"libpython{PYTHON_MINOR}-stdlib",
    "libc6", "libgcc-s1", "gcc-12-base", "libstdc++6", "libgomp1", "zlib1g", "libexpat1", "libssl3", "libffi8",
    "libbz2-1.0", "liblzma5", "libzstd1", "libsqlite3-0", "libncursesw6", "libtinfo6", "libreadline8", "libuuid1",
    "libdb5.3", "libgdbm6", "libgdbm-compat4", "libnsl2", "libtirpc3", "libtirpc-common", "libcrypt1",
    "libgssapi-krb5-2", "libk5crypto3", "libkeyutils1", "libkrb5-3", "libkrb5support0", "libcom-err2",
    "libselinux1", "libpcre2-8-0", "libmd0", "libacl1",
)
#: Keyed distributions (key.dsl_stack, the flashinfer namespace): the aarch64 venv gets this interpreter's versions.
KEYED = ("flashinfer-python", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
         "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi")
#: Everything else the stack imports, as resolved for aarch64 with flashinfer 0.6.15.post1 (installed
#: without dependency resolution: pip evaluates markers for this x86 machine, which would pull CUDA libraries).
OTHERS = (
    "torch==2.10.0", "triton==3.6.0", "numpy==2.4.6", "filelock==4.3.2", "typing_extensions==4.16.0", "sympy==1.14.0",
    "mpmath==1.3.0", "networkx==3.6.1", "Jinja2==3.1.6", "MarkupSafe==3.0.4", "fsspec==2026.9.0", "click==8.5.1",
    "cuda-bindings==13.4.4", "cuda-core==1.2.2", "cuda-pathfinder==1.9.1", "cuda-python==13.4.4", "cuda-tile==1.7.0",
    "einops==0.8.2", "nccl4py==0.6.0", "ninja==1.13.2", "nvidia-cudnn-frontend==1.32.0", "nvidia-ml-py==13.615.71",
    "packaging==26.4", "requests==2.34.2", "certifi==2026.10.19.post1", "charset-normalizer==3.5.3", "idna==3.21",
    "urllib3==2.8.0", "tabulate==0.10.0", "tqdm==4.70.1", "protobuf==7.36.2",
    # cute-diskcache's own
    "msgpack==1.2.4", "platformdirs==4.14.9",
)
#: b12x and what it imports that the venv lacks, at the versions vLLM 0.34 resolves; --no-deps (its
#: torch>=2.12 pin would pull a CUDA build). b12x 1.5.1 pins DSL 4.8.0; it runs on this stack's DSL,
#: and both sides must share one DSL (it is keyed).
B12X_WHEELS = ("b12x==1.5.1", "rich==15.0.0", "markdown-it-py==4.3.0", "mdurl==0.1.2", "pygments==2.21.0", "safetensors==0.8.0")
B12X_MODEL = "llama-3.1-8b-nvfp4"
_PLATFORMS = ("manylinux_2_36_aarch64", "manylinux_2_35_aarch64", "manylinux_2_34_aarch64", "manylinux_2_31_aarch64",
              "manylinux_2_28_aarch64", "manylinux_2_27_aarch64", "manylinux_2_24_aarch64", "manylinux_2_17_aarch64",
              "manylinux2014_aarch64", "linux_aarch64")
#: Our variables (and the DSL's arch) must not steer a child; bytecode writing stays on in the
#: emulated venv, or every import recompiles its sources under emulation.
_DROPPED_ENV = re.compile(r"^(CUTE_DISKCACHE_.*|FLASHINFER_B12X_DISK_CACHE|CUTE_DSL_ARCH|PYTHONPATH|PYTHONHOME|"
                          r"PYTHONDONTWRITEBYTECODE|PYTHONSTARTUP)$")
STEP_TIMEOUT_S = 1800
#: Each apt-get try against the mirror (the update and the download take seconds when the mirror answers).
APT_TRY_S = 180
APT_TRIES = 3


def qemu() -> str | None:
    """qemu's aarch64 user-mode emulator, or None."""
    return shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


def unavailable() -> str | None:
    """Why the emulated environment cannot be built or run here (one reason), or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"this machine is {platform.machine()}, not x86_64: the proof emulates an aarch64 host on an x86 one"
    if qemu() is None:
        return "qemu user mode is not installed (apt-get install qemu-user-static)"
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        return "apt-get and dpkg are needed to fetch Debian's arm64 python3.11"
    return None


def keyed_versions() -> dict[str, str]:
    """This interpreter's versions of the keyed distributions (absent ones left out)."""
    out = {}
    for name in KEYED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def spec() -> dict[str, Any]:
    """What the environment holds; a change rebuilds the part it concerns."""
    return {"debs": list(DEBS), "wheels": [f"{n}=={v}" for n, v in sorted(keyed_versions().items())] + list(OTHERS)}


def _run(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    log.info("$ %s", " ".join(map(str, cmd)))
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _apt(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """apt-get against Debian's mirror, each try bounded: a connection that stalls is killed and
    tried again rather than waited out (seen 2026-12-07: ``apt-get update`` sat 7 minutes on one
    InRelease that curl then fetched in 13 ms; apt's own http timeout never fired)."""
    for attempt in range(1, APT_TRIES + 1):
        try:
            return _run(cmd, timeout=APT_TRY_S, **kwargs)
        except subprocess.TimeoutExpired:
            if attempt == APT_TRIES:
                raise
            log.warning("apt-get %s stalled for %d s; trying again (%d of %d)", cmd[-1] if cmd[-1] == "update" else "download",
                        APT_TRY_S, attempt + 1, APT_TRIES)
    raise AssertionError("unreachable")


def _stamp(path: Path, data: Any) -> bool:
    """Whether ``path`` records ``data`` (the part was built from this spec)."""
    try:
        return json.loads(path.read_text()) == data
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _building(scratch: Path, what: str) -> Iterator[None]:
    """Hold ``scratch/<what>.lock`` (flock) while a part is checked and built: the test suite's
    two workers (and other runs on this machine) may want it at once; one builds, one waits.
    Not reentrant: the parts are built under separate locks, never nested."""
    scratch.mkdir(parents=True, exist_ok=True)
    fd = os.open(scratch / f"{what}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def build_sysroot(scratch: Path) -> Path:
    """Debian's arm64 python3.11 and libraries, unpacked under ``scratch/sysroot`` (reused)."""
    sysroot, stamp = scratch / "sysroot", scratch / "sysroot.json"
    if _stamp(stamp, list(DEBS)) and (sysroot / "usr" / "bin" / f"python{PYTHON_MINOR}").exists():
        return sysroot
    apt = scratch / "apt"
    for d in (apt / "lists" / "partial", apt / "cache" / "archives" / "partial", apt / "debs"):
        d.mkdir(parents=True, exist_ok=True)
    (apt / "status").touch()
    # This machine's sources, arm64 indexes in a private state directory: dpkg's own is untouched.
    opts = ["-o", "APT::Architecture=arm64", "-o", "APT::Architectures::=arm64", "-o", f"Dir::State::Lists={apt / 'lists'}",
            "-o", f"Dir::Cache={apt / 'cache'}", "-o", f"Dir::State::status={apt / 'status'}", "-o", "Debug::NoLocking=1"]
    _apt(["apt-get", *opts, "update"])
    for old in (apt / "debs").glob("*.deb"):
        old.unlink()
    _apt(["apt-get", *opts, "download", *DEBS], cwd=apt / "debs")
    shutil.rmtree(sysroot, ignore_errors=True)
    for deb in sorted((apt / "debs").glob("*.deb")):
        _run(["dpkg", "-x", deb, sysroot])
    stamp.write_text(json.dumps(list(DEBS)))
    return sysroot


def build(scratch: Path = DEFAULT_SCRATCH) -> Path:
    """Build (or reuse) the emulated environment; returns its ``python`` (a script running aarch64 CPython under qemu)."""
    why = unavailable()
    if why:
        raise RuntimeError(why)
    with _building(scratch, "env"):
        scratch.mkdir(parents=True, exist_ok=True)
        sysroot = build_sysroot(scratch)
        venv = scratch / "venv"
        python = venv / "bin" / "python"
        site = venv / "lib" / f"python{PYTHON_MINOR}" / "site-packages"
        wanted = spec()
        if not (_stamp(venv / "cdc-env.json", wanted) and python.exists()):
            shutil.rmtree(venv, ignore_errors=True)
            (venv / "bin").mkdir(parents=True)
            site.mkdir(parents=True)
            # home: the interpreter's prefix as the emulated process sees it (qemu -L maps /usr into the sysroot)
            (venv / "pyvenv.cfg").write_text(f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {PYTHON_MINOR}\n")
            platforms = [a for p in _PLATFORMS for a in ("--platform", p)]
            _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site, *platforms,
                  "--python-version", PYTHON_MINOR, "--implementation", "cp", "--abi", "cp" + PYTHON_MINOR.replace(".", ""),
                  "--only-binary=:all:", *wanted["wheels"]])
            (venv / "cdc-env.json").write_text(json.dumps(wanted))
        # Paths relative to the script: the environment still runs where a bind mount shows it elsewhere
        # (a test running the engine as another uid, which cannot enter root's home).
        _replace(python, "#!/bin/sh\n# aarch64 CPython (Debian's) under qemu user mode; built by scripts/emulated_aarch64.py\n"
                 'top=$(cd "$(dirname "$0")/../.." && pwd)\n'
                 f'exec {qemu()} -L "$top/{sysroot.name}" -0 "$0" "$top/{sysroot.name}/usr/bin/python{PYTHON_MINOR}" "$@"\n', 0o755)
        _replace(site / "cdc-checkout.pth", f"{REPO}\n")  # this checkout's cute_diskcache, as an editable install would
        return python


def _replace(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``path`` only if it differs, by an atomic rename: another process may be running it."""
    if path.is_file() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    os.replace(tmp, path)


def build_b12x(scratch: Path = DEFAULT_SCRATCH) -> dict[str, Path]:
    """b12x for each side (reused): machine -> a directory to put on that interpreter's ``PYTHONPATH``."""
    with _building(scratch, "b12x"):
        out = {}
        for machine in ("aarch64", "x86_64"):
            target = scratch / f"b12x-{machine}"
            stamp = scratch / f"b12x-{machine}.json"
            if not _stamp(stamp, list(B12X_WHEELS)) or not (target / "b12x").is_dir():
                shutil.rmtree(target, ignore_errors=True)
                where = [a for p in _PLATFORMS for a in ("--platform", p)] + [
                    "--python-version", PYTHON_MINOR, "--implementation", "cp", "--abi", "cp" + PYTHON_MINOR.replace(".", "")]
                _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target, "--only-binary=:all:",
                      *(where if machine == "aarch64" else []), *B12X_WHEELS])
                stamp.write_text(json.dumps(list(B12X_WHEELS)))
            out[machine] = target
    return out


def child_env(root: Path, extra: Mapping[str, str] | None = None, hook_dir: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env["CUTE_DISKCACHE_DIR"] = str(root)
    if hook_dir is not None:  # the tests' independent compile counter (a sitecustomize)
        env["PYTHONPATH"] = str(hook_dir)
    env.update(extra or {})
    return env


def prewarm(python: Path | str, root: Path, ms: Iterable[int], *extra: str, jobs: int = 1) -> dict[str, Any]:
    """``cute-diskcache prewarm`` of the model for dgx-spark into ``root`` with ``python``; its JSON summary."""
    root.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), "-m", "cute_diskcache.prewarm", "--model", MODEL, "--target", TARGET, "--max-num-tokens",
           str(MAX_NUM_TOKENS), "--m", ",".join(map(str, ms)), "--no-dense", "--jobs", str(jobs), "--json", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=child_env(root), capture_output=True, text=True, timeout=STEP_TIMEOUT_S, cwd=root.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"prewarm exited {proc.returncode}: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(proc.stdout)
    out["process_seconds"] = round(time.perf_counter() - t0, 2)
    return out


def probe(python: Path | str, root: Path | str, ms: Iterable[int], hook_dir: Path | None = None, *,
          max_num_tokens: int = MAX_NUM_TOKENS, extra_env: Mapping[str, str] | None = None,
          prefix: Sequence[str] = ()) -> dict[str, Any]:
    """A fresh engine process (``cute_diskcache._probe``) on ``root`` for dgx-spark; its JSON report,
    with ``stderr`` and, given ``hook_dir``, ``real_compiles`` (the DSL's compile calls, counted apart).
    ``prefix`` runs it under another command (another uid: tests/_nobody.py)."""
    cmd = [*prefix, str(python), "-m", "cute_diskcache._probe", "--target", TARGET, "--max-num-tokens", str(max_num_tokens),
           "--m", *map(str, ms)]
    return _engine_run("probe", cmd, child_env(Path(root), extra_env, hook_dir=hook_dir), hook_dir or Path(root).parent)


def _engine_run(what: str, cmd: Sequence[str], env: Mapping[str, str], cwd: Path) -> dict[str, Any]:
    """A fresh engine process: its last JSON line on stdout, with ``stderr``, ``real_compiles`` (the
    tests' DSL compile counter, when its sitecustomize is on the path) and ``process_seconds``."""
    t0 = time.perf_counter()
    proc = subprocess.run(list(map(str, cmd)), env=dict(env), capture_output=True, text=True, timeout=STEP_TIMEOUT_S, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}: {' '.join(map(str, cmd))}\n{proc.stderr[-4000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    out: dict[str, Any] = json.loads(lines[-1])
    out["stderr"] = proc.stderr
    counted = re.findall(r"^cdc-test real compiles: (\d+)$", proc.stderr, re.M)
    out["real_compiles"] = int(counted[-1]) if counted else None
    out["process_seconds"] = round(time.perf_counter() - t0, 2)
    return out


def entries(root: Path) -> dict[str, dict[str, Any]]:
    """digest -> the entry's namespace, object ELF machine and cubins (sha256 -> bytes), read as files."""
    out = {}
    for manifest in sorted(root.glob("v1/*/*/*/manifest.msgpack")):
        d = manifest.parent
        (obj,) = d.glob("object-*.o")
        cubins = {hashlib.sha256(c.read_bytes()).hexdigest(): c.read_bytes() for c in d.glob("cubin-*.cubin")}
        out[d.name] = {"namespace": d.parent.parent.name, "elf_machine": int.from_bytes(obj.read_bytes()[18:20], "little"),
                       "cubins": cubins, "shared": bool(list(d.glob("shared-*.so")))}
    return out


def kernel_times(summary: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """digest -> kind, m and compile seconds, from a prewarm's ``--json`` summary."""
    return {k["digest"]: {"kind": k["kind"], "m": k["ms"][0], "seconds": k["seconds"]} for k in summary["kernel_list"]}


def prove(scratch: Path = DEFAULT_SCRATCH, ms: Sequence[int] = DEFAULT_MS, workdir: Path | None = None,
          hook_dir: Path | None = None, native: bool = True, b12x_ms: Sequence[int] = ()) -> dict[str, Any]:
    """The whole proof (module docstring); returns its measurements and verdicts (``ok``).

    ``native``: also prewarm for an x86_64 host on this machine and run an x86 engine on it
    (native compile times and the x86 launch's words); the test leaves it out to save time.
    ``b12x_ms``: also cross-build b12x's linear kernels for these token counts, and let the aarch64
    engine on the cross-built cache drive b12x's after flashinfer's, in the same process
    (tests/spark_engine_driver.py): ``report["b12x"]`` then holds what :func:`prove_b12x` reports
    without ``native``, and the run pays one emulated engine start instead of two.
    """
    python = build(scratch)
    work = workdir or scratch / "proof"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    roots = {name: work / name / "root" for name in ("emulated", "cross", "native")}
    report: dict[str, Any] = {"machine": f"{platform.machine()} {_cpu_name()}, {os.cpu_count()} cores",
                              "load_before": os.getloadavg(), "ms": list(ms), "target": TARGET, "model": MODEL,
                              "qemu": _qemu_version(), "stack": keyed_versions(), "aarch64_torch": OTHERS[0]}
    emulated = prewarm(python, roots["emulated"], ms)
    cross = prewarm(sys.executable, roots["cross"], ms)
    report["prewarm"] = {"emulated": _brief(emulated), "cross": _brief(cross)}
    if native:
        report["prewarm"]["native_x86"] = _brief(prewarm(sys.executable, roots["native"], ms, "--host-machine", "x86_64"))
    engines = {"on_emulated": probe(python, roots["emulated"], ms, hook_dir)}
    if b12x_ms:
        sites = build_b12x(scratch)
        b12x_root = work / "cross-b12x" / "root"
        report["b12x"] = {"ms": list(b12x_ms), "model": B12X_MODEL, "b12x": list(B12X_WHEELS),
                          "prewarm": {"cross": prewarm_b12x(sys.executable, sites["x86_64"], b12x_root, b12x_ms)}}
        # what a Spark serving both libraries' kernels holds: the two cross-built roots in one (copies)
        both = work / "cross-both" / "root"
        shutil.copytree(roots["cross"], both)
        shutil.copytree(b12x_root, both, dirs_exist_ok=True)
        engines["on_cross"], b12x_engine = _engine_with_b12x(python, both, ms, b12x_ms, sites["aarch64"], hook_dir)
        report["b12x"].update(_b12x_verdict(report["b12x"]["prewarm"]["cross"], b12x_engine, entries(b12x_root)))
    else:
        engines["on_cross"] = probe(python, roots["cross"], ms, hook_dir)
    if native:
        engines["x86_on_native"] = probe(sys.executable, roots["native"], ms, hook_dir)
    report["engines"] = {name: _engine(r) for name, r in engines.items()}
    a, b = entries(roots["emulated"]), entries(roots["cross"])
    report["entries"] = {
        "same_keys": sorted(a) == sorted(b),
        "keys": len(a),
        "namespaces": sorted({e["namespace"] for e in (*a.values(), *b.values())}),
        "elf_machines": sorted({e["elf_machine"] for e in (*a.values(), *b.values())}),
        "cubins_identical": bool(a) and all(a[d]["cubins"] == b.get(d, {}).get("cubins") for d in a),
        "cubins": sum(len(e["cubins"]) for e in a.values()),
    }
    times_e, times_c = kernel_times(emulated), kernel_times(cross)
    times_n = kernel_times(report["prewarm"]["native_x86"]["summary"]) if native else {}
    per_kernel = []
    for digest, t in sorted(times_e.items(), key=lambda kv: kv[1]["m"]):
        row = {"kind": t["kind"], "m": t["m"], "digest": digest[:12], "emulated_s": t["seconds"],
               "cross_s": times_c.get(digest, {}).get("seconds")}
        native_row = next((n for n in times_n.values() if n["kind"] == t["kind"] and n["m"] == t["m"]), None)
        if native_row is not None:
            row["native_x86_s"] = native_row["seconds"]
            row["emulated_over_native"] = round(t["seconds"] / native_row["seconds"], 1) if native_row["seconds"] else None
        per_kernel.append(row)
    report["per_kernel"] = per_kernel
    report["load_after"] = os.getloadavg()
    n = len(a)
    launch = {name: e["launch_errors"] for name, e in report["engines"].items()}
    report["ok"] = bool(
        n == len(ms) and report["entries"]["same_keys"] and report["entries"]["cubins_identical"]
        and report["entries"]["elf_machines"] == [183]
        and all(e["compiles"] == 0 and e["hits"] == n and e["real_compiles"] in (0, None) for e in report["engines"].values())
        and all(all("expected device_type=cuda" in (err or "") for err in errs) for errs in launch.values())
        and len({json.dumps(errs) for errs in launch.values()}) == 1
        and report.get("b12x", {}).get("ok", True)
    )
    return report


def prove_b12x(scratch: Path = DEFAULT_SCRATCH, ms: Sequence[int] = (1,), workdir: Path | None = None,
               hook_dir: Path | None = None, native: bool = True) -> dict[str, Any]:
    """b12x's linear kernels for a Spark (module docstring, ``prove-b12x``); measurements and ``ok``.

    ``native``: also prewarm in the aarch64 Python (minutes a kernel) and compare its entries with
    the cross-built ones; the test leaves it out to save time.
    """
    python, sites = build(scratch), build_b12x(scratch)
    work = workdir or scratch / "proof-b12x"
    shutil.rmtree(work, ignore_errors=True)
    roots = {name: work / name / "root" for name in ("emulated", "cross")}
    report: dict[str, Any] = {"machine": f"{platform.machine()} {_cpu_name()}, {os.cpu_count()} cores", "load_before": os.getloadavg(),
                              "ms": list(ms), "target": TARGET, "model": B12X_MODEL, "qemu": _qemu_version(),
                              "stack": keyed_versions(), "b12x": list(B12X_WHEELS), "aarch64_torch": OTHERS[0], "prewarm": {}}
    report["prewarm"]["cross"] = prewarm_b12x(sys.executable, sites["x86_64"], roots["cross"], ms)
    if native:
        report["prewarm"]["emulated"] = prewarm_b12x(python, sites["aarch64"], roots["emulated"], ms)
    # the engine: a fresh aarch64 process through b12x's planning and compile factories, counted at the DSL too
    path = os.pathsep.join(str(p) for p in (hook_dir, sites["aarch64"]) if p is not None)
    engine = _engine_run("the emulated b12x engine",
                         [python, REPO / "tests" / "b12x_linear_driver.py", B12X_MODEL, TARGET, ",".join(map(str, ms))],
                         child_env(roots["cross"], {"PYTHONPATH": path, "FLASHINFER_B12X_DISK_CACHE": "1"}), roots["cross"].parent)
    report.update(_b12x_verdict(report["prewarm"]["cross"], engine, entries(roots["cross"])))
    if native:
        emulated, cross = entries(roots["emulated"]), entries(roots["cross"])
        report["entries"]["same_keys"] = sorted(emulated) == sorted(cross)
        report["entries"]["cubins_identical"] = bool(emulated) and all(emulated[d]["cubins"] == cross.get(d, {}).get("cubins") for d in emulated)
        report["ok"] = report["ok"] and report["entries"]["same_keys"] and report["entries"]["cubins_identical"]
    report["load_after"] = os.getloadavg()
    return report


def prewarm_b12x(python: Path | str, site: Path, root: Path, ms: Sequence[int]) -> dict[str, Any]:
    """``prewarm`` of b12x's linear kernels for dgx-spark into ``root``, with b12x from ``site``; what it did."""
    plan = ["prewarm", B12X_MODEL, "--target", TARGET, "--linear-backend", "b12x", "--m", ",".join(map(str, ms)), "--jobs", "1", "--json"]
    root.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run([str(python), "-m", "cute_diskcache", *plan], env=child_env(root, {"PYTHONPATH": str(site)}),
                          capture_output=True, text=True, timeout=STEP_TIMEOUT_S, cwd=root.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"b12x prewarm ({python}) exited {proc.returncode}\n{proc.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(proc.stdout)
    return {"kernels_compiled": out["kernels_compiled"], "jobs": out["jobs"], "errors": out["errors"], "seconds": out["seconds"],
            "host_machine": out["host_machine"], "namespaces": out["written"]["namespaces"],
            "process_seconds": round(time.perf_counter() - t0, 2),
            "per_kernel": [{"linear": j["linear"], "ms": j["ms"], "seconds": round(j["seconds"], 2)} for j in out["job_list"] if j["compiles"]]}


def _engine_with_b12x(python: Path, root: Path, ms: Sequence[int], b12x_ms: Sequence[int], b12x_site: Path,
                      hook_dir: Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """One fresh aarch64 engine on ``root``: flashinfer's MoE for ``ms``, then b12x's linears for
    ``b12x_ms`` (tests/spark_engine_driver.py); the probe's report and the b12x driver's, each with the
    process's ``stderr``, ``real_compiles`` (the DSL's count: the whole process, both parts) and seconds."""
    path = os.pathsep.join(str(p) for p in (hook_dir, b12x_site) if p is not None)
    cmd = [python, REPO / "tests" / "spark_engine_driver.py", B12X_MODEL, TARGET, ",".join(map(str, b12x_ms)), "--",
           "--target", TARGET, "--max-num-tokens", str(MAX_NUM_TOKENS), "--m", *map(str, ms)]
    both = _engine_run("the emulated engine (flashinfer, then b12x)", cmd,
                       child_env(root, {"PYTHONPATH": path, "FLASHINFER_B12X_DISK_CACHE": "1"}), root.parent)
    shared = {k: both[k] for k in ("stderr", "real_compiles", "process_seconds")}
    return {**both["flashinfer"], **shared}, {**both["b12x"], **shared}


def _b12x_verdict(cross: Mapping[str, Any], engine: Mapping[str, Any], built: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """What :func:`prove_b12x` reports of the cross-built entries and the aarch64 engine on them, and ``ok``."""
    e = {"jobs": engine["jobs"], "compiles": engine["counters"]["compiles"], "hits": engine["counters"]["hits"],
         "misses": engine["counters"]["misses"], "real_compiles": engine["real_compiles"],
         "load_seconds": round(engine["counters"]["load_seconds"], 3), "process_seconds": engine["process_seconds"],
         "attach_line": next((ln for ln in engine["stderr"].splitlines() if "attached:" in ln), None)}
    found = {"keys": len(built), "namespaces": sorted({v["namespace"] for v in built.values()}),
             "elf_machines": sorted({v["elf_machine"] for v in built.values()})}
    n = len(built)
    ok = bool(n and cross["kernels_compiled"] == n and found["elf_machines"] == [183] and e["compiles"] == 0
              and e["misses"] == 0 and e["hits"] == n and e["real_compiles"] in (0, None))
    return {"engine_on_cross": e, "entries": found, "ok": ok}


def _brief(summary: Mapping[str, Any]) -> dict[str, Any]:
    return {"kernels": summary["kernels"], "compiled": summary["compiled"], "failed": summary["failed"],
            "host_machine": summary.get("host_machine"), "wall_seconds": summary["wall_seconds"],
            "process_seconds": summary["process_seconds"], "namespaces": summary.get("written", {}).get("namespaces"),
            "summary": dict(summary)}


def _engine(report: Mapping[str, Any]) -> dict[str, Any]:
    return {"compiles": report["counters"]["compiles"], "hits": report["counters"]["hits"],
            "real_compiles": report["real_compiles"], "load_seconds": round(report["counters"]["load_seconds"], 3),
            "import_seconds": round(report["import_seconds"], 2), "process_seconds": report["process_seconds"],
            "launch_errors": [r["launch_error"] for r in report["records"]]}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "?"


def _qemu_version() -> str | None:
    q = qemu()
    if q is None:
        return None
    return subprocess.run([q, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("build", "prove", "prove-b12x"))
    ap.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH, help=f"where the environment lives (default {DEFAULT_SCRATCH})")
    ap.add_argument("--m", default=",".join(map(str, DEFAULT_MS)), help="batch sizes to prewarm and drive (default: one micro, static, dynamic)")
    ap.add_argument("--no-native", dest="native", action="store_false", help="skip the x86_64-host prewarm and engine (prove-b12x: the aarch64 prewarm)")
    ap.add_argument("--b12x-m", default="", help="prove: also b12x's linear kernels for these token counts, the same aarch64 engine driving them")
    ap.add_argument("--out", type=Path, help="also write the report (without the summaries) to this JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    why = unavailable()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.command == "build":
        print(build(args.scratch))
        return 0
    ms = [int(m) for m in args.m.split(",")]
    if args.command == "prove-b12x":
        report = prove_b12x(args.scratch, ms, native=args.native)
    else:
        report = prove(args.scratch, ms, native=args.native, b12x_ms=[int(m) for m in args.b12x_m.split(",") if m.strip()])
        for step in report["prewarm"].values():
            step.pop("summary", None)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
