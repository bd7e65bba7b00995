#!/usr/bin/env python3
"""One decode-shaped GEMM, called a few times, for ncu to profile (run under
`scripts/sessions/gpu-session16 ncu`): the skinny kernel with the config in
OPFUSE_SKINNY_CONFIG (or its default), or cuBLAS's F.linear with --cublas.

  ncu -k regex:skinny_gemm --launch-skip 2 --launch-count 1 \
      python3 scripts/skinny_ncu_driver.py 16 16384 4096
"""
import argparse

import torch
import torch.nn.functional as F

from opfuse import skinny_gemm as sg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("m", type=int)
    ap.add_argument("k", type=int)
    ap.add_argument("n", type=int)
    ap.add_argument("--cublas", action="store_true", help="F.linear (cuBLAS) instead of the skinny kernel")
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(args.m, args.k, device=dev).bfloat16()
    w = (torch.randn(args.n, args.k, device=dev) * args.k ** -0.5).bfloat16()
    b = torch.randn(args.n, device=dev).bfloat16()
    out = torch.empty(args.m, args.n, dtype=x.dtype, device=dev)
    for _ in range(args.calls):
        if args.cublas:
            out = F.linear(x, w, b)
        elif sg.linear(x, w, b, out=out) is None:
            raise SystemExit(f"the skinny kernel declined: {sg.last_error()}")
    torch.cuda.synchronize()
    torch.testing.assert_close(out, F.linear(x, w, b))


if __name__ == "__main__":
    main()
