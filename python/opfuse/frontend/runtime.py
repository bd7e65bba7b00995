"""Running a compiled partition on PyTorch tensors: the launch path."""
from __future__ import annotations

import functools
import logging
import math
import os
import threading

import torch

from .. import _C
from ..stats import bump, bump_launch
from .convert import TORCH_DTYPES

log = logging.getLogger("opfuse")


_thread = threading.local()

# Private PyTorch calls that Inductor's generated code uses on its own hot
# path, each with a public fallback: the current stream as a raw handle (no
# Stream object per call), the current device without torch.cuda's Python
# layer, and allocation without the argument parser and dispatcher.
_get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_dynamo_guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
_TensorGuards = getattr(_dynamo_guards, "TensorGuards", None)
_empty_strided_cpu = getattr(_dynamo_guards, "_empty_strided_cpu", None)
_empty_strided_cuda = getattr(_dynamo_guards, "_empty_strided_cuda", None)


_raw_stream = _get_raw_stream or (lambda index: torch.cuda.current_stream(index).cuda_stream)
_current_device = _get_device or (lambda: torch.cuda.current_device())
# What torch.backends.cuda.matmul.allow_tf32 reads, without its Python __getattr__.
_allow_tf32 = getattr(torch._C, "_get_cublas_allow_tf32", None) or (lambda: torch.backends.cuda.matmul.allow_tf32)


def gemm_cpp_launch() -> bool:
    """Whether partitions with GEMM steps run from the C++ launcher (as
    kernel-only ones do) instead of Python's _miss every call.
    On by default on both devices (=0 turns it off): on the H200 it passed
    the GEMM GPU tests and took 4.5 to 33 us off a call at M = 16
    (docs/perf-notes.md, "H200, session 9")."""
    return os.environ.get("OPFUSE_GEMM_CPP_LAUNCH", "") != "0"


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


def _workspace(device: int, stream: int) -> torch.Tensor:
    """One workspace per (device index, stream), from PyTorch's allocator, kept
    for the process: GEMMs on one stream run in order, so they can share it."""
    key = (device, stream)
    ws = _workspaces.get(key)
    if ws is None:
        # Have PyTorch load its cuBLAS (and cuBLASLt) first, so that opfuse's
        # dlopen finds that copy in the process instead of loading another.
        torch.cuda.current_blas_handle()
        ws = _workspaces[key] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", device))
    return ws


_zeroed_workspaces: dict = {}


def library_workspaces(library: bool, device: int, stream: int) -> tuple:
    """(cuBLASLt's workspace or None without library calls, the zeroed
    workspace) for (device, stream): what the C++ launcher asks once per
    (device, stream) and keeps. It asks only for runs that need one of them
    (GEMM steps; row steps whose groups exchange through the zeroed one)."""
    return _workspace(device, stream) if library else None, zeroed_workspace(device, stream)


def zeroed_workspace(device: int, stream: int) -> torch.Tensor:
    """The zeroed workspace for (device index, stream): the decode MLP
    kernel's region, then the row groups' counters and slots (rows staged
    over several blocks that exchange through global memory). Zeroed once on
    that stream from PyTorch's allocator and kept for the process (every
    kernel leaves its counters at zero). One per stream, so launches on two
    streams never share counters; inside CUDA graph capture it comes from the
    graph's pool and its zeroing is captured before the kernel."""
    key = (device, stream)
    ws = _zeroed_workspaces.get(key)
    if ws is None:
        ws = _zeroed_workspaces[key] = torch.zeros(_C.zeroed_workspace_bytes(), dtype=torch.uint8,
                                                   device=torch.device("cuda", device))
    return ws


_carriers: dict = {}


def size_carrier(n: int, device) -> torch.Tensor:
    """A tensor of shape (n,) that nobody reads (one bool, stride 0): it
    takes a size symbol that only a SymInt argument carries (the row count
    of a mean's backward, whose gradient has no such dim) into a partition
    as a tensor dim, where bind_symbols finds it and the launcher's layout
    check tells one value from another. Kept per (n, device): a call makes
    no tensor."""
    key = (n, device)
    t = _carriers.get(key)
    if t is None:
        if len(_carriers) >= 4096:  # sizes seen once in a long run: start again rather than grow
            _carriers.clear()
        t = _carriers[key] = torch.zeros(1, dtype=torch.bool, device=device).expand(n)
    return t


size_carrier.opfuse_op = True  # a view of a kept tensor: the backend counts no fallback


def _empty_strided(device: torch.device):
    """(size, stride, dtype) -> a new tensor on `device`'s type, from PyTorch's
    allocator (CUDA: the current device's caching allocator, which the launch
    path has checked is the layout's device)."""
    if device.type == "cuda":
        return _empty_strided_cuda or (
            lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device="cuda"))
    return _empty_strided_cpu or (lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device="cpu"))


def _layout_key(tensors, alignment: bool) -> tuple:
    """What a compiled layout depends on: shape, strides, dtype, device (for
    cuBLASLt also 16-byte alignment)."""
    if alignment:
        return tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors)
    return tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def _layout_check(tensors, key: tuple, alignment: bool, cpp_alignment: bool = False):
    """A callable, given tensors, that is true only when they have the layout
    `key` describes (the layout of `tensors`). PyTorch's TensorGuards (what
    Dynamo's guards use) checks Python type, dispatch keys, dtype, device,
    requires_grad, sizes and strides in one C++ call; stricter than the key,
    so a tensor it rejects only takes the slow path. Where it is missing,
    the key is recomputed and compared. `cpp_alignment`: the caller checks
    the addresses modulo 16 itself (_C.Launcher.push's align), so the
    callable leaves them out where it can."""
    check = None
    if _TensorGuards is not None:
        try:
            check = _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                  dynamic_dims_strides=[list(t.stride()) for t in tensors]).check
            if not check(*tensors):
                check = None
        except Exception:  # another signature in another torch: the key below
            check = None
    if check is None:
        return lambda *ts: _layout_key(ts, alignment) == key
    if alignment and not cpp_alignment:
        align = tuple(t.data_ptr() % 16 for t in tensors)
        guard = check
        return lambda *ts: guard(*ts) and tuple(t.data_ptr() % 16 for t in ts) == align
    return check


class _Layout:
    """One input layout of a partition, prepared on its first call: all that
    a later call with the same layout needs, so it derives nothing."""

    __slots__ = ("key", "prepared", "gemms", "out_specs", "outs", "device")

    def __init__(self, key, prepared, gemms, out_specs, outs, device):
        self.key = key
        # _C.PreparedRun: variant, sizes, strides, argument blocks, grids, and
        # (set_result) what a call returns.
        self.prepared = prepared
        self.gemms = gemms  # CPU GEMM steps (PyTorch's matmul), or None
        self.out_specs = out_specs  # (sizes, strides, dtype) per buffer the partition writes
        self.outs = outs  # per graph output: (index into inputs + written buffers, view shape or None)
        self.device = device  # CUDA device index


_EAGER, _PLAIN = "eager", "plain"  # what the slow path returns when the layout is not run by opfuse
_RECENT = 8  # layout checks tried before the slow path, most recent first (as _C.Launcher's)


def _run_errors(e: Exception):
    """The exception a failed run raises, as the launch path raises it: a
    RuntimeError (integer division by zero as eager's "ZeroDivisionError")."""
    if "ZeroDivisionError" in str(e):
        return RuntimeError("ZeroDivisionError")
    return RuntimeError(str(e)) if isinstance(e, ValueError) else e


class FusedPartition(_C.Launcher):
    """Calls the kernels of one compiled partition; falls back to the
    partition's eager module for inputs it was not compiled for.

    A call is _C.Launcher's (C++, no Python frame): the checks of the 8 most
    recent layouts, then the prepared run of the first that accepts. A call
    no check accepts comes to _miss, which finds or prepares the layout (or
    runs eagerly) and makes it the most recent. Partitions with library
    calls (GEMMs) take the same path unless gemm_cpp_launch() says no (the
    launcher also gets cuBLASLt's workspace, the TF32 setting or, on the
    CPU, PyTorch's matmul as a callback); then they run from _miss every
    time, set up in Python."""

    def __init__(self, compiled: "_C.CompiledGraph", eager: torch.fx.GraphModule, tensor_positions, input_dtypes,
                 name: str, dump=None, device=None, ir_text=None, gemm_epilogues=1):
        device = torch.device(device or "cpu")
        cuda = device.type == "cuda"
        # Every call argument a tensor, in order: the arguments are the tensors.
        n_args = len([n for n in eager.graph.nodes if n.op == "placeholder"])
        all_tensors = list(tensor_positions) == list(range(n_args))
        # Partitions with GEMM steps on the C++ launcher (gemm_cpp_launch): on
        # CUDA it asks for the workspaces once per (device, stream) and for
        # PyTorch's TF32 setting every call. Given either way, so that
        # use_gemm_cpp can switch.
        self.gemm_cpp = bool(compiled.num_library_calls) and gemm_cpp_launch()
        library = bool(compiled.num_library_calls) and cuda
        # On CUDA the workspaces always (asked only by runs that need one).
        super().__init__(cuda, None if all_tensors else list(tensor_positions),
                         _current_device if cuda else None, _raw_stream if cuda else None,
                         functools.partial(library_workspaces, library) if cuda else None,
                         _allow_tf32 if cuda else None)
        self._all_tensors = all_tensors
        self.ir_text = ir_text
        self.gemm_epilogues = gemm_epilogues  # the level `compiled` was planned with (CompiledGraph's argument)
        self.plain = None  # the same graph with fewer GEMM epilogues, built when cuBLASLt refuses one
        self.compiled = compiled
        self.eager = eager
        self.tensor_positions = tensor_positions  # which call arguments are tensors
        self.input_dtypes = input_dtypes
        self.name = name
        self.dump = dump
        self.device = device
        self.cuda = cuda
        self.num_kernels = compiled.num_kernels
        self.num_library_calls = compiled.num_library_calls
        buffers = compiled.buffers()
        self.n_inputs = sum(1 for b in buffers if b[2])
        self.out_dtypes = [TORCH_DTYPES[b[1]] for b in buffers[self.n_inputs:]]
        self.outputs = compiled.output_buffers()
        self.single = eager.graph.output_node().args[0]
        self.single = not isinstance(self.single, (tuple, list))
        self._by_layout = {}  # layout key -> _Layout
        self._recent = []  # graphs with library calls: (check, _Layout), most recent first
        self._refused = set()  # layout keys cuBLASLt refused with epilogues
        self.gemm_alignment_key = bool(self.num_library_calls and self.cuda)
        self._empty = _empty_strided(device)
        # GEMM result buffers allocated as one block (index into the written buffers), CUDA pairs.
        self.paired = [(a - self.n_inputs, b - self.n_inputs) for a, b in compiled.paired_buffers()]
        self.slow_calls = 0  # calls that missed every recent layout check (tests, inspection)

    def _prepare(self, tensors, key=None) -> _Layout:
        shapes = [list(t.shape) for t in tensors]
        strides = [list(t.stride()) for t in tensors]
        # Itself, or (a cat part empty at these sizes) the graph compiled with
        # that size fixed, whose written buffers may differ: taken from it.
        cg = self.compiled.for_sizes(shapes)
        out_dtypes, outputs = self.out_dtypes, self.outputs
        if cg is not self.compiled:
            out_dtypes = [TORCH_DTYPES[b[1]] for b in cg.buffers()[self.n_inputs:]]
            outputs = cg.output_buffers()
        syms = cg.bind(shapes)
        variant, compiled, hit = cg.variant(shapes, strides)
        if compiled:
            bump("cache_hits" if hit else "cache_misses")
            if self.dump is not None:
                self.dump.kernel_source(self.name, variant, cg.source(variant))
        device = None
        if self.cuda:
            device = tensors[0].device.index if tensors else None
            if device is None:
                device = _current_device()
        gemms = cg.gemms(syms) if self.num_library_calls and not self.cuda else None
        out_specs = []
        for i, dt in enumerate(out_dtypes):
            size = tuple(cg.buffer_shape(self.n_inputs + i, syms))
            out_specs.append((size, contiguous_strides(size), dt))
        prepared = _C.PreparedRun(cg, variant, syms, strides, -1 if device is None else device,
                                  self._empty, out_specs)
        # Outputs that are reshapes of a buffer are views of it (no copy kernel).
        outs = []
        for o, b in enumerate(outputs):
            shape = cg.output_shape(o, syms)
            outs.append((b, None if b < self.n_inputs or shape == cg.buffer_shape(b, syms) else tuple(shape)))
        prepared.set_result(0 if self.single else 1, outs)
        if self.num_library_calls:
            prepared.set_library([_pair_block(first, second, out_specs) for first, second in self.paired],
                                 functools.partial(_cpu_gemm_step, gemms) if gemms is not None else None)
        return _Layout(key, prepared, gemms, out_specs, outs, device)

    def prepare_layout(self, example) -> None:
        """Compiles and prepares the layout of `example` (tensors, fake ones
        too) before the first call."""
        key = _layout_key(example, False)
        if self.cuda:
            # At compile time too: AOTAutograd compiles the backward lazily on
            # autograd's device thread, which has no driver context before its
            # first CUDA op; variant() would then fail and the partition fall
            # back to eager (seen on the H200 as a first backward that dumped
            # no plan).
            ensure_context(example[0].device if example and example[0].device.index is not None else self.device)
        self._by_layout[key] = self._prepare(example, key)

    def layout_of(self, tensors):
        """The prepared layout these tensors would run with, or None (bench, tests)."""
        return self._by_layout.get(_layout_key(tensors, self.gemm_alignment_key))

    def _check_inputs(self, tensors) -> bool:
        """First call with a layout: are the inputs on the compiled device and dtypes?"""
        for t, dt in zip(tensors, self.input_dtypes):
            if t.device.type != self.device.type or t.dtype != dt:
                log.info("%s: input on %s/%s, compiled for %s/%s; running eagerly", self.name, t.device, t.dtype,
                         self.device, dt)
                return False
        return True

    def _layout(self, tensors):
        """The slow path, for inputs no recent layout check accepts: the
        layout by key (checked and prepared on its first call), made the
        most recent; or _EAGER / _PLAIN."""
        self.slow_calls += 1
        key = _layout_key(tensors, self.gemm_alignment_key)
        lay = self._by_layout.get(key)
        if lay is None:
            if key in self._refused:
                return _PLAIN
            if not self._check_inputs(tensors):
                return _EAGER
            if self.num_library_calls and self.compiled.empty_part_symbols([list(t.shape) for t in tensors]):
                # _prepare's graph for these sizes (for_sizes) may pair its GEMM
                # results otherwise than self.paired says: not taken here.
                log.info("%s: a cat part is empty at these sizes in a graph with library calls; running eagerly",
                         self.name)
                return _EAGER
            if self.cuda and tensors:
                ensure_context(tensors[0].device)  # variant() compiles for the current context's device
            lay = self._by_layout[key] = self._prepare(tensors, key)
        lay.key = key
        if self.num_library_calls and not self.gemm_cpp:
            self._recent.insert(0, (_layout_check(tensors, key, self.gemm_alignment_key), lay))
            del self._recent[_RECENT:]
        else:
            # cuBLASLt's alignment (CUDA GEMM partitions) checked in C++ on the pointers the launch reads anyway.
            align = [t.data_ptr() % 16 for t in tensors] if self.gemm_alignment_key else None
            self.push(_layout_check(tensors, key, self.gemm_alignment_key, cpp_alignment=True), lay.prepared, align)
        return lay

    def use_gemm_cpp(self, on: bool) -> None:
        """Runs this partition's GEMM layouts from the C++ launcher (on) or
        from Python's _miss (off) from the next call on (bench, tests)."""
        if self.num_library_calls:
            self.gemm_cpp = on
            self.clear_recent()
            self._recent = []

    def _forget(self, lay: _Layout) -> None:
        self._by_layout.pop(lay.key, None)
        self._recent = [r for r in self._recent if r[1] is not lay]
        self.forget(lay.prepared)

    def _tensors(self, args):
        return args if self._all_tensors else [args[i] for i in self.tensor_positions]

    def _miss(self, *args):
        """A call no recent layout check of the C++ launcher accepted (every
        call of a partition with library calls off the C++ path, gemm_cpp)."""
        tensors = self._tensors(args)
        if self.num_library_calls and not self.gemm_cpp:
            for check, lay in self._recent:
                if check(*tensors):
                    break
            else:
                lay = self._layout(tensors)
        else:
            lay = self._layout(tensors)
        if lay is _EAGER:
            return self.eager(*args)
        if lay is _PLAIN:
            return self.plain(*args)
        if self.cuda:
            if lay.device != _current_device():
                return self._other_device(*args)
            stream = _raw_stream(lay.device)
        else:
            stream = 0
        if self.gemm_cpp:
            return self.launch(lay.prepared, args)  # as a call the launcher's check accepted
        try:
            if not self.num_library_calls:
                if lay.prepared.wants_zeroed_workspace:
                    zws = zeroed_workspace(lay.device, stream)
                    return lay.prepared.finish(tensors, stream, zeroed_workspace=zws.data_ptr(),
                                               zeroed_workspace_bytes=zws.numel())
                return lay.prepared.finish(tensors, stream)  # counts its launches
            bufs = self._run_with_library_calls(lay, tensors, stream)
        except _C.GemmUnsupported as e:
            self._forget(lay)
            return self._gemm_fallback(lay.key, args, str(e))
        except Exception as e:
            err = _run_errors(e)
            if err is e:
                raise
            raise err from None
        everything = [*tensors, *bufs]
        outs = tuple(everything[i] if v is None else everything[i].view(v) for i, v in lay.outs)
        return outs[0] if self.single else outs

    def _gemm_refused(self, prepared, reason: str, args: tuple):
        """The C++ launcher's GemmUnsupported for a layout (cuBLASLt refused
        one of its GEMMs): as _miss's, the layout is forgotten and the call
        goes to _gemm_fallback."""
        lay = next((lay for lay in self._by_layout.values() if lay.prepared is prepared), None)
        if lay is None:  # forgotten meanwhile (another thread): only the call falls back
            self.forget(prepared)
            return self._gemm_fallback(None, args, reason)
        self._forget(lay)
        return self._gemm_fallback(lay.key, args, reason)

    def _other_device(self, *args):
        """The inputs' layout is prepared for another CUDA device than the current one."""
        log.info("%s: the current device is %d, not the inputs' device; running eagerly", self.name, _current_device())
        return self.eager(*args)

    def _written_buffers(self, lay: _Layout) -> list:
        """The buffers a run with library calls writes, from the allocator
        (Python's _miss path; the C++ launcher's does the same)."""
        empty = self._empty
        bufs = [None] * len(lay.out_specs)
        for first, second in self.paired:
            _, _, block_spec, view0, view1 = _pair_block(first, second, lay.out_specs)
            block = empty(*block_spec)
            bufs[first], bufs[second] = block.as_strided(*view0), block.as_strided(*view1)
        return [b if b is not None else empty(*spec) for b, spec in zip(bufs, lay.out_specs)]

    def _run_with_library_calls(self, lay: _Layout, tensors, stream: int) -> list:
        """A graph with GEMM steps: cuBLASLt's workspace and TF32 setting on
        the GPU, PyTorch's matmul on the CPU; returns the written buffers."""
        bufs = self._written_buffers(lay)
        ptrs = [t.data_ptr() for t in tensors]
        ptrs += [b.data_ptr() for b in bufs]
        if self.cuda:
            zws = zeroed_workspace(lay.device, stream)
            gemm_kernels, merged, folded = lay.prepared.run(
                ptrs, stream, _workspace(lay.device, stream).data_ptr(), WORKSPACE_BYTES,
                torch.backends.cuda.matmul.allow_tf32, zeroed_workspace=zws.data_ptr(), zeroed_workspace_bytes=zws.numel())
        else:
            everything = [*tensors, *bufs]
            gemms = lay.gemms
            gemm_kernels, merged, folded = lay.prepared.run(ptrs, stream,
                                                            cpu_gemm=lambda g: _cpu_gemm(gemms[g], everything))
        # GEMM steps that ran as opfuse's skinny GEMM kernel are kernel launches, not library calls;
        # those that ran inside a paired step's batched call are neither; generated kernels a GEMM
        # took in (the skinny GEMM reading Llama's gate) did not run.
        bump_launch(self.num_kernels + gemm_kernels - folded, self.num_library_calls - gemm_kernels - merged)
        return bufs

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


def _cpu_gemm_step(gemms, g: int, everything) -> None:
    """The C++ launcher's CPU GEMM callback (PreparedRun.set_library): step g."""
    _cpu_gemm(gemms[g], everything)


def _pair_block(first: int, second: int, out_specs) -> tuple:
    """Two GEMM results in one block, the second at the next 256-byte
    boundary (CompiledGraph.paired_buffers): one batched call computes both.
    As PreparedRun.set_library takes it: (first, second, the block's
    (sizes, strides, dtype), each result's (sizes, strides, storage offset))."""
    size, strides, dt = out_specs[first]
    n = math.prod(size)
    per = -(-n * dt.itemsize // 256) * 256 // dt.itemsize
    return first, second, ((2 * per,), (1,), dt), (size, strides, 0), (size, strides, per)


def contiguous_strides(size: tuple) -> tuple:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))
