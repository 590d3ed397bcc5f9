"""Side data decodes only into an allow-list of the DSL's classes (issue 39, finding 5).

A hit rebuilds the compile's object from its entry's side data (cute_diskcache/core/as_compiled.py).
The class names there once only had to start with a DSL module's name and were then walked
attribute by attribute, so ``subprocess.Popen`` or ``ctypes.CDLL`` (imported by a DSL module)
passed, and a decoded record built a ``tempfile`` closer that deleted an arbitrary file. A name in
an entry now only picks one of the DSL's compiled-function classes or one of its three plain
records; nothing is imported or looked up by a name the entry chose.
"""

from __future__ import annotations

import gc
import os
import zlib
from pathlib import Path

import msgpack
import pytest

from cute_diskcache.core import as_compiled

COMPILED = ["cutlass.cutlass_dsl.tvm_ffi_provider", "TVMFFIJitCompiledFunctionWithKwargs"]


@pytest.mark.parametrize("module, qualname", [
    ("cutlass.base_dsl.common", "subprocess.Popen"),
    ("cutlass.base_dsl.typing", "ctypes.CDLL"),
    ("cutlass.base_dsl.pyir_class_facts", "tempfile._TemporaryFileCloser"),
    ("subprocess", "Popen"),
    ("cutlass.base_dsl.jit_executor", "os"),
])
def test_no_class_outside_the_allow_list_resolves(module: str, qualname: str) -> None:
    with pytest.raises(ValueError):
        as_compiled._class_of(module, qualname)


def test_the_dsls_own_classes_still_resolve() -> None:
    from cutlass.base_dsl.jit_executor import JitFunctionArtifacts
    from cutlass.cutlass_dsl.tvm_ffi_provider import TVMFFIJitCompiledFunctionWithKwargs

    assert as_compiled._class_of(*COMPILED) is TVMFFIJitCompiledFunctionWithKwargs
    assert as_compiled._class_of("cutlass.base_dsl.jit_executor", "JitFunctionArtifacts") is JitFunctionArtifacts


def _result(top: list[str], records: dict) -> dict:
    return {"class": top, "state": {"function_name": "f"}, "unknown": [], "records": sorted(records),
            "records_z": zlib.compress(msgpack.packb(records, use_bin_type=True)), "signature": None, "remade": [], "mode": "keywords"}


def test_a_hit_never_builds_a_class_an_entry_names(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("kept")
    closer = ["cutlass.base_dsl.pyir_class_facts", "tempfile._TemporaryFileCloser"]
    records = {"artifacts": {"t": "obj", "c": closer, "v": {"file": {"t": "obj", "c": closer, "v": {}}, "name": str(victim),
                                                           "delete": True}}}
    # As the top-level class: the hit's check refuses the side data (a miss, never a rebuild).
    assert not as_compiled.valid(_result(["cutlass.base_dsl.common", "subprocess.Popen"], {}))
    # Inside a record of an allowed class: that record is never built; the attribute says why.
    result = _result(COMPILED, records)
    assert as_compiled.valid(result)
    kernel = as_compiled.rebuild(lambda *a: None, result, None, as_compiled.Payloads(lambda role: None))
    with pytest.raises(AttributeError, match="artifacts: not rebuilt from the cache entry"):
        kernel.artifacts  # noqa: B018
    del kernel
    gc.collect()
    assert victim.read_text() == "kept"
    assert os.path.exists(victim)


def test_an_allowed_record_is_rebuilt_as_before() -> None:
    from cutlass.base_dsl.jit_executor import JitFunctionArtifacts

    records = {"artifacts": {"t": "obj", "c": ["cutlass.base_dsl.jit_executor", "JitFunctionArtifacts"],
                             "v": {"PTX": "// ptx", "CUBIN": None, "MLIR": None}}}
    kernel = as_compiled.rebuild(lambda *a: None, _result(COMPILED, records), None, as_compiled.Payloads(lambda role: None))
    assert type(kernel.artifacts) is JitFunctionArtifacts and kernel.artifacts.PTX == "// ptx"
