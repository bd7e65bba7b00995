#!/usr/bin/env python3
"""Benchmark of the decode MLP kernel on a GPU (run from the repository root
after installing opfuse): the two M = 16 blocks of the gemm suite (and
M = 1) with eager PyTorch, torch.compile (Inductor), opfuse with its decode
MLP step and without it (OPFUSE_DECODE_MLP=0: cuBLASLt calls with timed
algorithms), and the kernel called directly with each config and L2
prefetch depth. Fractions are of the floor: every weight read once at the
copy bandwidth measured in the same run.

  python3 scripts/bench_decode_mlp.py [--iters 50] [--quick] [--m1] [--configs b64k256s4,...]
      [--prefetch 0,2,4,8] [--json out.json] [--smoke] [--opfuse-config TAG] [--max-autotune]

--opfuse-config sets the config of the opfuse graph runs (default: the
launcher's); --max-autotune times torch.compile(mode="max-autotune") beside
eager and the default mode only (its autotuning can take minutes), no opfuse
or kernel rows.
"""
import argparse
import json
import os

import torch

import opfuse
from opfuse import decode_mlp as dm
from opfuse.bench.cases import llama_mlp, mlp_block

from bench_skinny_gemm import copy_bandwidth_gb_s, time_us  # scripts/, this file's folder


def params(kind, m, k, h, dev):
    torch.manual_seed(0)
    r = lambda *s, scale=1.0: (torch.randn(*s, device=dev) * scale).bfloat16()
    x = r(m, k)
    if kind == "mlp":
        return (x, r(h, k, scale=k ** -0.5), r(h), r(k, h, scale=h ** -0.5), r(k))
    return (x, r(h, k, scale=k ** -0.5), r(h, k, scale=k ** -0.5), r(k, h, scale=h ** -0.5))


def direct(kind, p, out):
    if kind == "mlp":
        x, w1, b1, w2, b2 = p
        return lambda: dm.mlp(x, w1, w2, b1, b2, activation="relu", out=out)
    x, w1, w3, w2 = p
    return lambda: dm.mlp(x, w1, w2, activation="silu_gate", w3=w3, out=out)


def graphed(fn):
    """fn captured once as a CUDA graph (warm first): replay has no host launch cost."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="default config and prefetch only")
    ap.add_argument("--m1", action="store_true", help="also the blocks at M = 1")
    ap.add_argument("--json", default="")
    ap.add_argument("--configs", default="", help="comma-separated config tags (default: every candidate)")
    ap.add_argument("--prefetch", default="0,2,4,8", help="L2 prefetch depths to time")
    ap.add_argument("--smoke", action="store_true", help="one launch of each block, checked, then exit")
    ap.add_argument("--kernel-only", action="store_true", help="only the kernel's configs (no eager, Inductor, opfuse)")
    ap.add_argument("--opfuse-config", default="", help="config tag of the opfuse graph runs (OPFUSE_DECODE_MLP_CONFIG)")
    ap.add_argument("--max-autotune", action="store_true",
                    help="only eager, torch.compile and torch.compile max-autotune (no opfuse, no kernel configs)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    # Build every instantiation to be timed in parallel threads (NVRTC releases the GIL) into the disk cache.
    from concurrent.futures import ThreadPoolExecutor
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    wanted = args.configs.split(",") if args.configs else dm.candidates()
    if args.max_autotune:
        wanted = []
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda cg: dm.compile(torch.bfloat16, cg[1], cg[0], arch, use_cache=True),
                    [(c, g) for c in wanted for g in (False, True)]))
    if args.smoke:
        cases = [(cfg, kind, shape) for cfg in wanted for kind, shape in (
            ("mlp", (16, 1032, 2056)), ("llama", (5, 1032, 2056)), ("mlp", (16, 4096, 16384)), ("llama", (16, 4096, 11008)))]
        for cfg, kind, (m, k, h) in cases:
            os.environ["OPFUSE_DECODE_MLP_CONFIG"] = cfg
            p = params(kind, m, k, h, dev)
            fn = mlp_block if kind == "mlp" else llama_mlp
            out = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
            direct(kind, p, out)()
            torch.cuda.synchronize()
            ref = fn(*[t.double() for t in p])
            err = (out.double() - ref).abs().max().item()
            eerr = (fn(*p).double() - ref).abs().max().item()
            print(f"smoke {cfg} {kind} {m}x{k}x{h}: max err {err:.3g} (eager {eerr:.3g})", flush=True)
            assert err <= 2 * eerr + 2 * 2 ** -8 * ref.abs().max().item(), "smoke: wrong values"
        os.environ.pop("OPFUSE_DECODE_MLP_CONFIG", None)
        print("smoke ok", flush=True)
        return
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bw = copy_bandwidth_gb_s()
    print(f"{torch.cuda.get_device_name()}  sm_{major}{minor}  {sms} SMs  copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    blocks = [("mlp", 16, 4096, 16384), ("llama", 16, 4096, 11008)]
    if args.m1:
        blocks += [("mlp", 1, 4096, 16384), ("llama", 1, 4096, 11008)]
    for kind, m, k, h in blocks:
        p = params(kind, m, k, h, dev)
        fn = mlp_block if kind == "mlp" else llama_mlp
        floor = sum(2 * t.numel() for t in p[1:] if t.dim() == 2) / (bw * 1e9) * 1e6
        name = f"{kind} {m}x{k}x{h}"
        ref = fn(*[t.double() for t in p])
        want = fn(*p)
        out = torch.empty_like(want)
        res = {"case": name, "floor_us": floor}

        def record(label, us, note=""):
            res[label] = us
            print(f"  {name:<22} {label:<34} {us:8.1f} us  {floor / us:6.1%} of floor {note}", flush=True)

        print(f"{name}: floor {floor:.1f} us (90%: {floor / 0.9:.1f} us)", flush=True)
        if args.max_autotune:
            inductor_modes(args, fn, p, ref, record)
            rows.append(res)
            continue
        if not args.kernel_only:
            frameworks(args, name, kind, fn, p, ref, want, record)
        configs = args.configs.split(",") if args.configs else dm.candidates()
        for cfg in configs[:1] if args.quick else configs:
            os.environ["OPFUSE_DECODE_MLP_CONFIG"] = cfg
            for pf in ((2,) if args.quick else [int(v) for v in args.prefetch.split(",")]):
                os.environ["OPFUSE_DECODE_MLP_PREFETCH"] = str(pf)
                direct(kind, p, out)()
                torch.cuda.synchronize()
                err = (out.double() - ref).abs().max().item()
                record(f"kernel {cfg} prefetch {pf}", time_us(direct(kind, p, out), args.iters), f"max err {err:.3g}")
        os.environ.pop("OPFUSE_DECODE_MLP_CONFIG", None)
        os.environ.pop("OPFUSE_DECODE_MLP_PREFETCH", None)
        rows.append(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gb_s": bw, "rows": rows}, fh, indent=1)


def inductor_modes(args, fn, p, ref, record):
    """Eager and Inductor's default and max-autotune modes on the same inputs
    (issue 5 asks for max-autotune beside the default)."""
    import time
    record("eager", time_us(lambda: fn(*p), args.iters))
    for mode in ("default", "max-autotune"):
        torch._dynamo.reset()
        f = torch.compile(fn, mode=mode)
        t0 = time.perf_counter()
        got = f(*p)
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        err = (got.double() - ref).abs().max().item()
        record(f"torch.compile {mode}", time_us(lambda: f(*p), args.iters), f"compile {warm:.0f} s  max err {err:.3g}")


def frameworks(args, name, kind, fn, p, ref, want, record):
    """Eager, Inductor and opfuse with and without the decode MLP step, on the same inputs."""
    record("eager", time_us(lambda: fn(*p), args.iters))
    torch._dynamo.reset()
    ind = torch.compile(fn)
    record("torch.compile", time_us(lambda: ind(*p), args.iters))
    if args.opfuse_config:
        os.environ["OPFUSE_DECODE_MLP_CONFIG"] = args.opfuse_config
    for decode in ("0", "1"):
        os.environ["OPFUSE_DECODE_MLP"] = decode
        torch._dynamo.reset()
        f = torch.compile(fn, backend="opfuse")
        got = f(*p)
        opfuse.reset_stats()
        got = f(*p)
        s = opfuse.stats()
        err = (got.double() - ref).abs().max().item()
        eerr = (want.double() - ref).abs().max().item()
        label = f"opfuse decode MLP {args.opfuse_config or 'default'}" if decode == "1" else "opfuse cuBLASLt (DECODE_MLP=0)"
        record(label, time_us(lambda: f(*p), args.iters),
               f"calls/kernels {s['library_calls']}/{s['kernel_launches']}  max err {err:.3g} (eager {eerr:.3g})")
        record(label + " graph", time_us(graphed(lambda: f(*p)), args.iters))
    os.environ.pop("OPFUSE_DECODE_MLP", None)
    os.environ.pop("OPFUSE_DECODE_MLP_CONFIG", None)


if __name__ == "__main__":
    main()
