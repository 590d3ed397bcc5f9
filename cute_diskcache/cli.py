"""``cute-diskcache`` / ``python -m cute_diskcache``: the operator's view of the cache.

Subcommands: ``demo`` (cold vs warm engine start on a bundled target profile, no GPU needed),
``info`` (where the cache is and what it is keyed on), ``clear``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import config

#: Qwen3-30B-A3B's MoE layer, one GPU: 128 experts, top-8, hidden 2048, moe_intermediate 768.
DEMO_SHAPE = "128,8,2048,768"
#: One m per kernel kind on flashinfer 0.6.15: 1 -> micro, 16 -> static, 128 -> dynamic.
DEMO_MS = (1, 16, 128)


def _probe(root: Path, target: str, ms: list[int], shape: str) -> dict[str, Any]:
    from . import _probe as probe

    try:
        return probe.run(root, ms, target=target, shape=shape)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def cmd_demo(args: argparse.Namespace) -> int:
    """Two fresh processes on one empty cache root: the first compiles, the second loads."""
    from importlib.metadata import version

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="cute-diskcache-demo-"))
    try:
        print(
            f"flashinfer {version('flashinfer-python')}, nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}, "
            f"target profile {args.target}, MoE shape E,top_k,hidden,inter = {args.shape}"
        )
        print(f"cache root: {root}")
        print("cold start (empty cache) ...", flush=True)
        cold = _probe(root, args.target, args.m, args.shape)
        print("warm start (fresh process, same cache) ...", flush=True)
        warm = _probe(root, args.target, args.m, args.shape)
        rows = []
        for (site, _d, kind_c, t_cold, *_), (_s, _d2, kind_w, t_warm, *_) in zip(cold["events"], warm["events"]):
            rows.append((site.rsplit(".", 1)[-1], kind_c, t_cold, kind_w, t_warm))
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
        ok = warm["counters"]["compiles"] == 0 and all(
            a["launch_error"] == b["launch_error"] for a, b in zip(cold["records"], warm["records"])
        )
        print("same kernel ABI cold and warm: " + ("yes" if ok else "NO"))
        return 0 if ok else 1
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def cmd_info(args: argparse.Namespace) -> int:
    s = config.load()
    info: dict[str, Any] = {
        "root": str(s.root),
        "root_source": s.root_source,
        "enabled": s.enabled,
        "target": s.target,
        "readonly": s.readonly,
    }
    try:
        from .key import codegen_env, dsl_stack_string

        info["dsl"] = dsl_stack_string()
        info["codegen_env"] = codegen_env()
    except Exception as exc:  # info must work even with a broken DSL install
        info["dsl"] = f"unavailable: {exc}"
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:<12} {v}")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    root = config.load().root
    if not root.exists():
        print(f"nothing to clear: {root} does not exist")
        return 0
    removed = 0
    for name in ("v1", "quarantine"):
        p = root / name
        if p.exists():
            removed += sum(1 for _ in p.rglob("manifest.msgpack"))
            shutil.rmtree(p)
    print(f"cleared {root} ({removed} entries)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cute-diskcache", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="cold vs warm engine start on a target profile (no GPU needed)")
    d.add_argument("--target", default="rtx-pro-6000")
    d.add_argument("--shape", default=DEMO_SHAPE, help="experts,top_k,hidden,intermediate")
    d.add_argument("--m", type=int, nargs="+", default=list(DEMO_MS))
    d.add_argument("--dir", default=None, help="cache root to use (default: a temporary one)")
    d.add_argument("--keep", action="store_true", help="keep the temporary cache root")
    d.set_defaults(fn=cmd_demo)
    i = sub.add_parser("info", help="where the cache is and what it is keyed on")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_info)
    c = sub.add_parser("clear", help="delete every entry (and the quarantine) under the root")
    c.set_defaults(fn=cmd_clear)
    args = ap.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
