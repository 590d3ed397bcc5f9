"""A hit at the loader floor, and what the whole flashinfer call costs when it goes to the disk cache.

Issue 16's targets, measured in one run on the installed flashinfer (0.6.15.post1 in CI), for
micro (m=1), static (m=16) and dynamic (m=128) kernels of the Qwen3-30B-A3B layer:

1. cold: one fresh process compiles every kernel with an empty cache; its miss overhead is
   everything persistence adds to the compile (export, link, write), as a share of the compile;
2. warm, ``.so``: ``--runs`` fresh processes, each timing the first hit of every kernel in that
   process, then ``--repeat`` later hits (flashinfer's in-process dict emptied between them, so
   each call goes to the disk cache again). Every check is included (trust walk, sealed
   manifest, key, environment, host CPU, device facts, sha256 of what is loaded);
3. warm, ``.o``: the same with ``CUTE_DISKCACHE_SHARED_OBJECTS=0`` (the DSL's ``load_module``).

Two figures per hit, side by side:

- **cache layer**: the cache layer's call, from the request to the callable (its own events,
  ``cache.events``). Work done before that call (an adapter computing the key) is not in it;
- **whole call**: the wall time of the flashinfer call that had to go to the disk cache,
  ``Dispatcher.run(m)`` (flashinfer's selection and workspace, the compile path it takes when its
  in-process dict is empty, our key, our load, and the refused CPU launch). First: the first
  ``run(m)`` in a fresh process (the first m also pays the process's first kernel call, ~0.6 s on
  a 2-core CPU box in ``launch_sm120_static_moe``'s own frame, whichever code tree loaded it),
  after ``gc.collect()``: a child is deterministic, so without it a collection that comes due by
  the process's allocation phase (a generation-1 pass costs ~1-2 ms here) lands in the same first
  call of one tree in every run and decides that comparison by luck;
  later: each ``run(m)`` after emptying flashinfer's dicts. **memo** is the same call while
  flashinfer's dict holds the kernel (no disk cache involved), and ``later - memo`` (of the
  p50s) is what going to the disk cache adds to a call. Each later call must reach the cache
  layer with as many hits as the first call did, or the run stops (an in-process memo of ours
  would otherwise pass for a disk hit).

``--code TREE`` (repeatable) compares code trees in one run: every child runs with
``PYTHONPATH=TREE`` and checks that ``cute_diskcache`` is imported from it; each tree gets its own
cache root and cold compile (its keys differ), and the warm processes are interleaved across
trees and modes (A B A B ...), so load on the box hits all alike. Ratios are each tree's p50
over the first tree's. Without ``--code`` the installed package is measured.

flashinfer 0.7.4's own cache is compared in ``bench/native_vs_ours.py`` (run it with the 0.7.4 venv).

Run:  python bench/hit_path.py [--runs 5] [--repeat 20] [--modes so o]
Before/after (issue 22), old code in a worktree, new code in /work/main, and the noise of the
figures: the old code against a second copy of itself (A/A), in the same way:
  git worktree add /tmp/hp-old 6926ee6 && git worktree add /tmp/hp-old2 6926ee6
  python bench/hit_path.py --code /tmp/hp-old --code /work/main --runs 9 --repeat 20 \\
      --out bench/results/hit_path_ab.json | tee bench/results/hit_path_ab.txt
  python bench/hit_path.py --code /tmp/hp-old --code /tmp/hp-old2 --runs 9 --repeat 20 \\
      --out bench/results/hit_path_aa.json | tee bench/results/hit_path_aa.txt
Targets: later hit <= 1.0 ms p50 and first hit <= 3 ms; cold / warm >= 2000x; miss overhead <= 3%.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

KINDS = {1: "micro", 16: "static", 128: "dynamic"}
#: flashinfer's in-process kernel dicts for moe_dispatch; emptied so a call goes to the disk cache.
FLASHINFER_DICTS = ("_MICRO_KERNEL_CACHE", "_STATIC_KERNEL_CACHE", "_DYNAMIC_KERNEL_CACHE")


def child(args: argparse.Namespace) -> int:
    """One fresh engine start on the cache in $CUTE_DISKCACHE_DIR: first hits, later hits, memo calls."""
    import cute_diskcache

    module_file = str(Path(cute_diskcache.__file__).resolve())
    print(f"cute_diskcache: {module_file}", file=sys.stderr)
    if args.expect_tree and not Path(module_file).is_relative_to(Path(args.expect_tree).resolve()):
        print(f"cute_diskcache was imported from {module_file}, not from {args.expect_tree}", file=sys.stderr)
        return 3
    cute_diskcache.install(target=args.target)
    import flashinfer  # noqa: F401
    from flashinfer.cute_dsl.utils import current_cuda_stream
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch as md

    current_cuda_stream()  # flashinfer's one-off torch._dynamo import, outside the timings
    from cute_diskcache import flashinfer_sites

    try:
        from cute_diskcache.core import through
        from cute_diskcache.core.cache import default_cache
    except ImportError:  # a tree from before core/ (76569c1 and older): the same functions, then in these modules
        from cute_diskcache.cache import default_cache  # type: ignore[no-redef]
        from cute_diskcache.flashinfer_sites import _common as through  # type: ignore[no-redef]

    # "served": flashinfer's cute.compile call as it sees it, from the call to the object it gets
    # (key, hit, and the object of the compile's own class rebuilt around the loaded function):
    # the cache layer's events stop before that rebuild, where a fresh process once imported the
    # DSL's tvm-ffi provider. ``through.through_cache`` is the one call every served compile makes.
    served: list[float] = []
    real_through = through.through_cache

    def timed_through(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real_through(*a, **k)
        finally:
            served.append(time.perf_counter() - t0)

    through.through_cache = timed_through
    E, topk, k, n = (int(v) for v in args.shape.split(","))
    d = flashinfer_sites.Dispatcher(E, topk, k, n, max_num_tokens=4096)
    cache = default_cache()
    out: dict[str, Any] = {"module_file": module_file, "first": {}, "later": {}, "first_call": {}, "later_call": {},
                           "memo_call": {}, "first_served": {}, "later_served": {}, "outcomes": []}
    first_events: dict[int, int] = {}
    for m in args.m:
        kind = KINDS.get(m, str(m))
        before = len(cache.events)
        gc.collect()  # every tree's first call starts from an empty generation 0 (see the module's docstring)
        served.clear()
        t0 = time.perf_counter()
        d.run(m)
        out["first_call"][kind] = time.perf_counter() - t0
        out["first_served"][kind] = sum(served)
        events = cache.events[before:]
        first_events[m] = len(events)
        if not events:  # the cache layer never saw it: not attached (see the log above), or the site is not covered
            print(f"m={m}: the first call reached no cache layer", file=sys.stderr)
            return 5
        out["outcomes"] += [e[2] for e in events]
        out["first"][kind] = sum(e[3] for e in events)
        out.setdefault("persist", {})[kind] = [sum(e[3] for e in events), sum(e[4] for e in events)]
    for m in args.m:
        kind = KINDS.get(m, str(m))
        times, walls, served_times = [], [], []
        for _ in range(args.repeat):
            for name in FLASHINFER_DICTS:
                getattr(md, name, {}).clear()
            before = len(cache.events)
            served.clear()
            t0 = time.perf_counter()
            d.run(m)
            walls.append(time.perf_counter() - t0)
            served_times.append(sum(served))
            events = cache.events[before:]
            if len(events) != first_events[m] or any(e[2] != "hit" for e in events):
                print(f"m={m}: a later call reached the cache layer with {[e[2] for e in events]}, "
                      f"the first with {first_events[m]} event(s): not a disk hit like the first", file=sys.stderr)
                return 4
            times.append(sum(e[3] for e in events))
        out["later"][kind], out["later_call"][kind], out["later_served"][kind] = times, walls, served_times
        memo = []
        for _ in range(args.repeat):  # flashinfer's dict holds the kernel now: no disk cache
            t0 = time.perf_counter()
            d.run(m)
            memo.append(time.perf_counter() - t0)
        out["memo_call"][kind] = memo
    out["counters"] = cute_diskcache.counters()
    print(json.dumps(out))
    return 0


def _run(root: Path, args: argparse.Namespace, tree: Path | None, **env: str) -> dict[str, Any]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k not in ("FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH")}
    child_env.update(CUTE_DISKCACHE_DIR=str(root), **env)
    cmd = [sys.executable, __file__, "--child", "--target", args.target, "--shape", args.shape, "--repeat", str(args.repeat), "--m", *map(str, args.m)]
    if tree is not None:
        child_env["PYTHONPATH"] = str(tree)
        cmd += ["--expect-tree", str(tree)]
    proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"child for {tree or 'installed package'} ({env or 'default'}) failed, rc {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _stats(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:6.2f} ({min(xs) * 1e3:.2f})"


def _describe(tree: Path | None) -> str:
    """Which code a tree holds: its commit, and whether it has uncommitted changes."""
    if tree is None:
        return "installed package"
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "cute_diskcache"], capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(tree)
    return f"{tree} at {head}{' + uncommitted changes in cute_diskcache/' if dirty else ''}"


def _rows(cold: dict[str, Any], modes: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per kernel: the cold compile and every figure's samples, per mode."""
    rows = []
    for kind, (compile_s, persist_s) in cold["persist"].items():
        row: dict[str, Any] = {"kernel": kind, "compile_s": compile_s, "persist_s": persist_s}
        row["first"] = {mode: [r["first"][kind] for r in runs] for mode, runs in modes.items()}
        row["later"] = {mode: [t for r in runs for t in r["later"][kind]] for mode, runs in modes.items()}
        row["first_call"] = {mode: [r["first_call"][kind] for r in runs] for mode, runs in modes.items()}
        row["first_served"] = {mode: [r["first_served"][kind] for r in runs] for mode, runs in modes.items()}
        row["later_served"] = {mode: [t for r in runs for t in r["later_served"][kind]] for mode, runs in modes.items()}
        row["later_call"] = {mode: [t for r in runs for t in r["later_call"][kind]] for mode, runs in modes.items()}
        row["memo_call"] = {mode: [t for r in runs for t in r["memo_call"][kind]] for mode, runs in modes.items()}
        if "so" in modes:
            row["ratio_later_so"] = compile_s / statistics.median(row["later"]["so"])
            row["ratio_first_so"] = compile_s / statistics.median(row["first"]["so"])
        rows.append(row)
    return rows


def _print_tree(rows: list[dict[str, Any]], modes: list[str]) -> None:
    cols = [(fig, mode) for fig in ("first", "later") for mode in modes]
    print(f"{'kernel':<8}{'compile':>9}{'miss overhead':>15}" + "".join(f"{f'{fig} .{mode}':>15}" for fig, mode in cols)
          + (f"{'compile/later .so':>19}" if "so" in modes else ""))
    for row in rows:
        print(f"{row['kernel']:<8}{row['compile_s']:>7.2f} s{row['persist_s'] * 1e3:>8.0f} ms {100 * row['persist_s'] / row['compile_s']:>3.1f}%"
              + "".join(f"{_stats(row[fig][mode]):>15}" for fig, mode in cols)
              + (f"{row['ratio_later_so']:>18.0f}x" if "so" in modes else ""))
    print("served: flashinfer's cute.compile call, key + hit + the compile's class rebuilt (first in a fresh process, later):")
    for row in rows:
        print(f"{row['kernel']:<8}" + "".join(f"{_stats(row[fig][mode]):>15}" for fig in ("first_served", "later_served") for mode in modes))
    print("whole call, Dispatcher.run(m) wall:")
    cols = [(fig, mode) for fig in ("first_call", "later_call", "memo_call") for mode in modes]
    print(f"{'kernel':<8}" + "".join(f"{fig.split('_')[0] + ' .' + mode:>15}" for fig, mode in cols)
          + "".join(f"{f'later-memo .{mode}':>17}" for mode in modes))
    for row in rows:
        adds = [statistics.median(row["later_call"][mode]) - statistics.median(row["memo_call"][mode]) for mode in modes]
        print(f"{row['kernel']:<8}" + "".join(f"{_stats(row[fig][mode]):>15}" for fig, mode in cols) + "".join(f"{a * 1e3:>17.2f}" for a in adds))


#: The figures compared across trees: (label, row key).
FIGURES = (("cache first", "first"), ("cache later", "later"), ("served first", "first_served"), ("served later", "later_served"),
           ("call first", "first_call"), ("call later", "later_call"), ("call memo", "memo_call"))


def _ratios(base: list[dict[str, Any]], other: list[dict[str, Any]], modes: list[str]) -> dict[str, dict[str, float]]:
    """p50 of each figure in ``other`` over the same figure in ``base``, per kernel."""
    out: dict[str, dict[str, float]] = {}
    for b, o in zip(base, other):
        r = out[b["kernel"]] = {"compile": o["compile_s"] / b["compile_s"]}
        for label, key in FIGURES:
            for mode in modes:
                r[f"{label} .{mode}"] = statistics.median(o[key][mode]) / statistics.median(b[key][mode])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--expect-tree", help=argparse.SUPPRESS)
    ap.add_argument("--target", default="rtx-pro-6000")
    ap.add_argument("--shape", default="128,8,2048,768")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--modes", nargs="+", choices=("so", "o"), default=["so", "o"], help="so: linked shared objects; o: CUTE_DISKCACHE_SHARED_OBJECTS=0")
    ap.add_argument("--code", action="append", type=Path, help="a code tree to measure (PYTHONPATH=TREE); repeat to compare, the first is the base of the ratios")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "hit_path.json"))
    args = ap.parse_args()
    if args.child:
        return child(args)
    trees: list[Path | None] = [t.resolve() for t in args.code] if args.code else [None]
    mode_env = {"so": {}, "o": {"CUTE_DISKCACHE_SHARED_OBJECTS": "0"}}
    with tempfile.TemporaryDirectory(prefix="cdc-hit-") as tmp:
        roots = [Path(tmp) / f"cache-{i}" for i in range(len(trees))]
        colds = [_run(root, args, tree) for root, tree in zip(roots, trees)]
        for tree, cold in zip(trees, colds):
            assert set(cold["outcomes"]) == {"miss"}, (tree, cold["outcomes"])
        runs: list[dict[str, list[dict[str, Any]]]] = [{mode: [] for mode in args.modes} for _ in trees]
        for _ in range(args.runs):  # interleaved, so load on the box hits every tree and mode alike
            for i, (root, tree) in enumerate(zip(roots, trees)):
                for mode in args.modes:
                    runs[i][mode].append(_run(root, args, tree, **mode_env[mode]))
    for tree, by_mode in zip(trees, runs):
        for mode_runs in by_mode.values():
            assert all(set(r["outcomes"]) == {"hit"} for r in mode_runs), f"a warm run of {tree} compiled"
    print(f"# hit path {time.strftime('%Y-%m-%d %H:%M')}: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, no GPU; "
          f"flashinfer {version('flashinfer-python')}, DSL {version('nvidia-cutlass-dsl')}, target {args.target}")
    print(f"# first hit: p50 (min) over {args.runs} fresh processes; later hits: p50 (min) over {args.runs} x {args.repeat}; ms")
    print("# cache: the cache layer's call (its events); call: the whole Dispatcher.run(m) wall; memo: that call with flashinfer's dict holding the kernel")
    results = []
    for tree, cold, by_mode in zip(trees, colds, runs):
        rows = _rows(cold, by_mode)
        module_files = sorted({r["module_file"] for mode_runs in by_mode.values() for r in mode_runs} | {cold["module_file"]})
        print(f"\n## {_describe(tree)}; cute_diskcache from {', '.join(module_files)}")
        _print_tree(rows, args.modes)
        results.append({"code": str(tree) if tree else None, "describe": _describe(tree), "module_files": module_files, "rows": rows})
    ratios = {}
    for res in results[1:]:
        r = ratios[res["code"]] = _ratios(results[0]["rows"], res["rows"], args.modes)
        print(f"\n## ratio of p50s, {res['code']} / {results[0]['code']} (< 1: faster)")
        labels = ["compile"] + [f"{label} .{mode}" for label, _ in FIGURES for mode in args.modes]
        print(f"{'kernel':<8}" + "".join(f"{lab:>18}" for lab in labels))
        for kind, by_label in r.items():
            print(f"{kind:<8}" + "".join(f"{by_label[lab]:>18.2f}" for lab in labels))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "args": {k: v for k, v in vars(args).items() if k not in ("child", "expect_tree", "code")},
                               "rows": results[0]["rows"], "trees": results, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
