#!/usr/bin/env python3
"""Where an M = 16 block's time goes, kernel by kernel (run on a GPU after
installing opfuse; `scripts/sessions/gpu-session18 profile`).

Why: the gemm suite gives one number per block (events around each call).
Session 17 could not tell which route the Llama block took (the pair in one
TMA launch or cuBLASLt's batched pair) nor what each of its kernels cost.
This compiles the suite's blocks with the opfuse backend and prints, for
one call: the kernel launches and library calls (opfuse.stats), the skinny
GEMM's last config, and from torch.profiler's CUDA trace of calls queued
back to back behind a GPU sleep (the suite's situation) each kernel's
median duration, the gap from one kernel's end to the next one's start
(negative: programmatic launch overlaps them) and the call's span; then
the suite's timer per call and the mean of calls back to back.

  python3 scripts/decode_block_profile.py [--cases llama-16,mlp-16] [--calls 30]

Knobs are the environment's (OPFUSE_SKINNY_CONFIG, OPFUSE_SKINNY_TMA, ...):
run it once per setting, each in its own process.
"""
import argparse
import statistics
import warnings

import torch

import opfuse
from opfuse import skinny_gemm as sg
from opfuse.bench.cases import gemm_case
from opfuse.bench.timing import back_to_back_us, benchmark

CASES = {"llama-16": ("llama", 16, 4096, 11008), "mlp-16": ("mlp", 16, 4096, 16384)}


def cuda_kernels(prof):
    """(name, start ns, end ns) of every GPU kernel in the trace, in start order."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name() and "Memset" not in e.name():
            out.append((e.name(), e.start_ns(), e.start_ns() + e.duration_ns()))
    return sorted(out, key=lambda t: t[1])


def profile_calls(fn, args, calls, per_call):
    """Kernels of `calls` calls queued behind a GPU sleep, cut into calls of `per_call` kernels."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda._sleep(50_000_000)
            for _ in range(calls):
                fn(*args)
            torch.cuda.synchronize()
    ks = [k for k in cuda_kernels(prof) if "sleep" not in k[0] and "spin_kernel" not in k[0]]
    if per_call <= 0 or len(ks) % per_call:
        print(f"  profiler saw {len(ks)} kernels for {calls} calls (expected {per_call} a call): {[k[0][:40] for k in ks[:6]]}")
        return
    groups = [ks[i:i + per_call] for i in range(0, len(ks), per_call)]
    med = lambda v: statistics.median(v) / 1e3  # noqa: E731  (ns -> us)
    for j in range(per_call):
        name = groups[0][j][0]
        dur = med([g[j][2] - g[j][1] for g in groups])
        line = f"  kernel {j}: {dur:7.2f} us  {name[:70]}"
        if j:
            line += f"  (gap from kernel {j - 1}'s end: {med([g[j][1] - g[j - 1][2] for g in groups]):+.2f} us)"
        print(line)
    print(f"  span (first start to last end) {med([g[-1][2] - g[0][1] for g in groups]):7.2f} us; "
          f"between calls (last end to next first start) {med([b[0][1] - a[-1][2] for a, b in zip(groups, groups[1:])]):+.2f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="llama-16,mlp-16")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--bandwidth", type=float, default=4250.0, help="GB/s of the floor")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for name in args.cases.split(","):
        kind, m, k, h = CASES[name]
        case = gemm_case(kind, m, k, h, torch.bfloat16)
        inputs = case.make_inputs(dev, 0)
        floor_us = sum(t.numel() * t.element_size() for t in inputs) / (args.bandwidth * 1e9) * 1e6
        compiled = torch.compile(case.fn, backend="opfuse")
        for _ in range(3):
            out = compiled(*inputs)
        torch.cuda.synchronize()
        ref = case.fn(*inputs)
        err = (out.float() - ref.float()).abs().max().item()
        opfuse.reset_stats()
        compiled(*inputs)
        torch.cuda.synchronize()
        s = opfuse.stats()
        launches, library = s["kernel_launches"], s["library_calls"]
        print(f"{case.name} (inputs {floor_us:.1f} us at {args.bandwidth:.0f} GB/s): one call ran {launches} kernels, "
              f"{library} library calls; last skinny config {sg.last_config() or '-'}; max |opfuse - eager| {err:.3g}")
        profile_calls(compiled, inputs, args.calls, launches + library)
        per_call = benchmark(compiled, [inputs], dev, budget_s=0.5).median_ms * 1e3
        eager = benchmark(case.fn, [inputs], dev, budget_s=0.5).median_ms * 1e3
        b2b = back_to_back_us(lambda: compiled(*inputs))
        print(f"  suite timer per call {per_call:.1f} us ({floor_us / per_call:.1%} of the floor); eager {eager:.1f}; "
              f"back to back {b2b:.1f}")


if __name__ == "__main__":
    main()
