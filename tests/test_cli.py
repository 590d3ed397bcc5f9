"""The operator's CLI: every subcommand's table and its ``--json``, on synthetic entries.

Entries are written with :func:`entry.write` from hand-built keys (no flashinfer, no compile),
so each test runs in milliseconds. Two tests use the session's one real micro compile: a real
cubin for ``show --cubin`` and a real object for ``verify --device``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import flip_byte, make_artifact, make_env, make_key, mlir_of, payload_path, rewrite_manifest  # noqa: E402

from cute_diskcache import cli  # noqa: E402
from cute_diskcache.storage import entry, eviction, stats  # noqa: E402
from cute_diskcache.keys.key import CacheKey, Environment, dsl_stack  # noqa: E402

FLASHINFER = importlib.metadata.version("flashinfer-python")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    """No operator setting leaks in; fsync only costs time here; no counts left by other tests."""
    for name in list(os.environ):
        if name.startswith("CUTE_DISKCACHE_") or name == "CUTE_DSL_ARCH":
            monkeypatch.delenv(name)
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    stats.reset_for_tests()
    stats.bind(None)


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    r = tmp_path / "cache"
    monkeypatch.setenv("CUTE_DISKCACHE_DIR", str(r))
    return r


def current_env(**changes: Any) -> Environment:
    """The environment this install would key on (what ``prune`` keeps)."""
    fields: dict[str, Any] = dict(package=f"flashinfer-python=={FLASHINFER}", dsl=dsl_stack(), machine=platform.machine())
    fields.update(changes)
    return make_env(**fields)


def put(root: Path, key: CacheKey, body: bytes = b"\x22" * 48, *, used: float | None = None) -> Path:
    """Write one entry under ``root`` the way the store lays it out; optionally age its last use."""
    d = root / "v1" / key.env.namespace / key.digest[:2] / key.digest
    entry.write(d, key, make_artifact((body,), extra={"site": key.site}))
    if used is not None:
        os.utime(d, (used, used))
    return d


@pytest.fixture
def three(root: Path) -> dict[str, Path]:
    """micro, static and dynamic entries of one current namespace, of growing sizes."""
    env = current_env()
    return {kind: put(root, make_key(kind, env=env), bytes([i + 1]) * (1000 * (i + 1))) for i, kind in enumerate(("micro", "static", "dynamic"))}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().out


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    """A command's JSON: a result on stdout, or a refusal on stderr (stdout then empty)."""
    rc = cli.main([*argv, "--json"])
    out, err = capsys.readouterr()
    if rc == 2 and not out:
        return rc, json.loads(err)
    return rc, json.loads(out)


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


# --------------------------------------------------------------------------------------------
# stats / zero
# --------------------------------------------------------------------------------------------


def test_stats_table_and_json(root: Path, three: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_MAX_SIZE", "1G")
    ns = three["micro"].parent.parent.name
    stats.bind(root)
    stats.record(ns, "hits", 7)
    stats.record(ns, "misses", 2)
    stats.record(ns, "compiles", 2)
    stats.record(ns, "saved_seconds", 31.5)
    stats.record("other-ns", "quarantined")
    stats.flush()
    stats.reset_for_tests()
    stats.bind(None)

    rc, out = run(capsys, "stats")
    assert rc == 0
    lines = {ln.split("  ")[0]: ln for ln in out.splitlines()}
    assert lines["hits"].split()[1] == "7" and "77.8% of 9 lookups" in lines["hits"]
    assert "31.5 s" in lines["compile time saved"]
    assert lines["entries"].split()[1] == "3"
    assert "/ 1.0 GB" in lines["cache size"]
    assert f"{root}  (CUTE_DISKCACHE_DIR)" in lines["cache root"]
    ns_line = next(ln for ln in out.splitlines() if ln.startswith(ns))
    assert ns_line.split()[1:4] == ["7", "2", "2"]

    rc, data = run_json(capsys, "stats")
    total = sum(_dir_bytes(d) for d in three.values())
    assert rc == 0 and data["root"] == str(root) and data["root_source"] == "CUTE_DISKCACHE_DIR"
    assert data["max_size"] == 10**9
    assert data["total"]["hits"] == 7 and data["total"]["quarantined"] == 1
    assert data["total"]["entries"] == 3 and data["total"]["bytes"] == total
    assert data["namespaces"][ns]["entries"] == 3 and data["namespaces"][ns]["saved_seconds"] == 31.5
    assert data["namespaces"]["other-ns"]["entries"] == 0


def test_zero_forgets_statistics_but_not_entries(root: Path, three: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    stats.bind(root)
    stats.record("ns", "hits", 5)
    stats.flush()
    stats.reset_for_tests()
    stats.bind(None)
    assert run_json(capsys, "stats")[1]["total"]["hits"] == 5
    rc, out = run(capsys, "zero")
    assert rc == 0 and "zeroed" in out
    data = run_json(capsys, "stats")[1]
    assert data["total"]["hits"] == 0 and data["total"]["entries"] == 3
    assert run_json(capsys, "zero")[1] == {"schema": 1, "root": str(root), "zeroed": True}


def test_stats_on_an_absent_root(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, data = run_json(capsys, "stats")
    assert rc == 0 and data["total"]["entries"] == 0 and data["namespaces"] == {}
    assert not root.exists(), "looking must not create the root"


# --------------------------------------------------------------------------------------------
# list / show
# --------------------------------------------------------------------------------------------


def test_list_table_sort_and_filter(root: Path, three: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    other = put(root, make_key("micro", env=current_env(arch="sm_121a")))
    rc, out = run(capsys, "list")
    assert rc == 0
    body = out.splitlines()
    assert body[0].split() == ["digest", "site", "key", "size", "used", "compile"]
    assert max(map(len, body)) <= 100, "readable in 100 columns"
    for kind, d in three.items():
        row = next(ln for ln in body if ln.strip().startswith(d.name[:12]))
        assert f"moe_dispatch.{kind} " in row and f" {kind} " in row and "('" not in row and "2.0 s" in row
        assert "just now" in row
    assert sum(1 for ln in body if ln.startswith(three["micro"].parent.parent.name)) == 1, "one line per namespace"
    assert "4 entries" in out

    rc, data = run_json(capsys, "list", "--sort", "size")
    sizes = [e["bytes"] for e in data["entries"]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == _dir_bytes(three["dynamic"])
    first = data["entries"][0]
    assert first["digest"] == three["dynamic"].name and first["kind"] == "dynamic" and first["status"] == "ok"
    assert first["key"].startswith("('dynamic'") and first["compile_seconds"] == 2.0 and first["arch"] == "sm_120a"

    os.utime(three["static"], (time.time() + 100, time.time() + 100))
    assert run_json(capsys, "list", "--sort", "used")[1]["entries"][0]["digest"] == three["static"].name

    ns_other = other.parent.parent.name
    rc, data = run_json(capsys, "list", "--namespace", ns_other)
    assert [e["digest"] for e in data["entries"]] == [other.name]
    rc, out = run(capsys, "list", "--namespace", ns_other[:30])  # a prefix is enough: matches both
    assert "4 entries" in out


def test_list_marks_an_unreadable_manifest(root: Path, three: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    flip_byte(three["static"] / entry.MANIFEST)
    data = run_json(capsys, "list")[1]
    bad = next(e for e in data["entries"] if e["digest"] == three["static"].name)
    assert bad["status"].startswith("manifest")
    assert "[manifest" in run(capsys, "list")[1]


def test_show_manifest_by_prefix(root: Path, three: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    d = three["static"]
    key = make_key("static", env=current_env())
    rc, out = run(capsys, "show", d.name[:10])
    assert rc == 0
    assert f"digest           {d.name}" in out
    assert "status     ok" in out
    assert f"<{len(key.key_bytes)} bytes> {key.key_bytes.hex()[:20]}" in out
    assert "site             flashinfer.moe_dispatch.static" in out and "cubin[0]" in out

    rc, data = run_json(capsys, "show", d.name[:10])
    m = data["manifest"]
    assert m["digest"] == d.name and m["key_bytes"] == {"len": len(key.key_bytes), "hex": key.key_bytes.hex()}
    assert data["status"].startswith("ok") and data["bytes"] == _dir_bytes(d)

    flip_byte(payload_path(d, entry.read_manifest(d), "object"))
    assert "status     BAD checksum" in run(capsys, "show", d.name)[1]


def test_show_mlir_and_cubin_payloads(root: Path, three: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = three["micro"]
    m = entry.read_manifest(d)
    rc, out = run(capsys, "show", d.name[:12], "--mlir")
    assert rc == 0 and out == "module {\n  gpu.module @k {}\n}\n"
    assert run_json(capsys, "show", d.name[:12], "--mlir")[1]["mlir"] == out

    target = tmp_path / "k.cubin"
    rc, out = run(capsys, "show", d.name[:12], "--cubin", str(target))
    assert rc == 0 and f"cuobjdump -sass {target}" in out
    assert target.read_bytes() == payload_path(d, m, "cubin").read_bytes()
    rc, data = run_json(capsys, "show", d.name[:12], "--cubin", str(target), "--index", "1")
    assert rc == 2 and "out of range" in data["error"]

    flip_byte(payload_path(d, m, "mlir"))
    rc, data = run_json(capsys, "show", d.name[:12], "--mlir")
    assert rc == 2 and "sha256" in data["error"]


def test_show_refuses_unknown_and_ambiguous_prefixes(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = current_env()
    digests = []
    for i in range(17):  # 17 digests: two share a first hex digit
        digests.append(put(root, make_key("micro", env=env, site_key=("micro", i))).name)
    firsts = [d[0] for d in digests]
    shared = next(c for c in firsts if firsts.count(c) > 1)
    rc, data = run_json(capsys, "show", shared)
    assert rc == 2 and "ambiguous" in data["error"]
    rc, data = run_json(capsys, "show", "0" * 64)
    assert rc == 2 and "no entry" in data["error"]
    rc = cli.main(["show", "../etc"])
    assert rc == 2 and "not a digest" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------


def test_verify_reports_and_quarantines_bad_entries(root: Path, three: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "verify")[0] == 0
    bad = three["dynamic"]
    flip_byte(payload_path(bad, entry.read_manifest(bad), "cubin"))
    leftover = root / "v1" / bad.parent.parent.name / "ab" / ("ab" + "0" * 62)
    leftover.mkdir(parents=True)  # payloads of a writer that died before its manifest
    (leftover / "object-00.o").write_bytes(b"x")

    rc, out = run(capsys, "verify")
    assert rc == 1
    assert "4 entries" in out and "2 ok, 1 bad, 1 incomplete" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("BAD"))
    assert bad.name[:12] in row and "checksum" in row
    rc, data = run_json(capsys, "verify")
    assert rc == 1 and data["counts"] == {"ok": 2, "bad": 1, "incomplete": 1}
    assert {e["digest"]: e["status"] for e in data["entries"]}[bad.name] == "bad"

    rc, out = run(capsys, "verify", "--quarantine")
    assert rc == 1 and "[quarantined]" in out
    assert not bad.exists() and leftover.exists(), "bad entries move aside; an incomplete one may be a live writer"
    assert [p for p in (root / "quarantine").iterdir() if bad.name in p.name]
    assert run_json(capsys, "stats")[1]["total"]["quarantined"] == 1, "verify's quarantines count in the statistics"
    assert run(capsys, "verify")[0] == 0


def test_verify_catches_a_misplaced_entry(root: Path, three: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """An entry copied under another namespace verifies its checksums but is not where it belongs."""
    src = three["micro"]
    other_ns = root / "v1" / current_env(arch="sm_121a").namespace / src.parent.name
    other_ns.mkdir(parents=True)
    shutil.copytree(src, other_ns / src.name)
    rc, data = run_json(capsys, "verify")
    assert rc == 1
    reasons = [e["reason"] for e in data["entries"] if e["status"] == "bad"]
    assert len(reasons) == 1 and reasons[0].startswith("foreign")


def test_verify_device_loads_objects(root: Path, three: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Synthetic objects have the right checksums but are no loadable objects: --device says so."""
    assert run(capsys, "verify")[0] == 0
    rc, data = run_json(capsys, "verify", "--device")
    assert rc == 1
    assert data["counts"]["failed"] == 3 and data["counts"]["bad"] == 3
    assert all(e["reason"].startswith("load:") and "\n" not in e["reason"] for e in data["entries"])


def test_arch_matching() -> None:
    from cute_diskcache.keys.arch import arch_runs_on

    assert arch_runs_on("sm_120a", (12, 0)) and not arch_runs_on("sm_120a", (12, 1))
    assert arch_runs_on("sm_120f", (12, 1)) and not arch_runs_on("sm_121f", (12, 0))
    assert arch_runs_on("sm_90a", (9, 0)) and not arch_runs_on("sm_90a", (12, 0))
    assert not arch_runs_on("bogus", (9, 0))


# --------------------------------------------------------------------------------------------
# prune / evict / clear
# --------------------------------------------------------------------------------------------


def test_prune_removes_stale_namespaces(root: Path, three: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    keep = three["micro"].parent.parent.name
    stale = {
        "flashinfer": current_env(package="flashinfer-python==0.6.12"),
        "dsl": current_env(dsl=(("nvidia-cutlass-dsl", "4.6.3"),)),
        "machine": current_env(machine="aarch64" if platform.machine() != "aarch64" else "x86_64"),
        "format": None,
    }
    dirs = {why: put(root, make_key("micro", env=env)) for why, env in stale.items() if env is not None}
    fmt = put(root, make_key("static", env=current_env(sources="6" * 64)))
    m = entry.read_manifest(fmt)
    m["format"] = 0
    rewrite_manifest(fmt, m)
    dirs["format"] = fmt
    arch_dir = put(root, make_key("micro", env=current_env(arch="sm_121a")))
    for d in [*dirs.values(), arch_dir]:  # last used two days ago: nobody serves them any more
        os.utime(d, (time.time() - 2 * 86400,) * 2)

    rc, data = run_json(capsys, "prune", "--dry-run")
    assert rc == 0 and data["dry_run"]
    gone = {n["namespace"]: n["reason"] for n in data["namespaces"]}
    assert set(gone) == {d.parent.parent.name for d in dirs.values()}
    assert "0.6.12" in gone[dirs["flashinfer"].parent.parent.name] and FLASHINFER in gone[dirs["flashinfer"].parent.parent.name]
    assert "DSL stack" in gone[dirs["dsl"].parent.parent.name]
    assert "machine" in gone[dirs["machine"].parent.parent.name]
    assert "format 0" in gone[dirs["format"].parent.parent.name]
    assert all(d.exists() for d in dirs.values()), "--dry-run removes nothing"

    rc, out = run(capsys, "prune")
    assert rc == 0 and "removed 4 entries" in out and "flashinfer-python 0.6.12 (installed" in out
    assert not any(d.exists() for d in dirs.values())
    assert (root / "v1" / keep).is_dir() and arch_dir.exists(), "current namespaces and other arches stay without --arch"

    rc, data = run_json(capsys, "prune", "--arch", "sm_120a")
    assert [n["namespace"] for n in data["namespaces"]] == [arch_dir.parent.parent.name]
    assert not arch_dir.exists() and all(d.exists() for d in three.values())


def test_prune_older_than(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = current_env()
    now = time.time()
    old = put(root, make_key("micro", env=env), used=now - 40 * 86400)
    recent = put(root, make_key("static", env=env), used=now - 2 * 86400)
    rc, data = run_json(capsys, "prune", "--older-than", "30d", "--dry-run")
    assert [e["digest"] for e in data["old_entries"]] == [old.name] and old.exists()
    rc, out = run(capsys, "prune", "--older-than", "30d")
    assert rc == 0 and "1 entries unused for longer than 30d" in out
    assert not old.exists() and recent.exists()
    assert run_json(capsys, "prune", "--older-than", "36h")[1]["old_entries"][0]["digest"] == recent.name
    with pytest.raises(SystemExit):
        cli.main(["prune", "--older-than", "soon"])


def test_parse_duration() -> None:
    assert cli.parse_duration("30d") == 30 * 86400 and cli.parse_duration("12h") == 12 * 3600
    assert cli.parse_duration("90m") == 5400 and cli.parse_duration("2") == 2 * 86400 and cli.parse_duration("1w") == 7 * 86400


def test_evict_to_a_size(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = current_env()
    now = time.time()
    dirs = [put(root, make_key("micro", env=env, site_key=("micro", i)), bytes([i + 1]) * 4000, used=now - 1000 + i) for i in range(5)]
    one = max(_dir_bytes(d) for d in dirs)
    # The cap counts everything under the root, the statistics files of the processes that
    # used it included (this one's evict makes one): room for three entries and that.
    cap = one * 3 + 8000
    rc, data = run_json(capsys, "evict", "--max-size", str(cap), "--dry-run")
    assert rc == 0 and len(data["evicted"]) == 2 and all(d.exists() for d in dirs)
    rc, out = run(capsys, "evict", "--max-size", str(cap))
    assert rc == 0 and out.startswith("evicted 2 least recently used entries")
    assert [d.exists() for d in dirs] == [False, False, True, True, True]
    use = eviction.usage(root)
    assert use["entry_bytes"] <= one * 3 and use["bytes"] <= cap
    assert use["bytes"] == use["entry_bytes"] + sum(v["bytes"] for v in use["overhead"].values())
    assert run_json(capsys, "stats")[1]["total"]["evictions"] == 2, "evictions show as cleanups"
    rc, data = run_json(capsys, "evict", "--max-size", "0")
    assert len(data["evicted"]) == 3 and data["entries_after"] == 0
    with pytest.raises(SystemExit):
        cli.main(["evict", "--max-size", "lots"])


def test_clear_removes_entries_quarantine_locks_and_stats(root: Path, three: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("quarantine", "locks", "stats", "trash", "tmp", "reuse"):  # reuse: second-stage records (issue 31)
        (root / name).mkdir()
        (root / name / "f").write_bytes(b"x")
    rc, data = run_json(capsys, "clear")
    assert rc == 0 and data["entries_removed"] == 3
    assert sorted(data["dirs_removed"]) == sorted(cli.ROOT_DIRS)
    assert sorted(os.listdir(root)) == []
    assert "(0 entries" in run(capsys, "clear")[1]


def test_readonly_mode_refuses_changes(root: Path, three: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_READONLY", "1")
    for argv in (["clear"], ["zero"], ["evict", "--max-size", "0"], ["prune", "--arch", "sm_1"], ["verify", "--quarantine"]):
        rc, data = run_json(capsys, *argv)
        assert rc == 2 and "CUTE_DISKCACHE_READONLY" in data["error"], argv
    assert all(d.exists() for d in three.values())
    assert run(capsys, "list")[0] == 0 and run(capsys, "verify")[0] == 0, "reading is fine"


def test_root_option_overrides_the_environment(root: Path, three: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "elsewhere"
    data = run_json(capsys, "--root", str(empty), "stats")[1]
    assert data["root"] == str(empty) and data["root_source"] == "--root" and data["total"]["entries"] == 0


def test_info_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, data = run_json(capsys, "info")
    assert rc == 0 and data["root"] == str(root) and data["root_source"] == "CUTE_DISKCACHE_DIR"


# --------------------------------------------------------------------------------------------
# Entry points, and the real kernel
# --------------------------------------------------------------------------------------------


def test_console_script_and_module_run(root: Path, three: dict[str, Path]) -> None:
    env = {**os.environ, "CUTE_DISKCACHE_DIR": str(root)}
    proc = subprocess.run([sys.executable, "-m", "cute_diskcache", "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0
    for cmd in ("stats", "zero", "list", "show", "verify", "prune", "evict", "clear", "export", "import"):
        assert cmd in proc.stdout
    script = Path(sys.executable).with_name("cute-diskcache")
    if not script.exists():
        script = Path(shutil.which("cute-diskcache") or "cute-diskcache")
    if not script.exists():
        pytest.skip("the console script is not installed in this environment")
    proc = subprocess.run([str(script), "list", "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(e["digest"] for e in json.loads(proc.stdout)["entries"]) == sorted(d.name for d in three.values())


def _real_entry(root: Path) -> Path:
    dirs = sorted(root.glob("v1/*/*/*/manifest.msgpack"))
    assert len(dirs) == 1, dirs
    return dirs[0].parent


def test_show_cubin_of_a_real_kernel(micro_copy: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_DIR", str(micro_copy.root))
    d = _real_entry(micro_copy.root)
    out_file = tmp_path / "micro.cubin"
    rc, data = run_json(capsys, "show", d.name[:8], "--cubin", str(out_file))
    assert rc == 0 and data["arch"] == "sm_120a" and data["bytes"] == out_file.stat().st_size
    cubin = out_file.read_bytes()
    assert cubin.startswith(b"\x7fELF") and int.from_bytes(cubin[18:20], "little") == 190, "an EM_CUDA image"
    assert cubin in payload_path(d, entry.read_manifest(d), "object").read_bytes(), "the cubin embedded in the object"
    rc, out = run(capsys, "show", d.name[:8], "--mlir")
    assert rc == 0 and out.startswith("module") and "gpu.container_module" in out
    assert payload_path(d, entry.read_manifest(d), "mlir").name.endswith(".mlirbc.zz"), "stored as MLIR bytecode"
    assert out.rstrip("\n") == mlir_of(d, entry.read_manifest(d)).rstrip("\n")


def test_verify_device_loads_a_real_kernel(micro_copy: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DISKCACHE_DIR", str(micro_copy.root))
    d = _real_entry(micro_copy.root)
    rc, data = run_json(capsys, "verify", "--device")
    assert rc == 0, data
    assert data["counts"]["loaded"] == 1 and data["counts"]["failed"] == 0
    if data["device"] is None:
        assert data["entries"][0]["load_detail"] == "object loaded on the host (no GPU)"
        assert "no GPU here" in run(capsys, "verify", "--device")[1]

    # Same checksums, wrong object: only the load check can tell.
    m = entry.read_manifest(d)
    junk = make_artifact().object_bytes
    obj = payload_path(d, m, "object")
    obj.write_bytes(junk)
    import hashlib

    m["payloads"]["object"][0].update(size=len(junk), sha256=hashlib.sha256(junk).hexdigest())
    rewrite_manifest(d, m)
    assert run(capsys, "verify")[0] == 0
    rc, data = run_json(capsys, "verify", "--device")
    assert rc == 1 and data["counts"]["failed"] == 1 and data["entries"][0]["reason"].startswith("load:")


def test_verify_checks_signatures_when_a_key_is_set(root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    key = make_key("micro", env=current_env())
    entry.write(root / "v1" / key.env.namespace / key.digest[:2] / key.digest, key, make_artifact(), hmac_key=b"k1")
    assert run(capsys, "verify")[0] == 0, "without a key the signature is not looked at"
    monkeypatch.setenv("CUTE_DISKCACHE_HMAC_KEY", "k1")
    assert run(capsys, "verify")[0] == 0
    monkeypatch.setenv("CUTE_DISKCACHE_HMAC_KEY", "k2")
    rc, data = run_json(capsys, "verify")
    assert rc == 1 and data["entries"][0]["reason"].startswith("signature")


def test_prune_matches_import_names_and_keeps_what_was_used_recently(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 15, item 10: cached_compile records the import name (flashinfer, not flashinfer-python;
    __main__), which prune looked up as a distribution: "not installed", deleted. And on a root
    shared by two venvs, prune from one deleted the other's namespaces."""
    old = time.time() - 3 * 86400
    by_import = put(root, make_key("micro", env=current_env(kind="generic", package=f"flashinfer=={FLASHINFER}")), used=old)
    by_main = put(root, make_key("micro", env=current_env(kind="generic", package="__main__==0")), used=old)
    gone_pkg = put(root, make_key("micro", env=current_env(kind="generic", package="no_such_package_cdc==1.0")), used=old)
    other_venv = put(root, make_key("static", env=current_env(dsl=(("nvidia-cutlass-dsl", "4.6.3"),))))  # used just now

    rc, data = run_json(capsys, "prune")
    assert rc == 0
    assert [n["namespace"] for n in data["namespaces"]] == [gone_pkg.parent.parent.name]
    assert by_import.exists() and by_main.exists() and not gone_pkg.exists()
    assert other_venv.exists() and [k["namespace"] for k in data["kept_recent"]] == [other_venv.parent.parent.name]
    rc, data = run_json(capsys, "prune", "--recent", "0")
    assert [n["namespace"] for n in data["namespaces"]] == [other_venv.parent.parent.name] and not other_venv.exists()


def test_stats_says_what_the_rest_of_the_root_holds(root: Path, three: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 15, item 7: quarantine, staging, trash, statistics and lock files count toward the cap and show."""
    (root / "quarantine" / "20260101T000000-checksum-ab-000000").mkdir(parents=True)
    (root / "quarantine" / "20260101T000000-checksum-ab-000000" / "object.o").write_bytes(b"q" * 4000)
    (root / "tmp" / "import-x").mkdir(parents=True)
    (root / "tmp" / "import-x" / "f").write_bytes(b"t" * 1000)
    (root / "locks" / "ab").mkdir(parents=True)
    (root / "locks" / "ab" / ("ab" * 32 + ".lock")).touch()
    rc, data = run_json(capsys, "stats")
    o = data["overhead"]
    assert (o["quarantine"]["items"], o["quarantine"]["bytes"], o["tmp"]["items"], o["locks"]["items"]) == (1, 4000, 1, 1)
    t = data["total"]
    assert t["cache_bytes"] == t["bytes"] + sum(v["bytes"] for v in o.values())
    rc, out = run(capsys, "stats")
    line = next(ln for ln in out.splitlines() if ln.startswith("of which"))
    assert "quarantine 1 (4.0 KB)" in line and "staging 1" in line and "lock files 1" in line
