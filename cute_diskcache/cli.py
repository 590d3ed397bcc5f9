"""``cute-diskcache`` / ``python -m cute_diskcache``: the operator's view of the cache.

Subcommands, ccache style (every one takes ``--json``):

  stats                 hits, misses, compile time saved, size / max size, per namespace
  zero                  zero the statistics
  list                  one line per entry (``--namespace``, ``--sort size|created|used``)
  show DIGEST           one entry's manifest (``--mlir``, ``--cubin FILE`` for cuobjdump)
  verify                every checksum (``--device``: load every object; ``--quarantine``)
  prune                 drop namespaces of another flashinfer, DSL, machine or arch; ``--older-than``
  evict                 least-recently-used entries out until under ``--max-size``
  clear                 delete everything under the root
  export / import       one bundle file of verified entries, to bake into images;
                        ``--to-remote`` / ``--from-remote``: the same with the remote tier
  info / demo           where the cache is / cold vs warm engine start (no GPU needed)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.metadata
import json
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from . import config

#: Qwen3-30B-A3B's MoE layer, one GPU: 128 experts, top-8, hidden 2048, moe_intermediate 768.
DEMO_SHAPE = "128,8,2048,768"
#: One m per kernel kind on flashinfer 0.6.15: 1 -> micro, 16 -> static, 128 -> dynamic.
DEMO_MS = (1, 16, 128)
#: What ``clear`` removes: entries, quarantine, locks, statistics, eviction and import scratch.
ROOT_DIRS = ("v1", "quarantine", "locks", "stats", "trash", "tmp")


class CliError(Exception):
    """A refusal the user can fix (unknown digest, read-only mode): one line, exit status 2."""


# --------------------------------------------------------------------------------------------
# Output helpers
# --------------------------------------------------------------------------------------------


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _fmt_size(n: float) -> str:
    from .eviction import format_size

    return format_size(n)


def _fmt_time(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


def _fmt_count(v: float) -> str:
    return f"{v:.0f}"


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell; numbers (the ``right`` columns) flush right."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def one_line(text: str, width: int = 240) -> str:
    """An exception's text for a table cell: no colour codes, no newlines, bounded."""
    return _shorten(" ".join(_ANSI.sub("", text).split()), width)


def pairs(rows: Sequence[tuple[str, str]]) -> str:
    """ccache's ``-s`` layout: a label column, then the value."""
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v}" for k, v in rows)


def _jsonable(value: Any) -> Any:
    """Manifests hold bytes: JSON shows them as length and hex."""
    if isinstance(value, (bytes, bytearray)):
        return {"len": len(value), "hex": bytes(value).hex()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _print_json(data: Any) -> None:
    print(json.dumps(_jsonable(data), indent=2, sort_keys=False, default=str))


def _root(args: argparse.Namespace) -> tuple[Path, str]:
    if getattr(args, "root", None):
        return Path(args.root).expanduser(), "--root"
    return config.resolve_root()


def _writable_or_refuse(args: argparse.Namespace) -> None:
    if config.env_flag("CUTE_DISKCACHE_READONLY"):
        raise CliError(f"CUTE_DISKCACHE_READONLY is set: '{args.cmd}' would modify the cache; unset it to proceed")


@contextlib.contextmanager
def _counting(root: Path) -> Iterator[None]:
    """Let what a command does (evictions, quarantines) count in the root's statistics."""
    from . import stats

    previous = stats.describe()["root"]
    stats.bind(root)
    try:
        yield
    finally:
        stats.flush()
        stats.bind(Path(previous) if previous else None)


# --------------------------------------------------------------------------------------------
# demo / info / clear
# --------------------------------------------------------------------------------------------


def _probe(root: Path, target: str, ms: list[int], shape: str) -> dict[str, Any]:
    from . import _probe as probe

    try:
        return probe.run(root, ms, target=target, shape=shape)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None


def cmd_demo(args: argparse.Namespace) -> int:
    """Two fresh processes on one empty cache root: the first compiles, the second loads."""
    from importlib.metadata import version

    from .prewarm import target_refusal

    refusal = target_refusal(args.target)
    if refusal is not None:
        raise CliError(refusal)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="cute-diskcache-demo-"))
    say = (lambda *a, **k: None) if args.json else print
    try:
        say(
            f"flashinfer {version('flashinfer-python')}, nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}, "
            f"target profile {args.target}, MoE shape E,top_k,hidden,inter = {args.shape}"
        )
        say(f"cache root: {root}")
        say("cold start (empty cache) ...", flush=True)
        cold = _probe(root, args.target, args.m, args.shape)
        say("warm start (fresh process, same cache) ...", flush=True)
        warm = _probe(root, args.target, args.m, args.shape)
        rows = []
        for (site, _d, kind_c, t_cold, *_), (_s, _d2, kind_w, t_warm, *_) in zip(cold["events"], warm["events"]):
            rows.append((site.rsplit(".", 1)[-1], kind_c, t_cold, kind_w, t_warm))
        ok = warm["counters"]["compiles"] == 0 and all(
            a["launch_error"] == b["launch_error"] for a, b in zip(cold["records"], warm["records"])
        )
        if args.json:
            _print_json(
                {
                    "root": str(root),
                    "kernels": [{"kernel": k, "cold": kc, "cold_seconds": tc, "warm": kw, "warm_seconds": tw} for k, kc, tc, kw, tw in rows],
                    "cold_counters": cold["counters"],
                    "warm_counters": warm["counters"],
                    "same_abi": ok,
                }
            )
            return 0 if ok else 1
        print()
        print(f"{'kernel':<10}{'cold (compile)':>16}{'warm (disk hit)':>18}{'speedup':>10}")
        for kind, _kc, t_cold, kind_w, t_warm in rows:
            tag = "" if kind_w == "hit" else f"  ({kind_w}!)"
            print(f"{kind:<10}{_fmt_s(t_cold):>16}{_fmt_s(t_warm):>18}{t_cold / t_warm:>9.0f}x{tag}")
        tc = sum(r[2] for r in rows)
        tw = sum(r[4] for r in rows)
        print(f"{'total':<10}{_fmt_s(tc):>16}{_fmt_s(tw):>18}{tc / tw if tw else 0:>9.0f}x")
        print(
            f"\nwarm process: {warm['counters']['compiles']} compiles, {warm['counters']['hits']} disk hits; "
            f"cold process: {cold['counters']['compiles']} compiles, {cold['counters']['writes']} entries written"
        )
        print("same kernel ABI cold and warm: " + ("yes" if ok else "NO"))
        return 0 if ok else 1
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def cmd_info(args: argparse.Namespace) -> int:
    s = config.load()
    root, source = _root(args)
    info: dict[str, Any] = {
        "root": str(root),
        "root_source": source,
        "enabled": s.enabled,
        "target": s.target,
        "readonly": s.readonly,
        "max_size": os.environ.get("CUTE_DISKCACHE_MAX_SIZE", "default"),
        "single_flight": s.single_flight,
        "trust_shared": s.trust_shared,
        "signing": "on (CUTE_DISKCACHE_HMAC_KEY set)" if s.hmac_key else "off",
    }
    try:
        from .key import codegen_env, dsl_stack_string

        info["dsl"] = dsl_stack_string()
        info["codegen_env"] = codegen_env()
    except Exception as exc:  # info must work even with a broken DSL install
        info["dsl"] = f"unavailable: {exc}"
    if args.json:
        _print_json(info)
    else:
        for k, v in info.items():
            print(f"{k:<12} {v}")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    _writable_or_refuse(args)
    root, _ = _root(args)
    removed = 0
    dirs = []
    if root.exists():
        for name in ROOT_DIRS:
            p = root / name
            if os.path.lexists(p):
                if name == "v1":
                    removed += sum(1 for _ in p.rglob("manifest.msgpack"))
                dirs.append(name)
                if p.is_symlink() or not p.is_dir():
                    p.unlink()
                else:
                    shutil.rmtree(p)
    if args.json:
        _print_json({"root": str(root), "entries_removed": removed, "dirs_removed": dirs})
    elif not root.exists():
        print(f"nothing to clear: {root} does not exist")
    else:
        print(f"cleared {root} ({removed} entries; removed {', '.join(dirs) or 'nothing'})")
    return 0


# --------------------------------------------------------------------------------------------
# stats / zero
# --------------------------------------------------------------------------------------------

_NS_COLUMNS = (
    ("hits", "hits", _fmt_count),
    ("misses", "misses", _fmt_count),
    ("compiles", "compiles", _fmt_count),
    ("saved_seconds", "saved", lambda v: f"{v:.1f} s"),
    ("errors", "errors", _fmt_count),
    ("quarantined", "quarantined", _fmt_count),
    ("evictions", "cleanups", _fmt_count),
    ("entries", "entries", _fmt_count),
    ("bytes", "size", _fmt_size),
)


def _trust_note(root: Path) -> str | None:
    """Why a serving process would refuse this root (it then compiles everything), or None."""
    if config.env_flag("CUTE_DISKCACHE_TRUST_SHARED"):
        return None
    try:
        from . import trust

        return trust.root_refusal(root)
    except Exception:  # the check is advice here; stats must print regardless
        return None


def collect_stats(root: Path) -> dict[str, Any]:
    from . import eviction, stats

    # Fold the files of finished processes into one as we read (ccache does the same), unless
    # this is a read-only view: the sum is the same either way.
    compact = not config.env_flag("CUTE_DISKCACHE_READONLY") and os.access(root / "stats", os.W_OK)
    per_ns = stats.aggregate(root, compact=compact)
    use = eviction.usage(root)
    names = sorted(set(per_ns) | set(use["namespaces"]))
    namespaces: dict[str, dict[str, float]] = {}
    for ns in names:
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


def cmd_stats(args: argparse.Namespace) -> int:
    from . import eviction

    root, source = _root(args)
    data = collect_stats(root)
    cap = eviction.max_size()
    out = {"root": str(root), "root_source": source, "max_size": cap, "trust_refusal": _trust_note(root), "remote": _remote_label(), **data}
    if args.json:
        _print_json(out)
        return 0
    t = data["total"]
    lookups = t["hits"] + t["misses"]
    rate = f"  ({100 * t['hits'] / lookups:.1f}% of {lookups:.0f} lookups)" if lookups else ""
    size = f"{_fmt_size(t['cache_bytes'])} / {_fmt_size(cap) if cap > 0 else 'no limit'}"
    if cap > 0:
        size += f"  ({100 * t['cache_bytes'] / cap:.1f}%)"
    o = data["overhead"]
    held = (f"entries {_fmt_size(t['bytes'])}; quarantine {o['quarantine']['items']} ({_fmt_size(o['quarantine']['bytes'])}), "
            f"staging {o['tmp']['items']} ({_fmt_size(o['tmp']['bytes'])}), trash {o['trash']['items']} ({_fmt_size(o['trash']['bytes'])}), "
            f"statistics files {o['stats']['items']} ({_fmt_size(o['stats']['bytes'])}), lock files {o['locks']['items']}")
    rows = [
        ("cache root", f"{root}  ({source})"),
        ("hits", f"{t['hits']:.0f}{rate}"),
        ("misses", f"{t['misses']:.0f}"),
        ("compiles", f"{t['compiles']:.0f}  ({t['compile_seconds']:.1f} s compiling)"),
        ("compile time saved", f"{t['saved_seconds']:.1f} s  (loads took {t['load_seconds']:.2f} s)"),
        ("errors", f"{t['errors']:.0f}"),
        ("quarantined", f"{t['quarantined']:.0f}"),
        ("entries", f"{t['entries']:.0f}"),
        ("cache size", size),
        ("of which", held),
        ("cleanups", f"{t['evictions']:.0f}  (entries evicted to stay under the size limit)"),
    ]
    rows += _remote_rows(t)
    print(pairs(rows))
    if out["trust_refusal"]:
        print(f"WARNING: serving processes refuse this root: {out['trust_refusal']} (CUTE_DISKCACHE_TRUST_SHARED=1 overrides)")
    if data["namespaces"]:
        print()
        ns_rows = [[ns] + [fmt(rec.get(f, 0.0)) for f, _h, fmt in _NS_COLUMNS] for ns, rec in data["namespaces"].items()]
        print(table(["namespace"] + [h for _f, h, _fmt in _NS_COLUMNS], ns_rows, right=range(1, len(_NS_COLUMNS) + 1)))
    return 0


def _remote_label() -> str | None:
    """The configured remote, password hidden (None when there is none)."""
    settings = config.load()
    if not settings.remote:
        return None
    from .remote import redact

    return redact(settings.remote) + ("  (read-only)" if settings.remote_readonly else "")


def _remote_rows(t: dict[str, float]) -> list[tuple[str, str]]:
    """The remote tier's lines: only when a remote is configured or has counted anything."""
    label = _remote_label()
    fields = ("remote_hits", "remote_misses", "remote_errors", "remote_skipped", "remote_bytes_in", "remote_bytes_out", "published", "publish_dropped")
    if label is None and not any(t.get(f) for f in fields):
        return []
    g = lambda f: t.get(f, 0.0)  # noqa: E731
    asked = g("remote_hits") + g("remote_misses") + g("remote_errors")
    per = f", {_fmt_s(g('remote_seconds') / asked)} per fetch" if asked else ""
    return [
        ("remote", label or "(not configured now)"),
        ("remote hits", f"{g('remote_hits'):.0f}  (of the hits; {g('remote_misses'):.0f} remote misses, {g('remote_errors'):.0f} errors, "
                        f"{g('remote_skipped'):.0f} skipped while the remote was failing)"),
        ("remote traffic", f"{_fmt_size(g('remote_bytes_in'))} in, {_fmt_size(g('remote_bytes_out'))} out; "
                           f"{g('remote_seconds'):.2f} s on the request path{per}"),
        ("published", f"{g('published'):.0f}  ({g('publish_dropped'):.0f} dropped)"),
    ]


def cmd_zero(args: argparse.Namespace) -> int:
    from . import stats

    _writable_or_refuse(args)
    root, _ = _root(args)
    stats.zero(root)
    if args.json:
        _print_json({"root": str(root), "zeroed": True})
    else:
        print(f"statistics zeroed under {root}")
    return 0


# --------------------------------------------------------------------------------------------
# list / show
# --------------------------------------------------------------------------------------------


def _describe_entry(d: Path) -> dict[str, Any]:
    """One ``list`` row from the manifest alone (no payload reads: listing stays fast)."""
    from . import bundle, entry

    row: dict[str, Any] = {
        "digest": d.name,
        "namespace": d.parent.parent.name,
        "bytes": bundle.entry_bytes(d),
        "last_used": bundle.last_used(d),
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


_SORTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "size": lambda r: -r["bytes"],
    "created": lambda r: -r["created"],
    "used": lambda r: -r["last_used"],
}


def cmd_list(args: argparse.Namespace) -> int:
    from . import bundle

    root, _ = _root(args)
    rows = [_describe_entry(d) for d in bundle.entry_dirs(root, args.namespace)]
    if args.sort:
        rows.sort(key=_SORTS[args.sort])
    if args.json:
        _print_json({"root": str(root), "entries": rows})
        return 0
    if not rows:
        print(f"no entries under {root}")
        return 0
    lines = [
        (
            r["digest"][:12],
            r["namespace"],
            r["kind"],
            _shorten(r["key"], args.key_width) if r["status"] == "ok" else f"[{_shorten(r['status'], args.key_width - 2)}]",
            _fmt_size(r["bytes"]),
            _fmt_time(r["created"]),
            _fmt_time(r["last_used"]),
            f"{r['compile_seconds']:.2f} s",
        )
        for r in rows
    ]
    print(table(("digest", "namespace", "kind", "key", "size", "created", "used", "compile"), lines, right=(4, 7)))
    total = sum(r["bytes"] for r in rows)
    print(f"\n{len(rows)} entries, {_fmt_size(total)}")
    return 0


def find_entry(root: Path, prefix: str) -> Path:
    """The one entry whose digest starts with ``prefix`` (any namespace)."""
    from . import bundle

    prefix = prefix.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{1,64}", prefix):
        raise CliError(f"{prefix!r} is not a digest or digest prefix (hex)")
    found = [d for d in bundle.entry_dirs(root) if d.name.startswith(prefix)]
    if not found:
        raise CliError(f"no entry with digest {prefix}... under {root}")
    if len(found) > 1:
        names = ", ".join(f"{d.name[:16]} ({d.parent.parent.name})" for d in found[:8])
        raise CliError(f"digest prefix {prefix} is ambiguous: {names}{' ...' if len(found) > 8 else ''}")
    return found[0]


def _checked_payload(d: Path, manifest: dict[str, Any], role: str, index: int) -> bytes:
    """One payload's bytes, only if they still match the manifest's checksum."""
    import hashlib

    from . import entry

    items = manifest["payloads"].get(role, [])
    if not items:
        raise CliError(f"entry {d.name[:12]} has no {role} payload")
    if not 0 <= index < len(items):
        raise CliError(f"entry {d.name[:12]} has {len(items)} {role} payload(s); --index {index} is out of range")
    item = items[index]
    try:
        data = entry._read_payload(d / item["file"], item["size"])  # bounded, never through a link
    except entry.EntryError as exc:
        raise CliError(f"{role} payload: {exc}") from None
    if hashlib.sha256(data).hexdigest() != item["sha256"]:
        raise CliError(f"{role} payload {item['file']} does not match its sha256 (run 'cute-diskcache verify')")
    return data


def _pretty(value: Any, indent: int = 0) -> list[str]:
    """Manifest fields as aligned ``name  value`` lines; bytes as length + hex, times readable."""
    pad = " " * indent
    lines: list[str] = []
    width = max((len(str(k)) for k in value), default=0) + 2
    for k, v in value.items():
        label = f"{pad}{str(k):<{width}}"
        if isinstance(v, (bytes, bytearray)):
            hexed = bytes(v).hex()
            lines.append(f"{label}<{len(v)} bytes> {_shorten(hexed, 72)}")
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
    from . import bundle, entry

    root, _ = _root(args)
    d = find_entry(root, args.digest)
    try:
        manifest = entry.read_manifest(d)
    except entry.EntryError as exc:
        raise CliError(f"entry {d.name[:12]} has no readable manifest: {exc}") from None
    if args.mlir:
        raw = _checked_payload(d, manifest, "mlir", args.index)
        text = entry.mlir_text(raw, manifest["payloads"]["mlir"][args.index]["file"])
        if args.json:
            _print_json({"digest": d.name, "mlir": text})
        else:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return 0
    if args.cubin:
        data = _checked_payload(d, manifest, "cubin", args.index)
        out = Path(args.cubin)
        out.write_bytes(data)
        n = len(manifest["payloads"]["cubin"])
        info = {"digest": d.name, "cubin": str(out), "index": args.index, "of": n, "bytes": len(data), "arch": manifest["env"].get("arch")}
        if args.json:
            _print_json(info)
        else:
            print(f"wrote cubin {args.index} of {n} ({len(data)} bytes, {info['arch']}) to {out}; inspect with: cuobjdump -sass {out}")
        return 0
    try:
        bundle.check(d, hmac_key=config.load().hmac_key)
        status = "ok (every payload checksum verified)"
    except entry.EntryError as exc:
        status = f"BAD {exc.reason}: {exc.detail}"
    if args.json:
        _print_json({"path": str(d), "status": status, "bytes": bundle.entry_bytes(d), "last_used": bundle.last_used(d), "manifest": manifest})
        return 0
    print("\n".join(_pretty({"path": str(d), "status": status, "size": _fmt_size(bundle.entry_bytes(d)), "last used": _fmt_time(bundle.last_used(d))})))
    print("\n".join(_pretty(manifest)))
    return 0


# --------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------


def _arch_number(arch: str) -> tuple[int, int, str] | None:
    m = re.fullmatch(r"sm_(\d+)(\d)([af]?)", arch or "")
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


class Gpu:
    """The first visible CUDA device, through the driver API (cuda-python ships with the DSL)."""

    def __init__(self, cu: Any, dev: Any, name: str, capability: tuple[int, int]) -> None:
        self._cu, self._dev = cu, dev
        self.name, self.capability = name, capability
        self._ctx: Any = None

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @classmethod
    def find(cls) -> "Gpu | None":
        try:
            from cuda.bindings import driver as cu

            (err,) = cu.cuInit(0)
            if err != cu.CUresult.CUDA_SUCCESS:
                return None
            err, count = cu.cuDeviceGetCount()
            if err != cu.CUresult.CUDA_SUCCESS or count < 1:
                return None
            err, dev = cu.cuDeviceGet(0)
            attr = cu.CUdevice_attribute
            _, major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
            _, minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
            _, raw = cu.cuDeviceGetName(256, dev)
            name = raw.split(b"\0", 1)[0].decode(errors="replace")
            return cls(cu, dev, name, (int(major), int(minor)))
        except Exception:  # no driver, no device, no cuda-python: no GPU to check on
            return None

    def load_cubin(self, cubin: bytes) -> None:
        """Hand one cubin to the driver, which checks its arch and image; raises on refusal."""
        cu = self._cu
        if self._ctx is None:
            err, self._ctx = cu.cuDevicePrimaryCtxRetain(self._dev)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuDevicePrimaryCtxRetain: {err}")
            (err,) = cu.cuCtxSetCurrent(self._ctx)
        err, module = cu.cuModuleLoadData(cubin)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"the driver refused the cubin: {err.name if hasattr(err, 'name') else err}")
        cu.cuModuleUnload(module)


def _device_check(d: Path, manifest: dict[str, Any], obj: bytes, gpu: Gpu | None) -> tuple[str, str]:
    """(outcome, detail) of loading one verified entry: "loaded", "skipped" or "failed"."""
    from . import entry

    arch = str(manifest["env"].get("arch", "?"))
    if gpu is not None and not arch_runs_on(arch, gpu.capability):
        return "skipped", f"built for {arch}; the device is {gpu.arch} ({gpu.name})"
    if gpu is not None:
        from . import devicefacts

        why = devicefacts.mismatch(manifest["device"])
        if why is not None:
            return "skipped", f"built against other device facts: {why}"
    try:
        kernel = entry.load(obj, manifest["symbol"], manifest["tvm_ffi"])
        if kernel is None:
            raise RuntimeError(f"symbol {manifest['symbol']} not found")
        if gpu is not None:
            for item in manifest["payloads"].get("cubin", []):
                gpu.load_cubin((d / item["file"]).read_bytes())
    except Exception as exc:
        return "failed", f"{type(exc).__name__}: {one_line(str(exc))}"
    return "loaded", "object and its cubins loaded on the device" if gpu is not None else "object loaded on the host (no GPU)"


def cmd_verify(args: argparse.Namespace) -> int:
    from . import bundle, entry
    from .store import Store

    root, _ = _root(args)
    if args.quarantine:
        _writable_or_refuse(args)
    settings = config.load()
    gpu = Gpu.find() if args.device else None
    results: list[dict[str, Any]] = []
    store = Store(root, trust_shared=settings.trust_shared, hmac_key=settings.hmac_key)
    with _counting(root) if args.quarantine else contextlib.nullcontext():
        for d in bundle.entry_dirs(root, args.namespace):
            res: dict[str, Any] = {"digest": d.name, "namespace": d.parent.parent.name, "status": "ok"}
            try:
                manifest, obj = bundle.check(d, hmac_key=settings.hmac_key)
            except entry.EntryError as exc:
                res.update(status="incomplete" if exc.reason == "absent" else "bad", reason=f"{exc.reason}: {exc.detail}")
                if res["status"] == "bad" and args.quarantine:
                    store.quarantine(d, exc)
                    res["quarantined"] = not os.path.lexists(d)
                results.append(res)
                continue
            if args.device:
                res["load"], res["load_detail"] = _device_check(d, manifest, obj, gpu)
                if res["load"] == "failed":
                    res.update(status="bad", reason=f"load: {res['load_detail']}")
                    if args.quarantine:
                        store.quarantine(d, entry.EntryError("load", res["load_detail"]))
                        res["quarantined"] = not os.path.lexists(d)
            results.append(res)
    counts = {s: sum(1 for r in results if r["status"] == s) for s in ("ok", "bad", "incomplete")}
    device = None
    if args.device:
        device = {"name": gpu.name, "arch": gpu.arch} if gpu else None
        counts.update({k: sum(1 for r in results if r.get("load") == k) for k in ("loaded", "skipped", "failed")})
    if args.json:
        _print_json({"root": str(root), "device": device, "counts": counts, "entries": results})
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


# --------------------------------------------------------------------------------------------
# prune / evict
# --------------------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "": 86400}


def parse_duration(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w``; a bare number is days (as ccache's ``--evict-older-than``)."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (examples: 30d, 12h, 90m)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def current_environment() -> dict[str, Any]:
    """What this install would key new entries on, as far as it is knowable without importing flashinfer."""
    from .key import dsl_stack

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


def staleness(env: dict[str, Any], manifest_format: int, current: dict[str, Any], arch: str | None) -> str | None:
    """Why a namespace with this environment record can never hit again here, or None.

    The source fingerprint and codegen variables are left out on purpose: they need the
    package imported, or the serving process's environment, to compare; a namespace that
    differs only there stays until ``--older-than`` or eviction takes it.
    """
    from .key import FORMAT_VERSION

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


def _namespace_env(root: Path, ns: str) -> tuple[dict[str, Any], int] | None:
    """The environment record of a namespace: every entry in it shares one; the first readable wins."""
    from . import bundle, entry

    for d in bundle.entry_dirs(root, [ns]):
        if d.parent.parent.name != ns:
            continue
        try:
            m = entry.read_manifest(d)
        except entry.EntryError:
            continue
        return m["env"], m["format"]
    return None


def cmd_prune(args: argparse.Namespace) -> int:
    from . import bundle, locking

    _writable_or_refuse(args)
    root, _ = _root(args)
    current = current_environment()
    gone_ns: list[dict[str, Any]] = []
    kept_recent: list[dict[str, Any]] = []
    for ns in bundle.namespaces(root):
        found = _namespace_env(root, ns)
        if found is None:
            continue  # nothing readable: 'verify' reports it, eviction ages it out
        why = staleness(found[0], found[1], current, args.arch)
        if why is None:
            continue
        dirs = list(bundle.entry_dirs(root, [ns]))
        dirs = [d for d in dirs if d.parent.parent.name == ns]
        used = max((bundle.last_used(d) for d in dirs), default=0.0)
        if args.recent and used > time.time() - args.recent:
            # Stale from here, but something used it lately: another venv or host sharing this
            # root (recency is marked at most hourly). Eviction or --recent 0 takes it later.
            kept_recent.append({"namespace": ns, "reason": why, "last_used": used})
            continue
        gone_ns.append({"namespace": ns, "reason": why, "entries": len(dirs), "bytes": sum(bundle.entry_bytes(d) for d in dirs)})
        if not args.dry_run:
            bundle.remove_tree(root, root / "v1" / ns)
    old: list[dict[str, Any]] = []
    if args.older_than is not None:
        cutoff = time.time() - args.older_than
        for d in bundle.entry_dirs(root):
            used = bundle.last_used(d)
            if used and used < cutoff:
                old.append({"digest": d.name, "namespace": d.parent.parent.name, "last_used": used, "bytes": bundle.entry_bytes(d)})
                if not args.dry_run:
                    bundle.remove_tree(root, d)
    locks = 0 if args.dry_run else locking.prune(root)  # lock files nobody holds: safe beside live processes
    out = {
        "root": str(root),
        "dry_run": args.dry_run,
        "current": current,
        "namespaces": gone_ns,
        "kept_recent": kept_recent,
        "old_entries": old,
        "entries_removed": sum(n["entries"] for n in gone_ns) + len(old),
        "bytes_removed": sum(n["bytes"] for n in gone_ns) + sum(o["bytes"] for o in old),
        "lock_files_removed": locks,
    }
    if args.json:
        _print_json(out)
        return 0
    verb = "would remove" if args.dry_run else "removed"
    if gone_ns:
        rows = [(n["namespace"], n["entries"], _fmt_size(n["bytes"]), n["reason"]) for n in gone_ns]
        print(table(("stale namespace", "entries", "size", "why"), rows, right=(1, 2)))
    for k in kept_recent:
        print(f"kept {k['namespace']}: {k['reason']}, but used {_fmt_time(k['last_used'])} (within --recent {args.recent_text})")
    if args.older_than is not None:
        print(f"{len(old)} entries unused for longer than {args.older_than_text} ({_fmt_size(sum(o['bytes'] for o in old))})")
    print(f"{verb} {out['entries_removed']} entries ({_fmt_size(out['bytes_removed'])}) from {root}" + (f"; {locks} idle lock files" if locks else ""))
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    from . import bundle, eviction

    _writable_or_refuse(args)
    root, _ = _root(args)
    before = eviction.usage(root)
    goal = args.max_size if args.max_size is not None else eviction.max_size()
    with _counting(root):
        removed = eviction.evict(root, goal, dry_run=args.dry_run)
    after = eviction.usage(root)
    if args.dry_run:  # nothing moved: say what the cache would hold
        after["bytes"] -= sum(bundle.entry_bytes(p) for p in removed)
        after["entries"] -= len(removed)
    out = {
        "root": str(root),
        "max_size": goal,
        "dry_run": args.dry_run,
        "evicted": [str(p) for p in removed],
        "bytes_before": before["bytes"],
        "bytes_after": after["bytes"],
        "entries_after": after["entries"],
    }
    if args.json:
        _print_json(out)
    else:
        verb = "would evict" if args.dry_run else "evicted"
        print(
            f"{verb} {len(removed)} least recently used entries; cache {_fmt_size(before['bytes'])} -> "
            f"{_fmt_size(after['bytes'])} (limit {_fmt_size(goal)}, {after['entries']} entries left)"
        )
    return 0


# --------------------------------------------------------------------------------------------
# export / import
# --------------------------------------------------------------------------------------------


def _remote_client(*, publishing: bool) -> Any:
    """The remote tier as configured for serving processes (``CUTE_DISKCACHE_REMOTE``...)."""
    settings = config.load()
    if not settings.remote:
        raise CliError("CUTE_DISKCACHE_REMOTE is not set (e.g. redis://cache-host:6379/0)")
    if publishing and settings.remote_readonly:
        raise CliError("CUTE_DISKCACHE_REMOTE_READONLY is set: this node does not publish to the remote")
    from . import remote

    why = remote.refusal(settings)
    if why is not None:
        raise CliError(f"the remote tier is off: {why}")
    note = remote.unsigned_warning(settings)
    if note:
        print(note, file=sys.stderr)
    from .remote.client import RemoteCache

    return RemoteCache.from_settings(settings)


def _bundle_or_remote(args: argparse.Namespace, flag: str) -> None:
    if bool(args.bundle) == bool(getattr(args, flag.replace("-", "_"))):
        raise CliError(f"give a bundle file or --{flag}, one of the two")


def _export_to_remote(args: argparse.Namespace) -> int:
    from .remote import RemoteError

    root, _ = _root(args)
    client = _remote_client(publishing=True)
    with _counting(root):
        try:
            report = client.push(root, args.namespace)
        except RemoteError as exc:
            raise CliError(f"{client.label}: {exc}") from None
    if args.json:
        _print_json(report)
        return 0
    print(f"pushed {report['pushed']} entries ({_fmt_size(report['bytes'])}) from {root} to {report['remote']}; {report['present']} were there already")
    for s in report["skipped"]:
        print(f"skipped bad entry {s['digest'][:12]} ({s['namespace']}): {s['reason']}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from . import bundle

    _bundle_or_remote(args, "to-remote")
    if args.to_remote:
        return _export_to_remote(args)
    root, _ = _root(args)
    report = bundle.export_bundle(root, Path(args.bundle), args.namespace, hmac_key=config.load().hmac_key)
    if args.json:
        _print_json(report.as_dict())
        return 0
    size = Path(args.bundle).stat().st_size
    print(f"exported {report.entries} entries ({_fmt_size(report.bytes)}, {_fmt_size(size)} compressed) from {root} to {args.bundle}")
    for ns, n in report.namespaces.items():
        print(f"  {n:>5}  {ns}")
    for s in report.skipped:
        print(f"skipped bad entry {s['digest'][:12]} ({s['namespace']}): {s['reason']}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from . import bundle, eviction

    _writable_or_refuse(args)
    _bundle_or_remote(args, "from-remote")
    root, _ = _root(args)
    settings = config.load()
    with _counting(root):
        try:
            if args.from_remote:
                report = _pull_from_remote(root, settings, args.namespace)
            else:
                report = bundle.import_bundle(root, Path(args.bundle), hmac_key=settings.hmac_key, trust_shared=settings.trust_shared)
        except bundle.BundleError as exc:
            raise CliError(str(exc)) from None
        evicted = eviction.enforce(root)
    out = report.as_dict()
    out["evicted"] = len(evicted)
    if args.json:
        _print_json(out)
        return 0 if report.ok else 1
    h = report.header
    created = h.get("created")
    when = _fmt_time(created) if isinstance(created, (int, float)) else "?"
    if args.from_remote:
        print(f"{h.get('remote')} (prefix {h.get('prefix')}): {h.get('entries', '?')} entries")
    else:
        print(f"bundle {args.bundle}: {h.get('entries', '?')} entries, written {when} by {h.get('writer', '?')} on {h.get('host', '?')}")
    print(
        f"into {root}: {len(report.imported)} imported, {len(report.kept)} kept (valid entry already there), "
        f"{len(report.replaced)} replaced a bad one, {len(report.busy)} busy, {len(report.bad)} bad, {len(report.rejected)} members refused"
    )
    if evicted:
        print(f"evicted {len(evicted)} least recently used entries to stay under {_fmt_size(eviction.max_size())}")
    for b in report.bad:
        print(f"BAD entry {b['digest'][:12]} ({b['namespace']}): {b['reason']}")
    for r in report.rejected:
        print(f"REFUSED member {r['member']}: {r['reason']}")
    return 0 if report.ok else 1


def _pull_from_remote(root: Path, settings: config.Settings, namespaces: Sequence[str] | None) -> Any:
    from .remote import RemoteError
    from .store import Store

    client = _remote_client(publishing=False)
    store = Store(root, trust_shared=settings.trust_shared, hmac_key=settings.hmac_key)
    if not store.can_write():
        raise CliError(f"cannot import into {root}: refused or not writable (-v says why)")
    try:
        return client.pull(store, namespaces)
    except RemoteError as exc:
        raise CliError(f"{client.label}: {exc}") from None


# --------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------


def _size_arg(text: str) -> int:
    from .eviction import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import doctor

    return doctor.main((["--json"] if args.json else []) + (["--strict"] if args.strict else []))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="cute-diskcache",
        description="The operator's view of the cute-diskcache: statistics, entries, checks, clean-up, bundles.",
        epilog="The root is $CUTE_DISKCACHE_DIR, else flashinfer's cache dir (see 'cute-diskcache info').",
    )
    ap.add_argument("--root", help="cache root to operate on (default: as the serving process resolves it)")
    ap.add_argument("-v", "--verbose", action="count", default=0, help="show the library's log lines (-vv: debug)")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(fn=fn)
        return p

    p = add("stats", cmd_stats, "hits, misses, compile time saved, size / max size, per namespace")
    p = add("zero", cmd_zero, "zero the statistics (entries stay)")
    p = add("list", cmd_list, "one line per entry")
    p.add_argument("--namespace", action="append", help="only this namespace (a prefix is enough; repeatable)")
    p.add_argument("--sort", choices=sorted(_SORTS), help="largest / newest / most recently used first")
    p.add_argument("--key-width", type=int, default=48, help="characters of the key shown (default 48)")
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
    p = add("prune", cmd_prune, "remove namespaces of another flashinfer, DSL stack, machine (or --arch) and old entries")
    p.add_argument("--arch", help="also remove namespaces built for any other arch (e.g. sm_120a)")
    p.add_argument("--older-than", dest="older_than_text", metavar="AGE", help="also remove entries unused for AGE (30d, 12h, 90m)")
    p.add_argument("--recent", dest="recent_text", metavar="AGE", default="1d",
                   help="keep a stale-looking namespace used within AGE: another venv or host may share this root (default 1d; 0: off)")
    p.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    p = add("evict", cmd_evict, "evict least recently used entries until the cache fits --max-size")
    p.add_argument("--max-size", type=_size_arg, default=None, metavar="SIZE", help="e.g. 2G, 500M, 10GiB (default: CUTE_DISKCACHE_MAX_SIZE)")
    p.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    p = add("clear", cmd_clear, "delete every entry, the quarantine, locks and statistics under the root")
    p = add("export", cmd_export, "write verified entries into one bundle file (tar.gz), or push them to the remote")
    p.add_argument("bundle", nargs="?", help="the bundle file to write")
    p.add_argument("--to-remote", action="store_true", help="instead: publish every verified entry the remote (CUTE_DISKCACHE_REMOTE) lacks")
    p.add_argument("--namespace", action="append", help="only this namespace (a prefix is enough; repeatable)")
    p = add("import", cmd_import, "verify a bundle's (or the remote's) entries and merge them in; never replaces a valid entry")
    p.add_argument("bundle", nargs="?", help="the bundle file to read")
    p.add_argument("--from-remote", action="store_true", help="instead: fetch every entry of the remote (CUTE_DISKCACHE_REMOTE), e.g. to warm a new node")
    p.add_argument("--namespace", action="append", help="with --from-remote: only this namespace (a prefix is enough; repeatable)")
    p = add("doctor", cmd_doctor, "every sm12x MoE compile site of the installed flashinfer and who persists it")
    p.add_argument("--strict", action="store_true", help="exit 1 if any site is persisted by nothing")
    p = add("info", cmd_info, "where the cache is and what it is keyed on")
    p = add("demo", cmd_demo, "cold vs warm engine start on a target profile (no GPU needed)")
    p.add_argument("--target", default="rtx-pro-6000")
    p.add_argument("--shape", default=DEMO_SHAPE, help="experts,top_k,hidden,intermediate")
    p.add_argument("--m", type=int, nargs="+", default=list(DEMO_MS))
    p.add_argument("--dir", default=None, help="cache root to use (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the temporary cache root")
    return ap


def _setup_logging(verbose: int) -> logging.Handler | None:
    """The commands report what they did themselves; the library's log lines (written for a
    serving process: "recompiling", "refuses root") show only with ``-v``."""
    logger = logging.getLogger("cute_diskcache")
    handler = None
    if verbose and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("cute-diskcache: %(levelname)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.ERROR)
    return handler


def _user_errors() -> tuple[type[BaseException], ...]:
    """Refusals of what the user asked for (a target profile that cannot be used): exit 2, one line."""
    from .targets import ProfileRefused, UnknownProfileError

    return (UnknownProfileError, ProfileRefused)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if getattr(args, "older_than_text", None) is not None:
        try:
            args.older_than = parse_duration(args.older_than_text)
        except argparse.ArgumentTypeError as exc:
            ap.error(str(exc))
    elif args.cmd == "prune":
        args.older_than = None
    if args.cmd == "prune":
        try:
            args.recent = parse_duration(args.recent_text)
        except argparse.ArgumentTypeError as exc:
            ap.error(str(exc))
    logger = logging.getLogger("cute_diskcache")
    level = logger.level
    handler = _setup_logging(args.verbose)  # undone below: main() also runs inside other programs and tests
    try:
        return int(args.fn(args))
    except (CliError, *_user_errors()) as exc:
        if getattr(args, "json", False):
            _print_json({"error": str(exc)})
        else:
            print(f"cute-diskcache {args.cmd}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `cute-diskcache list | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        logger.setLevel(level)
        if handler is not None:
            logger.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
