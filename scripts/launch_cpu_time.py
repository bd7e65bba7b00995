"""Thread CPU time per call of the launch path's layers, for noisy shared
machines where `opfuse bench --suite launch`'s wall time swings:
time.thread_time_ns counts only this thread's CPU time. Self-contained (it
uses only what every opfuse since the PreparedRun change has: the
partition's layout_of and PreparedRun.launch), so the same file measures
two trees alternately:

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
from opfuse.frontend import runtime


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


def find_partition(f, args):
    found, original = [], runtime.FusedPartition.__call__

    def spy(self, *a):
        found.append((self, a))
        return original(self, *a)

    runtime.FusedPartition.__call__ = spy
    try:
        f(*args)
    finally:
        runtime.FusedPartition.__call__ = original
    assert len(found) == 1, len(found)
    return found[0]


def chain(x, b1, b2):
    return torch.relu(x + b1) * 0.5 + b2


def multi(x, b):
    y = torch.relu(x + b)
    r = y.sum(-1, keepdim=True)
    c = (y * r).sum(0)
    return y * 0.5 + c


def measure(fn, args, device):
    torch._dynamo.reset()
    f = torch.compile(fn, backend="opfuse")
    f(*args)
    part, pargs = find_partition(f, args)
    tensors = [pargs[i] for i in part.tensor_positions]
    lay = part.layout_of(tensors)
    outs = [torch.empty_strided(s, st, dtype=d, device=device) for s, st, d in lay.out_specs]
    ptrs = [t.data_ptr() for t in tensors] + [o.data_ptr() for o in outs]
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    a, b = args[0], args[1]
    return part.num_kernels, {"torch.compile": timed(lambda: f(*args), 2000),
                              "partition": timed(lambda: part(*pargs), 5000),
                              "run": timed(lambda: lay.prepared.launch(ptrs, stream), 5000),
                              "eager add": timed(lambda: torch.add(a, b), 5000)}


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
