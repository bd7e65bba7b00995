// Graph outputs that reshape a computed node are views of its buffer: the
// plan stores the source once and records the alias; no copy kernel.
#include <gtest/gtest.h>

#include "fusion/plan.h"
#include "ir/graph.h"
#include "runtime/compiled_graph.h"

namespace opfuse {
namespace {

TEST(OutputAlias, ReshapedOutputIsAViewOfItsSource) {
  // y = relu(x) is saved, and so is its [B*T, C] view (as autograd saves both).
  Graph g = parse_graph(R"(graph {
  %0 = input() {name="x"} : f32[s0, 8, 12]
  %1 = relu(%0) : f32[s0, 8, 12]
  %2 = reshape(%1) {shape=<s0*8, 12>} : f32[s0*8, 12]
  %3 = exp(%0) : f32[s0, 8, 12]
  %4 = reshape(%3) {shape=<s0*96>} : f32[s0*96]
  return (%1, %2, %4)
})");
  FusionPlan p = plan_fusion(g);
  ASSERT_EQ(p.kernels.size(), 1u);
  EXPECT_EQ(p.output_alias.at(2), 1);
  EXPECT_EQ(p.output_alias.at(4), 3);  // an inlined source is realized instead
  EXPECT_EQ(p.kernels[0].stores, (std::vector<int>{1, 3}));

  CompiledGraph cg(g, CompileOptions{});
  std::vector<int64_t> syms = cg.bind({{5, 8, 12}});
  EXPECT_EQ(cg.output_buffers()[1], cg.output_buffers()[0]);  // one buffer, two shapes
  EXPECT_EQ(cg.output_shape(1, syms), (std::vector<int64_t>{40, 12}));
  EXPECT_EQ(cg.output_shape(2, syms), (std::vector<int64_t>{480}));
  EXPECT_EQ(cg.buffer_shape(cg.output_buffers()[2], syms), (std::vector<int64_t>{5, 8, 12}));
}

}  // namespace
}  // namespace opfuse
