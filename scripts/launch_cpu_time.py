"""Thread CPU time per call of the launch path's layers (the seed chain),
for noisy shared machines where `opfuse bench --suite launch`'s wall time
swings: time.thread_time_ns counts only this thread's CPU time.

    N=4096 .venv/bin/python scripts/launch_cpu_time.py [cpu|cuda]

Prints torch.compile (the whole compiled call), partition
(FusedPartition.__call__) and eager add, wall/cpu us, best of 5 batches.
"""
import os
import sys
import time

import torch

from opfuse.bench.launch import _find_partition


def best_of(fn, calls, batches=5):
    for _ in range(200):
        fn()
    wall = cpu = float("inf")
    for _ in range(batches):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        for _ in range(calls):
            fn()
        cpu = min(cpu, (time.thread_time_ns() - c0) / calls / 1e3)
        wall = min(wall, (time.perf_counter_ns() - w0) / calls / 1e3)
    return wall, cpu


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    torch.set_num_threads(1)
    n = int(os.environ.get("N", "4096"))
    x, b1, b2 = (torch.randn(n, device=device) for _ in range(3))
    f = torch.compile(lambda x, b1, b2: torch.relu(x + b1) * 0.5 + b2, backend="opfuse")
    f(x, b1, b2)
    part, args = _find_partition(f, (x, b1, b2))
    res = {"torch.compile": best_of(lambda: f(x, b1, b2), 2000), "partition": best_of(lambda: part(*args), 5000),
           "eager add": best_of(lambda: torch.add(x, b1), 5000)}
    print(f"load {os.getloadavg()[0]:.1f} | " + "  ".join(f"{k} {w:.2f}/{c:.2f}" for k, (w, c) in res.items()),
          "(wall/cpu us)")


if __name__ == "__main__":
    main()
