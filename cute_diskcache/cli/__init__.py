"""``cute-diskcache`` / ``python -m cute_diskcache``: the operator's view of the cache.

Subcommands, ccache style; the global options ``--root DIR``, ``--json`` and ``-v`` go before or
after the subcommand, and ``--version`` prints the versions that key the cache:

  prewarm MODEL         fill the cache before the engine starts (vLLM's flags: -tp, --max-num-batched-tokens...)
  stats                 hits, misses, compile time saved, size / max size, per namespace
  zero                  zero the statistics
  list                  one line per entry (``--namespace``, ``--sort size|created|used``)
  show DIGEST           one entry's manifest (``--mlir``, ``--cubin FILE`` for cuobjdump)
  verify                every checksum (``--device``: load every object; ``--quarantine``)
  prune                 drop namespaces of another flashinfer, DSL, machine or arch; ``--older-than``
  evict                 least-recently-used entries out until under ``--max-size``
  clear                 delete everything under the root
  export / import       one bundle file of verified entries, to bake into images;
                        ``--to-remote`` / ``--from-remote``: the same with the remote tier
  info / demo / doctor  where the cache is / cold vs warm engine start (no GPU needed) / site coverage
  check MODEL           a deploy gate: every kernel MODEL needs (prewarm's flags) cached and usable here?

Each command group is one module (:mod:`.warm`, :mod:`.statistics`, :mod:`.entries`, :mod:`.cleanup`,
:mod:`.transfer`, :mod:`.about`) that parses, calls the library and prints; the policy lives in
the library (:mod:`~cute_diskcache.cli.inventory`, :mod:`~cute_diskcache.storage.staleness`,
:mod:`~cute_diskcache.storage.housekeeping`...).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from . import inventory
from ..storage.layout import ROOT_DIRS
from . import about, check, cleanup, entries, statistics, transfer, warm
from .common import CliError, global_options, parse_duration
from .output import print_json_error

__all__ = ["CliError", "ROOT_DIRS", "build_parser", "main", "parse_duration"]


def version_text() -> str:
    """``cute-diskcache --version``: ours, and the flashinfer / DSL / torch the cache keys on,
    read from the installed metadata (importing flashinfer would take seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    from .._version import __version__

    def installed(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return (f"cute-diskcache {__version__}\n"
            + "".join(f"{name} {installed(name)}\n" for name in ("flashinfer-python", "nvidia-cutlass-dsl", "torch"))).rstrip()


class _Version(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the versions and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_args: object) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="cute-diskcache",
        description="The operator's view of the cute-diskcache: prewarm, statistics, entries, checks, clean-up, bundles.",
        epilog="The root is $CUTE_DISKCACHE_DIR, else flashinfer's cache dir (see 'cute-diskcache info').",
        parents=[global_options(subcommand=False)],
    )
    ap.add_argument("--version", action=_Version)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    after = global_options(subcommand=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, parents=[after])
        p.set_defaults(fn=fn)
        return p

    for group in (warm, check, statistics, entries, cleanup, transfer, about):
        group.register(add)
    return ap


def _setup_logging(verbose: int) -> logging.Handler | None:
    """The commands report what they did themselves; the library's log lines (written for a
    serving process: "recompiling", "refuses root") show only with ``-v``."""
    logger = logging.getLogger("cute_diskcache")
    handler = None
    if verbose and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("cute-diskcache: %(levelname)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.ERROR)
    return handler


def _user_errors() -> tuple[type[BaseException], ...]:
    """Refusals of what the user asked for: exit 2, one line."""
    from ..keys.targets import ProfileRefused, UnknownProfileError

    return (CliError, inventory.Refused, UnknownProfileError, ProfileRefused)


def _durations(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``prune``'s ages, parsed here so a bad one is a usage error naming the value."""
    if args.cmd != "prune":
        return
    try:
        args.older_than = parse_duration(args.older_than_text) if args.older_than_text is not None else None
        args.recent = parse_duration(args.recent_text)
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    _durations(ap, args)
    logger = logging.getLogger("cute_diskcache")
    level = logger.level
    handler = _setup_logging(args.verbose)  # undone below: main() also runs inside other programs and tests
    try:
        return int(args.fn(args))
    except _user_errors() as exc:
        if getattr(args, "json", False):
            print_json_error(str(exc))
        else:
            print(f"cute-diskcache {args.cmd}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `cute-diskcache list | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        logger.setLevel(level)
        if handler is not None:
            logger.removeHandler(handler)


def console() -> int:
    """The ``cute-diskcache`` command (pyproject's script): :func:`main` in a process of its own, which
    ends once its exit handlers have run (:mod:`..fast_exit`); ``main`` itself also runs inside
    other programs and tests, whose exit is theirs."""
    from ..fast_exit import end

    return end(main())


if __name__ == "__main__":
    sys.exit(console())
