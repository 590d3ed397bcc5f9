#!/usr/bin/env python3
"""README command 1 on a CPU that shows AVX-512, then an engine on one that does not.

Issue 38's done-when, reproducible: the prewarm of README command 1 (qwen3-30b-a3b,
rtx-pro-6000, 512 tokens) runs in a private mount namespace whose /proc/cpuinfo adds the
AVX-512 family to this CPU's flags (what a Sapphire Rapids build box shows); then, where
/proc/cpuinfo has no AVX-512 (this CPU's flags without it), a fresh engine start requests every
planned kernel through flashinfer's real dispatch (``tests/key_completeness_driver.py serve``)
with the DSL's compiles counted independently (``tests/conftest.py``'s counter), and
``cute-diskcache check`` gates the same plan. Run as root (``unshare -m``) from the project root::

    python bench/host_code_serving.py --out bench/results/host_code_serving.json

Before host code became portable, every entry recorded the build CPU's AVX-512 extensions and
the engine compiled every kernel again; ``CUTE_DISKCACHE_HOST_CPU=native`` shows that case.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "tests" / "key_completeness_driver.py"
AVX512 = ("avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "avx512_vnni",
          "avx512vbmi", "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq")
MODEL, TARGET, TOKENS = "qwen3-30b-a3b", "rtx-pro-6000", "512"


def cpuinfo(path: Path, add: tuple[str, ...]) -> list[str]:
    """A prefix running a command where /proc/cpuinfo is this CPU's without AVX-512, plus ``add``."""
    text = Path("/proc/cpuinfo").read_text()

    def flags(m: re.Match[str]) -> str:
        kept = [f for f in m.group(2).split() if not f.startswith("avx512")]
        return f"{m.group(1)} {' '.join([*kept, *add])}"

    path.write_text(re.sub(r"(?m)^(flags\s*:)(.*)$", flags, text))
    return ["unshare", "-m", "sh", "-c", f'mount --bind "{path}" /proc/cpuinfo && exec "$@"', "sh"]


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=1800)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--host-cpu", default=None, help="CUTE_DISKCACHE_HOST_CPU for the prewarm (default: unset, portable)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="host-code-serving-"))
    root = work / "root"
    hook = work / "hook"
    hook.mkdir()
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import _COUNT_LINE, _SITECUSTOMIZE  # the tests' independent DSL compile counter

    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    base = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DISKCACHE_") and k not in ("FLASHINFER_B12X_DISK_CACHE", "CUTE_DSL_ARCH")}
    base["CUTE_DISKCACHE_DIR"] = str(root)
    build_box = cpuinfo(work / "cpuinfo-build", AVX512)
    serving = cpuinfo(work / "cpuinfo-serving", ())
    res: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "host_cpu_setting": args.host_cpu or "portable"}
    with open("/proc/cpuinfo") as fh:
        res["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")

    env = dict(base, **({"CUTE_DISKCACHE_HOST_CPU": args.host_cpu} if args.host_cpu else {}))
    t0 = time.perf_counter()
    pre = run([*build_box, sys.executable, "-m", "cute_diskcache", "prewarm", MODEL, "--target", TARGET,
               "--max-num-batched-tokens", TOKENS, "--json"], env, work)
    res["prewarm_s"] = round(time.perf_counter() - t0, 1)
    summary = json.loads(pre.stdout)
    res["prewarm"] = {k: summary.get(k) for k in ("kernels", "compiled", "already_cached", "failed", "by_kind")}

    plan = json.loads(run([sys.executable, str(DRIVER), "plan", MODEL, "--max-num-batched-tokens", TOKENS], base, work).stdout.splitlines()[-1])
    (work / "kernels.json").write_text(json.dumps({MODEL: plan["kernels"]}))
    served_env = dict(base, FLASHINFER_B12X_DISK_CACHE="1", CUTE_DSL_ARCH="sm_120a",
                      PYTHONPATH=os.pathsep.join(p for p in (str(hook), str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    t0 = time.perf_counter()
    served = run([*serving, sys.executable, str(DRIVER), "serve", "--kernels", str(work / "kernels.json"),
                  "--max-num-batched-tokens", TOKENS], served_env, work)
    report = json.loads(served.stdout.splitlines()[-1])
    counted = _COUNT_LINE.findall(served.stderr)
    res["serve"] = {"kernels_requested": len(plan["kernels"]), "hits": report["hits"], "compiles": report["compiles"],
                    "dsl_compiles": int(counted[-1]) if counted else None, "seconds": round(time.perf_counter() - t0, 1),
                    "refusals": sorted({ln.split("(", 1)[-1][:80] for ln in served.stderr.splitlines() if "does not fit" in ln})[:5]}
    check = run([*serving, sys.executable, "-m", "cute_diskcache", "--root", str(root), "check", MODEL, "--target", TARGET,
                 "--max-num-batched-tokens", TOKENS], base, work)
    res["check"] = {"exit": check.returncode, "first_line": (check.stdout.splitlines() or [""])[0]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
