"""The pieces of one partition call, timed one by one (part of `opfuse bench
--suite launch`).

The launch bench says the chain's partition call costs about 3 us over the
driver's floor (H200, d68063d). This module says where: each step the C++
launcher (`_C.Launcher`'s call, src/python/bindings_launch.cpp) makes per
call, timed alone in a Python loop of the same shape as the bench's, with
an empty call's loop overhead measured beside them:

  loop            a call of a no-op Python function (what every row below
                  also pays for its loop; subtract it)
  layout check    the layout's check (PyTorch's TensorGuards) on the inputs
  device          the current device (torch._C._cuda_getDevice)
  stream          the current stream's handle (_cuda_getCurrentRawStream)
  alloc + free    one output from PyTorch's caching allocator, dropped at
                  once (its free included), per output of the partition
  data_ptr        every input's and output's data_ptr()
  finish          the prepared run's call without check, device or stream:
                  allocation, pointers, launch, result
  run             the launch alone, outputs preallocated (the bench's "run")

The steps do not add up exactly to the partition call (the C++ launcher
calls them without a Python frame each), but they rank the pieces, which is
what deciding the next change needs.
"""
from __future__ import annotations

import torch

from ..frontend import runtime


def layout_and_check(part, part_args) -> tuple:
    """(the tensors, their prepared layout, the layout check Python's path
    builds for them) of the partition `part` called with `part_args`."""
    tensors = [part_args[i] for i in part.tensor_positions]
    layout = part.layout_of(tensors)
    if layout is None:
        raise RuntimeError("the partition has no prepared layout for these inputs")
    key = runtime._layout_key(tensors, part.gemm_alignment_key)
    check = runtime._layout_check(tensors, key, part.gemm_alignment_key)
    if not check(*tensors):
        raise RuntimeError("the layout check refuses the inputs it was built from")
    return tensors, layout, check


def part_calls(part, part_args, device: torch.device) -> dict:
    """Step name -> a no-argument callable making that step once, for the
    partition `part` called with `part_args` (no device or stream rows on
    the CPU)."""
    tensors, layout, check = layout_and_check(part, part_args)
    empty = runtime._empty_strided(device)
    specs = list(layout.out_specs)
    outs = [empty(*s) for s in specs]
    everything = tensors + outs
    ptrs = [t.data_ptr() for t in everything]
    prepared = layout.prepared

    def noop():
        return None

    steps = {"loop": noop, "layout check": lambda: check(*tensors)}
    stream = 0
    if device.type == "cuda":
        get_device, raw_stream = runtime._current_device, runtime._raw_stream
        dev = get_device()
        stream = raw_stream(dev)
        steps["device"] = get_device
        steps["stream"] = lambda: raw_stream(dev)
    steps["alloc + free"] = (lambda: empty(*specs[0])) if len(specs) == 1 else (lambda: [empty(*s) for s in specs])
    steps["data_ptr"] = lambda: [t.data_ptr() for t in everything]
    steps["finish"] = lambda: prepared.finish(tensors, stream)
    steps["run"] = lambda: (prepared.launch(ptrs, stream), outs)[1]  # the outputs it wrote
    return steps


def measure_parts(fn, args, device: torch.device, host_us, batches: int, calls: int) -> dict:
    """Step name -> (median, min) host us per call, for the one partition
    of `fn` compiled with opfuse (`host_us` is the bench's timer of a dict
    of callables, their batches in turn)."""
    from .launch import find_partition

    torch._dynamo.reset()
    compiled_fn = torch.compile(fn, backend="opfuse")
    compiled_fn(*args)
    part, part_args = find_partition(compiled_fn, args)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the bench's layers on the CPU
    try:
        return host_us(part_calls(part, part_args, device), device, batches, calls)
    finally:
        torch.set_num_threads(threads)
