#!/usr/bin/env python3
"""layer_norm backward (issue 3, branch lnbwd-3) in one GPU process: each
shape's knob variants timed with CUDA events (the whole backward: dx kernel
and the column sums), the fastest written to OUT/best.txt, then the rows_bwd
bench's layer_norm cases beside eager and torch.compile (Inductor), opfuse at
the defaults and at the shape's fastest variant. `--once` runs one backward
for ncu instead (opfuse with --env, or Inductor with --inductor).
Predictions: docs/perf-notes.md, "layer_norm backward: a register pipeline".
  python3 scripts/sessions/lnbwd3_session.py OUT_DIR [--budget 0.3]
  python3 scripts/sessions/lnbwd3_session.py --once 32768x4096 [--env 'K=V K=V|K=V'] [--inductor]"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rows_bwd2_session import bench_cases, lnb, lnb_inputs, restore, set_env, sweep  # noqa: E402

PIPE = "OPFUSE_ROW_PIPELINE=1 OPFUSE_ROW_CACHE_RAW=1"
BLOCKP = "OPFUSE_ROW_BLOCK_PARTIALS=1 OPFUSE_COLUMN_PARTS=528"
VARIANTS = {
    (32768, 4096): ["", PIPE, PIPE + " OPFUSE_COLUMN_PARTS=256", "OPFUSE_COLUMN_PARTS=256"],
    (262144, 256): ["", "OPFUSE_ROW_PIPELINE=1", BLOCKP, "OPFUSE_ROW_PIPELINE=1 " + BLOCKP],
    (8192, 32768): ["", "OPFUSE_ROW_SMEM_TENSORS=2", "OPFUSE_COLUMN_PARTIALS_WIDE=1 " + PIPE],
}


def once(shape, envs, inductor):
    """One call each of opfuse at each env setting ('|' between them) and,
    with inductor, of torch.compile's default backend, after a first call
    (for ncu: the kernels of the second calls are the ones to read)."""
    r, c = (int(v) for v in shape.split("x"))
    dy, x, mean, rstd, w, b = lnb_inputs(r, c)
    import opfuse  # noqa: F401
    for env in envs.split("|"):
        torch._dynamo.reset()
        saved = set_env(env)
        try:
            fn = torch.compile(lnb, backend="opfuse", dynamic=False)
            fn(dy, x, mean, rstd, w, b)
        finally:
            restore(saved)
        torch.cuda.synchronize()
        fn(dy, x, mean, rstd, w, b)
        torch.cuda.synchronize()
        print(f"ran {shape} opfuse [{env or 'defaults'}]", flush=True)
    if inductor:
        torch._dynamo.reset()
        fn = torch.compile(lnb, dynamic=False)
        fn(dy, x, mean, rstd, w, b)
        torch.cuda.synchronize()
        fn(dy, x, mean, rstd, w, b)
        torch.cuda.synchronize()
        print(f"ran {shape} inductor", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--budget", type=float, default=0.3)
    ap.add_argument("--once")
    ap.add_argument("--env", default="")
    ap.add_argument("--inductor", action="store_true")
    a = ap.parse_args()
    if a.once:
        once(a.once, a.env, a.inductor)
        return
    t0 = time.time()
    best = sweep(VARIANTS, t0, skip_errors=True)
    if a.out:
        Path(a.out, "best.txt").write_text("".join(f"{r}x{c}\t{v}\n" for (r, c), v in best.items()))
    bench_cases(VARIANTS, best, a.budget, a.out, t0)


if __name__ == "__main__":
    main()
