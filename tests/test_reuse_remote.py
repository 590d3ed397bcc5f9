"""Issue 31 item 4: the remote tier finds second-stage entries too.

A fleet upgraded to a new flashinfer release: the old release's nodes published their entries
and second-stage records to the remote (a ``file://`` store here, fsspec's real backend); a node
of the new release starts on an empty root. After its first-stage misses (local, then remote)
it traces, finds the old entry through the remote record, fetches it into its root (checked as
any import) and links it under the new key: nothing is compiled, the next process hits locally.
Real flashinfer (0.6.15.post1 here, 0.6.16.post4 in the matrix cell), real DSL, fresh processes;
the W4A16 kernels of tests/test_reuse.py (~5 s a process).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_reuse import DRIVER, W4A16, _entry, _env, _payload_shas, new_python  # noqa: F401 (a fixture)

HMAC = "fleet-key-for-the-test"


def _drive(python: str, root: Path, remote: Path, **extra: str) -> tuple[dict[str, Any], str]:
    env = {**_env(root, python), "CUTE_DISKCACHE_REMOTE": f"file://{remote}", "CUTE_DISKCACHE_HMAC_KEY": HMAC, **extra}
    proc = subprocess.run([python, str(DRIVER), *W4A16], env=env, cwd=root.parent, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, new_python: str) -> dict[str, Any]:  # noqa: F811
    base = tmp_path_factory.mktemp("reuse-remote")
    remote = base / "remote"
    remote.mkdir()
    old, _ = _drive(sys.executable, base / "old-node", remote)  # publishes entries and records at exit
    new, new_log = _drive(new_python, base / "new-node", remote)
    again, _ = _drive(new_python, base / "new-node", remote)
    return {"base": base, "remote": remote, "old": old, "new": new, "new_log": new_log, "again": again}


def test_old_release_publishes_its_records_behind_its_entries(fleet: dict[str, Any]) -> None:
    assert fleet["old"]["flashinfer"] == "0.6.15.post1" and fleet["old"]["counters"]["compiles"] == 2
    reuse_dir = fleet["remote"] / "cute-diskcache" / "reuse"
    (scope,) = list(reuse_dir.iterdir())
    # a marker per release that published records in the scope (the new node's reuse publishes too)
    markers = sorted(p.name for p in (scope / "from").iterdir())
    assert markers == ["flashinfer-python__0.6.15.post1", "flashinfer-python__0.6.16.post4"], markers
    records = [p for p in scope.iterdir() if p.name != "from"]
    assert len(records) == 2 and all(len(p.name) == 64 for p in records)  # one per traced IR, naming the newest entry


def test_a_new_node_of_the_upgraded_fleet_reuses_through_the_remote(fleet: dict[str, Any]) -> None:
    new = fleet["new"]
    assert new["flashinfer"] == "0.6.16.post4"
    assert new["counters"]["compiles"] == 0 and new["counters"]["reused"] == 2, new["counters"]
    assert [e["outcome"] for e in new["events"]] == ["reused", "reused"]
    assert fleet["new_log"].count("from flashinfer 0.6.15.post1: same traced IR") == 2
    # the payloads are the old release's entry's, fetched and checked, under the new key
    for old_event, new_event in zip(fleet["old"]["events"], new["events"]):
        a = _entry(fleet["base"] / "new-node", old_event["digest"])  # fetched into the new node's root
        b = _entry(fleet["base"] / "new-node", new_event["digest"])
        assert a.parent.parent.name.startswith("flashinfer-moe-0.6.15.post1-")
        assert b.parent.parent.name.startswith("flashinfer-moe-0.6.16.post4-")
        assert _payload_shas(b, "cubin") and _payload_shas(b, "cubin") == _payload_shas(a, "cubin")


def test_the_next_process_hits_locally(fleet: dict[str, Any]) -> None:
    again = fleet["again"]["counters"]
    assert again["hits"] == 2 and again["reused"] == 0 and again["compiles"] == 0 and again["traces"] == 0


def test_a_record_signed_with_another_key_is_not_followed(fleet: dict[str, Any], new_python: str, tmp_path: Path) -> None:  # noqa: F811
    """A record re-signed by a writer without the fleet's key (the remote seeded from the old
    release's root, as the next test shows serves the upgrade) is not followed: the node compiles.
    A record is a pointer at another verified entry, so an unsigned one would choose the kernel."""
    import msgpack

    remote = tmp_path / "remote"
    assert _seed(fleet["base"] / "old-node", remote)["records"] == 2
    for record in (remote / "cute-diskcache" / "reuse").glob("*/*"):
        if record.is_file():
            sealed = msgpack.unpackb(record.read_bytes(), raw=False)
            record.write_bytes(msgpack.packb({**sealed, "sig": hashlib.sha256(b"forged").hexdigest()}, use_bin_type=True))
    forged, _ = _drive(new_python, tmp_path / "node", remote)
    assert forged["counters"]["reused"] == 0 and forged["counters"]["compiles"] == 2, forged["counters"]


def test_sealed_record_opens_only_for_its_k2_and_key() -> None:
    from cute_diskcache.storage import reuse
    from cute_diskcache.keys.key import CacheKey, Environment

    key = CacheKey(Environment(kind="flashinfer-moe", package="flashinfer-python==1", sources="s", arch="sm_120a"), "site", (1,))
    k2, other = "a" * 64, "b" * 64
    value = reuse.sealed_record(key, k2, b"key")
    assert reuse.open_sealed(value, k2, b"key") == (key.env.namespace, key.digest)
    assert reuse.open_sealed(value, other, b"key") is None  # moved under another k2
    assert reuse.open_sealed(value, k2, b"another key") is None
    assert reuse.open_sealed(reuse.sealed_record(key, k2, None), k2, b"key") is None  # unsigned, to a node with a key
    assert reuse.open_sealed(reuse.sealed_record(key, k2, None), k2, None) == (key.env.namespace, key.digest)
    assert reuse.open_sealed(b"\x00junk", k2, None) is None


def test_first_fill_of_a_fleet_never_traces(fleet: dict[str, Any]) -> None:
    """The old release's node: nothing of another release on the remote, so no miss traced."""
    assert fleet["old"]["counters"]["traces"] == 0


def _seed(root: Path, remote: Path) -> dict[str, Any]:
    env = {**_env(root, sys.executable), "CUTE_DISKCACHE_REMOTE": f"file://{remote}", "CUTE_DISKCACHE_HMAC_KEY": HMAC}
    proc = subprocess.run([sys.executable, "-m", "cute_diskcache", "--root", str(root), "export", "--to-remote", "--json"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_a_remote_seeded_by_export_serves_an_upgraded_node(fleet: dict[str, Any], new_python: str, tmp_path: Path) -> None:  # noqa: F811
    """``export --to-remote`` publishes the root's records with its entries: a remote seeded
    from the old release's prewarmed root (not by write-behind) serves the upgrade too."""
    seeded = tmp_path / "seeded"
    pushed = _seed(fleet["base"] / "old-node", seeded)
    assert pushed["pushed"] == 2 and pushed["records"] == 2, pushed
    new, _ = _drive(new_python, tmp_path / "node", seeded)
    assert new["counters"]["reused"] == 2 and new["counters"]["compiles"] == 0, new["counters"]


def test_records_of_one_release_are_no_reason_to_trace(tmp_path: Path) -> None:
    """A first prewarm of a model with MoE and dense rows: each kind of one release writes records
    in its own namespace, and none of them makes the other's misses trace (the last CI run on
    6f2bc48: the dense GEMMs of qwen3-30b-a3b on 0.7.4 traced after the MoE kernels' commits);
    a record of another release does."""
    from cute_diskcache.storage import reuse
    from cute_diskcache.keys.key import CacheKey, Environment
    from cute_diskcache.storage.store import Store

    store = Store(tmp_path / "root")
    store.probe_writable()

    def env(kind: str, version: str) -> Environment:
        return Environment(kind=kind, package=f"flashinfer-python=={version}", sources=kind, arch="sm_120a")

    moe, dense = env("flashinfer-moe", "0.7.4"), env("flashinfer-dense", "0.7.4")
    assert moe.namespace != dense.namespace and reuse.scope(moe) == reuse.scope(dense)
    assert reuse.write_record(store, CacheKey(moe, "moe", (1,)), "c" * 64)
    assert not reuse.possible(store, dense) and not reuse.possible(store, moe)
    assert reuse.write_record(store, CacheKey(env("flashinfer-moe", "0.7.2.post1"), "moe", (1,)), "d" * 64)
    assert reuse.possible(store, dense) and reuse.possible(store, moe)
