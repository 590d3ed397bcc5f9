"""``prune``, ``evict`` and ``clear``: taking things out of the root."""

from __future__ import annotations

import argparse

from ..storage import eviction, housekeeping, layout, staleness
from .common import Add, counting, refuse_if_readonly, root_of, size_arg
from .output import fmt_size, fmt_time, print_json, table


def cmd_prune(args: argparse.Namespace) -> int:
    refuse_if_readonly(args)
    root, _ = root_of(args)
    report = staleness.prune(root, arch=args.arch, older_than=args.older_than, recent=args.recent, dry_run=args.dry_run)
    out = {"root": str(root), "dry_run": args.dry_run, **report}
    if args.json:
        print_json(out)
        return 0
    verb = "would remove" if args.dry_run else "removed"
    if report["namespaces"]:
        rows = [(n["namespace"], n["entries"], fmt_size(n["bytes"]), n["reason"]) for n in report["namespaces"]]
        print(table(("stale namespace", "entries", "size", "why"), rows, right=(1, 2)))
    for k in report["kept_recent"]:
        print(f"kept {k['namespace']}: {k['reason']}, but used {fmt_time(k['last_used'])} (within --recent {args.recent_text})")
    if args.older_than is not None:
        old = report["old_entries"]
        print(f"{len(old)} entries unused for longer than {args.older_than_text} ({fmt_size(sum(o['bytes'] for o in old))})")
    locks = report["lock_files_removed"]
    print(f"{verb} {out['entries_removed']} entries ({fmt_size(out['bytes_removed'])}) from {root}" + (f"; {locks} idle lock files" if locks else ""))
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    refuse_if_readonly(args)
    root, _ = root_of(args)
    before = eviction.usage(root)
    goal = args.max_size if args.max_size is not None else eviction.max_size()
    with counting(root):
        removed = eviction.evict(root, goal, dry_run=args.dry_run)
    after = eviction.usage(root)
    if args.dry_run:  # nothing moved: say what the cache would hold
        after["bytes"] -= sum(layout.entry_bytes(p) for p in removed)
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
        print_json(out)
    else:
        verb = "would evict" if args.dry_run else "evicted"
        print(
            f"{verb} {len(removed)} least recently used entries; cache {fmt_size(before['bytes'])} -> "
            f"{fmt_size(after['bytes'])} (limit {fmt_size(goal)}, {after['entries']} entries left)"
        )
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    refuse_if_readonly(args)
    root, _ = root_of(args)
    removed, dirs = housekeeping.clear(root)
    if args.json:
        print_json({"root": str(root), "entries_removed": removed, "dirs_removed": dirs})
    elif not root.exists():
        print(f"nothing to clear: {root} does not exist")
    else:
        print(f"cleared {root} ({removed} entries; removed {', '.join(dirs) or 'nothing'})")
    return 0


def register(add: Add) -> None:
    p = add("prune", cmd_prune, "remove namespaces of another flashinfer, DSL stack, machine (or --arch) and old entries")
    p.add_argument("--arch", help="also remove namespaces built for any other arch (e.g. sm_120a)")
    p.add_argument("--older-than", dest="older_than_text", metavar="AGE", help="also remove entries unused for AGE (30d, 12h, 90m)")
    p.add_argument("--recent", dest="recent_text", metavar="AGE", default="1d",
                   help="keep a stale-looking namespace used within AGE: another venv or host may share this root (default 1d; 0: off)")
    p.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    p = add("evict", cmd_evict, "evict least recently used entries until the cache fits --max-size")
    p.add_argument("--max-size", type=size_arg, default=None, metavar="SIZE", help="e.g. 2G, 500M, 10GiB (default: CUTE_DISKCACHE_MAX_SIZE)")
    p.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    add("clear", cmd_clear, "delete every entry, the quarantine, locks and statistics under the root")
