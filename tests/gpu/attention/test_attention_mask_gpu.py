"""GPU correctness of the attention kernels with an attn_mask (skipped without CUDA).

Through the ctypes harnesses (attn_runtime / attn_bwd_runtime, no opfuse
build needed). The FlashAttention rule against float32 references with the
same mask: forward max error at most 2x that of the low-precision PyTorch
reference (attn_reference.attention_lowp_ops), gradients 3x
(autograd through the same ops in q's dtype). Outputs are poisoned with NaN
before each launch. Rows whose keys are all masked must give O = 0,
LSE = -inf and dQ = 0, never NaN.

Mask kinds (make_mask): additive [Sq, Sk] in q's dtype with -inf entries and a
fully masked row, additive float32 [B, 1, Sq, Sk], additive [B, Hq, Sq, Sk] in
q's dtype, boolean [B, 1, Sq, Sk] with a fully masked row, a float32 view
with a storage offset and padded rows, and key padding (boolean
[B, 1, 1, Sk]: batch 0 keeps a prefix, batch 1 sees no key at all).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import attn_runtime as ar  # noqa: E402
from attn_inputs import case_seed, cuda_generator, randn  # noqa: E402
from attn_reference import add_attn_mask, attention_fp32, attention_lowp_ops, visible_mask  # noqa: E402

SEQ_PAIRS = [(113, 203), (128, 217), (1023, 1024), (1, 239), (512, 256)]
KINDS = ["add_sqsk", "add_b1_f32", "add_bh", "bool_b1", "view_f32", "keypad"]
# The `fwd` and `bwd` fixtures (the harnesses) come from conftest.py.


def make_mask(kind, B, Hq, Sq, Sk, dtype, seed):
    """An attn_mask of the given kind (see the module docstring)."""
    g = cuda_generator(seed)
    if kind == "add_sqsk":
        m = 2 * torch.randn(Sq, Sk, generator=g, device="cuda")
        m = m.masked_fill(torch.rand(Sq, Sk, generator=g, device="cuda") < 0.1, -math.inf)
        m[Sq // 2] = -math.inf  # a row that sees no key
        return m.to(dtype)
    if kind == "add_b1_f32":
        return 3 * torch.randn(B, 1, Sq, Sk, generator=g, device="cuda")
    if kind == "add_bh":
        m = torch.randn(B, Hq, Sq, Sk, generator=g, device="cuda")
        return m.masked_fill(torch.rand(B, Hq, Sq, Sk, generator=g, device="cuda") < 0.2, -math.inf).to(dtype)
    if kind == "bool_b1":
        m = torch.rand(B, 1, Sq, Sk, generator=g, device="cuda") > 0.3
        m[:, :, Sq - 1] = False
        return m
    if kind == "view_f32":
        base = torch.randn(B, 2, Sq + 3, Sk + 5, generator=g, device="cuda")
        m = base[:, 1:2, 3:, 5:]  # storage offset, padded rows, key stride 1
        assert m.storage_offset() > 0 and not m.is_contiguous()
        return m
    if kind == "keypad":
        m = torch.zeros(B, 1, 1, Sk, dtype=torch.bool, device="cuda")
        m[0, ..., : max(1, Sk - Sk // 3)] = True
        if B > 2:
            m[2:] = torch.rand(B - 2, 1, 1, Sk, generator=g, device="cuda") > 0.5
        return m  # batch 1 sees no key
    raise ValueError(kind)


def expected_kind(kind, dtype, Sq):
    if Sq == 1 and kind != "add_bh":  # one query row, heads broadcast: one value per (b, key)
        return "keypad"
    return {"add_sqsk": f"full-{'bf16' if dtype == torch.bfloat16 else 'f16'}", "add_b1_f32": "full-f32",
            "add_bh": f"full-{'bf16' if dtype == torch.bfloat16 else 'f16'}", "bool_b1": "full-bool",
            "view_f32": "full-f32", "keypad": "keypad"}[kind]


def check_forward(fwd, q, k, v, mask, causal, config=None, scale=None):
    B, Hq, Sq, D = q.shape
    out = torch.full((B, Hq, Sq, D), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, Sq), float("nan"), dtype=torch.float32, device=q.device)
    fwd(q, k, v, causal=causal, scale=scale, config=config, out=out, lse=lse, attn_mask=mask)
    torch.cuda.synchronize()
    ref, ref_lse, _ = attention_fp32(q, k, v, causal, scale, attn_mask=mask)
    lo = attention_lowp_ops(q, k, v, causal, scale, attn_mask=mask)
    err = (out.float() - ref).abs().nan_to_num(float("inf")).max().item()
    lo_err = (lo.float() - ref).abs().max().item()
    tag = fwd.last_config.tag()
    assert not torch.isnan(out).any(), f"NaN in the output ({tag})"
    assert err <= 2 * lo_err + 1e-5, f"output err {err:.3e} vs pytorch {lo_err:.3e} ({tag})"
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), dead), f"LSE must be -inf exactly on rows that see no key ({tag})"
    assert (out[dead] == 0).all(), "rows that see no key must be 0"
    live = ~dead
    if live.any():
        lerr = (lse[live] - ref_lse[live]).abs().max().item()
        assert lerr <= 1e-3 + 1e-4 * ref_lse[live].abs().max().item(), f"lse err {lerr:.3e} ({tag})"
    return out, lse, dead


def _qkv(B, Hq, Hkv, Sq, Sk, D, dtype, seed):
    return (randn(B, Hq, Sq, D, dtype=dtype, seed=seed), randn(B, Hkv, Sk, D, dtype=dtype, seed=seed + 1),
            randn(B, Hkv, Sk, D, dtype=dtype, seed=seed + 2))


# ---- forward -----------------------------------------------------------------


@pytest.mark.parametrize("Sq,Sk", SEQ_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("D,kernel", [(64, "default"), (128, "default"), (128, "mma")])
def test_forward_grid(fwd, D, kernel, kind, causal, Sq, Sk):
    # D = 128: the default (the Hopper kernel on sm_90) and the mma.sync kernel
    # explicitly; D = 64: the mma.sync kernel everywhere by default.
    seed = case_seed("mfwd", D, kind, causal, Sq, Sk)
    q, k, v = _qkv(2, 4, 4, Sq, Sk, D, torch.bfloat16, seed)
    mask = make_mask(kind, 2, 4, Sq, Sk, torch.bfloat16, seed + 3)
    assert ar.kernel_mask(mask, 2, 4, Sq, Sk, q.dtype)[0] == expected_kind(kind, q.dtype, Sq)
    cfg = ar.default_config(D, fwd.arch, fwd.smem_limit, masked=True) if kernel == "mma" else None
    _, _, dead = check_forward(fwd, q, k, v, mask, causal, config=cfg)
    if kind == "keypad":
        assert dead[1].all(), "batch 1 sees no key"
    hopper = fwd.arch.startswith("sm_90") and D == 128 and kernel == "default"
    assert isinstance(fwd.last_config, fwd.sm90.Sm90Config) == hopper, fwd.last_config


@pytest.mark.parametrize("Sq,Sk", [(113, 203), (1, 239), (512, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["add_b1_f32", "keypad"])
@pytest.mark.parametrize("D", [96, 256])
def test_forward_other_head_dims(fwd, D, kind, causal, Sq, Sk):
    seed = case_seed("mfwd-d", D, kind, causal, Sq, Sk)
    q, k, v = _qkv(2, 4, 4, Sq, Sk, D, torch.bfloat16, seed)
    check_forward(fwd, q, k, v, make_mask(kind, 2, 4, Sq, Sk, torch.bfloat16, seed + 3), causal)


@pytest.mark.parametrize("Sq,Sk", [(113, 203), (1023, 1024)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["add_sqsk", "keypad"])
def test_forward_f16(fwd, kind, causal, Sq, Sk):
    seed = case_seed("mfwd-f16", kind, causal, Sq, Sk)
    q, k, v = _qkv(2, 4, 4, Sq, Sk, 64, torch.float16, seed)
    check_forward(fwd, q, k, v, make_mask(kind, 2, 4, Sq, Sk, torch.float16, seed + 3), causal)


@pytest.mark.parametrize("Sq,Sk", [(113, 203), (512, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["add_bh", "keypad"])
@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (8, 1)])
def test_forward_gqa(fwd, Hq, Hkv, kind, causal, Sq, Sk):
    seed = case_seed("mfwd-gqa", Hq, Hkv, kind, causal, Sq, Sk)
    q, k, v = _qkv(3, Hq, Hkv, Sq, Sk, 128, torch.bfloat16, seed)
    check_forward(fwd, q, k, v, make_mask(kind, 3, Hq, Sq, Sk, torch.bfloat16, seed + 3), causal)


def test_forward_strided_key_dim_and_broadcast_key_dim(fwd):
    # A transposed mask (key stride != 1) and a per-query-row mask [B, 1, Sq, 1]
    # are copied to a contiguous key dim by kernel_mask, then read in place.
    B, H, Sq, Sk, D = 2, 4, 200, 150, 128
    q, k, v = _qkv(B, H, H, Sq, Sk, D, torch.bfloat16, 5)
    mt = torch.randn(B, 1, Sk, Sq, device="cuda").transpose(-1, -2)
    assert mt.stride(-1) != 1
    check_forward(fwd, q, k, v, mt, False)
    rowm = torch.ones(B, 1, Sq, 1, dtype=torch.bool, device="cuda")
    rowm[:, :, 7] = False
    _, _, dead = check_forward(fwd, q, k, v, rowm, True)
    assert dead[:, :, 7].all()


def test_forward_keypad_additive_and_scale(fwd):
    B, H, Sq, Sk, D = 3, 4, 300, 333, 64
    q, k, v = _qkv(B, H, H, Sq, Sk, D, torch.bfloat16, 9)
    m = torch.randn(B, 1, 1, Sk, device="cuda").bfloat16()
    m[1, ..., 100:] = -math.inf
    assert ar.kernel_mask(m, B, H, Sq, Sk, q.dtype)[0] == "keypad"
    for scale in (0.05, 0.5):
        check_forward(fwd, q, k, v, m, True, scale=scale)
    # [Sk] alone broadcasts over everything: key padding too.
    check_forward(fwd, q, k, v, m[0, 0, 0], False)


def test_forward_masked_rerun_is_bitwise_equal(fwd):
    q, k, v = _qkv(2, 4, 4, 1000, 1500, 128, torch.bfloat16, 3)
    m = make_mask("bool_b1", 2, 4, 1000, 1500, torch.bfloat16, 4)
    o1, l1 = fwd(q, k, v, causal=True, attn_mask=m)
    o2, l2 = fwd(q, k, v, causal=True, attn_mask=m)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


# The Hopper kernel's masked path (opt-in: OPFUSE_ATTN_SM90_MASK=1 or an
# explicit config), D = 128.
@pytest.mark.parametrize("Sq,Sk", [(113, 203), (1, 239), (1023, 1024), (512, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["add_sqsk", "bool_b1", "keypad"])
def test_forward_hopper_masked(fwd, kind, causal, Sq, Sk):
    if not fwd.arch.startswith("sm_90"):
        pytest.skip("needs an sm_90 device")
    seed = case_seed("mfwd-sm90", kind, causal, Sq, Sk)
    q, k, v = _qkv(2, 4, 2, Sq, Sk, 128, torch.bfloat16, seed)
    cfg = fwd.sm90.default_config_sm90(128, causal, masked=True)
    check_forward(fwd, q, k, v, make_mask(kind, 2, 4, Sq, Sk, torch.bfloat16, seed + 3), causal, config=cfg)
    assert isinstance(fwd.last_config, fwd.sm90.Sm90Config)


# ---- backward ----------------------------------------------------------------


def autograd_masked(q, k, v, dout, mask, causal, scale, dt):
    """(dq, dk, dv) by autograd through attention in dt (matmuls in dt, the
    softmax in float32 rounded to dt), rows that see no key giving 0."""
    q, k, v = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
    Hq, Hkv = q.shape[1], k.shape[1]
    ke = k.repeat_interleave(Hq // Hkv, dim=1) if Hq != Hkv else k
    ve = v.repeat_interleave(Hq // Hkv, dim=1) if Hq != Hkv else v
    s = add_attn_mask(torch.matmul(q, ke.transpose(-1, -2)).float() * scale, mask)
    s = s.masked_fill(~visible_mask(q.shape[2], k.shape[2], causal, q.device), float("-inf"))
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0).to(dt)
    torch.matmul(p, ve).backward(dout.to(dt))
    return q.grad, k.grad, v.grad


def check_backward(fwd, bwd, q, k, v, mask, causal, deterministic=False, seed=0):
    B, Hq, Sq, D = q.shape
    scale = 1.0 / math.sqrt(D)
    o, lse = fwd(q, k, v, causal=causal, attn_mask=mask)
    dout = randn(B, Hq, Sq, D, dtype=q.dtype, seed=seed + 7)
    out = tuple(torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device) for t in (q, k, v))
    dq, dk, dv = bwd(dout, q, k, v, o, lse, causal=causal, deterministic=deterministic, out=out, attn_mask=mask)
    assert mask is None or bwd.last_path == "mma"  # the Hopper backward has no mask: never sent one
    torch.cuda.synchronize()
    ref = autograd_masked(q, k, v, dout, mask, causal, scale, torch.float32)
    lo = autograd_masked(q, k, v, dout, mask, causal, scale, q.dtype)
    msgs = []
    for name, ours, r, l in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, lo):
        nan = int(torch.isnan(ours).sum())
        err = (ours.float() - r).abs().nan_to_num(float("inf")).max().item()
        lo_err = (l.float() - r).abs().max().item()
        if nan or not err <= 3 * lo_err + 1e-5:
            msgs.append(f"{name}: err {err:.3e} vs pytorch {lo_err:.3e}, NaN {nan}")
    assert not msgs, "\n  ".join(msgs)
    dead = torch.isneginf(lse)
    assert (dq[dead] == 0).all(), "rows that see no key must get dQ = 0"
    return dq, dk, dv


@pytest.mark.parametrize("Sq,Sk", SEQ_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("D", [64, 128])
def test_backward_grid(fwd, bwd, D, kind, causal, Sq, Sk):
    seed = case_seed("mbwd", D, kind, causal, Sq, Sk)
    q, k, v = _qkv(2, 4, 2, Sq, Sk, D, torch.bfloat16, seed)
    mask = make_mask(kind, 2, 4, Sq, Sk, torch.bfloat16, seed + 3)
    _, dk, dv = check_backward(fwd, bwd, q, k, v, mask, causal, seed=seed)
    if kind == "keypad":  # batch 1 sees no key; masked keys of batch 0 get nothing
        assert (dk[1] == 0).all() and (dv[1] == 0).all()
        assert (dk[0, :, max(1, Sk - Sk // 3):] == 0).all()


@pytest.mark.parametrize("Sq,Sk", [(113, 203), (1023, 1024), (1, 239)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["add_bh", "bool_b1", "keypad"])
def test_backward_deterministic(fwd, bwd, kind, causal, Sq, Sk):
    seed = case_seed("mbwd-det", kind, causal, Sq, Sk)
    q, k, v = _qkv(2, 4, 2, Sq, Sk, 128, torch.bfloat16, seed)
    mask = make_mask(kind, 2, 4, Sq, Sk, torch.bfloat16, seed + 3)
    a = check_backward(fwd, bwd, q, k, v, mask, causal, deterministic=True, seed=seed)
    b = check_backward(fwd, bwd, q, k, v, mask, causal, deterministic=True, seed=seed)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("Sq,Sk", [(113, 203), (512, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["add_b1_f32", "keypad"])
@pytest.mark.parametrize("D", [96, 256])
def test_backward_other_head_dims(fwd, bwd, D, kind, causal, Sq, Sk):
    seed = case_seed("mbwd-d", D, kind, causal, Sq, Sk)
    q, k, v = _qkv(2, 4, 4, Sq, Sk, D, torch.bfloat16, seed)
    check_backward(fwd, bwd, q, k, v, make_mask(kind, 2, 4, Sq, Sk, torch.bfloat16, seed + 3), causal, seed=seed)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["add_sqsk", "keypad"])
def test_backward_f16(fwd, bwd, kind, causal):
    seed = case_seed("mbwd-f16", kind, causal)
    q, k, v = _qkv(2, 4, 4, 300, 211, 64, torch.float16, seed)
    check_backward(fwd, bwd, q, k, v, make_mask(kind, 2, 4, 300, 211, torch.float16, seed + 3), causal, seed=seed)
