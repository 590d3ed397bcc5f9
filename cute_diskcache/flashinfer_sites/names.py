"""flashinfer's module names that the rest of the package needs, and nothing else.

Imported at interpreter start by the activation hook (which watches these modules being
imported), so it imports nothing: every other fact about flashinfer stays in this package.
"""

FLASHINFER = "flashinfer"
SM12X = "flashinfer.fused_moe.cute_dsl.blackwell_sm12x"
MOE_DISPATCH = f"{SM12X}.moe_dispatch"
FLASHINFER_UTILS = "flashinfer.cute_dsl.utils"
#: Every module under these packages is offered to the adapter as it is imported; the adapter
#: decides, per flashinfer version, which ones hold compile sites.
SITE_PACKAGES = (SM12X + ".",)
