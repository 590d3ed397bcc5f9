"""Reading the ELF images the DSL produces: the cubins inside an exported object, and what the
driver would read from a cubin's ``.nv.info`` records.

One parser, so the artifact format (which cubins an entry stores) and flashinfer's block-dim
probe stand-in (how many threads a kernel can launch) read cubins the same way. Nothing here
needs a GPU, a DSL or a CUDA toolkit: the layout is plain ELF64 plus NVIDIA's documented
``EIATTR`` record encoding.
"""

from __future__ import annotations

import struct
from typing import NamedTuple
from collections.abc import Iterator

EM_CUDA = 190
_SHT_SYMTAB, _SHT_NOBITS = 2, 8
#: ``(e_machine, EI_CLASS)`` of the host code each machine runs (64-bit, little-endian both):
#: what an entry's object or shared object must say before a process maps it.
HOST_CODE = {"x86_64": (62, 2), "aarch64": (183, 2)}
_ELFDATA2LSB = 1


class Section(NamedTuple):
    name: str
    type: int
    offset: int
    size: int  # bytes in the file (0 for SHT_NOBITS)
    link: int


def machine(image: bytes) -> int | None:
    """``e_machine`` of an ELF image (62 x86_64, 183 aarch64, 190 CUDA), or None when it is not one."""
    if len(image) < 20 or not image.startswith(b"\x7fELF"):
        return None
    return int(struct.unpack_from("<H", image, 18)[0])


def host_machine(image: bytes) -> str | None:
    """The machine whose host code an ELF image holds (``x86_64``, ``aarch64``: machine and
    class both), or None: not ELF, big-endian, 32-bit, or a machine no entry is written for.
    Read from the header alone, so a process can say what an object is for without mapping it."""
    if len(image) < 20 or not image.startswith(b"\x7fELF") or image[5] != _ELFDATA2LSB:
        return None
    found = (int(struct.unpack_from("<H", image, 18)[0]), image[4])
    return next((name for name, code in HOST_CODE.items() if code == found), None)


def sections(image: bytes) -> list[Section]:
    """The section headers of a 64-bit little-endian ELF image; ``struct.error`` or
    ``ValueError`` when it is damaged."""
    shoff = struct.unpack_from("<Q", image, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    # Elf64_Shdr: name, type (u32), flags, addr, offset, size (u64), link (u32), ...
    raw = [struct.unpack_from("<IIQQQQI", image, shoff + i * shentsize) for i in range(shnum)]
    names_at = raw[shstrndx][4]
    return [Section(_cstr(image, names_at + name), kind, offset, 0 if kind == _SHT_NOBITS else size, link)
            for name, kind, _flags, _addr, offset, size, link in raw]


def symbols(image: bytes, secs: list[Section] | None = None) -> list[tuple[str, int, int, int, int, int]]:
    """``.symtab`` in index order: (name, info, other, shndx, value, size); empty without one."""
    secs = sections(image) if secs is None else secs
    table = next((s for s in secs if s.type == _SHT_SYMTAB), None)
    if table is None:
        return []
    names_at = secs[table.link].offset
    out = []
    for i in range(table.size // 24):
        name, info, other, shndx, value, size = struct.unpack_from("<IBBHQQ", image, table.offset + i * 24)
        out.append((_cstr(image, names_at + name), info, other, shndx, value, size))
    return out


def _cstr(image: bytes, at: int) -> str:
    return image[at:image.index(b"\0", at)].decode(errors="replace")


def _elf_end(buf: bytes, at: int) -> int | None:
    """End offset of a CUDA ELF image starting at ``at`` (headers and every section), or None."""
    try:
        machine = struct.unpack_from("<H", buf, at + 18)[0]
        phoff, shoff = struct.unpack_from("<QQ", buf, at + 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", buf, at + 54)
        if machine != EM_CUDA or shnum == 0 or shentsize < 64:
            return None
        end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
        for i in range(shnum):
            sh = at + shoff + i * shentsize
            sh_type = struct.unpack_from("<I", buf, sh + 4)[0]
            sh_offset, sh_size = struct.unpack_from("<QQ", buf, sh + 24)
            if sh_type != _SHT_NOBITS:  # occupies no file bytes
                end = max(end, sh_offset + sh_size)
    except struct.error:
        return None
    return at + end if at + end <= len(buf) else None


def cubins_in(obj: bytes) -> list[bytes]:
    """The cubins embedded in an exported object: ELF images whose machine is EM_CUDA.

    The DSL lowers ``gpu.binary`` into an LLVM global before we see the module, so the object
    is the one place every DSL version leaves the cubin; reading it back from there needs
    nothing but the ELF header.
    """
    found: list[bytes] = []
    start = 1  # the object itself is the host ELF at offset 0
    while True:
        at = obj.find(b"\x7fELF\x02\x01", start)
        if at < 0 or at + 64 > len(obj):
            return found
        end = _elf_end(obj, at)
        if end is not None:
            found.append(obj[at:end])
            start = end
        else:
            start = at + 1


_EIATTR_MAX_THREADS, _EIATTR_REQNTID, _EIATTR_REGCOUNT = 0x05, 0x10, 0x2F


def kernel_facts(cubin: bytes) -> dict[str, int]:
    """Register count and reqntid/maxntid of the kernels in one cubin (``.nv.info`` records).

    ``EIATTR_REGCOUNT`` sits in the global ``.nv.info`` as (symbol index, count) for every
    function; only kernels (those with their own ``.nv.info.<name>`` section) count.
    """
    secs = sections(cubin)
    names = [sec.name for sec in secs]
    kernels = {n[len(".nv.info."):] for n in names if n.startswith(".nv.info.")}
    syms = symbols(cubin, secs)

    def symbol(index: int) -> str | None:
        return syms[index][0] if index < len(syms) else None

    regs = ntid = 0
    for i, name in enumerate(names):
        if name != ".nv.info" and not name.startswith(".nv.info."):
            continue
        offset, size = secs[i].offset, secs[i].size
        for attr, data in _records(cubin[offset:offset + size]):
            if attr == _EIATTR_REGCOUNT and len(data) >= 8:
                sym, count = struct.unpack_from("<II", data)
                if not syms or symbol(sym) in kernels:
                    regs = max(regs, count)
            elif attr in (_EIATTR_REQNTID, _EIATTR_MAX_THREADS) and len(data) >= 12:
                x, y, z = struct.unpack_from("<III", data)
                ntid = max(ntid, x * max(y, 1) * max(z, 1))
    return {"regs": regs, "ntid": ntid}


def _records(blob: bytes) -> Iterator[tuple[int, bytes]]:
    pos = 0
    while pos + 4 <= len(blob):
        fmt, attr = blob[pos], blob[pos + 1]
        if fmt == 0x04:  # EIFMT_SVAL: u16 size, then the value
            size = struct.unpack_from("<H", blob, pos + 2)[0]
            yield attr, blob[pos + 4:pos + 4 + size]
            pos += 4 + size
        else:  # NVAL / BVAL / HVAL: the value (if any) fits the 2 bytes after the header
            yield attr, blob[pos + 2:pos + 4]
            pos += 4
