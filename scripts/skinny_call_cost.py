#!/usr/bin/env python3
"""What one skinny GEMM costs called alone, against back to back (run on a
GPU after installing opfuse; `scripts/sessions/gpu-session16 callcost`).

Why: under ncu (a kernel alone, caches flushed) the default skinny configs
take 39-40 us on the M = 16 GEMMs where cuBLAS's nvjet kernel takes 35.9,
yet back to back (bench_skinny_gemm.py) they run 34.8-35.2 against
cuBLAS's 35.6-40.5. Back to back, programmatic dependent launch lets each
call's CTAs start and prefetch while the previous call drains; the gemm
suite's timer (events around every call) does not. This prints, per GEMM,
both timings for cuBLAS (F.linear), the default config with PDL on and off,
and the candidate configs given, so the per-call cost is measured, not
inferred.

  python3 scripts/skinny_call_cost.py [--configs n4u1w8b2c2p2,n4w4s11c1+OPFUSE_SKINNY_TMA_L2_PROMO=0,...]
                                     [--shapes 4096x22016,...]
"""
import argparse
import os

import torch
import torch.nn.functional as F

from opfuse import _C
from opfuse import skinny_gemm as sg
from opfuse.bench.cases import linear_operands
from opfuse.bench.timing import back_to_back_us, benchmark


def way_env(entry: str) -> dict:
    """"tag" or "tag+VAR=value+...": the config forced, and more knobs
    (e.g. n4w4s11c1+OPFUSE_SKINNY_TMA_L2_PROMO=0)."""
    tag, *knobs = entry.split("+")
    return {"OPFUSE_SKINNY_CONFIG": tag, **dict(k.split("=", 1) for k in knobs)}


def per_call_us(fn, dev):
    """The gemm suite's timer: events around each call, median."""
    return benchmark(fn, [()], dev, budget_s=0.5).median_ms * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="n4u1w8b2c2p2,n4u1w16b1c2p2,n4u2w8b2c2p2,n8u1w8b1c2p2")
    ap.add_argument("--bandwidth", type=float, default=4221.0)
    ap.add_argument("--shapes", default="4096x16384,16384x4096,4096x11008,11008x4096",
                    help="KxN of each M = 16 GEMM (e.g. 4096x22016: Llama's gate and up weights as one)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bw = args.bandwidth * 1e9
    print(f"{'GEMM / way':<40}{'back to back us':>17}{'per call us':>13}   (% of the weight floor)")
    for k, n in (tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")):
        m = 16
        x, w, b = linear_operands(m, k, n, dev)
        out = torch.empty(m, n, dtype=x.dtype, device=dev)
        floor = 2 * n * k / bw * 1e6
        default = _C.skinny_gemm_choose_config(m, n, k, major * 10 + minor, sms)
        print(f"{m} x {k} -> {n}  (floor {floor:.1f} us, default {default})")
        ways = [("cuBLAS (F.linear)", {}, lambda: F.linear(x, w, b)),
                ("skinny default, PDL on", {}, None),
                ("skinny default, PDL off", {"OPFUSE_SKINNY_PDL": "0"}, None)]
        ways += [(f"skinny {c}", way_env(c), None) for c in args.configs.split(",") if c]
        for name, env, fn in ways:
            os.environ.update(env)
            try:
                if fn is None:
                    if sg.linear(x, w, b, out=out) is None:
                        print(f"  {name:<38}declined: {sg.last_error()}")
                        continue
                    ref = sg.reference(x, w, b)[0].to(dev)  # float64; within twice cuBLAS's error
                    err, base = ((t.double() - ref).abs().max().item() for t in (out, F.linear(x, w, b)))
                    assert err <= 2 * base + 2 * torch.finfo(x.dtype).eps * ref.abs().max().item(), (name, err, base)
                    fn = lambda: sg.linear(x, w, b, out=out)  # noqa: E731
                t_b, t_c = back_to_back_us(fn), per_call_us(fn, dev)
                print(f"  {name:<38}{t_b:>10.1f} ({floor / t_b:4.0%}){t_c:>7.1f} ({floor / t_c:4.0%})")
            finally:
                for key in env:
                    del os.environ[key]


if __name__ == "__main__":
    main()
