"""Key completeness (issue 22, item 2): our keys keep apart every kernel flashinfer keeps apart.

A cache key that leaves out something a kernel depends on makes two kernels share one entry,
and the cache serves the wrong one. flashinfer's own in-memory memos are the reference: what
they key apart *is* a different kernel. While prewarm plans, every planned key hands flashinfer
its own ``PlannedKernel(digest)`` (:mod:`cute_diskcache.flashinfer_sites._common`), which
flashinfer memoises under its own key; so after planning, flashinfer's memo dicts map each of
its keys to one of our digests. For the full prewarm plans of three models, as the README runs
prewarm (``--target rtx-pro-6000 --max-num-batched-tokens 8192``), on flashinfer 0.6.15.post1
(this interpreter) and 0.7.4 (the second interpreter of ``test_flashinfer_074``), each in a
fresh child (``tests/key_completeness_driver.py``):

(a) no digest of ours appears under two distinct flashinfer keys, and the digests flashinfer
    holds are exactly the planned ones (the walk reached every memo, every planned kernel is
    one flashinfer keeps, none of ours is missing): the test cannot pass on an empty walk;
(b) a second fresh process, planning each kind's first and last token counts, plans the same
    flashinfer key -> digest map for them (no address or id in a key), and, for real
    (``slow``): prewarm compiles a kernel of each kind of each model (the dense model: each
    default-tactic kernel, and tuner candidates that carry every tactic value), and a fresh
    engine start requests each again through flashinfer's dispatch and hits it, with zero
    compiles by our count and by the DSL's.

The walk covers module globals and class attributes of every loaded flashinfer module: dicts
(values searched into tuples, as flashinfer stores ``(kernel, spec)``), and ``functools.cache``
getters, whose cache Python cannot list but the garbage collector's traversal hands over; a
bounded ``lru_cache`` cannot be read that way and is reported (none holds a planned kernel on
these stacks). A dict anywhere else holding a ``PlannedKernel`` is reported too, so a memo the
walk misses fails the test instead of shrinking it.

gpt-oss-120b has no plan on 0.7.4: that release's b12x NVFP4 MoE refuses hidden size 2880
(not a multiple of 128), so there is nothing of flashinfer's to compare; the test pins that
refusal so a release that lifts it brings the cell back. Cost on the 2-core box (1e89ffc, load
2.5): 3 min 06 s wall, 3 min 11 s of CPU: 11 planning children 90 s (gpt-oss-120b on
0.6.15.post1 plans 8192 m values, ~6 GB per process), the ``slow`` test 95 s (14 kernels
compiled then hit on 0.6.15.post1, 11 on 0.7.4). At load 5 the same file took 8 min 34 s.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_flashinfer_074 import _run  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent / "key_completeness_driver.py"
#: The flashinfer 0.7.4 interpreter, found as test_flashinfer_074 finds it (its fixture builds it).
FI074: str = os.environ.get("CUTE_DISKCACHE_FI074_PYTHON") or str(REPO / ".venv-fi074" / "bin" / "python")
MAX_TOKENS = 8192  # the README's prewarm command
_DROPPED_ENV = re.compile(r"^(CUTE_DISKCACHE_.*|FLASHINFER_B12X_DISK_CACHE|CUTE_DSL_ARCH|FLASHINFER_CUTE_DSL_DISABLE_CACHE)$")
_COUNT_LINE = re.compile(r"^cdc-test real compiles: (\d+)$", re.M)

STACKS = ("0.6.15.post1", "0.7.4")
MODELS = ("qwen3-30b-a3b", "gpt-oss-120b", "llama-3.1-8b-nvfp4")
DENSE_MODEL = "llama-3.1-8b-nvfp4"
#: The kinds each model must plan on each stack, at least one kernel of each (measured on
#: aec26c8: qwen3 89 kernels on 0.6.15.post1 and 18 on 0.7.4, gpt-oss-120b 161, llama 8).
KINDS = {
    ("qwen3-30b-a3b", "0.6.15.post1"): {"micro", "static", "dynamic", "b12x_fp4"},
    ("qwen3-30b-a3b", "0.7.4"): {"micro", "static", "dynamic", "b12x_fp4"},
    ("gpt-oss-120b", "0.6.15.post1"): {"micro", "static", "dynamic"},
    ("llama-3.1-8b-nvfp4", "0.6.15.post1"): {"b12x_fp4"},
    ("llama-3.1-8b-nvfp4", "0.7.4"): {"b12x_fp4"},
}
#: Cells flashinfer itself refuses to serve: what it says.
REFUSED = {("gpt-oss-120b", "0.7.4"): "hidden_size (2880) must be a multiple of 128"}
CELLS = [(model, stack) for stack in STACKS for model in MODELS]
PLANNED_CELLS = [cell for cell in CELLS if cell not in REFUSED]


def _python(stack: str) -> str:
    if stack == "0.7.4":
        if FI074 == "off" or not Path(FI074).exists():
            pytest.skip(f"no flashinfer 0.7.4 interpreter at {FI074} (tests/test_flashinfer_074.py builds it)")
        return FI074
    return sys.executable


def _env(root: Path, hook_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _DROPPED_ENV.match(k)}
    env["CUTE_DISKCACHE_DIR"] = str(root)
    env["FLASHINFER_WORKSPACE_BASE"] = str(root.parent / "flashinfer-workspace")  # flashinfer's own cache: per test
    env["CUTE_DSL_ARCH"] = "sm_120a"  # what the rtx-pro-6000 profile sets; set before any import, as in a container
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook_dir), str(REPO), env.get("PYTHONPATH", "")) if p)
    return env



def _driver(stack: str, tmp: Path, hook_dir: Path, *args: str) -> dict[str, Any]:
    """One fresh child of the driver; its JSON report, with the DSL's own compile count."""
    tmp.mkdir(parents=True, exist_ok=True)
    proc = _run([_python(stack), str(DRIVER), *args, "--max-num-batched-tokens", str(MAX_TOKENS)],
                _env(tmp / "root", hook_dir), tmp)
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if "error" in report:
        report["error"] += "\n" + proc.stderr[-1500:]  # prewarm's refusal, and what was said before it
    counted = _COUNT_LINE.findall(proc.stderr)
    report["real_compiles"] = int(counted[-1]) if counted else None
    report["stderr"] = proc.stderr
    return report


@pytest.fixture(scope="module")
def first_plans(tmp_path_factory: pytest.TempPathFactory, compile_hook_dir: Path) -> Any:
    """``first_plans(model, stack)``: the cell's plan in a fresh process, made once per module."""
    made: dict[tuple[str, str], dict[str, Any]] = {}

    def get(model: str, stack: str) -> dict[str, Any]:
        if (model, stack) not in made:
            made[model, stack] = _driver(stack, tmp_path_factory.mktemp("plan"), compile_hook_dir, "plan", model)
        return made[model, stack]

    return get


def _memo_map(report: dict[str, Any]) -> dict[tuple[str, str], str]:
    """(flashinfer memo, its key) -> our digest, as the driver read it."""
    return {(e["memo"], e["key"]): e["digest"] for e in report["memo_entries"]}


@pytest.mark.parametrize("model,stack", PLANNED_CELLS)
def test_no_two_flashinfer_kernels_share_one_of_our_keys(model: str, stack: str, first_plans: Any) -> None:
    report = first_plans(model, stack)
    assert "error" not in report, f"{model} on {stack}: {report['error']}"
    assert report["flashinfer"] == stack
    kernels = report["kernels"]
    planned = {k["digest"] for k in kernels}
    by_kind = {kind: sum(k["kind"] == kind for k in kernels) for kind in {k["kind"] for k in kernels}}
    assert KINDS[model, stack] <= {kind for kind, n in by_kind.items() if n > 0}, by_kind
    # A dry run compiles nothing: a real compile while planning is a kernel our hook did not key.
    assert report["real_compiles"] == 0, f"planning compiled {report['real_compiles']} kernels for real:\n{report['stderr'][-3000:]}"
    # Every memo read, and nothing holding a planned kernel outside them: the walk is complete.
    assert report["unreadable"] == [] and report["elsewhere"] == [], (report["unreadable"], report["elsewhere"])
    # The property: a digest of ours under two distinct keys of flashinfer = two kernels, one entry.
    assert not report["shared"], "flashinfer keeps these kernels apart, one key of ours each:\n" + "\n".join(
        f"  {digest[:16]}: {len(places)} keys of flashinfer, e.g. {places[0]} and {places[-1]}"
        for digest, places in report["shared"].items())
    # Not vacuous: flashinfer holds exactly the planned kernels, one key of its own for each.
    held = [e["digest"] for e in report["memo_entries"]]
    assert set(held) == planned, f"planned but not held: {sorted(planned - set(held))[:5]}; held, not planned: {sorted(set(held) - planned)[:5]}"
    assert len(held) == len(planned) == len(kernels), (len(held), len(planned), len(kernels))


def test_flashinfer_074_refuses_gpt_oss_120b(first_plans: Any) -> None:
    """The one cell without a plan: flashinfer 0.7.4's own refusal, nothing of ours."""
    for (model, stack), text in REFUSED.items():
        report = first_plans(model, stack)
        assert text in report.get("error", ""), f"{model} on {stack} no longer refused: {report.get('by_kind')}"


def _sample_ms(kernels: list[dict[str, Any]]) -> list[int]:
    """The token counts a second process plans: each kind's first and last kernel (by the token
    counts it serves). An address, id or pid in a key would change every key of that kind, so a
    sample of every kind finds it; planning all 8192 counts again cost a minute a cell."""
    ms: set[int] = set()
    for kind in {k["kind"] for k in kernels}:
        of_kind = sorted((k for k in kernels if k["kind"] == kind), key=lambda k: min(k["ms"]))
        ms |= {min(of_kind[0]["ms"]), max(of_kind[-1]["ms"])}
    return sorted(ms)


@pytest.mark.parametrize("model,stack", PLANNED_CELLS)
def test_a_fresh_process_plans_the_same_keys(model: str, stack: str, first_plans: Any, tmp_path: Path, compile_hook_dir: Path) -> None:
    """A second fresh process, planning a sample of the token counts under the same budget, plans
    exactly the first plan's kernels for those counts, under the same flashinfer keys."""
    first = first_plans(model, stack)
    assert "error" not in first, first.get("error")
    sample = _sample_ms(first["kernels"])
    second = _driver(stack, tmp_path, compile_hook_dir, "plan", model, "--m", ",".join(map(str, sample)))
    assert "error" not in second, second.get("error")
    expected = {k["digest"] for k in first["kernels"] if set(k["ms"]) & set(sample)}
    after = {k["digest"] for k in second["kernels"]}
    assert after == expected, (f"{len(expected - after)} of {len(expected)} digests not planned again (an address, id or "
                               f"pid in a key?); {len(after - expected)} new")
    assert {k["kind"] for k in second["kernels"]} == {k["kind"] for k in first["kernels"]}, "every kind sampled"
    first_map, second_map = _memo_map(first), _memo_map(second)
    changed = {key: (first_map.get(key), d) for key, d in second_map.items() if first_map.get(key) != d}
    assert second_map and not changed and set(second_map.values()) == expected, sorted(changed.items())[:5]


def _dense_sample(kernels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of the dense model's plan: every kernel of ``mm_fp4``'s own call (one per default tactic),
    and of the tuner's candidates (one call path, the tactic passed in) as few as carry every
    value each field of a tactic takes: [64, 128] tile sides in either place, both flags. A key
    or reload that went wrong for one tactic value is then still among the compiled; the other
    candidates repeat the path and its values (on both stacks 2 of the 6 carry them all: 4 of
    the plan's 8 kernels are compiled, each 3-4 s to compile and as long to serve here)."""
    tuned = [k for k in kernels if "tactic" in k["recipe"]]
    chosen = [k for k in kernels if "tactic" not in k["recipe"]]

    def values(k: dict[str, Any]) -> set[tuple[str, str]]:
        def walk(v: Any, at: str) -> Any:
            if isinstance(v, list):
                for i, item in enumerate(v):
                    yield from walk(item, f"{at}/{i}")
            else:
                yield at, json.dumps(v)
        return set(walk(json.loads(k["recipe"]["tactic"]), "")) | {("linear", str(k["recipe"]["linear"]))}

    left = set().union(*map(values, tuned)) if tuned else set()
    while left:  # greedy cover, in plan order on ties
        best = max(tuned, key=lambda k: len(values(k) & left))
        chosen.append(best)
        left -= values(best)
    return chosen


def _one_of_each_kind(kernels: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    """What the slow test compiles: of the dense model, :func:`_dense_sample`; of an MoE model,
    the kernel of each MoE kind first needed (its dense kernels are the dense model's: the same
    digests)."""
    if model == DENSE_MODEL:
        return _dense_sample(kernels)
    chosen: dict[str, dict[str, Any]] = {}
    for k in sorted(kernels, key=lambda k: min(k["ms"])):
        if k["group"] == "moe":
            chosen.setdefault(k["kind"], k)
    return list(chosen.values())


def _outcomes(report: dict[str, Any]) -> list[tuple[str, list[tuple[str, str]]]]:
    return [(k["digest"], [(e["digest"], e["outcome"]) for e in k["events"]]) for k in report["served"]]


@pytest.mark.slow
@pytest.mark.parametrize("stack", STACKS)
def test_compiled_kernels_hit_in_a_fresh_process_with_zero_compiles(stack: str, first_plans: Any, tmp_path: Path,
                                                                    compile_hook_dir: Path) -> None:
    """All models of a stack in one cold process (each chosen kernel compiled once, on exactly
    its planned digest), then one fresh process on the same root: each a hit, nothing compiled."""
    plans = {model: first_plans(model, stack) for model, s in PLANNED_CELLS if s == stack}
    assert not [p["error"] for p in plans.values() if "error" in p], {m: p["error"] for m, p in plans.items() if "error" in p}
    chosen = {model: _one_of_each_kind(plan["kernels"], model) for model, plan in plans.items()}
    for model, kernels in chosen.items():
        moe_kinds = KINDS[model, stack] - ({"b12x_fp4"} if model != DENSE_MODEL else set())
        assert {k["kind"] for k in kernels} >= moe_kinds, (model, [k["kind"] for k in kernels])
    wanted = tmp_path / "kernels.json"
    wanted.write_text(json.dumps(chosen))
    total = sum(map(len, chosen.values()))
    cold = _driver(stack, tmp_path, compile_hook_dir, "serve", "--kernels", str(wanted))
    assert _outcomes(cold) == [(d, [(d, "miss")]) for d, _ in _outcomes(cold)], _outcomes(cold)
    assert cold["compiles"] == total and cold["real_compiles"] == total, (cold["compiles"], cold["real_compiles"], total)
    warm = _driver(stack, tmp_path, compile_hook_dir, "serve", "--kernels", str(wanted))
    assert _outcomes(warm) == [(d, [(d, "hit")]) for d, _ in _outcomes(cold)], _outcomes(warm)
    assert warm["compiles"] == 0 and warm["hits"] == total, warm
    assert warm["real_compiles"] == 0, warm["stderr"][-3000:]
