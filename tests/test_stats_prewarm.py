"""Statistics tell serving from prewarm (issue 28, item 5).

A fresh prewarm of 89 kernels read as a 5.3% hit rate in ``stats`` and in the Prometheus output,
and an alert on the hit rate fired after every image build: prewarm's compiles were counted as
misses. Prewarm's workers count ``prewarm_compiles`` / ``prewarm_compile_seconds`` /
``prewarm_hits``; ``hits``, ``misses`` and ``compiles`` are serving's alone. The first test uses
synthetic entries (the counting is the cache's, not the DSL's); the last runs the real prewarm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _helpers, whatever pytest's import mode

from _helpers import make_artifact, make_key  # noqa: E402

from cute_diskcache import cli  # noqa: E402
from cute_diskcache.core import export  # noqa: E402
from cute_diskcache.storage import stats  # noqa: E402
from cute_diskcache.core.cache import CompileCache  # noqa: E402
from cute_diskcache.storage.store import Store  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_stats")


def _stats(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert cli.main(["--root", str(root), "stats", *args]) == 0
    return capsys.readouterr().out


def test_prewarm_compiles_are_not_serving_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(export, "export", lambda kernel, digest, seconds, extra, device, **kw: make_artifact())
    monkeypatch.setattr(CompileCache, "_load", lambda self, key, found: "loaded")
    root = tmp_path / "root"
    keys = [make_key("micro"), make_key("static"), make_key("dynamic")]
    prewarm = CompileCache(Store(root))
    prewarm.for_prewarm()
    for key in keys + keys[:1]:  # three compiles, then one found cached
        prewarm.get_or_compile(key, lambda: "compiled")
    serving = CompileCache(Store(root))
    for key in keys[:2]:
        assert serving.get_or_compile(key, lambda: "compiled")[0] == "loaded"
    stats.flush()

    total = json.loads(_stats(root, capsys, "--json"))["total"]
    assert (total["hits"], total["misses"], total["compiles"]) == (2, 0, 0), total
    assert (total["prewarm_compiles"], total["prewarm_hits"]) == (3, 1) and total["prewarm_compile_seconds"] >= 0, total
    text = _stats(root, capsys)
    assert "100.0% of 2 lookups" in text, text
    assert "prewarm" in text and "3 compiled" in text and "1 found cached" in text, text
    prom = _stats(root, capsys, "--format", "prometheus")
    series = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in prom.splitlines() if line and not line.startswith("#")}
    assert series["cute_diskcache_prewarm_compiles_total"] == 3 and series["cute_diskcache_misses_total"] == 0, prom
    assert series["cute_diskcache_prewarm_hits_total"] == 1 and series["cute_diskcache_hits_total"] == 2, prom


@pytest.mark.slow
def test_a_real_prewarm_leaves_no_serving_miss(tmp_path: Path) -> None:
    """The real command on the smallest real plan (one micro kernel: a compile)."""
    root = tmp_path / "root"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k not in ("FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH")}
    env["CUTE_DISKCACHE_DIR"] = str(root)
    proc = subprocess.run([sys.executable, "-m", "cute_diskcache.prewarm", "--model", "qwen3-30b-a3b", "--max-num-tokens", "1",
                           "--target", "rtx-pro-6000", "--no-dense", "--jobs", "1"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "cute_diskcache", "--root", str(root), "stats", "--json"], env=env,
                         capture_output=True, text=True, timeout=120)
    total = json.loads(out.stdout)["total"]
    assert total["prewarm_compiles"] >= 1 and total["misses"] == 0 and total["compiles"] == 0 and total["hits"] == 0, total
