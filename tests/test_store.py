"""The store: a bad entry is a miss that moves aside; a disk that says no is one warning.

Nothing here may raise into the compile path: every lookup returns an entry or None, every
commit returns a manifest or None.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import flip_byte, make_artifact, make_key, payload_path, rewrite_manifest  # noqa: E402

from cute_diskcache.storage import entry  # noqa: E402
from cute_diskcache.keys.key import CacheKey  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402


@pytest.fixture(autouse=True)
def fast_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """fsync's durability is entry.atomic_write's business (tested there); here it only costs time."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.fixture
def key() -> CacheKey:
    return make_key("static")


@pytest.fixture
def art() -> entry.Artifact:
    return make_artifact()


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "cache")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() else {}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cute_diskcache" and r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------------------------
# Lookups
# --------------------------------------------------------------------------------------------


def test_absent_entry_is_a_quiet_miss(store: Store, key: CacheKey, caplog: pytest.LogCaptureFixture) -> None:
    assert store.lookup_or_quarantine(key) is None
    assert store.rejected == 0
    assert not store.quarantine_dir.exists()
    assert _warnings(caplog) == []


def test_commit_then_lookup_hits(store: Store, key: CacheKey, art: entry.Artifact) -> None:
    manifest = store.commit(key, art)
    assert manifest is not None
    path = store.entry_dir(key)
    assert path == store.root / "v1" / key.env.namespace / key.digest[:2] / key.digest
    assert (path / entry.MANIFEST).is_file()
    found = store.lookup_or_quarantine(key)
    assert found is not None
    assert found[0] == manifest and found[1] == art.object_bytes
    assert store.rejected == 0


def test_entries_of_other_keys_do_not_answer(store: Store, key: CacheKey, art: entry.Artifact) -> None:
    store.commit(key, art)
    assert store.lookup_or_quarantine(make_key("micro")) is None
    assert store.rejected == 0


def _flip_object(path: Path, manifest: dict[str, Any]) -> None:
    flip_byte(payload_path(path, manifest, "object"))


def _truncate_cubin(path: Path, manifest: dict[str, Any]) -> None:
    p = payload_path(path, manifest, "cubin")
    p.write_bytes(p.read_bytes()[:-7])


def _garbage_manifest(path: Path, manifest: dict[str, Any]) -> None:
    (path / entry.MANIFEST).write_bytes(b"\x00garbage")


def _old_format(path: Path, manifest: dict[str, Any]) -> None:
    rewrite_manifest(path, {**manifest, "format": manifest["format"] + 1})


def _other_keys_manifest(path: Path, manifest: dict[str, Any]) -> None:
    rewrite_manifest(path, {**manifest, "key_bytes": make_key("dynamic").key_bytes})


def _entry_is_a_file(path: Path, manifest: dict[str, Any]) -> None:
    for p in path.iterdir():
        p.unlink()
    path.rmdir()
    path.write_bytes(b"not a directory")


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_flip_object, "checksum"),
        (_truncate_cubin, "truncated"),
        (_garbage_manifest, "manifest"),
        (_old_format, "stale"),
        (_other_keys_manifest, "foreign"),
        (_entry_is_a_file, "unreadable"),
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_bad_entry_is_quarantined_and_missed(
    store: Store,
    key: CacheKey,
    art: entry.Artifact,
    caplog: pytest.LogCaptureFixture,
    damage: Callable[[Path, dict[str, Any]], None],
    reason: str,
) -> None:
    manifest = store.commit(key, art)
    assert manifest is not None
    path = store.entry_dir(key)
    damage(path, manifest)
    damaged = _files(path) if path.is_dir() else {"": path.read_bytes()}

    assert store.lookup_or_quarantine(key) is None
    assert store.rejected == 1
    assert not os.path.lexists(path)
    moved = list(store.quarantine_dir.iterdir())
    assert len(moved) == 1
    assert f"-{reason}-" in moved[0].name and key.digest in moved[0].name
    kept = _files(moved[0]) if moved[0].is_dir() else {"": moved[0].read_bytes()}
    assert kept == damaged  # kept for a post-mortem, byte for byte
    assert len(_warnings(caplog)) == 1 and reason in _warnings(caplog)[0]

    # Now simply absent: no second rejection, no second warning.
    assert store.lookup_or_quarantine(key) is None
    assert store.rejected == 1
    assert len(list(store.quarantine_dir.iterdir())) == 1
    assert len(_warnings(caplog)) == 1

    # And the next compile's commit takes the slot back.
    assert store.commit(key, art) is not None
    found = store.lookup_or_quarantine(key)
    assert found is not None and found[1] == art.object_bytes


def test_two_quarantines_of_one_key_do_not_collide(store: Store, key: CacheKey, art: entry.Artifact) -> None:
    for _ in range(2):
        manifest = store.commit(key, art)
        assert manifest is not None
        _flip_object(store.entry_dir(key), manifest)
        assert store.lookup_or_quarantine(key) is None
    assert store.rejected == 2
    assert len(list(store.quarantine_dir.iterdir())) == 2


@pytest.mark.parametrize("name", ["object\x00.o", "../../../../../etc/passwd"], ids=["NUL", "escape"])
def test_hostile_manifest_is_a_miss_not_an_exception(store: Store, key: CacheKey, art: entry.Artifact, name: str) -> None:
    manifest = store.commit(key, art)
    assert manifest is not None
    manifest["payloads"]["object"][0]["file"] = name
    rewrite_manifest(store.entry_dir(key), manifest)
    assert store.lookup_or_quarantine(key) is None
    assert store.rejected == 1


# --------------------------------------------------------------------------------------------
# A root that cannot be written
# --------------------------------------------------------------------------------------------


@pytest.fixture
def blocked_store(tmp_path: Path) -> Store:
    """A root below a regular file: every mkdir fails with ENOTDIR, even for root."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache's parent should be")
    return Store(blocker / "cache")


def test_unwritable_root_warns_once_and_keeps_going(blocked_store: Store, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="cute_diskcache")
    assert blocked_store.writable
    results = [blocked_store.commit(make_key(kind), art) for kind in ("micro", "static", "dynamic", "static")]
    assert results == [None] * 4
    assert not blocked_store.writable
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert str(blocked_store.root) in warnings[0]


def test_unwritable_root_lookups_then_commits_warn_once(blocked_store: Store, art: entry.Artifact, caplog: pytest.LogCaptureFixture) -> None:
    """What an engine start does per kernel: lookup (miss), compile, commit. One warning total."""
    for kind in ("micro", "static", "dynamic", "micro"):
        k = make_key(kind)
        assert blocked_store.lookup_or_quarantine(k) is None
        assert blocked_store.commit(k, art) is None
    assert len(_warnings(caplog)) == 1
    assert blocked_store.rejected == 0
    assert not blocked_store.writable


# --------------------------------------------------------------------------------------------
# Read-only stores
# --------------------------------------------------------------------------------------------


def test_readonly_store_never_writes(tmp_path: Path, key: CacheKey, art: entry.Artifact) -> None:
    store = Store(tmp_path / "cache", readonly=True)
    assert not store.writable
    assert store.commit(key, art) is None
    assert store.lookup_or_quarantine(key) is None
    assert not (tmp_path / "cache").exists()


def test_readonly_store_reads_and_never_quarantines(tmp_path: Path, key: CacheKey, art: entry.Artifact) -> None:
    root = tmp_path / "cache"
    manifest = Store(root).commit(key, art)
    assert manifest is not None
    ro = Store(root, readonly=True)
    found = ro.lookup_or_quarantine(key)
    assert found is not None and found[1] == art.object_bytes

    _flip_object(ro.entry_dir(key), manifest)
    before = _files(root)
    for _ in range(2):
        assert ro.lookup_or_quarantine(key) is None
    assert ro.rejected == 2  # still counted: a shared cache with a bad entry is worth knowing
    assert _files(root) == before  # the entry stays in place, byte for byte
    assert not ro.quarantine_dir.exists()
    assert ro.commit(key, art) is None
    assert _files(root) == before


# --------------------------------------------------------------------------------------------
# Leftovers of a writer that died
# --------------------------------------------------------------------------------------------


def test_stray_temp_files_are_a_miss_then_commit_succeeds(store: Store, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture) -> None:
    path = store.entry_dir(key)
    path.mkdir(parents=True)
    (path / ".tmp.object-0123456789abcdef.o.otherhost.4242.a1b2c3d4e5f6").write_bytes(b"half an obj")
    (path / ".tmp.manifest.msgpack.otherhost.4242.0a0b0c0d0e0f").write_bytes(b"\x8f")
    assert store.lookup_or_quarantine(key) is None
    assert store.rejected == 0 and not store.quarantine_dir.exists()
    assert _warnings(caplog) == []

    assert store.commit(key, art) is not None
    found = store.lookup_or_quarantine(key)
    assert found is not None and found[1] == art.object_bytes


def test_payloads_without_manifest_are_a_miss_then_commit_succeeds(store: Store, key: CacheKey, art: entry.Artifact) -> None:
    """A writer killed after its payloads but before the commit marker."""
    manifest = store.commit(key, art)
    assert manifest is not None
    path = store.entry_dir(key)
    (path / entry.MANIFEST).unlink()
    payload_path(path, manifest, "object").write_bytes(b"a different, older object")
    assert store.lookup_or_quarantine(key) is None
    assert store.rejected == 0

    assert store.commit(key, art) is not None
    # The stale object under the content-addressed name must not be trusted on the next lookup.
    found = store.lookup_or_quarantine(key)
    assert found is None or found[1] == art.object_bytes


def test_concurrent_failing_commits_warn_once(store: Store, art: entry.Artifact, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine threads compiling at once all see the disk fail; the operator sees one line."""
    import errno
    import threading

    threads_n = 4
    barrier = threading.Barrier(threads_n, timeout=10)

    def full_disk(entry_dir: Path, key: CacheKey, art: entry.Artifact) -> dict[str, Any]:
        barrier.wait()  # every thread got past the writable check before any failed
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(entry, "write", full_disk)
    results: list[Any] = []
    threads = [threading.Thread(target=lambda k=k: results.append(store.commit(make_key(k), art))) for k in ("micro", "static", "dynamic", "micro")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results == [None] * threads_n
    assert not store.writable
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "disk full" in warnings[0]


# --------------------------------------------------------------------------------------------
# Races with removal (issue 15, item 13)
# --------------------------------------------------------------------------------------------


def test_reader_losing_a_payload_to_eviction_never_quarantines_the_fresh_entry(
    store: Store, key: CacheKey, art: entry.Artifact, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between our manifest read and our payload read, the entry is evicted and a third process
    commits a fresh one at the same path. Old code quarantined the path: the fresh entry."""
    assert store.commit(key, art) is not None
    fresh = make_artifact((b"\x44" * 48,))
    real = entry._read_payload
    fired: list[bool] = []

    def racing(path: Path, size: int, owner: int | None = None) -> bytes:
        if not fired:
            fired.append(True)
            d = store.entry_dir(key)
            shutil.rmtree(d)  # evicted...
            assert Store(store.root).commit(key, fresh) is not None  # ...and written again by someone else
        return real(path, size, owner)

    monkeypatch.setattr(entry, "_read_payload", racing)
    found = store.lookup_or_quarantine(key)
    assert fired and found is not None and found[1] == fresh.object_bytes, "read again: the fresh entry is a hit"
    assert not store.quarantine_dir.exists() and store.rejected == 0


def test_directory_vanishing_mid_commit_does_not_turn_writes_off(
    store: Store, key: CacheKey, art: entry.Artifact, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """rm -rf (or an eviction of the whole namespace) between mkdir and the write: old code took
    the ENOENT for a broken disk and stopped writing for the rest of the process."""
    from cute_diskcache.storage import trust

    real = trust.make_dirs
    fired: list[bool] = []

    def vanishing(root: Path, path: Path, *, shared: bool) -> None:
        real(root, path, shared=shared)
        if not fired and path == store.entry_dir(key):
            fired.append(True)
            shutil.rmtree(store.root / "v1")

    monkeypatch.setattr(trust, "make_dirs", vanishing)
    assert store.commit(key, art) is not None and fired
    assert store.writable and _warnings(caplog) == []
    assert store.commit(make_key("micro"), art) is not None
    assert store.lookup_or_quarantine(key) is not None


# --------------------------------------------------------------------------------------------
# Sound but not for this process: a miss that leaves the entry alone (issue 15, item 5)
# --------------------------------------------------------------------------------------------


def _other_cpu(path: Path, manifest: dict[str, Any]) -> None:
    rewrite_manifest(path, {**manifest, "host_isa": [*manifest["host_isa"], "avx1024_imaginary"]})


def _other_device(path: Path, manifest: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from cute_diskcache.keys import devicefacts

    rewrite_manifest(path, {**manifest, "device": {"source": "profile:x", "name": "x", "facts": {"multiprocessor_count": 170}}})
    monkeypatch.setattr(devicefacts, "mismatch", lambda record: "multiprocessor_count: built against 170, this device has 188")


@pytest.mark.parametrize("refusal", ["host-cpu", "device", "load"])
def test_refused_entry_that_is_sound_is_never_quarantined(
    store: Store, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """On a shared volume one odd node (another CPU, another device variant, a DSL that cannot
    load the object) moved aside every entry it touched; nodes with different CPUs quarantined
    each other's entries. Now it is a miss for that process and the entry stays."""
    from cute_diskcache.core.cache import CompileCache

    manifest = store.commit(key, art)
    assert manifest is not None
    path = store.entry_dir(key)
    if refusal == "host-cpu":
        _other_cpu(path, manifest)
    elif refusal == "device":
        _other_device(path, manifest, monkeypatch)
    else:
        from cute_diskcache.storage import loader

        refuse = lambda *a: (_ for _ in ()).throw(RuntimeError("Symbols not found: CuteDSLRT_x"))  # noqa: E731
        monkeypatch.setattr(loader, "load_object", refuse)
        monkeypatch.setattr(loader, "load_shared", refuse)
    before = _files(path)
    cache = CompileCache(store, single_flight=False)
    monkeypatch.setattr(store, "persist", lambda *a, **k: None)  # the compile's own rewrite is not what this is about
    kernel, _ = cache.get_or_compile(key, lambda: "compiled here")
    assert kernel == "compiled here" and cache.counters.compiles == 1
    assert not store.quarantine_dir.exists() and _files(path) == before, "the entry stays for the hosts it fits"
    warnings = _warnings(caplog)
    assert len(warnings) == 2 and "does not fit this process" in warnings[0] and refusal in warnings[0], warnings
    assert warnings[1].startswith(f"compiling {key.site} kernel {key.digest[:12]}: entry refused: "), warnings  # and why (explain)
