"""Roofline plot of a results file: where each run sits under the memory roof.

x = arithmetic intensity (FLOPs per byte of the floor), y = attained GFLOP/s;
the roof is measured bandwidth x intensity (and a flat compute ceiling when a
'TFLOP/s' ceiling record is present). A point on the slanted line runs at the
measured copy bandwidth. Needs matplotlib (on the GPU image; optional here).

    python -m opfuse.bench.plot bench/results/h200/rows-*.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

MARKERS = {"eager": "o", "torch.compile": "s", "opfuse": "*"}


def roofline_points(records: list[dict]) -> list[tuple[str, str, float, float]]:
    """(case, impl, FLOPs/byte, GFLOP/s) for every timed record with known FLOPs."""
    points = []
    for r in records:
        if r.get("metric") == "ms" and r.get("value") and r.get("flops") and r.get("bytes"):
            points.append((r["case"], r["impl"], r["flops"] / r["bytes"],
                           r["flops"] / (r["value"] / 1e3) / 1e9))
    return points


def ceilings(records: list[dict]) -> tuple[float | None, float | None]:
    """(copy GB/s, compute GFLOP/s) from the ceiling records, where present."""
    bw = next((r["value"] for r in records if r.get("impl") == "torch.copy_"), None)
    peak = next((r["value"] * 1e3 for r in records
                 if r.get("case", "").startswith("ceiling") and r.get("metric") == "TFLOP/s"),
                None)
    return bw, peak


def plot_roofline(records: list[dict], path: Path, title: str = "") -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot written ({path.name}): matplotlib is not installed")
        return None
    points = roofline_points(records)
    if not points:
        return None
    bw, peak = ceilings(records)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [p[2] for p in points]
    lo, hi = min(xs) / 2, max(xs) * 4
    if bw:
        roof = [bw * lo, bw * hi] if not peak else [min(bw * lo, peak), min(bw * hi, peak)]
        ax.plot([lo, hi], roof, "k-", lw=1.5, label=f"measured copy {bw:.0f} GB/s")
    for impl in dict.fromkeys(p[1] for p in points):
        mine = [p for p in points if p[1] == impl]
        ax.scatter([p[2] for p in mine], [p[3] for p in mine], marker=MARKERS.get(impl, "x"),
                   s=60, label=impl)
    labelled = set()
    for case, _, x, y in points:  # one label per case, at its first point
        if case not in labelled:
            labelled.add(case)
            ax.annotate(case, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of floor)")
    ax.set_ylabel("attained GFLOP/s")
    ax.set_title(title or "roofline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    for name in argv if argv is not None else sys.argv[1:]:
        src = Path(name)
        out = plot_roofline(json.loads(src.read_text()), src.with_suffix(".png"), src.stem)
        if out:
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
