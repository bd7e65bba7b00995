"""FX (core ATen) subgraph -> opfuse graph IR.

Each ATen op maps to one or a few IR ops. Node types are inferred by the C++
op rules; where PyTorch's recorded dtype differs (some ATen ops keep a
different output dtype), a cast is added, and a shape that differs is an
error, so the partition falls back to eager rather than run wrongly.
"""
from __future__ import annotations

import math
import operator
import threading

import torch

from .. import _C

aten = torch.ops.aten
prims = torch.ops.prims

DTYPE_NAMES = {
    torch.bool: "b8", torch.int32: "i32", torch.int64: "i64", torch.float16: "f16",
    torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64",
}
TORCH_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


class Unsupported(Exception):
    """The node (or a value it needs) cannot be expressed in the IR."""


def dtype_name(dt: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dt]
    except KeyError:
        raise Unsupported(f"dtype {dt} is not supported") from None


_equalities_cache: dict = {}  # id(ShapeEnv) -> (ShapeEnv, guards seen, {symbol: expression})


def _guarded_equalities(env) -> dict:
    """{symbol: expression} from the ShapeEnv's guards Eq(a, b) where a side
    is a plain symbol PyTorch kept (it replaces only what it can solve:
    x[1::2] * w guards Eq(s0//2, s1) and keeps s1). The graph runs only
    where Dynamo's guards hold, so the symbol may become the expression:
    then w is [s0//2] in the IR like x[1::2], kernels and shape checks see
    one size, and bind_symbols checks w against it."""
    import sympy

    cached = _equalities_cache.get(id(env))
    if cached is not None and cached[0] is env and cached[1] == len(env.guards):
        return cached[2]
    subs: dict = {}
    for guard in env.guards:
        e = guard.expr
        if not isinstance(e, sympy.Eq):
            continue
        a, b = e.lhs.xreplace(subs), e.rhs.xreplace(subs)
        # Two symbols: the later name becomes the earlier, so the choice does not depend on the guards' order.
        if a.is_Symbol and b.is_Symbol:
            a, b = sorted((a, b), key=str)
        for sym, other in ((b, a), (a, b)):
            if sym.is_Symbol and sym not in other.free_symbols:
                subs = {k: v.xreplace({sym: other}) for k, v in subs.items()}
                subs[sym] = other
                break
    _equalities_cache[id(env)] = (env, len(env.guards), subs)
    return subs


# Sizes the graph itself requires equal, which PyTorch does not guard (a
# slice_scatter's source against its slice: torch.slice_scatter(x, y, 0, 2)
# with y of its own size s1 and x of s0 gives the IR y as [s0 - 2]); set by
# convert_graph while it converts, {symbol: expression}. The IR then declares
# the input by the expression and bind_symbols checks every call's sizes
# against it, as eager checks them.
_required = threading.local()


def canonical_expr(s):
    """A SymInt's or SymFloat's expression with guarded equalities applied
    (_guarded_equalities), and those the graph requires (_required)."""
    expr = s.node.expr
    env = getattr(s.node, "shape_env", None)
    if env is None or expr.is_number:
        return expr
    subs = _guarded_equalities(env)
    expr = expr.xreplace(subs) if subs else expr
    required = getattr(_required, "subs", None)
    return expr.xreplace(required) if required else expr


class _Unify(Exception):
    """Raised mid-conversion: {symbol: expression} the graph requires; the
    conversion starts again with it (convert_graph)."""

    def __init__(self, subs):
        super().__init__(str(subs))
        self.subs = subs


def size_text(s) -> str:
    if isinstance(s, int):
        return str(s)
    if isinstance(s, torch.SymInt):
        expr = canonical_expr(s)
        if expr.is_number:
            return str(int(expr))
        text = str(expr)
        # `//` is PyTorch's FloorDiv (floor division, as the IR's); a lone
        # `/` would be a rational.
        for bad in ("floor", "Mod", "ceiling", "/", "Max", "Min", "Piecewise", "sqrt"):
            if bad in text.replace("//", ""):
                raise Unsupported(f"size expression {text} is not supported")
        return text.replace(" ", "")
    raise Unsupported(f"size {s!r} is not an integer")


def meta_val(node):
    val = node.meta.get("val")
    if val is None:
        raise Unsupported(f"{node.format_node()} has no recorded value")
    return val


class Converter:
    def __init__(self):
        self.g = _C.GraphBuilder()
        self.values: dict = {}   # fx node -> IR id, or tuple of ids

    # -- helpers ----------------------------------------------------------
    def add(self, op, inputs, **attrs):
        try:
            return self.g.add(op, list(inputs), attrs)
        except ValueError as e:
            raise Unsupported(str(e)) from None

    def scalar(self, v, like=None):
        if isinstance(v, bool):
            return self.g.scalar(float(v), "b8", True)
        if isinstance(v, int):
            return self.g.scalar(float(v), "i64", True)
        if isinstance(v, float):
            return self.g.scalar(v, "f64", True)
        raise Unsupported(f"scalar {v!r} is not a number")

    def val(self, a):
        if isinstance(a, torch.fx.Node):
            v = self.values.get(a)
            if v is None and isinstance(a.meta.get("val"), (torch.SymInt, torch.SymFloat)):
                # A size used as a number (mean's backward divides by it,
                # var's by 2.0 / sym_float(n)): scalars the run computes
                # from the inputs' sizes.
                v = self.values[a] = self.sym_scalar(a.meta["val"])
            if v is None or isinstance(v, tuple):
                raise Unsupported(f"value of {a.name} is not a tensor")
            return v
        if isinstance(a, (torch.SymInt, torch.SymFloat)) and not a.node.expr.is_number:
            return self.sym_scalar(a)
        return self.scalar(a)

    def sym_scalar(self, s):
        """IR scalars computing a SymInt or SymFloat from size symbols: an
        integer size expression is one size scalar; a float one (PyTorch's
        ToFloat, FloatTrueDiv, sums, products, reciprocals) is built of
        scalar ops over them."""
        if isinstance(s, torch.SymInt):
            try:
                return self.g.size_scalar(size_text(s))
            except Unsupported:
                pass
        return self._sympy_scalar(canonical_expr(s))

    def _sympy_scalar(self, e):
        import sympy

        name = type(e).__name__
        if e.is_Integer:
            return self.scalar(int(e))
        if e.is_Number:
            return self.scalar(float(e))
        if e.is_Symbol:
            return self.g.size_scalar(str(e))
        args = [self._sympy_scalar(a) for a in e.args] if name != "Pow" else None
        if name == "ToFloat":
            return self.add("cast", args, dtype=("dtype", "f64"))
        if name in ("FloatTrueDiv", "IntTrueDiv"):
            return self.add("div", args)
        if isinstance(e, (sympy.Add, sympy.Mul)):
            out = args[0]
            for a in args[1:]:
                out = self.add("add" if isinstance(e, sympy.Add) else "mul", [out, a])
            return out
        if name == "Pow" and e.exp.is_Integer and -4 <= int(e.exp) <= 4 and int(e.exp) != 0:
            base = self._sympy_scalar(e.base)
            out = base
            for _ in range(abs(int(e.exp)) - 1):
                out = self.add("mul", [out, base])
            return self.add("div", [self.scalar(1.0), out]) if int(e.exp) < 0 else out
        raise Unsupported(f"size expression {e} used as a number")

    def cast_to(self, i, dt: torch.dtype):
        name = dtype_name(dt)
        return i if self.g.dtype(i) == name else self.add("cast", [i], dtype=("dtype", name))

    def match(self, i, node_val):
        """Casts to the recorded dtype and checks the recorded shape."""
        i = self.cast_to(i, node_val.dtype)
        want = [_C.size_expr(size_text(s)) for s in node_val.shape]
        got = self.g.shape(i)
        if want != got:
            raise Unsupported(f"shape {got} differs from PyTorch's {want}")
        return i

    @staticmethod
    def shape_attr(val):
        return ("shape", [size_text(s) for s in val.shape])

    # -- the graph ----------------------------------------------------------
    def placeholder(self, node):
        val = meta_val(node)
        if not isinstance(val, torch.Tensor):
            return None  # a SymInt argument: sizes are taken from tensors
        if val.device.type not in ("cpu", "cuda"):
            raise Unsupported(f"device {val.device}")
        self.values[node] = self.g.input(node.name, dtype_name(val.dtype), [size_text(s) for s in val.shape])
        return self.values[node]

    def call(self, node):
        handler = HANDLERS.get(node.target)
        if handler is None and hasattr(node.target, "overloadpacket"):
            handler = HANDLERS.get(node.target.overloadpacket)
        if handler is None:
            raise Unsupported(f"no conversion for {node.target}")
        out = handler(self, node, *node.args, **node.kwargs)
        val = meta_val(node)
        if isinstance(out, tuple):
            self.values[node] = tuple(self.match(o, v) if o is not None else None for o, v in zip(out, val))
        else:
            self.values[node] = self.match(out, val)


def convert_graph(gm: torch.fx.GraphModule):
    """Returns (IR text, [placeholder nodes that are tensors], [outputs])."""
    _required.subs = {}
    try:
        for _ in range(16):  # one symbol more each time; a graph needs few
            try:
                return _convert_graph(gm)
            except _Unify as u:
                subs = {k: v.xreplace(u.subs) for k, v in _required.subs.items()}
                subs.update(u.subs)
                _required.subs = subs
        raise Unsupported("too many sizes required equal")
    finally:
        _required.subs = {}


def _convert_graph(gm: torch.fx.GraphModule):
    c = Converter()
    tensor_inputs = []
    outputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if c.placeholder(node) is not None:
                tensor_inputs.append(node)
        elif node.op == "call_function":
            if node.target is operator.getitem:
                src, idx = node.args
                c.values[node] = c.values[src][idx]
                if c.values[node] is None:
                    raise Unsupported(f"{node.name}: output {idx} of {src.name} is not computed")
            else:
                c.call(node)
        elif node.op == "output":
            outs = node.args[0]
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            for o in outs:
                if not isinstance(o, torch.fx.Node):
                    raise Unsupported("an output is not a tensor")
                outputs.append(c.val(o))
        else:
            raise Unsupported(f"{node.op} nodes are not supported")
    c.g.set_outputs(outputs)
    return c.g.text(), tensor_inputs


# -- handlers: (converter, node, *args, **kwargs) -> IR id or tuple ------------

def _binary(op):
    def h(c, node, a, b, alpha=1, **_):
        if alpha != 1:
            b = c.add("mul", [c.val(b), c.scalar(alpha)])
            return c.add(op, [c.val(a), b])
        return c.add(op, [c.val(a), c.val(b)])
    return h


def _unary(op, **attrs):
    return lambda c, node, x, *a, **k: c.add(op, [c.val(x)], **attrs)


def _div(c, node, a, b, rounding_mode=None):
    return c.add("div", [c.val(a), c.val(b)], rounding_mode=rounding_mode or "true")


def _dims(dims, rank):
    if dims is None:
        return []
    if isinstance(dims, int):
        dims = [dims]
    return [d % rank if rank else 0 for d in dims]


def _reduce(op):
    def h(c, node, x, dims=None, keepdim=False, dtype=None, **_):
        rank = len(meta_val(node.args[0]).shape)
        xi = c.val(x)
        if dtype is not None:
            xi = c.cast_to(xi, dtype)
        return c.add(op, [xi], dims=_dims(dims, rank), keepdim=bool(keepdim))
    return h


def _sum_default(c, node, x, dtype=None):
    xi = c.val(x)
    if dtype is not None:
        xi = c.cast_to(xi, dtype)
    return c.add("sum", [xi], dims=[], keepdim=False)


def _var(c, node, x, dims=None, correction=None, keepdim=False, **kw):
    if "unbiased" in kw:
        correction = 1 if kw["unbiased"] else 0
    rank = len(meta_val(x).shape)
    corr = 1 if correction is None else correction
    if not float(corr).is_integer():
        raise Unsupported("fractional correction")
    return c.add("var", [c.val(x)], dims=_dims(dims, rank), keepdim=bool(keepdim), correction=int(corr))


def _var_mean(c, node, x, dims=None, correction=None, keepdim=False, **kw):
    v = _var(c, node, x, dims, correction=correction, keepdim=keepdim, **kw)
    rank = len(meta_val(x).shape)
    m = c.add("mean", [c.val(x)], dims=_dims(dims, rank), keepdim=bool(keepdim))
    return (v, m)


def _arg(op):
    def h(c, node, x, dim=None, keepdim=False):
        xi = c.val(x)
        if dim is None:
            xi = c.add("reshape", [xi], shape=("shape", [str(meta_val(x).numel())]))
            out = c.add(op, [xi], dims=[0], keepdim=False)
            if keepdim:
                out = c.add("reshape", [out], shape=c.shape_attr(meta_val(node)))
            return out
        return c.add(op, [xi], dims=[dim], keepdim=bool(keepdim))
    return h


def _view(c, node, x, *a, **k):
    return c.add("reshape", [c.val(x)], shape=c.shape_attr(meta_val(node)))


def _expand(c, node, x, *a, **k):
    return c.add("expand", [c.val(x)], shape=c.shape_attr(meta_val(node)))


def _permute(c, node, x, dims):
    return c.add("permute", [c.val(x)], dims=list(dims))


def _transpose(c, node, x, d0=0, d1=1):
    rank = len(meta_val(x).shape)
    if rank < 2:
        return c.add("copy", [c.val(x)])
    dims = list(range(rank))
    d0, d1 = d0 % rank, d1 % rank
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return c.add("permute", [c.val(x)], dims=dims)


def _squeeze(c, node, x, dims=None):
    rank = len(meta_val(x).shape)
    return c.add("squeeze", [c.val(x)], dims=_dims(dims, rank))


def _symbolic_dim(x, dim) -> bool:
    size = meta_val(x).shape[dim]
    return isinstance(size, torch.SymInt) and not size.node.expr.is_number


def _slice_bound(v):
    """An int, or a size expression attribute (`<s0>`) for a symbolic one
    (None stays None)."""
    if isinstance(v, torch.fx.Node):  # a SymInt input of the graph, or size arithmetic on one
        v = meta_val(v)
    if isinstance(v, torch.SymInt):
        if v.node.expr.is_number:
            return int(v.node.expr)
        return ("shape", [size_text(v)])
    if v is not None and not isinstance(v, int):
        raise Unsupported(f"slice bound {v!r} is not an integer")
    return v


def _bounded(end) -> bool:
    """Whether a converted end bound (_slice_bound) ends before the dim does
    (PyTorch writes an open end as None or a huge int)."""
    return isinstance(end, tuple) or (end is not None and end < (1 << 62))


def _slice(c, node, x, dim=0, start=None, end=None, step=1):
    if not isinstance(step, int):
        raise Unsupported("a slice's step must be an integer")
    start, end = _slice_bound(start), _slice_bound(end)
    attrs = dict(dim=dim, start=start or 0, step=step)
    if _bounded(end):
        attrs["end"] = end
    if _symbolic_dim(x, dim) or isinstance(start, tuple) or isinstance(end, tuple):
        # PyTorch's size for the result (x[1:] of [s0]: s0 - 1) holds under
        # the guards it added on s0, and clamps nothing; the IR's clamped
        # bounds (s0 - min(1, s0)) are equal there but not the same
        # expression. The IR takes the bounds as checked (bind_symbols holds
        # every binding to them); a size PyTorch does clamp (a Min or Max in
        # it) is refused by size_text when the result is matched.
        # A symbolic bound (a cat's backward slices its gradient from <s0>)
        # is guarded the same way.
        attrs["inbounds"] = 1
    return c.add("slice", [c.val(x)], **attrs)


def _slice_scatter(c, node, base, src, dim=0, start=None, end=None, step=1):
    """slice_scatter(base, src) (a slice's backward: src into zeros). With
    step 1: base's parts before and after the slice around src, catted;
    with a step, the IR's slice_scatter (src's elements interleaved with
    base's)."""
    if not isinstance(step, int):
        raise Unsupported("a slice_scatter's step must be an integer")
    rank = len(meta_val(base).shape)
    dim = dim % rank
    _require_src_sizes(base, src, dim, start, end, step)
    start, end = _slice_bound(start), _slice_bound(end)
    symbolic = isinstance(start, tuple) or isinstance(end, tuple)
    extra = {"inbounds": 1} if _symbolic_dim(base, dim) or symbolic else {}
    b = c.val(base)
    s = c.cast_to(c.val(src), meta_val(base).dtype)
    bounded = _bounded(end)
    if step != 1:
        attrs = dict(dim=dim, start=start or 0, step=step, **extra)
        if bounded:
            attrs["end"] = end
        return c.add("slice_scatter", [b, s], **attrs)
    parts = []
    if start:
        parts.append(c.add("slice", [b], dim=dim, start=0, end=start, step=1, **extra))
    parts.append(s)
    if bounded:
        parts.append(c.add("slice", [b], dim=dim, start=end, step=1, **extra))
    return parts[0] if len(parts) == 1 else c.add("cat", parts, dim=dim)


def _size_sympy(v):
    """An int or SymInt as a sympy expression with the substitutions applied."""
    import sympy

    if isinstance(v, torch.fx.Node):
        v = meta_val(v)
    return canonical_expr(v) if isinstance(v, torch.SymInt) else sympy.Integer(int(v))


def _require_src_sizes(base, src, dim, start, end, step):
    """A slice_scatter's source has its slice's shape, which eager checks at
    every call but Dynamo does not guard: where a source dim is a symbol of
    its own (or the slice's length is one), the symbol becomes the other
    side's expression (_Unify). The slice's length is counted as the IR's
    inbounds slice counts it."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv

    bshape, sshape = meta_val(base).shape, meta_val(src).shape
    if len(bshape) != len(sshape):
        return
    size = _size_sympy(bshape[dim])
    lo = sympy.Integer(0) if start is None else _size_sympy(start)
    hi = size if end is None or (isinstance(end, int) and end >= (1 << 62)) else _size_sympy(end)
    if lo.is_number and lo < 0:
        lo = size + lo
    if hi.is_number and hi < 0:
        hi = size + hi
    if size.is_number:  # constant bounds on a constant dim: clamped as PyTorch clamps them
        lo, hi = min(max(lo, 0), size), min(max(hi, 0), size)
        hi = max(hi, lo)
    length = hi - lo if step == 1 else FloorDiv(hi - lo + step - 1, step)
    want = [length if d == dim else _size_sympy(b) for d, b in enumerate(bshape)]
    for w, v in zip(want, sshape):
        got = _size_sympy(v)
        if sympy.expand(got - w) == 0:
            continue
        for sym, other in ((got, w), (w, got)):
            if sym.is_Symbol and sym not in other.free_symbols:
                raise _Unify({sym: other})


def _select(c, node, x, dim, index):
    if not isinstance(index, int):
        raise Unsupported("select index must be an integer")
    rank = len(meta_val(x).shape)
    end = index + 1 if index != -1 else (1 << 62)
    attrs = dict(dim=dim, start=index, end=end, step=1)
    if _symbolic_dim(x, dim):
        attrs["inbounds"] = 1  # PyTorch has checked the index against the size (a guard)
    s = c.add("slice", [c.val(x)], **attrs)
    return c.add("squeeze", [s], dims=[dim % rank])


def _cat(c, node, tensors, dim=0):
    ins = [c.val(t) for t in tensors if not (isinstance(t, torch.fx.Node) and meta_val(t).shape == (0,))]
    return c.add("cat", ins, dim=dim)


def _full(c, node, size, value, dtype=None, **_):
    val = meta_val(node)
    return c.add("full", [], shape=c.shape_attr(val), value=float(value), dtype=("dtype", dtype_name(val.dtype)))


def _full_like(c, node, x, value, dtype=None, **_):
    return _full(c, node, None, value)


def _scalar_tensor(c, node, value, dtype=None, **_):
    return _full(c, node, None, value)


def _to_copy(c, node, x, dtype=None, device=None, **_):
    if device is not None and torch.device(device) != meta_val(x).device:
        raise Unsupported("device transfer")
    xi = c.val(x)
    return c.cast_to(xi, dtype) if dtype is not None else c.add("copy", [xi])


def _copy(c, node, dst, src, non_blocking=False):
    """aten.copy, the functional `dst.copy_(src)` that slice assignment
    becomes (`y[1:3] = z`, `y[:, ::2] += z`, then a slice_scatter): src's
    values in dst's dtype, broadcast to dst's shape; dst's values are not
    read."""
    d, s = meta_val(dst), meta_val(src)
    if s.device != d.device:
        raise Unsupported("device transfer")
    src_i = c.val(src)
    out = c.cast_to(src_i, d.dtype)
    if list(s.shape) != list(d.shape):
        return c.add("expand", [out], shape=c.shape_attr(meta_val(node)))
    return out if out != src_i else c.add("copy", [out])


def _convert(c, node, x, dtype):
    return c.cast_to(c.val(x), dtype)


def _clamp(c, node, x, min=None, max=None):
    attrs = {}
    for k, v in (("min", min), ("max", max)):
        if v is None:
            continue
        if isinstance(v, torch.fx.Node):
            raise Unsupported("tensor clamp bounds")
        attrs[k] = float(v)
    return c.add("clamp", [c.val(x)], **attrs)


def _clamp_tensor(c, node, x, min=None, max=None):
    xi = c.val(x)
    if min is not None:
        xi = c.add("maximum", [xi, c.val(min)])
    if max is not None:
        xi = c.add("minimum", [xi, c.val(max)])
    return xi


def _where(c, node, cond, a, b):
    return c.add("where", [c.val(cond), c.val(a), c.val(b)])


def _pow(c, node, a, b):
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        if b == 2:
            x = c.val(a)
            return c.add("mul", [x, x])
        if b == 0.5:
            return c.add("sqrt", [c.val(a)])
        if b == 1:
            return c.add("copy", [c.val(a)])
    return c.add("pow", [c.val(a), c.val(b)])


def _rsub(c, node, a, b, alpha=1):
    a_i = c.val(a)
    if alpha != 1:
        a_i = c.add("mul", [a_i, c.scalar(alpha)])
    return c.add("sub", [c.val(b), a_i])


def _gelu(c, node, x, approximate="none"):
    return c.add("gelu", [c.val(x)], approximate=approximate)


def _gelu_backward(c, node, grad, x, approximate="none"):
    return c.add("gelu_backward", [c.val(grad), c.val(x)], approximate=approximate)


def _softmax(op):
    def h(c, node, x, dim, half_to_float=False):
        return c.add(op, [c.val(x)], dim=dim)
    return h


def _softmax_bw(op):
    def h(c, node, grad, out, dim, input_dtype):
        return c.add(op, [c.val(grad), c.val(out)], dim=dim)
    return h


def _layer_norm(c, node, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    nd = len(normalized_shape)
    xi = c.val(x)
    ins = [xi]
    if weight is not None:
        ins.append(c.val(weight))
        if bias is not None:
            ins.append(c.val(bias))
    y = c.add("layer_norm", ins, normalized_ndim=nd, eps=float(eps))
    if weight is None and bias is not None:
        y = c.add("add", [y, c.val(bias)])
    mean = c.add("layer_norm_stats", [xi], normalized_ndim=nd, eps=float(eps), which="mean")
    rstd = c.add("layer_norm_stats", [xi], normalized_ndim=nd, eps=float(eps), which="rstd")
    return (y, mean, rstd)


def _layer_norm_backward(c, node, dy, x, normalized_shape, mean, rstd, weight, bias, mask):
    nd = len(normalized_shape)
    rank = len(meta_val(x).shape)
    dyi, xi, mi, ri = c.val(dy), c.val(x), c.val(mean), c.val(rstd)
    ins = [dyi, xi, mi, ri] + ([c.val(weight)] if weight is not None else [])
    dx = c.add("layer_norm_backward", ins, normalized_ndim=nd) if mask[0] else None
    batch = list(range(rank - nd))
    f32 = lambda i: c.cast_to(i, torch.float32) if c.g.dtype(i) in ("f16", "bf16") else i

    def over_batch(v):
        # The IR's sum with no dims sums everything: with no batch dims (a
        # rank-1 input normalized whole) there is nothing to sum over, and
        # the per-element value is the gradient itself.
        return c.add("sum", [v], dims=batch, keepdim=False) if batch else v

    dw = db = None
    if mask[1] and weight is not None:
        xhat = c.add("mul", [c.add("sub", [f32(xi), f32(mi)]), f32(ri)])
        dw = over_batch(c.add("mul", [f32(dyi), xhat]))
    if mask[2] and bias is not None:
        db = over_batch(f32(dyi))
    return (dx, dw, db)


def _threshold_backward(c, node, grad, x, threshold):
    cond = c.add("le", [c.val(x), c.scalar(threshold)])
    zero = c.add("full", [], shape=("shape", []), value=0.0, dtype=("dtype", c.g.dtype(c.val(grad))))
    return c.add("where", [cond, zero, c.val(grad)])


def _alias(c, node, x):
    return c.add("copy", [c.val(x)])


def _logical_not(c, node, x):
    return c.add("logical_not", [c.val(x)])


HANDLERS = {
    aten.add: _binary("add"), aten.sub: _binary("sub"), aten.mul: _binary("mul"),
    aten.div: _div, aten.true_divide: _div,
    aten.floor_divide: lambda c, n, a, b: c.add("div", [c.val(a), c.val(b)], rounding_mode="floor"),
    aten.rsub: _rsub,
    aten.neg: _unary("neg"), aten.abs: _unary("abs"), aten.exp: _unary("exp"), aten.log: _unary("log"),
    aten.log1p: _unary("log1p"), aten.expm1: _unary("expm1"), aten.sqrt: _unary("sqrt"), aten.rsqrt: _unary("rsqrt"),
    aten.reciprocal: _unary("reciprocal"), aten.relu: _unary("relu"), aten.sigmoid: _unary("sigmoid"),
    aten.tanh: _unary("tanh"), aten.erf: _unary("erf"), aten.sin: _unary("sin"), aten.cos: _unary("cos"),
    aten.sign: _unary("sign"), aten.isnan: _unary("isnan"), aten.silu: _unary("silu"),
    aten.gelu: _gelu, aten.gelu_backward: _gelu_backward, aten.pow: _pow,
    aten.maximum: _binary("maximum"), aten.minimum: _binary("minimum"),
    aten.clamp: _clamp, aten.clamp_min: lambda c, n, x, m: _clamp(c, n, x, min=m),
    aten.clamp_max: lambda c, n, x, m: _clamp(c, n, x, max=m),
    aten.where: _where,
    aten.eq: _binary("eq"), aten.ne: _binary("ne"), aten.lt: _binary("lt"), aten.le: _binary("le"),
    aten.gt: _binary("gt"), aten.ge: _binary("ge"),
    aten.logical_and: _binary("logical_and"), aten.logical_or: _binary("logical_or"),
    aten.logical_xor: _binary("logical_xor"), aten.logical_not: _logical_not,
    aten._to_copy: _to_copy, prims.convert_element_type: _convert, aten.clone: lambda c, n, x, **k: c.add("copy", [c.val(x)]),
    aten.alias: _alias, aten.copy: _copy,
    aten.full: _full, aten.full_like: _full_like, aten.scalar_tensor: _scalar_tensor,
    aten.sum: _reduce("sum"), aten.mean: _reduce("mean"), aten.amax: _reduce("amax"), aten.amin: _reduce("amin"),
    aten.var: _var, aten.var_mean: _var_mean, aten.argmax: _arg("argmax"), aten.argmin: _arg("argmin"),
    aten.view: _view, aten._unsafe_view: _view, aten.reshape: _view, aten.expand: _expand,
    aten.permute: _permute, aten.transpose: _transpose, aten.t: _transpose,
    aten.squeeze: _squeeze, aten.unsqueeze: lambda c, n, x, d: c.add("unsqueeze", [c.val(x)], dim=d),
    aten.slice: _slice, aten.slice_scatter: _slice_scatter, aten.select: _select, aten.cat: _cat,
    aten._softmax: _softmax("softmax"), aten._log_softmax: _softmax("log_softmax"),
    aten._softmax_backward_data: _softmax_bw("softmax_backward"),
    aten._log_softmax_backward_data: _softmax_bw("log_softmax_backward"),
    aten.native_layer_norm: _layer_norm, aten.native_layer_norm_backward: _layer_norm_backward,
    aten.threshold_backward: _threshold_backward,
    # GEMMs: library calls (cuBLASLt on the GPU, PyTorch's matmul on the CPU)
    aten.mm: lambda c, n, a, b: c.add("matmul", [c.val(a), c.val(b)]),
    aten.bmm: lambda c, n, a, b: c.add("matmul", [c.val(a), c.val(b)]),
}
GEMM_OPS = {aten.mm, aten.bmm}
# aten.sum.default has a different signature from sum.dim_IntList.
HANDLERS[aten.sum.default] = _sum_default


def register_opfuse_ops():
    """opfuse's own custom ops (opfuse.ops) become IR composites, so what
    surrounds them fuses into the same kernel instead of stopping at them."""
    ops = torch.ops.opfuse

    def layer_norm(c, node, x, nd, weight=None, bias=None, eps=1e-5):
        return _layer_norm(c, node, x, [None] * nd, weight, bias, eps)

    def rms_norm(c, node, x, nd, weight=None, eps=1e-6):
        xi = c.val(x)
        ins = [xi] + ([c.val(weight)] if weight is not None else [])
        y = c.add("rms_norm", ins, normalized_ndim=nd, eps=float(eps))
        return (y, c.add("rms_norm_rstd", [xi], normalized_ndim=nd, eps=float(eps)))

    for name, handler in (("softmax", _softmax("softmax")), ("log_softmax", _softmax("log_softmax")),
                          ("layer_norm", layer_norm), ("rms_norm", rms_norm)):
        if hasattr(ops, name):
            HANDLERS[getattr(ops, name).default] = handler


def supported_targets():
    return HANDLERS
