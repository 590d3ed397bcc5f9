"""A damaged entry is a miss: quarantined, recompiled correctly, rewritten; flashinfer never notices.

Each case copies the session's warm micro root, damages its one entry the way a crash, a bad
disk or a foreign writer would, and runs fresh probes through real flashinfer:

1. the damaged start exits cleanly, compiles exactly once, rejects exactly once (with one
   warning naming the reason), moves the entry under ``quarantine/`` with the reason in its
   name, and gets the kernel the cold start got (same ABI text);
2. the entry was rewritten: the next start would hit. A fresh process (8-9 s) proves it for one
   case of each way a hit loads or a lookup reads (the object, the linked shared object, the
   manifest, and a directory the rewrite shares with a dead writer's leftovers). After every
   other case, the rewrite goes through the same quarantine -> compile -> commit path, so this
   process checks what that fresh start would look up: the one entry under the cold start's
   digest verifies, every payload against its checksum, under the cold start's key,
   environment and digest (:meth:`Store.judge`, the check every lookup makes).

A hit reads and hashes only the payload it loads (issue 16): the linked shared object where the
entry has one, else the object. Damage to the object is therefore checked with the shared-object
path off (``CUTE_DISKCACHE_SHARED_OBJECTS=0``); damage to the cubin or MLIR, which no hit loads,
leaves hits alone and is what ``cute-diskcache verify`` reports.

A last test flips each byte of a real manifest in turn, in-process, and checks that every
single flip is refused by verification.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers beside it, whatever pytest's import mode

from _next_start import assert_next_start_would_hit, lookup_key  # noqa: E402

from cute_diskcache.storage import entry  # noqa: E402
from cute_diskcache.keys.key import encode  # noqa: E402

if TYPE_CHECKING:
    from conftest import Warm

Probe = Callable[..., dict[str, Any]]


# --------------------------------------------------------------------------------------------
# Damage: each function breaks the entry in ``d`` and returns the reason the store must give
# (None: the entry must simply be absent, a plain miss with nothing quarantined).
# --------------------------------------------------------------------------------------------


def _manifest(d: Path) -> dict[str, Any]:
    return entry.read_manifest(d)


def _write_manifest(d: Path, m: dict[str, Any]) -> None:
    """Re-sealed: a writer that produced a well-formed manifest with the wrong content."""
    (d / entry.MANIFEST).write_bytes(entry.pack_manifest(m))


def _payload(d: Path, role: str) -> Path:
    return d / _manifest(d)["payloads"][role][0]["file"]


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def truncated_object(d: Path) -> str:
    obj = _payload(d, "object")
    obj.write_bytes(obj.read_bytes()[: obj.stat().st_size // 2])
    return "truncated"


def zero_byte_object(d: Path) -> str:
    _payload(d, "object").write_bytes(b"")
    return "truncated"


def zero_byte_manifest(d: Path) -> str:
    (d / entry.MANIFEST).write_bytes(b"")
    return "manifest"


def flipped_object(d: Path) -> str:
    _flip(_payload(d, "object"))
    return "checksum"


def flipped_shared(d: Path) -> str:
    _flip(_payload(d, "shared"))
    return "checksum"


def truncated_shared(d: Path) -> str:
    so = _payload(d, "shared")
    so.write_bytes(so.read_bytes()[:1000])
    return "truncated"


def flipped_cubin(d: Path) -> str:
    _flip(_payload(d, "cubin"))
    return "checksum"


def flipped_mlir(d: Path) -> str:
    _flip(_payload(d, "mlir"))
    return "checksum"


def flipped_manifest_key(d: Path) -> str:
    """One bit of the stored key itself, in place: the manifest's seal no longer matches."""
    raw = (d / entry.MANIFEST).read_bytes()
    key_bytes = _manifest(d)["key_bytes"]
    at = raw.index(key_bytes) + len(key_bytes) // 2
    _flip(d / entry.MANIFEST, at)
    return "manifest"


def foreign_digest(d: Path) -> str:
    """A manifest that belongs to another entry (its digest names another directory)."""
    m = _manifest(d)
    m["digest"] = hashlib.sha256(b"another kernel").hexdigest()
    _write_manifest(d, m)
    return "foreign"


def foreign_key(d: Path) -> str:
    """The right digest, another key: what a digest collision or a forged manifest looks like."""
    m = _manifest(d)
    m["key_bytes"] = encode(["flashinfer.moe_dispatch.micro", ("micro", 1), None])
    _write_manifest(d, m)
    return "foreign"


def wrong_arch(d: Path) -> str:
    """Built for the DGX Spark's sm_121a (env_digest left alone: only the arch field says so)."""
    m = _manifest(d)
    m["env"]["arch"] = "sm_121a"
    _write_manifest(d, m)
    return "arch"


def _other_dsl(m: dict[str, Any]) -> None:
    m["env"]["dsl"] = [[name, "4.6.3" if name.startswith("nvidia-cutlass-dsl") else v] for name, v in m["env"]["dsl"]]


def wrong_dsl_recorded(d: Path) -> str:
    """The manifest says DSL 4.6.3 wrote it; its env_digest was not updated to match."""
    m = _manifest(d)
    _other_dsl(m)
    _write_manifest(d, m)
    return "stale|manifest"


def wrong_dsl_consistent(d: Path) -> str:
    """Written under DSL 4.6.3, env_digest and all: an object 4.8.1 must not trust."""
    m = _manifest(d)
    _other_dsl(m)
    m["env_digest"] = hashlib.sha256(encode(m["env"])).hexdigest()
    _write_manifest(d, m)
    return "stale"


def hostile_payload_name(d: Path) -> str:
    """A payload name that escapes the entry; the file it points at even holds the right bytes."""
    m = _manifest(d)
    obj = d / m["payloads"]["object"][0]["file"]
    shutil.move(obj, d.parent.parent / "evil")
    m["payloads"]["object"][0]["file"] = "../../evil"
    _write_manifest(d, m)
    return "manifest"


def stray_temp_files_only(d: Path) -> None:
    """A writer died before its commit: temp names and a payload, no manifest. Not an entry."""
    raw = (d / entry.MANIFEST).read_bytes()
    (d / entry.MANIFEST).unlink()
    obj = _payload_name_from(raw, "object")
    (d / obj).unlink()
    (d / f".tmp.{entry.MANIFEST}.otherhost.4242.a1b2c3d4e5f6").write_bytes(raw[: len(raw) // 3])
    (d / f".tmp.{obj}.otherhost.4242.0f0e0d0c0b0a").write_bytes(b"\x7fELF partial")
    return None


def _payload_name_from(raw: bytes, role: str) -> str:
    return str(entry.unpack_manifest(raw)["payloads"][role][0]["file"])


#: The object is what a hit loads only with the shared-object path off.
OBJECT_LOADED = {"CUTE_DISKCACHE_SHARED_OBJECTS": "0"}


@dataclass(frozen=True)
class Case:
    damage: Callable[[Path], str | None]
    slow: bool = False
    env: dict[str, str] | None = None
    unread: bool = False  # a payload no hit reads: hits go on, ``verify`` reports it
    # The next start's hit is proven by a fresh process (else by judging the rewrite in-process):
    # one case per payload a hit loads, per manifest damage, and per rewrite beside leftovers.
    next_start: bool = False


CASES = [
    Case(truncated_object, env=OBJECT_LOADED, next_start=True),
    Case(zero_byte_object, env=OBJECT_LOADED),
    Case(zero_byte_manifest, next_start=True),
    Case(flipped_object, env=OBJECT_LOADED),
    Case(flipped_shared, next_start=True),
    Case(truncated_shared),
    Case(flipped_cubin, unread=True),
    Case(flipped_mlir, unread=True),
    Case(flipped_manifest_key),
    Case(foreign_digest),
    Case(foreign_key, slow=True),
    Case(wrong_arch),
    Case(wrong_dsl_recorded),
    Case(wrong_dsl_consistent, slow=True),
    Case(hostile_payload_name),
    Case(stray_temp_files_only, next_start=True),
]


# --------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------


def _entry_dir(root: Path) -> Path:
    dirs = [p.parent for p in root.glob("v1/*/*/*/" + entry.MANIFEST)]
    assert len(dirs) == 1, dirs
    return dirs[0]


def _cold_manifest(warm: Warm) -> dict[str, Any]:
    """The manifest the cold start wrote (the session's root, never damaged)."""
    return _manifest(_entry_dir(warm.root))


def _assert_recovered(root: Path, cold: dict[str, Any], probe: Probe, reason: str | None,
                      env: dict[str, str] | None = None, *, cold_manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the damaged start; check it, then the next start: a fresh one, or (``cold_manifest``)
    in-process, judging what it would look up. Returns the damaged report."""
    digest = cold["events"][0][1]
    hurt = probe(root, 1, extra_env=env)
    c = hurt["counters"]
    warnings = re.findall(r"^cache entry .* rejected \((\w+):", hurt["stderr"], re.M)
    assert hurt["real_compiles"] == 1, hurt["stderr"]
    assert (c["compiles"], c["hits"], c["writes"], c["errors"]) == (1, 0, 1, 0), hurt["stderr"]
    assert hurt["records"][0]["launch_error"] == cold["records"][0]["launch_error"]
    assert hurt["kernels"] == cold["kernels"]
    quarantined = sorted((root / "quarantine").iterdir()) if (root / "quarantine").exists() else []
    if reason is None:
        assert c["rejected"] == 0 and warnings == [] and quarantined == []
        assert hurt["stderr"] == ""
    else:
        assert c["rejected"] == 1
        assert len(warnings) == 1 and re.fullmatch(reason, warnings[0]), hurt["stderr"]
        assert len(quarantined) == 1 and re.search(rf"-({reason})-{digest}-", quarantined[0].name), quarantined
        assert hurt["stderr"].count("\n") == 0, f"one warning line expected:\n{hurt['stderr']}"
    assert _entry_dir(root).name == digest

    if cold_manifest is not None:
        assert_next_start_would_hit(root, cold_manifest, same_payloads=env is None)
        return hurt
    again = probe(root, 1)
    assert again["real_compiles"] == 0, (again["events"], sorted(map(str, root.rglob("*"))), again["stderr"])
    assert (again["counters"]["hits"], again["counters"]["compiles"], again["counters"]["rejected"]) == (1, 0, 0)
    assert again["records"][0]["launch_error"] == cold["records"][0]["launch_error"]
    return hurt


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.damage.__name__, marks=[pytest.mark.slow] if c.slow else []) for c in CASES],
)
def test_damaged_entry_is_quarantined_and_rewritten(case: Case, micro_copy: Warm, warm_micro_root: Warm, probe: Probe) -> None:
    root, cold = micro_copy
    d = _entry_dir(root)
    evil_target = d.parent.parent / "evil"
    cold_manifest = _cold_manifest(warm_micro_root)
    reason = case.damage(d)
    if case.unread:
        _assert_unread_damage_is_left_to_verify(root, cold, probe, d, reason, cold_manifest)
        return
    _assert_recovered(root, cold, probe, reason, case.env, cold_manifest=None if case.next_start else cold_manifest)
    if case.damage is hostile_payload_name:
        assert evil_target.exists(), "the file outside the entry must be neither read into a hit nor removed"


def _assert_unread_damage_is_left_to_verify(root: Path, cold: dict[str, Any], probe: Probe, d: Path, reason: str | None,
                                            cold_manifest: dict[str, Any]) -> None:
    """Hits hash what they load; the damaged payload is read by ``verify``, which says so.

    After ``verify`` quarantined it, the key is a plain miss (no manifest, nothing left of the
    entry), which a start compiles and writes: what the cold start of the session's root did,
    and, beside a dead writer's leftovers, what ``stray_temp_files_only`` proves in a fresh
    process. Judged here rather than paid as a third fresh process with a compile.
    """
    from cute_diskcache import cli
    from cute_diskcache.storage.store import Store

    hit = probe(root, 1)
    assert hit["real_compiles"] == 0 and hit["counters"]["hits"] == 1 and hit["counters"]["rejected"] == 0, hit["stderr"]
    assert hit["records"][0]["launch_error"] == cold["records"][0]["launch_error"]
    assert not (root / "quarantine").exists()
    assert cli.main(["--root", str(root), "verify", "--quarantine"]) == 1
    assert [p.name.split("-")[1] for p in (root / "quarantine").iterdir()] == [reason]
    store = Store(root)
    assert store.judge(lookup_key(cold_manifest)) is None, "quarantined by verify: the next start misses and rebuilds"
    assert store.rejected == 0 and not d.exists(), sorted(map(str, d.rglob("*")))


@pytest.mark.slow
def test_manifest_of_another_kernel_is_foreign(micro_copy: Warm, warm_micro_root: Warm, warm_large_root: Warm, probe: Probe) -> None:
    """A real manifest of the static kernel, dropped into the micro kernel's entry.

    The recovery after it is the manifest cases' (quarantine, compile, commit), whose next start
    ``zero_byte_manifest`` runs in a fresh process: here the rewrite is judged in-process.
    """
    root, cold = micro_copy
    static = next(p for p in warm_large_root.root.glob("v1/*/*/*/" + entry.MANIFEST) if _manifest(p.parent)["site"].endswith("static"))
    shutil.copyfile(static, _entry_dir(root) / entry.MANIFEST)
    _assert_recovered(root, cold, probe, "foreign", cold_manifest=_cold_manifest(warm_micro_root))


# --------------------------------------------------------------------------------------------
# Every single-byte flip of a real manifest, in-process (no flashinfer, no compile)
# --------------------------------------------------------------------------------------------


def _expected_key(m: dict[str, Any]) -> Any:
    """What the adapter would look the entry up with: the key the manifest was written for."""
    env = SimpleNamespace(digest=m["env_digest"], arch=m["env"]["arch"], as_dict=lambda: m["env"])
    return SimpleNamespace(env=env, key_bytes=m["key_bytes"], digest=m["digest"])


def test_no_single_byte_flip_of_a_real_manifest_verifies(micro_copy: Warm) -> None:
    """Whatever field a flip lands in (the key, the symbol, the tvm-ffi flag, a size), it is a miss."""
    root, _ = micro_copy
    d = _entry_dir(root)
    raw = (d / entry.MANIFEST).read_bytes()
    key = _expected_key(_manifest(d))
    entry.verify(d, _manifest(d), key)  # the undamaged one passes, with this very key
    passed = []
    for at in range(len(raw)):
        flipped = bytearray(raw)
        flipped[at] ^= 0x01
        (d / entry.MANIFEST).write_bytes(bytes(flipped))
        try:
            entry.verify(d, entry.read_manifest(d), key)
        except entry.EntryError:
            continue
        passed.append(at)
    assert passed == [], f"flips at bytes {passed} of {len(raw)} still verified"
