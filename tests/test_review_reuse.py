"""Second-stage records and links under attack and under faults (issue 39, findings 2-4, 6, 7).

A record (``reuse/<scope>/<k2[:2]>/<k2>``) chooses which entry a kernel gets after an upgrade, so
it is held to an entry's rules: bound to the second-stage key it was written for and, with an
HMAC key, signed; one that fails is ignored with one warning and never exported. A link that
must copy makes the copy an entry's file (0644 whatever the umask); a hard link adds no bytes to
the size counter; ``prune`` takes records and release markers that name nothing any more; the
first *usable* record wins, here or in a layer.

Synthetic entries (tests/_helpers.py) and a stand-in trace: no compile. The hit's native load is
replaced by a marker naming the entry whose bytes it would load (every check before it is real);
what a real load does is tests/test_reuse.py's and tests/test_foreign_objects.py's business.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import msgpack
import pytest

from _helpers import make_artifact, make_env, make_key
from cute_diskcache.core.cache import CompileCache
from cute_diskcache.keys.trace import Traced, stage_two_key
from cute_diskcache.storage import eviction, layout, reuse, staleness
from cute_diskcache.storage.store import Store

CTX = "ctx"
OLD = make_env(package="flashinfer-python==0.6.15.post1", device="sm_120-188")
NEW = make_env(package="flashinfer-python==0.6.16.post4", sources="6" * 64, device="sm_120-188")
KEY = b"fleet-secret-0123456789abcdef"


def traced(ir: str) -> Traced:
    return Traced(ir_digest=ir * 32, dsl_hash="", function_name="f", dsl_version="", settings="", options="",
                  locations_stripped=True, seconds=0.0)


ACT, TOPK = traced("ac"), traced("70")  # two kernels' traced IR (the activation and top-k sum kernels)


def old_entry(store: Store, kind: str, ir: Traced, *, size: int = 16) -> Any:
    """An entry the old release compiled (its cubin ``size`` times its kind), with the record its compile writes."""
    key = make_key(kind, env=OLD)
    assert store.commit(key, make_artifact(cubin_bodies=(kind.encode() * size,))) is not None
    assert reuse.write_record(store, key, stage_two_key(make_key(kind, env=NEW), ir, CTX))
    return key


def engine(root: Path, *, hmac_key: bytes | None = None, read_dirs: tuple[Path, ...] = ()) -> CompileCache:
    cache = CompileCache(Store(root, hmac_key=hmac_key, read_dirs=read_dirs), single_flight=False)
    # The marker: which entry's bytes a hit would hand flashinfer (the reused entry's source).
    cache._load = lambda key, found: ("loaded", (found[0].get("reused_from") or {}).get("digest", found[0]["digest"]))  # type: ignore[method-assign]
    return cache


def ask(cache: CompileCache, kind: str, ir: Traced) -> Any:
    """The new release's engine asks for ``kind``'s kernel, whose trace is ``ir``."""
    kernel, _ = cache.get_or_compile(make_key(kind, env=NEW), lambda: "compiled",
                                     reuse=lambda: reuse.Plan(trace=lambda: ir, context=CTX))
    return kernel


def record_of(root: Path, kind: str, ir: Traced) -> Path:
    key = make_key(kind, env=NEW)
    return reuse._record_path(root, reuse.scope(key.env), stage_two_key(key, ir, CTX))


# --------------------------------------------------------------------------------------------
# Finding 2: records bound to their k2 and signed
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hmac_key", [KEY, None], ids=["signed", "unsigned-root"])
def test_a_record_copied_under_another_kernels_key_is_never_followed(tmp_path: Path, hmac_key: bytes | None,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    store = Store(root, hmac_key=hmac_key)
    old_entry(store, "micro", ACT)
    topk = old_entry(store, "static", TOPK)
    # A group member rewrites the activation kernel's record with top-k sum's (a valid record, for another k2).
    planted = record_of(root, "micro", ACT)
    planted.unlink()
    shutil.copyfile(record_of(root, "static", TOPK), planted)
    caplog.set_level(logging.WARNING, logger="cute_diskcache")
    cache = engine(root, hmac_key=hmac_key)
    assert ask(cache, "micro", ACT) == "compiled", "top-k sum's kernel handed out as the activation kernel"
    assert ask(engine(root, hmac_key=hmac_key), "micro", ACT) == "compiled"
    warned = [r for r in caplog.records if "ignores second-stage record" in r.getMessage()]
    assert len(warned) == 1 and "another second-stage key" in warned[0].getMessage(), [r.getMessage() for r in caplog.records]
    assert ask(engine(root, hmac_key=hmac_key), "static", TOPK) == ("loaded", topk.digest), "the sound record still serves"


def test_a_forged_record_without_the_key_is_never_followed_nor_exported(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = Store(root, hmac_key=KEY)
    act = old_entry(store, "micro", ACT)
    topk = old_entry(store, "static", TOPK)
    # Without the key a member writes a record for the activation kernel's k2 naming top-k sum's
    # entry as any writer does, but cannot sign it ...
    planted = record_of(root, "micro", ACT)
    assert reuse.write_record(Store(root), topk, planted.name)
    assert ask(engine(root, hmac_key=KEY), "micro", ACT) == "compiled", "top-k sum's kernel handed out as the activation kernel"
    # ... nor sign it with another key.
    assert reuse.write_record(Store(root, hmac_key=b"another key"), topk, planted.name)
    assert ask(engine(root, hmac_key=KEY), "micro", ACT) == "compiled"
    # export --to-remote publishes the sound record only, as stored (signed with the fleet's key).
    exported = {k2: named for _scope, k2, _ns, value in reuse.sealed_local_records(root, KEY)
                if (named := reuse.open_sealed(value, k2, KEY)) is not None}
    assert set(exported) == {record_of(root, "static", TOPK).name}
    assert exported[record_of(root, "static", TOPK).name][1] == topk.digest
    assert act.digest not in {d for _n, d in exported.values()}


def test_a_record_naming_another_entry_than_its_manifest_is_refused(tmp_path: Path) -> None:
    """The entry end of the binding: the record names (namespace, digest); the manifest found
    there must be that entry's."""
    root = tmp_path / "root"
    store = Store(root)
    old_entry(store, "micro", ACT)
    topk = old_entry(store, "static", TOPK)
    # An entry directory under a namespace its manifest does not name (moved there by hand).
    moved = layout.entry_dir(root, OLD.namespace.replace("flashinfer-moe", "flashinfer-gemm"), topk.digest)
    store.make_dirs(moved.parent)
    shutil.copytree(store.entry_dir(topk), moved)
    named = {"namespace": moved.parent.parent.name, "digest": topk.digest, "site": topk.site, "written": 0.0}
    with pytest.MonkeyPatch.context() as mp:  # a record naming the moved directory
        mp.setattr(reuse, "_record_value", lambda key: msgpack.packb(named, use_bin_type=True))
        assert reuse.write_record(store, topk, record_of(root, "micro", ACT).name)
    assert ask(engine(root), "micro", ACT) == "compiled"


# --------------------------------------------------------------------------------------------
# Finding 3: the copy fallback of a link
# --------------------------------------------------------------------------------------------


def test_a_copied_link_is_an_entry_file_whatever_the_umask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layer, root = tmp_path / "layer", tmp_path / "root"
    source = old_entry(Store(layer), "micro", ACT)
    real_link = os.link

    def across_filesystems(src: Any, dst: Any, **kw: Any) -> None:  # the layer on another filesystem
        if str(src).startswith(str(layer)):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src))
        real_link(src, dst, **kw)

    monkeypatch.setattr(os, "link", across_filesystems)
    old_umask = os.umask(0o002)  # Ubuntu's for users; the shared-volume setups docs/fleets.md describes
    try:
        cache = engine(root, read_dirs=(layer,))
        assert ask(cache, "micro", ACT) == ("loaded", source.digest), "the layer's kernel, reused"
        assert cache.counters.reused == 1 and cache.counters.compiles == 0
        new = cache.store.entry_dir(make_key("micro", env=NEW))
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in new.iterdir()}
        assert set(modes.values()) == {0o644}, modes
        assert not (root / layout.QUARANTINE_DIR).exists() or not any((root / layout.QUARANTINE_DIR).iterdir())
        again = engine(root, read_dirs=(layer,))
        assert ask(again, "micro", ACT) == ("loaded", source.digest) and again.counters.hits == 1
    finally:
        os.umask(old_umask)


# --------------------------------------------------------------------------------------------
# Finding 4: a hard link adds no bytes
# --------------------------------------------------------------------------------------------


def _on_disk(root: Path) -> int:
    seen: set[int] = set()
    total = 0
    for p in (root / layout.LAYOUT).rglob("*"):
        st = p.lstat()
        if stat.S_ISREG(st.st_mode) and st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    return total


def test_a_reused_entry_is_counted_once_and_culls_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    source = old_entry(Store(root), "micro", ACT, size=1 << 14)  # 80 KB of payloads
    source_dir = Store(root).entry_dir(source)
    before = eviction.read_usage(root).bytes
    # A cap the disk fits after the link (a manifest more), but not the link counted at its payloads' size.
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", str(before + layout.entry_bytes(source_dir) // 2))
    cache = engine(root)
    assert ask(cache, "micro", ACT) == ("loaded", source.digest)
    assert source_dir.exists(), "the old release's entry was culled: the link was counted twice"
    new_dir = cache.store.entry_dir(make_key("micro", env=NEW))
    walk = eviction.usage(root)
    assert walk["entry_bytes"] == _on_disk(root), "a walk counts a shared payload once"
    assert eviction.read_usage(root).bytes == walk["bytes"], "the counter agrees with the walk"
    assert layout.entry_bytes(new_dir) == (new_dir / "manifest.msgpack").stat().st_size, "only the manifest is new disk"
    # Removing the reused entry frees its manifest only: the payloads stay with the source.
    manifest_bytes = (new_dir / "manifest.msgpack").stat().st_size
    assert eviction.remove(root, new_dir) == manifest_bytes
    assert eviction.usage(root)["entry_bytes"] == _on_disk(root) == layout.entry_bytes(source_dir)


# --------------------------------------------------------------------------------------------
# Findings 6 and 7: stale records
# --------------------------------------------------------------------------------------------


def test_prune_takes_the_records_and_markers_of_what_it_removed(tmp_path: Path) -> None:
    """Finding 6, confirmed: an old release's marker outlived its entries, and every first-stage
    miss of the next release traced for nothing."""
    root = tmp_path / "root"
    gone = make_env(package="flashinfer-python==0.0.1", device="sm_120-188")  # a release not installed: stale
    store = Store(root)
    key = make_key(env=gone)
    store.commit(key, make_artifact())
    reuse.write_record(store, key, stage_two_key(make_key(env=NEW), ACT, CTX))
    assert reuse.possible(Store(root), NEW)
    report = staleness.prune(root, recent=0)
    assert [n["namespace"] for n in report["namespaces"]] == [gone.namespace]
    assert report["records_removed"] == 1
    assert not reuse.possible(Store(root), NEW), "a miss would still trace for a release that is gone"
    traces = engine(root)
    assert ask(traces, "micro", ACT) == "compiled" and traces.counters.traces == 0


def test_prune_keeps_records_that_name_live_entries(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = Store(root)
    source = old_entry(store, "micro", ACT)
    old_entry(store, "static", TOPK)
    shutil.rmtree(store.entry_dir(make_key("static", env=OLD)))  # evicted: its record is stale
    assert reuse.prune(root) == 1
    assert reuse.releases(root, reuse.scope(OLD)) == [reuse.release(OLD)]
    assert ask(engine(root), "micro", ACT) == ("loaded", source.digest)


def test_a_stale_record_here_does_not_hide_a_sound_one_in_a_layer(tmp_path: Path) -> None:
    """Finding 7, confirmed: the first record found won, usable or not."""
    layer, root = tmp_path / "layer", tmp_path / "root"
    source = old_entry(Store(layer), "micro", ACT)
    store = Store(root)
    evicted = old_entry(store, "micro", ACT)  # this root's own copy of the old entry ...
    shutil.rmtree(store.entry_dir(evicted))  # ... since evicted; its record stays
    assert ask(engine(root, read_dirs=(layer,)), "micro", ACT) == ("loaded", source.digest)
