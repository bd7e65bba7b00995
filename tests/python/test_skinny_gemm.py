"""The skinny GEMM (M <= 16, nn.Linear weights; src/kernels/skinny_gemm/).

Without a GPU: every instantiation the launcher can pick compiles with NVRTC
for sm_80 and sm_90 without spills, the config choice, the applicability
rules, and the float64 CPU reference against torch's float64 matmul.

On a GPU (marked gpu): the kernel against the float64 reference and eager
PyTorch (M in {1, 3, 8, 16}, K in {4096, 4104, 1000}, N = 1001, bias at a
storage offset, relu, tanh-gelu with its aux output, a residual), every
config (the pipelined ones too), determinism, CUDA-graph capture, and that
compiled graphs take the skinny path (opfuse.stats() and the launch
counter) when OPFUSE_SKINNY_GEMM=1, cuBLASLt with =0, and by default the
kernel for the shapes of default_takes only."""
import re

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse import _C
from opfuse import skinny_gemm as sg

from conftest import nvrtc_or_skip

ELEMS = {"bf16": torch.bfloat16, "f16": torch.float16}


@pytest.fixture(autouse=True)
def skinny_enabled(monkeypatch):
    """OPFUSE_SKINNY_GEMM=1 (every shape it supports); the default takes only
    some shapes (test_by_default_it_takes_the_down_projection)."""
    monkeypatch.setenv("OPFUSE_SKINNY_GEMM", "1")


def cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


# --- without a GPU -----------------------------------------------------------

@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("elem", ["bf16", "f16"])
def test_every_instantiation_compiles_without_spills(arch, elem):
    nvrtc_or_skip()
    for tag in _C.skinny_gemm_candidates(arch):
        cubin, log = _C.skinny_gemm_compile(elem, tag, arch)
        assert len(cubin) > 0
        regs = int(re.search(r"Used (\d+) registers", log).group(1))
        spills = re.search(r"(\d+) bytes spill stores", log).group(1)
        assert spills == "0", f"{tag} sm_{arch}:\n{log}"
        tma = re.fullmatch(r"n\d+w(\d+)s\d+c\d+(?:e\d+)?(?:x2|xg)?d?", tag)  # the TMA kernel: a producer warp more, one CTA an SM
        if tma:
            assert arch >= 90, tag
            warps, blocks = int(tma.group(1)) + 1, 1
        else:
            warps, blocks = (int(x) for x in re.match(r"n\d+u\d+w(\d+)b(\d+)c\d+", tag).groups())
        assert regs * warps * 32 * blocks <= 65536, f"{tag}: {regs} registers miss __launch_bounds__"


def test_pipelined_configs_compile_without_spills():
    """PIPE = 1 holds two chunks' operands: the configs measured with it keep
    within their __launch_bounds__ without spills."""
    nvrtc_or_skip()
    for tag in ("n4u2w8b2c2p1", "n8u2w8b1c2p1", "n8u1w8b1c2p1", "n4u2w8b2c1p1", "n8u1w8b1c2p2", "n8u2w8b1c2p2"):
        cubin, log = _C.skinny_gemm_compile("bf16", tag, 90)
        assert re.search(r"(\d+) bytes spill stores", log).group(1) == "0", f"{tag}:\n{log}"
    with pytest.raises(Exception, match="out of range"):
        _C.skinny_gemm_compile("bf16", "n8u1w8b2c1p3", 90)


def test_clusters_only_from_sm_90():
    nvrtc_or_skip()
    with pytest.raises(Exception, match="sm_90"):
        _C.skinny_gemm_compile("bf16", "n8u1w8b2c4", 80)
    with pytest.raises(Exception, match="sm_90"):
        _C.skinny_gemm_compile("bf16", "n4w4s11c1", 80)  # the TMA kernel
    assert all(t.endswith("c1") for t in _C.skinny_gemm_candidates(80))


def test_tma_config_choice_for_the_benchmark_shapes():
    """One wave on 132 SMs, at least 64 rows a CTA (A's 16-row box a small
    part of each stage), a ring of ~200 KB; the tags parse and round-trip."""
    choose = _C.skinny_gemm_choose_tma_config
    assert choose(16, 16384, 4096, 132) == "n4w4s11c1"   # 128 rows, 128 CTAs
    assert choose(16, 4096, 16384, 132) == "n2w4s12c2"   # 64 rows x a cluster of 2: 128 CTAs
    assert choose(16, 11008, 4096, 132) == "n3w4s12c1"   # 96 rows: 115 CTAs (4 consumer warps)
    assert choose(1, 4096, 11008, 132) == "n2w4s12c2"
    assert choose(16, 64, 64, 132) == "n1w4s12c1"        # one chunk of K: no cluster to split it
    for tag in ("n4w4s11c1", "n2w4s12c2", "n3w4s12c1"):
        assert tag in _C.skinny_gemm_candidates(90)
    with pytest.raises(Exception, match="out of range"):
        _C.skinny_gemm_compile("bf16", "n16w4s11c1", 90)  # 512 rows: more than a box holds
    with pytest.raises(Exception, match="out of range"):
        _C.skinny_gemm_compile("bf16", "n4w4s16c1", 90)  # 16 stages of 18 KB: more shared memory than an SM has


def test_trace_configs_parse_and_compile():
    """A trailing "t" is the same config built with its CTAs' timeline
    (diagnosis only: scripts/skinny_timeline.py); it round-trips through the
    parser and compiles without spills for both kernels."""
    nvrtc_or_skip()
    for tag in ("n8u1w8b1c2p1t", "n8u1w8b2c1t", "n4w4s11c1t", "n2w4s12c2e2t"):
        cubin, log = _C.skinny_gemm_compile("bf16", tag, 90)
        assert re.search(r"(\d+) bytes spill stores", log).group(1) == "0", f"{tag}:\n{log}"
    with pytest.raises(Exception, match="bad skinny GEMM config"):
        _C.skinny_gemm_compile("bf16", "n8u1w8b2c1tt", 90)


def test_trigger_start_configs_parse_and_compile():
    """A "d" suffix (OPFUSE_SKINNY_TRIGGER=start) builds the TMA kernel with
    its programmatic-launch trigger at the start instead of after the main
    loop: the tag round-trips, and the build differs from the plain one."""
    nvrtc_or_skip()
    for tag in ("n4w4s11c1", "n2w4s12c2", "n7w3s8c1xg"):
        plain, _ = _C.skinny_gemm_compile("bf16", tag, 90)
        early, log = _C.skinny_gemm_compile("bf16", tag + "d", 90)
        assert re.search(r"(\d+) bytes spill stores", log).group(1) == "0", f"{tag}d:\n{log}"
        assert bytes(plain) != bytes(early), tag
    with pytest.raises(Exception, match="bad skinny GEMM config"):
        _C.skinny_gemm_compile("bf16", "n4w4s11c1dd", 90)


def test_config_choice_for_the_benchmark_shapes():
    choose = _C.skinny_gemm_choose_config
    assert choose(16, 16384, 4096, 90, 132) == "n8u1w8b2c1"
    assert choose(16, 4096, 16384, 90, 132) == "n8u1w8b1c2p1"  # the best measured (one pipelined CTA an SM)
    assert choose(16, 11008, 4096, 90, 132) == "n8u1w8b2c1"
    assert choose(16, 4096, 11008, 90, 132) == "n8u1w8b1c2p1"


def test_what_it_declines():
    why = _C.skinny_gemm_unsupported_reason
    p = 1 << 20  # any 16-byte aligned address: nothing is read
    assert why("bf16", 16, 4096, 4096, p, 4096, p, 4096) == ""
    assert why("f16", 1, 1001, 1000, p, 0, p, 1000, activation="gelu_tanh") == ""
    assert "multiple of 8" in why("bf16", 4, 64, 1001, p, 1001, p, 1001)
    assert "1..16" in why("bf16", 17, 64, 64, p, 64, p, 64)
    assert "aligned" in why("bf16", 4, 64, 64, p + 2, 64, p, 64)
    assert why("bf16", 4, 64, 64, p, 64, p, 64, activation="silu") != ""


@pytest.mark.parametrize("activation", ["", "relu", "gelu_tanh"])
def test_cpu_reference_against_torch_float64(activation):
    torch.manual_seed(0)
    x = torch.randn(5, 40).to(torch.bfloat16)
    w = (torch.randn(13, 40) * 0.2).to(torch.bfloat16)
    bias = torch.randn(39).to(torch.bfloat16)[::3]
    res = torch.randn(5, 13).to(torch.bfloat16)
    out, aux = sg.reference(x, w, bias, res, activation)
    pre = x.double() @ w.double().T + bias.double() + res.double()
    act = {"": pre, "relu": torch.relu(pre), "gelu_tanh": F.gelu(pre, approximate="tanh")}[activation]
    torch.testing.assert_close(aux, pre.to(torch.bfloat16).double(), rtol=0, atol=0)
    torch.testing.assert_close(out, act.to(torch.bfloat16).double(), rtol=0, atol=1e-12)


# --- on a GPU ------------------------------------------------------------------

def operands(m, k, n, dtype, offset_bias=True):
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(dtype)
    storage = torch.randn(n + 5, device="cuda").to(dtype)
    bias = storage[3:3 + n] if offset_bias else storage[:n]  # 3 elements in: not 16-byte aligned
    res = torch.randn(m, n, device="cuda").to(dtype)
    return x, w, bias, res


def eager(x, w, bias, res, activation):
    y = F.linear(x, w, bias)
    if res is not None:
        y = y + res
    return {"": y, "relu": torch.relu(y), "gelu_tanh": F.gelu(y, approximate="tanh")}[activation]


def check(out, ref, eager_out):
    """No further from the float64 reference than twice eager (plus two ulps
    of the largest value): a K-long dot product in 16-bit floats misses
    assert_close's atol near zero for eager as well (the FlashAttention rule,
    product.md)."""
    ref_t = ref.to(out.device)
    assert out.shape == ref_t.shape and out.dtype == eager_out.dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref_t).abs().max().item()
    eager_err = (eager_out.double() - ref_t).abs().max().item()
    ulps = 2 * torch.finfo(out.dtype).eps * ref_t.abs().max().item()
    assert err <= 2 * eager_err + ulps, (err, eager_err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [4096, 4104, 1000])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_kernel_against_reference_and_eager(m, k, dtype):
    cuda_or_skip()
    torch.manual_seed(m * 7 + k)
    n = 1001
    x, w, bias, res = operands(m, k, n, dtype)
    cases = [dict(), dict(bias=bias, activation="relu"), dict(bias=bias, activation="gelu_tanh", aux=True),
             dict(residual=res), dict(bias=bias, residual=res, activation="gelu_tanh", aux=True)]
    for case in cases:
        before = sg.launch_count()
        got = sg.linear(x, w, **case)
        assert got is not None, f"skinny GEMM declined {case}: {sg.last_error()}"
        assert sg.launch_count() == before + 1
        out, aux = got
        act = case.get("activation", "")
        ref, ref_aux = sg.reference(x, w, case.get("bias"), case.get("residual"), act)
        check(out, ref, eager(x, w, case.get("bias"), case.get("residual"), act))
        if case.get("aux"):
            check(aux, ref_aux, eager(x, w, case.get("bias"), case.get("residual"), ""))


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["n8u1w8b2c1", "n8u1w8b2c2", "n8u1w8b2c4", "n8u1w8b2c8", "n4u2w8b1c1",
                                    "n4u2w8b2c2p1", "n8u2w8b1c2p1", "n8u1w8b2c1p1", "n4u1w8b3c2p1", "n4u2w8b2c1p1",
                                    "n8u1w8b1c2p1", "n8u1w8b1c4p1", "n8u1w8b1c8p1", "n8u1w8b1c2p2", "n8u1w8b1c8p2",
                                    "n8u2w8b1c2p2", "n16u1w8b1c1p1", "n16u1w8b1c4p1",
                                    "n4w4s11c1", "n4w4s11c4", "n11w1s12c1", "n4w4s8c1", "n2w4s12c2", "n1w1s2c8",
                                    "n4w4s11c1e2", "n1w1s3c8e1", "n3w4s12c1", "n1w4s32c1", "n4w4s11c1d",
                                    "n2w4s12c2d", "n2w4s20c1", "n2w3s24c1"])
def test_every_config_on_the_device(config, monkeypatch):
    cuda_or_skip()
    if (config[-2:] != "c1" or re.fullmatch(r"n\d+w\d+s\d+c\d+(?:e\d+)?d?", config)) and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters and the TMA kernel need sm_90")
    monkeypatch.setenv("OPFUSE_SKINNY_CONFIG", config)
    torch.manual_seed(1)
    for m, k, n in [(16, 4104, 1001), (3, 1000, 200), (16, 8, 64), (1, 16384, 136)]:
        x, w, bias, res = operands(m, k, n, torch.bfloat16)
        got = sg.linear(x, w, bias, res, "gelu_tanh", aux=True)
        assert got is not None, sg.last_error()
        ref, ref_aux = sg.reference(x, w, bias, res, "gelu_tanh")
        check(got[0], ref, eager(x, w, bias, res, "gelu_tanh"))
        check(got[1], ref_aux, eager(x, w, bias, res, ""))


@pytest.mark.gpu
def test_deterministic_and_row_strides():
    cuda_or_skip()
    torch.manual_seed(2)
    big = torch.randn(16, 4096 + 64, device="cuda").to(torch.bfloat16)
    x = big[:, 64:]  # row stride 4160, 128-byte offset
    w = (torch.randn(4096, 4096 + 8, device="cuda") * 0.02).to(torch.bfloat16)[:, :4096]
    first = sg.linear(x, w)[0]
    for _ in range(3):
        assert torch.equal(sg.linear(x, w)[0], first)
    check(first, sg.reference(x, w)[0], F.linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("config, promo", [("n4w4s11c1", ""), ("n2w4s12c2", ""), ("n4w4s11c1", "0"), ("n2w4s12c2", "2")])
def test_tma_kernel_with_views_and_odd_sizes(config, promo, monkeypatch):
    """The TMA kernel's tensor maps: A a row-strided view at a 128-byte
    offset, W a column slice (row stride past K), M of 1 and 5, N and K
    that leave partial boxes (zeros past them); float64 reference. Also
    with another L2 promotion (OPFUSE_SKINNY_TMA_L2_PROMO)."""
    cuda_or_skip()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernel needs sm_90")
    monkeypatch.setenv("OPFUSE_SKINNY_CONFIG", config)
    if promo:
        monkeypatch.setenv("OPFUSE_SKINNY_TMA_L2_PROMO", promo)
    torch.manual_seed(3)
    for m, k, n in [(16, 4096, 4096), (5, 4168, 1000), (1, 2056, 136)]:
        big = torch.randn(m, k + 64, device="cuda").to(torch.bfloat16)
        x = big[:, 64:]  # row stride k + 64, 128 bytes in
        w = (torch.randn(n, k + 8, device="cuda") * k ** -0.5).to(torch.bfloat16)[:, :k]
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        got = sg.linear(x, w, bias, activation="relu")
        assert got is not None, sg.last_error()
        check(got[0], sg.reference(x, w, bias, activation="relu")[0], F.relu(F.linear(x, w, bias)))
        again = sg.linear(x, w, bias, activation="relu")[0]
        assert torch.equal(again, got[0])  # deterministic: fixed order, no atomics


@pytest.mark.gpu
@pytest.mark.parametrize("knob, tma", [(None, True), ("1", True), ("0", False)])
def test_tma_kernel_is_the_default_on_sm90(knob, tma, monkeypatch):
    """On sm_90 the benchmark shapes go to the TMA kernel's configs unless
    OPFUSE_SKINNY_TMA=0; the gated form always stays with the register
    kernel (the TMA kernel has none)."""
    cuda_or_skip()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernel needs sm_90")
    if knob is None:
        monkeypatch.delenv("OPFUSE_SKINNY_TMA", raising=False)
    else:
        monkeypatch.setenv("OPFUSE_SKINNY_TMA", knob)
    monkeypatch.delenv("OPFUSE_SKINNY_CONFIG", raising=False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(4)
    x, w, bias, _ = operands(16, 4096, 4096, torch.bfloat16)
    before = sg.launch_count()
    got = sg.linear(x, w, bias)
    assert got is not None and sg.launch_count() == before + 1, sg.last_error()
    want = _C.skinny_gemm_choose_tma_config(16, 4096, 4096, sms) if tma else \
        _C.skinny_gemm_choose_config(16, 4096, 4096, 90, sms)
    assert sg.last_config() == want
    check(got[0], sg.reference(x, w, bias)[0], F.linear(x, w, bias))
    up = torch.randn_like(x)
    gated = sg.linear(x, w, bias, up=up)
    assert gated is not None, sg.last_error()
    assert re.fullmatch(r"n\d+u\d+w\d+b\d+c\d+(p\d+)?g1", sg.last_config()), sg.last_config()
    check(gated[0], sg.reference(x, w, bias, up=up)[0], F.linear((F.silu(x.float()) * up.float()).to(x.dtype), w, bias))


@pytest.mark.gpu
def test_config_forced_per_output_width(monkeypatch):
    """OPFUSE_SKINNY_CONFIG="tag@N,...": only GEMMs of N output columns take
    the tag (a 32-row, 32-stage ring here), the others the chooser's config;
    values against float64 either way."""
    cuda_or_skip()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernel needs sm_90")
    monkeypatch.delenv("OPFUSE_SKINNY_TMA", raising=False)
    monkeypatch.setenv("OPFUSE_SKINNY_GEMM", "1")
    monkeypatch.setenv("OPFUSE_SKINNY_CONFIG", "n7w3s9c1@1000,n1w4s32c1@4104")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(6)
    for n, want in ((4104, "n1w4s32c1"), (2048, _C.skinny_gemm_choose_tma_config(13, 2048, 4096, sms))):
        x, w, bias, _ = operands(13, 4096, n, torch.bfloat16)
        got = sg.linear(x, w, bias)
        assert got is not None, sg.last_error()
        assert sg.last_config() == want
        check(got[0], sg.reference(x, w, bias)[0], F.linear(x, w, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("config, ctas", [("n8u1w8b1c2p1t", 128), ("n4w4s11c1t", 32), ("n2w4s12c2t", 128)])
def test_trace_config_stamps_every_cta(config, ctas, monkeypatch):
    """A trace build computes the same product and writes, for every CTA,
    entry <= main loop done <= exit and its SM; with no buffer it writes
    nothing and still runs."""
    cuda_or_skip()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the configs need sm_90")
    monkeypatch.setenv("OPFUSE_SKINNY_CONFIG", config)
    torch.manual_seed(5)
    x, w, bias, _ = operands(16, 4096, 4096, torch.bfloat16)
    buf = torch.zeros(2048 * 6, dtype=torch.int64, device="cuda")
    try:
        _C.skinny_gemm_set_trace_buffer(buf.data_ptr())
        got = sg.linear(x, w, bias)
    finally:
        _C.skinny_gemm_set_trace_buffer(0)
    assert got is not None, sg.last_error()
    check(got[0], sg.reference(x, w, bias)[0], F.linear(x, w, bias))
    t = buf.view(-1, 6).cpu()
    ran = t[t[:, 0] != 0]
    assert ran.shape[0] == ctas and (t[ctas:] == 0).all()
    assert (ran[:, 0] <= ran[:, 2]).all() and (ran[:, 2] <= ran[:, 3]).all()
    assert (ran[:, 4] < torch.cuda.get_device_properties(0).multi_processor_count).all()
    if "s" in config:  # the TMA kernel stamps its first stage's MMAs
        assert (ran[:, 0] <= ran[:, 1]).all() and (ran[:, 1] <= ran[:, 2]).all()
    again = sg.linear(x, w, bias)  # no buffer: nothing written, same result
    assert again is not None and torch.equal(again[0], got[0])


@pytest.mark.gpu
def test_declines_what_it_does_not_cover():
    cuda_or_skip()
    x, w, _, _ = operands(4, 1001, 64, torch.bfloat16)  # K not a multiple of 8
    assert sg.linear(x, w) is None
    x, w, _, _ = operands(17, 64, 64, torch.bfloat16)
    assert sg.linear(x, w) is None
    x, w, _, _ = operands(4, 64, 64, torch.float32)
    assert sg.linear(x, w) is None


def mlp_block(x, w1, b1, w2, b2):
    return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


def counted(fn, *args):
    fn(*args)
    opfuse.reset_stats()
    before = sg.launch_count()
    out = fn(*args)
    s = opfuse.stats()
    return out, s["library_calls"], s["kernel_launches"], sg.launch_count() - before


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_compiled_graph_takes_the_skinny_path_when_enabled(m, monkeypatch):
    cuda_or_skip()
    monkeypatch.setenv("OPFUSE_SKINNY_GEMM", "1")
    monkeypatch.setenv("OPFUSE_DECODE_MLP", "0")  # else the whole block is one decode MLP kernel on sm_90
    torch.manual_seed(3)
    k, h, n = 512, 1024, 256
    args = [torch.randn(m, k, device="cuda").bfloat16(), (torch.randn(h, k, device="cuda") * k ** -0.5).bfloat16(),
            torch.randn(h, device="cuda").bfloat16(), (torch.randn(n, h, device="cuda") * h ** -0.5).bfloat16(),
            torch.randn(n, device="cuda").bfloat16()]
    f = torch.compile(mlp_block, backend="opfuse")
    out, calls, kernels, skinny = counted(f, *args)
    assert (calls, kernels, skinny) == (0, 2, 2), sg.last_error()
    ref = mlp_block(*[a.double() for a in args])
    check(out, ref, mlp_block(*args))
    monkeypatch.setenv("OPFUSE_SKINNY_GEMM", "0")
    out, calls, kernels, skinny = counted(f, *args)
    assert (calls, kernels, skinny) == (2, 0, 0)
    check(out, ref, mlp_block(*args))
    monkeypatch.delenv("OPFUSE_SKINNY_GEMM")  # the default: cuBLASLt at these shapes (short K)
    out, calls, kernels, skinny = counted(f, *args)
    assert (calls, kernels, skinny) == (2, 0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_by_default_it_takes_the_measured_shapes(m, monkeypatch):
    """Without OPFUSE_SKINNY_GEMM on sm_90: GEMMs with N and K of 4096 to
    16384 (default_takes) run the kernel, both of this block's, the second
    starting before the first ends (programmatic dependent launch); a block
    outside the box stays with cuBLASLt."""
    cuda_or_skip()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the default takes sm_90 shapes only")
    monkeypatch.delenv("OPFUSE_SKINNY_GEMM")
    monkeypatch.setenv("OPFUSE_DECODE_MLP", "0")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def block_args(k, h):
        return [torch.randn(m, k, device="cuda").bfloat16(), (torch.randn(h, k, device="cuda") * k ** -0.5).bfloat16(),
                torch.randn(h, device="cuda").bfloat16(), (torch.randn(k, h, device="cuda") * h ** -0.5).bfloat16(),
                torch.randn(k, device="cuda").bfloat16()]

    torch.manual_seed(5)
    assert _C.skinny_gemm_default_takes(m, 4096, 4096, 90, sms)
    args = block_args(4096, 4096)
    f = torch.compile(mlp_block, backend="opfuse")
    out, calls, kernels, skinny = counted(f, *args)
    assert (calls, kernels, skinny) == (0, 2, 2), sg.last_error()
    check(out, mlp_block(*[a.double() for a in args]), mlp_block(*args))
    # The same bits as launches that start only after the kernel before ends.
    for _ in range(3):
        assert torch.equal(f(*args), out)
    monkeypatch.setenv("OPFUSE_SKINNY_PDL", "0")
    assert torch.equal(f(*args), out)
    monkeypatch.delenv("OPFUSE_SKINNY_PDL")
    # Both GEMMs (N = 4096) take a pipelined config; as the p2 ping-pong: the
    # same MMAs in the same order, so the same bits.
    assert _C.skinny_gemm_choose_config(m, 4096, 4096, 90, sms).endswith("p1")
    monkeypatch.setenv("OPFUSE_SKINNY_PIPE", "2")
    before = sg.launch_count()
    assert torch.equal(f(*args), out)
    assert sg.launch_count() == before + 2, sg.last_error()
    monkeypatch.delenv("OPFUSE_SKINNY_PIPE")

    assert not _C.skinny_gemm_default_takes(m, 8192, 1024, 90, sms)  # short K
    assert not _C.skinny_gemm_default_takes(m, 1024, 8192, 90, sms)  # narrow N
    args = block_args(1024, 8192)
    g = torch.compile(mlp_block, backend="opfuse")
    out, calls, kernels, skinny = counted(g, *args)
    assert (calls, kernels, skinny) == (2, 0, 0)
    check(out, mlp_block(*[a.double() for a in args]), mlp_block(*args))


@pytest.mark.gpu
def test_odd_k_in_a_compiled_graph_stays_with_cublaslt():
    cuda_or_skip()
    x, w, bias, _ = operands(8, 1001, 300, torch.float16)
    f = torch.compile(lambda x, w, b: torch.relu(F.linear(x, w, b)), backend="opfuse")
    out, calls, kernels, skinny = counted(f, x, w, bias)
    assert (calls, skinny) == (1, 0)
    check(out, sg.reference(x, w, bias, None, "relu")[0].double(), torch.relu(F.linear(x, w, bias)))


@pytest.mark.gpu
def test_cuda_graph_capture_with_the_skinny_path(monkeypatch):
    cuda_or_skip()
    monkeypatch.setenv("OPFUSE_SKINNY_GEMM", "1")
    monkeypatch.setenv("OPFUSE_DECODE_MLP", "0")  # else the whole block is one decode MLP kernel on sm_90
    torch.manual_seed(4)
    args = [torch.randn(16, 256, device="cuda").bfloat16(), (torch.randn(512, 256, device="cuda") * 0.06).bfloat16(),
            torch.randn(512, device="cuda").bfloat16(), (torch.randn(128, 512, device="cuda") * 0.04).bfloat16(),
            torch.randn(128, device="cuda").bfloat16()]
    out = captured_and_replayed(torch.compile(mlp_block, backend="opfuse"), args, skinny_launches=2)
    check(out, mlp_block(*[a.double() for a in args]), mlp_block(*args))


def captured_and_replayed(f, args, skinny_launches):
    """f's call captured in a CUDA graph (compiled and loaded outside the
    capture; skinny_launches of the skinny GEMM recorded), its output
    zeroed, the graph replayed: the output."""
    f(*args)
    torch.cuda.synchronize()
    before = sg.launch_count()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(*args)
    assert sg.launch_count() == before + skinny_launches
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return out
