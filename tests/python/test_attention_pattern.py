"""Attention written out in a model (matmul, scale, mask, softmax, matmul) is
replaced by opfuse.ops.attention under backend="opfuse"; explain() says for
every softmax and SDPA call whether it was, and why not. Values against eager
(float32 tolerances, float64 for gradients' reference), forward and backward."""
import math

import pytest
import torch
import torch.nn.functional as F

import opfuse


def plain(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def masked(q, k, v, mask):  # mask: True = masked out (the usual masked_fill idiom)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    s = s.masked_fill(mask, float("-inf"))
    return F.dropout(F.softmax(s, dim=-1), p=0.0) @ v


def additive(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.3 + bias, -1) @ v


def probabilities_returned(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1), -1)
    return p @ v, p


def attention_candidates(fn, *args):
    return opfuse.explain(fn, *args).attention


def qkv(b=2, h=3, sq=37, sk=37, d=16, hkv=None, dtype=torch.float32, requires_grad=False, device="cpu"):
    t = [torch.randn(b, h, sq, d, dtype=dtype, device=device), torch.randn(b, hkv or h, sk, d, dtype=dtype, device=device),
         torch.randn(b, hkv or h, sk, d, dtype=dtype, device=device)]
    return [x.requires_grad_(requires_grad) for x in t]


def test_plain_pattern_is_fused_and_right(device):
    q, k, v = qkv(sq=29, sk=41, device=device)
    (cand,) = attention_candidates(plain, q, k, v)
    assert cand[2], cand
    torch.testing.assert_close(torch.compile(plain, backend="opfuse")(q, k, v), plain(q, k, v))


def test_masked_fill_pattern_with_dropout_p0(device):
    q, k, v = qkv(device=device)
    mask = torch.ones(37, 37, dtype=torch.bool, device=device).triu(1)  # causal, as a model writes it
    (cand,) = attention_candidates(masked, q, k, v, mask)
    assert cand[2] and "masked_out" in cand[3], cand
    torch.testing.assert_close(torch.compile(masked, backend="opfuse")(q, k, v, mask), masked(q, k, v, mask))


def test_additive_mask_pattern():
    q, k, v = qkv(sq=5, sk=9)
    bias = torch.randn(1, 3, 5, 9)
    (cand,) = attention_candidates(additive, q, k, v, bias)
    assert cand[2] and "additive" in cand[3], cand
    torch.testing.assert_close(torch.compile(additive, backend="opfuse")(q, k, v, bias), additive(q, k, v, bias))


def test_pattern_not_fused_when_the_probabilities_are_needed():
    q, k, v = qkv()
    (cand,) = attention_candidates(probabilities_returned, q, k, v)
    assert not cand[2] and "used more than once" in cand[3], cand
    out, p = torch.compile(probabilities_returned, backend="opfuse")(q, k, v)
    ref_out, ref_p = probabilities_returned(q, k, v)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(p, ref_p)


def test_softmax_that_is_not_attention_is_reported_not_fused():
    (cand,) = attention_candidates(lambda x: torch.softmax(x, -1) * 2, torch.randn(4, 8))
    assert not cand[2], cand


def test_training_through_the_fused_pattern(device):
    q, k, v = qkv(sq=23, sk=31, requires_grad=True, device=device)
    mask = torch.rand(23, 31, device=device) > 0.2
    mask[:, 0] = False  # every row keeps a key
    f = torch.compile(masked, backend="opfuse")
    f(q, k, v, mask).square().sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    masked(qd, kd, vd, mask).square().sum().backward()
    for g, t in zip(got, (qd, kd, vd)):
        torch.testing.assert_close(g, t.grad.float(), rtol=1e-4, atol=1e-4)


def test_sdpa_is_left_to_pytorch_unless_asked(monkeypatch):
    q, k, v = qkv()
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    (cand,) = attention_candidates(sdpa, q, k, v)
    assert cand[1] == "sdpa" and not cand[2] and "OPFUSE_ATTENTION=sdpa" in cand[3]
    monkeypatch.setenv("OPFUSE_ATTENTION", "sdpa")
    (cand,) = attention_candidates(sdpa, q, k, v)
    assert cand[2], cand
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(sdpa, backend="opfuse")(q, k, v), sdpa(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 64])  # 64: the CUDA kernel's head dims; 32: its math path
def test_half_pattern_meets_the_flashattention_rule(dtype, d, device):
    q, k, v = qkv(sq=41, sk=64, d=d, dtype=dtype, device=device)
    ref = plain(*(t.float() for t in (q, k, v)))
    err = (torch.compile(plain, backend="opfuse")(q, k, v).float() - ref).abs().max()
    eager_err = (plain(q, k, v).float() - ref).abs().max()
    assert err <= 2 * eager_err, (err, eager_err)
