"""Make the cache's log lines visible in a serving engine that configured no logging for us.

A library must not configure logging for its host, so until now the package added no handler
outside its CLI: inside vLLM (which configures its own ``vllm`` logger only) or a bare script,
our INFO lines went nowhere and warnings reached stderr as bare text through Python's
``logging.lastResort``. Here, when the cache attaches (flashinfer's import, never interpreter
start), the ``cute_diskcache`` logger gets one :class:`FallbackHandler` and a level:

* the handler writes ``[cute-diskcache] WARNING ...`` to stderr only while nobody else would
  show the record: it looks, at each record, for another handler on our logger or on an
  ancestor it propagates to (root's, from ``basicConfig``, SGLang, pytest). When there is one,
  the record reaches it by propagation and ours stays silent, so nothing prints twice, and an
  application that configures logging after we attached is honoured from then on;
* the level comes from ``CUTE_DISKCACHE_LOG_LEVEL`` (``debug|info|warning|error|off``); unset,
  INFO, unless the application already set one for the ``cute_diskcache`` logger (the CLI sets
  ERROR), which is then kept.
"""

from __future__ import annotations

import logging
import sys

LOGGER = "cute_diskcache"
LEVEL_ENV = "CUTE_DISKCACHE_LOG_LEVEL"  # config.SETTINGS["log_level"]
#: The accepted values of :data:`LEVEL_ENV`; ``off`` is above every level a record can have.
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR, "off": logging.CRITICAL + 10}
DEFAULT_LEVEL = "info"
#: How each line starts: greppable in an engine's mixed output.
PREFIX = "[cute-diskcache]"


class FallbackHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, for records no other handler in the logger's chain would show."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(_Formatter())

    def emit(self, record: logging.LogRecord) -> None:
        if others_would_show(logging.getLogger(record.name)):
            return
        self.stream = sys.stderr  # now's: pytest and others swap sys.stderr after we attached
        super().emit(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{PREFIX} {record.levelname} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def others_would_show(logger: logging.Logger) -> bool:
    """Whether a handler other than ours sits on ``logger`` or an ancestor it propagates to."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, FallbackHandler) for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent  # type: ignore[assignment]
    return False


def level_from_env() -> int | None:
    """The level ``CUTE_DISKCACHE_LOG_LEVEL`` asks for; None when unset. A value we do not know is
    the default, with one warning (a typo must not silence the cache, nor make it noisier)."""
    from . import config

    raw = (config.text("log_level") or "").lower()
    if not raw:
        return None
    if raw in LEVELS:
        return LEVELS[raw]
    logging.getLogger(LOGGER).warning("ignoring %s=%r (expected one of %s); using %s", LEVEL_ENV, raw, "|".join(LEVELS), DEFAULT_LEVEL)
    return LEVELS[DEFAULT_LEVEL]


def configure() -> None:
    """Give the ``cute_diskcache`` logger its level and our fallback handler (idempotent)."""
    logger = logging.getLogger(LOGGER)
    wanted = level_from_env()
    if wanted is not None:
        logger.setLevel(wanted)
    elif logger.level == logging.NOTSET:
        logger.setLevel(LEVELS[DEFAULT_LEVEL])
    if not any(isinstance(h, FallbackHandler) for h in logger.handlers):
        logger.addHandler(FallbackHandler())
