"""The gemm suite's four cases (issue 5) with opfuse's GEMM knobs as variants,
beside eager and torch.compile, in one process.

Each implementation compiles its own copy of the case's function (a distinct
code object, so Dynamo keeps one cache entry per variant and no reset
recompiles an earlier one under another variant's knobs); the knobs are read
when opfuse plans the partition, so each variant is compiled and warmed with
its environment set. Timing interleaves the implementations in rounds
(thermal drift at M = 8192 falls on all of them), median of all samples.

    python3 scripts/bench_gemm_variants.py [--out DIR] [--rounds 2] [--budget 0.15]
        [--cases mlp-8192,...] [--variants main,pairs,...]

Prints a table (median us, TFLOP/s at M = 8192, % of the weight-read floor at
M = 16, library calls and kernels per call) and writes gemm-variants.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

import torch

import opfuse
from opfuse.bench.cases import gemm_case
from opfuse.bench.ceilings import measure_copy_bandwidth
from opfuse.bench.checks import check, reference
from opfuse.bench.timing import benchmark, summarize

CASES = {"mlp-8192": ("mlp", 8192, 4096, 16384), "mlp-16": ("mlp", 16, 4096, 16384),
         "llama-8192": ("llama", 8192, 4096, 11008), "llama-16": ("llama", 16, 4096, 11008)}
# opfuse's knobs per variant; "main" is main's behaviour (no pairs, the
# heuristic's first 8 answers timed, no split-K re-cuts).
BASE = {"OPFUSE_GEMM_PAIRS": "0", "OPFUSE_GEMM_CANDIDATES": "8", "OPFUSE_GEMM_SPLITK": "0"}
VARIANTS = {
    "main": {},
    "pairs": {"OPFUSE_GEMM_PAIRS": "1"},
    "search": {"OPFUSE_GEMM_CANDIDATES": "32", "OPFUSE_GEMM_SPLITK": "16"},
    "pairs+search": {"OPFUSE_GEMM_PAIRS": "1", "OPFUSE_GEMM_CANDIDATES": "32", "OPFUSE_GEMM_SPLITK": "16"},
}


def fresh(fn, tag):
    """fn with its own code object: its own Dynamo cache."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def with_env(env, thunk):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return thunk()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.15, help="seconds of timing per implementation per round")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-inductor", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    t_start = time.perf_counter()
    bw = measure_copy_bandwidth(dev, budget_s=0.3)
    print(f"copy bandwidth {bw.gb_per_s:.0f} GB/s; commit {os.environ.get('OPFUSE_COMMIT', '?')}; "
          f"{torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    records = []
    for cname in args.cases.split(","):
        kind, m, k, h = CASES[cname]
        case = gemm_case(kind, m, k, h, torch.bfloat16)
        inputs = case.make_inputs(dev, 0)
        eager_out = case.fn(*inputs)
        expected = reference(case.fn, inputs, eager_out)
        weight_bytes = sum(t.numel() * t.element_size() for t in inputs[1:])
        floor_us = weight_bytes / bw.bytes_per_s * 1e6
        impls = {"eager": case.fn}
        if not args.no_inductor:
            impls["torch.compile"] = torch.compile(fresh(case.fn, "inductor"))
        envs = {}
        for v in args.variants.split(","):
            if kind == "mlp" and "pairs" in v:
                continue  # no two GEMMs share an A in the MLP block
            impls[f"opfuse:{v}"] = torch.compile(fresh(case.fn, v.replace("+", "_")), backend="opfuse")
            envs[f"opfuse:{v}"] = {**BASE, **VARIANTS[v]}
        samples, info = {}, {}
        for name, fn in impls.items():
            t0 = time.perf_counter()
            try:
                out = with_env(envs.get(name, {}), lambda: fn(*inputs))  # compile, tune, first call
                err = check(out, expected)
                fn(*inputs)
                opfuse.reset_stats()
                fn(*inputs)
                torch.cuda.synchronize()
                s = opfuse.stats()
                info[name] = {"error": err, "first_call_s": time.perf_counter() - t0,
                              "library_calls": s["library_calls"], "kernels": s["kernel_launches"]}
                samples[name] = []
            except Exception as exc:
                info[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"  {cname} {name}: ready in {time.perf_counter() - t0:.1f} s {info[name]}", flush=True)
        for _ in range(args.rounds):
            for name in samples:
                t = benchmark(impls[name], [inputs], dev, budget_s=args.budget, min_reps=10)
                samples[name].append(t.median_ms)
        # Per round medians; the reported value is the median of the round medians.
        for name in samples:
            ms = sorted(samples[name])
            med = summarize(ms).median_ms
            rec = {"case": cname, "impl": name, "median_us": med * 1e3, "round_medians_us": [x * 1e3 for x in ms],
                   "flops": case.flops, "tflops": case.flops / (med / 1e3) / 1e12,
                   "weight_bytes": weight_bytes, "floor_us": floor_us, "of_floor": floor_us / (med * 1e3),
                   "copy_gb_per_s": bw.gb_per_s, **info[name]}
            records.append(rec)
            print(f"{cname:11s} {name:22s} {med * 1e3:9.1f} us  {rec['tflops']:6.1f} TFLOP/s  "
                  f"{100 * rec['of_floor']:5.1f}% of floor  calls {info[name].get('library_calls')} "
                  f"kernels {info[name].get('kernels')}  err {info[name].get('error')}  rounds "
                  f"{['%.1f' % (x * 1e3) for x in ms]}", flush=True)
        del impls, inputs, eager_out, expected
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemm-variants.json"), "w") as f:
        json.dump({"commit": os.environ.get("OPFUSE_COMMIT"), "device": torch.cuda.get_device_name(),
                   "copy_gb_per_s": bw.gb_per_s, "records": records}, f, indent=1)
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
