"""Small opfuse IR graphs compiled once and run on tensors: the engine behind
opfuse.ops.{softmax, log_softmax, layer_norm, rms_norm} and their backward ops.

A graph is built with symbolic sizes (s0, s1, ...), so one compiled graph
serves every shape of its (dtype, rank, device, flags) key; the C++
CompiledGraph keeps one compiled variant per input stride signature.
"""
from __future__ import annotations

import threading
import time

import torch

from .. import _C
from ..frontend.convert import DTYPE_NAMES, TORCH_DTYPES
from ..frontend.runtime import ensure_context
from ..stats import bump, bump_time

_lock = threading.Lock()
_graphs: dict = {}


def dtype_name(dt: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dt]
    except KeyError:
        raise TypeError(f"opfuse.ops: dtype {dt} is not supported") from None


def sym_shape(rank: int, first: int = 0) -> list[str]:
    """The symbolic shape [s<first>, ..., s<first + rank - 1>]."""
    return [f"s{first + i}" for i in range(rank)]


class GraphKernel:
    """One IR graph compiled for one device (CPU, or one CUDA device)."""

    _MAX_LAYOUTS = 512

    def __init__(self, ir_text: str, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        t0 = time.perf_counter()
        self.compiled = _C.CompiledGraph(ir_text, target="cuda" if self.cuda else "cpu")
        bump_time("compile_seconds", time.perf_counter() - t0)
        bump("graphs_compiled")
        bump("kernels_compiled", self.compiled.num_kernels)
        self.ir_text = ir_text
        self.num_kernels = self.compiled.num_kernels
        buffers = self.compiled.buffers()
        self.n_inputs = sum(1 for b in buffers if b[2])
        self.out_dtypes = [TORCH_DTYPES[b[1]] for b in buffers[self.n_inputs:]]
        self.outputs = self.compiled.output_buffers()
        self._by_layout: dict = {}

    def _prepare(self, tensors):
        shapes = [list(t.shape) for t in tensors]
        strides = [list(t.stride()) for t in tensors]
        syms = self.compiled.bind(shapes)
        t0 = time.perf_counter()
        variant, compiled, hit = self.compiled.variant(shapes, strides)
        if compiled:
            bump_time("compile_seconds", time.perf_counter() - t0)
            bump("cache_hits" if hit else "cache_misses")
        out_shapes = [self.compiled.buffer_shape(self.n_inputs + i, syms) for i in range(len(self.out_dtypes))]
        views = []  # outputs that are reshapes of a buffer: views of it
        for o, b in enumerate(self.outputs):
            shape = self.compiled.output_shape(o, syms)
            views.append(None if b < self.n_inputs or shape == self.compiled.buffer_shape(b, syms) else shape)
        return variant, syms, strides, out_shapes, views

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Runs the graph; returns its outputs in graph order (fresh tensors)."""
        if self.cuda:
            ensure_context(self.device)
        key = tuple((t.shape, t.stride()) for t in tensors)
        entry = self._by_layout.get(key)
        if entry is None:
            if self.cuda:
                with torch.cuda.device(self.device):
                    entry = self._prepare(tensors)
            else:
                entry = self._prepare(tensors)
            if len(self._by_layout) >= self._MAX_LAYOUTS:
                self._by_layout.clear()
            self._by_layout[key] = entry
        variant, syms, strides, out_shapes, views = entry
        bufs = [torch.empty(s, dtype=d, device=self.device) for s, d in zip(out_shapes, self.out_dtypes)]
        ptrs = [t.data_ptr() for t in tensors] + [b.data_ptr() for b in bufs]
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.cuda else 0
        self.compiled.run(variant, syms, ptrs, strides, stream)
        bump("kernel_launches", self.num_kernels)
        everything = list(tensors) + bufs
        return [everything[i] if v is None else everything[i].view(v) for i, v in zip(self.outputs, views)]


def graph_kernel(key: tuple, device: torch.device, build) -> GraphKernel:
    """The cached GraphKernel for (key, device); build() returns the IR text on a miss."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    full = (key, device.type, device.index)
    k = _graphs.get(full)
    if k is None:
        with _lock:
            k = _graphs.get(full)
            if k is None:
                k = _graphs[full] = GraphKernel(build(), device)
    return k


def cached_graphs() -> dict:
    """(key, device type, device index) -> GraphKernel, for tests and inspection."""
    return dict(_graphs)


def check_device(*tensors):
    dev = tensors[0].device
    for t in tensors[1:]:
        if t is not None and t.device != dev:
            raise ValueError(f"opfuse.ops: all tensors must be on one device, got {dev} and {t.device}")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"opfuse.ops: device {dev} is not supported (cpu or cuda)")
    return dev
