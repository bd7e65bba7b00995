#!/usr/bin/env python3
"""Microbenchmark of the skinny GEMM on a GPU (run from the repository root
after installing opfuse): each decode-shaped GEMM of the gemm suite with the
skinny kernel (the default config and every candidate), with cuBLAS
(F.linear), and the two M = 16 blocks compiled by opfuse with the skinny path
on and off. Fractions are of the floor: the weight's bytes read once at the
copy bandwidth (--bandwidth GB/s, 4221 measured on the H200; the copy
bandwidth measured here is printed beside it).

  python3 scripts/bench_skinny_gemm.py [--bandwidth 4221] [--iters 50] [--configs n8u1w8b2c1,n4u2w8b2c2p1]
"""
import argparse
import os

import torch
import torch.nn.functional as F

import opfuse
from opfuse.bench.cases import linear_operands, llama_mlp, mlp_block
from opfuse.bench.timing import back_to_back_us
from opfuse import _C
from opfuse import skinny_gemm as sg

os.environ["OPFUSE_SKINNY_GEMM"] = "1"  # every shape; the blocks below time it on, off and by default


def time_us(fn, iters):
    """Median over 5 trials of the mean time of `iters` back-to-back calls (CUDA events)."""
    return back_to_back_us(fn, iters)


def copy_bandwidth_gb_s():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), 20)
    return 2 * src.numel() / us / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bandwidth", type=float, default=4221.0, help="copy bandwidth for the floor, GB/s")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--configs", default="", help="comma-separated config tags to time (default: the candidates)")
    ap.add_argument("--no-blocks", action="store_true", help="the GEMMs only, not the compiled blocks")
    args = ap.parse_args()
    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name()}  sm_{major}{minor}  {sms} SMs  copy bandwidth here "
          f"{copy_bandwidth_gb_s():.0f} GB/s  floor uses {args.bandwidth:.0f} GB/s")
    bw = args.bandwidth * 1e9
    configs = args.configs.split(",") if args.configs else _C.skinny_gemm_candidates(major * 10 + minor)
    print(f"\n{'GEMM (M x K -> N)':<26}{'floor us':>9}{'cuBLAS':>16}{'skinny default':>24}  best config")
    for m in (16, 1):
        for k, n in ((4096, 16384), (16384, 4096), (4096, 11008), (11008, 4096)):
            x, w, b = linear_operands(m, k, n, dev)
            floor = 2 * n * k / bw * 1e6
            out = torch.empty(m, n, dtype=x.dtype, device=dev)
            assert sg.linear(x, w, b, out=out) is not None, sg.last_error()
            torch.testing.assert_close(out, F.linear(x, w, b))
            t_cublas = time_us(lambda: F.linear(x, w, b), args.iters)
            t_default = time_us(lambda: sg.linear(x, w, b, out=out), args.iters)
            default = _C.skinny_gemm_choose_config(m, n, k, major * 10 + minor, sms)
            per_config = {}
            for cfg in configs:
                os.environ["OPFUSE_SKINNY_CONFIG"] = cfg
                per_config[cfg] = time_us(lambda: sg.linear(x, w, b, out=out), args.iters)
                del os.environ["OPFUSE_SKINNY_CONFIG"]
            best = min(per_config, key=per_config.get)
            print("    " + "  ".join(f"{c} {t:.1f}" for c, t in per_config.items()))
            print(f"{m:>3} x {k:>5} -> {n:<12}{floor:>9.1f}{t_cublas:>9.1f} ({floor / t_cublas:4.0%})"
                  f"{t_default:>9.1f} ({floor / t_default:4.0%}) {default}  {best} {per_config[best]:.1f}"
                  f" ({floor / per_config[best]:.0%})")

    if args.no_blocks:
        return
    print(f"\n{'block (compiled by opfuse)':<34}{'floor us':>9}{'skinny':>16}{'cuBLASLt':>16}{'default':>16}")
    blocks = [("mlp 16x4096x16384", mlp_block, (16, 4096, 16384), True),
              ("llama 16x4096x11008", llama_mlp, (16, 4096, 11008), False)]
    for name, fn, (m, k, h), bias in blocks:
        torch.manual_seed(0)
        x = torch.randn(m, k, device=dev).bfloat16()
        w1 = (torch.randn(h, k, device=dev) * k ** -0.5).bfloat16()
        w2 = (torch.randn(k, h, device=dev) * h ** -0.5).bfloat16()
        if bias:
            params = (x, w1, torch.randn(h, device=dev).bfloat16(), w2, torch.randn(k, device=dev).bfloat16())
        else:
            params = (x, w1, (torch.randn(h, k, device=dev) * k ** -0.5).bfloat16(), w2)
        weight_bytes = sum(2 * p.numel() for p in params[1:] if p.dim() == 2)  # the weights, read once
        floor = weight_bytes / bw * 1e6
        f = torch.compile(fn, backend="opfuse")
        times = {}
        for skinny in ("1", "0", ""):  # every GEMM it supports, none, the default's shapes
            os.environ["OPFUSE_SKINNY_GEMM"] = skinny
            f(*params)
            opfuse.reset_stats()
            f(*params)
            s = opfuse.stats()
            times[skinny] = (time_us(lambda: f(*params), args.iters), s["library_calls"], s["kernel_launches"])
        (ts, cs, ks), (tl, cl, kl), (td, cd, kd) = times["1"], times["0"], times[""]
        print(f"{name:<34}{floor:>9.1f}{ts:>9.1f} ({floor / ts:4.0%}){tl:>9.1f} ({floor / tl:4.0%})"
              f"{td:>9.1f} ({floor / td:4.0%})   calls/kernels {cs}/{ks} vs {cl}/{kl} vs {cd}/{kd}")
        # The default replayed as a CUDA graph: no host launch overhead.
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f(*params)
        tg = time_us(g.replay, args.iters)
        print(f"{'  as a CUDA graph (default)':<34}{floor:>9.1f}{tg:>9.1f} ({floor / tg:4.0%})")
        os.environ["OPFUSE_SKINNY_GEMM"] = "1"


if __name__ == "__main__":
    main()
