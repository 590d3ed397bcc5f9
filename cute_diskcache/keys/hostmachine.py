"""Which machine's host code this process writes: the building machine's, or its target's.

An entry is host launch code plus cubins, and the host code runs on the serving host's CPU. A
DGX Spark's host is aarch64, while image build boxes and CI runners are mostly x86_64: a
prewarm for a Spark on x86 that wrote x86_64 code into the x86_64 namespace, and reported
success, made a cache no Spark can ever use (issue 30). So a process that compiles for a
target profile whose host machine differs from its own either writes that machine's host code
into that machine's namespace (where the DSL can: :mod:`..core.crossbuild`) or is refused before it
compiles anything.

The machine is chosen once per process, before the first key is made, by prewarm (its workers)
and ``check``; every other process (a serving engine, a probe) keys and writes its own
machine's code and never calls :func:`build_for`.
"""

from __future__ import annotations

import logging
import platform

log = logging.getLogger("cute_diskcache")

#: Host machines an entry can be written for, as ``platform.machine()`` spells them on Linux
#: (and so as a key's namespace does).
MACHINES = ("x86_64", "aarch64")
_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "armv8": "aarch64"}

_target: str | None = None


class UnknownMachineError(ValueError):
    """A machine name that is not one of :data:`MACHINES` (or an alias of one)."""


def normalize(name: str) -> str:
    """``arm64`` -> ``aarch64``, ``amd64`` -> ``x86_64``; :class:`UnknownMachineError` for others."""
    raw = str(name).strip().lower()
    canonical = _ALIASES.get(raw, raw)
    if canonical not in MACHINES:
        raise UnknownMachineError(f"unknown host machine {name!r}; known: {', '.join(MACHINES)} (or arm64, amd64)")
    return canonical


def here() -> str:
    """This machine, as a key names it (``platform.machine()``, lower-cased)."""
    return platform.machine().lower()


def current() -> str:
    """The machine this process writes (and keys) host code for: what :func:`build_for` chose,
    else this one. A key's environment takes it (:class:`.key.Environment`)."""
    return _target if _target is not None else platform.machine()


def cross() -> bool:
    """Whether this process writes host code for a machine other than its own."""
    return _target is not None and _target != here()


def build_for(machine: str | None) -> None:
    """Key and write host code for ``machine`` in this process (None: this machine's).

    Must run before the first key is made: a kernel family's environment is built once per
    process. Switching to another machine afterwards is refused, as switching target profiles is.
    """
    global _target
    wanted = normalize(machine) if machine else None
    if wanted == here():
        wanted = None
    if _target is not None and wanted != _target:
        raise RuntimeError(f"this process already writes host code for {_target}; cannot switch to {wanted or here()}")
    if wanted is not None and _target is None:
        log.info("writing host code for %s (this machine: %s)", wanted, here())
    _target = wanted


def for_target(host_machines: tuple[str, ...], override: str | None = None) -> str:
    """The machine to build for a target whose card comes with ``host_machines`` (a profile's),
    or with ``override`` (``--host-machine``: an RTX card in an Arm server): this machine when it
    is one of them, else the first."""
    if override:
        return normalize(override)
    mine = here()
    return mine if mine in host_machines or not host_machines else host_machines[0]
