"""What a serving process says about its cache: one line at attach, one per compile, one at exit.

Users asked to see when and where kernels compile (vllm#46764) and why a seeded cache missed
(SkyRL#2167); ``stats`` needs a shell on the pod, which serverless platforms do not give. So:

* at attach (flashinfer's import, :meth:`~.cache.CompileCache.warm_up`): the root, whether it is
  read-only, and how many entries exist for this stack, counted from the namespace directories
  whose recorded environment fits this process (one manifest per namespace; the device is never
  asked: initialising CUDA in a process that forks workers later breaks CUDA in them);
* per compile: a WARNING naming the site, the kernel and why it missed (:mod:`..storage.explain`);
* at exit: hits, misses, compile seconds and seconds saved, only if the cache did anything.

Lines go through the ``cute_diskcache`` logger; :mod:`..logsetup` makes them visible when the
process configured no logging.
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..storage import layout
from .. import logsetup
from . import ranks

if TYPE_CHECKING:
    from ..keys.key import CacheKey

log = logging.getLogger("cute_diskcache")

#: How much of a kernel's own key the per-compile line shows.
_DESCRIPTION_CHARS = 200


def describe_kernel(key: CacheKey, why: str) -> str:
    """``<site> kernel 3f2a1b9c0d12: <why>; key ('micro', 128, ...)``: which kernel and why first,
    then the start of its own key (the part a person recognises: kind, shapes, dtypes)."""
    try:
        text = repr(key.site_key)
    except Exception:  # noqa: BLE001 - a key's repr is the library's code: a log line must never cost the engine
        text = "?"
    if len(text) > _DESCRIPTION_CHARS:
        text = text[: _DESCRIPTION_CHARS - 3] + "..."
    return f"{key.site} kernel {key.digest[:12]}: {why}; key {text}"


def attached(cache: Any) -> None:
    """The attach line, and the exit summary registered; never raises. ``cache``: a
    :class:`~.cache.CompileCache` (not imported here: the cache imports this module).

    A rank of an engine whose ranks vLLM has not set up yet says it at its first request
    (:func:`first_request`), when it knows whether it is the one to say it (:mod:`.ranks`)."""
    try:
        logsetup.configure()
        atexit.register(summary, cache)
        if ranks.pending():
            cache.attach_line_due = True
            return
        _say_attached(cache)
    except Exception as exc:  # noqa: BLE001 - a log line must never cost the engine
        log.debug("attach line skipped: %s: %s", type(exc).__name__, exc)


def first_request(cache: Any) -> None:
    """The attach line a rank put off (:func:`attached`); never raises."""
    cache.attach_line_due = False
    try:
        _say_attached(cache)
    except Exception as exc:  # noqa: BLE001 - a log line must never cost the engine
        log.debug("attach line skipped: %s: %s", type(exc).__name__, exc)


def _say_attached(cache: Any) -> None:
    here = ranks.current()
    cache.ranks = here
    level = logging.INFO if here is None or here.first else logging.DEBUG
    if not log.isEnabledFor(level):
        return
    store = cache.store
    count, stack = entries_for_this_stack(Path(store.root))
    noun = "entry" if count == 1 else "entries"
    engine = "" if here is None else f"; {here.local_size} ranks on this node (rank {here.rank} of {here.world_size} says this)"
    log.log(level, "attached: cache %s (%s), %d %s for this stack (%s)%s; on a miss: %s%s",
            store.root, _access(store), count, noun, stack, _layers(store), cache.on_miss, engine)


def _access(store: Any) -> str:
    if not store.trusted:
        return "refused: nothing is read or written"
    if store.readonly:
        return "read-only: CUTE_DISKCACHE_READONLY"
    if not store.writable:
        return "read-only"
    # The first miss finds out for sure (and warns once); say now what the filesystem says.
    # A root not made yet is made in its nearest existing ancestor: a read-only mount, a full
    # volume's read-only remount or a directory we may not write shows there (access(2): EROFS).
    level = Path(store.root)
    while not level.exists() and level.parent != level:
        level = level.parent
    if not os.access(level, os.W_OK | os.X_OK):
        return "read-only: no write permission" if level == Path(store.root) else f"read-only: cannot create it in {level}"
    return "writable"


def _layers(store: Any) -> str:
    """``; read layers: /opt/cute-diskcache (89 entries)``: the read-only roots looked up after
    this one (``CUTE_DISKCACHE_READ_DIRS``), each with what it holds for this stack, or why it
    serves nothing (missing, refused); empty without layers. A baked layer under an empty
    volume is where the hits come from: the root's own count alone read as an empty cache."""
    layers = getattr(store, "layers", ())
    if not layers:
        return ""
    parts = []
    for layer in layers:
        if not Path(layer.root).is_dir():
            parts.append(f"{layer.root} (missing)")
        elif not layer.trusted:
            parts.append(f"{layer.root} (refused: {layer._refusal})")
        else:
            n = entries_for_this_stack(Path(layer.root))[0]
            parts.append(f"{layer.root} ({n} {'entry' if n == 1 else 'entries'})")
    return f"; read layer{'s' if len(parts) != 1 else ''}: {', '.join(parts)}"


def entries_for_this_stack(root: Path) -> tuple[int, str]:
    """Entries in the namespaces whose environment fits this process, and that stack in words.

    Fits: same entry format, the installed version of the library that wrote it (flashinfer's,
    b12x's: each adapter's distribution), DSL stack and machine, and the arch when ``CUTE_DSL_ARCH`` names it (a target profile sets it; the device
    is never asked here). The kernels' source fingerprint and switches are not compared, so
    this counts what could serve this stack, not a promise of hits.
    """
    import importlib.metadata

    from ..storage import staleness
    from ..keys.key import FORMAT_VERSION, dsl_stack

    from .adapter import adapters

    dsl = [list(p) for p in dsl_stack()]
    machine = platform.machine()
    arch = os.environ.get("CUTE_DSL_ARCH") or None
    libraries: dict[str, str | None] = {}  # distribution -> installed version (None: not here)
    names: list[str] = []
    for adapter in adapters():
        try:
            version = importlib.metadata.version(adapter.distribution) if adapter.package_dir() else None
        except importlib.metadata.PackageNotFoundError:
            version = None
        libraries[adapter.distribution] = version
        if version:
            names.append(f"{adapter.name} {version}")
    count = 0
    for ns in layout.namespaces(root):
        found = staleness.namespace_env(root, ns)
        if found is None:
            continue
        env, fmt = found
        package = str(env.get("package", ""))
        if fmt != FORMAT_VERSION or env.get("dsl") != dsl or env.get("machine") != machine:
            continue
        if arch is not None and env.get("arch") != arch:
            continue
        distribution, _, version = package.partition("==")
        if distribution in libraries and version != libraries[distribution]:
            continue
        count += sum(1 for d in layout.entry_dirs(root, [ns]) if d.parent.parent.name == ns)
    words = names
    versions = dict(map(tuple, dsl))
    if "nvidia-cutlass-dsl" in versions:
        words.append(f"DSL {versions['nvidia-cutlass-dsl']}")
    words.append(arch or "arch of the device")
    words.append(machine)
    return count, ", ".join(words)


def summary(cache: Any) -> None:
    """The exit line: only when the cache did anything; never raises. A rank of an engine leaves
    its counters for the node's one line, with the totals (:func:`.ranks.report_once`)."""
    try:
        counters = cache.tally.snapshot()
        here = getattr(cache, "ranks", None) or ranks.current()
        if here is not None:
            try:
                spoken = ranks.report_once(here, counters)
            except OSError as exc:  # no private temporary directory: each rank says its own
                log.debug("engine summary not shared: %s", exc)
            else:
                if spoken is None:  # another rank says the node's totals
                    _say_summary(counters, cache.store.root, "this process", logging.DEBUG)
                    return
                totals, missing = spoken
                who = f"this engine ({here.local_size} ranks on this node"
                who += f"; ranks {', '.join(map(str, missing))} did not report)" if missing else ")"
                _say_summary(totals, cache.store.root, who, logging.INFO)
                return
        _say_summary(counters, cache.store.root, "this process", logging.INFO)
    except Exception as exc:  # noqa: BLE001 - a log line must never cost the engine (this runs at exit)
        log.debug("exit summary skipped: %s: %s", type(exc).__name__, exc)


def _say_summary(c: dict[str, Any], root: Any, who: str, level: int) -> None:
    if not (c.get("hits") or c.get("misses") or c.get("errors") or c.get("reused")):
        return
    parts = []
    if c["hits"]:
        parts.append(f"{c['hits']} hit{'s' if c['hits'] != 1 else ''}, {c['saved_seconds']:.1f} s of compiles saved "
                     f"({c['load_seconds'] * 1e3:.0f} ms loading)")
    if c.get("reused"):
        parts.append(f"{c['reused']} reused (an entry with the same traced IR: another release's, or another key's of this one) in {c['reuse_seconds']:.1f} s")
    if c["misses"]:
        compiled = f"{c['compiles']} compiled in {c['compile_seconds']:.1f} s" if c["compiles"] else "none compiled"
        parts.append(f"{c['misses']} miss{'es' if c['misses'] != 1 else ''}, {compiled}")
    if c["errors"]:
        parts.append(f"{c['errors']} error{'s' if c['errors'] != 1 else ''}")
    if c["lock_waits"]:
        parts.append(f"waited {c['lock_wait_seconds']:.1f} s for {c['lock_waits']} compile{'s' if c['lock_waits'] != 1 else ''} "
                     "of other processes")
    log.log(level, "%s: %s; cache %s", who, "; ".join(parts), root)
