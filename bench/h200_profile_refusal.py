"""On a real GPU: a target profile left in the environment must not stand in for the card (issue 15, item 4).

A prewarm image sets ``CUTE_DISKCACHE_TARGET`` to compile for a card it does not have; if that
variable reaches a serving box, a profile applied there would replace ``torch.cuda``'s device
queries and ``current_stream`` for the whole engine. Three checks, each in a fresh process on
the GPU box, printed as one JSON line:

1. ``targets.apply`` refuses with ``ProfileRefused`` and leaves ``torch.cuda`` alone;
2. through the import hook (``install()`` with the variable set, then ``import flashinfer``):
   one warning, and ``torch.cuda.current_stream()`` is the real stream of the real device;
3. ``prewarm --target`` exits 2 with one line; ``CUTE_DISKCACHE_TARGET_FORCE=1`` applies it.

Run on the GPU box:  python3 bench/h200_profile_refusal.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHECKS = {
    "apply": (
        "import torch; from cute_diskcache.keys import targets\n"
        "real = torch.cuda.current_stream\n"
        "try:\n    targets.apply('rtx-pro-6000'); out = 'applied'\n"
        "except targets.ProfileRefused as exc:\n    out = 'refused: ' + str(exc)[:120]\n"
        "print(out, '|', torch.cuda.current_stream is real, targets.active())\n"
    ),
    "import_hook": (
        "import logging; logging.basicConfig()\n"
        "import cute_diskcache; cute_diskcache.install()\n"
        "import flashinfer, torch\n"
        "s = torch.cuda.current_stream()\n"
        "print(type(s).__module__ + '.' + type(s).__name__, s.device, torch.cuda.get_device_name(), torch.cuda.get_device_capability())\n"
    ),
    "forced": (
        "from cute_diskcache.keys import targets\n"
        "print(targets.apply('rtx-pro-6000').name, targets.cuda_device_visible())\n"
    ),
}


def main() -> int:
    out = {}
    for name, code in CHECKS.items():
        env = {**os.environ, "CUTE_DISKCACHE_TARGET": "rtx-pro-6000"}
        if name == "forced":
            env["CUTE_DISKCACHE_TARGET_FORCE"] = "1"
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        out[name] = {"rc": proc.returncode, "stdout": proc.stdout.strip()[-400:], "stderr": proc.stderr.strip()[-600:]}
    proc = subprocess.run([sys.executable, "-m", "cute_diskcache.prewarm", "--model", "qwen3-30b-a3b", "--target", "rtx-pro-6000", "--dry-run"],
                          capture_output=True, text=True, timeout=600)
    out["prewarm"] = {"rc": proc.returncode, "stderr": proc.stderr.strip()[-400:]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
