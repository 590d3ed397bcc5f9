"""``explain.why_missed``: the reason a miss names, from synthetic entries (no compile).

Each test commits a real entry through the store under one environment, then asks why a key
under another environment (or the same key, refused) missed: the reason must name the field
that differs, with both values, as an operator would act on it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers import SITE_KEYS, make_artifact, make_env, make_key, rewrite_manifest  # noqa: E402

from cute_diskcache.storage import entry, explain  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "cache")


def test_empty_cache_says_no_entry(store: Store) -> None:
    assert explain.why_missed(store, make_key()) == "no entry for this kernel"


def test_same_kernel_under_another_flashinfer_and_dsl_names_both_versions(store: Store) -> None:
    old = make_env(package="flashinfer-python==0.6.15.post1",
                   dsl=(("apache-tvm-ffi", "0.1.15.post2"), ("nvidia-cutlass-dsl", "4.6.3"), ("nvidia-cutlass-dsl-libs-base", "4.8.1")))
    assert store.commit(make_key(env=old), make_artifact()) is not None
    new = make_env(package="flashinfer-python==0.7.4")
    why = explain.why_missed(store, make_key(env=new))
    assert why == ("this kernel's entry was made under another stack; it differs in: "
                   "flashinfer 0.6.15.post1 -> 0.7.4, DSL nvidia-cutlass-dsl 4.6.3 -> 4.8.1")


def test_env_switch_names_the_variable_and_both_values(store: Store) -> None:
    assert store.commit(make_key(env=make_env(codegen_env=(("CUTE_DSL_FOO", "1"),))), make_artifact()) is not None
    why = explain.why_missed(store, make_key(env=make_env()))
    assert why.endswith("differs in: env switch CUTE_DSL_FOO 1 -> unset"), why


def test_arch_and_device_differences(store: Store) -> None:
    assert store.commit(make_key(env=make_env(arch="sm_121a", device="cc12.1-48sm")), make_artifact()) is not None
    why = explain.why_missed(store, make_key(env=make_env(device="cc12.0-188sm")))
    assert why.endswith("differs in: arch sm_121a -> sm_120a, device cc12.1-48sm -> cc12.0-188sm"), why


def test_source_only_difference_says_source(store: Store) -> None:
    assert store.commit(make_key(env=make_env(sources="6" * 64)), make_artifact()) is not None
    why = explain.why_missed(store, make_key())
    assert why.endswith("differs in: source (the kernel's Python code differs at the same version)"), why


def test_another_shape_of_this_stack_is_a_plain_no_entry(store: Store) -> None:
    other_m = list(SITE_KEYS["micro"])
    other_m[3] = 2
    assert store.commit(make_key(site_key=tuple(other_m)), make_artifact()) is not None
    why = explain.why_missed(store, make_key())
    assert why == "no entry for this kernel (1 other flashinfer.moe_dispatch.micro kernel of this stack: another shape)", why


def test_nearest_entry_of_the_site_when_the_kernel_itself_is_nowhere(store: Store) -> None:
    other_m = list(SITE_KEYS["micro"])
    other_m[3] = 2
    assert store.commit(make_key(site_key=tuple(other_m), env=make_env(package="flashinfer-python==0.6.18")), make_artifact()) is not None
    why = explain.why_missed(store, make_key())
    assert why == "no entry for this kernel; the nearest entry of this site differs in: flashinfer 0.6.18 -> 0.6.15.post1", why


def test_refused_entry_for_another_cpu_says_host_cpu(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    key = make_key()
    manifest = store.commit(key, make_artifact())
    assert manifest is not None
    monkeypatch.setattr("cute_diskcache.keys.hostcpu.isa_extensions", lambda: ("sse2",))  # this "CPU" has no AVX-512
    rewrite_manifest(store.entry_dir(key), {**manifest, "host_isa": ["avx512f", "sse2"]})
    assert explain.why_missed(store, key) == "entry refused: host CPU (entry needs avx512f)"


def test_quarantined_entry_says_so(store: Store) -> None:
    key = make_key()
    assert store.commit(key, make_artifact()) is not None
    manifest_path = store.entry_dir(key) / entry.MANIFEST
    manifest_path.write_bytes(b"\x00garbage")
    assert store.lookup_or_quarantine(key) is None  # the store sets it aside
    assert not store.entry_dir(key).exists()
    assert explain.why_missed(store, key) == "entry refused: quarantined as manifest"


def test_refusal_the_caller_knows_is_said(store: Store) -> None:
    why = explain.why_missed(store, make_key(), refused=entry.EntryError("load", "RuntimeError: bad object"))
    assert why == "entry refused: load: RuntimeError: bad object"


def test_refused_root_is_named(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    why = explain.why_missed(Store(root), make_key())
    assert why.startswith("cache root refused: "), why


def test_never_raises(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_a: object, **_k: object) -> list[str]:
        raise OSError("disk on fire")

    monkeypatch.setattr("cute_diskcache.storage.layout.namespaces", broken)
    assert explain.why_missed(store, make_key()).startswith("no entry for this kernel (reason not determined: OSError")
