"""GPU correctness of attention_fwd.cu (skipped without CUDA).

The FlashAttention rule: max |ours - ref32| <= 2 * max |pytorch_lowp - ref32| + 1e-5,
where ref32 is attention on float32 upcasts of the same inputs and pytorch_lowp
is PyTorch's math-backend SDPA in the input dtype. Outputs and LSE are poisoned
with NaN before each launch, so an unwritten element fails.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import attn_runtime as ar  # noqa: E402
from attn_inputs import DTYPES, SEQ_PAIRS, case_seed, randn  # noqa: E402
from attn_reference import attention_fp32, attention_sdpa_math_lowp  # noqa: E402

# The `fwd` fixture (the harness) comes from conftest.py.


def describe(out, ref, lse=None, ref_lse=None, block_m=None):
    """A short account of where the output is wrong, for the failure message."""
    diff = (out.float() - ref).abs()
    nan = torch.isnan(out)
    lines = [f"max err {diff.nan_to_num(float('inf')).max().item():.3e}, NaN elements {int(nan.sum())} "
             f"of {out.numel()}"]
    bad_rows = (diff.nan_to_num(float("inf")) > 1e-2).any(dim=-1)  # [B, H, Sq]
    if bad_rows.any():
        idx = bad_rows.nonzero()
        lines.append(f"{idx.shape[0]} bad rows; first (b, h, i): {idx[:6].tolist()}")
        rows = idx[:, 2].unique()
        lines.append(f"bad query rows span {rows.min().item()}..{rows.max().item()} ({rows.numel()} distinct)")
        if block_m:
            lines.append(f"query blocks hit: {sorted(set((rows // block_m).tolist()))[:16]}")
        heads = idx[:, 1].unique().tolist()
        lines.append(f"heads hit: {heads[:16]}")
    flat = diff.nan_to_num(float("inf")).argmax()
    pos = list(torch.unravel_index(flat, diff.shape))
    lines.append(f"worst at (b, h, i, d) = {[int(p) for p in pos]}: ours {out[tuple(pos)].item():.5f} "
                 f"ref {ref[tuple(pos)].item():.5f}")
    if lse is not None:
        ld = (lse - ref_lse).abs()
        ld = torch.where(torch.isinf(ref_lse) & torch.isinf(lse) & (lse < 0), torch.zeros_like(ld), ld)
        lines.append(f"lse max err {ld.nan_to_num(float('inf')).max().item():.3e}, "
                     f"NaN {int(torch.isnan(lse).sum())}")
    return "\n  ".join(lines)


def run_and_check(fwd, q, k, v, causal, scale=None, config=None):
    B, Hq, Sq, D = q.shape
    out = torch.full((B, Hq, Sq, D), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, Sq), float("nan"), dtype=torch.float32, device=q.device)
    fwd(q, k, v, causal=causal, scale=scale, config=config, out=out, lse=lse)
    torch.cuda.synchronize()
    ref, ref_lse, _ = attention_fp32(q, k, v, causal, scale)
    pt = attention_sdpa_math_lowp(q, k, v, causal, scale)
    err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
    pt_err = (pt.float() - ref).abs().max().item() if out.numel() else 0.0
    cfg = fwd.last_config  # the tile that ran (sm_90: attention_fwd_sm90 for D = 64, 128)
    ok = not torch.isnan(out).any().item() and err <= 2 * pt_err + 1e-5
    assert ok, (f"output: err {err:.3e} vs pytorch {pt_err:.3e} ({cfg.tag()})\n  "
                + describe(out, ref, lse, ref_lse, cfg.block_m))
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), dead), "LSE must be -inf exactly on rows that see no key\n  " + \
        describe(out, ref, lse, ref_lse, cfg.block_m)
    if dead.any():
        assert (out[dead] == 0).all(), "rows that see no key must be 0"
    live = ~dead
    if live.any():
        lerr = (lse[live] - ref_lse[live]).abs().max().item()
        assert lerr <= 1e-3 + 1e-4 * ref_lse[live].abs().max().item(), f"lse err {lerr:.3e}\n  " + \
            describe(out, ref, lse, ref_lse, cfg.block_m)
    return out, lse


@pytest.mark.parametrize("Sq,Sk", SEQ_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_grid(fwd, dt, D, causal, Sq, Sk):
    B, H = 2, 4
    seed = case_seed(dt, D, causal, Sq, Sk)
    q = randn(B, H, Sq, D, dtype=DTYPES[dt], seed=seed)
    k = randn(B, H, Sk, D, dtype=DTYPES[dt], seed=seed + 1)
    v = randn(B, H, Sk, D, dtype=DTYPES[dt], seed=seed + 2)
    run_and_check(fwd, q, k, v, causal)


@pytest.mark.parametrize("Sq,Sk", SEQ_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,dt", [(128, "bf16"), (64, "f16")])
@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (8, 1)])
def test_gqa_mqa(fwd, Hq, Hkv, D, dt, causal, Sq, Sk):
    seed = case_seed("gqa", Hq, Hkv, D, dt, causal, Sq, Sk)
    q = randn(2, Hq, Sq, D, dtype=DTYPES[dt], seed=seed)
    k = randn(2, Hkv, Sk, D, dtype=DTYPES[dt], seed=seed + 1)
    v = randn(2, Hkv, Sk, D, dtype=DTYPES[dt], seed=seed + 2)
    run_and_check(fwd, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_non_contiguous(fwd, D, causal):
    # q, k, v as views of [B, S, H, D] tensors (the usual projection layout),
    # k and v sliced out of one packed kv tensor.
    B, Hq, Hkv, Sq, Sk = 2, 6, 3, 113, 203
    q = randn(B, Sq, Hq, D, dtype=torch.bfloat16, seed=D).transpose(1, 2)
    kv = randn(B, Sk, 2, Hkv, D, dtype=torch.bfloat16, seed=D + 1)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    run_and_check(fwd, q, k, v, causal)


@pytest.mark.parametrize("scale", [0.05, 0.5])
def test_scale(fwd, scale):
    q = randn(1, 4, 300, 128, dtype=torch.bfloat16, seed=7)
    k = randn(1, 4, 333, 128, dtype=torch.bfloat16, seed=8)
    v = randn(1, 4, 333, 128, dtype=torch.bfloat16, seed=9)
    run_and_check(fwd, q, k, v, True, scale=scale)


def _variant_params():
    out = []
    for d, cfgs in ar.VARIANT_CONFIGS.items():
        for cfg in cfgs:
            out.append(pytest.param(d, cfg, id=f"D{d}-{cfg.tag()}"))
    return out


@pytest.mark.parametrize("Sq,Sk", [(113, 203), (1023, 1024), (512, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,cfg", _variant_params())
def test_variant_tiles(fwd, D, cfg, causal, Sq, Sk):
    if fwd.smem_limit and ar.smem_bytes(D, cfg) > fwd.smem_limit:
        pytest.skip("tile does not fit this device")
    seed = case_seed("var", D, cfg, causal, Sq, Sk)
    q = randn(2, 4, Sq, D, dtype=torch.bfloat16, seed=seed)
    k = randn(2, 2, Sk, D, dtype=torch.bfloat16, seed=seed + 1)
    v = randn(2, 2, Sk, D, dtype=torch.bfloat16, seed=seed + 2)
    run_and_check(fwd, q, k, v, causal, config=cfg)


def test_empty_keys_and_deterministic_rerun(fwd):
    q = randn(1, 2, 77, 64, dtype=torch.bfloat16, seed=1)
    k = torch.empty(1, 2, 0, 64, dtype=torch.bfloat16, device="cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, 2, 77), float("nan"), device="cuda")
    fwd(q, k, k, out=out, lse=lse)
    torch.cuda.synchronize()
    assert (out == 0).all() and torch.isinf(lse).all() and (lse < 0).all()
    # Same inputs, same bits.
    q = randn(2, 4, 1000, 128, dtype=torch.bfloat16, seed=2)
    k = randn(2, 4, 1500, 128, dtype=torch.bfloat16, seed=3)
    v = randn(2, 4, 1500, 128, dtype=torch.bfloat16, seed=4)
    o1, l1 = fwd(q, k, v, causal=True)
    o2, l2 = fwd(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_bad_inputs_are_rejected(fwd):
    q = randn(1, 3, 16, 64, dtype=torch.bfloat16, seed=5)
    k = randn(1, 2, 16, 64, dtype=torch.bfloat16, seed=6)
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        fwd(q, k, k)
    with pytest.raises(ValueError, match="head dim"):
        x = randn(1, 2, 16, 80, dtype=torch.bfloat16, seed=7)
        fwd(x, x, x)
    with pytest.raises(ValueError, match="contiguous"):
        x = randn(1, 2, 64, 16, dtype=torch.bfloat16, seed=8).transpose(-1, -2)
        fwd(x, x, x)


# ---- the Hopper kernel (attention_fwd_sm90.cu); the grid above runs it by default on sm_90 ----

def _needs_sm90(fwd):
    if not fwd.arch.startswith("sm_90"):
        pytest.skip("needs an sm_90 device")


@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_sm90_dispatch_and_switch(fwd, D, monkeypatch):
    _needs_sm90(fwd)
    q = randn(1, 2, 200, D, dtype=torch.bfloat16, seed=D)
    k = randn(1, 2, 300, D, dtype=torch.bfloat16, seed=D + 1)
    run_and_check(fwd, q, k, k, True)
    assert isinstance(fwd.last_config, fwd.sm90.Sm90Config), fwd.last_config  # every head dim on sm_90
    monkeypatch.setenv("OPFUSE_ATTN_SM90", "0")
    run_and_check(fwd, q, k, k, True)
    assert isinstance(fwd.last_config, ar.FwdConfig), fwd.last_config


def _sm90_variant_params():
    import attn_runtime_sm90 as sm90

    return [pytest.param(d, cfg, id=f"D{d}-{cfg.tag()}") for d in sm90.HEAD_DIMS_SM90 for cfg in sm90.configs_sm90(d)]


@pytest.mark.parametrize("Sq,Sk", [(113, 203), (1, 239), (1023, 1024), (512, 256), (700, 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,cfg", _sm90_variant_params())
def test_sm90_variants(fwd, D, cfg, causal, Sq, Sk):
    _needs_sm90(fwd)
    seed = case_seed("sm90", D, cfg, causal, Sq, Sk)
    q = randn(2, 4, Sq, D, dtype=torch.float16, seed=seed)
    k = randn(2, 2, Sk, D, dtype=torch.float16, seed=seed + 1)
    v = randn(2, 2, Sk, D, dtype=torch.float16, seed=seed + 2)
    run_and_check(fwd, q, k, v, causal, config=cfg)


def test_sm90_many_key_blocks_and_rerun(fwd):
    # Long rows: every ring slot is reused many times (mbarrier phases wrap).
    _needs_sm90(fwd)
    q = randn(1, 2, 300, 128, dtype=torch.bfloat16, seed=11)
    k = randn(1, 2, 4099, 128, dtype=torch.bfloat16, seed=12)
    v = randn(1, 2, 4099, 128, dtype=torch.bfloat16, seed=13)
    o1, l1 = run_and_check(fwd, q, k, v, False)
    o2, l2 = fwd(q, k, v)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def _sm90_persistent_params():
    import attn_runtime_sm90 as sm90

    return [pytest.param(d, cfg, id=f"D{d}-{cfg.tag()}") for d in sm90.HEAD_DIMS_SM90 for cfg in sm90.configs_sm90(d)
            if cfg.persistent]


# (B, Hq, Hkv, Sq, Sk): tiles that see no key (causal, Sq > Sk) and a last
# tile whose third consumer has no row (700 = 3 x 192 + 124); then Sq = Sk with
# ragged last tiles and an odd number of query blocks (the middle one a single
# in the pairs schedule: 9 of 128 rows for 1100, 5 of 192 rows for 900).
# Then causal split tails (D = 64 and 128; the longest tile needs 16 key
# blocks): with tiles that see no key inside the line (2400 x 2050), and keys
# ahead of the queries (2000 x 2537).
PERSISTENT_SHAPES = [(3, 24, 8, 700, 300), (2, 40, 20, 1100, 1100), (1, 48, 16, 900, 900), (3, 24, 8, 2400, 2050),
                     (1, 40, 8, 2000, 2537)]


@pytest.mark.parametrize("shape", PERSISTENT_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,cfg", _sm90_persistent_params())
def test_sm90_persistent_grid_matches_one_cta_per_tile(fwd, D, cfg, causal, shape):
    # More tiles than SMs (each CTA loops over several, Q buffers, mbarrier
    # phases, ping-pong turns and, with overlap, the next tile's first S
    # carry across tiles), against the reference and against one CTA a tile
    # (same kernel: bit-identical).
    _needs_sm90(fwd)
    import dataclasses

    B, Hq, Hkv, Sq, Sk = shape
    seed = case_seed("persist", D, causal, shape)
    q = randn(B, Hq, Sq, D, dtype=torch.bfloat16, seed=seed)
    k = randn(B, Hkv, Sk, D, dtype=torch.bfloat16, seed=seed + 1)
    v = randn(B, Hkv, Sk, D, dtype=torch.bfloat16, seed=seed + 2)
    assert cfg.persistent and cfg.grid(Sq, Hq, B, fwd.num_sms)[0] < -(-Sq // cfg.block_m) * Hq * B
    o1, l1 = run_and_check(fwd, q, k, v, causal, config=cfg)
    o2, l2 = run_and_check(fwd, q, k, v, causal, config=dataclasses.replace(cfg, persistent=False))
    if cfg.for_call(causal, False, cfg.split_cuts(Sq, Sk, Hq, B, fwd.num_sms, causal)).split:
        # The split tail merged cut tiles (other float32 sums): not bit-identical to
        # uncut tiles, but to itself (the merge order is fixed).
        o3, l3 = run_and_check(fwd, q, k, v, causal, config=cfg)
        assert torch.equal(o1, o3) and torch.equal(l1, l3)
    else:
        assert torch.equal(o1, o2) and torch.equal(l1, l2)
