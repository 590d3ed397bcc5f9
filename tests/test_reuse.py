"""Issue 31: entries that survive a flashinfer upgrade (cute_diskcache.storage.reuse).

A cache filled by flashinfer 0.6.15.post1 (this venv) and then used by 0.6.16.post4 (the version
matrix's cell ``fi0.6.16.post4-dsl4.8.1``, same DSL stack, run with this checkout on its path):
every kernel whose traced IR did not change is served without a compile, from an entry whose
payloads are hard links of the old release's, and whose cubins and host object are byte for byte
what a fresh compile of the new release makes; the next process hits the first stage; the old
namespace can be pruned under it. Real flashinfer, real DSL, each process fresh.

The second generation, 0.7.2.post1 -> 0.7.4 (cells ``fi0.7.2.post1-dsl4.8.1`` and
``fi0.7.4-dsl4.8.1``), a release that changed some kernels: a root prewarmed by 0.7.2.post1
(llama-3.1-8b-nvfp4's 8 b12x FP4 GEMMs for m=1, the four W4A16 kernels), then a 0.7.4 engine
serving both: it compiles only the W4A16 fused-MoE kernel, whose traced IR changed, and reuses
the other 11, cubins byte-identical to 0.7.4's own compile; the next engine hits. Qwen3's MoE
kernels are not in it: 0.7.4 changed every one's traced IR (docs/performance.md), so they compile.

CI cost: the W4A16 cases compile two small kernels (~5 s a process, 4 processes); the MoE case is
``slow`` (prewarm of qwen3-30b-a3b's m=1 micro kernel on both releases and a fresh compile: ~40 s);
the 0.7.x cases are ``slow`` (5 processes, 16 kernels compiled: 75-95 s on 2 cores under load).
The cell's venv is built by ``scripts/compat_matrix.py``'s machinery when missing (the base venv
with torch 2.13.0 CPU from pip's cache, then flashinfer 0.6.16.post4 and the DSL over it).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DRIVER = HERE / "reuse_driver.py"
NEW_CELL = "fi0.6.16.post4-dsl4.8.1"
W4A16 = ["w4a16_activation", "w4a16_topk_sum"]


def _cell_python(name: str) -> str:
    """The interpreter of the version matrix's cell ``name`` (built when missing)."""
    sys.path.insert(0, str(HERE))
    from _compat import SCRATCH, matrix

    m = matrix()
    (cell,) = [c for c in m.CELLS if c.name == name]
    return str(m.cell_venv(cell, SCRATCH))


@pytest.fixture(scope="module")
def new_python() -> str:
    return _cell_python(NEW_CELL)


def _env(root: Path, python: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k != "CUTE_DSL_ARCH"}
    env["CUTE_DISKCACHE_DIR"] = str(root)
    if python != sys.executable:  # a matrix cell's interpreter: this checkout on its path
        env["PYTHONPATH"] = str(REPO)
    return env


def _run(python: str, root: Path, *args: str) -> tuple[dict[str, Any], str]:
    proc = subprocess.run([python, *args], env=_env(root, python), cwd=root.parent, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout.strip()
    return json.loads(out[out.index("{"):] if out.startswith("{") or "\n{" not in out else out[out.rindex("\n{") + 1:]), proc.stderr


def _drive(python: str, root: Path) -> tuple[dict[str, Any], str]:
    return _run(python, root, str(DRIVER), *W4A16)


def _entry(root: Path, digest: str) -> Path:
    (found,) = [p for p in (root / "v1").glob(f"*/{digest[:2]}/{digest}")]
    return found


def _manifest(entry_dir: Path) -> dict[str, Any]:
    from cute_diskcache.storage import entry

    return entry.read_manifest(entry_dir)


def _payload_shas(entry_dir: Path, role: str) -> list[str]:
    m = _manifest(entry_dir)
    return [hashlib.sha256((entry_dir / p["file"]).read_bytes()).hexdigest() for p in m["payloads"][role]]


@pytest.fixture(scope="module")
def upgraded(tmp_path_factory: pytest.TempPathFactory, new_python: str) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("reuse-w4a16")
    root, fresh = base / "root", base / "fresh"
    old, _ = _drive(sys.executable, root)
    import shutil

    shutil.copytree(root, base / "old-only", copy_function=os.link)  # the old release's cache, as it was
    new, new_log = _drive(new_python, root)
    again, _ = _drive(new_python, root)
    alone, _ = _drive(new_python, fresh)  # the new release's own compile, in an empty cache
    return {"root": root, "fresh": fresh, "old_only": base / "old-only", "old": old, "new": new, "new_log": new_log, "again": again, "alone": alone}


def test_upgrade_compiles_nothing_whose_traced_ir_kept(upgraded: dict[str, Any]) -> None:
    old, new = upgraded["old"], upgraded["new"]
    assert old["flashinfer"] == "0.6.15.post1" and new["flashinfer"] == "0.6.16.post4"
    assert old["counters"]["compiles"] == 2
    assert new["counters"]["compiles"] == 0 and new["counters"]["misses"] == 0
    assert new["counters"]["reused"] == 2 and new["counters"]["hits"] == 0
    assert [e["outcome"] for e in new["events"]] == ["reused", "reused"]
    assert new["counters"]["saved_seconds"] > 0
    # the engine's log says where each came from
    assert upgraded["new_log"].count("from flashinfer 0.6.15.post1: same traced IR") == 2


def test_reused_entries_equal_a_fresh_compile_byte_for_byte(upgraded: dict[str, Any]) -> None:
    new, alone = upgraded["new"], upgraded["alone"]
    assert alone["counters"]["compiles"] == 2 and alone["counters"]["reused"] == 0
    for reused, fresh in zip(new["events"], alone["events"]):
        assert reused["digest"] == fresh["digest"]  # the same first-stage key
        a, b = _entry(upgraded["root"], reused["digest"]), _entry(upgraded["fresh"], fresh["digest"])
        assert _payload_shas(a, "cubin") and _payload_shas(a, "cubin") == _payload_shas(b, "cubin")


def test_a_reused_kernel_is_what_a_compile_hands_flashinfer(upgraded: dict[str, Any]) -> None:
    """Side data (issue 28's result, the calling convention) on a second-stage hit: the class
    and public attributes flashinfer gets equal those of the new release's own compile."""
    new, alone = upgraded["new"]["kernels"], upgraded["alone"]["kernels"]
    assert sorted(new) == sorted(alone) == sorted(W4A16)
    for name in W4A16:
        assert new[name]["classes"][0] == alone[name]["classes"][0], name  # a hit: a subclass named like the compile's class
        assert set(alone[name]["classes"][:3]) <= set(new[name]["classes"]), name
        assert new[name]["public"] == alone[name]["public"], name


def test_on_miss_error_serves_what_another_release_compiled(upgraded: dict[str, Any], new_python: str, tmp_path: Path) -> None:
    """CUTE_DISKCACHE_ON_MISS=error refuses to compile, not to reuse: an upgraded engine in that
    mode serves the kernels whose traced IR kept."""
    import shutil

    root = tmp_path / "root"
    shutil.copytree(upgraded["old_only"], root, copy_function=os.link)
    env = {**_env(root, new_python), "CUTE_DISKCACHE_ON_MISS": "error"}
    proc = subprocess.run([new_python, str(DRIVER), *W4A16], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counters = json.loads(proc.stdout.strip().splitlines()[-1])["counters"]
    assert counters["reused"] == 2 and counters["compiles"] == 0 and counters["misses"] == 0


def test_reused_entry_is_hard_linked_and_stands_alone(upgraded: dict[str, Any]) -> None:
    root = upgraded["root"]
    for old_event, new_event in zip(upgraded["old"]["events"], upgraded["new"]["events"]):
        a, b = _entry(root, old_event["digest"]), _entry(root, new_event["digest"])
        assert a.parent.parent.name.startswith("flashinfer-moe-0.6.15.post1-")
        assert b.parent.parent.name.startswith("flashinfer-moe-0.6.16.post4-")
        m = _manifest(b)
        assert m["reused_from"]["digest"] == old_event["digest"]
        assert m["reused_from"]["package"] == "flashinfer-python==0.6.15.post1"
        assert m["env"]["package"] == "flashinfer-python==0.6.16.post4" and m["digest"] == new_event["digest"]
        obj = m["payloads"]["object"][0]["file"]
        assert os.stat(a / obj).st_ino == os.stat(b / obj).st_ino  # a link, no second copy


def test_next_process_hits_the_first_stage(upgraded: dict[str, Any]) -> None:
    again = upgraded["again"]["counters"]
    assert again["hits"] == 2 and again["reused"] == 0 and again["compiles"] == 0 and again["traces"] == 0


def test_first_fill_never_traces(upgraded: dict[str, Any]) -> None:
    """A cache no other release filled: a miss compiles without a trace (records of its own
    release are no reason to look)."""
    assert upgraded["old"]["counters"]["traces"] == 0
    assert upgraded["alone"]["counters"]["traces"] == 0


def test_prune_of_the_old_release_keeps_the_reused_entries(upgraded: dict[str, Any], new_python: str, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "root"
    shutil.copytree(upgraded["root"], root, copy_function=os.link)  # cheap: links again
    old_ns = _entry(root, upgraded["old"]["events"][0]["digest"]).parent.parent
    # prune as the upgraded node runs it: the old release's namespace is another flashinfer's
    proc = subprocess.run([new_python, "-m", "cute_diskcache", "prune", "--root", str(root), "--recent", "0", "--json"],
                          env=_env(root, new_python), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not old_ns.exists()
    after, _ = _drive(new_python, root)
    assert after["counters"]["hits"] == 2 and after["counters"]["compiles"] == 0


@pytest.mark.slow
def test_prewarm_after_an_upgrade_reuses_the_moe_kernel(tmp_path: Path, new_python: str) -> None:
    """The done-when path: prewarm on 0.6.15.post1, prewarm again on 0.6.16.post4: it says it
    reused the kernel (moe_dispatch's micro kernel, m=1) and compiled nothing; the reused entry's
    cubin is the one a fresh compile of 0.6.16.post4 makes."""
    args = ["-m", "cute_diskcache.prewarm", "qwen3-30b-a3b", "--m", "1", "--no-dense", "--target", "rtx-pro-6000", "--jobs", "1", "--json"]
    root, fresh = tmp_path / "root", tmp_path / "fresh"
    old, _ = _run(sys.executable, root, *args, "--root", str(root))
    assert old["compiled"] == 1 and old["reused"] == 0
    new, _ = _run(new_python, root, *args, "--root", str(root))
    assert new["compiled"] == 0 and new["reused"] == 1 and new["failed"] == 0
    (kernel,) = new["kernel_list"]
    assert kernel["kind"] == "micro" and kernel["status"] == "reused"
    alone, _ = _run(new_python, fresh, *args, "--root", str(fresh))
    assert alone["compiled"] == 1
    a, b = _entry(root, kernel["digest"]), _entry(fresh, kernel["digest"])
    assert _payload_shas(a, "cubin") and _payload_shas(a, "cubin") == _payload_shas(b, "cubin")


# --------------------------------------------------------------------------------------------
# 0.7.2.post1 -> 0.7.4: a release that changed some kernels (issue 31's second generation)
# --------------------------------------------------------------------------------------------

OLD_07, NEW_07 = "fi0.7.2.post1-dsl4.8.1", "fi0.7.4-dsl4.8.1"
W4A16_ALL = ["w4a16_gemm", "w4a16_fused_moe", "w4a16_activation", "w4a16_topk_sum"]
#: The one of them whose traced IR 0.7.4 changed (docs/performance.md, bench/upgrade_reuse.py).
W4A16_CHANGED = "w4a16_fused_moe"
#: The dense model's b12x FP4 GEMMs for m=1 as an autotuning engine with 64 tokens asks for them:
#: 8 kernels, every one's traced IR kept by 0.7.4. Prewarm and the engine size them alike.
DENSE_MODEL, DENSE_SIZES = "llama-3.1-8b-nvfp4", ("--m", "1", "--max-num-tokens", "64")
ENGINE = ("--engine", DENSE_MODEL, "--ms", "1", "--max-num-tokens", "64")
W4A16_SITE, DENSE_SITE = "flashinfer.moe_w4a16_compiler.w4a16", "flashinfer.gemm.b12x_fp4"


def _prewarm_dense(python: str, root: Path) -> dict[str, Any]:
    return _run(python, root, "-m", "cute_diskcache.prewarm", DENSE_MODEL, *DENSE_SIZES, "--target", "rtx-pro-6000",
                "--jobs", "1", "--json", "--root", str(root))[0]


def _outcomes(report: dict[str, Any], site: str) -> list[str]:
    return [e["outcome"] for e in report["events"] if e["site"] == site]


def _compiled_by(root: Path, digest: str) -> str:
    """The release whose compile made the entry ``digest``'s payloads: its ``reused_from`` chain
    followed down (a kernel may be reused from an entry that was itself reused)."""
    m = _manifest(_entry(root, digest))
    while "reused_from" in m:
        m = _manifest(_entry(root, m["reused_from"]["digest"]))
    return m["env"]["package"]


@pytest.fixture(scope="module")
def upgraded_07(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A root prewarmed by 0.7.2.post1 (the dense model's GEMMs by prewarm, the W4A16 kernels by a
    process asking flashinfer for them), then served by a 0.7.4 engine (the dense model, then the
    W4A16 kernels), twice; and the same 0.7.4 engine in an empty root. ~75 s on 2 cores."""
    old_python, new_python = _cell_python(OLD_07), _cell_python(NEW_07)
    base = tmp_path_factory.mktemp("reuse-07x")
    root, fresh = base / "root", base / "fresh"
    old_prewarm = _prewarm_dense(old_python, root)
    old_w4a16, _ = _run(old_python, root, str(DRIVER), *W4A16_ALL)
    new, new_log = _run(new_python, root, str(DRIVER), *W4A16_ALL, *ENGINE)
    again, _ = _run(new_python, root, str(DRIVER), *W4A16_ALL, *ENGINE)
    alone, _ = _run(new_python, fresh, str(DRIVER), *W4A16_ALL, *ENGINE)  # nothing to look up: all compiled
    return {"root": root, "fresh": fresh, "old_prewarm": old_prewarm, "old_w4a16": old_w4a16, "new": new,
            "new_log": new_log, "again": again, "alone": alone}


@pytest.mark.slow
def test_07x_upgrade_compiles_only_the_kernels_whose_traced_ir_changed(upgraded_07: dict[str, Any]) -> None:
    old_prewarm, old_w4a16, new = upgraded_07["old_prewarm"], upgraded_07["old_w4a16"], upgraded_07["new"]
    assert old_w4a16["flashinfer"] == "0.7.2.post1" and new["flashinfer"] == "0.7.4"
    assert old_prewarm["kernels"] == old_prewarm["compiled"] == 8 and old_w4a16["counters"]["compiles"] == 4
    # the 8 GEMMs kept their traced IR: none compiled; 3 W4A16 kernels reused, the changed one compiled
    assert _outcomes(new, DENSE_SITE) == ["reused"] * 8
    assert _outcomes(new, W4A16_SITE) == ["miss" if name == W4A16_CHANGED else "reused" for name in W4A16_ALL]
    assert new["counters"]["compiles"] == 1 and new["counters"].get("reused") == 11 and new["counters"]["hits"] == 0
    dense = [e["digest"] for e in new["events"] if e["site"] == DENSE_SITE]
    assert {_compiled_by(upgraded_07["root"], d) for d in dense} == {"flashinfer-python==0.7.2.post1"}
    # the engine's log says where each W4A16 kernel came from
    lines = [ln for ln in upgraded_07["new_log"].splitlines() if f"reused {W4A16_SITE} kernel" in ln]
    assert len(lines) == 3 and all("from flashinfer 0.7.2.post1: same traced IR" in ln for ln in lines), lines


@pytest.mark.slow
def test_07x_reused_entries_equal_a_fresh_compile_byte_for_byte(upgraded_07: dict[str, Any]) -> None:
    new, alone = upgraded_07["new"], upgraded_07["alone"]
    assert alone["counters"]["compiles"] == 12 and alone["counters"].get("reused", 0) == 0
    assert [e["digest"] for e in new["events"]] == [e["digest"] for e in alone["events"]]  # the same first-stage keys
    for event in new["events"]:
        a, b = _entry(upgraded_07["root"], event["digest"]), _entry(upgraded_07["fresh"], event["digest"])
        assert _payload_shas(a, "cubin") and _payload_shas(a, "cubin") == _payload_shas(b, "cubin"), event


@pytest.mark.slow
def test_07x_next_engine_hits_the_first_stage(upgraded_07: dict[str, Any]) -> None:
    again = upgraded_07["again"]
    assert _outcomes(again, DENSE_SITE) == ["hit"] * 8 and _outcomes(again, W4A16_SITE) == ["hit"] * 4
    assert again["counters"]["compiles"] == 0 and again["counters"].get("reused", 0) == 0 and again["counters"].get("traces", 0) == 0


#: A fresh process asking for W4A16 kernels that counts how often the DSL traced one (every entry
#: into ``CompileCallable._compile``: a trace that stops raises, a compile returns).
TRACES_CHILD = '''
import json, sys
import cute_diskcache
cute_diskcache.install(target="rtx-pro-6000")
sys.path.insert(0, sys.argv[1])
import compat_child
from cutlass.base_dsl.compiler import CompileCallable
from cute_diskcache.core.cache import default_cache

entered = {"n": 0, "depth": 0}
real = CompileCallable._compile

def counted(self, *a, **k):
    entered["depth"] += 1
    entered["n"] += entered["depth"] == 1
    try:
        return real(self, *a, **k)
    finally:
        entered["depth"] -= 1

CompileCallable._compile = counted
for name in sys.argv[2:]:
    compat_child._w4a16_compile(name)
print(json.dumps({"dsl_traces": entered["n"], "counters": default_cache().counters.as_dict(),
                  "events": [e[2] for e in default_cache().events]}))
'''


def test_a_kernel_traced_for_the_second_stage_and_not_found_is_lowered_from_that_trace(
        tmp_path: Path, new_python: str) -> None:
    """An upgrade never costs more than an empty cache: a kernel the other release never compiled is
    traced once for its second-stage key and lowered from that same trace (a separate compile traced
    it again: 0.7.2.post1 -> 0.7.4 took 1.11x the empty start)."""
    root = tmp_path / "root"
    _run(sys.executable, root, str(DRIVER), "w4a16_activation")  # the old release's records: a lookup is possible
    records = lambda: sorted(p.name for p in (root / "reuse").rglob("*") if p.is_file() and p.parent.name != "from")  # noqa: E731
    before = records()
    new, _ = _run(new_python, root, "-c", TRACES_CHILD, str(REPO / "scripts"), "w4a16_topk_sum")
    assert new["events"] == ["miss"] and new["counters"]["compiles"] == 1 and new["counters"]["traces"] == 1, new
    assert new["dsl_traces"] == 1, f"the DSL traced the kernel {new['dsl_traces']} times for one compile"
    assert len(records()) == len(before) + 1  # what it lowered is recorded for the next release
