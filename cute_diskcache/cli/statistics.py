"""``stats`` and ``zero``: ccache's ``-s`` and ``-z``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .. import config
from ..storage import eviction
from . import inventory
from .common import Add, CliError, refuse_if_readonly, root_of
from .output import fmt_count, fmt_s, fmt_size, pairs, print_json, table

_NS_COLUMNS = (
    ("hits", "hits", fmt_count),
    ("misses", "misses", fmt_count),
    ("compiles", "compiles", fmt_count),
    ("prewarm_compiles", "prewarmed", fmt_count),
    ("saved_seconds", "saved", lambda v: f"{v:.1f} s"),
    ("errors", "errors", fmt_count),
    ("quarantined", "quarantined", fmt_count),
    ("evictions", "cleanups", fmt_count),
    ("entries", "entries", fmt_count),
    ("bytes", "size", fmt_size),
)


def remote_label() -> str | None:
    """The configured remote, password hidden (None when there is none)."""
    settings = config.load()
    if not settings.remote:
        return None
    from ..remote import redact

    return redact(settings.remote) + ("  (read-only)" if settings.remote_readonly else "")


def _remote_rows(t: dict[str, float]) -> list[tuple[str, str]]:
    """The remote tier's lines: only when a remote is configured or has counted anything."""
    label = remote_label()
    fields = ("remote_hits", "remote_misses", "remote_errors", "remote_skipped", "remote_bytes_in", "remote_bytes_out", "published", "publish_dropped")
    if label is None and not any(t.get(f) for f in fields):
        return []
    g = lambda f: t.get(f, 0.0)  # noqa: E731 - a one-line getter, read where it is used
    asked = g("remote_hits") + g("remote_misses") + g("remote_errors")
    per = f", {fmt_s(g('remote_seconds') / asked)} per fetch" if asked else ""
    return [
        ("remote", label or "(not configured now)"),
        ("remote hits", f"{g('remote_hits'):.0f}  (of the hits; {g('remote_misses'):.0f} remote misses, {g('remote_errors'):.0f} errors, "
                        f"{g('remote_skipped'):.0f} skipped while the remote was failing)"),
        ("remote traffic", f"{fmt_size(g('remote_bytes_in'))} in, {fmt_size(g('remote_bytes_out'))} out; "
                           f"{g('remote_seconds'):.2f} s on the request path{per}"),
        ("published", f"{g('published'):.0f}  ({g('publish_dropped'):.0f} dropped)"),
    ]


def cmd_stats(args: argparse.Namespace) -> int:
    root, source = root_of(args)
    data = inventory.collect_stats(root)
    cap = eviction.max_size()
    out: dict[str, Any] = {"root": str(root), "root_source": source, "max_size": cap, "trust_refusal": inventory.trust_note(root),
                           "remote": remote_label(), **data}
    if args.format == "prometheus":
        if args.json:
            raise CliError("--json and --format prometheus are two output formats: give one")
        from . import prometheus

        sys.stdout.write(prometheus.render(str(root), data, max_size=cap, trust_refusal=out["trust_refusal"]))
        return 0
    if args.json:
        print_json(out)
        return 0
    t = data["total"]
    lookups = t["hits"] + t["misses"]
    rate = f"  ({100 * t['hits'] / lookups:.1f}% of {lookups:.0f} lookups)" if lookups else ""
    size = f"{fmt_size(t['cache_bytes'])} / {fmt_size(cap) if cap > 0 else 'no limit'}"
    if cap > 0:
        size += f"  ({100 * t['cache_bytes'] / cap:.1f}%)"
    o = data["overhead"]
    held = (f"entries {fmt_size(t['bytes'])}; quarantine {o['quarantine']['items']} ({fmt_size(o['quarantine']['bytes'])}), "
            f"staging {o['tmp']['items']} ({fmt_size(o['tmp']['bytes'])}), trash {o['trash']['items']} ({fmt_size(o['trash']['bytes'])}), "
            f"statistics files {o['stats']['items']} ({fmt_size(o['stats']['bytes'])}), lock files {o['locks']['items']}")
    rows = [
        ("cache root", f"{root}  ({source})"),
        ("hits", f"{t['hits']:.0f}{rate}"),
        ("misses", f"{t['misses']:.0f}"),
        ("compiles", f"{t['compiles']:.0f}  ({t['compile_seconds']:.1f} s compiling)"),
        ("prewarm", f"{t.get('prewarm_compiles', 0.0):.0f} compiled ({t.get('prewarm_compile_seconds', 0.0):.1f} s), "
                    f"{t.get('prewarm_hits', 0.0):.0f} found cached  (not in the hits, misses and compiles above: those are serving's)"),
        ("reused", f"{t.get('reused', 0.0):.0f} from an entry with the same traced IR (another release's, or another key's) "
                   f"({t.get('reuse_seconds', 0.0):.2f} s; prewarm {t.get('prewarm_reused', 0.0):.0f}); "
                   f"{t.get('traces', 0.0):.0f} misses traced ({t.get('trace_seconds', 0.0):.1f} s)"),
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


def cmd_zero(args: argparse.Namespace) -> int:
    from ..storage import stats

    refuse_if_readonly(args)
    root, _ = root_of(args)
    stats.zero(root)
    if args.json:
        print_json({"root": str(root), "zeroed": True})
    else:
        print(f"statistics zeroed under {root}")
    return 0


def register(add: Add) -> None:
    p = add("stats", cmd_stats, "hits, misses, compile time saved, size / max size, per namespace")
    p.add_argument("--format", choices=("text", "prometheus"), default="text",
                   help="prometheus: the text exposition format, for node_exporter's textfile collector "
                        "(write to a temporary name, then rename to *.prom)")
    add("zero", cmd_zero, "zero the statistics (entries stay)")
