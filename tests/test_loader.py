"""Hits at the loader floor (issue 16): the linked shared object, and every way back to the object.

Real flashinfer 0.6.15.post1 kernels, compiled on the CPU for the rtx-pro-6000 profile in fresh
processes. The shared object must give the kernel the object gives (the same ABI: the kernel's
own argument check, which prints its whole signature, refuses the CPU tensors with the same
text), and anything that keeps this process from loading it must fall back to the object, never
to a compile and never to a quarantine.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest

from cute_diskcache.core import export
from cute_diskcache.storage import entry, loader

if TYPE_CHECKING:
    from conftest import Warm

Probe = Callable[..., dict[str, Any]]


def _entry(root: Path) -> tuple[Path, dict[str, Any]]:
    (d,) = [p.parent for p in root.glob("v1/*/*/*/" + entry.MANIFEST)]
    return d, entry.read_manifest(d)


def _assert_same_kernel(warm: dict[str, Any], cold: dict[str, Any]) -> None:
    assert warm["real_compiles"] == 0, warm["stderr"]
    assert warm["counters"]["hits"] == 1 and warm["counters"]["compiles"] == 0 and warm["counters"]["rejected"] == 0
    assert warm["records"][0]["launch_error"] == cold["records"][0]["launch_error"]


def test_a_miss_links_a_shared_object_and_a_hit_loads_it(warm_micro_root: Warm, probe: Probe) -> None:
    d, m = _entry(warm_micro_root.root)
    (so,) = m["payloads"]["shared"]
    data = (d / so["file"]).read_bytes()
    assert data.startswith(b"\x7fELF") and hashlib.sha256(data).hexdigest() == so["sha256"]
    assert m["tvm_ffi"] and m["payloads"]["mlir"][0]["file"].endswith(".mlirbc.zz")
    exported = subprocess.run(["nm", "-D", "--defined-only", str(d / so["file"])], capture_output=True, text=True).stdout.split()
    assert [name for name in exported if not name.isalnum() or name.startswith("_")] == [f"__tvm_ffi_{m['symbol']}"], exported
    warm = probe(warm_micro_root.root, 1)
    _assert_same_kernel(warm, warm_micro_root.cold)
    assert warm["counters"]["shared_loads"] == 1
    objects = probe(warm_micro_root.root, 1, extra_env={"CUTE_DISKCACHE_SHARED_OBJECTS": "0"})
    _assert_same_kernel(objects, warm_micro_root.cold)
    assert objects["counters"]["shared_loads"] == 0


def test_without_a_toolchain_the_entry_holds_the_object_and_still_hits(tmp_path: Path, probe: Probe, warm_micro_root: Warm) -> None:
    root = tmp_path / "root"
    cold = probe(root, 1, extra_env={"CC": str(tmp_path / "no-such-cc")})
    assert cold["counters"]["writes"] == 1 and cold["stderr"] == ""
    _d, m = _entry(root)
    assert "shared" not in m["payloads"], "nothing linked, nothing claimed"
    warm = probe(root, 1)  # a process that could link loads the object: entries without one stay valid
    _assert_same_kernel(warm, warm_micro_root.cold)
    assert warm["counters"]["shared_loads"] == 0


@pytest.mark.slow
def test_a_shared_object_this_process_cannot_load_falls_back_to_the_object(micro_copy: Warm, warm_large_root: Warm, probe: Probe) -> None:
    """A shared object that verifies but does not load here (another kernel's library under this
    entry: its symbol is missing): the object is checked and loaded instead. Not the entry's
    fault, so no quarantine, no compile."""
    root, cold = micro_copy
    d, m = _entry(root)
    other = next(p.parent for p in warm_large_root.root.glob("v1/*/*/*/" + entry.MANIFEST)
                 if entry.read_manifest(p.parent)["site"].endswith("static"))
    theirs = entry.read_manifest(other)["payloads"]["shared"][0]
    shutil.copyfile(other / theirs["file"], d / theirs["file"])
    m["payloads"]["shared"] = [theirs]
    (d / entry.MANIFEST).write_bytes(entry.pack_manifest(m))
    warm = probe(root, 1)
    _assert_same_kernel(warm, cold)
    assert warm["counters"]["shared_loads"] == 0 and not (root / "quarantine").exists()


def test_link_is_deterministic_and_refuses_quietly(warm_micro_root: Warm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d, m = _entry(warm_micro_root.root)
    obj = (d / m["payloads"]["object"][0]["file"]).read_bytes()
    first, second = loader.link(obj, m["symbol"], tmp_path), loader.link(obj, m["symbol"], tmp_path)
    assert first is not None and first == second, "the same object links to the same bytes (entries are jobs-invariant)"
    assert first == (d / m["payloads"]["shared"][0]["file"]).read_bytes()
    assert loader.link(obj, "not_its_symbol", tmp_path) is None, "a library without the entry point is no library"
    assert loader.link(b"not an object", m["symbol"], tmp_path) is None
    monkeypatch.setenv("CUTE_DISKCACHE_SHARED_OBJECTS", "0")
    assert loader.link(obj, m["symbol"], tmp_path) is None
    assert not list(tmp_path.iterdir()), "scratch cleaned up"


_WITHOUT_TAP = (
    "import runpy, cute_diskcache.core.export as e\n"
    "e._install_tap = lambda: False  # a DSL whose provider is laid out otherwise\n"
    "runpy.run_module('cute_diskcache._probe', run_name='__main__', alter_sys=True)\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("host_cpu", ["portable", "native"])
def test_without_the_compile_time_object_the_entry_is_exported(warm_micro_root: Warm, compile_hook_dir: Path, tmp_path: Path,
                                                               host_cpu: str) -> None:
    """The compile-time object comes from a private DSL function; without it the entry is still
    written, with the same device code: for the baseline (the module written for its CPU,
    keeping the compile's function name), or with ``native`` the export path of before
    (``export_to_c``, under our own symbol)."""
    import json
    import sys

    from conftest import child_env

    root = tmp_path / "root"
    cmd = [sys.executable, "-c", _WITHOUT_TAP, "--target", "rtx-pro-6000", "--m", "1"]
    env = child_env(root, {"CUTE_DISKCACHE_HOST_CPU": host_cpu}, compile_hook_dir)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=compile_hook_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["counters"]["writes"] == 1
    _d, m = _entry(root)
    _d2, tapped = _entry(warm_micro_root.root)
    assert m["payloads"]["shared"]
    if host_cpu == "native":
        assert m["symbol"] == export.symbol_for(m["digest"]) and m["host_cpu"] == "native"
        assert tapped["symbol"] != m["symbol"], "the tapped object keeps the compile's own function name"
    else:
        assert m["symbol"] == tapped["symbol"] and m["host_cpu"] == "x86-64-v2"
    assert tapped["payloads"]["cubin"][0]["sha256"] == m["payloads"]["cubin"][0]["sha256"], "the same device code either way"


def test_a_hit_loads_the_verified_bytes_through_a_memfd(micro_copy: Warm, monkeypatch: pytest.MonkeyPatch) -> None:
    """What held in the review of issue 29: the bytes the DSL's loader (and ``dlopen``) reads are
    an anonymous in-memory copy of the bytes verified, never the path in the cache: a file
    rewritten between the check and the load changes nothing loaded. A real entry, the real
    loaders; the spies only record what path and bytes they were handed."""
    import ctypes
    import os

    import cutlass.cute.runtime as runtime

    d, manifest = _entry(micro_copy.root)
    seen: list[tuple[str, bytes]] = []
    real_load, real_cdll = runtime.load_module, ctypes.CDLL

    def load_module(path: str, **kw: Any) -> Any:
        seen.append((os.readlink(path), Path(path).read_bytes()))
        return real_load(path, **kw)

    def cdll(path: str, *a: Any, **kw: Any) -> Any:
        if str(path).startswith("/proc/self/fd/"):
            seen.append((os.readlink(path), Path(path).read_bytes()))
        return real_cdll(path, *a, **kw)

    monkeypatch.setattr(runtime, "load_module", load_module)
    monkeypatch.setattr(loader.ctypes, "CDLL", cdll)
    for role in ("object", "shared"):
        if not manifest["payloads"].get(role):
            continue
        data = entry.verify(d, manifest, None, role=role)
        on_disk = d / manifest["payloads"][role][0]["file"]
        on_disk.write_bytes(b"\x7fELF rewritten after the check")  # what a racing writer would leave
        kernel = loader.load_object(data, manifest["symbol"], manifest["tvm_ffi"]) if role == "object" else \
            loader.load_shared(data, manifest["symbol"])
        assert kernel is not None
        target, loaded = seen[-1]
        assert target.startswith("/memfd:cute_diskcache_") and loaded == data, (role, target)
    assert len(seen) == sum(1 for r in ("object", "shared") if manifest["payloads"].get(r)) >= 1, seen
