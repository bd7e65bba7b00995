"""Rows of an additive attn_mask that only huge values reach (finfo.min, the
convention of Hugging Face models for padding): eager's float sum
`scores + mask` absorbs the scores there, so such a row attends to its keys
with equal weights (the mean of V), and its gradients are those of that
softmax. The kernels saturate such values (attention_ptx.cu, mask_to_log2)
and store a marker as the row's LSE that the backward decodes
(attention_bwd.cu, attn_bwd_row_terms); the PyTorch-ops backward recomputes
P as a softmax. Checked against a float64 softmax written out, on the CPU
here and on CUDA (bf16, both forward kernels and the mma.sync backward) when
there is a GPU.
"""
from __future__ import annotations

import math

import pytest
import torch

import opfuse


def huge_mask(shape, dtype, seed, positive=False):
    """Small random values; rows 3 and 7 only finfo(dtype).min; row 10 half
    of its keys; with `positive`, two keys of row 12 at +1e36 (they take all
    the weight of that row)."""
    g = torch.Generator().manual_seed(seed)
    m = 0.3 * torch.randn(shape, generator=g)
    low = torch.finfo(dtype).min
    m[..., 3, :] = low
    m[..., 7, :] = low
    m[..., 10, : shape[-1] // 2] = low
    if positive:
        m[..., 12, 1] = 1e36
        m[..., 12, 5] = 1e36
    return m.to(dtype)


def reference(q, k, v, dout, mask, causal, scale):
    """float64: o, and the gradients of q, k, v (and of mask if it requires grad)."""
    G = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    m64 = mask.detach().double().requires_grad_(mask.requires_grad)
    ke, ve = (t.repeat_interleave(G, dim=1) for t in (k64, v64))
    s = q64 @ ke.transpose(-1, -2) * scale + m64
    Sq, Sk = s.shape[-2:]
    if causal:
        i = torch.arange(Sq).unsqueeze(1)
        j = torch.arange(Sk).unsqueeze(0)
        s = s.masked_fill((j > i + Sk - Sq).to(s.device), -math.inf)
    p = torch.softmax(s, -1)
    p = torch.where(torch.isnan(p), torch.zeros_like(p), p)  # rows that see no key
    o = p @ ve
    o.backward(dout.double())
    grads = [q64.grad, k64.grad, v64.grad] + ([m64.grad] if mask.requires_grad else [])
    return o.detach(), grads


def run(q, k, v, dout, mask, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = opfuse.ops.attention(q, k, v, causal=causal, attn_mask=mask)
    o.backward(dout)
    grads = [q.grad, k.grad, v.grad] + ([mask.grad] if mask.requires_grad else [])
    return o.detach(), grads


def check(got, want, tol, what):
    err = (got.double() - want).abs().max().item()
    assert not torch.isnan(got).any(), what
    assert err <= tol * max(1.0, want.abs().max().item()), f"{what}: {err:.3e}"


def case(device, dtype, D, Sq, Sk, Hq=4, Hkv=2, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731
    return mk(B, Hq, Sq, D), mk(B, Hkv, Sk, D), mk(B, Hkv, Sk, D), mk(B, Hq, Sq, D)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_dtype,positive,grad", [(torch.float32, False, False), (torch.bfloat16, False, False),
                                                      (torch.float32, True, False), (torch.float32, False, True)])
def test_cpu_rows_masked_by_huge_values(mask_dtype, positive, grad, causal):
    q, k, v, dout = case("cpu", torch.float32, 24, 37, 53)
    mask = huge_mask((2, 1, 37, 53), mask_dtype, 1, positive).requires_grad_(grad)
    o, grads = run(q, k, v, dout, mask, causal)
    ro, rgrads = reference(q, k, v, dout, mask, causal, 24 ** -0.5)
    check(o, ro, 1e-5, "o")
    row3 = v.double().repeat_interleave(2, dim=1)[:, :, : (3 + 53 - 37 + 1) if causal else 53].mean(2)
    torch.testing.assert_close(ro[:, :, 3], row3)  # the reference's own claim: the mean of the visible V
    for name, x, r in zip(("dq", "dk", "dv", "dmask"), grads, rgrads):
        check(x, r, 1e-4, name)


gpu = pytest.mark.gpu


# D = 128 takes the Hopper forward on sm_90 with a mask, D = 64 and 96 the
# mma.sync one; the backward is mma.sync with a mask. Each case compiles its
# own kernels, so the grid covers every mask kind and path once rather than
# their product.
CUDA_CASES = [("bf16", 128, False), ("bf16", 128, True), ("bf16", 64, True), ("f32", 128, False),
              ("f32-positive", 64, True), ("keypad", 128, True), ("keypad", 64, False), ("bf16-grad", 64, False),
              ("keypad", 96, True), ("bf16", 96, False)]


@gpu
@pytest.mark.parametrize("kind,D,causal", CUDA_CASES)
def test_cuda_rows_masked_by_huge_values(kind, D, causal):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    B, Sq, Sk = 2, 150, 211
    q, k, v, dout = case("cuda", torch.bfloat16, D, Sq, Sk, seed=3)
    if kind == "keypad":
        m = torch.zeros(B, 1, 1, Sk)
        m[1] = torch.finfo(torch.float32).min  # every row of batch 1
        m[0, ..., 100:] = torch.finfo(torch.float32).min
    else:
        m = huge_mask((B, 1, Sq, Sk), torch.bfloat16 if kind.startswith("bf16") else torch.float32, 4,
                      positive=kind.endswith("positive"))
    mask = m.cuda().requires_grad_(kind.endswith("grad"))
    opfuse.reset_stats()
    o, grads = run(q, k, v, dout, mask, causal)
    torch.cuda.synchronize()
    # The kernels ran: the forward's one launch, and the backward's three
    # unless the mask needs a gradient (then the PyTorch-ops backward).
    assert opfuse.stats()["kernel_launches"] == (1 if mask.requires_grad else 4)
    ro, rgrads = reference(q, k, v, dout, mask, causal, D ** -0.5)
    check(o, ro, 2e-2, "o")
    for name, x, r in zip(("dq", "dk", "dv", "dmask"), grads, rgrads):
        check(x, r, 2e-2, name)
