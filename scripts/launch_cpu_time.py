"""Thread CPU time per call of the launch path's layers, for noisy shared
machines where `opfuse bench --suite launch`'s wall time swings:
time.thread_time_ns counts only this thread's CPU time. The layers are
the bench's (opfuse.bench.launch.layer_calls), so running this file against
two trees alternately measures each tree's own path:

    N=4096 .venv/bin/python scripts/launch_cpu_time.py [cpu|cuda]

Prints, per graph (the seed chain on N elements: one kernel; the bench's
multi-kernel graph on 64 x 64), torch.compile (the whole compiled call),
partition (the partition's call), run (PreparedRun.launch, outputs
preallocated) and eager add: median (best) us over 7 batches.
"""
import os
import statistics
import sys
import time

import torch

import opfuse  # noqa: F401  (registers the backend before torch.compile looks it up)
from opfuse.bench.launch import chain, layer_calls, multi


def timed(fn, calls, batches=7):
    for _ in range(200):
        fn()
    per = []
    for _ in range(batches):
        c0 = time.thread_time_ns()
        for _ in range(calls):
            fn()
        per.append((time.thread_time_ns() - c0) / calls / 1e3)
    return statistics.median(per), min(per)


def measure(fn, args, device):
    k, calls_of = layer_calls(fn, args, torch.device(device))
    counts = {"torch.compile": 2000}
    return k, {layer: timed(call, counts.get(layer, 5000)) for layer, call in calls_of.items()}


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    torch.set_num_threads(1)
    n = int(os.environ.get("N", "4096"))
    graphs = {f"chain-{n}": (chain, tuple(torch.randn(n, device=device) for _ in range(3))),
              "multi-64x64": (multi, (torch.randn(64, 64, device=device), torch.randn(64, device=device)))}
    for name, (fn, args) in graphs.items():
        k, res = measure(fn, args, device)
        print(f"{name} ({k} kernels) load {os.getloadavg()[0]:.1f} | "
              + "  ".join(f"{layer} {m:.2f} ({b:.2f})" for layer, (m, b) in res.items()), "(cpu us, median (best))")


if __name__ == "__main__":
    main()
