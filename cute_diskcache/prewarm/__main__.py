"""``python -m cute_diskcache.prewarm``: the prewarm command (and its workers, ``--worker``)."""

import sys

from . import console

sys.exit(console())
