"""Direct access to opfuse's skinny GEMM kernel (the GEMM path for M <= 16 on
the GPU, src/kernels/skinny_gemm/): for tests and the microbenchmark. Graphs
compiled by opfuse use it for every GEMM it supports when
OPFUSE_SKINNY_GEMM=1, for none with =0, and by default for the shapes where
it was measured on the H200 (sm_90, N and K of 4096 to 16384:
_C.skinny_gemm_default_takes; GEMM pairs stay with cuBLASLt). linear()
follows the same switch."""
from __future__ import annotations

import torch

from opfuse import _C

_ELEM = {torch.bfloat16: "bf16", torch.float16: "f16"}


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
           activation: str = "", aux: bool = False, out: torch.Tensor | None = None, up: torch.Tensor | None = None):
    """act(x @ w.T + bias + residual) for x [M, K], w [N, K] (nn.Linear's
    layout), bias [N], residual [M, N], on the current stream; with `up`
    ([M, K] like x) the gated form, (silu(x) * up) @ w.T + ..., the product
    rounded to x's dtype. Returns (out, aux or None), or None when the kernel
    does not take the problem (nothing is launched then)."""
    if x.dtype not in _ELEM or w.dtype != x.dtype or x.dim() != 2 or w.dim() != 2 or not x.is_cuda:
        return None
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        return None
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype or up.stride(1) != 1 or up.device != x.device):
        return None
    _C.ensure_cuda_context(x.device.index)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    aux_t = torch.empty(m, n, dtype=x.dtype, device=x.device) if aux else None
    ok = _C.skinny_gemm(_ELEM[x.dtype], m, n, k, x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), out.data_ptr(),
                        bias=bias.data_ptr() if bias is not None else 0,
                        bias_stride=bias.stride(0) if bias is not None else 1,
                        c=residual.data_ptr() if residual is not None else 0,
                        ldc=residual.stride(0) if residual is not None else 0,
                        activation=activation, aux=aux_t.data_ptr() if aux_t is not None else 0,
                        stream=_stream(x.device), a2=up.data_ptr() if up is not None else 0,
                        lda2=up.stride(0) if up is not None else 0)
    return (out, aux_t) if ok else None


def reference(x: torch.Tensor, w: torch.Tensor, bias=None, residual=None, activation: str = "", up=None):
    """The C++ float64 reference (skinny_gemm_reference.h): (out, aux) as
    float64 CPU tensors holding values of x's dtype; `up`: the gated form."""
    xd, wd = x.detach().double().cpu(), w.detach().double().cpu()
    ud = up.detach().double().cpu() if up is not None else None
    bd = bias.detach().double().cpu() if bias is not None else None
    cd = residual.detach().double().cpu() if residual is not None else None
    m, k = xd.shape
    n = wd.shape[0]
    out = torch.empty(m, n, dtype=torch.float64)
    aux = torch.empty(m, n, dtype=torch.float64)
    _C.skinny_gemm_reference(_ELEM[x.dtype], m, n, k, xd.data_ptr(), xd.stride(0), wd.data_ptr(), wd.stride(0),
                             out.data_ptr(), bias=bd.data_ptr() if bd is not None else 0,
                             bias_stride=bd.stride(0) if bd is not None else 1,
                             c=cd.data_ptr() if cd is not None else 0, ldc=cd.stride(0) if cd is not None else 0,
                             activation=activation, aux=aux.data_ptr(),
                             a2=ud.data_ptr() if ud is not None else 0, lda2=ud.stride(0) if ud is not None else 0)
    return out, aux


def launch_count() -> int:
    """Skinny GEMM launches in this process (all callers)."""
    return _C.skinny_gemm_launch_count()


def last_error() -> str:
    """Why the last instantiation could not be built or loaded (then cuBLASLt ran)."""
    return _C.skinny_gemm_last_error()


def last_config() -> str:
    """The config tag of the last launch, e.g. "n4w4s11c1" (the TMA kernel) or
    "n8u1w8b1c2p1g1" (the register kernel); "" before the first."""
    return _C.skinny_gemm_last_config()
