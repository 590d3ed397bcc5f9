"""Bundles: export only verified entries; import treats the file as hostile and never loses a good entry.

Every bundle here is a real tar.gz: either written by ``export`` or built member by member
to carry exactly the hostile thing a test is about (links, devices, ``..``, corrupted bytes).
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import flip_byte, make_artifact, make_env, make_key, payload_path  # noqa: E402

from cute_diskcache import cli  # noqa: E402
from cute_diskcache.storage import bundle, entry, ingest, layout, stats  # noqa: E402
from cute_diskcache.keys.key import CacheKey  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("CUTE_DISKCACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    stats.reset_for_tests()
    stats.bind(None)


def put(root: Path, key: CacheKey, body: bytes = b"\x22" * 48) -> Path:
    d = root / "v1" / key.env.namespace / key.digest[:2] / key.digest
    entry.write(d, key, make_artifact((body,)))
    return d


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """Four entries in two namespaces."""
    root = tmp_path / "src"
    for i, kind in enumerate(("micro", "static", "dynamic")):
        put(root, make_key(kind), bytes([i + 1]) * (500 + i))
    put(root, make_key("micro", env=make_env(arch="sm_121a")))
    return root


def files_of(root: Path) -> dict[str, bytes]:
    """Every entry file under ``root/v1``, by its path relative to the root."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted((root / "v1").rglob("*")) if p.is_file()} if (root / "v1").exists() else {}


def digests(root: Path) -> list[str]:
    return sorted(d.name for d in layout.entry_dirs(root))


def members(path: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(path, "r:gz") as tar:
        out = []
        for m in tar.getmembers():
            fh = tar.extractfile(m) if m.isreg() else None
            out.append((m, fh.read() if fh else None))
        return out


def write_tar(path: Path, items: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in items:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def header(**changes: Any) -> tuple[tarfile.TarInfo, bytes]:
    doc = {"format": bundle.BUNDLE_FORMAT, "version": bundle.BUNDLE_VERSION, "layout": "v1", "entries": 0, "namespaces": {}, "created": time.time()}
    doc.update(changes)
    raw = json.dumps(doc).encode()
    info = tarfile.TarInfo(bundle.BUNDLE_MANIFEST)
    info.size = len(raw)
    return info, raw


def reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


# --------------------------------------------------------------------------------------------
# Export and the round trip
# --------------------------------------------------------------------------------------------


def test_round_trip_keeps_digests_and_bytes(src: Path, tmp_path: Path) -> None:
    path = tmp_path / "cache.tar.gz"
    report = bundle.export_bundle(src, path)
    assert report.entries == 4 and not report.skipped and sum(report.namespaces.values()) == 4
    names = [m.name for m, _ in members(path)]
    assert names[0] == bundle.BUNDLE_MANIFEST
    head = json.loads(members(path)[0][1] or b"")
    assert head["format"] == bundle.BUNDLE_FORMAT and head["version"] == 1 and head["entries"] == 4
    assert head["namespaces"] == report.namespaces and head["created"] <= time.time()

    dst = tmp_path / "dst"
    imported = bundle.import_bundle(dst, path)
    assert imported.ok and sorted(imported.imported) == digests(src)
    assert digests(dst) == digests(src)
    assert files_of(dst) == files_of(src)
    assert not list((dst / layout.TMP_DIR).iterdir()), "staging is cleaned up"
    for d in layout.entry_dirs(dst):
        ingest.check(d)


def test_export_leaves_bad_entries_out(src: Path, tmp_path: Path) -> None:
    victim = sorted(layout.entry_dirs(src))[1]
    flip_byte(payload_path(victim, entry.read_manifest(victim), "object"))
    (src / "v1" / victim.parent.parent.name / "ab" / ("ab" + "1" * 62)).mkdir(parents=True)  # no manifest: a writer at work
    path = tmp_path / "b.tgz"
    report = bundle.export_bundle(src, path)
    assert report.entries == 3
    assert [s["digest"] for s in report.skipped] == [victim.name] and "checksum" in report.skipped[0]["reason"]
    assert not any(victim.name in m.name for m, _ in members(path))
    dst = tmp_path / "dst"
    assert bundle.import_bundle(dst, path).ok and victim.name not in digests(dst) and len(digests(dst)) == 3


def test_export_selects_namespaces(src: Path, tmp_path: Path) -> None:
    ns = make_env(arch="sm_121a").namespace
    report = bundle.export_bundle(src, tmp_path / "b.tgz", [ns])
    assert report.entries == 1 and list(report.namespaces) == [ns]


def test_cli_export_import(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "b.tgz"
    assert cli.main(["--root", str(src), "export", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("exported 4 entries") and str(path) in out
    dst = tmp_path / "dst"
    assert cli.main(["--root", str(dst), "import", str(path)]) == 0
    out = capsys.readouterr().out
    assert ": 4 imported, 0 kept" in out
    assert cli.main(["--root", str(dst), "import", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and sorted(data["kept"]) == digests(src) and data["imported"] == []
    assert cli.main(["--root", str(src), "export", str(path), "--json", "--namespace", "flashinfer-moe-0.6.15.post1-sm_120a"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 3


# --------------------------------------------------------------------------------------------
# Import: corrupted entries, hostile members
# --------------------------------------------------------------------------------------------


def test_one_corrupted_entry_does_not_stop_the_others(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.tgz"
    bundle.export_bundle(src, good)
    items = members(good)
    i = next(i for i, (m, _) in enumerate(items) if "/object-" in m.name)
    victim = items[i][0].name.split("/")[3]
    data = bytearray(items[i][1] or b"")
    data[len(data) // 2] ^= 0xFF
    items[i] = (items[i][0], bytes(data))
    bad = write_tar(tmp_path / "bad.tgz", items)

    dst = tmp_path / "dst"
    report = bundle.import_bundle(dst, bad)
    assert not report.ok
    assert [b["digest"] for b in report.bad] == [victim] and report.bad[0]["reason"].startswith("checksum")
    assert sorted(report.imported) == sorted(set(digests(src)) - {victim}) == digests(dst)
    assert not list((dst / layout.TMP_DIR).iterdir())

    assert cli.main(["--root", str(tmp_path / "dst2"), "import", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"BAD entry {victim[:12]}" in out and ": 3 imported" in out and "1 bad" in out


def _valid_entry_members(src: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    d = sorted(layout.entry_dirs(src))[0]
    rel = d.relative_to(src).as_posix()
    return [reg(f"{rel}/{p.name}", p.read_bytes()) for p in sorted(d.iterdir())]


def _special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


HOSTILE = {
    "dotdot": (lambda ns, dg: reg("../escaped", b"x"), "'..'"),
    "dotdot-inside": (lambda ns, dg: reg(f"v1/{ns}/{dg[:2]}/../../../escaped", b"x"), "'..'"),
    "absolute": (lambda ns, dg: reg("/tmp/cute-diskcache-test-escaped", b"x"), "absolute"),
    "symlink": (lambda ns, dg: _special(f"v1/{ns}/{dg[:2]}/{dg}/evil", tarfile.SYMTYPE, "/etc/passwd"), "symbolic link"),
    "hardlink": (lambda ns, dg: _special(f"v1/{ns}/{dg[:2]}/{dg}/evil", tarfile.LNKTYPE, "/etc/passwd"), "hard link"),
    "chardev": (lambda ns, dg: _special(f"v1/{ns}/{dg[:2]}/{dg}/evil", tarfile.CHRTYPE), "device"),
    "fifo": (lambda ns, dg: _special(f"v1/{ns}/{dg[:2]}/{dg}/evil", tarfile.FIFOTYPE), "fifo"),
    "directory": (lambda ns, dg: _special(f"v1/{ns}/{dg[:2]}/{dg}/sub", tarfile.DIRTYPE), "not a regular file"),
    "outside-layout": (lambda ns, dg: reg("evil.sh", b"#!/bin/sh\n"), "outside"),
    "wrong-shard": (lambda ns, dg: reg(f"v1/{ns}/zz/{dg}/object-0.o", b"x"), "outside"),
    "too-deep": (lambda ns, dg: reg(f"v1/{ns}/{dg[:2]}/{dg}/a/b", b"x"), "outside"),
    "hidden-file": (lambda ns, dg: reg(f"v1/{ns}/{dg[:2]}/{dg}/.pth", b"x"), "outside"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_member_is_refused(case: str, src: Path, tmp_path: Path) -> None:
    make, reason = HOSTILE[case]
    valid = _valid_entry_members(src)
    ns, dg = valid[0][0].name.split("/")[1], "cd" + "0" * 62
    hostile = make(ns, dg)
    path = write_tar(tmp_path / "hostile.tgz", [header(), hostile, *valid])
    dst = tmp_path / "deep" / "dst"
    report = bundle.import_bundle(dst, path)
    assert not report.ok
    assert [r["member"] for r in report.rejected] == [hostile[0].name] and reason in report.rejected[0]["reason"]
    assert len(report.imported) == 1, "the valid entry beside it still comes in"
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "deep" / "escaped").exists()
    assert not Path("/tmp/cute-diskcache-test-escaped").exists()
    assert not (dst / "evil.sh").exists() and not list(dst.rglob("evil")) and not list(dst.rglob(".pth"))
    assert not list((dst / layout.TMP_DIR).iterdir())


def test_link_in_place_of_a_payload_fails_that_entry(src: Path, tmp_path: Path) -> None:
    valid = _valid_entry_members(src)
    obj = next(i for i, (m, _) in enumerate(valid) if "/object-" in m.name)
    valid[obj] = _special(valid[obj][0].name, tarfile.SYMTYPE, "/bin/sh")
    report = bundle.import_bundle(tmp_path / "dst", write_tar(tmp_path / "b.tgz", [header(), *valid]))
    assert report.rejected and report.bad and report.bad[0]["reason"].startswith("truncated")
    assert digests(tmp_path / "dst") == []


def test_oversized_member_is_refused_unread(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle, "MAX_MEMBER_BYTES", 4096)
    valid = _valid_entry_members(src)
    dg = "ef" + "0" * 62
    big = reg(f"v1/{valid[0][0].name.split('/')[1]}/ef/{dg}/object-0.o", b"\0" * 5000)
    report = bundle.import_bundle(tmp_path / "dst", write_tar(tmp_path / "b.tgz", [header(), big, *valid]))
    assert "larger than 4096 bytes" in report.rejected[0]["reason"]
    assert len(report.imported) == 1


def test_duplicate_member_spoils_its_entry(src: Path, tmp_path: Path) -> None:
    valid = _valid_entry_members(src)
    report = bundle.import_bundle(tmp_path / "dst", write_tar(tmp_path / "b.tgz", [header(), *valid, valid[0]]))
    assert report.bad and "twice" in report.bad[0]["reason"] and report.imported == []


def test_stowaway_file_is_dropped(src: Path, tmp_path: Path) -> None:
    valid = _valid_entry_members(src)
    prefix = valid[0][0].name.rsplit("/", 1)[0]
    report = bundle.import_bundle(tmp_path / "dst", write_tar(tmp_path / "b.tgz", [header(), *valid, reg(f"{prefix}/payload.so", b"\x7fELF")]))
    assert report.ok and len(report.imported) == 1
    assert not list((tmp_path / "dst").rglob("payload.so")), "a file no manifest names is never kept"


@pytest.mark.parametrize("what", ["no-header", "wrong-format", "garbage"])
def test_not_a_bundle(what: str, src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.tgz"
    if what == "no-header":
        write_tar(path, _valid_entry_members(src))
    elif what == "wrong-format":
        write_tar(path, [header(format="something-else"), *_valid_entry_members(src)])
    else:
        path.write_bytes(os.urandom(4096))
    with pytest.raises(bundle.BundleError):
        bundle.import_bundle(tmp_path / "dst", path)
    assert digests(tmp_path / "dst") == []
    assert cli.main(["--root", str(tmp_path / "dst"), "import", str(path)]) == 2
    assert "import:" in capsys.readouterr().err


def test_truncated_bundle_imports_what_is_whole(src: Path, tmp_path: Path) -> None:
    for i in range(20):  # enough entries that the cut falls after some of them
        put(src, make_key(site_key=("micro", i)), os.urandom(3000))
    path = tmp_path / "b.tgz"
    bundle.export_bundle(src, path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) * 2 // 3])
    dst = tmp_path / "dst"
    report = bundle.import_bundle(dst, path)
    assert not report.ok and any(r["member"] == "(stream)" for r in report.rejected)
    assert 0 < len(report.imported) < 24
    for d in layout.entry_dirs(dst):
        ingest.check(d)  # whatever came in is whole
    assert not list((dst / layout.TMP_DIR).iterdir())


# --------------------------------------------------------------------------------------------
# Import: what is already there
# --------------------------------------------------------------------------------------------


def test_import_never_replaces_a_valid_entry(src: Path, tmp_path: Path) -> None:
    path = tmp_path / "b.tgz"
    bundle.export_bundle(src, path)
    dst = tmp_path / "dst"
    key = make_key("static")
    mine = put(dst, key, b"\x99" * 700)  # same key, other (valid) bytes
    before = files_of(dst)
    report = bundle.import_bundle(dst, path)
    assert report.ok and report.kept == [key.digest] and key.digest not in report.imported
    assert {k: v for k, v in files_of(dst).items() if mine.name in k} == before


def test_import_replaces_a_bad_entry_and_quarantines_it(src: Path, tmp_path: Path) -> None:
    path = tmp_path / "b.tgz"
    bundle.export_bundle(src, path)
    dst = tmp_path / "dst"
    key = make_key("dynamic")
    mine = put(dst, key, b"\x99" * 700)
    flip_byte(payload_path(mine, entry.read_manifest(mine), "cubin"))
    report = bundle.import_bundle(dst, path)
    assert report.ok and report.replaced == [key.digest]
    ingest.check(mine)
    assert files_of(dst) == files_of(src)
    assert [p for p in (dst / "quarantine").iterdir() if key.digest in p.name and "checksum" in p.name]


def test_import_leaves_a_live_writer_alone(src: Path, tmp_path: Path) -> None:
    path = tmp_path / "b.tgz"
    bundle.export_bundle(src, path)
    dst = tmp_path / "dst"
    key = make_key("micro")
    busy = dst / "v1" / key.env.namespace / key.digest[:2] / key.digest
    busy.mkdir(parents=True)
    (busy / "object-0000.o").write_bytes(b"half")  # payloads written, manifest not yet
    report = bundle.import_bundle(dst, path)
    assert report.busy == [key.digest] and (busy / "object-0000.o").read_bytes() == b"half"
    old = time.time() - 3600  # the same directory an hour later: a writer that died
    os.utime(busy / "object-0000.o", (old, old))
    os.utime(busy, (old, old))
    report = bundle.import_bundle(dst, path)
    assert report.replaced == [key.digest] and files_of(dst) == files_of(src)


# --------------------------------------------------------------------------------------------
# Trust: signatures and the root
# --------------------------------------------------------------------------------------------


def test_signed_entries_travel_signed_and_only_our_key_lets_them_in(tmp_path: Path) -> None:
    signed, plain = tmp_path / "signed", tmp_path / "plain"
    for kind in ("micro", "static"):
        d = signed / "v1" / make_key(kind).env.namespace / make_key(kind).digest[:2] / make_key(kind).digest
        entry.write(d, make_key(kind), make_artifact(), hmac_key=b"fleet-key")
        put(plain, make_key(kind))
    assert bundle.export_bundle(signed, tmp_path / "s.tgz", hmac_key=b"fleet-key").entries == 2
    assert bundle.export_bundle(plain, tmp_path / "p.tgz").entries == 2
    assert bundle.export_bundle(plain, tmp_path / "x.tgz", hmac_key=b"fleet-key").entries == 0, "unsigned entries are not exported as verified"

    ok = bundle.import_bundle(tmp_path / "a", tmp_path / "s.tgz", hmac_key=b"fleet-key")
    assert ok.ok and len(ok.imported) == 2
    for d in layout.entry_dirs(tmp_path / "a"):
        ingest.check(d, hmac_key=b"fleet-key")
    other = bundle.import_bundle(tmp_path / "b", tmp_path / "s.tgz", hmac_key=b"another-key")
    assert len(other.bad) == 2 and all(b["reason"].startswith("signature") for b in other.bad) and digests(tmp_path / "b") == []
    unsigned = bundle.import_bundle(tmp_path / "c", tmp_path / "p.tgz", hmac_key=b"fleet-key")
    assert len(unsigned.bad) == 2 and all("not signed" in b["reason"] for b in unsigned.bad)


def test_import_refuses_a_root_others_can_write(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "b.tgz"
    bundle.export_bundle(src, path)
    dst = tmp_path / "shared"
    dst.mkdir()
    dst.chmod(0o777)
    with pytest.raises(bundle.BundleError, match="writable by group and others"):
        bundle.import_bundle(dst, path)
    assert not (dst / "v1").exists()
    assert cli.main(["--root", str(dst), "import", str(path)]) == 2
    assert "CUTE_DISKCACHE_TRUST_SHARED" in capsys.readouterr().err
    monkeypatch.setenv("CUTE_DISKCACHE_TRUST_SHARED", "1")
    assert cli.main(["--root", str(dst), "import", str(path)]) == 0
    assert digests(dst) == digests(src)


def test_import_never_follows_a_link_inside_the_root(src: Path, tmp_path: Path) -> None:
    path = tmp_path / "b.tgz"
    bundle.export_bundle(src, path)
    dst, elsewhere = tmp_path / "dst", tmp_path / "elsewhere"
    elsewhere.mkdir()
    ns = make_env(arch="sm_121a").namespace
    (dst / "v1").mkdir(parents=True)
    (dst / "v1" / ns).symlink_to(elsewhere)
    report = bundle.import_bundle(dst, path)
    assert [b["namespace"] for b in report.bad] == [ns] and report.bad[0]["reason"].startswith("link")
    assert len(report.imported) == 3 and list(elsewhere.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Hostile sizes and shapes (issue 15, items 11 and 12)
# --------------------------------------------------------------------------------------------


class _Zeros(io.RawIOBase):
    """``size`` zero bytes, streamed: a member that compresses 1000:1 without being held in memory."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def _bomb(path: Path, members_: list[tuple[tarfile.TarInfo, bytes | None]], name: str, size: int) -> Path:
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for info, data in members_:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
        info = tarfile.TarInfo(name)
        info.size = size
        tar.addfile(info, io.BufferedReader(_Zeros(size)))
    return path


def _staged_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes of each file import stages, as it writes them."""
    staged: list[int] = []
    real = ingest.stage_file

    def counting(dest: Path, chunks: Any, **kw: Any) -> None:
        staged.append(0)

        def counted() -> Any:
            for chunk in chunks:
                staged[-1] += len(chunk)
                yield chunk

        real(dest, counted(), **kw)

    monkeypatch.setattr(ingest, "stage_file", counting)
    return staged


def test_export_puts_each_manifest_before_its_payloads(src: Path, tmp_path: Path) -> None:
    path = tmp_path / "b.tgz"
    bundle.export_bundle(src, path)
    seen: dict[str, list[str]] = {}
    for m, _ in members(path)[1:]:
        seen.setdefault(m.name.rsplit("/", 1)[0], []).append(m.name.rsplit("/", 1)[1])
    assert seen and all(files[0] == entry.MANIFEST for files in seen.values())


def test_gzip_bomb_member_is_never_staged(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Old code staged a 204 kB bundle to 210 MB on the serving volume before any check."""
    valid = _valid_entry_members(src)
    prefix = valid[0][0].name.rsplit("/", 1)[0]
    staged = _staged_bytes(monkeypatch)
    # A payload name its manifest does not list, then one it lists but with another size.
    path = _bomb(tmp_path / "bomb.tgz", [header(), *valid], f"{prefix}/object-ffffffffffffffff.o", 200 << 20)
    assert path.stat().st_size < 2 << 20
    report = bundle.import_bundle(tmp_path / "dst", path)
    assert report.ok and len(report.imported) == 1, report
    assert sum(staged) < 64 << 10, staged
    obj = next(m for m, _ in valid if m.name.split("/")[-1].startswith("object-"))
    wrong = _bomb(tmp_path / "wrong.tgz", [header(), *[v for v in valid if v[0] is not obj]], obj.name, 200 << 20)
    staged.clear()
    report = bundle.import_bundle(tmp_path / "dst2", wrong)
    assert not report.ok and "its manifest says" in report.bad[0]["reason"] and sum(staged) < 64 << 10


def test_entry_with_too_many_files_is_refused_early(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundle written the old way (manifest last) is held to per-entry file and byte caps."""
    valid = _valid_entry_members(src)
    prefix = valid[0][0].name.rsplit("/", 1)[0]
    manifest = [v for v in valid if v[0].name.endswith(entry.MANIFEST)]
    junk = [reg(f"{prefix}/cubin-{i:016x}.cubin", b"\x7fELF" * 16) for i in range(bundle.MAX_ENTRY_FILES + 5)]
    staged = _staged_bytes(monkeypatch)
    report = bundle.import_bundle(tmp_path / "dst", write_tar(tmp_path / "many.tgz", [header(), *junk, *manifest]))
    assert not report.ok and f"more than {bundle.MAX_ENTRY_FILES} files" in report.bad[0]["reason"]
    assert len(staged) <= bundle.MAX_ENTRY_FILES


def test_import_stops_at_the_size_cap(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "b.tgz"
    bundle.export_bundle(src, path)
    total = sum(m.size for m, _ in members(path)[1:])
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", str(total // 2))
    report = bundle.import_bundle(tmp_path / "dst", path)
    assert any("more than" in r["reason"] and "CUTE_DISKCACHE_MAX_SIZE" in r["reason"] for r in report.rejected), report.rejected
    assert 0 < len(report.imported) < 4


def test_deeply_nested_bundle_header_is_refused_not_a_recursion_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = b"[" * 100_000 + b"]" * 100_000
    info = tarfile.TarInfo(bundle.BUNDLE_MANIFEST)
    info.size = len(raw)
    path = write_tar(tmp_path / "deep.tgz", [(info, raw)])
    with pytest.raises(bundle.BundleError, match="nested"):
        bundle.import_bundle(tmp_path / "dst", path)
    assert cli.main(["--root", str(tmp_path / "dst"), "import", str(path)]) == 2
    assert "nested" in capsys.readouterr().err


def test_non_ascii_signature_is_a_bad_entry_not_a_crash(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """hmac.compare_digest raised TypeError on a str with non-ASCII characters: verify and import crashed."""
    import msgpack

    d = sorted(layout.entry_dirs(src))[0]
    outer = msgpack.unpackb((d / entry.MANIFEST).read_bytes(), raw=False)
    outer["hmac"] = "\u00e9" * 64
    (d / entry.MANIFEST).write_bytes(msgpack.packb(outer, use_bin_type=True))
    monkeypatch.setenv("CUTE_DISKCACHE_HMAC_KEY", "fleet")
    assert cli.main(["--root", str(src), "verify"]) == 1
    assert "signature" in capsys.readouterr().out
    path = tmp_path / "b.tgz"
    monkeypatch.delenv("CUTE_DISKCACHE_HMAC_KEY")
    bundle.export_bundle(src, path)
    monkeypatch.setenv("CUTE_DISKCACHE_HMAC_KEY", "fleet")
    assert cli.main(["--root", str(tmp_path / "dst"), "import", str(path)]) == 1
    assert "signature" in capsys.readouterr().out
