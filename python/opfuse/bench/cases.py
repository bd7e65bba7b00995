"""The benchmark cases: the seed's chain and the row-wise reductions.

A case is a plain function plus an input factory, so every implementation
(eager, Inductor, opfuse) runs exactly the same Python code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

DTYPE_LABEL = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
               torch.float64: "f64"}


# --- the functions under test (module level, so subprocesses can import them) ---

def seed_chain(x, b1, b2):
    """The seed's section 3: four memory-bound ops that fusion turns into one."""
    return torch.relu(x + b1) * 0.5 + b2


def softmax(x):
    return torch.softmax(x, dim=-1)


def log_softmax(x):
    return torch.log_softmax(x, dim=-1)


def layer_norm(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)


def rms_norm(x, weight):
    return F.rms_norm(x, (x.shape[-1],), weight, eps=1e-6)


ROW_FUNCTIONS = {"softmax": softmax, "log_softmax": log_softmax,
                 "layer_norm": layer_norm, "rms_norm": rms_norm}

# Arithmetic per element, for the roofline's x axis (FLOPs per byte). A
# convention, counting each add, mul, max, exp or divide as one: the chain is
# add, max, mul, add; softmax is max, sub, exp, sum, div; log_softmax is max,
# sub, exp, sum, sub; layer_norm is sum, sub, square, sum, mul, mul, add;
# rms_norm is square, sum, mul, mul.
FLOPS_PER_ELEMENT = {"chain": 4, "softmax": 5, "log_softmax": 5, "layer_norm": 7,
                     "rms_norm": 4}


@dataclass
class Case:
    suite: str
    name: str
    fn: Callable
    make_inputs: Callable[[torch.device, int], tuple]  # (device, seed) -> inputs
    dtype: torch.dtype
    shape: tuple
    flops: float | None = None  # FLOPs per call (FLOPS_PER_ELEMENT for memory-bound cases)
    extra: dict = field(default_factory=dict)


def _randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _size_label(n: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def chain_case(n: int, dtype: torch.dtype) -> Case:
    def make(device, seed):
        gen = _generator(device, seed)
        return tuple(_randn((n,), dtype, device, gen) for _ in range(3))
    return Case("chain", f"chain-{_size_label(n)}-{DTYPE_LABEL[dtype]}", seed_chain, make,
                dtype, (n,), flops=FLOPS_PER_ELEMENT["chain"] * n)


def row_case(op: str, rows: int, cols: int, dtype: torch.dtype) -> Case:
    def make(device, seed):
        gen = _generator(device, seed)
        x = _randn((rows, cols), dtype, device, gen)
        if op == "layer_norm":
            return (x, _randn((cols,), dtype, device, gen), _randn((cols,), dtype, device, gen))
        if op == "rms_norm":
            return (x, _randn((cols,), dtype, device, gen))
        return (x,)
    return Case("rows", f"{op}-{rows}x{cols}-{DTYPE_LABEL[dtype]}", ROW_FUNCTIONS[op], make,
                dtype, (rows, cols), flops=FLOPS_PER_ELEMENT[op] * rows * cols)


def chain_cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type == "cuda":
        sizes = [4 << 20] if quick else [4 << 20, 16 << 20, 64 << 20]
        return [chain_case(n, dt) for dt in (torch.float32, torch.bfloat16) for n in sizes]
    return [chain_case((1 << 20) if quick else (16 << 20), torch.float32)]


def rows_cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type == "cuda":
        shapes = [(32768, 4096)] if quick else [(32768, 4096), (8192, 32768),
                                                (4096, 262144), (262144, 256)]
        dtype = torch.bfloat16
    else:
        shapes = [(512, 1024)] if quick else [(4096, 4096)]
        dtype = torch.float32
    return [row_case(op, r, c, dtype) for (r, c) in shapes for op in ROW_FUNCTIONS]


def linear_operands(m: int, k: int, n: int, device, seed: int = 0, dtype=torch.bfloat16):
    """x [m, k], an nn.Linear weight w [n, k] scaled by k^-1/2 and a bias
    [n], the decode GEMM scripts' operands (scripts/bench_skinny_gemm.py,
    skinny_call_cost.py, skinny_timeline.py)."""
    torch.manual_seed(seed)
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    return x, w, torch.randn(n, device=device).to(dtype)


def mlp_block(x, w1, b1, w2, b2):
    """The seed's section 5.1 block relu(x @ w1 + b1) @ w2 + b2, as nn.Linear layers."""
    return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


def llama_mlp(x, w1, w3, w2):
    """Llama's MLP (silu(x @ w1) * (x @ w3)) @ w2, as nn.Linear layers."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def gemm_case(kind: str, m: int, k: int, h: int, dtype: torch.dtype) -> Case:
    def make(device, seed):
        gen = _generator(device, seed)
        r = lambda *shape, scale=1.0: (_randn(shape, torch.float32, device, gen) * scale).to(dtype)
        x = r(m, k)
        if kind == "mlp":
            return (x, r(h, k, scale=k ** -0.5), r(h), r(k, h, scale=h ** -0.5), r(k))
        return (x, r(h, k, scale=k ** -0.5), r(h, k, scale=k ** -0.5), r(k, h, scale=h ** -0.5))
    fn, gemms = (mlp_block, 2) if kind == "mlp" else (llama_mlp, 3)
    return Case("gemm", f"{kind}-{m}x{k}x{h}-{DTYPE_LABEL[dtype]}", fn, make, dtype, (m, k, h),
                flops=2.0 * m * k * h * gemms)


def gemm_cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type == "cuda":
        shapes = [("mlp", 16, 4096, 16384)] if quick else [
            ("mlp", 8192, 4096, 16384), ("mlp", 16, 4096, 16384),
            ("llama", 8192, 4096, 11008), ("llama", 16, 4096, 11008)]
        return [gemm_case(kind, m, k, h, torch.bfloat16) for kind, m, k, h in shapes]
    shapes = [("mlp", 16, 256, 512)] if quick else [("mlp", 512, 512, 2048), ("llama", 512, 512, 1376)]
    return [gemm_case(kind, m, k, h, torch.float32) for kind, m, k, h in shapes]


def softmax_backward(dy, y):
    """The gradient kernel of softmax, as AOTAutograd's backward graph has it."""
    return torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype)


def layer_norm_backward(dy, x, mean, rstd, weight, bias):
    """dx, dweight and dbias of layer_norm, as AOTAutograd's backward graph has it."""
    return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, weight, bias,
                                                     [True, True, True])


# softmax backward: mul, sum, sub, mul; layer_norm backward (dx): about 10 per
# element, plus 3 for dweight and dbias.
FLOPS_PER_ELEMENT.update({"softmax_backward": 4, "layer_norm_backward": 13})


def row_backward_case(op: str, rows: int, cols: int, dtype: torch.dtype) -> Case:
    def make(device, seed):
        gen = _generator(device, seed)
        x = _randn((rows, cols), dtype, device, gen)
        dy = _randn((rows, cols), dtype, device, gen)
        if op == "softmax_backward":
            return (dy, torch.softmax(x.float(), -1).to(dtype))
        w, b = _randn((cols,), dtype, device, gen), _randn((cols,), dtype, device, gen)
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, [cols], w, b, 1e-5)
        return (dy, x, mean, rstd, w, b)
    fn = softmax_backward if op == "softmax_backward" else layer_norm_backward
    return Case("rows_bwd", f"{op}-{rows}x{cols}-{DTYPE_LABEL[dtype]}", fn, make, dtype, (rows, cols),
                flops=FLOPS_PER_ELEMENT[op] * rows * cols)


def rows_backward_cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type == "cuda":
        shapes = [(32768, 4096)] if quick else [(32768, 4096), (8192, 32768), (262144, 256)]
        dtype = torch.bfloat16
    else:
        shapes, dtype = [(512, 1024)] if quick else [(4096, 4096)], torch.float32
    return [row_backward_case(op, r, c, dtype) for (r, c) in shapes
            for op in ("softmax_backward", "layer_norm_backward")]


SUITES = {"chain": chain_cases, "rows": rows_cases, "rows_bwd": rows_backward_cases, "gemm": gemm_cases}
