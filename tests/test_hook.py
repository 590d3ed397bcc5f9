"""The one interception (issue 22): which compiles the hook on ``cutlass.cute.compile`` takes, and how.

What the real-compile tests cannot isolate, on a stand-in flashinfer package (a temporary
directory the hook is told is flashinfer's; its modules are real files, loaded under
``flashinfer.*`` names, so their sources are fingerprinted as flashinfer's are) and a stand-in
for the DSL's compile that records what reaches it (no kernel is compiled here):

* only a compile with a table row within :data:`.sites.DEPTH` frames above it is a site, the
  nearest row is the one it is keyed under, and a frame of flashinfer's own disk cache between
  the two leaves the compile to flashinfer; a compile reached through flashinfer's shared
  block-scaled GEMM helper is a site for the b12x runner and not for the SM100 runner;
* the ``cute.compile[...]`` subscript is keyed; a Python int bound to a parameter the kernel
  declares as a DSL integer is a runtime argument (keyed by type: the b12x GEMM's scale
  extents), a ``Constexpr`` is keyed by value;
* flashinfer's native builder hands a compile the hook cannot key back to flashinfer's builder;
* side data from disk of another shape is a miss, never an exception; patching is reversible.

Compiles are planned (:func:`~cute_diskcache.core.through.planning`): the plan holds
exactly the keys a site would look up, and nothing compiles.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_flashinfer_074 import fi074  # noqa: E402,F401  (builds the 0.7.4 venv on a fresh checkout)
from _helpers import make_artifact  # noqa: E402

from cute_diskcache.core import cache as cache_module  # noqa: E402
from cute_diskcache.core import describe  # noqa: E402
from cute_diskcache.core.cache import CompileCache  # noqa: E402
from cute_diskcache.core import hook  # noqa: E402
from cute_diskcache.core import through  # noqa: E402
from cute_diskcache.flashinfer_sites import native, sites  # noqa: E402
from cute_diskcache.flashinfer_sites.adapter import ADAPTER as FLASHINFER  # noqa: E402
from cute_diskcache.flashinfer_sites.sites import Row  # noqa: E402
from cute_diskcache.keys.key import Environment, UnkeyableError, encode  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402

cute = pytest.importorskip("cutlass.cute")
import cutlass  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


class _RealCompile:
    """Stands in for the DSL's ``cutlass.cute.compile``: records what reaches it."""

    def __init__(self, calls: list[tuple[Any, ...]] | None = None, options: Any = None) -> None:
        self.calls = [] if calls is None else calls
        self.options = options

    def __getitem__(self, options: Any) -> "_RealCompile":
        return _RealCompile(self.calls, options)

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        self.calls.append((self.options, args, kwargs))
        return "compiled in memory"


class _Opt:
    """Stands in for the DSL's option objects: their repr holds an address, their state does not."""

    def __init__(self, level: int) -> None:
        self._value = level


class _Cute:
    """``cutlass.cute`` as a stand-in module sees it: the real DSL, with the hook over the stand-in compile."""

    def __init__(self, dispatch: hook._Dispatch) -> None:
        self.compile = dispatch

    def __getattr__(self, name: str) -> Any:
        return getattr(cute, name)


class Package:
    """A stand-in flashinfer package: files under ``root``, loaded as ``flashinfer._cdc_hooktest.*``."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.real = _RealCompile()
        self.dispatch = hook._Dispatch(self.real)
        self._monkeypatch = monkeypatch
        self.loaded: list[str] = []

    def module(self, file: str, source: str, **globals_: Any) -> types.ModuleType:
        """Write ``file`` and import it; ``cute.compile`` in it is the hook over the stand-in compile."""
        path = self.root / file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        name = "flashinfer._cdc_hooktest." + file.removesuffix(".py").replace("/", ".")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        module.__dict__.update(cute=_Cute(self.dispatch), cutlass=cutlass, **globals_)
        sys.modules[name] = module
        self.loaded.append(name)
        spec.loader.exec_module(module)
        return module

    def row(self, file: str, function: str, kind: str = "t", **kw: Any) -> Row:
        """A table row for one of this package's functions (the table is restored afterwards)."""
        row = Row(file, function, kind, f"flashinfer.hooktest.{kind}", "flashinfer-hooktest", **kw)
        self._monkeypatch.setitem(sites.BY_WHERE, (file, function), row)
        return row


def _forget() -> None:
    hook._CODES.clear()
    hook._OURS.clear()
    hook._tree_facts.cache_clear()
    through.site_sources.cache_clear()


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    root = tmp_path / "flashinfer"
    root.mkdir()
    real_root = os.path.realpath(root)
    monkeypatch.setattr(FLASHINFER, "package_dir", lambda: real_root)
    monkeypatch.setattr(hook, "_ENABLED", True)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_120a")
    monkeypatch.delenv("CUTE_DISKCACHE_NATIVE_SITES", raising=False)
    monkeypatch.setattr(cache_module, "_default", CompileCache(Store(tmp_path / "cache"), single_flight=False))
    _forget()
    pkg = Package(root, monkeypatch)
    yield pkg
    for name in pkg.loaded:
        sys.modules.pop(name, None)
    _forget()


# --------------------------------------------------------------------------------------------
# Which compiles are sites
# --------------------------------------------------------------------------------------------


def test_only_a_rows_compiles_go_through_the_cache_and_the_subscript_is_keyed(package: Package) -> None:
    """Replaces the per-module ``cute`` proxy's test: the row's function is intercepted (both
    call forms), another function of the same file reaches the real compile untouched."""
    mod = package.module("kernels/site.py", """
        def site(n, opt=None):
            return (cute.compile if opt is None else cute.compile[opt])(n, options="--x")

        def other(n):
            return cute.compile(n)
    """)
    row = package.row("kernels/site.py", "site")
    with through.planning() as plan:
        assert through.planned(mod.site(1)) and through.planned(mod.site(1))
        assert through.planned(mod.site(2)) and through.planned(mod.site(1, opt=_Opt(3)))
        assert through.planned(mod.site(1, opt=_Opt(2)))
        assert mod.other(3) == "compiled in memory"
    assert [p["site"] for p in plan] == [row.name] * 5
    digests = [p["digest"] for p in plan]
    assert digests[0] == digests[1] and len(set(digests)) == 4  # same call: same key; n, subscript: others
    assert plan[0]["key"].options == ("'--x'", "None")
    assert plan[3]["key"].options == ("'--x'", f"({__name__}._Opt:[('_value', '3')])")
    assert {"kernels/site.py:site", "site"} <= set(plan[0]["key"].site_key.tree)  # the site and where it compiled
    assert plan[0]["key"].env.kind == "flashinfer-hooktest"
    assert package.real.calls == [(None, (3,), {})]  # only other() reached the real compile


def _chain(package: Package) -> types.ModuleType:
    return package.module("kernels/chain.py", """
        def site(n):
            return step(n)

        def step(n):  # one frame per level between the site and its compile
            return step(n - 1) if n > 0 else cute.compile(n)

        def outer(n):
            return site(n)
    """)


def test_a_site_is_found_within_depth_frames_and_not_beyond(package: Package) -> None:
    mod = _chain(package)
    row = package.row("kernels/chain.py", "site")
    within, beyond = sites.DEPTH - 2, sites.DEPTH - 1  # the site sits n + 1 frames above the compile
    with through.planning() as plan:
        assert through.planned(mod.site(within))
        assert mod.site(beyond) == "compiled in memory"
    assert [p["site"] for p in plan] == [row.name]
    assert [call[1] for call in package.real.calls] == [(0,)]


def test_find_site_names_the_row_the_modules_on_the_way_and_where_it_compiled(package: Package) -> None:
    mod = package.module("kernels/probe.py", """
        def site(probe):
            return helper(probe)

        def helper(probe):
            return probe()
    """)
    row = package.row("kernels/probe.py", "site")
    found = mod.site(lambda: hook._find_site(sys._getframe(1)))
    assert found == (row, ("flashinfer._cdc_hooktest.kernels.probe",) * 2, "helper")
    assert hook._find_site(sys._getframe()) is None  # this test: no row above it


def test_the_nearest_row_wins(package: Package) -> None:
    """A compile reached from two rows (a memoising wrapper called by a compile function) is
    keyed once, under the row nearest to it: never two entries for one kernel."""
    mod = _chain(package)
    package.row("kernels/chain.py", "outer", "outer")
    inner = package.row("kernels/chain.py", "site", "inner")
    with through.planning() as plan:
        mod.outer(0)
    assert [p["site"] for p in plan] == [inner.name]


def test_a_compile_under_flashinfers_own_disk_cache_is_flashinfers(package: Package) -> None:
    """``jit/cute_dsl_core.py`` (flashinfer's native builder) between a site and its compile:
    flashinfer caches that kernel itself, so the hook passes it through (one kernel, one cache).
    The same builder *above* a site does not hide the site."""
    assert "jit/cute_dsl_core.py" in sites.OWN_DISK_CACHES
    core = package.module("jit/cute_dsl_core.py", """
        def build_and_load_cute_dsl_kernel(module_name, kernel_name, compile_fn, extra_key_files=()):
            return compile_fn()
    """)
    mod = package.module("kernels/native.py", """
        def through_builder(n):
            return build_and_load_cute_dsl_kernel("m", "k", lambda: cute.compile(n))

        def site(n):
            return cute.compile(n)
    """, build_and_load_cute_dsl_kernel=core.build_and_load_cute_dsl_kernel)
    row = package.row("kernels/native.py", "through_builder")
    inner = package.row("kernels/native.py", "site", "inner")
    with through.planning() as plan:
        assert mod.through_builder(1) == "compiled in memory"
        assert through.planned(core.build_and_load_cute_dsl_kernel("m", "k", lambda: mod.site(2)))
    assert [p["site"] for p in plan] == [inner.name] and row.name != inner.name
    assert [call[1] for call in package.real.calls] == [(1,)]


#: flashinfer 0.7.4's block-scaled GEMM helper and two of its callers, reduced to their call
#: structure (gemm/gemm_mm_fp4_cute_dsl.py and gemm/gemm_base.py): the b12x runner compiles in
#: memory through the helper; the SM100 runner passes ``cache_module_name`` (flashinfer's disk cache).
HELPER = """
    def _compile_block_scaled_gemm(cache_key, cache_module_name=None):
        compile_kernel = _make_blockscaled_gemm_compile_fn(cache_key)
        if cache_module_name is None:
            return compile_kernel()
        from flashinfer._cdc_hooktest.jit.cute_dsl_core import build_and_load_cute_dsl_kernel
        return build_and_load_cute_dsl_kernel(cache_module_name, "k", compile_kernel)

    def _make_blockscaled_gemm_compile_fn(cache_key):
        def compile_kernel():
            return cute.compile(cache_key, options="--opt-level 2 --enable-tvm-ffi")
        return compile_kernel
"""
RUNNERS = """
    from flashinfer._cdc_hooktest.gemm.gemm_mm_fp4_cute_dsl import _compile_block_scaled_gemm

    def _b12x_gemm_fp4_runner():
        class B12xFp4GemmRunner:
            def forward(self, key):
                return _compile_block_scaled_gemm(key)
        return B12xFp4GemmRunner()

    def _cute_dsl_gemm_fp4_runner():
        class CuteDSLFp4GemmRunner:
            def forward(self, key):
                return _compile_block_scaled_gemm(key, cache_module_name="mm_fp4")
        return CuteDSLFp4GemmRunner()

    def _cute_dsl_gemm_mxfp8_sm107_runner():
        class CuteDSLMxfp8Sm107GemmRunner:
            def forward(self, key):
                return _compile_block_scaled_gemm(key)
        return CuteDSLMxfp8Sm107GemmRunner()
"""


def test_the_shared_gemm_helper_is_a_site_for_the_b12x_runner_only(package: Package) -> None:
    """Only the b12x runners' compiles are sites (the table's rows); the SM100 runners reach the
    same helper and compile for other archs, through flashinfer's disk cache or in memory."""
    package.module("jit/cute_dsl_core.py", """
        def build_and_load_cute_dsl_kernel(module_name, kernel_name, compile_fn, extra_key_files=()):
            return compile_fn()
    """)
    package.module("gemm/gemm_mm_fp4_cute_dsl.py", HELPER)
    base = package.module("gemm/gemm_base.py", RUNNERS)
    b12x = sites.BY_WHERE[("gemm/gemm_base.py", "_b12x_gemm_fp4_runner.B12xFp4GemmRunner.forward")]
    with through.planning() as plan:
        assert through.planned(base._b12x_gemm_fp4_runner().forward(("sm120", 128)))
        assert base._cute_dsl_gemm_fp4_runner().forward(("sm100", 128)) == "compiled in memory"
        assert base._cute_dsl_gemm_mxfp8_sm107_runner().forward(("sm107", 128)) == "compiled in memory"
    assert [p["site"] for p in plan] == [b12x.name] == ["flashinfer.gemm.b12x_fp4"]
    assert "_make_blockscaled_gemm_compile_fn.<locals>.compile_kernel" in plan[0]["key"].site_key.tree
    assert [call[1] for call in package.real.calls] == [(("sm100", 128),), (("sm107", 128),)]


# --------------------------------------------------------------------------------------------
# What the key holds
# --------------------------------------------------------------------------------------------

#: The b12x GEMM kernel's compile interface, reduced (0.7.4 declares the scale extents Int64,
#: earlier releases Int32; both are DSL integers: runtime arguments of one kernel).
GEMM = """
    class Sm120B12xGemm:
        def __init__(self, tile):
            self.tile = tile

        @cute.jit
        def wrapper(self, mA, sf_m: cutlass.Int64, sf_n: cutlass.Int32, sf_k: cutlass.Int64,
                    l: cutlass.Constexpr, max_active_clusters: cutlass.Constexpr, stream, swap_ab: cutlass.Constexpr = False):
            pass

    def site(kernel, *args):
        return cute.compile(kernel.wrapper, *args)
"""


def test_dynamic_parameters_are_the_positions_bound_to_dsl_integers(package: Package) -> None:
    mod = package.module("kernels/gemm.py", GEMM)
    wrapper = mod.Sm120B12xGemm(128).wrapper
    assert hook._dynamic_parameters(wrapper, ("a", 1, 2, 3, 1, 188, "s", False)) == {1, 2, 3}
    assert hook._dynamic_parameters(wrapper, ("a", True, 2.0, 3)) == {3}  # a bool, a float: values
    assert hook._dynamic_parameters(mod.site, (1, 2)) == set()  # unannotated: values
    assert hook._dynamic_parameters(len, (1,)) == set()  # nothing to read: values


def test_dsl_integers_bound_to_dsl_integer_parameters_are_runtime_arguments(package: Package) -> None:
    """flashinfer 0.7.4's KDA prefill passes its TMA descriptors' device addresses as
    ``cutlass.Int64(address)`` to ``cutlass.Int64`` parameters: runtime arguments, new in every
    process. Keyed by value, every fresh process missed (found on the H200); keyed by type, one
    entry. A DSL integer bound to a ``Constexpr`` is still a value."""
    import cutlass

    mod = package.module("kernels/gemm.py", GEMM)
    package.row("kernels/gemm.py", "site", "gemm")
    kernel = mod.Sm120B12xGemm(128)
    wrapper = kernel.wrapper
    assert hook._dynamic_parameters(wrapper, ("a", cutlass.Int64(7), 2, cutlass.Int64(9), cutlass.Int32(1), 188)) == {1, 2, 3}
    with through.planning() as plan:
        mod.site(kernel, "a", cutlass.Int64(0x7F00_0000_1000), 16, 32, 1, 188, "s")
        mod.site(kernel, "a", cutlass.Int64(0x7F00_0040_2000), 16, 32, 1, 188, "s")  # another process's address
        mod.site(kernel, "a", 1, 16, 32, 1, 188, "s")  # a Python int there: another type, another entry
    digests = [p["digest"] for p in plan]
    assert digests[0] == digests[1] and len(set(digests)) == 2, digests


def test_the_b12x_scale_extents_are_keyed_by_type_and_a_constexpr_by_value(package: Package) -> None:
    """flashinfer's b12x GEMM passes each layer's scale extents (sf_m, sf_n, sf_k) as DSL integers
    and compiles one kernel for every layer: two layers of other n and k share one entry (keyed
    by value they would compile once per layer). A ``Constexpr`` is baked in: another entry."""
    mod = package.module("kernels/gemm.py", GEMM)
    package.row("kernels/gemm.py", "site", "gemm")
    kernel = mod.Sm120B12xGemm(128)
    with through.planning() as plan:
        mod.site(kernel, "a", 1, 16, 32, 1, 188, "s")  # a layer of n=2048, k=4096
        mod.site(kernel, "a", 1, 48, 16, 1, 188, "s")  # n=6144, k=2048: the same kernel
        mod.site(kernel, "a", 1, 16, 32, 1, 94, "s")  # max_active_clusters: Constexpr
        mod.site(kernel, "a", 1, 16, 32, 1, 188, "s", True)  # swap_ab: Constexpr
        mod.site(mod.Sm120B12xGemm(64), "a", 1, 16, 32, 1, 188, "s")  # the kernel object's state
        mod.site(kernel, "a", 1, 16, 32, 2, 188, "s")  # l (batch): Constexpr
    digests = [p["digest"] for p in plan]
    assert digests[0] == digests[1]
    assert len(set(digests)) == 5, digests
    (described,) = [part[1] for part in plan[0]["key"].site_key.tree if isinstance(part, tuple) and part[:1] == ("args",)]
    assert described[2:5] == (("dynamic", "int"),) * 3 and described[5:7] == (1, 188), described


@pytest.mark.slow
def test_flashinfer_074s_b12x_wrapper_declares_its_scale_extents_dynamic(fi074: str) -> None:  # noqa: F811
    """The stand-in above mirrors the real kernel: flashinfer 0.7.4's b12x GEMM wrapper, read as
    the hook reads it (positions after the kernel's bound method)."""
    python = fi074
    code = textwrap.dedent("""
        import inspect
        from flashinfer.gemm.kernels import dense_blockscaled_gemm_sm120_b12x as m
        from cute_diskcache.core import hook
        cls = next(c for c in vars(m).values() if isinstance(c, type) and "wrapper" in vars(c)
                   and c.__module__ == m.__name__)
        names = list(inspect.signature(cls.wrapper).parameters)[1:]
        positions = hook._dynamic_parameters(cls.wrapper, (None, *range(len(names))))
        print(sorted(names[p - 1] for p in positions))
    """)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}, "PYTHONPATH": str(REPO),
           "CUTE_DSL_ARCH": "sm_120a"}
    proc = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "['sf_k', 'sf_m', 'sf_n']", proc.stdout


def test_describe_keeps_every_dataclass_field_and_type() -> None:
    """Replaces ``_common.plain``'s test: key elements flashinfer passes as dataclasses and named
    tuples keep their fields and their type."""
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        k: int
        n: int

    class NT(NamedTuple):
        a: int

    assert encode(hook.describe(Cfg(1, 2), NT(3))) != encode(hook.describe(Cfg(2, 1), NT(3)))
    assert encode(hook.describe(Cfg(1, 2))) != encode(hook.describe((1, 2)))
    assert hook.describe(NT(3)) == (("namedtuple:" + f"{NT.__module__}.{NT.__qualname__}", (3,)),)
    assert hook.describe(Cfg(1, 2))[0][2] == (("k", 1), ("n", 2))


def test_arg_signature_drops_addresses_and_refuses_the_unknown() -> None:
    class Stream:
        pass

    class Tensorish:
        element_type = int

        def mark_layout_dynamic(self) -> None: ...

        def __init__(self, address: int) -> None:
            self.address = address

        def __str__(self) -> str:
            return f"Tensor<0x{self.address:x}@gmem o (4,8):(8,1)>"

    assert describe.arg_signature(Tensorish(0x1000)) == describe.arg_signature(Tensorish(0x2000))
    assert describe.arg_signature(Stream())[0] == "stream"
    with pytest.raises(UnkeyableError):
        describe.arg_signature(object())
    with pytest.raises(UnkeyableError):
        through.options_text(object())  # its repr is an address


def test_a_compile_the_hook_cannot_key_runs_in_memory_with_one_warning(package: Package,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    mod = package.module("kernels/site.py", """
        def site(arg):
            return cute.compile(arg)
    """)
    row = package.row("kernels/site.py", "site")
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"), through.planning() as plan:
        assert mod.site(object()) == "compiled in memory"
    assert plan == [] and len(package.real.calls) == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"not caching {row.name} kernel: no description for compile argument of type builtins.object"]


# --------------------------------------------------------------------------------------------
# The one exception: flashinfer's native builder
# --------------------------------------------------------------------------------------------


@pytest.fixture
def native_site(package: Package) -> tuple[types.ModuleType, list[tuple[str, str]]]:
    """A site flashinfer builds through ``build_and_load_cute_dsl_kernel``, our builder in front."""
    built: list[tuple[str, str]] = []

    def flashinfers_builder(module_name: str, kernel_name: str, compile_fn: Callable[[], Any],
                            extra_key_files: Any = (), **kwargs: Any) -> str:
        built.append((module_name, kernel_name))
        return "flashinfer's own build"

    mod = package.module("kernels/dispatch.py", """
        def _get_kernel(arg):
            return build_and_load_cute_dsl_kernel("moe", "kernel", lambda: cute.compile(arg))
    """, build_and_load_cute_dsl_kernel=native._builder(flashinfers_builder))
    package.row("kernels/dispatch.py", "_get_kernel", "native_kernel", native=True)
    return mod, built


def test_the_native_builder_hands_a_compile_it_cannot_key_back_to_flashinfer(
        package: Package, native_site: tuple[types.ModuleType, list[tuple[str, str]]], caplog: pytest.LogCaptureFixture) -> None:
    """flashinfer's builder then builds it (its own disk cache), as if we were not there: never
    an in-memory compile that bypasses both caches, never our error."""
    mod, built = native_site
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"), through.planning() as plan:
        assert mod._get_kernel(object()) == "flashinfer's own build"
    assert built == [("moe", "kernel")] and plan == [] and package.real.calls == []
    assert len(caplog.records) == 1 and "no description for compile argument" in caplog.records[0].getMessage()
    assert hook.SERVING_NATIVE.get() is None


def test_the_native_builder_serves_a_keyable_compile_from_our_cache(
        package: Package, native_site: tuple[types.ModuleType, list[tuple[str, str]]]) -> None:
    mod, built = native_site
    with through.planning() as plan:
        assert through.planned(mod._get_kernel(7))
    assert built == [] and [p["site"] for p in plan] == ["flashinfer.hooktest.native_kernel"]
    assert hook.SERVING_NATIVE.get() is None


def test_the_hook_hands_back_only_inside_a_build_native_serves(package: Package) -> None:
    """:class:`~.hook.HandBack` is raised for an unkeyable compile while :mod:`.native` serves a
    build (the rows it saw recorded); anywhere else the same compile runs in memory."""
    mod = package.module("kernels/site.py", """
        def site(arg):
            return cute.compile(arg)
    """)
    row = package.row("kernels/site.py", "site")
    seen: list[Row] = []
    token = hook.SERVING_NATIVE.set(seen)
    try:
        with pytest.raises(hook.HandBack):
            mod.site(object())
    finally:
        hook.SERVING_NATIVE.reset(token)
    assert seen == [row] and package.real.calls == []
    assert mod.site(object()) == "compiled in memory"


# --------------------------------------------------------------------------------------------
# Side data read from disk is checked before it reaches flashinfer (issue 15, item 14)
# --------------------------------------------------------------------------------------------


def test_side_data_of_another_shape_is_a_miss_never_an_exception(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer version stored ``block_dim_probe`` as a list: old code raised AttributeError
    from ``site.deliver`` into flashinfer (it ran outside the try of through_cache). The direct
    micro kernel's row as the hook serves it (its extra_ok, deliver and adapt), keyed by hand."""
    from cute_diskcache.storage import loader

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_120a")
    cache = CompileCache(Store(tmp_path / "cache"), single_flight=False)
    row = sites.BY_WHERE[("fused_moe/cute_dsl/blackwell_sm12x/moe_direct_micro_kernel.py", "compile_direct_micro_kernel")]
    env = Environment(kind=row.namespace, package="flashinfer-python==0", sources="s", arch="sm_120a")
    site = dataclasses.replace(hook.site(row), key=lambda call: ("k", 1), env=lambda call: env, extra=None)
    call = through.Call({"row": row, "site": f"{row.file}:{row.function}", "wants_ptx": False},
                        (types.SimpleNamespace(launch_block_dim=512),), {})
    key = through.CacheKey(env, site.name, site.key(call), site.options(call))
    stored = {"block_dim_probe": [512, True], "kwargs_wrapper": False, "calling_convention": None}
    assert cache.store.commit(key, make_artifact(extra=stored)) is not None
    for name in ("load_object", "load_shared"):
        monkeypatch.setattr(loader, name, lambda *a: pytest.fail("side data of another shape must not be loaded"))
    compiled = object()
    kernel = through.through_cache(site, call, lambda: compiled, cache_fn=lambda: cache)
    assert kernel is compiled and cache.counters.compiles == 1 and cache.store.rejected == 1

    boom = through.Site("json", "other", "x", lambda call: ("k", 2), lambda call: env, deliver=lambda *a: {}["missing"])
    assert through.through_cache(boom, call, lambda: compiled, cache_fn=lambda: cache) is compiled


def test_the_collector_is_paused_on_the_way_to_a_hit_and_runs_during_a_compile() -> None:
    """A hit (key, lookup, load, side data) runs with the collector paused, so a collection that
    comes due while the key's few hundred tuples are alive does not land in it; a compile runs
    with it (seconds of allocation). The old code paused it for the key only, and a collection
    then walked the key during the lookup. A caller that paused it keeps it paused."""
    import gc

    seen: list[tuple[str, bool]] = []
    env = Environment(kind="k", package="p==0", sources="s", arch="sm_120a")

    class Cache:
        def get_or_compile(self, key: Any, compile_fn: Callable[[], Any], **_: Any) -> tuple[Any, dict[str, Any]]:
            seen.append(("lookup", gc.isenabled()))
            return compile_fn(), {}

    def key(call: Any) -> Any:
        seen.append(("key", gc.isenabled()))
        return ("k", 1)

    def compile_fn() -> object:
        seen.append(("compile", gc.isenabled()))
        return object()

    site = through.Site("x", "f", "x", key, lambda call: env)
    call = through.Call({}, (), {})
    assert gc.isenabled()
    through.through_cache(site, call, compile_fn, cache_fn=Cache)
    assert seen == [("key", False), ("lookup", False), ("compile", True)] and gc.isenabled()
    seen.clear()
    gc.disable()
    try:
        through.through_cache(site, call, compile_fn, cache_fn=Cache)
        assert seen == [("key", False), ("lookup", False), ("compile", False)] and not gc.isenabled()
    finally:
        gc.enable()


# --------------------------------------------------------------------------------------------
# Patching
# --------------------------------------------------------------------------------------------


def test_patch_is_idempotent_and_unpatch_puts_the_real_compile_back() -> None:
    """Replaces the proxy's restore test: one dispatcher on ``cutlass.cute.compile``, whatever
    the number of patches, and exactly the real compile back afterwards."""
    before = cute.compile
    if isinstance(before, hook._Dispatch):
        pytest.skip("the hook is already in place in this process")
    try:
        assert hook.patch() is True
        first = cute.compile
        assert isinstance(first, hook._Dispatch) and first._real is before
        assert hook.patch() is True and cute.compile is first
        assert isinstance(cute.compile[()], hook._Dispatch)  # the subscript form goes through it too
    finally:
        hook.unpatch()
    assert cute.compile is before and hook._ENABLED is False
    hook.unpatch()
    assert cute.compile is before


_JIT_CHILD = textwrap.dedent('''
    import sys, types
    import cutlass, cutlass.cute as cute
    from cute_diskcache.core import hook

    hook._ours = lambda module: True  # this script's module stands in for flashinfer's


    class Kernel:
        @cute.jit
        def wrapper(self, a: cutlass.Int32, b: cutlass.Constexpr):
            x = a + b


    kernel = Kernel()
    func = Kernel.__dict__["wrapper"]
    while isinstance(getattr(func, "__wrapped__", None), types.FunctionType):
        func = func.__wrapped__
    before = hook.describe(kernel.wrapper)
    code = func.__code__
    cute.compile(kernel.wrapper, 3, 4)
    rewritten = func.__code__ is not code
    after = hook.describe(kernel.wrapper)
    if sys.argv[1] == "old-dsl":  # a DSL before 4.8 keeps no copy of the code it rewrote
        func.__dict__.pop("_original_code", None)
    again = hook.describe(kernel.wrapper)
    print(rewritten, before == after == again)
''')


@pytest.mark.slow
@pytest.mark.parametrize("dsl", ["dsl", "old-dsl"])
def test_a_jit_functions_key_does_not_change_when_a_compile_rewrites_its_code(tmp_path: Path, dsl: str) -> None:
    """Compiling a ``cute.jit`` function replaces its ``__code__`` with the DSL preprocessor's
    rewrite. Keyed by ``__code__``, the second kernel of a prewarm using that function got
    another key than an engine (whose hits compile nothing) asks for: the b12x MXFP8 GEMM missed
    in every fresh process after prewarm had compiled the FP4 one (issue 22). The key takes the
    code as written: the DSL's ``_original_code``, or the code as this process first met it."""
    script = tmp_path / "jit_child.py"
    script.write_text(_JIT_CHILD)
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_120a"}
    proc = subprocess.run([sys.executable, str(script), dsl], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["True", "True"], proc.stdout[-2000:]


def test_the_adapter_stays_small_and_each_module_says_what_it_owns() -> None:
    """Issue 22: every flashinfer-specific fact lives in ``flashinfer_sites/``, at most 3,000 lines,
    and each module's docstring opens by saying what it is for."""
    import ast

    from cute_diskcache import flashinfer_sites

    package = Path(flashinfer_sites.__file__).parent
    modules = sorted(package.glob("*.py"))
    assert sum(len(p.read_text().splitlines()) for p in modules) <= 3000
    for path in modules:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, path.name
