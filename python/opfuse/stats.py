"""Exact counters of what opfuse compiled and ran (opfuse.stats())."""
import threading

from . import _C

_lock = threading.Lock()
_COUNTERS = ("graphs_compiled", "kernels_compiled", "kernel_launches", "library_calls", "cache_hits", "cache_misses",
             "fallback_ops")
_stats = dict.fromkeys(_COUNTERS, 0)
_stats["compile_seconds"] = 0.0  # time in opfuse's compiler (planning, codegen, compiling or loading kernels)


def bump(name: str, n: int = 1) -> None:
    with _lock:
        _stats[name] += n


def bump_launch(kernels: int, library_calls: int) -> None:
    """One partition call's launches, under one lock."""
    with _lock:
        _stats["kernel_launches"] += kernels
        _stats["library_calls"] += library_calls


def bump_time(name: str, seconds: float) -> None:
    with _lock:
        _stats[name] += seconds


def stats() -> dict:
    """graphs_compiled: opfuse partitions built; kernels_compiled: kernels in
    them; kernel_launches: opfuse kernels run (generated kernels, and GEMMs
    run by opfuse's own skinny GEMM kernel on the GPU, M <= 16); library_calls:
    GEMMs run as library calls (cuBLASLt with its fused epilogue on the GPU,
    PyTorch's matmul on the CPU); cache_hits / cache_misses:
    compiled variants found in / added to the disk cache; fallback_ops: graph
    nodes left to PyTorch (counted once per compiled graph; views, which
    cost PyTorch nothing, are not counted); compile_seconds: time spent in
    opfuse's compiler, Dynamo's and AOTAutograd's tracing excluded."""
    with _lock:
        out = dict(_stats)
    # The partitions' launch path counts in C++.
    out["kernel_launches"] += _C.launch_counts()
    out["library_calls"] += _C.library_call_counts()
    return out


def reset_stats() -> None:
    with _lock:
        for k in _COUNTERS:
            _stats[k] = 0
        _stats["compile_seconds"] = 0.0
        _C.reset_launch_counts()
