"""Issue 16's hit path and planning, observed in real processes (flashinfer and the DSL, not mocks).

* A hit pays nothing once per process: the attach (engine start) already read the CPU's
  extensions, the DSL stack and the kernel sources' fingerprint and imported the module of the
  class a hit hands back, so the first hit reads and imports none of them, and it writes nothing to disk (statistics go to a memory map set up at attach).
* Planning drives flashinfer's dispatch for every m with views of one set of input buffers
  (allocating per m made an 8192-token plan take 292 s), and says what it is doing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest and test_prewarm, whatever pytest's import mode
from conftest import TARGET, Warm, child_env  # noqa: E402
from test_prewarm import prewarm  # noqa: E402

pytestmark = pytest.mark.slow

#: One warm engine start with the hit path instrumented after the attach.
HIT_CHILD = textwrap.dedent('''
    import builtins, importlib.metadata as md, json, os, sys
    import cute_diskcache
    cute_diskcache.install(target=sys.argv[1])
    from cute_diskcache import flashinfer_sites
    from cute_diskcache.keys import key
    from cute_diskcache.core.cache import default_cache

    import flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_dispatch  # noqa: F401  the attach (import hook)
    seen = {"cpuinfo": 0, "distributions": 0, "source_hashes": 0, "fsync": 0, "writes": []}
    real_open, real_os_open, real_fsync = builtins.open, os.open, os.fsync
    real_code, real_dist, real_dists = key.module_code, md.distribution, md.distributions

    def spy_open(file, mode="r", *a, **k):
        if str(file) == "/proc/cpuinfo":
            seen["cpuinfo"] += 1
        if any(c in mode for c in "wax+"):
            seen["writes"].append(str(file))
        return real_open(file, mode, *a, **k)

    def spy_os_open(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            seen["writes"].append(str(path))
        return real_os_open(path, flags, *a, **k)

    def spy_fsync(fd):
        seen["fsync"] += 1
        return real_fsync(fd)

    def spy_code(*a, **k):
        seen["source_hashes"] += 1
        return real_code(*a, **k)

    def spy_dist(*a, **k):
        seen["distributions"] += 1
        return real_dist(*a, **k)

    def spy_dists(*a, **k):
        seen["distributions"] += 1
        return real_dists(*a, **k)

    builtins.open, os.open, os.fsync, key.module_code = spy_open, spy_os_open, spy_fsync, spy_code
    md.distribution, md.distributions = spy_dist, spy_dists
    loaded = set(sys.modules)
    try:
        flashinfer_sites.dispatch(128, 8, 2048, 768, [1], max_num_tokens=4096)
    finally:
        builtins.open, os.open, os.fsync, key.module_code = real_open, real_os_open, real_fsync, real_code
        md.distribution, md.distributions = real_dist, real_dists
    seen["imported"] = sorted(set(sys.modules) - loaded)
    seen["events"] = [e[2] for e in default_cache().events]
    print(json.dumps(seen))
''')

#: Planning's input buffers: every m gets views of the largest m's.
INPUTS_CHILD = textwrap.dedent('''
    import json, sys
    import cute_diskcache
    cute_diskcache.install(target=sys.argv[1])
    from cute_diskcache.flashinfer_sites import Dispatcher

    d = Dispatcher(128, 8, 2048, 768, max_num_tokens=64)
    storages = {m: [t.untyped_storage().data_ptr() for t in d._inputs(m)] for m in (64, 1, 17, 64)}
    shapes = {m: [list(t.shape) for t in d._inputs(m)] for m in (1, 17)}
    print(json.dumps({"storages": storages, "shapes": shapes}))
''')


def _child(code: str, root: Path, hook_dir: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", code, TARGET], env=child_env(root, None, hook_dir), capture_output=True,
                          text=True, timeout=900, cwd=hook_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


def test_a_hit_after_the_attach_rereads_nothing_and_writes_nothing(micro_copy: Warm, compile_hook_dir: Path) -> None:
    seen = _child(HIT_CHILD, micro_copy.root, compile_hook_dir)
    assert seen["events"] == ["hit"], seen
    assert seen["cpuinfo"] == 0 and seen["distributions"] == 0 and seen["source_hashes"] == 0, seen
    root = str(micro_copy.root)
    assert seen["fsync"] == 0 and [w for w in seen["writes"] if w.startswith(root)] == [], seen
    # The class a hit hands back is the compile's own (tvm-ffi's, for this kernel): its module is
    # loaded at the attach, not by the first request (importing it cost that request ~7 ms).
    dsl = [m for m in seen["imported"] if m.split(".")[0] in ("cutlass", "tvm_ffi")]
    assert dsl == [], f"the first hit imported the DSL's {dsl}"


def test_planning_reuses_one_set_of_input_buffers(tmp_path: Path, compile_hook_dir: Path) -> None:
    seen = _child(INPUTS_CHILD, tmp_path / "root", compile_hook_dir)
    storages = seen["storages"]
    assert storages["1"] == storages["17"] == storages["64"], storages
    assert [s[0] for s in seen["shapes"]["1"]] == [1, 1, 1] and [s[0] for s in seen["shapes"]["17"]] == [17, 17, 17], seen


def test_planning_says_what_it_is_doing(tmp_path: Path) -> None:
    """Before the compile bar, prewarm plans (one dispatch per m); that has its own progress line."""
    proc = prewarm(tmp_path / "root", "--model", "qwen3-30b-a3b", "--target", TARGET, "--max-num-tokens", "64", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.replace("\r", "\n").splitlines() if ln.startswith("planning MoE")]
    assert lines and "kernels" in lines[-1] and "64/64" in lines[-1], proc.stderr[-3000:]  # a plain line off a terminal
