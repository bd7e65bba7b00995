"""Host time of opfuse's launch path, layer by layer (`opfuse bench --suite launch`).

Two graphs on small tensors (the GPU finishes each kernel in a few
microseconds, so the host is what is measured), each compiled once and
called many times without synchronising inside a batch:

  chain     the seed chain relu(x + b1) * 0.5 + b2 on 4096 elements: one
            fused kernel
  multi     a row sum, a column sum and the elementwise work around them on
            64 x 64: a partition of several kernels (the count is reported)

Per call and per fused kernel, the host microseconds of

  torch.compile   the whole compiled function: Dynamo's guards, AOTAutograd's
                  wrappers, then opfuse's partition (what a user pays)
  partition       opfuse's partition call alone (FusedPartition, a
                  _C.Launcher: the layout checks, current device and stream,
                  output allocation, pointers, launch, count): our call path
                  end to end
  run             the C++ run alone (PreparedRun.launch), outputs
                  preallocated: pointers into the prepared argument blocks
                  and the launches
  eager add       one eager PyTorch op (add) for scale

and, on CUDA, the driver's floor: back-to-back cuLaunchKernel calls of an
empty kernel with the chain kernel's argument size, timed in C++
(`_C.time_empty_launches`). No launcher goes below it; "run" minus it is
what opfuse's C++ adds to a launch, "partition" minus it the whole path's
own cost.

Each number is the median over batches of the mean time per call in a batch
(and the fastest batch, less disturbed by other processes). On the CPU the
same layers are timed with one torch thread; there the kernels run on the
host, so "run" and "partition" include them (a few hundred ns for the
chain, a few us for the multi graph's reductions).

"partition" per fused kernel is the number the CUDA issue's 5 us target is
about. Then the chain's partition call step by step (launch_parts.py), and
the host steps of partitions with GEMM steps at M = 16, through Python's
_miss and through the C++ launcher (launch_gemm.py).
"""
from __future__ import annotations

import statistics
import time

import torch

from .cases import seed_chain as chain
from .launch_gemm import measure_gemm_steps
from .launch_parts import measure_parts
from .records import RunInfo, make_record

BATCHES, CALLS = 41, 200  # median over 41 batches of 200 calls
LAYERS = ("torch.compile", "partition", "run", "eager add")


def host_us_interleaved(fns: dict, device: torch.device, batches: int, calls: int) -> dict:
    """name -> (median, min) over batches of the mean host microseconds per
    call, the callables' batches taken in turn (batch 1 of each, then batch
    2 of each, ...), so that a slow stretch of a shared host (another
    process, a frequency change) falls on every row alike instead of on
    whichever row was being timed then (the 20261205 H100 run read the
    chain's partition at a median of 7.96 us with a fastest batch of 5.18,
    timed alone). Each batch follows one untimed call, in which a step that
    switches state (the GEMM partition's two paths) does so."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    for fn in fns.values():
        for _ in range(100):
            fn()
    sync(device)
    per_batch = {name: [] for name in fns}
    for _ in range(batches):
        for name, fn in fns.items():
            fn()
            sync(device)
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            per_batch[name].append((time.perf_counter_ns() - t0) / calls / 1e3)
            sync(device)  # outside the timed batch: the GPU never falls a queue behind
    return {name: (statistics.median(b), min(b)) for name, b in per_batch.items()}


def _host_us(fn, device: torch.device, batches: int, calls: int) -> tuple[float, float]:
    """(median, min) over batches of the mean host microseconds per call."""
    for _ in range(100):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync(device)
    per_batch = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        per_batch.append((time.perf_counter_ns() - t0) / calls / 1e3)
        sync(device)  # outside the timed batch: the GPU never falls a queue behind
    return statistics.median(per_batch), min(per_batch)


def find_partition(compiled_fn, args):
    """The one FusedPartition a compiled call goes through, and its arguments."""
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


def multi(x, b):
    # A row reduction, then a column reduction of something that needs it:
    # no one kernel computes both, so the partition launches several.
    y = torch.relu(x + b)
    r = y.sum(-1, keepdim=True)
    c = (y * r).sum(0)
    return y * 0.5 + c


def graphs(device: torch.device) -> dict:
    """name -> (function, example arguments)."""
    return {
        "chain-4K": (chain, tuple(torch.randn(4096, device=device) for _ in range(3))),
        "multi-64x64": (multi, (torch.randn(64, 64, device=device), torch.randn(64, device=device))),
    }


def layer_calls(fn, args, device: torch.device) -> tuple[int, dict]:
    """Compiles `fn` with opfuse and returns its kernel count and, per layer,
    a no-argument callable that makes one call of that layer (checked once
    against eager first, so that a layer that went wrong is not timed as fast)."""
    torch._dynamo.reset()
    compiled_fn = torch.compile(fn, backend="opfuse")
    compiled_fn(*args)
    part, part_args = find_partition(compiled_fn, args)
    tensors = [part_args[i] for i in part.tensor_positions]
    layout = part.layout_of(tensors)
    if layout is None or part.num_library_calls:
        raise RuntimeError("the launch bench needs a partition without library calls, prepared for its inputs")
    outs = [torch.empty_strided(size, stride, dtype=dt, device=device) for size, stride, dt in layout.out_specs]
    ptrs = [t.data_ptr() for t in tensors] + [o.data_ptr() for o in outs]
    stream = torch.cuda.current_stream(device).cuda_stream if part.cuda else 0
    a, b = args[0], args[1]
    torch.testing.assert_close(compiled_fn(*args), fn(*args))
    return part.num_kernels, {
        "torch.compile": lambda: compiled_fn(*args),
        "partition": lambda: part(*part_args),
        # `outs` is named in the call so that it lives as long as the
        # callable does: `ptrs` points into it.
        "run": lambda: (layout.prepared.launch(ptrs, stream), outs)[0],
        "eager add": lambda: torch.add(a, b),
    }


def measure_graph(fn, args, device: torch.device, batches: int = BATCHES, calls: int = CALLS) -> dict:
    """Host us (median, min) per layer for one graph, and its kernel count."""
    kernels, calls_of = layer_calls(fn, args, device)
    results = host_us_interleaved(calls_of, device, batches, calls)
    return {"layers": results, "kernels": kernels}


def measure_driver_floor(device: torch.device, batches: int = BATCHES, calls: int = CALLS) -> tuple[float, float]:
    """(median, min) over batches of host us per cuLaunchKernel of an empty kernel."""
    from .. import _C

    stream = torch.cuda.current_stream(device).cuda_stream
    _C.time_empty_launches(stream, 100)  # compile, load, warm
    torch.cuda.synchronize(device)
    per_batch = []
    for _ in range(batches):
        per_batch.append(_C.time_empty_launches(stream, calls) / calls / 1e3)
        torch.cuda.synchronize(device)
    return statistics.median(per_batch), min(per_batch)


def measure_launch(device: torch.device, quick: bool = False) -> dict:
    batches, calls = (9, 50) if quick else (BATCHES, CALLS)
    # On the CPU the kernels run in the call: one thread, so that a parallel
    # region waiting on a core another process holds is not timed as launch
    # overhead (the host path itself is single-threaded either way).
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        return {name: measure_graph(fn, args, device, batches, calls) for name, (fn, args) in graphs(device).items()}
    finally:
        torch.set_num_threads(threads)


def run_launch_suite(device: torch.device, info: RunInfo, quick: bool) -> list[dict]:
    measured = measure_launch(device, quick)
    print("\n== launch (host us: median over batches of the mean per call; min = fastest batch) ==")
    print(f"{'graph':12s} {'kernels':>7s} {'layer':14s} {'us/call':>9s} {'us/kernel':>10s} {'min us/call':>12s}")
    records = []
    batches, calls = (9, 50) if quick else (BATCHES, CALLS)
    if device.type == "cuda":
        med, best = measure_driver_floor(device, batches, calls)
        print(f"{'driver floor':12s} {1:7d} {'cuLaunchKernel':14s} {med:9.2f} {med:10.2f} {best:12.2f}")
        records.append(make_record(info, suite="launch", case="driver-floor-host", impl="cuLaunchKernel (empty kernel)",
                                   metric="ms", value=med / 1e3, floor=None, host_us=med, host_us_min=best,
                                   host_us_per_kernel=med, kernels=1))
    steps = measure_parts(chain, graphs(device)["chain-4K"][1], device, host_us_interleaved, batches, calls)
    for graph, r in measured.items():
        k = r["kernels"]
        for layer in LAYERS:
            med, best = r["layers"][layer]
            per_kernel = med / k if layer != "eager add" else None
            print(f"{graph:12s} {k:7d} {layer:14s} {med:9.2f} {per_kernel if per_kernel is not None else float('nan'):10.2f}"
                  f" {best:12.2f}")
            # Stored in 'ms' (the schema's time metric); the case says what it is.
            records.append(make_record(info, suite="launch", case=f"{graph}-host", impl=layer, metric="ms",
                                       value=med / 1e3, floor=None, host_us=med, host_us_min=best,
                                       host_us_per_kernel=per_kernel, kernels=k))
    print("chain-4K partition call, step by step (launch_parts.py; every row includes the 'loop' row's cost):")
    for step, (med, best) in steps.items():
        print(f"{'  ' + step:34s} {med:9.2f} {'':10s} {best:12.2f}")
        records.append(make_record(info, suite="launch", case="chain-4K-steps-host", impl=step, metric="ms",
                                   value=med / 1e3, floor=None, host_us=med, host_us_min=best, kernels=1))
    for graph, gemm_steps in measure_gemm_steps(device, host_us_interleaved, batches, calls, quick).items():
        print(f"{graph} partition with GEMM steps, step by step (launch_gemm.py; every row includes 'loop'):")
        for step, (med, best) in gemm_steps.items():
            print(f"{'  ' + step:34s} {med:9.2f} {'':10s} {best:12.2f}")
            records.append(make_record(info, suite="launch", case=f"{graph}-gemm-steps-host", impl=step, metric="ms",
                                       value=med / 1e3, floor=None, host_us=med, host_us_min=best))
    return records
