"""Helpers shared by the tests, the fuzzer and OPFUSE_DUMP repros: run an IR
graph through opfuse's CPU kernels and through the float64 oracle."""
from __future__ import annotations

import logging
import re

import numpy as np
import torch

from . import _C
from .frontend.convert import TORCH_DTYPES


def _input_specs(ir_text):
    specs = []
    for line in ir_text.splitlines():
        line = line.strip()
        if "= input()" in line:
            ty = line.rsplit(":", 1)[1].strip()
            dt, rest = ty.split("[", 1)
            specs.append((dt, [d.strip() for d in rest.rstrip("]").split(",") if d.strip()]))
    return specs


def random_inputs(ir_text, sizes, generator=None):
    """Random tensors for the graph's inputs; `sizes` gives each input's shape."""
    g = generator or torch.Generator().manual_seed(0)
    out = []
    for (dt, _), shape in zip(_input_specs(ir_text), sizes):
        dtype = TORCH_DTYPES[dt]
        if dtype == torch.bool:
            out.append(torch.rand(shape, generator=g) > 0.5)
        elif dtype in (torch.int32, torch.int64):
            out.append(torch.randint(-20, 20, shape, generator=g, dtype=dtype))
        else:
            out.append(torch.randn(shape, generator=g, dtype=torch.float64).to(dtype))
    return out


def same_layout_on(t: torch.Tensor, device) -> torch.Tensor:
    """t's values in the same layout (sizes, strides, storage offset, so
    the same alignment of its first element) on `device`."""
    n = t.untyped_storage().nbytes() // t.element_size()
    whole = torch.as_strided(t, (n,), (1,), 0).to(device)  # the whole storage, in order
    return torch.as_strided(whole, t.shape, t.stride(), t.storage_offset())


def run_compiled(compiled, inputs):
    """Runs a _C.CompiledGraph on CPU tensors (a graph compiled for the CPU)
    or CUDA tensors (compiled with target="cuda": the current stream, then
    a synchronisation); returns its outputs."""
    shapes = [list(t.shape) for t in inputs]
    strides = [list(t.stride()) for t in inputs]
    cuda = bool(inputs) and inputs[0].is_cuda
    device = inputs[0].device if inputs else torch.device("cpu")
    if cuda:
        from .frontend.runtime import ensure_context, zeroed_workspace
        ensure_context(device)
    compiled = compiled.for_sizes(shapes)  # itself, unless a cat part is empty at these sizes
    syms = compiled.bind(shapes)
    variant, _, _ = compiled.variant(shapes, strides)
    buffers = compiled.buffers()
    n_in = sum(1 for b in buffers if b[2])
    bufs = []
    for i, b in enumerate(buffers[n_in:]):
        t = torch.empty(compiled.buffer_shape(n_in + i, syms), dtype=TORCH_DTYPES[b[1]], device=device)
        if t.is_floating_point():
            t.fill_(float("nan"))  # poisoned: an unwritten element fails the comparison
        bufs.append(t)
    ptrs = [t.data_ptr() for t in inputs] + [b.data_ptr() for b in bufs]
    if cuda:
        stream = torch.cuda.current_stream(device).cuda_stream
        zws = zeroed_workspace(device.index if device.index is not None else torch.cuda.current_device(), stream)
        compiled.run(variant, syms, ptrs, strides, stream, zeroed_workspace=zws.data_ptr(),
                     zeroed_workspace_bytes=zws.numel())
        torch.cuda.synchronize(device)
    else:
        compiled.run(variant, syms, ptrs, strides)
    everything = list(inputs) + bufs
    return [everything[i].view(compiled.output_shape(o, syms)) for o, i in enumerate(compiled.output_buffers())]


def oracle(ir_text, inputs):
    outs = _C.evaluate(ir_text, [np.ascontiguousarray(t.to(torch.float64).numpy()) for t in inputs])
    return [torch.from_numpy(np.array(a)).to(TORCH_DTYPES[dt]) if dt != "f64" else torch.from_numpy(np.array(a))
            for dt, a in outs]


def check_ir_against_oracle(ir_text, sizes, rtol=None, atol=None):
    inputs = random_inputs(ir_text, sizes)
    got = run_compiled(_C.CompiledGraph(ir_text), inputs)
    want = oracle(ir_text, inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)


def contiguous_strides(shapes):
    """Row-major element strides of each shape (for compile-only tests that
    pass shapes and strides without tensors)."""
    out = []
    for s in shapes:
        st, acc = [], 1
        for d in reversed(s):
            st.insert(0, acc)
            acc *= d
        out.append(st)
    return out


class DDPBucketLog(logging.Handler):
    """Catches Dynamo's DDPOptimizer line 'created N buckets' (the DDP test's
    worker and bench/ddp_gpt2.py count how a model was split)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.buckets = []

    def emit(self, record):
        m = re.search(r"created (\d+) buckets", record.getMessage())
        if m:
            self.buckets.append(int(m.group(1)))

    @classmethod
    def attach(cls) -> "DDPBucketLog":
        """A new log, listening to DDPOptimizer's logger at INFO."""
        log = cls()
        ddp_log = logging.getLogger("torch._dynamo.backends.distributed")
        ddp_log.addHandler(log)
        ddp_log.setLevel(logging.INFO)
        return log


class OpfuseLog(logging.Handler):
    """The opfuse logger's INFO messages while entered (`with OpfuseLog() as
    log: ...; log.messages`). Not pytest's caplog: the GPU scripts run pytest
    with -p no:logging."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logger = logging.getLogger("opfuse")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        logger = logging.getLogger("opfuse")
        logger.removeHandler(self)
        logger.setLevel(self._level)


def ptxas_report(log):
    """{entry function: (registers, spill-store bytes)} from NVRTC's
    `--ptxas-options=-v` log (compile_cuda's third result)."""
    out, name = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and name:
            out[name] = (out.get(name, (None, 0))[0], int(m.group(1)))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out[name] = (int(m.group(1)), out.get(name, (None, 0))[1])
    return out
