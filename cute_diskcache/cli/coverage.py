"""Whether a cache covers what a host will ask of it, judged without touching the cache.

``cute-diskcache check`` (a deploy gate) asks, for every kernel a model's plan needs, whether a
serving process on this host would load that entry: the same checks a lookup makes (trust of
every level, the manifest's seal and signature, the key, arch, environment, host CPU, device
facts, every payload's checksum), but nothing is quarantined, counted, touched or written. A
gate that repaired what it inspected would pass on its second run and hide the fault. ``import``
asks the same of a bundle's namespaces as a whole (:func:`foreign_namespaces`).

Nothing here imports flashinfer or prints; :mod:`.check` plans and prints.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable

from ..keys import hostcpu
from ..storage import staleness
from ..keys.key import CacheKey
from ..storage.store import Refusal, Store, side_data_refusal

#: A finding's status: the entry would be loaded / there is none / there is one this host refuses.
OK, MISSING, UNUSABLE = "ok", "missing", "unusable"


@dataclasses.dataclass
class Finding:
    status: str
    why: str = ""
    #: host CPU extensions the entry's build CPU had and this one lacks (status unusable)
    cpu_lacks: list[str] = dataclasses.field(default_factory=list)
    #: the root (the writable one or a read-only layer) whose entry would be loaded (status ok)
    found_in: str | None = None
    #: the verified entry's side data (status ok), for the site's check
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)


def inspect(store: Store, key: CacheKey, extra_ok: Callable[[dict[str, Any]], bool] | None = None) -> Finding:
    """What a lookup of ``key`` in ``store`` would find on this host, read-only.

    The checks of :meth:`..Store.lookup_or_quarantine` without ``load`` (every payload is
    hashed), in the same order (the root, then each read-only layer of
    ``CUTE_DISKCACHE_READ_DIRS``), minus its side effects: a damaged entry is reported, not
    quarantined; a refusal is not logged or counted. When no root has a usable entry, the
    first refusal found is the answer (an entry that is there but unusable says more than one
    that is absent), else why the key missed.

    ``extra_ok``: the site's check of the entry's side data, which a hit applies to the first
    verified entry it finds (:func:`..storage.store.side_data_refusal`): refused there, the hit is a
    miss, whatever a later layer holds, and so is the finding.
    """
    refused: Finding | None = None
    for where in (store, *getattr(store, "layers", ())):
        found = _inspect_one(where, key)
        if found is None:
            continue
        if found.status == OK:
            why = side_data_refusal(found.extra, extra_ok)
            if why is not None:
                return Finding(UNUSABLE, f"{why.reason}: {why.detail} (written by another version of this site; "
                                         f"a serving process misses it and compiles)", found_in=found.found_in)
            return found
        if refused is None:
            refused = found if where is store else dataclasses.replace(found, why=f"{found.why} (in read-only layer {where.root})")
    return refused or Finding(MISSING, why_missed(store, key))


def _inspect_one(store: Store, key: CacheKey) -> Finding | None:
    """:func:`inspect` in one root; None when it has no entry for ``key``."""
    if not store.trusted:
        from .inventory import trust_note

        why = getattr(store, "_refusal", None) or trust_note(store.root) or "not trusted"
        return Finding(UNUSABLE, f"cache root {store.root} refused: {why}")
    verdict = store.judge(key)
    if verdict is None:
        return None
    if not isinstance(verdict, Refusal):
        return Finding(OK, found_in=str(store.root), extra=dict(verdict[0].get("extra") or {}))
    exc = verdict.error
    if exc.reason == "host-cpu" and verdict.manifest is not None:
        lacking = hostcpu.missing(verdict.manifest.get("host_isa") or [], machine=(verdict.manifest.get("env") or {}).get("machine"))
        return Finding(UNUSABLE, f"host CPU lacks {', '.join(lacking)} (the entry was built on a CPU with them)", lacking)
    if exc.reason in ("link", "untrusted"):
        return Finding(UNUSABLE, f"refused: {exc.detail}")
    damaged = " (damaged: a serving process quarantines it and compiles)" if verdict.corrupt else ""
    return Finding(UNUSABLE, f"{exc.reason}: {exc.detail}{damaged}")


def why_missed(store: Store, key: CacheKey) -> str:
    """Why ``key`` has no entry: the reason a serving process logs at that miss (the nearest
    entries' environment differences...)."""
    from ..storage.explain import why_missed as explain

    return str(explain(store, key))


def host_arch() -> tuple[str | None, str]:
    """The arch this host's kernels are built for, and where that came from: the target profile
    (``CUTE_DISKCACHE_TARGET``), else the GPU present; None when neither says."""
    from .. import config
    from ..keys import targets

    name = config.text("target")
    if name:
        try:
            return targets.get(name).arch, f"target profile {name}"
        except Exception:  # noqa: BLE001 - an unknown profile: the serving process ignores it too
            pass
    try:
        from ..keys.gpu import Gpu

        gpu = Gpu.find()
    except Exception:  # noqa: BLE001 - no driver, no cuda-python, a broken install: no GPU to name
        gpu = None
    if gpu is not None:
        return gpu.arch, f"GPU {gpu.name}"
    return None, "no GPU or target profile here"


def foreign_namespaces(root: Path, namespaces: Iterable[str], arch: str | None = None) -> list[dict[str, str]]:
    """The namespaces (of ``root``) whose entries this install can never load, with the reason
    :func:`..storage.staleness.reason` gives (another flashinfer, DSL stack, machine, entry format, arch)."""
    current = staleness.current_environment()
    out: list[dict[str, str]] = []
    for ns in namespaces:
        found = staleness.namespace_env(root, ns)
        if found is None:
            continue
        why = staleness.reason(found[0], found[1], current, arch)
        if why is not None:
            out.append({"namespace": ns, "reason": why.replace("(keeping ", "(this host: ")})
    return out
