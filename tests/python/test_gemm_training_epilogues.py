"""GEMM epilogues of training and autocast graphs: the gelu backward on the
call that computes its gradient input (cuBLASLt's DGELU / DGELU_BGRAD,
reading the gelu input the forward's GELU_AUX saved), and autocast's float32
biases and bias gradients read and written by 16-bit calls (BIAS_DATA_TYPE).

Two kinds of test:
- Plans (run anywhere): the graphs torch.compile hands to opfuse on this
  machine, planned again for CUDA, must use those epilogues. The GPU tests'
  launch counts are these plans' counts.
- GPU runs (skipped without CUDA): values against eager and a float64
  reference (test_gemm's rule), and the launches counted by opfuse.stats().
  A count that is off with a log line "cuBLASLt ..." in the failure message
  means cuBLASLt refused an epilogue at run time and the partition fell back
  (to a plan with fewer epilogues): the answer is still right, the fusion is
  not there on that cuBLASLt.
"""
import logging
import re

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse import _C

from test_gemm import check_against_reference, compiled, randn, run_counted

gpu = pytest.mark.gpu


def needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


class CudaPlan:
    """A partition planned for CUDA (no GPU needed to plan), at level 2
    (float32 biases read by the call; opt-in, since cuBLASLt refuses them on
    the H200: the GPU tests check the default level)."""

    def __init__(self, ir_text, level=2):
        self.cg = _C.CompiledGraph(ir_text, target="cuda", gemm_epilogues=level)
        self.text = self.cg.plan_text()
        self.calls = self.cg.num_library_calls
        self.kernels = self.cg.num_kernels
        self.epilogues = re.findall(r"epilogue=(\S+)", self.text)
        buffers = self.cg.buffers()
        gemms = self.cg.gemms([7] * len(self.cg.symbols()))
        # dtype of the bias each call reads, or of the bias gradient it writes
        self.bias_dtypes = [buffers[g["bias"]][1] if g["bias"] >= 0 else None for g in gemms]
        self.bias_grad_dtypes = [buffers[g["bias_grad"]][1] if g["bias_grad"] >= 0 else None for g in gemms]
        # ops of each generated kernel
        self.kernel_ops = [k["ops"] for k in self.cg.kernels()]

    def __repr__(self):
        return self.text


def gelu_mlp(hidden, dtype=torch.bfloat16, device="cpu", seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, hidden), torch.nn.GELU(approximate="tanh"),
                               torch.nn.Linear(hidden, 16)).to(device=device, dtype=dtype)


def relu_mlp(device="cpu", seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).to(device)


# -- the gelu_backward op itself (now one IR op, not a decomposition) -------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_backward_is_one_kernel_with_pytorchs_values(dtype, approximate, device):
    def f(g, x):
        return torch.ops.aten.gelu_backward(g, x, approximate=approximate)
    g, x = randn(37, 50, dtype=dtype, device=device), randn(37, 50, dtype=dtype, device=device, scale=3)
    out, calls, kernels = run_counted(compiled(f), g, x)
    assert (calls, kernels) == (0, 1)
    ref = f(g.double(), x.double())
    check_against_reference(out, f(g, x), ref)


def test_gelu_backward_compiles_for_the_gpu():
    # NVRTC needs no GPU: the CUDA prelude's opf_gelu_*_backward for half and
    # double values, in the vectorized and the scalar kernel.
    try:
        _C.nvrtc_version()
    except Exception as e:
        pytest.skip(f"NVRTC not available: {e}")
    ir = """graph {
  %0 = input() {name="g"} : bf16[s0, 64]
  %1 = input() {name="x"} : bf16[s0, 64]
  %2 = gelu_backward(%0, %1) {approximate="tanh"} : bf16[s0, 64]
  %3 = gelu_backward(%0, %1) {approximate="none"} : bf16[s0, 64]
  %4 = input() {name="y"} : f64[s0, 64]
  %5 = gelu_backward(%4, %4) {approximate="tanh"} : f64[s0, 64]
  %6 = gelu_backward(%4, %4) {approximate="none"} : f64[s0, 64]
  return (%2, %3, %5, %6)
}"""
    cg = _C.CompiledGraph(ir, target="cuda")
    for arch in (80, 90):
        cubin, _, log = cg.compile_cuda([[8, 64]] * 3, [[64, 1]] * 3, arch, False)
        assert len(cubin) > 0, log


# -- plans of the graphs torch.compile gives (no GPU needed) -----------------

@pytest.mark.parametrize("hidden", [64, 36])
def test_plan_bf16_gelu_mlp_training(hidden, partitions):
    model = gelu_mlp(hidden)
    x = randn(40, 24, dtype=torch.bfloat16).requires_grad_()
    compiled(model)(x).sum().backward()
    fw, bw = CudaPlan(partitions["forward_fused_0"]), CudaPlan(partitions["backward_fused_0"])
    if hidden == 64:
        assert fw.epilogues == ["bias+gelu_tanh+aux", "bias"], fw
        assert (fw.calls, fw.kernels) == (2, 0), fw
        # dh = g @ w2 carries the gelu backward and b1's gradient; dW2 =
        # g^T @ h carries b2's gradient (sum of g); dx and dW1 are plain.
        # Nothing else: the backward is four library calls.
        assert sorted(bw.epilogues) == sorted(["dgelu_tanh+bias_grad", "bias_grad", "none", "none"]), bw
        assert (bw.calls, bw.kernels) == (4, 0), bw
    else:
        # 36 is no multiple of 8 (cuBLASLt's aux leading dimension): the gelu
        # and its backward are kernels, planned so (no run-time refusal);
        # both bias gradients ride on the weight-gradient calls.
        assert fw.epilogues == ["bias", "bias"], fw
        assert (fw.calls, fw.kernels) == (2, 1), fw
        assert sorted(bw.epilogues) == sorted(["bias_grad", "bias_grad", "none", "none"]), bw
        assert (bw.calls, bw.kernels) == (4, 1), bw
        assert bw.kernel_ops == [["gelu_backward"]], bw


def test_plan_autocast_mlp_inference(partitions):
    model = relu_mlp()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(model)(randn(40, 24))
    p = CudaPlan(partitions["inference_fused_0"])
    # The bfloat16 block's two calls with the same epilogues, reading the
    # float32 biases; the kernels are the casts of the GEMM operands that
    # autocast asks for (w1, x, w2), none for a bias.
    assert p.epilogues == ["bias+relu", "bias"], p
    assert p.bias_dtypes == ["f32", "f32"], p
    assert (p.calls, p.kernels) == (2, 3), p
    assert all(ops == ["cast"] for ops in p.kernel_ops), p


def test_plan_autocast_gelu_mlp_training(partitions):
    model = gelu_mlp(64, dtype=torch.float32)
    x = randn(40, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(model)(x)
    out.float().sum().backward()
    fw, bw = CudaPlan(partitions["forward_fused_0"]), CudaPlan(partitions["backward_fused_0"])
    assert fw.epilogues == ["bias+gelu_tanh+aux", "bias"], fw
    assert fw.bias_dtypes == ["f32", "f32"], fw
    assert (fw.calls, fw.kernels) == (2, 3), fw  # casts of w1, x, w2 (w2's stored transposed for the backward)
    # The backward's calls write the float32 gradients of b1 (with the gelu
    # backward) and of b2 (with dW2) themselves.
    assert sorted(zip(bw.epilogues, map(str, bw.bias_grad_dtypes))) == \
        [("bias_grad", "f32"), ("dgelu_tanh+bias_grad", "f32"), ("none", "None")], bw
    # Kernels: the weight gradients' casts to float32 (a GEMM writes its
    # own dtype); x needs no gradient.
    assert (bw.calls, bw.kernels) == (3, 2), bw
    assert all("cast" in ops for ops in bw.kernel_ops), bw


def test_fewer_epilogue_levels_are_what_the_fallback_builds(partitions):
    # The run-time fallback (runtime.FusedPartition._gemm_fallback) plans
    # again at level 1 (no float32 biases) then 0 (none): what those plans are.
    model = relu_mlp()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(model)(randn(40, 24))
    text = partitions["inference_fused_0"]
    counts = []
    for level in (2, 1, 0):
        cg = _C.CompiledGraph(text, target="cuda", gemm_epilogues=level)
        counts.append((cg.num_library_calls, cg.num_kernels, re.findall(r"epilogue=(\S+)", cg.plan_text())))
    assert counts == [(2, 3, ["bias+relu", "bias"]), (2, 5, ["none", "none"]), (2, 5, ["none", "none"])]


def test_refused_epilogues_fall_back_one_level_at_a_time(partitions, monkeypatch):
    # runtime.FusedPartition._gemm_fallback without a GPU: what each refusal
    # builds (the partitions are not run: __call__ reports their level).
    from opfuse.frontend.runtime import FusedPartition

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(relu_mlp())(randn(40, 24))
    autocast_text = partitions.pop("inference_fused_0")
    torch._dynamo.reset()
    with torch.no_grad():
        compiled(relu_mlp().to(torch.bfloat16))(randn(40, 24, dtype=torch.bfloat16))
    bf16_text = partitions["inference_fused_0"]
    monkeypatch.setattr(FusedPartition, "__call__", lambda self, *args: self.gemm_epilogues)
    eager = torch.fx.symbolic_trace(torch.nn.Identity())

    def partition(text):
        return FusedPartition(_C.CompiledGraph(text, target="cuda", gemm_epilogues=2), eager, [], [], "p", device="cuda",
                              ir_text=text, gemm_epilogues=2)

    top = partition(autocast_text)
    assert top._gemm_fallback("layout", (), "refused") == 1  # float32 biases off: their casts are kernels
    assert top.plain.compiled.num_kernels == 5 and "layout" in top._refused
    assert top.plain._gemm_fallback("layout", (), "refused") == 0  # then no epilogues
    assert top.plain.plain.compiled.plan_text() == _C.CompiledGraph(autocast_text, target="cuda",
                                                                    gemm_epilogues=0).plan_text()
    bottom = top.plain.plain
    bottom.eager = lambda *args: "eager"
    assert bottom._gemm_fallback("layout", (), "refused") == "eager"  # a plain GEMM refused
    # Without float32 biases level 1 plans what level 2 did: straight to 0.
    assert partition(bf16_text)._gemm_fallback("layout", (), "refused") == 0


# -- GPU runs ------------------------------------------------------------------

class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def opfuse_log():
    """opfuse's log lines meanwhile (scripts/gpu-check runs pytest without
    its logging plugin, so no caplog)."""
    log = logging.getLogger("opfuse")
    handler, level = _Collect(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler.messages
    log.removeHandler(handler)
    log.setLevel(level)


def refusals(messages):
    """The fallback's log lines: why cuBLASLt did not take an epilogue."""
    return "\n".join(m for m in messages if "cuBLASLt" in m or "GEMM" in m) or "(no fallback logged)"


def train_step_counted(model, x, grad, autocast=False):
    """Forward and backward once warm; (output, forward counts, backward counts) of the second step."""
    def forward():
        if autocast:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return model(x)
        return model(x)
    forward().backward(grad)
    for p in model.parameters():
        p.grad = None
    if x.grad is not None:
        x.grad = None
    opfuse.reset_stats()
    out = forward()
    s = opfuse.stats()
    fw = (s["library_calls"], s["kernel_launches"])
    opfuse.reset_stats()
    out.backward(grad)
    s = opfuse.stats()
    return out, fw, (s["library_calls"], s["kernel_launches"])


@gpu
@pytest.mark.parametrize("m", [1, 5, 16, 67])
@pytest.mark.parametrize("hidden", [64, 136, 36])
def test_gpu_bf16_gelu_mlp_training_uses_dgelu(m, hidden, opfuse_log):
    needs_cuda()
    model = gelu_mlp(hidden, device="cuda")
    eager = gelu_mlp(hidden, device="cuda")
    ref = gelu_mlp(hidden, dtype=torch.float64, device="cuda")
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    x = randn(m, 24, dtype=torch.bfloat16, device="cuda").requires_grad_()
    xe, xr = x.detach().clone().requires_grad_(), x.detach().double().requires_grad_()
    grad = randn(m, 16, dtype=torch.bfloat16, device="cuda")
    out, fw, bw = train_step_counted(compiled(model), x, grad)
    e_out = eager(xe)
    e_out.backward(grad)
    r_out = ref(xr)
    r_out.backward(grad.double())
    pairs = [(out, e_out, r_out), (x.grad, xe.grad, xr.grad)]
    pairs += [(p.grad, pe.grad, pr.grad) for p, pe, pr in zip(model.parameters(), eager.parameters(), ref.parameters())]
    for o, e, r in pairs:
        check_against_reference(o, e, r, factor=3)
    # Counts planned by test_plan_bf16_gelu_mlp_training.
    want_fw, want_bw = ((2, 0), (4, 0)) if hidden % 8 == 0 else ((2, 1), (4, 1))
    if m == 1:
        # cuBLASLt has no bias-gradient (BGRADB) algorithm for a single
        # contracted row (status 15 on the H200): the backward falls back to
        # plain GEMMs with the gelu gradient and the bias sum in kernels.
        want_bw = (4, 2)
    assert (fw, bw) == (want_fw, want_bw), f"forward {fw}, backward {bw} (calls, kernels)\n{refusals(opfuse_log)}"


@gpu
@pytest.mark.parametrize("m", [1, 7, 16, 130])
def test_gpu_autocast_mlp_inference_reads_float32_biases(m, opfuse_log):
    needs_cuda()
    model = relu_mlp(device="cuda")
    x = randn(m, 24, device="cuda")
    f = compiled(model)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out, calls, kernels = run_counted(f, x)
        eager = model(x)
    ref = relu_mlp(device="cuda").double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    with torch.no_grad():
        check_against_reference(out, eager, ref(x.double()))
    # cuBLASLt takes a bias only in D's type (cublasLt.h,
    # CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE; a float32 bias beside bf16 was
    # refused with status 7 on the H200), so the default plans the float32
    # biases' casts as kernels: two calls with bias+relu and bias, five cast
    # kernels (w1, x, w2, b1, b2). Level 2 (float32 bias read by the call)
    # is planned by test_plan_autocast_mlp_inference.
    assert (calls, kernels) == (2, 5), f"(calls, kernels) = {(calls, kernels)}\n{refusals(opfuse_log)}"


@gpu
def test_gpu_autocast_float32_bias_at_an_odd_storage_offset():
    # A float32 bias 3 elements into its storage (4-byte aligned): right
    # whether cuBLASLt takes that alignment or the partition falls back.
    needs_cuda()
    storage = randn(300, device="cuda")
    x, w, b = randn(21, 32, device="cuda"), randn(48, 32, device="cuda", scale=0.2), storage[3:51]
    f = lambda x, w, b: torch.relu(F.linear(x, w, b))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out, calls, _ = run_counted(compiled(f), x, w, b)
        eager = f(x, w, b)
    check_against_reference(out, eager, f(x.double(), w.double(), b.double()))
    assert calls == 1


@gpu
@pytest.mark.parametrize("m", [3, 16, 67])
def test_gpu_autocast_gelu_mlp_training(m, opfuse_log):
    needs_cuda()
    model = gelu_mlp(64, dtype=torch.float32, device="cuda")
    eager = gelu_mlp(64, dtype=torch.float32, device="cuda")
    ref = gelu_mlp(64, dtype=torch.float64, device="cuda")
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    x = randn(m, 24, device="cuda")
    grad = randn(m, 16, dtype=torch.bfloat16, device="cuda")
    out, fw, bw = train_step_counted(compiled(model), x, grad, autocast=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        e_out = eager(x)
    e_out.backward(grad)
    r_out = ref(x.double())
    r_out.backward(grad.double())
    check_against_reference(out, e_out, r_out, factor=3)
    for p, pe, pr in zip(model.parameters(), eager.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        check_against_reference(p.grad, pe.grad, pr.grad, factor=3)
    # The default level casts the float32 biases in kernels and the bias
    # gradients' float32 casts too (see the inference test); level 2's plan is
    # test_plan_autocast_gelu_mlp_training's.
    # (The forward's casts: 6 kernels at m = 16 and 67, 5 at m = 3 on the H200.)
    assert fw[0] == 2 and fw[1] <= 6 and bw == (3, 4), f"forward {fw}, backward {bw} (calls, kernels)\n{refusals(opfuse_log)}"


@gpu
@pytest.mark.parametrize("layout, fused", [("contiguous", True), ("row stride 72", True),
                                           ("row stride 68", False), ("transposed", False)])
def test_gpu_dgelu_reads_the_saved_input_in_place_or_falls_back(layout, fused, opfuse_log):
    # gelu_backward(g @ w, pre): DGELU reads pre with its row stride when
    # that is a multiple of 8; otherwise the partition runs a plain GEMM and
    # the gelu backward in a kernel. Same answer either way.
    needs_cuda()
    m, n, k = 29, 64, 40
    g, w = randn(m, k, dtype=torch.bfloat16, device="cuda"), randn(k, n, dtype=torch.bfloat16, device="cuda", scale=0.2)
    if layout == "contiguous":
        pre = randn(m, n, dtype=torch.bfloat16, device="cuda", scale=2)
    elif layout.startswith("row stride"):
        pre = randn(m, int(layout.split()[-1]), dtype=torch.bfloat16, device="cuda", scale=2)[:, :n]
    else:
        pre = randn(n, m, dtype=torch.bfloat16, device="cuda", scale=2).t()
    f = lambda g, w, pre: torch.ops.aten.gelu_backward(g @ w, pre, approximate="tanh")
    out, calls, kernels = run_counted(compiled(f), g, w, pre)
    check_against_reference(out, f(g, w, pre), f(g.double(), w.double(), pre.double()))
    assert (calls, kernels) == ((1, 0) if fused else (1, 1)), f"{layout}: {(calls, kernels)}\n{refusals(opfuse_log)}"
