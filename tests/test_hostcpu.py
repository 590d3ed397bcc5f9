"""Host CPU: what host code a process writes (CUTE_DISKCACHE_HOST_CPU) and what an entry records."""

from __future__ import annotations

import logging
import platform

import pytest

from cute_diskcache import config
from cute_diskcache.keys import hostcpu, hostmachine

#: What a Sapphire Rapids / Zen 4 build box reports (as /proc/cpuinfo spells it, filtered).
BUILD_BOX = ("abm", "adx", "avx", "avx2", "avx512_bf16", "avx512_vp2intersect", "avx512bw", "avx512f", "avx_vnni",
             "bmi1", "bmi2", "cx16", "f16c", "fma", "gfni", "movbe", "popcnt", "sse", "sse2", "sse4_1", "sse4_2", "ssse3")


@pytest.fixture
def x86(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("CUTE_DISKCACHE_HOST_CPU", raising=False)


def test_the_default_is_x86_64_v2_and_records_its_extensions_only(x86: None) -> None:
    code = hostcpu.host_code()
    assert (code.name, code.llvm_cpu) == ("x86-64-v2", "x86-64-v2") and code.portable
    assert set(code.extensions) == {"cx16", "popcnt", "sse", "sse2", "sse4_1", "sse4_2", "ssse3"}
    # every name is one /proc/cpuinfo prints, or a host could never be judged to have it
    assert all(hostcpu._codegen_relevant(f) for f in code.extensions)


def test_the_baselines_nest(x86: None) -> None:
    v2, v3, v4 = (set(hostcpu.BASELINES[n].extensions) for n in ("x86-64-v2", "x86-64-v3", "x86-64-v4"))
    assert v2 < v3 < v4
    assert {"avx2", "fma", "bmi2", "f16c", "movbe", "abm"} <= v3 - v2
    assert not any(f.startswith("avx512") for f in v3)


def test_native_records_this_cpu(x86: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcpu, "isa_extensions", lambda: BUILD_BOX)
    monkeypatch.setenv("CUTE_DISKCACHE_HOST_CPU", "native")
    code = hostcpu.host_code()
    assert code.name == "native" and code.llvm_cpu is None and code.extensions == BUILD_BOX and not code.portable


def test_a_named_baseline_and_an_unknown_value(x86: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_HOST_CPU", "x86-64-v3")
    assert hostcpu.host_code().name == "x86-64-v3"
    monkeypatch.setenv("CUTE_DISKCACHE_HOST_CPU", "armv8-a")  # another machine's: this machine's default
    assert hostcpu.host_code().name == "x86-64-v2"
    monkeypatch.setenv("CUTE_DISKCACHE_HOST_CPU", "skylake-avx512")
    config._warned.clear()
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"):
        assert hostcpu.host_code().name == "x86-64-v2"
    assert "CUTE_DISKCACHE_HOST_CPU='skylake-avx512'" in caplog.text


def test_a_cross_build_writes_the_other_machine_s_baseline(x86: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostmachine, "_target", "aarch64")
    monkeypatch.setenv("CUTE_DISKCACHE_HOST_CPU", "native")  # this CPU says nothing about a Spark's
    code = hostcpu.host_code()
    assert (code.name, code.machine, code.llvm_cpu, code.extensions) == ("armv8-a", "aarch64", "generic", ("asimd", "fp"))


def test_a_host_is_judged_by_what_the_entry_records(x86: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcpu, "isa_extensions", lambda: ("avx", "avx2", "cx16", "popcnt", "sse", "sse2", "sse4_1", "sse4_2", "ssse3"))
    hostcpu._missing.cache_clear()
    assert hostcpu.missing(hostcpu.BASELINES["x86-64-v2"].extensions) == []
    assert hostcpu.missing(BUILD_BOX) == ["abm", "adx", "avx512_bf16", "avx512bw", "avx512f", "avx_vnni", "bmi1", "bmi2",
                                          "f16c", "fma", "gfni", "movbe"]


def test_what_a_prewarm_rebuilds(x86: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # an earlier release's entry from that build box needs more than x86-64-v2: rebuilt
    assert hostcpu.tuned_beyond(BUILD_BOX)[:3] == ["abm", "adx", "avx"]
    assert hostcpu.tuned_beyond(hostcpu.BASELINES["x86-64-v2"].extensions) == []
    monkeypatch.setenv("CUTE_DISKCACHE_HOST_CPU", "native")  # a native prewarm keeps native entries
    assert hostcpu.tuned_beyond(BUILD_BOX) == []


def test_a_build_box_names_what_serving_cpus_may_lack(x86: None) -> None:
    # avx512_vp2intersect: an intrinsics-only extension entries never record, so never named
    assert hostcpu.beyond_baseline(BUILD_BOX) == ["abm", "adx", "avx", "avx2", "avx512_bf16", "avx512bw", "avx512f", "avx_vnni",
                                                  "bmi1", "bmi2", "f16c", "fma", "gfni", "movbe"]


def test_only_native_entries_need_more_than_the_baseline(x86: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcpu, "isa_extensions", lambda: ("avx2", "avx512f", "sse2"))
    assert hostcpu.written_beyond_baseline() == []
    monkeypatch.setenv("CUTE_DISKCACHE_HOST_CPU", "native")
    assert hostcpu.written_beyond_baseline() == ["avx2", "avx512f"]
    monkeypatch.setenv("CUTE_DISKCACHE_HOST_CPU", "x86-64-v3")
    assert "avx2" in hostcpu.written_beyond_baseline()


def test_no_baseline_off_x86(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert hostcpu.beyond_baseline(("fp", "asimd", "sve2", "avx512f")) == []
