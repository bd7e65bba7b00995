"""CPU test of src/kernels/attention/attention_reference.{h,cpp}.

Builds the reference with the host C++ compiler (g++ -std=c++20) into a small
shared library, calls it through ctypes, and compares the plain (float64) and
tiled (float32 online softmax, the kernel's algorithm) implementations with a
float64 PyTorch computation of the same definition.
"""

from __future__ import annotations

import ctypes
import math

import pytest

torch = pytest.importorskip("torch")

from attn_reference import attention_fp32  # noqa: E402
from reference_lib import build_reference_lib  # noqa: E402


@pytest.fixture(scope="module")
def reflib(tmp_path_factory):
    return build_reference_lib(tmp_path_factory.mktemp("attnref"), "attnref", "attention_reference.cpp",
                               "reference_capi.cpp", "opfuse_attention_reference")


def _strides(t):
    return (ctypes.c_int64 * 3)(*t.stride()[:3])


def run_ref(lib, q, k, v, causal, scale=None, tiled=False, block_m=128, block_n=64, with_lse=True):
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    o = torch.full((B, Hq, Sq, D), float("nan"), dtype=torch.float32)
    lse = torch.full((B, Hq, Sq), float("nan"), dtype=torch.float32) if with_lse else None
    err = ctypes.create_string_buffer(512)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr()) if t is not None else None  # noqa: E731
    rc = lib.opfuse_attention_reference(
        int(tiled), block_m, block_n, ptr(q), _strides(q), ptr(k), _strides(k), ptr(v), _strides(v), ptr(o),
        _strides(o), ptr(lse), (ctypes.c_int64 * 2)(*(lse.stride()[:2] if with_lse else (0, 0))),
        (ctypes.c_int64 * 6)(B, Hq, Hkv, Sq, Sk, D), int(causal), ctypes.c_double(scale or 0.0), err, 512)
    if rc != 0:
        raise ValueError(err.value.decode())
    return o, lse


CASES = [
    # B, Hq, Hkv, Sq, Sk, D
    (2, 4, 4, 113, 203, 64),
    (1, 4, 2, 128, 217, 96),
    (1, 2, 1, 1, 239, 64),
    (1, 2, 2, 96, 48, 64),  # Sq > Sk: causal leaves rows 0..47 with no key
    (2, 8, 2, 67, 67, 128),
    (1, 2, 2, 33, 1, 256),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D", CASES)
def test_reference_matches_float64(reflib, B, Hq, Hkv, Sq, Sk, D, causal):
    g = torch.Generator().manual_seed(Sq * 1000 + Sk + D + causal)
    # q as a transposed [B, S, H, D] view: non-contiguous strides.
    q = torch.randn(B, Sq, Hq, D, generator=g).transpose(1, 2)
    k = torch.randn(B, Hkv, Sk, D, generator=g)
    v = torch.randn(B, Hkv, Sk, D, generator=g)
    want_o, want_lse, _ = attention_fp32(q.double(), k.double(), v.double(), causal)
    for tiled, blocks in ((False, (0, 0)), (True, (128, 64)), (True, (16, 32)), (True, (7, 5))):
        o, lse = run_ref(reflib, q, k, v, causal, tiled=tiled, block_m=blocks[0] or 1, block_n=blocks[1] or 1)
        tol = 2e-6 if not tiled else 2e-5
        assert not torch.isnan(o).any(), "NaN in output (unwritten or 0/0)"
        torch.testing.assert_close(o.double(), want_o, atol=tol, rtol=tol)
        dead = torch.isinf(want_lse)
        assert torch.equal(torch.isinf(lse), dead), "LSE must be -inf exactly on rows that see no key"
        torch.testing.assert_close(lse.double()[~dead], want_lse[~dead], atol=tol, rtol=tol)
        if dead.any():
            assert (o[dead.expand_as(lse)] == 0).all()


def test_reference_scale_and_empty_keys(reflib):
    q = torch.randn(1, 2, 5, 64)
    k = torch.randn(1, 2, 9, 64)
    v = torch.randn(1, 2, 9, 64)
    want, want_lse, _ = attention_fp32(q.double(), k.double(), v.double(), False, scale=0.3)
    o, lse = run_ref(reflib, q, k, v, False, scale=0.3, tiled=True)
    torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)
    # Sk = 0: every row sees no key.
    k0, v0 = torch.randn(1, 2, 0, 64), torch.randn(1, 2, 0, 64)
    for tiled in (False, True):
        o, lse = run_ref(reflib, q, k0, v0, False, tiled=tiled)
        assert (o == 0).all() and torch.isinf(lse).all() and (lse < 0).all()


def test_reference_rejects_bad_heads(reflib):
    q, k, v = torch.randn(1, 3, 4, 64), torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64)
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        run_ref(reflib, q, k, v, False)
