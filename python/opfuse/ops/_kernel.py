"""Small opfuse IR graphs compiled once and run on tensors: the engine behind
opfuse.ops.{softmax, log_softmax, layer_norm, rms_norm} and their backward ops.

A graph is built with symbolic sizes (s0, s1, ...), so one compiled graph
serves every shape of its (dtype, rank, device, flags) key; the C++
CompiledGraph keeps one compiled variant per input stride signature.
"""
from __future__ import annotations

import functools
import threading
import time

import torch

from .. import _C
from ..frontend.convert import DTYPE_NAMES, TORCH_DTYPES
from ..frontend.runtime import (_allow_tf32, _current_device, _empty_strided, _layout_check, _layout_key, _raw_stream,
                                contiguous_strides, ensure_context, library_workspaces, zeroed_workspace)
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


class GraphKernel(_C.Launcher):
    """One IR graph compiled for one device (CPU, or one CUDA device).

    A call (graph inputs in order) returns the graph's outputs in graph
    order as a list of fresh tensors. It is the launch path of the
    torch.compile partitions (_C.Launcher, frontend/runtime.py): the checks of
    the 8 most recent layouts and the prepared run of the first that
    accepts, in one C++ call; other layouts come to _miss, which prepares
    them once (up to _MAX_LAYOUTS kept)."""

    _MAX_LAYOUTS = 512

    def __init__(self, ir_text: str, device: torch.device):
        cuda = device.type == "cuda"
        # On CUDA the zeroed workspace, asked by runs whose row groups exchange through it (no library calls here).
        super().__init__(cuda, None, _current_device if cuda else None, _raw_stream if cuda else None,
                         functools.partial(library_workspaces, False) if cuda else None, _allow_tf32 if cuda else None)
        self.device = device
        self.cuda = cuda
        t0 = time.perf_counter()
        self.compiled = _C.CompiledGraph(ir_text, target="cuda" if self.cuda else "cpu")
        bump_time("compile_seconds", time.perf_counter() - t0)
        bump("graphs_compiled")
        bump("kernels_compiled", self.compiled.num_kernels)
        self.ir_text = ir_text
        self.num_kernels = self.compiled.num_kernels
        buffers = self.compiled.buffers()
        self.n_inputs = sum(1 for b in buffers if b[2])
        self.in_dtypes = [TORCH_DTYPES[b[1]] for b in buffers[:self.n_inputs]]
        self.out_dtypes = [TORCH_DTYPES[b[1]] for b in buffers[self.n_inputs:]]
        self.outputs = self.compiled.output_buffers()
        self._empty = _empty_strided(device)
        self._by_layout: dict = {}  # layout key -> PreparedRun
        self.slow_calls = 0  # calls no recent layout check accepted (tests)

    def _check(self, tensors) -> None:
        """A layout's first call: the inputs this graph was built for, or a clear error."""
        if len(tensors) != self.n_inputs:
            raise TypeError(f"opfuse.ops: the graph takes {self.n_inputs} tensors, got {len(tensors)}")
        for i, (t, dt) in enumerate(zip(tensors, self.in_dtypes)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"opfuse.ops: input {i} is {type(t).__name__}, not a tensor")
            if t.dtype != dt:
                raise TypeError(f"opfuse.ops: input {i} is {t.dtype}; this kernel was built for {dt}")
            if t.device.type != self.device.type or (self.cuda and t.device.index != self.device.index):
                raise ValueError(f"opfuse.ops: input {i} is on {t.device}; this kernel was built for {self.device}")

    def _prepare(self, tensors):
        shapes = [list(t.shape) for t in tensors]
        strides = [list(t.stride()) for t in tensors]
        syms = self.compiled.bind(shapes)
        t0 = time.perf_counter()
        variant, compiled, hit = self.compiled.variant(shapes, strides)
        if compiled:
            bump_time("compile_seconds", time.perf_counter() - t0)
            bump("cache_hits" if hit else "cache_misses")
        out_specs = []
        for i, dt in enumerate(self.out_dtypes):
            size = tuple(self.compiled.buffer_shape(self.n_inputs + i, syms))
            out_specs.append((size, contiguous_strides(size), dt))
        outs = []  # outputs that are reshapes of a buffer: views of it
        for o, b in enumerate(self.outputs):
            shape = self.compiled.output_shape(o, syms)
            outs.append((b, None if b < self.n_inputs or shape == self.compiled.buffer_shape(b, syms) else tuple(shape)))
        prepared = _C.PreparedRun(self.compiled, variant, syms, strides, self.device.index if self.cuda else -1,
                                  self._empty, out_specs)
        prepared.set_result(2, outs)  # a list of the graph's outputs
        return prepared

    def _miss(self, *tensors):
        """No recent layout check accepted these inputs (called by the C++ launcher)."""
        self.slow_calls += 1
        self._check(tensors)
        key = _layout_key(tensors, False)
        prepared = self._by_layout.get(key)
        if prepared is None:
            if self.cuda:
                ensure_context(self.device)
                with torch.cuda.device(self.device):  # variant() compiles for the current context's device
                    prepared = self._prepare(tensors)
            else:
                prepared = self._prepare(tensors)
            if len(self._by_layout) >= self._MAX_LAYOUTS:
                self._by_layout.clear()
            self._by_layout[key] = prepared
        self.push(_layout_check(tensors, key, False), prepared)
        if self.cuda:
            if _current_device() != self.device.index:
                return self._other_device(*tensors)
            stream = _raw_stream(self.device.index)
            if prepared.wants_zeroed_workspace:
                zws = zeroed_workspace(self.device.index, stream)
                return prepared.finish(tensors, stream, zeroed_workspace=zws.data_ptr(), zeroed_workspace_bytes=zws.numel())
            return prepared.finish(tensors, stream)
        return prepared.finish(tensors, 0)

    def _other_device(self, *tensors):
        """The inputs are on this kernel's device, not the current one: run there."""
        with torch.cuda.device(self.device):
            return self(*tensors)


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
