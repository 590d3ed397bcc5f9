"""Host CPU: which of a build CPU's extensions common serving CPUs lack (prewarm's note)."""

from __future__ import annotations

import platform

import pytest

from cute_diskcache.keys import hostcpu

#: What a Sapphire Rapids / Zen 4 build box reports (as /proc/cpuinfo spells it, filtered).
BUILD_BOX = ("abm", "adx", "avx", "avx2", "avx512_bf16", "avx512_vp2intersect", "avx512bw", "avx512f", "avx_vnni",
             "bmi1", "bmi2", "cx16", "f16c", "fma", "gfni", "movbe", "popcnt", "sse", "sse2", "sse4_1", "sse4_2", "ssse3")


@pytest.fixture
def x86(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")


def test_x86_64_v3_is_the_baseline(x86: None) -> None:
    # the psABI's x86-64-v3 (AVX2, BMI1/2, F16C, FMA, LZCNT, MOVBE over v2) names nothing
    assert hostcpu.beyond_baseline(sorted(hostcpu.X86_64_V3)) == []
    assert {"avx2", "fma", "bmi2", "f16c", "movbe", "sse4_2", "popcnt"} <= hostcpu.BASELINE
    assert not any(f.startswith("avx512") for f in hostcpu.BASELINE)


def test_a_build_box_names_what_serving_cpus_may_lack(x86: None) -> None:
    # avx512_vp2intersect: an intrinsics-only extension entries never record, so never named
    assert hostcpu.beyond_baseline(BUILD_BOX) == ["avx512_bf16", "avx512bw", "avx512f", "avx_vnni", "gfni"]


def test_this_cpu_is_judged_by_default(x86: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcpu, "isa_extensions", lambda: ("avx2", "avx512f", "sse2"))
    assert hostcpu.beyond_baseline() == ["avx512f"]


def test_no_baseline_off_x86(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert hostcpu.beyond_baseline(("fp", "asimd", "sve2", "avx512f")) == []
