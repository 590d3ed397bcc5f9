"""``export`` and ``import``: entries in and out of the root, as a bundle file or through the remote tier."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from ..storage import bundle, eviction
from .. import config, remote
from ..storage.store import Store
from .common import Add, CliError, counting, refuse_if_readonly, root_of
from .output import fmt_size, fmt_time, print_json


def _remote_client(*, publishing: bool) -> Any:
    settings = config.load()
    try:
        client = remote.open_client(settings, publishing=publishing)
    except remote.RemoteError as exc:
        raise CliError(str(exc)) from None
    note = remote.unsigned_warning(settings)
    if note:
        print(note, file=sys.stderr)
    return client


def _bundle_or_remote(args: argparse.Namespace, flag: str) -> None:
    if bool(args.bundle) == bool(getattr(args, flag.replace("-", "_"))):
        raise CliError(f"give a bundle file or --{flag}, one of the two")


def _export_to_remote(args: argparse.Namespace) -> int:
    root, _ = root_of(args)
    client = _remote_client(publishing=True)
    with counting(root):
        try:
            report = client.push(root, args.namespace)
        except remote.RemoteError as exc:
            raise CliError(f"{client.label}: {exc}") from None
    if args.json:
        print_json(report)
        return 0
    print(f"pushed {report['pushed']} entries ({fmt_size(report['bytes'])}) and {report['records']} second-stage records "
          f"from {root} to {report['remote']}; {report['present']} entries were there already")
    for s in report["skipped"]:
        print(f"skipped bad entry {s['digest'][:12]} ({s['namespace']}): {s['reason']}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    _bundle_or_remote(args, "to-remote")
    if args.to_remote:
        return _export_to_remote(args)
    root, _ = root_of(args)
    report = bundle.export_bundle(root, Path(args.bundle), args.namespace, hmac_key=config.load().hmac_key)
    if args.json:
        print_json(report.as_dict())
        return 0
    size = Path(args.bundle).stat().st_size
    print(f"exported {report.entries} entries ({fmt_size(report.bytes)}, {fmt_size(size)} compressed) from {root} to {args.bundle}")
    for ns, n in report.namespaces.items():
        print(f"  {n:>5}  {ns}")
    for s in report.skipped:
        print(f"skipped bad entry {s['digest'][:12]} ({s['namespace']}): {s['reason']}")
    return 0


def _pull_from_remote(root: Path, settings: config.Settings, namespaces: Sequence[str] | None) -> Any:
    client = _remote_client(publishing=False)
    store = Store.for_settings(settings, root, layers=False)
    if not store.probe_writable():
        raise CliError(f"cannot import into {root}: refused or not writable (-v says why)")
    try:
        return client.pull(store, namespaces)
    except remote.RemoteError as exc:
        raise CliError(f"{client.label}: {exc}") from None


def cmd_import(args: argparse.Namespace) -> int:
    refuse_if_readonly(args)
    _bundle_or_remote(args, "from-remote")
    root, _ = root_of(args)
    settings = config.load()
    with counting(root):
        try:
            if args.from_remote:
                report = _pull_from_remote(root, settings, args.namespace)
            else:
                report = bundle.import_bundle(root, Path(args.bundle), hmac_key=settings.hmac_key, trust_shared=settings.trust_shared,
                                              trust_group=settings.trust_group)
        except bundle.BundleError as exc:
            raise CliError(str(exc)) from None
        evicted = eviction.enforce(root)
    out = report.as_dict()
    out["evicted"] = len(evicted)
    foreign = _not_for_this_install(root, report.header)
    out["not_for_this_install"] = foreign
    if args.json:
        print_json(out)
        return 0 if report.ok else 1
    h = report.header
    created = h.get("created")
    when = fmt_time(created) if isinstance(created, (int, float)) else "?"
    if args.from_remote:
        print(f"{h.get('remote')} (prefix {h.get('prefix')}): {h.get('entries', '?')} entries")
    else:
        print(f"bundle {args.bundle}: {h.get('entries', '?')} entries, written {when} by {h.get('writer', '?')} on {h.get('host', '?')}")
    print(
        f"into {root}: {len(report.imported)} imported, {len(report.kept)} kept (valid entry already there), "
        f"{len(report.replaced)} replaced a bad one, {len(report.busy)} busy, {len(report.bad)} bad, {len(report.rejected)} members refused"
    )
    if evicted:
        print(f"evicted {len(evicted)} least recently used entries to stay under {fmt_size(eviction.max_size())}")
    for b in report.bad:
        print(f"BAD entry {b['digest'][:12]} ({b['namespace']}): {b['reason']}")
    for r in report.rejected:
        print(f"REFUSED member {r['member']}: {r['reason']}")
    if foreign:
        print(f"WARNING: {len(foreign)} of the bundle's namespaces do not match this install; their entries will not be used here:")
        for f in foreign:
            print(f"  {f['entries']:>5}  {f['namespace']}: {f['reason']}")
    return 0 if report.ok else 1


def _not_for_this_install(root: Path, header: dict[str, Any]) -> list[dict[str, Any]]:
    """The namespaces a bundle brought (its header lists them) that no process here can hit:
    another flashinfer or DSL, machine, entry format, or an arch other than this host's
    (its target profile, else its GPU; not compared when neither is known)."""
    from . import coverage

    namespaces = header.get("namespaces")
    if not isinstance(namespaces, dict):
        return []
    arch, _source = coverage.host_arch()
    found = coverage.foreign_namespaces(root, [str(ns) for ns in namespaces], arch)
    count = lambda ns: n if isinstance(n := namespaces.get(ns), int) else 0  # noqa: E731  (the header is the bundle's word)
    return [{**f, "entries": count(f["namespace"])} for f in found]


def register(add: Add) -> None:
    p = add("export", cmd_export, "write verified entries into one bundle file (tar.gz), or push them to the remote")
    p.add_argument("bundle", nargs="?", help="the bundle file to write")
    p.add_argument("--to-remote", action="store_true", help="instead: publish every verified entry the remote (CUTE_DISKCACHE_REMOTE) lacks")
    p.add_argument("--namespace", action="append", help="only this namespace (a prefix is enough; repeatable)")
    p = add("import", cmd_import, "verify a bundle's (or the remote's) entries and merge them in; never replaces a valid entry")
    p.add_argument("bundle", nargs="?", help="the bundle file to read")
    p.add_argument("--from-remote", action="store_true", help="instead: fetch every entry of the remote (CUTE_DISKCACHE_REMOTE), e.g. to warm a new node")
    p.add_argument("--namespace", action="append", help="with --from-remote: only this namespace (a prefix is enough; repeatable)")
