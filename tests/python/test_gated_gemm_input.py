"""Llama's gate read by the down projection (src/fusion/gated_gemm_input.cpp,
the skinny GEMM's gated form in src/kernels/skinny_gemm/): with
OPFUSE_GATED_GEMM=1, where the GEMM after the gate kernel takes silu(a) * b
as its A, the skinny GEMM forms the product as it loads A and the gate
kernel is not launched. Off by default (slower on the H200).

Without a GPU: which plans are marked (only a product read by that GEMM
alone, only silu, only on CUDA), every gated instantiation compiles with
NVRTC without spills, and the float64 CPU reference of the gated form
against torch.

On a GPU (marked gpu): the gated kernel against the float64 reference for
every config, rows and K that leave partial tiles; compiled Llama blocks at
M <= 16 run one kernel fewer with the knob where the skinny GEMM takes the down
projection, and the gate kernel without it (counted: library calls, kernel launches, skinny launches),
the weights in either memory order (a pair swaps its results), the same
bits with and without the fold, with OPFUSE_SKINNY_GEMM=0 the gate kernel
and cuBLASLt, and CUDA graph capture."""
import re

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse import _C
from opfuse import skinny_gemm as sg

from conftest import nvrtc_or_skip
from test_gemm import compiled
from test_gemm_pairs import llama_ir
from test_skinny_gemm import captured_and_replayed, check, counted, cuda_or_skip


@pytest.fixture(autouse=True)
def gated_gemm(monkeypatch):
    """The fold is opt-in; read when a graph is compiled."""
    monkeypatch.setenv("OPFUSE_GATED_GEMM", "1")


def gated_lines(ir, target="cuda"):
    text = _C.CompiledGraph(ir, target=target).plan_text()
    return re.findall(r"a=silu\(%\d+\)\*%\d+", text), text


# --- without a GPU -------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 16, 8192])
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_the_down_projection_is_marked(m, dt):
    """The mark is shape-blind: the runtime asks the skinny GEMM per run."""
    marks, text = gated_lines(llama_ir(m=m, dt=dt))
    assert len(marks) == 1, text
    gemms = [line for line in text.splitlines() if " gemm " in line]
    assert "a=silu(" in gemms[-1] and all("a=silu(" not in line for line in gemms[:-1]), text
    # The plan keeps the gate kernel: where the skinny GEMM declines, it runs.
    assert _C.CompiledGraph(llama_ir(m=m, dt=dt), target="cuda").num_kernels == 1


def test_not_marked_where_it_would_change_anything():
    assert gated_lines(llama_ir(out_h=True))[0] == []  # the product is an output: it must be written
    assert gated_lines(llama_ir(gate="relu"))[0] == []  # only silu's product
    assert gated_lines(llama_ir(gate="gelu"))[0] == []
    assert gated_lines(llama_ir(dt="f32"))[0] == []  # 16-bit only (the skinny GEMM's types)
    assert gated_lines(llama_ir(), target="cpu")[0] == []  # PyTorch runs the CPU's GEMMs


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("elem", ["bf16", "f16"])
def test_every_gated_instantiation_compiles_without_spills(arch, elem):
    nvrtc_or_skip()
    # The 128-row rivals (n16, not chosen, at ~250 registers ungated) spill gated: left out;
    # so is the TMA kernel (configs n..w..s..c..), which has no gated form.
    register_tags = [t for t in _C.skinny_gemm_candidates(arch) if re.fullmatch(r"n\d+u\d+w\d+b\d+c\d+(p\d+)?", t)]
    for tag in [t for t in register_tags if not t.startswith("n16")]:
        cubin, log = _C.skinny_gemm_compile(elem, tag + "g1", arch)
        assert len(cubin) > 0
        assert re.search(r"(\d+) bytes spill stores", log).group(1) == "0", f"{tag}g1 sm_{arch}:\n{log}"
        regs = int(re.search(r"Used (\d+) registers", log).group(1))
        warps, blocks = (int(x) for x in re.match(r"n\d+u\d+w(\d+)b(\d+)c\d+", tag).groups())
        assert regs * warps * 32 * blocks <= 65536, f"{tag}g1: {regs} registers miss __launch_bounds__"


def test_gate_is_not_a_tuning_tag():
    assert _C.skinny_gemm_choose_config(16, 4096, 11008, 90, 132) == "n8u1w8b1c2p1"
    with pytest.raises(Exception, match="out of range"):
        _C.skinny_gemm_compile("bf16", "n8u1w8b2c1g2", 90)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_reference_against_torch_float64(dtype):
    torch.manual_seed(0)
    g = torch.randn(5, 48).to(dtype)
    up_storage = torch.randn(5, 56).to(dtype)
    up = up_storage[:, 8:]  # a row stride of its own
    w = (torch.randn(13, 48) * 0.2).to(dtype)
    out, _ = sg.reference(g, w, up=up)
    a = (F.silu(g.double()) * up.double()).to(dtype).double()  # the product rounded once
    torch.testing.assert_close(out, (a @ w.double().T).to(dtype).double(), rtol=0, atol=0)


# --- on a GPU ------------------------------------------------------------------

def gated_operands(m, k, n, dtype, seed):
    torch.manual_seed(seed)
    g = torch.randn(m, k, device="cuda").to(dtype)
    up = torch.randn(m, k + 16, device="cuda").to(dtype)[:, 16:]  # offset 32 bytes, row stride k + 16
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(dtype)
    return g, up, w


def eager_gated(g, up, w):
    return F.linear(F.silu(g) * up, w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 4096), (5, 1000), (16, 4104), (16, 11008)])
def test_gated_kernel_against_reference_and_eager(m, k, dtype, monkeypatch):
    cuda_or_skip()
    monkeypatch.setenv("OPFUSE_SKINNY_GEMM", "1")
    g, up, w = gated_operands(m, k, 1001, dtype, seed=m + k)
    before = sg.launch_count()
    got = sg.linear(g, w, up=up)
    assert got is not None, sg.last_error()
    assert sg.launch_count() == before + 1
    check(got[0], sg.reference(g, w, up=up)[0], eager_gated(g, up, w))
    # An `up` of another shape or type, or misaligned: declined, nothing launched.
    for bad in (up[:, :-8], up.float(), torch.randn(m, k + 1, device="cuda").to(dtype)[:, 1:]):
        assert sg.linear(g, w, up=bad) is None
    assert sg.launch_count() == before + 1


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["n8u1w8b2c1", "n8u1w8b2c2", "n8u1w8b1c2p1", "n8u1w8b1c4p1", "n4u2w8b1c1",
                                    "n8u1w8b2c1p1", "n8u1w8b1c2p2"])
def test_every_gated_config_on_the_device(config, monkeypatch):
    cuda_or_skip()
    if config[-2:] != "c1" and "c1p" not in config and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need sm_90")
    monkeypatch.setenv("OPFUSE_SKINNY_GEMM", "1")
    monkeypatch.setenv("OPFUSE_SKINNY_CONFIG", config)
    for m, k, n in [(16, 4104, 1001), (3, 1000, 200), (16, 8, 64), (1, 16384, 136)]:
        g, up, w = gated_operands(m, k, n, torch.bfloat16, seed=k)
        got = sg.linear(g, w, up=up)
        assert got is not None, sg.last_error()
        check(got[0], sg.reference(g, w, up=up)[0], eager_gated(g, up, w))


def llama(x, w1, w3, w2):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def llama_args(m, k, h, dtype, w3_first=False):
    def weight(rows, cols):
        return (torch.randn(rows, cols, device="cuda") * cols ** -0.5).to(dtype)
    if w3_first:  # the allocation order decides which weight lies lower: the pair swaps its results
        w3 = weight(h, k)
        w1 = weight(h, k)
    else:
        w1 = weight(h, k)
        w3 = weight(h, k)
    return [torch.randn(m, k, device="cuda").to(dtype), w1, w3, weight(k, h)]


def reference_and_eager(args):
    return llama(*[a.double() for a in args]), llama(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,m,w3_first", [(torch.bfloat16, 16, False), (torch.bfloat16, 16, True),
                                              (torch.bfloat16, 5, False), (torch.float16, 1, True)])
def test_the_down_projection_reads_the_gate(dtype, m, w3_first, monkeypatch):
    """sm_90, the down projection in the skinny GEMM's default box (N = K =
    4096): the gate and up projections run as one cuBLASLt pair (K = 512
    is outside the box), then one skinny GEMM reading both results; no
    generated kernel runs. Without OPFUSE_GATED_GEMM the gate kernel runs
    before the skinny GEMM."""
    cuda_or_skip()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the default takes sm_90 shapes only")
    monkeypatch.delenv("OPFUSE_SKINNY_GEMM", raising=False)
    monkeypatch.setenv("OPFUSE_DECODE_MLP", "0")
    torch.manual_seed(7)
    args = llama_args(m, 512, 4096, dtype, w3_first)
    x, w1, w3, w2 = args
    args = [x, w1, w3, torch.randn(4096, 4096, device="cuda").to(dtype) * 4096 ** -0.5]
    f = compiled(llama)
    out, calls, kernels, skinny = counted(f, *args)
    assert (calls, kernels, skinny) == (1, 1, 1), sg.last_error()
    ref, eager = reference_and_eager(args)
    check(out, ref, eager)
    for _ in range(3):  # deterministic, and the same with the previous step's results fresh
        assert torch.equal(f(*args), out)

    # OPFUSE_SKINNY_GEMM=0: the gate kernel and cuBLASLt, as planned.
    monkeypatch.setenv("OPFUSE_SKINNY_GEMM", "0")
    out0, calls, kernels, skinny = counted(f, *args)
    assert (calls, kernels, skinny) == (2, 1, 0)
    check(out0, ref, eager)

    # The default (knob unset when compiled): the gate kernel, then the skinny GEMM.
    monkeypatch.delenv("OPFUSE_SKINNY_GEMM")
    monkeypatch.delenv("OPFUSE_GATED_GEMM")
    torch._dynamo.reset()
    out1, calls, kernels, skinny = counted(compiled(llama), *args)
    assert (calls, kernels, skinny) == (1, 2, 1)
    check(out1, ref, eager)


def skinny_pair_launches():
    """Skinny launches of Llama's gate and up projections at M <= 16: one
    launch of the TMA kernel for both on sm_90, else one each."""
    return 1 if torch.cuda.get_device_capability()[0] >= 9 else 2


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,h,counts", [(16, 72, 136, None), (17, 64, 88, (2, 1, 0))])
def test_every_gemm_skinny_with_the_gate_read_in(m, k, h, counts, monkeypatch):
    """OPFUSE_SKINNY_GEMM=1 at small sizes: at 16 rows the gate and up
    projections as skinny GEMMs (one launch of the TMA kernel for both on
    sm_90, the split pair: OPFUSE_GATED_GEMM=1 leaves the gate to the down
    projection), the down projection one more reading the gate; at 17 rows
    no skinny GEMM: the pair, the gate kernel and cuBLASLt. counts:
    (library calls, kernel launches, skinny launches)."""
    cuda_or_skip()
    monkeypatch.setenv("OPFUSE_SKINNY_GEMM", "1")
    monkeypatch.setenv("OPFUSE_DECODE_MLP", "0")
    if counts is None:
        counts = (0, skinny_pair_launches() + 1, skinny_pair_launches() + 1)
    torch.manual_seed(m)
    args = llama_args(m, k, h, torch.bfloat16)
    out, calls, kernels, skinny = counted(compiled(llama), *args)
    assert (calls, kernels, skinny) == counts, sg.last_error()
    check(out, *reference_and_eager(args))


@pytest.mark.gpu
def test_cuda_graph_capture_with_the_gate_read_in(monkeypatch):
    cuda_or_skip()
    monkeypatch.setenv("OPFUSE_SKINNY_GEMM", "1")
    monkeypatch.setenv("OPFUSE_DECODE_MLP", "0")
    torch.manual_seed(10)
    args = llama_args(16, 64, 96, torch.bfloat16)
    out = captured_and_replayed(compiled(llama), args, skinny_launches=skinny_pair_launches() + 1)
    check(out, *reference_and_eager(args))
