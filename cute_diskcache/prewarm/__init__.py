"""``cute-diskcache prewarm MODEL ...`` (or ``cute-diskcache-prewarm``, ``python -m cute_diskcache.prewarm``):
fill the cache before the engine starts, taking the engine's own flags (``--max-num-batched-tokens``,
``-tp``, ``-dp``, ``--enable-expert-parallel``, ``--dtype``).

Three steps, each done by flashinfer's own code so that a new flashinfer release that selects
kernels differently is followed automatically:

1. **Plan.** Drive ``B12xMoEWrapper`` exactly as vLLM configures it (``use_cuda_graph=True``,
   ``max_num_tokens = max_num_batched_tokens``) for every m the engine can see, with compiles
   intercepted: each site reports the key it would compile and gets a kernel that launches
   nothing. This yields the exact set of keys serving will ask for.
2. **Skip** keys that already have a verified entry.
3. **Compile** the rest in ``--jobs`` worker processes, each driving flashinfer for one
   representative m per missing kernel with the cache on, and checking that the key it
   compiled is the one planned.

The functional path (``b12x_fused_moe``, and the wrapper without CUDA graphs) grows its
workspace with the largest batch seen, and ``max_rows`` in the micro/static keys follows that
history (flashinfer PR #3836). From flashinfer 0.7.4 the workspace grows in power-of-two steps,
so the keys are a finite set; ``--functional`` plans and compiles all of them by driving that
path through every (workspace, m) pair it can meet (:mod:`..flashinfer_sites.functional`).
Before 0.7.4 those keys follow every batch history and ``--functional`` is refused.

The model's NVFP4 linear layers (attention, dense MLPs, shared experts) run flashinfer's dense
FP4 GEMM in vLLM (``mm_fp4(backend="b12x")``, flashinfer's code; ``--linear-backend b12x`` is the
b12x package's instead); their kernels are planned and compiled the same way, by driving
``mm_fp4`` as vLLM does (:mod:`.dense`), and reported apart from the MoE kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

from .. import config

#: Exit codes: 0 all good, 1 some kernels failed, 2 the model or config cannot be prewarmed.
EXIT_FAILED, EXIT_UNSUPPORTED = 1, 2
#: ``"schema"`` of the JSON prewarm prints (the CLI's, :data:`..cli.output.SCHEMA`).
JSON_SCHEMA = 1
#: Relative compile cost by kind (measured on 0.6.15.post1): schedule the long ones first.
_COST = {"dynamic": 4.5, "static": 2.3, "micro": 2.0, "direct_micro": 2.0, "w4a16": 1.5, "b12x_fp4": 1.5}


def _cost(kind: str) -> float:
    """flashinfer's natively cached kernels ("native-static", ...) cost what ours did."""
    return _COST.get(kind.removeprefix("native-"), 3.0)


def parse_ms(text: str) -> list[int]:
    """``"1,2,4-16,128"`` -> sorted unique ints."""
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if a < 1 or b < a:
            raise argparse.ArgumentTypeError(f"bad m range {part!r}")
        out.update(range(a, b + 1))
    return sorted(out)


@dataclass
class Kernel:
    digest: str
    kind: str
    ms: list[int] = field(default_factory=list)
    #: m values to dispatch, from cleared workspaces, so that the last one requests this kernel
    #: (the functional path: a workspace of the right size first); default ``ms[0]`` alone.
    recipe: tuple[int, ...] = ()
    status: str = "planned"  # planned | cached | compiled | failed
    native: bool = False  # flashinfer >= 0.6.18 persists it in its own cache, not ours
    key: Any = None  # the CacheKey the site asked for (ours only)
    path: str | None = None  # native: flashinfer's object file
    seconds: float = 0.0
    bytes: int = 0
    error: str | None = None
    group: str = "moe"  # moe | dense
    call: dict[str, Any] | None = None  # dense: the call that requests it (:mod:`.dense`)
    extra_ok: Any = None  # the site's check of an entry's side data, which a hit applies (ours only)

    def job(self) -> dict[str, Any]:
        """What a worker is sent to request this kernel again."""
        if self.group == "dense":
            return {"dense": self.call}
        return {"moe": list(self.recipe or (self.ms[0],))}


def _dispatcher(shape: Any, max_num_tokens: int, functional: bool = False) -> Any:
    from .. import flashinfer_sites

    return flashinfer_sites.Dispatcher(
        shape.num_experts,
        shape.top_k,
        shape.hidden_size,
        shape.intermediate_size,
        max_num_tokens=max_num_tokens,
        num_local_experts=shape.num_local_experts,
        activation=shape.activation,
        swiglu_alpha=shape.swiglu_alpha,
        swiglu_beta=shape.swiglu_beta,
        swiglu_limit=shape.swiglu_limit,
        quant_mode=shape.quant_mode,
        use_cuda_graph=not functional,
    )


def _calls(d: Any, ms: list[int], functional: bool) -> Any:
    """(recipe, m) for every dispatch planning makes, as it makes it."""
    if not functional:
        for m in ms:
            d.run(m)
            yield (m,), m
        return
    from ..flashinfer_sites import functional as fpath

    reason = fpath.unsupported()
    if reason:
        raise NotImplementedError(f"no --functional plan: {reason}")
    yield from fpath.walk(d.run, ms)


def plan(shape: Any, ms: list[int], max_num_tokens: int, functional: bool = False, progress: Any = None) -> dict[str, Kernel]:
    """Every kernel flashinfer would compile for these m, keyed by digest (this process only).

    ``functional``: the keys of the functional path (and the wrapper without CUDA graphs) for
    every workspace size those m can meet, each with the recipe that requests it again.
    ``progress``: a tqdm-like bar, advanced once per dispatch, told how many kernels so far.
    """
    from ..core import through

    kernels: dict[str, Kernel] = {}
    with through.planning() as requested:
        d = _dispatcher(shape, max_num_tokens, functional)
        if getattr(d, "offline_limit", None):
            raise NotImplementedError(f"no exact offline plan: {d.offline_limit}")
        for req, recipe, m in through.planned_requests(requested, _calls(d, ms, functional), tick(progress, kernels)):
            k = kernels.setdefault(req["digest"], Kernel(req["digest"], req["kind"], native=bool(req.get("native")),
                                                         key=req.get("key"), recipe=recipe, extra_ok=req.get("extra_ok")))
            if req.get("native"):
                k.path = req.get("path")
            if req.get("cached"):  # native: flashinfer's cache already has it
                k.status = "cached"
            k.ms.append(m)
    return kernels


def tick(progress: Any, kernels: dict[str, Any]) -> Callable[[], None] | None:
    """A planning call's progress tick: one step, and how many kernels so far."""
    if progress is None:
        return None

    def after_call() -> None:
        progress.update(1)
        progress.set_postfix(kernels=len(kernels), refresh=False)

    return after_call


def _entry_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else 0


def mark_cached(kernels: dict[str, Kernel]) -> None:
    """Flag kernels the serving engine would hit: the store's own lookup, with every check
    serving applies (trust, links, environment, arch, host CPU, checksums, the site's side
    data), no load."""
    from ..core.cache import default_cache
    from ..storage.store import side_data_refusal

    store = default_cache().store
    for k in kernels.values():
        if k.native:  # flashinfer's own cache; planning already asked it
            if k.status == "cached" and k.path and os.path.isfile(k.path):
                k.bytes = os.path.getsize(k.path)
            continue
        found = store.lookup_or_quarantine(k.key) if k.key is not None else None
        if found is not None and side_data_refusal(found[0]["extra"], k.extra_ok) is None:
            k.status, k.bytes = "cached", _entry_size(store.entry_dir(k.key))


# --------------------------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------------------------


def worker_main(args: argparse.Namespace) -> int:
    """A compile worker: read a job per stdin line (JSON), make its calls with the cache on, report JSON.

    A job is ``{"moe": [m, ...]}`` (the m values to dispatch, the last one requesting the
    kernel) or ``{"dense": {...}}`` (a :mod:`.dense` recipe).
    """
    from ..keys import hostmachine
    from . import models, dense as prewarm_dense
    from ..activation import install
    from ..core.cache import default_cache

    hostmachine.build_for(args.host_machine)  # the parent chose it (:func:`choose_host_machine`)
    install(target=args.target)
    cache = default_cache()
    cache.for_prewarm()
    dispatcher = _dispatcher(models.MoEShape(**json.loads(args.worker_shape)), args.max_num_tokens, args.functional) \
        if args.worker_shape else None
    dense = prewarm_dense.dispatcher(models.DenseShape.from_dict(json.loads(args.worker_dense))) if args.worker_dense else None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        recipe = [int(v) for v in job.get("moe", ())]
        m = recipe[-1] if recipe else int(job["dense"]["m"])
        mark = cache.tally.mark()
        t0 = time.perf_counter()
        error = None
        records: list[dict[str, Any]] = []
        try:
            if "dense" in job:
                prewarm_dense.run(dense, job["dense"])
            elif args.functional:
                from ..flashinfer_sites import functional as fpath

                records = fpath.replay(dispatcher.run, tuple(recipe))
            else:
                records = [dispatcher.run(v) for v in recipe]
        except Exception as exc:  # noqa: BLE001 - reported per kernel; the worker carries on
            error = f"{type(exc).__name__}: {exc}"
        events = [{"digest": e.digest, "outcome": e.outcome, "seconds": e.seconds} for e in cache.tally.since(mark)]
        # flashinfer's natively cached kernels, built (or found) by flashinfer itself.
        events += [{"digest": e["digest"], "outcome": e["outcome"], "seconds": e["seconds"], "path": e.get("path")}
                   for record in records for e in record.get("native", [])]
        print(json.dumps({"m": m, "events": events, "error": error, "seconds": time.perf_counter() - t0,
                          "writable": cache.store.writable}), flush=True)
    return 0


class _Worker:
    def __init__(self, cmd: list[str], out: queue.Queue[tuple[_Worker, dict[str, Any] | None]]) -> None:
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.current: Kernel | None = None
        self._out = out
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._out.put((self, json.loads(line)))
            except ValueError:
                continue
        self._out.put((self, None))  # exited

    def send(self, k: Kernel) -> None:
        self.current = k
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(k.job()) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass


WorkerPool = tuple[list[_Worker], "queue.Queue[tuple[_Worker, dict[str, Any] | None]]"]


def start_workers(shape: Any, args: argparse.Namespace, n: int, dense: Any = None) -> WorkerPool:
    """Start ``n`` compile workers now. prewarm starts them before it plans, so their own start
    (a Python interpreter importing flashinfer, seconds each) overlaps the planning.
    ``shape``: the MoE shape (or None); ``dense``: the dense layers (or None)."""
    cmd = [sys.executable, "-m", "cute_diskcache.prewarm", "--worker", "--max-num-tokens", str(args.max_num_tokens)]
    if shape is not None:
        cmd += ["--worker-shape", json.dumps(shape.as_dict())]
    if dense is not None:
        cmd += ["--worker-dense", json.dumps(dense.as_dict())]
    if args.functional:
        cmd.append("--functional")
    if args.target:
        cmd += ["--target", args.target]
    from ..keys import hostmachine

    if hostmachine.cross():
        cmd += ["--host-machine", hostmachine.current()]
    events: queue.Queue[tuple[_Worker, dict[str, Any] | None]] = queue.Queue()
    return [_Worker(cmd, events) for _ in range(max(1, n))], events


def compile_missing(kernels: list[Kernel], shape: Any, args: argparse.Namespace, progress: Any,
                    pool: WorkerPool | None = None, dense: Any = None) -> None:
    """Compile ``kernels`` in ``args.jobs`` worker processes, longest first, as workers free up.

    ``pool``: workers started earlier (:func:`start_workers`); those beyond what is needed are
    closed at once.
    """
    todo = sorted(kernels, key=lambda k: -_cost(k.kind))
    workers, events = pool if pool is not None else start_workers(shape, args, min(args.jobs, len(todo)), dense)
    closed: set[int] = set()
    for w in workers[len(todo):]:  # more started than there is work for (all of them when nothing is missing)
        w.close()
        closed.add(id(w))
    alive = len(workers)
    from ..storage import entry
    from ..core.cache import default_cache

    store = default_cache().store
    # Digests this run compiled (a recipe's first dispatch may compile another planned kernel).
    compiled_here: dict[str, float] = {}
    while alive:
        w, msg = events.get()
        if id(w) in closed and msg is not None:
            continue  # a worker we let go: only its exit counts
        if msg is None:  # the worker died; what it held failed
            alive -= 1
            if w.current is not None and w.current.status == "planned":
                w.current.status, w.current.error = "failed", f"worker exited with {w.proc.wait()}"
                progress.update(1)
            continue
        if "m" in msg:
            compiled_here.update((e["digest"], e["seconds"]) for e in msg["events"] if e["outcome"] == "miss")
        if "m" in msg and w.current is not None:
            k = w.current
            hit = [e for e in msg["events"] if e["digest"] == k.digest]
            if msg["error"] and not hit:
                k.status, k.error = "failed", msg["error"]
            elif not hit:
                k.status, k.error = "failed", f"flashinfer compiled other keys than planned for m={k.ms[0]}"
            else:
                k.status, k.seconds = {"miss": "compiled", "reused": "reused"}.get(hit[0]["outcome"], "cached"), hit[0]["seconds"]
                if k.digest in compiled_here:  # compiled by this run (maybe by another recipe first)
                    k.status, k.seconds = "compiled", compiled_here[k.digest]
                if k.native:
                    native_obj = Path(hit[0]["path"]) if hit[0].get("path") else None
                    k.path = str(native_obj) if native_obj else None
                    k.bytes = native_obj.stat().st_size if native_obj and native_obj.is_file() else 0
                elif not msg.get("writable", True):
                    k.status, k.error = "failed", "compiled but the cache root is not writable"
                if k.key is not None and (store.entry_dir(k.key) / entry.MANIFEST).exists():
                    k.bytes = _entry_size(store.entry_dir(k.key))
            w.current = None
            progress.update(1)
        for done in [t for t in todo if t.digest in compiled_here and not t.native]:
            todo.remove(done)  # already compiled on the way to another kernel
            done.status, done.seconds = "compiled", compiled_here[done.digest]
            if done.key is not None:
                done.bytes = _entry_size(store.entry_dir(done.key))
            progress.update(1)
        if todo:
            w.send(todo.pop(0))
        elif id(w) not in closed:
            w.close()
            closed.add(id(w))


def _stop(pool: WorkerPool | None) -> None:
    """Let early-started workers go (planning refused or found nothing to compile)."""
    for w in pool[0] if pool is not None else []:
        w.close()
        try:
            w.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            w.proc.kill()


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _counts(kernels: list[Kernel]) -> dict[str, Any]:
    by = lambda s: [k for k in kernels if k.status == s]  # noqa: E731 - a one-line filter, read where it is used
    kinds: dict[str, int] = {}
    for k in kernels:
        kinds[k.kind] = kinds.get(k.kind, 0) + 1
    return {
        "kernels": len(kernels),
        "by_kind": kinds,
        "already_cached": len(by("cached")),
        "compiled": len(by("compiled")),
        "reused": len(by("reused")),  # from an entry with the same traced IR (another release's, or another key's)
        "failed": len(by("failed")),
        "compile_seconds": round(sum(k.seconds for k in by("compiled")), 2),
        "bytes": sum(k.bytes for k in kernels),
    }


def _summary(kernels: dict[str, Kernel], wall: float) -> dict[str, Any]:
    """Totals, and the MoE and dense kernels apart (``groups``)."""
    everything = list(kernels.values())
    return {
        **_counts(everything),
        "wall_seconds": round(wall, 2),
        "groups": {group: _counts([k for k in everything if k.group == group]) for group in ("moe", "dense")},
        "failures": [{"digest": k.digest, "kind": k.kind, "group": k.group, "m": k.ms[0], "error": k.error}
                     for k in everything if k.status == "failed"],
    }


def _print_table(shape: Any, dense: Any, kernels: dict[str, Kernel], summary: dict[str, Any], dry: bool,
                 notes: list[str] = ()) -> None:  # type: ignore[assignment]
    if shape is not None:
        print(f"model {shape.model}: E={shape.num_experts} (local {shape.num_local_experts}) top_k={shape.top_k} "
              f"hidden={shape.hidden_size} intermediate/rank={shape.intermediate_size} {shape.activation} {shape.quant_mode}")
    if dense is not None:
        print(f"dense layers ({dense.model}, {dense.quant_mode}, out {dense.out_dtype}): "
              + ", ".join(f"{lin.name} {lin.n}x{lin.k}" for lin in dense.linears))
    for note in notes:
        print(f"  ({note})")
    print(f"{'kind':<15}{'kernels':>8}  first needed at m")
    order = ["micro", "static", "dynamic"]

    def rank(kind: str) -> tuple[bool, int, str]:
        base = kind.removeprefix("native-")
        return (kind.startswith("native-"), order.index(base) if base in order else len(order), kind)

    kinds = sorted({k.kind for k in kernels.values()}, key=rank)
    for kind in kinds:
        ks = [k for k in kernels.values() if k.kind == kind]
        ms = sorted({m for k in ks for m in k.ms})
        print(f"{kind:<15}{len(ks):>8}  {ms[0]}..{ms[-1]} ({len(ms)} m)")
    if any(k.native for k in kernels.values()):
        print("(native-*: persisted by flashinfer's own cache, prewarmed through it)")
    if any(k.group == "dense" for k in kernels.values()):
        print("(b12x_fp4: the dense layers' kernels; one serves every layer shape and batch size of its tactic)")
    if dry:
        return
    for group, title in (("moe", "MoE"), ("dense", "dense")):
        g = summary["groups"][group]
        if g["kernels"]:
            print(f"{title + ':':<7}kernels {g['kernels']}  already cached {g['already_cached']}  compiled {g['compiled']}  "
                  + (f"reused {g['reused']}  " if g["reused"] else "")
                  + f"failed {g['failed']}  compile {g['compile_seconds']:.1f} s  size {g['bytes'] / 1e6:.1f} MB")
    mb = summary["bytes"] / 1e6
    print(f"\nkernels {summary['kernels']}  already cached {summary['already_cached']}  compiled {summary['compiled']}  "
          + (f"reused {summary['reused']} (same traced IR as a cached entry)  " if summary["reused"] else "")
          + f"failed {summary['failed']}  wall {summary['wall_seconds']:.1f} s  compile {summary['compile_seconds']:.1f} s  "
          f"size {mb:.1f} MB")
    for f in summary["failures"]:
        print(f"  FAILED {f['kind']} m={f['m']} {f['digest'][:12]}: {f['error']}")


def where_written(kernels: dict[str, Kernel]) -> dict[str, Any]:
    """Where the kernels a serving engine will load now are: the root, entries per namespace,
    bytes (ours), and how many flashinfer keeps in its own cache (``native``)."""
    from ..core.cache import default_cache

    ours = [k for k in kernels.values() if not k.native and k.key is not None and k.status in ("compiled", "cached", "reused")]
    namespaces: dict[str, int] = {}
    for k in ours:
        namespaces[k.key.env.namespace] = namespaces.get(k.key.env.namespace, 0) + 1
    return {"root": str(default_cache().store.root), "namespaces": namespaces, "entries": len(ours),
            "bytes": sum(k.bytes for k in ours), "native": sum(1 for k in kernels.values() if k.native and k.status != "failed")}


def _cpu_extras() -> list[str]:
    """What the entries written here need beyond the default baseline (none unless
    ``CUTE_DISKCACHE_HOST_CPU`` asked for native or a wider baseline)."""
    from ..keys import hostcpu

    return hostcpu.written_beyond_baseline()


def _host_machine() -> str:
    from ..keys import hostmachine

    return hostmachine.current()


def _ranges(ms: list[int]) -> str:
    """``[1, 2, 3, 8]`` -> ``"1-3,8"`` (what :func:`parse_ms` reads)."""
    parts: list[str] = []
    for m in ms:
        if parts and m == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{m}"
        else:
            parts.append(str(m))
    return ",".join(parts)


def argv_of_plan(args: argparse.Namespace) -> list[str]:
    """The plan flags of ``args`` (:func:`add_plan_arguments`) as a command line, defaults left out."""
    out = [str(args.model)]
    out += ["-tp", str(args.tp)] if args.tp != 1 else []
    out += ["-dp", str(args.dp)] if getattr(args, "dp", 1) != 1 else []
    out += ["--enable-expert-parallel"] if getattr(args, "enable_expert_parallel", False) else []
    out += ["--ep", str(args.ep)] if args.ep != 1 else []
    out += ["--max-num-batched-tokens", str(args.max_num_tokens)]
    out += ["--dtype", args.dtype] if getattr(args, "dtype", "auto") != "auto" else []
    out += ["--m", _ranges(args.m)] if args.m else []
    out += ["--target", args.target] if args.target else []
    out += ["--host-machine", args.host_machine] if getattr(args, "host_machine", None) else []
    out += ["--functional"] if args.functional else []
    out += ["--no-dense"] if not args.dense else []
    out += ["--no-autotune"] if not args.autotune else []
    out += ["--linear-backend", "b12x"] if getattr(args, "linear_backend", "flashinfer") == "b12x" else []
    out += ["--moe-backend", "b12x"] if getattr(args, "moe_backend", "flashinfer_b12x") == "b12x" else []
    if getattr(args, "engine", "vllm") == "sglang":
        out += ["--engine", "sglang", "--attention-backend", str(args.attention_backend), "--page-size", str(args.page_size)]
        out += ["--context-length", str(args.context_length)] if args.context_length else []
        out += ["--max-running-requests", str(args.max_running_requests)] if args.max_running_requests else []
        out += ["--cuda-graph-max-bs", str(args.cuda_graph_max_bs)] if args.cuda_graph_max_bs else []
        out += ["--cuda-graph-bs", *map(str, args.cuda_graph_bs)] if args.cuda_graph_bs else []
    return out


def print_next_steps(written: dict[str, Any], cpu_extras: list[str], plan_argv: list[str], host_machine: str | None = None) -> None:
    """Prewarm's closing lines: where it wrote, what to serve with, how to gate a deploy, and a
    build CPU whose extensions common serving CPUs lack (every entry would miss there)."""
    import shlex

    from ..keys import hostmachine

    root = written["root"]
    print(f"\nwrote to {root}: {written['entries']} entr{'y' if written['entries'] == 1 else 'ies'} ({written['bytes'] / 1e6:.1f} MB)"
          + (f", {written['native']} more in flashinfer's own cache" if written["native"] else ""))
    for ns, n in sorted(written["namespaces"].items()):
        print(f"  {n:>5}  {ns}")
    print(f"next: serve with FLASHINFER_B12X_DISK_CACHE=1 CUTE_DISKCACHE_DIR={shlex.quote(root)}")
    print(f"      gate a deploy with: cute-diskcache --root {shlex.quote(root)} check {shlex.join(plan_argv)}"
          + ("  (on the serving host, without --target: its GPU decides)" if "--target" in plan_argv else ""))
    if host_machine and host_machine != hostmachine.here():
        print(f"note: the entries hold {host_machine} host code (cross-built on this {hostmachine.here()} machine) for "
              f"{host_machine} serving hosts; this machine cannot load them, and the check above answers for an "
              f"{host_machine} host here too")
    from ..keys import hostcpu

    code = hostcpu.host_code()
    if cpu_extras:
        print(f"note: {hostcpu.env_name()}={code.name}: the host code needs {', '.join(cpu_extras)}, beyond "
              f"{hostcpu.DEFAULT_BASELINE.get(code.machine)}; a serving host whose CPU lacks any of them will not use the "
              f"entries (a host-cpu miss; 'cute-diskcache check' there names them). Unset it for portable host code.")
    else:
        print(f"host code: {code.name} (any {code.machine} serving host with {code.name}'s extensions runs it; "
              f"{hostcpu.env_name()}=native tunes it for this CPU instead)")


def add_plan_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags that decide which kernels a model needs (model, parallelism, batch sizes,
    target, paths): prewarm's, and ``cute-diskcache check``'s, so the two plan the same set."""
    # vLLM's names (`vllm serve MODEL --max-num-batched-tokens N -tp 2`), so a launch command's
    # flags can be pasted; the names prewarm had before stay as aliases.
    ap.add_argument("model", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
                    help="local dir / config.json, Hugging Face repo id, or bundled name (--list-models); as `vllm serve MODEL`")
    ap.add_argument("--model", dest="model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tensor-parallel-size", "-tp", "--tp", "--tp-size", dest="tp", type=int, default=1, metavar="N",
                    help="the engine's tensor parallel size (shards the MoE intermediate size and the dense layers)")
    ap.add_argument("--data-parallel-size", "-dp", dest="dp", type=int, default=1, metavar="N",
                    help="the engine's data parallel size: vLLM shards the MoE layers over tp x dp ranks")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="as vLLM's: the MoE layers' tp x dp ranks each hold whole experts instead of a slice of every expert")
    ap.add_argument("--ep", type=int, default=1, metavar="N",
                    help="explicit expert parallel size of the MoE layers (overrides the vLLM-style computation)")
    ap.add_argument("--max-num-batched-tokens", "--max-num-tokens", dest="max_num_tokens", type=int, default=8192, metavar="N",
                    help="the engine's max_num_batched_tokens: it sizes the kernels, so it must match the engine's (default 8192)")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "half"), default="auto",
                    help="the engine's activation dtype (vLLM's --dtype): the dense GEMMs' output dtype (default: the checkpoint's)")
    ap.add_argument("--m", type=parse_ms, default=None, help="token counts to cover, e.g. 1-8,16,128 (default 1..max-num-batched-tokens)")
    ap.add_argument("--target", default=config.text("target"), help="device profile to compile for (no GPU needed)")
    ap.add_argument("--host-machine", default=None, metavar="MACHINE",
                    help="the serving host's CPU architecture, x86_64 or aarch64, whose host code the entries hold "
                         "(default: the target's: aarch64 for dgx-spark, x86_64 for the RTX cards)")
    ap.add_argument("--functional", action="store_true",
                    help="flashinfer >= 0.7.4: the keys of the functional b12x_fused_moe path (and the wrapper without "
                         "CUDA graphs) for every workspace size those m can meet, instead of the CUDA-graph wrapper's")
    ap.add_argument("--no-dense", dest="dense", action="store_false",
                    help="skip the model's NVFP4 linear layers (flashinfer's b12x dense GEMM); MoE kernels only")
    ap.add_argument("--linear-backend", choices=("flashinfer", "b12x"), default="flashinfer",
                    help="whose dense NVFP4 linear kernels: flashinfer's b12x GEMM (default) or the b12x package's "
                         "(vLLM's --linear-backend b12x; needs b12x installed and --target)")
    ap.add_argument("--moe-backend", choices=("flashinfer_b12x", "b12x"), default="flashinfer_b12x",
                    help="whose fused-MoE kernels: flashinfer's b12x MoE (default) or the b12x package's (vLLM's "
                         "--moe-backend b12x; its MoE kernels only; needs b12x installed and --target)")
    # SGLang's names (`python -m sglang.launch_server --model-path MODEL --attention-backend fa4 --tp-size 2 ...`).
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm",
                    help="whose engine start to plan: vLLM's (default) or SGLang's (its FA4 decode kernels on sm12x; "
                         "needs SGLang installed, --target and --attention-backend fa4)")
    ap.add_argument("--attention-backend", default=None, metavar="NAME", help="as SGLang's; --engine sglang plans fa4")
    ap.add_argument("--page-size", type=int, default=1, metavar="N", help="as SGLang's --page-size (default 1)")
    ap.add_argument("--context-length", type=int, default=None, metavar="N",
                    help="as SGLang's: the static max_seqlen_k of its SM12x decode (default: the model's max_position_embeddings)")
    ap.add_argument("--max-running-requests", type=int, default=None, metavar="N",
                    help="as SGLang's: caps the decode CUDA-graph batch sizes")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None, metavar="N",
                    help="as SGLang's (default: SGLang's for the target's memory and --tp-size)")
    ap.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None, metavar="BS",
                    help="as SGLang's: the decode CUDA-graph batch sizes, instead of SGLang's list up to --cuda-graph-max-bs")
    ap.add_argument("--no-autotune", dest="autotune", action="store_false",
                    help="the engine does not autotune flashinfer (vLLM: enable_flashinfer_autotune=False, -O0): plan "
                         "only the dense GEMM's default tactics, not every tactic the tuner runs")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cute-diskcache-prewarm", description="Fill the cute-diskcache before the engine starts.")
    add_plan_arguments(ap)
    add_run_arguments(ap)
    ap.add_argument("--root", metavar="DIR", help="cache root to fill (default: as the serving process resolves it)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("-v", "--verbose", action="count", default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-shape", help=argparse.SUPPRESS)
    ap.add_argument("--worker-dense", help=argparse.SUPPRESS)
    return ap


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """What prewarm does with the plan (``cute-diskcache prewarm`` adds these and the plan's;
    ``--root``, ``--json`` and ``-v`` are the CLI's global options there)."""
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile workers (default: one per CPU)")
    ap.add_argument("--dry-run", action="store_true", help="list the kernels, compile nothing")
    ap.add_argument("--verify", action="store_true", help="on the real GPU: dispatch every m again and report compiles")
    ap.add_argument("--list-models", action="store_true", help="list bundled model configs")


def moe_parallelism(args: argparse.Namespace) -> tuple[int, int]:
    """(tp, ep) of the MoE layers, as vLLM's ``FusedMoEParallelConfig.make`` derives them: over
    tp x dp ranks, sliced (tp) or, with ``--enable-expert-parallel``, whole experts (ep).
    An explicit ``--ep`` keeps prewarm's older meaning: tp slices and ep experts."""
    tp, dp, ep = args.tp, getattr(args, "dp", 1), args.ep
    if tp < 1 or dp < 1 or ep < 1:
        raise _models().ModelConfigError("--tensor-parallel-size, --data-parallel-size and --ep must be >= 1")
    if ep > 1:
        return tp, ep
    world = tp * dp
    return (1, world) if getattr(args, "enable_expert_parallel", False) and world > 1 else (world, 1)


def _models() -> Any:
    from . import models

    return models


def _shapes(args: argparse.Namespace) -> tuple[Any, Any, list[str]]:
    """(MoE shape or None, dense layers or None, notes) for ``--model``; raises the models'
    errors when neither can be prewarmed (the MoE path's error first: it is what refuses a
    checkpoint flashinfer's sm12x kernels cannot run)."""
    from . import models

    cfg, _where = models.load_config(args.model)
    moe = dense = None
    notes: list[str] = []
    if models.is_moe(cfg) or not args.dense:
        moe_tp, moe_ep = moe_parallelism(args)
        moe = models.moe_shape(args.model, tp=moe_tp, ep=moe_ep)
    if args.dense:
        try:
            dense = models.dense_shape(args.model, tp=args.tp).with_dtype(getattr(args, "dtype", "auto"))
        except (models.ModelConfigError, models.UnsupportedModelError) as exc:
            if moe is None:
                raise
            notes.append(f"dense layers not planned: {exc}")
        if dense is not None and not dense.linears:
            notes.append("dense layers not planned: the checkpoint leaves every linear layer unquantized")
            dense = None
    return moe, dense, notes


class PlanRefused(Exception):
    """The model, flags or stack cannot be planned (exit 2): one line that says why."""


def choose_host_machine(args: argparse.Namespace) -> str:
    """Key (and write) host code in this process for the machine the target's card is served
    from (:mod:`..keys.hostmachine`): the target profile's, or ``--host-machine``. Whether this
    machine can write it is asked after the profile is applied (:func:`cross_refusal`)."""
    from ..keys import hostmachine, targets

    override = getattr(args, "host_machine", None)
    try:
        machine = hostmachine.for_target(targets.get(args.target).host_machines if args.target else (), override)
    except hostmachine.UnknownMachineError as exc:
        raise PlanRefused(str(exc)) from None
    if not args.target and machine != hostmachine.here():
        raise PlanRefused(f"--host-machine {override} needs --target: without one, this machine's GPU and CPU are the ones served")
    hostmachine.build_for(machine)
    return machine


def cross_refusal(args: argparse.Namespace, root: str) -> str | None:
    """Why this machine cannot write the host code the target needs (one line naming the way
    that works: an arm64 build under emulation, the exact command), or None. Asked after the
    target profile is applied, before anything is compiled: the DSL is imported to answer."""
    import shlex

    from ..core import crossbuild
    from ..keys import hostmachine

    if not hostmachine.cross():
        return None
    machine = hostmachine.current()
    why = crossbuild.refusal(machine)
    if why is None:
        return None
    platform = {"aarch64": "linux/arm64", "x86_64": "linux/amd64"}[machine]
    command = (f"docker run --rm --platform {platform} -v {shlex.quote(root)}:/cache -e CUTE_DISKCACHE_DIR=/cache "
               f"<your {platform} serving image> cute-diskcache prewarm {shlex.join(argv_of_plan(args))}")
    return (f"target {args.target} is served from an {machine} host and this machine is {hostmachine.here()}: its entries must "
            f"hold {machine} host code, and this DSL cannot write it here ({why}); nothing was compiled. Prewarm in a "
            f"{platform} environment instead, e.g. under emulation on this machine: {command} "
            f"(docs/targets.md, 'Another host machine')")


def _raised_in_flashinfer(exc: BaseException) -> bool:
    """Whether flashinfer's own code raised ``exc`` (its refusal of a configuration), not ours:
    only then is it the user's answer rather than a bug to show with its traceback."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}flashinfer{os.sep}" in tb.tb_frame.f_code.co_filename


def resolve(args: argparse.Namespace) -> tuple[Any, Any, list[str], list[int]]:
    """(MoE shape or None, dense layers or None, notes, m values) for the plan flags of
    :func:`add_plan_arguments`; :class:`PlanRefused` when they cannot be planned."""
    from . import models
    from ..keys import targets

    if not args.model:
        raise PlanRefused("which model? give MODEL, as to `vllm serve MODEL` (bundled names: --list-models)")
    refusal = targets.refusal(args.target)
    if refusal is not None:
        raise PlanRefused(refusal)
    choose_host_machine(args)
    try:
        shape, dense, notes = _shapes(args)
    except (models.ModelConfigError, models.UnsupportedModelError) as exc:
        raise PlanRefused(str(exc)) from None
    ms = args.m or list(range(1, args.max_num_tokens + 1))
    if max(ms) > args.max_num_tokens:
        raise PlanRefused(f"m={max(ms)} exceeds --max-num-batched-tokens {args.max_num_tokens}")
    if args.functional and shape is None:
        raise PlanRefused("--functional plans the MoE path; this model has no MoE layers")
    return shape, dense, notes, ms


def stack_refusal() -> str | None:
    """Why this flashinfer + DSL cannot compile these kernels (the matrix proved it), or None."""
    from ..flashinfer_sites import compat

    return f"cute-diskcache refuses {compat.refusal()}" if compat.refusal() else None


def plan_model(args: argparse.Namespace, shape: Any, dense: Any, ms: list[int], *, quiet: bool = False) -> dict[str, Kernel]:
    """Every kernel the model needs for these m (MoE, then dense), as serving will ask for them,
    with progress bars on stderr unless ``quiet``. The cache must be installed (:func:`..install`)
    and this process must not serve afterwards. :class:`PlanRefused` when flashinfer refuses the
    configuration or requests no kernel we cover."""
    from .progress import bar

    name = (shape or dense).model
    kernels: dict[str, Kernel] = {}
    try:
        # Its own line from the start: importing flashinfer takes seconds before the first m.
        if shape is not None:
            with bar(None if args.functional else len(ms), "planning MoE", "m", disable=quiet) as planning_bar:
                kernels.update(plan(shape, ms, args.max_num_tokens, args.functional, progress=planning_bar))
        if dense is not None:
            from . import dense as prewarm_dense

            def new_kernel(digest: str, kind: str, key: Any, recipe: dict[str, Any]) -> Kernel:
                return Kernel(digest, kind, key=key, group="dense", call=recipe)

            with bar(None, "planning dense", "calls", disable=quiet) as planning_bar:
                dense_kernels: dict[str, Kernel] = {}
                prewarm_dense.plan(dense, ms, args.max_num_tokens, args.autotune, new_kernel, dense_kernels,
                                   after_call=tick(planning_bar, dense_kernels))
                kernels.update(dense_kernels)
    except NotImplementedError as exc:  # flashinfer's own refusal, e.g. EP on 0.6.x
        raise PlanRefused(f"flashinfer cannot serve {name} this way: {exc}") from None
    except ValueError as exc:  # flashinfer's validation of a shape (0.7.4: gpt-oss's hidden 2880 is no multiple of 128)
        if not _raised_in_flashinfer(exc):
            raise
        raise PlanRefused(f"flashinfer cannot serve {name} this way: {exc}") from None
    if not kernels:
        quant = (shape or dense).quant_mode
        raise PlanRefused(f"flashinfer requested no kernel cute-diskcache covers for {name} (quant {quant}); nothing to prewarm")
    return kernels


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args)
    return run(args)


def console() -> int:
    """The ``cute-diskcache-prewarm`` command (pyproject's script): :func:`main` in a process of its
    own, which ends once its exit handlers have run (:mod:`..fast_exit`)."""
    from ..fast_exit import end

    return end(main())


def run(args: argparse.Namespace) -> int:
    """Prewarm as parsed by :func:`build_parser` or ``cute-diskcache prewarm`` (same flags);
    ``--root`` is the cache root for this run and its workers."""
    root = getattr(args, "root", None)
    if root:
        name = config.env_name("root")  # the workers inherit the root through the environment
        previous = os.environ.get(name)
        os.environ[name] = str(Path(root).expanduser())
        try:
            return _run(args)
        finally:
            if previous is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = previous
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from . import models

    if args.list_models:
        print("\n".join(models.bundled()))
        return 0
    if getattr(args, "engine", "vllm") == "sglang":
        from . import sglang as prewarm_sglang

        return prewarm_sglang.run(args)
    if getattr(args, "moe_backend", "flashinfer_b12x") == "b12x":
        from . import b12x_moe

        return b12x_moe.run(args)
    if getattr(args, "linear_backend", "flashinfer") == "b12x":
        from . import b12x as prewarm_b12x

        return prewarm_b12x.run(args)
    from . import vllm as prewarm_vllm

    try:
        shape, dense, notes, ms = resolve(args)
    except PlanRefused as exc:
        skinny = None if args.verify else prewarm_vllm.resolve(args)
        if skinny is None or not skinny.configs:
            return refuse(args, str(exc))
        return prewarm_vllm.run_alone(args, skinny, str(exc))  # a BF16 checkpoint: vLLM's own kernels only
    if args.verify:
        return verify(shape, ms, args, dense)

    from ..activation import install

    if stack_refusal():  # the matrix shows this flashinfer + DSL cannot compile these kernels
        return refuse(args, str(stack_refusal()))
    t0 = time.perf_counter()
    install(target=args.target)
    from ..core.cache import default_cache

    default_cache().for_prewarm()  # the planner reports for itself: no engine attach line or summary
    cannot = cross_refusal(args, str(default_cache().store.root))
    if cannot:
        return refuse(args, cannot)
    pool = None if args.dry_run else start_workers(shape, args, args.jobs, dense)
    try:
        kernels = plan_model(args, shape, dense, ms, quiet=args.json)
    except PlanRefused as exc:
        _stop(pool)
        return refuse(args, str(exc))
    mark_cached(kernels)
    if not args.dry_run:
        from .progress import bar

        missing = [k for k in kernels.values() if k.status == "planned"]
        with bar(len(missing), "compiling", "kernels", disable=args.json or not missing) as compiling:
            compile_missing(missing, shape, args, compiling, pool, dense)
    skinny = prewarm_vllm.resolve(args)
    skinny_summary = prewarm_vllm.run(args, skinny) if skinny is not None and skinny.configs else None
    summary = _summary(kernels, time.perf_counter() - t0)
    if skinny_summary is not None:
        summary["vllm_skinny_gemm"] = skinny_summary
        summary["failed"] += skinny_summary["errors"]
    summary["model"] = shape.as_dict() if shape is not None else None
    summary["dense_layers"] = dense.as_dict() if dense is not None else None
    summary["notes"] = notes
    summary["target"] = args.target
    summary["host_machine"] = _host_machine()
    summary["functional"] = args.functional
    summary["autotune"] = args.autotune
    if not args.dry_run:
        summary["written"] = prewarm_vllm.with_written(where_written(kernels), skinny_summary)
        summary["host_cpu_beyond_baseline"] = _cpu_extras()
    if args.json:
        summary["kernel_list"] = [{"digest": k.digest, "kind": k.kind, "group": k.group, "ms": k.ms, "status": k.status,
                                   "native": k.native, "seconds": round(k.seconds, 3),
                                   "recipe": list(k.recipe) if k.group == "moe" else k.call}
                                  for k in kernels.values()]
        print(json.dumps({"schema": JSON_SCHEMA, **summary}, indent=1))
    else:
        _print_table(shape, dense, kernels, summary, args.dry_run, notes)
        if skinny_summary is not None:
            print("\n".join(prewarm_vllm.lines(skinny_summary, (shape or dense).model, args.target, args.dry_run)))
        if not args.dry_run:
            print_next_steps(summary["written"], summary["host_cpu_beyond_baseline"], argv_of_plan(args), summary["host_machine"])
    return EXIT_FAILED if summary["failed"] else 0


def verify(shape: Any, ms: list[int], args: argparse.Namespace, dense: Any = None) -> int:
    """On the real GPU, in a fresh process: dispatch every m (MoE and dense, the dense layers'
    tuner candidates too); any compile is a prewarm gap."""
    import torch

    if args.target or not torch.cuda.is_available():
        return refuse(args, "--verify runs flashinfer for real and needs the target GPU (and no --target)")
    from ..activation import install
    from ..core.cache import default_cache

    install()
    records = []
    if shape is not None:
        d = _dispatcher(shape, args.max_num_tokens, args.functional)
        if args.functional:  # every workspace size again, as planning met them
            from ..flashinfer_sites import functional as fpath

            for _recipe, _m in fpath.walk(lambda m: records.append(d.run(m)), ms):
                pass
        else:
            records = [d.run(m) for m in ms]
    if dense is not None:
        from . import dense as prewarm_dense

        for _call in prewarm_dense.calls(prewarm_dense.dispatcher(dense), ms, args.max_num_tokens, args.autotune):
            pass
    native = [e for r in records for e in r.get("native", [])]  # flashinfer's own cache (0.6.18+)
    native_compiles = sum(1 for e in native if e["outcome"] == "miss")
    counters = default_cache().counters
    return report_verify({"m": len(ms), "hits": counters.hits, "compiles": counters.compiles,
                          "native_hits": len(native) - native_compiles, "native_compiles": native_compiles},
                         as_json=args.json, native=bool(native))


def report_verify(result: dict[str, int], *, as_json: bool, native: bool = False) -> int:
    """``--verify``'s verdict: words, or one JSON object with ``--json``; exit 1 on any compile."""
    gap = bool(result["compiles"] or result["native_compiles"])
    if as_json:
        print(json.dumps({"schema": JSON_SCHEMA, **result}))
    else:
        print(f"verified {result['m']} batch sizes on this GPU: {result['hits']} disk hits, {result['compiles']} compiles"
              + (f"; flashinfer's own cache: {result['native_hits']} hits, {result['native_compiles']} compiles" if native else ""))
        print("every kernel came from the cache" if not gap else
              "GAP: serving would compile the kernels counted above; prewarm with the engine's exact flags")
    return EXIT_FAILED if gap else 0


def refuse(args: argparse.Namespace, message: str) -> int:
    """A plan or configuration prewarm cannot serve: one line on stderr (with ``--json``, a JSON
    object there, ``"schema"`` and ``"error"``, so stdout holds only results); exit 2."""
    if getattr(args, "json", False):
        print(json.dumps({"schema": JSON_SCHEMA, "error": message}), file=sys.stderr)
    else:
        print(f"error: {message}", file=sys.stderr)
    return EXIT_UNSUPPORTED

