"""opfuse.ops.attention: scaled dot-product attention as a torch custom op.

    o = opfuse.ops.attention(q, k, v, causal=False, scale=None, attn_mask=None, deterministic=None)

q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D] with Hq a multiple of Hkv (GQA/MQA).
Causal masking is aligned to the bottom-right corner (query i sees key j iff
j <= i + Sk - Sq; FlashAttention >= 2.1). attn_mask, broadcastable to
[B, Hq, Sq, Sk], is either boolean (True = attend) or additive (a float tensor
added to the scaled scores). A query row that sees no key gets 0, never NaN.

Paths of the forward (torch.ops.opfuse.attention returns (o, lse)):
  - CUDA, bfloat16/float16, D in {64, 96, 128, 256}, with or without an
    attn_mask: the FlashAttention-2-style kernel (src/kernels/attention/attention_fwd.cu;
    on sm_90 the Hopper kernel attention_fwd_sm90.cu for D 64/128 without a
    mask), compiled by NVRTC through the C++ launcher
    (src/runtime/attention_launcher.cpp) and launched on
    torch.cuda.current_stream(). The mask is read in place (pointer and
    strides over [B, Hq, Sq, Sk], 0 on broadcast dims) when it is bool, in q's
    dtype or float32 and its key dim is contiguous; other float dtypes go to
    float32, a non-contiguous key dim is copied (the mask's own shape); a key
    padding mask (one value per (b, key)) becomes a float32 [B, Sk] vector
    (bool: 0 / -inf) that the kernel reads once per key block;
  - CPU without a mask, float32/bfloat16/float16 (upcast to float32): the tiled
    online-softmax float32 kernel of src/kernels/attention/attention_reference.cpp;
  - CPU with a mask or float64 inputs: src/kernels/attention/attention_cpu.cpp
    (float32, or float64 for float64 inputs);
  - CUDA cases the kernel does not cover (other dtypes or head dims):
    a PyTorch math implementation on the device (float32 arithmetic, chunked
    over query rows), logged once per reason.
The log-sum-exp (float32; float64 for float64 inputs) is saved for the backward.
A row masked only by huge additive values (|mask| > 2^100 * ln 2, e.g.
finfo.min) sees its keys with equal weights, as in eager; the CUDA kernels
store a marker as its LSE, +-2^120 * (1 + log2(l) / 64) (docs/attention.md).

Paths of the backward (torch.ops.opfuse.attention_backward -> [dq, dk, dv(, dmask)]):
  - CUDA, bfloat16/float16, D in {64, 96, 128, 256}, with or without an
    attn_mask that needs no gradient (P is recomputed with it): the fused
    FlashAttention-2-style kernels (src/kernels/attention/attention_bwd.cu)
    through the C++ launcher (src/runtime/attention_bwd_launcher.cpp), with
    workspaces from PyTorch's allocator. dQ is summed with float32 atomics
    unless the backward is deterministic: `deterministic=True`, or
    `deterministic=None` (the default) while torch.use_deterministic_algorithms
    is on; then a separate dQ kernel gives bitwise-equal reruns;
  - everything else (CPU, an additive mask that requires grad, float32/float64,
    other head dims): the
    FlashAttention backward equations with PyTorch ops, P recomputed from q, k
    (a softmax of the scores; the saved LSE marks the rows that saw no key): dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)),
    dQ = scale dS K, dK = scale dS^T Q (summed over the query heads of a KV
    head), and for an additive mask that requires grad, dMask = dS summed to
    its shape; float32 (float64 for float64 inputs), chunked over query rows
    to bound the [Hq, rows, Sk] temporaries; on CUDA logged once per reason.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Optional

import torch
from torch import Tensor

from .. import _C
from ..stats import bump
from ._kernel import check_device

log = logging.getLogger("opfuse")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_HEAD_DIMS = (64, 96, 128, 256)
_CHUNK_ELEMENTS = 1 << 24  # score elements per chunk of the PyTorch paths
_logged: set = set()
_broken: dict = {}  # (device, dtype, head dim, causal) -> why the kernel failed to compile or launch


def _log_once(msg: str):
    if msg not in _logged:
        _logged.add(msg)
        log.info(msg)


def _compute_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.float64 if dt == torch.float64 else torch.float32


def _check(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor]):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"opfuse.ops.attention: {name} must be a tensor")
        if t.dim() != 4:
            raise ValueError(f"opfuse.ops.attention: {name} must be [B, H, S, D], got shape {list(t.shape)}")
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"opfuse.ops.attention: q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Hq, Sq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"opfuse.ops.attention: shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
                         "do not fit q [B, Hq, Sq, D], k = v [B, Hkv, Sk, D]")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"opfuse.ops.attention: Hq ({Hq}) must be a multiple of Hkv ({Hkv})")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in _FLOATS:
            raise TypeError(f"opfuse.ops.attention: attn_mask must be bool or float, got {attn_mask.dtype}")
        if attn_mask.dim() > 4:
            raise ValueError("opfuse.ops.attention: attn_mask has more than 4 dims")
        try:
            bs = torch.broadcast_shapes(attn_mask.shape, (B, Hq, Sq, k.shape[2]))
        except RuntimeError:
            bs = None
        if bs is None or tuple(bs) != (B, Hq, Sq, k.shape[2]):
            raise ValueError(f"opfuse.ops.attention: attn_mask of shape {list(attn_mask.shape)} does not broadcast "
                             f"to [B, Hq, Sq, Sk] = {[B, Hq, Sq, k.shape[2]]}")
    check_device(q, k, v, attn_mask)


def _lse_dtype(dt):
    return torch.float64 if dt == torch.float64 else torch.float32


def _mask4(mask: Tensor) -> Tensor:
    """The mask viewed with 4 dims (leading size-1 dims)."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask


# ---------------------------------------------------------------------------
# Forward paths
# ---------------------------------------------------------------------------


def _cuda_kernel_reason(q, k, v, attn_mask, scale) -> str:
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (the kernel takes bfloat16/float16)"
    if q.shape[3] not in KERNEL_HEAD_DIMS:
        return f"head dim {q.shape[3]} (the kernel takes {KERNEL_HEAD_DIMS})"
    if not scale > 0:
        return f"softmax scale {scale} (the kernel needs a positive scale)"
    if q.shape[0] > 65535 or q.shape[1] > 65535:
        return "batch or heads > 65535"
    if os.environ.get("OPFUSE_DISABLE") == "1":
        return "OPFUSE_DISABLE=1"
    return ""


def _mask_tag(attn_mask):
    """What a kernel failure is remembered by: the mask's dtype (None without one)."""
    return None if attn_mask is None else attn_mask.dtype


def _kernel_ready(t: Tensor) -> Tensor:
    """t itself when the kernel can read it (last dim contiguous, 16-byte
    aligned, strides multiples of 8 elements), else a contiguous copy."""
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:3]):
        return t
    return t.contiguous()


def _kernel_mask(attn_mask, B, Hq, Sq, Sk, q_dtype):
    """(kind, tensor, element strides over [B, Hq, Sq, Sk]) of an attn_mask as
    the kernels take it (kinds of src/runtime/attention_launcher.h), or
    ("", None, []) without one. Key padding (the head and query dims
    broadcast: one value per (b, key)) becomes a contiguous float32 [B, Sk]
    vector, 0 / -inf for a bool mask, read once per key block. Other masks
    are read in place when bool, in q's dtype or float32 with a contiguous key
    dim; other float dtypes go to float32 and a strided key dim is copied (the
    mask's own shape; a size-1 key dim is expanded to Sk first).
    tests/gpu/attention/attn_runtime.kernel_mask has the same rules."""
    if attn_mask is None:
        return "", None, []
    m = _mask4(attn_mask)
    e = m.expand(B, Hq, Sq, Sk)
    st = e.stride()
    if (Hq == 1 or st[1] == 0) and (Sq == 1 or st[2] == 0):
        kp = e[:, 0, 0, :]
        kp = torch.where(kp, 0.0, -math.inf) if kp.dtype == torch.bool else kp.float()
        return "keypad", kp.contiguous(), [Sk, 0, 0, 1]
    if m.dtype == torch.bool:
        kind = "full-bool"
    elif m.dtype == q_dtype:
        kind = "full-bf16" if q_dtype == torch.bfloat16 else "full-f16"
    else:
        kind = "full-f32"
        m = m.float()
    if Sk > 1 and (m.shape[3] == 1 or m.stride(-1) != 1):
        m = m.expand(*m.shape[:3], Sk).contiguous() if m.shape[3] == 1 else m.contiguous()
    e = m.expand(B, Hq, Sq, Sk)
    return kind, e, list(e.stride())


# (elem, sizes, causal, mask kind, device, OPFUSE_ATTN_SM90_SPLIT) -> attention_cuda_workspace's answer
_split_workspace: dict = {}


def _forward_cuda_kernel(q, k, v, causal, scale, attn_mask=None):
    q, k, v = _kernel_ready(q), _kernel_ready(k), _kernel_ready(v)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    mkind, mt, mstrides = _kernel_mask(attn_mask, B, Hq, Sq, Sk, q.dtype)
    o = torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    elem = "bf16" if q.dtype == torch.bfloat16 else "f16"
    ptrs = [q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr()]
    strides = [list(t.stride()[:3]) for t in (q, k, v, o)] + [list(lse.stride()[:2])]
    sizes = [B, Hq, Hkv, Sq, Sk, D]
    stream = torch.cuda.current_stream(q.device).cuda_stream
    mptr = mt.data_ptr() if mt is not None else 0
    # The Hopper kernel's split tail (non-causal calls whose tiles do not fill
    # whole rounds of SMs) merges cut tiles through a workspace whose flags
    # start at zero: from PyTorch's allocator on this stream, so CUDA graphs
    # capture the zeroing with the launch.
    # Its size depends on the shape, not the data: asked once per shape.
    key = (elem, tuple(sizes), bool(causal), mkind, q.device.index, os.environ.get("OPFUSE_ATTN_SM90_SPLIT"))
    ws_bytes, ws_zero = _split_workspace.get(key) or _split_workspace.setdefault(key, _C.attention_cuda_workspace(
        elem, ptrs, sizes, strides, bool(causal), float(scale), "", q.device.index, mkind, mptr, mstrides))
    ws = None
    if ws_bytes:
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device)
        ws[:ws_zero].zero_()
    _C.attention_cuda(elem, ptrs, sizes, strides, bool(causal), float(scale), stream, "", q.device.index,
                      mkind, mptr, mstrides, ws.data_ptr() if ws is not None else 0, ws_bytes)
    bump("kernel_launches")
    return o, lse


def _forward_cpu(q, k, v, attn_mask, causal, scale):
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    ct = _compute_dtype(q.dtype)

    def ready(t):  # compute dtype, last dim contiguous
        t = t.to(ct)
        return t if t.stride(-1) == 1 else t.contiguous()

    qc, kc, vc = ready(q), ready(k), ready(v)
    o = torch.empty((B, Hq, Sq, D), dtype=ct)
    lse = torch.empty((B, Hq, Sq), dtype=ct)
    sizes = [B, Hq, Hkv, Sq, Sk, D]
    ptrs = [qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), o.data_ptr(), lse.data_ptr()]
    if attn_mask is None and ct == torch.float32 and scale > 0:
        strides = [list(t.stride()[:3]) for t in (qc, kc, vc, o)] + [list(lse.stride()[:2])]
        _C.attention_cpu_tiled(ptrs, sizes, strides, bool(causal), float(scale))
    else:
        strides = [list(t.stride()[:3]) for t in (qc, kc, vc, o, lse)]
        kind, mptr, mstrides = "none", 0, []
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                m, kind = attn_mask, "bool"
            else:
                m, kind = attn_mask.to(ct), "additive"
            m = _mask4(m).expand(B, Hq, Sq, Sk)  # strides 0 on broadcast dims: nothing materialised
            mptr, mstrides = m.data_ptr(), list(m.stride())
            attn_mask = m  # keep alive through the call
        _C.attention_cpu("f64" if ct == torch.float64 else "f32", ptrs, sizes, strides, bool(causal), float(scale),
                         kind, mptr, mstrides)
    bump("kernel_launches")
    return o.to(q.dtype), lse


def _visible(i0, i1, Sq, Sk, causal, device):
    """Causal visibility [rows, Sk] (bottom-right aligned), or None."""
    if not causal:
        return None
    i = torch.arange(i0, i1, device=device).unsqueeze(1)
    j = torch.arange(Sk, device=device).unsqueeze(0)
    return j <= i + (Sk - Sq)


def _scores(qc, kc, mask4, b, i0, i1, causal, scale, Sq, Sk):
    """Scaled, masked scores [Hq, rows, Sk] of batch b, query rows [i0, i1)."""
    s = torch.matmul(qc[b, :, i0:i1], kc[b].transpose(-1, -2)) * scale
    hide = _visible(i0, i1, Sq, Sk, causal, s.device)
    hide = None if hide is None else ~hide
    if mask4 is not None:
        mb = mask4[b if mask4.shape[0] > 1 else 0]
        mb = mb[:, i0:i1] if mb.shape[1] > 1 else mb
        if mb.dtype == torch.bool:
            hide = ~mb if hide is None else (hide | ~mb)
        else:
            s = s + mb.to(s.dtype)
    if hide is not None:
        s = s.masked_fill(hide, -math.inf)
    return s


def _row_chunk(Hq, Sk):
    return max(1, _CHUNK_ELEMENTS // max(1, Hq * max(Sk, 1)))


def _expand_kv(t, G):
    return t if G == 1 else t.repeat_interleave(G, dim=1)


def _forward_math(q, k, v, attn_mask, causal, scale):
    """PyTorch ops on q's device (the CUDA path for cases the kernel does not cover)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    ct = _compute_dtype(q.dtype)
    qc = q.to(ct)
    kc, vc = _expand_kv(k.to(ct), Hq // Hkv), _expand_kv(v.to(ct), Hq // Hkv)
    mask4 = None if attn_mask is None else _mask4(attn_mask)
    o = torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=ct, device=q.device)
    step = _row_chunk(Hq, Sk)
    for b in range(B):
        for i0 in range(0, Sq, step):
            i1 = min(Sq, i0 + step)
            s = _scores(qc, kc, mask4, b, i0, i1, causal, scale, Sq, Sk)
            m = torch.logsumexp(s, dim=-1, keepdim=True) if Sk > 0 else torch.full(
                (Hq, i1 - i0, 1), -math.inf, dtype=ct, device=q.device)
            p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
            p = torch.where(torch.isinf(m), torch.zeros_like(p), p)
            o[b, :, i0:i1] = torch.matmul(p, vc[b]).to(q.dtype)
            lse[b, :, i0:i1] = m.squeeze(-1)
    return o, lse


# ---------------------------------------------------------------------------
# Backward paths
# ---------------------------------------------------------------------------


def _backward_cuda_kernel(grad, q, k, v, o, lse, causal, scale, deterministic, attn_mask=None):
    """The fused backward kernels (attention_bwd.cu): [dq, dk, dv] in q's dtype."""
    q, k, v, o, grad = (_kernel_ready(t) for t in (q, k, v, o, grad))
    lse = lse if lse.stride(-1) == 1 else lse.contiguous()
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    mkind, mt, mstrides = _kernel_mask(attn_mask, B, Hq, Sq, Sk, q.dtype)
    dq = torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, Hkv, Sk, D), dtype=q.dtype, device=q.device)
    dv = torch.empty((B, Hkv, Sk, D), dtype=q.dtype, device=q.device)
    rows = _C.attention_backward_padded_rows(Sq)
    delta = torch.empty((B, Hq, rows), dtype=torch.float32, device=q.device)
    # With a mask, lse2 holds two arrays: L2, then the rows' scales of S
    # (attention_bwd.cu, attn_bwd_row_terms: rows masked only by huge values).
    lse2 = torch.empty((2 if mt is not None else 1, B, Hq, rows), dtype=torch.float32, device=q.device)
    acc_cols = _C.attention_backward_accum_cols(D)  # 128 at D = 96 (the Hopper backward runs it as 128)
    acc = None if deterministic else torch.empty((B, Hq, rows, acc_cols), dtype=torch.float32, device=q.device)
    elem = "bf16" if q.dtype == torch.bfloat16 else "f16"
    ts = (q, k, v, o, grad, dq, dk, dv)
    ptrs = [t.data_ptr() for t in ts] + [lse.data_ptr(), delta.data_ptr(), lse2.data_ptr(),
                                         acc.data_ptr() if acc is not None else 0]
    strides = [list(t.stride()[:3]) for t in ts] + [list(lse.stride()[:2])]
    stream = torch.cuda.current_stream(q.device).cuda_stream
    _C.attention_backward_cuda(elem, ptrs, [B, Hq, Hkv, Sq, Sk, D], strides, bool(causal), float(scale),
                               bool(deterministic), stream, q.device.index, mkind,
                               mt.data_ptr() if mt is not None else 0, mstrides)
    # preprocess and dQ (convert or the deterministic kernel) when Sq > 0, dK/dV when Sk > 0
    bump("kernel_launches", 0 if B * Hq == 0 else 2 * (Sq > 0) + (Sk > 0))
    return [dq, dk, dv]


def _backward_math(grad, q, k, v, o, lse, attn_mask, causal, scale, want_dmask):
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    ct = _compute_dtype(q.dtype)
    qc, gc, oc = q.to(ct), grad.to(ct), o.to(ct)
    kc, vc = _expand_kv(k.to(ct), G), _expand_kv(v.to(ct), G)
    mask4 = None if attn_mask is None else _mask4(attn_mask)
    dq = torch.zeros((B, Hq, Sq, D), dtype=ct, device=q.device)
    dk = torch.zeros((B, Hq, Sk, D), dtype=ct, device=q.device)
    dv = torch.zeros((B, Hq, Sk, D), dtype=ct, device=q.device)
    dmask = torch.zeros(mask4.shape, dtype=ct, device=q.device) if want_dmask else None
    delta = (gc * oc).sum(-1, keepdim=True)  # rowsum(dO * O): [B, Hq, Sq, 1]
    step = _row_chunk(Hq, Sk)
    for b in range(B):
        for i0 in range(0, Sq, step):
            i1 = min(Sq, i0 + step)
            s = _scores(qc, kc, mask4, b, i0, i1, causal, scale, Sq, Sk)
            dead = torch.isinf(lse[b, :, i0:i1]).unsqueeze(-1)  # rows that saw no key: P = 0
            # P recomputed as a softmax rather than exp(S - LSE): a row masked
            # only by huge additive values (finfo.min) has scores that all
            # equal the mask value, where LSE = m + log(l) rounds to m and
            # exp(S - LSE) would give 1 instead of 1/l (and the CUDA forward
            # stores a marker there, attention_ptx.cu, huge_row_lse).
            p = torch.where(dead, torch.zeros_like(s), torch.softmax(s, dim=-1))
            g = gc[b, :, i0:i1]
            dv[b] += torch.matmul(p.transpose(-1, -2), g)
            dp = torch.matmul(g, vc[b].transpose(-1, -2))
            ds = p * (dp - delta[b, :, i0:i1])
            dq[b, :, i0:i1] = torch.matmul(ds, kc[b]) * scale
            dk[b] += torch.matmul(ds.transpose(-1, -2), qc[b, :, i0:i1]) * scale
            if want_dmask:
                r = ds if mask4.shape[1] > 1 else ds.sum(0, keepdim=True)
                r = r if mask4.shape[3] > 1 else r.sum(-1, keepdim=True)
                bi = b if mask4.shape[0] > 1 else 0
                if mask4.shape[2] > 1:
                    dmask[bi, :, i0:i1] += r
                else:
                    dmask[bi] += r.sum(1, keepdim=True)
    if G > 1:
        dk = dk.view(B, Hkv, G, Sk, D).sum(2)
        dv = dv.view(B, Hkv, G, Sk, D).sum(2)
    out = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
    if want_dmask:
        out.append(dmask.reshape(attn_mask.shape).to(attn_mask.dtype))
    return out


# ---------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------


@torch.library.custom_op("opfuse::attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], causal: bool,
                  scale: float, deterministic: int = -1) -> tuple[Tensor, Tensor]:
    # deterministic (-1: torch.are_deterministic_algorithms_enabled() when the
    # backward runs, 0: no, 1: yes) only travels to the backward.
    _check(q, k, v, attn_mask)
    if q.device.type == "cpu":
        if os.environ.get("OPFUSE_DISABLE") == "1":
            return _forward_math(q, k, v, attn_mask, causal, scale)
        return _forward_cpu(q, k, v, attn_mask, causal, scale)
    why = _cuda_kernel_reason(q, k, v, attn_mask, scale)
    broken = (q.device.index, q.dtype, q.shape[3], bool(causal), _mask_tag(attn_mask))
    if not why and broken in _broken:
        why = f"the kernel failed before: {_broken[broken]}"
    if not why:
        try:
            return _forward_cuda_kernel(q, k, v, causal, scale, attn_mask)
        except (RuntimeError, ValueError) as e:  # NVRTC or the driver missing or refusing: fall back, never crash
            _broken[broken] = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.warning("opfuse.ops.attention: the CUDA kernel failed (%s); using the PyTorch math path", e)
            why = "a kernel failure"
    _log_once(f"opfuse.ops.attention: PyTorch math path on {q.device.type} for {why}")
    return _forward_math(q, k, v, attn_mask, causal, scale)


@_attention_op.register_fake
def _(q, k, v, attn_mask, causal, scale, deterministic=-1):
    _check(q, k, v, attn_mask)
    B, Hq, Sq, D = q.shape
    return q.new_empty((B, Hq, Sq, D)), q.new_empty((B, Hq, Sq), dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("opfuse::attention_backward", mutates_args=())
def _attention_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                           attn_mask: Optional[Tensor], causal: bool, scale: float,
                           mask_grad: bool, deterministic: int = -1) -> list[Tensor]:
    want = bool(mask_grad) and attn_mask is not None and attn_mask.dtype != torch.bool
    if q.device.type == "cuda":
        why = _cuda_kernel_reason(q, k, v, attn_mask, scale)
        if not why and (lse.dtype != torch.float32 or grad.dtype != q.dtype or o.dtype != q.dtype):
            why = "saved tensors of another dtype"
        if not why and want:
            why = "the gradient of an additive attn_mask (the kernels compute none)"
        broken = ("bwd", q.device.index, q.dtype, q.shape[3], bool(causal), _mask_tag(attn_mask))
        if not why and broken in _broken:
            why = f"the backward kernel failed before: {_broken[broken]}"
        if not why:
            det = torch.are_deterministic_algorithms_enabled() if deterministic < 0 else bool(deterministic)
            try:
                return _backward_cuda_kernel(grad, q, k, v, o, lse, causal, scale, det, attn_mask)
            except (RuntimeError, ValueError) as e:  # NVRTC or the driver refusing: fall back, never crash
                _broken[broken] = str(e).splitlines()[0] if str(e) else type(e).__name__
                log.warning("opfuse.ops.attention: the CUDA backward kernel failed (%s); using PyTorch ops", e)
                why = "a kernel failure"
        _log_once(f"opfuse.ops.attention: PyTorch backward path on cuda for {why}")
    return _backward_math(grad, q, k, v, o, lse, attn_mask, causal, scale, want)


@_attention_backward_op.register_fake
def _(grad, q, k, v, o, lse, attn_mask, causal, scale, mask_grad, deterministic=-1):
    out = [torch.empty_like(q, memory_format=torch.contiguous_format),
           torch.empty_like(k, memory_format=torch.contiguous_format),
           torch.empty_like(v, memory_format=torch.contiguous_format)]
    if mask_grad and attn_mask is not None and attn_mask.dtype != torch.bool:
        out.append(torch.empty_like(attn_mask, memory_format=torch.contiguous_format))
    return out


def _attention_setup(ctx, inputs, output):
    q, k, v, attn_mask, causal, scale = inputs[:6]
    o, lse = output
    ctx.causal, ctx.scale = causal, scale
    ctx.deterministic = inputs[6] if len(inputs) > 6 else -1
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, attn_mask)


def _attention_bw(ctx, grad, _glse):
    q, k, v, o, lse, attn_mask = ctx.saved_tensors
    need = ctx.needs_input_grad
    mask_grad = bool(need[3]) and attn_mask is not None and attn_mask.dtype != torch.bool
    grads = torch.ops.opfuse.attention_backward(grad, q, k, v, o, lse, attn_mask, ctx.causal, ctx.scale, mask_grad,
                                                ctx.deterministic)
    dq, dk, dv = grads[0], grads[1], grads[2]
    dmask = grads[3] if mask_grad else None
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, dmask, None, None, None)


_attention_op.register_autograd(_attention_bw, setup_context=_attention_setup)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
              attn_mask: Optional[Tensor] = None, deterministic: Optional[bool] = None) -> Tensor:
    """Scaled dot-product attention (see the module docstring): q [B, Hq, Sq, D],
    k and v [B, Hkv, Sk, D]; causal masking aligned bottom-right; attn_mask
    bool (True = attend) or additive, broadcastable to [B, Hq, Sq, Sk];
    scale defaults to 1/sqrt(D). deterministic: the backward's dQ without
    atomics (bitwise-equal reruns); None follows
    torch.are_deterministic_algorithms_enabled() at backward time.
    Returns [B, Hq, Sq, D] in q's dtype."""
    _check(q, k, v, attn_mask)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    det = -1 if deterministic is None else int(bool(deterministic))
    return torch.ops.opfuse.attention(q, k, v, attn_mask, bool(causal), float(scale), det)[0]
