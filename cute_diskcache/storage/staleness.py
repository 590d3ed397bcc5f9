"""Which namespaces can never hit again on this install, and taking them out (``prune``).

A namespace is one environment (package version, DSL stack, machine, arch, entry format);
every entry in it shares one record, so one manifest says whether the whole namespace is
stale. What cannot be compared without importing the package or seeing the serving process's
environment (the source fingerprint, codegen variables) is never a reason here: such a
namespace stays until ``--older-than`` or the size cap takes it.

A root may be shared by several venvs or hosts, and what is stale from here may be what another
one serves: a namespace used within ``recent`` seconds is kept (recency is marked at most
hourly, see :func:`.eviction.touch`).
"""

from __future__ import annotations

import importlib.metadata
import platform
import time
from pathlib import Path
from typing import Any

from . import entry, eviction, layout, locking, reuse
from ..keys.key import FORMAT_VERSION, dsl_stack


def current_environment() -> dict[str, Any]:
    """What this install would key new entries on, as far as it is knowable without importing flashinfer."""
    return {"dsl": [list(p) for p in dsl_stack()], "machine": platform.machine()}


def _installed(package: str) -> set[str] | None:
    """Versions installed here of what a namespace's ``package`` field names; None: cannot tell.

    The field holds a distribution name (``flashinfer-python``, the adapter's) or an import
    name (``flashinfer``, ``mykernels``: what ``cached_compile`` records), so both are looked
    up. A module that is importable without any distribution (a source checkout on the path),
    or ``__main__``, cannot be compared: such a namespace is never pruned for its package.
    """
    if not package or package.startswith("__"):
        return None
    versions: set[str] = set()
    try:
        versions.add(importlib.metadata.version(package))
    except (importlib.metadata.PackageNotFoundError, ValueError):
        pass
    for dist in importlib.metadata.packages_distributions().get(package, []):
        try:
            versions.add(importlib.metadata.version(dist))
        except (importlib.metadata.PackageNotFoundError, ValueError):
            continue
    if not versions:
        from importlib.util import find_spec

        try:
            if find_spec(package) is not None:
                return None
        except (ImportError, ValueError):
            pass
    return versions


def reason(env: dict[str, Any], manifest_format: int, current: dict[str, Any], arch: str | None) -> str | None:
    """Why a namespace with this environment record can never hit again here, or None."""
    if manifest_format != FORMAT_VERSION:
        return f"entry format {manifest_format} (this version writes {FORMAT_VERSION})"
    package = str(env.get("package", ""))
    name, _, version = package.partition("==")
    installed = _installed(name)
    if installed is not None and not installed:
        return f"{name or 'its package'} is not installed"
    if installed is not None and version not in installed:
        return f"{name} {version} (installed: {', '.join(sorted(installed))})"
    dsl = [list(p) for p in env.get("dsl", [])]
    if dsl != current["dsl"]:
        theirs, ours = dict(map(tuple, dsl)), dict(map(tuple, current["dsl"]))
        diff = [f"{n} {theirs.get(n, 'absent')} (installed: {ours.get(n, 'none')})" for n in sorted(set(theirs) | set(ours)) if theirs.get(n) != ours.get(n)]
        return "DSL stack: " + ", ".join(diff)
    if env.get("machine") != current["machine"]:
        return f"machine {env.get('machine')} (this host: {current['machine']})"
    if arch is not None and env.get("arch") != arch:
        return f"arch {env.get('arch')} (keeping {arch})"
    return None


def _entries_of(root: Path, ns: str) -> list[Path]:
    return [d for d in layout.entry_dirs(root, [ns]) if d.parent.parent.name == ns]


def first_manifest(root: Path, ns: str) -> dict[str, Any] | None:
    """The first readable manifest of a namespace: every entry of it shares one environment."""
    for d in _entries_of(root, ns):
        try:
            return entry.read_manifest(d)
        except entry.EntryError:
            continue
    return None


def namespace_env(root: Path, ns: str) -> tuple[dict[str, Any], int] | None:
    """The environment record of a namespace and its entry format."""
    m = first_manifest(root, ns)
    return None if m is None else (m["env"], m["format"])


def prune(root: Path, *, arch: str | None = None, older_than: float | None = None, recent: float = 86400.0,
          dry_run: bool = False) -> dict[str, Any]:
    """Remove stale namespaces (and, with ``older_than`` seconds, entries unused that long).

    Returns what went (or would go): ``namespaces`` with their reason, ``kept_recent`` (stale
    from here but used within ``recent`` seconds), ``old_entries``, the totals, and the idle
    lock files pruned.
    """
    current = current_environment()
    gone_ns: list[dict[str, Any]] = []
    kept_recent: list[dict[str, Any]] = []
    for ns in layout.namespaces(root):
        found = namespace_env(root, ns)
        if found is None:
            continue  # nothing readable: 'verify' reports it, eviction ages it out
        why = reason(found[0], found[1], current, arch)
        if why is None:
            continue
        dirs = _entries_of(root, ns)
        used = max((layout.last_used(d) for d in dirs), default=0.0)
        if recent and used > time.time() - recent:
            kept_recent.append({"namespace": ns, "reason": why, "last_used": used})
            continue
        gone_ns.append({"namespace": ns, "reason": why, "entries": len(dirs), "bytes": sum(layout.entry_bytes(d) for d in dirs)})
        if not dry_run:
            eviction.remove(root, Path(root) / layout.LAYOUT / ns)
    old: list[dict[str, Any]] = []
    if older_than is not None:
        cutoff = time.time() - older_than
        for d in layout.entry_dirs(root):
            used = layout.last_used(d)
            if used and used < cutoff:
                old.append({"digest": d.name, "namespace": d.parent.parent.name, "last_used": used, "bytes": layout.entry_bytes(d)})
                if not dry_run:
                    eviction.remove(root, d)
    locks = 0 if dry_run else locking.prune(root)  # lock files nobody holds: safe beside live processes
    # second-stage records of what went, and the markers of releases they no longer name
    records = reuse.prune(root, dry_run=dry_run)  # a dry run counts those dead already
    return {
        "current": current,
        "namespaces": gone_ns,
        "kept_recent": kept_recent,
        "old_entries": old,
        "entries_removed": sum(n["entries"] for n in gone_ns) + len(old),
        "bytes_removed": sum(n["bytes"] for n in gone_ns) + sum(o["bytes"] for o in old),
        "lock_files_removed": locks,
        "records_removed": records,
    }
