"""Why a lookup missed, in words an operator can act on.

A miss costs a compile (seconds to minutes), and without a reason users reverse-engineer keys
(SkyRL#2167: an env hash fragmented a cache). :func:`why_missed` runs on a miss only, reads at
most one manifest per namespace plus a bounded number of this site's manifests (milliseconds),
and never raises. In order, it says:

* the root is refused (trust), so nothing is read from it;
* an entry for this very key exists but is refused here: damaged, quarantined, signature,
  built on a CPU with extensions this one lacks, for other device facts, not loadable here;
* the same kernel (same site, key and options) exists under another environment: which fields
  of the environment differ (flashinfer / DSL version, arch, machine, device, an env switch,
  the kernel's source);
* no entry for this kernel, and the nearest entries of this site are under an environment that
  differs in those fields, or under this one (another shape);
* no entry for this kernel, nothing of this site at all.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from . import entry, layout
from ..keys.key import CacheKey
from .staleness import first_manifest

#: Manifests read, at most, looking for entries of the missing kernel's site (one miss).
MAX_MANIFESTS = 400


def why_missed(store: Any, key: CacheKey, *, refused: BaseException | None = None) -> str:
    """A short reason why ``key`` has no usable entry in ``store``; never raises.

    ``refused``: what the caller already knows (a verified entry the DSL could not load, side
    data of another shape), said instead of re-deriving it.
    """
    try:
        return _why(store, key, refused)
    except Exception as exc:  # noqa: BLE001 - a reason is a courtesy: never the cause of a failure
        return f"no entry for this kernel (reason not determined: {type(exc).__name__}: {exc})"


def _why(store: Any, key: CacheKey, refused: BaseException | None) -> str:
    if refused is not None:
        return f"entry refused: {_entry_reason(refused)}"
    if not store.trusted:
        return f"cache root refused: {getattr(store, '_refusal', None) or 'not trusted'}{_layers(store, key)}"
    return _in_root(store, key) + _layers(store, key)


def _layers(store: Any, key: CacheKey) -> str:
    """What the read-only layers (``CUTE_DISKCACHE_READ_DIRS``) said: ``; read layer /opt/x: no entry``,
    ``... does not exist``, ``... refused: <why>``, ``... entry refused: <why>``; empty without layers."""
    parts = []
    for layer in getattr(store, "layers", ()):
        if not os.path.isdir(layer.root):
            parts.append(f"{layer.root} does not exist")
        elif not layer.trusted:
            parts.append(f"{layer.root} refused: {getattr(layer, '_refusal', None) or 'not trusted'}")
        else:
            verdict = layer.judge(key)
            error = getattr(verdict, "error", None)
            if error is not None:
                parts.append(f"{layer.root}: entry refused: {_entry_reason(error)}")
            else:
                parts.append(f"{layer.root}: {'no entry' if verdict is None else 'entry present but not used'}")
    if not parts:
        return ""
    return f"; read layer{'s' if len(parts) != 1 else ''} {'; '.join(parts)}"


def _in_root(store: Any, key: CacheKey) -> str:
    path: Path = store.entry_dir(key)
    if os.path.lexists(path):
        try:
            manifest = entry.read_manifest(path, hmac_key=store.hmac_key, owner=store.owner)
            entry.verify(path, manifest, key, owner=store.owner, role="object")
        except entry.EntryError as exc:
            if exc.reason != "absent":
                return f"entry refused: {_entry_reason(exc)}"
        else:
            return "entry present but not used (written after this process looked, or not loadable here)"
    quarantined = _quarantined(Path(store.root), key.digest)
    if quarantined:
        return f"entry refused: quarantined as {quarantined}"
    return _nearest(Path(store.root), key)


def _entry_reason(exc: BaseException) -> str:
    """``host CPU (entry needs avx512f)``, ``device facts: ...``: the refusal, read aloud."""
    reason, detail = getattr(exc, "reason", None), getattr(exc, "detail", str(exc))
    if reason == "host-cpu":
        needs = detail.split(" with ", 1)[-1].split(", which", 1)[0]
        return f"host CPU (entry needs {needs})"
    if reason == "device":
        return f"device facts ({detail})"
    if reason == "signature":
        return f"signature ({detail})"
    if reason in entry.CORRUPT:
        return f"damaged ({reason}: {detail}); set aside"
    return f"{reason}: {detail}" if reason else str(exc)


def _quarantined(root: Path, digest: str) -> str | None:
    """The reason word of this digest's newest quarantined copy (``<time>-<reason>-<digest>-<rand>``)."""
    names = sorted((d.name for d in layout.subdirs(root / layout.QUARANTINE_DIR) if f"-{digest}-" in d.name), reverse=True)
    if not names:
        return None
    head = names[0].split(f"-{digest}-", 1)[0]
    return head.split("-", 1)[1] if "-" in head else head


def _nearest(root: Path, key: CacheKey) -> str:
    ours = key.env.as_dict()
    own_ns = key.env.namespace
    same_kernel: list[tuple[int, dict[str, Any]]] = []
    other_envs: list[tuple[str, dict[str, Any]]] = []
    for ns in layout.namespaces(root):
        if ns == own_ns:
            continue
        manifest = first_manifest(root, ns)
        if manifest is None or manifest.get("env", {}).get("kind") != ours["kind"]:
            continue
        theirs = manifest["env"]
        try:  # where this kernel's entry would be, had it been compiled under that environment
            digest = hashlib.sha256(bytes.fromhex(str(manifest["env_digest"])) + key.key_bytes).hexdigest()
        except ValueError:
            continue
        if (layout.entry_dir(root, ns, digest) / entry.MANIFEST).exists():
            same_kernel.append((len(_differences(theirs, ours)), theirs))
        else:
            other_envs.append((ns, theirs))
    if same_kernel:
        same_kernel.sort(key=lambda t: t[0])
        return "this kernel's entry was made under another stack; it differs in: " + ", ".join(_differences(same_kernel[0][1], ours))
    budget = [MAX_MANIFESTS]
    own = _site_entries(root, own_ns, key.site, budget)
    if own:
        return f"no entry for this kernel ({own} other {key.site} kernel{'s' if own != 1 else ''} of this stack: another shape)"
    near: list[tuple[int, dict[str, Any]]] = []
    for ns, theirs in other_envs:
        if _site_entries(root, ns, key.site, budget, stop_at=1):
            near.append((len(_differences(theirs, ours)), theirs))
    if near:
        near.sort(key=lambda t: t[0])
        return "no entry for this kernel; the nearest entry of this site differs in: " + ", ".join(_differences(near[0][1], ours))
    return "no entry for this kernel"


def _site_entries(root: Path, ns: str, site: str, budget: list[int], stop_at: int | None = None) -> int:
    """How many entries of ``site`` ``ns`` holds (reading at most ``budget[0]`` manifests in all)."""
    found = 0
    for d in layout.entry_dirs(root, [ns]):
        if budget[0] <= 0 or (stop_at is not None and found >= stop_at):
            break
        if d.parent.parent.name != ns:
            continue
        budget[0] -= 1
        try:
            if entry.read_manifest(d).get("site") == site:
                found += 1
        except entry.EntryError:
            continue
    return found


def _version(package: str) -> tuple[str, str]:
    name, _, version = package.partition("==")
    return name.replace("-python", ""), version


def _differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Each field of an environment record that differs, as ``what: theirs -> ours``."""
    out: list[str] = []
    if theirs.get("format") != ours.get("format"):
        out.append(f"entry format {theirs.get('format')} -> {ours.get('format')}")
    if theirs.get("package") != ours.get("package"):
        (tname, tver), (oname, over) = _version(str(theirs.get("package", ""))), _version(str(ours.get("package", "")))
        out.append(f"{oname} {tver} -> {over}" if tname == oname else f"package {theirs.get('package')} -> {ours.get('package')}")
    tdsl, odsl = dict(map(tuple, theirs.get("dsl", []))), dict(map(tuple, ours.get("dsl", [])))
    for name in sorted(set(tdsl) | set(odsl)):
        if tdsl.get(name) != odsl.get(name):
            out.append(f"DSL {name} {tdsl.get(name, 'absent')} -> {odsl.get(name, 'absent')}")
    for field, label in (("arch", "arch"), ("machine", "machine"), ("device", "device")):
        if theirs.get(field) != ours.get(field):
            out.append(f"{label} {theirs.get(field) or 'none'} -> {ours.get(field) or 'none'}")
    tenv, oenv = dict(map(tuple, theirs.get("codegen_env", []))), dict(map(tuple, ours.get("codegen_env", [])))
    for name in sorted(set(tenv) | set(oenv)):
        if tenv.get(name) != oenv.get(name):
            out.append(f"env switch {name} {_shown(tenv.get(name))} -> {_shown(oenv.get(name))}")
    if theirs.get("sources") != ours.get("sources") and theirs.get("package") == ours.get("package"):
        out.append("source (the kernel's Python code differs at the same version)")
    elif theirs.get("sources") != ours.get("sources") and not out:
        out.append("source")
    return out or ["nothing recorded (another key)"]


def _shown(value: Any) -> str:
    return "unset" if value is None else repr(value) if value == "" else str(value)
