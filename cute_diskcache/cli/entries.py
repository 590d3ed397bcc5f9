"""``list``, ``show`` and ``verify``: the entries one by one."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import sys
from pathlib import Path
from typing import Any
from collections.abc import Callable

from .. import config
from ..storage import entry, layout
from . import inventory
from .common import Add, CliError, counting, refuse_if_readonly, root_of
from .output import fmt_ago, fmt_size, fmt_time, print_json, readable_key, shorten, table

_SORTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "size": lambda r: -r["bytes"],
    "created": lambda r: -r["created"],
    "used": lambda r: -r["last_used"],
}


def cmd_list(args: argparse.Namespace) -> int:
    root, _ = root_of(args)
    rows = [inventory.describe_entry(d) for d in layout.entry_dirs(root, args.namespace)]
    if args.sort:
        rows.sort(key=_SORTS[args.sort])
    if args.json:
        print_json({"root": str(root), "entries": rows})
        return 0
    if not rows:
        print(f"no entries under {root}")
        return 0
    print(_list_table(rows, args.key_width))
    total = sum(r["bytes"] for r in rows)
    print(f"\n{len(rows)} entries, {fmt_size(total)}  (cute-diskcache show DIGEST: one entry in full; --json: every field)")
    return 0


#: The width ``list`` fits in (an 80-100 column terminal, a CI log) unless --key-width asks more.
LIST_WIDTH = 100


def _site(r: dict[str, Any]) -> str:
    return shorten(str(r["site"]).removeprefix("flashinfer."), 26)


def _list_table(rows: list[dict[str, Any]], key_width: int | None) -> str:
    """Entries grouped under their namespace (the flashinfer / DSL / arch they were built for),
    one line each: digest, the compile site, the key's values as words, size, last use as an age."""
    cells = [(r["digest"][:12], _site(r), fmt_size(r["bytes"]), fmt_ago(r["last_used"]), f"{r['compile_seconds']:.1f} s")
             for r in rows]
    fixed = 2 + sum(max(len(h), *(len(c[i]) for c in cells)) + 2 for i, h in enumerate(("digest", "site", "size", "used", "compile")))
    width = key_width if key_width is not None else max(16, LIST_WIDTH - fixed)
    keys = [shorten(readable_key(r["key"]), width) if r["status"] == "ok" else f"[{shorten(r['status'], width - 2)}]" for r in rows]
    lines = table(("digest", "site", "key", "size", "used", "compile"),
                  [(c[0], c[1], k, c[2], c[3], c[4]) for c, k in zip(cells, keys, strict=True)], right=(3, 5)).splitlines()
    out = ["  " + lines[0]]
    by_ns: dict[str, list[int]] = {}
    for i, r in enumerate(rows):  # the namespaces in the order of their first row (the --sort order)
        by_ns.setdefault(r["namespace"], []).append(i)
    for ns, members in by_ns.items():
        out.append(f"{ns}  ({len(members)} entries)")
        out += ["  " + lines[i + 1] for i in members]
    return "\n".join(out)


def _pretty(value: Any, indent: int = 0) -> list[str]:
    """Manifest fields as aligned ``name  value`` lines; bytes as length + hex, times readable."""
    pad = " " * indent
    lines: list[str] = []
    width = max((len(str(k)) for k in value), default=0) + 2
    for k, v in value.items():
        label = f"{pad}{str(k):<{width}}"
        if isinstance(v, (bytes, bytearray)):
            hexed = bytes(v).hex()
            lines.append(f"{label}<{len(v)} bytes> {shorten(hexed, 72)}")
        elif isinstance(v, dict) and v:
            lines.append(f"{pad}{k}")
            lines += _pretty(v, indent + 2)
        elif isinstance(v, list) and v and all(isinstance(i, dict) for i in v):
            for i, item in enumerate(v):
                lines.append(f"{pad}{k}[{i}]")
                lines += _pretty(item, indent + 2)
        elif k == "created" and isinstance(v, (int, float)):
            lines.append(f"{label}{_dt.datetime.fromtimestamp(v).isoformat(timespec='seconds')}  ({v})")
        else:
            lines.append(f"{label}{v}")
    return lines


def cmd_show(args: argparse.Namespace) -> int:
    root, _ = root_of(args)
    d = inventory.find_entry(root, args.digest)
    try:
        manifest = entry.read_manifest(d)
    except entry.EntryError as exc:
        raise CliError(f"entry {d.name[:12]} has no readable manifest: {exc}") from None
    if args.mlir:
        raw = inventory.checked_payload(d, manifest, "mlir", args.index)
        text = entry.mlir_text(raw, manifest["payloads"]["mlir"][args.index]["file"])
        if args.json:
            print_json({"digest": d.name, "mlir": text})
        else:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return 0
    if args.cubin:
        data = inventory.checked_payload(d, manifest, "cubin", args.index)
        out = Path(args.cubin)
        out.write_bytes(data)
        n = len(manifest["payloads"]["cubin"])
        info = {"digest": d.name, "cubin": str(out), "index": args.index, "of": n, "bytes": len(data), "arch": manifest["env"].get("arch")}
        if args.json:
            print_json(info)
        else:
            print(f"wrote cubin {args.index} of {n} ({len(data)} bytes, {info['arch']}) to {out}; inspect with: cuobjdump -sass {out}")
        return 0
    status = inventory.entry_status(d, config.load().hmac_key)
    size, used = layout.entry_bytes(d), layout.last_used(d)
    if args.json:
        print_json({"path": str(d), "status": status, "bytes": size, "last_used": used, "manifest": manifest})
        return 0
    print("\n".join(_pretty({"path": str(d), "status": status, "size": fmt_size(size), "last used": fmt_time(used)})))
    print("\n".join(_pretty(manifest)))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    root, _ = root_of(args)
    if args.quarantine:
        refuse_if_readonly(args)
    with counting(root) if args.quarantine else contextlib.nullcontext():
        results, gpu = inventory.verify(root, namespaces=args.namespace, device=args.device, quarantine=args.quarantine)
    counts = {s: sum(1 for r in results if r["status"] == s) for s in ("ok", "bad", "incomplete")}
    device = None
    if args.device:
        device = {"name": gpu.name, "arch": gpu.arch} if gpu else None
        counts.update({k: sum(1 for r in results if r.get("load") == k) for k in ("loaded", "skipped", "failed")})
    if args.json:
        print_json({"root": str(root), "device": device, "counts": counts, "entries": results})
        return 1 if counts["bad"] else 0
    print(f"verified {len(results)} entries under {root}: {counts['ok']} ok, {counts['bad']} bad, {counts['incomplete']} incomplete")
    if args.device:
        if gpu is None:
            print("no GPU here: every object was loaded on the host (that needs no libcuda); the device-side check of the cubins was skipped")
        else:
            print(f"device: {gpu.name} ({gpu.arch}); entries built for another arch are not loaded")
        print(f"load check: {counts['loaded']} loaded, {counts['skipped']} skipped, {counts['failed']} failed")
    shown = [r for r in results if r["status"] != "ok" or r.get("load") == "skipped"]
    if shown:
        rows = [
            (
                "SKIP" if r["status"] == "ok" else r["status"].upper(),
                r["digest"][:12],
                r["namespace"],
                (r.get("reason") or r.get("load_detail", "")) + ("  [quarantined]" if r.get("quarantined") else ""),
            )
            for r in shown
        ]
        print()
        print(table(("", "digest", "namespace", "problem"), rows))
    if counts["incomplete"]:
        print("\nincomplete: a directory without a manifest (a writer at work, or one that died); never served")
    if counts["bad"] and not args.quarantine:
        print("\nbad entries are misses; 'cute-diskcache verify --quarantine' moves them aside")
    return 1 if counts["bad"] else 0


def register(add: Add) -> None:
    p = add("list", cmd_list, "one line per entry")
    p.add_argument("--namespace", action="append", help="only this namespace (a prefix is enough; repeatable)")
    p.add_argument("--sort", choices=sorted(_SORTS), help="largest / newest / most recently used first")
    p.add_argument("--key-width", type=int, default=None, help=f"characters of the key shown (default: what fits in {LIST_WIDTH} columns)")
    p = add("show", cmd_show, "one entry's manifest; --mlir / --cubin FILE for its payloads")
    p.add_argument("digest", help="the entry's digest; a unique prefix is enough")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--mlir", action="store_true", help="print the kernel's MLIR")
    g.add_argument("--cubin", metavar="FILE", help="write a cubin to FILE (for cuobjdump / nvdisasm)")
    p.add_argument("--index", type=int, default=0, help="which cubin (or MLIR) payload, default 0")
    p = add("verify", cmd_verify, "check every entry's checksums; exit 1 if any is bad")
    p.add_argument("--device", action="store_true", help="also load every object (and its cubins on the GPU present)")
    p.add_argument("--quarantine", action="store_true", help="move bad entries to <root>/quarantine")
    p.add_argument("--namespace", action="append", help="only this namespace (a prefix is enough; repeatable)")
