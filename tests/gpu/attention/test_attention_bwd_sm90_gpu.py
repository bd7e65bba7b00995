"""GPU correctness of the Hopper backward, attention_bwd_sm90.cu (skipped without an sm_90 device).

The FlashAttention rule of test_attention_bwd_gpu.check_grads (max error of
dQ, dK, dV against float32 autograd at most 3x that of autograd in the input
dtype; outputs poisoned with NaN first) over the seqlen pairs of the issue,
causal and not, bf16 and f16, GQA / MQA, the variant configurations; and the
dispatch: the default path on sm_90 for D = 64 / 128, OPFUSE_ATTN_BWD_SM90=0
and deterministic mode on the mma.sync kernels.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the Hopper backward needs sm_90", allow_module_level=True)

import attn_bwd_runtime as br  # noqa: E402
import attn_bwd_runtime_sm90 as b90  # noqa: E402
from test_attention_bwd_gpu import DTYPES, _seed, check_grads, randn  # noqa: E402

SEQ_PAIRS = [(113, 203), (128, 217), (1023, 1024), (1, 239), (512, 256), (4096, 4096)]


# fwd and bwd: the folder's fixtures (conftest.py).


def _qkv(B, Hq, Hkv, Sq, Sk, D, dtype, seed):
    return (randn(B, Hq, Sq, D, dtype=dtype, seed=seed), randn(B, Hkv, Sk, D, dtype=dtype, seed=seed + 1),
            randn(B, Hkv, Sk, D, dtype=dtype, seed=seed + 2))


@pytest.mark.parametrize("Sq,Sk", SEQ_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_sm90_grid(fwd, bwd, dt, D, causal, Sq, Sk):
    seed = _seed("bwd90", dt, D, causal, Sq, Sk)
    B, H = (1, 2) if Sq * Sk > 2**22 else (2, 4)
    q, k, v = _qkv(B, H, H, Sq, Sk, D, DTYPES[dt], seed)
    check_grads(fwd, bwd, q, k, v, causal, seed=seed)
    assert bwd.last_path == "sm90"


@pytest.mark.parametrize("Sq,Sk", [(113, 203), (1023, 1024), (512, 256), (1, 239)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,dt", [(128, "bf16"), (64, "f16")])
@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (8, 1)])
def test_sm90_gqa_mqa(fwd, bwd, Hq, Hkv, D, dt, causal, Sq, Sk):
    seed = _seed("gqa-bwd90", Hq, Hkv, D, dt, causal, Sq, Sk)
    q, k, v = _qkv(2, Hq, Hkv, Sq, Sk, D, DTYPES[dt], seed)
    check_grads(fwd, bwd, q, k, v, causal, seed=seed)
    assert bwd.last_path == "sm90"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,cfg", [(d, c) for d in b90.HEAD_DIMS for c in b90.configs(d)],
                         ids=lambda x: x.tag() if hasattr(x, "tag") else str(x))
def test_sm90_configs_and_against_mma(fwd, bwd, D, cfg, causal):
    # Every configuration meets the rule, and agrees with the mma.sync kernels
    # (same math, other accumulation order) on a ragged, GQA problem.
    q, k, v = _qkv(2, 4, 2, 1023, 517, D, torch.bfloat16, seed=41)
    o, lse = fwd(q, k, v, causal=causal)
    dout = randn(*q.shape, dtype=q.dtype, seed=44)
    a = bwd(dout, q, k, v, o, lse, causal=causal, tiles=cfg)
    assert bwd.last_path == "sm90"
    b = bwd(dout, q, k, v, o, lse, causal=causal, tiles=br.choose_tiles(D))
    assert bwd.last_path == "mma"
    torch.cuda.synchronize()
    for x, y in zip(a, b):
        assert (x.float() - y.float()).abs().max().item() <= 2e-2 * max(1.0, y.float().abs().max().item())
    check_grads(fwd, bwd, q, k, v, causal, seed=45)


def test_sm90_switch_and_deterministic_take_mma(fwd, bwd, monkeypatch):
    q, k, v = _qkv(1, 2, 2, 300, 300, 128, torch.bfloat16, seed=51)
    check_grads(fwd, bwd, q, k, v, True, deterministic=True, seed=52)
    assert bwd.last_path == "mma"
    monkeypatch.setenv("OPFUSE_ATTN_BWD_SM90", "0")
    check_grads(fwd, bwd, q, k, v, True, seed=53)
    assert bwd.last_path == "mma"
    monkeypatch.delenv("OPFUSE_ATTN_BWD_SM90")
    check_grads(fwd, bwd, q, k, v, True, seed=54)
    assert bwd.last_path == "sm90"


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_very_negative_scores_and_many_blocks(fwd, bwd, causal):
    # Scores about -500 with a ragged Sk (masked keys must give P = 0, not
    # exp(500)); then a long GQA problem whose CTAs loop over many query
    # blocks of several heads (the ring wraps many times), run twice.
    q = (4.0 + 0.1 * randn(1, 4, 77, 128, dtype=torch.float32, seed=61)).bfloat16()
    k = (-4.0 + 0.1 * randn(1, 2, 100, 128, dtype=torch.float32, seed=62)).bfloat16()
    v = randn(1, 2, 100, 128, dtype=torch.bfloat16, seed=63)
    dq, dk, dv = check_grads(fwd, bwd, q, k, v, causal, seed=64)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    q, k, v = _qkv(1, 8, 2, 2000, 1900, 64, torch.bfloat16, seed=65)
    first = check_grads(fwd, bwd, q, k, v, causal, seed=66)
    again = check_grads(fwd, bwd, q, k, v, causal, seed=66)
    assert torch.equal(first[1], again[1]) and torch.equal(first[2], again[2])  # dK, dV: no atomics
