"""Which code runs on which device: the capability rule for an arch a kernel was built for.

Key policy, beside the profiles (:mod:`.targets`) that name an arch and a capability: ``verify
--device`` asks it before handing a cubin to the driver, and it needs nothing but the two names.
"""

from __future__ import annotations

import re

_ARCH = re.compile(r"sm_(\d+)(\d)([af]?)")


def _arch_number(arch: str) -> tuple[int, int, str] | None:
    m = _ARCH.fullmatch(arch or "")
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def arch_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Can code built for ``arch`` (``sm_120a``, ``sm_100f``, ``sm_90``) run on a device of ``capability``?

    ``a`` (arch-specific) code runs on exactly that capability, ``f`` (family) code on the same
    major with an equal or newer minor, plain code on the same major too.
    """
    parsed = _arch_number(arch)
    if parsed is None:
        return False
    major, minor, suffix = parsed
    if suffix == "a":
        return (major, minor) == tuple(capability)
    return major == capability[0] and capability[1] >= minor
