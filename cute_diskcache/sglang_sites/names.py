"""SGLang's module names that the rest of the package needs, and nothing else.

Imported at interpreter start by the activation hook (which watches these modules being
imported), so it imports nothing: every other fact about SGLang stays in this package.
"""

SGLANG = "sglang"
#: SGLang's vendored FlashAttention-4 interface: its compile caches are SGLang's persistent ones
#: (``kernels/jit/cute_aot_cache.py``), stood aside as it is imported (:mod:`.native`).
FA4_INTERFACE = "sglang.kernels.ops.attention.flash_attn.cute.interface"
#: SGLang's JIT arch detection (which PDL and arch targets its kernels compile for); the FA4 interface imports it.
JIT_ARCH = "sglang.kernels.jit.utils.arch"
#: Every module under these prefixes is offered to the adapter as it is imported.
SITE_PACKAGES = (FA4_INTERFACE,)
