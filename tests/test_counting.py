"""One home for counting (storage/counting.py): the process's fields and the statistics file move
together, prewarm's counts go apart, a watched stretch says what it asked for, and nothing else in
the package counts on its own.

Read from the source for the last part (no flashinfer, no DSL): a counter moved by hand
(``counters.x += 1``), a ``stats.record`` outside the modules that own a file-only count, or an
event list sliced by index outside the tally each brings back a second place to count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cute_diskcache.core.cache import CompileCache
from cute_diskcache.remote.client import RemoteCache
from cute_diskcache.storage import counting, stats
from cute_diskcache.storage.store import Store

from _helpers import make_key

PKG = Path(__file__).resolve().parent.parent / "cute_diskcache"
pytestmark = pytest.mark.usefixtures("isolated_stats")

#: Modules that write a statistics-file-only count directly, each with its reason (counting.py's docstring).
FILE_ONLY_COUNTS = {
    "storage/counting.py": "the one home",
    "storage/store.py": "a quarantine happens in any store, with no cache in hand",
    "storage/eviction.py": "an eviction sweep runs where no cache is in hand",
    "remote/client.py": "bulk export and import move bytes outside any cache's lookups",
}


def test_add_moves_the_process_field_and_the_file_together() -> None:
    tally = counting.Tally(counting.Counters())
    tally.add("ns", hits=1, load_seconds=0.5, bytes_written=10)
    tally.add(None, shared_loads=1)
    assert (tally.fields.hits, tally.fields.load_seconds, tally.fields.shared_loads) == (1, 0.5, 1)
    assert stats.snapshot() == {"ns": {"hits": 1.0, "load_seconds": 0.5, "bytes_written": 10.0}}, \
        "a field the process lacks is the file's; None is the process's only"


def test_prewarm_counts_apart_and_writes_no_serving_miss() -> None:
    tally = counting.Tally(counting.Counters())
    tally.prewarm = True
    tally.add("ns", misses=1, compiles=1, compile_seconds=2.0, writes=1)
    assert (tally.fields.misses, tally.fields.compiles) == (1, 1), "the process counts everything"
    assert stats.snapshot() == {"ns": {"prewarm_compiles": 1.0, "prewarm_compile_seconds": 2.0, "writes": 1.0}}


def test_watch_names_what_was_served_and_how_much_moved() -> None:
    tally = counting.Tally(counting.Counters())
    tally.event("s", "before", "hit")
    with tally.watch("hits", "compiles") as seen:
        tally.event("s", "b", "miss", 1.0)
        tally.event("s", "a", "hit")
        tally.event("s", "a", "hit")
        tally.event("s", "c", "failed")
        tally.event("s", "d", "refused")
        tally.add(None, hits=2, compiles=1)
    assert seen.digests == ["a", "b"], "failed and refused kernels are not in the cache"
    assert seen.counts == {"hits": 2, "compiles": 1}
    assert [e.outcome for e in seen.events] == ["miss", "hit", "hit", "failed", "refused"]


def test_watch_fills_in_when_the_stretch_raises() -> None:
    tally = counting.Tally(counting.Counters())
    with pytest.raises(RuntimeError), tally.watch("misses") as seen:
        tally.event("s", "x", "failed")
        tally.add(None, misses=1)
        raise RuntimeError
    assert (seen.digests, seen.counts) == ([], {"misses": 1})


def test_the_cache_and_its_remote_count_through_a_tally(tmp_path: Path) -> None:
    """The cache's hit and the remote tier's miss land in their tallies and in one statistics file."""
    store = Store(tmp_path / "root")
    cache = CompileCache(store, single_flight=False)
    key = make_key("micro")
    cache.get_or_compile(key, lambda: "compiled")
    assert cache.events[-1].outcome == "miss" and cache.counters is cache.tally.fields
    remote = RemoteCache("memory://counting-test", timeout=1.0)
    remote._count(key.env.namespace, "remote_misses")
    assert remote.counters.remote_misses == 1 and remote.counters is remote.tally.fields
    ns = stats.snapshot()[key.env.namespace]
    assert ns["misses"] == 1 and ns["compiles"] == 1 and ns["remote_misses"] == 1


def _offences(rel: str, tree: ast.Module) -> dict[str, list[int]]:
    """Lines of ``tree`` that count outside the tally: by hand, into the file, or by slicing events."""
    found: dict[str, list[int]] = {"moved by hand": [], "recorded": [], "sliced": []}
    for node in ast.walk(tree):
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Attribute) \
                and isinstance(node.target.value, ast.Attribute) and node.target.value.attr == "counters":
            found["moved by hand"].append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "record" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "stats" and rel not in FILE_ONLY_COUNTS:
            found["recorded"].append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "events" \
                and rel != "storage/counting.py":
            found["sliced"].append(node.lineno)
    return found


def test_nothing_else_in_the_package_counts_on_its_own() -> None:
    """Use Tally.add, Tally.watch or mark/since; a file-only count says why in FILE_ONLY_COUNTS."""
    offences = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = str(p.relative_to(PKG))
        found = {kind: lines for kind, lines in _offences(rel, ast.parse(p.read_text(), rel)).items() if lines}
        if found:
            offences[rel] = found
    assert not offences, offences


def test_the_source_check_finds_each_way_of_counting_on_ones_own() -> None:
    sample = ast.parse("self.counters.hits += 1\nstats.record('ns', 'hits')\nx = cache.events[3:]\n")
    assert _offences("core/x.py", sample) == {"moved by hand": [1], "recorded": [2], "sliced": [3]}
    assert _offences("storage/store.py", sample)["recorded"] == [], "a file-only count with its reason"
