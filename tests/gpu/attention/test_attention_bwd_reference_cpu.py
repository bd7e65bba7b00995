"""CPU (CI) test of src/kernels/attention/attention_backward_reference.{h,cpp}:
the float64 backward reference against torch autograd in float64.

Builds the reference with the host C++ compiler into a small shared library
and calls it through ctypes; skips without a C++ compiler.
"""

from __future__ import annotations

import ctypes
import math

import pytest

torch = pytest.importorskip("torch")

from attn_reference import visible_mask  # noqa: E402
from reference_lib import build_reference_lib  # noqa: E402


@pytest.fixture(scope="module")
def reflib(tmp_path_factory):
    return build_reference_lib(tmp_path_factory.mktemp("attnbwdref"), "attnbwdref", "attention_backward_reference.cpp",
                               "reference_bwd_capi.cpp", "opfuse_attention_backward_reference")


def run_ref(lib, q, k, v, o, dout, causal, scale=None):
    dq = torch.full(q.shape, float("nan"), dtype=torch.float64)
    dk = torch.full(k.shape, float("nan"), dtype=torch.float64)
    dv = torch.full(v.shape, float("nan"), dtype=torch.float64)
    ts = (q, k, v, o, dout, dq, dk, dv)
    for t in ts:
        assert t.dtype == torch.float64 and (t.numel() == 0 or t.stride(-1) == 1)
    ptrs = (ctypes.c_void_p * 8)(*(t.data_ptr() for t in ts))
    strides = (ctypes.c_int64 * 24)(*(s for t in ts for s in t.stride()[:3]))
    B, Hq, Sq, D = q.shape
    shape = (ctypes.c_int64 * 6)(B, Hq, k.shape[1], Sq, k.shape[2], D)
    err = ctypes.create_string_buffer(512)
    rc = lib.opfuse_attention_backward_reference(ptrs, strides, shape, int(causal), ctypes.c_double(scale or 0.0),
                                                 err, 512)
    if rc != 0:
        raise ValueError(err.value.decode())
    return dq, dk, dv


def autograd_f64(q, k, v, dout, causal, scale):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    mask = visible_mask(q.shape[2], k.shape[2], causal, q.device)
    dead = ~mask.any(dim=-1)[:, None]
    s = (q @ ke.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")).masked_fill(dead, 0.0)
    p = torch.softmax(s, dim=-1).masked_fill(dead, 0.0)
    o = p @ ve
    o.backward(dout)
    return o.detach(), q.grad, k.grad, v.grad


CASES = [
    # B, Hq, Hkv, Sq, Sk, D
    (2, 4, 4, 13, 23, 64),
    (1, 4, 2, 33, 17, 96),
    (1, 2, 1, 1, 39, 64),
    (1, 2, 2, 24, 12, 32),  # Sq > Sk: causal rows 0..11 see no key
    (2, 8, 2, 17, 17, 128),
    (1, 2, 2, 9, 1, 256),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D", CASES)
def test_backward_reference_matches_autograd_float64(reflib, B, Hq, Hkv, Sq, Sk, D, causal):
    g = torch.Generator().manual_seed(Sq * 1000 + Sk + D + causal)
    # q and dout as transposed [B, S, H, D] views: non-contiguous strides.
    q = torch.randn(B, Sq, Hq, D, generator=g, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, Sq, Hq, D, generator=g, dtype=torch.float64).transpose(1, 2)
    scale = 1.0 / math.sqrt(D)
    o, *want = autograd_f64(q, k, v, dout, causal, scale)
    got = run_ref(reflib, q, k, v, o, dout, causal)
    for name, x, y in zip(("dq", "dk", "dv"), got, want):
        assert not torch.isnan(x).any(), f"{name}: NaN (unwritten or 0/0)"
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-9, msg=name)
    dead = ~visible_mask(Sq, Sk, causal, "cpu").any(dim=-1)
    if dead.any():
        assert (got[0][:, :, dead] == 0).all()


def test_backward_reference_scale_and_empty(reflib):
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 2, n, 64, generator=g, dtype=torch.float64) for n in (5, 9, 9, 5))
    o, *want = autograd_f64(q, k, v, dout, False, 0.3)
    for x, y in zip(run_ref(reflib, q, k, v, o, dout, False, scale=0.3), want):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-9)
    # Sk = 0: dq = 0; Sq = 0: dk = dv = 0.
    k0 = torch.zeros(1, 2, 0, 64, dtype=torch.float64)
    dq, _, _ = run_ref(reflib, q, k0, k0, torch.zeros_like(q), dout, False)
    assert (dq == 0).all()
    q0 = torch.zeros(1, 2, 0, 64, dtype=torch.float64)
    _, dk, dv = run_ref(reflib, q0, k, v, q0, q0, True)
    assert (dk == 0).all() and (dv == 0).all()


def test_backward_reference_rejects_bad_heads(reflib):
    q, k = torch.randn(1, 3, 4, 64, dtype=torch.float64), torch.randn(1, 2, 4, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        run_ref(reflib, q, k, k, q, q, False)
