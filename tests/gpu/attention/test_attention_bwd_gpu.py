"""GPU correctness of attention_bwd.cu (skipped without CUDA).

The FlashAttention rule for gradients: for each of dQ, dK, dV,
max |ours - ref32| <= 3 * max |pytorch_lowp - ref32| + 1e-5, where ref32 is
autograd through attention on float32 upcasts of the same inputs and
pytorch_lowp is autograd through the same PyTorch ops in the input dtype
(matmuls in bf16/f16, softmax in float32 rounded to the input dtype, as the
FlashAttention tests' reference). O and LSE come from opfuse's forward kernel;
gradient outputs are poisoned with NaN before each launch, so an unwritten
element fails.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import attn_bwd_runtime as br  # noqa: E402
from attn_inputs import DTYPES, SEQ_PAIRS, case_seed, randn  # noqa: E402
from attn_reference import visible_mask  # noqa: E402

# The `fwd` and `bwd` fixtures (the harnesses) come from conftest.py.
# test_attention_bwd_sm90_gpu imports DTYPES, _seed and randn from here.
_seed = case_seed


def attention_autograd(q, k, v, dout, causal, scale, compute_dtype):
    """Gradients (dq, dk, dv) of attention by autograd in compute_dtype. Rows that
    see no key get a zero output (and zero gradients), as the kernels' contract."""
    q, k, v = (t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v))
    Hq, Hkv = q.shape[1], k.shape[1]
    ke = k.repeat_interleave(Hq // Hkv, dim=1) if Hq != Hkv else k
    ve = v.repeat_interleave(Hq // Hkv, dim=1) if Hq != Hkv else v
    mask = visible_mask(q.shape[2], k.shape[2], causal, q.device)
    dead = ~mask.any(dim=-1)[:, None]  # [Sq, 1]
    s = torch.matmul(q, ke.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf")).masked_fill(dead, 0.0)  # no all--inf row: no NaN
    p = torch.softmax(s.float(), dim=-1).to(compute_dtype).masked_fill(dead, 0.0)
    o = torch.matmul(p, ve)
    o.backward(dout.to(compute_dtype))
    return q.grad, k.grad, v.grad


def check_grads(fwd, bwd, q, k, v, causal, scale=None, deterministic=False, dout=None, seed=0):
    B, Hq, Sq, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    o, lse = fwd(q, k, v, causal=causal, scale=scale)
    if dout is None:
        dout = randn(B, Hq, Sq, D, dtype=q.dtype, seed=seed + 7)
    out = tuple(torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device) for t in (q, k, v))
    dq, dk, dv = bwd(dout, q, k, v, o, lse, causal=causal, scale=scale, deterministic=deterministic, out=out)
    torch.cuda.synchronize()
    ref = attention_autograd(q, k, v, dout, causal, scale, torch.float32)
    pt = attention_autograd(q, k, v, dout, causal, scale, q.dtype)
    msgs = []
    for name, ours, r, lo in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, pt):
        if ours.numel() == 0:
            continue
        nan = int(torch.isnan(ours).sum())
        err = (ours.float() - r).abs().nan_to_num(float("inf")).max().item()
        pt_err = (lo.float() - r).abs().max().item()
        if nan or not err <= 3 * pt_err + 1e-5:
            worst = list(torch.unravel_index((ours.float() - r).abs().nan_to_num(float("inf")).argmax(), r.shape))
            msgs.append(f"{name}: err {err:.3e} vs pytorch {pt_err:.3e}, NaN {nan} of {ours.numel()}, "
                        f"worst at {[int(x) for x in worst]}: ours {ours[tuple(worst)].item():.5f} "
                        f"ref {r[tuple(worst)].item():.5f}")
    assert not msgs, "\n  ".join(msgs)
    dead = ~visible_mask(Sq, k.shape[2], causal, q.device).any(dim=-1)
    if dead.any():
        assert (dq[:, :, dead] == 0).all(), "rows that see no key must get dQ = 0"
    return dq, dk, dv


@pytest.mark.parametrize("Sq,Sk", SEQ_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_grid(fwd, bwd, dt, D, causal, Sq, Sk):
    seed = case_seed("bwd", dt, D, causal, Sq, Sk)
    q = randn(2, 4, Sq, D, dtype=DTYPES[dt], seed=seed)
    k = randn(2, 4, Sk, D, dtype=DTYPES[dt], seed=seed + 1)
    v = randn(2, 4, Sk, D, dtype=DTYPES[dt], seed=seed + 2)
    check_grads(fwd, bwd, q, k, v, causal, seed=seed)


@pytest.mark.parametrize("Sq,Sk", [(113, 203), (1023, 1024), (1, 239), (512, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_deterministic_grid(fwd, bwd, D, causal, Sq, Sk):
    seed = case_seed("det", D, causal, Sq, Sk)
    q = randn(2, 4, Sq, D, dtype=torch.bfloat16, seed=seed)
    k = randn(2, 2, Sk, D, dtype=torch.bfloat16, seed=seed + 1)
    v = randn(2, 2, Sk, D, dtype=torch.bfloat16, seed=seed + 2)
    check_grads(fwd, bwd, q, k, v, causal, deterministic=True, seed=seed)


@pytest.mark.parametrize("Sq,Sk", SEQ_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,dt", [(128, "bf16"), (64, "f16")])
@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (8, 1)])
def test_gqa_mqa(fwd, bwd, Hq, Hkv, D, dt, causal, Sq, Sk):
    seed = case_seed("gqa-bwd", Hq, Hkv, D, dt, causal, Sq, Sk)
    q = randn(2, Hq, Sq, D, dtype=DTYPES[dt], seed=seed)
    k = randn(2, Hkv, Sk, D, dtype=DTYPES[dt], seed=seed + 1)
    v = randn(2, Hkv, Sk, D, dtype=DTYPES[dt], seed=seed + 2)
    check_grads(fwd, bwd, q, k, v, causal, seed=seed)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_non_contiguous(fwd, bwd, D, causal, deterministic):
    # q, k, v sliced out of one packed [B, S, 3, H, D] projection, dout a
    # transposed [B, S, H, D] view: every row stride is 3 * H * D or H * D.
    B, H, Sq = 2, 4, 203
    qkv = randn(B, Sq, 3, H, D, dtype=torch.bfloat16, seed=D)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    dout = randn(B, Sq, H, D, dtype=torch.bfloat16, seed=D + 1).transpose(1, 2)
    assert not q.is_contiguous() and not dout.is_contiguous()
    check_grads(fwd, bwd, q, k, v, causal, deterministic=deterministic, dout=dout)


@pytest.mark.parametrize("scale", [0.05, 0.5])
def test_scale(fwd, bwd, scale):
    q = randn(1, 4, 300, 128, dtype=torch.bfloat16, seed=7)
    k = randn(1, 4, 333, 128, dtype=torch.bfloat16, seed=8)
    v = randn(1, 4, 333, 128, dtype=torch.bfloat16, seed=9)
    check_grads(fwd, bwd, q, k, v, True, scale=scale)


def _variant_params():
    out = []
    for d in br.HEAD_DIMS:
        for kv, q in list(zip(br.DKDV_TILES[d], br.DQ_TILES[d]))[1:]:
            out.append(pytest.param(d, kv, q, id=f"D{d}-{kv.tag()}-{q.tag()}"))
    return out


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,kv,qt", _variant_params())
def test_variant_tiles(fwd, bwd, D, kv, qt, causal, deterministic):
    q = randn(2, 4, 1023, D, dtype=torch.bfloat16, seed=11)
    k = randn(2, 2, 517, D, dtype=torch.bfloat16, seed=12)
    v = randn(2, 2, 517, D, dtype=torch.bfloat16, seed=13)
    o, lse = fwd(q, k, v, causal=causal)
    dout = randn(*q.shape, dtype=q.dtype, seed=14)
    a = bwd(dout, q, k, v, o, lse, causal=causal, deterministic=deterministic)
    b = bwd(dout, q, k, v, o, lse, causal=causal, deterministic=deterministic, tiles=(kv, qt))
    torch.cuda.synchronize()
    for x, y in zip(a, b):  # same math, other tiles: equal up to accumulation order
        assert (x.float() - y.float()).abs().max().item() <= 2e-2 * max(1.0, y.float().abs().max().item())


@pytest.mark.parametrize("D", [64, 128, 256])
def test_deterministic_reruns_bitwise_equal(fwd, bwd, D):
    q = randn(2, 8, 1000, D, dtype=torch.bfloat16, seed=21)
    k = randn(2, 2, 1500, D, dtype=torch.bfloat16, seed=22)
    v = randn(2, 2, 1500, D, dtype=torch.bfloat16, seed=23)
    o, lse = fwd(q, k, v, causal=True)
    dout = randn(*q.shape, dtype=q.dtype, seed=24)
    first = bwd(dout, q, k, v, o, lse, causal=True, deterministic=True)
    for _ in range(3):
        again = bwd(dout, q, k, v, o, lse, causal=True, deterministic=True)
        torch.cuda.synchronize()
        for x, y in zip(first, again):
            assert torch.equal(x, y)
    # torch.use_deterministic_algorithms selects the same path by default.
    torch.use_deterministic_algorithms(True)
    try:
        dflt = bwd(dout, q, k, v, o, lse, causal=True)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.cuda.synchronize()
    for x, y in zip(first, dflt):
        assert torch.equal(x, y)


def test_empty_sizes(fwd, bwd):
    # Sk = 0: dQ = 0; Sq = 0: dK = dV = 0.
    q = randn(1, 2, 77, 64, dtype=torch.bfloat16, seed=1)
    k = torch.empty(1, 2, 0, 64, dtype=torch.bfloat16, device="cuda")
    o, lse = fwd(q, k, k)
    for det in (False, True):
        dq, dk, dv = bwd(torch.ones_like(q), q, k, k, o, lse, deterministic=det,
                         out=(torch.full_like(q, float("nan")), torch.empty_like(k), torch.empty_like(k)))
        torch.cuda.synchronize()
        assert (dq == 0).all()
    q0 = torch.empty(1, 2, 0, 64, dtype=torch.bfloat16, device="cuda")
    k = randn(1, 2, 50, 64, dtype=torch.bfloat16, seed=2)
    lse0 = torch.empty(1, 2, 0, device="cuda")
    for det in (False, True):
        _, dk, dv = bwd(q0, q0, k, k, q0, lse0, deterministic=det,
                        out=(q0, torch.full_like(k, float("nan")), torch.full_like(k, float("nan"))))
        torch.cuda.synchronize()
        assert (dk == 0).all() and (dv == 0).all()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_very_negative_scores_never_nan(fwd, bwd, causal, deterministic):
    # Every score about -500: P = exp(S - LSE) is fine for real keys, but a
    # zero-filled key past Sk would give exp(500) = inf (the reason ragged key
    # blocks are masked). Ragged Sk, Sq, both dQ modes.
    D = 64
    q = (4.0 + 0.1 * randn(1, 4, 77, D, dtype=torch.float32, seed=31)).bfloat16()
    k = (-4.0 + 0.1 * randn(1, 2, 100, D, dtype=torch.float32, seed=32)).bfloat16()
    v = randn(1, 2, 100, D, dtype=torch.bfloat16, seed=33)
    dq, dk, dv = check_grads(fwd, bwd, q, k, v, causal, deterministic=deterministic, seed=34)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
