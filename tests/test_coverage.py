"""coverage.inspect: what a lookup would find, read without side effects (synthetic entries, no compile)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import flip_byte, make_artifact, make_key, payload_path, rewrite_manifest  # noqa: E402
from test_bundle import _isolated  # noqa: E402,F401  (autouse: no settings from the environment, no fsync, no stats file)

from cute_diskcache.cli import coverage  # noqa: E402
from cute_diskcache.keys import hostcpu  # noqa: E402
from cute_diskcache.storage import entry  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")} if root.exists() else {}


def committed(root: Path, kind: str = "micro") -> Path:
    key = make_key(kind)
    assert Store(root).commit(key, make_artifact()) is not None
    return Store(root).entry_dir(key)


def test_present_absent_and_nothing_written(tmp_path: Path) -> None:
    root = tmp_path / "root"
    committed(root)
    before = tree(root)
    store = Store(root)
    assert coverage.inspect(store, make_key("micro")) == coverage.Finding(coverage.OK, found_in=str(root))
    missing = coverage.inspect(store, make_key("static"))
    assert missing.status == coverage.MISSING and missing.why.startswith("no entry")
    assert tree(root) == before
    empty = tmp_path / "never-made"
    assert coverage.inspect(Store(empty), make_key("micro")).status == coverage.MISSING
    assert not empty.exists()


def test_damage_is_reported_not_quarantined(tmp_path: Path) -> None:
    root = tmp_path / "root"
    d = committed(root)
    flip_byte(payload_path(d, entry.read_manifest(d), "cubin"))  # a payload a hit never loads: still unusable to check
    before = tree(root)
    found = coverage.inspect(Store(root), make_key("micro"))
    assert found.status == coverage.UNUSABLE and found.why.startswith("checksum: ") and "quarantines" in found.why
    assert tree(root) == before and not (root / "quarantine").exists()


def test_host_cpu_lacking_an_extension_is_named(tmp_path: Path) -> None:
    root = tmp_path / "root"
    d = committed(root)
    here = set(hostcpu.isa_extensions())
    if not here:
        pytest.skip("no /proc/cpuinfo flags here: the host CPU cannot be judged")
    lacking = next(f for f in ("avx512_fp16", "apx_f", "avx10_2", "avx512f", "sve2") if f not in here)
    manifest = entry.read_manifest(d)
    manifest["host_isa"] = sorted(set(manifest["host_isa"]) | {lacking})
    rewrite_manifest(d, manifest)
    found = coverage.inspect(Store(root), make_key("micro"))
    assert (found.status, found.cpu_lacks) == (coverage.UNUSABLE, [lacking])
    assert found.why.startswith(f"host CPU lacks {lacking}")


def test_read_only_layers_are_looked_up_after_the_root(tmp_path: Path) -> None:
    """CUTE_DISKCACHE_READ_DIRS: an image-baked layer under an empty volume covers the kernel;
    a damaged copy in the writable root does not hide the layer's good one (serving quarantines
    the root's and loads the layer's)."""
    baked, volume = tmp_path / "baked", tmp_path / "volume"
    committed(baked)
    store = Store(volume, read_dirs=[baked])
    assert coverage.inspect(store, make_key("micro")) == coverage.Finding(coverage.OK, found_in=str(baked))
    d = committed(volume)
    flip_byte(payload_path(d, entry.read_manifest(d), "object"))
    assert coverage.inspect(store, make_key("micro")).found_in == str(baked)
    flip_byte(payload_path(b := Store(baked).entry_dir(make_key("micro")), entry.read_manifest(b), "object"))
    both_bad = coverage.inspect(store, make_key("micro"))
    assert both_bad.status == coverage.UNUSABLE and "read-only layer" not in both_bad.why  # the root's refusal first
