"""The adapter's interception machinery on a synthetic module: no flashinfer, no compile.

What the real-compile tests cannot isolate: that only the named site's calls are intercepted,
that the ``cute.compile[...]`` form keeps its subscript in the key, that unpatching restores
exactly what was there, and that key elements flashinfer uses (dataclasses, tensors with an
address in their text) become stable data or are refused.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any, NamedTuple

import pytest

from cute_diskcache.flashinfer_sites import _common
from cute_diskcache.key import UnkeyableError, encode


class _Opt:
    """Stands in for the DSL's OptLevel: its repr holds an address, its state does not."""

    def __init__(self, level: int) -> None:
        self._value = level


class _RealCompile:
    def __init__(self, options: Any = None) -> None:
        self.options = options
        self.calls: list[tuple[Any, ...]] = []

    def __getitem__(self, options: Any) -> "_RealCompile":
        inner = _RealCompile(options)
        inner.calls = self.calls
        return inner

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        self.calls.append((self.options, args, kwargs))
        return f"kernel{args}"


@pytest.fixture
def module() -> Any:
    mod = types.ModuleType("fake_flashinfer_site")
    exec(  # noqa: S102 - a synthetic flashinfer module
        "def site(n, opt=None):\n"
        "    cache_key = ('k', n)\n"
        "    return (cute.compile if opt is None else cute.compile[opt])(n, options='--x')\n"
        "def other(n):\n"
        "    return cute.compile(n)\n",
        mod.__dict__,
    )
    real_cute = types.ModuleType("cutlass.cute")
    real_cute.compile = _RealCompile()  # type: ignore[attr-defined]
    real_cute.something = 42  # type: ignore[attr-defined]
    mod.cute = real_cute  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    yield mod
    _common.PATCHES.restore(mod)
    del sys.modules[mod.__name__]


def _site(mod: Any) -> _common.Site:
    return _common.Site(mod.__name__, "site", "fake", lambda call: call.locals["cache_key"])


def test_only_the_site_is_intercepted_and_the_subscript_is_keyed(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = module.cute
    env = _common.Environment(kind="t", package="p==1", sources="s", arch="sm_120a")
    monkeypatch.setattr(_common, "environment", lambda *names: env)
    assert _common.install_proxy(module, _common.site_codes(module, [_site(module)]))
    assert module.cute.something == 42 and module.cute.__dict__["_cdc_real"] is real
    with _common.planning() as plan:
        assert _common.planned(module.site(1))
        assert _common.planned(module.site(2, opt=_Opt(3)))
        assert module.other(3) == "kernel(3,)"  # not a site: the real compile, untouched
    assert [p["key"].site_key for p in plan] == [("k", 1), ("k", 2)]
    assert plan[0]["key"].options == "--x"
    assert plan[1]["key"].options == ("--x", f"{__name__}._Opt:[('_value', '3')]")
    assert plan[0]["key"].digest != _common.CacheKey(env, "flashinfer.fake_flashinfer_site.fake", ("k", 1), None).digest
    assert real.compile.calls == [(None, (3,), {})]
    _common.PATCHES.restore(module)
    assert module.cute is real


def test_plain_keeps_every_dataclass_field_and_type() -> None:
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        k: int
        n: int

    class NT(NamedTuple):
        a: int

    assert encode(_common.plain((Cfg(1, 2), NT(3)))) != encode(_common.plain((Cfg(2, 1), NT(3))))
    assert encode(_common.plain(Cfg(1, 2))) != encode(_common.plain((1, 2)))
    assert _common.plain(NT(3)) == ("namedtuple", NT.__qualname__, (3,))


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

    assert _common.arg_signature(Tensorish(0x1000)) == _common.arg_signature(Tensorish(0x2000))
    assert _common.arg_signature(Stream())[0] == "stream"
    with pytest.raises(UnkeyableError):
        _common.arg_signature(object())
    with pytest.raises(UnkeyableError):
        _common.options_text(object())  # its repr is an address


# --------------------------------------------------------------------------------------------
# Side data read from disk is checked before it reaches flashinfer (issue 15, item 14)
# --------------------------------------------------------------------------------------------


def test_side_data_of_another_shape_is_a_miss_never_an_exception(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer version stored ``block_dim_probe`` as a list: old code raised AttributeError
    from ``site.deliver`` into flashinfer (it ran outside the try of through_cache)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from _helpers import make_artifact

    from cute_diskcache import loader
    from cute_diskcache.cache import CompileCache
    from cute_diskcache.flashinfer_sites import v0_7
    from cute_diskcache.store import Store

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_120a")
    cache = CompileCache(Store(tmp_path / "cache"), single_flight=False)
    site = _common.Site("json", "compile_direct_micro_kernel", "direct_micro", lambda call: ("k", 1),
                        deliver=v0_7._deliver_block_dim, extra_ok=v0_7._block_dim_ok)
    call = _common.Call({"kernel": types.SimpleNamespace(launch_block_dim=512)}, (), {})
    key = _common.CacheKey(_common.environment("json"), site.name, site.key(call), site.options(call))
    assert cache.store.commit(key, make_artifact(extra={"block_dim_probe": [512, True]})) is not None
    for name in ("load_object", "load_shared"):
        monkeypatch.setattr(loader, name, lambda *a: pytest.fail("side data of another shape must not be loaded"))
    compiled = object()
    kernel = _common.through_cache(site, call, lambda: compiled, cache_fn=lambda: cache)
    assert kernel is compiled and cache.counters.compiles == 1 and cache.store.rejected == 1

    boom = _common.Site("json", "other", "x", lambda call: ("k", 2), deliver=lambda *a: {}["missing"])
    assert _common.through_cache(boom, call, lambda: compiled, cache_fn=lambda: cache) is compiled
