"""The remote tier's object-store path, ``s3://`` through s3fs, against a real S3-protocol server.

moto's server mode (``ThreadedMotoServer``) listens on a free loopback port; s3fs reaches it
through ``AWS_ENDPOINT_URL``, as it would reach MinIO or a regional endpoint. Nodes are fresh
processes with separate roots compiling flashinfer 0.6.15.post1's micro kernel on the CPU for
the rtx-pro-6000 profile; "zero compiles" is the conftest's independent count. The fleet signs
its entries (``CUTE_DISKCACHE_HMAC_KEY``), as the README says a shared store must. A dead and a
hung endpoint must each leave every request working with the added time bounded.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _servers import DeadPort, HungServer, free_port  # noqa: E402

moto_server = pytest.importorskip("moto.server", reason="the s3 tests need moto[server] (the test extra installs it)")
pytest.importorskip("s3fs", reason="the s3 tests need s3fs (the test extra installs it)")

ProbeFn = Callable[..., dict[str, Any]]
BUCKET = "cdc-fleet"
TIMEOUT_S = 2.0  # HTTP to an object store: more than redis' 0.5 s


def _aws(endpoint: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}


def node_env(endpoint: str) -> dict[str, str]:
    return {"CUTE_DISKCACHE_REMOTE": f"s3://{BUCKET}/fleet", "CUTE_DISKCACHE_REMOTE_TIMEOUT": str(TIMEOUT_S),
            "CUTE_DISKCACHE_HMAC_KEY": "fleet-secret", **_aws(endpoint)}


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[str, Any]]:
    """(endpoint, boto3 client) of a private S3 server for this module, with an empty bucket."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import boto3

    saved = {k: os.environ.get(k) for k in _aws(endpoint)}
    os.environ.update(_aws(endpoint))
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        # moto keeps its buckets in process-wide state: a module that imported this fixture and
        # ran first (test_remote_fleet) leaves objects behind. The bucket is this module's, empty.
        for obj in client.list_objects_v2(Bucket=BUCKET).get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=obj["Key"])
        yield endpoint, client
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _objects(client: Any) -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=BUCKET).get("Contents", []) if not o["Key"].endswith(".hit"))


@pytest.mark.slow
def test_second_node_compiles_nothing_through_s3(probe: ProbeFn, s3: tuple[str, Any], tmp_path: Path) -> None:
    endpoint, client = s3
    a = probe(tmp_path / "node-a", 1, extra_env=node_env(endpoint))
    ca = a["counters"]
    assert a["real_compiles"] == 1 and (ca["compiles"], ca["writes"], ca["remote_misses"], ca["remote_errors"]) == (1, 1, 1, 0), a["stderr"]
    keys = [k for k in _objects(client) if "/cute-diskcache/reuse/" not in k]  # beside it: its second-stage record and marker
    assert len(keys) == 1 and keys[0].startswith("fleet/cute-diskcache/v1/") and keys[0].endswith(a["events"][0][1]), keys

    b = probe(tmp_path / "node-b", 1, extra_env=node_env(endpoint))
    cb = b["counters"]
    assert b["real_compiles"] == 0, b["stderr"]
    assert (cb["compiles"], cb["hits"], cb["remote_hits"], cb["remote_errors"]) == (0, 1, 1, 0)
    assert [r["launch_error"] for r in b["records"]] == [r["launch_error"] for r in a["records"]], "the same kernel, same ABI"
    print(f"\ns3 remote hit: {b['events'][0][3] * 1e3:.1f} ms (+ {cb['remote_setup_seconds'] * 1e3:.0f} ms importing s3fs, once)")

    # A node with another key refuses the fleet's entries: a miss, compiled locally, never loaded.
    c = probe(tmp_path / "node-c", 1, extra_env={**node_env(endpoint), "CUTE_DISKCACHE_HMAC_KEY": "another-fleet"})
    assert c["real_compiles"] == 1 and c["counters"]["remote_hits"] == 0 and c["counters"]["remote_errors"] == 1


@pytest.mark.serial
@pytest.mark.slow
def test_dead_s3_endpoint_costs_little(probe: ProbeFn, tmp_path: Path) -> None:
    with DeadPort() as dead:  # nothing listens there, nor can while the test runs
        t0 = time.perf_counter()
        r = probe(tmp_path / "root", 1, extra_env=node_env(f"http://127.0.0.1:{dead.port}"))
    c = r["counters"]
    assert r["real_compiles"] == 1 and (c["compiles"], c["writes"], c["errors"], c["remote_hits"]) == (1, 1, 0, 0) and c["remote_errors"] >= 1
    print(f"\ndead s3 endpoint: {c['remote_seconds'] * 1e3:.0f} ms added to the miss; wall {time.perf_counter() - t0:.1f} s")
    # s3fs and botocore retry a refused connect with backoff, for many seconds: the deadline cuts
    # that at TIMEOUT_S. Half a deadline more is margin for a loaded machine, well short of two.
    assert c["remote_seconds"] < TIMEOUT_S * 1.5


@pytest.mark.serial
@pytest.mark.slow
def test_hung_s3_endpoint_adds_at_most_the_timeout(probe: ProbeFn, tmp_path: Path) -> None:
    hung = HungServer()
    try:
        r = probe(tmp_path / "root", 1, extra_env=node_env(f"http://127.0.0.1:{hung.port}"))
    finally:
        hung.close()
    c = r["counters"]
    assert r["real_compiles"] == 1 and (c["compiles"], c["writes"], c["errors"]) == (1, 1, 0) and c["remote_errors"] >= 1
    assert hung.accepted >= 1 and "no answer within" in r["stderr"], r["stderr"]
    print(f"\nhung s3 endpoint: {c['remote_seconds'] * 1e3:.0f} ms added to the miss (timeout {TIMEOUT_S} s)")
    # At least the deadline, and well under two (a second call waited for after the first timed
    # out) or botocore's own 60 s read timeout: half a deadline of margin for a loaded machine.
    assert TIMEOUT_S * 0.9 < c["remote_seconds"] < TIMEOUT_S * 1.5
