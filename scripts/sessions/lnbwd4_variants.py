#!/usr/bin/env python3
"""layer_norm backward with the OPFUSE_ROW_ISSUE knobs (branch lnbwd-4) in
one GPU process: each shape's variants timed with CUDA events (the whole
backward: dx kernel and the column sums; rows_bwd2_session.time_variant,
max relative error beside), defaults first. Predictions: docs/perf-notes.md,
"lnbwd-4".
  python3 scripts/sessions/lnbwd4_variants.py [--shapes 32768x4096,262144x256,8192x32768]"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rows_bwd2_session import time_variant  # noqa: E402

VARIANTS = ["", "OPFUSE_ROW_INDEX32=1", "OPFUSE_ROW_EXACT_COLS=1", "OPFUSE_ROW_RAW_LANES=1", "OPFUSE_ROW_SUM2_CONST=1",
            "OPFUSE_ROW_ISSUE=1", ""]  # the defaults again last: drift across the run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32768x4096,262144x256,8192x32768")
    a = ap.parse_args()
    for shape in a.shapes.split(","):
        r, c = (int(v) for v in shape.split("x"))
        for v in VARIANTS:
            try:
                ms, err = time_variant(r, c, v)
            except Exception as e:  # reported, not timed
                print(f"variant {shape} [{v}]: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            print(f"variant {shape} [{v or 'defaults'}]: {ms * 1000:.1f} us, {3 * r * c * 2 / ms / 1e9:.2f} TB/s, "
                  f"max rel err {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
