"""No process maps an object that is not for its own machine (issue 39, finding 1).

An x86_64 process that cross-builds for a DGX Spark keys the aarch64 namespace, so the namespace
alone let it load aarch64 objects on a hit or a reuse and launch them (SIGILL / SIGSEGV in a
prewarm worker). Two rules, each tested here:

* the payload loader reads the ELF header (machine and class) before it maps anything, in every
  load path (:func:`cute_diskcache.storage.loader.refuse_foreign`);
* a cross-building process judges hits and reuses without loading them: it gets a stand-in
  (:class:`cute_diskcache.core.cache.NotLoaded`) once the bytes are the target machine's code.

The unit cases use synthetic entries (no DSL load can happen: that is the point); the last case is
the reviewer's reproduction with the real DSL and flashinfer: a cross-built W4A16 kernel hit and
launched by a fresh cross-building process.
"""

from __future__ import annotations

import json
import os
import platform
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from _helpers import EM_CUDA, make_artifact, make_elf, make_env, make_key
from cute_diskcache.core import cache as cache_module
from cute_diskcache.core.cache import CompileCache
from cute_diskcache.keys import hostmachine
from cute_diskcache.storage import entry, loader
from cute_diskcache.storage.store import Store

HERE = hostmachine.here()
OTHER = "aarch64" if HERE == "x86_64" else "x86_64"
EM = {"x86_64": 62, "aarch64": 183}
needs_x86 = pytest.mark.skipif(platform.machine() != "x86_64", reason="the cross-build tested is x86_64 -> aarch64")


def host_object(machine: str, *, elf_class: int = 2) -> bytes:
    """A synthetic exported object of ``machine``'s host code, with one cubin inside."""
    obj = bytearray(make_elf(EM[machine], b"host code " * 8))
    obj[4] = elf_class
    return bytes(obj) + b"\x00junk\x7fEL" + make_elf(EM_CUDA, b"\x22" * 48)


def artifact_of(obj: bytes) -> entry.Artifact:
    art = make_artifact()
    return entry.Artifact(object_bytes=obj, symbol=art.symbol, tvm_ffi=True, cubins=entry.cubins_in(obj), mlir_text=art.mlir_text,
                          compile_seconds=2.0, export_seconds=0.01, extra={})


@pytest.fixture
def dsl_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What reached the DSL's loader (``cutlass.cute.runtime.load_module``) or the in-memory file
    that both forms are mapped from (the step before ``load_module`` and ``dlopen``)."""
    import cutlass.cute.runtime as runtime

    reached: list[str] = []
    monkeypatch.setattr(runtime, "load_module", lambda path, **kw: reached.append(path) or pytest.fail("mapped"))
    monkeypatch.setattr(loader, "_memfd", lambda data, name: reached.append(name) or pytest.fail("about to be mapped"))
    return reached


def test_the_loader_never_maps_another_machines_object(dsl_loads: list[str]) -> None:
    for form in (loader.object_module, lambda data, _tvm: loader.load_shared(data, "cdc_test")):
        with pytest.raises(loader.ForeignObject, match=f"holds {OTHER} code"):
            form(host_object(OTHER), True)
        with pytest.raises(loader.ForeignObject, match="no known host"):  # this machine, 32-bit class
            form(host_object(HERE, elf_class=1), True)
        with pytest.raises(loader.ForeignObject):
            form(b"not an ELF image at all", True)
    assert dsl_loads == [], "refused before anything reached the DSL's loader or dlopen"


def _cache(root: Path, machine: str, obj: bytes) -> tuple[CompileCache, Any]:
    store = Store(root)
    key = make_key(env=make_env(machine=machine, arch="sm_121a"))
    store.commit(key, artifact_of(obj))
    return CompileCache(Store(root), single_flight=False), key


def test_a_process_never_loads_another_machines_object_whatever_the_namespace(tmp_path: Path, dsl_loads: list[str]) -> None:
    # An entry under this machine's namespace holding another machine's code (planted or mislabelled):
    # a refusal and a compile, never a load.
    cache, key = _cache(tmp_path / "root", HERE, host_object(OTHER))
    kernel, _ = cache.get_or_compile(key, lambda: "compiled here")
    assert kernel == "compiled here" and cache.counters.hits == 0 and cache.counters.compiles == 1
    assert dsl_loads == []


@needs_x86
def test_a_cross_build_judges_a_hit_without_loading_it(tmp_path: Path, dsl_loads: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostmachine, "_target", OTHER)  # what prewarm's workers for dgx-spark do (build_for)
    cache, key = _cache(tmp_path / "root", OTHER, host_object(OTHER))
    kernel, _ = cache.get_or_compile(key, lambda: pytest.fail("a sound entry of the target's machine is a hit"))
    assert isinstance(kernel, cache_module.NotLoaded) and cache.counters.hits == 1 and cache.counters.compiles == 0
    with pytest.raises(RuntimeError, match=f"holds {OTHER} host code: judged, not loaded"):
        kernel()  # a launch raises, as a fresh compile's launch does without the card
    assert dsl_loads == []

    # The target's namespace holding this machine's code is not the target's entry: compiled.
    cache, key = _cache(tmp_path / "root2", OTHER, host_object(HERE))
    kernel, _ = cache.get_or_compile(key, lambda: "compiled here")
    assert kernel == "compiled here" and cache.counters.hits == 0
    assert dsl_loads == []


DRIVER = """
import json, os, sys
from cute_diskcache.keys import hostmachine
hostmachine.build_for("aarch64")
import cute_diskcache
cute_diskcache.install(target="dgx-spark")
sys.path.insert(0, os.path.join(sys.argv[1], "scripts"))
import compat_child
from cute_diskcache.core.cache import default_cache
res, seen = compat_child._recorded_compile(lambda: compat_child._w4a16_compile("w4a16_activation"))
launch = compat_child._launch_like_compile(res.compiled, seen[-1])
print(json.dumps({"class": type(res.compiled).__name__, "launch": launch,
                  "events": [e[2] for e in default_cache().events]}), flush=True)
"""


@needs_x86
def test_a_cross_building_process_hits_a_real_aarch64_entry_and_survives_its_launch(tmp_path: Path) -> None:
    """The reviewer's reproduction: cold, then warm; before the fix the warm process died (SIGSEGV)."""
    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k != "CUTE_DSL_ARCH"}
    env.update(CUTE_DISKCACHE_DIR=str(tmp_path / "root"), PYTHONPATH=str(repo))
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", DRIVER, str(repo)], env=env, capture_output=True, text=True, timeout=600,
                              cwd=tmp_path)
        assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["events"] == ["miss"], cold
    [obj] = list((tmp_path / "root").glob("v1/*-aarch64-*/*/*/object-*.o"))
    assert struct.unpack_from("<H", obj.read_bytes(), 18)[0] == 183, "the entry holds aarch64 host code"
    assert warm["events"] == ["hit"] and warm["class"] == "NotLoaded", warm
    assert warm["launch"].startswith("RuntimeError: ") and "not loaded" in warm["launch"], warm
