// The public C++ API (opfuse/opfuse.h) at sizes that empty a cat part of
// symbolic size: the run takes the graph compiled with that size fixed
// (CompiledGraph::for_sizes), so the empty input's null pointer is never read.
#include <gtest/gtest.h>
#include <opfuse/opfuse.h>

#include <cmath>
#include <vector>

namespace {

TEST(ApiEmptyCatPart, RunsAndGivesTheOtherPartsValues) {
  opfuse::Program p;
  auto x = p.input("x", "f32", {"s0", "3"});
  auto y = p.input("y", "f32", {"s1", "3"});
  auto c = p.op("cat", {x, y}, {{"dim", int64_t{0}}});
  p.set_outputs({p.op("exp", {c})});
  opfuse::Compiled compiled = opfuse::compile(p);
  for (int64_t rows_x : {2, 0}) {
    for (int64_t rows_y : {0, 4}) {
      SCOPED_TRACE("x rows " + std::to_string(rows_x) + ", y rows " + std::to_string(rows_y));
      std::vector<float> xs(static_cast<size_t>(rows_x * 3)), ys(static_cast<size_t>(rows_y * 3));
      for (size_t i = 0; i < xs.size(); ++i) xs[i] = 0.1f * static_cast<float>(i);
      for (size_t i = 0; i < ys.size(); ++i) ys[i] = -0.2f * static_cast<float>(i);
      const int64_t rows = rows_x + rows_y;
      ASSERT_EQ(compiled.output_shapes({{rows_x, 3}, {rows_y, 3}}), (std::vector<std::vector<int64_t>>{{rows, 3}}));
      std::vector<float> out(static_cast<size_t>(rows * 3) + 1, NAN);  // one past the end: must stay unwritten
      compiled.run({{rows_x ? xs.data() : nullptr, "f32", {rows_x, 3}, {3, 1}},
                    {rows_y ? ys.data() : nullptr, "f32", {rows_y, 3}, {3, 1}}},
                   {{out.data(), "f32", {rows, 3}, {3, 1}}});
      for (size_t i = 0; i < xs.size(); ++i) EXPECT_FLOAT_EQ(out[i], std::exp(xs[i]));
      for (size_t i = 0; i < ys.size(); ++i) EXPECT_FLOAT_EQ(out[xs.size() + i], std::exp(ys[i]));
      EXPECT_TRUE(std::isnan(out.back()));
    }
  }
}

}  // namespace
