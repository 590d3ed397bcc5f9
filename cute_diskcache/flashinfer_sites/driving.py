"""Driving flashinfer's own dispatch, the way a serving engine does, to make it compile."""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
from typing import Any
from collections.abc import Iterator

from ..keys import targets
from . import native as native_builds
from ._common import flashinfer_version, version_tuple
from .names import MOE_DISPATCH, SM12X


def import_dispatch() -> tuple[float, float]:
    """Import flashinfer's MoE dispatch, then pay its first ``current_cuda_stream()`` (which
    imports torch._dynamo, ~1 s), so that the calls after it time only compiles or loads.

    Returns (import seconds, warm-up seconds). A target profile must be applied first.
    """
    import importlib

    t0 = time.perf_counter()
    importlib.import_module(MOE_DISPATCH)
    imported = time.perf_counter() - t0
    t0 = time.perf_counter()
    from flashinfer.cute_dsl.utils import current_cuda_stream

    current_cuda_stream()
    return imported, time.perf_counter() - t0


def kernel_cache_sizes() -> dict[str, int]:
    """How many kernels flashinfer holds in memory, per kind (every generation's dicts that exist)."""
    md = sys.modules.get(MOE_DISPATCH)
    if md is None:
        return {}
    out: dict[str, int] = {}
    for kind, attr in (("micro", "_MICRO_KERNEL_CACHE"), ("static", "_STATIC_KERNEL_CACHE"),
                       ("dynamic", "_DYNAMIC_KERNEL_CACHE"), ("direct_micro", "_DIRECT_MICRO_KERNEL_CACHE")):
        if hasattr(md, attr):
            out[kind] = len(getattr(md, attr) or {})
    compiler = sys.modules.get(f"{SM12X}.moe_w4a16_compiler")
    if compiler is not None:
        out["w4a16"] = len(getattr(compiler, "_COMPILE_CACHE", {}) or {})
    return out


class Dispatcher:
    """``B12xMoEWrapper`` configured as vLLM configures it (``use_cuda_graph=True``), fed m tokens.

    With ``use_cuda_graph=False`` it is the wrapper without CUDA graphs, which sizes its
    workspace per call exactly as the functional ``b12x_fused_moe`` does (see :mod:`.functional`).

    Selection, workspace sizing and the compile calls are flashinfer's own; we only feed it.
    Weights are zeros: compiles depend on shapes, never on values. Without a GPU the tensors
    live on the CPU, every kernel compiles for the target profile, and the launch that follows
    is refused by the kernel's own argument check; that refusal is recorded, not raised.
    A configuration flashinfer refuses (e.g. expert parallelism on a wrapper without it) raises
    flashinfer's own error from the constructor.

    flashinfer >= 0.6.18 builds some kernels through its own disk cache. While we serve them
    (the default) they are sites of ours like any other; left to flashinfer
    (``CUTE_DISKCACHE_NATIVE_SITES=flashinfer``), each ``run`` record lists them under ``native``
    (hit or miss, seconds), and planning records them too.
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
        use_cuda_graph: bool = True,
    ) -> None:
        import torch
        from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout
        from flashinfer.fused_moe.cute_dsl.b12x_moe import B12xMoEWrapper

        device = "cuda" if torch.cuda.is_available() and targets.active() is None else "cpu"
        E, k, n = num_experts, hidden_size, intermediate_size
        E_w = num_local_experts or E  # experts whose weights this rank holds
        w1_rows = (2 if _is_gated(activation) else 1) * n

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
        kwargs: dict[str, Any] = dict(
            num_experts=E,
            top_k=top_k,
            hidden_size=k,
            intermediate_size=n,
            use_cuda_graph=use_cuda_graph,
            max_num_tokens=max_num_tokens,
            device=device,
            activation=activation,
            num_local_experts=num_local_experts,
            quant_mode=quant_mode,
        )
        params = inspect.signature(B12xMoEWrapper.__init__).parameters
        kwargs.update(_swiglu_kwargs(params, swiglu_alpha=swiglu_alpha, swiglu_beta=swiglu_beta, swiglu_limit=swiglu_limit))
        if num_local_experts not in (None, E) and "expert_map" in params:
            # 0.6.18+: expert parallelism needs the global -> local map; rank 0 holds the first E_w.
            expert_map = torch.full((E,), -1, dtype=torch.int32, device=device)
            expert_map[:E_w] = torch.arange(E_w, dtype=torch.int32, device=device)
            kwargs["expert_map"] = expert_map
        self.wrapper = B12xMoEWrapper(**kwargs)
        #: What the wrapper was built with (tests compare it with what vLLM passes).
        self.wrapper_kwargs = {name: value for name, value in kwargs.items() if name != "expert_map"}
        self.device, self.E, self.k, self.top_k = device, E, k, top_k
        #: Why a dispatch on CPU tensors cannot mirror the card for this configuration (None:
        #: it can). Planning from such a dispatch would silently miss kernels.
        self.offline_limit: str | None = None
        if device == "cpu" and quant_mode == "w4a16" and version_tuple(flashinfer_version())[:3] >= (0, 6, 18):
            self.offline_limit = (
                f"flashinfer {flashinfer_version()} decides W4A16 routes on whether topk_ids is a CUDA tensor "
                "and packs them on the GPU (route packing refuses CPU tensors for m > 1): plan W4A16 on the card"
            )

    def _inputs(self, m: int) -> tuple[Any, Any, Any]:
        """Activations, expert ids and weights for m tokens: views of buffers kept for the largest m.

        Planning drives every m up to the engine's max_num_batched_tokens; allocating (and
        zeroing) an m x hidden activation per m cost 5 ms at m=3000 and 39 ms at m=8192, most of
        a dry run. The values are those a fresh allocation would hold (zeros; expert ids
        ``arange % E``; equal weights), so flashinfer sees the same inputs.
        """
        import torch

        held = getattr(self, "_held", None)
        if held is None or held[0].shape[0] < m:
            rows = max(m, held[0].shape[0] * 2 if held is not None else 0)
            x = torch.zeros(rows, self.k, dtype=torch.bfloat16, device=self.device)
            ids = (torch.arange(rows * self.top_k, dtype=torch.int32, device=self.device) % self.E).view(rows, self.top_k)
            weights = torch.full((rows, self.top_k), 1.0 / self.top_k, dtype=torch.float32, device=self.device)
            held = self._held = (x, ids, weights)
        return held[0][:m], held[1][:m], held[2][:m]

    def run(self, m: int, functional: bool = False) -> dict[str, Any]:
        """One ``wrapper.run`` for m tokens; which kernels it added to flashinfer's caches.

        ``functional``: call flashinfer's functional ``b12x_fused_moe`` with the same tensors
        instead (it shares the workspace cache of a wrapper built without CUDA graphs).
        """
        device = self.device
        w1, w1_sf, w2, w2_sf, ones = self._weights
        x, ids, weights = self._inputs(m)
        before = kernel_cache_sizes()
        events = len(native_builds.EVENTS)
        t0 = time.perf_counter()
        launch_error = None
        with _cpu_launch_stand_ins(device):
            try:
                if functional:
                    from flashinfer.fused_moe.cute_dsl.b12x_moe import b12x_fused_moe

                    kw = self.wrapper_kwargs
                    b12x_fused_moe(x, w1, w1_sf, w2, w2_sf, ids, weights, kw["num_experts"], kw["top_k"], w1_alpha=ones,
                                   w2_alpha=ones, fc2_input_scale=ones, num_local_experts=kw["num_local_experts"],
                                   activation=kw["activation"], quant_mode=kw["quant_mode"],
                                   **{k: v for k, v in kw.items() if k.startswith("swiglu_")})
                else:
                    self.wrapper.run(x, w1, w1_sf, w2, w2_sf, ids, weights, w1_alpha=ones, w2_alpha=ones, fc2_input_scale=ones)
            except Exception as exc:  # expected without a GPU: the kernel refuses CPU tensors
                if device == "cuda":
                    raise
                launch_error = f"{type(exc).__name__}: {exc}"
        after = kernel_cache_sizes()
        native = native_builds.EVENTS[events:]
        del native_builds.EVENTS[events:]
        return {
            "m": m,
            "seconds": time.perf_counter() - t0,
            "new_kernels": {kind: after[kind] - before.get(kind, 0) for kind in after if after[kind] - before.get(kind, 0)},
            "launch_error": launch_error,
            "native": native,
        }


#: flashinfer 0.6.15's defaults for the clamped-SwiGLU parameters it added that release.
_SWIGLU_DEFAULTS = {"swiglu_alpha": 1.702, "swiglu_beta": 1.0, "swiglu_limit": None}


def _is_gated(activation: str) -> bool:
    """Whether w1 holds gate and up rows (2n) or up rows only (n), as flashinfer decides it.

    0.6.15+ says so in ``moe_activation``; 0.6.12-0.6.14 have no such module and know two
    activations, ``silu`` (gated) and ``relu2`` (not): ``moe_dispatch`` tests ``== "silu"``.
    """
    try:
        from flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_activation import is_gated_activation
    except ImportError:
        return activation == "silu"
    return bool(is_gated_activation(activation))


def _swiglu_kwargs(params: Any, **values: Any) -> dict[str, Any]:
    """The SwiGLU keywords this wrapper takes (0.6.12-0.6.14 take none).

    A release without them can only run the defaults; asking it for others (gpt-oss's clamped
    SwiGLU) is refused, as flashinfer would refuse the model, never silently dropped.
    """
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name in params:
            out[name] = value
        elif value != _SWIGLU_DEFAULTS[name]:
            raise NotImplementedError(f"flashinfer {flashinfer_version()}'s B12xMoEWrapper has no {name} (asked for {value})")
    return out


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
