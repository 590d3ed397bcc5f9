#!/usr/bin/env python3
"""SGLang's FA4 SM12x decode kernels on a real GPU against the CPU prewarm (issue 41 item 4b).

``prewarm MODEL --engine sglang --attention-backend fa4 --target CARD`` plans and compiles on a box
without a GPU, with SGLang's own decode call on torch's fake tensors (``sglang_sites/planning.py``).
The question: does SGLang's same call with real CUDA tensors, on a GPU, ask for the same kernels
(the same keys), and are they the same code (the same cubins)?

On the lent GPU (an H100 or H200, sm_90), each child applies the card's profile as a GPU box does
(``targets.apply(force=True)``: the arch forced to sm_120a, the capability, SM count and memory
facts SGLang's SM120 planner reads; tensors, streams and the driver stay the real GPU's) and makes
SGLang's decode call (``planning.decode(..., fake=False)``) on real CUDA zeros for each batch size,
under ``through.launching_nothing()`` (an sm_120a kernel cannot launch on sm_90; without it the
forward's failed launch would stop the call before SGLang compiles the split-KV combine).

``all``: a cold child on an empty root, a fresh child on that root (must compile nothing), a fresh
child on a copy of the CPU prewarm's root (``--cpu-root``: must compile nothing either), then every
device-built entry compared byte for byte with the CPU-built entry of the same key. One JSON report.

Run (device; SGLang 0.5.23, DSL 4.8.0 and SGLang's tvm-ffi 0.1.11 carried as wheels; the CPU root
prewarmed here with ``prewarm llama-3.1-8b-nvfp4 --engine sglang --attention-backend fa4 --target
rtx-pro-6000 --context-length 8192 --cuda-graph-bs 1 24``)::

    python3 bench/gpu_proof_sglang.py all --cpu-root CPU_ROOT --out $OUT/gpu_proof_sglang.json

Staging, as done on 2026-12-07 (the device has Python 3.12 and no network; a call carries 64 MiB
with the tree): ``FLASHINFER_VERSION=0.7.2 DSL_VERSION=4.8.0 ../shared/device/stage.sh``, then drop
flashinfer's wheel from ``.dev/s2`` (65 MB; FA4 does not import it), split ``cu13.tar.xz`` (63.6 MB)
into two parts parked by two calls, and add to ``.dev/s2`` SGLang's tree unpacked from its cp311
wheel without its Rust ``.so`` files (31 MB as tar.xz), cp312 wheels of quack-kernels 0.6.5,
apache-tvm-ffi 0.1.11 (replacing stage.sh's) and ``scripts/make_sglang_venv.sh``'s import-time
packages, and the CPU root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_harness as H
from gpu_proof_inline_sm90 import _count_compiles

MODEL = "llama-3.1-8b-nvfp4"
CARD = "rtx-pro-6000"
CONTEXT = 8192


def _stand_in(card: str) -> None:
    """The card's profile as a GPU box applies it, with the real GPU's streams and, for whatever the
    profile does not say, the real GPU's properties."""
    import torch

    from cute_diskcache.keys import targets

    real = torch.cuda.get_device_properties
    real_stream = torch.cuda.current_stream
    targets.apply(card, force=True)
    profile_props = torch.cuda.get_device_properties()
    torch.cuda.current_stream = real_stream

    class Props:
        def __init__(self, props: Any) -> None:
            self._props = props
            self.__dict__.update(vars(profile_props))

        def __getattr__(self, name: str) -> Any:
            return getattr(self._props, name)

    torch.cuda.get_device_properties = lambda device=None: Props(real(device))


def child(sizes: tuple[int, ...], card: str) -> None:
    _stand_in(card)
    import cute_diskcache

    cute_diskcache.install()
    from cute_diskcache.core import through
    from cute_diskcache.core.cache import default_cache
    from cute_diskcache.prewarm import models
    from cute_diskcache.sglang_sites import planning

    compiles = _count_compiles()
    att = planning.attention_of(models.load_config(MODEL)[0], 1, 1, CONTEXT)
    res: dict[str, Any] = {"arch": os.environ.get("CUTE_DSL_ARCH"), "card": card, "sizes": list(sizes), "calls": []}
    t0 = time.perf_counter()
    try:
        for bs in sizes:
            events, t = len(default_cache().events), time.perf_counter()
            with through.launching_nothing():
                planning.decode(att, bs, fake=False)
            res["calls"].append({"bs": bs, "s": round(time.perf_counter() - t, 3),
                                 "events": [[e[1], e[2]] for e in default_cache().events[events:]]})
    except Exception as exc:  # noqa: BLE001 - reported in the JSON; the parent compares what it has
        import traceback

        res["error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
        res["traceback"] = traceback.format_exc()[-3000:]
    res["calls_s"] = round(time.perf_counter() - t0, 3)
    H.emit_with_cache(res, compiles[0])


def _entries(root: Path) -> dict[str, Any]:
    return {H.read_entry(d)["manifest"]["digest"]: H.read_entry(d) for d in H.entry_dirs(root)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("all", "child"))
    ap.add_argument("--sizes", default="1,24")
    ap.add_argument("--card", default=CARD)
    ap.add_argument("--cpu-root", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sizes = tuple(int(x) for x in args.sizes.split(","))
    if args.mode == "child":
        child(sizes, args.card)
        return 0
    report: dict[str, Any] = {"versions": H.versions(), "device": H.device_info(), "model": MODEL, "card": args.card,
                              "sizes": list(sizes), "context": CONTEXT}
    base = Path(tempfile.mkdtemp(prefix="cdc-sglang-gpu-"))
    dev_root = base / "device"
    env = dict(os.environ, CUTE_DISKCACHE_DIR=str(dev_root), SGLANG_CUTE_AOT_CACHE_DIR=str(base / "sglang-aot"))
    argv = ["child", "--sizes", args.sizes, "--card", args.card]
    report["cold"] = H.spawn(__file__, argv, env=env, timeout=400)
    report["warm"] = H.spawn(__file__, argv, env=env, timeout=200)
    if args.cpu_root:
        cpu_copy = base / "cpu"
        shutil.copytree(args.cpu_root, cpu_copy)
        report["on_cpu_root"] = H.spawn(__file__, argv, env=dict(env, CUTE_DISKCACHE_DIR=str(cpu_copy)), timeout=200)
        dev, cpu = _entries(dev_root), _entries(Path(args.cpu_root))
        report["entries"] = {"device": len(dev), "cpu": len(cpu), "common_keys": len(set(dev) & set(cpu)),
                             "device_only": sorted(dev.keys() - cpu.keys()), "cpu_only": sorted(cpu.keys() - dev.keys())}
        report["compare"] = {d: H.compare_entries(dev[d], cpu[d]) for d in sorted(set(dev) & set(cpu))}
    report["sglang_aot_files"] = sorted(str(p.relative_to(base)) for p in (base / "sglang-aot").rglob("*.o")) \
        if (base / "sglang-aot").is_dir() else []
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        args.out.write_text(text)
    print(text[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
