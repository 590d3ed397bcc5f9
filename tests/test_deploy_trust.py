"""Trust as deployed (issue 20, item 1): built as root, served as a user; fsGroup volumes.

OpenSSH's StrictModes rule: a level owned by this euid *or by root*, writable by nobody else,
is trusted. A cache a ``docker build`` prewarmed as root is therefore served to a non-root
engine (read-only: hits, misses compile in memory, one INFO line), while every refusal that
keeps out a writer we do not trust stays: another non-root user's root, a level group or
others may write. ``CUTE_DISKCACHE_TRUST_GROUP`` trusts one named group (a Kubernetes
``fsGroup`` volume: group-owned, setgid, 2775) and nothing wider.

The store-level tests switch this (root) process's effective ids to another user's for the
body (:func:`_nobody.as_user`): the store sees what that user's engine would, in milliseconds.
The last tests run a real engine-like child under ``setpriv --reuid=65534`` on a cache a real
flashinfer compile filled as root.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import make_artifact, make_key  # noqa: E402
from _nobody import NOBODY, as_user, can_run_as_others, prefix, public_dir  # noqa: E402

from cute_diskcache import config  # noqa: E402
from cute_diskcache.storage import entry  # noqa: E402
from cute_diskcache.keys.key import CacheKey  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402

if TYPE_CHECKING:
    from conftest import Warm

pytestmark = pytest.mark.skipif(can_run_as_others() is not None, reason=str(can_run_as_others()))

OTHER = 65533  # another non-root user
FS_GROUP = 4242  # what a pod spec's securityContext.fsGroup would say
OTHER_GROUP = 4343


@pytest.fixture(autouse=True)
def fast_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.fixture
def public() -> Iterator[Path]:
    """A directory every uid can search (pytest's own tmp is 0700: nobody could reach a root in it)."""
    d = public_dir("cdc-deploy-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def key() -> CacheKey:
    return make_key("micro")


@pytest.fixture
def art() -> entry.Artifact:
    return make_artifact()


@pytest.fixture
def baked(public: Path, key: CacheKey, art: entry.Artifact) -> Path:
    """A root prewarmed by root, as a ``docker build`` leaves it: root-owned, 0755 / 0644."""
    root = public / "baked"
    assert Store(root).commit(key, art) is not None
    return root


def _records(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cute_diskcache" and r.levelno >= level]


def _tree(path: Path) -> dict[str, tuple[bytes, int, int]]:
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else b"", p.stat().st_uid, p.stat().st_mode) for p in sorted(path.rglob("*"))}


# --------------------------------------------------------------------------------------------
# Built as root, served as a user
# --------------------------------------------------------------------------------------------


def test_root_built_cache_is_served_read_only_to_a_non_root_uid(baked: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture) -> None:
    """The old rule (owner must be this euid) refused it whole: every kernel compiled again."""
    caplog.set_level(logging.INFO, logger="cute_diskcache")
    before = _tree(baked)
    with as_user(NOBODY):
        store = Store(baked)
        assert store.trusted
        for _ in range(2):
            found = store.lookup_or_quarantine(key, load=True)
            assert found is not None and found[1] == art.object_bytes
        assert not store.probe_writable() and not store.writable
        assert store.commit(make_key("static"), art) is None
        with store.single_flight(make_key("static")) as flight:
            assert not flight.held
        store.maintain()
    assert _tree(baked) == before
    assert store.rejected == 0
    assert _records(caplog) == [
        f"cache root {baked} is owned by root and read-only for uid {NOBODY}: serving its entries, new kernels stay in memory"
    ]


def test_hit_only_process_on_a_root_built_cache_says_nothing(baked: Path, key: CacheKey, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="cute_diskcache")
    with as_user(NOBODY):
        store = Store(baked)
        assert store.lookup_or_quarantine(key) is not None and not store.writable
    assert _records(caplog) == []


@pytest.mark.parametrize("where", ["root", "v1", "entry", "manifest"])
def test_another_non_root_users_level_is_still_refused(baked: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture, where: str) -> None:
    """Root is trusted; uid 65533 is not, at any level: it could swap in an object we would load."""
    store = Store(baked)
    target = {"root": baked, "v1": baked / "v1", "entry": store.entry_dir(key), "manifest": store.entry_dir(key) / entry.MANIFEST}[where]
    os.chown(target, OTHER, OTHER)
    before = _tree(baked)
    with as_user(NOBODY):
        store = Store(baked)
        for _ in range(2):
            assert store.lookup_or_quarantine(key) is None
        assert store.commit(make_key("static"), art) is None
    assert _tree(baked) == before
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1 and f"owned by uid {OTHER}, not by this process's uid {NOBODY} or root" in warnings[0], warnings
    if where in ("root", "v1"):
        assert "refuses cache root" in warnings[0] and "CUTE_DISKCACHE_TRUST_SHARED=1" in warnings[0]


def test_group_or_others_writable_root_built_cache_is_refused(baked: Path, key: CacheKey, caplog: pytest.LogCaptureFixture) -> None:
    """Owned by root is not enough: a level others can write is anyone's."""
    (baked / "v1").chmod(0o777)
    with as_user(NOBODY):
        assert Store(baked).lookup_or_quarantine(key) is None
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "writable by group and others (mode 0777)" in warnings[0], warnings
    assert "TRUST_GROUP" not in warnings[0], "others-writable: no group setting can make it safe"


# --------------------------------------------------------------------------------------------
# fsGroup volumes: CUTE_DISKCACHE_TRUST_GROUP
# --------------------------------------------------------------------------------------------


@pytest.fixture
def volume(public: Path) -> Path:
    """What the kubelet makes of a PVC with ``fsGroup: 4242``: root:4242, setgid, 2775."""
    vol = public / "volume"
    vol.mkdir()
    os.chown(vol, 0, FS_GROUP)
    vol.chmod(0o2775)
    return vol


def test_fsgroup_volume_is_refused_without_the_setting_and_names_it(volume: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture) -> None:
    with as_user(NOBODY, groups=[FS_GROUP]):
        store = Store(volume)
        assert store.commit(key, art) is None and store.lookup_or_quarantine(key) is None
    assert list(volume.iterdir()) == []
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert "writable by group (mode 2775)" in warnings[0] and f"CUTE_DISKCACHE_TRUST_GROUP={FS_GROUP}" in warnings[0], warnings


def test_fsgroup_volume_is_shared_by_the_groups_uids_with_trust_group(volume: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture) -> None:
    """Pod A (uid 65534) writes; pod B (uid 65533, same fsGroup) hits A's entry and adds its own
    in A's directories: the levels we create are group-owned and 2775 whatever the umask; the
    size counter and lock files follow it (docs/deploy.md: such pods run with umask 002)."""
    old_umask = os.umask(0o002)
    try:
        with as_user(NOBODY, groups=[FS_GROUP]):
            a = Store(volume, trust_group=FS_GROUP)
            assert a.commit(key, art) is not None
        entry_dir = a.entry_dir(key)
        for level in (volume / "v1", entry_dir.parent.parent, entry_dir.parent, entry_dir):
            st = level.stat()
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, FS_GROUP, 0o2775), level
        for f in entry_dir.iterdir():
            assert f.stat().st_mode & 0o022 == 0, f  # entries are replaced by rename, never rewritten in place
        with as_user(OTHER, groups=[FS_GROUP]):
            b = Store(volume, trust_group=FS_GROUP)
            found = b.lookup_or_quarantine(key)
            assert found is not None and found[1] == art.object_bytes
            assert b.commit(make_key("static"), art) is not None  # into the shard A made
            assert b.lookup_or_quarantine(make_key("static")) is not None
    finally:
        os.umask(old_umask)
    assert _records(caplog, logging.WARNING) == []


def test_levels_made_under_trust_group_are_group_writable_whatever_the_umask(volume: Path, key: CacheKey, art: entry.Artifact) -> None:
    old_umask = os.umask(0o077)
    try:
        with as_user(NOBODY, groups=[FS_GROUP]):
            store = Store(volume / "cache", trust_group=FS_GROUP)  # the root itself made by us, too
            assert store.commit(key, art) is not None
    finally:
        os.umask(old_umask)
    d = store.entry_dir(key)
    for level in (volume / "cache", volume / "cache" / "v1", d.parent.parent, d.parent, d):
        assert (level.stat().st_gid, stat.S_IMODE(level.stat().st_mode)) == (FS_GROUP, 0o2775), level


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("others", "writable by group and others (mode 2777)"),
        ("other-group", "writable by group (mode 2775)"),
    ],
)
def test_trust_group_still_refuses_others_and_other_groups(
    volume: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture, change: str, why: str
) -> None:
    with as_user(NOBODY, groups=[FS_GROUP]):
        assert Store(volume, trust_group=FS_GROUP).commit(key, art) is not None
    level = Store(volume).entry_dir(key).parent  # the shard
    if change == "others":
        level.chmod(0o2777)
    else:
        os.chown(level, NOBODY, OTHER_GROUP)
        level.chmod(0o2775)
    with as_user(NOBODY, groups=[FS_GROUP]):
        store = Store(volume, trust_group=FS_GROUP)
        for _ in range(2):
            assert store.lookup_or_quarantine(key) is None
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1 and str(level) in warnings[0] and why in warnings[0], warnings


# --------------------------------------------------------------------------------------------
# POSIX ACLs and owners outside the group (issue 29, finding 1)
# --------------------------------------------------------------------------------------------

OUTSIDER = 3000  # a backup or log agent: no member of FS_GROUP


def _setfacl(*args: str) -> None:
    """A real POSIX ACL, as an operator sets one (Debian's ``acl`` package: scripts/ensure_test_tools.sh)."""
    exe = shutil.which("setfacl")
    assert exe is not None, "setfacl is not installed (apt-get install acl; .ci/run installs it)"
    subprocess.run([exe, *args], check=True, capture_output=True)


def _plant(volume: Path, key: CacheKey) -> bytes:
    """What an outsider who may write the root does: move ``v1`` aside and build its own tree,
    which the setgid root hands group FS_GROUP. Returns the object it planted."""
    legit = Store(volume).entry_dir(key)
    manifest = entry.read_manifest(legit)
    evil = b"\x7fELF-attacker-object"
    os.rename(volume / "v1", volume / ".old")
    d = volume / "v1" / key.env.namespace / key.digest[:2] / key.digest
    d.mkdir(parents=True)
    name = f"object-{hashlib.sha256(evil).hexdigest()[:16]}.o"
    (d / name).write_bytes(evil)
    manifest["payloads"] = {"object": [{"file": name, "size": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}], "cubin": [], "mlir": []}
    (d / entry.MANIFEST).write_bytes(entry.pack_manifest(manifest))
    return evil


def test_acl_entry_for_a_non_member_is_refused_not_loaded(volume: Path, key: CacheKey, art: entry.Artifact,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """``u:3000:rwx`` on the volume root: its mode still reads 2775 (the group bits show the ACL
    mask), and uid 3000, no member, plants an object; the engine must never load it."""
    with as_user(NOBODY, groups=[FS_GROUP]):
        assert Store(volume, trust_group=FS_GROUP).commit(key, art) is not None
    _setfacl("-m", f"u:{OUTSIDER}:rwx", str(volume))
    assert stat.S_IMODE(volume.stat().st_mode) == 0o2775, "the mode shows the mask, not the agent"
    with as_user(OUTSIDER):
        evil = _plant(volume, key)
    assert (volume / "v1").stat().st_gid == FS_GROUP, "setgid gave the outsider's tree the trusted group"
    with as_user(NOBODY, groups=[FS_GROUP]):
        store = Store(volume, trust_group=FS_GROUP)
        for _ in range(2):
            found = store.lookup_or_quarantine(key, load=True)
            assert found is None or found[1] != evil, "the outsider's object was loaded"
            assert found is None
        assert store.commit(make_key("static"), art) is None
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1 and f"POSIX ACL entry for uid {OUTSIDER}" in warnings[0], warnings
    assert "setfacl -x" in warnings[0], "the way out is named"


@pytest.mark.parametrize("where", ["entry", "manifest"])
def test_acl_below_the_root_is_refused_too(volume: Path, key: CacheKey, art: entry.Artifact, caplog: pytest.LogCaptureFixture,
                                           where: str) -> None:
    """An entry directory or a file a member made, which an ACL opens to an outsider (who could
    rewrite the object in place): a miss, never a load."""
    with as_user(NOBODY, groups=[FS_GROUP]):
        assert Store(volume, trust_group=FS_GROUP).commit(key, art) is not None
    d = Store(volume).entry_dir(key)
    _setfacl("-m", f"u:{OUTSIDER}:rw{'x' if where == 'entry' else ''}", str(d if where == "entry" else d / entry.MANIFEST))
    with as_user(NOBODY, groups=[FS_GROUP]):
        assert Store(volume, trust_group=FS_GROUP).lookup_or_quarantine(key, load=True) is None
    warnings = _records(caplog, logging.WARNING)
    assert any(f"POSIX ACL entry for uid {OUTSIDER}" in w for w in warnings), warnings


@pytest.mark.parametrize("acl", [f"u:{OUTSIDER}:r-x", f"g:{FS_GROUP}:rwx", f"u:{NOBODY}:rwx", f"d:u:{OUTSIDER}:rwx"])
def test_acl_entries_that_let_no_outsider_write_are_accepted(volume: Path, key: CacheKey, art: entry.Artifact,
                                                            caplog: pytest.LogCaptureFixture, acl: str) -> None:
    """Read-only entries (a backup agent that only reads), the trusted group named again, this
    uid, and a default ACL (it shapes new files, which are checked themselves) refuse nothing."""
    with as_user(NOBODY, groups=[FS_GROUP]):
        assert Store(volume, trust_group=FS_GROUP).commit(key, art) is not None
    _setfacl("-m", acl, str(volume))
    with as_user(NOBODY, groups=[FS_GROUP]):
        found = Store(volume, trust_group=FS_GROUP).lookup_or_quarantine(key, load=True)
        assert found is not None and found[1] == art.object_bytes
    assert _records(caplog, logging.WARNING) == []


def test_root_owned_by_another_uid_needs_trusted_directories_above_it(volume: Path, key: CacheKey, art: entry.Artifact,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A root another uid owns is trusted through its group only where nobody outside the group
    can write the directories above it (whoever can could have put it there): the group vouches
    for a member, never for an owner an outsider's write could have made."""
    root = volume / "cache"
    with as_user(OTHER, groups=[FS_GROUP]):  # another pod's uid, a member, made the root
        assert Store(root, trust_group=FS_GROUP).commit(key, art) is not None
    assert root.stat().st_uid == OTHER
    with as_user(NOBODY, groups=[FS_GROUP]):
        assert Store(root, trust_group=FS_GROUP).lookup_or_quarantine(key) is not None, "members share it"
    assert _records(caplog, logging.WARNING) == []
    _setfacl("-m", f"u:{OUTSIDER}:rwx", str(volume))  # the directory above it, opened to an outsider
    with as_user(NOBODY, groups=[FS_GROUP]):
        store = Store(root, trust_group=FS_GROUP)
        assert store.lookup_or_quarantine(key) is None and not store.trusted
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1 and f"owned by uid {OTHER}" in warnings[0] and f"POSIX ACL entry for uid {OUTSIDER}" in warnings[0], warnings


# --------------------------------------------------------------------------------------------
# Every door makes the group's directories (issue 29, findings 5 and 6)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("door", ["remote", "bundle"])
def test_entries_that_arrive_from_outside_leave_the_root_writable_by_the_group(
        volume: Path, public: Path, key: CacheKey, art: entry.Artifact, door: str, caplog: pytest.LogCaptureFixture) -> None:
    """Finding 5: uid 65534 fetches (or imports) an entry first; uid 65533, of the same group,
    must still add its own kernels to that namespace, and its statistics. Before, the merge made
    ``v1/``, the namespace and the shard 2755 and ``stats/`` 0755: read-only for every other uid."""
    from cute_diskcache.storage import bundle, stats
    from cute_diskcache.core.cache import CompileCache
    from cute_diskcache.remote.client import RemoteCache

    built = public / "built"
    assert Store(built).commit(key, art) is not None
    url = f"memory://cdc-tg-{os.getpid()}-{os.urandom(3).hex()}"
    if door == "remote":
        RemoteCache(url).push(built)
    else:
        bundle.export_bundle(built, public / "kernels.tar.gz")
    old_umask = os.umask(0o002)
    try:
        with as_user(NOBODY, groups=[FS_GROUP]):
            store = Store(volume, trust_group=FS_GROUP)
            if door == "remote":
                rc = RemoteCache(url, use_lease=False)
                assert rc.fetch(key, store) is not None
                assert rc.flush(10)  # the whole entry follows a hit into the local root
            else:
                assert bundle.import_bundle(volume, public / "kernels.tar.gz", trust_group=FS_GROUP).imported
            stats.reset_for_tests()
            CompileCache(store)
            stats.record(key.env.namespace, "hits")
        d = store.entry_dir(key)
        for level in (volume / "v1", d.parent.parent, d.parent, d, volume / "stats"):
            st = level.stat()
            assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (FS_GROUP, 0o2775), (level, oct(st.st_mode))
        with as_user(OTHER, groups=[FS_GROUP]):
            other = Store(volume, trust_group=FS_GROUP)
            static = make_key("static")  # same namespace, another shard or the same one
            assert other.commit(static, art) is not None, other._write_disabled_reason
            assert other.lookup_or_quarantine(static) is not None
            stats.reset_for_tests()
            stats.bind(None)
            CompileCache(other)
            stats.record(key.env.namespace, "hits")
            assert stats.describe()["mapped"], "uid 65533's statistics file could not be made in stats/"
    finally:
        os.umask(old_umask)
        stats.reset_for_tests()
        stats.bind(None)
    assert OTHER in {p.stat().st_uid for p in (volume / "stats").iterdir()}
    assert _records(caplog, logging.WARNING) == []


@pytest.mark.parametrize("member", [True, False])
def test_first_miss_under_trust_group_leaves_a_root_the_next_process_accepts(public: Path, key: CacheKey, art: entry.Artifact,
                                                                           caplog: pytest.LogCaptureFixture, member: bool) -> None:
    """Finding 6: a miss takes its lock first, which makes ``locks/``. Made with the umask's mode
    (002) and the process's own group, the next process's trust walk read it as "writable by
    group (mode 0775)" and refused the whole root (suggesting the wrong group). A member's
    ``locks/`` gets the trusted group and 2775; a non-member's (a reader that trusts the group)
    stays private."""
    vol = public / "vol"
    vol.mkdir()
    if member:  # the operator's root: the engine's, group FS_GROUP, 0775, no setgid bit
        root = vol
        os.chown(root, NOBODY, FS_GROUP)
        root.chmod(0o775)
    else:
        os.chown(vol, NOBODY, NOBODY)
        root = vol / "cache"  # made by the engine
    old_umask = os.umask(0o002)
    try:
        with as_user(NOBODY, groups=[FS_GROUP] if member else []):
            first = Store(root, trust_group=FS_GROUP)
            with first.single_flight(key) as flight:
                assert flight.held
                assert first.commit(key, art) is not None
            first.maintain()
            second = Store(root, trust_group=FS_GROUP)
            assert second.lookup_or_quarantine(key) is not None, second._refusal
    finally:
        os.umask(old_umask)
    locks = (root / "locks").stat()
    assert (locks.st_gid, stat.S_IMODE(locks.st_mode)) == ((FS_GROUP, 0o2775) if member else (NOBODY, 0o755)), oct(locks.st_mode)
    assert _records(caplog, logging.WARNING) == []


def test_refusal_under_trust_group_names_that_group_not_another(public: Path, key: CacheKey, caplog: pytest.LogCaptureFixture) -> None:
    """A level of another group that group may write, under TRUST_GROUP=4242 (what an older
    version's ``locks/`` looked like): the way out is giving it group 4242, not trusting the
    process's own group as well, which the refusal used to suggest."""
    root = public / "root"
    root.mkdir()
    os.chown(root, NOBODY, FS_GROUP)
    root.chmod(0o2775)
    (root / "locks").mkdir()
    os.chown(root / "locks", NOBODY, NOBODY)
    (root / "locks").chmod(0o775)
    with as_user(NOBODY, groups=[FS_GROUP]):
        assert not Store(root, trust_group=FS_GROUP).trusted
    (warning,) = _records(caplog, logging.WARNING)
    assert f"chgrp {FS_GROUP} {root / 'locks'}" in warning and f"CUTE_DISKCACHE_TRUST_GROUP={NOBODY}" not in warning, warning


def test_trust_group_setting_takes_a_gid_or_a_name(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_TRUST_GROUP", str(FS_GROUP))
    assert config.load().trust_group == FS_GROUP
    monkeypatch.setenv("CUTE_DISKCACHE_TRUST_GROUP", "root")
    assert config.load().trust_group == 0
    monkeypatch.setenv("CUTE_DISKCACHE_TRUST_GROUP", "no-such-group-cdc")
    assert config.load().trust_group is None, "an unknown name trusts nobody more"
    assert any("no-such-group-cdc" in w for w in _records(caplog, logging.WARNING))


# --------------------------------------------------------------------------------------------
# A real engine, uid 65534, on a cache a real compile filled as root
# --------------------------------------------------------------------------------------------

#: The child's logging, set up as a serving engine sets up its own (vLLM configures its
#: loggers; the root handler takes ours): every cute_diskcache line, debug included.
_ENGINE_LOGGING = """
import logging
logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
logging.getLogger("cute_diskcache").setLevel(logging.DEBUG)
"""


@pytest.fixture
def engine_as_nobody(public: Path, compile_hook_dir: Path) -> Callable[..., dict[str, Any]]:
    """``run(root, *ms, logging_configured=True)``: the probe as uid 65534 (no groups), with a
    HOME it can write; ``logging_configured=False`` leaves logging as an engine that never
    configures it does (the cache's own handler then speaks)."""
    from conftest import run_probe

    hooks = {}
    for configured in (True, False):
        hook = hooks[configured] = public / ("hook" if configured else "hook-plain")
        hook.mkdir(mode=0o755)
        (hook / "sitecustomize.py").write_text((compile_hook_dir / "sitecustomize.py").read_text() + (_ENGINE_LOGGING if configured else ""))
    stage = public / "stage"
    stage.mkdir()
    home = public / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)

    def run(root: Path, *ms: int, extra_env: dict[str, str] | None = None, logging_configured: bool = True) -> dict[str, Any]:
        return run_probe(hooks[logging_configured], root, *ms, prefix=prefix(NOBODY, stage=stage),
                         extra_env={"HOME": str(home), **(extra_env or {})})

    return run


def _bake(warm: Warm, public: Path) -> Path:
    root = public / "image" / "cache"
    shutil.copytree(warm.root, root)
    for d in (public / "image", root):
        d.chmod(0o755)
    return root


@pytest.mark.slow
def test_uid_65534_engine_hits_a_root_prewarmed_cache_with_no_compile(
    warm_micro_root: Warm, public: Path, engine_as_nobody: Callable[..., dict[str, Any]]
) -> None:
    """Issue 20's done-when: root prewarmed, uid 65534 serves it with 0 compiles, and the
    engine's stderr shows the hit with no logging configured."""
    root = _bake(warm_micro_root, public)
    before = _tree(root)
    report = engine_as_nobody(root, 1, logging_configured=False)
    assert report["real_compiles"] == 0, report["stderr"]
    assert report["counters"]["hits"] == 1 and report["counters"]["compiles"] == 0 and report["counters"]["writable"] is False
    assert report["records"][0]["launch_error"] == warm_micro_root.cold["records"][0]["launch_error"]
    ours = report["cache_log"]  # the [cute-diskcache] lines of the child's stderr
    assert len(ours) == 2, ours
    assert ours[0].startswith(f"[cute-diskcache] INFO attached: cache {root} (read-only), 1 entry for this stack"), ours
    assert ours[1].startswith("[cute-diskcache] INFO this process: 1 hit, "), ours
    assert "WARNING" not in report["stderr"] and "refuses" not in report["stderr"], report["stderr"]
    assert _tree(root) == before
    print("\n".join(ours))


@pytest.mark.slow
def test_uid_65534_engine_compiles_a_miss_in_memory_with_one_line(
    warm_micro_root: Warm, public: Path, engine_as_nobody: Callable[..., dict[str, Any]]
) -> None:
    root = _bake(warm_micro_root, public)
    before = _tree(root)
    report = engine_as_nobody(root, 1, 16)  # m=16: the static kernel, not in the cache
    assert report["real_compiles"] == 1 and report["counters"]["hits"] == 1 and report["counters"]["writes"] == 0
    line = f"cache root {root} is owned by root and read-only for uid {NOBODY}: serving its entries, new kernels stay in memory"
    assert report["stderr"].count(line) == 1, report["stderr"]
    assert "cannot write" not in report["stderr"] and "refuses" not in report["stderr"], report["stderr"]
    assert _tree(root) == before
    print(report["stderr"])


def test_import_stats_and_settings_follow_trust_group(volume: Path, public: Path, key: CacheKey, art: entry.Artifact,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every door agrees with the engine: ``import`` into an fsGroup volume, and the trust note
    ``stats`` prints, accept what CUTE_DISKCACHE_TRUST_GROUP accepts (they checked uid and mode
    alone), and a read layer of an unknown ~user is skipped, never an exception from load()."""
    from cute_diskcache.cli import inventory
    from cute_diskcache.storage import bundle

    built = public / "built"
    assert Store(built).commit(key, art) is not None
    archive = public / "kernels.tar.gz"
    bundle.export_bundle(built, archive)
    with as_user(NOBODY, groups=[FS_GROUP]):
        with pytest.raises(bundle.BundleError, match=f"CUTE_DISKCACHE_TRUST_GROUP={FS_GROUP}"):
            bundle.import_bundle(volume, archive)
        report = bundle.import_bundle(volume, archive, trust_group=FS_GROUP)
        assert len(report.as_dict()["imported"]) == 1 and not report.as_dict()["bad"], report.as_dict()
        assert Store(volume, trust_group=FS_GROUP).lookup_or_quarantine(key) is not None
        assert inventory.trust_note(volume) is not None
        monkeypatch.setenv("CUTE_DISKCACHE_TRUST_GROUP", str(FS_GROUP))
        assert inventory.trust_note(volume) is None
    monkeypatch.setenv("CUTE_DISKCACHE_READ_DIRS", f"~cdc-no-such-user/cache{os.pathsep}{public}")
    assert config.load().read_dirs == (public,)
