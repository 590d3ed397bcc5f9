"""Child for tests/test_vllm.py: vLLM 0.34.0's own code, on this CPU box, beside cute-diskcache.

Run with the vLLM test venv's interpreter (vLLM installed ``--no-deps``, cute-diskcache as a
wheel), never imported by pytest. Two modes, each printing one JSON line:

``plugins [--enable]``
    The variable is unset at interpreter start (so the ``.pth`` hook does nothing); with
    ``--enable`` it is set afterwards, then ``vllm.plugins.load_general_plugins()`` runs. Reports
    whether vLLM ran our entry point and whether the cache got attached.

``experts MODEL TP MAX_NUM_TOKENS [MODEL TP MAX_NUM_TOKENS ...]``
    For each model in turn (one JSON list when there are several), vLLM's ``FlashInferB12xExperts`` builds its ``B12xMoEWrapper`` (``_ensure_wrapper``, what its
    first ``apply`` does) from a ``FusedMoEConfig`` that vLLM's own class completes (TP split,
    max_num_tokens), for the bundled model's full-size shape; prewarm's dispatcher builds one
    for the same model, TP and max tokens. Both are real flashinfer wrappers; reported: the
    keywords vLLM passed, and each wrapper's scalar state. The one liberty taken: vLLM's wrapper
    gets ``device="cpu"`` added (there is no GPU here; vLLM leaves the device to flashinfer).
    Nothing is carried from one model to the next: flashinfer's class is given back after each.

``serve``
    A vLLM process's logging as vLLM sets it up (``vllm.logger.configure_logging`` with the
    default ``LoggingConfig``: a handler on the ``vllm`` logger only, stdout), the cache attached
    by vLLM's plugin loader, then flashinfer's MoE wrapper run for m=1 through the rtx-pro-6000
    profile. Nothing logs for cute-diskcache here: its lines must appear on their own.

``monitor MODE M [M ...]``
    ``serve``'s process after warm-up: vLLM's own JIT monitor activated as a vLLM worker does at
    the end of warm-up (``vllm.utils.jit_monitor.activate(mode=MODE)``, which wraps
    ``cutlass.cute.compile``), then flashinfer's MoE wrapper run for each ``M`` in turn. Reports
    the cache's counters and, per M, the error raised (vLLM's RuntimeError in ``error`` mode), if any.

``tp N``
    A tensor-parallel engine start on one node: N worker processes started as vLLM's
    multiprocessing executor starts them (``spawn``), each importing vLLM's distributed module,
    then flashinfer (so the cache attaches before the ranks exist, as in a worker), then setting
    up vLLM's world (``init_distributed_environment``, gloo on the CPU), running flashinfer's MoE
    wrapper for m=1 and tearing the world down again before exit, as vLLM's shutdown does.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def plugins(enable: bool) -> dict[str, Any]:
    assert "FLASHINFER_B12X_DISK_CACHE" not in os.environ, "the .pth would have attached the cache already"
    if enable:
        os.environ["FLASHINFER_B12X_DISK_CACHE"] = "1"
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from cute_diskcache import activation

    return {
        "entry_point_ran": "cute_diskcache.vllm_plugin" in sys.modules,
        "installed": activation.installed(),
        "import_hooks": sum(isinstance(f, activation._Finder) for f in sys.meta_path),
        "flashinfer_imported": "flashinfer" in sys.modules,
    }


def _scalars(obj: Any) -> dict[str, Any]:
    return {k: v for k, v in sorted(vars(obj).items()) if isinstance(v, (bool, int, float, str)) or v is None}


def experts(model: str, tp: int, max_num_tokens: int) -> dict[str, Any]:
    import cute_diskcache

    cute_diskcache.install(target="rtx-pro-6000")  # before flashinfer is imported: no GPU here
    import dataclasses

    import torch
    import flashinfer.fused_moe as ffm
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType, nvfp4_moe_quant_config)
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import FlashInferB12xExperts

    from cute_diskcache import prewarm
    from cute_diskcache.prewarm import models

    full = models.moe_shape(model, tp=1)  # what the checkpoint says; vLLM splits it by TP itself
    passed: list[dict[str, Any]] = []
    real = ffm.B12xMoEWrapper

    class Recorded(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            passed.append({"args": list(args), "kwargs": {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))
                                                          or v is None}})
            super().__init__(*args, **{"device": "cpu", **kwargs})

    ffm.B12xMoEWrapper = Recorded
    activation = {"silu": MoEActivation.SILU, "relu2": MoEActivation.RELU2_NO_MUL, "gelu_tanh": MoEActivation.GELU_TANH}[full.activation]
    moe_config = FusedMoEConfig(
        num_experts=full.num_experts, experts_per_token=full.top_k, hidden_dim=full.hidden_size,
        intermediate_size=full.intermediate_size, num_local_experts=full.num_experts, num_logical_experts=full.num_experts,
        activation=activation, device="cpu", routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=dataclasses.replace(FusedMoEParallelConfig.make_no_parallel(), tp_size=tp),
        in_dtype=torch.bfloat16, max_num_tokens=max_num_tokens,
    )
    E = full.num_experts
    quant_config = nvfp4_moe_quant_config(g1_alphas=torch.ones(E), g2_alphas=torch.ones(E), a1_gscale=torch.ones(E),
                                          a2_gscale=torch.ones(E), w1_scale=torch.ones(E), w2_scale=torch.ones(E))
    vllm_experts = FlashInferB12xExperts(moe_config, quant_config)
    try:
        vllm_experts._ensure_wrapper()
    finally:
        ffm.B12xMoEWrapper = real
    ours = prewarm._dispatcher(models.moe_shape(model, tp=tp), max_num_tokens)
    return {
        "vllm_passed": passed,
        "vllm_moe_config": {"intermediate_size_per_partition": moe_config.intermediate_size_per_partition,
                            "max_num_tokens": moe_config.max_num_tokens},
        "vllm_wrapper": _scalars(vllm_experts._wrapper),
        "prewarm_wrapper": _scalars(ours.wrapper),
        "prewarm_passed": {k: v for k, v in ours.wrapper_kwargs.items() if isinstance(v, (bool, int, float, str)) or v is None},
    }


def serve() -> dict[str, Any]:
    os.environ["FLASHINFER_B12X_DISK_CACHE"] = "1"
    os.environ["CUTE_DISKCACHE_TARGET"] = "rtx-pro-6000"  # no GPU here
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging, init_logger
    from vllm.plugins import load_general_plugins

    configure_logging(LoggingConfig())
    init_logger("vllm.cdc_test").info("vLLM logging configured")
    load_general_plugins()
    from cute_diskcache import counters, flashinfer_sites

    flashinfer_sites.import_dispatch()
    flashinfer_sites.dispatch(128, 8, 2048, 768, [1], max_num_tokens=4096, activation="silu")
    return counters()


def monitor(mode: str, ms: list[int]) -> dict[str, Any]:
    os.environ["FLASHINFER_B12X_DISK_CACHE"] = "1"
    os.environ["CUTE_DISKCACHE_TARGET"] = "rtx-pro-6000"  # no GPU here
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.plugins import load_general_plugins

    configure_logging(LoggingConfig())
    load_general_plugins()
    from cute_diskcache import counters, flashinfer_sites

    flashinfer_sites.import_dispatch()
    from vllm.utils import jit_monitor

    jit_monitor.activate(mode=mode)  # type: ignore[arg-type]
    # What each m's call raised: without a GPU every launch fails after the kernel is in hand
    # (a TypeError on CPU tensors); vLLM's RuntimeError means the monitor stopped the call first.
    raised = {str(r["m"]): r["launch_error"] for r in flashinfer_sites.dispatch(128, 8, 2048, 768, ms, max_num_tokens=4096,
                                                                              activation="silu")}
    return {**counters(), "raised": raised}


def _tp_worker(rank: int, size: int, port: int) -> None:
    os.environ["FLASHINFER_B12X_DISK_CACHE"] = "1"
    os.environ["CUTE_DISKCACHE_TARGET"] = "rtx-pro-6000"  # no GPU here
    from vllm.distributed import parallel_state
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from cute_diskcache import flashinfer_sites

    flashinfer_sites.import_dispatch()  # the cache attaches here; vLLM's ranks do not exist yet
    parallel_state.init_distributed_environment(world_size=size, rank=rank, local_rank=rank,
                                                distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    flashinfer_sites.dispatch(128, 8, 2048, 768, [1], max_num_tokens=4096, activation="silu")
    parallel_state.destroy_distributed_environment()


def tp(size: int) -> dict[str, Any]:
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_tp_worker, args=(r, size, port)) for r in range(size)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(600)
    return {"exitcodes": [w.exitcode for w in workers]}


def main(argv: list[str]) -> int:
    if argv[0] == "plugins":
        out = plugins("--enable" in argv[1:])
    elif argv[0] == "serve":
        out = serve()
    elif argv[0] == "tp":
        out = tp(int(argv[1]))
    elif argv[0] == "monitor":
        out = monitor(argv[1], [int(m) for m in argv[2:]])
    else:
        cases = [experts(argv[i], int(argv[i + 1]), int(argv[i + 2])) for i in range(1, len(argv), 3)]
        out = cases[0] if len(cases) == 1 else cases
    print(json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
