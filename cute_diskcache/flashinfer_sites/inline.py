"""flashinfer's inline compiles: sm12x kernels built inside an op, keyed by what the compile receives.

Some sm12x kernels are compiled in the middle of an op or a kernel runner (MSA's proxy score,
sparse decode and prefill; block-sparse attention; KDA prefill; GDN decode; the frost
low-latency MoE; the expert-parallel MoE's reduce and megakernels; on 0.6.12-0.6.17 the W4A16
MoE kernels, 0.6.17's direct micro kernel and 0.6.12/0.6.13's b12x dense GEMM). They share no compile
helper, several import ``cutlass.cute`` inside the function (no module global to proxy), and the
expert-parallel kernels are imported from a ``sys.path`` entry under names outside
``flashinfer.*``. So they are not patched one module at a time: the DSL's own
``cutlass.cute.compile`` is replaced, once, by a dispatcher that looks at its caller's code
object; a caller in :data:`SITES` (found by its file under flashinfer's package and its qualified
name) goes through the cache, every other caller reaches the real compile after one dict lookup.

Site key: everything the compile receives, as the DSL sees it (:func:`describe`), not
flashinfer's in-process key (which names a device index, or leaves out what a frame variable
fixes): the kernel object's class and every attribute it holds, a ``cute.jit`` function's
qualified name, defaults and closure (the reduce launchers close over the hidden size and the
grid), each tensor's element type, layout, alignment and memory space, fake tensors' symbolic
extents numbered by identity across the call (two tensors sharing a symbol compile to another
signature than two that do not), scalars and their DSL type, the stream's type, and the compile
options. The source of the site's module, of every flashinfer module the arguments come from,
and of the whole kernel tree for code imported from a ``sys.path`` entry joins the fingerprint,
with every environment variable that code reads. The device class (capability and SM count) is
part of every key's environment and driver attributes the compile reads are recorded and
checked (:mod:`..devicefacts`), which covers what these kernels ask of the card. An argument
:func:`describe` cannot describe, or options asking for artifacts a loaded kernel cannot
carry (PTX, CUBIN, dump directories), leave that compile in memory, with one warning.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.util
import inspect
import logging
import os
import sys
import threading
import types
import zlib
from pathlib import Path
from typing import Any

from ..key import Environment, UnkeyableError, code_digest, codegen_env, current_arch, env_reads, keyed_env
from . import _common, gemm
from ._common import NOT_CODEGEN_ENV, Call, Site, arg_signature, options_text

log = logging.getLogger("cute_diskcache")


@dataclasses.dataclass(frozen=True)
class Inline:
    """One function that compiles inline: its file under flashinfer's package, its qualified name."""

    file: str
    function: str  # qualified name as the site scan spells it ("launch_fwd._compile", "Cls.method")
    kind: str
    family: str  # site name flashinfer.<family>.<kind>; namespace flashinfer-<family>
    #: Code imported through a ``sys.path`` entry (not as ``flashinfer.*``): the directory, under
    #: flashinfer's package, whose every ``.py`` file joins the fingerprint.
    tree: str | None = None
    #: The first release where this function no longer compiles in place (None: none yet): from
    #: there on it calls a compile wrapper that is the site, or :mod:`.v0_7` serves that wrapper.
    before: tuple[int, ...] | None = None

    def applies(self, version: str) -> bool:
        return self.before is None or _common.version_tuple(version)[:3] < self.before


_EP = "moe_ep/kernel_src/sm120"
_SPLIT = f"{_EP}/split_cutedsl_megakernel"
_SWAPAB = f"{_EP}/swapab_cutedsl_megakernel"
_KDA = "kda_kernels/sm120_prefill"
_MOE = "fused_moe/cute_dsl/blackwell_sm12x"
_W4A16 = f"{_MOE}/moe_w4a16_kernel.py"

SITES = (
    Inline("msa_ops/proxy_score.py", "msa_proxy_score", "msa_proxy_score", "msa"),
    Inline("msa_ops/proxy_score.py", "msa_proxy_score_fp4", "msa_proxy_score_fp4", "msa"),
    Inline("msa_ops/sparse_decode.py", "msa_sparse_decode_attention", "msa_sparse_decode", "msa"),
    Inline("msa_ops/sparse_prefill.py", "_msa_sparse_prefill", "msa_sparse_prefill", "msa"),
    Inline("cute_dsl/sparse/bsa_attn_sm120.py", "bsa_attn_sm120_blk64_fwd", "bsa_fwd", "bsa"),
    Inline("cute_dsl/sparse/bsa_attn_sm120.py", "bsa_attn_sm120_blk64_sage_fwd", "bsa_sage_fwd", "bsa"),
    Inline(f"{_KDA}/decomp.py", "launch_prepare_device", "kda_prepare", "kda"),
    Inline(f"{_KDA}/decomp.py", "launch_recurrence_device", "kda_recurrence", "kda"),
    Inline(f"{_KDA}/decomp.py", "launch_fwd._compile", "kda_fwd", "kda"),
    Inline(f"{_KDA}/fused.py", "prepare_launch._compile", "kda_fused", "kda"),
    Inline("gdn_kernels/delta_rule_dsl/custom_compile_cache.py", "cached_compile", "gdn_delta_rule", "gdn"),
    Inline("gdn_kernels/experimental/kernel/gdn_fused_decode_cutedsl_sm120_pdl.py", "execute", "gdn_decode", "gdn"),
    Inline("fused_moe/backends/frost_low_latency/tc/deepseek_fp8.py", "execute", "frost_deepseek_fp8", "frost"),
    Inline("fused_moe/backends/frost_low_latency/tc/runtime.py", "execute", "frost_grouped", "frost"),
    Inline(f"{_SPLIT}/shim/runtime.py", "MegaMoESm120W4A8Frontend._ensure_compiled", "ep_w4a8_mega", "moe-ep", _SPLIT),
    Inline(f"{_SPLIT}/src/moe_sm120_mxfp4mxfp8_split/kernel_combine_reduce.py", "compile_topk_reduce",
           "ep_topk_reduce", "moe-ep", _SPLIT),
    Inline(f"{_SPLIT}/src/moe_sm120_mxfp4mxfp8_split/kernel_combine_reduce.py", "compile_gated_topk_reduce",
           "ep_gated_topk_reduce", "moe-ep", _SPLIT),
    Inline(f"{_SPLIT}/src/moe_sm120_mxfp4mxfp8_split/kernel_combine_reduce.py", "compile_persistent_topk_reduce",
           "ep_persistent_topk_reduce", "moe-ep", _SPLIT),
    Inline(f"{_SPLIT}/src/moe_sm120_mxfp4mxfp8_split/kernel_rank_local_combine.py", "compile_rank_local_combine",
           "ep_rank_local_combine", "moe-ep", _SPLIT),
    Inline(f"{_SWAPAB}/shim/mxfp8.py", "MegaMoESm120Mxfp8Frontend._ensure_mega_compiled", "ep_mxfp8_mega", "moe-ep", _SWAPAB),
    Inline(f"{_SWAPAB}/src/moe_nvfp4_swapab/megamoe_kernel.py", "Sm100MegaMoEKernel.aot_compile", "ep_swapab_aot",
           "moe-ep", _SWAPAB),
    Inline(f"{_SWAPAB}/src/moe_sm120_mxfp8_swapab/topk_reduce.py", "compile_topk_reduce", "ep_mxfp8_topk_reduce",
           "moe-ep", _SWAPAB),
    # The W4A16 MoE kernels compile in place up to 0.6.16; from 0.6.17 through the memoising
    # wrapper below, which from 0.6.18 on :mod:`.v0_7` replaces (one kernel, one entry). All take
    # the site name v0_7 gives that wrapper's kernels; the key tells them apart (site, kernel, tensors).
    Inline(_W4A16, "compile_w4a16_gemm", "w4a16", "moe_w4a16_compiler", before=(0, 6, 17)),
    Inline(_W4A16, "compile_w4a16_fused_moe", "w4a16", "moe_w4a16_compiler", before=(0, 6, 17)),
    Inline(_W4A16, "compile_w4a16_activation", "w4a16", "moe_w4a16_compiler", before=(0, 6, 17)),
    Inline(_W4A16, "compile_w4a16_topk_sum", "w4a16", "moe_w4a16_compiler", before=(0, 6, 17)),
    Inline(f"{_MOE}/moe_w4a16_compiler.py", "compile", "w4a16", "moe_w4a16_compiler", before=(0, 6, 18)),
    # 0.6.17's direct micro MoE kernel (from 0.6.18 :mod:`.v0_7`'s proxy serves it), with its
    # block-dim probe answer stored beside it (:func:`_direct_micro_site`).
    Inline(f"{_MOE}/moe_direct_micro_kernel.py", "compile_direct_micro_kernel", "direct_micro", "moe_direct_micro_kernel",
           before=(0, 6, 18)),
    # 0.6.12/0.6.13's b12x dense GEMM getter (``functools.cache``; it returns a closure around the
    # kernel, so the getter's result cannot be stored: the compile inside it is). Gone in 0.6.14.
    Inline("gemm/kernels/dense_blockscaled_gemm_sm120_b12x.py", "_get_compiled_dense_gemm", "b12x_dense_gemm", "gemm"),
)
_BY_WHERE = {(s.file, s.function): s for s in SITES}
#: What ``doctor`` says of these sites.
NOTE = "compiled inline; keyed by everything the compile receives (an argument it cannot describe: uncached, one warning)"
_MARKER = "_cdc_inline"


def covered(package_dir: Path, version: str | None = None) -> dict[tuple[str, str], str]:
    """(file as the site scan names it, function) -> kind for the sites the release defines (by name
    in its file) and compiles in place (:attr:`Inline.before`; default: the installed release)."""
    from .names import table_name

    version = version or _common.flashinfer_version()
    out = {}
    for s in SITES:
        if not s.applies(version):
            continue
        path = package_dir / s.file
        name = s.function.rpartition(".")[2]
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if f"def {name}(" in text:
            out[(table_name(s.file), s.function)] = s.kind
    return out


# --------------------------------------------------------------------------------------------
# What the compile receives, as data
# --------------------------------------------------------------------------------------------


class _Describer:
    """One call's arguments as key data; collects the modules the code comes from.

    Symbolic extents (``cute.sym_int()``) are numbered in order of first appearance across the
    whole call: the same symbol in two tensors ties their extents in the compiled signature.
    """

    def __init__(self) -> None:
        self.modules: dict[str, None] = {}
        self._symbols: dict[int, int] = {}
        self._keep: list[Any] = []  # keeps described symbols alive so ids stay unique for this call

    def _module(self, name: Any) -> None:
        if isinstance(name, str) and _ours(name):
            self.modules[name] = None

    def __call__(self, value: Any, depth: int = 0) -> Any:
        if depth > 32:
            raise UnkeyableError("compile argument nested deeper than 32 levels")
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return value
        if isinstance(value, enum.Enum):
            return ("enum", _qualname(type(value)), value.name)
        cls = type(value)
        mod = cls.__module__
        if isinstance(value, (tuple, list)):
            tag = "namedtuple:" + _qualname(cls) if hasattr(value, "_fields") else cls.__name__
            return (tag, tuple(self(v, depth + 1) for v in value))
        if isinstance(value, dict):
            items = [(self(k, depth + 1), self(v, depth + 1)) for k, v in value.items()]
            return ("dict", tuple(sorted(items, key=repr)))
        if isinstance(value, type):
            self._module(value.__module__)
            return ("class", _qualname(value))
        if mod == "torch" and cls.__name__ in ("dtype", "device", "Size"):
            return ("torch." + cls.__name__, str(value) if cls.__name__ != "device" else value.type)
        if dataclasses.is_dataclass(value):
            self._module(mod)
            fields = tuple((f.name, self(getattr(value, f.name), depth + 1)) for f in dataclasses.fields(value))
            return ("dataclass", _qualname(cls), fields)
        if isinstance(value, functools.partial):
            return ("partial", self(value.func, depth + 1), self(value.args, depth + 1), self(value.keywords, depth + 1))
        if isinstance(value, types.MethodType):
            func = value.__func__
            return ("method", self(value.__self__, depth + 1),
                    self._function(func, depth) if isinstance(func, types.FunctionType) else self(func, depth + 1))
        if isinstance(value, types.FunctionType):
            return self._function(value, depth)
        if cls.__name__ == "SymInt" and mod.startswith("cutlass"):
            return self._symbol(value)
        if cls.__name__ == "_FakeTensor" and mod.startswith("cutlass"):
            return ("fake_tensor", str(value.element_type), self(tuple(value.shape), depth + 1),
                    self(tuple(value.stride), depth + 1), getattr(value, "_assumed_align", None),
                    str(getattr(value, "memspace", None)), getattr(value, "_use_32bit_stride", None))
        if _ours(mod) and hasattr(value, "__dict__"):  # a kernel object: its class and its whole state
            self._module(mod)
            state = tuple(sorted((k, self(v, depth + 1)) for k, v in vars(value).items()))
            return ("object", _qualname(cls), state)
        if mod.startswith(_DSL_MODULES) or (mod.startswith("torch.") and "stream" in cls.__qualname__.lower()):
            return arg_signature(value)  # runtime tensors, streams, DSL numerics; refuses the rest
        raise UnkeyableError(f"no description for compile argument of type {_qualname(cls)}")

    def _function(self, fn: types.FunctionType, depth: int) -> Any:
        """A function by what it runs: its code, annotations, defaults and closure.

        Its module and qualified name alone would let two lambdas of one module, or two
        closures of one factory with other annotations, share an entry. A function from a
        module whose source no key fingerprints (neither flashinfer's nor the DSL's, which the
        DSL stack versions) is refused: an edit there would not change the key.
        """
        while isinstance(getattr(fn, "__wrapped__", None), types.FunctionType):
            fn = fn.__wrapped__
        module = fn.__module__ or ""
        if not (_ours(module) or module.startswith(_DSL_MODULES)):
            raise UnkeyableError(f"function {module}.{fn.__qualname__} comes from a module whose source is not "
                                 "fingerprinted (not flashinfer's, not the DSL's)")
        self._module(module)
        cells = []
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                cells.append((name, self(cell.cell_contents, depth + 1)))
            except ValueError:  # an empty cell
                cells.append((name, ("empty",)))
        return ("function", module, fn.__qualname__, code_digest(fn.__code__), self._annotations(fn, depth),
                self(fn.__defaults__, depth + 1), self(fn.__kwdefaults__, depth + 1), tuple(cells))

    def _annotations(self, fn: types.FunctionType, depth: int) -> Any:
        """Evaluated annotations (the DSL reads them: ``cutlass.Constexpr``, tensor types), in order.

        String annotations (``from __future__ import annotations``) are evaluated as
        ``inspect.get_annotations`` does; one that cannot be evaluated is keyed by its text.
        A typing construct (``Constexpr[int]``) is keyed by its ``repr``, which names it fully.
        """
        try:
            annotations = inspect.get_annotations(fn, eval_str=True)
        except Exception:
            annotations = dict(getattr(fn, "__annotations__", None) or {})
        out = []
        for name, value in annotations.items():
            try:
                out.append((name, self(value, depth + 1)))
            except UnkeyableError:
                text = repr(value)
                if " at 0x" in text:  # an object's identity, not a description
                    raise
                out.append((name, ("repr", _qualname(type(value)), text)))
        return tuple(out)

    def _symbol(self, sym: Any) -> Any:
        index = self._symbols.setdefault(id(sym), len(self._symbols))
        self._keep.append(sym)
        return ("sym", index, getattr(sym, "width", None), getattr(sym, "divisibility", None))


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


#: Modules of the DSL: its version (the DSL stack) is in every key, so its code is fingerprinted.
_DSL_MODULES = ("cutlass", "cuda.")


def _ours(module_name: str) -> bool:
    """A module of flashinfer's code: ``flashinfer.*``, or one loaded from its package directory
    under another name (the expert-parallel kernels' ``sys.path`` entries). Remembered per
    loaded module: a key describes many objects of the same few modules."""
    if module_name == "flashinfer" or module_name.startswith("flashinfer."):
        return True
    known = _OURS.get(module_name)
    if known is not None:
        return known
    module = sys.modules.get(module_name)
    root = _package_dir()
    path = getattr(module, "__file__", None)
    ours = bool(root and path and os.path.realpath(path).startswith(root + os.sep))
    if module is not None:
        _OURS[module_name] = ours
    return ours


_OURS: dict[str, bool] = {}


@functools.lru_cache(maxsize=1)
def _package_dir() -> str | None:
    """flashinfer's package directory (found without importing it)."""
    path = getattr(sys.modules.get("flashinfer"), "__file__", None)
    if path is None:
        try:
            spec = importlib.util.find_spec("flashinfer")
        except (ImportError, ValueError):
            spec = None
        path = getattr(spec, "origin", None)
    return os.path.realpath(os.path.dirname(path)) if path else None


#: Options that ask the compile for artifacts beside the kernel that a loaded kernel does not carry.
_ARTIFACT_OPTIONS = ("KeepCUBIN", "keep-ptx", "keep-cubin", "dump-dir")
#: Options that change no generated code: where PTX is dumped, and asking to keep it. A compile
#: that keeps its PTX gets it back on a hit (GDN's compile cache checks the PTX of every SM12x
#: kernel it compiles, in a fresh temporary directory each time).
_PTX_OPTIONS = ("KeepPTX", "DumpDir")
#: Compressed PTX above this is not stored (the manifest holds it); such an entry is never served.
_MAX_PTX_BYTES = 768 << 10


def _dsl_options(options: Any) -> tuple[Any, ...]:
    return options if isinstance(options, tuple) else () if options is None else (options,)


def wants_ptx(options: Any) -> bool:
    """Whether ``cute.compile[options]`` keeps the PTX (``KeepPTX(True)``)."""
    return any(type(o).__name__ == "KeepPTX" and getattr(o, "value", None) is True for o in _dsl_options(options))


def _options(call: Call) -> Any:
    codegen = tuple(o for o in _dsl_options(call.dsl_options) if type(o).__name__ not in _PTX_OPTIONS)
    text = (repr(call.kwargs.get("options")), options_text(codegen) if call.dsl_options is not None else "None")
    if any(word in part for part in text for word in _ARTIFACT_OPTIONS):
        raise UnkeyableError("the compile asks for artifacts (CUBIN, a dump directory) a loaded kernel does not carry")
    return (*text, "keep-ptx") if wants_ptx(call.dsl_options) else text  # such entries carry their PTX


# --------------------------------------------------------------------------------------------
# Sites
# --------------------------------------------------------------------------------------------


def _key(call: Call) -> Any:
    describe = call.locals["describer"]
    extra = {k: v for k, v in call.kwargs.items() if k != "options"}
    return ("inline", call.locals["site"], ("args", tuple(describe(a) for a in call.args)),
            ("kwargs", describe(extra)))


@functools.lru_cache(maxsize=None)
def _tree_facts(tree: str) -> tuple[str, tuple[str, ...]]:
    """sha256 over every ``.py`` file under ``tree`` (names relative to it) and the variables they read."""
    root = Path(_package_dir() or "") / tree
    h = hashlib.sha256()
    reads: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\n")
        reads.update(env_reads(data))
    return h.hexdigest(), tuple(sorted(reads))


def _environment(call: Call) -> Environment:
    """The site's module, the flashinfer modules its arguments come from, and its kernel tree."""
    site: Inline = call.locals["inline"]
    modules = [m for m in dict.fromkeys((call.locals["module"], *call.locals["describer"].modules))
               if m.startswith("flashinfer.") and m in sys.modules]
    facts = [_common.site_sources(m) for m in modules]
    prints = [f.fingerprint for f in facts]
    reads = {name for f in facts for name in f.env_reads}
    if site.tree is not None:
        tree_print, tree_reads = _tree_facts(site.tree)
        prints.append(f"tree:{site.tree}:{tree_print}")
        reads.update(tree_reads)
    if not prints:
        raise UnkeyableError(f"no source to fingerprint for {site.file}:{site.function}")
    switches = {**codegen_env(), **keyed_env(reads, not_codegen=NOT_CODEGEN_ENV)}
    return Environment(
        kind=f"flashinfer-{site.family}",
        package=f"flashinfer-python=={_common.flashinfer_version()}",
        sources=hashlib.sha256("".join(prints).encode()).hexdigest(),
        arch=current_arch(),
        codegen_env=tuple(sorted(switches.items())),
    )


def _extra(kernel: Any, call: Call) -> dict[str, Any]:
    extra = {"calling_convention": _common.calling_convention(kernel),
             "kwargs_wrapper": getattr(kernel, "_kwargs_wrapper", None) is not None}
    if call.locals.get("wants_ptx"):
        extra["ptx_z"] = _packed_ptx(kernel)
    return extra


def _packed_ptx(kernel: Any) -> bytes | None:
    """The compiled kernel's PTX, zlib-compressed (None: none, or too large to keep)."""
    try:
        ptx = kernel.__ptx__
        if isinstance(ptx, str) and os.path.isfile(ptx):
            ptx = Path(ptx).read_text()
    except Exception:  # no PTX after all: the entry is never served to a caller asking for it
        return None
    if not isinstance(ptx, str):
        return None
    packed = zlib.compress(ptx.encode(), 6)
    if len(packed) > _MAX_PTX_BYTES:
        log.warning("cute-diskcache: PTX of %d bytes not kept; this kernel compiles in every process", len(ptx))
        return None
    return packed


def _extra_ok(extra: dict[str, Any]) -> bool:
    """A tvm-ffi kernel's entry needs its calling convention; a plain one's has none; PTX, when
    stored, is bytes (a caller asking for PTX has it in its key's options, see :func:`_adapt`)."""
    wrapped = extra.get("kwargs_wrapper")
    if not isinstance(wrapped, bool) or ("ptx_z" in extra and not isinstance(extra["ptx_z"], bytes)):
        return False
    return gemm.convention_ok(extra) if wrapped else extra.get("calling_convention") is None


class WithPtx:
    """A loaded kernel that also answers ``__ptx__`` (the compiled one's), for callers that read it."""

    def __init__(self, kernel: Any, ptx: str) -> None:
        self._kernel = kernel
        self.__ptx__ = ptx

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._kernel(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)


def _adapt(kernel: Any, extra: dict[str, Any], call: Call) -> Any:
    kernel = gemm.as_compiled(kernel, extra, call)
    if not call.locals.get("wants_ptx"):
        return kernel
    try:
        have = kernel.__ptx__
    except Exception:
        have = None
    if have:
        return kernel  # compiled in this process
    packed = extra.get("ptx_z")
    if not isinstance(packed, bytes):  # not reached: the key says "keep-ptx" and such entries hold it
        log.error("cute-diskcache: %s entry holds no PTX for a caller that reads it", call.locals["site"])
        return kernel
    return WithPtx(kernel, zlib.decompress(packed).decode())


def _site(site: Inline) -> Site:
    return Site(site.file, site.function, site.kind, _key, options=_options, extra=_extra, extra_ok=_extra_ok,
                adapt=_adapt, site_name=f"flashinfer.{site.family}.{site.kind}",
                env_kind=f"flashinfer-{site.family}", env=_environment)


def _direct_micro_site(site: Inline) -> Site:
    """0.6.17's direct micro kernel: ``moe_dispatch`` probes every kernel it gets for the block
    size it can launch, which a loaded kernel cannot answer (flashinfer's probe then says no and
    turns the backend off). As :mod:`.v0_7` does from 0.6.18, the answer is stored beside the
    kernel and the probe, hooked in ``moe_dispatch`` as the kernel is handed over, reads it."""
    from . import v0_7

    def with_kernel(call: Call) -> Call:  # v0_7's helpers read the kernel object from the frame
        return dataclasses.replace(call, locals={**call.locals, "kernel": call.args[0]})

    def extra(kernel: Any, call: Call) -> dict[str, Any]:
        return {**_extra(kernel, call), **v0_7._block_dim_extra(kernel, with_kernel(call))}

    def deliver(kernel: Any, extra: dict[str, Any], call: Call) -> None:
        dispatch = sys.modules.get(v0_7.MOE_DISPATCH)
        if dispatch is not None:
            v0_7._hook_block_dim_probe(dispatch)
        v0_7._deliver_block_dim(kernel, extra, with_kernel(call))

    return dataclasses.replace(_site(site), extra=extra, deliver=deliver,
                               extra_ok=lambda extra: _extra_ok(extra) and v0_7._block_dim_ok(extra))


_SITE_RECORDS = {s: _direct_micro_site(s) if s.kind == "direct_micro" else _site(s) for s in SITES}


# --------------------------------------------------------------------------------------------
# The one hook: cutlass.cute.compile
# --------------------------------------------------------------------------------------------


def _where(code: types.CodeType) -> tuple[str, str] | None:
    """(file relative to flashinfer's package, qualified name as the scan spells it) of a code object."""
    root = _package_dir()
    if root is None:
        return None
    path = os.path.realpath(code.co_filename)
    if not path.startswith(root + os.sep):
        return None
    qualname = getattr(code, "co_qualname", code.co_name).replace(".<locals>", "")
    return path[len(root) + 1:].replace(os.sep, "/"), qualname


class _Dispatch:
    """``cutlass.cute.compile`` for the whole process: inline sites through the cache."""

    def __init__(self, real: Any, dsl_options: Any = None) -> None:
        self._real = real
        self._dsl_options = dsl_options

    def __getitem__(self, options: Any) -> "_Dispatch":
        return _Dispatch(self._real[options], options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        code = frame.f_code
        module = frame.f_globals.get("__name__", "")
        del frame
        try:
            site = _CODES[code]
        except KeyError:
            site = _CODES[code] = _lookup(code)
        if site is None or not _ENABLED:
            return self._real(*args, **kwargs)
        call = Call({"inline": site, "site": f"{site.file}:{site.function}", "module": module,
                     "describer": _Describer(), "wants_ptx": wants_ptx(self._dsl_options)}, args, kwargs, self._dsl_options)
        return _common.through_cache(_SITE_RECORDS[site], call, lambda: self._real(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _lookup(code: types.CodeType) -> Inline | None:
    where = _where(code)
    site = _BY_WHERE.get(where) if where is not None else None
    return site if site is not None and site.applies(_common.flashinfer_version()) else None


_CODES: dict[types.CodeType, Inline | None] = {}
_ENABLED = False
_LOCK = threading.Lock()
setattr(_Dispatch, _MARKER, True)


def patch() -> bool:
    """Put the dispatcher in ``cutlass.cute.compile`` (idempotent); True when it is there."""
    global _ENABLED
    with _LOCK:
        try:
            import cutlass.cute as cute
        except ImportError:
            return False
        _ENABLED = True
        return _common.PATCHES.replace(cute, "compile", _MARKER, lambda real: _Dispatch(real))


def unpatch() -> None:
    """Stop routing inline sites through the cache (the real compile is put back)."""
    global _ENABLED
    with _LOCK:
        _ENABLED = False
        try:
            import cutlass.cute as cute
        except ImportError:
            return
        _common.PATCHES.restore(cute, ("compile",))
        _CODES.clear()


def describe(*args: Any) -> tuple[Any, ...]:
    """What :func:`_key` makes of compile arguments (for tests and ``doctor``)."""
    d = _Describer()
    return tuple(d(a) for a in args)


__all__ = ["SITES", "Inline", "covered", "describe", "patch", "unpatch"]
