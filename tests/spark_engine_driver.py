"""Child of scripts/emulated_aarch64.py (``prove`` with ``b12x_ms``): one engine process on a Spark's cache
holding both libraries' kernels, cross-built on x86: flashinfer's MoE first (``cute_diskcache._probe``),
then b12x's NVFP4 linears (tests/b12x_linear_driver.py), as one vLLM engine whose MoE is flashinfer's
and whose linears are b12x's loads both.

One process instead of one per library because under qemu each fresh process costs about a minute of
emulated imports (torch, the DSL, flashinfer) before it asks the cache anything; neither part has a
kernel of the other's in memory, so each part's hits still come from the disk. flashinfer goes first:
b12x's set-up stands in for torch.cuda's answers, which must not steer flashinfer's launch.

    spark_engine_driver.py B12X_MODEL TARGET B12X_MS -- PROBE_ARGS...

Prints one JSON line: ``{"flashinfer": the probe's report, "b12x": the linear driver's report}``, the
b12x part's counters counted from where it began (the probe's are its own: it reports before b12x runs).
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
from pathlib import Path
from typing import Any


def _last_json(text: str) -> dict[str, Any]:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(f"no JSON line in:\n{text[-3000:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def main() -> int:
    sep = sys.argv.index("--")
    b12x_args, probe_args = sys.argv[1:sep], sys.argv[sep + 1:]
    from cute_diskcache import _probe

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = _probe.main(probe_args)
    if rc:
        raise SystemExit(f"the probe exited {rc}")
    flashinfer = _last_json(printed.getvalue())

    import cute_diskcache

    before = cute_diskcache.counters()
    driver = Path(__file__).resolve().with_name("b12x_linear_driver.py")
    sys.argv = [str(driver), *b12x_args]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(driver), run_name="__main__")
    b12x = _last_json(printed.getvalue())
    after = b12x["counters"]
    b12x["counters"] = {k: after[k] - before[k] if isinstance(after[k], (int, float)) and not isinstance(after[k], bool) else after[k]
                        for k in after}
    print(json.dumps({"flashinfer": flashinfer, "b12x": b12x}))
    return 0


if __name__ == "__main__":
    from cute_diskcache import fast_exit

    fast_exit.end(main())  # as our own commands end: after the exit handlers, without the teardown's collections
