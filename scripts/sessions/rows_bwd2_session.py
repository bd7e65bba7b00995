#!/usr/bin/env python3
"""layer_norm backward (issue 3, rows-bwd-2) in one GPU process: each shape's
knob variants timed with CUDA events (the whole backward: dx kernel and the
two column sums; max rel err against float32 eager), then the rows_bwd
bench's layer_norm cases beside eager and torch.compile, opfuse at the
defaults and at the shape's fastest variant (impl "opfuse+<knobs>").
Predictions: docs/perf-notes.md, "layer_norm backward: lean partials kernels".
  python3 scripts/sessions/rows_bwd2_session.py OUT_DIR [--budget 1.0]"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

LEAN = "OPFUSE_ROW_LEAN=1"
VARIANTS = {
    (32768, 4096): ["", "OPFUSE_ROW_PAIR_REDUCE=1", LEAN],
    (262144, 256): ["", LEAN],
    (8192, 32768): ["", "OPFUSE_ROW_PAIR_REDUCE=1"],
}


def set_env(settings):
    saved = {}
    for kv in settings.split():
        k, v = kv.split("=", 1)
        saved[k] = os.environ.get(k)
        os.environ[k] = v
    return saved


def restore(saved):
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def lnb(dy, x, mean, rstd, w, b):
    return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, b, [True, True, True])


def lnb_inputs(rows, cols):
    """lnb's arguments (dy, x, mean, rstd, w, b): bf16 on the GPU, seed 0."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(cols, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(cols, device="cuda", dtype=torch.bfloat16, generator=g)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [cols], w, b, 1e-5)
    return dy, x, mean, rstd, w, b


def time_variant(rows, cols, settings):
    import opfuse  # noqa: F401
    dy, x, mean, rstd, w, b = lnb_inputs(rows, cols)
    saved = set_env(settings)
    try:
        torch._dynamo.reset()
        fn = torch.compile(lnb, backend="opfuse", dynamic=False)
        out = fn(dy, x, mean, rstd, w, b)
    finally:
        restore(saved)
    ref = lnb(dy.float(), x.float(), mean, rstd, w.float(), b.float())
    err = max((o.float() - r).abs().max().item() / max(1.0, r.abs().max().item()) for o, r in zip(out, ref))
    times = []
    for _ in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            fn(dy, x, mean, rstd, w, b)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 5)
    ms = sorted(times)[len(times) // 2]
    return ms, err


def sweep(variants, t0, skip_errors=False):
    """Times each shape's knob variants; returns {(rows, cols): the fastest
    variant whose max rel err is under 0.05} ("" for the defaults). With
    skip_errors, a variant that does not compile or launch is reported and
    left out instead of ending the run."""
    best = {}
    for (r, c), shape_variants in variants.items():
        results = []
        for v in shape_variants:
            try:
                ms, err = time_variant(r, c, v)
            except Exception as e:
                if not skip_errors:
                    raise
                print(f"variant {r}x{c} [{v}]: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            nbytes = 3 * r * c * 2
            print(f"variant {r}x{c} [{v or 'defaults'}]: {ms * 1000:.1f} us, {nbytes / ms / 1e9:.2f} TB/s, max rel err {err:.3g}",
                  flush=True)
            results.append((ms, v, err))
        ok = [x for x in results if x[2] < 0.05]
        best[(r, c)] = min(ok)[1] if ok else ""
        print(f"  fastest {r}x{c}: [{best[(r, c)] or 'defaults'}]  ({time.time() - t0:.0f} s)", flush=True)
    return best


def bench_cases(shapes, best, budget, out, t0):
    """The rows_bwd bench's layer_norm cases at `shapes` beside eager and
    torch.compile, opfuse at the defaults and at best[shape] (impl
    "opfuse+<knobs>"); the records are written to `out` when given."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    from opfuse.bench.cases import row_backward_case
    from opfuse.bench.ceilings import measure_copy_bandwidth
    from opfuse.bench.records import run_info, write_records
    from opfuse.bench.runner import TABLE_HEADERS, bandwidth_record, run_case, table_rows, to_records
    from opfuse.bench.table import format_table
    device = torch.device("cuda")
    info = run_info(device)
    bw = measure_copy_bandwidth(device, budget_s=max(0.5, budget))
    print(f"copy bandwidth {bw.gb_per_s:.1f} GB/s", flush=True)
    records, rows = [bandwidth_record(bw, info, "rows_bwd")], []
    for (r, c) in shapes:
        case = row_backward_case("layer_norm_backward", r, c, torch.bfloat16)
        res = run_case(case, ["eager", "torch.compile", "opfuse"], device, budget_s=budget, min_reps=20)
        recs = to_records(res, bw, info)
        if best[(r, c)]:
            saved = set_env(best[(r, c)])
            try:
                knob = run_case(case, ["opfuse"], device, budget_s=budget, min_reps=20)
            finally:
                restore(saved)
            for k in knob:
                k.impl = "opfuse+" + best[(r, c)].replace("OPFUSE_", "").replace(" ", "+")
            res += knob
            recs += to_records(knob, bw, info)
        records += recs
        rows += table_rows(res, bw)
        print(f"{case.name}: " + ", ".join(f"{x.impl} {'ERROR ' + x.error if x.error else f'{x.timing.median_ms:.4g} ms'}" for x in res),
              flush=True)
    print(format_table(TABLE_HEADERS, rows))
    if out:
        print("wrote", write_records(records, info, "rows_bwd", Path(out)), f"({time.time() - t0:.0f} s)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--budget", type=float, default=1.0)
    a = ap.parse_args()
    t0 = time.time()
    best = sweep(VARIANTS, t0)
    bench_cases(VARIANTS, best, a.budget, a.out, t0)


if __name__ == "__main__":
    main()
