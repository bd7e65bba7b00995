// GEMMs in the plan: matmuls become library calls that read their operands in
// place (a transpose is a flag, not a copy) and, for the GPU, carry the
// epilogue cuBLASLt fuses. Goldens under tests/cpp/golden/planner/gemm_*.txt.
#include <gtest/gtest.h>

#include <string>

#include "fusion/plan.h"
#include "ir/graph.h"
#include "ir/ops.h"

namespace opfuse::golden {
::testing::AssertionResult matches_golden(const std::string& name, const std::string& actual);
}

namespace opfuse {
namespace {

FusionPlan plan(const std::string& text, bool epilogues, bool float32_bias = false) {
  Graph g = parse_graph(text);
  verify(g);
  PlannerOptions opt;
  opt.gemm_epilogues = epilogues;
  opt.gemm_float32_bias = float32_bias;
  return plan_fusion(g, opt);
}

std::string plan_text(const FusionPlan& p) { return "# graph after the passes\n" + print_graph(p.graph) + "# plan\n" + p.to_string(); }

size_t count(const FusionPlan& p, KernelGroup::Kind kind) {
  size_t n = 0;
  for (auto& k : p.kernels) n += k.kind == kind;
  return n;
}

// The seed's MLP block relu(x @ w1^T + b1) @ w2^T + b2, as linear layers.
const char* kMlp = R"(graph {
  %0 = input() {name="x"} : bf16[s0, 64]
  %1 = input() {name="w1"} : bf16[128, 64]
  %2 = input() {name="b1"} : bf16[128]
  %3 = input() {name="w2"} : bf16[32, 128]
  %4 = input() {name="b2"} : bf16[32]
  %5 = permute(%1) {dims=[1, 0]} : bf16[64, 128]
  %6 = matmul(%0, %5) : bf16[s0, 128]
  %7 = add(%6, %2) : bf16[s0, 128]
  %8 = relu(%7) : bf16[s0, 128]
  %9 = permute(%3) {dims=[1, 0]} : bf16[128, 32]
  %10 = matmul(%8, %9) : bf16[s0, 32]
  %11 = add(%10, %4) : bf16[s0, 32]
  return (%11)
})";

// Llama's MLP (silu(x @ w1) * (x @ w3)) @ w2.
const char* kLlama = R"(graph {
  %0 = input() {name="x"} : bf16[s0, 64]
  %1 = input() {name="w1"} : bf16[64, 176]
  %2 = input() {name="w3"} : bf16[64, 176]
  %3 = input() {name="w2"} : bf16[176, 64]
  %4 = matmul(%0, %1) : bf16[s0, 176]
  %5 = silu(%4) : bf16[s0, 176]
  %6 = matmul(%0, %2) : bf16[s0, 176]
  %7 = mul(%5, %6) : bf16[s0, 176]
  %8 = matmul(%7, %3) : bf16[s0, 64]
  return (%8)
})";

// A training forward: the tanh-gelu's input is also an output (saved for
// the backward), and a residual add follows the second linear layer.
const char* kGeluAuxResidual = R"(graph {
  %0 = input() {name="x"} : bf16[s0, 64]
  %1 = input() {name="w1"} : bf16[64, 256]
  %2 = input() {name="b1"} : bf16[256]
  %3 = input() {name="w2"} : bf16[256, 64]
  %4 = input() {name="b2"} : bf16[64]
  %5 = matmul(%0, %1) : bf16[s0, 256]
  %6 = add(%5, %2) : bf16[s0, 256]
  %7 = gelu(%6) {approximate="tanh"} : bf16[s0, 256]
  %8 = matmul(%7, %3) : bf16[s0, 64]
  %9 = add(%8, %4) : bf16[s0, 64]
  %10 = add(%9, %0) : bf16[s0, 64]
  return (%10, %6)
})";

// A linear layer's backward: dx = g @ w, dw = x^T @ g... as PyTorch's mm
// backward writes it (dw^T = g^T @ x), and the bias gradient sum(g, 0).
const char* kLinearBackward = R"(graph {
  %0 = input() {name="g"} : f32[s0, 48]
  %1 = input() {name="x"} : f32[s0, 40]
  %2 = input() {name="w"} : f32[48, 40]
  %3 = matmul(%0, %2) : f32[s0, 40]
  %4 = permute(%0) {dims=[1, 0]} : f32[48, s0]
  %5 = matmul(%4, %1) : f32[48, 40]
  %6 = sum(%0) {dims=[0], keepdim=false} : f32[48]
  return (%3, %5, %6)
})";

TEST(GemmPlan, MlpBlockIsTwoLibraryCallsWithEpilogues) {
  FusionPlan p = plan(kMlp, true);
  EXPECT_EQ(count(p, KernelGroup::Kind::Gemm), 2u);
  EXPECT_EQ(p.kernels.size(), 2u);  // nothing else
  EXPECT_EQ(p.kernels[0].gemm.epilogue_name(), "bias+relu");
  EXPECT_TRUE(p.kernels[0].gemm.b.transposed);
  EXPECT_EQ(p.kernels[1].gemm.epilogue_name(), "bias");
  EXPECT_TRUE(golden::matches_golden("planner/gemm_mlp.txt", plan_text(p)));
}

TEST(GemmPlan, WithoutEpiloguesTheBiasAndReluFuseIntoKernels) {
  FusionPlan p = plan(kMlp, false);
  EXPECT_EQ(count(p, KernelGroup::Kind::Gemm), 2u);
  EXPECT_EQ(p.kernels.size(), 4u);  // gemm, bias+relu, gemm, bias
  EXPECT_EQ(p.kernels[0].gemm.epilogue_name(), "none");
  EXPECT_TRUE(golden::matches_golden("planner/gemm_mlp_plain.txt", plan_text(p)));
}

TEST(GemmPlan, LlamaMlpIsThreeCallsAndOneKernel) {
  for (bool epi : {true, false}) {
    FusionPlan p = plan(kLlama, epi);
    EXPECT_EQ(count(p, KernelGroup::Kind::Gemm), 3u);
    EXPECT_EQ(p.kernels.size(), 4u);  // silu(a) * b in one kernel
    // With library calls (CUDA), the down projection may read silu(a) * b's
    // inputs in its place (gated_gemm_input.cpp): a = %4, b = %6.
    EXPECT_EQ(p.kernels[3].gemm.gate_silu, epi ? 4 : -1);
    EXPECT_EQ(p.kernels[3].gemm.gate_mul, epi ? 6 : -1);
  }
  EXPECT_TRUE(golden::matches_golden("planner/gemm_llama.txt", plan_text(plan(kLlama, true))));
}

TEST(GemmPlan, GeluAuxAndResidualRideOnTheCalls) {
  FusionPlan p = plan(kGeluAuxResidual, true);
  ASSERT_EQ(p.kernels.size(), 2u);
  EXPECT_EQ(p.kernels[0].gemm.epilogue_name(), "bias+gelu_tanh+aux");
  EXPECT_EQ(p.kernels[1].gemm.epilogue_name(), "bias+residual");
  EXPECT_TRUE(golden::matches_golden("planner/gemm_gelu_aux_residual.txt", plan_text(p)));
}

TEST(GemmPlan, Float32GeluStaysInAGeneratedKernel) {
  // cuBLASLt's gelu is coarser than float32: bias only, gelu in a kernel.
  std::string text = kGeluAuxResidual;
  for (size_t at; (at = text.find("bf16")) != std::string::npos;) text.replace(at, 4, "f32");
  FusionPlan p = plan(text, true);
  EXPECT_EQ(p.kernels[0].gemm.epilogue_name(), "bias");
  EXPECT_EQ(count(p, KernelGroup::Kind::Gemm), 2u);
}

TEST(GemmPlan, BiasGradientRidesOnTheWeightGradientCall) {
  FusionPlan p = plan(kLinearBackward, true);
  EXPECT_EQ(count(p, KernelGroup::Kind::Gemm), 2u);
  EXPECT_EQ(p.kernels.size(), 2u);  // the sum is no kernel of its own
  EXPECT_EQ(p.kernels[1].gemm.epilogue_name(), "bias_grad");
  EXPECT_EQ(p.kernels[1].gemm.bias_grad_operand, 0);
  FusionPlan plain = plan(kLinearBackward, false);
  EXPECT_EQ(plain.kernels.size(), 3u);
  EXPECT_TRUE(golden::matches_golden("planner/gemm_linear_backward.txt", plan_text(p)));
}

TEST(GemmPlan, OperandComputedInTheGraphIsRealized) {
  // (x * 2) @ w: the GEMM reads a buffer, so the product is a kernel's output.
  const char* text = R"(graph {
  %0 = input() {name="x"} : f32[9, 5]
  %1 = input() {name="w"} : f32[5, 3]
  %2 = scalar() {value=2, weak=true} : f64[]
  %3 = mul(%0, %2) : f32[9, 5]
  %4 = matmul(%3, %1) : f32[9, 3]
  return (%4)
})";
  FusionPlan p = plan(text, true);
  ASSERT_EQ(p.kernels.size(), 2u);
  EXPECT_EQ(p.kernels[0].kind, KernelGroup::Kind::Pointwise);
  EXPECT_EQ(p.kernels[1].gemm.a.node, 3);
}

TEST(GemmPlan, ATransposeThatIsAlsoAnOutputIsTheBufferTheCallReads) {
  // Autocast training: the bf16 cast of a weight, transposed, is saved for
  // the backward (a graph output). The GEMM reads that stored transpose.
  const char* text = R"(graph {
  %0 = input() {name="w"} : f32[48, 40]
  %1 = cast(%0) {dtype=bf16} : bf16[48, 40]
  %2 = permute(%1) {dims=[1, 0]} : bf16[40, 48]
  %3 = input() {name="x"} : bf16[s0, 40]
  %4 = matmul(%3, %2) : bf16[s0, 48]
  return (%2, %4)
})";
  for (bool epi : {true, false}) {
    FusionPlan p = plan(text, epi);
    ASSERT_EQ(p.kernels.size(), 2u);
    const GemmCall& c = p.kernels[1].gemm;
    EXPECT_EQ(c.b.node, 2);  // the stored permute, read as it is
    EXPECT_FALSE(c.b.transposed);
    EXPECT_EQ(p.kernels[0].stores, std::vector<int>{2});
  }
}

TEST(GemmPlan, AChainOfReshapesOfAComputedNodeIsAView) {
  // cast -> [B, T, V] -> [B*T, V] -> GEMM: one kernel (the cast), no copy.
  const char* text = R"(graph {
  %0 = input() {name="g"} : f32[s0, 7]
  %1 = cast(%0) {dtype=bf16} : bf16[s0, 7]
  %2 = reshape(%1) {shape=<s0, 7, 1>} : bf16[s0, 7, 1]
  %3 = reshape(%2) {shape=<s0, 7>} : bf16[s0, 7]
  %4 = input() {name="w"} : bf16[7, 5]
  %5 = matmul(%3, %4) : bf16[s0, 5]
  return (%5)
})";
  FusionPlan p = plan(text, true);
  ASSERT_EQ(p.kernels.size(), 2u);
  EXPECT_EQ(p.kernels[0].roots, std::vector<int>{1});
  EXPECT_EQ(p.kernels[1].gemm.a.node, 1);
}

TEST(GemmPlan, MatmulRejectsMismatchedOperands) {
  Graph g;
  int a = g.add_input("a", DType::Float32, {cst(4), cst(5)});
  int b = g.add_input("b", DType::Float32, {cst(6), cst(3)});
  try {
    g.add("matmul", {a, b});
    FAIL() << "expected a GraphError";
  } catch (const GraphError& e) {
    EXPECT_NE(std::string(e.what()).find("inner sizes differ"), std::string::npos) << e.what();
  }
  int c = g.add_input("c", DType::Float16, {cst(5), cst(3)});
  EXPECT_THROW(g.add("matmul", {a, c}), GraphError);
}

}  // namespace
}  // namespace opfuse

namespace opfuse {
namespace {

TEST(GemmPlan, MemoryGateKeepsTwoLargeOperandsFromLivingAtOnce) {
  // relu(x) and sigmoid(x) each feed their own GEMM. Fusing their kernels
  // horizontally (both read x) would save one read of x, so the roofline
  // gate alone would merge them; but then both 64 MiB operands would be
  // live together, where apart each dies at its GEMM. The peak-memory gate
  // keeps them apart.
  const char* text = R"(graph {
  %0 = input() {name="x"} : f32[4096, 4096]
  %1 = input() {name="w1"} : f32[4096, 8]
  %2 = input() {name="w2"} : f32[4096, 8]
  %3 = relu(%0) : f32[4096, 4096]
  %4 = matmul(%3, %1) : f32[4096, 8]
  %5 = sigmoid(%0) : f32[4096, 4096]
  %6 = matmul(%5, %2) : f32[4096, 8]
  return (%4, %6)
})";
  FusionPlan p = plan(text, true);
  size_t pointwise = 0;
  for (auto& k : p.kernels) pointwise += k.kind == KernelGroup::Kind::Pointwise;
  EXPECT_EQ(pointwise, 2u) << p.to_string();
  EXPECT_EQ(p.kernels.size(), 4u);
  // The same two operands feeding one GEMM each, but both also graph
  // outputs (live to the end anyway): now nothing is saved by keeping them
  // apart, and they fuse into one kernel that reads x once.
  std::string both = text;
  both.replace(both.find("return (%4, %6)"), 15, "return (%4, %6, %3, %5)");
  FusionPlan q = plan(both, true);
  pointwise = 0;
  for (auto& k : q.kernels) pointwise += k.kind == KernelGroup::Kind::Pointwise;
  EXPECT_EQ(pointwise, 1u) << q.to_string();
}

}  // namespace
}  // namespace opfuse

namespace opfuse {
namespace {

const GemmCall& call_of(const FusionPlan& p, int matmul) {
  for (auto& k : p.kernels)
    if (k.kind == KernelGroup::Kind::Gemm && k.gemm.matmul == matmul) return k.gemm;
  throw std::runtime_error("no library call for %" + std::to_string(matmul));
}

// The backward of Linear(24, 64) -> tanh-gelu -> Linear(64, 16) in bfloat16,
// as AOTAutograd writes it: dh = g @ w2; dpre = gelu_backward(dh, pre) with
// pre the gelu input the forward saved (GELU_AUX); dx = dpre @ w1;
// dw1 = dpre^T @ x; db1 = sum(dpre, 0).
const char* kGeluMlpBackward = R"(graph {
  %0 = input() {name="g"} : bf16[s0, 16]
  %1 = input() {name="w2"} : bf16[16, 64]
  %2 = matmul(%0, %1) : bf16[s0, 64]
  %3 = input() {name="pre"} : bf16[s0, 64]
  %4 = gelu_backward(%2, %3) {approximate="tanh"} : bf16[s0, 64]
  %5 = input() {name="w1"} : bf16[64, 24]
  %6 = matmul(%4, %5) : bf16[s0, 24]
  %7 = permute(%4) {dims=[1, 0]} : bf16[64, s0]
  %8 = input() {name="x"} : bf16[s0, 24]
  %9 = matmul(%7, %8) : bf16[64, 24]
  %10 = sum(%4) {dims=[0], keepdim=true} : bf16[1, 64]
  %11 = reshape(%10) {shape=<64>} : bf16[64]
  return (%6, %9, %11)
})";

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = 0; (at = s.find(from, at)) != std::string::npos; at += to.size()) s.replace(at, from.size(), to);
  return s;
}

TEST(GemmPlan, GeluBackwardRidesOnTheCallThatComputesItsGradient) {
  FusionPlan p = plan(kGeluMlpBackward, true);
  EXPECT_EQ(p.kernels.size(), 3u) << p.to_string();  // three GEMMs, nothing else
  EXPECT_EQ(count(p, KernelGroup::Kind::Gemm), 3u);
  const GemmCall& dh = call_of(p, 2);
  EXPECT_EQ(dh.epilogue_name(), "dgelu_tanh+bias_grad");
  EXPECT_EQ(dh.aux, 3);  // reads the saved gelu input
  EXPECT_TRUE(dh.reads_aux());
  EXPECT_EQ(dh.result, 4);
  EXPECT_EQ(dh.bias_grad, 10);
  EXPECT_EQ(dh.bias_grad_operand, GemmCall::kBiasGradOfResult);
  EXPECT_EQ(dh.written(), (std::vector<int>{4, 10}));
  // The weight-gradient call reads dpre transposed; the bias gradient is
  // already the first call's, so it takes no second copy of it.
  EXPECT_EQ(call_of(p, 9).epilogue_name(), "none");
  EXPECT_TRUE(call_of(p, 9).a.transposed);
  EXPECT_EQ(call_of(p, 6).epilogue_name(), "none");
  EXPECT_TRUE(golden::matches_golden("planner/gemm_dgelu_backward.txt", plan_text(p)));
  // Without epilogues: the gelu backward and the bias gradient are a row
  // kernel between the calls.
  FusionPlan plain = plan(kGeluMlpBackward, false);
  EXPECT_EQ(plain.kernels.size(), 4u) << plain.to_string();
  EXPECT_EQ(count(plain, KernelGroup::Kind::Row), 1u);
}

TEST(GemmPlan, GeluBackwardStaysAKernelWhereDgeluCannotTakeIt) {
  auto dgelu_calls = [](const FusionPlan& p) {
    int n = 0;
    for (auto& k : p.kernels) n += k.kind == KernelGroup::Kind::Gemm && k.gemm.reads_aux();
    return n;
  };
  // float32 and float16: cuBLASLt's gelu is bfloat16-only here (see the forward).
  EXPECT_EQ(dgelu_calls(plan(replace_all(kGeluMlpBackward, "bf16", "f32"), true)), 0);
  EXPECT_EQ(dgelu_calls(plan(replace_all(kGeluMlpBackward, "bf16", "f16"), true)), 0);
  // the erf gelu: cuBLASLt's is the tanh approximation
  EXPECT_EQ(dgelu_calls(plan(replace_all(kGeluMlpBackward, "\"tanh\"", "\"none\""), true)), 0);
  // a width that is no multiple of 8 (the aux's leading dimension)
  std::string narrow = replace_all(kGeluMlpBackward, "64", "36");
  EXPECT_EQ(dgelu_calls(plan(narrow, true)), 0) << plan(narrow, true).to_string();
  // dh is needed on its own (a graph output): D holds the gelu backward instead
  std::string dh_out = replace_all(kGeluMlpBackward, "return (%6, %9, %11)", "return (%6, %9, %11, %2)");
  EXPECT_EQ(dgelu_calls(plan(dh_out, true)), 0);
  // the gradient input is not the GEMM's result (gelu_backward(pre, dh))
  std::string swapped = replace_all(kGeluMlpBackward, "gelu_backward(%2, %3)", "gelu_backward(%3, %2)");
  EXPECT_EQ(dgelu_calls(plan(swapped, true)), 0);
  // the saved input is computed in the graph and not stored: no buffer to read
  const char* computed = R"(graph {
  %0 = input() {name="g"} : bf16[s0, 16]
  %1 = input() {name="w2"} : bf16[16, 64]
  %2 = matmul(%0, %1) : bf16[s0, 64]
  %3 = input() {name="pre"} : bf16[s0, 64]
  %4 = neg(%3) : bf16[s0, 64]
  %5 = gelu_backward(%2, %4) {approximate="tanh"} : bf16[s0, 64]
  return (%5)
})";
  FusionPlan pc = plan(computed, true);
  EXPECT_EQ(dgelu_calls(pc), 0) << pc.to_string();
  EXPECT_EQ(pc.kernels.size(), 2u);
  // ... and the same graph reading the saved input itself is one call
  FusionPlan pi = plan(replace_all(computed, "gelu_backward(%2, %4)", "gelu_backward(%2, %3)"), true);
  EXPECT_EQ(dgelu_calls(pi), 1) << pi.to_string();
  EXPECT_EQ(pi.kernels.size(), 1u);
}

TEST(GemmPlan, ForwardGeluAuxNeedsAWidthThatIsAMultipleOfEight) {
  std::string narrow = replace_all(kGeluAuxResidual, "256", "36");
  FusionPlan p = plan(narrow, true);
  EXPECT_EQ(p.kernels[0].gemm.epilogue_name(), "bias");  // the gelu is a kernel
  EXPECT_EQ(count(p, KernelGroup::Kind::Gemm), 2u);
  EXPECT_EQ(p.kernels.size(), 3u) << p.to_string();
}

// Linear(24, 64) -> relu -> Linear(64, 16) under torch.autocast(bfloat16),
// inference: the weights, the input and the biases are float32 and cast.
const char* kAutocastMlp = R"(graph {
  %0 = input() {name="b1"} : f32[64]
  %1 = cast(%0) {dtype=bf16} : bf16[64]
  %2 = input() {name="w1"} : f32[64, 24]
  %3 = cast(%2) {dtype=bf16} : bf16[64, 24]
  %4 = input() {name="x"} : f32[s0, 24]
  %5 = cast(%4) {dtype=bf16} : bf16[s0, 24]
  %6 = input() {name="b2"} : f32[16]
  %7 = cast(%6) {dtype=bf16} : bf16[16]
  %8 = input() {name="w2"} : f32[16, 64]
  %9 = cast(%8) {dtype=bf16} : bf16[16, 64]
  %10 = permute(%3) {dims=[1, 0]} : bf16[24, 64]
  %11 = permute(%9) {dims=[1, 0]} : bf16[64, 16]
  %12 = matmul(%5, %10) : bf16[s0, 64]
  %13 = add(%12, %1) : bf16[s0, 64]
  %14 = relu(%13) : bf16[s0, 64]
  %15 = matmul(%14, %11) : bf16[s0, 16]
  %16 = add(%15, %7) : bf16[s0, 16]
  return (%16)
})";

TEST(GemmPlan, AutocastBiasIsReadAsFloat32ByTheEpilogue) {
  FusionPlan p = plan(kAutocastMlp, true, true);
  // The bfloat16 block's two calls with the same epilogues, plus one cast
  // kernel per float32 GEMM operand (w1, x, w2), which autocast asks for.
  EXPECT_EQ(count(p, KernelGroup::Kind::Gemm), 2u);
  EXPECT_EQ(p.kernels.size(), 5u) << p.to_string();
  EXPECT_EQ(call_of(p, 12).epilogue_name(), "bias+relu");
  EXPECT_EQ(call_of(p, 12).bias, 0);  // the float32 input, not its cast
  EXPECT_EQ(call_of(p, 15).epilogue_name(), "bias");
  EXPECT_EQ(call_of(p, 15).bias, 6);
  for (auto& k : p.kernels)
    if (k.kind == KernelGroup::Kind::Pointwise) {
      ASSERT_EQ(k.roots.size(), 1u);
      EXPECT_EQ(p.graph.node(k.roots[0]).op, "cast");
      EXPECT_NE(p.graph.node(k.roots[0]).shape.size(), 1u) << "a bias cast is a kernel: " << p.to_string();
    }
  EXPECT_TRUE(golden::matches_golden("planner/gemm_autocast_mlp.txt", plan_text(p)));
  // Without float32 biases (cuBLASLt refused one): the bias adds, relu
  // included, are kernels after plain calls.
  FusionPlan same = plan(kAutocastMlp, true, false);
  EXPECT_EQ(call_of(same, 12).epilogue_name(), "none");
  EXPECT_EQ(same.kernels.size(), 7u) << same.to_string();
}

TEST(GemmPlan, OnlyAFloat32InputCastToTheGemmsDtypeIsAFloat32Bias) {
  // a float16 input cast to bfloat16: cuBLASLt takes no such bias
  std::string f16 = replace_all(kAutocastMlp, "f32[64]", "f16[64]");
  EXPECT_EQ(call_of(plan(f16, true, true), 12).epilogue_name(), "none");
  // a computed float32 bias: not in memory as float32
  const char* computed = R"(graph {
  %0 = input() {name="x"} : bf16[s0, 24]
  %1 = input() {name="w"} : bf16[24, 64]
  %2 = matmul(%0, %1) : bf16[s0, 64]
  %3 = input() {name="b"} : f32[64]
  %4 = neg(%3) : f32[64]
  %5 = cast(%4) {dtype=bf16} : bf16[64]
  %6 = add(%2, %5) : bf16[s0, 64]
  return (%6)
})";
  FusionPlan pc = plan(computed, true, true);
  EXPECT_EQ(pc.kernels[0].gemm.epilogue_name(), "none") << pc.to_string();
  FusionPlan pi = plan(replace_all(computed, "cast(%4)", "cast(%3)"), true, true);
  EXPECT_EQ(pi.kernels[0].gemm.epilogue_name(), "bias") << pi.to_string();
  EXPECT_EQ(pi.kernels[0].gemm.bias, 3);
  // a float32 GEMM: its bias is float32 anyway (an input, no cast)
  FusionPlan f32 = plan(replace_all(kMlp, "bf16", "f32"), true, true);
  EXPECT_EQ(f32.kernels[0].gemm.epilogue_name(), "bias+relu");
}

// The backward of the autocast block with a tanh-gelu (x needs no
// gradient): the weight and bias gradients are cast to float32.
const char* kAutocastGeluBackward = R"(graph {
  %0 = input() {name="tangents_1"} : bf16[s0, 16]
  %1 = input() {name="permute_2"} : bf16[16, 64]
  %2 = matmul(%0, %1) : bf16[s0, 64]
  %3 = permute(%0) {dims=[1, 0]} : bf16[16, s0]
  %4 = input() {name="gelu"} : bf16[s0, 64]
  %5 = matmul(%3, %4) : bf16[16, 64]
  %6 = sum(%0) {dims=[0], keepdim=true} : bf16[1, 16]
  %7 = input() {name="add"} : bf16[s0, 64]
  %8 = gelu_backward(%2, %7) {approximate="tanh"} : bf16[s0, 64]
  %9 = permute(%5) {dims=[1, 0]} : bf16[64, 16]
  %10 = reshape(%6) {shape=<16>} : bf16[16]
  %11 = permute(%8) {dims=[1, 0]} : bf16[64, s0]
  %12 = sum(%8) {dims=[0], keepdim=true} : bf16[1, 64]
  %13 = permute(%9) {dims=[1, 0]} : bf16[16, 64]
  %14 = cast(%10) {dtype=f32} : f32[16]
  %15 = input() {name="_to_copy_2"} : bf16[s0, 24]
  %16 = matmul(%11, %15) : bf16[64, 24]
  %17 = reshape(%12) {shape=<64>} : bf16[64]
  %18 = cast(%13) {dtype=f32} : f32[16, 64]
  %19 = permute(%16) {dims=[1, 0]} : bf16[24, 64]
  %20 = cast(%17) {dtype=f32} : f32[64]
  %21 = permute(%19) {dims=[1, 0]} : bf16[64, 24]
  %22 = cast(%21) {dtype=f32} : f32[64, 24]
  return (%14, %18, %20, %22)
})";

TEST(GemmPlan, AutocastBiasGradientIsWrittenInFloat32) {
  FusionPlan p = plan(kAutocastGeluBackward, true, true);
  const GemmCall& dh = call_of(p, 2);
  EXPECT_EQ(dh.epilogue_name(), "dgelu_tanh+bias_grad");
  EXPECT_EQ(dh.bias_grad, 20);  // the float32 cast, written by the call
  EXPECT_EQ(p.graph.node(dh.bias_grad).dtype, DType::Float32);
  EXPECT_EQ(dh.written(), (std::vector<int>{8, 20}));
  // The other bias gradient, a sum of the incoming gradient, is cast to
  // float32 by the weight-gradient call that reads that gradient transposed.
  const GemmCall& dw2 = call_of(p, 5);
  EXPECT_EQ(dw2.epilogue_name(), "bias_grad");
  EXPECT_EQ(dw2.bias_grad_operand, GemmCall::kBiasGradOfA);
  EXPECT_EQ(dw2.bias_grad, 14);
  // Kernels: the two weight gradients' casts to float32.
  EXPECT_EQ(count(p, KernelGroup::Kind::Gemm), 3u);
  EXPECT_EQ(p.kernels.size(), 5u) << p.to_string();
  EXPECT_TRUE(golden::matches_golden("planner/gemm_autocast_gelu_backward.txt", plan_text(p)));
  // Without float32 bias gradients: the calls write the bfloat16 sums and
  // kernels cast them.
  FusionPlan same = plan(kAutocastGeluBackward, true, false);
  EXPECT_EQ(call_of(same, 2).bias_grad, 12);
  EXPECT_EQ(call_of(same, 5).bias_grad, 6);
  EXPECT_EQ(same.kernels.size(), 7u) << same.to_string();
}

}  // namespace
}  // namespace opfuse
