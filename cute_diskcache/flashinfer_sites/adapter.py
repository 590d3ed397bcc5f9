"""flashinfer's :class:`~..core.adapter.Adapter` record: the facts the library-neutral hook reads.

Data only, gathered from this package: the site table (:mod:`.sites`), the variables that change
no code (:data:`._common.NOT_CODEGEN_ENV`), the direct micro kernel's side data (:mod:`.block_dim`).
"""

from __future__ import annotations

import functools

from ..core.adapter import Adapter, SideData, module_dir
from . import _common, block_dim, sites
from .names import FLASHINFER


@functools.lru_cache(maxsize=1)
def package_dir() -> str | None:
    """flashinfer's package directory (found without importing it)."""
    return module_dir(FLASHINFER)


ADAPTER = Adapter(
    name="flashinfer",
    distribution="flashinfer-python",
    module=FLASHINFER,
    package_dir=package_dir,
    version=lambda: _common.flashinfer_version(),
    by_where=sites.BY_WHERE,
    own_disk_caches=sites.OWN_DISK_CACHES,
    not_codegen_env=_common.NOT_CODEGEN_ENV,
    side_data={"block_dim": SideData(block_dim.extra, block_dim.extra_ok, block_dim.deliver)},
)
