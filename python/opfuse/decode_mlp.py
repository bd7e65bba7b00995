"""Direct access to opfuse's decode MLP kernel (src/kernels/decode_mlp/): one
persistent kernel for a whole MLP block at M <= 16 on sm_90, for tests and
the benchmark. Graphs compiled by opfuse reach it through the planner's
decode-MLP step (src/fusion/decode_mlp.cpp) when OPFUSE_DECODE_MLP=1: opt-in,
because on the H200 it was slower than the cuBLASLt chain (docs/perf-notes.md)."""
from __future__ import annotations

import torch

from opfuse import _C
from opfuse.frontend.runtime import zeroed_workspace

_ELEM = {torch.bfloat16: "bf16", torch.float16: "f16"}


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b1: torch.Tensor | None = None,
        b2: torch.Tensor | None = None, activation: str = "relu", w3: torch.Tensor | None = None,
        out: torch.Tensor | None = None):
    """act(x @ w1.T + b1) @ w2.T + b2, or with activation="silu_gate"
    (silu(x @ w1.T) * (x @ w3.T)) @ w2.T + b2, for x [M, K], weights in
    nn.Linear's layout ([rows, K], K unit-stride), on the current stream.
    Returns out [M, N], or raises RuntimeError with the reason when the kernel
    does not take the problem (nothing is launched then)."""
    if x.dtype not in _ELEM or x.dim() != 2 or not x.is_cuda:
        raise RuntimeError("decode MLP: x must be a 2-D bf16 or f16 CUDA tensor")
    for t in (w1, w2, w3):
        if t is not None and (t.dtype != x.dtype or t.dim() != 2 or t.stride(1) != 1):
            raise RuntimeError("decode MLP: weights must be 2-D, x's dtype, unit-stride rows")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise RuntimeError("decode MLP: x's rows must be unit-stride")
    m, k = x.shape
    h, n = w1.shape[0], w2.shape[0]
    if w1.shape[1] != k or w2.shape[1] != h or (w3 is not None and tuple(w3.shape) != (h, k)):
        raise RuntimeError("decode MLP: shapes do not chain")
    _C.ensure_cuda_context(x.device.index)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    stream = torch.cuda.current_stream(x.device).cuda_stream
    ws = zeroed_workspace(x.device.index, stream)
    ok, why = _C.decode_mlp(_ELEM[x.dtype], m, k, h, n, x.data_ptr(), x.stride(0), w1.data_ptr(), w1.stride(0),
                            w3.data_ptr() if w3 is not None else 0, w3.stride(0) if w3 is not None else 0,
                            b1.data_ptr() if b1 is not None else 0, b1.stride(0) if b1 is not None else 1,
                            w2.data_ptr(), w2.stride(0), b2.data_ptr() if b2 is not None else 0,
                            b2.stride(0) if b2 is not None else 1, out.data_ptr(), out.stride(0), activation,
                            stream, ws.data_ptr(), ws.numel())
    if not ok:
        raise RuntimeError("decode MLP: " + why)
    return out


def reference(x, w1, w2, b1=None, b2=None, activation: str = "relu", w3=None):
    """The C++ float64 reference (decode_mlp_reference.h): (out, h) as float64
    CPU tensors holding values of x's dtype."""
    d = lambda t: t.detach().double().cpu() if t is not None else None
    xd, w1d, w2d, w3d, b1d, b2d = d(x), d(w1), d(w2), d(w3), d(b1), d(b2)
    m, k = xd.shape
    h, n = w1d.shape[0], w2d.shape[0]
    out = torch.empty(m, n, dtype=torch.float64)
    hidden = torch.empty(m, h, dtype=torch.float64)
    ptr = lambda t: t.data_ptr() if t is not None else 0
    _C.decode_mlp_reference(_ELEM[x.dtype], m, k, h, n, ptr(xd), xd.stride(0), ptr(w1d), w1d.stride(0), ptr(w3d),
                            w3d.stride(0) if w3d is not None else 0, ptr(b1d), b1d.stride(0) if b1d is not None else 1,
                            ptr(w2d), w2d.stride(0), ptr(b2d), b2d.stride(0) if b2d is not None else 1,
                            out.data_ptr(), hidden.data_ptr(), activation)
    return out, hidden


def compile(dtype: torch.dtype, gated: bool, config: str, arch: int = 90, use_cache: bool = False):
    """NVRTC build of one instantiation (no GPU needed): (cubin, log). With
    use_cache it goes through the disk cache the launches use (a warm-up);
    it releases the GIL, so builds can run in threads."""
    return _C.decode_mlp_compile(_ELEM[dtype], gated, config, arch, use_cache)


def candidates() -> list[str]:
    return _C.decode_mlp_candidates()


def launch_count() -> int:
    return _C.decode_mlp_launch_count()


def last_error() -> str:
    return _C.decode_mlp_last_error()
