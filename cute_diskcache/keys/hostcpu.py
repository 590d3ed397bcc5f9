"""The host CPU's instruction-set extensions, for objects built on one machine and loaded on another.

An exported object is host launch code plus a cubin, and the DSL tunes the host code for the CPU
that compiled it (measured: the same kernel built on our CPU box and on the H200's host differs
in 128 bytes of x86 host code). An offline prewarm on a build box with, say, AVX-512 could then
hand a GPU box without it code that dies on an illegal instruction. Entries record the build
CPU's extensions that a compiler may use on its own; a loading CPU that lacks any of them treats
the entry as a miss. This is conservative (the code may not use every extension the build CPU
had) but never crashes.
"""

from __future__ import annotations

import functools
import platform
import re

# x86 extension names as /proc/cpuinfo spells them; everything else there (ht, hypervisor,
# cpuid bits, bug flags...) varies between identical hosts and VMs and says nothing about code.
_X86_ISA = re.compile(
    r"^(sse\d?(_\d)?|ssse3|avx.*|fma4?|f16c|bmi\d|adx|movbe|popcnt|abm|lzcnt|gfni|xop|cx16|apx.*)$"
)
# Extensions LLVM emits only for explicit intrinsics, never on its own when tuning for a CPU.
# The host code is launch glue lowered from MLIR (no intrinsics), so an entry cannot contain
# them; recording them made an AMD build box's entries (sse4a, avx512_vp2intersect) misses on
# Intel GPU hosts whose objects ran bitwise-correctly there (bench/results/gpu_proof_sm90.md).
# Left out as well: xsave*, rdrand, rdseed, aes, sha_ni, (v)pclmulqdq, vaes, amx*.
_INTRINSIC_ONLY = frozenset({"avx512_vp2intersect", "avx512_4vnniw", "avx512_4fmaps"})


def _codegen_relevant(flag: str) -> bool:
    return bool(_X86_ISA.match(flag)) and flag not in _INTRINSIC_ONLY


@functools.lru_cache(maxsize=None)
def isa_extensions() -> tuple[str, ...]:
    """This CPU's ISA extensions (sorted); empty where /proc/cpuinfo is unavailable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            text = fh.read(1 << 20)
    except OSError:
        return ()
    machine = platform.machine().lower()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if machine in ("x86_64", "amd64", "i686") and name == "flags":
            return tuple(sorted(f for f in value.split() if _codegen_relevant(f)))
        if machine in ("aarch64", "arm64") and name == "features":
            return tuple(sorted(value.split()))  # every aarch64 feature word is an ISA feature
    return ()


def recorded() -> tuple[str, ...]:
    """What a new entry records as its build CPU's extensions: this CPU's, or none when this
    process writes another machine's host code (:mod:`.hostmachine`): that object is built for
    the machine's baseline (no ``-mcpu``), and this CPU's extensions say nothing about it."""
    from . import hostmachine

    return () if hostmachine.cross() else isa_extensions()


def missing(recorded: list[str] | tuple[str, ...], machine: str | None = None) -> list[str]:
    """Extensions the build CPU had that this one lacks (empty if we cannot tell).

    ``machine``: the entry's host machine. An entry of another machine (``check --target
    dgx-spark`` on an x86 box reads aarch64 entries) cannot be judged against this CPU: empty.
    """
    if machine is not None and str(machine).lower() != platform.machine().lower():
        return []
    return list(_missing(tuple(recorded), isa_extensions()))


@functools.lru_cache(maxsize=256)
def _missing(recorded: tuple[str, ...], extensions: tuple[str, ...]) -> tuple[str, ...]:
    """Asked on every hit, of a handful of distinct build CPUs: answered once for each."""
    here = set(extensions)
    if not here:
        return ()
    if platform.machine().lower() in ("x86_64", "amd64", "i686"):
        # Entries written before the intrinsic-only filter list those extensions too.
        recorded = tuple(f for f in recorded if _codegen_relevant(f))
    return tuple(sorted(set(recorded) - here))


#: The extensions a build CPU may have without narrowing where its entries load: what common
#: serving CPUs all have. x86-64-v3 (the psABI's level: AVX2, BMI1/2, F16C, FMA, LZCNT, MOVBE
#: over v2's SSE4.2, SSSE3, POPCNT, CX16) is what every x86 host of a Blackwell GPU has (Intel
#: since Haswell, AMD since Zen 1, Intel's E-core Xeons included) and the level RHEL 10 and
#: other distributions build for; ADX is added because every CPU of that list has it too
#: (Broadwell and later, every Zen), so naming it would warn on every build box for no host.
#: Not in it: AVX-512 (Zen 2/3 EPYC and the E-core Xeon 6 lack it), AVX-VNNI, GFNI, VAES and the
#: like, which Sapphire Rapids or Zen 4 build boxes have and many serving hosts do not.
#: Names as /proc/cpuinfo spells them (``abm`` is LZCNT there).
X86_64_V3 = frozenset({
    "sse", "sse2",  # v1 (cmov, cx8, fxsr, mmx... are not ISA names we record)
    "cx16", "popcnt", "sse4_1", "sse4_2", "ssse3",  # v2 (sse3 is "pni", lahf_lm: not recorded)
    "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "lzcnt", "movbe",  # v3
})
BASELINE = X86_64_V3 | {"adx"}
BASELINE_NAME = "x86-64-v3 (the common serving baseline)"


def beyond_baseline(extensions: tuple[str, ...] | list[str] | None = None) -> list[str]:
    """This CPU's (or ``extensions``') recorded extensions that common serving CPUs lack
    (:data:`BASELINE`): a build box with any of them makes entries those hosts cannot use.
    Empty off x86 (no baseline is defined there: aarch64 build and serving hosts are usually
    the same Grace or Neoverse part) and where the CPU cannot be read."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    have = isa_extensions() if extensions is None else extensions
    return sorted(f for f in have if _codegen_relevant(f) and f not in BASELINE)
