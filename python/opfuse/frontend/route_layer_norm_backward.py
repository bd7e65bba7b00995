"""Routes aten.native_layer_norm_backward nodes of wide rows to
layer_norm_backward_wide (below: the kernel of opfuse.ops.layer_norm_backward
without the custom op's dispatch), whose wide-row kernel
(ops/layer_norm_wide.py) reads dy and x once where the generated plan reads
them twice past 8192 columns, and is faster from 193 16-bit columns too
(layer_norm_wide.shape_reason says which rows; the weight or bias gradient
asked, CUDA sm_90). The node then runs as opfuse's own op, outside the fused
partitions: its dx no longer fuses with neighbouring element-wise ops, a
trade that pays at these row lengths (the re-read costs ~0.7x the op's
whole floor). The width and dtypes are checked here from the node's fake
values (under dynamic shapes the row count may be symbolic, and the width
too: then the example's width decides); the rows, width, alignment and
strides are checked at each call, where the op falls back to the generated
kernels (the same answer)."""
from __future__ import annotations

import logging
import operator

import torch
from torch.fx.experimental.symbolic_shapes import size_hint

from ..ops import layer_norm_wide

log = logging.getLogger("opfuse")
aten = torch.ops.aten


def layer_norm_backward_wide(grad, x, mean, rstd, weight, bias, normalized_ndim: int, mask):
    """What a routed node calls: the wide-row kernel straight away, and
    opfuse.ops.layer_norm_backward (the generated kernels) for a call it does
    not take, e.g. misaligned views. Not the custom op first: its dispatch
    (autograd key, dynamo-disabled wrappers, alias checks) cost ~35 us of
    host time a call on the H200's host, where the kernel at 65536x384 takes
    ~90 (perf-notes, session 13). The graph is already AOTAutograd's
    backward: no autograd, and the frontend's guards keep the devices."""
    out = layer_norm_wide.try_run(grad, x, mean, rstd, weight, bias, normalized_ndim, mask)
    if out is None:
        out = torch.ops.opfuse.layer_norm_backward(grad, x, mean, rstd, weight, bias, normalized_ndim, mask)
    return out


layer_norm_backward_wide.opfuse_op = True  # opfuse's own kernel: the backend counts no fallback


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _width(dim, arg):
    """A normalized dim as an int: x's size if concrete, else the
    normalized_shape argument if that is, else a size hint; None if none."""
    values = (dim, _val(arg) if isinstance(arg, torch.fx.Node) else arg)
    concrete = [v for v in values if isinstance(v, int)]
    if concrete:
        return concrete[0]
    for v in values:
        if isinstance(v, torch.SymInt):
            try:
                return int(size_hint(v))
            except Exception:  # unbacked: no example value
                pass
    return None


def _reason(node) -> str:
    args = list(node.args) + [None] * (8 - len(node.args))
    grad, x, normalized_shape, mean, rstd, weight, bias, mask = args[:8]
    xv = _val(x)
    if xv is None or not isinstance(xv, torch.Tensor):
        return "no shape for the input"
    if xv.device.type != "cuda" or not torch.cuda.is_available():
        return "not on CUDA"
    if torch.cuda.get_device_capability(xv.device) < (9, 0):
        return "older than sm_90"
    nd = len(normalized_shape)
    row_dims, norm_dims = tuple(xv.shape[:xv.dim() - nd]), tuple(xv.shape[xv.dim() - nd:])
    # Dynamo's dynamic=True marks x's trailing dims symbolic too. The width
    # is then the normalized_shape argument where the model passed a
    # constant, else the example's (the size hint; normalized_shape is then
    # a SymInt, or a graph input node holding one, e.g. a closure's int):
    # the route is a choice of kernel, and try_run checks each call's width,
    # sending the ones the wide kernel does not take to the generated ones.
    norm_dims = tuple(_width(s, c) for s, c in zip(norm_dims, normalized_shape))
    if any(d is None for d in norm_dims):
        return "symbolic normalized sizes without an example value"
    # Dynamic shapes leave the row dims symbolic: the width decides, and
    # try_run checks the rows at each call. Without the route such a graph
    # gets the generated plan of symbolic sizes, which re-reads dy and x for
    # the column sums (2x the time of the concrete plan at 32768x4096,
    # perf-notes session 12), where the wide kernel beats even that one.
    shape = tuple(s if isinstance(s, int) else 1 for s in row_dims) + norm_dims
    wv, bv = _val(weight), _val(bias)
    gv = _val(grad)
    if gv is None or gv.dtype != xv.dtype:
        return "grad of another dtype"
    for u in node.users:
        if u.target is not operator.getitem:
            return "a user other than getitem"
    return layer_norm_wide.shape_reason(shape, nd, xv.dtype,
                                        wv.dtype if wv is not None else None, bv.dtype if bv is not None else None,
                                        list(mask))


def route_layer_norm_backward(gm: torch.fx.GraphModule) -> int:
    """Rewrites the qualifying nodes in place; returns how many."""
    if not layer_norm_wide.enabled():
        return 0
    routed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.native_layer_norm_backward.default:
            continue
        try:
            why = _reason(node)
        except Exception as e:  # a graph this pass does not understand stays as it is
            why = f"{type(e).__name__}: {e}"
        if why:
            log.info("opfuse: %s stays with the generated kernels: %s", node, why)
            continue
        grad, x, normalized_shape, mean, rstd, weight, bias, mask = node.args[:8]
        eff = [bool(mask[0]), bool(mask[1]) and weight is not None, bool(mask[2]) and bias is not None]
        index = {}
        for i, m in enumerate(eff):
            if m:
                index[i] = len(index)
        if any(u.args[1] not in index for u in node.users):
            continue  # a user reads an output that is not asked: leave it
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(layer_norm_backward_wide,
                                         (grad, x, mean, rstd, weight, bias, len(normalized_shape), eff))
        vals = _val(node)
        if isinstance(vals, (list, tuple)):
            new.meta["val"] = [vals[i] for i in range(3) if eff[i]]
        for u in list(node.users):
            u.args = (new, index[u.args[1]])
        gm.graph.erase_node(node)
        routed += 1
        log.info("opfuse: %s runs the wide-row layer_norm backward kernel", new)
    if routed:
        gm.graph.lint()
        gm.recompile()
    return routed
