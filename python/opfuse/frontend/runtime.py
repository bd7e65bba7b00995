"""Running a compiled partition on PyTorch tensors: the launch path."""
from __future__ import annotations

import logging

import torch

from .. import _C
from ..stats import bump
from .convert import TORCH_DTYPES

log = logging.getLogger("opfuse")


class FusedPartition:
    """Calls the kernels of one compiled partition; falls back to the
    partition's eager module for inputs it was not compiled for."""

    def __init__(self, compiled: "_C.CompiledGraph", eager: torch.fx.GraphModule, tensor_positions, input_dtypes,
                 name: str, dump=None, device=None):
        self.compiled = compiled
        self.eager = eager
        self.tensor_positions = tensor_positions  # which call arguments are tensors
        self.input_dtypes = input_dtypes
        self.name = name
        self.dump = dump
        self.device = torch.device(device or "cpu")
        self.cuda = self.device.type == "cuda"
        self.num_kernels = compiled.num_kernels
        buffers = compiled.buffers()
        self.n_inputs = sum(1 for b in buffers if b[2])
        self.out_dtypes = [TORCH_DTYPES[b[1]] for b in buffers[self.n_inputs:]]
        self.outputs = compiled.output_buffers()
        self.single = eager.graph.output_node().args[0]
        self.single = not isinstance(self.single, (tuple, list))
        self._by_layout = {}

    def _prepare(self, tensors):
        shapes = [list(t.shape) for t in tensors]
        strides = [list(t.stride()) for t in tensors]
        syms = self.compiled.bind(shapes)
        variant, compiled, hit = self.compiled.variant(shapes, strides)
        if compiled:
            bump("cache_hits" if hit else "cache_misses")
            if self.dump is not None:
                self.dump.kernel_source(self.name, variant, self.compiled.source(variant))
        out_shapes = [self.compiled.buffer_shape(self.n_inputs + i, syms) for i in range(len(self.out_dtypes))]
        return variant, syms, strides, out_shapes

    def __call__(self, *args):
        tensors = [args[i] for i in self.tensor_positions]
        for t, dt in zip(tensors, self.input_dtypes):
            if t.device.type != self.device.type or t.dtype != dt or (self.cuda and t.device.index != torch.cuda.current_device()):
                log.info("%s: input on %s/%s, compiled for %s/%s; running eagerly", self.name, t.device, t.dtype,
                         self.device, dt)
                return self.eager(*args)
        key = tuple((t.shape, t.stride()) for t in tensors)
        entry = self._by_layout.get(key)
        if entry is None:
            entry = self._by_layout[key] = self._prepare(tensors)
        variant, syms, strides, out_shapes = entry
        dev = tensors[0].device if tensors else self.device
        bufs = [torch.empty(s, dtype=d, device=dev) for s, d in zip(out_shapes, self.out_dtypes)]
        ptrs = [t.data_ptr() for t in tensors] + [b.data_ptr() for b in bufs]
        # The stream is read at every call, so the caller's stream (and CUDA
        # graph capture) is respected.
        stream = torch.cuda.current_stream(dev).cuda_stream if self.cuda else 0
        try:
            self.compiled.run(variant, syms, ptrs, strides, stream)
        except ValueError as e:  # ZeroDivisionError from integer division, as eager raises
            raise RuntimeError(str(e)) from None
        except Exception as e:
            if "ZeroDivisionError" in str(e):
                raise RuntimeError("ZeroDivisionError") from None
            raise
        bump("kernel_launches", self.num_kernels)
        everything = tensors + bufs
        outs = tuple(everything[i] for i in self.outputs)
        return outs[0] if self.single else outs
