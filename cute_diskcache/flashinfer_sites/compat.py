"""Which flashinfer and DSL releases cute-diskcache works with, and what it does with the others.

The facts come from the compatibility matrix (``scripts/compat_matrix.py``, results in
``compat/``): every release listed in :data:`VERIFIED` had each site kind it covers compiled
through flashinfer's own dispatch and then hit in a fresh process with zero compiles.

**Refused combinations** (:data:`REFUSED`): a flashinfer with a DSL that the matrix showed cannot
compile its kernels. cute-diskcache then attaches nothing and says so in one log line; flashinfer
runs as it would without us (and fails the same way), rather than a cache half-working.

**Unverified releases** (a 0.7.3, a 0.8 that appears later) are served like verified ones: a
site's key is everything its compile receives (:mod:`..core.hook`), not a site's in-process key that a
new release could outgrow, so there is nothing per site to vet. What can change is *where* a
release compiles: a site moved to a function the table does not name is not reached, and
``doctor --strict`` (the site scan, :mod:`.scan`) shows it as covered by nothing. One log line
says the release is unverified (:func:`note_unverified`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
from typing import Any
from collections.abc import Iterable, Sequence

from ._common import flashinfer_version, version_tuple

log = logging.getLogger("cute_diskcache")

#: flashinfer releases the matrix proved (compat/cells/*.json, status "proven"). Kept equal to the
#: matrix by tests/test_compat.py::test_verified_releases_are_the_proven_matrix_cells.
VERIFIED: tuple[str, ...] = (
    "0.6.12", "0.6.13", "0.6.14", "0.6.15.post1", "0.6.16.post4", "0.6.17",
    "0.6.18.post1", "0.7.0.post1", "0.7.1", "0.7.2", "0.7.2.post1", "0.7.4",
)


@dataclasses.dataclass(frozen=True)
class Refused:
    """A flashinfer range with a DSL range (half-open, version tuples) that cannot work.

    ``lacking``: the combination fails only when this distribution is absent (the DSL's CUDA 13
    libraries, which carry the ptxas that knows sm_120a's block-scaled MMA). ``evidence``: the
    compatibility matrix's site whose failure, with the DSL's own error, is the record.
    """

    flashinfer: tuple[tuple[int, ...], tuple[int, ...]]
    dsl: tuple[tuple[int, ...], tuple[int, ...]]
    reason: str
    lacking: str | None = None
    evidence: str = "micro"

    def matches(self, fi: str, dsl: str, installed: Iterable[str]) -> bool:
        f, d = version_tuple(fi)[:3], version_tuple(dsl)[:3]
        return (self.flashinfer[0] <= f < self.flashinfer[1] and self.dsl[0] <= d < self.dsl[1]
                and (self.lacking is None or self.lacking not in set(installed)))


REFUSED: tuple[Refused, ...] = (
    Refused(
        flashinfer=((0, 6, 12), (0, 6, 18)),
        dsl=((4, 5, 0), (4, 6, 0)),
        lacking="nvidia-cutlass-dsl-libs-cu13",
        reason=("nvidia-cutlass-dsl 4.5 without its cu13 libraries cannot assemble the sm12x MoE kernels "
                "(ptxas: \"Unexpected instruction types specified for '_mma'\"); install nvidia-cutlass-dsl[cu13]"),
    ),
    Refused(
        flashinfer=((0, 7, 1), (99,)),
        dsl=((4, 6, 0), (4, 7, 0)),
        reason=("its nvfp4 W4A4/W4A16 MoE runners import cutlass.experimental, which nvidia-cutlass-dsl 4.6 does not "
                "have (flashinfer's cu12/cu13 extras require >= 4.7); install nvidia-cutlass-dsl>=4.7"),
        evidence="w4a4",
    ),
)

_DSL_DISTS = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13")


def _installed(names: Sequence[str]) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


@functools.lru_cache(maxsize=1)
def refused_rule() -> Refused | None:
    """The rule refusing this process's flashinfer + DSL combination (None: none does).

    Read from distribution metadata only (a few lookups), never by importing the DSL.
    """
    dists = _installed(_DSL_DISTS)
    dsl = dists.get("nvidia-cutlass-dsl")
    if dsl is None:
        return None
    return next((rule for rule in REFUSED if rule.matches(flashinfer_version(), dsl, dists)), None)


def refusal() -> str | None:
    """Why this process's flashinfer + DSL combination is refused (None: it is not)."""
    rule = refused_rule()
    if rule is None:
        return None
    return f"flashinfer {flashinfer_version()} with nvidia-cutlass-dsl {_installed(_DSL_DISTS[:1])['nvidia-cutlass-dsl']}: {rule.reason}"


_REFUSAL_LOGGED: list[bool] = []


def refused() -> bool:
    """True when the combination is refused; the first call logs the one line that says why."""
    reason = refusal()
    if reason is not None and not _REFUSAL_LOGGED:
        _REFUSAL_LOGGED.append(True)
        log.warning("cute-diskcache refuses %s; flashinfer runs uncached", reason)
    return reason is not None


def verified(version: str | None = None) -> bool:
    return (version or flashinfer_version()) in VERIFIED


_UNVERIFIED_LOGGED: list[bool] = []


def note_unverified() -> None:
    """One log line for a release the matrix has not proved (its sites are served all the same)."""
    version = flashinfer_version()
    if not verified(version) and not _UNVERIFIED_LOGGED:
        _UNVERIFIED_LOGGED.append(True)
        from .. import logsetup

        logsetup.configure()  # said at the DSL's import, before the attach line configures it
        log.info("flashinfer %s is not a release the compatibility matrix proved; its sites are keyed by what they "
                 "compile as on every release (`cute-diskcache doctor --strict` lists any it no longer reaches)", version)


def report(version: str) -> dict[str, Any]:
    """For doctor: verified or not, and the refusal (only asked for the installed flashinfer: it
    reads the installed DSL)."""
    installed = version == flashinfer_version()
    rule = refused_rule() if installed else None
    return {
        "verified": verified(version),
        "verified_releases": list(VERIFIED),
        "refused": refusal() if installed else None,
        "refused_evidence": rule.evidence if rule else None,
    }
