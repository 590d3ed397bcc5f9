"""Issue 31, item 1: how many kernels a flashinfer upgrade could reuse, and what tracing costs.

For consecutive flashinfer releases on one DSL (default: 0.6.14 -> 0.6.15.post1 -> 0.6.16.post4
-> 0.6.17 and 0.7.1 -> 0.7.2.post1 -> 0.7.4, all on nvidia-cutlass-dsl 4.8.1), each release in its
own venv (built by ``scripts/compat_matrix.py``'s machinery under ``--scratch``, this checkout on
``PYTHONPATH``), for the full prewarm plans of qwen3-30b-a3b, gpt-oss-120b and the dense NVFP4
config (llama-3.1-8b-nvfp4), plus the four W4A16 MoE kernels (``scripts/compat_child.py``'s
driver, Qwen3-30B-A3B's layer at m=4), on the ``rtx-pro-6000`` profile:

* **every** kernel of the plan is traced (:func:`cute_diskcache.keys.trace.traced_ir`: the DSL's own
  tracing, stopped before lowering), giving its traced-IR digest (locations stripped) and the
  DSL's own module hash (locations kept);
* a **sample** (``--sample``; default: every micro/static kernel at m <= 3 or m % 10 == 0, every
  dynamic, dense and W4A16 kernel) is also compiled (:func:`cute_diskcache.keys.trace.compile_traced`:
  the digest of what the compile itself lowered), and its cubins and host object hashed as an
  entry would store them (``export.export``, fixed symbol).

Then per release pair: how many kernels of the new release have a traced IR that the old
release's plan already holds (what a second-stage key would reuse), under both notions of
"same"; for the sampled kernels, whether the same IR gave the same cubin and host object; and
the time to trace against the time to compile, per kernel kind, side by side in one process.

    python bench/upgrade_reuse.py                      # all cells (about 1.5 h on 2 cores)
    python bench/upgrade_reuse.py --cells 0.6.14 0.6.15.post1 --models qwen3-30b-a3b
    python bench/upgrade_reuse.py --report-only        # tables from bench/results/upgrade_reuse/
    python bench/upgrade_reuse.py --table              # docs/performance.md's tables from the summary
    python bench/upgrade_reuse.py --child ...          # (internal) one model in one cell's venv

Raw results: ``bench/results/upgrade_reuse/<cell>.json``, written once every model of the
release is done; until then each model's result is written as it finishes
(``<cell>/<model>.json``) and a rerun takes those up instead of running them again. Pairs and ratios:
``bench/results/upgrade_reuse.json``; the tables are printed as Markdown (docs/performance.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "upgrade_reuse"
SUMMARY = REPO / "bench" / "results" / "upgrade_reuse.json"
TARGET = "rtx-pro-6000"
DSL = "4.8.1"
CHAINS = (("0.6.14", "0.6.15.post1", "0.6.16.post4", "0.6.17"), ("0.7.1", "0.7.2.post1", "0.7.4"))
MODELS = ("qwen3-30b-a3b", "gpt-oss-120b", "llama-3.1-8b-nvfp4", "w4a16")
#: Every entry holds this symbol in the bench's exports, so host objects compare by content.
FIXED_DIGEST = "0" * 64


# ============================================================================================
# Child: one model's plan in one release's venv
# ============================================================================================


@dataclasses.dataclass
class _State:
    model: str = ""
    call: tuple[Any, ...] = ()  # the planning call being made: ("moe", m) or ("dense", m, linear, tactic)
    sample: str = "default"
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    text_dir: Path | None = None
    seen_kinds: set[str] = dataclasses.field(default_factory=set)


STATE = _State()


def _sampled(kind: str, m: int | None) -> bool:
    if STATE.sample == "all":
        return True
    if STATE.sample == "none":
        return False
    if kind in ("micro", "static"):
        return m is not None and (m <= 3 or m % 10 == 0)
    return True  # dynamic, b12x_fp4, w4a16: few per plan


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_PURELIB = __import__("sysconfig").get_path("purelib")


def _dsl_state() -> tuple[Any, ...]:
    """What a trace must leave as it found it: the DSL's JIT cache size and its per-compile state."""
    from cutlass.cutlass_dsl import CuTeDSL

    dsl = CuTeDSL._get_dsl()
    return (len(dsl.jit_cache), len(dsl.kernel_info), dsl.num_kernels, dsl.compile_options.to_str())


def _on_request(site: Any, call: Any, compile_fn: Any) -> None:
    """Trace (and, if sampled, compile) one planned kernel: called after the first-stage key was
    built, as a second stage would be (tracing stores traced values on flashinfer's kernel objects)."""
    from cutlass.base_dsl.compiler import CompileCallable

    from cute_diskcache.core import export
    from cute_diskcache.keys import devicefacts, trace
    from cute_diskcache.core import through

    plan = through.PLAN
    digest = plan[-1]["digest"] if plan else None
    # The real DSL compile (cute.compile or cute.compile[options]) and exactly its arguments, as
    # the hook hands them to its compile function (functools.partial(front.through_wrappers, real,
    # options, args, kwargs)); a layout change fails here, loudly.
    real, _options, args, kwargs = compile_fn.args
    if not isinstance(real, CompileCallable):
        raise TypeError(f"expected the DSL's CompileCallable, got {type(real).__name__}")
    m = STATE.call[1] if STATE.call else None
    rec: dict[str, Any] = {"model": STATE.model, "site": site.name, "kind": site.kind, "digest": digest,
                           "call": list(STATE.call), "m": m}
    first_of_kind = site.kind not in STATE.seen_kinds
    STATE.seen_kinds.add(site.kind)
    rec["first_of_kind"] = first_of_kind
    state_before = _dsl_state()
    located: dict[str, Any] = {}

    def locate(dsl: Any, module: Any, function_name: str) -> None:
        """The module with its locations, the install prefix taken out: what a digest that kept
        locations would see in an in-place upgrade (same prefix, lines moved or not)."""
        t0 = time.perf_counter()
        text = module.operation.get_asm(enable_debug_info=True).replace(_PURELIB, "<site-packages>")
        located.update(digest=_sha(text.encode()), seconds=time.perf_counter() - t0)

    try:
        with devicefacts.recording() as facts:
            t = trace.traced_ir(real, *args, keep_text=STATE.text_dir is not None and first_of_kind,
                                trace_finalize_hooks=locate, **kwargs)
        rec.update(located_digest=_sha(f"{located['digest']}{t.dsl_version}{t.settings}{t.options}".encode()),
                   locate_s=round(located["seconds"], 4))
        rec.update(ir_digest=t.ir_digest, dsl_hash=t.dsl_hash, function_name=t.function_name,
                   trace_s=round(t.seconds - located["seconds"], 4),
                   dsl_version=t.dsl_version, options=t.options, settings=t.settings,
                   trace_device_facts=sorted((facts.get("facts") or {}).items()))
        if t.text is not None and STATE.text_dir is not None:
            (STATE.text_dir / f"{STATE.model}-{site.kind}-m{m}.mlir").write_text(t.text)
    except Exception as exc:  # recorded: a kernel that cannot be traced keeps release-scoped keys
        rec["trace_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    rec["dsl_state_kept"] = _dsl_state() == state_before
    if "ir_digest" in rec and _sampled(site.kind, m):
        try:
            with devicefacts.recording() as facts, export.capturing() as objects:
                t0 = time.perf_counter()
                compiled, lowered = trace.compile_traced(real, *args, **kwargs)
                seconds = time.perf_counter() - t0
            art = export.export(compiled, FIXED_DIGEST, seconds, captured=objects, link=False)
            rec.update(compile_s=round(seconds, 4), compiled_ir_digest=lowered.ir_digest if lowered else None,
                       object_sha=_sha(art.object_bytes), cubin_sha=[_sha(c) for c in art.cubins],
                       object_bytes=len(art.object_bytes), tvm_ffi=art.tvm_ffi,
                       compile_device_facts=sorted((facts.get("facts") or {}).items()))
        except Exception as exc:
            rec["compile_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    STATE.records.append(rec)


def _install_probe() -> None:
    from cute_diskcache.core import through
    from cute_diskcache.flashinfer_sites import dense, driving

    real_tc = through.through_cache

    def through_cache(site: Any, call: Any, compile_fn: Any, **kwargs: Any) -> Any:
        before = len(through.PLAN) if through.PLAN is not None else None
        out = real_tc(site, call, compile_fn, **kwargs)
        if before is not None and len(through.PLAN) > before:  # a planned request (keyed)
            _on_request(site, call, compile_fn)
        elif before is not None:
            STATE.records.append({"model": STATE.model, "site": site.name, "kind": site.kind, "unkeyed": True,
                                  "call": list(STATE.call)})
        return out

    through.through_cache = through_cache
    moe_run, dense_run = driving.Dispatcher.run, dense.DenseDispatcher.run

    def run_moe(self: Any, m: int, *a: Any, **k: Any) -> Any:
        STATE.call = ("moe", m)
        return moe_run(self, m, *a, **k)

    def run_dense(self: Any, m: int, index: int | None = None, tactic: Any = None) -> Any:
        STATE.call = ("dense", m, index, None if tactic is None else dense.tactic_text(tactic))
        return dense_run(self, m, index, tactic)

    driving.Dispatcher.run = run_moe
    dense.DenseDispatcher.run = run_dense


def _plan_w4a16() -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    import compat_child

    from cute_diskcache.core import through

    with through.planning():
        for name in compat_child.W4A16_SITES:
            STATE.call = ("w4a16", compat_child.W4A16_M, name)
            try:
                compat_child._w4a16_compile(name)
            except Exception as exc:  # what flashinfer does with a planned stand-in after the compile
                STATE.records.append({"model": "w4a16", "kind": name, "after_compile_error": f"{type(exc).__name__}: {exc}"[:300],
                                      "call": list(STATE.call)})


def child(args: argparse.Namespace) -> int:
    import cute_diskcache

    here = Path(cute_diskcache.__file__).resolve().parent.parent
    if args.code and here != Path(args.code).resolve():
        raise SystemExit(f"cute_diskcache imported from {here}, not {args.code}")
    cute_diskcache.install(target=args.target)
    t_import = time.perf_counter()
    import flashinfer  # noqa: F401

    from cute_diskcache import prewarm
    from cute_diskcache.keys import trace
    from cute_diskcache.flashinfer_sites import flashinfer_version

    import_s = time.perf_counter() - t_import
    STATE.model, STATE.sample = args.child, args.sample
    STATE.text_dir = Path(args.text_dir) if args.text_dir else None
    if STATE.text_dir:
        STATE.text_dir.mkdir(parents=True, exist_ok=True)
    _install_probe()
    t0 = time.perf_counter()
    refused = None
    plan: list[dict[str, Any]] = []
    if args.child == "w4a16":
        _plan_w4a16()
    else:
        pargs = prewarm.build_parser().parse_args([args.child, "--target", args.target, "--dry-run"])
        try:
            shape, dense_shape, _notes, ms = prewarm.resolve(pargs)
            kernels = prewarm.plan_model(pargs, shape, dense_shape, ms, quiet=True)
            plan = [{"digest": k.digest, "kind": k.kind, "group": k.group, "first_m": k.ms[0], "n_m": len(k.ms)}
                    for k in kernels.values()]
        except prewarm.PlanRefused as exc:
            refused = str(exc)
    from importlib.metadata import version

    print(json.dumps({
        "model": args.child, "flashinfer": flashinfer_version(), "dsl": version("nvidia-cutlass-dsl"),
        "trace_unsupported": trace.unsupported(), "refused": refused, "plan": plan, "records": STATE.records,
        "import_s": round(import_s, 2), "wall_s": round(time.perf_counter() - t0, 1),
    }), flush=True)
    return 0


# ============================================================================================
# Parent: venvs, children, comparison
# ============================================================================================


def _cell_python(fi: str, scratch: Path, overrides: dict[str, str]) -> Path:
    if fi in overrides:
        return Path(overrides[fi])
    sys.path.insert(0, str(REPO / "scripts"))
    import compat_matrix

    return compat_matrix.cell_venv(compat_matrix.Cell(fi, DSL), scratch)


def _child_env(code: Path, root: Path) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items()
            if not (k.startswith(("CUTE_DISKCACHE_", "FLASHINFER_WORKSPACE_")) or k in
                    ("FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"))}
    return {**keep, "PYTHONPATH": str(code), "CUTE_DISKCACHE_DIR": str(root / "root"),
            "FLASHINFER_WORKSPACE_BASE": str(root / "workspace")}


def _model_path(cell_path: Path, model: str) -> Path:
    """Where one model's raw result lies until its release is complete (``fi<X>-dsl<Y>/<model>.json``)."""
    return cell_path.with_suffix("") / f"{model}.json"


def run_cell(fi: str, python: Path, models: list[str], sample: str, text_dir: Path | None, cell_path: Path,
             force: bool = False) -> dict[str, Any]:
    """Run each model of one release in its own child, writing each model's raw result as soon as
    it finishes (an interruption loses at most the model in progress); a model whose result is
    already there is read back, not run again, unless ``force``."""
    out: dict[str, Any] = {"flashinfer": fi, "dsl": DSL, "python": str(python), "models": {}}
    for model in models:
        path = _model_path(cell_path, model)
        if path.exists() and not force:
            out["models"][model] = json.loads(path.read_text())
            print(f"  fi {fi} {model}: result exists ({path.parent.name}/{path.name})", flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix="cdc-upgrade-") as tmp:
            cmd = [str(python), str(Path(__file__).resolve()), "--child", model, "--target", TARGET, "--sample", sample,
                   "--code", str(REPO)]
            if text_dir is not None:
                cmd += ["--text-dir", str(text_dir / f"fi{fi}")]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=_child_env(REPO, Path(tmp)), cwd=tmp, capture_output=True, text=True)
            wall = time.perf_counter() - t0
        line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
        if proc.returncode != 0 or line is None:
            result: dict[str, Any] = {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
        else:
            result = json.loads(line)
        result.update(process_wall_s=round(wall, 1), date=time.strftime("%Y-%m-%d %H:%M"), machine=_machine(),
                      sample=sample)
        out["models"][model] = result
        if "error" not in result:  # a failed model is run again next time
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp_path = path.with_suffix(".tmp")
            tmp_path.write_text(json.dumps(result, separators=(",", ":")) + "\n")
            tmp_path.replace(path)
        recs = result.get("records", [])
        print(f"  fi {fi} {model}: {len(recs)} requests, {sum('compile_s' in r for r in recs)} compiled, "
              f"{wall:.0f} s{' ERROR' if 'error' in result else ''}", flush=True)
    return out


def _identity(rec: dict[str, Any]) -> tuple[Any, ...]:
    """A kernel's identity across releases: the model, the site kind and the planning call that
    first requested it (m; for dense kernels the layer and tactic too)."""
    return (rec["model"], rec["kind"], *[json.dumps(c) for c in rec.get("call", [])])


def _kernels(cell: dict[str, Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for model in cell["models"].values():
        seen: set[str] = set()
        for rec in model.get("records", []):
            if rec.get("unkeyed") or "after_compile_error" in rec:
                continue
            if rec.get("digest") in seen:
                continue
            seen.add(rec.get("digest"))
            out.setdefault(_identity(rec), rec)
    return out


def _kind_group(kind: str) -> str:
    return "w4a16" if kind.startswith("w4a16") else kind


def _by_model(cell: dict[str, Any]) -> dict[str, dict[tuple[Any, ...], dict[str, Any]]]:
    out: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {}
    for ident, rec in _kernels(cell).items():
        out.setdefault(rec["model"], {})[ident] = rec
    return out


def compare(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """What ``new``'s kernels could take from ``old``'s entries, per model.

    Reuse is content-addressed: a kernel of ``new`` is reusable when its traced-IR digest is
    among *any* of ``old``'s kernels (of any model: a second-stage key does not know the model).
    Cubins and objects compare kernels of the same identity (model, kind, planning call).
    """
    a_all = _kernels(old)
    digests = {name: {r[name] for r in a_all.values() if name in r} for name in ("ir_digest", "located_digest", "dsl_hash")}
    cubin_of_ir = {r["ir_digest"]: r["cubin_sha"] for r in a_all.values() if "cubin_sha" in r}
    a_models, out = _by_model(old), {}
    for model, b in _by_model(new).items():
        a = a_models.get(model, {})
        row: dict[str, Any] = {"kernels": len(b), "old_kernels": len(a), "refused_before": (old["models"].get(model) or {}).get("refused"),
                               "traced": sum("ir_digest" in r for r in b.values()), "kinds": {}}
        for name, label in (("ir_digest", "same_ir"), ("located_digest", "same_located"), ("dsl_hash", "same_dsl_hash")):
            row[label] = sum(r.get(name) in digests[name] for r in b.values())
        # A reused kernel's cubin against the cubin the old release compiled for that IR.
        row["reused_compared"] = sum(r.get("ir_digest") in cubin_of_ir and "cubin_sha" in r for r in b.values())
        row["reused_same_cubin"] = sum(cubin_of_ir.get(r.get("ir_digest")) == r.get("cubin_sha") for r in b.values()
                                       if r.get("ir_digest") in cubin_of_ir and "cubin_sha" in r)
        pairs = [(a[i], r) for i, r in b.items() if i in a and "cubin_sha" in a[i] and "cubin_sha" in r]
        row["compared"] = len(pairs)
        for ra, rb in pairs:
            same_ir, same_cubin = ra["ir_digest"] == rb["ir_digest"], ra["cubin_sha"] == rb["cubin_sha"]
            key = f"{'same' if same_ir else 'other'}_ir_{'same' if same_cubin else 'other'}_cubin"
            row[key] = row.get(key, 0) + 1
            if same_ir:
                row["same_ir_same_object"] = row.get("same_ir_same_object", 0) + (ra["object_sha"] == rb["object_sha"])
        for r in b.values():
            k = row["kinds"].setdefault(_kind_group(r["kind"]), [0, 0])
            k[0] += r.get("ir_digest") in digests["ir_digest"]
            k[1] += 1
        seconds = [(r.get("compile_s"), r.get("trace_s"), r.get("ir_digest") in digests["ir_digest"]) for r in b.values()]
        if seconds and all(c is not None and t is not None for c, t, _ in seconds):
            row["compile_all_s"] = round(sum(c for c, _, _ in seconds), 1)
            row["trace_all_plus_compile_changed_s"] = round(sum(t + (0 if same else c) for c, t, same in seconds), 1)
        out[model] = row
    for model, info in new["models"].items():  # a model the new release refuses: nothing to reuse or compile
        if model not in out and info.get("refused"):
            out[model] = {"kernels": 0, "old_kernels": len(a_models.get(model, {})), "refused": info["refused"]}
    return out


def timing(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Trace against compile per kind, pooled over every release (each pair from one process,
    the trace just before the compile); the first kernel of a kind in a process apart (it pays
    the DSL's preprocessing of the kernel's Python once)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for cell in cells.values():
        for rec in _kernels(cell).values():
            if "compile_s" in rec and "trace_s" in rec:
                by.setdefault(_kind_group(rec["kind"]), []).append(rec)
    out: dict[str, Any] = {}
    for kind, recs in sorted(by.items()):
        later = [r for r in recs if not r.get("first_of_kind")]
        first = [r for r in recs if r.get("first_of_kind")]
        row: dict[str, Any] = {"compiled": len(recs), "ir_same_in_compile": sum(r.get("compiled_ir_digest") == r["ir_digest"] for r in recs)}
        for label, group in (("later", later), ("first", first)):
            if group:
                row[label] = {"n": len(group), "trace_median_s": round(statistics.median(r["trace_s"] for r in group), 3),
                              "compile_median_s": round(statistics.median(r["compile_s"] for r in group), 3),
                              "ratio_median": round(statistics.median(r["trace_s"] / r["compile_s"] for r in group), 3)}
        out[kind] = row
    return out


def _pairs(cells: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for chain in CHAINS:
        present = [c for c in chain if c in cells]
        pairs += list(zip(present, present[1:]))
        if len(present) > 2:
            pairs.append((present[0], present[-1]))  # an upgrade that skips releases
    return pairs


def _machine() -> str:
    load = os.getloadavg()
    return (f"{platform.machine()}, {platform.processor() or 'cpu'}, {len(os.sched_getaffinity(0))} cores, no GPU; "
            f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at the end")


def _vkey(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.replace(".post", ".").split("."))


def report(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    names = sorted(cells, key=_vkey)
    summary = {"pairs": {f"{a} -> {b}": compare(cells[a], cells[b]) for a, b in _pairs(names)}, "timing": timing(cells)}
    print(markdown(summary))
    return summary


def markdown(summary: dict[str, Any]) -> str:
    """The two tables of docs/performance.md, from a summary (``bench/results/upgrade_reuse.json``):
    per release pair and model, then trace against compile per kind."""
    out = ["| upgrade | model | kernels | same traced IR | per kind (same / all) | same IR, DSL hash recipe with locations (in place) | same DSL hash (other venv) | reused: same cubin | reused: same host object | other IR, same cubin | seconds over the plan: compile all / trace all + compile those with other IR |",
           "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for pair, models in summary["pairs"].items():
        for model, r in models.items():
            if r.get("refused"):
                out.append(f"| {pair} | {model} (new release refuses the model: {r['refused'].split(': ', 1)[-1]}) | 0 | - | - | - | - | - | - | - | - |")
                continue
            if not r["kernels"]:
                continue
            kinds = ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in r["kinds"].items())
            refused = " (old release refuses the model)" if r["refused_before"] else ""
            cost = f"{r['compile_all_s']} / {r['trace_all_plus_compile_changed_s']}" if "compile_all_s" in r else "-"
            out.append(f"| {pair} | {model}{refused} | {r['kernels']} | {r['same_ir']} | {kinds} | {r['same_located']} | {r['same_dsl_hash']} | "
                       f"{r['reused_same_cubin']}/{r['reused_compared']} | {r.get('same_ir_same_object', 0)}/{r.get('same_ir_same_cubin', 0) + r.get('same_ir_other_cubin', 0)} | "
                       f"{r.get('other_ir_same_cubin', 0)}/{r.get('other_ir_same_cubin', 0) + r.get('other_ir_other_cubin', 0)} | {cost} |")
    out += ["", "| kind | compiled (all releases) | trace median s | compile median s | trace / compile (median) | first of its kind in a process: trace / compile s = ratio (median) | compile lowered the traced IR |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for kind, r in summary["timing"].items():
        later, first = r.get("later") or r.get("first"), r.get("first")
        first_text = (f"{first['trace_median_s']:.2f} / {first['compile_median_s']:.2f} = {first['ratio_median']:.2f} (n={first['n']})"
                      if first else "-")
        out.append(f"| {kind} | {r['compiled']} | {later['trace_median_s']:.2f} | {later['compile_median_s']:.2f} | {later['ratio_median']:.2f} | "
                   f"{first_text} | {r['ir_same_in_compile']}/{r['compiled']} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="+", default=[c for chain in CHAINS for c in chain], metavar="FLASHINFER")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--sample", choices=("default", "all", "none"), default="default")
    ap.add_argument("--scratch", type=Path, default=None, help="venvs (default: compat_matrix's)")
    ap.add_argument("--python", action="append", default=[], metavar="FI=PATH", help="use this interpreter for a release")
    ap.add_argument("--text-dir", type=Path, default=None, help="write the first traced module of each kind here (diffs)")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--table", action="store_true", help="print docs/performance.md's tables from the committed summary (writes nothing)")
    ap.add_argument("--results", type=Path, default=None, help="read the cells' results from here (default: bench/results/upgrade_reuse)")
    ap.add_argument("--force", action="store_true", help="rerun releases and models that have results")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--target", default=TARGET, help=argparse.SUPPRESS)
    ap.add_argument("--code", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.table:
        print(markdown(json.loads(SUMMARY.read_text())))
        return 0
    sys.path.insert(0, str(REPO / "scripts"))
    import compat_matrix

    scratch = args.scratch or compat_matrix.DEFAULT_SCRATCH
    overrides = dict(item.split("=", 1) for item in args.python)
    RESULTS.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if not args.report_only:
        for fi in args.cells:
            path = RESULTS / f"fi{fi}-dsl{DSL}.json"
            if path.exists() and not args.force:
                print(f"fi {fi}: results exist ({path.name}); --force to rerun", flush=True)
                continue
            python = _cell_python(fi, scratch, overrides)
            t0 = time.perf_counter()
            cell = run_cell(fi, python, args.models, args.sample, args.text_dir, path, args.force)
            if any("error" in m for m in cell["models"].values()):
                print(f"fi {fi}: a model failed; its release stays unfinished (the others are kept)", flush=True)
                continue
            cell.update(date=time.strftime("%Y-%m-%d %H:%M"), code=commit, machine=_machine(), sample=args.sample,
                        seconds=round(time.perf_counter() - t0, 1))
            path.write_text(json.dumps(cell, indent=None, separators=(",", ":")) + "\n")
            for model in args.models:  # the release's file holds them now
                _model_path(path, model).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                path.with_suffix("").rmdir()
    results = args.results or RESULTS
    cells = {json.loads(p.read_text())["flashinfer"]: json.loads(p.read_text()) for p in sorted(results.glob("fi*.json"))}
    summary = report(cells)
    (SUMMARY if args.results is None else results.parent / SUMMARY.name).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": _machine(), "dsl": DSL, "target": TARGET,
                                   "code": commit,
                                   "cells": {fi: {k: c.get(k) for k in ("date", "code", "machine", "sample", "seconds")} for fi, c in cells.items()},
                                   **summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
