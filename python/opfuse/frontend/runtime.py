"""Running a compiled partition on PyTorch tensors: the launch path."""
from __future__ import annotations

import logging
import threading

import torch

from .. import _C
from ..stats import bump, bump_launch
from .convert import TORCH_DTYPES

log = logging.getLogger("opfuse")


_thread = threading.local()

# PyTorch's current stream as a raw handle: the private call Inductor's
# generated code uses (no Stream object built per call), else the public one.
_get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(index: int) -> int:
    if _get_raw_stream is not None:
        return _get_raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def ensure_context(device: torch.device) -> None:
    """The CUDA context current on this thread (once per thread and device):
    autograd's backward threads may have none for the driver API."""
    done = getattr(_thread, "devices", None)
    if done is None:
        done = _thread.devices = set()
    if device.index not in done:
        _C.ensure_cuda_context(device.index if device.index is not None else torch.cuda.current_device())
        done.add(device.index)


# cuBLASLt's workspace (PyTorch gives cuBLAS 32 MiB on Hopper as well).
WORKSPACE_BYTES = 32 * 1024 * 1024
_workspaces: dict = {}


def _workspace(device: torch.device, stream: int) -> torch.Tensor:
    """One workspace per (device, stream), from PyTorch's allocator, kept for
    the process: GEMMs on one stream run in order, so they can share it."""
    key = (device.index, stream)
    ws = _workspaces.get(key)
    if ws is None:
        # Have PyTorch load its cuBLAS (and cuBLASLt) first, so that opfuse's
        # dlopen finds that copy in the process instead of loading another.
        torch.cuda.current_blas_handle()
        ws = _workspaces[key] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return ws


class FusedPartition:
    """Calls the kernels of one compiled partition; falls back to the
    partition's eager module for inputs it was not compiled for."""

    def __init__(self, compiled: "_C.CompiledGraph", eager: torch.fx.GraphModule, tensor_positions, input_dtypes,
                 name: str, dump=None, device=None, ir_text=None, gemm_epilogues=2):
        self.ir_text = ir_text
        self.gemm_epilogues = gemm_epilogues  # the level `compiled` was planned with (CompiledGraph's argument)
        self.plain = None  # the same graph with fewer GEMM epilogues, built when cuBLASLt refuses one
        self.compiled = compiled
        self.eager = eager
        self.tensor_positions = tensor_positions  # which call arguments are tensors
        self.input_dtypes = input_dtypes
        self.name = name
        self.dump = dump
        self.device = torch.device(device or "cpu")
        self.cuda = self.device.type == "cuda"
        self.num_kernels = compiled.num_kernels
        self.num_library_calls = compiled.num_library_calls
        buffers = compiled.buffers()
        self.n_inputs = sum(1 for b in buffers if b[2])
        self.out_dtypes = [TORCH_DTYPES[b[1]] for b in buffers[self.n_inputs:]]
        self.outputs = compiled.output_buffers()
        self.single = eager.graph.output_node().args[0]
        self.single = not isinstance(self.single, (tuple, list))
        self._by_layout = {}
        self._refused = set()  # layout keys cuBLASLt refused with epilogues
        self.gemm_alignment_key = bool(self.num_library_calls and self.cuda)

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
        gemms = self.compiled.gemms(syms) if self.num_library_calls and not self.cuda else None
        # Outputs that are reshapes of a buffer are views of it (no copy kernel).
        views = []
        for o, b in enumerate(self.outputs):
            shape = self.compiled.output_shape(o, syms)
            views.append(None if b < self.n_inputs or shape == self.compiled.buffer_shape(b, syms) else shape)
        return variant, syms, strides, out_shapes, gemms, views

    @staticmethod
    def _cpu_gemm(spec, everything):
        """A GEMM step on the CPU: PyTorch's matmul straight into the output
        buffer (the planner leaves its epilogue to the next kernel)."""
        def operand(key):
            buf, shape, transposed = spec[key]
            t = everything[buf]
            if list(t.shape) != shape:
                t = t.view(shape)  # a realized buffer is contiguous: any reshape is a view
            return t.transpose(-1, -2) if transposed else t
        torch.matmul(operand("a"), operand("b"), out=everything[spec["out"]])

    def _check_inputs(self, tensors) -> bool:
        """First call with a layout: are the inputs on the compiled device and dtypes?"""
        for t, dt in zip(tensors, self.input_dtypes):
            if t.device.type != self.device.type or t.dtype != dt:
                log.info("%s: input on %s/%s, compiled for %s/%s; running eagerly", self.name, t.device, t.dtype,
                         self.device, dt)
                return False
        return True

    def __call__(self, *args):
        # The hot path: one dict lookup keyed by the inputs' layout (shape,
        # stride, dtype, device; for cuBLASLt also 16-byte alignment), whose
        # entry was checked and prepared on the first call with that layout.
        tensors = [args[i] for i in self.tensor_positions]
        if self.gemm_alignment_key:
            key = tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors)
        else:
            key = tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)
        entry = self._by_layout.get(key)
        if entry is None:
            if key in self._refused:
                return self.plain(*args)
            if not self._check_inputs(tensors):
                return self.eager(*args)
            entry = self._by_layout[key] = self._prepare(tensors)
        variant, syms, strides, out_shapes, gemms, views = entry
        if self.cuda:
            dev = tensors[0].device if tensors else torch.device("cuda", torch.cuda.current_device())
            if dev.index != torch.cuda.current_device():
                log.info("%s: inputs on %s but the current device is %d; running eagerly", self.name, dev,
                         torch.cuda.current_device())
                return self.eager(*args)
            ensure_context(dev)
            # The stream is read at every call, so the caller's stream (and
            # CUDA graph capture) is respected.
            stream = _raw_stream(dev.index)
        else:
            dev, stream = self.device, 0
        bufs = [torch.empty(s, dtype=d, device=dev) for s, d in zip(out_shapes, self.out_dtypes)]
        ptrs = [t.data_ptr() for t in tensors] + [b.data_ptr() for b in bufs]
        everything = tensors + bufs
        gemm_kernels = 0  # GEMM steps that ran as opfuse's skinny GEMM kernel, not as library calls
        try:
            if not self.num_library_calls:
                self.compiled.run(variant, syms, ptrs, strides, stream)
            elif self.cuda:
                gemm_kernels = self.compiled.run(variant, syms, ptrs, strides, stream,
                                                 workspace=_workspace(dev, stream).data_ptr(),
                                                 workspace_bytes=WORKSPACE_BYTES,
                                                 allow_tf32=torch.backends.cuda.matmul.allow_tf32)
            else:
                self.compiled.run(variant, syms, ptrs, strides, stream,
                                  cpu_gemm=lambda g: self._cpu_gemm(gemms[g], everything))
        except _C.GemmUnsupported as e:
            del self._by_layout[key]
            return self._gemm_fallback(key, args, str(e))
        except ValueError as e:  # ZeroDivisionError from integer division, as eager raises
            raise RuntimeError(str(e)) from None
        except Exception as e:
            if "ZeroDivisionError" in str(e):
                raise RuntimeError("ZeroDivisionError") from None
            raise
        bump_launch(self.num_kernels + gemm_kernels, self.num_library_calls - gemm_kernels)
        outs = tuple(everything[i] if v is None else everything[i].view(v) for i, v in zip(self.outputs, views))
        return outs[0] if self.single else outs

    def _gemm_fallback(self, key, args, reason):
        """cuBLASLt refused a GEMM with its epilogue (a layout, alignment or
        dtype it does not take): this input layout runs the same graph
        planned with fewer epilogues from now on: first without float32
        biases beside 16-bit GEMMs (autocast's; their casts become kernels),
        then without epilogues (plain GEMMs, the epilogues in generated
        kernels); where even a plain GEMM is refused, the partition runs
        eagerly."""
        if self.ir_text is None or self.compiled.target != "cuda" or self.gemm_epilogues <= 0:
            log.info("%s: %s; running eagerly", self.name, reason)
            return self.eager(*args)
        if self.plain is None:
            level = self.gemm_epilogues - 1
            fewer = _C.CompiledGraph(self.ir_text, target="cuda", gemm_epilogues=level)
            if level > 0 and fewer.plan_text() == self.compiled.plan_text():  # that level changes nothing here
                level = 0
                fewer = _C.CompiledGraph(self.ir_text, target="cuda", gemm_epilogues=0)
            self.plain = FusedPartition(fewer, self.eager, self.tensor_positions, self.input_dtypes,
                                        f"{self.name}_epilogues{level}", self.dump, self.device,
                                        self.ir_text, gemm_epilogues=level)
        self._refused.add(key)
        log.info("%s: %s; this layout uses %s from now on", self.name, reason,
                 "plain GEMMs with the epilogue in generated kernels" if self.plain.gemm_epilogues == 0 else
                 "GEMM epilogues without float32 biases (their casts in generated kernels)")
        return self.plain(*args)
