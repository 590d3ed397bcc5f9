"""The root's layout, and the one walk over it that everything else uses.

::

    <root>/v1/<namespace>/<digest[:2]>/<digest>/   one entry: manifest.msgpack + payloads
    <root>/quarantine/<time>-<reason>-<digest>-<rand>/   entries that failed a check
    <root>/locks/<digest[:2]>/<digest>.lock         single-flight (see .locking)
    <root>/stats/                                   per-process counters (see .stats)
    <root>/tmp/                                     staging: exports, imports, remote fetches
    <root>/trash/                                   what is being deleted (renamed here first)
    <root>/usage                                    the size counter (see .eviction)

``stats``, ``list``, ``verify``, eviction and bundles must agree on what an entry is and how
big it is, so they all walk through here: a directory ``v1/<ns>/<xx>/<digest>`` whose names fit
the layout, never reached through a link, and its regular files whose names we could have
written (a writer's ``.tmp.*`` files are not the entry's, but they are counted as its bytes:
they take the same disk).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from collections.abc import Iterator, Sequence

LAYOUT = "v1"
QUARANTINE_DIR = "quarantine"
LOCKS_DIR = "locks"
STATS_DIR = "stats"
TMP_DIR = "tmp"
TRASH_DIR = "trash"
USAGE_FILE = "usage"
#: Everything ``clear`` removes.
#: Second-stage records (:mod:`.reuse`): pointers to entries, by traced IR.
REUSE_DIR = "reuse"
ROOT_DIRS = (LAYOUT, QUARANTINE_DIR, LOCKS_DIR, STATS_DIR, TRASH_DIR, TMP_DIR, REUSE_DIR)

NAMESPACE_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")
DIGEST_RE = re.compile(r"[0-9a-f]{64}")
FILE_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
_ENTRY_FILE = re.compile(rf"{LAYOUT}/([^/]+)/([^/]+)/([^/]+)/([^/]+)")


def entry_dir(root: Path, namespace: str, digest: str) -> Path:
    # Joined as text, made a Path once: four pathlib joins cost ~0.1 ms on a kernel's first hit.
    return Path(os.path.join(root, LAYOUT, namespace, digest[:2], digest))


def entry_file(relative: str) -> tuple[str, str, str] | None:
    """``(namespace, digest, file)`` of a path relative to a root that names an entry's file
    exactly as we lay it out (``v1/<ns>/<digest[:2]>/<digest>/<file>``), else None: how a bundle
    member or a remote object's file is held to the layout before anything touches the disk."""
    m = _ENTRY_FILE.fullmatch(relative)
    if not m:
        return None
    ns, shard, digest, file = m.groups()
    if not (valid_namespace(ns) and DIGEST_RE.fullmatch(digest) and shard == digest[:2] and FILE_RE.fullmatch(file)):
        return None
    return ns, digest, file


def valid_namespace(name: str) -> bool:
    return bool(NAMESPACE_RE.fullmatch(name)) and name not in (".", "..")


def namespace_matches(namespace: str, wanted: Sequence[str] | None) -> bool:
    """``--namespace`` selection: an exact name or a prefix (namespaces are long)."""
    return not wanted or any(namespace == w or namespace.startswith(w) for w in wanted)


def subdirs(path: Path) -> list[os.DirEntry[str]]:
    """Directories directly under ``path``, sorted, never through a link; [] if unreadable."""
    try:
        with os.scandir(path) as it:
            return sorted((d for d in it if d.is_dir(follow_symlinks=False)), key=lambda d: d.name)
    except OSError:
        return []


def namespaces(root: Path) -> list[str]:
    return [d.name for d in subdirs(Path(root) / LAYOUT) if valid_namespace(d.name)]


def entry_dirs(root: Path, namespace: Sequence[str] | None = None) -> Iterator[Path]:
    """Every entry directory under ``root``, sorted. Names that do not fit the layout are skipped."""
    for ns in namespaces(root):
        if not namespace_matches(ns, namespace):
            continue
        for shard in subdirs(Path(root) / LAYOUT / ns):
            for d in subdirs(Path(shard.path)):
                if DIGEST_RE.fullmatch(d.name) and d.name[:2] == shard.name:
                    yield Path(d.path)


def entry_files(entry_dir: Path) -> list[Path]:
    """The regular files of an entry that travel with it (a writer's temp files do not)."""
    try:
        with os.scandir(entry_dir) as it:
            return sorted(
                (Path(f.path) for f in it if f.is_file(follow_symlinks=False) and FILE_RE.fullmatch(f.name)),
                key=lambda p: p.name,
            )
    except OSError:
        return []


def tree_bytes(path: Path, seen: set[tuple[int, int]] | None = None) -> tuple[int, int]:
    """(bytes, files) of every regular file under ``path``, never following a link.

    A file with other names (a hard link: a reused entry's payloads are links of another
    entry's, :mod:`.reuse`) takes its disk once, as ``du`` counts it: counted the first time a
    walk that shares ``seen`` over several trees meets its inode, and never without ``seen``,
    where the answer is what ``path`` alone adds to the disk (what writing it took, what
    removing it frees).
    """
    total = files = 0
    stack = [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for d in it:
                    try:
                        if d.is_dir(follow_symlinks=False):
                            stack.append(d.path)
                        elif d.is_file(follow_symlinks=False):
                            st = d.stat(follow_symlinks=False)
                            files += 1
                            if st.st_nlink <= 1:
                                total += st.st_size
                            elif seen is not None and (st.st_dev, st.st_ino) not in seen:
                                seen.add((st.st_dev, st.st_ino))
                                total += st.st_size
                    except OSError:
                        continue  # removed under our feet
        except OSError:
            continue
    return total, files


def entry_bytes(entry_dir: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """The disk an entry takes: every regular file in its directory, temp files included; a
    payload it shares with another entry (a hard link) as :func:`tree_bytes` counts it."""
    return tree_bytes(entry_dir, seen)[0]


def last_used(entry_dir: Path) -> float:
    """When an entry was last used: its directory's mtime (``eviction.touch`` bumps it)."""
    try:
        return entry_dir.stat().st_mtime
    except OSError:
        return 0.0
