"""How the commands print: ccache-style label/value pairs, padded tables, sizes and times, JSON."""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any, Sequence

from ..config import format_size


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_size(n: float) -> str:
    return format_size(n)


def fmt_time(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


def fmt_count(v: float) -> str:
    return f"{v:.0f}"


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell; numbers (the ``right`` columns) flush right."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def pairs(rows: Sequence[tuple[str, str]]) -> str:
    """ccache's ``-s`` layout: a label column, then the value."""
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v}" for k, v in rows)


def jsonable(value: Any) -> Any:
    """Manifests hold bytes: JSON shows them as length and hex."""
    if isinstance(value, (bytes, bytearray)):
        return {"len": len(value), "hex": bytes(value).hex()}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def print_json(data: Any) -> None:
    print(json.dumps(jsonable(data), indent=2, sort_keys=False, default=str))
