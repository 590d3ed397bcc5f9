"""``cached_compile`` keys on the code as it is at each call (issue 15, item 3).

Measured on the old code: after the kernel's module was edited and ``importlib.reload``-ed (what
a notebook's autoreload does), the next call returned the old body's kernel from memory (0
compiles, 0 hits), and a kernel compiled from new code under another key was stored under the
old fingerprint, where a later process running the old code loaded it. Here a real kernel is
compiled by the real DSL for the rtx-pro-6000 profile in fresh processes, and its MLIR (stored
in the entry) says which body it came from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cute_diskcache.storage import entry

KERNEL = textwrap.dedent(
    """
    import cutlass
    import cutlass.cute as cute


    @cute.kernel
    def _add(x: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        x[tidx] = x[tidx] + cutlass.Float32({value})


    @cute.jit
    def add(x: cute.Tensor):
        _add(x).launch(grid=(1, 1, 1), block=(32, 1, 1))
    """
)

CHILD = textwrap.dedent(
    """
    import importlib, json, os, sys, time
    from pathlib import Path
    from cute_diskcache.keys import targets
    targets.apply("rtx-pro-6000")
    import cute_diskcache
    from cutlass.cute.runtime import make_fake_compact_tensor
    import cutlass
    sys.path.insert(0, sys.argv[1])
    import cdc_reload_kernels.kern as kern
    x = make_fake_compact_tensor(cutlass.Float32, (32,))
    out = {}
    first = cute_diskcache.cached_compile(kern.add, x, key=("add", 32))
    out["first"] = cute_diskcache.counters()
    out["same_object_again"] = cute_diskcache.cached_compile(kern.add, x, key=("add", 32)) is first
    if sys.argv[2] == "edit":
        path = Path(kern.__file__)
        path.write_text(path.read_text().replace("Float32(1.0)", "Float32(2.0)"))
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a later save, whatever the clock
        importlib.reload(kern)
        second = cute_diskcache.cached_compile(kern.add, x, key=("add", 32))
        out["second"] = cute_diskcache.counters()
        out["same_object_after_reload"] = second is first
    from cute_diskcache.core.cache import default_cache
    out["events"] = [(e[1], e[2]) for e in default_cache().events]
    print(json.dumps(out))
    """
)


def _child(root: Path, code_dir: Path, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k != "CUTE_DSL_ARCH"}
    env["CUTE_DISKCACHE_DIR"] = str(root)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(code_dir), mode], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cubins(root: Path) -> dict[str, bytes]:
    """digest -> the cubin each stored entry holds (the kernel body, as the GPU would run it)."""
    found = {}
    for manifest_path in sorted(root.glob("v1/*/*/*/" + entry.MANIFEST)):
        d = manifest_path.parent
        m = entry.read_manifest(d)
        found[d.name] = (d / m["payloads"]["cubin"][0]["file"]).read_bytes()
    return found


@pytest.mark.slow
def test_edited_and_reloaded_kernel_compiles_its_new_body(tmp_path: Path) -> None:
    code = tmp_path / "code"
    (code / "cdc_reload_kernels").mkdir(parents=True)
    (code / "cdc_reload_kernels" / "__init__.py").write_text("")
    kern = code / "cdc_reload_kernels" / "kern.py"
    kern.write_text(KERNEL.format(value="1.0"))
    root = tmp_path / "root"

    out = _child(root, code, "edit")
    assert out["first"]["compiles"] == 1 and out["same_object_again"], out
    # After the edit and reload: a new compile, a new kernel object; never the old body's.
    assert out["second"]["compiles"] == 2 and out["second"]["hits"] == 0, out
    assert out["same_object_after_reload"] is False
    (first, _), (second, _) = out["events"][0], out["events"][-1]
    cubins = _cubins(root)
    assert sorted(cubins) == sorted({first, second}) and first != second, "each body stored under its own code's key"
    assert cubins[first] != cubins[second], "the two bodies compiled to different code"
    assert b"\x00\x00\x80\x3f" in cubins[first] and b"\x00\x00\x80\x3f" not in cubins[second]  # 1.0f vs 2.0f

    # A later process running the old code gets the old body's entry (a hit), never the new one.
    kern.write_text(KERNEL.format(value="1.0"))
    old = _child(root, code, "load")
    assert old["first"]["compiles"] == 0 and old["first"]["hits"] == 1, old
    assert old["events"] == [[first, "hit"]]
