"""Device facts (issue 7): what a compile read about the GPU is recorded, and checked at load.

The first half pins the comparison logic against profiles and a stand-in live device. The
second half compiles a real kernel (``tests/devicefacts_child.py``: ``min_blocks_per_mp=2``
makes the DSL read MAX_SHARED_MEMORY_PER_MULTIPROCESSOR and bake it into the IR) in fresh
processes through the real DSL, with target profiles whose facts differ from the build's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cute_diskcache.keys import devicefacts, targets
from cute_diskcache.storage import entry
from cute_diskcache.keys.key import Environment

from _helpers import make_artifact, make_key

CHILD = Path(__file__).with_name("devicefacts_child.py")
PRO = targets.get("rtx-pro-6000")
H200 = targets.get("h200")


@pytest.fixture
def profile(monkeypatch: pytest.MonkeyPatch):
    """Make a profile the active one for this test only (``targets.apply`` is once per process)."""

    def use(p: targets.DeviceProfile | None) -> None:
        monkeypatch.setattr(targets, "_active", p)

    return use


def _record(**facts: int) -> dict[str, Any]:
    return {"source": "profile:rtx-pro-6000", "name": PRO.device_name, "facts": facts}


# -- comparison logic -------------------------------------------------------------------------


def test_fact_names_are_the_driver_attribute_without_prefix() -> None:
    class Attr:
        name = "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"

    assert devicefacts.fact_name(Attr()) == "max_shared_memory_per_block_optin"
    assert devicefacts.fact_name("CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT") == "multiprocessor_count"


def test_matching_facts_are_no_mismatch(profile) -> None:
    profile(PRO)
    assert devicefacts.mismatch(_record(multiprocessor_count=188, max_shared_memory_per_multiprocessor=102400)) is None


@pytest.mark.parametrize(
    "fact,built,here",
    [
        ("multiprocessor_count", 170, 188),
        ("max_shared_memory_per_multiprocessor", 233472, 102400),
        ("compute_capability_minor", 1, 0),
    ],
)
def test_a_differing_fact_is_named(profile, fact: str, built: int, here: int) -> None:
    profile(PRO)
    why = devicefacts.mismatch(_record(compute_capability_major=12, **{fact: built}))
    assert why is not None and why.startswith(f"{fact}: built against {built}") and f"this device has {here}" in why


def test_a_fact_the_profile_cannot_answer_is_a_mismatch(profile) -> None:
    profile(PRO)
    why = devicefacts.mismatch(_record(l2_cache_size=100 << 20))
    assert why is not None and "l2_cache_size" in why and "cannot tell" in why


def test_no_profile_and_no_device_compares_nothing(profile, monkeypatch: pytest.MonkeyPatch) -> None:
    profile(None)
    monkeypatch.setattr(devicefacts, "_live_attribute", lambda name, device_id: None)
    devicefacts._source_for.cache_clear()
    try:
        assert not devicefacts.current_source().available
        assert devicefacts.mismatch(_record(multiprocessor_count=1)) is None
        assert devicefacts.device_class() == ""
    finally:
        devicefacts._source_for.cache_clear()


def test_live_device_values_are_compared_and_read_once(profile, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a profile the live device answers (a stand-in for the driver here; the H200 run
    in bench/results/gpu_proof_sm90.md reads the real one)."""
    profile(None)
    reads: list[str] = []
    live = {"compute_capability_major": 9, "compute_capability_minor": 0, "multiprocessor_count": 132,
            "max_shared_memory_per_multiprocessor": 233472}

    def fake_live(name: str, device_id: int) -> int | None:
        reads.append(name)
        return live.get(name)

    monkeypatch.setattr(devicefacts, "_live_attribute", fake_live)
    monkeypatch.setattr(devicefacts, "_live_device_name", lambda device_id: "NVIDIA H200")
    devicefacts._source_for.cache_clear()
    try:
        assert devicefacts.device_class() == "cc9.0-132sm"
        assert devicefacts.current_source().device_name == "NVIDIA H200"
        built = {"source": "profile:h200", "name": "NVIDIA H200", "facts": {k: v for k, v in live.items()}}
        assert devicefacts.mismatch(built) is None
        built["facts"]["max_shared_memory_per_multiprocessor"] = 102400
        assert devicefacts.mismatch(built) == (
            "max_shared_memory_per_multiprocessor: built against 102400 (profile:h200), this device has 233472 (device)"
        )
        for _ in range(3):
            devicefacts.mismatch(built)
        assert sorted(set(reads)) == sorted(reads), "each live attribute is read once per process"
    finally:
        devicefacts._source_for.cache_clear()


def test_device_class_separates_card_models(profile) -> None:
    digests = {}
    for name in ("rtx-pro-6000", "rtx-5090", "dgx-spark", "h200"):
        profile(targets.get(name))
        env = Environment(kind="t", package="p==1", sources="s", arch=targets.get(name).arch)
        digests[name] = (env.device, env.digest)
    assert digests["rtx-pro-6000"][0] == "cc12.0-188sm"
    assert digests["rtx-5090"][0] == "cc12.0-170sm"
    assert digests["h200"][0] == "cc9.0-132sm"
    assert len({d for _, d in digests.values()}) == 4


@pytest.mark.parametrize(
    "record",
    [None, [], {"source": "x", "name": "n"}, {"source": "x", "name": "n", "facts": {"a": "1"}},
     {"source": "x", "name": "n", "facts": {"a": True}}, {"source": 1, "name": "n", "facts": {}}],
)
def test_malformed_device_records_are_refused(record: Any) -> None:
    assert not devicefacts.validate(record)


def test_manifest_without_a_valid_device_record_is_a_miss(tmp_path: Path, profile) -> None:
    profile(PRO)
    key = make_key()
    art = make_artifact()
    art.device = {"source": "profile:rtx-pro-6000", "name": "n", "facts": {"multiprocessor_count": 188}}
    d = tmp_path / key.digest
    entry.write(d, key, art)
    manifest = entry.read_manifest(d)
    assert manifest["device"]["facts"] == {"multiprocessor_count": 188}
    entry.verify(d, manifest, key)  # fits the profile: no error
    art.device = {"source": "profile:rtx-pro-6000", "name": "n", "facts": {"multiprocessor_count": 170}}
    entry.write(d, key, art)
    with pytest.raises(entry.EntryError) as err:
        entry.verify(d, entry.read_manifest(d), key)
    assert err.value.reason == "device" and "multiprocessor_count" in err.value.detail
    art.device = {"facts": "nonsense"}
    entry.write(d, key, art)
    with pytest.raises(entry.EntryError) as err:
        entry.read_manifest(d)
    assert err.value.reason == "manifest" and "device" in err.value.detail


# -- real compiles in fresh processes --------------------------------------------------------


def _child(cache: Path, *args: str) -> tuple[dict[str, Any], str]:
    env = dict(os.environ, CUTE_DISKCACHE_DIR=str(cache))
    env.pop("CUTE_DSL_ARCH", None)
    env.pop("CUTE_DISKCACHE_TARGET", None)
    proc = subprocess.run([sys.executable, str(CHILD), *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _manifests(cache: Path) -> list[dict[str, Any]]:
    return [entry.read_manifest(p.parent) for p in sorted((cache / "v1").glob("*/*/*/manifest.msgpack"))]


@pytest.mark.slow
def test_recorded_fact_that_differs_is_a_named_miss_and_a_missing_one_fails_loudly(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    built, _ = _child(cache)
    assert built["counters"]["compiles"] == 1 and built["counters"]["writes"] == 1, built
    (manifest,) = _manifests(cache)
    device = manifest["device"]
    assert device["source"] == "profile:rtx-pro-6000" and device["name"] == PRO.device_name
    assert device["facts"] == {
        "compute_capability_major": 12,
        "compute_capability_minor": 0,
        "max_shared_memory_per_multiprocessor": 102400,  # read by the DSL during the compile
        "multiprocessor_count": 188,
    }
    assert manifest["env"]["device"] == "cc12.0-188sm"

    hit, _ = _child(cache)
    assert (hit["counters"]["hits"], hit["counters"]["compiles"]) == (1, 0), hit

    # Same card model and key, one fact differs (a wrong profile, or a card variant): a miss
    # whose one warning names the fact. The entry is sound, just not for this device: it is not
    # quarantined (issue 15, item 5); this process's compile then rewrites it for its own value.
    other, log = _child(cache, "--set", "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR=99999")
    assert (other["counters"]["hits"], other["counters"]["compiles"], other["counters"]["rejected"]) == (0, 1, 1), other
    # The refusal names the fact; the compile's own line (issue 20) says why it missed: the same.
    warnings = [line for line in log.splitlines() if line.startswith("LOG WARNING")]
    assert len(warnings) == 2 and "max_shared_memory_per_multiprocessor: built against 102400" in warnings[0], log
    assert "this device has 99999" in warnings[0]
    assert warnings[1].startswith("LOG WARNING compiling ") and "entry refused: device facts (max_shared_memory_per_multiprocessor" in warnings[1]
    assert not (cache / "quarantine").exists()
    (rebuilt,) = _manifests(cache)
    assert rebuilt["device"]["facts"]["max_shared_memory_per_multiprocessor"] == 99999

    # A profile that lacks a fact the compile reads: the compile itself fails, naming it, and
    # nothing is written.
    fresh = tmp_path / "fresh"
    failed, _ = _child(fresh, "--drop", "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR")
    assert "MissingDeviceFact" in failed.get("error", "") and "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR" in failed["error"], failed
    assert failed["counters"]["writes"] == 0 and not _manifests(fresh)

    # ...but a kernel that does not read it compiles fine under that profile: only facts the
    # compile reads are demanded.
    ok, _ = _child(fresh, "--drop", "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR", "--min-blocks", "1")
    assert "error" not in ok and ok["counters"]["writes"] == 1, ok
    (plain,) = _manifests(fresh)
    assert "max_shared_memory_per_multiprocessor" not in plain["device"]["facts"]


@pytest.mark.slow
def test_another_card_model_gets_its_own_entry(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _child(cache)
    other, log = _child(cache, "--profile", "rtx-5090")
    assert (other["counters"]["hits"], other["counters"]["compiles"], other["counters"]["rejected"]) == (0, 1, 0), other
    assert "rejected" not in log
    devices = sorted(m["env"]["device"] for m in _manifests(cache))
    assert devices == ["cc12.0-170sm", "cc12.0-188sm"]
    again, _ = _child(cache)
    assert (again["counters"]["hits"], again["counters"]["compiles"]) == (1, 0)


def test_profile_from_json_overrides_and_drops_attributes(tmp_path: Path) -> None:
    path = tmp_path / "rtx-5060-ti.json"
    path.write_text(json.dumps({"base": "rtx-5090", "device_name": "NVIDIA GeForce RTX 5060 Ti", "sm_count": 36,
                                "max_active_clusters_1": 36, "attributes": {"max_threads_per_block": None, "L2_CACHE_SIZE": 33554432}}))
    p = targets.get(str(path))
    assert (p.name, p.sm_count, p.arch) == ("rtx-5060-ti", 36, "sm_120a")
    attrs = p.driver_attributes()
    assert attrs["MULTIPROCESSOR_COUNT"] == 36 and attrs["L2_CACHE_SIZE"] == 33554432
    assert "MAX_THREADS_PER_BLOCK" not in attrs
    path.write_text(json.dumps({"base": "rtx-5090", "sm_cuont": 36}))
    with pytest.raises(targets.UnknownProfileError, match="sm_cuont"):
        targets.get(str(path))
