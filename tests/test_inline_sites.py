"""Compile sites (issues 13, 22): the one hook on ``cutlass.cute.compile`` and the key it builds.

What the real flashinfer 0.7.4 tests (tests/test_flashinfer_074_dense.py: MSA's ops) cannot
isolate: which callers are intercepted (by file under flashinfer's package and qualified name,
including code imported under another module name, as the expert-parallel kernels are), that
the key holds every input of the compile a different kernel can come from (symbol sharing
between fake tensors, a launcher's closure, a kernel object's state), and that what cannot be
described or carried by a loaded kernel is left in memory. The dispatcher test compiles a real
kernel with the real DSL for the rtx-pro-6000 profile in fresh processes; the site module is a
stand-in placed in a directory the test names flashinfer's package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from cute_diskcache.core import hook
from cute_diskcache.core import through
from cute_diskcache.flashinfer_sites import sites
from cute_diskcache.flashinfer_sites.adapter import ADAPTER as FLASHINFER
from cute_diskcache.keys.key import UnkeyableError, encode

cute = pytest.importorskip("cutlass.cute")
import cutlass  # noqa: E402


def _fake(*shape: object, align: int = 16) -> object:
    return cute.runtime.make_fake_compact_tensor(cutlass.Float16, shape, assumed_align=align)


def test_fake_tensors_sharing_a_symbol_are_another_key_than_two_that_do_not() -> None:
    """MSA's decode gives mCuK its own symbol so the compiled signature accepts per-request
    lengths: tied and untied extents compile to different signatures."""
    def tied() -> tuple[object, ...]:
        s = cute.sym_int()
        return hook.describe(_fake(s, 128), _fake(s, 64))

    def untied() -> tuple[object, ...]:
        return hook.describe(_fake(cute.sym_int(), 128), _fake(cute.sym_int(), 64))

    assert tied() == tied() and untied() == untied()  # fresh symbols, same structure: the same key
    assert tied() != untied()
    assert hook.describe(_fake(cute.sym_int(divisibility=8), 128)) != hook.describe(_fake(cute.sym_int(), 128))
    assert hook.describe(_fake(cute.sym_int(), 128, align=16)) != hook.describe(_fake(cute.sym_int(), 128, align=4))
    encode(tied())  # key data


def _flashinfer_module(name: str, source: str) -> types.ModuleType:
    """Stand-in for one of flashinfer's modules: its functions and classes say they are flashinfer's."""
    mod = types.ModuleType(f"flashinfer._cdc_test_{name}")
    mod.__dict__.update(cute=cute, cutlass=cutlass)
    # dont_inherit: annotations evaluated at definition, as in flashinfer's modules (this file's
    # ``from __future__ import annotations`` would otherwise make them strings)
    exec(compile(textwrap.dedent(source), mod.__name__, "exec", dont_inherit=True), mod.__dict__)  # noqa: S102
    for obj in mod.__dict__.values():
        if isinstance(obj, type):
            obj.__module__ = mod.__name__
    sys.modules[mod.__name__] = mod
    return mod


@pytest.fixture
def launchers() -> types.ModuleType:
    mod = _flashinfer_module("launchers", """
        def launcher(hidden, grid):
            @cute.jit
            def _launch(x: cute.Tensor) -> None:
                return (hidden, grid)  # closed over, as the expert-parallel reduce launchers close over theirs

            return _launch

        def make_kernel(wide):
            # one factory, two annotations: the DSL specialises on them
            def kernel(x: cutlass.Float32 if wide else cutlass.Float16, n: cutlass.Constexpr[int]):
                return x

            return kernel

        double = lambda x: x * 2  # noqa: E731
        triple = lambda x: x * 3  # noqa: E731
    """)
    yield mod
    del sys.modules[mod.__name__]


def test_a_launchers_closure_is_in_the_key(launchers: types.ModuleType) -> None:
    launcher = launchers.launcher
    assert hook.describe(launcher(4096, [8, 1, 1])) == hook.describe(launcher(4096, [8, 1, 1]))
    assert hook.describe(launcher(4096, [8, 1, 1])) != hook.describe(launcher(7168, [8, 1, 1]))
    assert hook.describe(launcher(4096, [8, 1, 1])) != hook.describe(launcher(4096, [16, 1, 1]))
    fn = hook.describe(launcher(4096, [8, 1, 1]))[0]
    assert fn[0] == "function" and fn[2].endswith("launcher.<locals>._launch"), fn  # the body, not the DSL's wrapper


def test_a_functions_code_and_annotations_are_in_the_key(launchers: types.ModuleType) -> None:
    """Issue 22: module, qualified name, defaults and closure do not tell two functions apart.

    Two lambdas of one module share all four; so do the closures of one factory whose
    annotations (which the DSL specialises on) differ.
    """
    assert launchers.double.__qualname__ == launchers.triple.__qualname__
    assert hook.describe(launchers.double) != hook.describe(launchers.triple)
    assert hook.describe(launchers.double) == hook.describe(launchers.double)
    wide, narrow = launchers.make_kernel(True), launchers.make_kernel(False)
    assert hook.describe(wide) != hook.describe(narrow)
    assert hook.describe(wide) == hook.describe(launchers.make_kernel(True))
    encode(hook.describe(wide, narrow, launchers.double))  # key data


def test_a_function_from_a_module_no_key_fingerprints_is_refused(launchers: types.ModuleType) -> None:
    """Issue 22: a callback from outside flashinfer (a ``score_mod`` held by a kernel object) was
    keyed by its name while edits to its module changed nothing: x*2 and x*3 shared an entry."""
    def score_mod(x: object) -> object:  # this test module: neither flashinfer's nor the DSL's
        return x

    kernels = _flashinfer_module("holder", """
        class Attention:
            def __init__(self, score_mod):
                self.score_mod = score_mod
    """)
    try:
        with pytest.raises(UnkeyableError, match="not fingerprinted"):
            hook.describe(score_mod)
        with pytest.raises(UnkeyableError, match="not fingerprinted"):
            hook.describe(kernels.Attention(score_mod))
        hook.describe(kernels.Attention(launchers.double))  # flashinfer's own callback is keyed
        hook.describe(cute.make_layout)  # the DSL's functions are versioned by the DSL stack
    finally:
        del sys.modules[kernels.__name__]


@pytest.fixture
def kernels() -> types.ModuleType:
    """A module of flashinfer's (by name) defining a kernel class, as MSA's kernel modules do."""
    mod = types.ModuleType("flashinfer._cdc_test_kernels")
    exec(textwrap.dedent("""
        class Kernel:
            def __init__(self, head_dim, paged, dtype, extra=None):
                self.head_dim, self.paged, self.dtype, self.extra = head_dim, paged, dtype, extra

        class MsaProxyScoreDecodeStreamSm12x(Kernel):
            pass
    """), mod.__dict__)  # noqa: S102
    for obj in mod.__dict__.values():
        if isinstance(obj, type):
            obj.__module__ = mod.__name__
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_a_kernel_objects_whole_state_is_in_the_key(kernels: types.ModuleType) -> None:
    K = kernels.Kernel
    assert hook.describe(K(128, True, cutlass.Float16)) == hook.describe(K(128, True, cutlass.Float16))
    for other in (K(64, True, cutlass.Float16), K(128, False, cutlass.Float16), K(128, True, cutlass.BFloat16)):
        assert hook.describe(other) != hook.describe(K(128, True, cutlass.Float16))
    # Regression: a kernel class named "...Stream..." (MSA's streaming proxy score) was taken for a
    # CUDA stream, keyed by its type alone: every head dim and layout shared one entry.
    S = kernels.MsaProxyScoreDecodeStreamSm12x
    assert hook.describe(S(128, True, cutlass.Float16)) != hook.describe(S(64, True, cutlass.Float16))
    d = hook.describer()
    d(K(128, True, cutlass.Float16))
    assert "flashinfer._cdc_test_kernels" in d.modules  # its module joins the source fingerprint


def test_what_cannot_be_described_is_refused_never_guessed(kernels: types.ModuleType) -> None:
    with pytest.raises(UnkeyableError):
        hook.describe(kernels.Kernel(128, True, cutlass.Float16, extra=object()))
    with pytest.raises(UnkeyableError):
        hook.describe(object())  # not flashinfer's, not the DSL's


class KeepPTX:
    """Stands in for the DSL's option objects (their class name is what counts)."""

    def __init__(self, value: object = True) -> None:
        self.value = value


class DumpDir(KeepPTX):
    pass


class KeepCUBIN(KeepPTX):
    pass


def test_ptx_options_are_kept_out_of_the_key_and_other_artifacts_are_refused() -> None:
    """GDN's compile cache keeps the PTX of each SM12x kernel in a fresh temporary directory:
    the directory changes no code (not keyed), keeping the PTX is keyed (those entries carry it).
    A CUBIN a loaded kernel cannot hand back leaves the compile in memory."""
    def options(*opts: object) -> object:
        return hook._options(through.Call({}, (), {}, dsl_options=opts))

    assert hook._options(through.Call({}, (), {"options": "--enable-tvm-ffi"}))
    assert options(KeepPTX(), DumpDir("/tmp/a")) == options(KeepPTX(), DumpDir("/tmp/b"))
    assert options(KeepPTX(), DumpDir("/tmp/a"))[-1] == "keep-ptx" and options(DumpDir("/tmp/a"))[-1] != "keep-ptx"
    with pytest.raises(UnkeyableError, match="artifacts"):
        options(KeepCUBIN())


def test_sites_are_named_as_the_scan_names_them() -> None:
    """The table's (file, function) pairs are what ``doctor`` matches: nested functions drop
    ``<locals>``, methods keep their class."""
    code = compile("def launch_fwd():\n    def _compile():\n        pass\n    return _compile\n", "/x/flashinfer/kda/decomp.py", "exec")
    ns: dict[str, object] = {}
    exec(code, ns)  # noqa: S102
    inner = ns["launch_fwd"]().__code__  # type: ignore[operator]
    root = os.path.realpath("/x/flashinfer")
    old = FLASHINFER.package_dir
    FLASHINFER.package_dir = lambda: root
    try:
        assert hook._where(inner) == (FLASHINFER, "kda/decomp.py", "launch_fwd._compile")
    finally:
        FLASHINFER.package_dir = old
    assert len({(r.file, r.function) for r in sites.ROWS}) == len(sites.ROWS) == len(sites.BY_WHERE)


# --------------------------------------------------------------------------------------------
# The dispatcher with the real DSL, in fresh processes
# --------------------------------------------------------------------------------------------

SITE = textwrap.dedent(
    """
    import cutlass
    import cutlass.cute as cute


    @cute.kernel
    def _add(x: cute.Tensor, value: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        x[tidx] = x[tidx] + cutlass.Float32(value)


    def build(value):
        @cute.jit
        def launch(x: cute.Tensor):
            _add(x, value).launch(grid=(1, 1, 1), block=(32, 1, 1))

        import cutlass.cute as cute_inside  # as MSA's ops import it, inside the function
        x = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (32,))
        return cute_inside.compile(launch, x)


    def build_keeping_ptx(value):
        # as GDN's compile cache does on SM12x: keep the PTX, in a fresh directory, and read it
        import tempfile
        from cutlass.base_dsl.compiler import DumpDir

        @cute.jit
        def launch(x: cute.Tensor):
            _add(x, value).launch(grid=(1, 1, 1), block=(32, 1, 1))

        x = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (32,))
        with tempfile.TemporaryDirectory() as tmp:
            compiled = cute.compile[(cute.KeepPTX(True), DumpDir(tmp))](launch, x)
            ptx = compiled.__ptx__
        return ptx if isinstance(ptx, str) and ptx.lstrip().startswith("//") else None


    def other(value):
        @cute.jit
        def launch(x: cute.Tensor):
            _add(x, value).launch(grid=(1, 1, 1), block=(32, 1, 1))

        return cute.compile(launch, cute.runtime.make_fake_compact_tensor(cutlass.Float32, (32,)))
    """
)

CHILD = textwrap.dedent(
    """
    import json, sys
    from cute_diskcache.keys import targets
    targets.apply("rtx-pro-6000")
    import cute_diskcache
    from cute_diskcache.core import hook
    from cute_diskcache.flashinfer_sites import sites
    package, values = sys.argv[1], [float(v) for v in sys.argv[2].split(",")]
    from cute_diskcache.flashinfer_sites.adapter import ADAPTER
    ADAPTER.package_dir = lambda: package
    for function, kind in (("build", "test_build"), ("build_keeping_ptx", "test_ptx")):
        row = sites.Row("kernels/site.py", function, kind, "flashinfer.test." + kind, "test", tree="kernels")
        sites.BY_WHERE[(row.file, row.function)] = row
    assert hook.patch()
    import importlib.util
    spec = importlib.util.spec_from_file_location("cdc_inline_site", package + "/kernels/site.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cdc_inline_site"] = mod
    spec.loader.exec_module(mod)
    out = {"built": [type(mod.build(v)).__name__ for v in values]}
    out["after_build"] = cute_diskcache.counters()
    mod.other(values[0])
    out["after_other"] = cute_diskcache.counters()
    if "--ptx" in sys.argv:
        import hashlib
        ptx = mod.build_keeping_ptx(values[0])
        out["ptx_sha256"] = ptx and hashlib.sha256(ptx.encode()).hexdigest()
        out["ptx_entry"] = bool(ptx) and ".entry" in ptx
    from cute_diskcache.core.cache import default_cache
    out["events"] = [(e[0], e[2]) for e in default_cache().events]
    hook.unpatch()
    import cutlass.cute as cute
    out["restored"] = not isinstance(cute.compile, hook._Dispatch)
    print(json.dumps(out))
    """
)


def _child(root: Path, package: Path, values: str, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k != "CUTE_DSL_ARCH"}
    env.update(CUTE_DISKCACHE_DIR=str(root), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(package), values, *flags], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_an_inline_site_compiles_once_and_other_callers_pass_through(tmp_path: Path) -> None:
    package = tmp_path / "flashinfer"
    (package / "kernels").mkdir(parents=True)
    (package / "kernels" / "site.py").write_text(SITE)
    root = tmp_path / "root"

    cold = _child(root, package, "1.0")
    assert cold["events"] == [["flashinfer.test.test_build", "miss"]], cold
    assert cold["after_build"]["compiles"] == 1 and cold["after_build"]["writes"] == 1
    # other() is in the same file, not in the table: the real compile, untouched by the cache
    assert cold["after_other"] == cold["after_build"] and cold["restored"]

    warm = _child(root, package, "1.0,2.0")
    assert warm["events"] == [["flashinfer.test.test_build", "hit"], ["flashinfer.test.test_build", "miss"]], warm
    assert warm["after_build"]["compiles"] == 1 and warm["after_build"]["hits"] == 1  # 2.0: its closure, another key

    # The kernel tree is the fingerprint: editing any file in it is a miss, never the old kernel.
    (package / "kernels" / "helpers.py").write_text("HIDDEN = 4096\n")
    edited = _child(root, package, "1.0")
    assert edited["events"] == [["flashinfer.test.test_build", "miss"]], edited


@pytest.mark.slow
def test_a_compile_that_keeps_its_ptx_gets_it_back_on_a_hit(tmp_path: Path) -> None:
    """GDN's compile cache compiles every SM12x kernel with KeepPTX into a fresh temporary
    directory and rejects the kernel unless its PTX passes a check. The directory is not in the
    key (it changes every call, and no code); the PTX is stored with the entry and a hit answers
    ``__ptx__`` with the compiled kernel's own text."""
    package = tmp_path / "flashinfer"
    (package / "kernels").mkdir(parents=True)
    (package / "kernels" / "site.py").write_text(SITE)
    root = tmp_path / "root"
    cold = _child(root, package, "1.0", "--ptx")
    assert cold["events"][-1] == ["flashinfer.test.test_ptx", "miss"] and cold["ptx_entry"], cold
    warm = _child(root, package, "1.0", "--ptx")
    assert warm["events"][-1] == ["flashinfer.test.test_ptx", "hit"], warm
    assert warm["ptx_sha256"] == cold["ptx_sha256"] and warm["ptx_entry"]


@pytest.mark.parametrize("dsl_first", [False, True])
def test_the_hook_is_in_place_whichever_is_imported_first(dsl_first: bool) -> None:
    """Regression: the hook used to be put in place only when a flashinfer module we watch was
    imported after the DSL; a process that reached an inline site through modules we do not watch
    (the expert-parallel kernels, imported under their own names) compiled uncached."""
    code = textwrap.dedent(f"""
        import sys
        if {dsl_first}:
            import cutlass.cute
        import cute_diskcache
        cute_diskcache.install()
        import cutlass.cute as cute
        from cute_diskcache.core import hook
        print(isinstance(cute.compile, hook._Dispatch), "flashinfer" in sys.modules)
        cute_diskcache.uninstall()
        print(isinstance(cute.compile, hook._Dispatch))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k != "FLASHINFER_B12X_DISK_CACHE"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False", "False"], proc.stdout
