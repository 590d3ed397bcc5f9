"""Progress for long commands (prewarm): a tqdm bar on a terminal, plain lines anywhere else.

A bar redraws its line with carriage returns; in a ``docker build`` or Kubernetes Job log each
redraw is kept, and one prewarm left 91 frames of block characters there. So the bar is drawn
only when stderr is a terminal; otherwise :class:`Lines` writes one readable line every
``interval`` seconds ("compiling: 12/89 kernels (34 s)") and one when the step ends. tqdm is an
optional dependency (``pip install 'cute-diskcache[prewarm]'``): without it, lines on a terminal too.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

#: Seconds between two plain lines.
INTERVAL_S = 5.0


class Lines:
    """The part of tqdm's interface prewarm uses (``update``, ``set_postfix``, a context), as lines."""

    def __init__(self, total: int | None, desc: str, unit: str, *, disable: bool = False, file: IO[str] | None = None,
                 interval: float = INTERVAL_S) -> None:
        self.total, self.desc, self.unit, self.disable = total, desc, unit, disable
        self.file = file if file is not None else sys.stderr
        self.interval = interval
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self._start = self._last = time.monotonic()

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def line(self) -> str:
        done = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        return f"{self.desc}: {done} {self.unit}{extra} ({time.monotonic() - self._start:.0f} s)"

    def _write(self) -> None:
        self._last = time.monotonic()
        if not self.disable:
            print(self.line(), file=self.file, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._last >= self.interval:
            self._write()

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix.update(values)

    def close(self) -> None:
        if self.n or self.total:
            self._write()
        self.disable = True  # once


def bar(total: int | None, desc: str, unit: str, *, disable: bool = False, file: IO[str] | None = None) -> Any:
    """A tqdm bar when ``file`` (stderr) is a terminal and tqdm is installed, else :class:`Lines`."""
    out = file if file is not None else sys.stderr
    if not disable and _is_terminal(out):
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return tqdm(total=total, desc=desc, unit=unit, file=out, leave=True)
    return Lines(total, desc, unit, disable=disable, file=out)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or a stand-in without isatty
        return False
