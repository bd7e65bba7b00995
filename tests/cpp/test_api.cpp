// The public C++ API (opfuse/opfuse.h): sizes that empty a cat part of
// symbolic size (the run takes the graph compiled with that size fixed,
// CompiledGraph::for_sizes, so the empty input's null pointer is never
// read), outputs that are reshapes or graph inputs, and bad outputs.
#include <gtest/gtest.h>
#include <opfuse/opfuse.h>

#include <algorithm>
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

namespace {

// x [s0, 4] -> relu, returned as [s0 * 4] (a reshape of the stored value),
// x itself, and x again: outputs that are views or graph inputs.
opfuse::Program views_and_inputs(opfuse::Value* x_out) {
  opfuse::Program p;
  auto x = p.input("x", "f32", {"s0", "4"});
  auto r = p.op("relu", {x});
  auto flat = p.op("reshape", {r}, {{"shape", std::vector<int64_t>{-1}}});
  p.set_outputs({flat, x, r, x});
  *x_out = x;
  return p;
}

TEST(Api, OutputsThatAreReshapesOrInputsAreWritten) {
  opfuse::Value x;
  opfuse::Compiled c = opfuse::compile(views_and_inputs(&x));
  const int64_t rows = 3;
  // x transposed in memory: element (i, j) at j * rows + i.
  std::vector<float> xs(static_cast<size_t>(rows * 4));
  for (size_t i = 0; i < xs.size(); ++i) xs[i] = static_cast<float>(i) - 5.5f;
  auto shapes = c.output_shapes({{rows, 4}});
  ASSERT_EQ(shapes, (std::vector<std::vector<int64_t>>{{rows * 4}, {rows, 4}, {rows, 4}, {rows, 4}}));
  std::vector<std::vector<float>> outs(4, std::vector<float>(static_cast<size_t>(rows * 4), NAN));
  c.run({{xs.data(), "f32", {rows, 4}, {1, rows}}},
        {{outs[0].data(), "f32", {rows * 4}, {1}},
         {outs[1].data(), "f32", {rows, 4}, {4, 1}},
         {outs[2].data(), "f32", {rows, 4}, {4, 1}},
         {outs[3].data(), "f32", {rows, 4}, {4, 1}}});
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < 4; ++j) {
      const float v = xs[static_cast<size_t>(j * rows + i)];
      const size_t at = static_cast<size_t>(i * 4 + j);
      EXPECT_EQ(outs[0][at], std::max(v, 0.f));
      EXPECT_EQ(outs[1][at], v);
      EXPECT_EQ(outs[2][at], std::max(v, 0.f));
      EXPECT_EQ(outs[3][at], v);
    }
}

TEST(Api, BadOutputsAreClearErrors) {
  opfuse::Value x;
  opfuse::Compiled c = opfuse::compile(views_and_inputs(&x));
  std::vector<float> xs(8), o0(8), o1(8), o2(8), o3(8);
  const opfuse::TensorRef in{xs.data(), "f32", {2, 4}, {4, 1}};
  auto run_with = [&](opfuse::TensorRef bad, int which) {
    std::vector<opfuse::TensorRef> outs{{o0.data(), "f32", {8}, {1}}, {o1.data(), "f32", {2, 4}, {4, 1}},
                                        {o2.data(), "f32", {2, 4}, {4, 1}}, {o3.data(), "f32", {2, 4}, {4, 1}}};
    outs[static_cast<size_t>(which)] = bad;
    c.run({in}, outs);
  };
  EXPECT_NO_THROW(run_with({o1.data(), "f32", {2, 4}, {4, 1}}, 1));
  EXPECT_THROW(run_with({o1.data(), "f32", {4, 2}, {2, 1}}, 1), opfuse::Error);  // an input's output: shape
  EXPECT_THROW(run_with({o1.data(), "f16", {2, 4}, {4, 1}}, 1), opfuse::Error);  // dtype
  EXPECT_THROW(run_with({o2.data(), "f32", {2, 4}, {1, 2}}, 2), opfuse::Error);  // not contiguous
  EXPECT_THROW(run_with({o0.data(), "f32", {2, 4}, {4, 1}}, 0), opfuse::Error);  // the reshape's shape is [8]
}

}  // namespace
