"""SGLang's own CuTe-DSL compiles through the same hook (issue 41): its adapter, its ``cute_aot``
cache standing aside for the FA4 kernels, and ``doctor``'s SGLang block.

SGLang 0.5.23 pins flashinfer 0.7.2 and DSL 4.8.0 and requires a CUDA torch, so everything that
imports SGLang runs in a second interpreter (``scripts/make_sglang_venv.sh``: SGLang over the
matrix's fi0.7.2-dsl4.8.0 cell, a CPU torch), found through ``CUTE_DISKCACHE_SGLANG_PYTHON`` or
built on first use, once per machine. SGLang and the DSL are real: the slow tests drive SGLang's
FA4 SM12x decode path as its FlashAttention backend calls it (:mod:`sglang_driver`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRATCH = Path(os.environ.get("CUTE_DISKCACHE_COMPAT_SCRATCH") or Path.home() / ".cache" / "cute-diskcache" / "compat")
SGLANG_PY: str = os.environ.get("CUTE_DISKCACHE_SGLANG_PYTHON") or str(SCRATCH / "sglang-0.5.23" / "bin" / "python")
TIMEOUT_S = 300
FWD, COMBINE = "sglang.fa4.flash_fwd.FlashAttentionForwardSm120", "sglang.fa4.flash_fwd_combine.FlashAttentionForwardCombine"

pytestmark = pytest.mark.skipif(SGLANG_PY == "off", reason="CUTE_DISKCACHE_SGLANG_PYTHON=off: SGLang tests skipped")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import child_env, split_stderr  # noqa: E402


@pytest.fixture(scope="module")
def sglang_python() -> str:
    """The SGLang interpreter, checked: SGLang 0.5.23 over flashinfer 0.7.2, DSL 4.8.0, a CPU torch."""
    if not os.environ.get("CUTE_DISKCACHE_SGLANG_PYTHON"):
        build = subprocess.run(["bash", str(REPO / "scripts" / "make_sglang_venv.sh"), str(Path(SGLANG_PY).parent.parent)],
                               capture_output=True, text=True, timeout=1800)
        assert build.returncode == 0, f"building the SGLang venv failed:\n{build.stderr[-4000:]}"
    out = _child(SGLANG_PY, "import importlib.metadata as m, json, torch\n"
                 "print(json.dumps([m.version(d) for d in ('sglang', 'flashinfer-python', 'nvidia-cutlass-dsl')] + [torch.version.cuda]))", {})
    assert out == ["0.5.23", "0.7.2", "4.8.0", None], out  # torch.version.cuda None: never a CUDA torch
    return SGLANG_PY


def _env(root: Path | None, extra: dict[str, str], hook_dir: Path | None = None) -> dict[str, str]:
    env = child_env(root or Path("/nonexistent-cdc-root"), extra, hook_dir or REPO)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook_dir or ""), str(REPO)) if p)
    env.setdefault("SGLANG_CUTE_AOT_CACHE_DIR", str((root or Path("/nonexistent-cdc-root")).parent / "sglang-aot"))
    return env


def _child(python: str, code: str, extra: dict[str, str], root: Path | None = None) -> Any:
    proc = subprocess.run([python, "-c", textwrap.dedent(code)], env=_env(root, extra), capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=str(REPO / "tests"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# The site table, read from SGLang's source; doctor's block
# --------------------------------------------------------------------------------------------

_DOCTOR = """
    import json, os
    from cute_diskcache.cli import doctor
    from cute_diskcache.sglang_sites import scan
    out = []
    for env in ({}, {"CUTE_DISKCACHE_NATIVE_SITES": "sglang"}):
        os.environ.update(env)
        rep = {"sglang": scan.report(), "b12x": {"b12x": None, "sites": [], "summary": {}}}
        out.append({"block": rep["sglang"], "text": doctor._b12x_lines(rep, False), "strict": doctor.strict_failure(rep)})
    print(json.dumps(out))
"""


def test_doctor_lists_sglang_sites_with_who_persists_each(sglang_python: str) -> None:
    """Every row is a function of SGLang 0.5.23 that calls ``cute.compile``; doctor lists the rows as
    ours, SGLang's FA4 cache's when ``CUTE_DISKCACHE_NATIVE_SITES`` names sglang (the in-memory rows
    then persisted by nothing, which ``--strict`` fails on), and counts the rest."""
    ours, left = _child(sglang_python, _DOCTOR, {})
    block = ours["block"]
    assert block["sglang"] == "0.5.23" and block["missing_adapter_sites"] == [], block["missing_adapter_sites"]
    rows = {(s["file"], s["function"]): s["status"] for s in block["sites"] if s["row"]}
    assert set(rows.values()) == {"cute-diskcache"} and len(rows) == 4
    assert len(block["sites"]) == 32 and block["summary"] == {"cute-diskcache": 4, "sglang": 2, "nothing": 26}
    text = "\n".join(ours["text"])
    assert "cute-diskcache kernels/ops/attention/flash_attn/cute/interface.py:_flash_attn_fwd " in text, text
    assert "stands aside for the FA4 kernels" in text and ours["strict"] is False
    statuses = {(s["file"], s["function"]): s["status"] for s in left["block"]["sites"] if s["row"]}
    assert statuses[("kernels/ops/attention/flash_attn/cute/interface.py", "_flash_attn_fwd")] == "sglang"
    assert statuses[("kernels/ops/gemm/cutedsl_dsv3_fused_a_gemm.py", "_compiled_kernel")] == "nothing"
    assert left["strict"] is True


def test_the_scan_finds_every_compile_and_a_vanished_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan can fail: a release that moved a row's compile shows the row as missing (``--strict`` fails)."""
    from cute_diskcache.sglang_sites import adapter, scan, sites

    target = tmp_path / sites.FA4_INTERFACE_FILE
    target.parent.mkdir(parents=True)
    target.write_text("import cutlass.cute as cute\ndef _flash_attn_fwd(x):\n    return cute.compile(x)\n"
                      "def _compile_fwd_combine_v2(x):\n    def inner():\n        return cute.compile[()](x)\n    return inner()\n")
    (tmp_path / "multimodal_gen").mkdir()
    (tmp_path / "multimodal_gen" / "k.py").write_text("import cutlass.cute as cute\ndef f(x):\n    return cute.compile(x)\n")
    found = {(s["file"], s["function"]) for s in scan.scan(tmp_path)}
    assert found == {(sites.FA4_INTERFACE_FILE, "_flash_attn_fwd"), (sites.FA4_INTERFACE_FILE, "_compile_fwd_combine_v2.inner")}
    monkeypatch.setattr(adapter, "package_dir", lambda: str(tmp_path))
    rep = scan.report()
    assert rep["missing_adapter_sites"] == sorted(f"{r.file}:{r.function}" for r in sites.ROWS[1:]) and scan.strict_failure(rep)


#: A stand-in for SGLang's FA4 layout: the interface keeps its SM12x forward host in a global that
#: only a real-tensor call sets (SGLang imports the host on first use), so what the interface's
#: globals reach depends on what the process did before the compile.
_LAZY_SGLANG = {
    "__init__.py": "", "kernels/__init__.py": "", "kernels/ops/__init__.py": "", "kernels/ops/attention/__init__.py": "",
    "kernels/ops/attention/flash_attn/__init__.py": "", "kernels/ops/attention/flash_attn/cute/__init__.py": "",
    "kernels/ops/attention/fa4_sm120/__init__.py": "",
    "kernels/ops/attention/fa4_sm120/runtime.py": "class Host:\n    pass\n",
    "kernels/ops/attention/flash_attn/cute/interface.py": (
        "host = None\n\n\ndef _flash_attn_fwd(fake):\n    global host\n    if not fake:\n"
        "        from sglang.kernels.ops.attention.fa4_sm120.runtime import Host\n        host = Host()\n"),
}

_SOURCES = """
    import json, os, sys
    root, mode, wanted = {args!r}
    sys.path.insert(0, root)
    from cute_diskcache.core import hook
    from cute_diskcache.sglang_sites import adapter, sites
    adapter.ADAPTER.package_dir = lambda: os.path.join(root, "sglang")
    from sglang.kernels.ops.attention.flash_attn.cute import interface
    interface._flash_attn_fwd(fake=mode == "fake")
    modules = tuple(m for m in wanted if m in sys.modules)
    row = sites.BY_WHERE[(sites.FA4_INTERFACE_FILE, "_flash_attn_fwd")]
    print(json.dumps(hook._environment_of(row, modules, adapter.ADAPTER).as_dict()))
"""


def test_sglangs_arch_detection_sees_the_target_card_on_a_cpu_torch(sglang_python: str, tmp_path: Path) -> None:
    """Issue 41 4b, the lent H100 re-run: with the keys fixed, 2 of the 3 FA4 kernels a GPU forced
    to sm_120a asked for were the CPU prewarm's, byte for byte; the split-KV combine was not. SGLang
    compiles it with PDL when its JIT arch detection finds capability >= 9, and on a CPU torch that
    detection (``torch.cuda.current_device()`` first) found nothing and said 0.0: the prewarm built
    a combine kernel without PDL that no sm12x GPU asks for. Under a target profile, SGLang's
    detection now sees the profile's card."""
    out = _child(sglang_python, """
        import json
        import cute_diskcache
        cute_diskcache.install(target="rtx-pro-6000")
        import sglang.kernels.ops.attention.flash_attn.cute.interface
        from sglang.kernels.jit.utils.arch import get_jit_cuda_arch, is_arch_support_pdl
        arch = get_jit_cuda_arch()
        print(json.dumps([arch.major, arch.minor, is_arch_support_pdl()]))
    """, {}, tmp_path / "root")
    assert out == [12, 0, True], out


def test_an_fa4_key_does_not_depend_on_what_the_process_loaded_before_the_compile(tmp_path: Path) -> None:
    """Issue 41 4b: the CPU prewarm (SGLang's call on fake tensors) and a GPU engine (real tensors,
    which load FA4's SM12x forward host first) keyed the same kernels apart, with "the kernel's
    Python code differs" (measured on the lent H100 with bench/gpu_proof_sglang.py: 3 misses on the
    CPU-built root). The rows fingerprint FA4's tree, not what its modules' globals reach; the tree's
    code, and quack's version, still change the key."""
    for rel, text in _LAZY_SGLANG.items():
        (tmp_path / "sglang" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sglang" / rel).write_text(text)
    interface, runtime = "sglang.kernels.ops.attention.flash_attn.cute.interface", "sglang.kernels.ops.attention.fa4_sm120.runtime"

    def env(mode: str, *modules: str) -> dict[str, Any]:
        out: dict[str, Any] = _child(sys.executable, _SOURCES.replace("{args!r}", repr((str(tmp_path), mode, modules))),
                                     {"CUTE_DSL_ARCH": "sm_120a"})
        return out

    prewarm = env("fake", interface)
    engine = env("real", interface, runtime)  # the forward host loaded, and on the way to the compile
    assert prewarm == engine
    (tmp_path / "sglang" / "kernels/ops/attention/fa4_sm120/runtime.py").write_text("class Host:\n    tiles = 2\n")
    assert env("fake", interface)["sources"] != prewarm["sources"], "a change in FA4's tree changes the key"


def test_doctor_without_sglang_says_so() -> None:
    from cute_diskcache.sglang_sites import scan

    rep = scan.report()
    assert rep["sglang"] is None  # the main interpreter has no SGLang
    assert scan.render(rep) == ["sglang           not installed"] and not scan.strict_failure(rep)


_ASIDE = """
    import json
    import cute_diskcache
    cute_diskcache.install(target="rtx-pro-6000")
    from sglang.kernels.jit import cute_aot_cache as aot
    from sglang.kernels.ops.attention.flash_attn.cute import interface
    from cute_diskcache.sglang_sites import native, sites
    kinds = lambda: sorted({type(getattr(getattr(interface, f), a)).__name__ for f, a in sites.AOT_CACHES})
    from cute_diskcache.core import hook
    out = {"aside": native.standing_aside(interface), "kinds": kinds(), "trees": hook._tree_facts.cache_info().currsize}
    cute_diskcache.uninstall()
    out.update(after=native.standing_aside(interface), kinds_after=kinds())
    print(json.dumps(out))
"""


def test_sglang_s_fa4_cache_stands_aside_and_comes_back(sglang_python: str, tmp_path: Path) -> None:
    """One kernel, one cache: as the FA4 interface is imported, its four persistent caches become
    SGLang's own in-memory ones; uninstall puts SGLang's back. Left to SGLang, nothing is replaced.
    While ours serves, FA4's code tree is fingerprinted at that import, not by the first request."""
    aot = {"SGLANG_CUTE_AOT_CACHE_DIR": str(tmp_path / "aot")}
    out = _child(sglang_python, _ASIDE, aot)
    assert out == {"aside": True, "kinds": ["JITCache"], "trees": 1, "after": False, "kinds_after": ["JITPersistentCache"]}
    left = _child(sglang_python, _ASIDE, {**aot, "CUTE_DISKCACHE_NATIVE_SITES": "sglang"})
    assert left["aside"] is False and left["kinds"] == ["JITPersistentCache"] and left["trees"] == 0


def test_a_keyword_wrapper_with_a_default_that_is_no_plain_value_keeps_its_convention() -> None:
    """SGLang's FA4 forward defaults ``aux_data`` to an ``AuxData`` tuple and a flag to ``Int32(0)``:
    no convention was stored for it, so its entry was refused at every hit (the warm run compiled the
    forward again). Now the parameters up to the last such default are required on a hit; a call that
    passes them all (SGLang's) goes through, one that leans on that default fails loudly."""
    from cute_diskcache.core.convention import Convention, calling_convention, convention_ok

    class Aux(tuple):  # a NamedTuple-like default
        pass

    def wrapper(q, aux=Aux(), flag=object(), window=None, *, stream=None, scale=object()):  # noqa: B008
        raise AssertionError("the compiled wrapper is not called on a hit")

    class Compiled:
        _kwargs_wrapper = staticmethod(wrapper)

    conv = calling_convention(Compiled())
    assert conv == {"arg_names": ["q", "aux", "flag", "window"], "arg_defaults": [None], "kwonly_names": ["stream", "scale"],
                    "kwonly_defaults": {"stream": None}} and convention_ok(conv)
    calls = []
    hit = Convention(lambda *a: calls.append(a), conv)
    hit(1, 2, 3, 4, stream=5, scale=6)
    hit(1, 2, 3, stream=5, scale=6)  # the plain trailing default is still filled in
    assert calls == [(1, 2, 3, 4, 5, 6), (1, 2, 3, None, 5, 6)]
    with pytest.raises(TypeError):
        hit(1, stream=5, scale=6)  # leaned on the AuxData default: refused, never a wrong value


# --------------------------------------------------------------------------------------------
# The real compile: SGLang's FA4 SM12x decode, cold then fresh; a planted object
# --------------------------------------------------------------------------------------------


def _driver(python: str, root: Path, aot: Path, hook_dir: Path, extra: dict[str, str] | None = None) -> dict[str, Any]:
    env = _env(root, {"SGLANG_CUTE_AOT_CACHE_DIR": str(aot), **(extra or {})}, hook_dir)
    proc = subprocess.run([python, str(REPO / "tests" / "sglang_driver.py")], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=hook_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"], out["cache_log"], out["real_compiles"] = split_stderr(proc.stderr)
    return out


def _entries(root: Path) -> list[str]:
    from cute_diskcache.storage import entry

    return sorted(entry.read_manifest(m.parent)["site"] for m in root.rglob(entry.MANIFEST))


def _files(aot: Path) -> dict[str, tuple[bytes, int]]:
    """SGLang's objects under ``aot``: bytes and modification time, so a rewrite shows even with the same bytes."""
    return {p.relative_to(aot).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(aot.rglob("*.o"))}


class Fa4Runs(NamedTuple):
    """SGLang's FA4 decode in four fresh processes over one SGLang cache directory (see :func:`fa4_runs`)."""

    left: dict[str, Any]
    hijacked: dict[str, Any]
    planted: bytes  # what was planted at the forward's path
    forward: Path
    sglang_dir: dict[str, tuple[bytes, int]]  # SGLang's directory once planted
    cold: dict[str, Any]
    entries: list[str]  # our root as the cold process left it
    namespaces: list[str]
    after_cold: dict[str, tuple[bytes, int]]
    warm: dict[str, Any]
    after_warm: dict[str, tuple[bytes, int]]


@pytest.fixture(scope="module")
def fa4_runs(sglang_python: str, tmp_path_factory: pytest.TempPathFactory, compile_hook_dir: Path) -> Fa4Runs:
    """Left to SGLang, its cache writes the forward and combine objects; another kernel's object is
    planted at the forward's path and loaded by a second process as its forward. Then ours serves
    on an empty root (cold) and again on what that left (warm), over the same SGLang directory:
    the cold process is both the empty-cache compile and the one that must not read the planted
    file, so the two tests below read one set of processes (each process is a fresh interpreter
    with SGLang, ~10 s here, plus the FA4 compiles)."""
    tmp = tmp_path_factory.mktemp("fa4")
    aot, root = tmp / "sglang-aot", tmp / "root"
    native = {"CUTE_DISKCACHE_NATIVE_SITES": "sglang"}
    left = _driver(sglang_python, tmp / "unused", aot, compile_hook_dir, native)
    fwd, combine = (next(aot.rglob(f"*/{name}/*.o")) for name in ("fwd", "fwd_combine"))
    shutil.copyfile(combine, fwd)  # a valid object of another kernel, at the forward's key
    planted = fwd.read_bytes()
    hijacked = _driver(sglang_python, tmp / "unused", aot, compile_hook_dir, native)
    sglang_dir = _files(aot)
    cold = _driver(sglang_python, root, aot, compile_hook_dir)
    entries, namespaces, after_cold = _entries(root), sorted(p.name for p in (root / "v1").glob("*")), _files(aot)
    warm = _driver(sglang_python, root, aot, compile_hook_dir)
    return Fa4Runs(left, hijacked, planted, fwd, sglang_dir, cold, entries, namespaces, after_cold, warm, _files(aot))


@pytest.mark.slow
def test_fa4_sm120_compiles_on_an_empty_cache_and_nothing_on_a_warm_one(fa4_runs: Fa4Runs) -> None:
    """Issue 41, 4a: SGLang's own FA4 plan and compile for an RTX PRO 6000 (a split-KV decode: the
    forward and its combine), in a fresh process on an empty cache, then on the warm one. SGLang's
    own cache, standing aside, loads nothing and writes nothing: its directory stays as it was
    (it holds the objects :func:`fa4_runs` left there)."""
    cold, warm = fa4_runs.cold, fa4_runs.warm
    assert cold["real_compiles"] == 2 and cold["counters"]["compiles"] == cold["counters"]["writes"] == 2, cold
    assert cold["standing_aside"] is True and cold["sglang_loaded"] == 0
    assert cold["sglang_files"] == sorted(fa4_runs.sglang_dir) and fa4_runs.after_cold == fa4_runs.sglang_dir
    assert fa4_runs.entries == sorted([FWD, COMBINE]) and fa4_runs.namespaces
    assert all("sm_120a" in name for name in fa4_runs.namespaces), fa4_runs.namespaces
    assert warm["real_compiles"] == 0 and warm["counters"]["hits"] == 2 and warm["counters"]["compiles"] == 0, warm
    assert warm["sglang_loaded"] == 0 and fa4_runs.after_warm == fa4_runs.sglang_dir


@pytest.mark.slow
def test_a_planted_object_in_sglang_s_layout_is_never_loaded_while_ours_serves(fa4_runs: Fa4Runs) -> None:
    """Issue 41, 4c. Left to SGLang (``CUTE_DISKCACHE_NATIVE_SITES=sglang``), its cache writes the FA4
    forward and combine objects; another kernel's object planted at the forward's path is then linked
    and handed to SGLang as its forward, with no compile (what a hostile file would get). With ours
    serving, SGLang's directory is never read: nothing is loaded from it, both kernels compile, and
    the planted file is left as it was."""
    left, hijacked, ours = fa4_runs.left, fa4_runs.hijacked, fa4_runs.cold
    assert left["real_compiles"] == 2 and left["counters"]["compiles"] == 0 and left["standing_aside"] is False, left
    assert hijacked["sglang_loaded"] == 2 and hijacked["real_compiles"] == 0, hijacked  # SGLang ran the planted file
    assert ours["sglang_loaded"] == 0 and ours["standing_aside"] is True, ours
    assert ours["real_compiles"] == 2 and ours["counters"]["writes"] == 2 and fa4_runs.entries == sorted([FWD, COMBINE])
    # untouched: neither read nor rewritten
    assert fa4_runs.forward.read_bytes() == fa4_runs.planted and len(ours["sglang_files"]) == 2
    assert fa4_runs.after_cold == fa4_runs.sglang_dir


# --------------------------------------------------------------------------------------------
# prewarm / check --engine sglang (issue 41 item 3)
# --------------------------------------------------------------------------------------------

PLAN = ["llama-3.1-8b-nvfp4", "--engine", "sglang", "--attention-backend", "fa4", "--target", "rtx-pro-6000",
        "--context-length", "8192"]


def _cli(python: str, root: Path, hook_dir: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, *argv], env=_env(root, {}, hook_dir), capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=hook_dir)


def test_prewarm_dry_run_plans_sglang_s_decode_capture(sglang_python: str, tmp_path: Path, compile_hook_dir: Path) -> None:
    """SGLang's decode CUDA-graph batch sizes for a 96 GB card at TP 1 (its own generator, up to 256),
    each call planned by SGLang's SM120 forward host: nothing compiled, nothing written."""
    root = tmp_path / "root"
    proc = _cli(sglang_python, root, compile_hook_dir, "-m", "cute_diskcache.prewarm", *PLAN, "--root", str(root),
                "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    sizes = out["batch_sizes"]
    assert sizes[:6] == [1, 2, 4, 8, 12, 16] and sizes[-1] == 256 and len(sizes) == 36, sizes
    assert out["attention"] == {"heads": 32, "kv_heads": 8, "head_dim": 128, "page_size": 1, "context_length": 8192}
    assert out["kernels"] == 3 and out["kernels_compiled"] == 0 and not (root / "v1").exists()
    assert sorted(k for r in out["job_list"] for k in r["kernels"]) == sorted([FWD, COMBINE, FWD])
    refused = _cli(sglang_python, root, compile_hook_dir, "-m", "cute_diskcache.prewarm", *PLAN[:3], "--target", "rtx-pro-6000",
                   "--dry-run", "--json")
    assert refused.returncode == 2 and "--attention-backend fa4" in refused.stderr


@pytest.mark.slow
def test_prewarm_then_check_and_a_fresh_sglang_process_compiles_nothing(
        sglang_python: str, tmp_path: Path, compile_hook_dir: Path) -> None:
    """Issue 41 item 3 and 4a on a prewarmed cache: prewarm compiles the kernels SGLang's capture at
    batch sizes 1 and 24 needs; check exits 0 on that root and 1 on an empty one; SGLang's own FA4
    decode at batch 1 in a fresh process then compiles nothing."""
    root = tmp_path / "root"
    warm = _cli(sglang_python, root, compile_hook_dir, "-m", "cute_diskcache.prewarm", *PLAN, "--cuda-graph-bs", "1", "24",
                "--root", str(root), "--jobs", "2", "--json")
    assert warm.returncode == 0, warm.stderr[-4000:]
    out = json.loads(warm.stdout)
    assert out["kernels_compiled"] == 3 and out["errors"] == 0 and _entries(root) == sorted([FWD, FWD, COMBINE])
    ok = _cli(sglang_python, root, compile_hook_dir, "-m", "cute_diskcache", "--root", str(root), "check", *PLAN,
              "--cuda-graph-bs", "1", "24")
    assert ok.returncode == 0 and ok.stdout.startswith("ok: all 3 kernels"), ok.stdout + ok.stderr[-3000:]
    empty = _cli(sglang_python, tmp_path / "empty", compile_hook_dir, "-m", "cute_diskcache", "--root", str(tmp_path / "empty"),
                 "check", *PLAN, "--cuda-graph-bs", "1", "24")
    assert empty.returncode == 1 and "3 missing" in empty.stdout, empty.stdout + empty.stderr[-3000:]
    served = _driver(sglang_python, root, tmp_path / "sglang-aot", compile_hook_dir, {"SGLANG_DRIVER_SHAPE": "1,32,8,128,1,8192"})
    assert served["real_compiles"] == 0 and served["counters"]["hits"] == 2 and served["counters"]["compiles"] == 0, served


_QWEN3X = """
    import json, sys
    import cute_diskcache
    cute_diskcache.install(target="rtx-pro-6000")
    from sglang.kernels.kda_kernels import qwen3x_nvfp4_gemm_sm120 as q
    sf_m, sf_n, sf_k = map(int, sys.argv[1:4])
    q._compile_decode_kernel(0, sf_m, sf_n, sf_k, direct_scheduler=True, m1_epilogue=True, cache_policy=True)
    print(json.dumps(cute_diskcache.counters()))
"""


@pytest.mark.slow
def test_the_qwen3x_nvfp4_gemm_row_compiles_once_and_serves_every_shape(
        sglang_python: str, tmp_path: Path, compile_hook_dir: Path) -> None:
    """SGLang's default NVFP4 decode GEMM on sm_120 (Qwen3.x shapes), through SGLang's own compile
    function as ``_run_qwen3x_nvfp4_gemm`` calls it: a cold process compiles it (SGLang keeps it in
    memory only), a fresh one with another layer's scale-factor extents (runtime ``Int32``
    arguments, as SGLang's own in-process key assumes) hits it. The profile stands in for
    ``torch.cuda.device`` on a CPU torch."""
    root = tmp_path / "root"

    def run(*sf: int) -> tuple[dict[str, Any], int | None]:
        proc = subprocess.run([sglang_python, "-c", textwrap.dedent(_QWEN3X), *map(str, sf)], env=_env(root, {}, compile_hook_dir),
                              capture_output=True, text=True, timeout=TIMEOUT_S, cwd=compile_hook_dir)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1]), split_stderr(proc.stderr)[2]

    # m=1 on two Qwen3.x projections with n < k (direct scheduler): (k, n) = (9216, 2560), then
    # (12288, 4096); sf_m, sf_n, sf_k = ceil(m/128), ceil(n/128), ceil(k/16/4), as SGLang computes them.
    cold, compiled = run(1, 20, 144)
    assert compiled == 1 and cold["writes"] == 1, cold
    warm, compiled = run(1, 32, 192)
    assert compiled == 0 and warm["hits"] == 1 and warm["compiles"] == 0, warm
    assert _entries(root) == ["sglang.qwen3x_nvfp4_gemm"]
