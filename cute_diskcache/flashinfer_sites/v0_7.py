"""flashinfer 0.6.18 to 0.7.x: the sm12x MoE sites, including those flashinfer caches itself.

From 0.6.18 flashinfer persists moe_dispatch's static, micro and dynamic kernels itself
(``build_and_load_cute_dsl_kernel``), keyed on a fingerprint that includes torch's build: a
cache prewarmed with a CPU torch misses on the GPU box, and the mismatch wipes the module
directory. By default (``CUTE_DISKCACHE_NATIVE_SITES=cute-diskcache``) we serve those three from
our cache instead, keyed without torch, and flashinfer's native layer is neither read nor
written for them (:func:`serve_native_sites`); ``=flashinfer`` leaves them to flashinfer. Either
way one kernel never has two caches. These sites compile in memory on every start, and are
covered here (verified on 0.7.4; 0.6.18 has the first two with the same code):

=================================  ==========================================================
site                               site key (the site's own in-process key, plus)
=================================  ==========================================================
``moe_direct_micro_kernel.``       ``("direct_micro", kernel.__cache_key__, topk_ids_dtype)``;
``compile_direct_micro_kernel``    the block-dim probe result is stored beside the artifact
``moe_w4a16_compiler.compile``     ``(compile_spec.json_key, options key)``: the memoising
                                   wrapper's own key; ``cute.compile[OptLevel(3)]`` form
``moe_nvfp4_w4a4.run_moe_w4a4``    ``(T, H, I, N13, E, TOPK)`` + every compile argument's
``moe_nvfp4_w4a16.run_moe_w4a16``  signature (their tensors have static shapes) and consts
``moe_{fp8,mxfp8_mxfp4}_{fc1_act,  flashinfer's ``_COMPILED`` key + n and k (which that key
fc1_act_q1,fc2_finalize,gemm}.``   lacks) + the argument signatures
``compiled_kernel``
=================================  ==========================================================

Device facts these sites read on a real card are answered from the target profile when one
is active (see :func:`apply_profile`), so an offline compile takes the decisions the card would.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import sys
import threading
import time
from types import ModuleType
from typing import Any, Iterator

from .. import targets
from ..key import UnkeyableError
from . import _common, compat
from .. import elf
from .offline import cuda_presenting
from ._common import MOE_DISPATCH, PATCHES, SM12X, Call, Site, arg_signature, install_proxy, plain, site_codes, version_tuple

log = logging.getLogger("cute_diskcache")

FIRST = (0, 6, 18)
#: Releases of this generation the compatibility matrix proved (see :mod:`.compat`).
VERIFIED = tuple(v for v in compat.VERIFIED if version_tuple(v)[:3] >= FIRST)

DIRECT_MICRO = f"{SM12X}.moe_direct_micro_kernel"
W4A16_COMPILER = f"{SM12X}.moe_w4a16_compiler"
W4A16_KERNEL = f"{SM12X}.moe_w4a16_kernel"
NVFP4_W4A4 = f"{SM12X}.moe_nvfp4_w4a4"
NVFP4_W4A16 = f"{SM12X}.moe_nvfp4_w4a16"
#: fp8 / mxfp8xmxfp4 op modules; each compiles in ``compiled_kernel`` a kernel defined in
#: ``kernel_<op module>``.
OP_MODULES = tuple(
    f"{SM12X}.moe_{fmt}_{op}"
    for fmt in ("fp8", "mxfp8_mxfp4")
    for op in ("fc1_act", "fc1_act_q1", "fc2_finalize", "gemm")
)


def applies(version: str) -> bool:
    return version_tuple(version)[:3] >= FIRST


# --------------------------------------------------------------------------------------------
# Site keys
# --------------------------------------------------------------------------------------------


def _signatures(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(arg_signature(a) for a in args)


def _direct_micro_key(call: Call) -> Any:
    kernel = call.locals["kernel"]
    return ("direct_micro", plain(kernel.__cache_key__), call.locals["topk_ids_dtype"])


def _run_moe_key(kind: str) -> Any:
    def key(call: Call) -> Any:
        v = call.locals
        # args[0] is the program; the rest are the fake tensors, the stream and (w4a16) consts.
        return (kind, v["T"], v["H"], v["I"], v["N13"], v["E"], v["TOPK"],
                getattr(call.args[0], "__qualname__", type(call.args[0]).__qualname__), _signatures(call.args[1:]))

    return key


def _op_key(call: Call) -> Any:
    op = call.locals["op"]
    # flashinfer's key has no n or k: two layers of different widths would share a kernel in
    # memory. On disk they must not.
    return (plain(call.locals["key"]), ("n", int(op.n)), ("k", int(op.k)), _signatures(call.args[1:]))


def _defining_module(obj: Any) -> str:
    return getattr(obj, "__module__", None) or type(obj).__module__


def _w4a16_key(call: Call) -> Any:
    return (call.locals["compile_spec"].json_key, call.locals["options_key"])


def _w4a16_modules(call: Call) -> tuple[str, ...]:
    kernel_module = _defining_module(call.args[0])
    if kernel_module in sys.modules and kernel_module != W4A16_COMPILER:
        return (W4A16_COMPILER, kernel_module)
    return (W4A16_COMPILER,)


# --------------------------------------------------------------------------------------------
# The direct micro kernel's block-dim probe: side data stored beside the artifact
# --------------------------------------------------------------------------------------------

#: id(kernel) -> (kernel, block_dim, accepts): answers moe_dispatch's probe for kernels we handed out.
_BLOCK_DIM: dict[int, tuple[Any, int, bool]] = {}
_BLOCK_DIM_LOCK = threading.Lock()


def _block_dim_extra(kernel: Any, call: Call) -> dict[str, Any]:
    return {"block_dim_probe": probe_block_dim(kernel, int(call.locals["kernel"].launch_block_dim))}


def _block_dim_ok(extra: dict[str, Any]) -> bool:
    """Side data from disk is what :func:`_block_dim_extra` writes, or the entry is a miss."""
    probe = extra.get("block_dim_probe")
    return (isinstance(probe, dict) and isinstance(probe.get("block_dim"), int) and not isinstance(probe.get("block_dim"), bool)
            and isinstance(probe.get("accepts"), bool))


def _deliver_block_dim(kernel: Any, extra: dict[str, Any], call: Call) -> None:
    block_dim = int(call.locals["kernel"].launch_block_dim)
    stored = extra.get("block_dim_probe") if _block_dim_ok(extra) else {}
    if stored.get("block_dim") == block_dim and isinstance(stored.get("accepts"), bool):
        accepts = stored["accepts"]
    elif _common.planned(kernel):
        accepts = True  # planning with nothing on disk yet: the kernel's reqntid makes it the rule
    else:
        return  # an entry without the probe (should not happen): the hook probes
    with _BLOCK_DIM_LOCK:
        _BLOCK_DIM[id(kernel)] = (kernel, block_dim, accepts)


def accepts_block_dim(compiled: Any, block_dim: int) -> bool:
    """moe_dispatch's ``compiled_direct_micro_accepts_block_dim``, answered from side data.

    A kernel that came through the cache (hit or miss) carries its stored answer: a hit never
    probes again. Any other kernel is probed now (:func:`probe_block_dim`).
    """
    with _BLOCK_DIM_LOCK:
        found = _BLOCK_DIM.get(id(compiled))
    if found is not None and found[0] is compiled and found[1] == int(block_dim):
        return found[2]
    return bool(probe_block_dim(compiled, int(block_dim))["accepts"])


def probe_block_dim(compiled: Any, block_dim: int) -> dict[str, Any]:
    """Whether ``compiled`` can launch ``block_dim`` threads, and how we know.

    On the real card: flashinfer's own driver probe (``source: driver``). For a target profile
    the driver is absent (flashinfer's probe would say False and disable the backend): the
    answer comes from the cubin, as the driver computes it, from the kernel's register count
    and its ``reqntid``/``maxntid`` (``source: cubin``). Both record the cubin facts.
    """
    info: dict[str, Any] = {"block_dim": int(block_dim)}
    profile = targets.active()
    try:
        limits = cubin_thread_limits(compiled, profile)
    except Exception as exc:  # facts only; never fail the compile over them
        log.debug("cubin facts unavailable: %s", exc)
        limits = None
    info["cubin"] = limits
    if profile is None:
        real = sys.modules[DIRECT_MICRO].compiled_direct_micro_accepts_block_dim
        info.update(accepts=bool(real(compiled, block_dim)), source="driver")
        if limits is not None and (limits["max_threads"] >= block_dim) != info["accepts"]:
            log.warning("direct micro block-dim probe: driver says %s, cubin facts %s", info["accepts"], limits)
    elif limits is not None:
        info.update(accepts=limits["max_threads"] >= block_dim, source="cubin", target=profile.name)
    else:
        log.warning("direct micro block-dim probe: no driver and no cubin facts; assuming it launches")
        info.update(accepts=True, source="assumed", target=profile.name)
    return info


def cubin_thread_limits(compiled: Any, profile: targets.DeviceProfile | None = None) -> dict[str, Any] | None:
    """``CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK`` of a compiled kernel, from its cubin.

    The driver's answer is the least of the device's block limit (1024), the kernel's
    ``reqntid``/``maxntid`` and what its registers allow: ``regs * 32`` rounded up to the
    256-register allocation unit per warp, against the 64 Ki registers of one block.
    """

    obj = compiled.dump_to_object("cdc_probe")
    cubins = elf.cubins_in(obj)
    if not cubins:
        return None
    attrs = profile.driver_attributes() if profile else {"MAX_THREADS_PER_BLOCK": 1024, "MAX_REGISTERS_PER_BLOCK": 65536}
    regs = ntid = 0
    for cubin in cubins:
        facts = elf.kernel_facts(cubin)
        regs = max(regs, facts["regs"])
        ntid = max(ntid, facts["ntid"])
    per_warp = -(-regs * 32 // 256) * 256 if regs else 256
    by_regs = (attrs["MAX_REGISTERS_PER_BLOCK"] // per_warp) * 32
    limit = min(attrs["MAX_THREADS_PER_BLOCK"], by_regs, ntid or attrs["MAX_THREADS_PER_BLOCK"])
    return {"regs": regs, "ntid": ntid, "max_threads": limit}


# --------------------------------------------------------------------------------------------
# Sites
# --------------------------------------------------------------------------------------------


def _proxy_sites() -> dict[str, list[Site]]:
    """module -> the sites in it that compile through its module-global ``cute``."""
    sites = {
        DIRECT_MICRO: [Site(DIRECT_MICRO, "compile_direct_micro_kernel", "direct_micro", _direct_micro_key,
                            extra=_block_dim_extra, deliver=_deliver_block_dim, extra_ok=_block_dim_ok)],
        NVFP4_W4A4: [Site(NVFP4_W4A4, "run_moe_w4a4", "w4a4", _run_moe_key("w4a4"))],
        NVFP4_W4A16: [Site(NVFP4_W4A16, "run_moe_w4a16", "nvfp4_w4a16", _run_moe_key("w4a16"))],
    }
    for name in OP_MODULES:
        sites[name] = [Site(name, "compiled_kernel", name.rsplit(".moe_", 1)[-1], _op_key)]
    return sites


#: The subscript (``OptLevel(3)``) is already in the site key, as flashinfer's options key.
W4A16_SITE = Site(W4A16_COMPILER, "compile", "w4a16", _w4a16_key,
                  options=lambda call: call.kwargs.get("options"), modules=_w4a16_modules)

#: (file relative to blackwell_sm12x/, function) -> kind, for the coverage report.
COVERED = {
    **{(f"{m.rsplit('.', 1)[-1]}.py", s.function): s.kind for m, ss in _proxy_sites().items() for s in ss},
    ("moe_w4a16_compiler.py", "compile"): "w4a16",
}
#: What each site relies on in flashinfer's source (module -> function -> shape), checked before
#: caching on a release outside VERIFIED (:mod:`.compat`): the frame locals its key reads, and
#: the keywords of its compile call (all keyed; ``**`` is direct micro's ``compile_kwargs``,
#: whose keys :func:`~._common.compile_options` checks at run time).
SHAPES: dict[str, dict[str, compat.SiteShape]] = {
    DIRECT_MICRO: {"compile_direct_micro_kernel": compat.shape(("kernel", "topk_ids_dtype"), cute_compile={"options", "**"})},
    NVFP4_W4A4: {"run_moe_w4a4": compat.shape(("T", "H", "I", "N13", "E", "TOPK"), cute_compile={"options"})},
    NVFP4_W4A16: {"run_moe_w4a16": compat.shape(("T", "H", "I", "N13", "E", "TOPK"), cute_compile={"options"})},
    **{name: {"compiled_kernel": compat.shape(("op", "key"), cute_compile=())} for name in OP_MODULES},
    W4A16_COMPILER: {"compile": compat.shape(("compile_spec", "dsl_compile_options"),
                                             module_globals=("_COMPILE_CACHE", "_COMPILE_CACHE_LOCK", "_options_cache_key"))},
}


def patch(module: ModuleType) -> bool:
    """Attach to one flashinfer module of this generation (idempotent); True if it has sites."""
    name = module.__name__
    with PATCHES.lock:
        if name in _proxy_sites():
            sites = _proxy_sites()[name]
            keep = compat.vetted(module, [s.function for s in sites], SHAPES[name])
            codes = site_codes(module, [s for s in sites if s.function in keep])
            return bool(codes) and install_proxy(module, codes)
        if name == W4A16_COMPILER:
            return _patch_w4a16_compiler(module)
        if name == W4A16_KERNEL:
            compiler = sys.modules.get(W4A16_COMPILER)
            return compiler is not None and _patch_w4a16_compiler(compiler)
        if name == MOE_DISPATCH:
            _hook_block_dim_probe(module)
            serving = serve_native_sites(module)
            if serving:
                from .v0_6 import _warm_up

                _warm_up(module)
            return serving
    return False


def unpatch(module: ModuleType) -> None:
    names = ["cute", "compile", "cached_compile", NATIVE_BUILDER]
    if targets.active() is None:
        names.append("compiled_direct_micro_accepts_block_dim")  # a profile still needs it
    PATCHES.restore(module, tuple(names))


def _hook_block_dim_probe(md: ModuleType) -> None:
    if hasattr(md, "compiled_direct_micro_accepts_block_dim") and not PATCHES.touched(md, "compiled_direct_micro_accepts_block_dim"):
        PATCHES.set(md, "compiled_direct_micro_accepts_block_dim", accepts_block_dim)


def _patch_w4a16_compiler(compiler: ModuleType) -> bool:
    """Route the W4A16 memoising wrapper through the disk cache.

    ``moe_w4a16_compiler.compile`` imports ``cutlass.cute`` inside the function, so there is
    no module global to proxy: the wrapper itself is replaced, in its module and in
    ``moe_w4a16_kernel`` (which imported it by name as ``cached_compile``).
    """
    real = PATCHES.original(compiler, "compile")
    if real is None or not hasattr(compiler, "_COMPILE_CACHE"):
        return False
    if not compat.vetted(compiler, ["compile"], SHAPES[W4A16_COMPILER]):
        return False
    wrapper = compiler.__dict__.get("compile")
    if not getattr(wrapper, "_cdc_w4a16", False):
        wrapper = _w4a16_wrapper(compiler, real)
        PATCHES.set(compiler, "compile", wrapper)
    kernel_mod = sys.modules.get(W4A16_KERNEL)
    if kernel_mod is not None and kernel_mod.__dict__.get("cached_compile") in (real, wrapper):
        PATCHES.set(kernel_mod, "cached_compile", wrapper, original=real)
    return True


def _w4a16_wrapper(compiler: ModuleType, real: Any) -> Any:
    def compile(func: Any, *args: Any, compile_spec: Any = None, dsl_compile_options: Any = None, **kwargs: Any) -> Any:
        if compile_spec is None:
            return real(func, *args, compile_spec=compile_spec, dsl_compile_options=dsl_compile_options, **kwargs)
        options_key = compiler._options_cache_key(dsl_compile_options)
        memo_key = (compile_spec.json_key, options_key)
        with compiler._COMPILE_CACHE_LOCK:
            compiled = compiler._COMPILE_CACHE.get(memo_key)
        if compiled is not None:
            return compiled
        call = Call({"compile_spec": compile_spec, "options_key": options_key}, (func, *args), kwargs, dsl_compile_options)
        kernel = _common.through_cache(
            W4A16_SITE, call,
            lambda: real(func, *args, compile_spec=compile_spec, dsl_compile_options=dsl_compile_options, **kwargs),
        )
        if not _common.planned(kernel):
            with compiler._COMPILE_CACHE_LOCK:
                compiler._COMPILE_CACHE[memo_key] = kernel
        return kernel

    compile._cdc_w4a16 = True  # type: ignore[attr-defined]
    compile.__doc__ = real.__doc__
    return compile


# --------------------------------------------------------------------------------------------
# Target profile stand-ins
# --------------------------------------------------------------------------------------------


def apply_profile(module: ModuleType, profile: targets.DeviceProfile) -> None:
    """Answer this generation's device queries from ``profile`` (no card in the machine).

    * moe_dispatch's ``_is_sm120_nvfp4`` asks whether the *tensors* live on an SM120 card; on
      CPU tensors it says no and picks other cutovers and ``one_round_fc1`` than the card.
    * The direct micro block-dim probe asks the driver (see :func:`probe_block_dim`).
    * Sites that compile against ``from_dlpack`` tensors would compile for generic instead of
      global memory: their tensors are presented as ``cuda:0`` (:class:`.offline.CudaPresented`).

    (The DSL's own driver attribute queries are answered for every generation, by the caller.)
    """
    name = module.__name__
    if name == MOE_DISPATCH and hasattr(module, "_is_sm120_nvfp4"):
        sm120 = tuple(profile.capability) == (12, 0)
        module._is_sm120_nvfp4 = lambda device, quant_mode: sm120 and quant_mode == "nvfp4"
        _hook_block_dim_probe(module)
    dlpack_users = [module] if name in (NVFP4_W4A4, NVFP4_W4A16) else []
    if name in OP_MODULES:
        kernel_mod = sys.modules.get(name.replace(".moe_", ".kernel_moe_", 1))
        if kernel_mod is not None:
            dlpack_users.append(kernel_mod)
    for mod in dlpack_users:
        if hasattr(mod, "from_dlpack"):
            mod.from_dlpack = cuda_presenting(mod.from_dlpack)


# --------------------------------------------------------------------------------------------
# flashinfer's native sites, served from our cache (CUTE_DISKCACHE_NATIVE_SITES=cute-diskcache)
# --------------------------------------------------------------------------------------------

NATIVE_BUILDER = "build_and_load_cute_dsl_kernel"
#: moe_dispatch's functions that build through flashinfer's native cache -> our kind.
NATIVE_FUNCTIONS = {"_get_static_kernel": "static", "_get_micro_kernel": "micro", "_get_dynamic_kernel": "dynamic"}
#: (file, function) -> kind, for the coverage report while we serve them.
NATIVE_COVERED = {("moe_dispatch.py", fn): kind for fn, kind in NATIVE_FUNCTIONS.items()}
#: Each reads flashinfer's ``cache_key`` from its frame and builds through the native builder
#: (module, kernel name, compile_fn positionally; ``extra_key_files`` keyed by content,
#: ``enable_tvm_ffi`` keyed), whose ``compile_fn`` calls ``cute.compile(..., options=...)``.
NATIVE_SHAPES = {MOE_DISPATCH: {fn: compat.shape(("cache_key",), build_and_load_cute_dsl_kernel={"extra_key_files", "enable_tvm_ffi"},
                                                 cute_compile={"options"}) for fn in NATIVE_FUNCTIONS}}
_MISSING = object()


def serves_native() -> bool:
    """Whether flashinfer's natively cached sites are ours to serve (``CUTE_DISKCACHE_NATIVE_SITES``)."""
    from .. import config

    return config.load().native_sites == "cute-diskcache"


def _native_key(call: Call) -> Any:
    """flashinfer's on-disk kernel name and its in-process key, canonically encoded.

    The name is flashinfer's sole per-kernel disk key (a shape prefix plus 16 hex digits of
    ``repr(cache_key)``); the tuple itself makes ours injective without relying on that repr.
    What flashinfer's ``meta.json`` guards module-wide (arch, DSL stack, sources) is our
    Environment's job, without torch's build: torch does not change the kernel.
    """
    v = call.locals
    return ("native", v["module_name"], v["kernel_name"], plain(v["cache_key"]))


def _native_options(call: Call) -> Any:
    # The compile options string lives inside flashinfer's compile_fn closure (its source is
    # fingerprinted); the export format is what the caller states.
    return ("enable_tvm_ffi", bool(call.locals["enable_tvm_ffi"]))


@functools.lru_cache(maxsize=None)
def _modules_of(files: tuple[str, ...]) -> tuple[str, ...]:
    """The imported flashinfer modules behind flashinfer's ``extra_key_files`` (paths).

    flashinfer passes ``module.__file__`` itself, so paths match as text; resolving links is
    only the fallback (a realpath of every flashinfer module costs ~30 ms on a serving start).
    """
    by_file = {f: name for name, mod in list(sys.modules.items())
               if name.startswith("flashinfer") and isinstance(f := getattr(mod, "__file__", None), str)}
    resolved: dict[str, str] = {}
    names = []
    for path in files:
        name = by_file.get(path)
        if name is None:
            resolved = resolved or {os.path.realpath(f): n for f, n in by_file.items()}
            name = resolved.get(os.path.realpath(path))
        if name is None:  # a key file we cannot fingerprint as a module: never a weaker key
            raise UnkeyableError(f"key source {os.path.basename(path)} is not an imported flashinfer module")
        names.append(name)
    return tuple(sorted(set(names) - {MOE_DISPATCH}))


def _native_modules(call: Call) -> tuple[str, ...]:
    """moe_dispatch, plus every module flashinfer itself names as this kernel's key sources."""
    return (MOE_DISPATCH, *_modules_of(tuple(call.locals["extra_key_files"])))


SERVED_NATIVE_SITES = [Site(MOE_DISPATCH, fn, kind, _native_key, options=_native_options, modules=_native_modules)
                       for fn, kind in NATIVE_FUNCTIONS.items()]


def _native_builder(md: ModuleType, real: Any, sites: list[Site]) -> Any:
    """moe_dispatch's view of ``build_and_load_cute_dsl_kernel``: ``sites`` through our cache.

    Any other caller, a call with arguments we do not know, or a kernel we cannot key goes to
    flashinfer's own builder, as if we were not there.
    """
    codes = site_codes(md, sites)

    def build_and_load_cute_dsl_kernel(module_name: str, kernel_name: str, compile_fn: Any,
                                       extra_key_files: Any = (), **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        site = codes.get(frame.f_code)
        cache_key = frame.f_locals.get("cache_key", _MISSING) if site is not None else _MISSING
        del frame

        def native() -> Any:
            return real(module_name, kernel_name, compile_fn, extra_key_files, **kwargs)

        if site is None or cache_key is _MISSING or set(kwargs) - {"enable_tvm_ffi"}:
            return native()
        call = Call({"module_name": module_name, "kernel_name": kernel_name, "cache_key": cache_key,
                     "extra_key_files": tuple(extra_key_files), "enable_tvm_ffi": kwargs.get("enable_tvm_ffi", True)}, (), {})
        return _common.through_cache(site, call, compile_fn, uncached=native)

    build_and_load_cute_dsl_kernel._cdc_native = True  # type: ignore[attr-defined]
    build_and_load_cute_dsl_kernel.__doc__ = real.__doc__
    return build_and_load_cute_dsl_kernel


def serve_native_sites(md: ModuleType) -> bool:
    """Serve moe_dispatch's natively cached sites from our cache, or hand them back (idempotent).

    Replaces the name ``build_and_load_cute_dsl_kernel`` inside moe_dispatch only: flashinfer's
    other users of its native cache (attention, GEMM, norm kernels) are untouched. True if we
    serve them now.
    """
    with PATCHES.lock:
        current = md.__dict__.get(NATIVE_BUILDER)
        ours = getattr(current, "_cdc_native", False)
        if not serves_native():
            if ours:
                PATCHES.restore(md, (NATIVE_BUILDER,))
            return False
        if ours:
            return True
        real = PATCHES.original(md, NATIVE_BUILDER)
        keep = compat.vetted(md, NATIVE_FUNCTIONS, NATIVE_SHAPES[MOE_DISPATCH])
        served = [s for s in SERVED_NATIVE_SITES if s.function in keep]
        if real is None or not site_codes(md, served):
            return False
        PATCHES.set(md, NATIVE_BUILDER, _native_builder(md, real, served))
        return True


def serving_native(md: ModuleType | None = None) -> bool:
    """Whether moe_dispatch's native sites go through our cache in this process right now."""
    md = md if md is not None else sys.modules.get(MOE_DISPATCH)
    return md is not None and bool(getattr(md.__dict__.get(NATIVE_BUILDER), "_cdc_native", False))


# --------------------------------------------------------------------------------------------
# flashinfer's native sites left to flashinfer (CUTE_DISKCACHE_NATIVE_SITES=flashinfer):
# planned and observed, never cached by us
# --------------------------------------------------------------------------------------------


_IDENTITY_WARNED: list[bool] = []


def native_identity(module_name: str, kernel_name: str, compile_fn: Any, extra_key_files: Any, enable_tvm_ffi: bool) -> dict[str, Any]:
    """Which native kernel a ``build_and_load_cute_dsl_kernel`` call is, and whether it is on disk.

    Computed as flashinfer's cache does (same spec, same source hash) without compiling.
    """
    from flashinfer.jit import cute_dsl_core as core

    kind = "native-" + kernel_name.split("_", 1)[0]
    out: dict[str, Any] = {"kind": kind, "name": f"{module_name}/{kernel_name}", "cached": False, "native": True}
    try:
        disabled = core.cute_dsl_cache_disabled()
        sha = core._hash_source_files(tuple(extra_key_files))
        spec = core.JitSpecCuteDsl(module_name, kernel_name, compile_fn, sha, **_spec_options(core, enable_tvm_ffi))
        out.update(name=spec.name, path=str(spec.object_path), cached=bool(spec.is_compiled) and not disabled,
                   disabled=disabled)
        ident = json.dumps([spec.name, spec.expected_meta, str(spec.object_path)], sort_keys=True)
    except Exception as exc:  # identity is for reporting; a failure must not stop dispatch
        if not _IDENTITY_WARNED:  # once: a release whose native cache API moved shows up, not every kernel
            _IDENTITY_WARNED.append(True)
            log.warning("flashinfer %s: cannot tell whether its native kernels are cached (%s: %s); prewarm "
                        "will list them as missing", _common.flashinfer_version(), type(exc).__name__, exc)
        ident = json.dumps([module_name, kernel_name])
    out["digest"] = hashlib.sha256(ident.encode()).hexdigest()
    return out


def _spec_options(core: ModuleType, enable_tvm_ffi: bool) -> dict[str, Any]:
    """The keywords this release's ``JitSpecCuteDsl`` takes beyond the four positional ones.

    ``enable_tvm_ffi`` arrived in 0.7.4; 0.6.18-0.7.2.post1 build every native kernel with
    tvm-ffi and passing it is a TypeError (which once made every native kernel look uncached).
    """
    import inspect

    if "enable_tvm_ffi" in inspect.signature(core.JitSpecCuteDsl.__init__).parameters:
        return {"enable_tvm_ffi": enable_tvm_ffi}
    if not enable_tvm_ffi:
        raise TypeError(f"flashinfer {_common.flashinfer_version()} builds native kernels with tvm-ffi only")
    return {}


@contextlib.contextmanager
def native_sites(events: list[dict[str, Any]]) -> Iterator[None]:
    """While dispatching: plan flashinfer's native kernels, or observe them being built.

    Planning (:func:`~._common.planning` active): record each as a ``native-*`` kernel and
    return a kernel that launches nothing. Otherwise flashinfer builds and persists it exactly
    as it would, and ``events`` gets a hit/miss record (miss: ``compile_fn`` ran). A no-op while
    we serve them (:func:`serving_native`): they are then sites of ours like any other.
    """
    md = sys.modules.get(MOE_DISPATCH)
    real = md.__dict__.get(NATIVE_BUILDER) if md is not None else None
    if real is None or serving_native(md):  # ours: planned and counted like every site of ours
        yield
        return

    def build_and_load(module_name: str, kernel_name: str, compile_fn: Any, extra_key_files: Any = (), **kwargs: Any) -> Any:
        ident = native_identity(module_name, kernel_name, compile_fn, extra_key_files, kwargs.get("enable_tvm_ffi", True))
        if _common.PLAN is not None:
            _common.PLAN.append({"kind": ident["kind"], "digest": ident["digest"], "site": ident["name"],
                                 "native": True, "cached": ident["cached"], "path": ident.get("path")})
            return _common.PlannedKernel(ident["digest"])
        ran: list[float] = []

        def counted() -> Any:
            t = time.perf_counter()
            try:
                return compile_fn()
            finally:
                ran.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        result = real(module_name, kernel_name, counted, extra_key_files, **kwargs)
        events.append({"digest": ident["digest"], "kind": ident["kind"], "site": ident["name"], "path": ident.get("path"),
                       "outcome": "miss" if ran else "hit", "seconds": ran[0] if ran else time.perf_counter() - t0})
        return result

    PATCHES.set(md, "build_and_load_cute_dsl_kernel", build_and_load)
    try:
        yield
    finally:
        PATCHES.restore(md, ("build_and_load_cute_dsl_kernel",))
