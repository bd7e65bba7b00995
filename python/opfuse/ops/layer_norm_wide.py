"""layer_norm backward for wide rows (src/kernels/layer_norm_backward/):
dx and the weight and bias gradients from one read of dy and x, on sm_90.

The generated row kernels fold the weight and bias gradients into the dx
kernel only while a block holds a row's 2 x n float32 column partials (n <=
8192); past that the plan re-reads dy and x in a column kernel. This kernel
splits each row over a thread-block cluster instead (a fixed column slice a
CTA, partials in registers, the row sums through distributed shared memory,
R rows a cluster barrier), and a small kernel adds the clusters' partials.

`try_run` is what opfuse.ops.layer_norm_backward (and through it the graphs
whose aten.native_layer_norm_backward the frontend routes here, see
frontend/route_layer_norm_backward.py) calls first; None means "not taken"
(nothing launched, the generated kernels run). OPFUSE_LNBWD_WIDE=0 turns the
path off.
"""
from __future__ import annotations

import functools
import logging
import math
import os
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import _C
from ..knobs import count_from_env
from ..frontend.runtime import _current_device, _raw_stream, ensure_context
from ..stats import bump

log = logging.getLogger("opfuse")

_empty_cuda = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None), "_empty_strided_cuda", None) or (
    lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device="cuda"))

_ELEM = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def _columns_from_env(name: str, default: int) -> int:
    return count_from_env(name, default, "a column count")


def _line_from_env() -> int:
    return _columns_from_env("OPFUSE_LNBWD_WIDE_ABOVE", 512)


# Past 8192 columns the generated kernels cannot keep a row's partials on
# chip (they re-read dy and x: ~40% of the floor); every such row comes here.
GENERATED_MAX_COLS = 8192
# Below that, 16-bit rows wider than this line come here too. H200, bf16,
# compiled graphs, back-to-back calls at 992a87a (perf-notes, session 12),
# us, this kernel against the generated ones: 32768x2048 137 / 171,
# 65536x3584 399 / 430, 32768x4096 220 / 246, 24576x5120 309 / 471 (its
# config only 5/8 full), 16384x8192 226 / 463; and with 128-thread CTAs up
# to 1024 columns (session 13, 150f1ba, the kernel alone): 65536x576 93 /
# 186, 65536x768 105 / 178, 32768x1024 81 / 138, 32768x1280 92 / 136,
# 32768x1536 101 / 149. So from 513 columns, where the lane groups end.
# OPFUSE_LNBWD_WIDE_ABOVE (read at import) moves the line; above 8192 it
# moves nothing.
SMALL_ROWS_ABOVE = _line_from_env()
# 16-bit rows of 193 to this many columns (at most 512) come here too, to
# the lane-group variant: H200 at 3bf41ea, the rows_bwd suite, 262144x256
# 0.112 ms (85% of the floor) against 0.122; back-to-back calls, 65536x512
# 121 against 128 us, but 131072x128 118 against 57 (not routed).
# OPFUSE_LNBWD_WIDE_SHORT (read at import; 0 turns it off) moves the top.
SHORT_ROWS_ABOVE = 192
SHORT_ROWS_UP_TO = min(_columns_from_env("OPFUSE_LNBWD_WIDE_SHORT", 512), 512)


def enabled() -> bool:
    return os.environ.get("OPFUSE_LNBWD_WIDE") != "0"


@functools.lru_cache(maxsize=None)
def _sm90_index(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _sm90(device: torch.device) -> bool:
    return device.type == "cuda" and _sm90_index(device.index if device.index is not None else torch.cuda.current_device())


def shape_reason(x_shape: Sequence[int], nd: int, dtype: torch.dtype, weight_dtype, bias_dtype, mask) -> str:
    """Why the kernel does not take a problem of these shapes and dtypes
    (empty when it does), without tensors or a GPU: for the frontend's
    routing at compile time; the run-time checks (alignment, strides,
    device) come on top."""
    if dtype not in _ELEM:
        return f"dtype {dtype}"
    if weight_dtype not in (None, dtype) or bias_dtype not in (None, dtype):
        return "weight or bias of another dtype"
    if nd < 1 or nd > len(x_shape):
        return "normalized_ndim out of range"
    n = math.prod(x_shape[len(x_shape) - nd:])
    rows = math.prod(x_shape[:len(x_shape) - nd])
    short = SHORT_ROWS_ABOVE < n <= SHORT_ROWS_UP_TO and dtype != torch.float32
    if n <= GENERATED_MAX_COLS and (n <= SMALL_ROWS_ABOVE or dtype == torch.float32) and not short:
        return f"n = {n}: the generated kernels take these rows (partials on chip)"
    if rows < 1:
        return "no rows"
    if not ((mask[1] and weight_dtype is not None) or (mask[2] and bias_dtype is not None)):
        return "no weight or bias gradient asked"
    if not _C.lnbwd_wide_choose_config(_ELEM[dtype], n):
        return f"n = {n} is wider than the kernel covers"
    return ""


def _rows_view(t: Tensor, rows: int, n: int) -> Optional[Tensor]:
    try:
        v = t.view(rows, n)
    except RuntimeError:
        return None
    return v if v.stride(1) == 1 or n == 1 else None


def _tensor_key(t: Optional[Tensor]):
    return None if t is None else (t.shape, t.stride(), t.dtype)


def _layout_key(grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor],
                bias: Optional[Tensor], nd: int, mask) -> tuple:
    """What the checks of a call depend on: every tensor's sizes, strides and
    dtype (not its address), nd, the mask, the device and the routing lines
    (module constants, which tests move)."""
    return (SHORT_ROWS_ABOVE, SHORT_ROWS_UP_TO, SMALL_ROWS_ABOVE, GENERATED_MAX_COLS,
            x.shape, x.stride(), x.dtype, x.device, grad.shape, grad.stride(), grad.dtype,
            mean.shape, mean.stride(), mean.dtype, rstd.shape, rstd.stride(), rstd.dtype,
            _tensor_key(weight), _tensor_key(bias), nd, bool(mask[0]), bool(mask[1]), bool(mask[2]))


class _Layout:
    """A layout the kernel takes: what a call needs besides the pointers."""
    __slots__ = ("dt", "rows", "n", "ld_dy", "ld_x", "specs", "device", "index")

    def __init__(self, dt, rows, n, ld_dy, ld_x, x, weight, bias, want):
        self.dt, self.rows, self.n, self.ld_dy, self.ld_x = dt, rows, n, ld_dy, ld_x
        # (sizes, strides, dtype) of dx, dw and db, None where not asked: set
        # here, so a call only allocates.
        self.specs = tuple((tuple(t.shape), _contiguous(t.shape), t.dtype) if w else None
                           for t, w in zip((x, weight, bias), want))
        self.device, self.index = x.device, x.device.index


def _contiguous(size) -> tuple:
    out, acc = [], 1
    for d in reversed(size):
        out.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(out))


def _check_layout(grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor],
                  bias: Optional[Tensor], nd: int, mask):
    """The checks that depend on the layout alone (not the addresses): a
    _Layout when the kernel takes it, else why not (a string)."""
    if not x.is_cuda or not 1 <= nd <= x.dim():
        return "not CUDA, or normalized_ndim out of range"
    n = math.prod(x.shape[x.dim() - nd:])
    if n <= SHORT_ROWS_ABOVE or SHORT_ROWS_UP_TO < n <= min(GENERATED_MAX_COLS, SMALL_ROWS_ABOVE):
        return f"n = {n}: the generated kernels take these rows"
    if not _sm90(x.device):
        return "older than sm_90"
    wd = weight.dtype if weight is not None else None
    bd = bias.dtype if bias is not None else None
    if grad.dtype != x.dtype:
        return "grad of another dtype"
    why = shape_reason(tuple(x.shape), nd, x.dtype, wd, bd, mask)
    if why:
        return why
    rows = x.numel() // n
    if mean.dtype != torch.float32 or rstd.dtype != torch.float32 or mean.numel() != rows or rstd.numel() != rows:
        return "mean or rstd not float32 with one value a row"
    x2, g2 = _rows_view(x, rows, n), _rows_view(grad, rows, n)
    if x2 is None or g2 is None or not mean.is_contiguous() or not rstd.is_contiguous():
        return "x or grad not rows of unit stride, or mean or rstd not contiguous"
    if weight is not None and not weight.is_contiguous():
        return "weight not contiguous"
    want = (bool(mask[0]), bool(mask[1]) and weight is not None, bool(mask[2]) and bias is not None)
    dt = _ELEM[x.dtype]
    # Alignment is checked at each call (pointers): 16 stands in here.
    why = _C.lnbwd_wide_unsupported_reason(dt, rows, n, g2.stride(0), x2.stride(0), n, *want, weight is not None, 16)
    if why:
        return why
    return _Layout(dt, rows, n, g2.stride(0), x2.stride(0), x, weight, bias, want)


# Layout key -> _Layout, or None for a layout the kernel does not take. The
# checks above cost ~45 us of host time a call on the H200's host (session
# 13), more than the kernel at 65536x384; a layout's later calls skip them.
_layouts: dict = {}
_MAX_LAYOUTS = 256


def try_run(grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
            nd: int, mask) -> Optional[list[Tensor]]:
    """[dx, dw, db] for the asked outputs (as opfuse.ops.layer_norm_backward
    returns them), or None when the kernel does not take the problem."""
    if not x.is_cuda or not enabled():
        return None
    key = _layout_key(grad, x, mean, rstd, weight, bias, nd, mask)
    lay = _layouts.get(key, _layouts)
    if lay is _layouts:
        lay = _check_layout(grad, x, mean, rstd, weight, bias, nd, mask)
        if isinstance(lay, str):  # said once a layout: later calls find None
            log.info("opfuse: layer_norm backward of x %s %s on the generated kernels: %s",
                     tuple(x.shape), x.dtype, lay)
            lay = None
        if len(_layouts) >= _MAX_LAYOUTS:
            _layouts.clear()
        _layouts[key] = lay
    if lay is None:
        return None
    if (grad.data_ptr() | x.data_ptr() | (weight.data_ptr() if weight is not None else 0)) & 15:
        return None  # the 128-bit loads need 16-byte aligned rows
    index = lay.index
    ensure_context(lay.device)
    parts = _C.lnbwd_wide_parts(lay.dt, lay.rows, lay.n)
    if parts <= 0:
        return None
    if _current_device() == index:
        empty = _empty_cuda
    else:
        def empty(size, stride, dtype):
            return torch.empty_strided(size, stride, dtype=dtype, device=lay.device)
    dx, dw, db = (empty(*spec) if spec is not None else None for spec in lay.specs)
    ws = empty((2 * parts * lay.n,), (1,), torch.float32)
    _C.lnbwd_wide_run(lay.dt, lay.rows, lay.n, grad.data_ptr(), lay.ld_dy, x.data_ptr(), lay.ld_x, mean.data_ptr(),
                      rstd.data_ptr(), weight.data_ptr() if weight is not None else 0,
                      dx.data_ptr() if dx is not None else 0, lay.n, dw.data_ptr() if dw is not None else 0,
                      db.data_ptr() if db is not None else 0, ws.data_ptr(), ws.numel(), _raw_stream(index))
    bump("kernel_launches", 2)  # the row kernel and the column sums of both gradients
    return [t for t in (dx, dw, db) if t is not None]


def reference(grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor], nd: int = 1):
    """The C++ float64 reference (layer_norm_backward_reference.h): (dx, dw,
    db) as float64 CPU tensors, unrounded."""
    n = math.prod(x.shape[x.dim() - nd:])
    rows = x.numel() // n
    g = grad.detach().double().cpu().reshape(rows, n).contiguous()
    xx = x.detach().double().cpu().reshape(rows, n).contiguous()
    m = mean.detach().double().cpu().reshape(rows).contiguous()
    r = rstd.detach().double().cpu().reshape(rows).contiguous()
    w = weight.detach().double().cpu().reshape(n).contiguous() if weight is not None else None
    dx = torch.empty(rows, n, dtype=torch.float64)
    dw = torch.empty(n, dtype=torch.float64)
    db = torch.empty(n, dtype=torch.float64)
    _C.lnbwd_wide_reference(rows, n, g.data_ptr(), n, xx.data_ptr(), n, m.data_ptr(), r.data_ptr(),
                            w.data_ptr() if w is not None else 0, dx.data_ptr(), dw.data_ptr(), db.data_ptr())
    return dx.reshape(x.shape), dw, db


def launch_count() -> int:
    """Launches of the wide-row kernel in this process."""
    return _C.lnbwd_wide_launch_count()


def last_error() -> str:
    """Why the last instantiation could not be built or loaded (then the generated kernels ran)."""
    return _C.lnbwd_wide_last_error()
