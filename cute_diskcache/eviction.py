"""Size cap and least-recently-used eviction, ccache style.

Recency is the entry directory's mtime, which we set ourselves on a hit (:func:`touch`):
access times are useless on the ``noatime``/``relatime`` mounts most servers use. A touch is
skipped when the entry was marked within the last hour, so a hot entry costs one ``stat`` per
hit, not a metadata write.

Eviction runs after a write that pushes the cache over its cap (down to 90% of it, so the next
few writes do not each trigger a scan) and on demand (``cute-diskcache evict``). An entry
leaves by one ``rename`` into ``trash/`` (atomic for readers, and it needs no free space on a
full disk), then is deleted.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("cute_diskcache")

DEFAULT_MAX_SIZE = "5G"
_TOUCH_EVERY_S = 3600.0
_LOW_WATER = 0.9
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT][iI]?)?[bB]?\s*$")


def parse_size(text: str) -> int:
    """``"5G"`` -> 5e9 bytes. K/M/G/T are decimal, Ki/Mi/Gi/Ti binary, as in ccache; a trailing B is allowed."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 500M, 5G, 2GiB, 1048576)")
    number, unit = m.group(1), (m.group(2) or "").upper()
    return int(float(number) * _UNITS[unit])


def format_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def max_size() -> int:
    """``CUTE_DISKCACHE_MAX_SIZE`` (0 means no cap), else 5 GB."""
    raw = os.environ.get("CUTE_DISKCACHE_MAX_SIZE", DEFAULT_MAX_SIZE)
    try:
        return parse_size(raw)
    except ValueError:
        log.warning("ignoring CUTE_DISKCACHE_MAX_SIZE=%r (not a size); using %s", raw, DEFAULT_MAX_SIZE)
        return parse_size(DEFAULT_MAX_SIZE)


def touch(entry_dir: Path) -> None:
    """Mark an entry as used now (skipped if marked within the hour)."""
    try:
        if time.time() - os.stat(entry_dir).st_mtime > _TOUCH_EVERY_S:
            os.utime(entry_dir)
    except OSError:
        pass  # read-only or vanished: recency is advisory


def _entries(root: Path) -> list[tuple[float, int, str, Path]]:
    """(last use, bytes, namespace, dir) of every committed entry."""
    out = []
    base = Path(root) / "v1"
    if not base.is_dir():
        return out
    for ns in os.scandir(base):
        if not ns.is_dir(follow_symlinks=False):
            continue
        for shard in os.scandir(ns.path):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for ent in os.scandir(shard.path):
                if not ent.is_dir(follow_symlinks=False):
                    continue
                size = 0
                try:
                    for f in os.scandir(ent.path):
                        if f.is_file(follow_symlinks=False):
                            size += f.stat(follow_symlinks=False).st_size
                    out.append((ent.stat(follow_symlinks=False).st_mtime, size, ns.name, Path(ent.path)))
                except FileNotFoundError:
                    continue  # evicted or quarantined under our feet
    return out


def usage(root: Path) -> dict[str, Any]:
    """Total and per-namespace bytes and entry counts."""
    namespaces: dict[str, dict[str, int]] = {}
    total = count = 0
    for _used, size, ns, _path in _entries(root):
        rec = namespaces.setdefault(ns, {"bytes": 0, "entries": 0})
        rec["bytes"] += size
        rec["entries"] += 1
        total += size
        count += 1
    return {"bytes": total, "entries": count, "namespaces": namespaces}


def evict(root: Path, max_bytes: int, *, dry_run: bool = False) -> list[Path]:
    """Remove least-recently-used entries until the cache holds at most ``max_bytes``."""
    entries = _entries(root)
    return _remove_oldest(root, entries, max_bytes, dry_run=dry_run)


def enforce(root: Path) -> list[Path]:
    """After a write: if over the cap, evict down to 90% of it (one directory scan)."""
    cap = max_size()
    if cap <= 0:
        return []
    entries = _entries(root)
    if sum(size for _u, size, _ns, _p in entries) <= cap:
        return []
    return _remove_oldest(root, entries, int(cap * _LOW_WATER), dry_run=False)


def _remove_oldest(root: Path, entries: list[tuple[float, int, str, Path]], goal: int, *, dry_run: bool) -> list[Path]:
    from . import stats

    entries = sorted(entries)
    total = sum(size for _u, size, _ns, _p in entries)
    removed: list[Path] = []
    trash = Path(root) / "trash"
    for _used, size, ns, path in entries:
        if total <= goal:
            break
        if not dry_run:
            try:
                trash.mkdir(exist_ok=True)
                dest = trash / f"{path.name}-{os.getpid()}-{os.urandom(3).hex()}"
                os.rename(path, dest)
            except FileNotFoundError:
                continue  # someone else removed it
            except OSError as exc:
                log.warning("eviction stopped: cannot move %s: %s", path, exc)
                break
            shutil.rmtree(dest, ignore_errors=True)
            stats.record(ns, "evictions")
        removed.append(path)
        total -= size
    if removed and not dry_run:
        log.info("evicted %d entries from %s (down to %s)", len(removed), root, format_size(goal))
    return removed
