"""Driving flashinfer's dense NVFP4 GEMM the way vLLM 0.34 does, to make it compile.

A word on names: flashinfer calls this GEMM's backend ``"b12x"`` (``mm_fp4(backend="b12x")``,
``_b12x_gemm_fp4_runner``), after the project its kernels came from. It is flashinfer's own code,
called "the dense GEMM" here; the b12x *package* (``pip install b12x``) is :mod:`..b12x_sites`.

vLLM's ``FlashInferB12xNvFp4LinearKernel.apply_weights`` quantizes the activations with its
own op, then calls ``flashinfer_scaled_fp4_mm(x_fp4, weight, x_scale, weight_scale, alpha,
x.dtype, backend="b12x")``, which is ``flashinfer.mm_fp4(a, b.t(), a_scale, b_scale.t(), alpha,
out_dtype, use_8x4_sf_layout=False, backend="b12x", block_size=16, use_nvfp4=True)``: the
weight is ``(n, k/2)`` packed FP4 padded to 32, its scales ``(n padded to 128, k/16)`` swizzled,
``alpha`` one float32, no ``out`` and flashinfer's default ``enable_pdl=True``.
(``tests/test_vllm_dense.py`` reads vLLM's source to keep this true.)

Two paths compile there, and :class:`DenseDispatcher` drives both with flashinfer's own code:

* **default**: outside autotuning, flashinfer runs its fallback tactic, the m-aware default
  plan (``_default_dense_gemm_plan``): one kernel per distinct plan over the batch sizes;
* **autotune**: vLLM tunes flashinfer at start-up by default (``enable_flashinfer_autotune``)
  over ``flashinfer.fused_moe.utils.get_hybrid_num_tokens_buckets(max_num_batched_tokens)``;
  for each bucket flashinfer's tuner asks the dense GEMM's runner for its valid tactics and runs (so
  compiles) every one. :meth:`DenseDispatcher.candidates` asks the same runner the same
  question and :meth:`DenseDispatcher.run` runs one tactic the way the tuner does
  (``runner(inputs, tactic=...)``). flashinfer's tuner itself cannot be driven without a GPU:
  it times each tactic with CUDA events and skips the tactic before compiling it.

Without a GPU the tensors live on the CPU; every kernel compiles for the target profile and
its launch is refused by the kernel's own argument check, which is recorded, not raised.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..keys import targets

MM_FP4_BACKEND = "b12x"  # flashinfer's name for the dense GEMM backend (not the b12x package)


def _tuple(value: Any) -> Any:
    """A tactic read back from JSON (lists) as flashinfer builds it (tuples)."""
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value


def tactic_text(tactic: Any) -> str:
    return json.dumps(tactic)


def tactic_from_text(text: str) -> Any:
    return _tuple(json.loads(text))


class DenseDispatcher:
    """``flashinfer.mm_fp4`` with vLLM's arguments for each of a rank's NVFP4 linear shapes.

    ``linears``: ``(n, k)`` per layer kind, as :class:`~..prewarm.models.DenseShape` lists them.
    Weights and scales are zeros: compiles depend on shapes and tactics, never on values.
    """

    def __init__(self, linears: list[tuple[int, int]], *, out_dtype: str = "bfloat16") -> None:
        import torch

        import flashinfer
        from flashinfer.gemm import gemm_base

        if not hasattr(flashinfer, "mm_fp4") or not hasattr(gemm_base, "_b12x_gemm_fp4_runner"):
            raise NotImplementedError("this flashinfer has no dense FP4 GEMM (mm_fp4 backend='b12x')")
        self._mm_fp4 = flashinfer.mm_fp4
        self._gemm_base = gemm_base
        self.device = "cuda" if torch.cuda.is_available() and targets.active() is None else "cpu"
        self.out_dtype = getattr(torch, out_dtype)
        self.linears = [(int(n), int(k)) for n, k in linears]
        fp8 = torch.float8_e4m3fn
        self._weights = [
            (torch.zeros(n, k // 2, dtype=torch.uint8, device=self.device),
             torch.zeros(-(-n // 128) * 128, -(-(k // 16) // 4) * 4, dtype=torch.uint8, device=self.device).view(fp8))
            for n, k in self.linears
        ]
        self._alpha = torch.ones(1, dtype=torch.float32, device=self.device)
        self._held: dict[int, tuple[Any, Any]] = {}  # k -> (activations, scales) for the largest m so far
        self._runner: Any = None

    def _activations(self, m: int, k: int) -> tuple[Any, Any]:
        """``(m, k/2)`` packed FP4 and its swizzled ``(m padded to 128, k/16)`` scales: views of
        buffers kept for the largest m (planning drives every m up to max_num_batched_tokens)."""
        import torch

        held = self._held.get(k)
        if held is None or held[0].shape[0] < m:
            rows = max(m, 2 * held[0].shape[0] if held is not None else 0)
            a = torch.zeros(rows, k // 2, dtype=torch.uint8, device=self.device)
            sf = torch.zeros(-(-rows // 128) * 128, -(-(k // 16) // 4) * 4, dtype=torch.uint8,
                             device=self.device).view(torch.float8_e4m3fn)
            held = self._held[k] = (a, sf)
        return held[0][:m], held[1][:-(-m // 128) * 128]

    def _inputs(self, m: int, index: int) -> list[Any]:
        """The inputs ``mm_fp4`` hands its runners (and its tuner), in its order."""
        import torch

        n, k = self.linears[index]
        a, a_sf = self._activations(m, k)
        b, b_sf = self._weights[index]
        out = torch.empty(m, n, dtype=self.out_dtype, device=self.device)
        get_buf = getattr(self._gemm_base, "_get_stream_cache_buf", None) or self._gemm_base._get_cache_buf  # 0.6.x: the latter
        workspace = get_buf("mm_fp4_workspace", self._gemm_base.DEFAULT_WORKSPACE_SIZE, a.device)
        return [a, b.t(), a_sf, b_sf.t(), self._alpha, self.out_dtype, out, 16, True, workspace]

    def runner(self) -> Any:
        """The dense GEMM's runner (``_b12x_gemm_fp4_runner``), built as ``mm_fp4`` builds it for this device."""
        if self._runner is None:
            from flashinfer.utils import get_compute_capability

            major, minor = get_compute_capability(self._weights[0][0].device)
            self._runner = self._gemm_base._b12x_gemm_fp4_runner(major, minor, True, self.out_dtype, True)
        return self._runner

    def candidates(self, m: int, index: int) -> list[Any]:
        """The tactics flashinfer's tuner profiles (so compiles) for a bucket of m tokens."""
        return list(self.runner().get_valid_tactics(self._inputs(m, index), None))

    def run(self, m: int, index: int | None = None, tactic: Any = None) -> dict[str, Any]:
        """One call per linear (or the one given): ``mm_fp4`` as vLLM calls it, or with ``tactic``
        the runner the way flashinfer's tuner runs a candidate."""
        t0 = time.perf_counter()
        errors = []
        for i in range(len(self.linears)) if index is None else [index]:
            try:
                if tactic is None:
                    a, b, a_sf, b_sf, alpha, out_dtype, *_ = self._inputs(m, i)
                    self._mm_fp4(a, b, a_sf, b_sf, alpha, out_dtype, use_8x4_sf_layout=False, backend=MM_FP4_BACKEND,
                                 block_size=16, use_nvfp4=True)
                else:
                    self.runner()(inputs=self._inputs(m, i), tactic=tactic)
            except Exception as exc:  # expected without a GPU: the kernel refuses CPU tensors
                if self.device == "cuda":
                    raise
                errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
        return {"m": m, "seconds": time.perf_counter() - t0, "launch_errors": errors}


def tuning_buckets(max_num_tokens: int) -> list[int]:
    """The batch sizes vLLM 0.34 tunes flashinfer at (its ``flashinfer_autotune``)."""
    from flashinfer.fused_moe.utils import get_hybrid_num_tokens_buckets

    return list(get_hybrid_num_tokens_buckets(max_num_tokens))
