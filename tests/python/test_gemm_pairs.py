"""GEMM pairs: two GEMMs of one A and two same-shaped B (Llama's gate and up
projections) run as one strided-batched cuBLASLt
call, A's batch stride 0, B's the distance between the weights, the two
results allocated as one block. Which steps pair is checked on the plan
(no GPU); values against float64, the weights in either memory order, and
the library-call count on the GPU. By default pairs run as one call up to 64
rows of A; OPFUSE_GEMM_PAIRS=1 at any size (the tests below), =0 never."""
import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse import _C

from test_gemm import assert_gemm_close, compiled, randn, run_counted

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def llama_ir(m=16, k=64, h=88, dt="bf16", out_gate=False, bias=False, gate="silu", out_h=False):
    """Llama's MLP as the converter writes it (F.linear layers); out_gate also
    returns the gate GEMM's result, out_h the gated product; bias adds a bias
    to the up projection; gate: the gate projection's activation."""
    lines = []

    def node(text):
        lines.append(f"%{len(lines)} = {text}")
        return f"%{len(lines) - 1}"

    x = node(f'input() {{name="x"}} : {dt}[{m}, {k}]')
    w1 = node(f'input() {{name="w1"}} : {dt}[{h}, {k}]')
    w3 = node(f'input() {{name="w3"}} : {dt}[{h}, {k}]')
    w2 = node(f'input() {{name="w2"}} : {dt}[{k}, {h}]')
    b3 = node(f'input() {{name="b3"}} : {dt}[{h}]') if bias else None
    g = node(f"matmul({x}, {node(f'permute({w1}) {{dims=[1, 0]}} : {dt}[{k}, {h}]')}) : {dt}[{m}, {h}]")
    act = node(f"{gate}({g}) : {dt}[{m}, {h}]")
    up = node(f"matmul({x}, {node(f'permute({w3}) {{dims=[1, 0]}} : {dt}[{k}, {h}]')}) : {dt}[{m}, {h}]")
    if bias:
        up = node(f"add({up}, {b3}) : {dt}[{m}, {h}]")
    prod = node(f"mul({act}, {up}) : {dt}[{m}, {h}]")
    out = node(f"matmul({prod}, {node(f'permute({w2}) {{dims=[1, 0]}} : {dt}[{h}, {k}]')}) : {dt}[{m}, {k}]")
    outs = f"{out}, {g}" if out_gate else f"{out}, {prod}" if out_h else out
    return "graph {\n  " + "\n  ".join(lines) + f"\n  return ({outs})\n}}"


def pairs_of(ir, monkeypatch, on=True):
    monkeypatch.setenv("OPFUSE_GEMM_PAIRS", "1" if on else "0")
    return _C.CompiledGraph(ir, target="cuda").gemm_pairs()


def test_gate_and_up_projections_pair(monkeypatch):
    cg_pairs = pairs_of(llama_ir(), monkeypatch)
    assert cg_pairs == [(0, 1)]
    monkeypatch.setenv("OPFUSE_GEMM_PAIRS", "1")
    cg = _C.CompiledGraph(llama_ir(), target="cuda")
    first, second = cg.paired_buffers()[0]
    gemms = cg.gemms()
    assert (first, second) == (gemms[0]["out"], gemms[1]["out"])
    assert gemms[0]["a"][0] == gemms[1]["a"][0] and gemms[0]["b"][0] != gemms[1]["b"][0]


def test_pairs_are_on_by_default(monkeypatch):
    monkeypatch.delenv("OPFUSE_GEMM_PAIRS", raising=False)
    assert _C.CompiledGraph(llama_ir(), target="cuda").gemm_pairs() == [(0, 1)]


def test_no_pair_when_off_on_the_cpu_or_unlike(monkeypatch):
    assert pairs_of(llama_ir(), monkeypatch, on=False) == []
    monkeypatch.setenv("OPFUSE_GEMM_PAIRS", "1")
    assert _C.CompiledGraph(llama_ir(), target="cpu").gemm_pairs() == []
    # A result the caller sees is not scratch: it cannot share a block.
    assert pairs_of(llama_ir(out_gate=True), monkeypatch) == []
    # A bias on one of the two (a per-call operand), and B of different shapes.
    assert pairs_of(llama_ir(bias=True), monkeypatch) == []
    unlike = """graph {
  %0 = input() {name="x"} : bf16[16, 64]
  %1 = input() {name="w1"} : bf16[88, 64]
  %2 = input() {name="w3"} : bf16[96, 64]
  %3 = permute(%1) {dims=[1, 0]} : bf16[64, 88]
  %4 = matmul(%0, %3) : bf16[16, 88]
  %5 = permute(%2) {dims=[1, 0]} : bf16[64, 96]
  %6 = matmul(%0, %5) : bf16[16, 96]
  %7 = sum(%4) {dims=[1], keepdim=false} : bf16[16]
  %8 = sum(%6) {dims=[1], keepdim=false} : bf16[16]
  %9 = add(%7, %8) : bf16[16]
  return (%9)
}"""
    assert len(_C.CompiledGraph(unlike, target="cuda").gemms()) == 2
    assert pairs_of(unlike, monkeypatch) == []


def test_pair_gate_marked_where_only_the_gate_reads_the_pair(monkeypatch):
    """The pair's launch may form Llama's gate itself (the skinny GEMM's
    gated pair) where the two results are exactly silu(one) * other and
    nothing else reads them; not where a result or the gate's input is an
    output, where the gate is not silu, or with OPFUSE_GATED_PAIR=0."""
    monkeypatch.delenv("OPFUSE_GEMM_PAIRS", raising=False)
    monkeypatch.delenv("OPFUSE_GATED_PAIR", raising=False)
    monkeypatch.delenv("OPFUSE_GATED_GEMM", raising=False)
    cg = _C.CompiledGraph(llama_ir(), target="cuda")
    gemms = cg.gemms()
    [(first, kernel, h, first_is_gate)] = cg.pair_gates()
    assert (first, kernel, first_is_gate) == (0, 0, True)
    assert h == gemms[2]["a"][0]  # the down projection reads what the pair would write
    for ir in (llama_ir(out_gate=True), llama_ir(out_h=True), llama_ir(gate="relu"), llama_ir(bias=True)):
        assert _C.CompiledGraph(ir, target="cuda").pair_gates() == []
    assert _C.CompiledGraph(llama_ir(), target="cpu").pair_gates() == []
    monkeypatch.setenv("OPFUSE_GATED_PAIR", "0")
    assert _C.CompiledGraph(llama_ir(), target="cuda").pair_gates() == []
    # Opting in to the down projection reading the gate leaves the gate to it.
    monkeypatch.delenv("OPFUSE_GATED_PAIR")
    monkeypatch.setenv("OPFUSE_GATED_GEMM", "1")
    assert _C.CompiledGraph(llama_ir(), target="cuda").pair_gates() == []


@pytest.mark.parametrize("n,tag", [(11008, "n7w3s8c1xg"), (16384, "n8w4s5c1xg"), (4104, "n2w4s12c1xg"), (13, "n1w3s12c1xg")])
def test_gated_pair_config_is_one_wave(n, tag):
    """H = BN / 2 columns of h a CTA, at most one CTA an SM: Llama's N =
    11008 on 132 SMs takes 84 columns (168 rows of a box), 132 CTAs."""
    assert _C.skinny_gemm_choose_gated_pair_config(16, n, 4096, 132) == tag
    cfg = tag.split("w")
    rows = 8 * int(cfg[0][1:]) * int(cfg[1].split("s")[0])
    assert -(-n // (rows // 2)) <= 132 or rows == 256


@pytest.mark.parametrize("tbps,tag", [(0.0, "n7w3s8c1xg"), (4.8, "n7w3s8c1xg"), (3.35, "n7w3s6c1xg"), (2.0, "n7w3s4c1xg"),
                                      (9.0, "n7w3s8c1xg")])
def test_gated_pair_stages_follow_the_dram_bandwidth(tbps, tag):
    """At most 1.7 stages per TB/s of peak DRAM bandwidth (bytes in flight
    cover bandwidth x latency; more cost on the H100), at least 4, at most
    what shared memory holds: the H200 keeps s8, the H100 takes s6."""
    assert _C.skinny_gemm_choose_gated_pair_config(16, 11008, 4096, 132, tbps) == tag


PAIR_CASES = [(torch.bfloat16, m, k, h, w3_first) for m, k, h in [(1, 64, 88), (5, 72, 136), (16, 4096, 1000), (67, 29, 37)]
              for w3_first in (False, True)] + [(torch.float16, 16, 72, 136, True), (torch.float32, 5, 29, 37, False)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,m,k,h,w3_first", PAIR_CASES,
                         ids=[f"{str(c[0])[6:]}-{c[1]}x{c[2]}x{c[3]}-{'w3first' if c[4] else 'w1first'}" for c in PAIR_CASES])
def test_llama_mlp_pair_values_and_calls(dtype, m, k, h, w3_first, monkeypatch):
    monkeypatch.setenv("OPFUSE_GEMM_PAIRS", "1")
    dev = "cuda"
    # The allocation order decides which weight lies lower in memory: both orders
    # (the second swaps the two result halves instead of a negative stride).
    if w3_first:
        w3 = randn(h, k, dtype=dtype, device=dev, scale=k ** -0.5)
        w1 = randn(h, k, dtype=dtype, device=dev, scale=k ** -0.5)
    else:
        w1 = randn(h, k, dtype=dtype, device=dev, scale=k ** -0.5)
        w3 = randn(h, k, dtype=dtype, device=dev, scale=k ** -0.5)
    args = [randn(m, k, dtype=dtype, device=dev), w1, w3, randn(k, h, dtype=dtype, device=dev, scale=h ** -0.5)]

    def llama(x, w1, w3, w2):
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    out, calls, kernels = run_counted(compiled(llama), *args)
    assert_gemm_close(out, llama, args)
    assert (calls, kernels) == (2, 1)


@pytest.mark.gpu
@needs_cuda
def test_pair_with_batched_x_and_a_transposed_view(monkeypatch):
    """x of [batch, seq, k] (reshaped to a matrix in the graph) and weights
    given as transposed views of [k, h] buffers."""
    monkeypatch.setenv("OPFUSE_GEMM_PAIRS", "1")
    dev, dt, k, h = "cuda", torch.bfloat16, 40, 56
    x = randn(3, 7, k, dtype=dt, device=dev)
    w1 = randn(k, h, dtype=dt, device=dev, scale=k ** -0.5).t()
    w3 = randn(k, h, dtype=dt, device=dev, scale=k ** -0.5).t()
    w2 = randn(k, h, dtype=dt, device=dev, scale=h ** -0.5)

    def llama(x, w1, w3, w2):
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    out, calls, kernels = run_counted(compiled(llama), x, w1, w3, w2)
    assert_gemm_close(out, llama, [x, w1, w3, w2])
    assert calls == 2


@pytest.mark.gpu
@needs_cuda
def test_pair_forward_and_backward(monkeypatch):
    monkeypatch.setenv("OPFUSE_GEMM_PAIRS", "1")
    dev, dt, m, k, h = "cuda", torch.float32, 24, 48, 72
    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, dtype=torch.float64) * scale).requires_grad_()
    ref = [leaf(m, k), leaf(h, k, scale=k ** -0.5), leaf(h, k, scale=k ** -0.5), leaf(k, h, scale=h ** -0.5)]
    mine = [r.detach().to(dt).requires_grad_() for r in ref]

    def llama(x, w1, w3, w2):
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    grad = torch.randn(m, k, device=dev, dtype=torch.float64)
    compiled(llama)(*mine).backward(grad.to(dt))
    llama(*ref).backward(grad)
    for a, r in zip(mine, ref):
        torch.testing.assert_close(a.grad.double(), r.grad, rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m,calls", [(16, 2), (64, 2), (65, 3)])
def test_default_pairs_decode_shapes_only(m, calls, monkeypatch):
    monkeypatch.delenv("OPFUSE_GEMM_PAIRS", raising=False)
    dev, dt, k, h = "cuda", torch.bfloat16, 64, 88
    args = [randn(m, k, dtype=dt, device=dev), randn(h, k, dtype=dt, device=dev, scale=k ** -0.5),
            randn(h, k, dtype=dt, device=dev, scale=k ** -0.5), randn(k, h, dtype=dt, device=dev, scale=h ** -0.5)]

    def llama(x, w1, w3, w2):
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    out, got, kernels = run_counted(compiled(llama), *args)
    assert_gemm_close(out, llama, args)
    assert (got, kernels) == (calls, 1)


def test_views_of_one_activation_pair(monkeypatch):
    """The backend passes each x.view(...) of a 3-D activation as its own
    partition input: the plan pairs them (the run compares their pointers)."""
    ir = """graph {
  %0 = input() {name="w1"} : bf16[56, 40]
  %1 = permute(%0) {dims=[1, 0]} : bf16[40, 56]
  %2 = input() {name="w3"} : bf16[56, 40]
  %3 = permute(%2) {dims=[1, 0]} : bf16[40, 56]
  %4 = input() {name="view"} : bf16[21, 40]
  %5 = matmul(%4, %1) : bf16[21, 56]
  %6 = input() {name="view_2"} : bf16[21, 40]
  %7 = matmul(%6, %3) : bf16[21, 56]
  %8 = mul(%5, %7) : bf16[21, 56]
  return (%8)
}"""
    assert pairs_of(ir, monkeypatch) == [(0, 1)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("w3_first", [False, True])
@pytest.mark.parametrize("way", ["default", "n6w4s7c1xg", "m1", "f16", "split", "n2w4s12c2x2", "n6w4s7c1x2", "off"])
def test_decode_pair_in_one_skinny_launch(w3_first, way, monkeypatch):
    """On sm_90 a decode-shaped pair inside the skinny GEMM's default box
    runs as one launch of its TMA kernel, the weights in either memory
    order. By default that launch also forms Llama's gate (the gated pair,
    "...xg": the chooser's 64-row boxes, forced 192-row ones; M = 1;
    float16), then the plain down projection: no library call, no generated
    kernel, two skinny launches a call. With OPFUSE_GATED_PAIR=0 ("split"
    and the forced "...x2": a cluster splitting K, 192-row tiles) the pair
    writes both results and the gate kernel runs between the two launches.
    OPFUSE_SKINNY_TMA=0 ("off"): the cuBLASLt pair instead."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernel needs sm_90")
    from opfuse import skinny_gemm as sg
    monkeypatch.delenv("OPFUSE_GEMM_PAIRS", raising=False)
    monkeypatch.delenv("OPFUSE_SKINNY_GEMM", raising=False)
    monkeypatch.setenv("OPFUSE_SKINNY_TMA", "0" if way == "off" else "1")
    gated = way in ("default", "n6w4s7c1xg", "m1", "f16")
    monkeypatch.setenv("OPFUSE_GATED_PAIR", "1" if gated else "0")
    monkeypatch.delenv("OPFUSE_GATED_GEMM", raising=False)
    if way.endswith(("x2", "xg")):  # forced on the down projection too
        monkeypatch.setenv("OPFUSE_SKINNY_CONFIG", way)
    else:
        monkeypatch.delenv("OPFUSE_SKINNY_CONFIG", raising=False)
    torch.manual_seed(11)
    dev, dt, m, k, h = "cuda", torch.bfloat16, 13, 4160, 4104  # tails in K and in each weight's rows
    if way == "m1":
        m = 1
    if way == "f16":
        dt = torch.float16
    x = randn(m, k, dtype=dt, device=dev)
    first = randn(h, k, dtype=dt, device=dev, scale=k ** -0.5)
    other = randn(h, k, dtype=dt, device=dev, scale=k ** -0.5)
    w1, w3 = (other, first) if w3_first else (first, other)
    w2 = randn(k, h, dtype=dt, device=dev, scale=h ** -0.5)
    args = [x, w1, w3, w2]

    def llama(x, w1, w3, w2):
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    fn = compiled(llama)
    fn(*args)
    before = sg.launch_count()
    out, calls, kernels = run_counted(fn, *args)
    assert_gemm_close(out, llama, args)
    if way == "off":
        assert calls == 1 and sg.launch_count() - before == 2  # the cuBLASLt pair, the skinny down projection
        assert kernels == 2  # the gate kernel and the skinny down projection
    else:
        assert calls == 0 and sg.launch_count() - before == 4, sg.last_error()  # two calls of (pair, down)
        # Gated: the gate kernel folded into the pair's launch (nothing else folds it by default).
        assert kernels == (2 if gated else 3), sg.last_error()
