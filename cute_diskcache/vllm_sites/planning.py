"""Owns driving vLLM's own skinny GEMM compile offline: which configurations a card's plan table
gives a model's layers, and compiling one with vLLM's code for a card that is not here.

vLLM 0.34 marks an unquantized, bias-free BF16 linear (or LM head) for its skinny GEMM when its
weight shape ``(N, K)`` has a plan for the device's capability
(``skinny_gemm_plans.SKINNY_GEMM_PLANS_BY_CAPABILITY``; only (12, 1), DGX Spark), and its warm-up
compiles every configuration of that plan (``kernel_warmup._warmup_skinny_gemm``: the plan's
values, BF16, no residual), whatever the token counts. The kernel depends on the configuration,
the dtype, the residual flag and whether the device supports PDL, never on the layer's N.

Nothing of vLLM's serving stack is imported: importing ``vllm.model_executor`` loads about 440
modules (7.6 s here) and on a CPU box warns that its C extension is missing. The package parents
above the kernels' directory are registered as bare packages over their real directories (their
``__init__`` not run), so the two modules load under their real names (the key names the kernel's
class by its module) with what they import themselves. A process where vLLM is already imported
uses it as it is. Either way the process must not serve afterwards.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import types
from typing import Any

from .names import SKINNY_GEMM, SKINNY_GEMM_PLANS, VLLM

#: vLLM's packages above the skinny GEMM's modules, registered bare when vLLM is not imported.
_PARENTS = (VLLM, "vllm.model_executor", "vllm.model_executor.kernels", "vllm.model_executor.kernels.linear")


def _modules() -> tuple[types.ModuleType, types.ModuleType]:
    """(``skinny_gemm_plans``, ``skinny_gemm``), loaded without vLLM's package initialisers."""
    if VLLM not in sys.modules:
        from .adapter import package_dir

        root = package_dir()
        if root is None:
            raise ImportError("vLLM is not installed in this interpreter")
        for name in _PARENTS:
            module = types.ModuleType(name)
            module.__path__ = [os.path.join(root, *name.split(".")[1:])]
            sys.modules[name] = module
    return importlib.import_module(SKINNY_GEMM_PLANS), importlib.import_module(SKINNY_GEMM)


def plans(capability: tuple[int, int]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """The plan table for ``capability``: each weight shape ``(N, K)`` with the configurations its
    plan names (plain fields, in vLLM's order), empty when vLLM plans nothing for that card."""
    table = _modules()[0].SKINNY_GEMM_PLANS_BY_CAPABILITY.get(tuple(capability)) or {}
    return {tuple(shape): _unique(dataclasses.asdict(c) for c in plan.values()) for shape, plan in table.items()}


def configs(capability: tuple[int, int], shapes: list[tuple[int, int]] | None) -> list[dict[str, Any]]:
    """What vLLM's warm-up compiles for layers of these weight shapes on that card: the union of
    their plans' configurations (every configuration of the table when ``shapes`` is None)."""
    table = plans(capability)
    chosen = table.values() if shapes is None else [table[s] for s in shapes if s in table]
    return sorted(_unique(c for plan in chosen for c in plan), key=lambda c: tuple(-1 if v is None else v for v in c.values()))


def _unique(items: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out


def init_worker(target: str, host_machine: str | None = None) -> None:
    """A process that plans or compiles for ``target``: the host machine its entries are for (the
    parent chose it, :func:`..prewarm.choose_host_machine`), the card's profile in place (the DSL's
    arch, torch.cuda's answers: vLLM is not one of the libraries whose import applies it), then our
    cache on."""
    from ..activation import install
    from ..keys import hostmachine, targets

    hostmachine.build_for(host_machine)  # before the first key
    targets.apply(target)
    install(target=target)


def compile_config(config: dict[str, Any], capability: tuple[int, int]) -> None:
    """vLLM's own ``ShapeDynamicSkinnyGemm._compile`` for one configuration (BF16, no residual, as
    its warm-up asks), answering its two device questions as vLLM's CUDA platform would on the card:
    PDL is supported from capability 9 (``CudaPlatform.is_arch_support_pdl``), and the stream is a
    driver ``CUstream`` (the key takes a stream by its type; a fake stream would key apart)."""
    import torch
    from cuda.bindings.driver import CUstream

    module = _modules()[1]
    gemm = module.ShapeDynamicSkinnyGemm()
    gemm._use_pdl = lambda: capability[0] >= 9
    gemm._stream = lambda: CUstream(0)
    gemm._compile(torch.bfloat16, module.SkinnyGemmConfig(**config), False)
