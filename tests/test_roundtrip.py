"""Cold compile in one process, warm load in the next: the cache's whole reason to exist.

Real flashinfer 0.6.15.post1 and the real DSL on the CPU, through the rtx-pro-6000 profile;
every process is fresh. A kernel compiled on the CPU cannot be launched, and the refusal is
the kernel's own argument check, whose text spells out its full signature: a reloaded kernel
that refuses with the same text has the same ABI as the one that was compiled.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest

if TYPE_CHECKING:
    from conftest import Warm

MICRO_SITE = "flashinfer.moe_dispatch.micro"


def _entries(root: Path) -> dict[str, tuple[int, int]]:
    """Every file of every entry (``v1/``) with size and mtime: a hit must leave them all alone.

    Only the entries: a process may keep its activity counters under the root too.
    """
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in (root / "v1").rglob("*") if p.is_file()}


def _launch_errors(report: dict[str, Any]) -> dict[int, str]:
    return {r["m"]: r["launch_error"] for r in report["records"]}


def _assert_warm(warm: dict[str, Any], cold: dict[str, Any], hits: int) -> None:
    """A fresh process served every kernel from disk, and they are the kernels ``cold`` built."""
    c = warm["counters"]
    assert warm["real_compiles"] == 0, warm["stderr"]
    assert (c["compiles"], c["misses"], c["hits"], c["rejected"], c["errors"], c["writes"]) == (0, 0, hits, 0, 0, 0)
    assert warm["kernels"] == cold["kernels"]
    errors = _launch_errors(warm)
    assert all(errors.values()), "on the CPU every launch must be refused by the kernel's argument check"
    assert errors == _launch_errors(cold)
    assert [(e[0], e[1]) for e in warm["events"]] == [(e[0], e[1]) for e in cold["events"]]
    assert all(e[2] == "hit" and e[3] > 0 for e in warm["events"])
    assert warm["stderr"] == ""


def test_an_entry_names_no_module_of_ours(warm_micro_root: Warm, list_manifests: Callable[[Path], list[Path]]) -> None:
    """An entry written before a move of our modules (issue 32 item 5 put them in folders) must
    still hit after it: neither its key nor its manifest may name where our code lives (a module
    name, a file path). The writer's version ("cute-diskcache 0.1.0") is the one mention of us,
    and it is in no key."""
    (manifest,) = list_manifests(warm_micro_root.root)
    assert re.findall(rb"cute_diskcache[\w./]*", manifest.read_bytes()) == []


def test_cold_process_compiles_and_writes_one_entry(warm_micro_root: Warm, list_manifests: Callable[[Path], list[Path]]) -> None:
    cold = warm_micro_root.cold
    c = cold["counters"]
    assert cold["real_compiles"] == 1
    assert (c["compiles"], c["writes"], c["hits"], c["rejected"], c["errors"]) == (1, 1, 0, 0, 0)
    assert cold["kernels"] == {"micro": 1, "static": 0, "dynamic": 0}
    assert cold["records"][0]["new_kernels"] == {"micro": 1}
    assert "Mismatched Tensor" in cold["records"][0]["launch_error"]
    assert [(e[0], e[2]) for e in cold["events"]] == [(MICRO_SITE, "miss")]
    found = list_manifests(warm_micro_root.root)
    assert len(found) == 1 and found[0].parent.name == cold["events"][0][1]
    assert not (warm_micro_root.root / "quarantine").exists()


def test_fresh_process_loads_instead_of_compiling(warm_micro_root: Warm, probe: Callable[..., dict[str, Any]]) -> None:
    before = _entries(warm_micro_root.root)
    warm = probe(warm_micro_root.root, 1)
    _assert_warm(warm, warm_micro_root.cold, hits=1)
    load_ms = warm["events"][0][3] * 1e3
    print(f"\nmicro m=1: cold compile {warm_micro_root.cold['events'][0][3]:.2f} s, warm load {load_ms:.2f} ms")
    assert _entries(warm_micro_root.root) == before, "a hit must not touch an entry"
    assert not (warm_micro_root.root / "quarantine").exists()


def test_cache_copied_to_another_path_still_hits(
    warm_micro_root: Warm, probe: Callable[..., dict[str, Any]], tmp_path: Path
) -> None:
    moved = tmp_path / "somewhere else" / "deeper"
    shutil.copytree(warm_micro_root.root, moved)
    _assert_warm(probe(moved, 1), warm_micro_root.cold, hits=1)


def test_no_cache_run_compiles_and_writes_nothing(probe: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    root = tmp_path / "root"
    plain = probe(root, 1, args=("--no-cache",))
    assert plain["real_compiles"] == 1
    assert plain["kernels"]["micro"] == 1
    assert plain["counters"]["compiles"] == 0 and plain["events"] == []
    assert not root.exists() or not any(root.rglob("*"))


@pytest.mark.slow
def test_static_and_dynamic_round_trip(warm_large_root: Warm, probe: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    cold = warm_large_root.cold
    assert cold["real_compiles"] == 2
    assert (cold["counters"]["compiles"], cold["counters"]["writes"]) == (2, 2)
    assert [r["new_kernels"] for r in cold["records"]] == [{"static": 1}, {"dynamic": 1}]
    root = tmp_path / "copy"
    shutil.copytree(warm_large_root.root, root)
    warm = probe(root, 16, 128)
    _assert_warm(warm, cold, hits=2)
    for cold_event, warm_event in zip(cold["events"], warm["events"]):
        print(f"\n{cold_event[0]}: cold compile {cold_event[3]:.2f} s, warm load {warm_event[3] * 1e3:.2f} ms")


def test_a_switch_flashinfer_reads_is_keyed(micro_copy: Warm, probe: Callable[..., dict[str, Any]]) -> None:
    """Issue 15, item 16: the modules moe_dispatch reaches read FLASHINFER_B12X_MICRO_SHARE_INPUT
    (at import). A value constant in a process needs no place in flashinfer's in-process key, but
    a disk cache shared across processes must hold it: flipping it is another entry, not a hit."""
    from cute_diskcache.storage import entry

    root, cold = micro_copy
    flipped = probe(root, 1, extra_env={"FLASHINFER_B12X_MICRO_SHARE_INPUT": "1"})
    assert flipped["counters"]["hits"] == 0 and flipped["real_compiles"] == 1, flipped["stderr"]
    other = flipped["events"][0][1]
    assert other != cold["events"][0][1]
    (manifest,) = [entry.read_manifest(p.parent) for p in root.glob(f"v1/*/*/{other}/manifest.msgpack")]
    assert ["FLASHINFER_B12X_MICRO_SHARE_INPUT", "1"] in manifest["env"]["codegen_env"]
    again = probe(root, 1)  # unset again: the original entry, a hit
    assert again["real_compiles"] == 0 and again["events"][0][1] == cold["events"][0][1]
