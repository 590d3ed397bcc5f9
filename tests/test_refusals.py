"""What the user asked for cannot be done: one clear line and exit status 2, never a traceback.

Exit status 1 means "kernels failed" (prewarm) or "bad entries" (verify, import); a build
script must be able to tell that from "the command line is wrong". And a target profile must
never stand in for a real GPU that the process can see (issue 15, items 4 and 15).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cute_diskcache import activation
from cute_diskcache.keys import targets


def _run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    child = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k not in ("FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH")}
    child["CUTE_DISKCACHE_DIR"] = str(tmp_path / "root")
    child.update(env)
    return subprocess.run([sys.executable, "-m", *args], env=child, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def _bad_profiles(tmp_path: Path) -> dict[str, str]:
    misspelt = tmp_path / "misspelt.json"
    misspelt.write_text(json.dumps({"base": "rtx-5090", "sm_cuont": 36}))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    return {"unknown": "rtx-9090", "missing": str(tmp_path / "nowhere.json"), "misspelt": str(misspelt), "broken": str(broken)}


@pytest.mark.parametrize("which", ["unknown", "missing", "misspelt", "broken"])
@pytest.mark.parametrize("entry", ["prewarm", "prewarm-env", "demo"])
def test_unusable_target_profile_is_one_line_and_exit_2(which: str, entry: str, tmp_path: Path) -> None:
    profile = _bad_profiles(tmp_path)[which]
    if entry == "prewarm":
        proc = _run(["cute_diskcache.prewarm", "--model", "qwen3-30b-a3b", "--target", profile, "--dry-run"], tmp_path)
    elif entry == "prewarm-env":
        proc = _run(["cute_diskcache.prewarm", "--model", "qwen3-30b-a3b", "--dry-run"], tmp_path, CUTE_DISKCACHE_TARGET=profile)
    else:
        proc = _run(["cute_diskcache", "demo", "--target", profile], tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "profile" in lines[0] and (which != "unknown" or "known:" in lines[0]), lines[0]


def test_typo_in_the_serving_environment_keeps_the_cache_on(tmp_path: Path) -> None:
    """CUTE_DISKCACHE_TARGET=rtx-9090 under the .pth door: one warning, the cache still attaches."""
    code = "import cute_diskcache.activation as a; print(a.installed())"
    proc = subprocess.run(
        [sys.executable, "-c", "import logging; logging.basicConfig(); " + code],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_")},
             "FLASHINFER_B12X_DISK_CACHE": "1", "CUTE_DISKCACHE_TARGET": "rtx-9090", "CUTE_DISKCACHE_DIR": str(tmp_path / "root")},
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
    assert "ignoring CUTE_DISKCACHE_TARGET" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


# --------------------------------------------------------------------------------------------
# A profile never stands in for a visible GPU (item 4)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    """No profile applied in this process, and torch.cuda restored afterwards."""
    import torch

    monkeypatch.setattr(targets, "_active", None)
    for name in ("get_device_properties", "get_device_capability", "get_device_name", "current_stream", "is_current_stream_capturing"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    monkeypatch.delenv("CUTE_DISKCACHE_TARGET_FORCE", raising=False)
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)


def test_profile_is_refused_when_a_cuda_device_is_visible(fresh_targets: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    real_stream = torch.cuda.current_stream
    monkeypatch.setattr(targets, "_nvml_device_count", lambda: 1)  # what NVML says on a GPU box
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert targets.cuda_device_visible()
    with pytest.raises(targets.ProfileRefused, match="CUDA device is visible.*CUTE_DISKCACHE_TARGET_FORCE=1"):
        targets.apply("rtx-pro-6000")
    assert targets.active() is None and torch.cuda.current_stream is real_stream, "torch.cuda left alone"
    assert "CUTE_DSL_ARCH" not in os.environ

    monkeypatch.setattr(activation, "_profile_name", "rtx-pro-6000")
    activation._apply_profile()  # the import-hook door: a warning, then the real device
    assert activation._profile_name is None and targets.active() is None

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # every device hidden: compiling offline is fine
    assert not targets.cuda_device_visible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("CUTE_DISKCACHE_TARGET_FORCE", "1")
    assert targets.apply("rtx-pro-6000").name == "rtx-pro-6000"


def test_no_device_here_means_profiles_apply(fresh_targets: None) -> None:
    assert not targets.cuda_device_visible(), "this CI machine has no GPU"
    assert targets.apply("rtx-5090").sm_count == 170


def test_prewarm_refuses_a_profile_beside_a_gpu(tmp_path: Path) -> None:
    """The same refusal from the command line, exit 2 (the GPU simulated through NVML's answer)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "pynvml.py").write_text("class NVMLError(Exception): pass\n"  # as nvidia-ml-py's: what a failed call raises
                                    "def nvmlInit(): pass\ndef nvmlShutdown(): pass\ndef nvmlDeviceGetCount(): return 1\n")
    proc = _run(["cute_diskcache.prewarm", "--model", "qwen3-30b-a3b", "--target", "rtx-pro-6000", "--dry-run"], tmp_path,
                PYTHONPATH=os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]))
    assert proc.returncode == 2 and "CUDA device is visible" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
