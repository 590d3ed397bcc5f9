"""Host code any CPU of the fleet runs: entries written for a named baseline, not the build CPU.

The promise is "prewarm on a build box, serve anywhere". An entry's host object is launch glue;
written for the build CPU it carried that CPU's extensions, and a serving host without them
refused the whole cache. Here every claim is checked on real objects: the instructions of each
host object are decoded (iced-x86) and held to the baseline its manifest names; an entry built
where /proc/cpuinfo shows AVX-512 is hit where it does not; and the host code of a portable
entry runs, as far as a machine without a GPU goes, on an emulated CPU without AVX (qemu user
mode, ``-cpu Nehalem``: x86-64-v2), where a natively tuned entry is refused.
"""

from __future__ import annotations

import collections
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cute_diskcache.keys import hostcpu
from cute_diskcache.storage import entry

from _nobody import can_run_as_others
from test_remote_redis import redis_db, redis_url  # noqa: F401  (fixtures)

HERE = Path(__file__).resolve().parent
CHILD = HERE / "host_code_child.py"

#: The instruction sets (iced-x86's CpuidFeature names) each baseline allows. CET_IBT is endbr64,
#: a NOP on every CPU without CET: the linker's start-up code in a shared object carries it.
_V1 = {"INTEL8086", "INTEL186", "INTEL286", "INTEL386", "INTEL486", "X64", "CMOV", "CX8", "FPU", "FPU287", "FPU387",
       "MMX", "SSE", "SSE2", "MULTIBYTENOP", "FXSR", "PAUSE", "TSC", "CPUID", "CET_IBT"}
ALLOWED = {
    "x86-64-v2": _V1 | {"SSE3", "SSSE3", "SSE4_1", "SSE4_2", "POPCNT", "CMPXCHG16B"},
}
ALLOWED["x86-64-v3"] = ALLOWED["x86-64-v2"] | {"AVX", "AVX2", "BMI1", "BMI2", "F16C", "FMA", "LZCNT", "MOVBE", "XSAVE"}

#: /proc/cpuinfo flags of an x86-64-v2 CPU (a Nehalem: what qemu's ``-cpu Nehalem`` emulates).
NEHALEM_FLAGS = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 "
                 "syscall nx rdtscp lm constant_tsc pni ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm")
#: The AVX-512 family a Sapphire Rapids build box shows.
AVX512_FLAGS = ("avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "avx512_vnni",
                "avx512vbmi", "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq")

pytestmark = pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86_64 Linux host code")


def instruction_sets(image: bytes) -> collections.Counter[str]:
    """How many instructions of each instruction set the executable sections of an ELF image hold."""
    iced = pytest.importorskip("iced_x86")
    elffile = pytest.importorskip("elftools.elf.elffile")
    names = {value: name for name, value in vars(iced.CpuidFeature).items() if not name.startswith("_") and isinstance(value, int)}
    counts: collections.Counter[str] = collections.Counter()
    for section in elffile.ELFFile(io.BytesIO(image)).iter_sections():
        if section["sh_type"] == "SHT_PROGBITS" and section["sh_flags"] & 0x4:  # SHF_EXECINSTR
            for instruction in iced.Decoder(64, section.data()):
                counts.update(names[f] for f in instruction.cpuid_features())
    return counts


def host_payloads(root: Path) -> list[tuple[dict[str, Any], str, bytes]]:
    """(manifest, file name, bytes) of every object and shared object of every entry under ``root``."""
    out = []
    for manifest_path in sorted(root.glob("v1/*/*/*/manifest.msgpack")):
        manifest = entry.read_manifest(manifest_path.parent)
        for role in ("object", "shared"):
            for item in manifest["payloads"].get(role, []):
                out.append((manifest, item["file"], (manifest_path.parent / item["file"]).read_bytes()))
    assert out, f"no entry under {root}"
    return out


def beyond(image: bytes, baseline: str) -> dict[str, int]:
    return {name: n for name, n in instruction_sets(image).items() if name not in ALLOWED[baseline]}


def prewarm_json(root: Path, *args: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k != "FLASHINFER_B12X_DISK_CACHE"}
    env["CUTE_DISKCACHE_DIR"] = str(root)
    proc = subprocess.run([sys.executable, "-m", "cute_diskcache.prewarm", *args, "--json"], env=env, capture_output=True,
                          text=True, timeout=600, cwd=root.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def cpuinfo_with_flags(path: Path, flags: str) -> Path:
    """This machine's /proc/cpuinfo with every ``flags`` line replaced."""
    text = Path("/proc/cpuinfo").read_text()
    path.write_text(re.sub(r"(?m)^(flags\s*:).*$", lambda m: f"{m.group(1)} {flags}", text))
    return path


def seeing(cpuinfo: Path) -> list[str]:
    """A command prefix: what follows runs in a private mount namespace where /proc/cpuinfo is ``cpuinfo``."""
    return ["unshare", "-m", "sh", "-c", f'mount --bind "{cpuinfo}" /proc/cpuinfo && exec "$@"', "sh"]


def avx512_views(tmp_path: Path) -> tuple[list[str], list[str]]:
    """Prefixes for a build box that shows this CPU plus the AVX-512 family, and for a serving
    host that shows this CPU without any AVX-512 (skips where that cannot be staged)."""
    _needs_namespaces()
    flags = re.search(r"(?m)^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text())
    if flags is None:
        pytest.skip("no flags line in /proc/cpuinfo")
    plain = " ".join(f for f in flags.group(1).split() if not f.startswith("avx512"))
    return (seeing(cpuinfo_with_flags(tmp_path / "cpuinfo-avx512", f"{plain} {' '.join(AVX512_FLAGS)}")),
            seeing(cpuinfo_with_flags(tmp_path / "cpuinfo-plain", plain)))


def _needs_namespaces() -> None:
    why = can_run_as_others()
    if why is not None:
        pytest.skip(why)


def tiny(root: Path, *, prefix: tuple[str, ...] | list[str] = (), host_cpu: str | None = None, build: bool = False,
         on_miss: str = "error", dsl_abi: bool = False) -> dict[str, Any]:
    """One process of tests/host_code_child.py over ``root``: its JSON line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}
    env.update(FLASHINFER_B12X_DISK_CACHE="1", CUTE_DISKCACHE_DIR=str(root), CUTE_DISKCACHE_ON_MISS="compile" if build else on_miss)
    if host_cpu is not None:
        env["CUTE_DISKCACHE_HOST_CPU"] = host_cpu
    cmd = [*prefix, os.path.realpath(sys.executable), str(CHILD), *(["build"] if build else []), *(["--dsl-abi"] if dsl_abi else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=root.parent)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-4000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    out: dict[str, Any] = json.loads(lines[-1])
    out["stderr"] = proc.stderr
    return out


@pytest.fixture(scope="module")
def tiny_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny kernel compiled into one root with the default host code and one tuned for this CPU."""
    roots = {}
    for setting in ("portable", "native"):
        root = tmp_path_factory.mktemp(f"tiny-{setting}") / "root"
        built = tiny(root, host_cpu=None if setting == "portable" else setting, build=True)
        assert built["compiles"] == 1, built
        roots[setting] = root
    return roots


# --------------------------------------------------------------------------------------------
# What the objects hold
# --------------------------------------------------------------------------------------------


def test_a_compile_writes_host_code_for_the_baseline_it_records(warm_micro_root: Any) -> None:
    """flashinfer's micro kernel, compiled by a serving process (the session's cold probe)."""
    for manifest, name, image in host_payloads(warm_micro_root.root):
        assert manifest["host_cpu"] == "x86-64-v2", manifest.get("host_cpu")
        assert manifest["host_isa"] == list(hostcpu.BASELINES["x86-64-v2"].extensions)
        assert beyond(image, "x86-64-v2") == {}, f"{name} holds instructions beyond x86-64-v2"


def test_the_disassembly_tells_native_code_from_the_baseline(tiny_roots: dict[str, Path]) -> None:
    """The check above can fail: this CPU's own tuning (AVX here) is beyond x86-64-v2, and the
    native entry records this CPU's extensions, as entries did before."""
    for manifest, name, image in host_payloads(tiny_roots["portable"]):
        assert manifest["host_cpu"] == "x86-64-v2" and beyond(image, "x86-64-v2") == {}, name
    if "avx" not in hostcpu.isa_extensions():
        pytest.skip("this CPU has no AVX: its native code is x86-64-v2 code")
    native = host_payloads(tiny_roots["native"])
    for manifest, _name, _image in native:
        assert manifest["host_cpu"] == "native"
        assert manifest["host_isa"] == list(hostcpu.isa_extensions())
    assert any("AVX" in beyond(image, "x86-64-v2") for _m, _n, image in native), "native code used no AVX here"


@pytest.mark.slow
def test_a_named_baseline_is_written_and_recorded(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert tiny(root, host_cpu="x86-64-v3", build=True)["compiles"] == 1
    payloads = host_payloads(root)
    for manifest, name, image in payloads:
        assert manifest["host_cpu"] == "x86-64-v3"
        assert manifest["host_isa"] == list(hostcpu.BASELINES["x86-64-v3"].extensions)
        assert beyond(image, "x86-64-v3") == {}, name
    assert any("AVX" in beyond(image, "x86-64-v2") for _m, _n, image in payloads)


def test_a_compile_of_the_dsl_s_own_abi_hands_the_caller_the_baseline_code(tmp_path: Path) -> None:
    """b12x compiles without tvm-ffi: the DSL runs its own natively tuned code in the compiling
    process, so the entry gets the baseline's and the caller gets the entry as a hit loads it:
    the compiling process and every later one run the same code (and it runs to the driver)."""
    root = tmp_path / "root"
    compiled = tiny(root, dsl_abi=True, on_miss="compile")
    assert compiled["compiles"] == 1 and "cuda" in compiled.get("raised", "").lower(), compiled
    for manifest, name, image in host_payloads(root):
        assert manifest["tvm_ffi"] is False and manifest["host_cpu"] == "x86-64-v2"
        assert beyond(image, "x86-64-v2") == {}, name
    hit = tiny(root, dsl_abi=True)
    assert hit["hits"] == 1 and hit["compiles"] == 0
    assert (compiled["type"], compiled["engine"]) == (hit["type"], hit["engine"]), (compiled, hit)


# --------------------------------------------------------------------------------------------
# Where the entries load
# --------------------------------------------------------------------------------------------


def test_the_host_code_runs_on_a_cpu_without_avx(tiny_roots: dict[str, Path], tmp_path: Path) -> None:
    """A fresh process on an emulated x86-64-v2 CPU (qemu -cpu Nehalem: no AVX, no AVX-512, and
    a /proc/cpuinfo that says so) hits the portable entry and runs its host code to the CUDA
    driver; the natively tuned entry is refused there (a miss, ON_MISS=error raises), never run."""
    _needs_namespaces()
    qemu = shutil.which("qemu-x86_64-static")
    if qemu is None:
        pytest.skip("qemu-x86_64-static is not installed (scripts/ensure_test_tools.sh installs it)")
    nehalem = seeing(cpuinfo_with_flags(tmp_path / "cpuinfo", NEHALEM_FLAGS))
    served = tiny(tiny_roots["portable"], prefix=[*nehalem, qemu, "-cpu", "Nehalem"])
    assert served["hits"] == 1 and served["compiles"] == 0, served
    assert "cuda" in served.get("raised", "").lower(), served  # its host code ran up to the driver call
    refused = tiny(tiny_roots["native"], prefix=nehalem)
    if "avx" in hostcpu.isa_extensions():
        assert "entry refused" in refused.get("refused", ""), refused
        assert re.search(r"host-cpu: built on a CPU with [^;]*\bavx", refused["stderr"]), refused["stderr"][-2000:]
        assert refused["hits"] == 0


def test_an_avx512_build_box_s_entries_serve_a_cpu_without_it(tmp_path: Path, probe: Any) -> None:
    """The issue's case: a build box with AVX-512 compiles, a serving host without it loads
    every kernel with 0 compiles (counted at the DSL), and ``check`` passes there."""
    build_box, serving = avx512_views(tmp_path)
    root = tmp_path / "root"
    cold = probe(root, 1, prefix=build_box)
    assert cold["counters"]["compiles"] == 1
    served = probe(root, 1, prefix=serving)
    assert served["real_compiles"] == 0 and served["counters"]["hits"] == 1, served["cache_log"]
    checked = subprocess.run([*serving, sys.executable, "-m", "cute_diskcache", "--root", str(root), "check", "qwen3-30b-a3b",
                              "--target", "rtx-pro-6000", "--m", "1", "--no-dense"], capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]


@pytest.mark.slow
def test_the_native_setting_keeps_entries_to_cpus_like_the_build_box(tmp_path: Path, probe: Any) -> None:
    """CUTE_DISKCACHE_HOST_CPU=native: tuned for and recorded as the build CPU, as before; a host
    without its AVX-512 says so and compiles (so the test above can fail)."""
    build_box, serving = avx512_views(tmp_path)
    root = tmp_path / "root"
    probe(root, 1, prefix=build_box, extra_env={"CUTE_DISKCACHE_HOST_CPU": "native"})
    served = probe(root, 1, prefix=serving)
    assert served["counters"]["compiles"] == 1
    assert any("host-cpu" in line and "avx512" in line for line in served["cache_log"]), served["cache_log"]


# --------------------------------------------------------------------------------------------
# Caches written before: kept for the hosts they fit, rebuilt by a prewarm
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_prewarm_over_a_native_entry_rebuilds_it_portable(tmp_path: Path, probe: Any) -> None:
    """A cache of an earlier release (host code tuned for its build CPU, recorded as such) still
    serves the hosts it fits; a prewarm over it rewrites the entry for the baseline."""
    root = tmp_path / "root"
    probe(root, 1, extra_env={"CUTE_DISKCACHE_HOST_CPU": "native"})
    (manifest_path,) = root.glob("v1/*/*/*/manifest.msgpack")
    assert entry.read_manifest(manifest_path.parent)["host_cpu"] == "native"
    assert probe(root, 1)["counters"]["hits"] == 1, "a native entry still serves the CPU it fits"
    plan = ("--model", "qwen3-30b-a3b", "--target", "rtx-pro-6000", "--max-num-tokens", "4096", "--m", "1", "--no-dense")
    # One worker for one kernel: prewarm starts its --jobs workers (each importing flashinfer) before it plans.
    out = prewarm_json(root, *plan, "--jobs", "1")
    assert out["compiled"] == 1 and out["already_cached"] == 0, out
    assert entry.read_manifest(manifest_path.parent)["host_cpu"] == "x86-64-v2"
    # The rebuilt entry is cached for the next prewarm (its dry run marks what a real run skips,
    # without starting workers; real re-runs: tests/test_prewarm.py).
    again = prewarm_json(root, *plan, "--dry-run")
    assert again["already_cached"] == 1 and again["compiled"] == 0, again


# --------------------------------------------------------------------------------------------
# A fleet of two CPU generations on one Redis
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_fleet_of_two_cpu_classes_compiles_once(probe: Any, redis_db: Any, redis_url: str, tmp_path: Path) -> None:
    """A node whose CPU shows AVX-512 compiles and publishes; a node of an older generation,
    with its own empty root, loads the fleet's entry: one compile fleet-wide, both nodes serve."""
    from test_remote_redis import node_env

    newer, older = avx512_views(tmp_path)
    first = probe(tmp_path / "node-new" / "root", 1, prefix=newer, extra_env=node_env(redis_url))
    assert first["real_compiles"] == 1
    second = probe(tmp_path / "node-old" / "root", 1, prefix=older, extra_env=node_env(redis_url))
    assert second["real_compiles"] == 0, second["cache_log"]
    assert second["counters"]["hits"] == 1 and second["counters"]["remote_hits"] == 1, second["counters"]


def test_a_reused_entry_keeps_the_host_code_record_of_its_source(tmp_path: Path) -> None:
    """A kernel linked from another release's entry after an upgrade is the same object: its
    manifest names the same baseline and extensions (synthetic entries, no compile)."""
    import dataclasses

    from _helpers import make_artifact, make_key
    from cute_diskcache.keys.trace import stage_two_key
    from cute_diskcache.storage import reuse
    from cute_diskcache.storage.store import Store
    from test_review_reuse import ACT, CTX, NEW, OLD, ask, engine

    v2 = hostcpu.BASELINES["x86-64-v2"]
    store = Store(tmp_path / "root")
    old = make_key("micro", env=OLD)
    assert store.commit(old, dataclasses.replace(make_artifact(), host_cpu=v2.name, host_isa=v2.extensions)) is not None
    assert reuse.write_record(store, old, stage_two_key(make_key("micro", env=NEW), ACT, CTX))
    assert ask(engine(tmp_path / "root"), "micro", ACT) == ("loaded", old.digest)
    (linked,) = [p.parent for p in (tmp_path / "root").glob("v1/*/*/*/manifest.msgpack") if p.parent.name != old.digest]
    manifest = entry.read_manifest(linked)
    assert manifest["reused_from"]["digest"] == old.digest
    assert (manifest["host_cpu"], manifest["host_isa"]) == ("x86-64-v2", list(v2.extensions))


@pytest.mark.parametrize("asked, rebuilt", [(None, True), ("native", True), ("x86-64-v2", False)],
                         ids=["earlier-release", "asked-native", "dsl-wrote-native-anyway"])
def test_what_a_prewarm_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: str | None, rebuilt: bool) -> None:
    """A prewarm rebuilds an entry tuned beyond the baseline when its writer was asked for
    something else (an earlier release recorded nothing); one whose writer was asked for the
    baseline and could only write native code stays, or every prewarm would compile it again."""
    import dataclasses

    from _helpers import make_artifact, make_key, rewrite_manifest
    from cute_diskcache.storage.store import Refusal, Store

    monkeypatch.delenv("CUTE_DISKCACHE_HOST_CPU", raising=False)
    tuned = ("avx", "avx2", "avx512f", "cx16", "popcnt", "sse", "sse2", "sse4_1", "sse4_2", "ssse3")
    monkeypatch.setattr(hostcpu, "isa_extensions", lambda: tuned)  # the entry fits this CPU
    hostcpu._missing.cache_clear()
    store, key = Store(tmp_path / "root"), make_key("micro")
    assert store.commit(key, dataclasses.replace(make_artifact(), host_cpu="native", host_isa=tuned)) is not None
    manifest = entry.read_manifest(store.entry_dir(key))
    if asked is None:
        manifest.pop("host_cpu_asked")
    else:
        manifest["host_cpu_asked"] = asked
    rewrite_manifest(store.entry_dir(key), manifest)
    assert not isinstance(store.judge(key), Refusal), "serving: a tuned entry that fits this CPU is a hit"
    store.rebuild_tuned_entries()
    verdict = store.judge(key)
    assert isinstance(verdict, Refusal) == rebuilt, verdict
    if rebuilt:
        assert verdict.error.reason == "tuned" and "avx512f" in verdict.error.detail
    hostcpu._missing.cache_clear()
