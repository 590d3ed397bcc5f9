"""Small builders shared by the key, entry and store unit tests.

Nothing here imports flashinfer or the DSL: the unit tests build keys, environments and
artifacts by hand so each file runs in a second or two. The site keys copy the shapes of
flashinfer 0.6.15.post1's ``moe_dispatch`` ``cache_key`` tuples, so a key-encoding change that
would break the real adapter breaks these tests first.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import torch

from cute_diskcache.storage import entry
from cute_diskcache.keys.key import CacheKey, Environment

#: Field names of each kind's ``cache_key`` tuple, in order, as moe_dispatch builds them.
SITE_FIELDS: dict[str, tuple[str, ...]] = {
    "micro": (
        "kind", "state_E", "weight_E", "m", "k", "n", "num_topk", "max_rows", "mac",
        "mma_tiler_mn", "topk_ids_dtype", "input_scales_are_reciprocal", "fast_math",
        "share_input_across_experts", "share_expert_scales", "single_token", "activation",
        "swiglu_alpha", "swiglu_beta", "swiglu_limit",
    ),
    "static": (
        "kind", "activation_precision", "state_E", "weight_E", "m", "k", "n", "num_topk",
        "max_rows", "mac", "mma_tiler_mn", "topk_ids_dtype", "input_scales_are_reciprocal",
        "fast_math", "activation", "swiglu_alpha", "swiglu_beta", "swiglu_limit",
    ),
    "dynamic": (
        "kind", "activation_precision", "E", "k", "n", "num_topk", "mac", "mma_tiler_mn",
        "topk_ids_dtype", "input_scales_are_reciprocal", "fast_math", "activation",
        "swiglu_alpha", "swiglu_beta", "swiglu_limit", "share_input_across_experts",
    ),
}

#: Realistic keys: E128 top8 k2048 n768 on an RTX PRO 6000 (188 SMs), defaults elsewhere.
SITE_KEYS: dict[str, tuple[Any, ...]] = {
    "micro": (
        "micro", 128, 128, 1, 2048, 768, 8, 8, 188, (128, 128), torch.int32,
        False, True, False, False, True, "silu", 1.702, 1.0, None,
    ),
    "static": (
        "static", "fp4", 128, 128, 16, 2048, 768, 8, 128, 188, (128, 128), torch.int32,
        False, True, "silu", 1.702, 1.0, None,
    ),
    "dynamic": (
        "dynamic", "fp4", 128, 2048, 768, 8, 188, (128, 128), torch.int32,
        False, True, "silu", 1.702, 1.0, None, False,
    ),
}

#: The options string moe_dispatch passes to ``cute.compile`` at all three sites.
OPTIONS = "--opt-level 2 --enable-tvm-ffi"


def make_env(**changes: Any) -> Environment:
    """An Environment with every field explicit, so digests never depend on the test host."""
    fields: dict[str, Any] = dict(
        kind="flashinfer-moe",
        package="flashinfer-python==0.6.15.post1",
        sources="5" * 64,
        arch="sm_120a",
        dsl=(
            ("apache-tvm-ffi", "0.1.15.post2"),
            ("nvidia-cutlass-dsl", "4.8.1"),
            ("nvidia-cutlass-dsl-libs-base", "4.8.1"),
        ),
        codegen_env=(),
        machine="x86_64",
    )
    fields.update(changes)
    return Environment(**fields)


def make_key(kind: str = "micro", *, env: Environment | None = None, site_key: Any = None, options: Any = OPTIONS) -> CacheKey:
    """A CacheKey as the adapter builds it for ``kind``'s site."""
    return CacheKey(
        env if env is not None else make_env(),
        f"flashinfer.moe_dispatch.{kind}",
        SITE_KEYS[kind] if site_key is None else site_key,
        options,
    )


# --------------------------------------------------------------------------------------------
# Synthetic ELF images
# --------------------------------------------------------------------------------------------

EM_X86_64 = 62
EM_CUDA = 190
_SHT_PROGBITS = 1
_SHT_NOBITS = 8


def _section_header(sh_type: int, offset: int, size: int) -> bytes:
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize.
    return struct.pack("<IIQQQQIIQQ", 0, sh_type, 0, 0, offset, size, 0, 0, 1, 0)


def make_elf(machine: int = EM_CUDA, body: bytes = b"\x11" * 40, *, nobits_size: int = 1 << 20) -> bytes:
    """A minimal little-endian ELF64 image: header, one PROGBITS section, one NOBITS section.

    The NOBITS section claims ``nobits_size`` bytes that occupy no file space: a reader that
    counted them would run past the image.
    """
    shoff = 64 + len(body)
    sections = [
        _section_header(0, 0, 0),  # SHT_NULL
        _section_header(_SHT_PROGBITS, 64, len(body)),
        _section_header(_SHT_NOBITS, shoff, nobits_size),
    ]
    ident = b"\x7fELF\x02\x01\x01" + b"\x00" * 9
    header = ident + struct.pack(
        "<HHIQQQIHHHHHH",
        1,  # e_type ET_REL
        machine,
        1,  # e_version
        0,  # e_entry
        0,  # e_phoff
        shoff,
        0,  # e_flags
        64,  # e_ehsize
        0,  # e_phentsize
        0,  # e_phnum
        64,  # e_shentsize
        len(sections),
        0,  # e_shstrndx
    )
    assert len(header) == 64
    return header + body + b"".join(sections)


def make_object(cubins: list[bytes]) -> bytes:
    """A fake exported object: a host ELF header at offset 0, then the cubins among junk."""
    out = make_elf(EM_X86_64, b"host code " * 8)
    for i, cubin in enumerate(cubins):
        out += b"\x00junk%d\x7fEL" % i + cubin
    return out + b"trailing host data"


def make_artifact(
    cubin_bodies: tuple[bytes, ...] = (b"\x22" * 48,),
    *,
    mlir: str | None = "module {\n  gpu.module @k {}\n}\n",
    extra: dict[str, Any] | None = None,
) -> entry.Artifact:
    """An Artifact with synthetic bytes and one real-looking CUDA ELF per body."""
    cubins = [make_elf(EM_CUDA, body) for body in cubin_bodies]
    obj = make_object(cubins)
    return entry.Artifact(
        object_bytes=obj,
        symbol="cdc_test",
        tvm_ffi=True,
        cubins=entry.cubins_in(obj),
        mlir_text=mlir,
        compile_seconds=2.0,
        export_seconds=0.01,
        extra=dict(extra or {}),
    )


# --------------------------------------------------------------------------------------------
# Entry files
# --------------------------------------------------------------------------------------------


def payload_path(entry_dir: Path, manifest: dict[str, Any], role: str, index: int = 0) -> Path:
    return entry_dir / manifest["payloads"][role][index]["file"]


def flip_byte(path: Path, at: int | None = None) -> None:
    """Invert one byte (the middle one by default) in place."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def rewrite_manifest(entry_dir: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` as a valid, sealed manifest: tests of the semantic checks behind the seal."""
    (entry_dir / entry.MANIFEST).write_bytes(entry.pack_manifest(manifest))


def mlir_of(entry_dir: Path, manifest: dict[str, Any]) -> str:
    """The stored MLIR as text: zlib text (``.mlir.zz``), or bytecode (``.mlirbc.zz``) printed by the DSL's bindings."""
    path = payload_path(entry_dir, manifest, "mlir")
    raw = zlib.decompress(path.read_bytes())
    if not path.name.endswith(".mlirbc.zz"):
        return raw.decode()
    from cutlass._mlir import ir

    ctx = ir.Context()
    ctx.allow_unregistered_dialects = True
    return str(ir.Module.parse(raw, ctx))
