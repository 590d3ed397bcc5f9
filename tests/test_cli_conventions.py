"""The CLI follows the conventions an operator already knows (issue 23): ``--version``; global
options before or after the subcommand; ``prewarm`` as a subcommand with vLLM's flag names;
``doctor --all``; one name for the cache root; words, not Python values; ``list`` in 100
columns; progress bars only on a terminal; JSON with a schema version and refusals on stderr.

Most tests use synthetic entries (no compile); the prewarm ones plan a bundled model with
flashinfer's dispatch (``--dry-run``: nothing compiles) in a child process, as an operator runs it.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import make_artifact, make_key  # noqa: E402

from cute_diskcache import cli, prewarm  # noqa: E402
from cute_diskcache.prewarm import progress  # noqa: E402
from cute_diskcache.storage import entry, stats  # noqa: E402

TARGET = "rtx-pro-6000"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("CUTE_DISKCACHE_") or name in ("CUTE_DSL_ARCH", "FLASHINFER_B12X_DISK_CACHE"):
            monkeypatch.delenv(name)
    stats.reset_for_tests()
    stats.bind(None)


def put(root: Path, kind: str, *, used: float | None = None) -> Path:
    key = make_key(kind)
    d = root / "v1" / key.env.namespace / key.digest[:2] / key.digest
    entry.write(d, key, make_artifact((b"\x11" * 64,), extra={"site": key.site}))
    if used is not None:
        os.utime(d, (used, used))
    return d


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def child(*argv: str, root: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python -m cute_diskcache ARGV`` with stderr a pipe (as in a build log), no settings of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k not in ("FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH")}
    return subprocess.run([sys.executable, "-m", "cute_diskcache", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=root.parent)


# --------------------------------------------------------------------------------------------
# --version, global options, one name for the root
# --------------------------------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    from cute_diskcache._version import __version__

    assert out.splitlines()[0] == f"cute-diskcache {__version__}"
    assert f"flashinfer-python {importlib.metadata.version('flashinfer-python')}" in out
    assert f"nvidia-cutlass-dsl {importlib.metadata.version('nvidia-cutlass-dsl')}" in out


def test_version_does_not_import_flashinfer(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", "import sys; from cute_diskcache import cli\n"
                           "try:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
                           "print('flashinfer' in sys.modules)"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "False"


@pytest.mark.parametrize("argv", [
    ["stats", "--json", "--root", "{root}"],
    ["--json", "stats", "--root", "{root}"],
    ["--root", "{root}", "stats", "--json"],
    ["--root", "{root}", "--json", "-v", "stats"],
    ["stats", "--root", "{root}", "-v", "--json"],
])
def test_global_options_before_or_after_the_subcommand(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cache"
    put(root, "micro")
    rc, out, _ = run(capsys, *(a.format(root=root) for a in argv))
    data = json.loads(out)
    assert rc == 0 and data["root"] == str(root) and data["root_source"] == "--root" and data["total"]["entries"] == 1


def test_a_global_option_before_is_not_reset_by_the_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cache"
    args = cli.build_parser().parse_args(["--root", str(root), "--json", "-v", "list"])
    assert args.root == str(root) and args.json is True and args.verbose == 1
    args = cli.build_parser().parse_args(["list"])
    assert args.root is None and args.json is False and args.verbose == 0


def test_demo_takes_root_and_keeps_dir(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    text = capsys.readouterr().out
    assert "--root" in text and "--dir" not in text, "one name for the root; --dir is a hidden alias"
    ap = cli.build_parser()
    assert ap.parse_args(["demo", "--root", "/x"]).root == "/x"
    assert ap.parse_args(["demo", "--dir", "/y"]).root == "/y", "--dir: the old name still works"
    assert ap.parse_args(["--root", "/z", "demo"]).root == "/z"


# --------------------------------------------------------------------------------------------
# Words, list, JSON
# --------------------------------------------------------------------------------------------


def test_info_in_words(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--root", str(tmp_path), "info")
    lines = {ln.split(None, 1)[0]: ln for ln in out.splitlines()}
    assert rc == 0
    assert lines["enabled"].split()[-1] == "no" and lines["target"].split()[-1] == "none"
    for python_value in ("True", "False", "None", "{}"):
        assert python_value not in out.split(), out


def test_list_fits_100_columns_with_sites_and_ages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cache"
    micro = put(root, "micro", used=time.time() - 3 * 3600 - 60)
    put(root, "static", used=time.time() - 2 * 86400 - 60)
    rc, out, _ = run(capsys, "--root", str(root), "list")
    assert rc == 0
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 100, "\n".join(ln for ln in lines if len(ln) > 100)
    row = next(ln for ln in lines if micro.name[:12] in ln)
    assert "moe_dispatch.micro" in row and "3 h ago" in row
    assert "('" not in out and "torch." not in out, "keys as words, not Python tuples"
    assert any("2 d ago" in ln for ln in lines)


def test_json_has_a_schema_and_errors_go_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cache"
    put(root, "micro")
    for argv in (["stats"], ["list"], ["info"], ["verify"], ["prune", "--dry-run"], ["evict", "--dry-run", "--max-size", "1G"]):
        rc, out, _ = run(capsys, "--root", str(root), *argv, "--json")
        assert rc == 0 and json.loads(out)["schema"] == 1, argv
    rc, out, err = run(capsys, "--root", str(root), "show", "0" * 64, "--json")
    assert rc == 2 and out == "", "stdout holds results only"
    refusal = json.loads(err)
    assert refusal["schema"] == 1 and "no entry" in refusal["error"]


def test_doctor_all_from_the_main_cli(capsys: pytest.CaptureFixture[str]) -> None:
    rc, short, _ = run(capsys, "doctor")
    assert rc == 0 and "--all lists every site" in short
    rc, full, _ = run(capsys, "doctor", "--all")
    assert rc == 0 and "--all lists every site" not in full and len(full.splitlines()) > len(short.splitlines())
    rc, out, _ = run(capsys, "--json", "doctor")
    assert rc == 0 and json.loads(out)["schema"] == 1


# --------------------------------------------------------------------------------------------
# Progress: a bar on a terminal, lines elsewhere
# --------------------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_plain_lines_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    log = io.StringIO()
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    with progress.bar(89, "compiling", "kernels", file=log) as bar:
        assert isinstance(bar, progress.Lines)
        for _ in range(12):
            clock[0] += 0.5
            bar.update(1)  # 6 s: one line at 5 s
        bar.set_postfix(kernels=7)
    text = log.getvalue()
    assert "\r" not in text
    assert text.splitlines() == ["compiling: 10/89 kernels (5 s)", "compiling: 12/89 kernels, kernels 7 (6 s)"]


def test_progress_is_a_bar_on_a_terminal() -> None:
    pytest.importorskip("tqdm")
    term = _Terminal()
    with progress.bar(3, "compiling", "kernels", file=term) as bar:
        assert not isinstance(bar, progress.Lines)
        bar.update(3)
    assert "\r" in term.getvalue()


# --------------------------------------------------------------------------------------------
# prewarm as a subcommand, with vLLM's flag names
# --------------------------------------------------------------------------------------------


def test_prewarm_takes_vllm_flag_names_and_the_old_ones() -> None:
    ap = prewarm.build_parser()
    new = ap.parse_args(["qwen3-30b-a3b", "--max-num-batched-tokens", "64", "-tp", "2"])
    old = ap.parse_args(["--model", "qwen3-30b-a3b", "--max-num-tokens", "64", "--tp", "2"])
    long = ap.parse_args(["qwen3-30b-a3b", "--max-num-batched-tokens", "64", "--tensor-parallel-size", "2"])
    for args in (new, old, long):
        assert (args.model, args.max_num_tokens, args.tp) == ("qwen3-30b-a3b", 64, 2)
    # vLLM's MoE sharding: tp x dp ranks slice every expert, or hold whole experts with EP.
    assert prewarm.moe_parallelism(ap.parse_args(["m", "-tp", "2", "-dp", "2"])) == (4, 1)
    assert prewarm.moe_parallelism(ap.parse_args(["m", "-tp", "2", "-dp", "2", "--enable-expert-parallel"])) == (1, 4)
    assert prewarm.moe_parallelism(ap.parse_args(["m", "--ep", "2"])) == (1, 2), "the old explicit --ep"
    cli_args = cli.build_parser().parse_args(["prewarm", "qwen3-30b-a3b", "--target", TARGET, "--max-num-batched-tokens", "8",
                                             "-tp", "1", "--dry-run", "--root", "/r"])
    assert (cli_args.model, cli_args.max_num_tokens, cli_args.tp, cli_args.root, cli_args.dry_run) == ("qwen3-30b-a3b", 8, 1, "/r", True)


def _kernels(proc: subprocess.CompletedProcess[str]) -> list[tuple[str, str]]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["schema"] == 1
    return sorted((k["digest"], k["kind"]) for k in data["kernel_list"])


def test_prewarm_subcommand_plans_what_the_old_program_plans(tmp_path: Path) -> None:
    """The done-when command of issue 23, as an operator types it, against the standalone
    program with the old flag names: the same kernels; no carriage returns in a piped log."""
    root = tmp_path / "cache"
    proc = child("prewarm", "qwen3-30b-a3b", "--target", TARGET, "--max-num-batched-tokens", "24", "-tp", "1", "--dry-run",
                 "--root", str(root), "--no-dense", root=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "micro" in proc.stdout and "static" in proc.stdout
    assert "\r" not in proc.stderr and "planning MoE: 24/24 m" in proc.stderr, proc.stderr[-2000:]
    new = _kernels(child("--json", "prewarm", "qwen3-30b-a3b", "--target", TARGET, "--max-num-batched-tokens", "24", "-tp", "1",
                         "--dry-run", "--no-dense", root=root))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k not in ("FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH")}
    old = _kernels(subprocess.run([sys.executable, "-m", "cute_diskcache.prewarm", "--model", "qwen3-30b-a3b", "--target", TARGET,
                                   "--max-num-tokens", "24", "--tp", "1", "--dry-run", "--no-dense", "--json"],
                                  env={**env, "CUTE_DISKCACHE_DIR": str(root)}, capture_output=True, text=True, timeout=600))
    assert new == old and len(new) > 3
    assert not root.exists() or not list(root.glob("v1/*/*/*/manifest.msgpack")), "a dry run writes nothing"


def test_prewarm_help_names_the_engine_flags(tmp_path: Path) -> None:
    proc = child("prewarm", "--help", root=tmp_path / "cache")
    assert proc.returncode == 0
    missing = [f for f in ("MODEL", "--max-num-batched-tokens", "--tensor-parallel-size", "-tp", "--data-parallel-size",
                           "--enable-expert-parallel", "--dtype", "--root", "--json") if f not in proc.stdout]
    assert not missing, proc.stdout


def test_prewarm_verify_prints_json_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    """``--verify``'s verdict (the dispatch itself needs the GPU): words by default, JSON with --json."""
    clean = {"m": 64, "hits": 72, "compiles": 0, "native_hits": 0, "native_compiles": 0}
    assert prewarm.report_verify(clean, as_json=False) == 0
    words = capsys.readouterr().out
    assert "72 disk hits, 0 compiles" in words and "{" not in words
    assert prewarm.report_verify({**clean, "compiles": 3}, as_json=True) == 1
    assert json.loads(capsys.readouterr().out) == {"schema": 1, **clean, "compiles": 3}


def test_prewarm_refusal_in_json_mode_goes_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "--json", "--root", str(tmp_path), "prewarm", "qwen3-30b-a3b-bf16", "--target", TARGET, "--dry-run")
    assert rc == 2 and out == ""
    refusal = json.loads(err.strip().splitlines()[-1])
    assert refusal["schema"] == 1 and "NVFP4" in refusal["error"]
    rc, out, err = run(capsys, "--root", str(tmp_path), "prewarm", "qwen3-30b-a3b-bf16", "--target", TARGET, "--dry-run")
    assert rc == 2 and out == "" and err.startswith("error: ")


def test_engine_flags_change_the_planned_shapes() -> None:
    """-tp / -dp / --enable-expert-parallel shard the MoE layers as vLLM does; --dtype is the dense GEMMs' output."""
    ap = prewarm.build_parser()

    def shapes(*argv: str) -> tuple[Any, Any]:
        moe, dense, _notes = prewarm._shapes(ap.parse_args(["qwen3-30b-a3b", *argv]))
        return moe, dense

    moe, dense = shapes()
    assert (moe.intermediate_size, moe.num_local_experts, dense.out_dtype) == (768, 128, "bfloat16")
    moe, _ = shapes("-tp", "2", "-dp", "2")
    assert (moe.intermediate_size, moe.num_local_experts) == (768 // 4, 128)
    moe, dense = shapes("-tp", "2", "-dp", "2", "--enable-expert-parallel")
    assert (moe.intermediate_size, moe.num_local_experts) == (768, 128 // 4)
    assert dense.linears == shapes("-tp", "2")[1].linears, "the dense layers follow tp alone"
    assert shapes("--dtype", "float16")[1].out_dtype == "float16"
