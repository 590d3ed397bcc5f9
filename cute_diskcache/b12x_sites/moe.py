"""Owns b12x's fused MoE as vLLM 0.34's ``--moe-backend b12x`` drives it, made offline.

vLLM's ``b12x_warmup`` asks each MoE layer's ``B12xExperts`` (``fused_moe/b12x.py``) for one warm-up
unit per layer signature, whose ``warmup_launches(token_counts)`` does, for one layer: per token
count, b12x's ``plan_execution`` names an (implementation, execution) signature; the first count of
each signature is launched: ``plan(Caps(max_tokens=count, ..., frozen=True))``, ``bind``, ``run``.
b12x compiles inside that run (its tensor API, which vLLM uses, declares no compile job), so
:func:`drive` makes those calls, on experts b12x's own ``prepare_weights`` prepared from placeholder
CPU tensors of the shapes vLLM hands it. A compile depends on shapes, dtypes, modes and the plan,
not on weight values (``tests/test_b12x_moe.py`` compares the keys with those of random weights).
The caller chooses what a compile does: :func:`..core.through.planning` (keys only, ``check``) or
:func:`..core.through.launching_nothing` (compiled into our cache; prewarm); nothing launches.

Two answers stand in for the card (the tensors are CPU ones, the card is a target profile):
b12x's SM count of a tensor's device (``get_num_sm``, 1 for a CPU device) and the direct micro
kernel's launch-capability probe (``cuKernelGetAttribute`` on the loaded kernel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

#: vLLM's ``_B12X_MOE_MODES`` for the checkpoints prewarm reads: the mode name prewarm uses ->
#: (b12x quant mode, source format, W13 layout). ``nvfp4-a16`` is ``VLLM_B12X_MOE_FP4_FORCE_A16=1``.
MODES: dict[str, tuple[str, str, str]] = {
    "nvfp4": ("nvfp4", "modelopt_nvfp4", "w31"),
    "nvfp4-a16": ("w4a16", "modelopt_nvfp4", "w13"),
    "mxfp4-a8": ("w4a8_mx", "fp4_e8m0_k32", "w31"),
    "mxfp4-a16": ("w4a16", "fp4_e8m0_k32", "w31"),
}
#: Modes whose preparation runs on the CPU: b12x repacks W4A16 and MXFP4 W4A8 weights with a
#: kernel on the weights' device (``prepare_w4a16_packed_weights`` asks that device's properties).
OFFLINE_MODES = ("nvfp4",)


def _round_up(v: int, to: int) -> int:
    return (v + to - 1) // to * to


@dataclasses.dataclass(frozen=True)
class Layer:
    """One MoE layer as ``B12xExperts`` sees it after vLLM's NVFP4 conversion for b12x."""

    num_experts: int
    hidden_size: int
    intermediate_size: int  # per rank, before vLLM pads it to 64 (``_pad_gated_weights``)
    top_k: int
    activation: str
    dtype: str  # the engine's activation dtype: bfloat16 or float16
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    swiglu_beta: float | None = None

    @property
    def padded_intermediate(self) -> int:
        return _round_up(self.intermediate_size, 64)

    def tensor_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The tensors vLLM hands ``prepare_weights`` (``prepare_nvfp4_moe_layer_for_b12x``: gated
        halves padded to 64 rows, block scales swizzled to 128 x 4 tiles)."""
        e, h, i = self.num_experts, self.hidden_size, self.padded_intermediate
        return {
            "w1_fp4": ((e, 2 * i, h // 2), "uint8"),
            "w1_blockscale": ((e, _round_up(2 * i, 128), _round_up(h // 16, 4)), "float8_e4m3fn"),
            "w2_fp4": ((e, h, i // 2), "uint8"),
            "w2_blockscale": ((e, _round_up(h, 128), _round_up(i // 16, 4)), "float8_e4m3fn"),
            **{name: ((e,), "float32") for name in ("w1_global_scale", "w2_global_scale", "a1_gscale", "a2_gscale")},
        }


def layer_of(shape: Any, dtype: str) -> Layer:
    """The layer of a :class:`..prewarm.models.MoEShape` (its swiglu parameters as vLLM's
    ``_swiglu_params`` passes them: alpha and beta only for ``swigluoai_uninterleave``)."""
    oai = shape.activation == "swigluoai_uninterleave"
    return Layer(shape.num_local_experts, shape.hidden_size, shape.intermediate_size, shape.top_k, shape.activation,
                 dtype, shape.swiglu_limit, shape.swiglu_alpha if oai else None, shape.swiglu_beta if oai else None)


def placeholders(layer: Layer) -> dict[str, Any]:
    """Uninitialised CPU tensors of the shapes and dtypes vLLM prepares (no weight is read)."""
    import torch

    return {name: torch.empty(s, dtype=getattr(torch, d)) for name, (s, d) in layer.tensor_shapes().items()}


def prepare(layer: Layer, mode: str, tensors: dict[str, Any]) -> Any:
    """b12x's prepared experts, as ``B12xExperts._prepare_experts`` asks for them."""
    import torch
    from b12x.moe import fused_moe

    quant_mode, source_format, w13_layout = MODES[mode]
    dtype = getattr(torch, layer.dtype)
    plan = fused_moe.plan_weights(quant_modes=quant_mode, source_format=source_format, activation=layer.activation,
                                  params_dtype=dtype, num_experts=layer.num_experts, hidden_size=layer.hidden_size,
                                  intermediate_size=layer.padded_intermediate, w13_layout=w13_layout)
    return fused_moe.prepare_weights(plan=plan, params_dtype=dtype, **tensors)


@contextlib.contextmanager
def card_answers(sm_count: int) -> Iterator[None]:
    """The two device answers of the module docstring, for b12x modules loaded now; put back after."""
    from b12x._lib import utils
    from b12x.moe.fused_moe import _impl

    real_sms = utils.get_num_sm

    def get_num_sm(device: Any) -> int:
        return sm_count if getattr(device, "type", "cuda") != "cuda" else real_sms(device)

    replaced = [(m, "get_num_sm", real_sms) for m in list(sys.modules.values())
                if getattr(m, "__name__", "").startswith("b12x.") and getattr(m, "get_num_sm", None) is real_sms]
    replaced.append((_impl, "_compiled_direct_micro_accepts_block_dim", _impl._compiled_direct_micro_accepts_block_dim))
    for module, name, _ in replaced:
        setattr(module, name, get_num_sm if name == "get_num_sm" else (lambda compiled, block_dim: True))
    try:
        yield
    finally:
        for module, name, real in replaced:
            setattr(module, name, real)


def launch_counts(prepared: Any, layer: Layer, mode: str, counts: tuple[int, ...]) -> dict[tuple[Any, Any], int]:
    """``warmup_launches``'s choice: the first token count of each (implementation, execution)."""
    from b12x.moe import fused_moe

    chosen: dict[tuple[Any, Any], int] = {}
    for tokens in sorted({int(c) for c in counts if int(c) > 0}):
        plan = fused_moe.plan_execution(num_tokens=tokens, num_topk=layer.top_k, device=prepared.w1_fp4.device,
                                        weight_plan=prepared.plan, quant_mode=MODES[mode][0],
                                        apply_router_weight_on_input=False, swiglu_limit=layer.swiglu_limit,
                                        swiglu_alpha=layer.swiglu_alpha, swiglu_beta=layer.swiglu_beta)
        chosen.setdefault((plan.implementation, plan.execution), tokens)
    return chosen


def launch(prepared: Any, layer: Layer, mode: str, tokens: int) -> None:
    """One of ``warmup_launches``'s launches: b12x's plan, bind and run for ``tokens`` rows."""
    import torch
    from b12x.moe import fused_moe

    quant_mode = MODES[mode][0]
    device, dtype, k = prepared.w1_fp4.device, getattr(torch, layer.dtype), layer.top_k
    plan = fused_moe.plan(fused_moe.Caps(
        max_tokens=tokens, num_topk=k, device=device, weight_plan=prepared.plan, core_token_counts=(tokens,),
        route_num_experts=0, quant_mode=quant_mode, apply_router_weight_on_input=False,
        swiglu_limit=layer.swiglu_limit, swiglu_alpha=layer.swiglu_alpha, swiglu_beta=layer.swiglu_beta, frozen=True))
    hidden = torch.zeros((tokens, layer.hidden_size), dtype=dtype, device=device)
    ids = torch.arange(k, dtype=torch.int32, device=device).unsqueeze(0).expand(tokens, -1).contiguous()
    ids.remainder_(layer.num_experts)
    binding = fused_moe.bind(
        plan, scratch=torch.empty((int(plan.scratch_specs()[0].shape[0]),), dtype=torch.uint8, device=device),
        a=hidden, experts=prepared, topk_weights=torch.full((tokens, k), 1.0 / k, dtype=torch.float32, device=device),
        topk_ids=ids, output=torch.empty_like(hidden), input_scales_static=True,
        unit_scale_contract=quant_mode == "w4a16")
    fused_moe.run(binding=binding)


def drive(layer: Layer, mode: str, counts: tuple[int, ...], sm_count: int,
          tensors: dict[str, Any] | None = None) -> list[tuple[str, int]]:
    """``warmup_launches`` for ``layer``: (implementation, tokens) of each launch, in order. Run it
    under :func:`..core.through.planning` or :func:`..core.through.launching_nothing`."""
    prepared = prepare(layer, mode, tensors if tensors is not None else placeholders(layer))
    done = []
    with card_answers(sm_count):
        for (implementation, _execution), tokens in launch_counts(prepared, layer, mode, counts).items():
            launch(prepared, layer, mode, tokens)
            done.append((str(implementation), tokens))
    return done
