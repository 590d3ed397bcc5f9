"""Owns prewarm's b12x side: which b12x kernels vLLM 0.34's b12x warm-up compiles, planned by b12x.

vLLM's ``model_executor/warmup/b12x_warmup.py`` calls, for every linear layer shape of the model
and every token count of ``utils/b12x.py::b12x_warmup_token_counts`` (``{1}``, the CUDA-graph
capture sizes, the largest batch), ``blockscaled.mm_nvfp4`` (``kernels/linear/nvfp4/b12x.py``).
b12x resolves each call to a declaration: ``heuristic_plan(query_from_call(operands, recipe))``
(``torch.ops.b12x.blockscaled_serialized``), whose row capacity is the next power of two, then
materialises its default configuration for the device through metadata-only ``CompileJob``
factories (``_compile_jobs``: the same factory and arguments its lazy path runs). This module
makes the same calls with meta tensors (shapes and dtypes only) and a target profile's device
identity, and runs the jobs in workers set up as b12x's own GPU-less compile workers
(``compile_pool._initialize_worker``), with our cache on: every compile goes through the hook.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: vLLM 0.34's NVFP4 recipe as ``mm_nvfp4`` passes it to ``blockscaled.mm``.
NVFP4 = {"ab_dtype": "float4_e2m1fn", "sf_dtype": "float8_e4m3fn", "sf_vec_size": 16, "block_fp8": False}
#: The device UUID a target profile stands for (b12x's worker setup asks for one; keys never hold it).
_UUID = "GPU-00000000-0000-0000-0000-000000000000"


def default_capture_sizes(max_num_batched_tokens: int, max_num_seqs: int = 256) -> list[int]:
    """vLLM 0.34's default CUDA-graph capture sizes (``VllmConfig._set_cudagraph_sizes``, no
    speculative decoding): 1, 2, 4, 8..248 by 8, 256..ceiling by 16, the ceiling being
    ``min(2 * max_num_seqs, 512, max_num_batched_tokens)``."""
    cap = min(max_num_seqs * 2, 512, max_num_batched_tokens)
    sizes = [n for n in (1, 2, 4) if n <= cap] + list(range(8, min(cap + 1, 256), 8)) + list(range(256, cap + 1, 16))
    extra = [n for n in (max_num_batched_tokens, max_num_seqs) if n <= cap]
    return sorted(set(sizes + extra))


def token_counts(max_num_batched_tokens: int, capture_sizes: list[int] | None = None) -> tuple[int, ...]:
    """``b12x_warmup_token_counts``: 1, the serving sizes (capture sizes), the largest batch."""
    sizes = default_capture_sizes(max_num_batched_tokens) if capture_sizes is None else capture_sizes
    return tuple(sorted({1, *(int(s) for s in sizes if int(s) > 0), int(max_num_batched_tokens)}))


@dataclasses.dataclass
class PlannedJob:
    """One b12x compile job: a declaration's default configuration on the target, and the calls that need it."""

    linear: str
    n: int
    k: int
    capacity: int
    job: Any  # b12x's CompileJob (factory, args, kwargs)
    ms: list[int] = dataclasses.field(default_factory=list)

    @property
    def factory(self) -> str:
        return str(self.job.factory)

    def identity(self) -> str:
        """What makes two jobs the same work: the factory and its metadata arguments."""
        return repr((self.job.factory, self.job.args, self.job.kwargs))


def detected_device(profile: Any) -> Any:
    """b12x's ``DetectedDevice`` for a target profile (``preparation/device.py``), ordinal 0."""
    from b12x.preparation.device import DetectedDevice
    from b12x.preparation.types import DeviceIdentity

    identity = DeviceIdentity(vendor="nvidia", compute_capability=tuple(profile.capability), sm_count=profile.sm_count,
                              product_name=profile.device_name)
    return DetectedDevice(ordinal=0, identity=identity, uuid=_UUID,
                          max_shared_memory_per_block=profile.max_shared_memory_per_block_optin,
                          max_shared_memory_per_multiprocessor=profile.max_shared_memory_per_multiprocessor)


def _declaration(n: int, k: int, m: int, out_dtype: str) -> Any:
    """What ``mm_nvfp4`` on an (m x k) activation and an (n x k) NVFP4 weight resolves to."""
    import torch
    from b12x.gemm.blockscaled._preparation import heuristic_plan, query_from_call

    def meta(shape: tuple[int, ...], dtype: Any) -> Any:
        return torch.empty(shape, dtype=dtype, device="meta")

    source = (meta((m, k // 2), torch.uint8), meta((m, k // 16), torch.float8_e4m3fn))
    weight = (meta((n, k // 2), torch.uint8), meta((n, k // 16), torch.float8_e4m3fn))
    query = query_from_call(source, weight, alpha=meta((1,), torch.float32), c_dtype=out_dtype, expected_m=None, **NVFP4)
    return heuristic_plan(query, torch.device("cuda", 0))


def plan(dense: Any, counts: tuple[int, ...], profile: Any) -> list[PlannedJob]:
    """The b12x compile jobs of vLLM's NVFP4 linear warm-up for ``dense`` (a :class:`~..prewarm.models.DenseShape`)."""
    device = detected_device(profile)
    jobs: dict[str, PlannedJob] = {}
    for lin in dense.linears:
        for m in counts:
            declaration = _declaration(lin.n, lin.k, m, dense.out_dtype)
            configuration = declaration.contract.configure(declaration.query, device=device.identity,
                                                           override=declaration.override, search=False)
            for job in declaration._compile_jobs(configuration.default, device):
                planned = PlannedJob(lin.name, lin.n, lin.k, declaration.query.max_rows, job)
                planned = jobs.setdefault(planned.identity(), planned)
                planned.ms.append(m)
    return list(jobs.values())


def init_worker(target: str, host_machine: str | None = None) -> None:
    """A compile worker: the host machine its entries are for (the parent chose it: the target's,
    :func:`..prewarm.choose_host_machine`; another machine's means cross-built host code in that
    machine's namespace), our cache on and the target profile in place, then b12x's own GPU-less
    compile environment for that card (torch.cuda's answers, the DSL's arch)."""
    from ..keys import hostmachine, targets
    from ..activation import install

    hostmachine.build_for(host_machine)  # before the first key
    install(target=target)
    profile = targets.get(target)
    from b12x._lib import compile_pool

    from . import native

    native.keep_store_aside()  # b12x's set-up below marks this process as its own compile worker
    compile_pool._initialize_worker(0, tuple(profile.capability), _UUID, profile.device_name, profile.sm_count,
                                    profile.max_shared_memory_per_block_optin, profile.max_shared_memory_per_multiprocessor,
                                    _Activity())


def compile_worker(target: str, host_machine: str | None) -> None:
    """A prewarm worker compiling b12x's jobs: :func:`init_worker`, its cache a prewarm worker's (no
    attach line or exit summary, compiles at DEBUG, counted as prewarm statistics), as flashinfer's are."""
    init_worker(target, host_machine)
    from ..core.cache import default_cache

    default_cache().for_prewarm()


class _Activity(list):  # type: ignore[type-arg]
    """The activity counter b12x's worker setup updates (its pool shares one between processes;
    ours are independent, and a ``multiprocessing.Array`` would leak a semaphore per worker)."""

    def __init__(self) -> None:
        super().__init__((0, 0))
        import threading

        self._lock = threading.Lock()

    def get_lock(self) -> Any:
        return self._lock


def run_job(job: Any) -> dict[str, Any]:
    """Run one job's factory (its programs compile, or load from our cache); what it cost, and the
    digests of the entries it compiled or found (``digests``)."""
    import time

    from b12x._lib.compile_pool import _factory

    from ..core.cache import default_cache

    t0 = time.perf_counter()
    with default_cache().tally.watch("compiles", "hits", "errors") as seen:
        programs = _factory(job.factory)(*job.args, **dict(job.kwargs))
    return {"seconds": time.perf_counter() - t0, "programs": len(programs) if hasattr(programs, "__len__") else 1,
            "digests": seen.digests, **seen.counts}
