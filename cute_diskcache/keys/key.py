"""Cache keys: a canonical, injective byte encoding of a call site's key plus its environment.

Two different keys must never share bytes, or a wrong kernel is served. Python's ``repr`` and
``hash`` are not enough: ``repr`` of a float loses nothing but ``True == 1`` and ``0.0 == -0.0``
compare equal, and dtype objects have no stable hash across processes. So every element is
written with an explicit type tag, floats as their IEEE-754 bits, and the tagged tree is packed
with msgpack, whose output is deterministic for lists, ints, strings and bytes.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.metadata
import marshal
import math
import os
import re
import stat
import struct
import sys
from pathlib import Path
from dataclasses import dataclass, field
from types import CodeType, ModuleType
from typing import Any
from collections.abc import Iterable, Mapping

import msgpack

from .. import config

#: Bumped when the encoding or the manifest layout changes; old entries then simply miss.
FORMAT_VERSION = 1

_NAN_BITS = struct.pack(">d", math.nan)


class UnkeyableError(TypeError):
    """A key element has no canonical encoding; the compile is not cached (never guessed)."""


class Plain:
    """A key element tree of exact built-ins, encoded in one C call: the hit path's key.

    A compile hook keys everything a compile receives (a few hundred tuples, strings and ints),
    once per kernel per process, on the request that has to go to the disk cache; tagging it
    element by element here costs more than the cache's whole hit. ``marshal`` format 2 writes a
    tree of exact ``tuple``, ``str``, ``int``, ``float``, ``bool``, ``None`` and ``bytes`` in C and
    is injective on it: it reads back to an equal tree of the same types (``True`` is not ``1``,
    ``-0.0`` is not ``0.0``), and format 2 has no back-references, so the bytes do not depend on
    what else refers to an element. A subclass of ``int`` or ``str`` is refused (unkeyable, never
    keyed by a lossy text). The caller builds the tree from those types only: marshal would also
    write a set (in hash order: other bytes per process, misses) or a bytes-like object (as
    bytes). A later Python that wrote these types differently would give the same tree other
    bytes: misses. ``repr`` shows the tree, for manifests and messages.
    """

    __slots__ = ("tree", "data")

    def __init__(self, tree: Any) -> None:
        try:
            data = marshal.dumps(tree, 2)
        except ValueError as exc:  # marshal's only word for "holds a type I do not write"
            raise UnkeyableError(f"key holds an element that is not a plain built-in ({exc})") from None
        self.tree, self.data = tree, data

    def __repr__(self) -> str:
        return repr(self.tree)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plain) and self.data == other.data

    def __hash__(self) -> int:
        return hash(self.data)


def _tag(value: Any, depth: int = 0) -> Any:
    if depth > 64:
        raise UnkeyableError("key nested deeper than 64 levels")
    # Exact types first, by one dict lookup: a site key is ~600 small elements and this runs on
    # every first request of a kernel in a process (the hit path). Subclasses take the checks below.
    kind = _EXACT.get(type(value))
    if kind is not None:
        if kind == "t":  # leaves inline: most of a site key is short tuples of strings and ints
            out = []
            for v in value:
                leaf = _EXACT.get(type(v))
                if leaf == "s" or leaf == "b" or (leaf == "i" and -(2**63) <= v < 2**64):
                    out.append([leaf, v])
                elif leaf == "n":
                    out.append(["n"])
                else:
                    out.append(_tag(v, depth + 1))
            return ["t", out]
        if kind == "i" and not -(2**63) <= value < 2**64:
            return ["I", str(value)]
        return [kind, value] if kind != "n" else ["n"]
    if type(value) is Plain:  # already canonical bytes; "p" keeps them apart from any tagged tree
        return ["p", value.data]
    # bool before int: True must not encode like 1.
    if value is None:
        return ["n"]
    if isinstance(value, bool):
        return ["b", value]
    if isinstance(value, enum.Enum):
        return ["e", _qualname(type(value)), _tag(value.value, depth + 1)]
    if isinstance(value, int):
        # msgpack takes 64-bit ints; bigger ones go through their decimal text.
        return ["i", value] if -(2**63) <= value < 2**64 else ["I", str(value)]
    if isinstance(value, float):
        # Bits, not repr: -0.0 and 0.0 differ, every nan is one nan.
        return ["f", _NAN_BITS if math.isnan(value) else struct.pack(">d", value)]
    if isinstance(value, str):
        return ["s", value]
    if isinstance(value, bytes):
        return ["y", value]
    if isinstance(value, tuple):
        return ["t", [_tag(v, depth + 1) for v in value]]
    if isinstance(value, list):
        return ["l", [_tag(v, depth + 1) for v in value]]
    if isinstance(value, Mapping):
        items = [(_pack(_tag(k, depth + 1)), _tag(v, depth + 1)) for k, v in value.items()]
        return ["d", [[k, v] for k, v in sorted(items, key=lambda kv: kv[0])]]
    if isinstance(value, (frozenset, set)):
        return ["S", sorted(_pack(_tag(v, depth + 1)) for v in value)]
    mod = type(value).__module__
    if mod == "torch" and type(value).__name__ == "dtype":
        return ["torch.dtype", str(value)]
    if isinstance(value, type):
        # cutlass numeric types (cutlass.Float4E2M1FN ...) are classes.
        return ["type", _qualname(value)]
    raise UnkeyableError(f"no canonical encoding for {type(value).__module__}.{type(value).__qualname__}")


#: Exact built-in types -> their tag (what the isinstance chain below gives them, faster).
_EXACT: dict[type, str] = {str: "s", int: "i", tuple: "t", bool: "b", type(None): "n", bytes: "y"}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _pack(tree: Any) -> bytes:
    return msgpack.packb(tree, use_bin_type=True)


def encode(value: Any) -> bytes:
    """Canonical bytes of a key element tree; raises :class:`UnkeyableError` if impossible."""
    return _pack(_tag(value))


@functools.lru_cache(maxsize=4096)
def code_digest(code: CodeType) -> str:
    """sha256 of what a function's code object does, for keys that name a function.

    A function's module and qualified name do not say which code it is: two lambdas of one
    module share both, and so do the closures one factory returns. What the interpreter runs
    is: the bytecode, the names and constants it uses (nested code objects, such as inner
    functions and comprehensions, recursively), its argument layout and flags. File name and
    line numbers are left out, so a function moved within its file keeps its entries (its
    module's source hash still sees the edit).
    """
    return hashlib.sha256(encode(_code_tree(code, 0))).hexdigest()


def _code_tree(code: CodeType, depth: int) -> Any:
    if depth > 32:
        raise UnkeyableError("code objects nested deeper than 32 levels")
    return ("code", code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
            code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
            tuple(_const(c, depth) for c in code.co_consts))


def _const(value: Any, depth: int) -> Any:
    """A code object's constant as key data; a frozenset (``x in {..}``) in a stable order."""
    if isinstance(value, CodeType):
        return _code_tree(value, depth + 1)
    if isinstance(value, tuple):
        return ("tuple", tuple(_const(v, depth) for v in value))
    if isinstance(value, frozenset):
        return ("frozenset", tuple(sorted((_const(v, depth) for v in value), key=encode)))
    if value is Ellipsis:
        return ("ellipsis",)
    if isinstance(value, complex):
        return ("complex", value.real, value.imag)
    return value


# --------------------------------------------------------------------------------------------
# Environment: everything outside the call site's own key that changes the compiled bytes.
# --------------------------------------------------------------------------------------------

#: DSL variables that change logging, dumping or caching but never the generated code.
#: Every other ``CUTE_DSL_*`` variable is keyed: an unknown knob costs a miss, never a wrong kernel.
_NON_CODEGEN_DSL_ENV = frozenset(
    {
        "CUTE_DSL_LOG_TO_CONSOLE",
        "CUTE_DSL_LOG_TO_FILE",
        "CUTE_DSL_LOG_LEVEL",
        "CUTE_DSL_PRINT_IR",
        "CUTE_DSL_PRINT_AFTER_PREPROCESSOR",
        "CUTE_DSL_SHOW_STACKTRACE",
        "CUTE_DSL_NO_CACHE",
        "CUTE_DSL_JIT_CACHE_MAX_ELEMS",
        "CUTE_DSL_DUMP_DIR",
        "CUTE_DSL_CACHE_DIR",
        "CUTE_DSL_KEEP",
        "CUTE_DSL_KEEP_IR",
        "CUTE_DSL_KEEP_PTX",
        "CUTE_DSL_KEEP_CUBIN",
        "CUTE_DSL_KEEP_SASS",
        "CUTE_DSL_WARNINGS_IGNORE",
        "CUTE_DSL_ENABLE_OPTIMIZATION_WARNINGS",
        "CUTE_DSL_DISABLE_FILE_CACHING",
        "CUTE_DSL_JIT_TIME_PROFILING",
        "CUTE_DSL_ARCH",  # keyed separately, as the target arch
    }
)


def codegen_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables that can change generated code, as a sorted dict."""
    environ = os.environ if environ is None else environ
    return {
        k: environ[k]
        for k in sorted(environ)
        if k.startswith("CUTE_DSL_") and k not in _NON_CODEGEN_DSL_ENV
    }


_DSL_CORE = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core", "apache-tvm-ffi")


def _dsl_flavour() -> str | None:
    """``cu12`` or ``cu13``: which CUDA build of the DSL libraries this process actually loads."""
    try:
        from cutlass.cute.runtime import find_runtime_libraries

        for path in find_runtime_libraries(enable_tvm_ffi=False):
            for part in Path(path).parts:
                if part in ("cu12", "cu13") or (part.startswith("cu") and part[2:].isdigit()):
                    return part
    except Exception:  # noqa: BLE001 - no DSL runtime to ask: the flavour is unknown, and the key says so
        return None
    return None


@functools.cache
def dsl_stack() -> tuple[tuple[str, str], ...]:
    """The DSL distributions this process compiles with, and apache-tvm-ffi, with versions.

    Measured: an object built with DSL 4.8.1 fails to load under 4.6.3, and the libs wheels
    version independently of the front end, so each is keyed. Only the CUDA flavour of the libs
    actually loaded counts: the DSL's default install pulls in both cu12 and cu13 libs, and
    keying an unused one made a cache built on a CPU box miss on a GPU box whose image lacked
    it (measured on the H200, bench/results/h200_offline_vs_device.json). Names are looked up
    directly: scanning every installed distribution took 67-129 ms on a GPU image.
    When the flavour cannot be determined, every installed libs flavour is keyed (a miss, never
    a wrong kernel).
    """
    names = list(_DSL_CORE)
    flavour = _dsl_flavour()
    if flavour is not None:
        names.append(f"nvidia-cutlass-dsl-libs-{flavour}")
    else:
        names += [
            (d.metadata.get("Name") or "").lower().replace("_", "-")
            for d in importlib.metadata.distributions()
            if (d.metadata.get("Name") or "").lower().replace("_", "-").startswith("nvidia-cutlass-dsl-libs-")
        ]
    found: dict[str, str] = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(sorted(found.items()))


def dsl_stack_string(stack: Iterable[tuple[str, str]] | None = None) -> str:
    return ",".join(f"{n}=={v}" for n, v in (dsl_stack() if stack is None else stack))


def _device_class() -> str:
    from .devicefacts import device_class  # imports targets; kept off the import of this module

    return device_class()


def _host_machine() -> str:
    from .hostmachine import current

    return current()


def current_arch() -> str:
    """The arch the DSL will compile for: ``CUTE_DSL_ARCH``, else the DSL's own detection."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    try:
        from cutlass.base_dsl.env_manager import detect_gpu_arch

        return str(detect_gpu_arch("CUTE_DSL"))
    except Exception:  # noqa: BLE001 - older DSLs; fall back to torch's view of the device
        import torch

        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


#: Environment reads in Python source: ``os.environ.get("X")``, ``os.environ["X"]``,
#: ``os.getenv("X")``, ``"X" in os.environ``, and helpers named like ``_env_flag("X")``.
_ENV_READ = re.compile(
    rb"""(?:environ(?:\.get|\.setdefault|\.pop)?\s*[\[(]\s*|getenv\(\s*|\b\w*(?i:env)\w*\(\s*)["']([A-Z][A-Z0-9_]{2,})["']"""
    rb"""|["']([A-Z][A-Z0-9_]{2,})["']\s+(?:not\s+)?in\s+(?:os\.)?environ\b"""
)
#: Variables a module may read that never change the code a compile generates: paths and
#: tools, process placement, and our own settings. Everything else a kernel's modules read is
#: keyed (a value constant within a process never needs to be in an in-process key, but a disk
#: cache shared across processes must hold it). ``CUTE_DSL_*`` variables are keyed by
#: :func:`codegen_env` under their own rules; a site adapter adds its library's own such
#: variables (flashinfer's logging and cache paths: :mod:`..flashinfer_sites`).
NOT_CODEGEN_ENV = frozenset({
    # paths, tools, the shell
    "HOME", "USER", "USERNAME", "PATH", "PATHEXT", "TMPDIR", "TERM", "LIB", "INCLUDE", "CC", "CXX", "MAX_JOBS",
    "CUDA_HOME", "CUDA_PATH", "CUDA_TOOLKIT_PATH", "GITHUB_OUTPUT",
    # process placement: which GPU and rank, not what is compiled for it (the device facts are checked apart)
    # (NVIDIA_*: what the NVIDIA container runtime sets in every GPU container; a key holding one
    # made every CPU-prewarmed entry of a library that reads it miss in a GPU pod, measured with
    # b12x on the lent H100: bench/gpu_proof_b12x.py)
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "CUFILE_ENV_PATH_JSON",
    "CUDA_LAUNCH_BLOCKING", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT",
    # our own switches
    config.ENABLE_ENV, *(env for env, _default in config.SETTINGS.values()),
})


def env_reads(source: bytes) -> tuple[str, ...]:
    """Names of the environment variables a module's source reads (sorted, deduplicated)."""
    return tuple(sorted({(a or b).decode() for a, b in _ENV_READ.findall(source)}))


@functools.cache
def _file_facts(path: str, size: int, mtime_ns: int) -> tuple[str, tuple[str, ...]]:
    """sha256 of a module file's bytes (source, ``.pyc`` or extension module alike) and the
    environment variables it reads (Python source only). Keyed on the file's stat, so an edited
    file is read again and an unchanged one costs one ``stat``."""
    with open(path, "rb") as fh:
        data = fh.read()
    return hashlib.sha256(data).hexdigest(), env_reads(data) if path.endswith(".py") else ()


def module_code(mod: ModuleType) -> tuple[str, tuple[str, ...], tuple[Any, ...]] | None:
    """``(digest, environment reads, stamp)`` of one module's code; None for a namespace package.

    The module's file (source, ``.pyc`` alone, or a compiled extension: whatever runs), else
    the source its loader hands out (zip imports). ``stamp`` changes when the code does (the
    file's size and mtime): what a caller may compare to reuse a fingerprint. A module with code
    we cannot read raises :class:`UnkeyableError`: a key must never rest on nothing.
    """
    name = getattr(mod, "__name__", "?")
    path = getattr(mod, "__file__", None)
    if isinstance(path, str):
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode):
            digest, names = _file_facts(path, st.st_size, st.st_mtime_ns)
            return digest, names, (path, st.st_size, st.st_mtime_ns)
    loader = getattr(mod, "__loader__", None)
    get_source = getattr(loader, "get_source", None)
    if get_source is not None:
        try:
            text = get_source(name)
        except Exception:  # noqa: BLE001 - ImportError, OSError: the loader cannot give it
            text = None
        if isinstance(text, str):
            data = text.encode("utf-8", "surrogatepass")
            digest = hashlib.sha256(data).hexdigest()
            return digest, env_reads(data), ("source", digest)
    if path is None and hasattr(mod, "__path__"):
        return None  # a namespace package has no code of its own
    raise UnkeyableError(f"module {name} has no source or module file to fingerprint ({path or 'no __file__'})")


def reached_modules(root: ModuleType, package: str) -> dict[str, ModuleType]:
    """``root`` and every module of ``package`` it reaches through globals (see :func:`source_fingerprint`)."""
    seen: dict[str, ModuleType] = {}
    todo = [root]
    while todo:
        mod = todo.pop()
        name = getattr(mod, "__name__", "")
        if name in seen or not (name == package or name.startswith(package + ".")):
            continue
        seen[name] = mod
        is_package = hasattr(mod, "__path__")
        for value in list(vars(mod).values()):
            if isinstance(value, ModuleType):
                # A package holds every submodule anyone imported as an attribute: following
                # those would make the hash depend on import order, not on the code reached.
                if not (is_package and getattr(value, "__name__", "").startswith(name + ".")):
                    todo.append(value)
                continue
            owner = getattr(value, "__module__", None)
            if isinstance(owner, str) and owner not in seen and (owner == package or owner.startswith(package + ".")):
                owner_mod = sys.modules.get(owner)
                if owner_mod is not None:
                    todo.append(owner_mod)
    return seen


@dataclass(frozen=True)
class SourceFacts:
    """What the code a kernel comes from contributes to its key."""

    fingerprint: str  # sha256 over module names and their code digests
    env_reads: tuple[str, ...]  # environment variables that code reads (all, before NOT_CODEGEN_ENV)
    stamp: tuple[Any, ...]  # per module (name, file, size, mtime): equal stamps mean equal code


def source_facts(root: ModuleType, package: str) -> SourceFacts:
    """Fingerprint ``root``'s code and what it reaches in ``package``; see :func:`source_fingerprint`."""
    seen = reached_modules(root, package)
    h = hashlib.sha256()
    names: set[str] = set()
    stamp = []
    for name in sorted(seen):
        code = module_code(seen[name])
        if code is None:
            continue
        digest, reads, mod_stamp = code
        h.update(name.encode() + b"\0" + digest.encode() + b"\n")
        names.update(reads)
        stamp.append((name, *mod_stamp))
    return SourceFacts(h.hexdigest(), tuple(sorted(names)), tuple(stamp))


def source_fingerprint(root: ModuleType, package: str) -> str:
    """Hash the code of ``root`` and every module of ``package`` it reaches through globals.

    Content and module names only, never absolute paths: a cache copied to another install
    prefix (another venv, another container layout) must still hit. Reaching modules through
    globals follows exactly the code a kernel class pulls in (helpers in other subpackages too)
    without hashing all of flashinfer. Objects defined in the package root count too; a
    package's own submodule attributes do not (they are whatever happened to be imported).
    A module is hashed by what runs: its source file, a ``.pyc`` or extension module shipped
    without source, or the source a zip importer gives; one with none raises
    :class:`UnkeyableError`.
    """
    return source_facts(root, package).fingerprint


def code_stamp(stamp: tuple[Any, ...]) -> bool:
    """Whether every module file in a :class:`SourceFacts` stamp is unchanged (one ``stat`` each).

    Code read through a loader (zip imports) has no cheap stamp: never called unchanged.
    """
    for item in stamp:
        if item[1] == "source":
            return False
        _name, path, size, mtime_ns = item
        try:
            st = os.stat(path)
        except OSError:
            return False
        if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
            return False
    return True


def keyed_env(reads: Iterable[str], environ: Mapping[str, str] | None = None, *, not_codegen: Iterable[str] = ()) -> dict[str, str]:
    """The variables among ``reads`` that are set and may change codegen: part of a key.

    ``not_codegen``: more names to leave out, which the caller's library documents as logging,
    paths or caching (see :data:`NOT_CODEGEN_ENV`).
    """
    environ = os.environ if environ is None else environ
    skip = NOT_CODEGEN_ENV | frozenset(not_codegen)
    return {n: environ[n] for n in sorted(set(reads)) if n in environ and n not in skip and not n.startswith("CUTE_DSL_")}


@dataclass(frozen=True)
class Environment:
    """What, besides the call site's key, decides the compiled bytes.

    ``namespace`` groups entries that share all of it, so stale ones (another flashinfer, DSL
    or arch) can be pruned as a whole and a listing reads like ccache's.
    """

    kind: str  # which adapter made the key, e.g. "flashinfer-moe"
    package: str  # e.g. "flashinfer-python==0.6.15.post1"
    sources: str  # source_fingerprint(...)
    arch: str
    dsl: tuple[tuple[str, str], ...] = field(default_factory=dsl_stack)
    codegen_env: tuple[tuple[str, str], ...] = field(default_factory=lambda: tuple(codegen_env().items()))
    # host code: x86_64 vs aarch64 (DGX Spark); this machine's, or the one a prewarm for another
    # host's card writes (.hostmachine)
    machine: str = field(default_factory=lambda: _host_machine())
    # capability and SM count of the card compiled for (a target profile's or the live one's);
    # the other device facts a compile reads are recorded in its manifest (see .devicefacts)
    device: str = field(default_factory=lambda: _device_class())

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "kind": self.kind,
            "package": self.package,
            "sources": self.sources,
            "arch": self.arch,
            "dsl": [list(p) for p in self.dsl],
            "codegen_env": [list(p) for p in self.codegen_env],
            "machine": self.machine,
            "device": self.device,
        }

    @functools.cached_property
    def digest(self) -> str:
        return hashlib.sha256(encode(self.as_dict())).hexdigest()

    @functools.cached_property
    def namespace(self) -> str:
        """Readable and unique: ``flashinfer-moe-0.6.15.post1-sm_120a-x86_64-<hash12>``."""
        version = self.package.split("==")[-1]
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{self.kind}-{version}-{self.arch}-{self.machine}")
        return f"{safe}-{self.digest[:12]}"


@dataclass(frozen=True)
class CacheKey:
    """A call site's own key, its compile options, and the environment: one entry."""

    env: Environment
    site: str
    site_key: Any
    options: Any = None

    @functools.cached_property
    def key_bytes(self) -> bytes:
        return encode([self.site, self.site_key, self.options])

    @functools.cached_property
    def digest(self) -> str:
        return hashlib.sha256(bytes.fromhex(self.env.digest) + self.key_bytes).hexdigest()
