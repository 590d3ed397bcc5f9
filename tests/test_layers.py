"""Layered roots (issue 20, item 2): an image-baked cache read-only under a writable one.

``CUTE_DISKCACHE_READ_DIRS`` lists read-only roots looked up after ``CUTE_DISKCACHE_DIR``:
lookups read the writable root first, then each layer; commits go to the writable root; a
layer is never written, locked or quarantined (a damaged entry there is a miss with one
warning, and stays). Synthetic entries: nothing here needs a kernel to run.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import flip_byte, make_artifact, make_key, payload_path  # noqa: E402
from _nobody import NOBODY, as_user, can_run_as_others  # noqa: E402
from test_deploy_trust import fast_fsync, key, public  # noqa: E402,F401  (fixtures; fast_fsync is autouse)

from cute_diskcache import config  # noqa: E402
from cute_diskcache.core import cache  # noqa: E402
from cute_diskcache.storage import entry  # noqa: E402
from cute_diskcache.keys.key import CacheKey  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402

BAKED = make_artifact((b"\x44" * 48,))
FRESH = make_artifact((b"\x55" * 48,))


@pytest.fixture
def baked(public: Path, key: CacheKey) -> Path:
    """The image's layer: prewarmed as root, root-owned, 0755/0644."""
    root = public / "image-cache"
    assert Store(root).commit(key, BAKED) is not None
    return root


@pytest.fixture
def volume(public: Path) -> Path:
    """The writable root's parent, as a volume mounted for the engine's uid."""
    vol = public / "volume"
    vol.mkdir()
    os.chown(vol, NOBODY, NOBODY)
    return vol


def _tree(path: Path) -> dict[str, tuple[bytes, float]]:
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime) for p in sorted(path.rglob("*"))}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cute_diskcache" and r.levelno >= logging.WARNING]


needs_root = pytest.mark.skipif(can_run_as_others() is not None, reason=str(can_run_as_others()))


@needs_root
def test_hit_from_the_baked_layer_miss_written_to_the_writable_root(baked: Path, volume: Path, key: CacheKey, caplog: pytest.LogCaptureFixture) -> None:
    """As a non-root engine would run it: the baked layer is root's, the volume is ours."""
    before = _tree(baked)
    other = make_key("static")
    with as_user(NOBODY):
        store = Store(volume / "cache", read_dirs=[baked])
        found = store.lookup_or_quarantine(key, load=True)
        assert found is not None and found[1] == BAKED.object_bytes, "served from the layer, in place"
        assert store.lookup_or_quarantine(other) is None
        assert store.commit(other, FRESH) is not None
        found = store.lookup_or_quarantine(other)
        assert found is not None and found[1] == FRESH.object_bytes
        store.maintain()
    assert _tree(baked) == before, "the layer is never written (not even an access time bump)"
    assert store.entry_dir(other).is_dir() and not store.entry_dir(key).exists(), "a layer's hit is not copied up"
    assert not Store(baked).entry_dir(other).exists()
    assert _warnings(caplog) == []


def test_writable_root_is_read_first(tmp_path: Path, key: CacheKey) -> None:
    layer, top = tmp_path / "layer", tmp_path / "top"
    assert Store(layer).commit(key, BAKED) is not None
    assert Store(top).commit(key, FRESH) is not None
    found = Store(top, read_dirs=[layer]).lookup_or_quarantine(key)
    assert found is not None and found[1] == FRESH.object_bytes


def test_layers_are_read_in_order(tmp_path: Path, key: CacheKey) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    assert Store(first).commit(key, FRESH) is not None
    assert Store(second).commit(key, BAKED) is not None
    found = Store(tmp_path / "top", read_dirs=[first, second]).lookup_or_quarantine(key)
    assert found is not None and found[1] == FRESH.object_bytes
    found = Store(tmp_path / "top", read_dirs=[second, first]).lookup_or_quarantine(key)
    assert found is not None and found[1] == BAKED.object_bytes


def test_damaged_entry_in_a_layer_is_a_miss_with_one_warning_and_stays(tmp_path: Path, key: CacheKey, caplog: pytest.LogCaptureFixture) -> None:
    """A writable root would quarantine it; a layer must not be touched (an image, or someone else's volume)."""
    layer = tmp_path / "layer"
    assert Store(layer).commit(key, BAKED) is not None
    d = Store(layer).entry_dir(key)
    flip_byte(payload_path(d, entry.read_manifest(d), "object"))
    before = _tree(layer)
    store = Store(tmp_path / "top", read_dirs=[layer])
    for _ in range(3):
        assert store.lookup_or_quarantine(key) is None
    assert _tree(layer) == before and not (layer / "quarantine").exists()
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "read-only" in warnings[0] and "checksum" in warnings[0], warnings
    assert store.commit(key, FRESH) is not None  # the compile lands in the writable root...
    found = store.lookup_or_quarantine(key)
    assert found is not None and found[1] == FRESH.object_bytes  # ...and shadows the bad one
    assert _tree(layer) == before


@needs_root
def test_a_layer_we_do_not_trust_is_refused_and_the_writable_root_still_serves(tmp_path: Path, key: CacheKey, caplog: pytest.LogCaptureFixture) -> None:
    layer, top = tmp_path / "layer", tmp_path / "top"
    assert Store(layer).commit(key, BAKED) is not None
    os.chown(layer, NOBODY, NOBODY)  # another non-root user's tree
    store = Store(top, read_dirs=[layer])
    assert store.lookup_or_quarantine(key) is None
    assert store.commit(key, FRESH) is not None
    found = store.lookup_or_quarantine(key)
    assert found is not None and found[1] == FRESH.object_bytes
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "refuses cache root" in warnings[0] and str(layer) in warnings[0], warnings


def test_read_dirs_setting_builds_the_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top, a, b = tmp_path / "top", tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv("CUTE_DISKCACHE_DIR", str(top))
    monkeypatch.setenv("CUTE_DISKCACHE_READ_DIRS", f"{a}::{b}:{a}:{top}")
    assert config.load().read_dirs == (a, b), "blanks, repeats and the writable root itself are dropped"
    cache.reset_default_cache()
    try:
        store = cache.default_cache().store
        assert store.root == top and [layer.root for layer in store.layers] == [a, b]
        assert all(layer.readonly for layer in store.layers)
    finally:
        cache.reset_default_cache()


def test_single_root_has_no_layers(tmp_path: Path, key: CacheKey) -> None:
    store = Store(tmp_path / "top")
    assert store.layers == ()
    assert store.commit(key, FRESH) is not None and store.lookup_or_quarantine(key) is not None


# --------------------------------------------------------------------------------------------
# Issue 29, finding 10: what READ_DIRS holds is said, and only absolute paths are layers
# --------------------------------------------------------------------------------------------


def test_read_dirs_takes_absolute_paths_and_says_what_it_ignores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """XDG's rule for XDG_DATA_DIRS: a relative entry is invalid and ignored (resolved against the
    working directory, it was another layer in every process started elsewhere); a missing one is
    kept (a volume may be mounted later) but said, once."""
    (tmp_path / "relative" / "dir").mkdir(parents=True)
    baked = tmp_path / "baked"
    baked.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(config, "_warned", set())
    monkeypatch.setenv("CUTE_DISKCACHE_READ_DIRS", f"relative/dir{os.pathsep}{os.pathsep}{baked}{os.pathsep}{tmp_path / 'not-mounted'}")
    with caplog.at_level(logging.WARNING, logger="cute_diskcache"):
        for _ in range(2):
            assert config.load().read_dirs == (baked, tmp_path / "not-mounted")
    warnings = _warnings(caplog)
    assert len(warnings) == 2, warnings
    assert "ignoring 'relative/dir' in CUTE_DISKCACHE_READ_DIRS (not an absolute path)" in warnings[0]
    assert f"{tmp_path / 'not-mounted'}, which is not a directory here" in warnings[1]


_ENGINE = """
import sys
sys.path.insert(0, sys.argv[1])
from _helpers import make_artifact, make_key
from cute_diskcache.core import cache, export
export.export = lambda *a, **kw: make_artifact()
cache.CompileCache._load = lambda self, key, found: "loaded"
c = cache.default_cache()
c.warm_up()
for kind in ("micro", "static"):
    c.get_or_compile(make_key(kind), lambda: "compiled")
print(c.counters.hits, c.counters.compiles)
"""


def test_attach_line_and_miss_reason_name_the_layers(tmp_path: Path) -> None:
    """An engine on an empty volume over a baked layer said "0 entries for this stack" and, at a
    miss, nothing of the layers: the operator could not tell a layer that is missing, refused or
    simply lacks the kernel from one that is not configured."""
    import subprocess

    baked = tmp_path / "baked"
    assert Store(baked).commit(make_key("micro"), BAKED) is not None
    missing = tmp_path / "not-mounted"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}
    env.update(CUTE_DISKCACHE_DIR=str(tmp_path / "volume"), CUTE_DISKCACHE_READ_DIRS=f"{baked}{os.pathsep}{missing}",
               CUTE_DISKCACHE_LOG_LEVEL="info")
    proc = subprocess.run([sys.executable, "-c", _ENGINE, str(Path(__file__).resolve().parent)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1", "1"], "the micro kernel from the layer, the static one compiled"
    (attach,) = [ln for ln in proc.stderr.splitlines() if "attached:" in ln]
    assert f"; read layers: {baked} (" in attach and f"{missing} (missing)" in attach, attach
    (miss,) = [ln for ln in proc.stderr.splitlines() if "compiling" in ln]
    assert f"read layers {baked}: no entry; {missing} does not exist" in miss, miss


# --------------------------------------------------------------------------------------------
# What held in the review of issue 29: hostile layers, and eviction never touching a layer
# --------------------------------------------------------------------------------------------

OUTSIDER = 3000


def _edir(layer: Path, key: CacheKey) -> Path:
    return Store(layer).entry_dir(key)


def _obj(layer: Path, key: CacheKey) -> Path:
    d = _edir(layer, key)
    return payload_path(d, entry.read_manifest(d), "object")


def _swap_for_link(path: Path, aside: Path) -> None:
    os.rename(path, aside)
    os.symlink(aside, path)


_HOSTILE = {
    "root owned by another uid": lambda d, k: os.chown(d, OUTSIDER, OUTSIDER),
    "root others may write": lambda d, k: d.chmod(0o777),
    "root sticky 1777": lambda d, k: d.chmod(0o1777),
    "root group may write, no TRUST_GROUP": lambda d, k: d.chmod(0o775),
    "v1 a symlink": lambda d, k: _swap_for_link(d / "v1", d.parent / f"{d.name}-v1"),
    "namespace a symlink": lambda d, k: _swap_for_link(d / "v1" / k.env.namespace, d.parent / f"{d.name}-ns"),
    "shard of another uid": lambda d, k: os.chown(_edir(d, k).parent, OUTSIDER, OUTSIDER),
    "entry a symlink": lambda d, k: _swap_for_link(_edir(d, k), d.parent / f"{d.name}-entry"),
    "entry group may write": lambda d, k: _edir(d, k).chmod(0o775),
    "manifest a symlink": lambda d, k: _swap_for_link(_edir(d, k) / entry.MANIFEST, d.parent / f"{d.name}-manifest"),
    "manifest of another uid": lambda d, k: os.chown(_edir(d, k) / entry.MANIFEST, OUTSIDER, OUTSIDER),
    "object a symlink": lambda d, k: _swap_for_link(_obj(d, k), d.parent / f"{d.name}-object"),
    "object of another uid": lambda d, k: os.chown(_obj(d, k), OUTSIDER, OUTSIDER),
    "object others may write": lambda d, k: _obj(d, k).chmod(0o666),
    "object a FIFO": lambda d, k: (lambda o: (o.unlink(), os.mkfifo(o)))(_obj(d, k)),
    "object one byte flipped": lambda d, k: flip_byte(_obj(d, k)),
}


@needs_root
@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_hostile_layer_is_never_loaded(public: Path, volume: Path, key: CacheKey, case: str) -> None:
    """The review's 16 layouts of a read layer someone else could have shaped: each refused
    (a miss), by an engine of another uid, and nothing under the layer changed."""
    layer = public / "layer"
    assert Store(layer).commit(key, BAKED) is not None
    _HOSTILE[case](layer, key)
    with as_user(NOBODY):
        store = Store(volume / "cache", read_dirs=[layer])
        assert store.lookup_or_quarantine(key, load=True) is None, case
        assert store.lookup_or_quarantine(key) is None, case
    assert not (layer / "quarantine").exists()


@needs_root
def test_layer_reached_through_a_link_is_the_operators_path(public: Path, volume: Path, key: CacheKey) -> None:
    """The guard of the 16: the layer's own path may be a link (the operator's setting)."""
    layer = public / "layer"
    assert Store(layer).commit(key, BAKED) is not None
    os.symlink(layer, public / "layer-link")
    with as_user(NOBODY):
        found = Store(volume / "cache", read_dirs=[public / "layer-link"]).lookup_or_quarantine(key, load=True)
    assert found is not None and found[1] == BAKED.object_bytes


def test_eviction_and_housekeeping_never_touch_a_layer(tmp_path: Path, key: CacheKey, monkeypatch: pytest.MonkeyPatch) -> None:
    """The size cap, LRU eviction and housekeeping act on the writable root only: a layer
    holding three entries keeps every file and every mtime while the root evicts down to its cap."""
    from cute_diskcache.storage import eviction, housekeeping

    layer = tmp_path / "layer"
    keys = [make_key(kind) for kind in ("micro", "static", "dynamic")]
    for i, k in enumerate(keys):
        assert Store(layer).commit(k, make_artifact((bytes([i + 1]) * 4000,))) is not None
    before = {str(p.relative_to(layer)): p.lstat().st_mtime_ns for p in layer.rglob("*")}
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "20K")
    store = Store(tmp_path / "root", read_dirs=[layer])
    for i in range(12):
        store.commit(make_key("micro", site_key=("micro",) + (i,) * 19), make_artifact((bytes([50 + i]) * 4000,)))
    assert sum(1 for _ in (tmp_path / "root" / "v1").rglob(entry.MANIFEST)) < 12, "the root did evict"
    eviction.make_room(store.root, 10**9, keep=None)
    housekeeping.maintain(store.root, force=True)
    store.maintain()
    assert {str(p.relative_to(layer)): p.lstat().st_mtime_ns for p in layer.rglob("*")} == before
    assert all(store.lookup_or_quarantine(k) is not None for k in keys)
