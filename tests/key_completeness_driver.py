"""Child process for tests/test_key_completeness.py: plan one model, or serve its planned kernels.

Run with either flashinfer interpreter (the main one, or the 0.7.4 venv), never imported by pytest.
Prints one JSON line.

``plan MODEL``: prewarm's own dry run (``cute-diskcache-prewarm MODEL --dry-run --json``, the
README's flags), then a walk of what flashinfer memoised while planning. Each planned key
handed flashinfer its own ``PlannedKernel(digest)`` (:mod:`cute_diskcache.core.through`),
so flashinfer's memo dicts say which of our digests each of *its* keys got. Reported: the
plan's kernel list, every (memo, flashinfer key, digest) found, the digests that share one of
ours across distinct flashinfer keys (computed here, with the keys' own equality), and any
container holding a ``PlannedKernel`` that the walk did not reach.

``serve --kernels FILE``: an engine start: the cache attached for the target, then for each
kernel of ``FILE`` (``{model: [kernel, ...]}``, from plans' kernel lists) the call that
requested it, made again through flashinfer's real dispatch; reports per kernel what the
cache did (miss = compiled and stored, hit).

    python key_completeness_driver.py plan qwen3-30b-a3b --max-num-batched-tokens 8192
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import sys
import time
import warnings
from typing import Any, Iterator

TARGET = "rtx-pro-6000"
#: How deep a memo's value is searched for a PlannedKernel (flashinfer stores tuples like
#: ``(kernel, workspace_spec)`` as values).
_DEPTH = 3


def _plan_argv(model: str, max_tokens: int, extra: list[str]) -> list[str]:
    return [model, "--target", TARGET, "--max-num-batched-tokens", str(max_tokens), *extra]


def _digests_in(value: Any, depth: int = _DEPTH) -> Iterator[str]:
    """Every PlannedKernel's digest in ``value`` (itself, or inside tuples / lists / dict values)."""
    from cute_diskcache.core.through import PlannedKernel

    if isinstance(value, PlannedKernel):
        yield value.digest
    elif depth > 0 and isinstance(value, (tuple, list)):
        for item in value:
            yield from _digests_in(item, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            yield from _digests_in(item, depth - 1)


def _cache_dict(wrapper: Any) -> dict[Any, Any] | None:
    """The key -> result dict of a ``functools.cache`` (unbounded ``lru_cache``) wrapper.

    Python offers no way to list such a cache; the C wrapper hands its dict to the garbage
    collector's traversal, which is how it is read here. A bounded ``lru_cache`` keeps its
    results in link objects the collector does not see: those stay unreadable (reported).
    """
    dicts = [r for r in gc.get_referents(wrapper) if isinstance(r, dict) and r is not getattr(wrapper, "__dict__", None)]
    return dicts[0] if len(dicts) == 1 else None


def _memos() -> Iterator[tuple[str, Any]]:
    """(name, container) of every flashinfer module global, and class attribute of a class a
    flashinfer module defines, that can hold kernels: dicts and functools caches. A container
    re-exported under several names is yielded once, under the first module name in order."""
    seen: set[int] = set()
    for mod_name in sorted(n for n in list(sys.modules) if n == "flashinfer" or n.startswith("flashinfer.")):
        module = sys.modules.get(mod_name)
        if module is None:
            continue
        places = [(f"{mod_name}.{attr}", value) for attr, value in list(vars(module).items())]
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and getattr(value, "__module__", None) == mod_name:
                places += [(f"{mod_name}.{attr}.{cattr}", cvalue) for cattr, cvalue in list(vars(value).items())]
        for where, value in places:
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, dict) or hasattr(value, "cache_info"):
                if id(value) not in seen:
                    seen.add(id(value))
                    yield where, value


def walk() -> dict[str, Any]:
    """What flashinfer holds after planning: its memo entries that hold a PlannedKernel."""
    with warnings.catch_warnings():  # reading module globals touches deprecated aliases (torch's reduce_op)
        warnings.simplefilter("ignore")
        return _walk()


def _walk() -> dict[str, Any]:
    entries: list[tuple[str, Any, str]] = []
    unreadable: list[dict[str, Any]] = []
    walked: set[int] = set()
    for where, memo in _memos():
        if isinstance(memo, dict):
            items = memo
        else:  # a functools cache
            items = _cache_dict(memo)
            if items is None:
                info = memo.cache_info()
                if info.currsize:
                    unreadable.append({"memo": where, "size": info.currsize})
                continue
            where += "[functools cache]"
        walked.add(id(items))
        for key, value in list(items.items()):
            entries.extend((where, key, digest) for digest in _digests_in(value))
    # Flashinfer keys that share one of our digests, with the keys' own equality (not reprs).
    by_digest: dict[str, set[tuple[str, Any]]] = {}
    for where, key, digest in entries:
        by_digest.setdefault(digest, set()).add((where, key))
    shared = {d: sorted(repr(p) for p in places) for d, places in by_digest.items() if len(places) > 1}
    return {
        "memo_entries": [{"memo": w, "key": repr(k), "digest": d} for w, k, d in entries],
        "shared": shared,
        "unreadable": unreadable,
        "elsewhere": _elsewhere(walked),
    }


def _elsewhere(walked: set[int]) -> list[str]:
    """Containers that hold a PlannedKernel directly but are no flashinfer memo walked above
    (an instance's attributes, a closure...): the walk would be missing a memo."""
    out = []
    for obj in gc.get_objects():
        if id(obj) in walked or not isinstance(obj, dict):
            continue
        if any(next(_digests_in(v, 1), None) is not None for v in list(obj.values())):
            out.append(f"dict of {len(obj)} keys, e.g. {next(iter(obj))!r}"[:200])
    return out


def plan(args: argparse.Namespace) -> dict[str, Any]:
    from cute_diskcache import prewarm

    t0 = time.perf_counter()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            extra = ["--dry-run", "--json", *(["--m", args.m] if args.m else [])]
            rc = prewarm.main(_plan_argv(args.model, args.max_num_batched_tokens, extra))
    except Exception as exc:  # flashinfer refusing the shape: reported, the test decides
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    if rc != 0:
        return {"error": f"prewarm exited {rc}: {out.getvalue()[-2000:]}", "seconds": seconds}
    summary = json.loads(out.getvalue())
    import flashinfer

    return {"flashinfer": flashinfer.__version__, "seconds": seconds, "kernels": summary["kernel_list"],
            "by_kind": summary["by_kind"], **walk()}


def serve(args: argparse.Namespace) -> dict[str, Any]:
    """An engine start that requests every kernel of ``--kernels`` ({model: [kernel, ...]}, each
    from a plan's kernel list) with the cache attached: each model's dispatchers, as prewarm's
    workers build them, make the call that requested the kernel while planning."""
    from cute_diskcache import prewarm
    from cute_diskcache.prewarm import dense as prewarm_dense
    from cute_diskcache.activation import install
    from cute_diskcache.core.cache import default_cache

    wanted: dict[str, list[dict[str, Any]]] = json.loads(open(args.kernels).read())
    install(target=TARGET)
    cache = default_cache()
    t0 = time.perf_counter()
    served = []
    for model, kernels in wanted.items():
        pargs = prewarm.build_parser().parse_args(_plan_argv(model, args.max_num_batched_tokens, []))
        shape, dense, _notes, _ms = prewarm.resolve(pargs)
        moe = prewarm._dispatcher(shape, pargs.max_num_tokens) if shape is not None else None
        linear = prewarm_dense.dispatcher(dense) if dense is not None else None
        for k in kernels:
            before = len(cache.events)
            if k["group"] == "dense":
                prewarm_dense.run(linear, k["recipe"])
            else:
                for m in k["recipe"]:
                    moe.run(int(m))
            served.append({"model": model, "digest": k["digest"], "kind": k["kind"],
                           "events": [{"digest": e[1], "outcome": e[2], "seconds": round(e[3], 3)} for e in cache.events[before:]]})
    return {"served": served, "seconds": time.perf_counter() - t0,
            "hits": cache.counters.hits, "compiles": cache.counters.compiles}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("plan", "serve"))
    ap.add_argument("model", nargs="?", help="plan: the model (serve reads its models from --kernels)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kernels", help="serve: a JSON file holding a plan's kernel list")
    ap.add_argument("--m", help="plan: only these token counts (prewarm's --m), under the same batched-token budget")
    args = ap.parse_args()
    report = plan(args) if args.mode == "plan" else serve(args)
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    from cute_diskcache import fast_exit

    fast_exit.end(main())  # as our own commands end: after the exit handlers, without the teardown's collections
