"""flashinfer 0.7.4, a real install in a second interpreter: every sm12x MoE site, native ones too.

Every check runs in fresh child processes of ``$CUTE_DISKCACHE_FI074_PYTHON`` (a venv with
flashinfer 0.7.4, the same DSL and this checkout installed; ``scripts/make_fi074_venv.sh``
makes one), driving flashinfer's own entry points on CPU tensors for the ``rtx-pro-6000``
profile (``tests/fi074_driver.py``, ``python -m cute_diskcache._probe`` and ``prewarm``).
Real compiles are counted in the child independently of our counters (conftest's
``sitecustomize``). The module pays for one cold and one warm run of all twelve sites and
reuses them; the three sites flashinfer caches natively (served from our cache unless
``CUTE_DISKCACHE_NATIVE_SITES=flashinfer``) get their own runs. About three minutes on two cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
#: The flashinfer 0.7.4 interpreter: $CUTE_DISKCACHE_FI074_PYTHON, else a venv this module builds
#: once with scripts/make_fi074_venv.sh (about a minute; reused afterwards), so the README's one
#: test command covers both flashinfer generations. CUTE_DISKCACHE_FI074_PYTHON=off skips.
FI074: str | None = os.environ.get("CUTE_DISKCACHE_FI074_PYTHON") or str(REPO / ".venv-fi074" / "bin" / "python")
pytestmark = [
    pytest.mark.skipif(FI074 == "off", reason="CUTE_DISKCACHE_FI074_PYTHON=off: flashinfer 0.7.4 tests skipped"),
    pytest.mark.slow,
]
DRIVER = Path(__file__).resolve().parent / "fi074_driver.py"
TARGET = "rtx-pro-6000"
TIMEOUT_S = 600
_DROPPED_ENV = re.compile(r"^(CUTE_DISKCACHE_.*|FLASHINFER_B12X_DISK_CACHE|CUTE_DSL_ARCH|FLASHINFER_CUTE_DSL_DISABLE_CACHE)$")
_COUNT_LINE = re.compile(r"^cdc-test real compiles: (\d+)$", re.M)

#: driver site name -> the site name our manifests carry.
SITES = {
    "direct_micro": "flashinfer.moe_direct_micro_kernel.direct_micro",
    "w4a16": "flashinfer.moe_w4a16_compiler.w4a16",
    "w4a4": "flashinfer.moe_nvfp4_w4a4.w4a4",
    "nvfp4_w4a16": "flashinfer.moe_nvfp4_w4a16.nvfp4_w4a16",
    **{
        f"{fmt}_{op}": f"flashinfer.moe_{fmt}_{op}.{fmt}_{op}"
        for fmt in ("fp8", "mxfp8_mxfp4")
        for op in ("fc1_act", "fc1_act_q1", "fc2_finalize", "gemm")
    },
}
TVM_FFI_SITES = ("w4a4", "nvfp4_w4a16")  # their launch error prints the kernel's signature
OP_SITES = tuple(name for name in SITES if name.startswith(("fp8_", "mxfp8_")))
#: The three kernels flashinfer 0.7.4 persists itself (moe_dispatch, build_and_load_cute_dsl_kernel);
#: we serve them unless CUTE_DISKCACHE_NATIVE_SITES=flashinfer (OPT_OUT).
NATIVE_SITES = {"moe_dispatch.py:_get_static_kernel", "moe_dispatch.py:_get_micro_kernel", "moe_dispatch.py:_get_dynamic_kernel"}
NATIVE_MICRO, NATIVE_STATIC = "flashinfer.moe_dispatch.micro", "flashinfer.moe_dispatch.static"
OPT_OUT = {"CUTE_DISKCACHE_NATIVE_SITES": "flashinfer"}


def _env(root: Path, workspace: Path, hook_dir: Path, front: tuple[Path, ...] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env["CUTE_DISKCACHE_DIR"] = str(root)
    env["FLASHINFER_WORKSPACE_BASE"] = str(workspace)  # flashinfer's native cache: per test
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*map(str, front), str(hook_dir), str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd)
    if proc.returncode != 0:
        pytest.fail(f"exited {proc.returncode}: {' '.join(cmd)}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def _json_report(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        pytest.fail(f"no JSON report\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    counted = _COUNT_LINE.findall(proc.stderr)
    out["real_compiles"] = int(counted[-1]) if counted else None
    out["stderr"] = proc.stderr
    return out


class Child:
    """Runs 0.7.4 children against one cache root and one flashinfer workspace.

    ``extra_env`` is added to the child's environment; ``front`` goes first on its PYTHONPATH.
    """

    def __init__(self, root: Path, workspace: Path, hook_dir: Path, *,
                 extra_env: dict[str, str] | None = None, front: tuple[Path, ...] = ()) -> None:
        self.root, self.workspace, self.hook_dir = root, workspace, hook_dir
        self.extra_env, self.front = dict(extra_env or {}), front

    def env(self) -> dict[str, str]:
        return {**_env(self.root, self.workspace, self.hook_dir, self.front), **self.extra_env}

    def driver(self, *sites: str, args: tuple[str, ...] = ()) -> dict[str, Any]:
        cmd = [str(FI074), str(DRIVER), "--target", TARGET, *args, *sites]
        return _json_report(_run(cmd, self.env(), self.hook_dir))

    def module(self, *args: str) -> subprocess.CompletedProcess[str]:
        return _run([str(FI074), "-m", *args], self.env(), self.hook_dir)


def _manifests(root: Path) -> dict[str, dict[str, Any]]:
    """site name -> manifest of every committed entry (one per site in these roots)."""
    from cute_diskcache.storage import entry

    out = {}
    for path in root.glob("v1/*/*/*/manifest.msgpack"):
        manifest = entry.unpack_manifest(path.read_bytes())
        manifest["_path"] = path
        out.setdefault(manifest["site"], manifest)
    return out


def _native_objects(workspace: Path) -> dict[str, tuple[int, int]]:
    """flashinfer's own cache of the sm12x MoE module: relative path -> (size, mtime_ns)."""
    return {str(p.relative_to(workspace)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in workspace.rglob("cached_ops/b12x_moe_*/*") if p.is_file()}


def _by_site(report: dict[str, Any]) -> dict[str, list[str]]:
    """site name -> outcomes ("hit" / "miss") of the cache events in a child report."""
    out: dict[str, list[str]] = {}
    for site, _digest, outcome, *_ in report["events"]:
        out.setdefault(site, []).append(outcome)
    return out


# --------------------------------------------------------------------------------------------
# One cold and one warm run of every site, shared by the module
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fi074(compile_hook_dir: Path) -> str:
    """The 0.7.4 interpreter, checked: flashinfer 0.7.4 and this checkout's cute_diskcache."""
    if not os.environ.get("CUTE_DISKCACHE_FI074_PYTHON"):
        venv = Path(str(FI074)).parent.parent
        build = subprocess.run(["bash", str(REPO / "scripts" / "make_fi074_venv.sh"), str(venv)],
                               capture_output=True, text=True, timeout=1200)
        assert build.returncode == 0, f"building the flashinfer 0.7.4 venv failed:\n{build.stderr[-4000:]}"
    proc = subprocess.run(
        [str(FI074), "-c", "import importlib.metadata as m, json, cute_diskcache; "
         "print(json.dumps([m.version('flashinfer-python'), cute_diskcache.__file__]))"],
        env=_env(compile_hook_dir / "unused", compile_hook_dir / "unused", compile_hook_dir),
        capture_output=True, text=True, timeout=120, cwd=compile_hook_dir,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, package_file = json.loads(proc.stdout.strip().splitlines()[-1])
    assert version == "0.7.4", f"{FI074} has flashinfer {version}, not 0.7.4"
    assert Path(package_file).resolve().is_relative_to(REPO), f"{FI074} imports cute_diskcache from {package_file}, not this checkout"
    return str(FI074)


@pytest.fixture(scope="module")
def shared(fi074: str, tmp_path_factory: pytest.TempPathFactory, compile_hook_dir: Path) -> dict[str, Any]:
    """Cold (empty root) then warm (fresh process, same root) over all twelve sites."""
    base = tmp_path_factory.mktemp("fi074")
    child = Child(base / "root", base / "workspace", compile_hook_dir)
    cold = child.driver(*SITES)
    manifests_after_cold = {s: m["_path"].read_bytes() for s, m in _manifests(child.root).items()}
    warm = child.driver(*SITES)
    return {"child": child, "cold": cold, "warm": warm, "manifest_bytes": manifests_after_cold}


def test_every_site_misses_cold_then_hits_warm_with_zero_compiles(shared: dict[str, Any]) -> None:
    cold, warm = shared["cold"], shared["warm"]
    assert cold["flashinfer"] == warm["flashinfer"] == "0.7.4"
    cold_by, warm_by = _by_site(cold), _by_site(warm)
    for name, site in SITES.items():
        assert cold_by.get(site) == ["miss"], (name, cold_by.get(site))
        assert warm_by.get(site) == ["hit"], (name, warm_by.get(site))
    assert cold["counters"]["compiles"] == cold["counters"]["writes"] == len(SITES), cold["counters"]
    assert cold["real_compiles"] == len(SITES)  # one real compile per site, nothing else compiled
    assert warm["counters"]["compiles"] == 0 and warm["counters"]["hits"] == len(SITES), warm["counters"]
    assert warm["real_compiles"] == 0, warm["stderr"][-3000:]
    assert set(_manifests(shared["child"].root)) == set(SITES.values())


def test_warm_kernels_answer_launches_like_the_compiled_ones(shared: dict[str, Any]) -> None:
    """Without a GPU every launch fails after the compile or load: with the same error.

    The tvm-ffi runners' error spells out the kernel's whole argument signature, so equal text
    there is the CPU-side proof that the loaded kernel has the compiled kernel's ABI (and that
    it was compiled for CUDA tensors: the CPU tensors we pass are refused).
    """
    cold, warm = shared["cold"]["sites"], shared["warm"]["sites"]
    for name in SITES:
        assert cold[name]["error"] and cold[name]["error"] == warm[name]["error"], name
    for name in TVM_FFI_SITES:
        assert "expected device_type=cuda" in cold[name]["error"], cold[name]["error"]


def test_keys_carry_the_site_key_and_the_core_environment(shared: dict[str, Any]) -> None:
    manifests = _manifests(shared["child"].root)
    for site, manifest in manifests.items():
        env = manifest["env"]
        assert env["kind"] == "flashinfer-moe" and env["package"] == "flashinfer-python==0.7.4", site
        assert env["arch"] == "sm_120a" and manifest["namespace"].startswith("flashinfer-moe-0.7.4-sm_120a-"), site
    # One key for every site (issue 22): what the compile received, named by the site it came from.
    for name, site in SITES.items():
        key_repr = manifests[site]["key_repr"]
        assert key_repr.startswith("('compile', 'fused_moe/cute_dsl/blackwell_sm12x/"), (name, key_repr[:200])
    direct = manifests[SITES["direct_micro"]]["key_repr"]
    assert "moe_direct_micro_kernel.py:compile_direct_micro_kernel" in direct and "('object', 'flashinfer." in direct
    assert "moe_w4a16_compiler.py:compile" in manifests[SITES["w4a16"]]["key_repr"]
    assert "OptLevel" in manifests[SITES["w4a16"]]["options"]  # cute.compile[OptLevel(3)]: the subscript is keyed
    for name in OP_SITES:
        # flashinfer's in-process op key has no n and k; what the compile receives has them
        # (test_other_n_is_a_miss_not_a_wrong_hit proves they separate entries).
        assert "('object', 'flashinfer.fused_moe.cute_dsl.blackwell_sm12x.kernel_moe_" in manifests[SITES[name]]["key_repr"]
    # Sites compiled against (CPU) tensors presented as CUDA ones compile for global memory, as on
    # the card: their kernels expect CUDA tensors (test_warm_kernels_answer_launches_like_the_compiled_ones).
    assert "@generic" not in manifests[SITES["w4a4"]]["key_repr"]
    # Each site's sources fingerprint is its own module's, so namespaces differ by site family.
    assert manifests[SITES["fp8_gemm"]]["env"]["sources"] != manifests[SITES["w4a4"]]["env"]["sources"]


def _cubins(entry_dir: Path) -> list[bytes]:
    from cute_diskcache.storage import elf

    return [c for path in sorted(entry_dir.iterdir()) if path.is_file() for c in elf.cubins_in(path.read_bytes())]


def test_other_n_shares_the_entry_because_the_compile_is_the_same(shared: dict[str, Any], tmp_path: Path) -> None:
    """flashinfer's in-process op key has no n and k, and neither has what the compile receives
    (n and k are dynamic extents of the sample tensors): one kernel serves every width, in
    flashinfer's memory and, keyed by what the compile receives, on our disk (the hand-written key
    this replaced added n and k and compiled one kernel per width). That sharing is right: a cold
    compile for the other n, in an empty cache, builds the very same cubin."""
    child: Child = shared["child"]
    other = child.driver("fp8_gemm", args=("--n", "256"))
    assert _by_site(other) == {SITES["fp8_gemm"]: ["hit"]} and other["real_compiles"] == 0
    fresh = Child(tmp_path / "root", tmp_path / "workspace", child.hook_dir)
    cold = fresh.driver("fp8_gemm", args=("--n", "256"))
    assert _by_site(cold) == {SITES["fp8_gemm"]: ["miss"]} and cold["real_compiles"] == 1
    shared_entry = _manifests(child.root)[SITES["fp8_gemm"]]
    fresh_entry = _manifests(fresh.root)[SITES["fp8_gemm"]]
    assert fresh_entry["_path"].parent.name == shared_entry["_path"].parent.name  # the same key
    cubins = _cubins(fresh_entry["_path"].parent)
    assert cubins and cubins == _cubins(shared_entry["_path"].parent)


def test_block_dim_probe_is_stored_and_comes_back_identical(shared: dict[str, Any]) -> None:
    cold, warm = shared["cold"], shared["warm"]
    manifest = _manifests(shared["child"].root)[SITES["direct_micro"]]
    probe = manifest["extra"]["block_dim_probe"]
    # Compiled for a target profile: no driver, so the answer comes from the cubin, as the
    # driver computes it (registers against 64 Ki per block, capped by reqntid).
    assert probe["source"] == "cubin" and probe["target"] == TARGET
    assert probe["block_dim"] == 512 and probe["cubin"]["ntid"] == 512 and 0 < probe["cubin"]["regs"] <= 255
    assert probe["accepts"] is (probe["cubin"]["max_threads"] >= 512)
    assert cold["probes"] == [512], "one probe, at compile time"
    assert cold["block_dim_accepts"] == [probe["accepts"]]
    # The hit hands flashinfer the stored answer and never probes again.
    assert warm["probes"] == []
    assert warm["block_dim_accepts"] == cold["block_dim_accepts"]
    # The warm run left the stored side data as it was.
    assert manifest["_path"].read_bytes() == shared["manifest_bytes"][SITES["direct_micro"]]


def test_block_dim_answer_comes_from_disk(shared: dict[str, Any], tmp_path: Path) -> None:
    """Flip the stored answer: a hit must give flashinfer the stored value, not a fresh probe.

    flashinfer then refuses the direct micro kernel and falls back to the MMA micro kernel, one
    of its natively cached sites, which we serve: that is the one compile, into our cache.
    """
    from cute_diskcache.storage import entry

    child: Child = shared["child"]
    root = tmp_path / "root"
    shutil.copytree(child.root, root)
    manifest = _manifests(root)[SITES["direct_micro"]]
    path = manifest.pop("_path")
    assert manifest["extra"]["block_dim_probe"]["accepts"] is True
    manifest["extra"]["block_dim_probe"]["accepts"] = False
    path.write_bytes(entry.pack_manifest(manifest))
    tampered = Child(root, tmp_path / "workspace", child.hook_dir).driver("direct_micro")
    assert _by_site(tampered) == {SITES["direct_micro"]: ["hit"], NATIVE_MICRO: ["miss"]}
    assert tampered["block_dim_accepts"] == [False] and tampered["probes"] == []
    assert tampered["kernels"]["micro"] == 1  # flashinfer's fallback
    assert tampered["counters"]["compiles"] == 1 and tampered["native_events"] == []
    assert tampered["real_compiles"] == 1  # the micro kernel, nothing else
    assert NATIVE_MICRO in _manifests(root) and not _native_objects(tmp_path / "workspace")


# --------------------------------------------------------------------------------------------
# flashinfer's native sites (static, micro, dynamic): served from our cache, or left to flashinfer
# --------------------------------------------------------------------------------------------


@pytest.fixture
def gpu_torch(tmp_path: Path) -> Path:
    """A directory that makes a child see another torch build, as the GPU box's CUDA torch.

    flashinfer's native fingerprint hashes the version and RECORD of every installed torch
    distribution; a ``torch-2.13.0+cu130.dist-info`` first on the child's path changes it (and
    ``importlib.metadata.version("torch")``) while the torch code that runs stays the same.
    """
    dist = tmp_path / "gpu-torch" / "torch-2.13.0+cu130.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cu130\n")
    (dist / "RECORD").write_text("torch/__init__.py,sha256=not-the-cpu-build,1\n")
    return dist.parent


def test_prewarm_puts_native_sites_in_our_cache_and_another_torch_build_hits(
        fi074: str, tmp_path: Path, compile_hook_dir: Path, gpu_torch: Path) -> None:
    """Qwen3-235B-A22B at TP 4 (n=384): m=1 takes the direct micro kernel, m=9 a static one.

    The static kernel is one flashinfer caches natively, keyed on torch's build; prewarmed into
    our cache it hits in a fresh process that sees another torch build, with flashinfer's own
    cache directory never written on either side.

    Four interpreters: the prewarm and its one worker (its report carries the plan a dry run
    prints), the serving probe, a dry run afterwards. A prewarm starts its ``--jobs`` workers,
    each importing flashinfer, before it plans, even when nothing is missing: the re-run is a
    dry run, and what it marks cached is what a real run skips (tests/test_prewarm.py and
    tests/test_prewarm_functional.py re-run real prewarms).
    """
    child = Child(tmp_path / "root", tmp_path / "workspace", compile_hook_dir)
    args = ["cute_diskcache.prewarm", "--model", "qwen3-235b-a22b", "--tp", "4", "--target", TARGET,
            "--max-num-tokens", "4096", "--m", "1,9", "--json"]
    done = json.loads(child.module(*args, "--jobs", "1").stdout)
    assert done["by_kind"] == {"direct_micro": 1, "static": 1}, done
    assert not any(k["native"] for k in done["kernel_list"])  # ours to serve, not flashinfer's to persist
    assert done["failed"] == 0 and done["compiled"] == 2, done
    assert set(_manifests(child.root)) == {SITES["direct_micro"], NATIVE_STATIC}
    assert _native_objects(child.workspace) == {}, "flashinfer's own cache was written"

    serving = Child(child.root, tmp_path / "gpu-workspace", compile_hook_dir, front=(gpu_torch,))
    served = _json_report(serving.module("cute_diskcache._probe", "--target", TARGET, "--shape", "128,8,4096,384",
                                         "--max-num-tokens", "4096", "--m", "1", "9"))
    assert served["real_compiles"] == 0, served["stderr"][-3000:]
    assert served["counters"]["hits"] == 2 and served["counters"]["compiles"] == 0
    assert {e[0] for e in served["events"]} == {SITES["direct_micro"], NATIVE_STATIC}
    assert [e for r in served["records"] for e in r["native"]] == []  # flashinfer's builder never ran
    assert _native_objects(serving.workspace) == {}
    again = json.loads(child.module(*args, "--dry-run").stdout)
    assert again["by_kind"] == done["by_kind"] and not any(k["native"] for k in again["kernel_list"]), again
    assert again["already_cached"] == 2 and again["compiled"] == 0, again


def test_native_site_key_ignores_torch_and_flashinfers_cache_is_neither_read_nor_written(
        fi074: str, tmp_path: Path, compile_hook_dir: Path, gpu_torch: Path) -> None:
    """The opt-out path first (flashinfer's own cache, as before), then ours on the same workspace.

    1. ``CUTE_DISKCACHE_NATIVE_SITES=flashinfer``: flashinfer builds and persists the micro
       kernel itself; nothing of ours is involved.
    2. Same, seeing another torch build: flashinfer's fingerprint changes and it compiles again
       (and rewrites its module directory): the miss this strategy exists for.
    3. Ours, on that same workspace: a miss of ours. flashinfer's valid entry is not consulted
       and its files are left byte-for-byte and time-for-time as they were.
    4. Ours, fresh process, the other torch build: a hit, same digest, zero compiles.
    """
    root, ws = tmp_path / "root", tmp_path / "workspace"
    native = Child(root, ws, compile_hook_dir, extra_env=OPT_OUT).driver("native_micro")
    assert native["serving_native"] is False and native["events"] == []
    assert [(e["kind"], e["outcome"]) for e in native["native_events"]] == [("native-micro", "miss")]
    assert native["real_compiles"] == 1
    assert any(p.endswith(".o") and "/micro_" in p for p in _native_objects(ws)), _native_objects(ws)

    rebuilt = Child(root, ws, compile_hook_dir, extra_env=OPT_OUT, front=(gpu_torch,)).driver("native_micro")
    assert rebuilt["native_torch_fingerprint"] != native["native_torch_fingerprint"]
    assert [(e["kind"], e["outcome"]) for e in rebuilt["native_events"]] == [("native-micro", "miss")]
    assert rebuilt["real_compiles"] == 1

    before = _native_objects(ws)
    ours = Child(root, ws, compile_hook_dir).driver("native_micro")
    assert ours["serving_native"] is True and ours["native_events"] == []
    assert _by_site(ours) == {NATIVE_MICRO: ["miss"]} and ours["real_compiles"] == 1
    assert ours["counters"]["compiles"] == ours["counters"]["writes"] == 1
    assert _native_objects(ws) == before, "flashinfer's cache was touched while we served its site"
    manifest = _manifests(root)[NATIVE_MICRO]
    # Keyed like every site, by what its compile receives (through the hook, under our builder).
    assert manifest["key_repr"].startswith("('compile', 'fused_moe/cute_dsl/blackwell_sm12x/moe_dispatch.py:_get_micro_kernel', "
                                           "'_get_micro_kernel.<locals>.<lambda>'"), manifest["key_repr"][:300]
    assert "torch" not in json.dumps(manifest["env"]), manifest["env"]

    warm = Child(root, tmp_path / "gpu-workspace", compile_hook_dir, front=(gpu_torch,)).driver("native_micro")
    assert warm["native_torch_fingerprint"] == rebuilt["native_torch_fingerprint"] != ours["native_torch_fingerprint"]
    assert _by_site(warm) == {NATIVE_MICRO: ["hit"]} and warm["events"][0][1] == ours["events"][0][1]
    assert warm["real_compiles"] == 0 and warm["counters"]["compiles"] == 0, warm["stderr"][-3000:]
    # The loaded kernel has the compiled one's signature (the CPU launch error spells it out).
    assert warm["sites"]["native_micro"]["error"] == ours["sites"]["native_micro"]["error"] == native["sites"]["native_micro"]["error"]
    assert _native_objects(tmp_path / "gpu-workspace") == {}


def test_prewarm_refuses_w4a16_offline_with_the_reason(fi074: str, tmp_path: Path, compile_hook_dir: Path) -> None:
    """0.7.4 decides W4A16 routes on ``topk_ids.is_cuda``: a CPU plan would silently miss kernels."""
    cfg = tmp_path / "model"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "hidden_size": 2048, "quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"},
    }))
    child = Child(tmp_path / "root", tmp_path / "workspace", compile_hook_dir)
    proc = subprocess.run([fi074, "-m", "cute_diskcache.prewarm", "--model", str(cfg), "--target", TARGET,
                           "--max-num-tokens", "64", "--dry-run"], env=child.env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=compile_hook_dir)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "no exact offline plan" in proc.stderr and "W4A16" in proc.stderr


def test_prewarm_says_why_flashinfer_refuses_a_model_without_a_traceback(fi074: str, tmp_path: Path, compile_hook_dir: Path) -> None:
    """0.7.4's b12x NVFP4 MoE refuses gpt-oss-120b's hidden size 2880 with a ValueError from its own
    validation; prewarm printed that as a traceback. Now it is prewarm's refusal (exit 2, one line).
    Our own ValueErrors still show their traceback (only flashinfer's frame makes it a refusal)."""
    child = Child(tmp_path / "root", tmp_path / "workspace", compile_hook_dir)
    proc = subprocess.run([fi074, "-m", "cute_diskcache.prewarm", "--model", "gpt-oss-120b", "--target", TARGET,
                           "--max-num-tokens", "64", "--dry-run"], env=child.env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=compile_hook_dir)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "flashinfer cannot serve" in proc.stderr and "hidden_size (2880) must be a multiple of 128" in proc.stderr


# --------------------------------------------------------------------------------------------
# doctor
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def doctor_074(fi074: str, tmp_path_factory: pytest.TempPathFactory, compile_hook_dir: Path) -> dict[str, Any]:
    """``doctor --json`` on 0.7.4 over an empty root, as served and with the opt-out, once per run:
    this module reads its MoE sites, tests/test_flashinfer_074_dense.py the rest. Each run is a
    fresh interpreter importing and scanning all of flashinfer; the two modules asked the same
    questions of the same install. Read it, never change it."""
    from conftest import once_per_run

    def build(d: Path) -> dict[str, Any]:
        child = Child(d / "root", d / "workspace", compile_hook_dir)
        opt_out = Child(child.root, child.workspace, compile_hook_dir, extra_env=OPT_OUT)
        return {"root": str(child.root), "workspace": str(child.workspace),
                "served": json.loads(child.module("cute_diskcache.cli.doctor", "--json").stdout),
                "opt_out": json.loads(opt_out.module("cute_diskcache.cli.doctor", "--json").stdout)}

    return once_per_run(tmp_path_factory, "fi074-doctor", build)[1]


def test_doctor_on_074(doctor_074: dict[str, Any], compile_hook_dir: Path) -> None:
    child = Child(Path(doctor_074["root"]), Path(doctor_074["workspace"]), compile_hook_dir)
    report = doctor_074["served"]
    assert report["flashinfer"] == "0.7.4" and report["verified"] is True
    # The MoE package's sites (doctor scans all of flashinfer: the rest is checked in
    # tests/test_flashinfer_074_dense.py).
    moe = [s for s in report["sites"] if s["path"].startswith("fused_moe/cute_dsl/blackwell_sm12x/")]
    status = {f"{s['file']}:{s['function']}": s["status"] for s in moe}
    assert report["native_sites"] == "cute-diskcache"
    assert {site for site, st in status.items() if st == "flashinfer"} == set()
    assert [s for s, st in status.items() if st == "nothing"] == []
    ours = {site for site, st in status.items() if st == "cute-diskcache"}
    assert NATIVE_SITES <= ours
    assert {"moe_direct_micro_kernel.py:compile_direct_micro_kernel", "moe_w4a16_compiler.py:compile",
            "moe_nvfp4_w4a4.py:run_moe_w4a4", "moe_nvfp4_w4a16.py:run_moe_w4a16"} <= ours
    assert {f"moe_{name}.py:compiled_kernel" for name in OP_SITES} <= ours
    # moe_w4a16_kernel compiles through the W4A16 wrapper, so it is covered through it.
    assert {s for s in ours if s.startswith("moe_w4a16_kernel.py:")} == {
        f"moe_w4a16_kernel.py:compile_w4a16_{k}" for k in ("gemm", "fused_moe", "activation", "topk_sum")}
    assert report["missing_adapter_sites"] == []
    assert report["root"] == str(child.root) and report["native_cache_dir"].startswith(str(child.workspace))
    assert len(status) == 19 and set(status.values()) == {"cute-diskcache"}
    text = child.module("cute_diskcache.cli.doctor").stdout
    assert "native sites   served by cute-diskcache" in text
    left = doctor_074["opt_out"]
    assert left["native_sites"] == "flashinfer"
    left_moe = [s for s in left["sites"] if s["path"].startswith("fused_moe/cute_dsl/blackwell_sm12x/")]
    assert {f"{s['file']}:{s['function']}" for s in left_moe if s["status"] == "flashinfer"} == NATIVE_SITES
    assert {f"{s['file']}:{s['function']}" for s in left_moe if s["status"] == "nothing"} == set()
