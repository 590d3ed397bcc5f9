"""Which CPU an entry's host code is written for, and whether this CPU can run it.

An entry is host launch glue (argument packing, the driver calls) plus cubins. Left to itself the
DSL tunes that glue for the CPU that compiled it, so a cache prewarmed on an AVX-512 build box
was refused whole by a serving host without AVX-512 (the entry recorded the build CPU's
extensions, and a host lacking any of them treated it as a miss). Nothing in launch glue needs
more than SSE4.2, so by default every compile writes its host code for a named baseline
(:data:`DEFAULT_BASELINE` of the machine) and the entry records the baseline's name and the
extensions it implies: a host is judged by "the baseline's extensions are a subset of mine".
``CUTE_DISKCACHE_HOST_CPU=native`` keeps the old way (tuned for and recorded as the build CPU);
another baseline's name picks that one. Entries written by earlier releases recorded their build
CPU and keep being judged that way.

Why x86-64-v2 and not v3: the glue gains nothing from AVX2 (measured in docs/performance.md: the
v3 object differs only by VEX encodings of the same struct copies, and launches take the same
time), while v2 runs on every x86-64 CPU since 2009 (Nehalem, Bulldozer), a workstation's old
CPU under a new RTX card included, and on qemu's default CPU models.
"""

from __future__ import annotations

import functools
import platform
import re
from dataclasses import dataclass

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


@functools.cache
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


#: x86 psABI micro-architecture levels, as /proc/cpuinfo spells the extensions each implies (sse3 is
#: "pni" there and lahf_lm, cmov, cx8... are not recorded names, so they are left out; LZCNT is
#: "abm"). v4 is listed for those who ask for it by name; it is never a default.
_X86_64_V2 = ("cx16", "popcnt", "sse", "sse2", "sse4_1", "sse4_2", "ssse3")
_X86_64_V3 = _X86_64_V2 + ("abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe")
_X86_64_V4 = _X86_64_V3 + ("avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl")


@dataclass(frozen=True)
class HostCode:
    """What an entry's host code is written for: a baseline's name (or ``native``), the machine,
    the CPU name LLVM is given (None: the DSL's own choice, this CPU), and the extensions the
    entry records (what a loading CPU must have)."""

    name: str
    machine: str
    llvm_cpu: str | None
    extensions: tuple[str, ...]

    @property
    def portable(self) -> bool:
        return self.llvm_cpu is not None


#: Named baselines per machine. aarch64's is what the DGX Spark cross-build writes (LLVM's
#: generic AArch64: Armv8-A with FP and Advanced SIMD, no -mcpu).
BASELINES: dict[str, HostCode] = {
    "x86-64-v2": HostCode("x86-64-v2", "x86_64", "x86-64-v2", tuple(sorted(_X86_64_V2))),
    "x86-64-v3": HostCode("x86-64-v3", "x86_64", "x86-64-v3", tuple(sorted(_X86_64_V3))),
    "x86-64-v4": HostCode("x86-64-v4", "x86_64", "x86-64-v4", tuple(sorted(_X86_64_V4))),
    "armv8-a": HostCode("armv8-a", "aarch64", "generic", ("asimd", "fp")),
}
#: What ``portable`` (the default) means on each machine.
DEFAULT_BASELINE = {"x86_64": "x86-64-v2", "aarch64": "armv8-a"}
#: ``CUTE_DISKCACHE_HOST_CPU`` values besides a baseline's name.
PORTABLE, NATIVE = "portable", "native"


def choices() -> tuple[str, ...]:
    return (PORTABLE, NATIVE, *BASELINES)


def env_name() -> str:
    from .. import config

    return config.env_name("host_cpu")


def _setting() -> str:
    from .. import config

    raw = (config.text("host_cpu") or PORTABLE).lower()
    if raw in choices():
        return raw
    name = config.env_name("host_cpu")
    config.warn_once(name, raw, "ignoring %s=%r (expected one of %s); using %s", name, raw, "|".join(choices()), PORTABLE)
    return PORTABLE


def native() -> HostCode:
    """This CPU, as the DSL tunes for it when left alone."""
    return HostCode(NATIVE, platform.machine().lower(), None, isa_extensions())


def host_code() -> HostCode:
    """What this process writes host code for: the setting's baseline for the machine it writes
    for (:mod:`.hostmachine`), or this CPU with ``native``. A process writing another machine's
    code cannot tune for a CPU it has not got: it writes that machine's default baseline."""
    from . import hostmachine

    machine = hostmachine.current().lower()
    wanted = _setting()
    if wanted == NATIVE and not hostmachine.cross():
        return native()
    chosen = BASELINES.get(wanted)
    if chosen is None or chosen.machine != machine:
        chosen = BASELINES.get(DEFAULT_BASELINE.get(machine, ""))
    return chosen if chosen is not None else native()


def tuned_beyond(recorded: list[str] | tuple[str, ...], code: HostCode | None = None) -> list[str]:
    """Extensions an entry's host code needs beyond what this process writes (``code``, default
    :func:`host_code`): a native entry from an earlier release, or from a ``native`` build box,
    that prewarm rebuilds so the cache serves every host again. Empty when ``code`` is native."""
    code = code or host_code()
    if not code.portable:
        return []
    allowed = set(code.extensions)
    return sorted(f for f in recorded if f not in allowed and (code.machine != "x86_64" or _codegen_relevant(f)))


def beyond_baseline(extensions: tuple[str, ...] | list[str] | None = None) -> list[str]:
    """This CPU's (or ``extensions``') codegen-relevant extensions beyond the machine's default
    baseline: what a ``native`` entry written here records and a serving host may lack. Empty
    off x86 (aarch64 build and serving hosts are usually the same Grace or Neoverse part)."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return []
    base = set(BASELINES[DEFAULT_BASELINE["x86_64"]].extensions)
    have = isa_extensions() if extensions is None else extensions
    return sorted(f for f in have if _codegen_relevant(f) and f not in base)


def written_beyond_baseline() -> list[str]:
    """What the entries this process writes need beyond the default baseline: none unless the
    host code is ``native`` (then this CPU's extras), or a wider baseline was asked for by name."""
    code = host_code()
    if code.portable:
        base = set(BASELINES.get(DEFAULT_BASELINE.get(code.machine, ""), code).extensions)
        return sorted(set(code.extensions) - base)
    return beyond_baseline()
