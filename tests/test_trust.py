"""Trust: a cache of native code must not become a way to run someone else's code.

Three refusals, each a miss (kernels compile in memory) with one log line saying why:
a root other users can write or another user owns; a symbolic link anywhere below the root
(never followed, never written through, its target never moved); with an HMAC key, an entry
that is unsigned or badly signed (a miss; the entry stays, and our own compile rewrites it signed:
another fleet's signature is not damage, so it is never quarantined).

The store-level tests build entries by hand (fast); the last ones run real probes, so the
refusal is seen the way an operator sees it: one line on a fresh engine's stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import make_artifact, make_key, payload_path  # noqa: E402

from cute_diskcache.storage import entry, trust  # noqa: E402
from cute_diskcache.keys.key import CacheKey  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402

if TYPE_CHECKING:
    from conftest import Warm

Probe = Callable[..., dict[str, Any]]
KEY = b"fleet secret \x00\xff"
OTHER_UID = 65534  # nobody


@pytest.fixture(autouse=True)
def fast_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.fixture
def key() -> CacheKey:
    return make_key("micro")


@pytest.fixture
def art() -> entry.Artifact:
    return make_artifact()


@pytest.fixture
def root(tmp_path: Path, key: CacheKey, art: entry.Artifact) -> Path:
    """A root holding one good, unsigned entry for ``key``; private (0700) like pytest's tmp."""
    r = tmp_path / "cache"
    assert Store(r).commit(key, art) is not None
    return r


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cute_diskcache" and r.levelno >= logging.WARNING]


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()}


def _assert_refused(store: Store, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture, why: str) -> None:
    """Serves nothing, writes nothing, locks nothing; one warning naming the reason, however often asked."""
    before = _tree(store.root)
    for _ in range(3):
        assert store.lookup_or_quarantine(key) is None
        assert store.commit(make_key("static"), art) is None
        with store.single_flight(key) as flight:
            assert not flight.held and flight.outcome == "off"
    assert _tree(store.root) == before
    assert not list(store.root.glob("locks/*")) and not store.quarantine_dir.exists()
    assert store.rejected == 0 and not store.writable
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "refuses cache root" in warnings[0] and why in warnings[0] and "CUTE_DISKCACHE_TRUST_SHARED" in warnings[0]


# --------------------------------------------------------------------------------------------
# Who can write the root
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "mode", "why"),
    [
        ("", 0o775, "writable by group (mode 0775)"),
        ("", 0o757, "writable by others (mode 0757)"),
        ("", 0o1777, "writable by group and others (mode 1777)"),  # sticky: still anyone can add files
        ("v1", 0o770, "writable by group"),
        ("locks", 0o777, "writable by group and others"),
    ],
)
def test_root_others_can_write_is_refused(
    root: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture, where: str, mode: int, why: str
) -> None:
    target = root / where
    target.mkdir(exist_ok=True)
    target.chmod(mode)
    _assert_refused(Store(root), key, art, caplog, why)


def test_trust_shared_accepts_a_group_writable_root(root: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture) -> None:
    root.chmod(0o775)
    store = Store(root, trust_shared=True)
    found = store.lookup_or_quarantine(key)
    assert found is not None and found[1] == art.object_bytes
    assert store.writable and store.commit(make_key("static"), art) is not None
    assert _warnings(caplog) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
@pytest.mark.parametrize("where", ["", "v1"])
def test_root_owned_by_another_user_is_refused(root: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture, where: str) -> None:
    os.chown(root / where, OTHER_UID, -1)
    _assert_refused(Store(root), key, art, caplog, f"owned by uid {OTHER_UID}")
    assert Store(root, trust_shared=True).lookup_or_quarantine(key) is not None


def test_v1_that_is_a_link_is_refused(root: Path, tmp_path: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = tmp_path / "elsewhere"
    (root / "v1").rename(elsewhere)
    (root / "v1").symlink_to(elsewhere)
    _assert_refused(Store(root), key, art, caplog, "symbolic link")


def test_absent_root_is_created_private_whatever_the_umask(tmp_path: Path, key: CacheKey, art: entry.Artifact) -> None:
    """A umask of 002 must not make the next process refuse the root this one made."""
    root = tmp_path / "new" / "cache"
    old = os.umask(0o002)
    try:
        store = Store(root)
        assert store.commit(key, art) is not None
        with store.single_flight(make_key("static")) as flight:
            assert flight.held
    finally:
        os.umask(old)
    for d in (root, root / "v1", root / "locks"):
        assert d.stat().st_mode & 0o022 == 0, oct(d.stat().st_mode)
    assert Store(root).lookup_or_quarantine(key) is not None


# --------------------------------------------------------------------------------------------
# Links below the root: never followed, never written through, targets never moved
# --------------------------------------------------------------------------------------------


def test_entry_dir_that_is_a_link_is_not_followed(root: Path, tmp_path: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture) -> None:
    store = Store(root)
    path = store.entry_dir(key)
    outside = tmp_path / "outside" / key.digest
    shutil.move(str(path), str(outside))  # a perfectly valid entry, just not inside the root
    path.symlink_to(outside)
    snapshot = _tree(outside)

    assert store.lookup_or_quarantine(key) is None
    assert store.rejected == 1
    assert any("link" in w for w in _warnings(caplog))
    assert not os.path.lexists(path), "the link itself is moved aside"
    [moved] = list(store.quarantine_dir.iterdir())
    assert moved.is_symlink() and "-link-" in moved.name
    assert _tree(outside) == snapshot, "the link's target must be left alone"

    assert store.commit(key, art) is not None  # the rewrite lands in a real directory
    assert not path.is_symlink() and store.lookup_or_quarantine(key) is not None
    assert _tree(outside) == snapshot


@pytest.mark.parametrize("level", ["namespace", "shard"])
def test_directory_link_above_the_entry_is_refused(
    root: Path, tmp_path: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture, level: str
) -> None:
    store = Store(root)
    link = store.entry_dir(key).parent if level == "shard" else store.entry_dir(key).parent.parent
    outside = tmp_path / "outside"
    shutil.move(str(link), str(outside))
    link.symlink_to(outside)
    snapshot = _tree(outside)

    for _ in range(2):
        assert store.lookup_or_quarantine(key) is None
        assert store.commit(key, make_artifact((b"\x33" * 64,))) is None, "never write through a link"
    assert _tree(outside) == snapshot
    assert link.is_symlink() and not store.quarantine_dir.exists()
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str(link) in warnings[0] and "symbolic link" in warnings[0], warnings


@pytest.mark.parametrize("role", ["manifest", "object", "cubin"])
def test_file_link_to_identical_bytes_outside_is_refused(
    root: Path, tmp_path: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture, role: str
) -> None:
    """The link's target holds exactly the right bytes: only refusing the link itself catches it."""
    store = Store(root)
    path = store.entry_dir(key)
    manifest = entry.read_manifest(path)
    victim = path / entry.MANIFEST if role == "manifest" else payload_path(path, manifest, role)
    outside = tmp_path / "outside.bin"
    shutil.move(str(victim), str(outside))
    victim.symlink_to(outside)
    snapshot = outside.read_bytes()

    with pytest.raises(entry.EntryError) as info:
        entry.verify(path, entry.read_manifest(path), key)
    assert info.value.reason == "link"
    assert store.lookup_or_quarantine(key) is None
    assert store.rejected == 1 and any("link" in w for w in _warnings(caplog))
    assert outside.read_bytes() == snapshot
    assert store.commit(key, art) is not None and store.lookup_or_quarantine(key) is not None


def test_first_link_stops_at_missing_components(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").symlink_to(tmp_path)
    assert trust.first_link(tmp_path, tmp_path / "a" / "b" / "c") == tmp_path / "a" / "b"
    assert trust.first_link(tmp_path, tmp_path / "a" / "x" / "y") is None
    assert trust.first_link(tmp_path, tmp_path / "a") is None


# --------------------------------------------------------------------------------------------
# Signatures
# --------------------------------------------------------------------------------------------


def _outer(path: Path) -> dict[str, Any]:
    return msgpack.unpackb((path / entry.MANIFEST).read_bytes(), raw=False)


def _write_outer(path: Path, outer: dict[str, Any]) -> None:
    (path / entry.MANIFEST).write_bytes(msgpack.packb(outer, use_bin_type=True))


def _tamper(path: Path, *, signature: str | None) -> None:
    """What an attacker without the key can do: change the body, recompute the seal, keep or drop the hmac."""
    outer = _outer(path)
    body = entry.unpack_manifest((path / entry.MANIFEST).read_bytes())
    body["extra"] = {"evil": True}
    raw = msgpack.packb(body, use_bin_type=True)
    outer["body"] = raw
    outer["sha256"] = entry._sha(raw)
    if signature is None:
        outer.pop("hmac", None)
    else:
        outer["hmac"] = signature
    _write_outer(path, outer)


def test_signed_round_trip(tmp_path: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture) -> None:
    store = Store(tmp_path / "cache", hmac_key=KEY)
    manifest = store.commit(key, art)
    assert manifest is not None
    outer = _outer(store.entry_dir(key))
    assert outer["hmac"] == trust.sign(KEY, outer["sha256"]) and outer["hmac"] != trust.sign(b"other", outer["sha256"])
    found = store.lookup_or_quarantine(key)
    assert found is not None and found[1] == art.object_bytes
    # A reader without a key still reads signed entries: signing is for whoever checks.
    assert Store(tmp_path / "cache").lookup_or_quarantine(key) is not None
    assert store.rejected == 0 and _warnings(caplog) == []


@pytest.mark.parametrize(
    "signature",
    [
        pytest.param(None, id="hmac-dropped"),
        pytest.param("kept", id="old-hmac-kept"),
        pytest.param("0" * 64, id="forged-hmac"),
        pytest.param(b"\x00", id="hmac-of-wrong-type"),
        pytest.param("\u00e9" * 64, id="hmac-non-ascii"),  # compare_digest raised TypeError on this
    ],
)
def test_tampered_body_with_a_recomputed_seal_is_a_miss(
    tmp_path: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture, signature: Any
) -> None:
    store = Store(tmp_path / "cache", hmac_key=KEY)
    assert store.commit(key, art) is not None
    path = store.entry_dir(key)
    _tamper(path, signature=_outer(path)["hmac"] if signature == "kept" else signature)
    # Without a key the tampered entry reads fine: the seal alone proves nothing about who wrote it.
    assert entry.read_manifest(path)["extra"] == {"evil": True}

    with pytest.raises(entry.EntryError) as info:
        entry.read_manifest(path, hmac_key=KEY)
    assert info.value.reason == "signature"
    assert store.lookup_or_quarantine(key) is None
    assert store.rejected == 1
    assert not store.quarantine_dir.exists() and (path / entry.MANIFEST).exists(), "a signature is not damage: the entry stays"
    assert len(_warnings(caplog)) == 1 and ("signature" in _warnings(caplog)[0] or "not signed" in _warnings(caplog)[0])
    assert store.commit(key, art) is not None
    found = store.lookup_or_quarantine(key)
    assert found is not None and found[0]["extra"] == {}


def test_another_fleets_entry_is_a_miss_that_stays(tmp_path: Path, key: CacheKey, art: entry.Artifact) -> None:
    """Signed with another key: not ours to load, not ours to move aside (issue 15, item 5)."""
    other = Store(tmp_path / "cache", hmac_key=b"someone else's key")
    other.commit(key, art)
    store = Store(tmp_path / "cache", hmac_key=KEY)
    assert store.lookup_or_quarantine(key) is None and store.rejected == 1
    assert not store.quarantine_dir.exists()
    assert other.lookup_or_quarantine(key) is not None, "the other fleet still hits it"
    assert store.commit(key, art) is not None and store.lookup_or_quarantine(key) is not None  # our compile then replaces it


def test_unsigned_entry_is_a_miss_then_rewritten_signed(root: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture) -> None:
    store = Store(root, hmac_key=KEY)
    path = store.entry_dir(key)
    payloads_before = {p.name: p.stat().st_ino for p in path.iterdir() if p.name != entry.MANIFEST}
    assert "hmac" not in _outer(path)
    for _ in range(2):  # a miss reads the store twice (again under the lock): one line, one rejection
        assert store.lookup_or_quarantine(key) is None
    assert store.rejected == 1 and not store.quarantine_dir.exists()
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "not signed" in warnings[0]

    assert store.commit(key, art) is not None
    assert _outer(path)["hmac"] == trust.sign(KEY, _outer(path)["sha256"])
    assert store.lookup_or_quarantine(key) is not None
    # Same bytes, same names: the payloads were verified and kept, only the manifest changed.
    assert {p.name: p.stat().st_ino for p in path.iterdir() if p.name != entry.MANIFEST} == payloads_before


def test_rewrite_replaces_a_payload_whose_bytes_do_not_match_its_name(root: Path, key: CacheKey, art: entry.Artifact) -> None:
    """A leftover (or planted) file under a content-addressed name must not survive a rewrite."""
    store = Store(root)
    path = store.entry_dir(key)
    manifest = entry.read_manifest(path)
    obj = payload_path(path, manifest, "object")
    obj.write_bytes(b"not the object")
    (path / entry.MANIFEST).unlink()
    assert store.commit(key, art) is not None
    found = store.lookup_or_quarantine(key)
    assert found is not None and found[1] == art.object_bytes


# --------------------------------------------------------------------------------------------
# Real engine starts: what the operator sees
# --------------------------------------------------------------------------------------------


def test_world_writable_root_is_refused_by_a_real_process(micro_copy: Warm, probe: Probe) -> None:
    root, cold = micro_copy
    root.chmod(0o777)
    before = _tree(root)
    report = probe(root, 1)
    assert report["real_compiles"] == 1 and report["counters"]["hits"] == 0
    assert report["counters"]["writes"] == 0 and report["counters"]["writable"] is False
    assert report["records"][0]["launch_error"] == cold["records"][0]["launch_error"]
    lines = report["stderr"].splitlines()
    assert len(lines) == 1 and "refuses cache root" in lines[0] and "mode 0777" in lines[0], report["stderr"]
    assert _tree(root) == before

    trusted = probe(root, 1, extra_env={"CUTE_DISKCACHE_TRUST_SHARED": "1"})
    assert trusted["real_compiles"] == 0 and trusted["counters"]["hits"] == 1 and trusted["stderr"] == ""


def test_hmac_key_resigns_an_unsigned_cache_then_hits(micro_copy: Warm, probe: Probe) -> None:
    root, cold = micro_copy
    env = {"CUTE_DISKCACHE_HMAC_KEY": "fleet-secret"}
    first = probe(root, 1, extra_env=env)
    assert first["real_compiles"] == 1 and first["counters"]["writes"] == 1 and first["counters"]["rejected"] == 1
    lines = first["stderr"].splitlines()
    assert len(lines) == 1 and "not signed" in lines[0], first["stderr"]
    assert not (root / "quarantine").exists()

    second = probe(root, 1, extra_env=env)
    assert second["real_compiles"] == 0 and second["counters"]["hits"] == 1 and second["stderr"] == ""
    assert second["records"][0]["launch_error"] == cold["records"][0]["launch_error"]

    wrong = probe(root, 1, extra_env={"CUTE_DISKCACHE_HMAC_KEY": "not-the-secret"})
    assert wrong["real_compiles"] == 1 and wrong["counters"]["rejected"] == 1
    assert "signature" in wrong["stderr"] and not (root / "quarantine").exists(), "another key's entry is a miss, not damage"


# --------------------------------------------------------------------------------------------
# Every level below the root (issue 15, item 1)
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _levels(store: Store, key: CacheKey) -> list[Path]:
    d = store.entry_dir(key)
    return [store.root, store.root / "v1", d.parent.parent, d.parent, d]


def test_every_level_a_commit_makes_is_private_whatever_the_umask(tmp_path: Path, key: CacheKey, art: entry.Artifact) -> None:
    """Under umask 002 mkdir(parents=True) made namespace, shard and entry directories 0775: any
    group member could then swap in a manifest and object (and recompute an unsigned seal)."""
    store = Store(tmp_path / "cache")
    with _umask(0o002):
        assert store.commit(key, art) is not None
        store.quarantine(store.entry_dir(make_key("static")), entry.EntryError("checksum", "test"))  # makes quarantine/
    for level in _levels(store, key) + [store.quarantine_dir]:
        assert stat.S_IMODE(level.stat().st_mode) & 0o022 == 0, f"{level} is {stat.S_IMODE(level.stat().st_mode):04o}"
    for f in store.entry_dir(key).iterdir():
        assert stat.S_IMODE(f.stat().st_mode) & 0o022 == 0, f


@pytest.mark.parametrize("level", [2, 3, 4], ids=["namespace", "shard", "entry"])
def test_group_writable_level_is_a_miss_until_a_commit_tightens_it(
    root: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture, level: int
) -> None:
    """A level an older version made 0775 (or a planted one): never read through; ours, so our
    next commit takes the write bits away and the entry is served again."""
    store = Store(root)
    target = _levels(store, key)[level]
    target.chmod(0o775)
    assert store.lookup_or_quarantine(key) is None
    assert store.lookup_or_quarantine(key) is None
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "writable by group" in warnings[0], warnings
    assert store.commit(key, art) is not None
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    found = Store(root).lookup_or_quarantine(key)
    assert found is not None and found[1] == art.object_bytes


@pytest.mark.parametrize("role", ["manifest", "object"])
def test_file_others_can_write_is_refused(root: Path, key: CacheKey, art: entry.Artifact, role: str) -> None:
    store = Store(root)
    path = store.entry_dir(key)
    target = path / entry.MANIFEST if role == "manifest" else payload_path(path, entry.read_manifest(path), "object")
    target.chmod(0o666)
    assert store.lookup_or_quarantine(key) is None
    [moved] = list(store.quarantine_dir.iterdir())
    assert "-untrusted-" in moved.name
    assert store.commit(key, art) is not None and store.lookup_or_quarantine(key) is not None
    assert Store(root, trust_shared=True).lookup_or_quarantine(key) is not None, "a trusted shared root accepts group-writable files"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_entry_directory_of_another_user_is_refused(root: Path, key: CacheKey, art: entry.Artifact) -> None:
    store = Store(root)
    os.chown(store.entry_dir(key), OTHER_UID, -1)
    assert store.lookup_or_quarantine(key) is None
    [moved] = list(store.quarantine_dir.iterdir())
    assert "-untrusted-" in moved.name and moved.stat().st_uid == OTHER_UID


def test_root_removed_under_a_running_store_is_remade_private(tmp_path: Path, key: CacheKey, art: entry.Artifact) -> None:
    """rm -rf <root> under a running engine (the README says it is safe): the next commit made
    the root and v1/ again with the umask's mode, and every later process refused the root."""
    store = Store(tmp_path / "cache")
    assert store.commit(key, art) is not None
    shutil.rmtree(store.root)
    with _umask(0o002):
        assert store.commit(make_key("static"), art) is not None
    for level in _levels(store, make_key("static")):
        assert stat.S_IMODE(level.stat().st_mode) & 0o022 == 0, level
    fresh = Store(tmp_path / "cache")
    assert fresh.trusted and fresh.lookup_or_quarantine(make_key("static")) is not None
