"""The remote tier's parts on their own: breaker, write-behind queue, value format, fetch checks.

No server here: the store is fsspec's ``memory://`` (in-process) or ``file://`` (a directory),
or, for the deadline tests, a backend that never answers. The real-Redis and real-kernel
tests are in ``test_remote_redis.py``. Entries are synthetic (``_helpers``): what is tested is
that a fetched value goes through the same checks as a local entry, not the DSL.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import make_artifact, make_env, make_key  # noqa: E402

from cute_diskcache import cli, config  # noqa: E402
from cute_diskcache.storage import entry, ingest, layout  # noqa: E402
from cute_diskcache.keys.key import CacheKey  # noqa: E402
from cute_diskcache.remote import RemoteError, blob, from_url, redact  # noqa: E402
from cute_diskcache.remote.breaker import Breaker  # noqa: E402
from cute_diskcache.remote.client import RemoteCache  # noqa: E402
from cute_diskcache.remote.publisher import Publisher  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_stats")


def commit(root: Path, key: CacheKey, body: bytes = b"\x22" * 48, hmac_key: bytes | None = None) -> Path:
    store = Store(root, hmac_key=hmac_key)
    assert store.commit(key, make_artifact((body,))) is not None
    return store.entry_dir(key)


@pytest.fixture
def memory_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh ``memory://`` store per test (fsspec's memory filesystem is process-global)."""
    import fsspec

    url = f"memory://cdc-test-{os.getpid()}-{request.node.name[:40]}-{os.urandom(3).hex()}"
    yield url
    try:
        fsspec.filesystem("memory").rm(url.split("://", 1)[1], recursive=True)
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------------------------
# Breaker
# --------------------------------------------------------------------------------------------


def test_breaker_opens_after_threshold_then_lets_one_probe_through() -> None:
    now = [0.0]
    b = Breaker(threshold=3, cooldown=10.0, clock=lambda: now[0])
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.state == "closed"
    assert b.allow()
    b.failure()
    assert b.state == "open" and not b.allow()
    now[0] = 9.9
    assert not b.allow()
    now[0] = 10.0
    assert b.state == "half-open"
    assert b.allow(), "after the cool-down one call probes"
    assert not b.allow(), "only one probe at a time"
    b.failure()
    assert b.state == "open" and not b.allow(), "a failed probe opens it again at once"
    now[0] = 20.0
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.allow()


def test_breaker_success_resets_the_count() -> None:
    b = Breaker(threshold=2, cooldown=10.0)
    b.failure()
    b.success()
    b.failure()
    assert b.state == "closed", "failures must be consecutive"


# --------------------------------------------------------------------------------------------
# Publisher
# --------------------------------------------------------------------------------------------


@pytest.mark.serial
def test_publisher_never_blocks_drops_when_full_and_flushes() -> None:
    gate = threading.Event()
    sent: list[int] = []
    dropped: list[int] = []

    blocked_s = 30.0

    def send(job: int) -> None:
        gate.wait(blocked_s)
        sent.append(job)

    pub: Publisher[int] = Publisher(send, maxsize=2, on_drop=dropped.append)
    t0 = time.perf_counter()
    results = [pub.submit(i) for i in range(6)]
    # Six submits are microseconds; one that waits for room waits for the blocked send (30 s).
    assert time.perf_counter() - t0 < 1.0, "submit never waits for the remote"
    # The worker holds one job (blocked in send) and the queue two: the rest are dropped.
    assert results.count(True) in (2, 3) and dropped == [i for i, ok in enumerate(results) if not ok]
    assert pub.flush(0.2) is False, "a bounded flush gives up"
    gate.set()
    assert pub.flush(blocked_s) is True and sent == [i for i, ok in enumerate(results) if ok]
    assert pub.pending() == 0


def test_publisher_survives_a_failing_send(caplog: pytest.LogCaptureFixture) -> None:
    sent: list[int] = []

    def send(job: int) -> None:
        if job == 0:
            raise ValueError("boom")
        sent.append(job)

    pub: Publisher[int] = Publisher(send)
    pub.submit(0)
    pub.submit(1)
    assert pub.flush(5) and sent == [1]
    assert "boom" in caplog.text


# --------------------------------------------------------------------------------------------
# Value format
# --------------------------------------------------------------------------------------------


def test_blob_round_trip_carries_the_entry_byte_for_byte(tmp_path: Path) -> None:
    key = make_key("static")
    d = commit(tmp_path / "a", key)
    ns, digest, value = blob.pack(d)
    assert (ns, digest) == (key.env.namespace, key.digest)
    files = blob.unpack(value, ns, digest)
    assert files == {p.name: p.read_bytes() for p in d.iterdir()}
    edir = blob.stage(files, tmp_path / "staging", ns, digest)
    manifest, _ = ingest.check(edir)
    assert manifest["digest"] == key.digest
    name = blob.object_name("pfx/", ns, digest)
    assert name == f"pfx/v1/{ns}/{digest}" and blob.parse_name("pfx", name) == (ns, digest)
    assert blob.parse_name("pfx", f"pfx/v1/{ns}/../{digest}") is None
    assert blob.parse_name("pfx", f"other/v1/{ns}/{digest}") is None


def _doc(value: bytes) -> dict[str, Any]:
    doc: dict[str, Any] = msgpack.unpackb(value, raw=False)
    return doc


@pytest.mark.parametrize(
    "case",
    ["garbage", "not-a-map", "version", "other-digest", "other-namespace", "dotdot", "slash", "no-manifest", "str-payload", "too-many"],
)
def test_blob_unpack_refuses_what_cannot_be_laid_out(case: str, tmp_path: Path) -> None:
    key = make_key("micro")
    ns, digest, value = blob.pack(commit(tmp_path / "a", key))
    doc = _doc(value)
    if case == "garbage":
        raw = b"\xc1garbage"
    elif case == "not-a-map":
        raw = msgpack.packb([1, 2])
    else:
        if case == "version":
            doc["version"] = 2
        elif case == "other-digest":
            doc["digest"] = "0" * 64
        elif case == "other-namespace":
            doc["namespace"] = make_env(arch="sm_121a").namespace
        elif case == "dotdot":
            doc["files"]["../../evil.o"] = b"x"
        elif case == "slash":
            doc["files"]["sub/evil.o"] = b"x"
        elif case == "no-manifest":
            del doc["files"][entry.MANIFEST]
        elif case == "str-payload":
            doc["files"]["object-x.o"] = "text"
        elif case == "too-many":
            doc["files"].update({f"cubin-{i:04d}.cubin": b"x" for i in range(blob.MAX_FILES)})
        raw = msgpack.packb(doc, use_bin_type=True)
    with pytest.raises(entry.EntryError):
        blob.unpack(raw, ns, digest)


# --------------------------------------------------------------------------------------------
# Fetch and publish through a real fsspec store
# --------------------------------------------------------------------------------------------


def test_read_through_then_local(tmp_path: Path, memory_url: str) -> None:
    key = make_key("micro")
    src = commit(tmp_path / "a", key)
    rc = RemoteCache(memory_url)
    rc.publish(key, src)
    assert rc.flush(5) and rc.counters.published == 1 and rc.counters.remote_bytes_out > 0

    node_b = Store(tmp_path / "b")
    found = rc.fetch(key, node_b)
    assert found is not None and rc.flush(5)  # the whole entry is stored in the background, after the hit
    assert found == node_b.lookup_or_quarantine(key), "stored locally, loaded as a local entry"
    assert found[1] == entry.verify(src, entry.read_manifest(src), key)
    c = rc.counters
    assert (c.remote_hits, c.remote_misses, c.remote_errors) == (1, 0, 0) and c.remote_bytes_in == c.remote_bytes_out
    assert not list((tmp_path / "b" / layout.TMP_DIR).iterdir()), "staging is cleaned up"

    assert rc.fetch(make_key("dynamic"), node_b) is None
    assert rc.counters.remote_misses == 1


def test_second_publish_of_one_entry_is_a_no_op(tmp_path: Path, memory_url: str) -> None:
    key = make_key("micro")
    first = commit(tmp_path / "a", key, b"\x01" * 48)
    RemoteCache(memory_url).push(tmp_path / "a")
    ours = RemoteCache(memory_url)
    ours.publish(key, commit(tmp_path / "b", key, b"\x01" * 48))
    assert ours.flush(5) and ours.counters.published == 0
    value = ours.backend().get(ours.name(key.env.namespace, key.digest))  # type: ignore[union-attr]
    assert value is not None and blob.unpack(value, key.env.namespace, key.digest)[entry.MANIFEST] == (first / entry.MANIFEST).read_bytes()


def test_read_only_node_loads_a_verified_copy_and_writes_nothing(tmp_path: Path, memory_url: str) -> None:
    key = make_key("micro")
    rc = RemoteCache(memory_url)
    rc.push(commit(tmp_path / "a", key).parents[3])
    ro_root = tmp_path / "ro"
    found = rc.fetch(key, Store(ro_root, readonly=True))
    assert found is not None and rc.counters.remote_hits == 1
    assert not ro_root.exists(), "nothing written under a read-only root"


@pytest.mark.parametrize("damage", ["flipped-payload-bit", "garbage", "unsigned"])
def test_bad_remote_value_is_a_miss_then_replaced_by_our_compile(damage: str, tmp_path: Path, memory_url: str) -> None:
    key = make_key("micro")
    hmac_key = b"fleet" if damage == "unsigned" else None
    src = commit(tmp_path / "a", key)  # unsigned
    rc = RemoteCache(memory_url, hmac_key=hmac_key)
    backend = rc.backend()
    assert backend is not None
    name = rc.name(key.env.namespace, key.digest)
    _ns, _d, value = blob.pack(src)
    if damage == "flipped-payload-bit":
        doc = _doc(value)
        obj = next(n for n in doc["files"] if n.startswith("object-"))
        doc["files"][obj] = bytes([doc["files"][obj][0] ^ 1]) + doc["files"][obj][1:]
        value = msgpack.packb(doc, use_bin_type=True)
    elif damage == "garbage":
        value = os.urandom(300)
    backend.put(name, value, only_if_absent=False)

    node = Store(tmp_path / "b", hmac_key=hmac_key)
    assert rc.fetch(key, node) is None
    assert (rc.counters.remote_hits, rc.counters.remote_errors) == (0, 1)
    assert node.lookup_or_quarantine(key) is None and not list(layout.entry_dirs(tmp_path / "b")), "nothing bad comes in"
    assert backend.get(name) == value, "a fetch never deletes the remote object"

    # This node compiles it (here: writes it) and its publish replaces the bad value.
    rc.publish(key, commit(tmp_path / "b", key, hmac_key=hmac_key))
    assert rc.flush(5) and rc.counters.published == 1
    fresh = RemoteCache(memory_url, hmac_key=hmac_key)
    assert fresh.fetch(key, Store(tmp_path / "c", hmac_key=hmac_key)) is not None


def test_node_with_another_signing_key_leaves_the_fleets_entry_alone(tmp_path: Path, memory_url: str,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Issue 29, finding 4: a fleet signs with K1; one node (a canary mid-rotation, a typo) holds
    K2. It misses (another key's entry is never loaded) and compiles, and the fleet's entry stays:
    the local rule, where a badly signed entry is not damage. Before, its publish replaced the
    fleet's entry and the next correct node compiled again."""
    from cute_diskcache.core import export
    from cute_diskcache.core.cache import CompileCache

    monkeypatch.setattr(export, "export", lambda kernel, digest, seconds, extra, device, **kw: make_artifact())
    monkeypatch.setattr(CompileCache, "_load", lambda self, key, found: "loaded")
    key = make_key("micro")

    def node(name: str, hmac_key: bytes) -> tuple[Any, RemoteCache, CompileCache]:
        rc = RemoteCache(memory_url, hmac_key=hmac_key, use_lease=False)
        cache = CompileCache(Store(tmp_path / name, hmac_key=hmac_key), remote=rc)
        kernel, _ = cache.get_or_compile(key, lambda: "compiled")
        assert rc.flush(5)
        return kernel, rc, cache

    assert node("a", b"K1")[0] == "compiled"
    fleets = RemoteCache(memory_url).backend().get(RemoteCache(memory_url).name(key.env.namespace, key.digest))  # type: ignore[union-attr]
    kernel, odd, _ = node("odd", b"K2")
    assert kernel == "compiled" and odd.counters.published == 0, "the odd node's compile stays its own"
    rc = RemoteCache(memory_url)
    assert rc.backend().get(rc.name(key.env.namespace, key.digest)) == fleets, "the fleet's entry is untouched"  # type: ignore[union-attr]
    for name in ("c", "d"):
        kernel, rc_n, cache = node(name, b"K1")
        assert kernel == "loaded" and cache.counters.compiles == 0 and rc_n.counters.remote_hits == 1, name
    odd_lines = [r.getMessage() for r in caplog.records if "signed with another key" in r.getMessage()]
    assert len(odd_lines) == 1 and "stays" in odd_lines[0], odd_lines


def test_entry_for_another_key_under_our_name_is_refused(tmp_path: Path, memory_url: str) -> None:
    """A value copied under another entry's name: the name check refuses it before any disk write."""
    ours, theirs = make_key("micro"), make_key("static")
    rc = RemoteCache(memory_url)
    _ns, _d, value = blob.pack(commit(tmp_path / "a", theirs))
    rc.backend().put(rc.name(ours.env.namespace, ours.digest), value, only_if_absent=False)  # type: ignore[union-attr]
    assert rc.fetch(ours, Store(tmp_path / "b")) is None and rc.counters.remote_errors == 1


class _Hung:
    """A backend whose calls never return (a store that accepted the connection and went quiet)."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def get(self, name: str) -> bytes | None:
        self.calls += 1
        self.release.wait(30)
        return None

    def put(self, name: str, data: bytes, *, only_if_absent: bool) -> bool:
        self.calls += 1
        self.release.wait(30)
        return True

    def delete(self, name: str) -> None:
        pass

    def names(self, prefix: str) -> Iterator[str]:
        return iter(())


@pytest.mark.serial
def test_deadline_bounds_every_call_and_the_breaker_stops_asking(tmp_path: Path) -> None:
    hung = _Hung()
    timeout = 0.4
    rc = RemoteCache("hung://", timeout=timeout, cooldown=60, backend=hung)
    store = Store(tmp_path / "r")
    # Built before the clock starts: a process's first key imports the device-facts module (over
    # a second), which an earlier test in the same process used to have paid for.
    key = make_key("micro")
    seconds = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert rc.fetch(key, store) is None
        seconds.append(time.perf_counter() - t0)
    hung.release.set()
    assert hung.calls == 3, "three failures open the breaker; then the remote is not asked"
    # Each call: at least the deadline, and far under the 30 s the hung backend holds it. With
    # the breaker open: no call and no wait (waited anyway, it is the deadline again). The
    # margins are the deadline's, not what a quiet machine's scheduler takes to wake a thread.
    assert all(timeout * 0.95 < s < timeout + 5 for s in seconds[:3]), seconds
    assert all(s < timeout / 2 for s in seconds[3:]), seconds
    c = rc.counters
    assert (c.remote_errors, c.remote_skipped) == (3, 2), c
    # Counted: every deadline, and no more than the calls took as seen from outside them.
    assert 3 * timeout * 0.95 < c.remote_seconds <= sum(seconds) + 1e-6, (c.remote_seconds, seconds)
    # A publish while the breaker is open is dropped (counted), not attempted.
    rc.publish(make_key("micro"), commit(tmp_path / "a", make_key("micro")))
    assert rc.flush(5) and rc.counters.publish_dropped == 1 and hung.calls == 3


def test_unusable_url_disables_the_remote_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rc = RemoteCache("nosuchscheme://x/y")
    assert rc.fetch(make_key("micro"), Store(tmp_path)) is None
    assert rc.fetch(make_key("micro"), Store(tmp_path)) is None
    assert caplog.text.count("disabled") == 1
    with pytest.raises(RemoteError):
        from_url("no-scheme-here", timeout=1)


def test_settings_and_redaction(monkeypatch: pytest.MonkeyPatch) -> None:
    s = config.load()
    assert s.remote is None and not s.remote_readonly and s.remote_timeout == 1.0 and s.remote_prefix == "cute-diskcache"
    monkeypatch.setenv("CUTE_DISKCACHE_REMOTE", "redis://:hunter2@cache:6379/0")
    monkeypatch.setenv("CUTE_DISKCACHE_REMOTE_READONLY", "1")
    monkeypatch.setenv("CUTE_DISKCACHE_REMOTE_TIMEOUT", "0.25")
    monkeypatch.setenv("CUTE_DISKCACHE_REMOTE_PREFIX", "/fleet-a/")
    s = config.load()
    assert (s.remote, s.remote_readonly, s.remote_timeout, s.remote_prefix) == ("redis://:hunter2@cache:6379/0", True, 0.25, "fleet-a")
    assert "hunter2" not in repr(s)
    assert redact(s.remote) == "redis://:***@cache:6379/0"
    assert "CUTE_DISKCACHE_REMOTE" in {env for env, _d in config.SETTINGS.values()}


@pytest.mark.parametrize("remote", [None, "redis://127.0.0.1:1/0"])
def test_no_client_code_loads_until_a_local_miss(remote: str | None, tmp_path: Path) -> None:
    """No remote set: nothing of the remote tier is imported. Set: still nothing, until a local miss asks it."""
    import subprocess

    code = (
        "import sys, cute_diskcache.core.cache as c; cache = c.default_cache();"
        "print(type(cache.remote).__name__, sorted(m for m in ('redis', 'fsspec', 'cute_diskcache.remote.client', 'cute_diskcache.storage.bundle') "
        "if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}
    env["CUTE_DISKCACHE_DIR"] = str(tmp_path)
    if remote:
        env["CUTE_DISKCACHE_REMOTE"] = remote
        env["CUTE_DISKCACHE_HMAC_KEY"] = "fleet-secret"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == ("LazyRemote []" if remote else "NoneType []")


@pytest.mark.parametrize("opt_in", [False, True])
def test_remote_without_a_signing_key_fails_closed(opt_in: bool, tmp_path: Path) -> None:
    """Issue 15, item 2: unsigned remote entries were loaded without a word; whoever could SET a
    key shipped native code to every node. Now the remote stays off (one warning), unless the
    operator opts in to unsigned entries (then one warning saying so)."""
    import subprocess

    code = "import cute_diskcache.core.cache as c; print(type(c.default_cache().remote).__name__)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")}
    env.update(CUTE_DISKCACHE_DIR=str(tmp_path), CUTE_DISKCACHE_REMOTE=(tmp_path / "shared").as_uri())
    if opt_in:
        env["CUTE_DISKCACHE_REMOTE_UNSIGNED"] = "1"
    proc = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(); " + code], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    if opt_in:
        assert proc.stdout.strip() == "LazyRemote" and "accepting unsigned entries" in lines[0]
    else:
        assert proc.stdout.strip() == "NoneType" and "CUTE_DISKCACHE_HMAC_KEY is not set" in lines[0]
        assert "CUTE_DISKCACHE_REMOTE_UNSIGNED=1" in lines[0]


def test_unsigned_remote_entry_is_refused_by_a_signing_node(tmp_path: Path, memory_url: str) -> None:
    """With the key set, a remote value written without it (or by anyone else) is never loaded."""
    unsigned = RemoteCache(memory_url)
    src = Store(tmp_path / "src")
    key = make_key("micro")
    src.commit(key, make_artifact())
    unsigned.publish(key, src.entry_dir(key))
    assert unsigned.flush(10)
    signing = Store(tmp_path / "node", hmac_key=b"fleet")
    assert RemoteCache(memory_url, hmac_key=b"fleet").fetch(key, signing) is None
    assert not list((tmp_path / "node").rglob("manifest.msgpack"))


# --------------------------------------------------------------------------------------------
# CLI: export --to-remote / import --from-remote, stats (file:// store: a directory)
# --------------------------------------------------------------------------------------------


def test_cli_push_pull_and_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    keys = [make_key(k) for k in ("micro", "static", "dynamic")] + [make_key("micro", env=make_env(arch="sm_121a"))]
    for i, k in enumerate(keys):
        commit(src, k, bytes([i + 1]) * 64)
    monkeypatch.setenv("CUTE_DISKCACHE_REMOTE", (tmp_path / "shared").as_uri())
    assert cli.main(["--root", str(src), "export", "--to-remote"]) == 2, "no key, no opt-in: the remote tier is off"
    assert "CUTE_DISKCACHE_HMAC_KEY is not set" in capsys.readouterr().err
    monkeypatch.setenv("CUTE_DISKCACHE_REMOTE_UNSIGNED", "1")

    assert cli.main(["--root", str(src), "export", "--to-remote", "--json"]) == 0
    pushed = json.loads(capsys.readouterr().out)
    assert (pushed["pushed"], pushed["present"]) == (4, 0)
    assert cli.main(["--root", str(src), "export", "--to-remote"]) == 0
    assert "pushed 0 entries" in capsys.readouterr().out and len(list((tmp_path / "shared").rglob("*"))) > 4

    dst = tmp_path / "dst"
    ns = keys[0].env.namespace
    assert cli.main(["--root", str(dst), "import", "--from-remote", "--namespace", ns]) == 0
    assert ": 3 imported, 0 kept" in capsys.readouterr().out
    assert cli.main(["--root", str(dst), "import", "--from-remote", "--json"]) == 0
    pulled = json.loads(capsys.readouterr().out)
    assert pulled["ok"] and len(pulled["imported"]) == 1 and len(pulled["kept"]) == 3
    assert sorted(d.name for d in layout.entry_dirs(dst)) == sorted(d.name for d in layout.entry_dirs(src))

    assert cli.main(["--root", str(dst), "stats"]) == 0
    out = capsys.readouterr().out
    assert "remote hits" in out and "published" in out and (tmp_path / "shared").as_uri() in out
    assert cli.main(["--root", str(dst), "export"]) == 2, "a bundle file or --to-remote"
    assert "one of the two" in capsys.readouterr().err
    monkeypatch.setenv("CUTE_DISKCACHE_REMOTE_READONLY", "1")
    assert cli.main(["--root", str(src), "export", "--to-remote"]) == 2
    monkeypatch.delenv("CUTE_DISKCACHE_REMOTE")
    monkeypatch.delenv("CUTE_DISKCACHE_REMOTE_READONLY")
    assert cli.main(["--root", str(src), "stats"]) == 0
    assert "(not configured now)" in capsys.readouterr().out, "what was counted still shows"
    assert cli.main(["--root", str(tmp_path / "fresh"), "stats"]) == 0
    assert "remote" not in capsys.readouterr().out, "no remote lines without a remote or remote activity"


# --------------------------------------------------------------------------------------------
# What held in the review of issue 29: forged .hit values never load
# --------------------------------------------------------------------------------------------


def _forge(hit: bytes, how: str) -> bytes:
    import hashlib

    d = msgpack.unpackb(hit, raw=False)
    files = d["files"]
    outer = msgpack.unpackb(files[entry.MANIFEST], raw=False)
    if how == "unsigned":
        outer.pop("hmac")
        files[entry.MANIFEST] = msgpack.packb(outer, use_bin_type=True)
    elif how == "another key":
        files[entry.MANIFEST] = entry.pack_manifest(msgpack.unpackb(outer["body"], raw=False), hmac_key=b"attacker")
    elif how == "payload swapped":
        for name in files:
            if name != entry.MANIFEST:
                files[name] = b"\x7fELF evil" + files[name][9:]
    elif how == "new payload, sealed without key":
        body = msgpack.unpackb(outer["body"], raw=False)
        evil = b"\x7fELF evil!"
        name = f"object-{hashlib.sha256(evil).hexdigest()[:16]}.o"
        body["payloads"]["object"] = [{"file": name, "size": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}]
        body["payloads"].pop("shared", None)
        d["files"] = {entry.MANIFEST: entry.pack_manifest(body), name: evil}
    elif how == "hmac as bytes":
        outer["hmac"] = outer["hmac"].encode()
        files[entry.MANIFEST] = msgpack.packb(outer, use_bin_type=True)
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize("whole", ["absent", "forged too"])
@pytest.mark.parametrize("how", ["unsigned", "another key", "payload swapped", "new payload, sealed without key", "hmac as bytes"])
def test_forged_hit_value_is_never_loaded_by_a_signing_node(tmp_path: Path, memory_url: str, how: str, whole: str) -> None:
    """The review's 10 forgeries of a ``.hit`` value (and of the whole entry beside it): with a
    key set, each is a miss and nothing of it enters the local root."""
    key = make_key("micro")
    src = commit(tmp_path / "src", key, hmac_key=b"K")
    _whole, hit = blob.pack_both(src, hmac_key=b"K")
    rc = RemoteCache(memory_url, hmac_key=b"K")
    backend = rc.backend()
    name = rc.name(key.env.namespace, key.digest)
    forged = _forge(hit, how)
    backend.put(blob.hit_object_name(rc.prefix, key.env.namespace, key.digest), forged, only_if_absent=False)  # type: ignore[union-attr]
    if whole == "forged too":
        backend.put(name, forged, only_if_absent=False)  # type: ignore[union-attr]
    node = Store(tmp_path / "node", hmac_key=b"K")
    assert rc.fetch(key, node) is None
    assert rc.flush(5) and node.lookup_or_quarantine(key) is None and not list(layout.entry_dirs(tmp_path / "node"))


def test_unforged_hit_value_loads(tmp_path: Path, memory_url: str) -> None:
    """The guard of the forgeries above: the same value, untouched, is a remote hit."""
    key = make_key("micro")
    src = commit(tmp_path / "src", key, hmac_key=b"K")
    _whole, hit = blob.pack_both(src, hmac_key=b"K")
    rc = RemoteCache(memory_url, hmac_key=b"K")
    rc.backend().put(blob.hit_object_name(rc.prefix, key.env.namespace, key.digest), hit, only_if_absent=False)  # type: ignore[union-attr]
    found = rc.fetch(key, Store(tmp_path / "node", hmac_key=b"K"))
    assert found is not None and rc.counters.remote_hits == 1
