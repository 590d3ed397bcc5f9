"""What every command shares: the root it works on, the read-only refusal, argument types."""

from __future__ import annotations

import argparse
import contextlib
import re
from pathlib import Path
from collections.abc import Callable, Iterator

from .. import config

#: ``add(name, handler, help)``: a subcommand with the global options (``--root``, ``--json``,
#: ``-v``); each command module registers with it.
Add = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]


def global_options(*, subcommand: bool) -> argparse.ArgumentParser:
    """``--root``, ``--json`` and ``-v``, accepted before the subcommand and after it (as git,
    ccache and kubectl take them). The main parser sets the defaults; a subcommand's copy has
    none (``SUPPRESS``), so a value given before the subcommand is not overwritten by its default."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("global options")
    quiet: dict[str, object] = {"default": argparse.SUPPRESS} if subcommand else {}
    g.add_argument("--root", metavar="DIR", help="cache root to operate on (default: as the serving process resolves it)",
                   **({"default": None} | quiet))
    g.add_argument("--json", action="store_true", help="machine-readable output (a JSON object with \"schema\": 1)",
                   **({"default": False} | quiet))
    g.add_argument("-v", "--verbose", action="count", help="show the library's log lines (-vv: debug)",
                   **({"default": 0} | quiet))
    return p


class CliError(Exception):
    """A refusal the user can fix (unknown digest, read-only mode): one line, exit status 2."""


def root_of(args: argparse.Namespace) -> tuple[Path, str]:
    """``--root``, else the root a serving process would resolve, and which rule chose it."""
    if getattr(args, "root", None):
        return Path(args.root).expanduser(), "--root"
    return config.resolve_root()


def refuse_if_readonly(args: argparse.Namespace) -> None:
    if config.flag("readonly"):
        raise CliError(f"{config.env_name('readonly')} is set: '{args.cmd}' would modify the cache; unset it to proceed")


@contextlib.contextmanager
def counting(root: Path) -> Iterator[None]:
    """Let what a command does (evictions, quarantines) count in the root's statistics."""
    from ..storage import stats

    previous = stats.describe()["root"]
    stats.bind(root)
    try:
        yield
    finally:
        stats.flush()
        stats.bind(Path(previous) if previous else None)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "": 86400}


def parse_duration(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w``; a bare number is days (as ccache's ``--evict-older-than``)."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (examples: 30d, 12h, 90m)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def size_arg(text: str) -> int:
    try:
        return config.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
