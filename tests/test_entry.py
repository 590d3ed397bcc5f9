"""Entries: what one cache entry holds on disk, and every way a bad one must be refused.

A cache that loads what it did not write (a flipped bit, a truncated copy, another key's entry,
a manifest crafted to escape its directory) serves a wrong kernel or crashes the engine. Every
refusal here must be an ``EntryError``: the store turns those, and only those, into a miss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import sys
from pathlib import Path
from typing import Any, Callable

import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import (  # noqa: E402
    EM_CUDA,
    EM_X86_64,
    flip_byte,
    make_artifact,
    make_elf,
    make_key,
    make_object,
    mlir_of,
    payload_path,
    rewrite_manifest,
)

from cute_diskcache.storage import entry  # noqa: E402
from cute_diskcache.storage.entry import EntryError  # noqa: E402
from cute_diskcache.keys.key import FORMAT_VERSION, CacheKey  # noqa: E402


@pytest.fixture
def key() -> CacheKey:
    return make_key("micro")


@pytest.fixture
def art() -> entry.Artifact:
    return make_artifact()


@pytest.fixture
def written(tmp_path: Path, key: CacheKey, art: entry.Artifact) -> tuple[Path, dict[str, Any]]:
    """A good entry on disk, in a directory named after its digest as the store lays it out."""
    entry_dir = tmp_path / key.digest
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: None)  # setup speed only; the atomic_write tests fsync
        return entry_dir, entry.write(entry_dir, key, art)


def _load(entry_dir: Path, key: CacheKey | None) -> bytes:
    """What the store does on lookup: parse, then verify."""
    return entry.verify(entry_dir, entry.read_manifest(entry_dir), key)


# --------------------------------------------------------------------------------------------
# Embedded cubins
# --------------------------------------------------------------------------------------------


def test_cubins_in_finds_the_cuda_elf_inside_the_object() -> None:
    cubin = make_elf(EM_CUDA, b"\x33" * 40)
    obj = make_object([cubin])
    assert obj.startswith(b"\x7fELF") and obj.index(cubin) > 64
    assert entry.cubins_in(obj) == [cubin]


def test_cubins_in_finds_several_and_skips_host_elves() -> None:
    first, second = make_elf(EM_CUDA, b"\x01" * 24), make_elf(EM_CUDA, b"\x02" * 56)
    host = make_elf(EM_X86_64, b"\x03" * 32)
    obj = make_object([first, host, second])
    assert entry.cubins_in(obj) == [first, second]


def test_cubins_in_skips_images_that_run_past_the_buffer() -> None:
    cubin = make_elf(EM_CUDA, b"\x04" * 40)
    assert entry.cubins_in(b"\x00" * 8 + cubin[:-1]) == []
    assert entry.cubins_in(b"\x00" * 8 + cubin[:60]) == []  # not even a whole header
    assert entry.cubins_in(b"") == []


def test_cubins_in_ignores_nobits_sizes() -> None:
    """SHT_NOBITS (.bss) claims memory, not file bytes; counting it would lose the cubin."""
    cubin = make_elf(EM_CUDA, b"\x05" * 40, nobits_size=1 << 40)
    assert entry.cubins_in(b"\x00" * 8 + cubin) == [cubin]


# --------------------------------------------------------------------------------------------
# Round trip
# --------------------------------------------------------------------------------------------


def test_write_then_read_and_verify_returns_the_object(written: tuple[Path, dict[str, Any]], key: CacheKey, art: entry.Artifact) -> None:
    entry_dir, manifest = written
    assert entry.read_manifest(entry_dir) == manifest
    assert _load(entry_dir, key) == art.object_bytes
    assert _load(entry_dir, None) == art.object_bytes


def test_manifest_describes_the_entry(written: tuple[Path, dict[str, Any]], key: CacheKey, art: entry.Artifact) -> None:
    entry_dir, manifest = written
    assert manifest["format"] == FORMAT_VERSION
    assert manifest["digest"] == key.digest == entry_dir.name
    assert manifest["env"] == key.env.as_dict() and manifest["env"]["arch"] == "sm_120a"
    assert manifest["key_bytes"] == key.key_bytes
    assert manifest["symbol"] == art.symbol and manifest["tvm_ffi"] is True
    assert manifest["compile_seconds"] == 2.0
    counts = {role: len(items) for role, items in manifest["payloads"].items()}
    assert counts == {"object": 1, "cubin": 1, "mlir": 1}
    assert payload_path(entry_dir, manifest, "object").read_bytes() == art.object_bytes
    assert payload_path(entry_dir, manifest, "cubin").read_bytes() == art.cubins[0]
    assert art.cubins[0][18:20] == struct.pack("<H", EM_CUDA)
    assert mlir_of(entry_dir, manifest) == art.mlir_text
    for items in manifest["payloads"].values():
        for item in items:
            assert (entry_dir / item["file"]).stat().st_size == item["size"]


def test_write_leaves_only_named_files(written: tuple[Path, dict[str, Any]]) -> None:
    entry_dir, manifest = written
    names = {p.name for p in entry_dir.iterdir()}
    expected = {entry.MANIFEST} | {item["file"] for items in manifest["payloads"].values() for item in items}
    assert names == expected


def test_rewriting_an_entry_is_harmless(written: tuple[Path, dict[str, Any]], key: CacheKey, art: entry.Artifact) -> None:
    """Two processes racing on one key both write; payload names are content-addressed."""
    entry_dir, first = written
    second = entry.write(entry_dir, key, art)
    assert second["payloads"] == first["payloads"]
    assert _load(entry_dir, key) == art.object_bytes


def test_entry_without_mlir_or_cubins_verifies(tmp_path: Path, key: CacheKey) -> None:
    art = entry.Artifact(b"\x7fELF\x02\x01 plain object", "cdc_x", False, [], None, 1.0, 0.0, {"block_dim": [128, 1, 1]})
    entry_dir = tmp_path / key.digest
    manifest = entry.write(entry_dir, key, art)
    assert manifest["payloads"]["cubin"] == [] and manifest["payloads"]["mlir"] == []
    assert _load(entry_dir, key) == art.object_bytes
    assert entry.read_manifest(entry_dir)["extra"] == {"block_dim": [128, 1, 1]}


# --------------------------------------------------------------------------------------------
# Hostile manifests: always EntryError, never anything else
# --------------------------------------------------------------------------------------------

_HOSTILE_RAW: dict[str, bytes] = {
    "empty file": b"",
    "not msgpack": b"\xc1\xc1\xc1",
    "text": b"hello, I am not a manifest",
    "trailing bytes": msgpack.packb({"format": 1}) + b"\x00",
    "a list": msgpack.packb([1, 2, 3]),
    "a string": msgpack.packb("manifest"),
    "nil": msgpack.packb(None),
    "str32 of 4 GiB": b"\xdb\xff\xff\xff\xff",
    "bin32 of 4 GiB": b"\xc6\xff\xff\xff\xff",
    "array32 of 4G items": b"\xdd\xff\xff\xff\xff",
    "map32 of 4G items": b"\xdf\xff\xff\xff\xff",
    "deep arrays": b"\x91" * 100_000 + b"\xc0",
    "deep maps": b"\x81\xa1a" * 50_000 + b"\xc0",
    "invalid utf-8": b"\x81\xa6format\xa2\xff\xfe",
    "int map key": msgpack.packb({1: 2}),
    "bad timestamp ext": b"\xd4\xff\x00",
    "unknown ext": msgpack.packb(msgpack.ExtType(5, b"xx")),
}


@pytest.mark.parametrize("raw", list(_HOSTILE_RAW.values()), ids=list(_HOSTILE_RAW))
def test_undecodable_manifest_is_entry_error(tmp_path: Path, key: CacheKey, raw: bytes) -> None:
    entry_dir = tmp_path / key.digest
    entry_dir.mkdir()
    (entry_dir / entry.MANIFEST).write_bytes(raw)
    with pytest.raises(EntryError):
        _load(entry_dir, key)


@pytest.mark.parametrize("raw", list(_HOSTILE_RAW.values()), ids=list(_HOSTILE_RAW))
def test_hostile_body_behind_a_valid_seal_is_entry_error(tmp_path: Path, key: CacheKey, raw: bytes) -> None:
    """The seal only proves the body is intact, not sane: the same hostile bytes, sealed."""
    entry_dir = tmp_path / key.digest
    entry_dir.mkdir()
    sealed = msgpack.packb({"seal": "sha256", "sha256": hashlib.sha256(raw).hexdigest(), "body": raw}, use_bin_type=True)
    (entry_dir / entry.MANIFEST).write_bytes(sealed)
    with pytest.raises(EntryError):
        _load(entry_dir, key)


def test_manifest_over_one_mib_is_refused_unread(written: tuple[Path, dict[str, Any]], key: CacheKey) -> None:
    entry_dir, manifest = written
    rewrite_manifest(entry_dir, {**manifest, "extra": {"pad": b"x" * (1 << 20)}})
    assert (entry_dir / entry.MANIFEST).stat().st_size > 1 << 20
    with pytest.raises(EntryError, match="1 MiB"):
        _load(entry_dir, key)


def test_manifest_that_is_a_directory_is_entry_error(tmp_path: Path, key: CacheKey) -> None:
    entry_dir = tmp_path / key.digest
    (entry_dir / entry.MANIFEST).mkdir(parents=True)
    with pytest.raises(EntryError):
        _load(entry_dir, key)


def test_missing_manifest_is_absent(tmp_path: Path, key: CacheKey) -> None:
    with pytest.raises(EntryError) as info:
        _load(tmp_path / key.digest, key)
    assert info.value.reason == "absent"


_WRONG_TYPED: dict[type | tuple[type, ...], list[Any]] = {
    int: ["1", 1.0, None, [1]],
    str: [1, b"x", None, ["x"]],
    dict: [[], "x", None, 1],
    bytes: ["x", 1, None, [1]],
    bool: [1, "true", None],
    (int, float): ["1.0", None, [1.0]],
}


def _field_cases() -> list[Any]:
    cases = []
    for name, typ in entry._FIELD_TYPES.items():
        cases.append(pytest.param(name, dataclasses.MISSING, id=f"{name}-missing"))
        for bad in _WRONG_TYPED[typ]:
            cases.append(pytest.param(name, bad, id=f"{name}-{type(bad).__name__}"))
    return cases


@pytest.mark.parametrize(("field", "bad"), _field_cases())
def test_wrong_field_type_is_entry_error(written: tuple[Path, dict[str, Any]], key: CacheKey, field: str, bad: Any) -> None:
    entry_dir, manifest = written
    tampered = dict(manifest)
    if bad is dataclasses.MISSING:
        del tampered[field]
    else:
        tampered[field] = bad
    rewrite_manifest(entry_dir, tampered)
    with pytest.raises(EntryError):
        _load(entry_dir, key)


def _with_payloads(manifest: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    payloads = {role: [dict(item) for item in items] for role, items in manifest["payloads"].items()}
    change(payloads)
    return {**manifest, "payloads": payloads}


def _rename_object(name: Any) -> Callable[[dict[str, Any]], None]:
    def change(p: dict[str, Any]) -> None:
        p["object"][0]["file"] = name

    return change


def _set_object_field(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(p: dict[str, Any]) -> None:
        p["object"][0][field] = value

    return change


_HOSTILE_PAYLOADS: dict[str, Callable[[dict[str, Any]], None]] = {
    "name ../ escape": _rename_object("../../../etc/passwd"),
    "name with /": _rename_object("sub/object.o"),
    "absolute name": _rename_object("/etc/passwd"),
    "name with backslash": _rename_object("..\\object.o"),
    "leading dot": _rename_object(".hidden.o"),
    "dot": _rename_object("."),
    "dot dot": _rename_object(".."),
    "manifest as payload": _rename_object(entry.MANIFEST),
    "empty name": _rename_object(""),
    "NUL in name": _rename_object("object\x00.o"),
    "name not a string": _rename_object(b"object.o"),
    "size negative": _set_object_field("size", -1),
    "size over 1 GiB": _set_object_field("size", (1 << 30) + 1),
    "size 2**40": _set_object_field("size", 1 << 40),
    "size a string": _set_object_field("size", "12"),
    "sha256 missing": lambda p: p["object"][0].pop("sha256"),
    "sha256 as bytes": _set_object_field("sha256", b"\x00" * 32),
    "record not a map": lambda p: p["object"].__setitem__(0, ["object.o", 1, "00"]),
    "role not a list": lambda p: p.__setitem__("cubin", {"file": "x"}),
    "unknown role": lambda p: p.__setitem__("exe", []),
    "bytes role": lambda p: p.__setitem__(b"object", p.pop("object")),
    "zero object payloads": lambda p: p.__setitem__("object", []),
    "no object role": lambda p: p.pop("object"),
    "no payloads at all": lambda p: p.clear(),
    "two object payloads": lambda p: p["object"].append(dict(p["cubin"][0])),
}


@pytest.mark.parametrize("change", list(_HOSTILE_PAYLOADS.values()), ids=list(_HOSTILE_PAYLOADS))
def test_hostile_payload_records_are_entry_error(written: tuple[Path, dict[str, Any]], key: CacheKey, change: Callable[[dict[str, Any]], None]) -> None:
    entry_dir, manifest = written
    rewrite_manifest(entry_dir, _with_payloads(manifest, change))
    with pytest.raises(EntryError):
        _load(entry_dir, key)
    with pytest.raises(EntryError):
        _load(entry_dir, None)  # the CLI's verify, which checks no key


def test_payload_records_are_checked_before_any_file_is_opened(written: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A crafted name must be refused by parsing alone, not by luck of what open() says."""
    entry_dir, manifest = written
    rewrite_manifest(entry_dir, _with_payloads(manifest, _rename_object("../" + entry_dir.name + "/" + manifest["payloads"]["object"][0]["file"])))
    with pytest.raises(EntryError) as info:
        entry.read_manifest(entry_dir)
    assert info.value.reason == "manifest"


# --------------------------------------------------------------------------------------------
# verify: damaged payloads and foreign entries
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["object", "cubin", "mlir"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_payload_byte_is_checksum_error(written: tuple[Path, dict[str, Any]], key: CacheKey, role: str, where: str) -> None:
    entry_dir, manifest = written
    path = payload_path(entry_dir, manifest, role)
    flip_byte(path, {"first": 0, "middle": None, "last": path.stat().st_size - 1}[where])
    with pytest.raises(EntryError) as info:
        _load(entry_dir, key)
    assert info.value.reason == "checksum"


@pytest.mark.parametrize("role", ["object", "cubin", "mlir"])
@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: p.write_bytes(p.read_bytes()[:-1]), id="truncated"),
        pytest.param(lambda p: p.write_bytes(b""), id="zero-bytes"),
        pytest.param(lambda p: p.write_bytes(p.read_bytes() + b"\x00"), id="grown"),
        pytest.param(lambda p: p.unlink(), id="missing"),
        pytest.param(lambda p: (p.unlink(), p.mkdir()), id="a-directory"),
    ],
)
def test_damaged_payload_is_entry_error(written: tuple[Path, dict[str, Any]], key: CacheKey, role: str, damage: Callable[[Path], Any]) -> None:
    entry_dir, manifest = written
    damage(payload_path(entry_dir, manifest, role))
    with pytest.raises(EntryError) as info:
        _load(entry_dir, key)
    assert info.value.reason in ("truncated", "unreadable")


def test_zero_byte_manifest_is_entry_error(written: tuple[Path, dict[str, Any]], key: CacheKey) -> None:
    entry_dir, _ = written
    (entry_dir / entry.MANIFEST).write_bytes(b"")
    with pytest.raises(EntryError) as info:
        _load(entry_dir, key)
    assert info.value.reason == "manifest"


def test_wrong_format_version_is_stale(written: tuple[Path, dict[str, Any]], key: CacheKey) -> None:
    entry_dir, manifest = written
    rewrite_manifest(entry_dir, {**manifest, "format": FORMAT_VERSION + 1})
    with pytest.raises(EntryError) as info:
        _load(entry_dir, key)
    assert info.value.reason == "stale"


def test_entry_in_another_directory_is_foreign(written: tuple[Path, dict[str, Any]], key: CacheKey) -> None:
    entry_dir, _ = written
    moved = entry_dir.with_name("0" * 64)
    entry_dir.rename(moved)
    with pytest.raises(EntryError) as info:
        _load(moved, key)
    assert info.value.reason == "foreign"
    with pytest.raises(EntryError):
        _load(moved, None)  # even without a key: the manifest says where it belongs


@pytest.mark.parametrize(
    "changes",
    [
        {"sources": "6" * 64},
        {"package": "flashinfer-python==0.6.16"},
        {"dsl": (("apache-tvm-ffi", "0.1.15.post2"), ("nvidia-cutlass-dsl", "4.6.3"))},
        {"codegen_env": (("CUTE_DSL_COMPILER_OPT", "-O3"),)},
        {"machine": "aarch64"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_other_environment_is_stale(written: tuple[Path, dict[str, Any]], key: CacheKey, changes: dict[str, Any]) -> None:
    entry_dir, _ = written
    other = CacheKey(dataclasses.replace(key.env, **changes), key.site, key.site_key, key.options)
    with pytest.raises(EntryError) as info:
        _load(entry_dir, other)
    assert info.value.reason == "stale"
    assert next(iter(changes)) in info.value.detail  # says what differs


@pytest.mark.parametrize(
    ("field", "value"),
    [("dsl", [["nvidia-cutlass-dsl", "4.6.3"]]), ("machine", "aarch64"), ("sources", "0" * 64), ("codegen_env", [["CUTE_DSL_X", "1"]])],
)
def test_manifest_env_tampered_under_the_right_digest_is_stale(written: tuple[Path, dict[str, Any]], key: CacheKey, field: str, value: Any) -> None:
    """A damaged env record must not hide behind an intact env_digest."""
    entry_dir, manifest = written
    rewrite_manifest(entry_dir, {**manifest, "env": {**manifest["env"], field: value}})
    with pytest.raises(EntryError) as info:
        _load(entry_dir, key)
    assert info.value.reason == "stale" and field in info.value.detail


def test_other_arch_is_refused_as_arch(written: tuple[Path, dict[str, Any]], key: CacheKey) -> None:
    """Measured: an sm_120a object loads on an sm_90 GPU and fails only at call time."""
    entry_dir, _ = written
    other = CacheKey(dataclasses.replace(key.env, arch="sm_121a"), key.site, key.site_key, key.options)
    with pytest.raises(EntryError) as info:
        _load(entry_dir, other)
    assert info.value.reason == "arch"
    assert "sm_120a" in info.value.detail and "sm_121a" in info.value.detail


def test_manifest_arch_tampered_is_refused(written: tuple[Path, dict[str, Any]], key: CacheKey) -> None:
    entry_dir, manifest = written
    rewrite_manifest(entry_dir, {**manifest, "env": {**manifest["env"], "arch": "sm_90a"}})
    with pytest.raises(EntryError) as info:
        _load(entry_dir, key)
    assert info.value.reason == "arch"


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda k: CacheKey(k.env, k.site, k.site_key[:3] + (2,) + k.site_key[4:], k.options), id="other-m"),
        pytest.param(lambda k: CacheKey(k.env, "flashinfer.moe_dispatch.static", k.site_key, k.options), id="other-site"),
        pytest.param(lambda k: CacheKey(k.env, k.site, k.site_key, "--opt-level 3 --enable-tvm-ffi"), id="other-options"),
    ],
)
def test_entry_for_another_key_is_foreign(written: tuple[Path, dict[str, Any]], key: CacheKey, other: Callable[[CacheKey], CacheKey]) -> None:
    """Even sitting in the right directory (a copy, a rename), another key's entry is refused."""
    entry_dir, _ = written
    with pytest.raises(EntryError) as info:
        _load(entry_dir, other(key))
    assert info.value.reason == "foreign"


def test_manifest_claiming_another_key_is_foreign(written: tuple[Path, dict[str, Any]], key: CacheKey) -> None:
    entry_dir, manifest = written
    rewrite_manifest(entry_dir, {**manifest, "key_bytes": make_key("static").key_bytes})
    with pytest.raises(EntryError) as info:
        _load(entry_dir, key)
    assert info.value.reason == "foreign"


def test_any_flipped_manifest_bit_is_refused(written: tuple[Path, dict[str, Any]], key: CacheKey) -> None:
    """The issue asks for a miss on a flipped manifest byte: the seal covers every field.

    Before the seal, 338 of 1470 single-bit flips (in extra, symbol, site, options, created...)
    still verified.
    """
    entry_dir, _ = written
    raw = (entry_dir / entry.MANIFEST).read_bytes()
    for i in range(len(raw)):
        (entry_dir / entry.MANIFEST).write_bytes(raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1 :])
        with pytest.raises(EntryError):
            _load(entry_dir, key)


def test_verify_without_key_skips_environment_checks(written: tuple[Path, dict[str, Any]], art: entry.Artifact) -> None:
    """The CLI verifies entries of any environment: internal consistency only."""
    entry_dir, manifest = written
    rewrite_manifest(entry_dir, {**manifest, "env": {**manifest["env"], "arch": "sm_121a"}})
    assert _load(entry_dir, None) == art.object_bytes


def test_verify_returns_exactly_the_checked_bytes(written: tuple[Path, dict[str, Any]], key: CacheKey, art: entry.Artifact) -> None:
    entry_dir, manifest = written
    obj = _load(entry_dir, key)
    assert obj == payload_path(entry_dir, manifest, "object").read_bytes() == art.object_bytes
    assert obj is not art.object_bytes


# --------------------------------------------------------------------------------------------
# atomic_write
# --------------------------------------------------------------------------------------------


def _temps(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".tmp.")]


def test_atomic_write_success_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "object-0123.o"
    entry.atomic_write(target, b"first")
    entry.atomic_write(target, b"second, longer")
    assert target.read_bytes() == b"second, longer"
    assert _temps(tmp_path) == []


def test_atomic_write_large_payload(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    entry.atomic_write(tmp_path / "big", data)
    assert (tmp_path / "big").read_bytes() == data


def test_atomic_write_failed_fsync_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "object-0123.o"
    entry.atomic_write(target, b"old")

    def fsync_fails(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync_fails)
    with pytest.raises(OSError):
        entry.atomic_write(target, b"new bytes")
    with pytest.raises(OSError):
        entry.atomic_write(tmp_path / "fresh", b"data")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"  # never half-replaced
    assert not (tmp_path / "fresh").exists()
    assert _temps(tmp_path) == []


def test_atomic_write_failed_replace_leaves_no_temp(tmp_path: Path) -> None:
    """os.replace onto a non-empty directory fails for real, no monkeypatch needed."""
    target = tmp_path / "occupied"
    (target / "inside").mkdir(parents=True)
    with pytest.raises(OSError):
        entry.atomic_write(target, b"data")
    assert _temps(tmp_path) == []


def test_write_failing_midway_publishes_no_manifest(tmp_path: Path, key: CacheKey, art: entry.Artifact, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest is the commit marker: if any payload fails, no reader sees an entry."""
    calls = {"n": 0}
    real_fsync = os.fsync

    def fsync_fails_second_time(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_fails_second_time)
    entry_dir = tmp_path / key.digest
    with pytest.raises(OSError):
        entry.write(entry_dir, key, art)
    monkeypatch.undo()
    assert not (entry_dir / entry.MANIFEST).exists()
    assert _temps(entry_dir) == []
    with pytest.raises(EntryError) as info:
        _load(entry_dir, key)
    assert info.value.reason == "absent"


def test_temp_names_are_unique_per_host_process_and_call(tmp_path: Path) -> None:
    """pids collide across containers sharing a volume: host and randomness disambiguate."""
    import socket

    final = tmp_path / "manifest.msgpack"
    a, b = entry._temp_name(final), entry._temp_name(final)
    assert a != b and a.parent == b.parent == tmp_path
    for name in (a.name, b.name):
        assert name.startswith(".tmp.manifest.msgpack.")
        assert socket.gethostname() in name and str(os.getpid()) in name


# --------------------------------------------------------------------------------------------
# Host CPU: an object built on a CPU with extensions this one lacks is never loaded
# --------------------------------------------------------------------------------------------


def test_entry_records_the_build_cpu_extensions(written: tuple[Path, dict[str, Any]]) -> None:
    from cute_diskcache.keys import hostcpu

    _, manifest = written
    assert manifest["host_isa"] == list(hostcpu.isa_extensions())


def test_entry_from_a_cpu_with_more_extensions_is_a_miss(written: tuple[Path, dict[str, Any]], key: CacheKey) -> None:
    from cute_diskcache.keys import hostcpu

    if not hostcpu.isa_extensions():
        pytest.skip("this host exposes no /proc/cpuinfo flags")
    entry_dir, manifest = written
    rewrite_manifest(entry_dir, {**manifest, "host_isa": [*manifest["host_isa"], "avx1024_imaginary"]})
    with pytest.raises(EntryError) as err:
        _load(entry_dir, key)
    assert err.value.reason == "host-cpu" and "avx1024_imaginary" in str(err.value)


def test_entry_from_a_cpu_with_fewer_extensions_loads(written: tuple[Path, dict[str, Any]], key: CacheKey) -> None:
    entry_dir, manifest = written
    rewrite_manifest(entry_dir, {**manifest, "host_isa": manifest["host_isa"][:1]})
    assert _load(entry_dir, key)


@pytest.mark.parametrize("bad", ["avx2", [1, 2], ["x"] * 600])
def test_malformed_host_isa_is_refused(written: tuple[Path, dict[str, Any]], key: CacheKey, bad: Any) -> None:
    entry_dir, manifest = written
    rewrite_manifest(entry_dir, {**manifest, "host_isa": bad})
    with pytest.raises(EntryError):
        _load(entry_dir, key)


def test_isa_extensions_filter_keeps_only_instruction_sets() -> None:
    from cute_diskcache.keys import hostcpu

    isa = hostcpu.isa_extensions()
    assert "hypervisor" not in isa and "ht" not in isa
    import platform

    if platform.machine() == "x86_64" and isa:
        assert "sse2" in isa or "avx" in isa


def test_intrinsic_only_extensions_are_not_recorded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An AMD build box's sse4a / avx512_vp2intersect / xsaveerptr made its entries misses on an
    Intel GPU host they ran correctly on (measured on the H200); LLVM never emits those on its own."""
    import builtins
    import io

    from cute_diskcache.keys import hostcpu

    amd = "processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 sse4a popcnt avx avx2 fma bmi1 bmi2 avx512f " \
          "avx512_vp2intersect xsave xsaveerptr rdrand aes vaes sha_ni hypervisor\n"
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO(amd) if path == "/proc/cpuinfo" else real_open(path, *a, **k))
    monkeypatch.setattr(hostcpu.platform, "machine", lambda: "x86_64")
    hostcpu.isa_extensions.cache_clear()
    try:
        assert hostcpu.isa_extensions() == ("avx", "avx2", "avx512f", "bmi1", "bmi2", "fma", "popcnt", "sse", "sse2", "sse4_1", "sse4_2", "ssse3")
    finally:
        hostcpu.isa_extensions.cache_clear()


def test_older_entries_listing_intrinsic_only_extensions_still_load(written: tuple[Path, dict[str, Any]], key: CacheKey) -> None:
    entry_dir, manifest = written
    rewrite_manifest(entry_dir, {**manifest, "host_isa": [*manifest["host_isa"], "sse4a", "xsaveerptr", "avx512_vp2intersect", "rdrand"]})
    assert _load(entry_dir, key)
