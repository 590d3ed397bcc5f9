"""A DGX Spark's host, emulated (issue 30): aarch64 CPython + the real stack under qemu user mode.

scripts/emulated_aarch64.py builds the environment once, outside the checkout
(``$CUTE_DISKCACHE_AARCH64_SCRATCH``, default ``~/.cache/cute-diskcache/aarch64``), and runs the
proof; this test runs it on one micro kernel (m 1) in CI, where each emulated compile costs
30-50 s, and on one kernel of each kind with ``CUTE_DISKCACHE_SPARK_MS=1,16,128`` (the run whose
figures are in docs/performance.md):

* prewarm in the aarch64 Python, then a fresh aarch64 engine on that cache: 0 compiles (counted
  at the DSL too), a hit per kernel, each launch failing in the kernel's own host code for want
  of a CUDA device, as on x86;
* the same prewarm on this x86 box (cross-built): the same keys, byte-identical cubins, aarch64
  objects, and the aarch64 engine hits those too;
* ``check --target dgx-spark`` on x86 passes on the aarch64-built cache (it answers for a Spark);
* the aarch64 DSL cannot write x86_64 host code: a prewarm there for an x86 card stops before
  compiling, exit 2, naming the mismatch and the command that works;
* the b12x package's NVFP4 linear kernels (issue 32), prewarmed on this x86 box for a Spark, are
  hit by a fresh aarch64 process driving b12x's own planning and compile factories: 0 compiles.

The last two engines are one process (tests/spark_engine_driver.py): flashinfer's MoE, then b12x's
linears, on a root holding both cross-built sets, as one engine serving both libraries' kernels
would. Each emulated process start costs about a minute of qemu before it asks the cache anything;
neither part has the other's kernels in memory, so each part's hits come from the disk, and the
DSL's own compile count covers the whole process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _compat, whatever pytest's import mode
from _compat import script  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
#: batch sizes proven: micro only by default (CI's budget); any list with CUTE_DISKCACHE_SPARK_MS
MS = tuple(int(m) for m in os.environ.get("CUTE_DISKCACHE_SPARK_MS", "1").split(",") if m.strip())


def _kind(m: int) -> str:
    """The MoE kernel kind flashinfer picks for m tokens (micro 1-5, static 6-80, dynamic above)."""
    return "micro" if m <= 5 else "static" if m <= 80 else "dynamic"


def emulation() -> ModuleType:
    """scripts/emulated_aarch64.py as a module (a script, not part of the package)."""
    return script("emulated_aarch64")


pytestmark = [pytest.mark.slow, pytest.mark.skipif(emulation().unavailable() is not None, reason=str(emulation().unavailable()))]


@pytest.fixture(scope="module")
def python() -> Path:
    return Path(emulation().build())


@pytest.fixture(scope="module")
def proof(tmp_path_factory: pytest.TempPathFactory, compile_hook_dir: Path, python: Path) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("spark-proof")
    report: dict[str, Any] = emulation().prove(ms=MS, workdir=work, hook_dir=compile_hook_dir, native=False, b12x_ms=(1,))
    report["work"] = work
    print(json.dumps({k: v for k, v in report.items() if k not in ("prewarm", "work")}, indent=1, default=str))
    return report


def test_emulated_prewarm_then_emulated_engine_compiles_nothing(proof: dict[str, Any]) -> None:
    emulated = proof["prewarm"]["emulated"]
    assert emulated["compiled"] == emulated["kernels"] == len(MS) and emulated["host_machine"] == "aarch64", emulated
    assert {k["kind"] for k in emulated["summary"]["kernel_list"]} == {_kind(m) for m in MS}
    engine = proof["engines"]["on_emulated"]
    assert engine["real_compiles"] == 0 and engine["compiles"] == 0 and engine["hits"] == len(MS), engine
    # the kernel's own host code ran (its device check): a launch fails only for want of a GPU
    assert all(e and e.endswith("expected device_type=cuda") for e in engine["launch_errors"]), engine["launch_errors"]


def test_cross_built_entries_match_the_native_aarch64_build_and_are_hit(proof: dict[str, Any]) -> None:
    entries = proof["entries"]
    assert entries["same_keys"] and entries["keys"] == len(MS), entries
    assert entries["cubins_identical"] and entries["cubins"] >= len(MS), "the x86-built cubins are the aarch64-built ones, byte for byte"
    assert entries["elf_machines"] == [183], "every object holds aarch64 host code"
    assert len(entries["namespaces"]) == 1 and "-aarch64-" in entries["namespaces"][0], entries["namespaces"]
    engine = proof["engines"]["on_cross"]
    assert engine["real_compiles"] == 0 and engine["compiles"] == 0 and engine["hits"] == len(MS), engine
    assert engine["launch_errors"] == proof["engines"]["on_emulated"]["launch_errors"], "the same kernels, the same words"


def test_check_on_x86_answers_for_a_spark_on_the_aarch64_built_cache(proof: dict[str, Any]) -> None:
    root = Path(proof["work"]) / "emulated" / "root"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k != "CUTE_DSL_ARCH"}
    plan = ["qwen3-30b-a3b", "--target", "dgx-spark", "--max-num-batched-tokens", str(emulation().MAX_NUM_TOKENS),
            "--m", ",".join(map(str, MS)), "--no-dense"]
    proc = subprocess.run([sys.executable, "-m", "cute_diskcache", "--root", str(root), "--json", "check", *plan],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and report["counts"]["ok"] == len(MS) and report["host_machine"] == "aarch64"


def test_the_aarch64_dsl_cannot_write_x86_host_code_and_says_what_works(python: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    env = emulation().child_env(root)
    proc = subprocess.run([str(python), "-m", "cute_diskcache", "prewarm", "qwen3-30b-a3b", "--target", "rtx-pro-6000",
                           "--m", "1", "--no-dense", "--jobs", "1"], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "x86_64 host" in line and "this machine is aarch64" in line and "nothing was compiled" in line, line
    assert "docker run --rm --platform linux/amd64" in line and "cute-diskcache prewarm qwen3-30b-a3b" in line, line
    assert not list(root.glob("v1/*/*/*/manifest.msgpack")), "nothing compiled, nothing written"
    print(line)


@pytest.fixture(scope="module")
def b12x_proof(proof: dict[str, Any]) -> dict[str, Any]:
    """b12x's part of the proof: its kernels cross-built apart, hit by the same aarch64 engine after flashinfer's."""
    report: dict[str, Any] = proof["b12x"]
    return report


def test_b12x_kernels_cross_built_for_a_spark_are_hit_by_an_aarch64_engine(b12x_proof: dict[str, Any]) -> None:
    cross = b12x_proof["prewarm"]["cross"]
    # llama-3.1-8b-nvfp4's four linear shapes at one token: four kernels, aarch64 host code written on x86
    assert cross["kernels_compiled"] == cross["jobs"] == 4 and cross["errors"] == 0 and cross["host_machine"] == "aarch64", cross
    [namespace] = cross["namespaces"]
    assert namespace.startswith("b12x-1.5.1-sm_121a-aarch64-"), namespace
    assert b12x_proof["entries"]["elf_machines"] == [183] and b12x_proof["entries"]["keys"] == 4, b12x_proof["entries"]
    engine = b12x_proof["engine_on_cross"]
    assert engine["real_compiles"] == 0 and engine["compiles"] == 0 and engine["misses"] == 0 and engine["hits"] == 4, engine
    assert "b12x 1.5.1" in engine["attach_line"] and "aarch64" in engine["attach_line"], engine["attach_line"]
    assert b12x_proof["ok"]
