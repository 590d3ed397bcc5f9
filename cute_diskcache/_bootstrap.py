"""Run by ``cute_diskcache.pth`` at interpreter start, only when FLASHINFER_B12X_DISK_CACHE is on.

The .pth line itself checks the variable, so an interpreter without it never imports this
package. Here we only register an import hook: flashinfer, torch and the DSL stay unimported
until the program imports them itself.
"""

try:
    from .activation import install as _install

    _install()
except Exception as _exc:  # pragma: no cover  # noqa: BLE001 - a broken cache must never break python itself
    import logging

    logging.getLogger("cute_diskcache").warning("cute-diskcache bootstrap failed: %s", _exc)
