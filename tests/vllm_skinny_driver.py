"""Child of tests/test_vllm_skinny.py: vLLM 0.34's own skinny GEMM warm-up, in a fresh process.

As an engine start on a DGX Spark reaches it (``kernel_warmup``): vLLM's ``maybe_use_skinny_gemm``
marks each BF16, bias-free layer whose weight shape has a plan, ``_warmup_skinny_gemm`` requests
their plans' configurations, and ``cutedsl_warmup`` compiles them, all from vLLM's wheel. The layers
are ``torch.nn.Linear`` on the meta device with the per-rank weight shapes the test names (vLLM's
parallel layers need a process group; the warm-up reads only ``weight`` and ``bias``). The card is
the ``dgx-spark`` profile; vLLM's platform on a CPU torch knows no GPU, so its three answers are the
CUDA platform's on that card: capability (12, 1), PDL supported, the current stream. The cache is
on through ``cute_diskcache.install()``. The last line is JSON: the units compiled and our counters.
"""

from __future__ import annotations

import json
import sys
import types

from cute_diskcache.keys import targets

targets.apply("dgx-spark")
import cute_diskcache  # noqa: E402

cute_diskcache.install(target="dgx-spark")

import torch  # noqa: E402
from vllm.model_executor.layers.utils import maybe_use_skinny_gemm  # noqa: E402
from vllm.model_executor.warmup import cutedsl_warmup, kernel_warmup  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
import vllm.utils.torch_utils as torch_utils  # noqa: E402

current_platform.get_device_capability = lambda device_id=0: DeviceCapability(12, 1)  # type: ignore[method-assign]
current_platform.is_arch_support_pdl = lambda: True  # type: ignore[method-assign]
current_platform.is_cuda = lambda: True  # type: ignore[method-assign]
torch_utils.current_stream = lambda: types.SimpleNamespace(cuda_stream=0)
torch.accelerator.synchronize = lambda *a, **k: None  # no card to wait for

model = torch.nn.Module()
for i, shape in enumerate(sys.argv[1:]):
    n, k = (int(v) for v in shape.split("x"))
    layer = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="meta")
    maybe_use_skinny_gemm(layer)
    model.add_module(f"layer{i}", layer)
kernel_warmup._warmup_skinny_gemm(model)
units = cutedsl_warmup._collect_unique_compile_units(cutedsl_warmup._iter_cutedsl_warmup_compile_units())
cutedsl_warmup.cutedsl_warmup()
print(json.dumps({"units": len(units), "marked": sum(getattr(m, "use_skinny_gemm", False) for m in model.children()),
                  "counters": cute_diskcache.counters()}))
