"""opfuse.ops: softmax, log_softmax, layer_norm, rms_norm and attention as torch
custom ops (docs/ops.md).

- torch.library.opcheck on every op (schema, fake tensors, autograd
  registration, AOT dispatch with dynamic shapes);
- values against float64 references with assert_close's per-dtype tolerances;
  backward against autograd of the float64 reference (gradcheck in float64);
- attention: the FlashAttention rule for bfloat16/float16 (our max error vs a
  float32 reference at most 2x that of PyTorch's own low-precision SDPA (math
  backend), 3x for gradients), odd sizes, Sq != Sk, bottom-right causal, GQA
  and MQA, key-padding and additive masks, fully masked rows (0, never NaN);
- inside torch.compile (inductor and opfuse backends, fullgraph: no graph break);
- CUDA code paths compiled with NVRTC for sm_80 and sm_90 (no GPU needed);
  tests marked `gpu` run them and skip without a CUDA device.
"""
from __future__ import annotations

import concurrent.futures as cf
import importlib
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import opfuse
import opfuse.ops as ops
from opfuse import _C
from opfuse.ops import _kernel, norms

from conftest import needs_nvrtc

HAS_CUDA = torch.cuda.is_available()
# the module (opfuse.ops.attention is the function)
attention_module = importlib.import_module("opfuse.ops.attention")


LOW = (torch.bfloat16, torch.float16)
ALL = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def rand(*shape, dtype=torch.float32, device="cpu", seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    return t.requires_grad_(requires_grad)


def grad_tol(dtype):
    # Gradients of low precision ops carry the rounding of the inputs, the
    # output gradient and the result: a few ulps of the largest entries.
    return {torch.float64: dict(rtol=1e-7, atol=1e-7), torch.float32: dict(rtol=1e-4, atol=1e-5),
            torch.bfloat16: dict(rtol=3e-2, atol=3e-2), torch.float16: dict(rtol=5e-3, atol=5e-3)}[dtype]


# ---------------------------------------------------------------------------
# softmax / log_softmax / layer_norm / rms_norm
#
# Every distinct (op, dtype, rank, flags, stride class) compiles a kernel
# (~0.5 s cold on 2 cores; conftest gives each run an empty cache), so the
# tests share one canonical layout per dtype (X_SHAPE, contiguous, last dim)
# and exercise other layouts, dims and flags in float32 only.
# ---------------------------------------------------------------------------

X_SHAPE = (3, 5, 37)


def ref_layer_norm(x, nd, w, b, eps):
    dims = list(range(x.dim() - nd, x.dim()))
    xd = x.double()
    mean = xd.mean(dims, keepdim=True)
    var = ((xd - mean) ** 2).mean(dims, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = (xd - mean) * rstd
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y, mean, rstd


def ref_rms_norm(x, nd, w, eps):
    dims = list(range(x.dim() - nd, x.dim()))
    xd = x.double()
    rstd = torch.rsqrt((xd * xd).mean(dims, keepdim=True) + eps)
    y = xd * rstd
    if w is not None:
        y = y * w.double()
    return y, rstd


def _strided(shape, dtype=torch.float32, seed=0):
    """A non-contiguous view of `shape` (every other element of the last dim)."""
    return rand(*shape[:-1], shape[-1] * 2, dtype=dtype, seed=seed)[..., ::2]


def _norm_case(op, x, nd=1, affine="both", dim=-1):
    """(function of the leaves, float64 reference of the leaves, leaves)."""
    ns = tuple(x.shape[x.dim() - nd:])
    dtype = x.dtype
    w = rand(*ns, dtype=dtype, seed=2, requires_grad=True) if affine in ("weight", "both") else None
    b = rand(*ns, dtype=dtype, seed=3, requires_grad=True) if affine in ("bias", "both") and op == "layer_norm" else None
    eps = 1e-5 if op == "layer_norm" else torch.finfo(dtype).eps
    leaves = [t for t in (x, w, b) if t is not None]

    def split(ts):
        it = iter(ts)
        return next(it), (next(it) if w is not None else None), (next(it) if b is not None else None)

    if op in ("softmax", "log_softmax"):
        return (lambda x: getattr(ops, op)(x, dim)), (lambda x: getattr(torch, op)(x, dim)), [x]
    if op == "layer_norm":
        return (lambda *t: ops.layer_norm(split(t)[0], ns, *split(t)[1:], eps=eps),
                lambda *t: F.layer_norm(split(t)[0], ns, *split(t)[1:], eps), leaves)
    return (lambda *t: ops.rms_norm(split(t)[0], ns, split(t)[1]),  # eps=None: finfo(dtype).eps, as PyTorch
            lambda *t: F.rms_norm(split(t)[0], ns, split(t)[1], eps), leaves)


def check_norm(op, x, **kw):
    """Values against float64 with assert_close's tolerances for x.dtype, and
    the backward against autograd of the float64 definition."""
    dtype = x.dtype
    x.requires_grad_()
    fn, ref, leaves = _norm_case(op, x, **kw)
    y = fn(*leaves)
    refs = [t.detach().double().requires_grad_() for t in leaves]
    yr = ref(*refs)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y, yr.to(dtype))
    gy = rand(*y.shape, dtype=dtype, seed=4)
    got = torch.autograd.grad(y, leaves, gy)
    want = torch.autograd.grad(yr, refs, gy.double())
    for g, r, leaf in zip(got, want, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
        torch.testing.assert_close(g, r.to(dtype), **grad_tol(dtype))


NORM_OPS = ["softmax", "log_softmax", "layer_norm", "rms_norm"]


@pytest.mark.parametrize("dtype", ALL, ids=str)
@pytest.mark.parametrize("op", NORM_OPS)
def test_norm_ops_values_and_grads(op, dtype):
    check_norm(op, rand(*X_SHAPE, dtype=dtype))


@pytest.mark.parametrize("op", NORM_OPS)
def test_norm_ops_layouts_dims_and_flags(op):
    """float32: a strided input, another dim / two normalised dims, rank 1, affine variants."""
    check_norm(op, _strided(X_SHAPE))
    if op in ("softmax", "log_softmax"):
        check_norm(op, rand(4, 1, 113), dim=0)
        check_norm(op, rand(203), dim=0)
        return
    check_norm(op, rand(2, 7, 33), nd=2)
    check_norm(op, rand(239))
    for affine in (("none", "bias") if op == "layer_norm" else ("none",)):
        check_norm(op, rand(*X_SHAPE), affine=affine)


def test_norm_statistics_come_from_the_forward():
    for dtype in (torch.float32, torch.bfloat16):
        x = rand(*X_SHAPE, dtype=dtype)
        w, b = rand(37, dtype=dtype, seed=2), rand(37, dtype=dtype, seed=3)
        y, mean, rstd = torch.ops.opfuse.layer_norm(x, 1, w, b, 1e-5)
        yr, mr, rr = ref_layer_norm(x, 1, w, b, 1e-5)
        assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == (3, 5, 1)
        torch.testing.assert_close(mean, mr.float())
        torch.testing.assert_close(rstd, rr.float(), rtol=1e-5, atol=1e-5)
        y, rstd = torch.ops.opfuse.rms_norm(x, 1, w, torch.finfo(dtype).eps)
        torch.testing.assert_close(rstd, ref_rms_norm(x, 1, w, torch.finfo(dtype).eps)[1].float(), rtol=1e-5, atol=1e-5)


def test_mixed_dtype_weights_and_empty_inputs():
    x = rand(*X_SHAPE, dtype=torch.bfloat16)
    w = rand(37, seed=1)  # float32 weight on a bfloat16 input, as in autocast models
    y = ops.layer_norm(x, (37,), w, None)
    torch.testing.assert_close(y, ref_layer_norm(x, 1, w, None, 1e-5)[0].to(torch.bfloat16))
    y = ops.rms_norm(x, (37,), w, 1e-6)
    torch.testing.assert_close(y, ref_rms_norm(x, 1, w, 1e-6)[0].to(torch.bfloat16))
    e = torch.empty(0, 5, 37)
    w = rand(37)
    for fn in (lambda t: ops.softmax(t, -1), lambda t: ops.layer_norm(t, (37,), w, w), lambda t: ops.rms_norm(t, (37,), w)):
        assert fn(e).shape == e.shape
    assert ops.softmax(torch.tensor(3.0), 0).item() == 1.0


@pytest.mark.parametrize("op", NORM_OPS)
def test_gradcheck_float64(op):
    # the canonical float64 kernels (rank 3, last dim), on a small tensor
    x = rand(2, 3, 7, dtype=torch.float64, requires_grad=True)
    fn, _, leaves = _norm_case(op, x)
    assert torch.autograd.gradcheck(fn, tuple(leaves))


def test_forward_is_one_fused_kernel_and_backward_reuses_saved_stats():
    x = rand(*X_SHAPE, requires_grad=True)
    w = rand(37, seed=2, requires_grad=True)
    b = rand(37, seed=3, requires_grad=True)
    calls = [lambda: ops.softmax(x, -1), lambda: ops.log_softmax(x, -1), lambda: ops.layer_norm(x, (37,), w, b),
             lambda: ops.rms_norm(x, (37,), w)]
    for call in calls:
        call().sum().backward()  # compile
        opfuse.reset_stats()
        y = call()
        assert opfuse.stats()["kernel_launches"] == 1, "the forward must be one fused kernel"
        opfuse.reset_stats()
        y.sum().backward()
        # dx is one kernel; layer_norm's dw and db reductions add theirs
        assert 1 <= opfuse.stats()["kernel_launches"] <= 3
    kernels = {k[0][0]: g.num_kernels for k, g in _kernel.cached_graphs().items()}
    for op in ("softmax", "log_softmax", "layer_norm", "rms_norm", "softmax_backward", "log_softmax_backward"):
        assert kernels[op] == 1, (op, kernels[op])
    # The backward graphs take mean/rstd as inputs: they do not recompute the statistics.
    for (key, _, _), g in _kernel.cached_graphs().items():
        if key[0] == "layer_norm_backward":
            assert 'name="mean"' in g.ir_text and 'name="rstd"' in g.ir_text
            assert "layer_norm_stats" not in g.ir_text
        if key[0] == "rms_norm_backward":
            assert 'name="rstd"' in g.ir_text and "rms_norm_rstd" not in g.ir_text

# ---------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------


def _opcheck_cases(device):
    # the canonical layouts and flags of the value tests, so no new kernels compile
    x = rand(*X_SHAPE, device=device, requires_grad=True)
    w = rand(37, device=device, seed=2, requires_grad=True)
    b = rand(37, device=device, seed=3, requires_grad=True)
    y = torch.softmax(x.detach(), -1)
    mean = x.detach().mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.detach().var(-1, unbiased=False, keepdim=True) + 1e-5)
    eps = torch.finfo(torch.float32).eps
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q = rand(2, 4, 9, 64, dtype=dt, device=device, requires_grad=True)
    k = rand(2, 2, 13, 64, dtype=dt, device=device, seed=1, requires_grad=True)
    v = rand(2, 2, 13, 64, dtype=dt, device=device, seed=2, requires_grad=True)
    pad = torch.ones(2, 1, 1, 13, dtype=torch.bool, device=device)
    pad[1, ..., 7:] = False
    add = rand(9, 13, dtype=dt, device=device, seed=3, requires_grad=True)
    o, lse = torch.ops.opfuse.attention(q.detach(), k.detach(), v.detach(), None, True, 0.125)
    go = rand(2, 4, 9, 64, dtype=dt, device=device, seed=4)
    return [
        ("softmax", (x, -1)),
        ("log_softmax", (x, 2)),
        ("softmax_backward", (y, y, -1)),
        ("log_softmax_backward", (y, y.log(), -1)),
        ("layer_norm", (x, 1, w, b, 1e-5)),
        ("layer_norm", (x, 1, None, b, 1e-5)),
        ("layer_norm_backward", (y, x.detach(), mean, rstd, w.detach(), b.detach(), 1, [True, True, True])),
        ("rms_norm", (x, 1, w, eps)),
        ("rms_norm_backward", (y, x.detach(), rstd, w.detach(), 1, [True, True])),
        ("attention", (q, k, v, None, False, 0.125)),
        ("attention", (q, k, v, None, True, 0.125)),
        ("attention", (q, k, v, pad, False, 0.125)),
        ("attention", (q, k, v, add, True, 0.125)),
        ("attention_backward", (go, q.detach(), k.detach(), v.detach(), o, lse, None, True, 0.125, False)),
    ]


def _opcheck(device):
    for name, args in _opcheck_cases(device):
        op = getattr(torch.ops.opfuse, name).default
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (name, result)


def test_opcheck_cpu():
    _opcheck("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_opcheck_cuda():
    _opcheck("cuda")


def test_argument_errors():
    with pytest.raises(TypeError):
        ops.softmax(torch.arange(5), 0)
    with pytest.raises(IndexError):
        ops.softmax(torch.randn(3, 4), 2)
    with pytest.raises(ValueError):
        ops.layer_norm(torch.randn(3, 4), (5,))
    with pytest.raises(ValueError):
        ops.rms_norm(torch.randn(3, 4), (4,), torch.randn(5))
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError):
        ops.attention(q, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))  # 3 heads over 2
    with pytest.raises(ValueError):
        ops.attention(q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError):
        ops.attention(q, q.double(), q)


# ---------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------


def ref_attention(q, k, v, causal=False, scale=None, mask=None, dtype=torch.float64):
    """The definition, in `dtype`: bottom-right causal mask built explicitly,
    bool mask True = attend, additive mask added to the scaled scores, and a
    softmax that gives 0 (with finite gradients) on fully masked rows."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    G = q.shape[1] // k.shape[1]
    q, k, v = q.to(dtype), k.to(dtype).repeat_interleave(G, 1), v.to(dtype).repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    Sq, Sk = q.shape[2], k.shape[2]
    hide = torch.zeros(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        hide = ~torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(Sk - Sq)
    if mask is not None and mask.dtype == torch.bool:
        hide = hide | ~mask
    elif mask is not None:
        s = s + mask.to(dtype)
    s = s.masked_fill(hide, -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    return (e / torch.where(den == 0, torch.ones_like(den), den)) @ v


def torch_low_precision(q, k, v, causal, scale, mask):
    """PyTorch's own low-precision attention (SDPA, math backend) with the same
    bottom-right causal mask, GQA by repeating k and v."""
    G = q.shape[1] // k.shape[1]
    Sq, Sk = q.shape[2], k.shape[2]
    m = mask
    if causal:
        c = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(Sk - Sq)
        if m is None:
            m = c
        elif m.dtype == torch.bool:
            m = m & c
        else:
            m = m.masked_fill(~c, -math.inf)
    if m is not None and m.dtype != torch.bool:
        m = m.to(q.dtype)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=m,
                                              scale=scale)


def _qkv(B, Hq, Hkv, Sq, Sk, D, dtype, device="cpu", seed=0):
    q = rand(B, Hq, Sq, D, dtype=dtype, device=device, seed=seed, requires_grad=True)
    k = rand(B, Hkv, Sk, D, dtype=dtype, device=device, seed=seed + 1, requires_grad=True)
    v = rand(B, Hkv, Sk, D, dtype=dtype, device=device, seed=seed + 2, requires_grad=True)
    return q, k, v


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check_flash_rule(q, k, v, causal=False, scale=None, mask=None, grads=True):
    """Our error vs a float32 reference is at most 2x PyTorch's (3x for gradients)."""
    o = ops.attention(q, k, v, causal=causal, scale=scale, attn_mask=mask)
    assert o.dtype == q.dtype and not o.isnan().any()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = ref_attention(q32, k32, v32, causal, scale, mask, dtype=torch.float32)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    pt = torch_low_precision(ql, kl, vl, causal, scale, mask)
    err, err_pt = _max_err(o, ref), _max_err(pt, ref)
    assert err <= 2 * err_pt, f"output error {err:.3g} > 2 x PyTorch's {err_pt:.3g}"
    if not grads:
        return
    go = rand(*o.shape, dtype=q.dtype, device=q.device, seed=7)
    ours = torch.autograd.grad(o, (q, k, v), go)
    want = torch.autograd.grad(ref, (q32, k32, v32), go.float())
    theirs = torch.autograd.grad(pt, (ql, kl, vl), go)
    for name, a, w, t in zip("qkv", ours, want, theirs):
        assert a.dtype == q.dtype and a.shape == w.shape and not a.isnan().any()
        e, e_pt = _max_err(a, w), _max_err(t, w)
        assert e <= 3 * e_pt, f"d{name} error {e:.3g} > 3 x PyTorch's {e_pt:.3g}"


# (Sq, Sk): odd sizes, Sq != Sk both ways, one query row
SEQ_PAIRS = [(113, 203), (1, 239), (128, 217), (203, 113), (64, 64)]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqs", SEQ_PAIRS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_attention_flash_rule(dtype, causal, seqs):
    Sq, Sk = seqs
    heads = (4, 2) if Sq != 64 else (4, 1)  # GQA, MQA
    q, k, v = _qkv(2, heads[0], heads[1], Sq, Sk, 64, dtype, seed=Sq + Sk)
    check_flash_rule(q, k, v, causal=causal, grads=dtype == torch.bfloat16 or Sq == 113)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_against_float64(dtype, causal):
    for (Sq, Sk), (Hq, Hkv), D in [((113, 203), (4, 2), 64), ((203, 113), (3, 1), 40), ((1, 239), (2, 2), 128)]:
        q, k, v = _qkv(2, Hq, Hkv, Sq, Sk, D, dtype, seed=Sq)
        o = ops.attention(q, k, v, causal=causal)
        qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = ref_attention(qr, kr, vr, causal)
        torch.testing.assert_close(o, ref.to(dtype))
        go = rand(*o.shape, dtype=dtype, seed=3)
        for a, w in zip(torch.autograd.grad(o, (q, k, v), go), torch.autograd.grad(ref, (qr, kr, vr), go.double())):
            torch.testing.assert_close(a, w.to(dtype), **grad_tol(dtype))


def test_causal_is_bottom_right_aligned():
    q, k, v = _qkv(1, 2, 2, 5, 9, 16, torch.float64)
    o = ops.attention(q, k, v, causal=True)
    bottom_right = ref_attention(q, k, v, causal=True)
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # PyTorch: top-left when Sq != Sk
    torch.testing.assert_close(o, bottom_right)
    assert _max_err(o, top_left) > 1e-3
    # Sq > Sk: the first Sq - Sk query rows see no key at all -> 0
    q, k, v = _qkv(1, 2, 1, 9, 5, 16, torch.float32)
    o = ops.attention(q, k, v, causal=True)
    assert (o[:, :, :4] == 0).all() and not o.isnan().any()
    torch.testing.assert_close(o, ref_attention(q, k, v, causal=True).float())


def test_attention_scale_and_strided_inputs():
    base = rand(2, 9, 4, 32)  # [B, S, H, D] -> transposed views [B, H, S, D]
    q = base.transpose(1, 2)
    k = rand(2, 11, 4, 32, seed=1).transpose(1, 2)
    v = rand(2, 11, 4, 32, seed=2).transpose(1, 2)
    for scale in (0.3, None):
        torch.testing.assert_close(ops.attention(q, k, v, scale=scale), ref_attention(q, k, v, scale=scale).float())
    # a negative scale is valid math (the CUDA kernel would not take it; CPU does)
    torch.testing.assert_close(ops.attention(q, k, v, scale=-0.2), ref_attention(q, k, v, scale=-0.2).float())


def _padding_mask(B, Sk, lengths, device="cpu"):
    m = torch.zeros(B, 1, 1, Sk, dtype=torch.bool, device=device)
    for b, n in enumerate(lengths):
        m[b, ..., :n] = True
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_key_padding_mask_with_fully_masked_rows(dtype, causal):
    B, Hq, Hkv, Sq, Sk, D = 3, 4, 2, 37, 53, 32
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, dtype, seed=11)
    mask = _padding_mask(B, Sk, [Sk, 17, 0])  # batch 2: every key padded -> every row fully masked
    o = ops.attention(q, k, v, causal=causal, attn_mask=mask)
    assert not o.isnan().any()
    assert (o[2] == 0).all()
    go = rand(*o.shape, dtype=dtype, seed=5)
    grads = torch.autograd.grad(o, (q, k, v), go)
    for g in grads:
        assert not g.isnan().any()
    assert all((g[2] == 0).all() for g in grads)
    if dtype in LOW:
        check_flash_rule(*_qkv(B, Hq, Hkv, Sq, Sk, D, dtype, seed=11), causal=causal, mask=mask)
        return
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = ref_attention(qr, kr, vr, causal, mask=mask)
    torch.testing.assert_close(o, ref.to(dtype))
    for a, w in zip(grads, torch.autograd.grad(ref, (qr, kr, vr), go.double())):
        torch.testing.assert_close(a, w.to(dtype), **grad_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_additive_mask_and_its_gradient(dtype):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 4, 19, 31, 16
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, dtype, seed=21)
    for shape in [(Sq, Sk), (B, 1, Sq, Sk), (1, Hq, 1, Sk)]:
        mask = rand(*shape, dtype=dtype, seed=22)
        mask = mask.masked_fill(rand(*shape, seed=23) > 1.2, -math.inf).requires_grad_()
        o = ops.attention(q, k, v, causal=True, attn_mask=mask)
        if dtype in LOW:
            check_flash_rule(q, k, v, causal=True, mask=mask.detach(), grads=False)
            continue
        qr, kr, vr, mr = (t.detach().double().requires_grad_() for t in (q, k, v, mask))
        ref = ref_attention(qr, kr, vr, True, mask=mr)
        torch.testing.assert_close(o, ref.float())
        go = rand(*o.shape, seed=5)
        got = torch.autograd.grad(o, (q, k, v, mask), go)
        want = torch.autograd.grad(ref, (qr, kr, vr, mr), go.double())
        for a, w in zip(got, want):
            assert a.shape == w.shape
            torch.testing.assert_close(a, w.float(), **grad_tol(torch.float32))
    # A row whose additive mask is all -inf is fully masked too.
    mask = torch.zeros(Sq, Sk, dtype=dtype)
    mask[3] = -math.inf
    o = ops.attention(q, k, v, attn_mask=mask)
    assert (o[:, :, 3] == 0).all() and not o.isnan().any()


def test_attention_gradcheck_float64():
    q, k, v = _qkv(1, 2, 1, 3, 5, 4, torch.float64, seed=31)
    mask = rand(3, 5, dtype=torch.float64, seed=32, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v, m: ops.attention(q, k, v, causal=True, attn_mask=m),
                                    (q, k, v, mask))
    pad = _padding_mask(1, 5, [3])
    assert torch.autograd.gradcheck(lambda q, k, v: ops.attention(q, k, v, attn_mask=pad, scale=0.7), (q, k, v))


def test_attention_cpu_paths_agree():
    """The tiled float32 kernel (no mask) and the masked CPU kernel (all-True
    mask) compute the same thing; float64 runs in float64."""
    q, k, v = (t.detach() for t in _qkv(2, 4, 2, 77, 131, 48, torch.float32, seed=41))
    for causal in (False, True):
        tiled = ops.attention(q, k, v, causal=causal)
        masked = ops.attention(q, k, v, causal=causal, attn_mask=torch.ones(131, dtype=torch.bool))
        torch.testing.assert_close(tiled, masked)
        o64, lse64 = torch.ops.opfuse.attention(q.double(), k.double(), v.double(), None, causal, 48 ** -0.5)
        assert o64.dtype == lse64.dtype == torch.float64
        torch.testing.assert_close(o64, ref_attention(q, k, v, causal), rtol=1e-12, atol=1e-12)


def test_attention_lse_is_saved_and_correct():
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 9, 7, 16, torch.float32, seed=51))
    o, lse = torch.ops.opfuse.attention(q, k, v, None, True, 0.25)
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.25
    s = s.masked_fill(~torch.ones(9, 7, dtype=torch.bool).tril(-2), -math.inf)
    want = torch.logsumexp(s, -1)
    assert torch.isinf(lse[:, :, :2]).all() and (lse[:, :, :2] < 0).all()  # rows 0, 1 see no key
    torch.testing.assert_close(lse[:, :, 2:].double(), want[:, :, 2:], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# torch.compile: the ops are single graph nodes (no graph break)
# ---------------------------------------------------------------------------


def _model(q, k, v, x, w, pad):
    a = ops.attention(q, k, v, causal=True)
    b = ops.attention(q, k, v, attn_mask=pad)
    return a, b, ops.layer_norm(x, (37,), w, w), ops.rms_norm(x, (37,), w), ops.softmax(x, -1), ops.log_softmax(x, -1)


@pytest.mark.parametrize("backend", ["inductor", "opfuse"])
def test_inside_torch_compile(backend):
    q, k, v = _qkv(2, 4, 2, 13, 21, 32, torch.float32, seed=61)
    x = rand(*X_SHAPE, requires_grad=True)
    w = rand(37, seed=1, requires_grad=True)
    pad = _padding_mask(2, 21, [21, 9])
    leaves = (q, k, v, x, w)
    eager = _model(q, k, v, x, w, pad)
    ge = torch.autograd.grad(sum(o.sum() for o in eager), leaves)
    compiled = torch.compile(_model, backend=backend, fullgraph=True)  # fullgraph: a graph break raises
    got = compiled(q, k, v, x, w, pad)
    gc = torch.autograd.grad(sum(o.sum() for o in got), leaves)
    for a, b in zip(got + gc, eager + ge):
        torch.testing.assert_close(a, b)


def test_disable_env_runs_pytorch(monkeypatch):
    monkeypatch.setenv("OPFUSE_DISABLE", "1")
    x = rand(4, 37, requires_grad=True)
    w = rand(37, seed=1)
    opfuse.reset_stats()
    torch.testing.assert_close(ops.softmax(x, -1), torch.softmax(x, -1))
    torch.testing.assert_close(ops.rms_norm(x, (37,), w, 1e-6), F.rms_norm(x, (37,), w, 1e-6))
    q, k, v = _qkv(1, 2, 1, 5, 7, 8, torch.float32)
    torch.testing.assert_close(ops.attention(q, k, v, causal=True), ref_attention(q, k, v, True).float())
    assert opfuse.stats()["kernel_launches"] == 0


# ---------------------------------------------------------------------------
# CUDA code: compiled with NVRTC here (no GPU needed), run by the gpu tests
# ---------------------------------------------------------------------------


@needs_nvrtc
def test_attention_launcher_compiles_for_sm80_and_sm90():
    # One instantiation per architecture through the C++ launcher's compile path
    # (name expression -> lowered name, disk cache); the whole set is the slow test below.
    jobs = [("bf16", 64, False, _C.attention_tile(64, 113, 203, False, 80), 80),
            ("f16", 128, True, _C.attention_tile(128, 4096, 4096, True, 90), 90)]
    with cf.ThreadPoolExecutor(max_workers=2) as ex:  # NVRTC releases the GIL
        results = list(ex.map(lambda j: _C.attention_compile(*j), jobs))
    for (elem, d, causal, tile, arch), (expr, lowered, cubin, log, hit) in zip(jobs, results):
        assert expr == _C.attention_name_expression(elem, d, causal, tile)
        assert lowered.startswith("_ZN11opfuse_attn13attention_fwd") and lowered.encode() in cubin
        assert cubin[:4] == b"\x7fELF" and not hit
        assert f"sm_{arch}" in log
    again = _C.attention_compile(*jobs[0])
    assert again[4] and again[1] == results[0][1] and again[2] == results[0][2]  # from the disk cache


@pytest.mark.slow
@needs_nvrtc
def test_every_attention_instantiation_compiles(request):
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("slow (~2 min on 2 cores): run with -m slow")
    jobs = [(e, d, c, t, arch) for arch in (80, 90) for d in (64, 96, 128, 256)
            for t in _C.attention_candidate_tiles(d, arch) for e in ("bf16", "f16") for c in (False, True)]
    with cf.ThreadPoolExecutor(max_workers=2) as ex:
        for r in ex.map(lambda j: _C.attention_compile(*j), jobs):
            assert r[2][:4] == b"\x7fELF"


def test_attention_tile_choice():
    assert _C.attention_tile(64, 1000, 1000, False, 90) == "128x128w4b2"
    assert _C.attention_tile(128, 4096, 8192, False, 90) == "256x64w8b1"
    assert _C.attention_tile(128, 4096, 8192, True, 90) == "128x64w4b2"
    assert _C.attention_tile(256, 100, 100, False, 80) == "128x32w8b1"
    assert _C.attention_tile(256, 100, 100, False, 86) == "64x32w4b1"
    assert _C.attention_smem_bytes(128, "128x64w4b2") == (128 + 4 * 64) * (128 + 8) * 2


def test_attention_cuda_checks_without_gpu():
    args = dict(elem="bf16", ptrs=[0, 0, 0, 0, 0], sizes=[1, 4, 2, 10, 10, 64],
                strides=[[2560, 640, 64]] * 4 + [[40, 10]], causal=False, scale=0.125)
    assert _C.attention_cuda_unsupported_reason(*args.values()) == ""
    bad = dict(args, sizes=[1, 4, 2, 10, 10, 80])
    assert "head dim" in _C.attention_cuda_unsupported_reason(*bad.values())
    bad = dict(args, strides=[[2560, 640, 63]] + [[2560, 640, 64]] * 3 + [[40, 10]])
    assert "multiples of 8" in _C.attention_cuda_unsupported_reason(*bad.values())
    bad = dict(args, ptrs=[2, 0, 0, 0, 0])
    assert "aligned" in _C.attention_cuda_unsupported_reason(*bad.values())


def test_attention_mask_checks_without_gpu():
    # attn_mask through the C++ launcher's checks (attention_launcher.h): kind
    # names, the key stride, key padding's zero head/row strides, alignment.
    args = dict(elem="bf16", ptrs=[0, 0, 0, 0, 0], sizes=[2, 4, 2, 10, 12, 64],
                strides=[[2560, 640, 64]] * 4 + [[40, 10]], causal=True, scale=0.125)
    why = lambda kind, ptr, st: _C.attention_cuda_unsupported_reason(*args.values(), kind, ptr, st)  # noqa: E731
    assert why("", 0, []) == ""
    assert why("full-bool", 4096 + 1, [0, 0, 12, 1]) == ""  # bool: any byte address
    assert why("full-bf16", 4096, [480, 120, 12, 1]) == ""
    assert why("full-f32", 4096, [0, 0, 0, 1]) == ""
    assert why("keypad", 4096, [12, 0, 0, 1]) == ""
    assert "key dim" in why("full-f32", 4096, [0, 0, 1, 12])
    assert "key padding" in why("keypad", 4096, [12, 0, 12, 1])
    assert "aligned" in why("full-f32", 4096 + 2, [0, 0, 12, 1])
    assert "null" in why("full-f16", 0, [0, 0, 12, 1])
    with pytest.raises(ValueError, match="mask kind"):
        why("full-f64", 4096, [0, 0, 12, 1])
    e = _C.attention_name_expression("bf16", 64, True, "128x128w4b2", "keypad")
    assert e.endswith("false, opfuse_attn::MaskKeyPad>")
    assert _C.attention_name_expression("f16", 96, False, "128x64w4b2").endswith("false>")
    assert _C.attention_backward_tiles(64, 90) == ("128x128w8b1", "128x64w8b1")


@needs_nvrtc
def test_attention_masked_instantiations_compile():
    # One masked forward (mma.sync and Hopper) and one masked backward problem
    # through the launchers' compile paths; CI compiles the whole set in
    # tests/gpu/attention/test_attention*_nvrtc_compile.py.
    expr, lowered, cubin, _, _ = _C.attention_compile("bf16", 64, False, "128x64w4b2", 80, False, "full-bool")
    assert "MaskFull<opfuse_attn::bool8>" in expr and cubin[:4] == b"\x7fELF"
    expr, lowered, cubin, _, _ = _C.attention_sm90_compile("bf16", 128, True, "wg128x128s2p", False, "keypad")
    assert "attention_fwd_sm90" in expr and "MaskKeyPad" in expr and cubin[:4] == b"\x7fELF"
    exprs, lowered, cubin, _, _ = _C.attention_backward_compile("f16", 64, True, 90, False, "full-f16")
    assert any("attention_bwd_dkdv<opfuse_attn::f16, 64, true, 64, 128, 8, 1, true, opfuse_attn::MaskFull" in x
               for x in exprs), exprs
    assert len(lowered) == 5 and cubin[:4] == b"\x7fELF"


@needs_nvrtc
def test_attention_sm90_option_tags_compile():
    # The OPTS letters of a Hopper tile tag (o overlap, k skip, l pairs, d descriptors) reach
    # the name expression as the template argument after the Mask, the same
    # as tests/gpu/attention/attn_runtime_sm90.name_expression_sm90 writes it.
    expr, _, cubin, log, _ = _C.attention_sm90_compile("bf16", 128, True, "wg128x128s2pl", False, "keypad")
    assert expr.endswith("true, opfuse_attn::MaskKeyPad, 4>") and cubin[:4] == b"\x7fELF"
    expr, _, cubin, log, _ = _C.attention_sm90_compile("f16", 64, False, "wg192x128s4pl", False)
    assert expr.endswith("true, opfuse_attn::MaskNone, 4>") and cubin[:4] == b"\x7fELF"
    assert "Performance Loss" not in log
    # d (descriptors by offset, bit 8): the non-causal default since branch attn-fwd-4.
    expr, _, cubin, log, _ = _C.attention_sm90_compile("bf16", 128, False, "wg128x128s2pd", False)
    assert expr.endswith("false, 128, 2, 2, true, opfuse_attn::MaskNone, 8>") and cubin[:4] == b"\x7fELF"
    assert "Performance Loss" not in log
    # w (split tail, bit 16): the non-causal default since session 23, the causal one (with
    # pairs, "lw") since session 24; a causal "w" kernel without pairs does not exist.
    expr, _, cubin, log, _ = _C.attention_sm90_compile("bf16", 64, False, "wg192x128s4pdw", False)
    assert expr.endswith("false, 128, 3, 4, true, opfuse_attn::MaskNone, 24>") and cubin[:4] == b"\x7fELF"
    assert "Performance Loss" not in log
    expr, _, cubin, log, _ = _C.attention_sm90_compile("bf16", 128, True, "wg128x128s2plw", False)
    assert expr.endswith("true, 128, 2, 2, true, opfuse_attn::MaskNone, 20>") and cubin[:4] == b"\x7fELF"
    assert "Performance Loss" not in log
    with pytest.raises(Exception, match="kOptSplit"):
        _C.attention_sm90_compile("bf16", 128, True, "wg128x128s2pdw", False)
    # b (query blocks ending at Sq, bit 32): causal only, the causal default since session 24.
    expr, _, cubin, log, _ = _C.attention_sm90_compile("bf16", 64, True, "wg192x128s4plwb", False)
    assert expr.endswith("true, 128, 3, 4, true, opfuse_attn::MaskNone, 52>") and cubin[:4] == b"\x7fELF"
    assert "Performance Loss" not in log
    with pytest.raises(Exception, match="kOptShift"):
        _C.attention_sm90_compile("bf16", 64, False, "wg192x128s4pb", False)
    with pytest.raises(ValueError, match="tag"):
        _C.attention_sm90_compile("bf16", 128, True, "wg128x128s2lp", False)
    # t (O through TMA stores, bit 64; session 25): one store per 64 columns, not with the overlap.
    expr, _, cubin, log, _ = _C.attention_sm90_compile("bf16", 128, False, "wg128x128s2pdwt", False)
    assert expr.endswith("false, 128, 2, 2, true, opfuse_attn::MaskNone, 88>") and cubin[:4] == b"\x7fELF"
    assert "Performance Loss" not in log and "0 bytes spill stores" in log
    with pytest.raises(ValueError, match="'t' needs two consumers and no 'o'"):
        _C.attention_sm90_compile("bf16", 128, False, "wg128x128s2pot", False)
    with pytest.raises(ValueError, match="'t' needs two consumers"):
        _C.attention_sm90_compile("bf16", 64, False, "wg192x128s4pdwt", False)
    with pytest.raises(ValueError, match="tag"):
        _C.attention_sm90_compile("bf16", 128, True, "wg128x128s2pdl", False)


def test_attention_sm90_mirrors_match_the_launcher():
    # The ctypes harness (tests/gpu/attention/attn_runtime_sm90.py) decides on its own whether a call
    # cuts the causal split and how much shared memory a tile takes; both must be the launcher's.
    import random
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "gpu" / "attention"))
    import attn_runtime_sm90 as sm

    rng = random.Random(24)
    for _ in range(3000):
        sq, sk = rng.randint(1, 20000), rng.randint(1, 20000)
        if rng.random() < 0.3:
            sk = sq
        block_m, block_n = rng.choice([64, 128, 192]), rng.choice([64, 128, 176])
        hb, grid, shift = rng.randint(1, 600), rng.choice([1, 7, 78, 114, 132]), rng.random() < 0.5
        assert (_C.attention_sm90_causal_split_cuts(sq, sk, block_m, block_n, hb, grid, shift)
                == sm.causal_split_cuts(sq, sk, block_m, block_n, hb, grid, shift)), (sq, sk, block_m, block_n, hb, grid)
    # FlashAttention setup: cut at S >= 2048 (16 key blocks), not below.
    assert _C.attention_sm90_causal_split_cuts(2048, 2048, 192, 128, 8 * 32, 132, True)
    assert not _C.attention_sm90_causal_split_cuts(1024, 1024, 192, 128, 16 * 32, 132, True)
    for d in sm.HEAD_DIMS_SM90:
        for cfg in sm.configs_sm90(d):
            assert _C.attention_sm90_smem_bytes(d, cfg.tag()) == sm.smem_bytes_sm90(d, cfg), cfg.tag()


def test_attention_sm90_head_dim_96_tiles():
    # D = 96 on Hopper: its own instantiation with rows stored 128 columns
    # wide in shared memory (whole swizzle atoms); D = 128's tiles, the
    # non-causal one without "d" (ptxas spilled 8 bytes with it).
    assert [_C.attention_sm90_stored_dim(d) for d in (64, 96, 128, 256)] == [64, 128, 128, 256]
    assert _C.attention_sm90_default_tile(96, False) == _C.attention_sm90_default_tile(128, False).replace("d", "")
    assert _C.attention_sm90_default_tile(96, True) == _C.attention_sm90_default_tile(128, True)
    assert _C.attention_sm90_default_tile(96, True, True) == _C.attention_sm90_default_tile(128, True, True)
    for causal in (False, True):
        tag = _C.attention_sm90_default_tile(96, causal)
        assert _C.attention_sm90_smem_bytes(96, tag) == _C.attention_sm90_smem_bytes(128, tag)
    with pytest.raises(ValueError, match="64, 96, 128 and 256"):
        _C.attention_sm90_default_tile(80, False)


@needs_nvrtc
@pytest.mark.parametrize("arch", [80, 90])
def test_norm_kernels_compile_for_cuda(arch):
    """The generated CUDA source of every forward and backward graph compiles."""
    graphs = [
        (norms._softmax_graph("softmax", "bf16", 3, 2), [[4, 5, 64]]),
        (norms._softmax_backward_graph("log_softmax_backward", "f16", 2, 1), [[4, 64], [4, 64]]),
        (norms._layer_norm_graph("bf16", 3, 1, "bf16", "bf16", 1e-5), [[4, 5, 64], [64], [64]]),
        (norms._layer_norm_backward_graph("bf16", "f32", 3, 1, "bf16", "bf16", (True, True, True)),
         [[4, 5, 64], [4, 5, 64], [4, 5, 1], [4, 5, 1], [64]]),
        (norms._rms_norm_graph("f16", 2, 1, "f32", 1e-6), [[4, 64], [64]]),
        (norms._rms_norm_backward_graph("f32", "f32", 2, 1, "f32", (True, True)), [[4, 64], [4, 64], [4, 1], [64]]),
    ]
    for text, shapes in graphs:
        cg = _C.CompiledGraph(text, target="cuda")
        strides = [list(torch.empty(s).stride()) for s in shapes]
        cubin, _, _ = cg.compile_cuda(shapes, strides, arch, False)
        assert len(cubin) > 0


def test_backward_graphs_for_known_shapes_fold_the_column_sums():
    """On CUDA the layer_norm and rms_norm backward ops build their graphs for
    the concrete shape when a weight or bias gradient is asked: the planner
    then folds the column sums into the dx kernel (column partials) instead of
    a kernel that reads dy and x again."""
    for text in (norms._layer_norm_backward_graph("bf16", "f32", 2, 1, "bf16", "bf16", (True, True, True), (32768, 4096)),
                 norms._rms_norm_backward_graph("bf16", "f32", 2, 1, "bf16", (True, True), (4099, 256))):
        plan = _C.CompiledGraph(text, target="cuda").plan_text()
        assert "column_partials" in plan.splitlines()[0], plan
    symbolic = norms._layer_norm_backward_graph("bf16", "f32", 2, 1, "bf16", "bf16", (True, True, True))
    assert "column_partials" not in _C.CompiledGraph(symbolic, target="cuda").plan_text()


def test_backward_shape_specialization_is_bounded(monkeypatch):
    class FakeCuda:  # the attributes _column_sum_dims reads
        is_cuda = True
        device = "cuda:0"

        def __init__(self, *shape):
            self.shape = shape

        def numel(self):
            return math.prod(self.shape)

    monkeypatch.setattr(norms, "_specialized", {})
    monkeypatch.setattr(norms, "MAX_SHAPES_SPECIALIZED", 2)
    key = ("layer_norm_backward", "test")
    assert norms._column_sum_dims(key, FakeCuda(8, 64), True) == (8, 64)
    assert norms._column_sum_dims(key, FakeCuda(8, 64), False) is None  # no column gradient asked
    assert norms._column_sum_dims(key, FakeCuda(9, 64), True) == (9, 64)
    assert norms._column_sum_dims(key, FakeCuda(10, 64), True) is None  # past the bound: the symbolic graph
    assert norms._column_sum_dims(key, FakeCuda(8, 64), True) == (8, 64)  # already built
    assert norms._column_sum_dims(key, FakeCuda(0, 64), True) is None


def test_backward_shape_bound_from_the_environment(monkeypatch):
    """OPFUSE_NORM_BWD_SHAPES: 16 by default, 0 for the symbolic graph
    always, a clear error naming the variable for a value that is no count."""
    for raw, bound in (("", 16), ("0", 0), ("3", 3), ("-2", 0)):
        monkeypatch.setenv("OPFUSE_NORM_BWD_SHAPES", raw)
        assert norms._shapes_from_env() == bound, raw
    monkeypatch.setenv("OPFUSE_NORM_BWD_SHAPES", "many")
    with pytest.raises(ValueError, match="OPFUSE_NORM_BWD_SHAPES='many'"):
        norms._shapes_from_env()


# ---------------------------------------------------------------------------
# GPU execution (skipped without a CUDA device)
# ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ALL, ids=str)
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "layer_norm", "rms_norm"])
def test_norms_cuda(op, dtype):
    x = rand(6, 5, 129, dtype=dtype, device="cuda", requires_grad=True)
    w = rand(129, dtype=dtype, device="cuda", seed=1, requires_grad=True)
    fn = {"softmax": lambda x: ops.softmax(x, -1), "log_softmax": lambda x: ops.log_softmax(x, 1),
          "layer_norm": lambda x: ops.layer_norm(x, (129,), w, w), "rms_norm": lambda x: ops.rms_norm(x, (129,), w)}[op]
    ref = {"softmax": lambda x: torch.softmax(x, -1), "log_softmax": lambda x: torch.log_softmax(x, 1),
           "layer_norm": lambda x: F.layer_norm(x, (129,), wr, wr), "rms_norm": lambda x: F.rms_norm(x, (129,), wr, torch.finfo(dtype).eps)}[op]
    wr = w.detach().double().requires_grad_()
    xr = x.detach().double().requires_grad_()
    y, yr = fn(x), ref(xr)
    torch.testing.assert_close(y, yr.to(dtype))
    gy = rand(*y.shape, dtype=dtype, device="cuda", seed=3)
    leaves = (x, w) if op in ("layer_norm", "rms_norm") else (x,)
    rleaves = (xr, wr) if op in ("layer_norm", "rms_norm") else (xr,)
    for a, b in zip(torch.autograd.grad(y, leaves, gy), torch.autograd.grad(yr, rleaves, gy.double())):
        torch.testing.assert_close(a, b.to(dtype), **grad_tol(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqs", SEQ_PAIRS + [(1023, 1024), (512, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_attention_cuda_kernel_flash_rule(dtype, D, causal, seqs):
    Sq, Sk = seqs
    q, k, v = _qkv(2, 4, 2, Sq, Sk, D, dtype, device="cuda", seed=Sq + D)
    opfuse.reset_stats()
    check_flash_rule(q, k, v, causal=causal, grads=D in (96, 128))
    assert not attention_module._broken, attention_module._broken  # no compile/launch failure fell back
    assert opfuse.stats()["kernel_launches"] >= 1  # the forward ran the kernel, not the math path


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [False, True])
def test_attention_cuda_head_dim_96_views_of_wider_rows(causal):
    # D = 96 views of 128-column rows whose last 32 columns hold NaN: on sm_90
    # the D = 128 kernel reads through tensor maps of 96 columns, so those
    # columns must come in as TMA's zero fill, never from memory; and it must
    # store only O's 96 columns (O here is contiguous: a 97th column written
    # would land on the next row). Same bits as on contiguous copies.
    B, Hq, Hkv, Sq, Sk = 2, 4, 2, 203, 331
    wide = [rand(B, h, s, 128, dtype=torch.bfloat16, device="cuda", seed=40 + i)
            for i, (h, s) in enumerate(((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))]
    for t in wide:
        t[..., 96:] = float("nan")
    q, k, v = (t[..., :96] for t in wide)
    assert q.stride(2) == 128 and not q.is_contiguous()
    opfuse.reset_stats()
    o = ops.attention(q, k, v, causal=causal)
    assert not attention_module._broken, attention_module._broken
    assert opfuse.stats()["kernel_launches"] >= 1
    assert o.shape == (B, Hq, Sq, 96) and not o.isnan().any()
    assert torch.equal(o, ops.attention(*(t.contiguous() for t in (q, k, v)), causal=causal))
    check_flash_rule(*(t.contiguous().requires_grad_() for t in (q, k, v)), causal=causal, grads=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [False, True])
def test_attention_cuda_head_dim_96_backward_views(causal, monkeypatch):
    # The backward at D = 96 (on sm_90 the D = 128 Hopper kernels with
    # AttnBwdParams.d_cols = 96): q, k, v and dO are views of 128-column rows
    # holding NaN past 96. Gradients: no NaN, dK and dV the same bits as from
    # contiguous copies (each key block has one writer), dQ (float atomics)
    # within rounding; the mma.sync backward agrees; the flash rule holds.
    B, Hq, Hkv, Sq, Sk = 2, 4, 2, 203, 331
    shapes = ((Hq, Sq), (Hkv, Sk), (Hkv, Sk), (Hq, Sq))
    wide = [rand(B, h, s, 128, dtype=torch.bfloat16, device="cuda", seed=60 + i) for i, (h, s) in enumerate(shapes)]
    for t in wide:
        t[..., 96:] = float("nan")
    q, k, v, go = (t[..., :96] for t in wide)
    q, k, v = (t.requires_grad_() for t in (q, k, v))  # (views of non-leaf-grad tensors: leaves)
    o = ops.attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(o, (q, k, v), go)
    assert not attention_module._broken, attention_module._broken
    assert all(not g.isnan().any() for g in grads)
    qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    gc = torch.autograd.grad(ops.attention(qc, kc, vc, causal=causal), (qc, kc, vc), go.contiguous())
    torch.testing.assert_close(grads[0], gc[0], rtol=1e-2, atol=1e-2)  # one bf16 step apart at most
    assert torch.equal(grads[1], gc[1]) and torch.equal(grads[2], gc[2])
    monkeypatch.setenv("OPFUSE_ATTN_BWD_SM90", "0")
    gm = torch.autograd.grad(ops.attention(qc, kc, vc, causal=causal), (qc, kc, vc), go.contiguous())
    for a, b in zip(gc, gm):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    monkeypatch.delenv("OPFUSE_ATTN_BWD_SM90")
    check_flash_rule(qc, kc, vc, causal=causal, grads=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_attention_cuda_masks_and_fallbacks():
    q, k, v = _qkv(3, 4, 2, 37, 53, 64, torch.bfloat16, device="cuda", seed=71)
    mask = _padding_mask(3, 53, [53, 17, 0], device="cuda")
    o = ops.attention(q, k, v, causal=True, attn_mask=mask)  # PyTorch math path on the GPU
    assert (o[2] == 0).all() and not o.isnan().any()
    check_flash_rule(q, k, v, causal=True, mask=mask)
    # head dim 40 and float32 take the math path too
    for dt, D in ((torch.bfloat16, 40), (torch.float32, 64)):
        q, k, v = _qkv(1, 2, 1, 33, 47, D, dt, device="cuda")
        torch.testing.assert_close(ops.attention(q, k, v, causal=True), ref_attention(q, k, v, True).to(dt))


def _kernel_call_args(q, k, v, causal=False):
    # attention_cuda_workspace's arguments for a default-tile call (as ops/attention.py makes them).
    B, Hq, Sq, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    _kernel_call_args.alive = (o, lse)
    return ("bf16" if q.dtype == torch.bfloat16 else "f16", [t.data_ptr() for t in (q, k, v, o, lse)],
            [B, Hq, k.shape[1], Sq, k.shape[2], D], [list(t.stride()[:3]) for t in (q, k, v, o)] + [list(lse.stride()[:2])],
            causal, 1.0 / D ** 0.5, "", q.device.index)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_attention_cuda_split_tail(D, causal, monkeypatch):
    # More tiles than SMs, not a whole number of rounds: on sm_90 the Hopper
    # kernel cuts the last rounds' tiles over the CTAs by key blocks and
    # merges the pieces through the workspace the op allocates (odd Sk: the
    # ragged key block sits in the written piece). GQA. Causal (Sk < Sq, so
    # the diagonal is offset): the pairs schedule's tail, tiles of several
    # lengths, cut where the equal ranges end.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the split tail is the Hopper kernel's")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # (causal: the split needs a longest tile of 16 key blocks)
    B, Hq, Hkv, Sq, Sk = 2, 40, 10, 2100, 2037
    tiles = -(-Sq // (192 if D == 64 else 128)) * Hq * B
    assert tiles > sms and tiles % sms, (tiles, sms)
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, device="cuda", seed=91 + D)
    args = _kernel_call_args(q, k, v, causal)
    ws_bytes, ws_zero = _C.attention_cuda_workspace(*args)
    assert ws_bytes > ws_zero > 0
    check_flash_rule(q, k, v, causal=causal)
    assert not attention_module._broken, attention_module._broken
    o1 = ops.attention(q, k, v, causal=causal)
    o2 = ops.attention(q, k, v, causal=causal)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2)  # the merge order is fixed: reruns are bit-identical
    monkeypatch.setenv("OPFUSE_ATTN_SM90_SPLIT", "0")
    assert _C.attention_cuda_workspace(*args) == (0, 0)
    # uncut tiles: rounding apart
    torch.testing.assert_close(ops.attention(q, k, v, causal=causal), o1, rtol=0, atol=2e-2)
    monkeypatch.delenv("OPFUSE_ATTN_SM90_SPLIT")
    # CUDA graph capture: the workspace's zeroing is captured with the launch.
    with torch.no_grad():
        g = torch.cuda.CUDAGraph()
        qs, ks, vs = (t.detach().clone() for t in (q, k, v))
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            og = ops.attention(qs, ks, vs, causal=causal)
        for seed in (5, 6):
            q2, k2, v2 = (t.detach() for t in _qkv(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, device="cuda", seed=seed))
            qs.copy_(q2), ks.copy_(k2), vs.copy_(v2)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(og, ops.attention(q2, k2, v2, causal=causal))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [128])
def test_attention_cuda_tma_store_of_o(D, causal):
    # Tile letter "t" through the C++ launcher: O leaves through TMA stores
    # (a map over O made by the launcher) into a strided view ([B, S, H, D]
    # memory, an offset into a sentinel-filled buffer): the same bits as the
    # default tile's 16-byte copies, LSE too, and nothing written outside O's
    # rows (ragged Sq, causal query blocks ending at Sq: rows before 0 and past
    # Sq fall outside the map). Split tails cut (more tiles than SMs, GQA).
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel's option")
    B, Hq, Hkv, Sq, Sk = 2, 40, 10, 2100, 2037
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, device="cuda", seed=77 + D)
    tag = {64: "wg192x128s4p", 128: "wg128x128s2p"}[D] + ("lwb" if causal else "dw")  # the defaults
    outs = []
    for t in (tag, tag + "t"):
        store = torch.full((B * Sq * Hq * D + 4096,), 7.0, dtype=torch.bfloat16, device="cuda")
        o = store[1024:1024 + B * Sq * Hq * D].view(B, Sq, Hq, D).transpose(1, 2)
        lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device="cuda")
        args = ("bf16", [x.data_ptr() for x in (q, k, v, o, lse)], [B, Hq, Hkv, Sq, Sk, D],
                [list(x.stride()[:3]) for x in (q, k, v, o)] + [list(lse.stride()[:2])], causal, 1.0 / D ** 0.5)
        ws_bytes, ws_zero = _C.attention_cuda_workspace(*args, t, 0)
        ws = torch.zeros(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")
        _C.attention_cuda(*args, torch.cuda.current_stream().cuda_stream, t, 0, workspace=ws.data_ptr(),
                          workspace_bytes=ws_bytes)
        torch.cuda.synchronize()
        assert (store[:1024] == 7).all() and (store[1024 + B * Sq * Hq * D:] == 7).all(), t
        outs.append((o.clone(), lse.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # bottom-right causal: query i sees keys j <= i + Sk - Sq; rows that see none give 0
    mask = torch.ones(Sq, Sk, dtype=torch.bool, device="cuda").tril(Sk - Sq) if causal else None
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(Hq // Hkv, 1), v.float().repeat_interleave(Hq // Hkv, 1), attn_mask=mask)
    seen = slice(max(Sq - Sk, 0) if causal else 0, Sq)
    assert (outs[1][0][:, :, :seen.start] == 0).all()
    torch.testing.assert_close(outs[1][0][:, :, seen].float(), ref[:, :, seen], rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_attention_cuda_stream_and_compile():
    q, k, v = _qkv(2, 8, 2, 300, 300, 128, torch.bfloat16, device="cuda", seed=81)
    s = torch.cuda.Stream()
    ref = ops.attention(q, k, v, causal=True)
    s.wait_stream(torch.cuda.current_stream())  # the inputs were written on the default stream
    with torch.cuda.stream(s):
        o = ops.attention(q, k, v, causal=True)
    s.synchronize()
    torch.testing.assert_close(o, ref, rtol=0, atol=0)
    compiled = torch.compile(lambda q, k, v: ops.attention(q, k, v, causal=True), backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), ref, rtol=0, atol=0)

