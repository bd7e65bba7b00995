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


def add_attn_mask(s, attn_mask):
    """Scores s [B, Hq, Sq, Sk] with an attn_mask applied (bool: False gives
    -inf; float: added in s's dtype), the mask broadcast as in SDPA."""
    if attn_mask is None:
        return s
    if attn_mask.dtype == torch.bool:
        return s.masked_fill(~attn_mask, float("-inf"))
    return s + attn_mask.to(s.dtype)


def attention_fp32(q, k, v, causal=False, scale=None, attn_mask=None):
    """float32 (or float64 for float64 inputs) reference: returns (out, lse, scores)."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    k, v = _expand_kv(k, v, q.shape[1])
    s = add_attn_mask(torch.matmul(q, k.transpose(-1, -2)) * scale, attn_mask)
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


def attention_lowp_ops(q, k, v, causal=False, scale=None, attn_mask=None):
    """PyTorch ops in q's dtype (the FlashAttention tests' low-precision
    reference): S = Q K^T rounded to q's dtype, the mask added and the
    softmax taken in float32, P rounded to q's dtype, P V in q's dtype. Used
    where SDPA cannot take the mask (a float32 mask with bf16 q). Rows that see
    no key give 0."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k, v = _expand_kv(k, v, q.shape[1])
    s = add_attn_mask(torch.matmul(q, k.transpose(-1, -2)).float() * scale, attn_mask)
    s = s.masked_fill(~visible_mask(q.shape[2], k.shape[2], causal, q.device), float("-inf"))
    dead = torch.isinf(s).all(dim=-1, keepdim=True) & (s.amax(dim=-1, keepdim=True) < 0)
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return torch.matmul(p.to(q.dtype), v)
