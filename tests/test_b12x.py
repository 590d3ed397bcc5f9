"""The b12x package's compiles through the same hook (issue 32 item 2): its adapter, its disk cache
standing aside, ``doctor``'s b12x block, and flashinfer's embedded copy staying flashinfer's.

b12x 1.5.1 pins DSL 4.8.0, so everything that imports b12x runs in a second interpreter
(``scripts/make_b12x_venv.sh``: b12x over the flashinfer 0.7.4 matrix cell, a CPU torch), found
through ``CUTE_DISKCACHE_B12X_PYTHON`` or built on first use (seconds with the cell in place).
b12x and the DSL are real; the kernel the slow tests compile is b12x's MXFP8 row quantizer through
b12x's own getter (:mod:`b12x_driver`).
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
B12X_PY: str = os.environ.get("CUTE_DISKCACHE_B12X_PYTHON") or str(REPO / ".venv-b12x" / "bin" / "python")
TIMEOUT_S = 300
QUANT = "b12x.mxfp8_rows._MXFP8RowsQuantLaunch"

pytestmark = pytest.mark.skipif(B12X_PY == "off", reason="CUTE_DISKCACHE_B12X_PYTHON=off: b12x tests skipped")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import child_env, once_per_run  # noqa: E402


@pytest.fixture(scope="module")
def b12x_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The b12x interpreter, checked: b12x 1.5.1, DSL 4.8.0, this checkout's cute_diskcache on its path.

    Built and checked once per run (test_b12x_moe.py uses it too): the check is a b12x import in
    a fresh interpreter, seconds that say the same thing each time."""

    def check(_: Path) -> str:
        if not os.environ.get("CUTE_DISKCACHE_B12X_PYTHON"):
            build = subprocess.run(["bash", str(REPO / "scripts" / "make_b12x_venv.sh"), str(Path(B12X_PY).parent.parent)],
                                   capture_output=True, text=True, timeout=1200)
            assert build.returncode == 0, f"building the b12x venv failed:\n{build.stderr[-4000:]}"
        out = _child(B12X_PY, "import importlib.metadata as m, json, b12x._lib.compiler as c\n"
                     "print(json.dumps([m.version('b12x'), m.version('nvidia-cutlass-dsl'), c.__file__]))", {})
        version, dsl, compiler_file = out
        assert (version, dsl) == ("1.5.1", "4.8.0"), out
        return B12X_PY

    python: str = once_per_run(tmp_path_factory, "b12x-python", check)[1]
    return python


def _env(root: Path | None, extra: dict[str, str], hook_dir: Path | None = None) -> dict[str, str]:
    env = child_env(root or Path("/nonexistent-cdc-root"), extra, hook_dir or REPO)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook_dir or ""), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.setdefault("B12X_COMPILE_CACHE_DIR", str((root or Path("/nonexistent-cdc-root")).parent / "b12x-cache"))
    return env


def _child(python: str, code: str, extra: dict[str, str], root: Path | None = None) -> Any:
    proc = subprocess.run([python, "-c", textwrap.dedent(code)], env=_env(root, extra), capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=str(REPO / "tests"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# The site table, read from b12x's source
# --------------------------------------------------------------------------------------------


_DOCTOR = """
    import json, os
    from cute_diskcache.cli import doctor
    from cute_diskcache.b12x_sites import scan
    out = []
    for env in ({}, {"CUTE_DISKCACHE_NATIVE_SITES": "b12x"}, {"B12X_COMPILE_DISK_CACHE": "0"}):
        os.environ.update(env)
        rep = {"b12x": scan.report()}
        out.append({"block": rep["b12x"], "text": doctor._b12x_lines(rep, False), "strict": doctor.strict_failure(rep)})
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def doctor_b12x_blocks(b12x_python: str) -> list[dict[str, Any]]:
    """doctor's b12x block by setting (default, ``NATIVE_SITES=b12x``, b12x's cache off), from one
    b12x process, once per module: the first is the plain scan of b12x's source (nothing set)."""
    out: list[dict[str, Any]] = _child(b12x_python, _DOCTOR, {})
    return out


def test_b12x_compiles_only_through_the_wrapper_the_table_names(doctor_b12x_blocks: list[dict[str, Any]]) -> None:
    """b12x 1.5.1's one compile wrapper is the table's row, the kernels call it, and no b12x
    function calls ``cute.compile`` itself: every b12x compile reaches the hook under the row."""
    rep = doctor_b12x_blocks[0]["block"]
    roles = [s["role"] for s in rep["sites"]]
    assert roles.count("wrapper") == 1 and roles.count("direct") == 0, rep["sites"]
    assert roles.count("kernel") > 50  # 91 in 1.5.1: the GEMM, MoE, attention, quant... getters
    assert rep["missing_adapter_sites"] == [] and rep["summary"] == {"cute-diskcache": len(roles), "b12x": 0, "nothing": 0}
    kernels = {(s["file"], s["function"]) for s in rep["sites"] if s["role"] == "kernel"}
    assert ("_lib/quant/mxfp8_rows.py", "_get_compiled_mxfp8_rows_quant") in kernels
    assert rep["prewarm_refused"] is None  # 1.5.1 has the planning API prewarm drives


def test_prewarm_refuses_a_b12x_without_the_planning_api(tmp_path: Path) -> None:
    """b12x 1.3.0 and older have the wrapper but not the preparation system and GPU-less compile
    workers prewarm drives (``sites.PLANNING_API``): prewarm exits 2 with the reason doctor's b12x
    block gives, rather than a traceback (the compat matrix's b12x 1.3.0 cell; no b12x imported)."""
    pkg = tmp_path / "b12x"
    (pkg / "_lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_lib" / "compiler.py").write_text("def _call_cute_compile(c, f, a, k):\n    return c(f, *a, **k)\n")
    (pkg / "_lib" / "compile_pool.py").write_text("def _factory(reference):\n    return reference\n")  # 1 of 6 names
    env = {**_env(tmp_path / "root", {}), "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    proc = subprocess.run([sys.executable, "-m", "cute_diskcache.prewarm", "llama-3.1-8b-nvfp4", "--target", "rtx-pro-6000",
                           "--linear-backend", "b12x", "--dry-run", "--json"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = json.loads(proc.stderr.strip().splitlines()[-1])["error"]
    doctor = subprocess.run([sys.executable, "-c", "import json; from cute_diskcache.b12x_sites import scan; "
                             "print(json.dumps(scan.report()['prewarm_refused']))"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert json.loads(doctor.stdout) == error
    assert "no offline planning API" in error and "_lib/compile_pool.py:_initialize_worker" in error
    assert "_lib/compile_pool.py:_factory" not in error and "gemm/blockscaled/_preparation.py:heuristic_plan" in error


def test_the_scan_finds_a_direct_compile_outside_the_wrapper(tmp_path: Path) -> None:
    """The scan can fail: a b12x function that calls ``cute.compile`` itself is persisted by nothing."""
    from cute_diskcache.b12x_sites import scan

    (tmp_path / "_lib").mkdir()
    (tmp_path / "_lib" / "compiler.py").write_text("def _call_cute_compile(c, f, a, k):\n    return c(f, *a, **k)\n")
    (tmp_path / "k.py").write_text("from b12x._lib.compiler import compile as bc\nimport cutlass.cute as cute\n"
                                   "def through(x):\n    return bc(x)\n"
                                   "class K:\n    def stray(self, x):\n        return cute.compile[()](x)\n")
    found = {(s["file"], s["function"]): s["role"] for s in scan.scan(tmp_path)}
    assert found == {("_lib/compiler.py", "_call_cute_compile"): "wrapper", ("k.py", "through"): "kernel",
                     ("k.py", "K.stray"): "direct"}


# --------------------------------------------------------------------------------------------
# One kernel, one cache: b12x's disk layer stands aside while ours serves
# --------------------------------------------------------------------------------------------

_ASIDE = """
    import json, contextlib
    import cute_diskcache
    cute_diskcache.install()
    import b12x._lib.compiler as c
    from cute_diskcache.b12x_sites import native, sites
    from cute_diskcache.core.adapter import by_name
    out = {"aside": native.standing_aside(c), "load": repr(c._load_cute_compile_from_disk("0" * 64)),
           "lock": type(c._disk_cache_key_lock("0" * 64)).__name__,
           "rows": sorted(f for f, _ in by_name("b12x").by_where), "own": sorted(by_name("b12x").own_disk_caches)}
    cute_diskcache.uninstall()
    out["after_uninstall"] = native.standing_aside(c) or any(getattr(c, n).__module__ != c.__name__ for n in sites.NATIVE_LAYER)
    print(json.dumps(out))
"""


def test_b12x_disk_layer_stands_aside_while_ours_serves(b12x_python: str) -> None:
    out = _child(b12x_python, _ASIDE, {})
    assert out == {"aside": True, "load": "None", "lock": "nullcontext", "rows": ["_lib/compiler.py"], "own": [],
                   "after_uninstall": False}


def test_native_sites_naming_b12x_leaves_b12x_its_cache(b12x_python: str) -> None:
    """``CUTE_DISKCACHE_NATIVE_SITES=b12x``: nothing of b12x's is replaced, and its wrapper's file is
    b12x's own cache to the hook (its compiles handed back), as flashinfer's native sites are."""
    out = _child(b12x_python, _ASIDE, {"CUTE_DISKCACHE_NATIVE_SITES": "flashinfer, b12x"})
    assert out["aside"] is False and out["lock"] == "_GeneratorContextManager" and out["rows"] == []
    assert out["own"] == ["_lib/compiler.py"]


def test_flashinfer_s_embedded_copy_stays_flashinfer_s(b12x_python: str) -> None:
    """flashinfer 0.7.4 embeds b12x under ``experimental/b12x``: a compile there is flashinfer's
    (left to that copy's cache, as before b12x had an adapter); the standalone wrapper is b12x's row."""
    out = _child(b12x_python, """
        import json, os, flashinfer.experimental as e
        import b12x._lib.compiler as standalone
        from cute_diskcache.core import hook
        embedded = os.path.join(os.path.dirname(e.__file__), "b12x", "_lib", "compiler.py")
        code = compile(open(embedded).read(), embedded, "exec")
        fn = next(c for c in code.co_consts if getattr(c, "co_name", "") == "_call_cute_compile")
        row = hook._classify(standalone._call_cute_compile.__code__)
        print(json.dumps({"embedded": hook._classify(fn), "where": hook._where(fn)[0].name,
                          "standalone": [row.name, row.per_target], "b12x_root": hook._where(standalone.compile.__code__)[0].name}))
    """, {})
    assert out == {"embedded": "the library's own cache", "where": "flashinfer", "standalone": ["b12x", True], "b12x_root": "b12x"}


# --------------------------------------------------------------------------------------------
# doctor's b12x block
# --------------------------------------------------------------------------------------------


def test_doctor_lists_b12x_sites_with_who_persists_each(doctor_b12x_blocks: list[dict[str, Any]]) -> None:
    """The b12x block as ``doctor`` prints it and judges it (``--strict``), by setting: ours serves
    (default), b12x's cache keeps them, or nothing does (left to b12x with its cache off). The
    block alone, in one process: the whole report also scans all of flashinfer 0.7.4 (~40 s here)."""
    for (status, strict), got in zip((("cute-diskcache", False), ("b12x", False), ("nothing", True)), doctor_b12x_blocks,
                                     strict=True):
        assert got["block"]["b12x"] == "1.5.1" and {s["status"] for s in got["block"]["sites"]} == {status}
        assert f"  {status:<15}_lib/compiler.py:_call_cute_compile  " in "\n".join(got["text"]), got["text"]
        assert got["strict"] is strict


def test_doctor_without_b12x_says_so() -> None:
    from cute_diskcache.cli import doctor
    from cute_diskcache.b12x_sites import scan

    rep = scan.report()
    assert rep["b12x"] is None  # the main interpreter has no standalone b12x
    assert "b12x             " in doctor.render({"flashinfer": None, "b12x": rep})


# --------------------------------------------------------------------------------------------
# Neutral pieces: the settings list, entry names per target, the DSL's pointer by base class
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, value", [("b12x", "b12x"), ("b12x, flashinfer", "flashinfer,b12x"), ("FLASHINFER", "flashinfer"),
                                        ("b12x,nonsense", "cute-diskcache"), ("", "cute-diskcache")])
def test_native_sites_is_a_list_of_libraries(raw: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from cute_diskcache import config

    monkeypatch.setenv("CUTE_DISKCACHE_NATIVE_SITES", raw)
    assert config.load().native_sites == value
    assert config.left_to_library("b12x") == ("b12x" in value.split(","))
    assert config.left_to_library("flashinfer") == ("flashinfer" in value.split(","))


def test_a_per_target_row_names_entries_after_what_it_compiles() -> None:
    from cute_diskcache.core.adapter import by_name
    from cute_diskcache.core import hook

    class _Launch:
        def __call__(self) -> None: ...

    def kernel() -> None: ...

    assert hook._target_name(_Launch()) == "test_b12x.test_a_per_target_row_names_entries_after_what_it_compiles._Launch"
    assert hook._target_name(kernel).endswith("_what_it_compiles.kernel")
    (row,) = by_name("b12x").by_where.values()
    assert hook.site(row, "dense_gemm._DenseGemmLaunch").name == "b12x.dense_gemm._DenseGemmLaunch"
    assert hook.site(row).name == "b12x"


def test_a_library_s_subclass_of_the_dsl_pointer_is_keyed_without_its_address() -> None:
    """b12x passes its own ``_Pointer`` (a subclass of the DSL's ``Pointer``): described by element
    type, space and alignment as the DSL's own, never by its address (it was refused before)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import _Pointer
    from cutlass.cute.typing import Pointer

    from cute_diskcache.core.describe import Describer

    class LibraryPointer(_Pointer):  # b12x._lib.utils._Pointer is a copy of the DSL's _Pointer
        pass

    class Bare(Pointer):  # a subclass of the abstract type only
        def __init__(self, address: int) -> None:
            self._pointer, self._dtype, self._addr_space, self._assumed_align = address, cutlass.Uint8, cute.AddressSpace.gmem, 16

    d = Describer(lambda module: module == __name__)
    a = d(LibraryPointer(16, cutlass.Uint8, cute.AddressSpace.gmem, assumed_align=16))
    b = d(LibraryPointer(4096, cutlass.Uint8, cute.AddressSpace.gmem, assumed_align=16))
    c = d(LibraryPointer(16, cutlass.Uint32, cute.AddressSpace.gmem, assumed_align=16))
    assert a == b != c and a[0] == "pointer"
    assert d(Bare(16)) == d(Bare(32))


# --------------------------------------------------------------------------------------------
# The real compile: b12x's quantizer, cold then fresh
# --------------------------------------------------------------------------------------------


def _driver(python: str, root: Path, hook_dir: Path, extra: dict[str, str]) -> dict[str, Any]:
    from conftest import split_stderr

    proc = subprocess.run([python, str(REPO / "tests" / "b12x_driver.py")], env=_env(root, extra, hook_dir),
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=hook_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"], out["cache_log"], out["real_compiles"] = split_stderr(proc.stderr)
    return out


def _entries(root: Path) -> list[str]:
    """The site names of the entries under ``root`` (their manifests, as the store reads them)."""
    from cute_diskcache.storage import entry

    return sorted(entry.read_manifest(m.parent)["site"] for m in root.rglob(entry.MANIFEST))


class ColdWarm(NamedTuple):
    """Two fresh b12x processes on one root, ours serving: the first on an empty cache, the second after it."""

    cold: dict[str, Any]
    entries: list[str]  # the root's entries as the cold process left them
    namespaces: list[str]
    warm: dict[str, Any]


@pytest.fixture(scope="module")
def quantizer_cold_warm(b12x_python: str, tmp_path_factory: pytest.TempPathFactory, compile_hook_dir: Path) -> ColdWarm:
    """b12x's quantizer compiled cold, then loaded by a fresh process, once per module: the two
    tests below read the same pair of processes (the compile and load, and what each one says)."""
    root = tmp_path_factory.mktemp("quantizer") / "root"
    cold = _driver(b12x_python, root, compile_hook_dir, {})
    entries, namespaces = _entries(root), sorted(p.name for p in (root / "v1").iterdir()) if (root / "v1").is_dir() else []
    return ColdWarm(cold, entries, namespaces, _driver(b12x_python, root, compile_hook_dir, {}))


@pytest.mark.slow
def test_a_b12x_kernel_compiles_once_into_our_cache_and_a_fresh_process_loads_it(quantizer_cold_warm: ColdWarm) -> None:
    cold, warm = quantizer_cold_warm.cold, quantizer_cold_warm.warm
    assert cold["real_compiles"] == 1 and cold["counters"]["compiles"] == cold["counters"]["writes"] == 1, cold
    assert cold["standing_aside"] and cold["b12x_objects"] == []  # one kernel, one cache: ours
    assert quantizer_cold_warm.entries == [QUANT] and quantizer_cold_warm.namespaces
    assert all("sm_120a" in name for name in quantizer_cold_warm.namespaces), quantizer_cold_warm.namespaces
    assert warm["real_compiles"] == 0 and warm["counters"]["hits"] == 1 and warm["counters"]["compiles"] == 0, warm
    # One voice: b12x's counters say what ours say. The cold process's compile is b12x's miss; the
    # warm process's hit is b12x's disk hit, not a miss (before, b12x counted a miss for a kernel we served).
    assert cold["b12x"]["compile_misses"] == 1, cold["b12x"]
    assert warm["b12x"]["compile_misses"] == 0 and warm["b12x"]["disk_cache_hits"] == 1, warm["b12x"]


def test_the_attach_line_names_b12x_and_counts_its_entries(quantizer_cold_warm: ColdWarm) -> None:
    """A b12x process's attach line named only flashinfer's version (the b12x venv carries
    flashinfer too), so a platform engineer read b12x's entries as flashinfer 0.7.4's."""
    lines = [quantizer_cold_warm.cold["cache_log"], quantizer_cold_warm.warm["cache_log"]]
    attach = [next(ln for ln in log if "attached:" in ln) for log in lines]
    assert "0 entries for this stack (flashinfer 0.7.4, b12x 1.5.1, DSL 4.8.0, sm_120a" in attach[0], attach
    assert "1 entry for this stack (flashinfer 0.7.4, b12x 1.5.1, DSL 4.8.0, sm_120a" in attach[1], attach


@pytest.mark.slow
def test_left_to_b12x_the_kernel_is_in_b12x_s_cache_and_not_ours(b12x_python: str, tmp_path: Path, compile_hook_dir: Path) -> None:
    root = tmp_path / "root"
    extra = {"CUTE_DISKCACHE_NATIVE_SITES": "b12x"}
    cold = _driver(b12x_python, root, compile_hook_dir, extra)
    assert cold["real_compiles"] == 1 and cold["counters"]["compiles"] == 0 and len(cold["b12x_objects"]) == 1, cold
    warm = _driver(b12x_python, root, compile_hook_dir, extra)
    assert warm["real_compiles"] == 0 and warm["b12x"]["disk_cache_hits"] == 1 and _entries(root) == []


def test_the_b12x_adapter_stays_small_and_each_module_says_what_it_owns() -> None:
    """Issue 32: b12x's knowledge is one package beside flashinfer's, mostly data."""
    import ast

    from cute_diskcache import b12x_sites

    modules = sorted(Path(b12x_sites.__file__).parent.glob("*.py"))
    assert sum(len(p.read_text().splitlines()) for p in modules) <= 910  # 865 with the MoE warm-up driven offline (moe.py, 172) and one voice with b12x's books; 900 with doctor's 'prewarm plans' column (scan.py)
    for path in modules:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, path.name



def test_a_b12x_key_does_not_depend_on_what_else_the_process_set_up(b12x_python: str) -> None:
    """b12x's compile worker replaces ``compiler._call_cute_compile`` with a counting wrapper of
    ``compile_pool``'s, so a fingerprint of what the compiler's globals reach took in
    ``compile_pool`` in a prewarm worker and not in a serving process: every CPU-prewarmed dense
    GEMM missed on the lent H100 (``bench/results/gpu_proof_b12x_h100_before.json``). b12x's row
    fingerprints its whole tree, which covers every b12x module whatever the process imported."""
    code = """
        import json, sys
        from cute_diskcache.b12x_sites import planning
        if sys.argv[-1] == "worker":
            planning.init_worker("rtx-pro-6000")
        else:
            from cute_diskcache.keys import targets
            targets.apply("rtx-pro-6000")
        import b12x._lib.compiler, b12x._lib.dense_gemm
        from cute_diskcache.b12x_sites import sites
        from cute_diskcache.b12x_sites.adapter import ADAPTER
        from cute_diskcache.core import hook
        env = hook._environment_of(sites.ROWS[0], ("b12x._lib.compiler", "b12x._lib.dense_gemm"), ADAPTER)
        print(json.dumps([env.sources, sys.argv[-1]]))
    """
    seen = {}
    for mode in ("worker", "serving"):
        proc = subprocess.run([b12x_python, "-c", textwrap.dedent(code), mode], env=_env(None, {}), capture_output=True,
                              text=True, timeout=TIMEOUT_S, cwd=str(REPO / "tests"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        sources, got = json.loads(proc.stdout.strip().splitlines()[-1])
        seen[got] = sources
    assert seen["worker"] == seen["serving"], seen

# --------------------------------------------------------------------------------------------
# prewarm --linear-backend b12x (issue 32 items 3 and 4a)
# --------------------------------------------------------------------------------------------

MODEL = "llama-3.1-8b-nvfp4"
#: Token counts for the tests: three row capacities of b12x's (1, 8, 16), 12 jobs; the whole
#: default set (52 counts, 44 jobs, 18 kernels, ~45 s on 2 cores) is what an operator runs.
MS = "1,8,16"


def _prewarm(python: str, root: Path, hook_dir: Path, *flags: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    proc = subprocess.run([python, "-m", "cute_diskcache.prewarm", MODEL, "--target", "rtx-pro-6000", "--linear-backend", "b12x",
                           "--m", MS, "--json", "--root", str(root), *flags], env=_env(root, {}, hook_dir),
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=hook_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout), proc


def test_prewarm_dry_run_lists_the_b12x_jobs_vllms_warmup_needs(b12x_python: str, tmp_path: Path, compile_hook_dir: Path) -> None:
    """b12x's own planning on meta tensors: one job per linear shape and row capacity (the next
    power of two of a token count), nothing compiled, nothing written."""
    out, _ = _prewarm(b12x_python, tmp_path / "root", compile_hook_dir, "--dry-run")
    rows = out["job_list"]
    assert out["jobs"] == len(rows) == 4 * 3 and out["kernels_compiled"] == 0
    assert {(r["linear"], r["n"], r["k"]) for r in rows} == {("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096),
                                                            ("gate_up_proj", 28672, 4096), ("down_proj", 4096, 14336)}
    assert sorted({r["capacity"] for r in rows}) == [1, 8, 16] and all(r["ms"] == [r["capacity"]] for r in rows)
    assert not (tmp_path / "root" / "v1").exists()


def test_the_token_counts_are_vllms() -> None:
    from cute_diskcache.b12x_sites import planning

    counts = planning.token_counts(8192)
    assert counts[:5] == (1, 2, 4, 8, 16) and counts[-3:] == (496, 512, 8192) and len(counts) == 52
    assert planning.token_counts(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)  # the ceiling is the batch


@pytest.mark.slow
def test_after_prewarm_vllms_b12x_warmup_path_compiles_nothing(b12x_python: str, tmp_path: Path, compile_hook_dir: Path) -> None:
    """Issue 32 item 4a on the CPU: prewarm, then a fresh process making the calls vLLM's b12x
    warm-up resolves to (b12x's planning, then its jobs' factories) loads every kernel: 0 compiles,
    counted by the DSL's own compile entry point."""
    from conftest import split_stderr

    root = tmp_path / "root"
    out, _ = _prewarm(b12x_python, root, compile_hook_dir, "--jobs", "2")
    kernels = out["kernels_compiled"]
    assert out["jobs"] == 12 and kernels > 0 and out["errors"] == 0, out
    assert len(_entries(root)) == kernels and all(n.startswith("b12x.dense_gemm.") for n in _entries(root)), _entries(root)
    proc = subprocess.run([b12x_python, str(REPO / "tests" / "b12x_linear_driver.py"), MODEL, "rtx-pro-6000", MS],
                          env=_env(root, {}, compile_hook_dir), capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=compile_hook_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fresh = json.loads(proc.stdout.strip().splitlines()[-1])
    _stderr, _log, real = split_stderr(proc.stderr)
    assert real == 0 and fresh["compiles"] == 0 and fresh["counters"]["hits"] == kernels, (real, fresh)
    _prewarm_again_skips_every_job(b12x_python, root, compile_hook_dir, kernels)
    _check_gates_the_prewarmed_root(b12x_python, root, compile_hook_dir)


def _prewarm_again_skips_every_job(python: str, root: Path, hook_dir: Path, kernels: int, *flags: str) -> None:
    """A second prewarm over the filled root plans, finds every job's kernels in the store and
    reports them cached without a worker loading them (flashinfer's prewarm skips its cached
    kernels too); the code before loaded every entry again in spawned workers."""
    out, _ = _prewarm(python, root, hook_dir, "--jobs", "2", *flags)
    assert out["kernels_compiled"] == 0 and out["kernels_cached"] == kernels and out["errors"] == 0, out
    assert {r["status"] for r in out["job_list"]} == {"cached"} and sum(r["seconds"] for r in out["job_list"]) == 0, out["job_list"]


def _check(python: str, root: Path, hook_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "cute_diskcache", "--root", str(root), "check", MODEL, "--target", "rtx-pro-6000",
                           "--linear-backend", "b12x", "--m", MS, *flags], env=_env(root, {}, hook_dir),
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=hook_dir)


def _check_gates_the_prewarmed_root(python: str, root: Path, hook_dir: Path) -> None:
    """``check --linear-backend b12x`` (issue 32 item 3): b12x's planned jobs, judged as flashinfer's
    are. On the prewarmed root every kernel is there; with one entry gone the gate fails naming it
    and the prewarm that puts it back; nothing compiles and nothing is written either time."""
    from cute_diskcache.storage import entry, layout

    digests = sorted(m.parent.name for m in root.rglob(entry.MANIFEST))
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    ok = _check(python, root, hook_dir, "--json")
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-4000:]
    report = json.loads(ok.stdout)
    assert report["ok"] and report["linear_backend"] == "b12x" and report["counts"] == {"ok": len(digests), "missing": 0, "unusable": 0}
    assert sorted(r["digest"] for r in report["kernels"]) == digests, report["kernels"]
    assert {r["group"] for r in report["kernels"]} == {"b12x"} and all(r["ms"] for r in report["kernels"])
    gone = layout.entry_dir(root, next(r["namespace"] for r in report["kernels"] if r["digest"] == digests[0]), digests[0])
    shutil.rmtree(gone)
    failed = _check(python, root, hook_dir)
    assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-4000:]
    lines = [line for line in failed.stdout.splitlines() if line.startswith("b12x/")]
    assert len(lines) == 1 and digests[0][:12] in lines[0] and "missing" in lines[0], failed.stdout
    assert f"FAILED: 1 of {len(digests)} kernels" in failed.stdout and "--linear-backend b12x" in failed.stdout
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == [p for p in before if not p.startswith(str(gone.relative_to(root)))]


def test_check_for_b12x_refuses_what_it_cannot_plan(b12x_python: str, tmp_path: Path) -> None:
    """``check --linear-backend b12x`` exits 2 with one line, reading nothing of the root, where it
    cannot gate: no b12x here, a MoE model (b12x's MoE kernels are not planned), or b12x's kernels
    left to b12x's own cache (the hook would hand the planning's compiles to b12x: they would run)."""
    root = tmp_path / "root"
    cases = ((sys.executable, MODEL, {}, "needs the b12x package"),
             (b12x_python, "qwen3-30b-a3b", {}, "is a MoE model"),
             (b12x_python, MODEL, {"CUTE_DISKCACHE_NATIVE_SITES": "b12x"}, "b12x's own disk cache"))
    for python, model, extra, why in cases:
        proc = subprocess.run([python, "-m", "cute_diskcache", "--root", str(root), "check", model, "--target", "rtx-pro-6000",
                               "--linear-backend", "b12x"], env=_env(root, extra), capture_output=True, text=True,
                              timeout=TIMEOUT_S, cwd=str(tmp_path))
        assert proc.returncode == 2 and why in proc.stderr, (model, extra, proc.stdout[-2000:], proc.stderr[-2000:])
    assert not root.exists()


# --------------------------------------------------------------------------------------------
# The engine's flags mean the same for b12x: --dtype, another host machine, the closing lines
# --------------------------------------------------------------------------------------------

SPARK = ("--target", "dgx-spark", "--linear-backend", "b12x", "--m", "1")


def _cli(python: str, root: Path, *args: str, hook_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "cute_diskcache", "--root", str(root), *args], env=_env(root, {}, hook_dir),
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=str(hook_dir or root.parent))


def test_a_target_chosen_after_b12x_was_imported_still_applies(b12x_python: str) -> None:
    """prewarm and check import b12x to plan before they install the cache with the target; the
    profile was applied only once flashinfer was imported, so on an environment where nothing
    imports flashinfer the DSL compiled for its own default arch (sm_100a) and check looked in
    that namespace. Now a library already imported gets the profile when the target is set."""
    out = _child(b12x_python, """
        import json, os, sys
        import b12x._lib.compiler
        from cute_diskcache.activation import install
        install(target="dgx-spark")
        from cute_diskcache.keys import key
        print(json.dumps([os.environ.get("CUTE_DSL_ARCH"), key.current_arch(), "flashinfer" in sys.modules]))
    """, {})
    assert out == ["sm_121a", "sm_121a", False], out


def test_a_spark_target_plans_and_checks_b12x_s_kernels_in_the_aarch64_namespace(b12x_python: str, tmp_path: Path) -> None:
    """``--target dgx-spark`` on an x86 box: a Spark's engine reads the aarch64 namespace, so
    prewarm plans for an aarch64 host and ``check`` looks there (it once planned and looked in
    x86_64's, where no Spark ever reads). Planning only: nothing compiles, nothing is written."""
    root = tmp_path / "root"
    dry = _cli(b12x_python, root, "--json", "prewarm", MODEL, *SPARK, "--dry-run")
    assert dry.returncode == 0, dry.stderr[-4000:]
    assert json.loads(dry.stdout)["host_machine"] == "aarch64"
    gate = _cli(b12x_python, root, "--json", "check", MODEL, *SPARK)
    assert gate.returncode == 1, gate.stdout[-2000:] + gate.stderr[-4000:]
    report = json.loads(gate.stdout)
    assert report["host_machine"] == "aarch64" and report["counts"]["missing"] == len(report["kernels"]) > 0
    assert {r["namespace"].split("-sm_121a-")[1].split("-")[0] for r in report["kernels"]} == {"aarch64"}, report["kernels"]
    assert not root.exists()


def test_dtype_is_the_b12x_linears_output_dtype(b12x_python: str, tmp_path: Path) -> None:
    """vLLM's NVFP4 linears pass the activations' dtype as b12x's output dtype: ``--dtype float16``
    plans other kernels than the checkpoint's bfloat16 (it was ignored: the bfloat16 ones were
    planned, and a float16 engine compiled at start). A dtype no NVFP4 linear serves is refused."""
    root = tmp_path / "root"
    dry = _cli(b12x_python, root, "--json", "prewarm", MODEL, "--target", "rtx-pro-6000", "--linear-backend", "b12x",
               "--m", "1", "--dry-run", "--dtype", "half")
    assert dry.returncode == 0 and json.loads(dry.stdout)["model"]["out_dtype"] == "float16", dry.stderr[-4000:]
    digests = {}
    for dtype in ("auto", "float16"):
        gate = _cli(b12x_python, root, "--json", "check", MODEL, "--target", "rtx-pro-6000", "--linear-backend", "b12x",
                    "--m", "1", "--dtype", dtype)
        assert gate.returncode == 1, gate.stdout[-2000:] + gate.stderr[-4000:]
        digests[dtype] = {r["digest"] for r in json.loads(gate.stdout)["kernels"]}
    assert digests["auto"] and digests["float16"] and not digests["auto"] & digests["float16"], digests
    bad = _cli(sys.executable, root, "prewarm", MODEL, "--target", "rtx-pro-6000", "--linear-backend", "b12x", "--dtype", "float32")
    assert bad.returncode == 2 and "--dtype: invalid choice: 'float32'" in bad.stderr, bad.stderr[-2000:]
    assert not root.exists()


@pytest.mark.slow
def test_prewarm_for_a_spark_cross_builds_b12x_s_kernels_and_names_the_gate(b12x_python: str, tmp_path: Path,
                                                                             compile_hook_dir: Path) -> None:
    """``prewarm --target dgx-spark --linear-backend b12x`` on x86 (m 1: four jobs, one kernel each):
    the workers write aarch64 host code (the DSL's own ABI cross-export, :mod:`cute_diskcache.core.crossbuild`)
    into the aarch64 namespace, as for flashinfer's kernels, and prewarm closes as flashinfer's does,
    naming the deploy gate; that gate, run as printed, passes here for a Spark."""
    import shlex

    from cute_diskcache.storage import elf, entry

    root = tmp_path / "root"
    # One worker compiles the four kernels: a second would be another interpreter importing torch, the
    # DSL and b12x (seconds of CPU) to prove nothing more here; two workers at once are the warm-up test's
    # (test_after_prewarm_vllms_b12x_warmup_path_compiles_nothing, --jobs 2).
    proc = _cli(b12x_python, root, "prewarm", MODEL, *SPARK, "--jobs", "1", hook_dir=compile_hook_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    manifests = sorted(root.rglob(entry.MANIFEST))
    assert manifests and all("-sm_121a-aarch64-" in m.parent.parent.parent.name for m in manifests), manifests
    objects = [p for m in manifests for p in m.parent.glob("object-*.o")]
    assert len(objects) == len(manifests) and {elf.machine(p.read_bytes()) for p in objects} == {183}, "EM_AARCH64"
    assert f"wrote to {root}: {len(manifests)} entries" in proc.stdout, proc.stdout
    assert "note: the entries hold aarch64 host code" in proc.stdout
    assert "attached:" not in proc.stderr, "the workers are prewarm workers: no engine attach line"
    [gate_line] = [line for line in proc.stdout.splitlines() if "gate a deploy with: " in line]
    gate = shlex.split(gate_line.split("gate a deploy with: ")[1].split("  (")[0])
    assert gate[0] == "cute-diskcache" and "--linear-backend" in gate and "dgx-spark" in gate, gate_line
    checked = subprocess.run([b12x_python, "-m", "cute_diskcache", *gate[1:]], env=_env(root, {}, compile_hook_dir),
                             capture_output=True, text=True, timeout=TIMEOUT_S, cwd=compile_hook_dir)
    assert checked.returncode == 0 and checked.stdout.startswith(f"ok: all {len(manifests)} kernels"), checked.stdout + checked.stderr[-3000:]
    again = _cli(b12x_python, root, "prewarm", MODEL, *SPARK, "--jobs", "2", "--json", hook_dir=compile_hook_dir)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-4000:]
    out = json.loads(again.stdout)
    assert out["kernels_compiled"] == 0 and out["kernels_cached"] == len(manifests), out
    assert {r["status"] for r in out["job_list"]} == {"cached"}, "a second cross-build plans and skips: no worker loads aarch64 code"
    assert sorted(root.rglob(entry.MANIFEST)) == manifests


# --------------------------------------------------------------------------------------------
# b12x's own flows that pass kernels between processes through its disk layer
# --------------------------------------------------------------------------------------------

_POOL = """
    import json, sys, time
    from pathlib import Path
    from cute_diskcache.keys import targets
    from cute_diskcache.prewarm import models
    from cute_diskcache.b12x_sites import planning
    from b12x._lib import compile_plan, compiler
    from b12x._lib.compile_pool import CompilePool

    def main():
        card = "rtx-pro-6000"
        profile = targets.get(card)
        # b12x's planning for one linear shape, as prewarm plans it (b12x's own query -> plan -> jobs)
        planning.init_worker(card)
        job = planning.plan(models.dense_shape("llama-3.1-8b-nvfp4"), (1,), profile)[1].job
        # b12x's startup preparation with one compile worker: a spawned process, our cache on in it
        pool = CompilePool(device_ordinal=0, compute_capability=tuple(profile.capability),
                           device_uuid="GPU-00000000-0000-0000-0000-000000000000", product_name=profile.device_name,
                           sm_count=profile.sm_count, max_shared_memory_per_block=profile.max_shared_memory_per_block_optin,
                           max_shared_memory_per_multiprocessor=profile.max_shared_memory_per_multiprocessor, workers=1)
        programs = tuple(pool.submit_plans(pool.plan([job]), required=True))
        deadline = time.monotonic() + 240
        while not pool.ready(programs) and time.monotonic() < deadline:
            time.sleep(0.1)
        ready = pool.ready(programs)
        pool.close(terminate=True)
        keys = [p.key for p in programs if p.dialect == "cute"]
        loads = {}
        for when, scope in (("serving", None), ("no_lowering", compile_plan.forbid_lowering)):
            if scope is None:
                loads[when] = [compiler._load_cute_compile_from_disk(k) is not None for k in keys]
            else:
                with scope():
                    loads[when] = [compiler._load_cute_compile_from_disk(k) is not None for k in keys]
        print(json.dumps({"ready": ready, "cute_programs": len(keys),
                          "available": [compile_plan.compiled_program_available(p) for p in programs],
                          "loads": loads}))

    if __name__ == "__main__":
        main()
"""


@pytest.mark.slow
def test_b12x_s_compile_pool_publishes_to_its_parent_while_ours_serves(b12x_python: str, tmp_path: Path) -> None:
    """b12x's preparation with compile workers learns that a worker's kernel exists, and loads it,
    only through b12x's disk (``compiled_program_available``; a no-compilation phase loads, never
    compiles). With b12x's disk standing aside everywhere, the parent never saw the worker's kernel:
    a ``PreparationSession(compile_workers>0)`` then failed with "compiler completed without
    publishing required artifacts". Now the worker compiles through our hook (the kernel is in our
    cache) and still publishes to b12x's disk; outside a no-compilation phase a load stays ours."""
    root, b12x_cache, site = tmp_path / "root", tmp_path / "b12x-cache", tmp_path / "site"
    # activation as an installed package has it, in the worker b12x spawns too: our .pth, read at start-up
    site.mkdir()
    shutil.copy(REPO / "cute_diskcache.pth", site / "zz_cute_diskcache.pth")
    (site / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")
    script = tmp_path / "pool_parent.py"
    script.write_text(textwrap.dedent(_POOL))
    env = _env(root, {"FLASHINFER_B12X_DISK_CACHE": "1", "CUTE_DISKCACHE_TARGET": "rtx-pro-6000",
                      "B12X_COMPILE_CACHE_DIR": str(b12x_cache)})
    env["PYTHONPATH"] = os.pathsep.join((str(site), env["PYTHONPATH"]))
    proc = subprocess.run([b12x_python, str(script)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ready"] and out["cute_programs"] == 1, out
    assert out["available"] == [True], "the parent sees what its worker compiled"
    assert out["loads"] == {"serving": [False], "no_lowering": [True]}, out
    assert [e.rsplit(".", 1)[0] for e in _entries(root)] == ["b12x.dense_gemm"], "the worker's compile went through our cache"
    assert len(list(b12x_cache.rglob("*.o"))) == 1, "and was published where b12x's parent reads it"


def test_our_prewarm_workers_leave_b12x_s_disk_alone(b12x_python: str, tmp_path: Path) -> None:
    """b12x's worker set-up, which our prewarm workers run too, marks a process as b12x's compile
    worker; ours must still write only our cache (a build box gets no b12x cache of its own)."""
    out = _child(b12x_python, """
        import json
        from cute_diskcache.b12x_sites import native, planning
        from b12x._lib import compiler
        planning.init_worker("rtx-pro-6000")
        print(json.dumps({"offline_worker": bool(compiler._OFFLINE_CUTE_NO_JIT), "publishes": native._publishes(compiler),
                          "lock": type(compiler._disk_cache_key_lock("0" * 64)).__name__}))
    """, {})
    assert out == {"offline_worker": True, "publishes": False, "lock": "nullcontext"}, out
