"""The flashinfer adapter: the only module that knows how flashinfer compiles its sm12x MoE kernels.

flashinfer 0.6.12-0.6.17 ``moe_dispatch`` compiles its static, micro and dynamic kernels with
``cute.compile(...)`` inside ``_get_static_kernel`` / ``_get_micro_kernel`` /
``_get_dynamic_kernel``, after computing an exact in-process ``cache_key`` tuple. We replace the
``cute`` name *inside that module only* with a proxy whose ``compile`` looks at its caller: at a
known site it takes that ``cache_key`` from the frame and goes through the disk cache; any other
caller gets the real ``cute.compile`` untouched. moe_dispatch then stores whatever we return in
its own ``_*_KERNEL_CACHE`` dicts, so its in-process behaviour is unchanged.

flashinfer >= 0.6.18 persists these three kernels itself (``flashinfer/jit/cute_dsl_core.py``);
there the proxy is still installed but every call passes through, so the two caches never hold
the same kernel.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Iterator

from . import targets
from .cache import CompileCache, default_cache
from .key import CacheKey, Environment, UnkeyableError, current_arch, source_fingerprint

log = logging.getLogger("cute_diskcache")

MOE_DISPATCH = "flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_dispatch"
FLASHINFER_UTILS = "flashinfer.cute_dsl.utils"

#: site function in moe_dispatch -> kernel kind. Valid for 0.6.12 <= flashinfer < 0.6.18.
SITES = {
    "_get_static_kernel": "static",
    "_get_micro_kernel": "micro",
    "_get_dynamic_kernel": "dynamic",
}
FIRST_NATIVE = (0, 6, 18)  # flashinfer caches these sites on disk itself from here on
FIRST_SUPPORTED = (0, 6, 12)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits or not piece[0].isdigit():
            break
        parts.append(int(digits))
    return tuple(parts)


def flashinfer_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        mod = sys.modules.get("flashinfer")
        return str(getattr(mod, "__version__", "0+unknown"))


def coverage(md: ModuleType, version: str) -> dict[str, str]:
    """For each known site: 'cute-diskcache', 'flashinfer' (native disk cache) or 'absent'."""
    native = _version_tuple(version)[:3] >= FIRST_NATIVE or hasattr(md, "build_and_load_cute_dsl_kernel")
    out = {}
    for fn_name in SITES:
        if not hasattr(md, fn_name):
            out[fn_name] = "absent"
        elif native:
            out[fn_name] = "flashinfer"
        else:
            out[fn_name] = "cute-diskcache"
    return out


class _Compile:
    """``cute.compile`` as moe_dispatch sees it: sites go through the cache, the rest pass."""

    def __init__(self, real: Any, sites: dict[Any, str], env_fn: Any, cache_fn: Any) -> None:
        self._real = real
        self._sites = sites  # code object -> kernel kind
        self._env_fn = env_fn
        self._cache_fn = cache_fn

    def __getitem__(self, options: Any) -> Any:
        # cute.compile[OptLevel(3)](...) form: not used by the 0.6.x sites; pass through.
        return self._real[options]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        kind = self._sites.get(frame.f_code)
        site_key = frame.f_locals.get("cache_key") if kind is not None else None
        del frame
        if kind is None or site_key is None:
            return self._real(*args, **kwargs)
        try:
            key = CacheKey(self._env_fn(), f"flashinfer.moe_dispatch.{kind}", site_key, kwargs.get("options"))
            key.digest  # noqa: B018 - encode now, so an unkeyable element is caught here
            cache: CompileCache = self._cache_fn()
        except UnkeyableError as exc:
            log.warning("not caching %s kernel: %s", kind, exc)
            return self._real(*args, **kwargs)
        except Exception as exc:  # environment or settings trouble: run uncached, say why
            log.error("cute-diskcache disabled for this %s compile: %s: %s", kind, type(exc).__name__, exc)
            return self._real(*args, **kwargs)
        if _plan is not None:
            _plan.append({"kind": kind, "digest": key.digest, "key": key})
            return _planned_kernel
        kernel, _extra = cache.get_or_compile(key, lambda: self._real(*args, **kwargs))
        return kernel

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


#: While planning (see :func:`planning`), sites record their key here instead of compiling.
_plan: list[dict[str, Any]] | None = None


def _planned_kernel(*_args: Any, **_kwargs: Any) -> None:
    """What a site gets while planning: a kernel that launches nothing."""
    return None


@contextlib.contextmanager
def planning() -> Iterator[list[dict[str, Any]]]:
    """Record every kernel flashinfer asks for, without compiling or launching any.

    flashinfer keeps what a site returns in its in-process caches, so a process that planned
    must not serve: prewarm plans in a process of its own.
    """
    global _plan
    _plan = []
    try:
        yield _plan
    finally:
        _plan = None


class _CuteProxy(ModuleType):
    """A stand-in for ``cutlass.cute`` inside moe_dispatch only; everything but compile delegates."""

    def __init__(self, real: ModuleType, compile_: _Compile) -> None:
        super().__init__(real.__name__)
        self.__dict__["_cdc_real"] = real
        self.__dict__["compile"] = compile_

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_cdc_real"], name)


_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _environment(md_name: str) -> Environment:
    md = sys.modules[md_name]
    return Environment(
        kind="flashinfer-moe",
        package=f"flashinfer-python=={flashinfer_version()}",
        sources=source_fingerprint(md, "flashinfer"),
        arch=current_arch(),
    )


def patch(md: ModuleType) -> bool:
    """Install the proxy into moe_dispatch (idempotent). True when its sites now use our cache."""
    with _lock:
        if isinstance(md.__dict__.get("cute"), _CuteProxy):
            return _covered(md)
        real = md.__dict__.get("cute")
        if real is None:
            log.debug("moe_dispatch has no 'cute' global; nothing to patch")
            return False
        covered = _covered(md)
        sites = {getattr(md, fn).__code__: kind for fn, kind in SITES.items() if covered and hasattr(md, fn)}
        proxy = _CuteProxy(real, _Compile(real.compile, sites, lambda: _environment(md.__name__), default_cache))
        md.cute = proxy
        if covered:
            _warm_up(md)
            log.debug("cute-diskcache covers moe_dispatch sites %s", ", ".join(SITES))
        else:
            log.debug("flashinfer %s: moe_dispatch sites left to flashinfer", flashinfer_version())
        return covered


def _warm_up(md: ModuleType) -> None:
    """Do the once-per-process work now, at engine start, instead of on the first request.

    Hashing the kernel sources, listing the DSL distributions and dlopening the DSL runtime
    cost ~10 ms together. The target arch is NOT resolved here: without CUTE_DSL_ARCH that
    queries the CUDA driver, and initialising CUDA in a process that may fork workers later
    (an engine's front end) breaks CUDA in the children.
    """
    from .entry import preload_runtime
    from .key import dsl_stack

    try:
        dsl_stack()
        source_fingerprint(md, "flashinfer")
        default_cache()
        preload_runtime()
    except Exception as exc:  # only an optimisation; the first compile site retries
        log.debug("warm-up skipped: %s", exc)


def _covered(md: ModuleType) -> bool:
    version = flashinfer_version()
    if _version_tuple(version)[:3] < FIRST_SUPPORTED:
        return False
    return any(v == "cute-diskcache" for v in coverage(md, version).values())


def unpatch(md: ModuleType) -> None:
    with _lock:
        proxy = md.__dict__.get("cute")
        if isinstance(proxy, _CuteProxy):
            md.cute = proxy.__dict__["_cdc_real"]


def apply_profile(md: ModuleType) -> None:
    """With a target profile, answer flashinfer's max-active-clusters probe from the profile.

    The DSL's probe launches an occupancy query on the driver, which a box without the card
    cannot answer; flashinfer would then warn and fall back to the SM count.
    """
    profile = targets.active()
    if profile is None:
        return

    def get_max_active_clusters(cluster_size: int) -> int:
        return profile.max_active_clusters(cluster_size)

    utils = sys.modules.get(FLASHINFER_UTILS)
    for mod in (utils, md):
        if mod is not None and hasattr(mod, "get_max_active_clusters"):
            mod.get_max_active_clusters = get_max_active_clusters


# --------------------------------------------------------------------------------------------
# Driving flashinfer's own dispatch, the way a serving engine does, to make it compile.
# --------------------------------------------------------------------------------------------


def kernel_cache_sizes() -> dict[str, int]:
    """How many kernels moe_dispatch holds in memory, per kind (0.6.x layout)."""
    md = sys.modules.get(MOE_DISPATCH)
    names = {"micro": "_MICRO_KERNEL_CACHE", "static": "_STATIC_KERNEL_CACHE", "dynamic": "_DYNAMIC_KERNEL_CACHE"}
    return {kind: len(getattr(md, attr, {}) or {}) for kind, attr in names.items()} if md else {}


class Dispatcher:
    """``B12xMoEWrapper`` configured as vLLM configures it (``use_cuda_graph=True``), fed m tokens.

    Selection, workspace sizing and the compile calls are flashinfer's own; we only feed it.
    Weights are zeros: compiles depend on shapes, never on values. Without a GPU the tensors
    live on the CPU, every kernel compiles for the target profile, and the launch that follows
    is refused by the kernel's own argument check; that refusal is recorded, not raised.
    A configuration flashinfer refuses (e.g. expert parallelism on a wrapper without it) raises
    flashinfer's own error from the constructor.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        max_num_tokens: int = 4096,
        activation: str = "silu",
        num_local_experts: int | None = None,
        swiglu_alpha: float = 1.702,
        swiglu_beta: float = 1.0,
        swiglu_limit: float | None = None,
        quant_mode: str = "nvfp4",
    ) -> None:
        import torch
        from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout
        from flashinfer.fused_moe.cute_dsl.b12x_moe import B12xMoEWrapper
        from flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_activation import is_gated_activation

        device = "cuda" if torch.cuda.is_available() and targets.active() is None else "cpu"
        E, k, n = num_experts, hidden_size, intermediate_size
        E_w = num_local_experts or E  # experts whose weights this rank holds
        w1_rows = (2 if is_gated_activation(activation) else 1) * n

        def scale(rows: int, cols: int) -> torch.Tensor:
            m_pad = (rows + 127) // 128 * 128
            kb = ((cols // 16) + 3) // 4 * 4
            flat = torch.zeros(E_w * m_pad * kb, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
            return convert_sf_to_mma_layout(flat, m=rows, k=cols, num_groups=E_w)

        ones = torch.ones(E_w, dtype=torch.float32, device=device)
        self._weights = (
            torch.zeros(E_w, w1_rows, k // 2, dtype=torch.uint8, device=device),
            scale(w1_rows, k),
            torch.zeros(E_w, k, n // 2, dtype=torch.uint8, device=device),
            scale(k, n),
            ones,
        )
        self.wrapper = B12xMoEWrapper(
            num_experts=E,
            top_k=top_k,
            hidden_size=k,
            intermediate_size=n,
            use_cuda_graph=True,
            max_num_tokens=max_num_tokens,
            device=device,
            activation=activation,
            num_local_experts=num_local_experts,
            swiglu_alpha=swiglu_alpha,
            swiglu_beta=swiglu_beta,
            swiglu_limit=swiglu_limit,
            quant_mode=quant_mode,
        )
        self.device, self.E, self.k, self.top_k = device, E, k, top_k

    def run(self, m: int) -> dict[str, Any]:
        """One ``wrapper.run`` for m tokens; which kernels it added to moe_dispatch's caches."""
        import time

        import torch

        device, E, k, top_k = self.device, self.E, self.k, self.top_k
        w1, w1_sf, w2, w2_sf, ones = self._weights
        x = torch.zeros(m, k, dtype=torch.bfloat16, device=device)
        ids = (torch.arange(m * top_k, dtype=torch.int32, device=device) % E).view(m, top_k)
        weights = torch.full((m, top_k), 1.0 / top_k, dtype=torch.float32, device=device)
        before = kernel_cache_sizes()
        t0 = time.perf_counter()
        launch_error = None
        with _cpu_launch_stand_ins(device):
            try:
                self.wrapper.run(x, w1, w1_sf, w2, w2_sf, ids, weights, w1_alpha=ones, w2_alpha=ones, fc2_input_scale=ones)
            except Exception as exc:  # expected without a GPU: the kernel refuses CPU tensors
                if device == "cuda":
                    raise
                launch_error = f"{type(exc).__name__}: {exc}"
        after = kernel_cache_sizes()
        return {
            "m": m,
            "seconds": time.perf_counter() - t0,
            "new_kernels": {kind: after[kind] - before.get(kind, 0) for kind in after if after[kind] - before.get(kind, 0)},
            "launch_error": launch_error,
        }


def dispatch(num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, ms: list[int], **kwargs: Any) -> list[dict[str, Any]]:
    """:class:`Dispatcher` over ``ms`` in order; one record per m."""
    d = Dispatcher(num_experts, top_k, hidden_size, intermediate_size, **kwargs)
    return [d.run(m) for m in ms]


@contextlib.contextmanager
def _cpu_launch_stand_ins(device: str) -> Iterator[None]:
    """Without a GPU, skip the Triton routing pre-pass the micro path runs before compiling.

    ``triton_compact.compact_topk_ids`` compacts expert ids on the GPU; it shapes no kernel
    (compile keys do not see it) but Triton refuses to launch without a driver, which would
    stop dispatch before the micro kernel for m >= 2 is even requested.
    """
    if device != "cpu":
        yield
        return
    import importlib

    tc = importlib.import_module("flashinfer.fused_moe.cute_dsl.blackwell_sm12x.triton_compact")
    real = getattr(tc, "compact_topk_ids", None)
    tc.compact_topk_ids = lambda *a, **k: None
    try:
        yield
    finally:
        if real is not None:
            tc.compact_topk_ids = real
