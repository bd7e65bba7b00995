"""GPU: opfuse.ops.attention's backward dispatches to the fused kernels
(skipped without CUDA or without the built opfuse package).

Checks, through torch autograd on the custom op: the kernel path is taken (no
"PyTorch backward path" log, three launches counted), the FlashAttention rule
for gradients, that the C++ launcher gives the same bits as the ctypes harness
in deterministic mode, the deterministic= argument and
torch.use_deterministic_algorithms, non-contiguous inputs, and the PyTorch-ops
fallback for a mask (logged, still correct).
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
from test_attention_bwd_gpu import attention_autograd, randn  # noqa: E402
from opfuse.testing import OpfuseLog  # noqa: E402

pytestmark = pytest.mark.gpu


def _grads(q, k, v, dout, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = opfuse.ops.attention(q, k, v, **kw)
    o.backward(dout)
    return o.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,dt", [(64, torch.float16), (128, torch.bfloat16), (256, torch.bfloat16)])
def test_op_backward_uses_the_kernel_and_meets_the_rule(D, dt, causal):
    q = randn(2, 8, 300, D, dtype=dt, seed=D)
    k = randn(2, 2, 211, D, dtype=dt, seed=D + 1)
    v = randn(2, 2, 211, D, dtype=dt, seed=D + 2)
    dout = randn(2, 8, 300, D, dtype=dt, seed=D + 3)
    opfuse.reset_stats()
    with OpfuseLog() as logs:
        _, dq, dk, dv = _grads(q, k, v, dout, causal=causal)
    torch.cuda.synchronize()
    assert not [m for m in logs.messages if "PyTorch backward path" in m or "failed" in m], logs.messages
    assert opfuse.stats()["kernel_launches"] == 1 + 3  # forward + preprocess, dK/dV, dQ
    scale = 1.0 / math.sqrt(D)
    ref = attention_autograd(q, k, v, dout, causal, scale, torch.float32)
    pt = attention_autograd(q, k, v, dout, causal, scale, dt)
    for name, x, r, lo in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, pt):
        err = (x.float() - r).abs().max().item()
        pt_err = (lo.float() - r).abs().max().item()
        assert err <= 3 * pt_err + 1e-5, f"{name}: {err:.3e} vs pytorch {pt_err:.3e}"


def test_op_deterministic_matches_the_harness_bitwise():
    q = randn(2, 8, 500, 128, dtype=torch.bfloat16, seed=1)
    k = randn(2, 4, 700, 128, dtype=torch.bfloat16, seed=2)
    v = randn(2, 4, 700, 128, dtype=torch.bfloat16, seed=3)
    dout = randn(2, 8, 500, 128, dtype=torch.bfloat16, seed=4)
    o, dq, dk, dv = _grads(q, k, v, dout, causal=True, deterministic=True)
    _, dq2, dk2, dv2 = _grads(q, k, v, dout, causal=True, deterministic=True)
    torch.use_deterministic_algorithms(True)
    try:
        _, dq3, dk3, dv3 = _grads(q, k, v, dout, causal=True)
    finally:
        torch.use_deterministic_algorithms(False)
    _, lse = ar.AttentionForward()(q, k, v, causal=True)
    hq, hk, hv = br.AttentionBackward()(dout, q, k, v, o, lse, causal=True, deterministic=True)
    torch.cuda.synchronize()
    for a, b, c, h in ((dq, dq2, dq3, hq), (dk, dk2, dk3, hk), (dv, dv2, dv3, hv)):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, h)


def test_op_backward_non_contiguous_and_mask_fallback():
    B, H, S, D = 2, 4, 203, 64
    qkv = randn(B, S, 3, H, D, dtype=torch.bfloat16, seed=9)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    dout = randn(B, S, H, D, dtype=torch.bfloat16, seed=10).transpose(1, 2)
    _, dq, dk, dv = _grads(q, k, v, dout, causal=True)
    ref = attention_autograd(q, k, v, dout, True, D ** -0.5, torch.float32)
    pt = attention_autograd(q, k, v, dout, True, D ** -0.5, torch.bfloat16)
    for x, r, lo in zip((dq, dk, dv), ref, pt):
        assert (x.float() - r).abs().max().item() <= 3 * (lo.float() - r).abs().max().item() + 1e-5
    # A boolean key-padding mask takes the PyTorch-ops backward, logged once.
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device="cuda")
    mask[1, ..., 150:] = False
    with OpfuseLog():
        _, dq, dk, dv = _grads(q, k, v, dout, attn_mask=mask)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert (dk[1, :, 150:] == 0).all() and (dv[1, :, 150:] == 0).all()
