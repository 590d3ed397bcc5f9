"""``prewarm``: the same command as ``cute-diskcache-prewarm``, as a subcommand (the flags are
:mod:`..prewarm`'s own; ``--root``, ``--json`` and ``-v`` are the global options)."""

from __future__ import annotations

import argparse

from .. import prewarm
from .common import Add


def cmd_prewarm(args: argparse.Namespace) -> int:
    return prewarm.run(args)


def register(add: Add) -> None:
    p = add("prewarm", cmd_prewarm, "compile every kernel MODEL needs before the engine starts (takes vLLM's flags)")
    prewarm.add_plan_arguments(p)
    prewarm.add_run_arguments(p)
