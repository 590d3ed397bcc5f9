#!/usr/bin/env python3
"""The b12x axis of the compatibility matrix: which b12x releases cute-diskcache is proven on.

vLLM 0.34's ``b12x`` backends import the standalone b12x package (``pip install vllm[b12x]``:
b12x 1.5.1, which pins nvidia-cutlass-dsl 4.8.0). Each cell is one b12x release with the DSL its
metadata pins: vLLM's pin, and what the package index allows beyond it. A cell's venv layers b12x
over an existing flashinfer cell of ``compat_matrix.py`` with that DSL (a ``.pth`` line, nothing
copied), or over the shared base venv with the DSL installed. b12x goes in with ``--no-deps``:
every release declares ``torch>=2.12``, which would let pip pull a multi-GB CUDA build; the CPU
torch 2.13.0 comes from the base venv, and what b12x imports besides is named in :data:`B12X_DEPS`.

Then, each in a fresh process of the cell's interpreter, this checkout on ``PYTHONPATH``, for the
``rtx-pro-6000`` profile (sm_120a, no GPU):

1. ``doctor --json`` and ``doctor --strict``: b12x's sites and who persists each; whether prewarm
   can plan this b12x (``prewarm_refused``);
2. a cold ``prewarm llama-3.1-8b-nvfp4 --linear-backend b12x --m 1,8 --json --root R``: b12x's own
   planning of vLLM's NVFP4 linear warm-up, every job compiled into an empty cache;
3. a fresh process (``scripts/compat_b12x_child.py``) making the same b12x calls: it must make
   **0 compiles** (our counter and the DSL's ``CompileCallable._compile``) and hit every entry the
   prewarm wrote, digest for digest;
4. b12x's runtime path, which every release has: one kernel (the MXFP8 row quantizer) through
   b12x's own getter, compiled as a serving process compiles it into an empty cache, then a fresh
   process: 0 compiles, the same digest, the same object handed to b12x
   (``compat_child.result_summary``); on b12x >= 1.5.0 also the entry b12x's offline compile worker
   writes (``no_jit_engine``, as prewarm's workers compile) loaded by a fresh serving process: the
   same digest and object as the serving compile.

A cell is **proven** when 3 and 4 hold and ``doctor --strict`` passes; **refused** when prewarm
declines the b12x release (exit 2 with doctor's ``prewarm_refused`` reason) and 4 holds; anything
else is **failed**, a bug (a crash, a compile in the fresh process, another kernel handed back).
One JSON per cell goes to ``compat/b12x/``, the run to ``compat/run.json`` (key ``b12x``), the
table to ``compat/README.md`` (written by ``compat_matrix.write_markdown``). CI does not run this.

    python scripts/compat_b12x.py                              # every b12x cell (~10 min on 2 cores)
    python scripts/compat_b12x.py --cells b12x1.5.1-dsl4.8.0
    python scripts/compat_b12x.py --table-only
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compat_matrix as cm

log = logging.getLogger("compat_b12x")

CHILD = Path(__file__).resolve().parent / "compat_b12x_child.py"
RESULTS = cm.RESULTS / "b12x"
MODEL, MS = "llama-3.1-8b-nvfp4", "1,8"
#: What b12x imports on the paths we drive, besides torch and the DSL (its ``transformers``
#: requirement is for its model loaders, never imported here). apache-tvm-ffi as the flashinfer
#: cells have it (b12x: ``>=0.1.6,<0.2``, not 0.1.8).
B12X_DEPS = ("apache-tvm-ffi==0.1.15.post2", "cuda-python", "rich", "safetensors")
_DROPPED_ENV = re.compile(r"^(B12X_.*|XDG_CACHE_HOME)$")


@dataclasses.dataclass(frozen=True)
class B12xCell:
    """One b12x release with the DSL its metadata pins, over ``layer`` (a flashinfer cell's name) or the base."""

    b12x: str
    dsl: str
    layer: str | None = None
    roles: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"b12x{self.b12x}-dsl{self.dsl}"

    def requirements(self) -> list[str]:
        dsl = [] if self.layer else [f"nvidia-cutlass-dsl=={self.dsl}", f"nvidia-cutlass-dsl-libs-cu12=={self.dsl}",
                                     f"nvidia-cutlass-dsl-libs-cu13=={self.dsl}"]
        return [f"b12x=={self.b12x}", *dsl, *B12X_DEPS] + ([f"layer:{self.layer}"] if self.layer else [])


VLLM_PIN, INDEX = "vLLM 0.34.0 pin (vllm[b12x])", "on the index beyond vLLM's pin"
#: b12x on the index: 1.5.1 (DSL 4.8.0), 1.5.0 (4.7.1), 1.3.0 and 1.2.8 (4.6.2), older 1.2.x, 1.1.0
#: and 0.x (not cells: releases before 1.5.0 lack the planning API prewarm drives). vLLM 0.34.0
#: pins 1.5.1 with flashinfer-python 0.7.3, which is not on the index: 0.7.4's cell (same DSL) stands
#: in. 1.5.0 has no flashinfer cell with its DSL; 1.3.0 layers on 0.6.18.post1's 4.6.2 cell.
CELLS = (
    B12xCell("1.5.1", "4.8.0", "fi0.7.4-dsl4.8.0", (VLLM_PIN,)),
    B12xCell("1.5.0", "4.7.1", None, (INDEX,)),
    B12xCell("1.3.0", "4.6.2", "fi0.6.18.post1-dsl4.6.2", (INDEX,)),
    B12xCell("1.2.8", "4.6.2", "fi0.6.18.post1-dsl4.6.2", (INDEX,)),
)


def cell_venv(cell: B12xCell, scratch: Path) -> Path:
    """The cell's interpreter (reused when its stamp matches): b12x over its layer or the base."""
    venv = scratch / "cells" / cell.name
    python = venv / "bin" / "python"
    stamp = venv / "compat-cell.json"
    with cm.building(venv):  # two test workers may want it at once: one builds, one waits
        if stamp.is_file() and json.loads(stamp.read_text()) == cell.requirements():
            return python
        if cell.layer:
            layer = next(c for c in cm.CELLS if c.name == cell.layer)
            under = cm._purelib(cm.cell_venv(layer, scratch))  # built if absent, reused if present
        else:
            under = cm._purelib(cm.base_venv(scratch) / "bin" / "python")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
        # Lowest priority on sys.path; the layer's own .pth lines (its base: torch, ...) are read too.
        # b12x's own directory comes first, so flashinfer 0.7.4's `b12x` alias package is shadowed.
        (cm._purelib(python) / "zz_compat_base.pth").write_text(f"{under}\nimport site; site.addsitedir({str(under)!r})\n")
        constraints = cm._constraints(scratch)
        dsl = [r for r in cell.requirements() if r.startswith("nvidia-cutlass-dsl")]
        if dsl:
            cm._pip(python, *dsl, constraints=constraints)
        cm._pip(python, "--no-deps", f"b12x=={cell.b12x}", constraints=constraints)
        cm._pip(python, *B12X_DEPS, constraints=constraints)
        stamp.write_text(json.dumps(cell.requirements()))
        return python


@dataclasses.dataclass
class Run(cm.Run):
    """A flashinfer cell's run, with b12x's own cache directory and switches of the caller left out."""

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in super().env(**extra).items() if not _DROPPED_ENV.match(k)}
        env["B12X_COMPILE_CACHE_DIR"] = str(self.workdir / "b12x-cache")  # never the user's
        return env


def doctor(run: Run) -> dict[str, Any]:
    t = time.perf_counter()
    proc, full, rc_strict = cm.run_doctor(run)
    report = full.get("b12x") or {}
    return {
        "rc_strict": rc_strict,
        "b12x": report.get("b12x"),
        "summary": report.get("summary"),
        "prewarm_refused": report.get("prewarm_refused"),
        "missing_adapter_sites": report.get("missing_adapter_sites"),
        "wrapper": [f"{s['file']}:{s['function']}" for s in report.get("sites", []) if s["role"] == "wrapper"],
        "nothing": [f"{s['file']}:{s['function']}" for s in report.get("sites", []) if s["status"] == "nothing"],
        "error": None if report else (proc.stderr[-2000:] or "no b12x block"),
        "seconds": round(time.perf_counter() - t, 1),
    }


def entries(root: Path) -> dict[str, str]:
    """The entries a cache root holds: digest -> namespace (``layout``: v1/<ns>/<xx>/<digest>)."""
    return {p.name: p.parent.parent.name for p in sorted((root / "v1").glob("*/*/*")) if p.is_dir()}


def prewarm(run: Run) -> dict[str, Any]:
    t = time.perf_counter()
    proc = run.run("-m", "cute_diskcache.prewarm", MODEL, "--target", cm.TARGET, "--linear-backend", "b12x",
                   "--m", MS, "--jobs", "1", "--json", "--root", str(run.workdir / "root"))
    out = cm._json_line(proc) or {}
    if proc.returncode != 0 and "error" not in out:  # --json puts a refusal on stderr as JSON
        err = next((json.loads(ln) for ln in reversed(proc.stderr.splitlines()) if ln.startswith("{")), None)
        out = err or {"error": cm._first_error_line(proc.stderr)}
    return {
        "rc": proc.returncode, "error": out.get("error"), "jobs": out.get("jobs"),
        "kernels_compiled": out.get("kernels_compiled"), "kernels_cached": out.get("kernels_cached"),
        "errors": out.get("errors"),
        "per_job": [{k: r.get(k) for k in ("linear", "n", "k", "capacity", "factory", "ms", "seconds", "compiles", "hits")}
                    for r in out.get("job_list", [])],
        "entries": entries(run.workdir / "root"),
        "wall_seconds": round(time.perf_counter() - t, 1),
    }


def fresh(run: Run) -> dict[str, Any]:
    """The fresh process after the prewarm: the same b12x calls (``plan``), counted."""
    return _child(run, "plan", MODEL, cm.TARGET, MS)


def runtime(run: Run, offline_run: Run | None) -> dict[str, Any]:
    """b12x's runtime path, with or without its planning API: one kernel through b12x's own getter,
    as a serving process compiles it, in an empty cache (cold), then in a fresh serving process: 0
    compiles, the same digest, the same object handed to b12x (``compat_child.result_summary``).
    With ``offline_run`` (b12x >= 1.5.0) also the entry b12x's offline compile worker writes (as
    prewarm's workers do, ``no_jit_engine``), loaded by a fresh serving process: the same digest
    and the same object as the serving compile."""
    cold = _child(run, "runtime", cm.TARGET)
    warm = _child(run, "runtime", cm.TARGET) if cold.get("rc") == 0 else None
    problems = _runtime_problems("fresh process", cold, warm)
    offline = served = None
    if offline_run is not None and not problems:
        offline = _child(offline_run, "runtime", cm.TARGET, "--offline")
        served = _child(offline_run, "runtime", cm.TARGET) if offline.get("rc") == 0 else None
        problems += _runtime_problems("offline entry, serving process", offline, served, like=cold)
    return {"status": "failed" if problems else "proven", "problems": problems,
            "site": (cold.get("events") or [[None]])[0][0], "cold_seconds": cold.get("wall_seconds"),
            **{name: None if out is None else {k: out.get(k) for k in ("compiles", "real_compiles", "events", "rc", "error")}
               for name, out in (("cold", cold), ("warm", warm), ("offline", offline), ("offline_served", served))}}


def _runtime_problems(what: str, cold: dict[str, Any], warm: dict[str, Any] | None,
                      like: dict[str, Any] | None = None) -> list[str]:
    """What is wrong with a compile (``cold``) and its fresh process's load (``warm``); the loaded
    object must be what ``like`` (default ``cold``) was handed, under ``like``'s digest."""
    like = like or cold
    if cold.get("rc") != 0 or cold.get("error") or cold.get("compiles") != 1 or cold.get("real_compiles") != 1:
        return [f"{what}: cold exit {cold.get('rc')}, {cold.get('compiles')} compiles ({cold.get('real_compiles')} at the DSL)"
                f"{': ' + str(cold.get('error')) if cold.get('error') else ''}"]
    if warm is None or warm.get("rc") != 0 or warm.get("compiles") != 0 or warm.get("real_compiles") != 0:
        return [f"{what}: exit {warm and warm.get('rc')}, {warm and warm.get('compiles')} compiles "
                f"({warm and warm.get('real_compiles')} at the DSL)"]
    if [e[1:] for e in warm["events"]] != [[e[1], "hit"] for e in like["events"]]:
        return [f"{what}: events {warm['events']} after {like['events']}"]
    return [f"{what}: {d}" for d in cm.result_differences(like.get("results"), warm.get("results"))]


def _child(run: Run, *args: str) -> dict[str, Any]:
    t = time.perf_counter()
    proc = run.run(str(CHILD), *args)
    out = cm._json_line(proc) or {"error": f"exit {proc.returncode}: {cm._first_error_line(proc.stderr)}"}
    out["rc"] = proc.returncode
    out["wall_seconds"] = round(time.perf_counter() - t, 1)
    (out.get("counters") or {}).pop("root", None)  # a path of the machine that ran it, not a result
    return out


def judge(doc: dict[str, Any], cold: dict[str, Any], warm: dict[str, Any] | None, rt: dict[str, Any]) -> tuple[str, str]:
    """A refusal must be doctor's reason, and b12x's runtime path must still be proven there."""
    problems = [f"runtime path: {'; '.join(rt['problems'])}"] if rt["status"] != "proven" else []
    if cold["rc"] == 2 and doc.get("prewarm_refused") and doc["prewarm_refused"] in (cold.get("error") or ""):
        if problems:
            return "failed", "; ".join([f"prewarm refused: {doc['prewarm_refused']}", *problems])
        return "refused", doc["prewarm_refused"]
    if cold["rc"] != 0 or cold.get("errors"):
        problems.append(f"prewarm exit {cold['rc']}: {cold.get('error')}")
    elif not cold.get("kernels_compiled") or len(cold["entries"]) != cold["kernels_compiled"]:
        problems.append(f"prewarm compiled {cold.get('kernels_compiled')} kernels, {len(cold['entries'])} entries")
    if warm is None:
        problems.append("no fresh run")
    else:
        hits = sorted(e[1] for e in warm.get("events", []) if e[2] == "hit")
        others = [e for e in warm.get("events", []) if e[2] != "hit"]
        if warm.get("rc") != 0 or warm.get("error"):
            problems.append(f"fresh process exit {warm.get('rc')}: {warm.get('error')}")
        elif warm.get("compiles") != 0 or warm.get("real_compiles") != 0:
            problems.append(f"fresh process made {warm.get('compiles')} compiles ({warm.get('real_compiles')} at the DSL)")
        elif others:
            problems.append(f"fresh process events other than hits: {others[:3]}")
        elif set(hits) != set(cold["entries"]):
            problems.append(f"fresh process hit {len(set(hits))} digests, the prewarm wrote {len(cold['entries'])}, "
                            f"{len(set(hits) ^ set(cold['entries']))} differ")
    if doc.get("rc_strict") != 0:
        problems.append(f"doctor --strict exit {doc.get('rc_strict')}")
    if problems:
        return "failed", "; ".join(problems)
    return "proven", (f"{cold['kernels_compiled']} kernels: fresh process 0 compiles (ours and the DSL's), "
                      f"every one a hit on the prewarm's digest; runtime path: cold 1 compile, fresh 0, same object")


def run_cell(cell: B12xCell, scratch: Path, code: Path = cm.REPO) -> dict[str, Any]:
    t0 = time.perf_counter()
    python = cell_venv(cell, scratch)
    venv_s = time.perf_counter() - t0
    workdir = scratch / "runs" / cell.name
    shutil.rmtree(workdir, ignore_errors=True)
    run = Run(python, code, workdir)
    result: dict[str, Any] = {"cell": cell.name, "b12x": cell.b12x, "dsl": cell.dsl, "layer": cell.layer,
                              "roles": list(cell.roles), "installed": cm.installed_versions(python)}
    result["doctor"] = doc = doctor(run)
    log.info("    doctor: strict exit %s, prewarm refused: %s", doc["rc_strict"], doc["prewarm_refused"])
    result["prewarm"] = cold = prewarm(run)
    log.info("    cold prewarm exit %s: %s kernels compiled in %s s", cold["rc"], cold["kernels_compiled"], cold["wall_seconds"])
    result["fresh"] = warm = fresh(run) if cold["rc"] == 0 else None
    offline = None if doc.get("prewarm_refused") else Run(python, code, workdir / "runtime-offline")
    result["runtime"] = rt = runtime(Run(python, code, workdir / "runtime"), offline)  # their own empty caches
    log.info("    runtime path (%s): %s %s", rt["site"], rt["status"], "; ".join(rt["problems"])[:300])
    status, reason = judge(doc, cold, warm, rt)
    result.update(status=status, reason=reason, machine=cm.machine(), code=cm.code_version(code),
                  date=datetime.date.today().isoformat(),
                  seconds={"venv": round(venv_s, 1), "total": round(time.perf_counter() - t0, 1)})
    return result


# --------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------


def load_results(results: Path = RESULTS) -> list[dict[str, Any]]:
    order = {c.name: i for i, c in enumerate(CELLS)}
    out = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))] if results.is_dir() else []
    return sorted(out, key=lambda r: order.get(r["cell"], len(order)))


def _kernels_text(r: dict[str, Any]) -> str:
    """``7 (compile_fixed; 6144x4096: rows 1 3s, rows 8 1s; ...)``: per linear shape and row capacity,
    the seconds its job took; ``shared`` where the job compiled nothing of its own (b12x's memory
    cache held the kernel another job of the run compiled)."""
    cold = r.get("prewarm") or {}
    if r["status"] != "proven":
        return "-"
    by_shape: dict[str, list[str]] = {}
    for j in cold.get("per_job", []):
        seconds = f"{j['seconds']:.1f}s" if j.get("compiles") else "shared"
        by_shape.setdefault(f"{j['n']}x{j['k']}", []).append(f"rows {j['capacity']} {seconds}")
    factories = sorted({j["factory"].rpartition(":")[2] for j in cold.get("per_job", [])})
    shapes = "; ".join(f"{shape}: {', '.join(parts)}" for shape, parts in by_shape.items())
    return f"{cold['kernels_compiled']} ({', '.join(factories)}; {shapes})"


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| b12x | DSL | stack | why this cell | status | cold prewarm: kernels (job, compile seconds) | "
            "fresh process | runtime path: MXFP8 row quantizer through b12x's getter | doctor --strict | note |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        warm, d = r.get("fresh") or {}, r.get("doctor") or {}
        fresh_text = (f"{warm.get('compiles')} compiles ({warm.get('real_compiles')} at the DSL), {warm.get('hits')} hits"
                      if warm else "-")
        fi = (r.get("installed") or {}).get("flashinfer-python")
        stack = f"flashinfer {fi} cell" if fi else "DSL only"
        strict = "pass" if d.get("rc_strict") == 0 else f"exit {d.get('rc_strict')}" + (
            f": nothing persists {', '.join(d['nothing'])}" if d.get("nothing") else "")
        note = "" if r["status"] == "proven" else r["reason"]
        rt = r.get("runtime") or {}
        rt_text = ("-" if not rt else f"**failed**: {'; '.join(rt['problems'])[:200]}" if rt["status"] != "proven"
                   else f"cold {rt['cold_seconds']:.0f}s; fresh process 0 compiles, same object"
                   + ("; offline worker's entry: same digest, same object" if rt.get("offline") else ""))
        rows.append(f"| {r['b12x']} | {r['dsl']} | {stack} | {', '.join(r['roles'])} | **{r['status']}** | {_kernels_text(r)} | "
                    f"{fresh_text} | {rt_text} | {strict} | {note.replace('|', '/')} |")
    return "\n".join(rows)


def markdown(results: list[dict[str, Any]], info: dict[str, Any] | None) -> list[str]:
    """compat/README.md's b12x section (``main`` hands it to ``compat_matrix.write_markdown``, which keeps it
    when compat_matrix.py rewrites the file)."""
    if not results:
        return []
    counts = {s: sum(r["status"] == s for r in results) for s in ("proven", "refused", "failed")}
    lines = [
        "## b12x x nvidia-cutlass-dsl",
        "",
        "Generated by `python scripts/compat_b12x.py` (one JSON per cell in `b12x/`). The standalone b12x package",
        "(vLLM 0.34's `vllm[b12x]` backends), each release with the DSL its metadata pins, torch 2.13.0 CPU, b12x",
        f"installed without its dependencies. Cold: `prewarm {MODEL} --target {cm.TARGET} --linear-backend b12x --m {MS}`",
        "into an empty cache (one worker); then a fresh process making the calls vLLM's b12x warm-up resolves to",
        "(`scripts/compat_b12x_child.py`) must make 0 compiles (ours and the DSL's `CompileCallable._compile`) and hit",
        "every entry the prewarm wrote. The runtime path, in every cell: b12x's MXFP8 row quantizer through b12x's own",
        "getter into an empty cache as a serving process compiles it, then a fresh process (0 compiles, the same digest,",
        "the same object handed to b12x); where b12x has offline compile workers (>= 1.5.0), also the entry such a worker",
        "writes (as prewarm's do: `no_jit_engine`) loaded by a fresh serving process: the same digest, the same object.",
        "A release prewarm cannot plan is **refused** with doctor's reason; its runtime path must still be proven.",
        "vLLM 0.34.0 pins b12x 1.5.1 with flashinfer-python 0.7.3, which is not on the",
        "package index (`pip download flashinfer-python==0.7.3` fails): the 0.7.4 cell with the same DSL stands in.",
        "Not cells: b12x 1.2.0-1.2.6, 1.1.0 and 0.x (older than 1.2.8, without the planning API as well).",
        "",
    ]
    if info:
        lines += [f"Last run: {info.get('date')}, {info.get('cells')} cells in {info.get('minutes')} min on {info.get('machine')} "
                  f"(code {info.get('code')}).", ""]
    lines += [", ".join(f"{n} {s}" for s, n in counts.items()) + ".", "", table(results)]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", nargs="+", default=["all"], help="cell names or 'all'")
    ap.add_argument("--scratch", type=Path, default=cm.DEFAULT_SCRATCH, help="where the venvs go (shared with compat_matrix.py)")
    ap.add_argument("--code", type=Path, default=cm.REPO, help="the cute-diskcache source tree under test")
    ap.add_argument("--results", type=Path, default=cm.RESULTS, help="where b12x/*.json, run.json and README.md go")
    ap.add_argument("--table-only", action="store_true", help="only regenerate the tables from the results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    by_name = {c.name: c for c in CELLS}
    chosen = list(CELLS) if args.cells == ["all"] else [by_name[n] for n in args.cells]
    out_dir = args.results / "b12x"
    if not args.table_only:
        out_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        cm.run_cells(chosen, lambda cell: run_cell(cell, args.scratch, args.code), out_dir,
                     lambda cell: {"cell": cell.name, "b12x": cell.b12x, "dsl": cell.dsl, "layer": cell.layer,
                                   "roles": list(cell.roles)})
        if len(chosen) == len(CELLS):
            run_json = args.results / "run.json"
            info = json.loads(run_json.read_text()) if run_json.is_file() else {}
            info["b12x"] = {"date": datetime.date.today().isoformat(), "cells": len(chosen),
                            "minutes": round((time.perf_counter() - t0) / 60), "machine": cm.machine(),
                            "code": cm.code_version(args.code)}
            run_json.write_text(json.dumps(info, indent=1) + "\n")
    results = load_results(out_dir)
    run_json = args.results / "run.json"
    info = json.loads(run_json.read_text()) if run_json.is_file() else {}
    cm.write_markdown(cm.load_results(args.results), args.results / "README.md", None,
                      b12x_section=markdown(results, info.get("b12x")))
    print(table(results))
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
