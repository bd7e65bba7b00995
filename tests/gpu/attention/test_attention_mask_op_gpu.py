"""GPU: opfuse.ops.attention with an attn_mask runs the fused kernels
(skipped without CUDA or without the built opfuse package).

Checks: forward and backward take the kernels (no "PyTorch math path" /
"PyTorch backward path" log, launches counted) for a key-padding mask, an
additive [B, 1, Sq, Sk] mask in q's dtype and a boolean [Sq, Sk] one, with
and without causal, under the FlashAttention rule; the C++ launcher gives the
ctypes harness's bits; an additive mask that requires grad keeps the
PyTorch-ops backward (logged) with the right dMask; attention written out in
a torch.compile graph with a mask runs fused.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
opfuse = pytest.importorskip("opfuse")

import attn_bwd_runtime as br  # noqa: E402
import attn_runtime as ar  # noqa: E402
from test_attention_bwd_op_gpu import _Records  # noqa: E402
from test_attention_mask_gpu import autograd_masked, make_mask, randn  # noqa: E402
from attn_reference import attention_fp32, attention_lowp_ops  # noqa: E402

pytestmark = pytest.mark.gpu


def _run(q, k, v, dout, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = opfuse.ops.attention(q, k, v, **kw)
    o.backward(dout)
    return o.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["keypad", "add_bh", "add_sqsk", "bool_b1"])
def test_op_masked_forward_and_backward_use_the_kernels(kind, causal):
    B, Hq, Hkv, Sq, Sk, D = 2, 8, 2, 300, 211, 128
    q = randn(B, Hq, Sq, D, dtype=torch.bfloat16, seed=1)
    k = randn(B, Hkv, Sk, D, dtype=torch.bfloat16, seed=2)
    v = randn(B, Hkv, Sk, D, dtype=torch.bfloat16, seed=3)
    dout = randn(B, Hq, Sq, D, dtype=torch.bfloat16, seed=4)
    mask = make_mask(kind, B, Hq, Sq, Sk, torch.bfloat16, 5)
    opfuse.reset_stats()
    with _Records() as logs:
        o, dq, dk, dv = _run(q, k, v, dout, causal=causal, attn_mask=mask)
    torch.cuda.synchronize()
    assert not [m for m in logs.messages if "PyTorch" in m or "failed" in m], logs.messages
    assert opfuse.stats()["kernel_launches"] == 1 + 3
    ref, ref_lse, _ = attention_fp32(q, k, v, causal, attn_mask=mask)
    lo = attention_lowp_ops(q, k, v, causal, attn_mask=mask)
    assert not torch.isnan(o).any()
    assert (o.float() - ref).abs().max().item() <= 2 * (lo.float() - ref).abs().max().item() + 1e-5
    assert (o[torch.isinf(ref_lse)] == 0).all()
    scale = 1.0 / math.sqrt(D)
    r32 = autograd_masked(q, k, v, dout, mask, causal, scale, torch.float32)
    rlo = autograd_masked(q, k, v, dout, mask, causal, scale, torch.bfloat16)
    for name, x, r, l in zip(("dq", "dk", "dv"), (dq, dk, dv), r32, rlo):
        err, lerr = (x.float() - r).abs().max().item(), (l.float() - r).abs().max().item()
        assert err <= 3 * lerr + 1e-5, f"{name}: {err:.3e} vs pytorch {lerr:.3e}"


def test_op_masked_matches_the_harness_bitwise():
    B, H, Sq, Sk, D = 2, 4, 500, 700, 128
    q, k, v = (randn(B, H, s, D, dtype=torch.bfloat16, seed=i) for i, s in ((11, Sq), (12, Sk), (13, Sk)))
    dout = randn(B, H, Sq, D, dtype=torch.bfloat16, seed=14)
    for kind in ("keypad", "bool_b1"):
        mask = make_mask(kind, B, H, Sq, Sk, torch.bfloat16, 15)
        o, dq, dk, dv = _run(q, k, v, dout, causal=True, attn_mask=mask, deterministic=True)
        ho, hl = ar.AttentionForward()(q, k, v, causal=True, attn_mask=mask)
        hq, hk, hv = br.AttentionBackward()(dout, q, k, v, ho, hl, causal=True, deterministic=True, attn_mask=mask)
        torch.cuda.synchronize()
        for a, b in ((o, ho), (dq, hq), (dk, hk), (dv, hv)):
            assert torch.equal(a, b), kind


def test_op_additive_mask_with_grad_keeps_the_reference_backward():
    B, H, Sq, Sk, D = 2, 4, 97, 130, 64
    q, k, v = (randn(B, H, s, D, dtype=torch.bfloat16, seed=i) for i, s in ((21, Sq), (22, Sk), (23, Sk)))
    bias = (0.5 * torch.randn(1, H, Sq, Sk, device="cuda")).bfloat16().requires_grad_()
    dout = randn(B, H, Sq, D, dtype=torch.bfloat16, seed=24)
    with _Records() as logs:
        o = opfuse.ops.attention(q, k, v, attn_mask=bias)
        o.backward(dout)
    assert any("gradient of an additive attn_mask" in m for m in logs.messages), logs.messages
    assert not any("math path" in m for m in logs.messages), logs.messages  # the forward ran the kernel
    b64 = bias.detach().double().requires_grad_()
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) / math.sqrt(D) + b64
    (torch.softmax(s, -1) @ v.double()).backward(dout.double())
    err = (bias.grad.double() - b64.grad).abs().max().item()
    assert err <= 2e-2 * max(1.0, b64.grad.abs().max().item()), err


def test_compiled_graph_with_a_mask_runs_fused():
    # The pattern pass (frontend/attention_pattern.py) turns masked_fill(pad,
    # -inf) into attn_mask = ~pad: a key-padding mask, now run by the kernel;
    # an additive bias likewise (a full mask in q's dtype).
    def padded(q, k, v, pad):
        s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        return torch.softmax(s.masked_fill(pad, float("-inf")), dim=-1) @ v

    def biased(q, k, v, bias):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.125 + bias, -1) @ v

    B, H, S, D = 2, 4, 160, 64
    q, k, v = (randn(B, H, S, D, dtype=torch.bfloat16, seed=i) for i in (31, 32, 33))
    pad = torch.zeros(B, 1, 1, S, dtype=torch.bool, device="cuda")
    pad[1, ..., 100:] = True
    bias = randn(1, 1, S, S, dtype=torch.bfloat16, seed=34)
    for fn, m in ((padded, pad), (biased, bias)):
        torch._dynamo.reset()
        opfuse.reset_stats()
        with _Records() as logs:
            out = torch.compile(fn, backend="opfuse")(q, k, v, m)
        torch.cuda.synchronize()
        ref = fn(q.float(), k.float(), v.float(), m if m.dtype == torch.bool else m.float())
        assert (out.float() - ref).abs().max().item() <= 3e-2, fn.__name__
        assert not [x for x in logs.messages if "math path" in x], logs.messages
        assert opfuse.stats()["kernel_launches"] >= 1, fn.__name__
