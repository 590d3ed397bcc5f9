"""``CUTE_DISKCACHE_ON_MISS=compile|warn|error``: what a miss does in a serving process.

``error`` is a CI gate (SGLang's ``SGLANG_CRASH_ON_JIT_COMPILE``, vLLM's ``--jit-monitor-mode
error``): the miss raises :class:`cute_diskcache.CacheMissError` naming the kernel and why, and
nothing is compiled, locked or written. Proven twice: in-process on a synthetic store (the
compile function is never called, no lock file exists), and in a real engine-like child on
flashinfer's MoE wrapper, where the DSL's own compile counter stays at 0.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers import make_artifact, make_key  # noqa: E402

import cute_diskcache  # noqa: E402
from cute_diskcache.core import cache as cachemod  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402


SITE = "flashinfer.moe_dispatch.micro"


def _never(*_a: Any) -> Any:
    raise AssertionError("compile_fn ran although CUTE_DISKCACHE_ON_MISS=error")


def test_error_raises_names_the_kernel_and_why_and_touches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_ON_MISS", "error")
    root = tmp_path / "cache"
    cache = cachemod.CompileCache(Store(root))
    key = make_key()
    with pytest.raises(cute_diskcache.CacheMissError) as info:
        cache.get_or_compile(key, _never)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert (err.site, err.digest, err.reason) == (key.site, key.digest, "no entry for this kernel")
    assert f"not compiling {key.site} kernel {key.digest[:12]}: no entry for this kernel" in str(err)
    assert (cache.counters.misses, cache.counters.compiles, cache.counters.writes) == (1, 0, 0)
    assert not (root / "locks").exists() and not (root / "v1").exists(), "no lock taken, nothing written"


def test_error_still_serves_hits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A complete cache passes the gate: the hit path is untouched (the load is the DSL's, so the
    synthetic entry's object fails to load: that refusal must be the reason named, not 'no entry')."""
    monkeypatch.setenv("CUTE_DISKCACHE_ON_MISS", "error")
    store = Store(tmp_path / "cache")
    key = make_key()
    assert store.commit(key, make_artifact()) is not None
    cache = cachemod.CompileCache(store)
    with pytest.raises(cute_diskcache.CacheMissError) as info:
        cache.get_or_compile(key, _never)
    assert info.value.reason.startswith("entry refused: load: "), info.value.reason


@pytest.mark.parametrize("value", ["compile", "warn", "", "bogus"])
def test_compile_and_warn_compile_with_one_warning_saying_why(value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_ON_MISS", value)
    cache = cachemod.CompileCache(Store(tmp_path / "cache"), single_flight=False)
    assert cache.on_miss == ("compile" if value in ("", "bogus") else value)
    key = make_key()
    kernel = object()
    with caplog.at_level(logging.DEBUG, logger="cute_diskcache"):
        got, _extra = cache.get_or_compile(key, lambda: kernel)  # the export of a fake kernel fails: counted, kernel kept
    assert got is kernel and cache.counters.compiles == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.getMessage().startswith("compiling ")]
    assert warnings == [f"compiling {key.site} kernel {key.digest[:12]}: no entry for this kernel; key ('micro', 128, 128, 1, 2048, "
                        f"768, 8, 8, 188, (128, 128), torch.int32, False, True, False, False, True, 'silu', 1.702, 1.0, None)"]
    if value == "bogus":
        assert any("ignoring CUTE_DISKCACHE_ON_MISS='bogus'" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------------------
# A real engine-like child: flashinfer's MoE wrapper through the rtx-pro-6000 profile
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_engine_miss_under_error_raises_and_compiles_nothing(tmp_path: Path, probe: Any, warm_micro_root: Any) -> None:
    """The probe records what ``wrapper.run`` raised (on this CPU box every launch raises; here
    the call never got that far): an engine's call raises the same."""
    root = tmp_path / "empty-root"
    report = probe(root, 1, extra_env={"CUTE_DISKCACHE_ON_MISS": "error"})
    digest = warm_micro_root.cold["events"][0][1]  # the kernel the same call compiled in the session's cold probe
    expected = (f"CUTE_DISKCACHE_ON_MISS=error: not compiling {SITE} kernel {digest[:12]}: no entry for this kernel; "
                "key ('compile', 'fused_moe/cute_dsl/blackwell_sm12x/moe_dispatch.py:_get_micro_kernel', '_get_micro_kernel', "
                "('args', (('object', 'flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_micro_kernel.MoEMicr")
    (record,) = report["records"]
    assert record["launch_error"].startswith(f"CacheMissError: {expected}"), record["launch_error"]
    assert f"[cute-diskcache] ERROR {expected}" in "\n".join(report["cache_log"]), report["cache_log"]
    assert report["stderr"].startswith(expected), report["stderr"]  # the one line said, besides the attach and summary
    assert report["real_compiles"] == 0, "the DSL compiled nothing"
    assert (report["counters"]["misses"], report["counters"]["compiles"], report["counters"]["writes"]) == (1, 0, 0)
    assert report["kernels"] == {k: 0 for k in report["kernels"]}, "flashinfer memoised no kernel"
    assert not list(root.glob("v1/*/*/*")) and not list(root.glob("locks/*/*")), "nothing written, no lock taken"


@pytest.mark.slow
def test_engine_under_error_on_a_warm_cache_passes(micro_copy: Any, probe: Any) -> None:
    warm = probe(micro_copy.root, 1, extra_env={"CUTE_DISKCACHE_ON_MISS": "error"})
    assert warm["real_compiles"] == 0 and warm["counters"]["hits"] == 1 and warm["stderr"] == ""
    assert "on a miss: error" in warm["cache_log"][0]
