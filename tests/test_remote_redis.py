"""Fleet sharing through a real redis-server: nodes are separate processes with separate roots.

Every test talks to a redis-server this module starts on a free loopback port (the binary is
installed by ``scripts/ensure_test_tools.sh`` (README step 2, ``.ci/run``); without it these tests fail, unless ``CDC_TEST_NO_REDIS=1`` says
this machine has none on purpose). The kernels are real: flashinfer 0.6.15.post1's micro
kernel compiled on the CPU through the rtx-pro-6000 profile by the ``probe`` fixture, and
"zero compiles" is the conftest's independent count of the DSL's compiles.

Failure modes are real too: a closed port (dead remote), a socket server that accepts and
never answers (hung remote), and bytes flipped inside a stored value (corrupt remote). Each
must leave every request working, with the added latency bounded; the measured numbers are
printed (``-s``) and asserted only against generous bounds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import make_artifact, make_key  # noqa: E402
from _servers import DeadPort, HungServer, free_port  # noqa: E402

from cute_diskcache.storage import entry, ingest  # noqa: E402
from cute_diskcache.remote import blob  # noqa: E402
from cute_diskcache.remote.client import RemoteCache  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402

if TYPE_CHECKING:
    from conftest import Warm

ProbeFn = Callable[..., dict[str, Any]]
#: Set to 1 on a developer machine without redis-server to skip (CI must not set it).
OPT_OUT = "CDC_TEST_NO_REDIS"
TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server on loopback for this module, stopped afterwards."""
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get(OPT_OUT) == "1":
            pytest.skip(f"redis-server not installed and {OPT_OUT}=1")
        pytest.fail(f"redis-server is not installed (.ci/run installs it: apt-get install redis-server); {OPT_OUT}=1 skips these tests on purpose")
    import redis

    workdir = tmp_path_factory.mktemp("redis")
    log = open(workdir / "redis.log", "wb")
    # free_port() frees the port before redis binds it: with two xdist workers another
    # worker's server can take it in between. Ours answers with its own pid, else try again.
    for _attempt in range(5):
        port = free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
            stdout=log, stderr=subprocess.STDOUT,
        )
        client = redis.Redis(port=port, socket_timeout=1)
        deadline = time.monotonic() + 15
        answered = None
        while answered is None and proc.poll() is None and time.monotonic() < deadline:
            try:
                answered = int(client.info("server")["process_id"])
            except redis.ConnectionError:
                time.sleep(0.05)
        if answered == proc.pid and proc.poll() is None:
            break
        proc.kill()
        proc.wait()
    else:
        pytest.fail(f"redis-server did not start: {(workdir / 'redis.log').read_text()[-2000:]}")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture
def redis_db(redis_url: str) -> Iterator[Any]:
    """An empty database for one test."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def hung() -> Iterator[HungServer]:
    server = HungServer()
    server.url = f"redis://127.0.0.1:{server.port}/0"  # type: ignore[attr-defined]
    yield server
    server.close()


def node_env(url: str, **extra: str) -> dict[str, str]:
    # A signing fleet, as a shared store requires (without a key the remote tier is off: test_remote_unit).
    return {"CUTE_DISKCACHE_REMOTE": url, "CUTE_DISKCACHE_REMOTE_TIMEOUT": str(TIMEOUT_S), "CUTE_DISKCACHE_HMAC_KEY": "fleet-secret", **extra}


def unsigned_node_env(url: str) -> dict[str, str]:
    """A node that takes unsigned remote entries by explicit opt-in (and says so, once)."""
    env = node_env(url, CUTE_DISKCACHE_REMOTE_UNSIGNED="1")
    del env["CUTE_DISKCACHE_HMAC_KEY"]
    return env


def entry_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted((root / "v1").rglob("*")) if p.is_file()}


def remote_names(db: Any) -> list[str]:
    """The whole entries (not their ``.hit`` values: :mod:`cute_diskcache.remote.blob`)."""
    return sorted(k.decode() for k in db.keys("cute-diskcache/v1/*") if not k.endswith(b".hit"))


def check_value(value: bytes, name: str, tmp: Path) -> dict[str, Any]:
    """The manifest of a remote value that verifies like a bundle entry (raises otherwise)."""
    parsed = blob.parse_name("cute-diskcache", name)
    assert parsed is not None
    ns, digest = parsed
    edir = blob.stage(blob.unpack(value, ns, digest), tmp / os.urandom(4).hex(), ns, digest)
    manifest, _ = ingest.check(edir)
    return manifest


def _launch_errors(report: dict[str, Any]) -> dict[int, str]:
    return {r["m"]: r["launch_error"] for r in report["records"]}


# --------------------------------------------------------------------------------------------
# Two nodes, one compile
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_second_node_compiles_nothing(probe: ProbeFn, redis_db: Any, redis_url: str, tmp_path: Path) -> None:
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    a = probe(node_a, 1, extra_env=node_env(redis_url))
    ca = a["counters"]
    assert a["real_compiles"] == 1 and (ca["compiles"], ca["writes"], ca["remote_misses"], ca["remote_errors"]) == (1, 1, 1, 0)
    names = remote_names(redis_db)
    assert len(names) == 1 and names[0].endswith(a["events"][0][1]), "the compile was published at exit (write-behind)"
    check_value(redis_db.get(names[0]), names[0], tmp_path)

    b = probe(node_b, 1, extra_env=node_env(redis_url))
    cb = b["counters"]
    assert b["real_compiles"] == 0, b["stderr"]
    assert (cb["compiles"], cb["misses"], cb["hits"], cb["remote_hits"], cb["remote_errors"], cb["published"]) == (0, 0, 1, 1, 0, 0)
    assert [(e[1], e[2]) for e in b["events"]] == [(a["events"][0][1], "remote-hit")]
    assert b["kernels"] == a["kernels"] and _launch_errors(b) == _launch_errors(a), "the same kernel, same ABI"
    assert entry_files(node_b) == entry_files(node_a), "stored locally, byte for byte"
    assert b["stderr"] == ""
    hit_ms, fetch_ms = b["events"][0][3] * 1e3, cb["remote_seconds"] * 1e3
    print(f"\nremote hit: {hit_ms:.1f} ms (fetch + verify + store {fetch_ms:.1f} ms, {cb['remote_bytes_in']} bytes; "
          f"+ {cb['remote_setup_seconds'] * 1e3:.0f} ms importing redis-py, once per process); "
          f"node A compiled in {a['events'][0][3]:.2f} s")
    assert len(remote_names(redis_db)) == 1, "a hit publishes nothing"


# --------------------------------------------------------------------------------------------
# A remote that is down, hung or corrupt: every request still works, the delay is bounded
# --------------------------------------------------------------------------------------------


@pytest.mark.serial
@pytest.mark.slow
def test_dead_remote_costs_a_refused_connect(probe: ProbeFn, tmp_path: Path) -> None:
    """A refused connect costs milliseconds; retried, or waited on, it costs the deadline.
    With a 2 s deadline, half of it tells the two apart however loaded the machine is."""
    timeout = 2.0
    with DeadPort() as dead:  # nothing listens there, nor can while the test runs
        t0 = time.perf_counter()
        r = probe(tmp_path / "root", 1, extra_env=node_env(f"redis://127.0.0.1:{dead.port}/0", CUTE_DISKCACHE_REMOTE_TIMEOUT=f"{timeout:g}"))
    wall = time.perf_counter() - t0
    c = r["counters"]
    # remote_errors: the fetch, and maybe already the background publish (it may also fail after the report).
    assert r["real_compiles"] == 1 and (c["compiles"], c["writes"], c["errors"], c["remote_hits"]) == (1, 1, 0, 0) and c["remote_errors"] >= 1
    assert "Connection refused" in r["stderr"], r["stderr"]
    print(f"\ndead remote: {c['remote_seconds'] * 1e3:.1f} ms added to the miss (+ {c['remote_setup_seconds'] * 1e3:.0f} ms importing redis-py, "
          f"once per process); process wall {wall:.1f} s")
    assert c["remote_seconds"] < timeout / 2


@pytest.mark.serial
@pytest.mark.slow
def test_hung_remote_adds_at_most_the_timeout(probe: ProbeFn, hung: HungServer, tmp_path: Path) -> None:
    """At least the deadline (the miss did ask the hung remote and waited for it), and well under
    two deadlines (a second call waited for after the first timed out) or no deadline at all (a
    hang for good): a 1 s deadline leaves half a second of margin for a loaded machine."""
    timeout = 1.0
    t0 = time.perf_counter()
    r = probe(tmp_path / "root", 1, extra_env=node_env(hung.url, CUTE_DISKCACHE_REMOTE_TIMEOUT=f"{timeout:g}"))
    wall = time.perf_counter() - t0
    c = r["counters"]
    assert r["real_compiles"] == 1 and (c["compiles"], c["writes"], c["errors"]) == (1, 1, 0) and c["remote_errors"] >= 1
    assert hung.accepted >= 1 and ("Timeout reading" in r["stderr"] or "no answer within" in r["stderr"]), r["stderr"]  # socket timeout or our deadline
    print(f"\nhung remote: {c['remote_seconds'] * 1e3:.0f} ms added to the miss (timeout {timeout} s; + {c['remote_setup_seconds'] * 1e3:.0f} ms import); compile "
          f"{r['events'][0][3]:.2f} s; process wall {wall:.1f} s (exit waits for the publish, bounded)")
    assert timeout * 0.9 < c["remote_seconds"] < timeout * 1.5
    assert (tmp_path / "root" / "v1").is_dir() and len(list((tmp_path / "root" / "v1").glob("*/*/*/manifest.msgpack"))) == 1


@pytest.mark.slow
def test_local_hit_never_asks_the_remote(probe: ProbeFn, hung: HungServer, micro_copy: Warm) -> None:
    r = probe(micro_copy.root, 1, extra_env=unsigned_node_env(hung.url))  # the warm root's entries are unsigned
    c = r["counters"]
    assert r["real_compiles"] == 0 and (c["hits"], c["remote_hits"], c["remote_misses"], c["remote_errors"]) == (1, 0, 0, 0)
    assert c["remote_seconds"] == 0 and hung.accepted == 0, "a hit never touches the remote"
    lines = r["stderr"].splitlines()
    assert len(lines) == 1 and "accepting unsigned entries" in lines[0], r["stderr"]


@pytest.mark.slow
def test_corrupt_remote_value_is_a_miss_and_gets_replaced(
    probe: ProbeFn, redis_db: Any, redis_url: str, warm_micro_root: Warm, tmp_path: Path
) -> None:
    pushed = RemoteCache(redis_url).push(warm_micro_root.root)
    assert pushed["pushed"] == 1
    (name,) = remote_names(redis_db)
    doc = msgpack.unpackb(redis_db.get(name), raw=False)
    obj = next(n for n in doc["files"] if n.startswith("object-"))
    data = bytearray(doc["files"][obj])
    data[len(data) // 2] ^= 0x01  # one flipped bit in the kernel's object
    doc["files"][obj] = bytes(data)
    bad = msgpack.packb(doc, use_bin_type=True)
    redis_db.set(name, bad)
    redis_db.delete(name + ".hit")  # as published before hit values existed: the whole value is what a node reads

    r = probe(tmp_path / "root", 1, extra_env=unsigned_node_env(redis_url))  # the pushed warm entry is unsigned
    c = r["counters"]
    assert r["real_compiles"] == 1 and (c["compiles"], c["writes"], c["remote_hits"], c["remote_errors"]) == (1, 1, 0, 1)
    assert "checksum" in r["stderr"] and "will replace it" in r["stderr"]
    assert _launch_errors(r) == _launch_errors(warm_micro_root.cold)
    assert not (tmp_path / "root" / "quarantine").exists(), "the bad value never reached the cache root"
    healed = redis_db.get(name)
    assert healed != bad, "this node's compile replaced the bad value"
    assert check_value(healed, name, tmp_path)["digest"] == name.rsplit("/", 1)[1]


# --------------------------------------------------------------------------------------------
# Concurrent publishers of one entry
# --------------------------------------------------------------------------------------------

_PUBLISHER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[4])
    from _helpers import make_key
    from cute_diskcache.remote.client import RemoteCache
    from cute_diskcache.storage.store import Store
    root, url, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    key = make_key("micro")
    rc = RemoteCache(url, timeout=5)
    rc.backend()
    (root / "ready").touch()
    while not go.exists():
        time.sleep(0.001)
    rc.publish(key, Store(root).entry_dir(key))
    assert rc.flush(30)
    print(json.dumps(rc.counters.as_dict()))
    """
)


def test_concurrent_publishers_of_one_entry(redis_db: Any, redis_url: str, tmp_path: Path) -> None:
    key = make_key("micro")
    roots = [tmp_path / f"node-{i}" for i in range(4)]
    manifests = set()
    for root in roots:
        store = Store(root)
        assert store.commit(key, make_artifact()) is not None  # same kernel, each node's own manifest (time, host)
        manifests.add((store.entry_dir(key) / entry.MANIFEST).read_bytes())
    assert len(manifests) == 4
    go = tmp_path / "go"
    tests_dir = str(Path(__file__).resolve().parent)
    procs = [
        subprocess.Popen([sys.executable, "-c", _PUBLISHER, str(root), redis_url, str(go), tests_dir], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for root in roots
    ]
    deadline = time.monotonic() + 120
    while not all((root / "ready").exists() for root in roots):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.01)
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(o["published"] for o in outs) == 1, outs
    assert all(o["remote_errors"] == 0 and o["publish_dropped"] == 0 for o in outs), outs
    (name,) = remote_names(redis_db)
    value = redis_db.get(name)
    assert check_value(value, name, tmp_path)["digest"] == key.digest
    assert blob.unpack(value, key.env.namespace, key.digest)[entry.MANIFEST] in manifests, "exactly one publisher's entry, whole"
