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

FusionPlan plan(const std::string& text, bool epilogues) {
  Graph g = parse_graph(text);
  verify(g);
  PlannerOptions opt;
  opt.gemm_epilogues = epilogues;
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
