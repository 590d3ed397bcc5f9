"""Owns knowing which rank of an engine this process is, so that an engine says each thing once.

With tensor parallelism every worker process attaches the cache and had its own attach line and
exit summary: a TP=8 engine said everything eight times. vLLM tells its own code which rank a
process is through ``vllm.distributed.parallel_state`` (its world group: rank, local rank, world
size; its node count), and logs "once per node" with ``is_local_first_rank()``
(``vllm.logger``'s ``scope="local"``). We ask the same module, only when vLLM already imported
it, and never guess from environment variables.

* The attach line is said by the first local rank, with the number of ranks on this node; the
  others say theirs at DEBUG. A process that attaches before vLLM set up its ranks says it
  when it first asks for a kernel, when they are known (a plain process: at attach, as before).
* The exit summary is said once per node, with the totals of its ranks: each rank leaves its
  counters in a private directory shared by the ranks of one engine (the workers one vLLM engine
  core started: same parent process, same world), and the last to leave says the totals; the first
  local rank waits :data:`WAIT_S` for the others, then says what it has, naming who is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: How long the first local rank waits at exit for the others' counters before speaking alone.
WAIT_S = 2.0
_PARALLEL_STATE = "vllm.distributed.parallel_state"


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's place in a multi-process engine (as vLLM's world group says it)."""

    rank: int
    local_rank: int
    world_size: int
    local_size: int  # ranks on this node
    group: str  # the same for the ranks of one engine on one node

    @property
    def first(self) -> bool:
        return self.local_rank == 0


def pending() -> bool:
    """vLLM is imported but has not set up its ranks yet (a rank's attach line would come too early)."""
    module = sys.modules.get(_PARALLEL_STATE)
    return module is not None and getattr(module, "_WORLD", None) is None


def current() -> Ranks | None:
    """This process's ranks, when vLLM set up a world of more than one process; else None."""
    module = sys.modules.get(_PARALLEL_STATE)
    world = getattr(module, "_WORLD", None) if module is not None else None
    if world is None:
        return None
    try:
        size = int(world.world_size)
        if size <= 1:
            return None
        nodes = max(1, int(getattr(module, "_NODE_COUNT", None) or 1))
        ranks = tuple(int(r) for r in getattr(world, "ranks", range(size)))
        group = f"{os.getppid()}-{size}-{hash(ranks) & 0xFFFFFFFF:08x}"
        return Ranks(int(world.rank), int(world.local_rank), size, max(1, size // nodes), group)
    except Exception:  # noqa: BLE001 - another vLLM's layout: each process speaks for itself, as before
        return None


def _dir(ranks: Ranks) -> Path:
    base = Path(tempfile.gettempdir()) / f"cute-diskcache-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    if base.stat().st_uid != os.getuid():
        raise PermissionError(f"{base} is not ours")
    return base / f"engine-{ranks.group}"


def report_once(ranks: Ranks, counters: dict[str, Any]) -> tuple[dict[str, Any], list[int]] | None:
    """Leave this rank's counters; return (totals, local ranks missing) when this process is the
    one to say the node's summary, else None (another rank says it)."""
    d = _dir(ranks)
    d.mkdir(mode=0o700, exist_ok=True)
    tmp = d / f".rank-{ranks.local_rank}.{os.getpid()}"
    tmp.write_text(json.dumps(counters))
    os.replace(tmp, d / f"rank-{ranks.local_rank}.json")
    deadline = time.monotonic() + (WAIT_S if ranks.first else 0.0)
    while True:
        if not d.is_dir() or (d / "reported").exists():  # another rank said it (and cleared the directory)
            return None
        present = _present(d, ranks)
        if len(present) == ranks.local_size or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if len(present) < ranks.local_size and not ranks.first:
        return None  # not the last one out: the last (or the first local rank, after waiting) says it
    try:
        os.close(os.open(d / "reported", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except (FileExistsError, FileNotFoundError):  # another rank is saying it, or has
        return None
    totals: dict[str, Any] = {}
    for data in present.values():
        for name, value in data.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                totals[name] = totals.get(name, 0) + value
    if len(present) == ranks.local_size:  # everyone has left: moved away whole, then cleared
        done = d.with_name(f"{d.name}.done-{os.getpid()}")
        os.rename(d, done)
        for path in done.iterdir():
            path.unlink(missing_ok=True)
        done.rmdir()
    return totals, sorted(set(range(ranks.local_size)) - set(present))


def _present(d: Path, ranks: Ranks) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for r in range(ranks.local_size):
        try:
            out[r] = json.loads((d / f"rank-{r}.json").read_text())
        except (OSError, ValueError):
            continue
    return out


__all__ = ["Ranks", "WAIT_S", "current", "pending", "report_once"]
