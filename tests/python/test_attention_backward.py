"""The attention backward's C++ side without a GPU: the launcher's NVRTC
compile path (sm_80 and sm_90, disk cache), its argument checks, the float64
reference binding against autograd, and the op's deterministic= argument on
the CPU path. The kernels themselves run in tests/gpu/attention (gpu-marked).
"""
from __future__ import annotations

import concurrent.futures as cf
import math
import pathlib
import sys

import pytest
import torch

import opfuse
import opfuse.ops as ops
from opfuse import _C

from conftest import needs_nvrtc


@needs_nvrtc
def test_backward_launcher_compiles_for_sm80_and_sm90():
    jobs = [("bf16", 128, True, 80), ("f16", 256, False, 90)]
    with cf.ThreadPoolExecutor(max_workers=2) as ex:  # NVRTC releases the GIL
        results = list(ex.map(lambda j: _C.attention_backward_compile(*j), jobs))
    for (elem, d, causal, arch), (exprs, lowered, cubin, log, hit) in zip(jobs, results):
        assert len(exprs) == len(lowered) == 5
        assert f"<opfuse_attn::{elem}, {d}" in exprs[1] and ("true" if causal else "false") in exprs[1]
        for name in lowered:
            assert name.startswith("_ZN11opfuse_attn") and name.encode() in cubin
        assert cubin[:4] == b"\x7fELF" and f"sm_{arch}" in log
    again = _C.attention_backward_compile(*jobs[0])
    assert again[4] and again[1] == results[0][1] and again[2] == results[0][2]  # from the disk cache


def test_backward_tiles_match_the_harness():
    # The C++ launcher and the ctypes harness (which the GPU tests and the
    # benchmark use) must pick the same tiles, or the measured kernel is not
    # the shipped one.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "gpu" / "attention"))
    import attn_bwd_runtime as br

    for arch, limit in ((80, 166912), (90, 232448), (86, 101376)):
        for d in (64, 96, 128, 256):
            for masked in (False, True):  # a masked dK/dV kernel stages one more per-row array
                try:
                    want = tuple(t.tag() for t in br.choose_tiles(d, f"sm_{arch}", limit, masked=masked))
                except ValueError:
                    with pytest.raises(ValueError):
                        _C.attention_backward_tiles(d, arch, limit, masked)
                    continue
                assert _C.attention_backward_tiles(d, arch, limit, masked) == want, (arch, d, masked)
    # The masked kernel's shared memory is the unmasked one's plus one
    # BLOCK_M x 4-byte array in each of the two stages.
    for d in (64, 128):
        kv, _ = br.choose_tiles(d, "sm_90", 232448, masked=True)
        assert br.dkdv_smem(d, kv, True) == br.dkdv_smem(d, kv) + 2 * kv.block_m * 4


def test_backward_sm90_tiles_match_the_harness(monkeypatch):
    # The Hopper backward: the C++ launcher's default tile (OPTS letters
    # included) is the harness's DEFAULT, which the GPU runs measured, and each
    # OPFUSE_ATTN_BWD_SM90_DQ mode gives the same plain tile in both.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "gpu" / "attention"))
    import attn_bwd_runtime_sm90 as b90

    monkeypatch.delenv("OPFUSE_ATTN_BWD_SM90_DQ", raising=False)
    for d in (64, 128):
        tags = _C.attention_backward_sm90_tiles(d)
        assert tags[0] == tags[1] == b90.DEFAULT[d].tag(), (d, tags)
        assert set(tags[1:]) <= {c.tag() for c in b90.configs(d)}, (d, tags)
    for mode, tiles in b90.BY_DQ_MODE.items():
        monkeypatch.setenv("OPFUSE_ATTN_BWD_SM90_DQ", str(mode))
        for d, cfg in tiles.items():
            assert _C.attention_backward_sm90_tiles(d)[0] == cfg.tag() == b90.default(d).tag(), (mode, d)


def test_backward_sm90_runs_head_dim_96_as_128(monkeypatch):
    # D = 96 on Hopper: the D = 128 kernels (tiles, dq_accum rows of 128
    # floats), with AttnBwdParams.d_cols = 96 limiting what they read and write.
    monkeypatch.delenv("OPFUSE_ATTN_BWD_SM90_DQ", raising=False)
    assert _C.attention_backward_sm90_tiles(96) == _C.attention_backward_sm90_tiles(128)
    assert _C.attention_backward_accum_cols(96) == 128
    assert [_C.attention_backward_accum_cols(d) for d in (64, 128, 256)] == [64, 128, 256]
    with pytest.raises(ValueError, match="64, 96 and 128"):
        _C.attention_backward_sm90_tiles(256)


def _bwd_args(**over):
    B, Hq, Hkv, Sq, Sk, D = 1, 4, 2, 10, 12, 64
    a = dict(elem="bf16", ptrs=[0] * 12, sizes=[B, Hq, Hkv, Sq, Sk, D],
             strides=[[Hq * Sq * D, Sq * D, D]] * 6 + [[Hkv * Sk * D, Sk * D, D]] * 2 + [[Hq * Sq, Sq]],
             causal=True, scale=0.125, deterministic=False)
    a.update(over)
    return a


def test_backward_checks_without_gpu():
    assert _C.attention_backward_unsupported_reason(*_bwd_args().values()) == ""
    assert "head dim" in _C.attention_backward_unsupported_reason(*_bwd_args(sizes=[1, 4, 2, 10, 12, 80]).values())
    assert "multiple of heads_kv" in _C.attention_backward_unsupported_reason(
        *_bwd_args(sizes=[1, 3, 2, 10, 12, 64]).values())
    bad = _bwd_args()
    bad["strides"] = [[2560, 640, 60]] + bad["strides"][1:]
    assert "multiples of 8" in _C.attention_backward_unsupported_reason(*bad.values())
    assert "aligned" in _C.attention_backward_unsupported_reason(*_bwd_args(ptrs=[0] * 9 + [4, 0, 0]).values())
    assert _C.attention_backward_padded_rows(0) == 0
    assert _C.attention_backward_padded_rows(1) == 128 and _C.attention_backward_padded_rows(129) == 256


def _autograd_f64(q, k, v, dout, causal, scale):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    Sq, Sk = q.shape[2], k.shape[2]
    i, j = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
    mask = (j <= i + Sk - Sq) if causal else torch.ones(Sq, Sk, dtype=torch.bool)
    dead = ~mask.any(-1, keepdim=True)
    s = (q @ ke.transpose(-1, -2) * scale).masked_fill(~mask, -math.inf).masked_fill(dead, 0.0)
    o = torch.softmax(s, -1).masked_fill(dead, 0.0) @ ve
    o.backward(dout)
    return o.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [False, True])
def test_backward_reference_binding(causal):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 19, 32, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 11, 32, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 4, 19, 32, generator=g, dtype=torch.float64)
    o, *want = _autograd_f64(q, k, v, dout, causal, 0.2)
    got = [torch.full_like(t, math.nan) for t in (q, k, v)]
    ts = [q, k, v, o, dout, *got]
    _C.attention_backward_reference([t.data_ptr() for t in ts], [2, 4, 2, 19, 11, 32],
                                    [list(t.stride()[:3]) for t in ts], causal, 0.2)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-9)


def test_deterministic_argument_on_cpu():
    # The CPU backward is PyTorch ops (deterministic already): the argument is
    # accepted and changes nothing.
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 7, 16, generator=g, requires_grad=True) for _ in range(3))
    grads = []
    for det in (None, False, True):
        o = ops.attention(q, k, v, causal=True, deterministic=det)
        grads.append(torch.autograd.grad(o.sum(), (q, k, v)))
    for a in grads[1:]:
        for x, y in zip(a, grads[0]):
            assert torch.equal(x, y)
    assert torch.ops.opfuse.attention.default._schema.arguments[-1].name == "deterministic"
