"""The torch.compile backend: AOTAutograd gives core-ATen forward and
backward graphs; supported nodes are partitioned from unsupported ones,
each partition is converted to the IR, planned, generated and compiled by
the C++ core, and the rest stays with PyTorch."""
from __future__ import annotations

import functools
import logging
import operator
import os
import time

import torch
from torch._decomp import core_aten_decompositions
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from .. import _C
from ..stats import bump, bump_time
from . import convert
from .dump import from_env
from .attention_pattern import fuse_attention
from .route_layer_norm_backward import route_layer_norm_backward
from .runtime import FusedPartition, size_carrier

log = logging.getLogger("opfuse")
aten = torch.ops.aten

# Ops that only move or alias data: a partition of these alone is not worth
# a kernel (PyTorch does them as views, without a copy).
VIEW_ONLY = {aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten.permute, aten.transpose, aten.t,
             aten.squeeze, aten.unsqueeze, aten.slice, aten.select, aten.alias}


def _packet(target):
    return getattr(target, "overloadpacket", target)


# (CompositeImplicitAutograd registrations, table): see _decompositions.
_decomposition_cache: tuple = (-1, {})


def _decompositions():
    """The decomposition table AOTAutograd traces with (read-only). Building
    it walks every CompositeImplicitAutograd operator (30-110 ms on the
    development VM, each graph: it was two thirds of opfuse's share of a
    warm compile), so it is built once, and again only when
    CompositeImplicitAutograd kernels have been registered since (a library
    loaded later brings its own; other ops, which torch registers lazily
    now and then, leave the table as it was)."""
    global _decomposition_cache
    registered = len(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd"))
    if _decomposition_cache[0] != registered:
        _decomposition_cache = (registered, _build_decompositions())
    return _decomposition_cache[1]


def _build_decompositions():
    # Core ATen decompositions, except the ops opfuse maps to its own
    # composite or elementwise ops; addmm is split so its bias add fuses
    # with what follows.
    table = dict(core_aten_decompositions())
    # gelu_backward stays one op: the planner gives it to the GEMM that
    # computes its gradient input (cuBLASLt's DGELU epilogue).
    for op in (aten.native_layer_norm_backward.default, aten._softmax_backward_data.default,
               aten._log_softmax_backward_data.default, aten.gelu_backward.default):
        table.pop(op, None)
    # The CPU flash-attention op's decomposition covers its forward only: with
    # it, AOTAutograd saves the wrong tensors for its backward (wrong
    # gradients in float32, a dtype error under autocast). Inductor leaves it
    # out of its table for the same reason; PyTorch runs it whole.
    table.pop(aten._scaled_dot_product_flash_attention_for_cpu.default, None)

    def addmm(bias, a, b, beta=1, alpha=1):
        out = torch.mm(a, b)
        if alpha != 1:
            out = out * alpha
        return out + (bias * beta if beta != 1 else bias)

    table[aten.addmm.default] = addmm
    return table


class Report:
    """What one compilation did (collected by opfuse.explain)."""

    def __init__(self):
        self.kernels = []
        self.fallbacks = []
        self.fused_nodes = 0
        self.attention = []  # attention_pattern.Candidate per softmax / SDPA seen


_active_reports: list = []


def _record_fallback(op, reason):
    for r in _active_reports:
        r.fallbacks.append((op, reason))


def _supported_tensor(val):
    return isinstance(val, torch.Tensor) and val.dtype in convert.DTYPE_NAMES and val.device.type in ("cpu", "cuda")


class _Support(OperatorSupportBase):
    def is_node_supported(self, submodules, node) -> bool:
        if node.op != "call_function":
            return False
        if _view_for_gemm_from_outside(node, self):
            return False
        if node.target is operator.getitem:
            return isinstance(node.args[0], torch.fx.Node) and self.is_node_supported(submodules, node.args[0])
        if node.target not in convert.HANDLERS and _packet(node.target) not in convert.HANDLERS:
            return False
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        return all(v is None or _supported_tensor(v) for v in vals) and val is not None


def _constant_fill(node) -> bool:
    """A node that makes a tensor without reading one (full, scalar_tensor)."""
    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    reads = [a for a in list(node.args) + list(node.kwargs.values()) for a in (a if isinstance(a, (list, tuple)) else [a])]
    return not any(isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) for a in reads)


def _feeds_gemm(node) -> bool:
    """A view some GEMM reads, directly or through more views."""
    for u in node.users:
        if _packet(u.target) in convert.GEMM_OPS:
            return True
        if _packet(u.target) in VIEW_ONLY and _feeds_gemm(u):
            return True
    return False


def _transpose_read_by_gemms(node) -> bool:
    """A swap of the last two dims of a tensor (not of another view) that
    only GEMMs read. Inside the partition it costs nothing either (the
    planner makes it the call's transpose flag and reads the tensor in
    place), and there the planner sees which tensor the GEMM reads
    transposed: a weight-gradient GEMM of dy^T @ x then also computes the
    bias gradient sum(dy, 0) (BGRADB) instead of leaving it to a kernel."""
    if _packet(node.target) != aten.permute or not node.users or len(node.args) < 2:
        return False
    src = node.args[0]
    if not isinstance(src, torch.fx.Node) or (src.op == "call_function" and _packet(src.target) in VIEW_ONLY):
        return False
    r = len(node.args[1])
    if r < 2 or [d % r for d in node.args[1]] != list(range(r - 2)) + [r - 1, r - 2]:
        return False
    return all(u.op == "call_function" and _packet(u.target) in convert.GEMM_OPS for u in node.users)


def _view_for_gemm_from_outside(node, support) -> bool:
    """A view of something computed outside opfuse (a graph input, a weight,
    an unsupported op) that a GEMM reads: left to PyTorch, where it is free,
    so the GEMM gets it as an input and reads it in place through its
    strides. Inside the partition it would cost a copy kernel (a transpose
    that only GEMMs read costs none: see _transpose_read_by_gemms)."""
    if _packet(node.target) not in VIEW_ONLY or _transpose_read_by_gemms(node):
        return False
    root = node
    while root.op == "call_function" and _packet(root.target) in VIEW_ONLY and root.args and isinstance(root.args[0], torch.fx.Node):
        root = root.args[0]
    outside = root.op != "call_function" or not support.is_node_supported(None, root)
    return outside and _feeds_gemm(node)


def _trim_view_tails(partition) -> None:
    """Leaves views whose users are all outside the partition to PyTorch:
    there they are free (a view), inside they would be a copy kernel."""
    changed = True
    while changed:
        changed = False
        for node in list(partition.nodes):
            is_view = _packet(node.target) in VIEW_ONLY or (
                node.target is operator.getitem and _packet(node.args[0].target) in VIEW_ONLY)
            if is_view and node.users and all(u not in partition.nodes for u in node.users):
                del partition.nodes[node]
                changed = True


class _FusedModule(torch.nn.Module):
    """A partition in the fused GraphModule (its registered submodule, for
    printing and inspection). The generated code does not call it: it finds
    the FusedPartition itself (a C++ callable, _C.Launcher) in the
    GraphModule's instance dict, with no Python frame between (see
    _compile_aten_graph)."""

    def __init__(self, fused: FusedPartition):
        super().__init__()
        self.fused = fused

    def forward(self, *args):
        return self.fused(*args)

    def __call__(self, *args):
        return self.fused(*args)


def _add_size_carriers(gm: torch.fx.GraphModule, call: torch.fx.Node, sub: torch.fx.GraphModule) -> None:
    """A size symbol that is no tensor input's dim (a cat's backward: the
    gradient is [s0 + s1], and slicing it needs s0 itself; mean's backward
    divides by the rows it summed, a SymInt argument) could not be bound
    by the compiled graph from its inputs' shapes. Each such symbol that
    the graph has as a SymInt input gets a carrier: an argument
    size_carrier(s, device) of shape (s,) that the partition takes as one
    more tensor input (never read)."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    tensors = [n for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)]
    if not tensors:
        return
    # (in the sizes conversion writes: guarded equalities applied)
    expr = convert.canonical_expr
    carried = {expr(d) for n in tensors for d in n.meta["val"].shape if isinstance(d, torch.SymInt) and expr(d).is_Symbol}
    needed = set()
    for n in placeholders:
        val = n.meta.get("val")
        sizes = list(val.shape) if isinstance(val, torch.Tensor) else [val]
        for d in sizes:
            if isinstance(d, torch.SymInt):
                needed |= expr(d).free_symbols
    # Where the graph has each symbol by itself: its SymInt inputs.
    sources = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.SymInt) and expr(val).is_Symbol:
            sources.setdefault(expr(val), n)
    first = tensors[0].meta["val"]
    for symbol in sorted(needed - carried, key=str):
        source = sources.get(symbol)
        if source is None:
            continue  # the compiled graph names the symbol it cannot bind, and the partition falls back
        val = source.meta["val"]
        with first.fake_mode:
            fake = torch.empty_strided((val,), (0,), dtype=torch.bool, device=first.device)
        with sub.graph.inserting_after(placeholders[-1]):
            holder = sub.graph.placeholder(f"size_carrier_{symbol}")
        holder.meta["val"] = fake
        placeholders.append(holder)
        with gm.graph.inserting_before(call):
            arg = gm.graph.call_function(size_carrier, (source, first.device))
        arg.meta["val"] = fake
        call.args = (*call.args, arg)
    sub.recompile()


def _compile_partition(sub: torch.fx.GraphModule, name: str, dump):
    ir_text, tensor_nodes = convert.convert_graph(sub)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    positions = [placeholders.index(n) for n in tensor_nodes]
    dtypes = [n.meta["val"].dtype for n in tensor_nodes]
    devices = {n.meta["val"].device for n in tensor_nodes}
    if len(devices) > 1:
        raise convert.Unsupported(f"inputs on several devices: {sorted(map(str, devices))}")
    device = devices.pop() if devices else torch.device("cpu")
    compiled = _C.CompiledGraph(ir_text, target=device.type)
    fused = FusedPartition(compiled, sub, positions, dtypes, name, dump, device, ir_text)
    # Compile the variant for the recorded strides now, not on the first call.
    example = [n.meta["val"] for n in tensor_nodes]
    if compiled.num_library_calls and device.type == "cuda":
        pass  # the layout key holds pointer alignment too: prepared on the first call
    elif all(isinstance(s, int) for t in example for s in list(t.shape) + list(t.stride())):
        fused.prepare_layout(example)
    if dump is not None:
        sizes = [[s if isinstance(s, int) else 7 for s in t.shape] for t in example]
        dump.partition(name, ir_text, compiled, sizes)
    return fused, compiled


def compile_aten_graph(gm: torch.fx.GraphModule, example_inputs, phase: str = "forward"):
    start = time.perf_counter()
    try:
        return _compile_aten_graph(gm, example_inputs, phase)
    finally:
        bump_time("compile_seconds", time.perf_counter() - start)


def _compile_aten_graph(gm: torch.fx.GraphModule, example_inputs, phase: str):
    dump = from_env()
    tag = dump.new_name(phase) if dump else phase
    if dump is not None:
        dump.write(f"{tag}.aten.py", gm.code)
    try:
        route_layer_norm_backward(gm)
    except Exception as e:  # the generated kernels take the node as before
        log.warning("opfuse: layer_norm backward routing failed, graph left as it is: %s: %s", type(e).__name__, e)
    partitioner = CapabilityBasedPartitioner(gm, _Support(), allows_single_node_partition=True)
    partitions = partitioner.propose_partitions()
    for p in partitions:
        _trim_view_tails(p)
    # Partitions of views alone, or of constant fills alone (full,
    # scalar_tensor: nothing to fuse, and their sizes may be SymInt
    # arguments no tensor of the partition binds), stay with PyTorch.
    partitions = [p for p in partitions
                  if any(n.target is not operator.getitem and _packet(n.target) not in VIEW_ONLY
                         and not _constant_fill(n) for n in p.nodes)]
    fused_gm = partitioner.fuse_partitions(partitions) if partitions else gm

    for node in list(fused_gm.graph.nodes):
        if node.op != "call_module" or not node.target.startswith("fused_"):
            continue
        sub = getattr(fused_gm, node.target)
        name = f"{tag}_{node.target}"
        try:
            _add_size_carriers(fused_gm, node, sub)
            fused, compiled = _compile_partition(sub, name, dump)
        except Exception as e:  # any failure: this partition runs eagerly
            reason = f"{type(e).__name__}: {e}"
            log.warning("opfuse: partition %s falls back to eager: %s", name, reason)
            for n in sub.graph.nodes:
                if n.op == "call_function" and n.target is not operator.getitem:
                    bump("fallback_ops")
                    _record_fallback(str(n.target), reason)
            continue
        module = _FusedModule(fused)
        setattr(fused_gm, node.target, module)
        # The partition itself in the instance dict, where the generated
        # code's `self.fused_N` finds it before nn.Module.__getattr__: the
        # call goes straight to the C++ launch path, without the module's
        # Python frame.
        fused_gm.__dict__[node.target] = fused
        bump("graphs_compiled")
        bump("kernels_compiled", compiled.num_kernels)
        n_ops = sum(1 for n in sub.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
        for r in _active_reports:
            r.fused_nodes += n_ops
            for k in compiled.kernels():
                r.kernels.append(dict(k, partition=name))
        log.info("opfuse: %s: %d ops -> %d kernels", name, n_ops, compiled.num_kernels)

    for node in fused_gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            if _packet(node.target) in VIEW_ONLY:
                continue  # a view costs PyTorch nothing: not a fallback
            if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
                continue  # arithmetic on sizes (sym_float(n), 2.0 / n): Python's, no kernel
            if _constant_fill(node):
                continue  # a fill alone: PyTorch's one launch, nothing opfuse would fuse it with
            if str(node.target).startswith("opfuse.") or getattr(node.target, "opfuse_op", False):
                continue  # opfuse's own fused ops (attention, routed layer_norm backward): not a fallback
            bump("fallback_ops")
            reason = "not supported by opfuse" if not _Support().is_node_supported(None, node) else "alone: a view"
            _record_fallback(str(node.target), reason)
    fused_gm.recompile()
    # A lazy GraphModule's forward stays a trampoline (recompile check, then
    # nn.Module.__call__) for as long as it is held: generate the code now
    # and hand AOTAutograd the generated forward itself, with a boxed
    # argument list as AOTAutograd calls compiled graphs.
    real_recompile = getattr(fused_gm, "real_recompile", None)
    if real_recompile is not None:
        real_recompile()
    return make_boxed_func(fused_gm.forward)


def opfuse_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """torch.compile(model, backend="opfuse")."""
    if os.environ.get("OPFUSE_DISABLE") == "1":
        log.info("opfuse: OPFUSE_DISABLE=1, running the graph eagerly")
        return gm.forward
    # Attention written out (or SDPA, when asked) becomes opfuse.ops.attention
    # before AOTAutograd, so the backward is the fused op's, not the pattern's.
    try:
        candidates = fuse_attention(gm)
    except Exception as e:  # a failed rewrite leaves the graph as Dynamo gave it
        log.warning("opfuse: attention pattern pass failed, graph left as it is: %s: %s", type(e).__name__, e)
        candidates = []
    for c in candidates:
        log.info("opfuse: attention at %s (%s): %s", c.node, c.kind, ("fused: " if c.fused else "not fused: ") + c.reason)
        for r in _active_reports:
            r.attention.append(c)
    return aot_autograd(
        fw_compiler=functools.partial(compile_aten_graph, phase="forward"),
        bw_compiler=functools.partial(compile_aten_graph, phase="backward"),
        inference_compiler=functools.partial(compile_aten_graph, phase="inference"),
        decompositions=_decompositions(),
    )(gm, example_inputs)


def compile(model_or_fn=None, **options):
    """opfuse.compile(fn) is torch.compile(fn, backend="opfuse")."""
    if model_or_fn is None:
        return lambda m: compile(m, **options)
    return torch.compile(model_or_fn, backend="opfuse", **options)
