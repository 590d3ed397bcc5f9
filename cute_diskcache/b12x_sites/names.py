"""b12x's module names that the rest of the package needs, and nothing else.

Imported at interpreter start by the activation hook (which watches these modules being
imported), so it imports nothing: every other fact about b12x stays in this package.
"""

B12X = "b12x"
#: b12x's one compile wrapper and its disk layer: stood aside as it is imported (:mod:`.native`).
COMPILER = "b12x._lib.compiler"
#: Where b12x keeps its "no lowering now" flag (a no-compilation phase: :mod:`.native`).
COMPILE_PLAN = "b12x._lib.compile_plan"
#: Every module under these prefixes is offered to the adapter as it is imported.
SITE_PACKAGES = (COMPILER,)
