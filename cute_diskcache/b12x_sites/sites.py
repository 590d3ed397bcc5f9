"""Owns the table of b12x's compile sites and the facts of its code that the key needs: data only.

Every CuTe compile b12x 1.5.1 makes goes through one wrapper, ``_lib/compiler.py::
_call_cute_compile`` (called by ``compile``, which ``launch`` calls; no other b12x module calls
``cute.compile``): one row, naming its entries by the compile target (``per_target``:
``b12x.dense_gemm._DenseGemmLaunch``), so ``stats``, ``ls`` and ``doctor`` still show kernels by
family. Its key is what the compile receives, as for flashinfer's sites; b12x's own key is never
used. The whole b12x tree is fingerprinted (``tree=""``): b12x resolves kernels through shared
helpers, and fingerprints every file of its package itself.

flashinfer 0.7.4's embedded copy (``flashinfer/experimental/b12x``) is flashinfer's: its compiles
are left to that copy's own cache by flashinfer's adapter (``flashinfer_sites.sites.OWN_DISK_CACHES``).
"""

from __future__ import annotations

from ..core.adapter import Row

COMPILER_FILE = "_lib/compiler.py"
WRAPPER = "_call_cute_compile"

ROWS: tuple[Row, ...] = (
    Row(COMPILER_FILE, WRAPPER, "cute", "b12x", "b12x", tree="", per_target=True),
)
BY_WHERE: dict[tuple[str, str], Row] = {(r.file, r.function): r for r in ROWS}

#: b12x's disk layer, around the compile in ``compiler.compile``: stands aside while ours serves
#: (:mod:`.native`): a load finds nothing, a store and a manifest write nothing, the per-key lock
#: is no lock (our single-flight covers the compile; b12x's opens a file for writing in its
#: directory, which raises on a read-only or foreign-owned one); b12x's own again where its
#: compile pool hands kernels from workers to their parent (:mod:`.native` says where). With it,
#: b12x's miss log, held until b12x's books can say whether ours served the kernel (one voice).
NATIVE_LAYER = ("_load_cute_compile_from_disk", "_store_cute_compile_to_disk", "_ensure_cute_compile_manifest",
                "_disk_cache_key_lock", "_log_cute_compile_miss")

#: Variables b12x's code reads that change no generated code: b12x's own list
#: (``_compile_environment_key``'s operational variables) less the three that pick a configuration
#: (``B12X_AUTOTUNE``, ``B12X_AUTOTUNE_EXHAUSTIVE``, ``B12X_TUNING_CACHE_VERSION`` stay keyed).
NOT_CODEGEN_ENV = frozenset({
    "B12X_COMPILE_CACHE_DIR", "B12X_COMPILE_DISK_CACHE", "B12X_COMPILE_MEMORY_CACHE",
    "B12X_COMPILE_MEMORY_CACHE_SIZE", "B12X_COMPILE_SPEC_MEMO", "B12X_LOG_CUTE_COMPILES",
    "B12X_LOG_CUTE_COMPILES_AFTER_ENGINE_START", "B12X_LOG_CUTE_COMPILE_ARGS",
    "B12X_LOG_CUTE_COMPILE_STACK", "B12X_LOG_CUTE_COMPILE_STACK_DEPTH", "B12X_PRINT_COMPILE_PROGRESS",
    "B12X_PREPARATION_TRACE_DIR", "B12X_TIMING", "B12X_TIMING_THRESHOLD_MS", "B12X_ENGINE_STARTED",
    "B12X_COMPILE_WORKERS", "XDG_CACHE_HOME",
})
#: Compile keywords that change no generated code (b12x's offline workers add ``no_jit_engine``).
NOT_CODEGEN_KWARGS = frozenset({"no_jit_engine"})
#: What ``doctor`` says of the row.
NOTE = "b12x's one compile wrapper: every b12x kernel, keyed by everything the compile receives"

#: The kernel functions (``doctor``'s b12x sites) whose compiles ``prewarm`` plans, with the flags
#: that plan them: the functions vLLM's warm-up reaches through b12x for the bundled models, as
#: running the planners shows (``tests/test_b12x_planned.py`` runs them and compares). Every other
#: b12x kernel function compiles at the engine's first start, through the wrapper into our cache,
#: and hits from then on; ``docs/versions.md``'s survey says why each family is not planned.
PLANNED: dict[tuple[str, str], str] = {
    ("_lib/dense_gemm.py", "_get_compiled_dense_gemm"): "--linear-backend b12x (NVFP4)",
    ("moe/fused_moe/_impl.py", "_get_micro_kernel"): "--moe-backend b12x (NVFP4)",
    ("moe/fused_moe/_impl.py", "_get_dynamic_kernel"): "--moe-backend b12x (NVFP4)",
}

#: What prewarm's planning (:mod:`.planning`) calls in b12x, by file: its preparation system
#: (declarations, device identity, the compile jobs of a configuration) and its GPU-less compile
#: workers, both first in b12x 1.5.0 (1.5.0 and 1.5.1 ship the same code). A b12x without them
#: (1.3.0 and older) cannot be planned offline: prewarm refuses it, doctor says why; its runtime
#: compiles still go through the wrapper row above.
PLANNING_API: dict[str, tuple[str, ...]] = {
    "_lib/compile_pool.py": ("_initialize_worker", "_factory"),
    "gemm/blockscaled/_preparation.py": ("heuristic_plan", "query_from_call"),
    "preparation/device.py": ("DetectedDevice",),
    "preparation/types.py": ("DeviceIdentity",),
}
