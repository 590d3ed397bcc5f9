"""What a root holds, read for an operator: statistics with sizes, entry rows, one entry, checks.

Every read goes through the same walk (:mod:`..storage.layout`) and the same checked payload reader
(:func:`..storage.entry.read_payload`) as the serving path, so ``stats``, ``list`` and ``verify`` agree
with each other and with what a lookup would do. Nothing here prints; :mod:`.cli` does.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from .. import config
from ..storage import entry, eviction, ingest, layout, stats
from ..keys.arch import arch_runs_on
from ..keys.gpu import Gpu
from ..storage.store import Store

_HEX = frozenset("0123456789abcdef")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Refused(Exception):
    """What the operator asked for cannot be had: an unknown or ambiguous digest, a payload the
    entry lacks or that fails its checksum. One line, for the CLI's exit status 2."""


def collect_stats(root: Path, *, compact: bool | None = None) -> dict[str, Any]:
    """Counters per namespace, with each namespace's entries and bytes from one walk, and totals.

    ``compact`` folds the statistics files of finished processes into one as it reads (ccache
    does the same); the default does so unless the view is read-only. The sums are the same.
    """
    if compact is None:
        compact = not config.flag("readonly") and os.access(Path(root) / layout.STATS_DIR, os.W_OK)
    per_ns = stats.aggregate(root, compact=compact)
    use = eviction.usage(root)
    namespaces: dict[str, dict[str, float]] = {}
    for ns in sorted(set(per_ns) | set(use["namespaces"])):
        rec = {f: 0.0 for f in stats.FIELDS}
        rec.update(per_ns.get(ns, {}))
        u = use["namespaces"].get(ns, {"bytes": 0, "entries": 0})
        rec["entries"], rec["bytes"] = u["entries"], u["bytes"]
        namespaces[ns] = rec
    total = stats.totals(per_ns)
    # bytes: the entries (the namespaces add up to it); cache_bytes: everything the size cap
    # counts, i.e. the entries plus what the rest of the root holds (overhead).
    total["entries"], total["bytes"], total["cache_bytes"] = use["entries"], use["entry_bytes"], use["bytes"]
    return {"namespaces": namespaces, "total": total, "overhead": use["overhead"]}


def trust_note(root: Path) -> str | None:
    """Why a serving process would refuse this root (it then compiles everything), or None."""
    if config.flag("trust_shared"):
        return None
    try:
        from ..storage import trust

        return trust.root_refusal(root, group=config.trust_group())
    except Exception:  # noqa: BLE001 - advice for a report: it must print regardless
        return None


def describe_entry(d: Path) -> dict[str, Any]:
    """One ``list`` row from the manifest alone (no payload reads: listing stays fast)."""
    row: dict[str, Any] = {
        "digest": d.name,
        "namespace": d.parent.parent.name,
        "bytes": layout.entry_bytes(d),
        "last_used": layout.last_used(d),
        "path": str(d),
    }
    try:
        m = entry.read_manifest(d)
    except entry.EntryError as exc:
        row.update(status=f"{exc.reason}: {exc.detail}", site="?", kind="?", key="", created=0.0, compile_seconds=0.0, arch="?")
        return row
    row.update(
        status="ok",
        site=m["site"],
        kind=m["site"].rsplit(".", 1)[-1],
        key=str(m.get("key_repr", "")),
        created=float(m["created"]),
        compile_seconds=float(m["compile_seconds"]),
        arch=str(m["env"].get("arch", "?")),
    )
    return row


def find_entry(root: Path, prefix: str) -> Path:
    """The one entry whose digest starts with ``prefix`` (any namespace); :class:`Refused` otherwise."""
    prefix = prefix.strip().lower()
    if not prefix or len(prefix) > 64 or not set(prefix) <= _HEX:
        raise Refused(f"{prefix!r} is not a digest or digest prefix (hex)")
    found = [d for d in layout.entry_dirs(root) if d.name.startswith(prefix)]
    if not found:
        raise Refused(f"no entry with digest {prefix}... under {root}")
    if len(found) > 1:
        names = ", ".join(f"{d.name[:16]} ({d.parent.parent.name})" for d in found[:8])
        raise Refused(f"digest prefix {prefix} is ambiguous: {names}{' ...' if len(found) > 8 else ''}")
    return found[0]


def checked_payload(d: Path, manifest: dict[str, Any], role: str, index: int) -> bytes:
    """One payload's bytes, only if they still match the manifest's checksum."""
    items = manifest["payloads"].get(role, [])
    if not items:
        raise Refused(f"entry {d.name[:12]} has no {role} payload")
    if not 0 <= index < len(items):
        raise Refused(f"entry {d.name[:12]} has {len(items)} {role} payload(s); --index {index} is out of range")
    try:
        return entry.read_payload(d, items[index], role=role)
    except entry.EntryError as exc:
        hint = " (run 'cute-diskcache verify')" if exc.reason == "checksum" else ""
        raise Refused(f"{role} payload: {exc}{hint}") from None


def entry_status(d: Path, hmac_key: bytes | None) -> str:
    """``ok ...`` when every payload checksum holds, else ``BAD <reason>: <detail>``."""
    try:
        ingest.check(d, hmac_key=hmac_key)
        return "ok (every payload checksum verified)"
    except entry.EntryError as exc:
        return f"BAD {exc.reason}: {exc.detail}"


def device_check(d: Path, manifest: dict[str, Any], obj: bytes, gpu: Gpu | None) -> tuple[str, str]:
    """(outcome, detail) of loading one verified entry: "loaded", "skipped" or "failed"."""
    from ..storage import loader

    arch = str(manifest["env"].get("arch", "?"))
    if gpu is not None and not arch_runs_on(arch, gpu.capability):
        return "skipped", f"built for {arch}; the device is {gpu.arch} ({gpu.name})"
    if gpu is not None:
        from ..keys import devicefacts

        why = devicefacts.mismatch(manifest["device"])
        if why is not None:
            return "skipped", f"built against other device facts: {why}"
    try:
        kernel = loader.load_object(obj, manifest["symbol"], manifest["tvm_ffi"])
        if kernel is None:
            raise RuntimeError(f"symbol {manifest['symbol']} not found")
        if gpu is not None:
            for item in manifest["payloads"].get("cubin", []):
                gpu.load_cubin(entry.read_payload(d, item, role="cubin"))
    except Exception as exc:  # noqa: BLE001 - the loader's or driver's refusal, whatever its kind, is this entry's verdict
        return "failed", f"{type(exc).__name__}: {one_line(str(exc))}"
    return "loaded", "object and its cubins loaded on the device" if gpu is not None else "object loaded on the host (no GPU)"


def one_line(text: str, width: int = 240) -> str:
    """An exception's text for a table cell: no colour codes (the DSL's errors have them), no newlines, bounded."""
    text = " ".join(_ANSI.sub("", text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def verify(root: Path, *, namespaces: Sequence[str] | None = None, device: bool = False, quarantine: bool = False,
           settings: config.Settings | None = None) -> tuple[list[dict[str, Any]], Gpu | None]:
    """Check every entry (checksums; with ``device`` also load it); with ``quarantine`` move bad ones aside.

    Returns one record per entry (``status`` ok / bad / incomplete, ``reason``, ``load``...) and
    the GPU the loads used (None: loaded on the host only).
    """
    settings = settings or config.load()
    gpu = Gpu.find() if device else None
    results: list[dict[str, Any]] = []
    store = Store.for_settings(settings, root, layers=False)
    for d in layout.entry_dirs(root, namespaces):
        res: dict[str, Any] = {"digest": d.name, "namespace": d.parent.parent.name, "status": "ok"}
        try:
            manifest, obj = ingest.check(d, hmac_key=settings.hmac_key)
        except entry.EntryError as exc:
            res.update(status="incomplete" if exc.reason == "absent" else "bad", reason=f"{exc.reason}: {exc.detail}")
            if res["status"] == "bad" and quarantine:
                store.quarantine(d, exc)
                res["quarantined"] = not os.path.lexists(d)
            results.append(res)
            continue
        if device:
            res["load"], res["load_detail"] = device_check(d, manifest, obj, gpu)
            if res["load"] == "failed":
                res.update(status="bad", reason=f"load: {res['load_detail']}")
                if quarantine:
                    store.quarantine(d, entry.EntryError("load", res["load_detail"]))
                    res["quarantined"] = not os.path.lexists(d)
        results.append(res)
    return results, gpu
