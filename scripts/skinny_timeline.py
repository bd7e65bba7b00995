#!/usr/bin/env python3
"""Where a skinny GEMM's time goes when it runs alone: each CTA's
%globaltimer stamps (trace builds, tag suffix "t") for one GEMM called alone
(events around it, the gemm suite's timer) and back to back (run on a GPU
after installing opfuse; `scripts/sessions/gpu-session16 timeline`).

Why: alone, every skinny config takes 2.5-4 us more than back to back,
cuBLAS's kernel 0.5-1 us (docs/perf-notes.md, "H200, session 16"). The
stamps say whether that time is before the CTAs start, in their first
loads (TMA kernel: stamp 1 after its first stage's MMAs), in the steady
stream, or in the tail. Times in us from the call's first CTA entry:

  entry spread   last CTA entry
  first MMA      TMA kernel: stage 1's MMAs done, median / max over CTAs
  loop end       main loop done, median / max
  span           last CTA exit
  gap            back to back: this call's first entry minus the previous
                 call's last exit (negative: they overlap)

  python3 scripts/skinny_timeline.py [--configs n8u1w8b2c1,n4w4s11c1]
"""
import argparse
import os
import statistics

import torch
import torch.nn.functional as F

from opfuse import _C
from opfuse import skinny_gemm as sg
from opfuse.bench.cases import linear_operands

SLOTS = 6  # words per CTA (skinny_gemm.cu, trace_stamp)
MAX_CTAS = 2048


def stamps(buf: torch.Tensor) -> torch.Tensor:
    """[CTAs, 6] of the CTAs that ran (entry written)."""
    t = buf.view(-1, SLOTS).cpu()
    return t[t[:, 0] != 0]


def describe(t: torch.Tensor) -> dict:
    t0 = t[:, 0].min()
    us = lambda v: float(v) / 1000.0  # noqa: E731
    out = {"ctas": t.shape[0], "entry spread": us(t[:, 0].max() - t0), "span": us(t[:, 3].max() - t0)}
    loop = (t[:, 2] - t0).double()
    out["loop end med"], out["loop end max"] = us(loop.median()), us(loop.max())
    first = t[:, 1]
    if (first != 0).any():
        f = (first[first != 0] - t[first != 0][:, 0]).double()
        out["first MMA med"], out["first MMA max"] = us(f.median()), us(f.max())
    return out


def median_dict(ds):
    return {k: statistics.median(d[k] for d in ds) for k in ds[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="", help="tags (without 't'); default: each shape's default config and "
                                                  "the TMA kernel's choice")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bufs = [torch.zeros(MAX_CTAS * SLOTS, dtype=torch.int64, device=dev) for _ in range(args.calls)]
    # The event floor: a one-CTA kernel timed as the calls below (what the
    # events and the launch cost any kernel, against the span of the CTAs).
    one, floor_ms = torch.zeros(1, device=dev), []
    for _ in range(args.calls):
        torch.cuda._sleep(2_000_000)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        one.add_(1)
        e1.record()
        torch.cuda.synchronize()
        floor_ms.append(e0.elapsed_time(e1))
    print(f"event floor (a one-element add between events): {statistics.median(floor_ms) * 1000:.2f} us")
    for k, n in ((4096, 16384), (16384, 4096)):
        m = 16
        x, w, b = linear_operands(m, k, n, dev)
        out = torch.empty(m, n, dtype=x.dtype, device=dev)
        configs = args.configs.split(",") if args.configs else [
            _C.skinny_gemm_choose_config(m, n, k, major * 10 + minor, sms), _C.skinny_gemm_choose_tma_config(m, n, k, sms)]
        for cfg in configs:
            os.environ["OPFUSE_SKINNY_CONFIG"] = cfg + "t"
            try:
                _C.skinny_gemm_set_trace_buffer(bufs[0].data_ptr())
                if sg.linear(x, w, b, out=out) is None:
                    print(f"{m}x{k}->{n} {cfg}t declined: {sg.last_error()}")
                    continue
                torch.testing.assert_close(out.float(), F.linear(x, w, b).float(), atol=0.05, rtol=0.05)
                # Alone: a GPU sleep ahead so the host is ahead; events around each call.
                alone, ms = [], []
                for i in range(args.calls):
                    bufs[i].zero_()
                    torch.cuda._sleep(2_000_000)
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    _C.skinny_gemm_set_trace_buffer(bufs[i].data_ptr())
                    e0.record()
                    sg.linear(x, w, b, out=out)
                    e1.record()
                    torch.cuda.synchronize()
                    ms.append(e0.elapsed_time(e1))
                    alone.append(describe(stamps(bufs[i])))
                # Back to back: no events between the calls.
                for bf in bufs:
                    bf.zero_()
                torch.cuda._sleep(2_000_000)
                for i in range(args.calls):
                    _C.skinny_gemm_set_trace_buffer(bufs[i].data_ptr())
                    sg.linear(x, w, b, out=out)
                torch.cuda.synchronize()
                runs = [stamps(bf) for bf in bufs]
                b2b = [describe(r) for r in runs[1:]]
                gaps = [float(runs[i][:, 0].min() - runs[i - 1][:, 3].max()) / 1000 for i in range(1, len(runs))]
                per_call = [float(runs[i][:, 3].max() - runs[i - 1][:, 3].max()) / 1000 for i in range(1, len(runs))]
            finally:
                _C.skinny_gemm_set_trace_buffer(0)
                del os.environ["OPFUSE_SKINNY_CONFIG"]
            a, bb = median_dict(alone), median_dict(b2b)
            print(f"{m}x{k}->{n} {cfg}t ({a['ctas']:.0f} CTAs)")
            print(f"  alone: event {statistics.median(ms) * 1000:.1f} us; "
                  + ", ".join(f"{key} {v:.2f}" for key, v in a.items() if key != "ctas"))
            print(f"  back to back: exit to exit {statistics.median(per_call):.1f} us, gap {statistics.median(gaps):.2f}; "
                  + ", ".join(f"{key} {v:.2f}" for key, v in bb.items() if key != "ctas"))


if __name__ == "__main__":
    main()
