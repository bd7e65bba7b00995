#!/usr/bin/env python3
"""Times the wide-row layer_norm backward (dx, dw, db) beside the generated
kernels and eager, CUDA events, median of repeats, one process:
  python3 scripts/lnbwd_wide_variants.py [--shapes 8192x32768,...] [--configs t512c8r2v1b2,...]
"generated" is OPFUSE_LNBWD_WIDE=0 (the fused row kernel plus the column
kernel); each config forces OPFUSE_LNBWD_WIDE_CONFIG. At n <= 8192 (the
generated kernels' rows) the wide variants lift the width threshold
(GENERATED_MAX_COLS) for their calls, to compare the two there. The floor is dy and x
read once and dx written once at the copy bandwidth given (--copy-gbs)."""
import argparse
import os

import torch

import opfuse  # noqa: F401  (registers torch.ops.opfuse)
from opfuse.ops import layer_norm_wide as lw

aten = torch.ops.aten


def median_us(fn, reps=30, warm=5, inner=1):
    """Median over reps of the time of `inner` back-to-back calls, divided by
    inner: with inner > 1 the host path of each call (checks, allocations)
    overlaps the previous call's kernels, as in a training step."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / inner)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x32768,16384x16384,4096x65536")
    ap.add_argument("--configs", default="")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--copy-gbs", type=float, default=4220.0)
    ap.add_argument("--inner", type=int, default=1, help="back-to-back calls per timed pair of events")
    args = ap.parse_args()
    max_cols, short_above = lw.GENERATED_MAX_COLS, lw.SHORT_ROWS_ABOVE
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    for shape in args.shapes.split(","):
        rows, n = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        x = torch.randn(rows, n, device="cuda", dtype=dtype)
        dy = torch.randn(rows, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype)
        _, mean, rstd = aten.native_layer_norm(x, [n], w, b, 1e-5)
        floor = 3 * rows * n * x.element_size() / (args.copy_gbs * 1e3)
        ref = aten.native_layer_norm_backward(dy.double(), x.double(), [n], mean.double(), rstd.double(), w.double(),
                                              b.double(), [True, True, True])
        op = lambda: torch.ops.opfuse.layer_norm_backward(dy, x, mean, rstd, w, b, 1, [True, True, True])
        eager = lambda: aten.native_layer_norm_backward(dy, x, [n], mean, rstd, w, b, [True, True, True])
        print(f"{args.dtype} {shape}: floor {floor:.1f} us, default config {lw._C.lnbwd_wide_choose_config(args.dtype, n)}")
        def compiled():
            # A compiled graph of the aten op (as the rows_bwd suite): the
            # generated kernels specialised to the shape, or the routed op;
            # compiled at its first call, under its variant's environment.
            state = {}

            def run():
                if "f" not in state:
                    torch._dynamo.reset()
                    state["f"] = torch.compile(
                        lambda *a: aten.native_layer_norm_backward(a[0], a[1], [n], *a[2:], [True, True, True]),
                        backend="opfuse", dynamic=False)
                return state["f"](dy, x, mean, rstd, w, b)
            return run

        variants = [("eager", {}, eager), ("generated (op)", {"OPFUSE_LNBWD_WIDE": "0"}, op),
                    ("generated (compiled)", {"OPFUSE_LNBWD_WIDE": "0"}, compiled()), ("compiled", {}, compiled()),
                    ("wide default", {}, op)]
        variants += [(f"wide {c}", {"OPFUSE_LNBWD_WIDE_CONFIG": c}, op) for c in args.configs.split(",") if c]
        for name, env, fn in variants:
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            lw.GENERATED_MAX_COLS = 0 if name.startswith("wide") else max_cols
            lw.SHORT_ROWS_ABOVE = 0 if name.startswith("wide") else short_above
            try:
                before = lw.launch_count()
                outs = fn()
                torch.cuda.synchronize()
                took = lw.launch_count() > before
                errs = " ".join(f"{(o.double() - r).abs().max().item():.3g}" for o, r in zip(outs, ref))
                us = median_us(fn, inner=args.inner)
                print(f"  {name:24s} {us:8.1f} us  {floor / us * 100:5.1f}% of floor  wide={int(took)}  max err dx/dw/db {errs}")
            except Exception as e:
                print(f"  {name:24s} failed: {type(e).__name__}: {str(e)[:300]}")
            finally:
                lw.GENERATED_MAX_COLS, lw.SHORT_ROWS_ABOVE = max_cols, short_above
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v


if __name__ == "__main__":
    main()
