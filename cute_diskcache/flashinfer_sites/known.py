"""What the site scan knows about flashinfer besides our own adapters.

:mod:`.scan` finds every CuTe-DSL compile call in the installed flashinfer; this module says how
to read what it found, as data:

* **which arch** a site builds for, from the words its path and its code use: sm12x
  (``sm120``, ``sm_121a``, ``sm12x``, ``b12x``...), another arch only (``sm90``, ``sm100``,
  ``hopper``, ``rubin``, a ``blackwell/`` tree...), or any arch (a kernel with no such word is
  compiled for whatever card runs it, SM120 included);
* flashinfer's **shared compile helpers**, which compile on behalf of callers: each caller is a
  site of its own, persisted or not, so the helper is listed as "per caller";
* flashinfer's **other disk caches** (besides ``build_and_load_cute_dsl_kernel``), and
  generated sources that only ever compile inside another site;
* **test, benchmark and example code** shipped in the wheel (CUTLASS's examples under
  ``data/``, the EP kernels' testers), which no engine reaches.
"""

from __future__ import annotations

import re

#: sm12x family words: sm120, sm_120a, sm121, sm12x, b12x (the blackwell_sm12x tree included).
SM12X = re.compile(r"sm_?12[0-9x](?![0-9])|b12x", re.I)
#: Other archs: Ampere to Rubin by number, and by name.
OTHER = re.compile(r"sm_?(80|86|87|89|90|100|101|103|107|110)(?![0-9])|hopper|rubin", re.I)
#: A path component naming flashinfer's SM100 tree (``fused_moe/cute_dsl/blackwell/``, ``gdn_kernels/blackwell/``).
OTHER_DIRS = frozenset({"blackwell", "hopper", "rubin"})

SM12X_ARCH, ANY_ARCH, OTHER_ARCH = "sm12x", "any", "other"

#: (file, function) -> why: flashinfer's helpers that compile for their callers.
HELPERS = {
    ("gemm/gemm_mm_fp4_cute_dsl.py", "_compile_block_scaled_gemm"):
        "block-scaled GEMM helper: persisted or not per caller (flashinfer's disk cache when given cache_module_name)",
    ("gemm/gemm_mm_fp4_cute_dsl.py", "_make_blockscaled_gemm_compile_fn.compile_kernel"):
        "block-scaled GEMM helper: persisted or not per caller",
    ("gemm/gemm_base.py", "_compile_block_scaled_gemm"):  # 0.6.x keeps it here
        "block-scaled GEMM helper: persisted or not per caller",
}
#: (file, function) -> which cache: compile functions flashinfer persists with a cache of its own.
OWN_CACHES = {
    ("experimental/b12x/_lib/compiler.py", "compile"):
        "flashinfer's experimental b12x disk cache (keyed with torch's version)",
}
#: (file, function) -> why: natively cached sm12x sites left to flashinfer's cache: each compiles only
#: under ``torch.cuda.device`` / from kernel sources its engine specialises for the device, which a
#: box without the card cannot drive, so serving them from ours could not be proven here.
NOT_SERVED = {
    ("fused_moe/backends/cudnn_frost/runtime.py", "_load_source_cached"):
        "cuDNN-Frost compiles sources its engine materialises for the device",
    ("kda_kernels/sm120_prefill/runtime.py", "build_kernel"): "compiles under torch.cuda.device",
}
#: (file pattern, function) -> (file, function): generated kernel sources whose ``compile``
#: only ever runs inside another site (cuDNN-Frost loads its per-arch sources through the
#: native builder in ``runtime._load_source_cached``); they are persisted as that site is.
COMPILED_THROUGH = (
    (re.compile(r"fused_moe/backends/cudnn_frost/artifacts/[^/]+/sources/[^/]+\.py"), "compile",
     ("fused_moe/backends/cudnn_frost/runtime.py", "_load_source_cached")),
)
#: Test, benchmark, example and reference code: a path component, a file or a class/function name.
HARNESS = re.compile(r"(^|[/._])(tests?|testing|tester|benchmarks?|bench|examples?|reference|ref)(?=[/._]|$)"
                     r"|Tester|Benchmark|Reference")


def names_sm12x(data: bytes) -> bool:
    """Whether a file's bytes name the sm12x family anywhere (a fast filter before any parse)."""
    low = data.lower()
    return (b"sm12" in low or b"sm_12" in low or b"b12x" in low) and bool(SM12X.search(low.decode("utf-8", "replace")))


def path_arch(path: str) -> str | None:
    """What a file's place in flashinfer says of its arch (None: nothing)."""
    if SM12X.search(path):
        return SM12X_ARCH
    parts = set(path.split("/")[:-1])
    if OTHER.search(path) or parts & OTHER_DIRS:
        return OTHER_ARCH
    return None


def code_arch(words: set[str]) -> str | None:
    """What the words of a site's code (names, attributes, strings, imports) say of its arch."""
    text = " ".join(words)
    if SM12X.search(text):
        return SM12X_ARCH
    if OTHER.search(text):
        return OTHER_ARCH
    return None


def site_arch(path: str, words: set[str]) -> tuple[str, str]:
    """(arch, why) for a site: its path decides when it names an arch, else its code.

    Code can widen an other-arch file to sm12x (a dispatcher with an SM120 branch), never
    narrow an sm12x tree (its kernels keep class names copied from the SM100 ones).
    """
    by_path, by_code = path_arch(path), code_arch(words)
    if by_path == SM12X_ARCH:
        return SM12X_ARCH, "path"
    if by_code == SM12X_ARCH:
        return SM12X_ARCH, "code"
    if by_path == OTHER_ARCH:
        return OTHER_ARCH, "path"
    if by_code == OTHER_ARCH:
        return OTHER_ARCH, "code"
    return ANY_ARCH, "no arch named"


def harness(path: str, function: str) -> bool:
    """Whether a site is test, benchmark or reference code shipped with flashinfer."""
    return bool(HARNESS.search(path) or HARNESS.search(function))


def compiled_through(path: str, function: str) -> tuple[str, str] | None:
    """The site a generated source's compile runs inside, if it is one (:data:`COMPILED_THROUGH`)."""
    for pattern, fn, target in COMPILED_THROUGH:
        if fn == function and pattern.fullmatch(path):
            return target
    return None
