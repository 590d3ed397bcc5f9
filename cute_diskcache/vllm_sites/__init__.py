"""The vLLM adapter: the only code that knows how vLLM's own CuTe-DSL kernels compile.

vLLM 0.34 calls ``cute.compile`` itself; the site an sm12x engine start reaches (its skinny GEMM on
DGX Spark) is a row of :mod:`.sites`, keyed and served by the library-neutral hook on
``cutlass.cute.compile`` with vLLM's record (:mod:`.adapter`). Nothing is attached to vLLM itself:
it has no disk cache to stand aside and asks the device nothing a profile must answer at import.
:mod:`.planning` drives vLLM's own compile offline for a named card. vLLM is not a dependency:
without it, nothing here is imported.
"""
