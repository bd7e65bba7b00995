"""softmax, log_softmax, layer_norm, rms_norm as torch custom ops.

Each forward is one fused opfuse kernel (a Row kernel of the C++ planner),
generated and compiled for the input's (dtype, rank, device, flags) once and
cached; the backward ops are opfuse kernels too (softmax_backward,
log_softmax_backward, layer_norm_backward + the weight/bias reductions,
rms_norm_backward + the weight reduction). The norms' statistics (mean, rstd)
are outputs of the forward kernel, saved for the backward, which therefore
does not recompute them.

Custom ops (namespace "opfuse"), as torch.ops.opfuse.<name>:
  softmax(Tensor x, int dim) -> Tensor
  softmax_backward(Tensor grad, Tensor y, int dim) -> Tensor
  log_softmax(Tensor x, int dim) -> Tensor
  log_softmax_backward(Tensor grad, Tensor y, int dim) -> Tensor
  layer_norm(Tensor x, int normalized_ndim, Tensor? weight, Tensor? bias, float eps) -> (y, mean, rstd)
  layer_norm_backward(grad, x, mean, rstd, weight?, bias?, int normalized_ndim, bool[3] output_mask) -> Tensor[]
  rms_norm(Tensor x, int normalized_ndim, Tensor? weight, float eps) -> (y, rstd)
  rms_norm_backward(grad, x, rstd, weight?, int normalized_ndim, bool[2] output_mask) -> Tensor[]
The statistics keep the normalised dims as size 1 (as aten.native_layer_norm)
and are float32 for float32/bfloat16/float16 inputs, float64 for float64.
"""
from __future__ import annotations

import os
import threading
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import _C
from ..knobs import count_from_env
from . import layer_norm_wide
from ._kernel import check_device, dtype_name, graph_kernel, sym_shape

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _disabled() -> bool:
    return os.environ.get("OPFUSE_DISABLE") == "1"


# The backward graphs' weight and bias gradients are column sums over the
# rows. With symbolic sizes the planner gives them a kernel of their own that
# reads dy and x again; with the sizes known it folds them into the dx kernel
# as column partials (plus one small kernel a gradient), as in graphs that
# torch.compile hands over. H200, bf16, the op with symbolic sizes against a
# compiled graph: 32768x4096 517 against 246 us, 262144x256 2658 against 124
# (perf-notes, session 12). So on CUDA these graphs are built for the
# concrete shape, up to this many shapes per op variant (each is an NVRTC
# compile, cached on disk); shapes past that share the symbolic graph.
# OPFUSE_NORM_BWD_SHAPES sets the bound (0: always the symbolic graph).
def _shapes_from_env() -> int:
    return count_from_env("OPFUSE_NORM_BWD_SHAPES", 16, "a count of shapes")


MAX_SHAPES_SPECIALIZED = _shapes_from_env()
_specialized: dict = {}
_specialized_lock = threading.Lock()


def _column_sum_dims(key: tuple, x: Tensor, columns_asked: bool) -> Optional[tuple]:
    """x's sizes, when the backward graph of `key` should be built for them
    (CUDA, a weight or bias gradient asked); None for the symbolic graph."""
    if not (columns_asked and x.is_cuda and x.numel() > 0):
        return None
    dims = tuple(int(d) for d in x.shape)
    with _specialized_lock:
        seen = _specialized.setdefault((key, x.device), set())
        if dims in seen:
            return dims
        if len(seen) >= MAX_SHAPES_SPECIALIZED:
            return None
        seen.add(dims)
    return dims


def _shape_of(rank: int, dims: Optional[tuple]) -> list[str]:
    return [str(d) for d in dims] if dims is not None else sym_shape(rank)


def _stat_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.float64 if dt == torch.float64 else torch.float32


def _check_float(name, x):
    if not isinstance(x, Tensor):
        raise TypeError(f"opfuse.ops.{name}: expected a tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"opfuse.ops.{name}: needs a float16/bfloat16/float32/float64 tensor, got {x.dtype}")


def _norm_dim(dim: int, rank: int) -> int:
    r = max(rank, 1)
    if not -r <= dim < r:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-r}, {r - 1}], but got {dim})")
    return dim % r


# ---------------------------------------------------------------------------
# Graph builders (IR text for one key)
# ---------------------------------------------------------------------------


def _softmax_graph(op: str, dt: str, rank: int, dim: int) -> str:
    g = _C.GraphBuilder()
    x = g.input("x", dt, sym_shape(rank))
    g.set_outputs([g.add(op, [x], {"dim": dim})])
    return g.text()


def _softmax_backward_graph(op: str, dt: str, rank: int, dim: int) -> str:
    g = _C.GraphBuilder()
    dy = g.input("grad", dt, sym_shape(rank))
    y = g.input("y", dt, sym_shape(rank))
    g.set_outputs([g.add(op, [dy, y], {"dim": dim})])
    return g.text()


def _layer_norm_graph(dt: str, rank: int, nd: int, wdt: Optional[str], bdt: Optional[str], eps: float) -> str:
    g = _C.GraphBuilder()
    x = g.input("x", dt, sym_shape(rank))
    norm_shape = sym_shape(rank)[rank - nd:]
    ins = [x]
    if wdt is not None:
        ins.append(g.input("weight", wdt, norm_shape))
    if bdt is not None:
        b = g.input("bias", bdt, norm_shape)
        if wdt is None:  # layer_norm takes (x[, w[, b]]): a weight of ones keeps one rounding at the end
            ins.append(g.add("full", [], {"shape": ("shape", norm_shape), "value": 1.0, "dtype": ("dtype", bdt)}))
        ins.append(b)
    attrs = {"normalized_ndim": nd, "eps": float(eps)}
    y = g.add("layer_norm", ins, attrs)
    mean = g.add("layer_norm_stats", [x], dict(attrs, which="mean"))
    rstd = g.add("layer_norm_stats", [x], dict(attrs, which="rstd"))
    g.set_outputs([y, mean, rstd])
    return g.text()


def _wide(g, i):
    return g.add("cast", [i], {"dtype": ("dtype", "f32")}) if g.dtype(i) in ("f16", "bf16") else i


def _reduce_batch(g, x, rank: int, nd: int, out_dtype: str):
    """Sums over the leading (batch) dims and casts to out_dtype."""
    batch = list(range(rank - nd))
    if not batch and g.dtype(x) == out_dtype:
        return g.add("copy", [x])  # never return an input buffer (custom op outputs must not alias inputs)
    r = g.add("sum", [x], {"dims": batch, "keepdim": False}) if batch else x
    return r if g.dtype(r) == out_dtype else g.add("cast", [r], {"dtype": ("dtype", out_dtype)})


def _layer_norm_backward_graph(dt: str, st: str, rank: int, nd: int, wdt: Optional[str], bdt: Optional[str],
                               mask: tuple, dims: Optional[tuple] = None) -> str:
    g = _C.GraphBuilder()
    shape = _shape_of(rank, dims)
    stat_shape = shape[:rank - nd] + ["1"] * nd
    dy = g.input("grad", dt, shape)
    x = g.input("x", dt, shape)
    mean = g.input("mean", st, stat_shape)
    rstd = g.input("rstd", st, stat_shape)
    w = g.input("weight", wdt, shape[rank - nd:]) if wdt is not None else None
    outs = []
    if mask[0]:
        outs.append(g.add("layer_norm_backward", [dy, x, mean, rstd] + ([w] if w is not None else []),
                          {"normalized_ndim": nd}))
    if mask[1]:
        xhat = g.add("mul", [g.add("sub", [_wide(g, x), _wide(g, mean)]), _wide(g, rstd)])
        outs.append(_reduce_batch(g, g.add("mul", [_wide(g, dy), xhat]), rank, nd, wdt))
    if mask[2]:
        outs.append(_reduce_batch(g, _wide(g, dy), rank, nd, bdt))
    g.set_outputs(outs)
    return g.text()


def _rms_norm_graph(dt: str, rank: int, nd: int, wdt: Optional[str], eps: float) -> str:
    g = _C.GraphBuilder()
    x = g.input("x", dt, sym_shape(rank))
    ins = [x] + ([g.input("weight", wdt, sym_shape(rank)[rank - nd:])] if wdt is not None else [])
    attrs = {"normalized_ndim": nd, "eps": float(eps)}
    y = g.add("rms_norm", ins, attrs)
    rstd = g.add("rms_norm_rstd", [x], attrs)
    g.set_outputs([y, rstd])
    return g.text()


def _rms_norm_backward_graph(dt: str, st: str, rank: int, nd: int, wdt: Optional[str], mask: tuple,
                             dims: Optional[tuple] = None) -> str:
    g = _C.GraphBuilder()
    shape = _shape_of(rank, dims)
    dy = g.input("grad", dt, shape)
    x = g.input("x", dt, shape)
    rstd = g.input("rstd", st, shape[:rank - nd] + ["1"] * nd)
    w = g.input("weight", wdt, shape[rank - nd:]) if wdt is not None else None
    outs = []
    if mask[0]:
        outs.append(g.add("rms_norm_backward", [dy, x, rstd] + ([w] if w is not None else []), {"normalized_ndim": nd}))
    if mask[1]:
        xhat = g.add("mul", [_wide(g, x), _wide(g, rstd)])
        outs.append(_reduce_batch(g, g.add("mul", [_wide(g, dy), xhat]), rank, nd, wdt))
    g.set_outputs(outs)
    return g.text()


def _dn(t: Optional[Tensor]) -> Optional[str]:
    return None if t is None else dtype_name(t.dtype)


# ---------------------------------------------------------------------------
# softmax / log_softmax
# ---------------------------------------------------------------------------


def _run_softmax(op: str, x: Tensor, dim: int) -> Tensor:
    check_device(x)
    if x.dim() == 0:
        return _run_softmax(op, x.reshape(1), 0).reshape(())
    d = _norm_dim(dim, x.dim())
    k = graph_kernel((op, x.dtype, x.dim(), d), x.device, lambda: _softmax_graph(op, dtype_name(x.dtype), x.dim(), d))
    return k(x)[0]


def _run_softmax_backward(op: str, grad: Tensor, y: Tensor, dim: int) -> Tensor:
    check_device(grad, y)
    if grad.dtype != y.dtype:
        grad = grad.to(y.dtype)
    if y.dim() == 0:
        return _run_softmax_backward(op, grad.reshape(1), y.reshape(1), 0).reshape(())
    d = _norm_dim(dim, y.dim())
    k = graph_kernel((op + "_backward", y.dtype, y.dim(), d), y.device,
                     lambda: _softmax_backward_graph(op + "_backward", dtype_name(y.dtype), y.dim(), d))
    return k(grad, y)[0]


def _define_softmax_ops(op: str, eager, eager_backward) -> None:
    """Registers opfuse::<op> and opfuse::<op>_backward (op: softmax or
    log_softmax) as custom ops with fake implementations and autograd; with
    opfuse disabled they run `eager` / `eager_backward` (PyTorch's)."""

    @torch.library.custom_op(f"opfuse::{op}", mutates_args=())
    def forward(x: Tensor, dim: int) -> Tensor:
        if _disabled():
            return eager(x, dim)
        return _run_softmax(op, x, dim)

    @forward.register_fake
    def _(x, dim):
        _norm_dim(dim, x.dim())
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.custom_op(f"opfuse::{op}_backward", mutates_args=())
    def backward(grad: Tensor, y: Tensor, dim: int) -> Tensor:
        if _disabled():
            return eager_backward(grad, y, dim, y.dtype)
        return _run_softmax_backward(op, grad, y, dim)

    @backward.register_fake
    def _(grad, y, dim):
        return torch.empty_like(y, memory_format=torch.contiguous_format)

    def setup(ctx, inputs, output):
        ctx.dim = inputs[1]
        ctx.save_for_backward(output)

    def grad_of(ctx, grad):
        (y,) = ctx.saved_tensors
        return backward(grad, y, ctx.dim), None

    forward.register_autograd(grad_of, setup_context=setup)


_define_softmax_ops("softmax", torch.softmax, torch._softmax_backward_data)
_define_softmax_ops("log_softmax", torch.log_softmax, torch._log_softmax_backward_data)


def softmax(x: Tensor, dim: int) -> Tensor:
    """softmax(x, dim) as one fused opfuse kernel (float32 arithmetic for half
    inputs, as PyTorch); differentiable (backward: one opfuse kernel)."""
    _check_float("softmax", x)
    return torch.ops.opfuse.softmax(x, dim)


def log_softmax(x: Tensor, dim: int) -> Tensor:
    """log_softmax(x, dim) as one fused opfuse kernel; differentiable."""
    _check_float("log_softmax", x)
    return torch.ops.opfuse.log_softmax(x, dim)


# ---------------------------------------------------------------------------
# layer_norm
# ---------------------------------------------------------------------------


def _check_norm_args(name, x, nd, weight, bias=None):
    if not 1 <= nd <= x.dim():
        raise ValueError(f"opfuse.ops.{name}: normalized_shape must have between 1 and {x.dim()} dims, got {nd}")
    want = tuple(x.shape[x.dim() - nd:])
    for what, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            _check_float(name, t)
            if tuple(t.shape) != want:
                raise ValueError(f"opfuse.ops.{name}: {what} of shape {tuple(t.shape)} does not match "
                                 f"normalized_shape {want}")


def _stat_shape(x: Tensor, nd: int):
    return tuple(x.shape[:x.dim() - nd]) + (1,) * nd


@torch.library.custom_op("opfuse::layer_norm", mutates_args=())
def _layer_norm_op(x: Tensor, normalized_ndim: int, weight: Optional[Tensor], bias: Optional[Tensor],
                   eps: float) -> tuple[Tensor, Tensor, Tensor]:
    check_device(x, weight, bias)
    nd = normalized_ndim
    _check_norm_args("layer_norm", x, nd, weight, bias)
    if _disabled():
        y, mean, rstd = torch.native_layer_norm(x, x.shape[x.dim() - nd:], weight, bias, eps)
        st = _stat_dtype(x.dtype)
        return y, mean.to(st).reshape(_stat_shape(x, nd)), rstd.to(st).reshape(_stat_shape(x, nd))
    key = ("layer_norm", x.dtype, x.dim(), nd, _dn(weight), _dn(bias), float(eps))
    k = graph_kernel(key, x.device, lambda: _layer_norm_graph(dtype_name(x.dtype), x.dim(), nd, _dn(weight), _dn(bias), eps))
    y, mean, rstd = k(*[t for t in (x, weight, bias) if t is not None])
    return y, mean, rstd


@_layer_norm_op.register_fake
def _(x, normalized_ndim, weight, bias, eps):
    _check_norm_args("layer_norm", x, normalized_ndim, weight, bias)
    st = _stat_dtype(x.dtype)
    shape = _stat_shape(x, normalized_ndim)
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(shape, dtype=st),
            x.new_empty(shape, dtype=st))


@torch.library.custom_op("opfuse::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor],
                            bias: Optional[Tensor], normalized_ndim: int, output_mask: list[bool]) -> list[Tensor]:
    check_device(grad, x, mean, rstd, weight, bias)
    nd = normalized_ndim
    mask = (bool(output_mask[0]), bool(output_mask[1]) and weight is not None, bool(output_mask[2]) and bias is not None)
    if not any(mask):
        return []
    if grad.dtype != x.dtype:
        grad = grad.to(x.dtype)
    if _disabled():
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            grad, x, x.shape[x.dim() - nd:], mean, rstd, weight, bias, list(mask))
        return [t for t, m in zip((dx, dw, db), mask) if m]
    if grad.is_cuda:
        wide = layer_norm_wide.try_run(grad, x, mean, rstd, weight, bias, nd, mask)
        if wide is not None:
            return wide
    key = ("layer_norm_backward", x.dtype, mean.dtype, x.dim(), nd, _dn(weight), _dn(bias), mask)
    dims = _column_sum_dims(key, x, mask[1] or mask[2])
    k = graph_kernel(key + (dims,), x.device, lambda: _layer_norm_backward_graph(
        dtype_name(x.dtype), dtype_name(mean.dtype), x.dim(), nd, _dn(weight), _dn(bias), mask, dims))
    return k(*[t for t in (grad, x, mean, rstd, weight) if t is not None])


@_layer_norm_backward_op.register_fake
def _(grad, x, mean, rstd, weight, bias, normalized_ndim, output_mask):
    out = []
    if output_mask[0]:
        out.append(torch.empty_like(x, memory_format=torch.contiguous_format))
    if output_mask[1] and weight is not None:
        out.append(torch.empty_like(weight, memory_format=torch.contiguous_format))
    if output_mask[2] and bias is not None:
        out.append(torch.empty_like(bias, memory_format=torch.contiguous_format))
    return out


def _layer_norm_setup(ctx, inputs, output):
    x, nd, weight, bias, eps = inputs
    y, mean, rstd = output
    ctx.nd = nd
    ctx.has_w, ctx.has_b = weight is not None, bias is not None
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, mean, rstd, weight, bias)


def _layer_norm_bw(ctx, grad, _gmean, _grstd):
    x, mean, rstd, weight, bias = ctx.saved_tensors
    need = ctx.needs_input_grad
    mask = [need[0], need[2] and ctx.has_w, need[3] and ctx.has_b]
    grads = iter(torch.ops.opfuse.layer_norm_backward(grad, x, mean, rstd, weight, bias, ctx.nd, mask))
    dx = next(grads) if mask[0] else None
    dw = next(grads) if mask[1] else None
    db = next(grads) if mask[2] else None
    return dx, None, dw, db, None


_layer_norm_op.register_autograd(_layer_norm_bw, setup_context=_layer_norm_setup)


def _normalized_ndim(name: str, x: Tensor, normalized_shape) -> int:
    if isinstance(normalized_shape, (int, torch.SymInt)):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(normalized_shape)
    nd = len(normalized_shape)
    if not 1 <= nd <= x.dim() or tuple(x.shape[x.dim() - nd:]) != normalized_shape:
        raise ValueError(f"opfuse.ops.{name}: normalized_shape {list(normalized_shape)} does not match the last dims "
                         f"of an input of shape {list(x.shape)}")
    return nd


def layer_norm(x: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor] = None,
               bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """F.layer_norm as one fused opfuse kernel that also stores the mean and
    rstd for the backward (torch.ops.opfuse.layer_norm returns all three)."""
    _check_float("layer_norm", x)
    nd = _normalized_ndim("layer_norm", x, normalized_shape)
    return torch.ops.opfuse.layer_norm(x, nd, weight, bias, float(eps))[0]


# ---------------------------------------------------------------------------
# rms_norm
# ---------------------------------------------------------------------------


@torch.library.custom_op("opfuse::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, normalized_ndim: int, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    check_device(x, weight)
    nd = normalized_ndim
    _check_norm_args("rms_norm", x, nd, weight)
    if _disabled():
        st = _stat_dtype(x.dtype)
        dims = list(range(x.dim() - nd, x.dim()))
        rstd = torch.rsqrt(x.to(st).pow(2).mean(dims, keepdim=True) + eps)
        y = x.to(st) * rstd
        if weight is not None:
            y = y * weight.to(st)
        return y.to(x.dtype), rstd
    key = ("rms_norm", x.dtype, x.dim(), nd, _dn(weight), float(eps))
    k = graph_kernel(key, x.device, lambda: _rms_norm_graph(dtype_name(x.dtype), x.dim(), nd, _dn(weight), eps))
    y, rstd = k(*[t for t in (x, weight) if t is not None])
    return y, rstd


@_rms_norm_op.register_fake
def _(x, normalized_ndim, weight, eps):
    _check_norm_args("rms_norm", x, normalized_ndim, weight)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(_stat_shape(x, normalized_ndim), dtype=_stat_dtype(x.dtype)))


@torch.library.custom_op("opfuse::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(grad: Tensor, x: Tensor, rstd: Tensor, weight: Optional[Tensor], normalized_ndim: int,
                          output_mask: list[bool]) -> list[Tensor]:
    check_device(grad, x, rstd, weight)
    nd = normalized_ndim
    mask = (bool(output_mask[0]), bool(output_mask[1]) and weight is not None)
    if not any(mask):
        return []
    if grad.dtype != x.dtype:
        grad = grad.to(x.dtype)
    if _disabled():
        st = rstd.dtype
        dims = list(range(x.dim() - nd, x.dim()))
        xhat = x.to(st) * rstd
        g = grad.to(st) * (weight.to(st) if weight is not None else 1)
        out = []
        if mask[0]:
            out.append((rstd * (g - xhat * (g * xhat).mean(dims, keepdim=True))).to(x.dtype))
        if mask[1]:
            out.append((grad.to(st) * xhat).sum(list(range(x.dim() - nd))).to(weight.dtype))
        return out
    key = ("rms_norm_backward", x.dtype, rstd.dtype, x.dim(), nd, _dn(weight), mask)
    dims = _column_sum_dims(key, x, mask[1])
    k = graph_kernel(key + (dims,), x.device, lambda: _rms_norm_backward_graph(
        dtype_name(x.dtype), dtype_name(rstd.dtype), x.dim(), nd, _dn(weight), mask, dims))
    return k(*[t for t in (grad, x, rstd, weight) if t is not None])


@_rms_norm_backward_op.register_fake
def _(grad, x, rstd, weight, normalized_ndim, output_mask):
    out = []
    if output_mask[0]:
        out.append(torch.empty_like(x, memory_format=torch.contiguous_format))
    if output_mask[1] and weight is not None:
        out.append(torch.empty_like(weight, memory_format=torch.contiguous_format))
    return out


def _rms_norm_setup(ctx, inputs, output):
    x, nd, weight, eps = inputs
    y, rstd = output
    ctx.nd = nd
    ctx.has_w = weight is not None
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, rstd, weight)


def _rms_norm_bw(ctx, grad, _grstd):
    x, rstd, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    mask = [need[0], need[2] and ctx.has_w]
    grads = iter(torch.ops.opfuse.rms_norm_backward(grad, x, rstd, weight, ctx.nd, mask))
    dx = next(grads) if mask[0] else None
    dw = next(grads) if mask[1] else None
    return dx, None, dw, None


_rms_norm_op.register_autograd(_rms_norm_bw, setup_context=_rms_norm_setup)


def rms_norm(x: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor] = None,
             eps: Optional[float] = None) -> Tensor:
    """F.rms_norm as one fused opfuse kernel that also stores rstd for the
    backward (torch.ops.opfuse.rms_norm returns both). eps=None takes
    torch.finfo(x.dtype).eps, as PyTorch."""
    _check_float("rms_norm", x)
    nd = _normalized_ndim("rms_norm", x, normalized_shape)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return torch.ops.opfuse.rms_norm(x, nd, weight, float(eps))[0]
