"""PyTorch references for attention forward (same semantics as the kernel).

q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D]; GQA by repeating k/v heads; causal
mask aligned bottom-right (query i sees key j iff j <= i + Sk - Sq); rows that
see no key give output 0 and LSE -inf.
"""

from __future__ import annotations

import math

import torch


def visible_mask(Sq: int, Sk: int, causal: bool, device) -> torch.Tensor:
    """[Sq, Sk] bool, True where query i may see key j."""
    if not causal:
        return torch.ones((Sq, Sk), dtype=torch.bool, device=device)
    i = torch.arange(Sq, device=device)[:, None]
    j = torch.arange(Sk, device=device)[None, :]
    return j <= i + (Sk - Sq)


def _expand_kv(k, v, Hq):
    Hkv = k.shape[1]
    if Hkv != Hq:
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    return k, v


def attention_fp32(q, k, v, causal=False, scale=None):
    """float32 (or float64 for float64 inputs) reference: returns (out, lse, scores)."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    k, v = _expand_kv(k, v, q.shape[1])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = visible_mask(q.shape[2], k.shape[2], causal, q.device)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    p = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(p), p)
    out = torch.matmul(p, v)
    return out, lse, s


def attention_sdpa_math_lowp(q, k, v, causal=False, scale=None):
    """PyTorch's own low-precision SDPA (math backend) with the same mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k, v = _expand_kv(k, v, q.shape[1])
    mask = visible_mask(q.shape[2], k.shape[2], causal, q.device)
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # Rows that see no key: PyTorch versions differ (NaN or 0); the contract is 0.
    dead = ~mask.any(dim=-1)
    if dead.any():
        out = out.masked_fill(dead[None, None, :, None], 0)
    return out
