"""vLLM ``vllm.general_plugins`` entry point.

vLLM calls every general plugin in every process it starts (engine core, workers), possibly
more than once; ``install`` is idempotent. The plugin honours the same switch as the .pth
bootstrap so that installing the package never changes behaviour by itself.
"""

from __future__ import annotations


def register() -> None:
    from .config import ENABLE_ENV, env_flag

    if env_flag(ENABLE_ENV):
        from .activation import install

        install()
