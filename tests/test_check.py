"""``cute-diskcache check``: the deploy gate, with real flashinfer 0.6.15.post1 and the real DSL on the CPU.

It fails on an empty cache naming every kernel the model needs, passes after a real prewarm with
the command prewarm itself prints, names entries this host's CPU cannot run, reports damage
without repairing it, and never writes to the cache it judges.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import flip_byte, payload_path, rewrite_manifest  # noqa: E402

from cute_diskcache.keys import hostcpu  # noqa: E402
from cute_diskcache.storage import entry  # noqa: E402

TARGET = "rtx-pro-6000"
#: The smallest real plan: one micro kernel (m=1) of the bundled qwen3-30b-a3b.
PLAN = ("--model", "qwen3-30b-a3b", "--max-num-tokens", "1", "--target", TARGET, "--no-dense")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CUTE_DISKCACHE_") and k not in ("FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH")}
    return env


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cute_diskcache", *args], env=_env(), capture_output=True, text=True,
                          timeout=600, cwd=cwd)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime: what "nothing was modified" compares."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")} if root.exists() else {}


@pytest.fixture(scope="module")
def prewarmed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One real prewarm of :data:`PLAN` (a compile: seconds); (root, what prewarm printed)."""
    root = tmp_path_factory.mktemp("check-prewarmed") / "root"
    env = {**_env(), "CUTE_DISKCACHE_DIR": str(root)}
    proc = subprocess.run([sys.executable, "-m", "cute_diskcache.prewarm", "--model", "qwen3-30b-a3b", "--max-num-tokens", "1",
                           "--target", TARGET, "--no-dense", "--jobs", "1"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=root.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, proc.stdout


@pytest.fixture
def prewarmed_copy(prewarmed: tuple[Path, str], tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(prewarmed[0], root)
    return root


def only_manifest(root: Path) -> Path:
    (manifest,) = root.glob("v1/*/*/*/manifest.msgpack")
    return manifest.parent


def test_empty_cache_fails_with_a_table_of_the_missing_kernels(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = cli("--root", str(root), "check", "--model", "qwen3-30b-a3b", "--max-num-tokens", "1", "--target", TARGET, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["kernel", "digest", "batch", "status", "why"], proc.stdout
    rows = [ln for ln in lines[1:] if ln.startswith(("moe/", "dense/"))]
    # m=1 of qwen3-30b-a3b: one micro MoE kernel and the dense layers' b12x kernels (its tactics)
    assert sum(r.startswith("moe/micro ") for r in rows) == 1, proc.stdout
    assert sum(r.startswith("dense/b12x_fp4 ") for r in rows) >= 1, proc.stdout
    assert all(" missing " in r for r in rows), proc.stdout
    assert "qkv_proj" in proc.stdout and f"FAILED: {len(rows)} of {len(rows)} kernels" in proc.stdout
    fix = next(ln for ln in lines if ln.startswith("fix: "))
    assert fix.startswith(f"fix: CUTE_DISKCACHE_DIR={root} cute-diskcache-prewarm ") and "qwen3-30b-a3b" in fix, fix
    assert not root.exists(), "check writes nothing, not even the root or a statistics file"


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    no_model = cli("--root", str(tmp_path / "r"), "check", cwd=tmp_path)
    assert no_model.returncode == 2 and "model" in no_model.stderr.lower()
    bad_target = cli("--root", str(tmp_path / "r"), "check", "--model", "qwen3-30b-a3b", "--target", "no-such-card", cwd=tmp_path)
    assert bad_target.returncode == 2 and "no-such-card" in bad_target.stderr
    bad_flag = cli("--root", str(tmp_path / "r"), "check", "--model", "qwen3-30b-a3b", "--m", "4-2", cwd=tmp_path)
    assert bad_flag.returncode == 2


@pytest.mark.slow
def test_prewarm_says_where_it_wrote_and_its_gate_command_passes(prewarmed: tuple[Path, str], tmp_path: Path) -> None:
    root, out = prewarmed
    assert f"wrote to {root}: 1 entry (" in out, out
    assert "flashinfer-moe-0.6.15.post1-sm_120a" in out
    assert f"serve with FLASHINFER_B12X_DISK_CACHE=1 CUTE_DISKCACHE_DIR={root}" in out
    # the host code is the baseline's whatever this CPU is: no "prewarm on a CPU like the serving hosts'" note
    assert "host code: x86-64-v2 (any x86_64 serving host" in out, out
    assert "note: CUTE_DISKCACHE_HOST_CPU" not in out
    gate = next(ln for ln in out.splitlines() if "gate a deploy with: " in ln)
    argv = shlex.split(gate.split("gate a deploy with: ", 1)[1].split("  (", 1)[0])
    assert argv[:4] == ["cute-diskcache", "--root", str(root), "check"], argv
    before = tree(root)
    proc = cli(*argv[1:], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.startswith("ok: 1 kernel bundled:qwen3-30b-a3b needs (1 micro) is cached and usable on target rtx-pro-6000")
    assert tree(root) == before, "check modified the cache"


@pytest.mark.slow
def test_entry_built_on_a_cpu_with_more_extensions_is_named(prewarmed_copy: Path, tmp_path: Path) -> None:
    """A serving host whose CPU lacks an extension the build CPU had: the entry record says
    which, and check names it (the manifest is re-sealed: an unsigned seal is anyone's to compute)."""
    here = set(hostcpu.isa_extensions())
    lacking = next(f for f in ("avx512_fp16", "apx_f", "avx10_2", "avx512f") if f not in here)
    d = only_manifest(prewarmed_copy)
    manifest = entry.read_manifest(d)
    manifest["host_isa"] = sorted(set(manifest["host_isa"]) | {lacking})
    rewrite_manifest(d, manifest)
    proc = cli("--root", str(prewarmed_copy), "check", *PLAN, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert f"unusable  host CPU lacks {lacking} (the entry was built on a CPU with them)" in proc.stdout, proc.stdout
    assert f"this host's CPU lacks {lacking}:" in proc.stdout
    as_json = json.loads(cli("--root", str(prewarmed_copy), "check", "--json", *PLAN, cwd=tmp_path).stdout)
    assert as_json["ok"] is False and as_json["host_cpu_lacks"] == [lacking]
    (row,) = as_json["kernels"]
    assert (row["status"], row["kernel"], row["cpu_lacks"]) == ("unusable", "micro", [lacking])


@pytest.mark.parametrize("extra", [{"calling_convention": None}, {"kwargs_wrapper": False, "calling_convention": None},
                                   {"kwargs_wrapper": False, "calling_convention": None, "result": None}])
def test_gate_and_engine_judge_side_data_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: dict[str, object]) -> None:
    """The same entry, the site's own check (flashinfer's micro site's, as the hook applies it):
    the gate says ok exactly when a serving process with CUTE_DISKCACHE_ON_MISS=error hits."""
    from _helpers import make_artifact, make_key

    from cute_diskcache.cli import coverage
    from cute_diskcache.core.cache import CompileCache
    from cute_diskcache.errors import CacheMissError
    from cute_diskcache.core import hook
    from cute_diskcache.flashinfer_sites import sites
    from cute_diskcache.storage.store import Store

    extra_ok = hook.site(next(r for r in sites.ROWS if r.kind == "micro")).extra_ok
    root, key = tmp_path / "root", make_key("micro")
    assert Store(root).commit(key, make_artifact(extra=extra)) is not None
    gate = coverage.inspect(Store(root, readonly=True), key, extra_ok=extra_ok)
    monkeypatch.setenv("CUTE_DISKCACHE_ON_MISS", "error")
    monkeypatch.setattr(CompileCache, "_load", lambda self, key, found: "loaded")
    try:
        CompileCache(Store(root, readonly=True)).get_or_compile(key, lambda: "compiled", extra_ok=extra_ok)
        engine = coverage.OK
    except CacheMissError:
        engine = coverage.UNUSABLE
    assert gate.status == engine == (coverage.OK if "result" in extra else coverage.UNUSABLE), (gate, engine)


def test_side_data_the_engine_refuses_is_unusable_to_the_gate_too(prewarmed_copy: Path, tmp_path: Path) -> None:
    """Issue 29, finding 8: an entry whose side data is of another shape (an earlier writer's: no
    ``kwargs_wrapper``) is a miss in a serving process (the site's check, at every hit); the gate
    must say so, not "ok". One judgement for both: the site's check travels with the plan."""
    d = only_manifest(prewarmed_copy)
    manifest = entry.read_manifest(d)
    manifest["extra"] = {k: v for k, v in manifest["extra"].items() if k != "kwargs_wrapper"}
    rewrite_manifest(d, manifest)
    proc = cli("--root", str(prewarmed_copy), "check", "--json", *PLAN, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout)["kernels"]
    assert row["status"] == "unusable" and row["why"].startswith("extra: its side data is not of the shape"), row


@pytest.mark.slow
def test_damaged_entry_is_reported_and_left_in_place(prewarmed_copy: Path, tmp_path: Path) -> None:
    """A serving process would quarantine it; the gate only says so (a gate that repaired what
    it judged would pass on its second run)."""
    d = only_manifest(prewarmed_copy)
    flip_byte(payload_path(d, entry.read_manifest(d), "object"))
    before = tree(prewarmed_copy)
    for _ in range(2):
        proc = cli("--root", str(prewarmed_copy), "check", "--json", *PLAN, cwd=tmp_path)
        assert proc.returncode == 1, proc.stderr[-2000:]
        (row,) = json.loads(proc.stdout)["kernels"]
        assert row["status"] == "unusable" and row["why"].startswith("checksum: ") and "damaged" in row["why"], row
    assert tree(prewarmed_copy) == before and not (prewarmed_copy / "quarantine").exists()


def test_a_library_branch_refused_or_left_to_its_own_cache_is_the_clis_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """check's b12x, b12x MoE and SGLang branches: prewarm's refusal, word for word, or the library
    keeping its kernels itself (``CUTE_DISKCACHE_NATIVE_SITES``), which check cannot judge."""
    import argparse

    from cute_diskcache.cli import check
    from cute_diskcache.cli.common import CliError
    from cute_diskcache.prewarm import spawned

    def refused(args: argparse.Namespace) -> None:
        raise spawned.Refused("--moe-backend b12x compiles for a named card: pass --target")

    with pytest.raises(CliError, match="^--moe-backend b12x compiles for a named card"):
        check._resolved(refused, argparse.Namespace(), "b12x", "b12x's own disk cache")
    monkeypatch.delenv("CUTE_DISKCACHE_NATIVE_SITES", raising=False)
    assert check._resolved(lambda args: ("plan",), argparse.Namespace(), "b12x", "b12x's own disk cache") == ("plan",)
    monkeypatch.setenv("CUTE_DISKCACHE_NATIVE_SITES", "b12x")
    with pytest.raises(CliError, match="names b12x: its kernels are kept by b12x's own disk cache, which check does not judge"):
        check._resolved(lambda args: ("plan",), argparse.Namespace(), "b12x", "b12x's own disk cache")
    assert check._resolved(lambda args: ("plan",), argparse.Namespace(), "sglang", "SGLang's own cute_aot cache") == ("plan",)
