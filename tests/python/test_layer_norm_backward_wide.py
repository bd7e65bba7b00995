"""The wide-row layer_norm backward (src/kernels/layer_norm_backward/,
python/opfuse/ops/layer_norm_wide.py).

Without a GPU: every instantiation the launcher can pick compiles with NVRTC
for sm_90 without spills and within its launch bounds, sm_80 is refused,
the config choice and what it declines, and the float64 CPU reference
against PyTorch's float64 native_layer_norm_backward.

On a GPU (marked gpu): dx, dw and db against float64 (each output's error at
most twice eager's in the same dtype, plus a floor) over bf16, f16 and f32,
rows that do not fill a batch, n that does not fill the cluster, no weight,
no bias, dx not asked, 3-D inputs, rows with a stride and a storage offset;
bitwise-equal reruns; CUDA-graph capture; misaligned inputs fall back to
the generated kernels with the same answer; and compiled graphs route
aten.native_layer_norm_backward there (the launch counter, opfuse.stats()).
"""
import re

import pytest
import torch

import opfuse
from opfuse import _C
from opfuse.ops import layer_norm_wide as lw
from opfuse.testing import OpfuseLog

from conftest import nvrtc_or_skip

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
aten = torch.ops.aten


# --- without a GPU -----------------------------------------------------------

@pytest.mark.parametrize("elem", ["bf16", "f16", "f32"])
def test_every_instantiation_compiles_without_spills(elem):
    nvrtc_or_skip()
    tags = set(_C.lnbwd_wide_candidates(elem))
    for n in (8, 40, 256, 512, 2048, 4096, 8192, 8200, 16384, 32768, 65536):
        tag = _C.lnbwd_wide_choose_config(elem, n)
        if tag:
            assert tag in tags, f"{elem} n={n}: {tag} is not among the candidates CI compiles"
    for tag in tags:
        cubin, log = _C.lnbwd_wide_compile(elem, tag, 90)
        assert len(cubin) > 0
        entry = log.split("opfuse_lnbwd_wide")[-1]
        regs = int(re.search(r"Used (\d+) registers", entry).group(1))
        assert re.search(r"(\d+) bytes spill stores", entry).group(1) == "0", f"{elem} {tag}:\n{log}"
        threads, blocks = (int(x) for x in re.match(r"t(\d+)[cg]\d+r\d+v\d+b(\d+)", tag).groups())
        assert regs * threads * blocks <= 65536, f"{tag}: {regs} registers miss __launch_bounds__"


def test_clusters_only_from_sm_90():
    nvrtc_or_skip()
    with pytest.raises(Exception, match="sm_90"):
        _C.lnbwd_wide_compile("bf16", "t512c8r2v1b2", 80)


def test_config_choice():
    choose = _C.lnbwd_wide_choose_config
    assert choose("bf16", 32768) == "t512c8r2v1b2s3"  # the benchmark shape: 4096 columns a CTA, the ring
    assert choose("f16", 20000) == "t512c8r2v1b2s3"
    assert choose("bf16", 16384) == "t512c4r2v1b2s3"
    assert choose("bf16", 4096) == "t256c2r2v1b4s3" and choose("f16", 8192) == "t512c2r2v1b2s3"
    assert choose("bf16", 2048) == "t256c1r2v1b4s3" and choose("bf16", 1032) == "t256c1r2v1b4s3"
    assert choose("bf16", 1024) == "t128c1r4v1b8s3" and choose("f16", 520) == "t128c1r4v1b8s3"
    assert choose("bf16", 256) == "t256g32r2v1b4" and choose("f16", 40) == "t256g8r2v1b4"
    assert choose("bf16", 512) == "t256g32r2v2b2"
    assert choose("bf16", 65536) == "t512c8r2v2b1s2"
    assert choose("f32", 32768) == "t512c8r1v2b2"
    assert choose("bf16", 65544) == "" and choose("f32", 32776) == ""
    with pytest.raises(Exception, match="dtype"):
        choose("f64", 32768)


def test_what_it_declines():
    r = _C.lnbwd_wide_unsupported_reason
    assert r("bf16", 64, 32768, 32768, 32768, 32768, True, True, True, True, 16) == ""
    assert "multiple of 8" in r("bf16", 64, 32764, 32764, 32764, 32764, True, True, True, True, 16)
    assert "aligned" in r("bf16", 64, 32768, 32768, 32768, 32768, True, True, True, True, 2)
    assert "row stride" in r("bf16", 64, 32768, 32772, 32768, 32768, True, True, True, True, 16)
    assert "no weight or bias gradient" in r("bf16", 64, 32768, 32768, 32768, 32768, True, False, False, True, 16)
    assert "wider" in r("bf16", 64, 70000, 70000, 70000, 70000, True, True, True, True, 16)
    shape_reason = lw.shape_reason
    assert shape_reason((64, 32768), 1, torch.bfloat16, torch.bfloat16, torch.bfloat16, [True, True, True]) == ""
    assert shape_reason((64, 1536), 1, torch.bfloat16, torch.bfloat16, None, [True, True, False]) == ""
    assert shape_reason((64, 520), 1, torch.bfloat16, torch.bfloat16, None, [True, True, False]) == ""
    assert "on chip" in shape_reason((64, 1536), 1, torch.float32, torch.float32, None, [True, True, False])
    assert "on chip" in shape_reason((64, 8192), 1, torch.float32, torch.float32, None, [True, True, False])
    assert shape_reason((64, 8192), 1, torch.bfloat16, torch.bfloat16, None, [True, True, False]) == ""
    assert shape_reason((64, 4096), 1, torch.float16, torch.float16, None, [True, True, False]) == ""
    assert shape_reason((64, 5120), 1, torch.bfloat16, torch.bfloat16, None, [True, True, False]) == ""
    assert shape_reason((64, 1544), 1, torch.bfloat16, torch.bfloat16, None, [True, True, False]) == ""
    assert "dtype" in shape_reason((64, 32768), 1, torch.float64, None, None, [True, True, True])
    assert "another dtype" in shape_reason((64, 32768), 1, torch.bfloat16, torch.float32, None, [True, True, True])
    assert "no weight or bias" in shape_reason((64, 32768), 1, torch.bfloat16, None, None, [True, True, True])


def test_width_line_from_the_environment(monkeypatch):
    monkeypatch.delenv("OPFUSE_LNBWD_WIDE_ABOVE", raising=False)
    assert lw._line_from_env() == 512
    monkeypatch.setenv("OPFUSE_LNBWD_WIDE_ABOVE", "8192")
    assert lw._line_from_env() == 8192
    monkeypatch.setenv("OPFUSE_LNBWD_WIDE_ABOVE", "wide")
    with pytest.raises(ValueError, match="OPFUSE_LNBWD_WIDE_ABOVE"):
        lw._line_from_env()
    assert lw._columns_from_env("OPFUSE_LNBWD_WIDE_SHORT", 512) == 512
    monkeypatch.setenv("OPFUSE_LNBWD_WIDE_SHORT", "0")
    assert lw._columns_from_env("OPFUSE_LNBWD_WIDE_SHORT", 512) == 0
    monkeypatch.setattr(lw, "SHORT_ROWS_UP_TO", 512)
    assert lw.shape_reason((64, 256), 1, torch.bfloat16, torch.bfloat16, None, [True, True, False]) == ""
    assert lw.shape_reason((64, 400), 1, torch.float16, torch.float16, None, [True, True, False]) == ""
    assert "on chip" in lw.shape_reason((64, 128), 1, torch.bfloat16, torch.bfloat16, None, [True, True, False])
    assert "on chip" in lw.shape_reason((64, 256), 1, torch.float32, torch.float32, None, [True, True, False])
    assert lw.shape_reason((64, 1024), 1, torch.bfloat16, torch.bfloat16, None, [True, True, False]) == ""
    monkeypatch.setattr(lw, "SMALL_ROWS_ABOVE", 1536)
    assert "on chip" in lw.shape_reason((64, 1024), 1, torch.bfloat16, torch.bfloat16, None, [True, True, False])


def _inputs(shape, nd, dtype, device, gen_stats=True):
    x = torch.randn(shape, dtype=torch.float64, device=device).to(dtype)
    dy = torch.randn(shape, dtype=torch.float64, device=device).to(dtype)
    n = 1
    for s in shape[len(shape) - nd:]:
        n *= s
    w = (1 + 0.5 * torch.randn(shape[len(shape) - nd:], dtype=torch.float64, device=device)).to(dtype)
    b = torch.randn(shape[len(shape) - nd:], dtype=torch.float64, device=device).to(dtype)
    xd = x.double()
    dims = list(range(len(shape) - nd, len(shape)))
    mean = xd.mean(dim=dims, keepdim=True)
    rstd = (xd.var(dim=dims, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    return dy, x, mean.float(), rstd.float(), w, b


@pytest.mark.parametrize("with_weight", [True, False])
def test_cpu_reference_against_torch_float64(with_weight):
    torch.manual_seed(0)
    dy, x, mean, rstd, w, b = _inputs((5, 37), 1, torch.float64, "cpu")
    w = w if with_weight else None
    dx, dw, db = lw.reference(dy, x, mean, rstd, w)
    ex, ew, eb = aten.native_layer_norm_backward(dy, x, [37], mean.double(), rstd.double(), w, b,
                                                 [True, with_weight, True])
    torch.testing.assert_close(dx, ex, rtol=1e-12, atol=1e-12)
    if with_weight:
        torch.testing.assert_close(dw, ew, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(db, eb, rtol=1e-12, atol=1e-12)


def test_cpu_reference_refuses_bad_sizes():
    z = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(Exception, match="out of range"):
        _C.lnbwd_wide_reference(2, 4, z.data_ptr(), 3, z.data_ptr(), 4, z.data_ptr(), z.data_ptr(), 0, 0, 0, 0)


# --- on a GPU ----------------------------------------------------------------

def sm90_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs sm_90 (thread-block clusters)")


def _check(out, ref, eager, what):
    """out's error against float64 at most twice eager's (same dtype), plus a floor."""
    err = (out.double() - ref).abs().max().item()
    eerr = (eager.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    floor = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out.dtype] * max(1.0, scale)
    assert err <= 2 * eerr + floor, f"{what}: error {err:.3g} against eager's {eerr:.3g} (scale {scale:.3g})"


def _run_op(dy, x, mean, rstd, w, b, nd, mask):
    return torch.ops.opfuse.layer_norm_backward(dy, x, mean, rstd, w, b, nd, mask)


def _twice_bitwise_equal_and_close(dy, x, mean, rstd, w, b, what):
    """Two runs of the wide-row kernel (rows of the last dim): bitwise equal,
    and within _check of float64."""
    n = x.shape[-1]
    before = lw.launch_count()
    a = _run_op(dy, x, mean, rstd, w, b, 1, [True, True, True])
    c = _run_op(dy, x, mean, rstd, w, b, 1, [True, True, True])
    torch.cuda.synchronize()
    assert lw.launch_count() == before + 2, lw.last_error()
    for u, v in zip(a, c):
        assert torch.equal(u, v), "reruns differ"
    ref = aten.native_layer_norm_backward(dy.double(), x.double(), [n], mean.double(), rstd.double(), w.double(),
                                          b.double(), [True, True, True])
    eag = aten.native_layer_norm_backward(dy, x, [n], mean, rstd, w, b, [True, True, True])
    for i in range(3):
        _check(a[i], ref[i], eag[i], what + ["dx", "dw", "db"][i])


CASES = [  # shape, nd
    ((257, 32768), 1),  # rows not a multiple of the batch; the benchmark's width
    ((3, 9000), 1),     # n fills part of the cluster's last vectors
    ((64, 16384), 1),
    ((5, 65536), 1),
    ((2, 3, 12288), 1),
    ((6, 4, 4096), 2),  # two normalised dims: n = 16384
    ((129, 4096), 1),   # 16-bit: 256-thread CTAs, clusters of 2 (float32: the generated kernels)
    ((33, 3584), 1),    # 16-bit: the last CTA's columns seven eighths full
    ((65, 1600), 1),    # 16-bit: one 256-thread CTA a row, 200 of its 256 vectors
    ((31, 8192), 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,nd", CASES)
@pytest.mark.parametrize("elem", ["bf16", "f16", "f32"])
def test_against_float64_and_eager(shape, nd, elem):
    sm90_or_skip()
    dtype = DTYPES[elem]
    n = 1
    for s in shape[len(shape) - nd:]:
        n *= s
    if not _C.lnbwd_wide_choose_config(elem, n):
        pytest.skip(f"{elem} n={n}: wider than the kernel covers")
    torch.manual_seed(1)
    dy, x, mean, rstd, w, b = _inputs(shape, nd, dtype, "cuda")
    taken = not lw.shape_reason(shape, nd, dtype, dtype, dtype, [True, True, True])
    assert taken or n <= lw.GENERATED_MAX_COLS
    before = lw.launch_count()
    dx, dw, db = _run_op(dy, x, mean, rstd, w, b, nd, [True, True, True])
    torch.cuda.synchronize()
    assert lw.launch_count() == before + int(taken), lw.last_error()
    norm = list(shape[len(shape) - nd:])
    rx, rw, rb = aten.native_layer_norm_backward(dy.double(), x.double(), norm, mean.double(), rstd.double(), w.double(),
                                                 b.double(), [True, True, True])
    ex, ew, eb = aten.native_layer_norm_backward(dy, x, norm, mean, rstd, w, b, [True, True, True])
    assert dx.shape == x.shape and dw.shape == w.shape and db.shape == b.shape
    assert dx.dtype == dtype and dw.dtype == dtype and db.dtype == dtype
    _check(dx, rx, ex, "dx")
    _check(dw, rw, ew, "dw")
    _check(db, rb, eb, "db")


@pytest.mark.gpu
@pytest.mark.parametrize("elem", ["bf16", "f32"])
def test_every_config_on_the_device(elem, monkeypatch):
    sm90_or_skip()
    dtype = DTYPES[elem]
    vec = 4 if elem == "f32" else 8
    monkeypatch.setattr(lw, "GENERATED_MAX_COLS", 0)  # every width to this kernel, as forced
    monkeypatch.setattr(lw, "SHORT_ROWS_ABOVE", 0)
    for tag in _C.lnbwd_wide_candidates(elem):
        threads, kind, size, nv = re.match(r"t(\d+)([cg])(\d+)r\d+v(\d+)", tag).groups()
        lanes = int(size) * int(threads) if kind == "c" else int(size)  # a cluster's threads, or a group's lanes
        n = min(lanes * int(nv) * vec, 65536) - 3 * vec  # the last vectors of the last CTA (group) empty
        monkeypatch.setenv("OPFUSE_LNBWD_WIDE_CONFIG", tag)
        torch.manual_seed(8)
        dy, x, mean, rstd, w, b = _inputs((67, n), 1, dtype, "cuda")
        before = lw.launch_count()
        got = _run_op(dy, x, mean, rstd, w, b, 1, [True, True, True])
        torch.cuda.synchronize()
        assert lw.launch_count() == before + 1, f"{tag}: {lw.last_error()}"
        ref = aten.native_layer_norm_backward(dy.double(), x.double(), [n], mean.double(), rstd.double(), w.double(),
                                              b.double(), [True, True, True])
        eag = aten.native_layer_norm_backward(dy, x, [n], mean, rstd, w, b, [True, True, True])
        for i in range(3):
            _check(got[i], ref[i], eag[i], f"{tag} n={n} " + ["dx", "dw", "db"][i])


@pytest.mark.gpu
@pytest.mark.parametrize("mask,with_w,with_b", [
    ([True, True, False], True, False),
    ([True, False, True], False, True),   # no weight: g = dy
    ([False, True, True], True, True),    # dx not asked
    ([True, False, True], True, True),
])
def test_masks_and_missing_affine(mask, with_w, with_b):
    sm90_or_skip()
    torch.manual_seed(2)
    dy, x, mean, rstd, w, b = _inputs((33, 32768), 1, torch.bfloat16, "cuda")
    w = w if with_w else None
    b = b if with_b else None
    before = lw.launch_count()
    outs = _run_op(dy, x, mean, rstd, w, b, 1, mask)
    torch.cuda.synchronize()
    assert lw.launch_count() == before + 1
    ref = aten.native_layer_norm_backward(dy.double(), x.double(), [32768], mean.double(), rstd.double(),
                                          w.double() if w is not None else None,
                                          b.double() if b is not None else None, mask)
    eag = aten.native_layer_norm_backward(dy, x, [32768], mean, rstd, w, b, mask)
    eff = [mask[0], mask[1] and with_w, mask[2] and with_b]
    got = iter(outs)
    assert len(outs) == sum(eff)
    for i, m in enumerate(eff):
        if m:
            _check(next(got), ref[i], eag[i], ["dx", "dw", "db"][i])


@pytest.mark.gpu
def test_strided_rows_with_offset_and_deterministic():
    sm90_or_skip()
    torch.manual_seed(3)
    n = 32768
    big_x = torch.randn(100, n + 64, device="cuda", dtype=torch.bfloat16)
    big_dy = torch.randn(100, n + 128, device="cuda", dtype=torch.bfloat16)
    x, dy = big_x[1:, 8:8 + n], big_dy[1:, 64:64 + n]  # row strides n + 64 and n + 128, offsets
    assert not x.is_contiguous() and x.storage_offset() > 0
    xd = x.double()
    mean = xd.mean(-1, keepdim=True).float()
    rstd = (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt().float()
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    _twice_bitwise_equal_and_close(dy, x, mean, rstd, w, b, "")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,elem", [(20001, 256, "bf16"), (999, 392, "f16"), (33, 40, "bf16"),
                                         (4099, 512, "bf16"), (3000, 128, "f16")])
def test_short_rows_lane_groups(rows, n, elem, monkeypatch):
    """Rows of at most 512 columns in lane groups (forced where the routing
    line leaves them to the generated kernels): many batches a group, groups
    with no rows, rows of a wider tensor at an offset, bitwise reruns."""
    sm90_or_skip()
    monkeypatch.setattr(lw, "SHORT_ROWS_UP_TO", 512)
    monkeypatch.setattr(lw, "SHORT_ROWS_ABOVE", 0)  # 40 and 128 columns too (not routed by default)
    assert "g" in _C.lnbwd_wide_choose_config(elem, n)
    dtype = DTYPES[elem]
    torch.manual_seed(rows)
    big_x = torch.randn(rows, n + 24, device="cuda", dtype=dtype)
    x = big_x[:, 8:8 + n]  # rows n + 24 apart, 16 bytes in
    dy = torch.randn(rows, n, device="cuda", dtype=dtype)
    xd = x.double()
    mean = xd.mean(-1, keepdim=True).float()
    rstd = (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt().float()
    w = (1 + 0.5 * torch.randn(n, device="cuda", dtype=torch.float64)).to(dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    _twice_bitwise_equal_and_close(dy, x, mean, rstd, w, b, f"rows={rows} n={n} ")
    # no weight, dx and the bias gradient only
    got = _run_op(dy, x, mean, rstd, None, b, 1, [True, False, True])
    ref = aten.native_layer_norm_backward(dy.double(), xd, [n], mean.double(), rstd.double(), None, b.double(),
                                          [True, False, True])
    eag = aten.native_layer_norm_backward(dy, x, [n], mean, rstd, None, b, [True, False, True])
    _check(got[0], ref[0], eag[0], "dx without weight")
    _check(got[1], ref[2], eag[2], "db without weight")


@pytest.mark.gpu
def test_misaligned_falls_back_with_the_same_answer():
    sm90_or_skip()
    torch.manual_seed(4)
    n = 16384
    big = torch.randn(40 * n + 1, device="cuda", dtype=torch.bfloat16)
    x = big[1:].view(40, n)  # 2-byte offset: not 16-byte aligned
    dy = torch.randn(40, n, device="cuda", dtype=torch.bfloat16)
    xd = x.double()
    mean = xd.mean(-1, keepdim=True).float()
    rstd = (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt().float()
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    before = lw.launch_count()
    dx, dw = _run_op(dy, x, mean, rstd, w, None, 1, [True, True, False])
    torch.cuda.synchronize()
    assert lw.launch_count() == before  # the generated kernels ran
    ref = aten.native_layer_norm_backward(dy.double(), xd, [n], mean.double(), rstd.double(), w.double(), None,
                                          [True, True, False])
    eag = aten.native_layer_norm_backward(dy, x, [n], mean, rstd, w, None, [True, True, False])
    _check(dx, ref[0], eag[0], "dx")
    _check(dw, ref[1], eag[1], "dw")


@pytest.mark.gpu
def test_layout_checks_cached_but_addresses_checked_each_call(monkeypatch):
    """try_run checks a layout once (sizes, strides, dtypes, the routing
    lines) and the pointers at every call: a misaligned view with the layout
    of an earlier aligned call falls back with the same answer, and moving a
    routing line changes the decision for a layout already seen."""
    sm90_or_skip()
    torch.manual_seed(9)
    rows, n = 48, 16384
    big = torch.randn(rows * n + 8, device="cuda", dtype=torch.bfloat16)
    aligned, shifted = big[:rows * n].view(rows, n), big[1:1 + rows * n].view(rows, n)
    assert aligned.stride() == shifted.stride() and shifted.data_ptr() % 16
    dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for x, taken in ((aligned, True), (shifted, False), (aligned, True)):
        xd = x.double()
        mean = xd.mean(-1, keepdim=True).float()
        rstd = (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt().float()
        before = lw.launch_count()
        got = _run_op(dy, x, mean, rstd, w, b, 1, [True, True, True])
        torch.cuda.synchronize()
        assert lw.launch_count() == before + int(taken)
        ref = aten.native_layer_norm_backward(dy.double(), xd, [n], mean.double(), rstd.double(), w.double(),
                                              b.double(), [True, True, True])
        eag = aten.native_layer_norm_backward(dy, x, [n], mean, rstd, w, b, [True, True, True])
        for i in range(3):
            _check(got[i], ref[i], eag[i], f"taken={taken} " + ["dx", "dw", "db"][i])
    # 256 columns: lane groups by default; with the short range off, not.
    dy, x, mean, rstd, w, b = _inputs((999, 256), 1, torch.bfloat16, "cuda")
    for up_to, taken in ((512, True), (0, False), (512, True)):
        monkeypatch.setattr(lw, "SHORT_ROWS_UP_TO", up_to)
        before = lw.launch_count()
        _run_op(dy, x, mean, rstd, w, b, 1, [True, True, True])
        torch.cuda.synchronize()
        assert lw.launch_count() == before + int(taken), up_to


@pytest.mark.gpu
def test_off_switch(monkeypatch):
    sm90_or_skip()
    monkeypatch.setenv("OPFUSE_LNBWD_WIDE", "0")
    dy, x, mean, rstd, w, b = _inputs((8, 16384), 1, torch.bfloat16, "cuda")
    before = lw.launch_count()
    dx, dw, db = _run_op(dy, x, mean, rstd, w, b, 1, [True, True, True])
    torch.cuda.synchronize()
    assert lw.launch_count() == before


@pytest.mark.gpu
def test_cuda_graph_capture():
    sm90_or_skip()
    torch.manual_seed(5)
    dy, x, mean, rstd, w, b = _inputs((300, 32768), 1, torch.bfloat16, "cuda")
    eager = _run_op(dy, x, mean, rstd, w, b, 1, [True, True, True])  # loads the kernel before capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _run_op(dy, x, mean, rstd, w, b, 1, [True, True, True])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = _run_op(dy, x, mean, rstd, w, b, 1, [True, True, True])
    dy.copy_(torch.randn_like(dy))
    g.replay()
    torch.cuda.synchronize()
    fresh = _run_op(dy, x, mean, rstd, w, b, 1, [True, True, True])
    torch.cuda.synchronize()
    for u, v, e in zip(outs, fresh, eager):
        assert torch.equal(u, v)
        assert not torch.equal(u, e)


@pytest.mark.gpu
def test_compiled_graph_routes_native_layer_norm_backward():
    sm90_or_skip()
    torch.manual_seed(6)
    dy, x, mean, rstd, w, b = _inputs((512, 32768), 1, torch.bfloat16, "cuda")

    def fn(dy, x, mean, rstd, w, b):
        return aten.native_layer_norm_backward(dy, x, [32768], mean, rstd, w, b, [True, True, True])

    compiled = opfuse.compile(fn)
    compiled(dy, x, mean, rstd, w, b)
    torch.cuda.synchronize()
    opfuse.reset_stats()
    before = lw.launch_count()
    got = compiled(dy, x, mean, rstd, w, b)
    torch.cuda.synchronize()
    assert lw.launch_count() == before + 1
    st = opfuse.stats()
    assert st["kernel_launches"] == 2 and st["library_calls"] == 0, st  # the row kernel and the column sums
    ref = fn(dy.double(), x.double(), mean.double(), rstd.double(), w.double(), b.double())
    eag = fn(dy, x, mean, rstd, w, b)
    for i in range(3):
        _check(got[i], ref[i], eag[i], ["dx", "dw", "db"][i])


@pytest.mark.gpu
def test_dynamic_shapes_route_it_too():
    """A graph compiled with symbolic row counts (dynamic shapes) routes the
    node as well (the width decides); each call's rows are checked then."""
    sm90_or_skip()
    torch.manual_seed(10)
    n = 4096

    def fn(dy, x, mean, rstd, w, b):
        return aten.native_layer_norm_backward(dy, x, [n], mean, rstd, w, b, [True, True, True])

    compiled = torch.compile(fn, backend="opfuse", dynamic=True)
    said = OpfuseLog()  # the routing pass's and try_run's reasons, for a failure's message
    for rows in (300, 517, 1):
        dy, x, mean, rstd, w, b = _inputs((rows, n), 1, torch.bfloat16, "cuda")
        before = lw.launch_count()
        with said:
            got = compiled(dy, x, mean, rstd, w, b)
        torch.cuda.synchronize()
        assert lw.launch_count() == before + 1, (rows, said.messages)
        ref = fn(dy.double(), x.double(), mean.double(), rstd.double(), w.double(), b.double())
        eag = fn(dy, x, mean, rstd, w, b)
        for i in range(3):
            _check(got[i], ref[i], eag[i], f"rows={rows} " + ["dx", "dw", "db"][i])


@pytest.mark.gpu
def test_training_step_through_layer_norm_uses_it():
    sm90_or_skip()
    torch.manual_seed(7)
    ln = torch.nn.LayerNorm(16384, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ln.weight.normal_(1, 0.2)
        ln.bias.normal_()
    x = torch.randn(96, 16384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(96, 16384, device="cuda", dtype=torch.bfloat16)
    compiled = opfuse.compile(lambda t: (ln(t) * r).sum())
    before = lw.launch_count()
    compiled(x).backward()
    torch.cuda.synchronize()
    assert lw.launch_count() == before + 1
    got = (x.grad.clone(), ln.weight.grad.clone(), ln.bias.grad.clone())
    x.grad = None
    ln.weight.grad = ln.bias.grad = None
    (ln(x) * r).sum().backward()
    eag = (x.grad, ln.weight.grad, ln.bias.grad)
    ln64 = torch.nn.LayerNorm(16384, device="cuda", dtype=torch.float64)
    with torch.no_grad():
        ln64.weight.copy_(ln.weight)
        ln64.bias.copy_(ln.bias)
    x64 = x.detach().double().requires_grad_(True)
    (ln64(x64) * r.double()).sum().backward()
    ref = (x64.grad, ln64.weight.grad, ln64.bias.grad)
    for i in range(3):
        _check(got[i], ref[i], eag[i], ["dx", "dw", "db"][i])
