"""``import`` of a bundle made for another stack says so: which namespaces, why, and that their
entries will not be used here (they are imported all the same: a shared volume serves many stacks)."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import make_artifact, make_env, make_key  # noqa: E402
from test_bundle import _isolated  # noqa: E402,F401  (autouse: no settings from the environment, no fsync, no stats file)

from cute_diskcache import cli  # noqa: E402
from cute_diskcache.cli import coverage  # noqa: E402
from cute_diskcache.storage import bundle, entry, staleness  # noqa: E402
from cute_diskcache.keys.key import CacheKey  # noqa: E402


def put(root: Path, key: CacheKey) -> None:
    entry.write(root / "v1" / key.env.namespace / key.digest[:2] / key.digest, key, make_artifact())


def this_stack(**changes: object) -> object:
    """An environment this install would key on (the fields prune and import can compare)."""
    current = staleness.current_environment()
    fields: dict[str, object] = {"dsl": tuple(tuple(p) for p in current["dsl"]), "machine": platform.machine()}
    fields.update(changes)
    return make_env(**fields)


@pytest.fixture
def mixed_bundle(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A bundle with one namespace of this stack, one of another flashinfer, one of another DSL,
    and one of another arch; returns it and the namespaces by what they are."""
    src = tmp_path / "src"
    envs = {
        "here": this_stack(),
        "old_flashinfer": this_stack(package="flashinfer-python==0.6.9"),
        "old_dsl": this_stack(dsl=(("nvidia-cutlass-dsl", "4.2.0"),)),
        "other_arch": this_stack(arch="sm_121a"),
    }
    for env in envs.values():
        put(src, make_key("micro", env=env))
    path = tmp_path / "b.tar.gz"
    report = bundle.export_bundle(src, path)
    assert report.entries == 4
    return path, {what: env.namespace for what, env in envs.items()}


def test_import_names_the_namespaces_this_install_cannot_use(mixed_bundle: tuple[Path, dict[str, str]], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path, ns = mixed_bundle
    monkeypatch.setenv("CUTE_DISKCACHE_TARGET", "rtx-pro-6000")  # this host's arch: sm_120a
    assert cli.main(["--root", str(tmp_path / "dst"), "import", str(path)]) == 0
    out = capsys.readouterr().out
    assert "4 imported" in out
    assert "WARNING: 3 of the bundle's namespaces do not match this install; their entries will not be used here:" in out
    lines = {ln.split(": ", 1)[0].split()[-1]: ln for ln in out.splitlines() if ln.startswith("      1  ")}
    assert set(lines) == {ns["old_flashinfer"], ns["old_dsl"], ns["other_arch"]}, out
    assert "flashinfer-python 0.6.9 (installed: 0.6.15.post1)" in lines[ns["old_flashinfer"]]
    assert "DSL stack: " in lines[ns["old_dsl"]] and "nvidia-cutlass-dsl 4.2.0 (installed: 4.8.1)" in lines[ns["old_dsl"]]
    assert "arch sm_121a (this host: sm_120a)" in lines[ns["other_arch"]]


def test_json_lists_them_and_a_matching_bundle_says_nothing(mixed_bundle: tuple[Path, dict[str, str]], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    path, ns = mixed_bundle
    monkeypatch.setattr(coverage, "host_arch", lambda: (None, "neither a GPU nor a target profile"))
    assert cli.main(["--root", str(tmp_path / "dst"), "import", "--json", str(path)]) == 0
    listed = {f["namespace"]: f for f in json.loads(capsys.readouterr().out)["not_for_this_install"]}
    # the arch is not compared when the host's is unknown
    assert set(listed) == {ns["old_flashinfer"], ns["old_dsl"]} and listed[ns["old_dsl"]]["entries"] == 1
    src = tmp_path / "only-here"
    put(src, make_key("static", env=this_stack()))
    bundle.export_bundle(src, tmp_path / "here.tar.gz")
    assert cli.main(["--root", str(tmp_path / "dst2"), "import", str(tmp_path / "here.tar.gz")]) == 0
    assert "WARNING" not in capsys.readouterr().out
