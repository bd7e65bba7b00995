"""Random-graph fuzzer: random IR graphs through the fusion planner and the CPU
code generator, checked against the float64 oracle (`_C.evaluate`).

Each graph mixes elementwise ops (unary, binary, where, comparisons, logical
ops, casts, clamp, pow, scalars, full), layout ops (permute, reshape, expand,
slice, squeeze/unsqueeze, cat), reductions (sum, mean, amax, amin, var,
argmax, prod with random dims and keepdim) and the composite ops (softmax,
log_softmax, layer_norm and its statistics, rms_norm and its rstd) over
inputs of rank 1-3 with small odd sizes, size-1 dims that broadcast, and
sometimes symbolic sizes (a second binding runs the same compiled graph at
other sizes; a cat part may be empty there, which CompiledGraph.for_sizes
serves). Several values of each graph are outputs, so kernels have several
outputs and intermediates are realized.

Tolerances come from a forward error analysis done while the graph is built:
every value carries an interval that bounds it and a bound on the absolute
difference between the compiled kernel and the oracle (rounding of the
compute type, the oracle's rounding of each half-precision node, error
propagated through each op's derivative, accumulation over the reduction
size). Ops whose result is discrete (comparisons, casts to integers, argmax,
floor division, sign) only read values that must be bit-identical on both
sides, so a rounding difference can never flip them; ops with a restricted
domain (log, sqrt, rsqrt, reciprocal, division, pow) read values kept away
from the edge of the domain, or read exact values directly and then only
feed a graph output (NaN and inf must then match exactly).

CI runs OPFUSE_FUZZ_GRAPHS graphs (default 40) from OPFUSE_FUZZ_SEED; a
larger manual run:

    OPFUSE_FUZZ_GRAPHS=2000 OPFUSE_FUZZ_SEED=7 .venv/bin/python -m pytest -q -p no:logging tests/python/test_fuzz.py

and one graph again: OPFUSE_FUZZ_SEED=7 OPFUSE_FUZZ_ONLY=123 (same command).
A failure prints the IR text, every input's dtype, shape, strides and storage
offset, and the output that differed.
"""
from __future__ import annotations

import collections
import math
import os
import random
from dataclasses import dataclass, field

import pytest
import torch

from opfuse import _C
from opfuse.frontend.convert import TORCH_DTYPES
from opfuse.testing import oracle, run_compiled, same_layout_on

SEED = int(os.environ.get("OPFUSE_FUZZ_SEED", "20250611"))
NUM_GRAPHS = int(os.environ.get("OPFUSE_FUZZ_GRAPHS", "40"))
ONLY = [int(s) for s in os.environ.get("OPFUSE_FUZZ_ONLY", "").split(",") if s.strip()]

FLOATS = ("f32", "f64", "bf16", "f16")
INTS = ("i32", "i64")
SIZES = (3, 5, 7, 9, 11, 15)
LARGE_SIZES = (1031, 4099, 8209, 40961)
# Relative rounding of one node in each dtype, with room for a few ulp of
# libm differences between float and double transcendental functions.
U = {"f64": 4e-16, "f32": 3e-7, "f16": 1.0e-3, "bf16": 8e-3, "i32": 0.0, "i64": 0.0, "b8": 0.0}
INPUT_RANGE = {"float": 3.0, "int": 20}
POOL_LIMIT = 1e4  # values beyond this only feed outputs
# A value whose error bound exceeds this fraction of its magnitude bound is not
# generated: comparing it would check little (ill-conditioned, e.g. a norm of
# nearly constant rows with a tiny eps, or a long half-precision chain).
MAX_REL_ERR = 0.1
# No value larger than this at any binding: inputs stay under 150k elements,
# but an expand of a size-1 dim to a large one multiplies them (seed 3404,
# graph 116: s0x8209x8209, 1G float64 elements a node in the oracle at the
# second binding, which holds every node, used or not).
MAX_VALUE_NUMEL = 600_000


def ucomp(dt):
    """Rounding of the type the kernel computes in (half types in float32)."""
    return U["f64"] if dt == "f64" else U["f32"]


def is_float(dt):
    return dt in FLOATS


def rnd(dt, m):
    """Absolute rounding error of one node of dtype `dt` whose magnitude is <= m."""
    return (U[dt] + ucomp(dt)) * m if is_float(dt) else 0.0


def exact_in(value, dt):
    """Whether the float `value` converts to the float dtype dt without rounding."""
    return float(torch.tensor(value, dtype=torch.float64).to(TORCH_DTYPES[dt])) == value


# Conversions that never round.
WIDEN = {("f16", "f32"), ("bf16", "f32"), ("f16", "f64"), ("bf16", "f64"), ("f32", "f64"), ("b8", "f32"),
         ("b8", "f64"), ("b8", "bf16"), ("b8", "f16"), ("b8", "i32"), ("b8", "i64"), ("i32", "i64")}


def powbound(m, n):
    m = max(float(m), 1e-300)
    return math.inf if n * math.log(m) > 700 else m**n


def bcast_ok(a, b):
    return all(x == y or x == "1" or y == "1" for x, y in zip(reversed(a), reversed(b)))


@dataclass
class Val:
    id: int
    dtype: str
    shape: list
    lo: float
    hi: float
    err: float  # bound on |kernel - oracle|; 0 means bit-identical
    nan: bool = False  # may hold NaN or inf (identically on both sides)
    terminal: bool = False  # only feeds outputs
    op: str = ""
    weak: bool = False  # a weak scalar (Python number)

    @property
    def m(self):
        return max(abs(self.lo), abs(self.hi))

    @property
    def exact(self):
        return self.err == 0.0


@dataclass
class Case:
    index: int
    text: str
    inputs: list  # (name, dtype, shape strings)
    bindings: list  # symbol -> size, one dict per run at other sizes
    outputs: list  # Val per graph output
    layouts: list  # per run after the first: one layout name per input
    ops: collections.Counter = field(default_factory=collections.Counter)
    empty_parts: int = 0  # cat parts empty at the second binding (run on for_sizes there)


class GraphGen:
    """Builds one random graph through _C.GraphBuilder, tracking per value an
    interval and an error bound (see the module docstring)."""

    def __init__(self, seed, index):
        self.rng = random.Random(f"{seed}:{index}")
        self.index = index
        self.b = _C.GraphBuilder()
        self.pool = []  # operands
        self.values = []  # output candidates
        self.input_specs = []
        self.ops = collections.Counter()
        self.syms = [{}]
        self.empty_parts = 0  # cat parts empty at the second binding

    # -- plumbing ----------------------------------------------------------

    def sizes(self, shape, binding=0):
        env = {"min": min, "max": max, **self.syms[binding]}
        return [int(eval(d, {"__builtins__": {}}, env)) for d in shape]  # noqa: S307 (our own expressions)

    def numel_max(self, shape):
        return max(math.prod(self.sizes(shape, k)) for k in range(len(self.syms)))

    def emit(self, op, inputs, attrs, lo, hi, err, nan=False, terminal=False, part_only=False):
        """The new value, or None where the op does not apply. part_only: a
        cat part that may be empty at some binding (CompiledGraph.for_sizes
        then runs the graph with its size fixed): kept out of the operand
        pool and the outputs."""
        if not nan and math.isfinite(err) and err > MAX_REL_ERR * max(abs(lo), abs(hi)) + 1e-7:
            return None
        probed = self.probe(op, inputs, attrs)
        if probed is None or self.numel_max(probed[1]) > MAX_VALUE_NUMEL:
            return None
        try:
            vid = self.b.add(op, [v.id for v in inputs], attrs or {})
        except ValueError:
            return None
        dt = self.b.dtype(vid)
        shape = self.b.shape(vid)
        if not part_only and any(s <= 0 for k in range(len(self.syms)) for s in self.sizes(shape, k)):
            return None  # empty results stay out of the graph's outputs (unused nodes are dropped)
        if dt == "b8":
            lo, hi = max(lo, 0.0), min(hi, 1.0)
        if not is_float(dt):
            assert err == 0.0, (op, dt, err)
            lo, hi = math.floor(lo), math.ceil(hi)
        err = err + 0.0
        if not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(err)):
            nan = True
        v = Val(vid, dt, shape, lo, hi, err, nan, terminal or nan or max(abs(lo), abs(hi)) > POOL_LIMIT, op)
        self.ops[op] += 1
        if part_only:
            return v
        self.values.append(v)
        if not v.terminal:
            self.pool.append(v)
        return v

    def pick(self, pred=lambda v: True):
        cands = [v for v in self.pool if pred(v)]
        if not cands:
            return None
        return self.rng.choices(cands, weights=[1 + i for i in range(len(cands))])[0]

    def partner(self, a, pred=lambda v: True):
        """Another operand that broadcasts with `a` (or None)."""
        return self.pick(lambda v: v is not a and bcast_ok(v.shape, a.shape) and pred(v))

    def scalar(self, value, dtype="f64", weak=True):
        vid = self.b.scalar(float(value), dtype, weak)
        self.ops["scalar"] += 1
        return Val(vid, self.b.dtype(vid), [], float(value), float(value), 0.0, op="scalar", weak=weak)

    def probe(self, op, inputs, attrs=None):
        """The (dtype, shape) `op` would give (None if the combination is
        invalid), found on a scratch graph so that the real one gets no node
        it does not keep: the oracle evaluates every node, and a dead one
        could raise or be huge."""
        probe = _C.GraphBuilder()
        ids = [probe.scalar(v.lo, v.dtype, True) if v.weak else probe.input("t", v.dtype, v.shape) for v in inputs]
        try:
            vid = probe.add(op, ids, attrs or {})
        except ValueError:
            return None
        return probe.dtype(vid), probe.shape(vid)

    def result_dtype(self, op, inputs, attrs=None):
        probed = self.probe(op, inputs, attrs)
        return probed and probed[0]

    def conv_err(self, v, dt):
        """Error bound of v after conversion to dtype dt (exact conversions add nothing)."""
        if v.dtype == dt or v.weak or (v.dtype, dt) in WIDEN:
            return v.err
        if not is_float(v.dtype) and is_float(dt) and v.m <= 256:
            return v.err
        return v.err + rnd(dt, v.m)

    def make_positive(self, x):
        """A value >= 0.25 derived from x (for log, sqrt, division, pow)."""
        r = self.rng.random()
        if r < 0.4:
            a = self.unary_to(x, "abs")
            return a and self.binary_to(a, self.scalar(self.rng.choice([0.25, 0.5, 1.0])), "add")
        if r < 0.7:
            s = self.unary_to(x, "sigmoid")
            return s and self.binary_to(s, self.scalar(0.25), "add")
        t = self.unary_to(x, "tanh")
        return t and self.unary_to(t, "exp")

    def squash(self, x):
        return self.unary_to(x, self.rng.choice(["tanh", "sigmoid", "erf"]))

    # -- inputs ------------------------------------------------------------

    def make_inputs(self):
        rng = self.rng
        rank = rng.choice([1, 2, 2, 3, 3, 3])
        base = [str(rng.choice(SIZES)) for _ in range(rank)]
        if rng.random() < 0.12:
            # One large dim: the kernels' OpenMP-parallel paths (over 32768 or
            # 65536 elements) and the 8192-element chunks of the last dim.
            d = rng.randrange(rank)
            base[d] = str(rng.choice([n for n in LARGE_SIZES if n * 3 ** (rank - 1) <= 150_000]))
            for k in rng.sample(range(rank), rank):
                if k != d and math.prod(int(b) for b in base) > 150_000:
                    base[k] = "3"
        if rng.random() < 0.3:
            for k, d in enumerate(rng.sample(range(rank), rng.randint(1, min(2, rank)))):
                name = f"s{k}"
                self.syms[0][name] = int(base[d])
                base[d] = name
            self.syms.append({s: rng.choice(SIZES) for s in self.syms[0]})
            if math.prod(self.sizes(base, 1)) > 150_000:
                self.syms[1] = {s: 3 for s in self.syms[0]}
        self.base = base
        n_in = rng.randint(2, 4)
        for i in range(n_in):
            if i == 0:
                dt, shape = rng.choice(["f32", "f32", "bf16", "f16", "f64"]), list(base)
            else:
                dt = rng.choices(["f32", "f64", "bf16", "f16", "i32", "i64", "b8"], [10, 2, 3, 3, 2, 2, 2])[0]
                r = rng.randint(1, rank)
                shape = [d if rng.random() > 0.3 else "1" for d in base[rank - r:]]
            name = f"in{i}"
            vid = self.b.input(name, dt, shape)
            self.input_specs.append((name, dt, shape))
            if is_float(dt):
                lo, hi = -INPUT_RANGE["float"], INPUT_RANGE["float"]
            elif dt == "b8":
                lo, hi = 0, 1
            else:
                lo, hi = -INPUT_RANGE["int"], INPUT_RANGE["int"] - 1
            v = Val(vid, dt, shape, lo, hi, 0.0, op="input")
            self.pool.append(v)

    # -- elementwise ---------------------------------------------------------

    UNARY = ["neg", "abs", "relu", "sign", "tanh", "sigmoid", "erf", "sin", "cos", "gelu", "silu", "exp", "expm1",
             "log", "log1p", "sqrt", "rsqrt", "reciprocal", "isnan", "logical_not"]

    def unary_to(self, x, op, attrs=None):
        """Applies `op` to x if its domain allows; returns the new value or None."""
        if x is None:
            return None
        lo, hi, e, m = x.lo, x.hi, x.err, x.m
        fdt = x.dtype if is_float(x.dtype) else "f32"  # the result dtype of float ops
        if op in ("sign", "isnan", "logical_not") and not x.exact and not (op == "isnan" and not x.nan):
            return None
        if x.nan and op not in ("neg", "abs", "relu", "isnan", "tanh", "sigmoid"):
            return None
        if x.dtype == "b8" and op not in ("logical_not", "isnan", "relu"):
            return None
        if op == "neg":
            return self.emit(op, [x], attrs, -hi, -lo, e, x.nan)
        if op == "abs":
            return self.emit(op, [x], attrs, 0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), m, e, x.nan)
        if op == "relu":
            return self.emit(op, [x], attrs, max(lo, 0.0), max(hi, 0.0), e, x.nan)
        if op == "sign":
            return self.emit(op, [x], attrs, -1.0 if lo < 0 else 0.0, 1.0 if hi > 0 else 0.0, 0.0, x.nan)
        if op in ("isnan", "logical_not"):
            return self.emit(op, [x], attrs, 0, 1, 0.0)
        if op == "tanh":
            return self.emit(op, [x], attrs, math.tanh(lo), math.tanh(hi), e + rnd(fdt, 1.0), x.nan)
        if op == "sigmoid":
            sig = lambda t: 1.0 / (1.0 + math.exp(-max(min(t, 700), -700)))  # noqa: E731
            return self.emit(op, [x], attrs, sig(lo), sig(hi), 0.25 * e + rnd(fdt, 1.0), x.nan)
        if op == "erf":
            return self.emit(op, [x], attrs, math.erf(lo), math.erf(hi), 1.13 * e + rnd(fdt, 1.0))
        if op in ("sin", "cos"):
            if m > 20:
                return None
            return self.emit(op, [x], attrs, -1.0, 1.0, e + rnd(fdt, 1.0))
        if op in ("gelu", "silu"):
            return self.emit(op, [x], attrs, -0.3, max(hi, 0.0) + 0.01, 1.13 * e + rnd(fdt, m + 0.3))
        if op in ("exp", "expm1"):
            if hi > 4:
                return None
            base = 0.0 if op == "exp" else -1.0
            return self.emit(op, [x], attrs, math.exp(lo) + base, math.exp(hi) + base,
                             math.exp(hi) * e + rnd(fdt, math.exp(hi)))
        # Domain-restricted ops: away from the edge, or raw on exact values into an output.
        edge = {"log": 0.0, "log1p": -1.0, "sqrt": 0.0, "rsqrt": 0.0, "reciprocal": 0.0}[op]
        margin = lo - e - edge
        if margin < 0.2:
            if not x.exact or op == "reciprocal" and x.dtype in ("b8",):
                return None
            return self.emit(op, [x], attrs, -math.inf, math.inf, 0.0, nan=True, terminal=True)
        if op == "log":
            return self.emit(op, [x], attrs, math.log(lo), math.log(hi), e / lo + rnd(fdt, max(abs(math.log(lo)), abs(math.log(hi)))))
        if op == "log1p":
            return self.emit(op, [x], attrs, math.log1p(lo), math.log1p(hi),
                             e / (1 + lo) + rnd(fdt, max(abs(math.log1p(lo)), abs(math.log1p(hi)))))
        if op == "sqrt":
            return self.emit(op, [x], attrs, math.sqrt(lo), math.sqrt(hi), e / (2 * math.sqrt(lo)) + rnd(fdt, math.sqrt(hi)))
        if op == "rsqrt":
            return self.emit(op, [x], attrs, 1 / math.sqrt(hi), 1 / math.sqrt(lo), 0.5 * lo ** -1.5 * e + rnd(fdt, 1 / math.sqrt(lo)))
        if op == "reciprocal":
            return self.emit(op, [x], attrs, 1 / hi, 1 / lo, e / lo**2 + rnd(fdt, 1 / lo))
        raise AssertionError(op)

    def gen_unary(self):
        x = self.pick()
        if x is None:
            return None
        op = self.rng.choice(self.UNARY)
        attrs = {"approximate": self.rng.choice(["none", "tanh"])} if op == "gelu" else None
        if op in ("log", "sqrt", "rsqrt", "reciprocal", "log1p") and x.lo - x.err < 0.2 and self.rng.random() < 0.75:
            x = self.make_positive(x)
        return self.unary_to(x, op, attrs)

    def binary_to(self, a, b, op, attrs=None):
        if a is None or b is None:
            return None
        if (a.nan or b.nan) and op not in ("add", "mul", "maximum", "minimum"):
            return None
        exact = a.exact and b.exact
        ints = all(not is_float(v.dtype) for v in (a, b))
        dt = self.result_dtype(op, [a, b], attrs)
        if dt is None:
            return None
        if dt == "b8" and op in ("add", "mul", "maximum", "minimum") and not exact:
            return None
        fdt = dt if is_float(dt) else "f32"
        ea, eb = self.conv_err(a, fdt), self.conv_err(b, fdt)
        if op in ("add", "sub"):
            lo = a.lo + (b.lo if op == "add" else -b.hi)
            hi = a.hi + (b.hi if op == "add" else -b.lo)
            m = max(abs(lo), abs(hi))
            if not is_float(dt):
                return self.emit(op, [a, b], attrs, lo, hi, 0.0) if exact and m < 2**30 else None
            return self.emit(op, [a, b], attrs, lo, hi, ea + eb + rnd(dt, m), a.nan or b.nan)
        if op == "mul":
            c = [a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi]
            lo, hi = min(c), max(c)
            m = max(abs(lo), abs(hi))
            if not is_float(dt):
                return self.emit(op, [a, b], attrs, lo, hi, 0.0) if exact and m < 2**30 else None
            return self.emit(op, [a, b], attrs, lo, hi, b.m * ea + a.m * eb + ea * eb + rnd(dt, m), a.nan or b.nan)
        if op in ("maximum", "minimum"):
            f = max if op == "maximum" else min
            lo, hi = f(a.lo, b.lo), f(a.hi, b.hi)
            if not is_float(dt):
                return self.emit(op, [a, b], attrs, lo, hi, 0.0) if exact else None
            # The result is one operand's value: exact when both are values of
            # dt, but a weak scalar that dt cannot hold (0.1 in bf16) is picked
            # as it is by the kernel (half-precision intermediates stay in
            # float32) and rounded by the oracle (seed 36, graph 66).
            e = max(ea, eb)
            if any(v.weak and not exact_in(v.lo, dt) for v in (a, b)):
                e += rnd(dt, max(abs(lo), abs(hi)))
            return self.emit(op, [a, b], attrs, lo, hi, e, a.nan or b.nan)
        if op == "div":
            mode = (attrs or {}).get("rounding_mode", "true")
            if b.lo - b.err <= 0.2 and b.hi + b.err >= -0.2:
                return None
            den_min = min(abs(b.lo), abs(b.hi)) - b.err
            c = [a.lo / b.lo, a.lo / b.hi, a.hi / b.lo, a.hi / b.hi]
            lo, hi = min(c), max(c)
            if mode == "true":
                m = max(abs(lo), abs(hi))
                return self.emit(op, [a, b], attrs, lo, hi, ea / den_min + a.m * eb / den_min**2 + rnd(dt, m))
            if not exact:
                return None
            if is_float(dt) and dt != "f32":
                return None  # float64: the oracle's floor(a / b) may round onto an integer; halves: see below
            if is_float(dt) and not (a.dtype == b.dtype == "f32"):
                return None
            return self.emit(op, [a, b], attrs, math.floor(lo) - 1, math.ceil(hi) + 1, 0.0)
        if op == "pow":
            if ints:
                p = powbound(a.m, b.hi)
                return self.emit(op, [a, b], attrs, -p, p, 0.0) if exact and b.lo >= 0 and p < 2**30 else None
            if a.lo - a.err < 0.25 or a.hi > 8 or b.m > 3:
                return None
            corners = [x**y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
            lo, hi = min(corners), max(corners)
            if b.lo < 0 < b.hi or b.lo <= 1 <= b.hi:
                lo, hi = min(lo, 1.0, a.lo), max(hi, 1.0, a.hi)
            d_a = max(abs(y) * x ** (y - 1) for x in (a.lo, a.hi) for y in (b.lo, b.hi, 0.0 if b.lo < 0 < b.hi else b.lo))
            d_b = hi * max(abs(math.log(a.lo)), abs(math.log(a.hi)))
            return self.emit(op, [a, b], attrs, lo, hi, d_a * ea + d_b * eb + rnd(dt, hi))
        if op in ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor"):
            if not exact:
                return None
            return self.emit(op, [a, b], attrs, 0, 1, 0.0)
        raise AssertionError(op)

    def random_scalar(self, like):
        r = self.rng.random()
        if not is_float(like.dtype) and r < 0.5:
            return self.scalar(self.rng.choice([2, 3, -1, 5]), "i64", True)
        if r < 0.15:
            return self.scalar(self.rng.choice([0.5, 2.0, -1.5]), self.rng.choice(["f32", "f64", "bf16"]), False)
        return self.scalar(self.rng.choice([0.5, 2.0, -1.5, 0.1, 3.0, 0.75]))

    def gen_binary(self):
        a = self.pick()
        if a is None:
            return None
        op = self.rng.choices(["add", "sub", "mul", "maximum", "minimum", "div", "pow"], [5, 4, 5, 2, 2, 3, 1])[0]
        b = self.partner(a) if self.rng.random() < 0.75 else None
        if b is None:
            b = self.random_scalar(a)
        attrs = None
        if op == "div":
            if self.rng.random() < 0.3:
                attrs = {"rounding_mode": self.rng.choice(["floor", "trunc"])}
                if not is_float(b.dtype) and b.lo <= 0 <= b.hi:  # an integer denominator without zero
                    b = self.unary_to(b, "abs")
                    b = b and self.binary_to(b, self.scalar(1, "i64"), "add")
            elif b.lo - b.err <= 0.2 and b.hi + b.err >= -0.2:
                b = self.make_positive(b)
        if op == "pow":
            if is_float(a.dtype) or self.rng.random() < 0.5:
                if a.lo - a.err < 0.25 or a.hi > 8:
                    a = self.make_positive(a)
                if self.rng.random() < 0.5 or b.m > 3 or not is_float(b.dtype):
                    b = self.scalar(self.rng.choice([2.0, 3.0, 0.5, -1.0, 1.5, -0.5]))
            else:
                b = self.scalar(self.rng.choice([2, 3]), "i64")
        return self.binary_to(a, b, op, attrs)

    def gen_compare(self):
        a = self.pick(lambda v: v.exact)
        if a is None:
            return None
        if a.dtype == "b8" or self.rng.random() < 0.3:
            op = self.rng.choice(["logical_and", "logical_or", "logical_xor"] if a.dtype == "b8" else ["eq", "ne"])
        else:
            op = self.rng.choice(["eq", "ne", "lt", "le", "gt", "ge"])
        b = self.partner(a, lambda v: v.exact) if self.rng.random() < 0.6 else None
        if b is None:
            b = self.scalar(self.rng.choice([0.0, 0.5, -1.0, 1.0])) if is_float(a.dtype) else self.scalar(self.rng.choice([0, 1, 3]), "i64")
        return self.binary_to(a, b, op)

    def gen_where(self):
        cond = self.pick(lambda v: v.dtype == "b8" and v.exact)
        if cond is None:
            cond = self.gen_compare()
            if cond is None or cond.dtype != "b8":
                return None
        a = self.partner(cond) or self.random_scalar(cond)
        b = self.pick(lambda v: v is not a and bcast_ok(v.shape, cond.shape) and bcast_ok(v.shape, a.shape))
        if b is None or self.rng.random() < 0.3:
            b = self.random_scalar(a)
        if a.nan or b.nan:
            return None
        dt = self.result_dtype("where", [cond, a, b])
        if dt is None or not is_float(dt) and not (a.exact and b.exact):
            return None
        e = max(self.conv_err(a, dt), self.conv_err(b, dt)) if is_float(dt) else 0.0
        return self.emit("where", [cond, a, b], None, min(a.lo, b.lo), max(a.hi, b.hi), e)

    def gen_cast(self):
        x = self.pick()
        if x is None:
            return None
        to = self.rng.choice(FLOATS + INTS + ("b8",))
        if to == x.dtype:
            return None
        if not is_float(to):
            if not x.exact or x.nan or (to == "i32" and x.m >= 2**31):
                return None
            lo, hi = (0, 1) if to == "b8" else (math.trunc(x.lo), math.trunc(x.hi))
            return self.emit("cast", [x], {"dtype": ("dtype", to)}, lo, hi, 0.0)
        return self.emit("cast", [x], {"dtype": ("dtype", to)}, x.lo, x.hi, self.conv_err(x, to), x.nan)

    def gen_clamp(self):
        x = self.pick(lambda v: is_float(v.dtype) and not v.nan)
        if x is None:
            return None
        attrs = {}
        if self.rng.random() < 0.7:
            attrs["min"] = self.rng.choice([-1.0, -0.5, 0.0, 0.25])
        if self.rng.random() < 0.7 or not attrs:
            attrs["max"] = self.rng.choice([0.5, 1.0, 2.0])
        lo = max(x.lo, attrs.get("min", -math.inf))
        hi = min(x.hi, attrs.get("max", math.inf))
        lo, hi = min(lo, hi), max(lo, hi)
        lo, hi = min(lo, attrs.get("max", lo)), max(hi, attrs.get("min", hi))
        return self.emit("clamp", [x], attrs, lo, hi, x.err)

    def gen_full(self):
        like = self.pick()
        shape = like.shape if like is not None else self.base
        dt = self.rng.choice(["f32", "f32", "bf16", "i64", "f64"])
        value = float(self.rng.choice([0.5, -2.0, 3.0, 1.0]))
        return self.emit("full", [], {"shape": ("shape", list(shape)), "value": value, "dtype": ("dtype", dt)},
                         value, value, 0.0)

    # -- reductions ----------------------------------------------------------

    def red_dims(self, rank, one=False):
        if rank == 0:
            return None
        if one:
            return [self.rng.randrange(rank) - (rank if self.rng.random() < 0.3 else 0)]
        k = self.rng.randint(1, rank)
        dims = sorted(self.rng.sample(range(rank), k))
        return [d - rank if self.rng.random() < 0.2 else d for d in dims]

    def gen_reduction(self):
        op = self.rng.choices(["sum", "mean", "amax", "amin", "var", "argmax", "argmin", "prod"], [5, 4, 3, 2, 2, 2, 1, 1])[0]
        x = self.pick(lambda v: v.dtype != "b8" and len(v.shape) > 0 and not v.nan)
        if x is None:
            return None
        if op in ("mean", "var") and not is_float(x.dtype):
            return None
        if op in ("argmax", "argmin") and not x.exact:
            return None
        rank = len(x.shape)
        dims = self.red_dims(rank, one=op in ("argmax", "argmin"))
        attrs = {"keepdim": self.rng.random() < 0.5}
        if dims is not None and not (op in ("argmax", "argmin") and self.rng.random() < 0.2):
            attrs["dims"] = dims
        red = sorted(d % rank for d in attrs.get("dims", range(rank)))
        n = max(math.prod(self.sizes([x.shape[d] for d in red], k)) for k in range(len(self.syms)))
        fdt = x.dtype if is_float(x.dtype) else "f32"
        acc = ucomp(fdt) * (2 + math.sqrt(n))  # relative accumulation error per unit of magnitude
        if op == "sum":
            lo, hi = n * x.lo, n * x.hi
            if not is_float(x.dtype):
                return self.emit(op, [x], attrs, lo, hi, 0.0)
            if self.rng.random() < 0.15 and x.dtype in ("bf16", "f16"):
                attrs["dtype"] = ("dtype", "f32")
                fdt = "f32"
            return self.emit(op, [x], attrs, lo, hi, n * x.err + acc * n * x.m + rnd(fdt, n * x.m))
        if op == "mean":
            return self.emit(op, [x], attrs, x.lo, x.hi, x.err + acc * x.m + rnd(fdt, x.m))
        if op in ("amax", "amin"):
            return self.emit(op, [x], attrs, x.lo, x.hi, x.err)
        if op in ("argmax", "argmin"):
            return self.emit(op, [x], attrs, 0, n - 1, 0.0)
        if op == "var":
            corr = self.rng.choice([0, 1, 1])
            attrs["correction"] = corr
            if n - corr <= 0:
                return self.emit(op, [x], attrs, -math.inf, math.inf, 0.0, nan=True, terminal=True) if x.exact else None
            w = x.hi - x.lo
            scale = n / (n - corr)
            return self.emit(op, [x], attrs, 0.0, w * w * scale,
                             2 * w * x.err * scale + acc * 4 * w * w * scale + rnd(fdt, w * w * scale))
        if op == "prod":
            if powbound(x.m, n) > 1e4:
                if not is_float(x.dtype):
                    return None
                x = self.squash(x)
                if x is None:
                    return None
            if not is_float(x.dtype):
                p = powbound(x.m, n)
                return self.emit(op, [x], attrs, -p, p, 0.0) if p < 2**52 else None
            mn = powbound(x.m, n)
            lo, hi = (x.lo**n, x.hi**n) if x.lo >= 0 else (-mn, mn)
            return self.emit(op, [x], attrs, min(lo, hi), max(lo, hi),
                             n * powbound(x.m, n - 1) * x.err + 2 * acc * n * mn + rnd(fdt, mn))
        raise AssertionError(op)

    # -- layout ----------------------------------------------------------------

    def passthrough(self, op, inputs, attrs, part_only=False):
        x = inputs[0]
        return self.emit(op, inputs, attrs, x.lo, x.hi, x.err, x.nan, part_only=part_only)

    def gen_layout(self):
        op = self.rng.choice(["permute", "reshape", "expand", "slice", "unsqueeze", "squeeze", "cat", "cat"])
        x = self.pick(lambda v: len(v.shape) > 0)
        if x is None:
            return None
        rank, rng = len(x.shape), self.rng
        if op == "permute":
            if rank < 2:
                return None
            dims = list(range(rank))
            while dims == sorted(dims):
                rng.shuffle(dims)
            return self.passthrough(op, [x], {"dims": [d - rank if rng.random() < 0.2 else d for d in dims]})
        if op == "reshape":
            shape = list(x.shape)
            kind = rng.choice(["flatten", "merge", "split", "ones"])
            if kind == "flatten" or rank == 1 and kind == "merge":
                shape = ["*".join(f"({d})" for d in shape)]
            elif kind == "merge":
                i = rng.randrange(rank - 1)
                shape[i:i + 2] = [f"({shape[i]})*({shape[i + 1]})"]
            elif kind == "split":
                splits = [(i, int(d)) for i, d in enumerate(shape) if d.isdigit() and int(d) in (9, 15, 21, 25, 35, 45)]
                if not splits:
                    return None
                i, d = rng.choice(splits)
                f = 3 if d % 3 == 0 else 5
                shape[i:i + 1] = [str(f), str(d // f)]
            else:
                shape.insert(rng.randrange(rank + 1), "1")
            return self.passthrough(op, [x], {"shape": ("shape", shape)})
        if op == "expand":
            ones = [i for i, d in enumerate(x.shape) if d == "1"]
            if not ones and rank >= 3:
                return None
            shape = list(x.shape)
            for i in ones:
                if rng.random() < 0.7:
                    off = len(self.base) - rank
                    shape[i] = self.base[off + i] if 0 <= off + i < len(self.base) else str(rng.choice(SIZES))
            if rng.random() < 0.4 and rank < 3:
                shape.insert(0, str(rng.choice(SIZES)))
            if shape == x.shape:
                return None
            return self.passthrough(op, [x], {"shape": ("shape", shape)})
        if op == "slice":
            d = rng.randrange(rank)
            attrs = {"dim": d - rank if rng.random() < 0.2 else d}
            if rng.random() < 0.7:
                attrs["start"] = rng.choice([1, 2, -3, -2, 0])
            if rng.random() < 0.5:
                attrs["end"] = rng.choice([-1, 4, 100, 6])
            if rng.random() < 0.5:
                attrs["step"] = rng.choice([2, 3])
            return self.passthrough(op, [x], attrs)
        if op == "unsqueeze":
            return self.passthrough(op, [x], {"dim": rng.randint(-rank - 1, rank)})
        if op == "squeeze":
            ones = [i for i, d in enumerate(x.shape) if d == "1"]
            if not ones:
                return None
            return self.passthrough(op, [x], {"dims": rng.sample(ones, rng.randint(1, len(ones))) if rng.random() < 0.7 else []})
        if op == "cat":
            d = rng.randrange(rank)
            same = [v for v in self.pool if v is not x and len(v.shape) == rank and not v.nan
                    and all(v.shape[k] == x.shape[k] for k in range(rank) if k != d)]
            others = rng.sample(same, min(len(same), rng.randint(1, 2))) if same else []
            # Along a dim of symbol s that is smaller at the second binding,
            # sometimes x[k:] with k that smaller value: a part empty there
            # (the graph runs on for_sizes at those sizes).
            sym = x.shape[d] if len(self.syms) > 1 and x.shape[d] in self.syms[0] else None
            if sym is not None and self.syms[1][sym] < self.syms[0][sym] and rng.random() < 0.8:
                s = self.passthrough("slice", [x], {"dim": d, "start": self.syms[1][sym], "inbounds": 1}, part_only=True)
                if s is not None:
                    others = others[:1] + [s]
                    self.empty_parts += 1
            if not others:
                # A symbolic dim's bounds must be declared in bounds (every size here is >= 3).
                s = self.passthrough("slice", [x], {"dim": d, "start": 1, **({"inbounds": 1} if sym else {})})
                if s is None:
                    return None
                others = [s]
            ins = [x] + others
            rng.shuffle(ins)
            attrs = {"dim": d - rank if rng.random() < 0.2 else d}
            dt = self.result_dtype("cat", ins, attrs)
            if dt is None:
                return None
            if not is_float(dt) and not all(v.exact for v in ins):
                return None
            e = max(self.conv_err(v, dt) for v in ins) if is_float(dt) else 0.0
            return self.emit("cat", ins, attrs, min(v.lo for v in ins), max(v.hi for v in ins), e)
        raise AssertionError(op)

    # -- composites ------------------------------------------------------------

    def affine_operand(self, x, k):
        """A float value that broadcasts to x's last k dims (a norm's weight or bias)."""
        tail = x.shape[len(x.shape) - k:]
        return self.pick(lambda v: is_float(v.dtype) and not v.nan and len(v.shape) <= k and v.m <= 10
                         and bcast_ok(v.shape, tail) and all(s == "1" or s == t for s, t in zip(reversed(v.shape), reversed(tail))))

    def gen_composite(self):
        op = self.rng.choice(["softmax", "log_softmax", "layer_norm", "layer_norm_stats", "rms_norm", "rms_norm_rstd"])
        x = self.pick(lambda v: is_float(v.dtype) and len(v.shape) > 0 and not v.nan and v.m <= 100)
        if x is None:
            return None
        rank, rng = len(x.shape), self.rng
        uc = ucomp(x.dtype)
        if op in ("softmax", "log_softmax"):
            d = rng.randrange(rank)
            n = max(self.sizes([x.shape[d]], k)[0] for k in range(len(self.syms)))
            w = x.hi - x.lo
            attrs = {"dim": d - rank if rng.random() < 0.3 else d}
            if op == "softmax":
                return self.emit(op, [x], attrs, 0.0, 1.0, x.err + 4 * n * uc + rnd(x.dtype, 1.0))
            m = w + math.log(n)
            return self.emit(op, [x], attrs, -m, 0.0, 2 * x.err + 4 * uc * (m + x.m) + rnd(x.dtype, m))
        k = rng.randint(1, rank)
        n = max(math.prod(self.sizes(x.shape[rank - k:], b)) for b in range(len(self.syms)))
        eps = rng.choice([1e-5, 1e-3, 1e-2]) if op.startswith("layer") else rng.choice([1e-6, 1e-3, 1e-2])
        attrs = {"normalized_ndim": k, "eps": eps}
        sq = math.sqrt(n)
        if op == "layer_norm":
            ins = [x]
            if rng.random() < 0.6:
                w = self.affine_operand(x, k)
                if w is not None:
                    ins.append(w)
                    b = self.affine_operand(x, k) if rng.random() < 0.6 else None
                    if b is not None:
                        ins.append(b)
            mw = ins[1].m if len(ins) > 1 else 1.0
            ew = ins[1].err if len(ins) > 1 else 0.0
            mb = ins[2].m if len(ins) > 2 else 0.0
            eb = ins[2].err if len(ins) > 2 else 0.0
            # Error of (x - mean) * rstd; rstd <= 1/sqrt(eps) amplifies it where a row is nearly constant.
            e_xhat = (2 * x.err + 2 * uc * x.m * (1 + sq)) * (1 + sq) / math.sqrt(eps) + 4 * uc * sq
            m = sq * mw + mb
            return self.emit(op, ins, attrs, -m, m, e_xhat * mw + sq * ew + eb + rnd(x.dtype, m))
        if op == "rms_norm":
            ins = [x]
            if rng.random() < 0.6:
                w = self.affine_operand(x, k)
                if w is not None:
                    ins.append(w)
            mw = ins[1].m if len(ins) > 1 else 1.0
            ew = ins[1].err if len(ins) > 1 else 0.0
            e_y = x.err / math.sqrt(eps) + sq * (x.err / (2 * math.sqrt(eps)) + uc * (4 + sq))
            m = sq * mw
            return self.emit(op, ins, attrs, -m, m, e_y * mw + sq * ew + rnd(x.dtype, m))
        sdt = "f64" if x.dtype == "f64" else "f32"
        if op == "layer_norm_stats" and rng.random() < 0.5:
            attrs["which"] = "mean"
            return self.emit(op, [x], attrs, x.lo, x.hi, x.err + uc * x.m * (2 + sq) + rnd(sdt, x.m))
        if op == "layer_norm_stats":
            attrs["which"] = "rstd"
            delta = 2 * x.err + 2 * uc * x.m * (1 + sq)
        else:
            delta = x.err + uc * x.m * (1 + sq)
        hi = 1 / math.sqrt(eps)
        rel = delta / (2 * math.sqrt(eps)) + 4 * uc * (2 + sq)
        # Terminal: its absolute error is too coarse to feed further ops.
        return self.emit(op, [x], attrs, 0.0, hi, rel * hi + rnd(sdt, hi), terminal=True)

    # -- the graph ---------------------------------------------------------------

    def build(self):
        self.make_inputs()
        gens = [(self.gen_unary, 6), (self.gen_binary, 8), (self.gen_compare, 2), (self.gen_where, 2),
                (self.gen_cast, 3), (self.gen_clamp, 1), (self.gen_full, 0.3), (self.gen_reduction, 4),
                (self.gen_layout, 4), (self.gen_composite, 2.5)]
        target = self.rng.randint(18, 30)
        made = tries = 0
        while made < target and tries < 400:
            tries += 1
            f = self.rng.choices([g for g, _ in gens], [w for _, w in gens])[0]
            if f():
                made += 1
        n_out = min(len(self.values), self.rng.randint(6, 9))
        # The last values, every terminal one (each would otherwise be dead), and random intermediates.
        outs = self.values[-3:]
        outs += [v for v in self.values if v.terminal and v not in outs][:4]
        rest = [v for v in self.values if v not in outs]
        outs += self.rng.sample(rest, max(0, min(len(rest), n_out - len(outs))))
        if self.rng.random() < 0.05:
            outs.append(self.pool[0])  # a graph input returned as an output
        self.rng.shuffle(outs)
        self.b.set_outputs([v.id for v in outs])
        layouts = []  # runs on non-contiguous inputs, after the contiguous one
        if self.rng.random() < 0.6:
            layouts.append([self.rng.choice(["contiguous", "transposed", "strided", "offset", "expanded"])
                            for _ in self.input_specs])
        return Case(self.index, self.b.text(), self.input_specs, self.syms, outs, layouts, self.ops, self.empty_parts)


def make_case(index, seed=SEED):
    return GraphGen(seed, index).build()


# -- inputs ----------------------------------------------------------------------

def concrete(shape, binding):
    env = {"min": min, "max": max, **binding}
    return [int(eval(d, {"__builtins__": {}}, env)) for d in shape]  # noqa: S307


def make_tensor(dtype, shape, layout, g):
    """A tensor of `shape` with random values in the inputs' ranges, laid out as asked."""
    tdt = TORCH_DTYPES[dtype]

    def values(sh):
        if dtype == "b8":
            return torch.rand(sh, generator=g) > 0.5
        if dtype in INTS:
            return torch.randint(-INPUT_RANGE["int"], INPUT_RANGE["int"], sh, generator=g, dtype=tdt)
        r = INPUT_RANGE["float"]
        return torch.randn(sh, generator=g, dtype=torch.float64).clamp(-r, r).to(tdt)

    rank = len(shape)
    if layout == "transposed" and rank >= 2:
        return values(list(reversed(shape))).permute(*reversed(range(rank)))
    if layout == "strided" and rank >= 1:
        big = values(shape[:-1] + [2 * shape[-1] + 1])
        return big[..., 1::2]
    if layout == "offset":
        flat = values([math.prod(shape) + 3])
        return flat[3:].view(shape)
    if layout == "expanded" and rank >= 1:
        dims = [i for i, s in enumerate(shape) if s > 1]
        if dims:
            small = list(shape)
            small[dims[int(torch.randint(len(dims), (1,), generator=g))]] = 1
            return values(small).expand(shape)
    return values(shape)


def describe_inputs(case, inputs):
    lines = []
    for (name, dt, shape), t in zip(case.inputs, inputs):
        lines.append(f"  {name}: {dt} declared {shape} -> shape {list(t.shape)} strides {list(t.stride())} "
                     f"storage_offset {t.storage_offset()}")
    return "\n".join(lines)


def tolerance(v):
    if not is_float(v.dtype):
        return 0.0, 0.0
    return 2.0 * U[v.dtype], 2.0 * v.err + 1e-30


def check_run(case, cg, inputs, label, device="cpu"):
    # CUDA: the same values in the same layouts (storage offsets too, so the
    # vector twins' alignment checks see what they see on the CPU).
    got = run_compiled(cg, [same_layout_on(t, device) for t in inputs] if device != "cpu" else inputs)
    got = [g.cpu() for g in got]
    want = oracle(case.text, inputs)
    assert len(got) == len(want) == len(case.outputs)
    for i, (g, w, v) in enumerate(zip(got, want, case.outputs)):
        rtol, atol = tolerance(v)
        try:
            assert g.dtype == w.dtype, f"dtype {g.dtype} vs oracle {w.dtype}"
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as e:
            pytest.fail(
                f"fuzz graph {case.index} (OPFUSE_FUZZ_SEED={SEED} OPFUSE_FUZZ_ONLY={case.index}), run '{label}': "
                f"output {i} (%{v.id} {v.op}, {v.dtype}) differs from the oracle "
                f"(rtol={rtol:.3g}, atol={atol:.3g}):\n{e}\n\ninputs:\n{describe_inputs(case, inputs)}\n\n{case.text}\n"
                f"plan:\n{cg.plan_text()}",
                pytrace=False,
            )


def run_case(case, device="cpu"):
    try:
        return _run_case(case, device)
    except Exception as e:  # a crash in the compiler: say which graph
        pytest.fail(f"fuzz graph {case.index} (OPFUSE_FUZZ_SEED={SEED} OPFUSE_FUZZ_ONLY={case.index}) raised "
                    f"{type(e).__name__}: {str(e)[:3000]}\n\n{case.text}", pytrace=False)


def _run_case(case, device="cpu"):
    cg = _C.CompiledGraph(case.text, target="cuda") if device == "cuda" else _C.CompiledGraph(case.text)
    g = torch.Generator().manual_seed(SEED * 1000 + case.index)
    base = case.bindings[0]
    shapes = [concrete(s, base) for _, _, s in case.inputs]
    check_run(case, cg, [make_tensor(dt, sh, "contiguous", g) for (_, dt, _), sh in zip(case.inputs, shapes)],
              "contiguous", device)
    for layout in case.layouts:
        ins = [make_tensor(dt, sh, lay, g) for (_, dt, _), sh, lay in zip(case.inputs, shapes, layout)]
        check_run(case, cg, ins, "layouts " + ",".join(layout), device)
    if len(case.bindings) > 1:
        # Symbolic sizes: the same compiled graph at other sizes.
        shapes = [concrete(s, case.bindings[1]) for _, _, s in case.inputs]
        check_run(case, cg, [make_tensor(dt, sh, "contiguous", g) for (_, dt, _), sh in zip(case.inputs, shapes)],
                  f"sizes {case.bindings[1]}", device)
    return cg


INDICES = ONLY or list(range(NUM_GRAPHS))


@pytest.mark.parametrize("index", INDICES)
def test_random_graph_matches_oracle(index, device):
    """The CPU kernels; on a GPU machine the CUDA kernels of the same graphs
    too (the same inputs, layouts and sizes, against the same oracle)."""
    run_case(make_case(index), device)


REQUIRED_OPS = {
    "add", "sub", "mul", "div", "neg", "abs", "exp", "log", "sqrt", "rsqrt", "pow", "relu", "gelu", "silu", "sigmoid",
    "tanh", "erf", "sin", "cos", "maximum", "minimum", "clamp", "where", "eq", "lt", "gt", "cast", "logical_and",
    "sum", "mean", "amax", "amin", "var", "argmax", "argmin", "prod", "permute", "reshape", "expand", "slice", "unsqueeze",
    "squeeze", "cat", "softmax", "log_softmax", "layer_norm", "layer_norm_stats", "rms_norm", "scalar",
}


@pytest.mark.skipif(bool(ONLY), reason="a chosen subset of graphs")
def test_fuzzer_covers_the_op_registry():
    """The default run really exercises hundreds of ops of every kind."""
    total = collections.Counter()
    dtypes = set()
    casts = set()
    empty_parts = 0
    for i in INDICES:
        case = make_case(i)
        total.update(case.ops)
        empty_parts += case.empty_parts
        dtypes.update(dt for _, dt, _ in case.inputs)
        for line in case.text.splitlines():
            if " cast(" in line:
                casts.add(line.split("dtype=")[1].split("}")[0])
    assert REQUIRED_OPS <= set(total), f"never generated: {sorted(REQUIRED_OPS - set(total))}"
    # About 1 graph in 30 (a symbolic dim, smaller at the second binding, cut
    # by a cat): the default seed's 40 have one (graph 13); asked of 200 or more.
    assert empty_parts >= 1 or NUM_GRAPHS < 200, "no graph has a cat part that the second binding empties"
    assert sum(v for k, v in total.items() if k != "scalar") >= 300 * NUM_GRAPHS / 40, total
    assert dtypes >= {"f32", "f64", "bf16", "f16", "i32", "i64", "b8"}, dtypes
    assert casts >= {"f32", "f64", "bf16", "f16", "i32", "i64", "b8"}, casts
    assert set(_C.op_names()) >= set(total), "the fuzzer used an op the registry lacks"


# -- regressions: compiler bugs the fuzzer found, as minimal graphs -------------------

def check_text(text, inputs):
    cg = _C.CompiledGraph(text)
    for g, w in zip(run_compiled(cg, inputs), oracle(text, inputs)):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_regression_an_integer_zero_made_float_is_positive():
    """(float)(int32_t)x became a truncation of x under -fno-trapping-math,
    -0.0 for x in (-1, 0), so 1 / float(int(x)) was -inf where PyTorch gives
    inf (seed 3939, graph 115)."""
    text = """graph {
  %0 = input() {name="x"} : bf16[8]
  %1 = cast(%0) {dtype=i32} : i32[8]
  %2 = cast(%1) {dtype=f16} : f16[8]
  %3 = reciprocal(%2) : f16[8]
  %4 = input() {name="y"} : f64[8]
  %5 = cast(%4) {dtype=i64} : i64[8]
  %6 = cast(%5) {dtype=f64} : f64[8]
  %7 = reciprocal(%6) : f64[8]
  return (%3, %7)
}"""
    x = torch.tensor([-0.4, 0.4, -1.5, 2.5, -0.0, 0.0, -3.7, 3.7], dtype=torch.bfloat16)
    check_text(text, [x, x.double()])


def test_regression_argmax_over_a_size_one_dim():
    """Emitted C++ used the loop variable of the size-1 axis, which has none (fixed in 3c0d046)."""
    text = """graph {
  %0 = input() {name="x"} : f32[1, 5]
  %1 = argmax(%0) {dims=[0]} : i64[5]
  return (%1)
}"""
    check_text(text, [torch.randn(1, 5)])


def test_regression_argmax_without_dims_is_the_flattened_index():
    """The index was the one along the first reduced axis only (fixed in 3c0d046)."""
    text = """graph {
  %0 = input() {name="x"} : f32[3, 5]
  %1 = argmax(%0) : i64[]
  return (%1)
}"""
    x = torch.zeros(3, 5)
    x[1, 4] = 1.0  # the flattened index is 9 (torch.argmax(x) == 9); the kernel gave 1
    check_text(text, [x])
