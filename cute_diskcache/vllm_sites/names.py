"""vLLM's module names that the rest of the package needs, and nothing else.

Imported by the adapters' registry and by prewarm, so it imports nothing: every other fact about
vLLM stays in this package.
"""

VLLM = "vllm"
#: The module of vLLM's own shape-dynamic skinny GEMM (its one ``cute.compile`` call on sm12x).
SKINNY_GEMM = "vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm"
#: vLLM's plan tables for it, by device capability.
SKINNY_GEMM_PLANS = "vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm_plans"
