"""A target served from another host machine (issue 30): DGX Spark (aarch64) from an x86_64 box.

A prewarm for ``dgx-spark`` on x86 once wrote x86_64 host code into the x86_64 namespace and
reported success: a cache no Spark can load. Now it writes aarch64 host code into the aarch64
namespace (the DSL cross-builds it, :mod:`cute_diskcache.core.crossbuild`), and ``check --target
dgx-spark`` here answers for a Spark host. Real flashinfer, the real DSL, one micro kernel
(m=1). The aarch64 side (an emulated Spark loading these entries) is tests/test_spark_emulated.py.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cute_diskcache.keys import hostcpu, hostmachine, targets

X86 = platform.machine() == "x86_64"
needs_x86 = pytest.mark.skipif(not X86, reason="cross-building from x86_64 to aarch64 is what is tested")
PLAN = ("qwen3-30b-a3b", "--target", "dgx-spark", "--max-num-batched-tokens", "4096", "--m", "1", "--no-dense")


def cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k not in ("FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH")}
    return subprocess.run([sys.executable, "-m", "cute_diskcache", "--root", str(root), *args], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root.parent)


def objects(root: Path) -> dict[str, bytes]:
    """namespace/digest -> the entry's object bytes."""
    return {f"{p.parent.parent.parent.name}/{p.parent.name}": p.read_bytes() for p in root.glob("v1/*/*/*/object-*.o")}


def test_profiles_name_their_host_machines(tmp_path: Path) -> None:
    assert targets.get("dgx-spark").host_machines == ("aarch64",)
    assert all(targets.get(n).host_machines == ("x86_64",) for n in ("rtx-pro-6000", "rtx-5090", "rtx-5080", "rtx-5070-ti"))
    arm_server = tmp_path / "rtx-pro-6000-arm.json"
    arm_server.write_text(json.dumps({"base": "rtx-pro-6000", "host_machines": ["arm64"]}))
    assert targets.get(str(arm_server)).host_machines == ("aarch64",), "an RTX card in an Arm server, arm64 spelt as Docker does"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"base": "rtx-pro-6000", "host_machines": ["riscv64"]}))
    with pytest.raises(targets.UnknownProfileError, match="riscv64"):
        targets.get(str(bad))


def test_the_machine_built_for() -> None:
    here = hostmachine.here()
    assert hostmachine.for_target(("x86_64", "aarch64")) == here, "this machine when the card comes with it"
    other = "aarch64" if here == "x86_64" else "x86_64"
    assert hostmachine.for_target((other,)) == other
    assert hostmachine.for_target((other,), "amd64" if here == "x86_64" else "arm64") == here, "--host-machine wins"
    with pytest.raises(hostmachine.UnknownMachineError):
        hostmachine.normalize("sparc")


def test_another_machines_entry_is_not_judged_by_this_cpu() -> None:
    other = "aarch64" if hostmachine.here() == "x86_64" else "x86_64"
    have = set(hostcpu.isa_extensions())
    if not have:
        pytest.skip("this CPU's extensions cannot be read")
    # an extension this CPU lacks, spelt as /proc/cpuinfo spells it here
    lacking = next(f for f in ("avx512_fp16", "avx512f", "avx10_2", "sve2", "sme2", "sve") if f not in have)
    assert hostcpu.missing([lacking]) == [lacking]
    assert hostcpu.missing([lacking], machine=hostmachine.here()) == [lacking]
    assert hostcpu.missing([lacking], machine=other) == [], "check on x86 reading a Spark's entries cannot judge the Spark's CPU"


@needs_x86
def test_prewarm_for_a_spark_writes_aarch64_host_code_and_check_answers_for_a_spark(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = cli(root, "--json", "prewarm", *PLAN, "--jobs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["compiled"] == out["kernels"] == 1 and out["failed"] == 0, out
    assert out["host_machine"] == "aarch64"
    [(name, obj)] = objects(root).items()
    assert "-sm_121a-aarch64-" in name, f"a Spark's entry goes to an aarch64 namespace, not {name}"
    assert obj[:4] == b"\x7fELF" and int.from_bytes(obj[18:20], "little") == 183, "aarch64 host code (EM_AARCH64)"
    assert not list(root.glob("v1/*/*/*/shared-*.so")), "no x86 link of an aarch64 object"

    # The deploy gate, on this x86 box, for a Spark: the aarch64 namespace answers.
    gate = cli(root, "--json", "check", *PLAN)
    assert gate.returncode == 0, gate.stdout[-3000:] + gate.stderr[-2000:]
    report = json.loads(gate.stdout)
    assert report["ok"] and report["host_machine"] == "aarch64" and report["host_cpu_checked"] is False
    assert {r["namespace"] for r in report["kernels"]} == {name.split("/")[0]}

    # The same cache does not serve an x86_64 host of that card: the gate says so.
    x86 = cli(root, "--json", "check", *PLAN, "--host-machine", "x86_64")
    assert x86.returncode == 1, x86.stdout[-2000:]
    assert json.loads(x86.stdout)["counts"]["missing"] == 1

    # Human output: the closing note names the aarch64 host code.
    again = cli(root, "prewarm", *PLAN, "--jobs", "1")
    assert again.returncode == 0 and "already cached 1" in again.stdout, again.stdout + again.stderr[-2000:]
    assert "aarch64 host code" in again.stdout and "-aarch64-" in again.stdout


@needs_x86
def test_host_machine_flags_that_cannot_be_served_are_refused_before_compiling(tmp_path: Path) -> None:
    root = tmp_path / "root"
    unknown = cli(root, "prewarm", *PLAN, "--host-machine", "sparc")
    assert unknown.returncode == 2 and "unknown host machine 'sparc'" in unknown.stderr, unknown.stderr[-2000:]
    no_target = cli(root, "prewarm", "qwen3-30b-a3b", "--m", "1", "--no-dense", "--host-machine", "aarch64")
    assert no_target.returncode == 2 and "needs --target" in no_target.stderr, no_target.stderr[-2000:]
    assert not root.exists() or not objects(root), "nothing compiled"


def test_json_summary_is_unchanged_for_a_native_target(tmp_path: Path) -> None:
    """A target served from this machine keeps its namespace: nothing about keys moves for it."""
    root = tmp_path / "root"
    target = "dgx-spark" if hostmachine.here() == "aarch64" else "rtx-pro-6000"
    proc = cli(root, "--json", "prewarm", "qwen3-30b-a3b", "--target", target, "--m", "1", "--no-dense", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, Any] = json.loads(proc.stdout)
    assert out["host_machine"] == platform.machine()
