"""Where the time of one backward call goes: the GPU time of each kernel of the
launch sequence (torch.profiler, CUPTI) against the time per call seen by CUDA
events around back-to-back calls, for the Hopper backward tiles named on the
command line (default: the default tile). FlashAttention setup as
bench_attention_bwd.py: bf16, hidden 2048, 16k tokens.

    python tests/gpu/attention/time_bwd_parts.py [--d 128] [--s 4096] [--b B] [--causal] [TAG ...]
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import attn_bwd_runtime as br  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("tags", nargs="*")
ap.add_argument("--calls", type=int, default=10)
pb = br.hopper_bench_problem(ap)
a, bwd, q, k, v, dout, o, lse = pb.a, pb.bwd, pb.q, pb.k, pb.v, pb.dout, pb.o, pb.lse
B, H, S, D = pb.B, pb.H, pb.S, pb.D
grads = tuple(torch.empty_like(t) for t in (q, k, v))
flops = 2.5 * 4 * B * H * S * S * D / (2 if a.causal else 1)
for tag in a.tags or [None]:
    cfg = bwd.sm90.BwdSm90Config.parse(tag) if tag else None

    def call():
        bwd(dout, q, k, v, o, lse, causal=a.causal, deterministic=False, out=grads, tiles=cfg)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.calls):
            call()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.time_range.elapsed_us())  # microseconds
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.calls):
        call()
    end.record()
    torch.cuda.synchronize()
    per_call_us = start.elapsed_time(end) * 1e3 / a.calls
    gpu_us = sum(sum(t) for t in kernels.values()) / a.calls
    print(f"{tag or bwd.sm90.default(D).tag()} B={B} H={H} D={D} S={S} causal={a.causal}: {per_call_us:.1f} us per call back to back "
          f"({flops / per_call_us / 1e6:.0f} TFLOP/s), kernels {gpu_us:.1f} us", flush=True)
    for name, ts in sorted(kernels.items(), key=lambda x: -sum(x[1])):
        print(f"  {sum(ts) / a.calls:9.1f} us  x{len(ts) // a.calls}  {name[:110]}", flush=True)
