"""How the commands print: ccache-style label/value pairs, padded tables, sizes and times, JSON."""

from __future__ import annotations

import datetime as _dt
import json
import re
import sys
import time
from typing import Any
from collections.abc import Sequence

from ..config import format_size


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_size(n: float) -> str:
    return format_size(n)


def fmt_time(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


def fmt_ago(ts: float, now: float | None = None) -> str:
    """How long ago, as a person says it ("3 h ago"); a date past two months; "-" for never."""
    if not ts:
        return "-"
    age = (time.time() if now is None else now) - ts
    if age < 0:
        return "just now" if age > -60 else fmt_time(ts)  # another host's clock, a little ahead
    for limit, unit, size in ((60, "s", 1), (3600, "min", 60), (86400, "h", 3600), (61 * 86400, "d", 86400)):
        if age < limit:
            return "just now" if unit == "s" and age < 5 else f"{age // size:.0f} {unit} ago"
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d")


_TUPLE_NOISE = re.compile(r"[()'\"]|torch\.")


def readable_key(key_repr: str) -> str:
    """A site key's repr as words: ``('micro', 128, (128, 128), torch.int32)`` -> ``micro 128 128x128 int32``.

    The repr is all a manifest keeps (the key itself holds torch dtypes); inner pairs become
    ``AxB`` and the quotes, brackets and module prefixes go, so the values can be read and grepped."""
    text = re.sub(r"\((\d+), (\d+)\)", r"\1x\2", key_repr.strip())
    return " ".join(part for part in _TUPLE_NOISE.sub("", text).split(", ") if part != "")


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
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))]
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


#: The version of every JSON document the commands print (``"schema": 1`` at the top level):
#: raised when a field is removed or changes meaning, so scripts can refuse what they do not know.
SCHEMA = 1


def with_schema(data: Any) -> Any:
    return {"schema": SCHEMA, **data} if isinstance(data, dict) else data


def print_json(data: Any) -> None:
    print(json.dumps(jsonable(with_schema(data)), indent=2, sort_keys=False, default=str))


def print_json_error(message: str) -> None:
    """A refusal in ``--json`` mode: a JSON object on stderr, so stdout holds only results."""
    print(json.dumps({"schema": SCHEMA, "error": message}), file=sys.stderr)
