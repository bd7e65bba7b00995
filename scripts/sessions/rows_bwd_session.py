#!/usr/bin/env python3
"""The row-backward measurement plan of one GPU session (issue 3): each
(ops, shapes, knob settings) line timed in one process with CUDA events by
row_variants.child (the bench's kernels; TB/s over input read once + output
written once; max rel err against float32 eager). Predictions are in
docs/perf-notes.md, "row backward: prefetch, wide partials".
  python3 scripts/sessions/rows_bwd_session.py [--quick]"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # row_variants.py
import row_variants as rv  # noqa: E402

LNB, SMB = "layer_norm_backward", "softmax_backward"
PLAN = [
    # layer_norm backward 32768x4096: dx kernel with partials, 2 rows an SM.
    ([LNB], "32768x4096", ["", "OPFUSE_ROW_PREFETCH=1"]),
    # 262144x256: lane groups of 16 at 94 registers (2 blocks of 256 an SM).
    ([LNB], "262144x256", ["", "OPFUSE_ROW_PARTIAL_VALUES=8", "OPFUSE_ROW_PARTIAL_VALUES=8 OPFUSE_ROW_PREFETCH=1"]),
    # 8192x32768: not split by default (5 passes); clusters of 8 with partials.
    ([LNB], "8192x32768", ["", "OPFUSE_COLUMN_PARTIALS_WIDE=1",
                           "OPFUSE_COLUMN_PARTIALS_WIDE=1 OPFUSE_ROW_PREFETCH=1 OPFUSE_ROW_MIN_BLOCKS=2"]),
    # softmax backward 8192x32768: the second pass's re-reads miss L2.
    ([SMB], "8192x32768", ["", "OPFUSE_ROW_REVERSE_LOOPS=1",
                           "OPFUSE_ROW_REVERSE_LOOPS=1 OPFUSE_ROW_LOOP_THREADS=1024 OPFUSE_ROW_MIN_BLOCKS=2",
                           "OPFUSE_ROW_LOOP_THREADS=1024 OPFUSE_ROW_MIN_BLOCKS=2"]),
    ([SMB], "32768x4096", ["", "OPFUSE_ROW_PREFETCH=1 OPFUSE_ROW_PREFETCH_AHEAD=560"]),
    # Forward, on the way: the same knobs where they apply.
    (["softmax"], "32768x4096", ["", "OPFUSE_ROW_PREFETCH=1 OPFUSE_ROW_PREFETCH_AHEAD=1100"]),
    (["softmax", "layer_norm"], "8192x32768", ["", "OPFUSE_ROW_REVERSE_LOOPS=1"]),
]


def main():
    for ops, shape, variants in PLAN:
        shapes = [tuple(int(v) for v in shape.split("x"))]
        for settings in variants:
            print(f"variant {settings or 'defaults'}", flush=True)
            rv.with_env(settings, lambda: rv.child(shapes, ops))


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    main()
