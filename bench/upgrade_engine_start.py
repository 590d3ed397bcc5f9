"""Issue 31: a cold engine start after a flashinfer upgrade, on the upgraded cache against an empty one.

For each release pair (default 0.6.15.post1 -> 0.6.16.post4 and 0.7.2.post1 -> 0.7.4, both on
nvidia-cutlass-dsl 4.8.1, each release in its version-matrix cell venv, this checkout on
``PYTHONPATH``), for qwen3-30b-a3b on the ``rtx-pro-6000`` profile:

* **setup** (untimed): the old release's ``prewarm`` fills ``<work>/<pair>/old-root`` (the cache a
  node had before the upgrade); the new release's ``prewarm --dry-run --json`` gives the kernel
  list its engine asks for;
* **timed**: a fresh process of the new release, ``tests/key_completeness_driver.py serve`` (the
  cache attached, then each planned kernel requested again through flashinfer's real dispatch,
  as the engine requests it), on (a) a copy of the old root (**upgraded**) and (b) an empty root
  (**empty**); each run with its own empty ``FLASHINFER_WORKSPACE_BASE``, so flashinfer's own JIT
  cache holds nothing. The wall time is the whole process's (interpreter, imports, attach,
  serving). Repetitions alternate the order (upgraded first, then empty first).

Printed per pair: kernels requested, reused, compiled and hit (from the cache's events in the
child), wall seconds upgraded and empty, and their ratio; with the machine (CPU model, cores, load
average before and after) and the versions. Results: ``--out`` (``.json`` and ``.txt``).

    python bench/upgrade_engine_start.py --setup-only      # prewarm the old roots, plan (any time)
    python bench/upgrade_engine_start.py                   # setup if missing, then the timed runs
    python bench/upgrade_engine_start.py --m 1-64 --max-num-tokens 64   # a smaller plan
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "tests" / "key_completeness_driver.py"
MODEL = "qwen3-30b-a3b"
TARGET = "rtx-pro-6000"
DSL = "4.8.1"
PAIRS = (("0.6.15.post1", "0.6.16.post4"), ("0.7.2.post1", "0.7.4"))
OUT = REPO / "bench" / "results" / "upgrade_engine_start"


def cell_python(fi: str) -> Path:
    """The interpreter of the version matrix's cell for ``fi`` on DSL 4.8.1 (built when missing)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import compat_matrix

    return compat_matrix.cell_venv(compat_matrix.Cell(fi, DSL), compat_matrix.DEFAULT_SCRATCH)


def child_env(root: Path, workspace: Path) -> dict[str, str]:
    """This checkout first on the path, the cache at ``root``, flashinfer's JIT workspace at
    ``workspace``; nothing of the caller's that would steer the child (ours, the DSL's arch)."""
    keep = {k: v for k, v in os.environ.items()
            if not (k.startswith(("CUTE_DISKCACHE_", "FLASHINFER_WORKSPACE_")) or k in
                    ("FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"))}
    return {**keep, "PYTHONPATH": str(REPO), "CUTE_DISKCACHE_DIR": str(root), "FLASHINFER_WORKSPACE_BASE": str(workspace)}


def plan_argv(args: argparse.Namespace) -> list[str]:
    extra = ["--m", args.m] if args.m else []
    return [MODEL, "--target", TARGET, "--max-num-batched-tokens", str(args.max_num_tokens), *extra]


def _json_out(proc: subprocess.CompletedProcess[str], what: str) -> dict[str, Any]:
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def setup(pair: tuple[str, str], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The old release's prewarmed root and the new release's kernel list (reused when present)."""
    old, new = pair
    base = work / f"{old}-{new}"
    done = base / "setup.json"
    if done.exists() and json.loads(done.read_text())["plan_argv"] == plan_argv(args):
        return json.loads(done.read_text())
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    old_python, new_python = cell_python(old), cell_python(new)
    with tempfile.TemporaryDirectory(prefix="cdc-ws-") as ws:
        t0 = time.perf_counter()
        prewarm = _json_out(subprocess.run(
            [str(old_python), "-m", "cute_diskcache.prewarm", *plan_argv(args), "--jobs", str(args.jobs), "--json",
             "--root", str(base / "old-root")], env=child_env(base / "old-root", Path(ws)), capture_output=True, text=True),
            f"prewarm on {old}")
        prewarm_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="cdc-plan-") as tmp:
        planned = _json_out(subprocess.run(
            [str(new_python), "-m", "cute_diskcache.prewarm", *plan_argv(args), "--dry-run", "--json", "--root", str(Path(tmp) / "root")],
            env=child_env(Path(tmp) / "root", Path(tmp) / "ws"), capture_output=True, text=True), f"plan on {new}")
    (base / "kernels.json").write_text(json.dumps({MODEL: planned["kernel_list"]}))
    info = {"old": old, "new": new, "plan_argv": plan_argv(args), "old_python": str(old_python), "new_python": str(new_python),
            "old_prewarm": {k: prewarm[k] for k in ("kernels", "compiled", "reused", "failed")}, "old_prewarm_s": round(prewarm_s, 1),
            "new_kernels": planned["kernels"], "new_by_kind": planned.get("by_kind")}
    done.write_text(json.dumps(info, indent=1))
    return info


def engine_start(python: str, kernels: Path, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One cold engine start (a fresh process) on ``root``: wall seconds, and what the cache did."""
    with tempfile.TemporaryDirectory(prefix="cdc-ws-") as ws:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run([python, str(DRIVER), "serve", "--kernels", str(kernels), "--max-num-batched-tokens",
                               str(args.max_num_tokens)], env=child_env(root, Path(ws)), cwd=ws, capture_output=True, text=True,
                              timeout=args.timeout)
        wall = time.perf_counter() - t0
    report = _json_out(proc, f"engine start on {root}")
    outcomes = [e["outcome"] for s in report["served"] for e in s["events"]]
    return {"wall_s": round(wall, 2), "serve_s": round(report["seconds"], 2), "requested": len(report["served"]),
            "reused": outcomes.count("reused"), "compiled": report["compiles"], "hits": report["hits"],
            "misses": outcomes.count("miss"), "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)}


def run_pair(info: dict[str, Any], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    base = work / f"{info['old']}-{info['new']}"
    runs: dict[str, list[dict[str, Any]]] = {"upgraded": [], "empty": []}
    # untimed: the new release's interpreter and libraries read once, so neither case pays the cold page cache
    warm = subprocess.run([info["new_python"], "-c", f"import cute_diskcache; cute_diskcache.install(target={TARGET!r}); import flashinfer"],
                          env=child_env(base / "warm", base / "warm-ws"), capture_output=True, text=True)
    if warm.returncode != 0:
        print(f"  (warm-up import failed, timing anyway: {warm.stderr[-300:]})", flush=True)
    for rep in range(args.repeat):
        order = ("upgraded", "empty") if rep % 2 == 0 else ("empty", "upgraded")
        for case in order:
            root = base / "run-root"
            shutil.rmtree(root, ignore_errors=True)
            if case == "upgraded":
                shutil.copytree(base / "old-root", root)  # a real copy: the old root stays as prewarmed
            r = engine_start(info["new_python"], base / "kernels.json", root, args)
            runs[case].append(r)
            print(f"  {info['old']} -> {info['new']} {case:8s}: {r['wall_s']:7.1f} s wall, reused {r['reused']}, compiled "
                  f"{r['compiled']}, hits {r['hits']} (load {r['load_before']:.1f} -> {r['load_after']:.1f})", flush=True)
            shutil.rmtree(root, ignore_errors=True)
    up = min(r["wall_s"] for r in runs["upgraded"])
    empty = min(r["wall_s"] for r in runs["empty"])
    return {**info, "runs": runs, "upgraded_wall_s": up, "empty_wall_s": empty, "ratio": round(up / empty, 3)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions(python: str) -> dict[str, str]:
    code = ("import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in "
            "('flashinfer-python', 'nvidia-cutlass-dsl', 'torch')}))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def table(summary: dict[str, Any]) -> str:
    lines = [f"# {summary['title']}", f"date: {summary['date']}", f"machine: {summary['machine']}",
             f"code: {summary['code']}; model {MODEL}, target {TARGET}, plan: {' '.join(summary['plan_argv'][3:])}",
             f"repetitions: {summary['repeat']}, interleaved (the lower wall time of each case is compared)", "",
             "| upgrade | kernels | upgraded: reused / compiled / hits | empty: reused / compiled / hits | wall s upgraded | wall s empty | upgraded / empty |",
             "|---|---:|---|---|---:|---:|---:|"]
    for p in summary["pairs"]:
        u, e = p["runs"]["upgraded"][0], p["runs"]["empty"][0]
        lines.append(f"| {p['old']} -> {p['new']} | {p['new_kernels']} | {u['reused']} / {u['compiled']} / {u['hits']} | "
                     f"{e['reused']} / {e['compiled']} / {e['hits']} | {p['upgraded_wall_s']:.1f} | {p['empty_wall_s']:.1f} | "
                     f"{p['ratio']:.2f} |")
    lines.append("")
    for p in summary["pairs"]:
        lines.append(f"{p['old']} -> {p['new']}: old {p['versions_old']}, new {p['versions_new']}; old root prewarmed "
                     f"(untimed setup, {p['old_prewarm_s']} s): {p['old_prewarm']}")
        for case in ("upgraded", "empty"):
            walls = ", ".join(f"{r['wall_s']:.1f} s (load {r['load_before']:.1f})" for r in p["runs"][case])
            lines.append(f"  {case}: {walls}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", nargs="+", default=[f"{a}:{b}" for a, b in PAIRS], help="OLD:NEW flashinfer releases")
    ap.add_argument("--m", help="prewarm's --m (default: its own, 1..max-num-tokens)")
    ap.add_argument("--max-num-tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per case, interleaved")
    ap.add_argument("--jobs", type=int, default=1, help="setup: the old release's prewarm workers")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "cute-diskcache" / "bench-upgrade-engine-start")
    ap.add_argument("--setup-only", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one engine start may take")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    pairs = [tuple(p.split(":")) for p in args.pairs]
    infos = []
    for pair in pairs:
        print(f"setup {pair[0]} -> {pair[1]} ...", flush=True)
        infos.append(setup(pair, args.work, args))
        print(f"  {json.dumps(infos[-1]['old_prewarm'])}, {infos[-1]['new_kernels']} kernels planned on {pair[1]}", flush=True)
    if args.setup_only:
        return 0
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = []
    for info in infos:
        results.append({**run_pair(info, args.work, args), "versions_old": _versions(info["old_python"]),
                        "versions_new": _versions(info["new_python"])})
    load_after = os.getloadavg()
    code = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    summary = {"title": "Cold engine start after a flashinfer upgrade: upgraded cache vs empty (issue 31)", "date": started,
               "machine": (f"{_cpu_model()}, {len(os.sched_getaffinity(0))} cores ({os.cpu_count()} online), no GPU; load average "
                           f"{'/'.join(f'{v:.1f}' for v in load_before)} before, {'/'.join(f'{v:.1f}' for v in load_after)} after"),
               "code": code, "plan_argv": plan_argv(args), "repeat": args.repeat, "pairs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    text = table(summary)
    args.out.with_suffix(".txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
