"""The statistics in Prometheus' text exposition format (``cute-diskcache stats --format prometheus``).

For node_exporter's textfile collector, the usual way to get a batch job's or a CLI's numbers
into Prometheus without a server in the process: a cron job or a sidecar writes
``cute-diskcache stats --format prometheus > dir/cute_diskcache.prom.tmp`` and renames it to
``.prom`` (the collector must never read half a file). Names follow Prometheus' conventions:
``cute_diskcache_`` prefix, base units (seconds, bytes), ``_total`` on counters; every series
has the ``root`` and ``namespace`` labels (one namespace is one flashinfer + DSL + arch stack,
so a fleet can see which stack its hits come from). Format:
https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Iterable

#: (statistics field, metric name, help). Counters: what processes counted (``stats.FIELDS``).
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("hits", "cute_diskcache_hits_total", "Kernel lookups answered by an entry (local or remote)."),
    ("misses", "cute_diskcache_misses_total", "Kernel lookups that found no usable entry."),
    ("compiles", "cute_diskcache_compiles_total", "Kernels compiled because of a miss."),
    ("compile_seconds", "cute_diskcache_compile_seconds_total", "Seconds spent compiling on misses."),
    ("saved_seconds", "cute_diskcache_saved_seconds_total", "Compile seconds the hits saved (each entry's recorded compile time)."),
    ("load_seconds", "cute_diskcache_load_seconds_total", "Seconds spent loading entries on hits."),
    ("errors", "cute_diskcache_errors_total", "Exports or loads that failed and fell back to a plain compile."),
    ("quarantined", "cute_diskcache_quarantined_total", "Damaged entries set aside."),
    ("writes", "cute_diskcache_writes_total", "Entries committed."),
    ("bytes_written", "cute_diskcache_written_bytes_total", "Bytes of entries committed."),
    ("evictions", "cute_diskcache_evictions_total", "Entries evicted to stay under the size limit."),
    ("remote_hits", "cute_diskcache_remote_hits_total", "Hits served by the remote tier (also counted in hits)."),
    ("remote_misses", "cute_diskcache_remote_misses_total", "Remote lookups that found nothing."),
    ("remote_errors", "cute_diskcache_remote_errors_total", "Remote lookups that failed."),
    ("remote_skipped", "cute_diskcache_remote_skipped_total", "Remote lookups skipped while the remote was failing."),
    ("remote_bytes_in", "cute_diskcache_remote_received_bytes_total", "Bytes fetched from the remote tier."),
    ("remote_bytes_out", "cute_diskcache_remote_sent_bytes_total", "Bytes published to the remote tier."),
    ("remote_seconds", "cute_diskcache_remote_seconds_total", "Seconds spent on remote requests on the lookup path."),
    ("published", "cute_diskcache_published_total", "Entries published to the remote tier."),
    ("publish_dropped", "cute_diskcache_publish_dropped_total", "Entries not published (queue full or remote failing)."),
    ("prewarm_compiles", "cute_diskcache_prewarm_compiles_total",
     "Kernels prewarm compiled (not in misses or compiles: those count serving processes only)."),
    ("prewarm_compile_seconds", "cute_diskcache_prewarm_compile_seconds_total", "Seconds prewarm spent compiling."),
    ("prewarm_hits", "cute_diskcache_prewarm_hits_total", "Kernels prewarm found cached (not in hits)."),
    ("reused", "cute_diskcache_reused_total",
     "First-stage misses served by another flashinfer release's entry with the same traced IR (not in hits or misses)."),
    ("reuse_seconds", "cute_diskcache_reuse_seconds_total", "Seconds those reuses took (trace, link, load)."),
    ("traces", "cute_diskcache_traces_total", "Kernels traced on a miss to look for another release's entry."),
    ("trace_seconds", "cute_diskcache_trace_seconds_total", "Seconds spent tracing on misses."),
    ("prewarm_reused", "cute_diskcache_prewarm_reused_total", "Kernels prewarm reused from another release's entry (not in reused)."),
)
#: Gauges per namespace: what the root holds now.
NAMESPACE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("entries", "cute_diskcache_entries", "Entries held."),
    ("bytes", "cute_diskcache_bytes", "Bytes the entries hold."),
)


def escape_label(value: str) -> str:
    """A label value as the exposition format quotes it: backslash, double quote and newline escaped.

    The format is UTF-8. A path's bytes that are not (``os.fsdecode`` keeps them as lone
    surrogates) are written as ``\\xff``, the way Python shows such bytes: passed on raw they
    made the whole file invalid, and the collector dropped every series in it.
    """
    try:
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate no byte produced
        raw = value.encode("utf-8", "backslashreplace")
    value = raw.decode("utf-8", "backslashreplace")
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def number(v: float) -> str:
    """A sample value: integers without a fraction, ``+Inf`` / ``-Inf`` / ``NaN`` as the format spells them."""
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return f"{v:.17g}"


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in pairs) + "}"


def _family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {name} {escape_help(help_text)}", f"# TYPE {name} {kind}"]
    return lines + [f"{name}{labels} {number(value)}" for labels, value in samples]


def render(root: str, stats: dict[str, Any], *, max_size: int, trust_refusal: str | None) -> str:
    """The text exposition of :func:`.inventory.collect_stats`'s ``stats`` for ``root``."""
    namespaces: dict[str, dict[str, float]] = stats["namespaces"]
    per_ns = {ns: _labels((("root", root), ("namespace", ns))) for ns in namespaces}
    lines: list[str] = []
    for field, name, help_text in COUNTERS:
        lines += _family(name, "counter", help_text, [(per_ns[ns], rec.get(field, 0.0)) for ns, rec in namespaces.items()])
    for field, name, help_text in NAMESPACE_GAUGES:
        lines += _family(name, "gauge", help_text, [(per_ns[ns], rec.get(field, 0.0)) for ns, rec in namespaces.items()])
    at_root = _labels((("root", root),))
    total = stats["total"]
    lines += _family("cute_diskcache_cache_bytes", "gauge",
                     "Bytes under the root the size limit counts (entries, quarantine, staging, statistics).",
                     [(at_root, total.get("cache_bytes", 0.0))])
    lines += _family("cute_diskcache_max_size_bytes", "gauge", "The size limit (0: none).", [(at_root, max(0, max_size))])
    lines += _family("cute_diskcache_root_trusted", "gauge",
                     "1 when serving processes accept the root; 0 when they refuse it and compile everything.",
                     [(at_root, 0 if trust_refusal else 1)])
    return "\n".join(lines) + "\n"
