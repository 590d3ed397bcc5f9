"""``info``, ``doctor`` and ``demo``: where the cache is, what it covers, what it is worth."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

from .. import config
from . import demo
from ..keys import targets
from .common import Add, CliError, root_of
from .output import fmt_s, print_json


def cmd_info(args: argparse.Namespace) -> int:
    s = config.load()
    root, source = root_of(args)
    info: dict[str, Any] = {
        "root": str(root),
        "root_source": source,
        "enabled": s.enabled,
        "target": s.target,
        "readonly": s.readonly,
        "max_size": config.text("max_size") or "default",
        "single_flight": s.single_flight,
        "trust_shared": s.trust_shared,
        "signing": "on (CUTE_DISKCACHE_HMAC_KEY set)" if s.hmac_key else "off",
    }
    try:
        from ..keys.key import codegen_env, dsl_stack_string

        info["dsl"] = dsl_stack_string()
        info["codegen_env"] = codegen_env()
    except Exception as exc:  # noqa: BLE001 - info must work even with a broken DSL install
        info["dsl"] = f"unavailable: {exc}"
    if args.json:
        print_json(info)
    else:
        for k, v in info.items():
            print(f"{k.replace('_', ' '):<14}{_words(v)}")
    return 0


def _words(value: Any) -> str:
    """A setting as the README writes it: yes / no / none, never Python's True / False / None."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "none"
    return str(value)


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import doctor

    return doctor.main((["--json"] if args.json else []) + (["--strict"] if args.strict else []) + (["--all"] if args.all else []))


def cmd_demo(args: argparse.Namespace) -> int:
    """Two fresh processes on one empty cache root: the first compiles, the second loads."""
    refusal = targets.refusal(args.target)
    if refusal is not None:
        raise CliError(refusal)
    chosen = args.root  # --root DIR (or the old --dir DIR); else a temporary root
    root = Path(chosen).expanduser() if chosen else Path(tempfile.mkdtemp(prefix="cute-diskcache-demo-"))
    say = (lambda *a, **k: None) if args.json else print
    try:
        say(
            f"flashinfer {version('flashinfer-python')}, nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}, "
            f"target profile {args.target}, MoE shape E,top_k,hidden,inter = {args.shape}"
        )
        say(f"cache root: {root}")
        phases = {"cold": "cold start (empty cache) ...", "warm": "warm start (fresh process, same cache) ..."}
        try:
            result = demo.run(root, target=args.target, ms=args.m, shape=args.shape, on_phase=lambda p: say(phases[p], flush=True))
        except RuntimeError as exc:
            raise SystemExit(str(exc)) from None
        rows, cold, warm, ok = result["rows"], result["cold"], result["warm"], result["ok"]
        if args.json:
            print_json(
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
            print(f"{kind:<10}{fmt_s(t_cold):>16}{fmt_s(t_warm):>18}{t_cold / t_warm:>9.0f}x{tag}")
        tc = sum(r[2] for r in rows)
        tw = sum(r[4] for r in rows)
        print(f"{'total':<10}{fmt_s(tc):>16}{fmt_s(tw):>18}{tc / tw if tw else 0:>9.0f}x")
        print(
            f"\nwarm process: {warm['counters']['compiles']} compiles, {warm['counters']['hits']} disk hits; "
            f"cold process: {cold['counters']['compiles']} compiles, {cold['counters']['writes']} entries written"
        )
        print("same kernel ABI cold and warm: " + ("yes" if ok else "NO"))
        return 0 if ok else 1
    finally:
        if not chosen and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def register(add: Add) -> None:
    p = add("doctor", cmd_doctor, "every CuTe-DSL compile site of the installed flashinfer and b12x, and who persists it")
    p.add_argument("--strict", action="store_true", help="exit 1 if any site is persisted by nothing")
    p.add_argument("--all", action="store_true", help="list every site, not only the sm12x ones")
    add("info", cmd_info, "where the cache is and what it is keyed on")
    p = add("demo", cmd_demo, "cold vs warm engine start on a target profile (no GPU needed); "
                              "--root DIR: the demo's cache root (default: a temporary one, removed afterwards)")
    p.add_argument("--target", default="rtx-pro-6000")
    p.add_argument("--shape", default=demo.DEMO_SHAPE, help="experts,top_k,hidden,intermediate")
    p.add_argument("--m", type=int, nargs="+", default=list(demo.DEMO_MS))
    # The cache root is the global --root here too (default for the demo: a temporary one,
    # removed afterwards); --dir was its name before.
    p.add_argument("--dir", dest="root", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--keep", action="store_true", help="keep the temporary cache root")
