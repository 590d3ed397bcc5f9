"""Run a child as another uid (``setpriv``), the way a non-root engine in a container runs.

This box's Python lives under ``/root`` (mode 0700), which uid 65534 cannot enter: a plain
``setpriv --reuid=65534 python`` fails before it reads a line. Copying a 3.5 GB interpreter is
not worth it; instead the child runs in a private mount namespace (``unshare -m``, as root)
where the unreachable ancestor of ``sys.prefix`` is covered by an empty 0755 tmpfs into which
the one directory holding the interpreter is bind-mounted back. Nothing changes outside the
namespace, and the child still gets no privilege: ``setpriv`` drops every uid, gid and group
before ``exec``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

NOBODY = 65534


def _unreachable_ancestor(path: Path) -> Path | None:
    """The highest directory above ``path`` that others cannot search, else None."""
    for parent in reversed(path.parents):
        try:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return parent
        except OSError:
            return None
    return None


def public_dir(prefix: str, owner: int = 0) -> Path:
    """A fresh directory under the system temp dir that every uid can search (0755), owned by ``owner``."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    if owner:
        os.chown(path, owner, owner)
    return path


def can_run_as_others() -> str | None:
    """Why this host cannot run :func:`prefix` children, or None."""
    if os.geteuid() != 0:
        return "needs root (setpriv to another uid, unshare -m)"
    for tool in ("setpriv", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool}(1) is not installed"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"cannot make a mount namespace: {probe.stderr.decode(errors='replace').strip()}"
    return None


def prefix(uid: int = NOBODY, gid: int | None = None, groups: Sequence[int] = (), *, stage: Path, setup: str = "", umask: str | None = None) -> list[str]:
    """The command prefix that runs what follows as ``uid`` (``gid``, supplementary ``groups``),
    with this interpreter reachable. ``stage``: an empty directory the bind mount passes through.
    ``setup``: shell commands run as root in the child's mount namespace first (a read-only or a
    tiny volume); ``umask``: the child's, as a container's entrypoint would set it."""
    ids = [f"--reuid={uid}", f"--regid={uid if gid is None else gid}"]
    ids += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    steps = [setup] if setup else []
    hidden = _unreachable_ancestor(Path(sys.prefix).resolve())
    if hidden is not None:
        keep = Path(sys.prefix).resolve().relative_to(hidden).parts[0]
        steps.append(
            f'mount --bind "{hidden / keep}" "{stage}" && mount -t tmpfs -o mode=755 tmpfs "{hidden}" && '
            f'mkdir "{hidden / keep}" && mount --bind "{stage}" "{hidden / keep}"'
        )
    if umask is not None:
        steps.append(f"umask {umask}")
    if not steps:
        return ["setpriv", *ids, "--"]
    script = " && ".join([*steps, f'exec setpriv {" ".join(ids)} -- "$@"'])
    return ["unshare", "-m", "sh", "-c", script, "sh"]


@contextlib.contextmanager
def as_user(uid: int = NOBODY, gid: int | None = None, groups: Sequence[int] = ()) -> Iterator[None]:
    """This (root) process's effective uid, gid and groups set to another user's for the body:
    a store built inside sees exactly what that user's engine would (``geteuid``, permissions),
    without a child process. Restored however the body ends."""
    saved = os.getgroups()
    os.setgroups(list(groups))
    os.setegid(uid if gid is None else gid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(saved)
