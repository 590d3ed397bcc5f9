"""Pictures of the benchmark results: cold compile vs warm hit per kernel kind (log scale), and
prewarm wall time vs --jobs against the ideal. Reads bench/out/*.json, writes PNGs beside them.

    python bench/plot.py [--out-dir bench/out]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "out"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out_dir)
    cw = out / "cold_vs_warm.json"
    if cw.exists():
        data = json.loads(cw.read_text())
        rows, meta = data["rows"], data["meta"]
        kinds = [r["kernel"] for r in rows]
        cold = [r["compile_s"] * 1e3 for r in rows]
        warm = [r["hit_p50_ms"] for r in rows]
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = range(len(kinds))
        ax.bar([x - 0.2 for x in xs], cold, width=0.4, label="cold: compile (ms)")
        ax.bar([x + 0.2 for x in xs], warm, width=0.4, label="warm: disk hit, p50 (ms)")
        for x, c, w in zip(xs, cold, warm):
            ax.text(x, c * 1.3, f"{c / w:.0f}x", ha="center")
        ax.set_yscale("log")
        ax.set_xticks(list(xs), kinds)
        ax.set_ylabel("milliseconds (log)")
        ax.set_ylim(top=max(cold) * 5)
        ax.set_title(f"flashinfer {meta['flashinfer']} sm12x MoE, {meta['target']} profile\n{meta['machine']}", fontsize=9)
        ax.legend(fontsize=8, loc="center right")
        fig.tight_layout()
        fig.savefig(out / "cold_vs_warm.png", dpi=120)
        print(f"wrote {out / 'cold_vs_warm.png'}")
    ps = out / "prewarm_scaling.json"
    if ps.exists():
        data = json.loads(ps.read_text())
        rows = data["rows"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        jobs = [r["jobs"] for r in rows]
        ax.plot(jobs, [r["wall_s"] for r in rows], "o-", label="prewarm wall")
        ax.plot(jobs, [r["ideal_s"] for r in rows], "s--", label="sum of compiles / jobs")
        ax.plot(jobs, [1.2 * r["ideal_s"] for r in rows], ":", label="target: 1.2x ideal")
        ax.set_xlabel("--jobs")
        ax.set_ylabel("seconds")
        ax.set_xticks(jobs)
        ax.set_title(f"prewarm {data['meta']['model']} m={data['meta']['m']} ({rows[0]['kernels']} kernels)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "prewarm_scaling.png", dpi=120)
        print(f"wrote {out / 'prewarm_scaling.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
