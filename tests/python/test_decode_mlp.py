"""The decode MLP kernel (src/kernels/decode_mlp/): a whole MLP block at
M <= 16 in one persistent kernel, and the planner's pass that uses it
(src/fusion/decode_mlp.cpp).

- CPU (CI): NVRTC builds every instantiation for sm_90 without spills; with
  the opt-in OPFUSE_DECODE_MLP=1 the CUDA plans of both MLP blocks at M = 16
  are one call of the kernel, at M = 8192 (and without the knob) they are
  unchanged; the float64 CPU reference against PyTorch's float64 math.
- GPU (marked): the kernel against float64 at M in {1, 5, 16} for both
  blocks, with sizes that leave partial tiles and k chunks and biases at odd
  offsets, every config; repeated launches, problems of other shapes and CUDA
  graph replay (the grid barrier and the tile counters reset themselves);
  torch.compile of both blocks at M <= 16 runs one kernel with the knob.

Accuracy: the kernel rounds h once to the element type (as the unfused
graph stores it) and accumulates in float32; the rule is test_gemm's
(close to float64, or at most twice eager's error plus two ulps).
"""
import os
import re

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse import _C, decode_mlp
from opfuse.frontend import runtime

from conftest import nvrtc_or_skip
from test_gemm import check_against_reference, compiled, run_counted

gpu = pytest.mark.gpu


def mlp_block(x, w1, b1, w2, b2):
    return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


def llama_mlp(x, w1, w3, w2):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def make_args(kind, m, k, h, n, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype).to(device)
    x = r(m, k)
    if kind == "mlp":
        return [x, r(h, k, scale=k ** -0.5), r(h), r(n, h, scale=h ** -0.5), r(n)]
    return [x, r(h, k, scale=k ** -0.5), r(h, k, scale=k ** -0.5), r(n, h, scale=h ** -0.5)]


# ---------------------------------------------------------------------------
# CPU: NVRTC builds, plans, the reference
# ---------------------------------------------------------------------------

def test_every_instantiation_compiles_for_sm90_without_spills():
    nvrtc_or_skip()
    for config in decode_mlp.candidates():
        assert _C.decode_mlp_smem_bytes(config) <= 227 * 1024
        for dtype in (torch.bfloat16, torch.float16):
            for gated in (False, True):
                cubin, log = decode_mlp.compile(dtype, gated, config, 90)
                assert len(cubin) > 0
                spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
                assert spills and all(s == ("0", "0") for s in spills), f"{config} {dtype} gated={gated}:\n{log}"


def test_sm80_is_refused():
    with pytest.raises(Exception, match="sm_90"):
        decode_mlp.compile(torch.bfloat16, False, "b64k256s4g1", 80)


def cuda_plan(fn, args, partitions, monkeypatch, decode="1"):
    """fn's partition (traced on the CPU) planned for CUDA with OPFUSE_DECODE_MLP=decode (None: unset)."""
    with torch.no_grad():
        compiled(fn)(*args)
    (text,) = partitions.values()
    if decode is None:
        monkeypatch.delenv("OPFUSE_DECODE_MLP", raising=False)
    else:
        monkeypatch.setenv("OPFUSE_DECODE_MLP", decode)
    cg = _C.CompiledGraph(text, target="cuda")
    return cg


@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_plan_at_m16_is_one_decode_mlp_call(kind, partitions, monkeypatch):
    fn = mlp_block if kind == "mlp" else llama_mlp
    args = make_args(kind, 16, 64, 96, 40, torch.bfloat16, "cpu")
    cg = cuda_plan(fn, args, partitions, monkeypatch)
    text = cg.plan_text()
    assert (cg.num_library_calls, cg.num_kernels) == (1, 0), text
    want = "decode_mlp_relu+bias" if kind == "mlp" else "decode_mlp_silu_gate"
    assert re.findall(r"epilogue=(\S+)", text) == [want], text
    # No buffer for the intermediates: only the inputs and the output.
    assert len(cg.buffers()) == len(args) + 1


@pytest.mark.parametrize("kind", ["mlp", "llama"])
@pytest.mark.parametrize("m,decode", [(8192, "1"), (16, "0"), (16, None)])
def test_plan_unchanged_at_m8192_and_when_off(kind, m, decode, partitions, monkeypatch):
    fn = mlp_block if kind == "mlp" else llama_mlp
    args = make_args(kind, m, 64, 96, 40, torch.bfloat16, "cpu")
    cg = cuda_plan(fn, args, partitions, monkeypatch, decode=decode)
    assert (cg.num_library_calls, cg.num_kernels) == ((2, 0) if kind == "mlp" else (3, 1)), cg.plan_text()
    assert "decode_mlp" not in cg.plan_text()


def scaled_mlp(x, w1, b1, w2, b2):
    """x comes from a generated kernel (as a norm's output would): the block still fuses."""
    return mlp_block(x * 2, w1, b1, w2, b2)


def test_plan_with_x_written_by_a_kernel(partitions, monkeypatch):
    args = make_args("mlp", 16, 64, 96, 40, torch.bfloat16, "cpu")
    cg = cuda_plan(scaled_mlp, args, partitions, monkeypatch)
    assert (cg.num_library_calls, cg.num_kernels) == (1, 1), cg.plan_text()
    assert "decode_mlp_relu" in cg.plan_text()


def test_plan_not_taken_for_unaligned_sizes_or_float32(partitions, monkeypatch):
    # K = 60 is not a multiple of 8: the kernel's bulk copies need 16-byte rows.
    args = make_args("mlp", 16, 60, 96, 40, torch.bfloat16, "cpu")
    cg = cuda_plan(mlp_block, args, partitions, monkeypatch)
    assert cg.num_library_calls == 2 and "decode_mlp" not in cg.plan_text()
    partitions.clear()
    torch._dynamo.reset()
    args = make_args("mlp", 16, 64, 96, 40, torch.float32, "cpu")
    cg = cuda_plan(mlp_block, args, partitions, monkeypatch)
    assert "decode_mlp" not in cg.plan_text()


@pytest.mark.parametrize("kind,act", [("mlp", "relu"), ("mlp", "gelu_tanh"), ("mlp", ""), ("llama", "silu_gate")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_matches_float64_torch(kind, act, dtype):
    m, k, h, n = 5, 24, 40, 16
    args = make_args(kind, m, k, h, n, dtype, "cpu", seed=1)
    d = [a.double() for a in args]
    if kind == "mlp":
        x, w1, b1, w2, b2 = d
        pre = x @ w1.T + b1
        hid = {"relu": torch.relu(pre), "gelu_tanh": F.gelu(pre, approximate="tanh"), "": pre}[act]
        out, hidden = decode_mlp.reference(args[0], args[1], args[3], args[2], args[4], activation=act)
    else:
        x, w1, w3, w2 = d
        hid = F.silu(x @ w1.T) * (x @ w3.T)
        b2 = None
        out, hidden = decode_mlp.reference(args[0], args[1], args[3], activation=act, w3=args[2])
    hid = hid.to(dtype).double()  # h rounded once, as the kernel stores it
    torch.testing.assert_close(hidden, hid, rtol=0, atol=0)
    want = hid @ d[3 if kind == "mlp" else 3].T
    if kind == "mlp":
        want = want + d[4]
    torch.testing.assert_close(out, want.to(dtype).double(), rtol=0, atol=0)


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------

def needs_sm90():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs sm_90")


def run_kernel(kind, args, act="relu"):
    if kind == "mlp":
        x, w1, b1, w2, b2 = args
        return decode_mlp.mlp(x, w1, w2, b1, b2, activation=act)
    x, w1, w3, w2 = args
    return decode_mlp.mlp(x, w1, w2, activation="silu_gate", w3=w3)


def eager(kind, args, act="relu"):
    if kind == "mlp":
        x, w1, b1, w2, b2 = args
        pre = F.linear(x, w1, b1)
        hid = {"relu": torch.relu(pre), "gelu_tanh": F.gelu(pre, approximate="tanh"), "": pre}[act]
        return F.linear(hid, w2, b2)
    return llama_mlp(*args)


def reference64(kind, args, act="relu"):
    d = [a.double() for a in args]
    return eager(kind, d, act)


# Sizes: K not a multiple of the 256-value chunk, H not a multiple of the
# 64-row tile (nor of the gated 32-row tile), N not a multiple of 64.
SHAPES = [(200, 328, 72), (1032, 2056, 520)]


@gpu
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("kind", ["mlp", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_against_float64(m, kind, dtype):
    needs_sm90()
    for k, h, n in SHAPES:
        args = make_args(kind, m, k, h, n, dtype, "cuda", seed=m)
        out = run_kernel(kind, args)
        torch.cuda.synchronize()
        check_against_reference(out, eager(kind, args), reference64(kind, args))


@gpu
@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_every_config_against_float64(kind, monkeypatch):
    needs_sm90()
    for config in decode_mlp.candidates():
        monkeypatch.setenv("OPFUSE_DECODE_MLP_CONFIG", config)
        for m, (k, h, n) in ((16, SHAPES[1]), (3, (2056, 1040, 136))):
            args = make_args(kind, m, k, h, n, torch.bfloat16, "cuda", seed=m)
            out = run_kernel(kind, args)
            check_against_reference(out, eager(kind, args), reference64(kind, args))


@gpu
def test_problems_of_other_shapes_share_the_workspace():
    # Few tiles, then many, then few again: the tile counters live in a fixed
    # region that nothing else writes (a bug once put them over partials).
    needs_sm90()
    small = make_args("mlp", 4, 200, 328, 72, torch.bfloat16, "cuda", seed=7)
    large = make_args("llama", 16, 1032, 4104, 1032, torch.bfloat16, "cuda", seed=8)
    first_small, first_large = run_kernel("mlp", small), run_kernel("llama", large)
    for _ in range(3):
        assert torch.equal(run_kernel("mlp", small), first_small)
        assert torch.equal(run_kernel("llama", large), first_large)
    check_against_reference(first_large, eager("llama", large), reference64("llama", large))


@gpu
def test_two_streams_have_their_own_workspace():
    # One zeroed workspace per (device, stream) from PyTorch's allocator: the
    # blocks launched on two streams with no order between them share no
    # counters, partials or h, and give the serial results bit for bit.
    # (Each launch is cooperative: a grid starts only once all its CTAs fit,
    # so two grids of one CTA per SM cannot each hold half the GPU and wait
    # for the other at their barriers.)
    needs_sm90()
    a = make_args("mlp", 16, 1032, 2056, 520, torch.bfloat16, "cuda", seed=11)
    b = make_args("llama", 16, 1032, 2056, 520, torch.bfloat16, "cuda", seed=12)
    want_a, want_b = run_kernel("mlp", a), run_kernel("llama", b)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for s in (s1, s2):
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(10):
        with torch.cuda.stream(s1):
            outs.append((run_kernel("mlp", a), want_a))
        with torch.cuda.stream(s2):
            outs.append((run_kernel("llama", b), want_b))
    torch.cuda.synchronize()
    for got, want in outs:
        assert torch.equal(got, want)
    dev = torch.cuda.current_device()
    w1, w2 = (runtime.zeroed_workspace(dev, s.cuda_stream) for s in (s1, s2))
    assert w1.data_ptr() != w2.data_ptr() and w1.numel() == _C.zeroed_workspace_bytes()


@gpu
def test_missing_or_small_workspace_is_refused():
    needs_sm90()
    x, w1, b1, w2, b2 = make_args("mlp", 16, 1032, 2056, 520, torch.bfloat16, "cuda")
    out = torch.empty(16, 520, dtype=torch.bfloat16, device="cuda")
    ws = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    call = lambda ptr, size: _C.decode_mlp("bf16", 16, 1032, 2056, 520, x.data_ptr(), x.stride(0), w1.data_ptr(),
                                           w1.stride(0), 0, 0, b1.data_ptr(), 1, w2.data_ptr(), w2.stride(0),
                                           b2.data_ptr(), 1, out.data_ptr(), out.stride(0), "relu", stream, ptr, size)
    before = decode_mlp.launch_count()
    ok, why = call(0, 0)
    assert not ok and "workspace" in why
    ok, why = call(ws.data_ptr(), ws.numel())
    assert not ok and "bytes of workspace" in why
    assert decode_mlp.launch_count() == before


@gpu
@pytest.mark.parametrize("act", ["gelu_tanh", ""])
def test_kernel_other_activations(act):
    needs_sm90()
    args = make_args("mlp", 7, 520, 1040, 200, torch.bfloat16, "cuda", seed=3)
    out = run_kernel("mlp", args, act)
    check_against_reference(out, eager("mlp", args, act), reference64("mlp", args, act))


@gpu
def test_biases_at_odd_offsets_and_strided_rows():
    needs_sm90()
    dtype = torch.bfloat16
    m, k, h, n = 9, 264, 520, 136
    x, w1, b1, w2, b2 = make_args("mlp", m, k, h, n, dtype, "cuda", seed=4)
    s1 = torch.randn(h + 3, device="cuda").to(dtype)
    s2 = torch.randn(2 * n + 1, device="cuda").to(dtype)
    b1o, b2o = s1[3:], s2[1::2]  # 3 elements in; every other element from an odd offset
    xs = torch.randn(m, k + 8, device="cuda").to(dtype)[:, :k]  # row stride k + 8
    args = [xs, w1, b1o, w2, b2o]
    out = run_kernel("mlp", args)
    check_against_reference(out, eager("mlp", args), reference64("mlp", args))


@gpu
@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_repeated_launches_and_graph_replay(kind):
    needs_sm90()
    dtype = torch.bfloat16
    args = make_args(kind, 16, 1032, 2056, 520, dtype, "cuda", seed=5)
    first = run_kernel(kind, args)
    for _ in range(20):  # the barrier's generation and the tile counters carry over launches
        again = run_kernel(kind, args)
        assert torch.equal(again, first)  # deterministic: the same sums in the same order
    check_against_reference(first, eager(kind, args), reference64(kind, args))
    static_out = torch.empty_like(first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_kernel(kind, args)  # warm on the capture stream: the workspace exists before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if kind == "mlp":
            x, w1, b1, w2, b2 = args
            decode_mlp.mlp(x, w1, w2, b1, b2, activation="relu", out=static_out)
        else:
            x, w1, w3, w2 = args
            decode_mlp.mlp(x, w1, w2, activation="silu_gate", w3=w3, out=static_out)
    for i in range(5):
        args[0].copy_(make_args(kind, 16, 1032, 2056, 520, dtype, "cuda", seed=10 + i)[0])
        static_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(static_out, eager(kind, args), reference64(kind, args))
        assert torch.equal(static_out, run_kernel(kind, args))


@gpu
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_torch_compile_runs_one_kernel(m, kind, monkeypatch):
    needs_sm90()
    monkeypatch.setenv("OPFUSE_DECODE_MLP", "1")  # opt-in
    fn = mlp_block if kind == "mlp" else llama_mlp
    args = make_args(kind, m, 264, 520, 136, torch.bfloat16, "cuda", seed=6)
    before = decode_mlp.launch_count()
    out, calls, kernels = run_counted(compiled(fn), *args)
    check_against_reference(out, fn(*args), fn(*[a.double() for a in args]))
    assert (calls, kernels) == (0, 1), decode_mlp.last_error()
    assert decode_mlp.launch_count() - before == 2


@gpu
def test_torch_compile_with_x_written_by_a_kernel(monkeypatch):
    needs_sm90()
    monkeypatch.setenv("OPFUSE_DECODE_MLP", "1")
    args = make_args("mlp", 16, 264, 520, 136, torch.bfloat16, "cuda", seed=9)
    out, calls, kernels = run_counted(compiled(scaled_mlp), *args)
    check_against_reference(out, scaled_mlp(*args), scaled_mlp(*[a.double() for a in args]))
    assert (calls, kernels) == (0, 2), decode_mlp.last_error()


@gpu
def test_refused_problem_says_why():
    needs_sm90()
    x, w1, b1, w2, b2 = make_args("mlp", 17, 64, 64, 64, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="1..16"):
        decode_mlp.mlp(x, w1, w2, b1, b2)
