"""The host steps of a call of a partition with GEMM steps, timed one by one
(part of `opfuse bench --suite launch`).

Such a partition used to run every call from Python (FusedPartition._miss
and _run_with_library_calls); with OPFUSE_GEMM_CPP_LAUNCH it runs from the
C++ launcher as kernel-only partitions do (src/python/bindings_launch.cpp).
The rows, each timed alone in the launch bench's loop (every row includes
the 'loop' row's cost):

  loop               a call of a no-op Python function
  layout check       the layout check Python's _miss asks (TensorGuards; on
                     CUDA with its Python lambda over data_ptr() % 16)
  device, stream     (CUDA) the current device and stream's handle
  alloc written      the written buffers (and GEMM pair blocks) from
                     PyTorch's allocator, dropped at once
  data_ptr           every input's and written buffer's data_ptr()
  workspace          (CUDA) cuBLASLt's workspace from runtime's dict
  decode workspace   (CUDA, decode MLP partitions) the decode MLP's
  tf32 backends      (CUDA) torch.backends.cuda.matmul.allow_tf32, as the
                     Python path reads it
  tf32 _C getter     (CUDA) torch._C._get_cublas_allow_tf32, as the C++
                     launcher calls it
  bump_launch        the Python path's count (one lock)
  run                PreparedRun.run on preallocated pointers: the GEMM
                     steps and kernels alone (cuBLASLt's own host cost on
                     CUDA; on the CPU PyTorch's matmuls, i.e. compute)
  partition python   the whole call through Python's _miss
  partition c++      the whole call through the C++ launcher

"partition python" minus "partition c++" is what the C++ path saves per
call. On the CPU, "run" is compute and every row is a proxy only for the
GPU's host path (another machine, and no cuBLASLt).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..frontend import runtime
from ..stats import bump_launch
from .launch_parts import layout_and_check


def mlp(x, w1, b1, w2, b2):
    return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


def llama(x, w1, w3, w2):
    # Two GEMMs of one operand: on CUDA a pair (one batched call into one block).
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def gemm_graphs(device: torch.device, quick: bool) -> dict:
    """name -> (function, example arguments): decode-shaped (M = 16) MLPs.
    The small ones are host-bound on the GPU; on CUDA also the gemm suite's
    decode shapes, whose GPU time (~70-90 us) the host path may exceed."""
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)

    def r(*shape):
        return (torch.randn(shape, generator=gen, device=device) / shape[-1] ** 0.5).to(dt)

    # On the CPU the GEMMs run in the call: tiny ones, so that compute does
    # not bury the host steps.
    k, h = (256, 1024) if device.type == "cuda" else (32, 64)
    shapes = [("mlp", 16, k, h)]
    if not quick:
        shapes.append(("llama", 16, k, h))
        if device.type == "cuda":
            shapes += [("mlp", 16, 4096, 16384), ("llama", 16, 4096, 11008)]
    out = {}
    for kind, m, k, h in shapes:
        if kind == "mlp":
            out[f"mlp-{m}x{k}x{h}"] = (mlp, (r(m, k), r(h, k), r(h), r(k, h), r(k)))
        else:
            out[f"llama-{m}x{k}x{h}"] = (llama, (r(m, k), r(h, k), r(h, k), r(k, h)))
    return out


def gemm_step_calls(part, part_args, device: torch.device) -> dict:
    """Step name -> a no-argument callable making that step once, for the
    GEMM partition `part` called with `part_args`."""
    if not part.num_library_calls:
        raise RuntimeError("the partition has no GEMM steps")
    tensors, lay, check = layout_and_check(part, part_args)
    bufs = part._written_buffers(lay)
    everything = [*tensors, *bufs]
    ptrs = [t.data_ptr() for t in everything]
    steps = {"loop": lambda: None, "layout check": lambda: check(*tensors)}
    if device.type == "cuda":
        get_device, raw_stream = runtime._current_device, runtime._raw_stream
        dev = get_device()
        stream = raw_stream(dev)
        ws = runtime._workspace(dev, stream)
        dws = runtime.zeroed_workspace(dev, stream)
        steps["device"] = get_device
        steps["stream"] = lambda: raw_stream(dev)
    steps["alloc written"] = lambda: part._written_buffers(lay)
    steps["data_ptr"] = lambda: [t.data_ptr() for t in everything]
    if device.type == "cuda":
        steps["workspace"] = lambda: runtime._workspace(dev, stream).data_ptr()
        steps["zeroed workspace"] = lambda: runtime.zeroed_workspace(dev, stream).data_ptr()
        steps["tf32 backends"] = lambda: torch.backends.cuda.matmul.allow_tf32
        steps["tf32 _C getter"] = runtime._allow_tf32
        tf32 = runtime._allow_tf32()
        steps["bump_launch"] = lambda: bump_launch(0, 0)
        # `bufs` named in the call so that it lives as long as the callable (`ptrs` points into it).
        steps["run"] = lambda: (lay.prepared.run(
            ptrs, stream, ws.data_ptr(), ws.numel(), tf32,
            zeroed_workspace=dws.data_ptr(), zeroed_workspace_bytes=dws.numel()), bufs)[1]
    else:
        steps["bump_launch"] = lambda: bump_launch(0, 0)
        gemms = lay.gemms
        steps["run"] = lambda: (lay.prepared.run(ptrs, 0, cpu_gemm=lambda g: runtime._cpu_gemm(gemms[g], everything)),
                                bufs)[1]

    def path(cpp: bool):
        def call():
            if part.gemm_cpp != cpp:  # the first call after a switch prepares nothing: the layout is kept
                part.use_gemm_cpp(cpp)
            return part(*part_args)
        return call

    steps["partition python"] = path(False)
    steps["partition c++"] = path(True)
    return steps


def measure_gemm_steps(device: torch.device, host_us, batches: int, calls: int, quick: bool) -> dict:
    """graph -> {step: (median, min) host us per call}; the partition is
    left on the path it was built with."""
    from .launch import find_partition

    results = {}
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the launch bench's other rows
    try:
        for name, (fn, args) in gemm_graphs(device, quick).items():
            torch._dynamo.reset()
            compiled_fn = torch.compile(fn, backend="opfuse")
            compiled_fn(*args)
            part, part_args = find_partition(compiled_fn, args)
            built_with = part.gemm_cpp
            try:
                results[name] = host_us(gemm_step_calls(part, part_args, device), device, batches, calls)
            finally:
                part.use_gemm_cpp(built_with)
    finally:
        torch.set_num_threads(threads)
    return results
