// The row cache plan (codegen/row_cache_plan.h): which values a row kernel
// keeps in registers between stages, on kernels lowered from real graphs.
#include <gtest/gtest.h>

#include "codegen/lower.h"
#include "codegen/row_cache_plan.h"
#include "fusion/passes.h"
#include "ir/graph.h"

namespace opfuse {
namespace {

KernelIR only_kernel(const char* text) {
  Graph g = parse_graph(text);
  verify(g);
  FusionPlan p = plan_fusion(g);
  EXPECT_EQ(p.kernels.size(), 1u);
  return lower_kernel(p, p.kernels.at(0), "k");
}

// A structural key: the statement's kind, buffer and index, op and operands.
std::string key(const KStmt& s, const std::vector<std::string>& args) {
  std::string k = std::to_string(static_cast<int>(s.kind)) + " " + s.node.op + " b" + std::to_string(s.buffer);
  for (auto& e : s.index) k += " " + to_string(e);
  for (auto& a : args) k += " {" + a + "}";
  return k;
}

const char* kSoftmax = R"(graph {
  %0 = input() {name="x"} : f32[s0, 37]
  %1 = softmax(%0) {dim=-1} : f32[s0, 37]
  return (%1)
})";

TEST(RowCachePlan, SoftmaxKeepsExpOfTheSumStageInTheLoadsRegisters) {
  KernelIR k = only_kernel(kSoftmax);  // see golden/codegen/softmax.kir.txt
  ASSERT_EQ(k.stages.size(), 3u);
  RowCachePlan p = plan_row_cache(k, key, false);
  // One array: x (stage 0 -> stage 1), then exp(x - max) (stage 1 -> 2).
  ASSERT_EQ(p.slots(), 1);
  EXPECT_EQ(p.write[0].size(), 1u);
  EXPECT_EQ(p.read[1].size(), 1u);
  EXPECT_EQ(p.write[1].size(), 1u);
  int exp_value = k.stages[1].loop[2].dst;
  EXPECT_EQ(k.stages[1].loop[2].node.op, "exp");
  EXPECT_EQ(p.write[1].count(exp_value), 1u);
  // The output stage reads exp and skips the load, the subtraction and exp.
  EXPECT_EQ(p.read[2].size(), 1u);
  EXPECT_EQ(p.read[2].count(k.stages[2].loop[2].dst), 1u);
  EXPECT_EQ(p.skip[2].size(), 2u);
  EXPECT_TRUE(p.skip[0].empty());
  // Loads only: the same one array, but every stage recomputes exp.
  RowCachePlan loads = plan_row_cache(k, key, true);
  EXPECT_EQ(loads.slots(), 1);
  EXPECT_EQ(loads.read[2].count(k.stages[2].loop[0].dst), 1u);
}

TEST(RowCachePlan, LayerNormWithAffineCachesTheCenteredValue) {
  KernelIR k = only_kernel(R"(graph {
  %0 = input() {name="x"} : f32[s0, 64]
  %1 = input() {name="w"} : f32[64]
  %2 = input() {name="b"} : f32[64]
  %3 = layer_norm(%0, %1, %2) {normalized_ndim=1, eps=0.00001} : f32[s0, 64]
  return (%3)
})");
  RowCachePlan p = plan_row_cache(k, key, false);
  // x - mean is written by the variance stage and read by the output stage;
  // the weight and bias, loaded only by the output stage, are not cached.
  EXPECT_EQ(p.slots(), 1) << to_string(p);
  size_t last = k.stages.size() - 1;
  EXPECT_EQ(p.read[last].size(), 1u) << to_string(p);
}

TEST(RowCachePlan, SingleStageKernelsCacheNothing) {
  KernelIR k = only_kernel(R"(graph {
  %0 = input() {name="x"} : f32[s0, 64]
  %1 = sum(%0) {dims=[1], keepdim=false} : f32[s0]
  return (%1)
})");
  RowCachePlan p = plan_row_cache(k, key, false);
  EXPECT_EQ(p.slots(), 0);
}

}  // namespace
}  // namespace opfuse
