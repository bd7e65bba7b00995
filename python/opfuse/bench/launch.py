"""Host time of opfuse's launch path, layer by layer (`opfuse bench --suite launch`).

The seed chain on a tiny tensor (4096 elements: the GPU finishes each kernel
in a few microseconds, so the host is what is measured) is compiled once and
called many times without synchronising; per call we report the host time of

  torch.compile   the whole compiled function: Dynamo's guards, AOTAutograd's
                  wrappers, then opfuse's partition (what a user pays)
  partition       opfuse's FusedPartition.__call__ alone: the layout check,
                  output allocation, stream, the C++ run
  run             the C++ run the partition makes (PreparedRun.launch) alone,
                  outputs preallocated: pointers into the prepared argument
                  blocks and cuLaunchKernel (until the launch-path change
                  after 37659d9 this was CompiledGraph.run, which also
                  converted size and stride lists and worked out the launch
                  geometry on every call)
  eager           one eager PyTorch op (add) for scale

On the CPU the same layers are timed (the kernel is a few microseconds of
host work there, so "run" and "partition" include it).

"partition" per fused kernel is the number the CUDA issue's 5 us target is
about (the chain is one kernel).
"""
from __future__ import annotations

import time

import torch

from .records import RunInfo, make_record

CALLS = 2000


def _host_us(fn, calls: int, device: torch.device) -> float:
    for _ in range(50):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = None
    for _ in range(3):  # best of three batches: the least disturbed by other work
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t = (time.perf_counter() - t0) / calls * 1e6
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = t if best is None else min(best, t)
    return best


def _find_partition(compiled_fn, args):
    """The FusedPartition opfuse built for the function (via the backend's report)."""
    from ..frontend import runtime

    found = []
    original = runtime.FusedPartition.__call__

    def spy(self, *a):
        found.append((self, a))
        return original(self, *a)

    runtime.FusedPartition.__call__ = spy
    try:
        compiled_fn(*args)
    finally:
        runtime.FusedPartition.__call__ = original
    if len(found) != 1:
        raise RuntimeError(f"expected one opfuse partition, found {len(found)}")
    return found[0]


def measure_launch(device: torch.device, quick: bool = False) -> dict:
    calls = 200 if quick else CALLS
    n = 4096
    x, b1, b2 = (torch.randn(n, device=device) for _ in range(3))
    chain = lambda x, b1, b2: torch.relu(x + b1) * 0.5 + b2  # noqa: E731
    torch._dynamo.reset()
    compiled_fn = torch.compile(chain, backend="opfuse")
    compiled_fn(x, b1, b2)
    part, part_args = _find_partition(compiled_fn, (x, b1, b2))
    tensors = [part_args[i] for i in part.tensor_positions]
    layout = part.layout_of(tensors)
    outs = [torch.empty_strided(size, stride, dtype=dt, device=device) for size, stride, dt in layout.out_specs]
    ptrs = [t.data_ptr() for t in tensors] + [o.data_ptr() for o in outs]
    stream = torch.cuda.current_stream(device).cuda_stream if part.cuda else 0
    results = {
        "torch.compile": _host_us(lambda: compiled_fn(x, b1, b2), calls, device),
        "partition": _host_us(lambda: part(*part_args), calls, device),
        "run": _host_us(lambda: layout.prepared.launch(ptrs, stream), calls, device),
        "eager add": _host_us(lambda: torch.add(x, b1), calls, device),
    }
    results["kernels"] = part.num_kernels
    return results


def run_launch_suite(device: torch.device, info: RunInfo, quick: bool) -> list[dict]:
    r = measure_launch(device, quick)
    print(f"\n== launch (host us per call, seed chain of 4096 elements, {r['kernels']} fused kernel) ==")
    records = []
    for layer in ("torch.compile", "partition", "run", "eager add"):
        print(f"{layer:14s} {r[layer]:8.2f} us")
        # Stored in 'ms' (the schema's time metric); the case says what it is.
        records.append(make_record(info, suite="launch", case="chain-4K-host", impl=layer, metric="ms",
                                   value=r[layer] / 1e3, floor=None, host_us=r[layer], kernels=r["kernels"]))
    return records
