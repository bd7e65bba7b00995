"""Masked vs unmasked attention on the GPU (ctypes harnesses), beside PyTorch SDPA.

D = 128, bf16, B * S = 16k tokens, H = 16, not causal. Masks: none; key
padding (bool [B, 1, 1, S], each batch keeping a different prefix); an
additive bf16 [B, 1, S, S] mask; a boolean [B, 1, S, S] mask. Rows: opfuse
forward on the mma.sync kernel and (opt-in) the Hopper kernel, opfuse
forward + backward (mma.sync forward, fused backward), SDPA's efficient and
cuDNN backends with the same mask (as SDPA takes it: bool or bf16). Times are
medians of CUDA-event timings; TFLOP/s counts 4 B H S^2 D (forward) and
2.5x that (forward + backward) whatever the mask.

    python bench_attention_mask.py --out DIR [--seqlen 4096] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch

import attn_bwd_runtime as br
import attn_runtime as ar


def timeit(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def masks(B, S, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    keep = torch.zeros(B, 1, 1, S, dtype=torch.bool, device=dev)
    for b in range(B):
        keep[b, ..., : S - b * S // 8] = True
    add = torch.randn(B, 1, S, S, generator=g, device=dev).bfloat16()
    boolm = torch.rand(B, 1, S, S, generator=g, device=dev) > 0.2
    return {"none": None, "keypad": keep, "full-bf16": add, "full-bool": boolm}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    S, H, D = a.seqlen, a.heads, a.dim
    B = max(1, 16384 // S)
    dev = "cuda"
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=dev).bfloat16() for _ in range(3))
    dout = torch.randn(B, H, S, D, device=dev).bfloat16()
    fwd, bwd = ar.AttentionForward(), br.AttentionBackward()
    sm90 = fwd.sm90
    flops = 4 * B * H * S * S * D
    rows = []

    def add(name, mask, ms, f):
        rows.append(dict(name=name, mask=mask, ms=round(ms, 4), tflops=round(f / ms / 1e9, 1)))
        print(f"{name:34} {mask:10} {ms:8.3f} ms {f / ms / 1e9:7.1f} TFLOP/s", flush=True)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    for mname, m in masks(B, S, dev).items():
        # forward: mma.sync (the default for masked calls) and Hopper
        cfg_mma = ar.default_config(D, fwd.arch, fwd.smem_limit, masked=m is not None)
        add("opfuse fwd mma.sync", mname, timeit(lambda: fwd(q, k, v, attn_mask=m, config=cfg_mma), a.iters), flops)
        if fwd.arch.startswith("sm_90"):
            cfg = sm90.default_config_sm90(D, False)
            add("opfuse fwd hopper", mname, timeit(lambda: fwd(q, k, v, attn_mask=m, config=cfg), a.iters), flops)
        # forward + backward (the forward as dispatched by default)
        def fb():
            o, lse = fwd(q, k, v, attn_mask=m)
            bwd(dout, q, k, v, o, lse, attn_mask=m)
        add("opfuse fwd+bwd (default fwd)", mname, timeit(fb, a.iters), 2.5 * flops)
        # SDPA with the same mask (bool or bf16, as SDPA takes it)
        for bname, be in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def sf():
                with sdpa_kernel(be):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
            try:
                add(f"sdpa {bname} fwd", mname, timeit(sf, a.iters), flops)
                qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))

                def sfb():
                    with sdpa_kernel(be):
                        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=m)
                    o.backward(dout)
                add(f"sdpa {bname} fwd+bwd", mname, timeit(sfb, a.iters), 2.5 * flops)
            except RuntimeError as e:
                print(f"sdpa {bname} {mname}: {str(e).splitlines()[0][:160]}", flush=True)
                rows.append(dict(name=f"sdpa {bname}", mask=mname, error=str(e).splitlines()[0][:300]))
    meta = dict(B=B, H=H, S=S, D=D, dtype="bf16", causal=False, device=torch.cuda.get_device_name(),
                torch=torch.__version__, commit=os.environ.get("OPFUSE_COMMIT", "unknown"))
    with open(os.path.join(a.out, "bench_mask.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
