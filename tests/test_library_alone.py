"""A process with b12x and no flashinfer: the hook on ``cutlass.cute.compile`` goes on, and the
cache says nothing about flashinfer.

The hook is library-neutral (:mod:`cute_diskcache.core.hook`), so the neutral layer puts it in
place (:func:`cute_diskcache.activation._attach_dsl`); each adapter may only withhold it for its
own library (flashinfer's refused combinations). When flashinfer's adapter put it there, such a
process logged "flashinfer 0+unknown is not a release the compatibility matrix proved".

The child interpreter sees the real site-packages of this one without flashinfer (a directory of
links to every other entry), the real b12x of the b12x venv, and this checkout.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_b12x import B12X_PY, b12x_python  # noqa: E402, F401 - the b12x venv's fixture, built on first use

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(B12X_PY == "off", reason="CUTE_DISKCACHE_B12X_PYTHON=off: b12x tests skipped")
_LEFT_OUT = ("flashinfer", "cute_diskcache", "_editable_impl_cute_diskcache", "__editable__")


def _site_without_flashinfer(b12x_python: str, into: Path) -> Path:
    """This interpreter's site-packages less flashinfer (and any installed cute_diskcache), plus b12x."""
    into.mkdir()
    for top in site.getsitepackages():
        for entry in Path(top).iterdir():
            if not entry.name.startswith(_LEFT_OUT) and not (into / entry.name).exists():
                (into / entry.name).symlink_to(entry)
    where = subprocess.run([b12x_python, "-c", "import importlib.metadata as m, b12x, json, os; "
                            "print(json.dumps([os.path.dirname(b12x.__file__), str(m.distribution('b12x')._path)]))"],
                           capture_output=True, text=True, timeout=120, env={"PATH": os.environ.get("PATH", "")})
    assert where.returncode == 0, where.stderr[-3000:]
    for path in map(Path, json.loads(where.stdout)):
        (into / path.name).symlink_to(path)
    return into


def test_b12x_without_flashinfer_gets_the_hook_and_no_flashinfer_line(b12x_python: str, tmp_path: Path) -> None:
    packages = _site_without_flashinfer(b12x_python, tmp_path / "site")
    child = textwrap.dedent(f"""
        import json, site, sys
        site.addsitedir({str(packages)!r})
        sys.path.insert(0, {str(REPO)!r})
        import importlib.util
        assert importlib.util.find_spec("flashinfer") is None, "flashinfer is visible"
        import cute_diskcache
        cute_diskcache.install()
        import cutlass.cute as cute
        import b12x._lib.compiler
        print(json.dumps({{"hooked": bool(getattr(cute.compile, "_cdc_inline", False)),
                          "b12x": b12x._lib.compiler.__file__}}))
    """)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "CUTE_DISKCACHE_LOG_LEVEL": "debug",
           "CUTE_DISKCACHE_DIR": str(tmp_path / "root"), "B12X_COMPILE_CACHE_DIR": str(tmp_path / "b12x-cache")}
    proc = subprocess.run([sys.executable, "-S", "-c", child], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["hooked"], "the library-neutral hook is on cutlass.cute.compile without flashinfer"
    assert out["b12x"].startswith(str(packages)), out["b12x"]
    said = [line for line in proc.stderr.splitlines() if line.startswith("[cute-diskcache]")]
    assert not [line for line in said if "flashinfer" in line], "\n".join(said)
