// The canonical text form: parse(print(g)) reproduces g node for node, the
// printed form is a fixed point, and a golden text pins the format down.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "ir/graph.h"
#include "ir_test_util.h"

namespace opfuse {
namespace {

using irtest::graphs_equal;
using irtest::shape_of;
using Ints = std::vector<int64_t>;

// A graph that uses every kind of attribute value (integer, float, bool,
// string with escapes, integer list, shape with symbols, dtype) and ops of
// every kind, with symbolic sizes that exercise min/max/floordiv printing.
Graph rich_graph() {
  Graph g;
  int x = g.add_input("x", DType::Float32, {sym("s0"), cst(8)});
  int w = g.add_input("w \"quoted\" \\ name", DType::BFloat16, shape_of({8}));
  int ids = g.add_input("ids", DType::Int32, {sym("s0"), sym("s1") * cst(2)});
  int half = g.add_scalar(0.5, DType::Float64);
  int y = g.add("mul", {x, half});
  int ge = g.add("gelu", {y}, {{"approximate", std::string("tanh")}});
  int wc = g.add("cast", {w}, {{"dtype", DType::Float32}});
  int a = g.add("add", {ge, wc});
  int s = g.add("sum", {a}, {{"dims", Ints{1}}, {"keepdim", true}});
  int r = g.add("reshape", {a}, {{"shape", Shape{cst(8), sym("s0")}}});
  int p = g.add("permute", {r}, {{"dims", Ints{1, 0}}});
  int sl = g.add("slice", {p}, {{"dim", int64_t{0}}, {"start", int64_t{-3}}, {"end", int64_t{100}}, {"step", int64_t{2}}});
  int sm = g.add("softmax", {x}, {{"dim", int64_t{-1}}});
  int ln = g.add("layer_norm", {x, wc}, {{"normalized_ndim", int64_t{1}}, {"eps", 1e-5}});
  int f = g.add("full", {}, {{"shape", Shape{sym("s0"), cst(1)}}, {"value", -INFINITY}, {"dtype", DType::Float32}});
  int ex = g.add("expand", {s}, {{"shape", Shape{sym("s0"), cst(8)}}});
  int cat = g.add("cat", {sm, ln, ex, f}, {{"dim", int64_t{1}}});
  int am = g.add("argmax", {ids}, {{"dims", Ints{-1}}});
  int cmp = g.add("gt", {ids, g.add_scalar(3, DType::Int64)});
  int wh = g.add("where", {cmp, ids, g.add_scalar(-1.5, DType::Float64)});
  int sq = g.add("squeeze", {g.add("unsqueeze", {wh}, {{"dim", int64_t{0}}})}, {{"dims", Ints{}}});
  int v = g.add("var", {sq}, {{"dims", Ints{0, 1}}, {"correction", int64_t{0}}});
  g.outputs = {sl, cat, am, v};
  return g;
}

TEST(TextForm, RichGraphVerifies) {
  Graph g = rich_graph();
  EXPECT_NO_THROW(verify(g));
  // The slice over the symbolic dim gives a size with min, max and //.
  std::string slice_size = to_string(g.node(g.outputs[0]).shape[0]);
  EXPECT_NE(slice_size.find("min("), std::string::npos) << slice_size;
  EXPECT_NE(slice_size.find("//2"), std::string::npos) << slice_size;
}

TEST(TextForm, ParsePrintReproducesGraph) {
  Graph g = rich_graph();
  std::string text = print_graph(g);
  Graph back = parse_graph(text);
  EXPECT_TRUE(graphs_equal(g, back)) << text;
  EXPECT_NO_THROW(verify(back));
  EXPECT_EQ(print_graph(back), text);  // canonical: printing is a fixed point
}

TEST(TextForm, AttributeKindsSurvive) {
  Graph back = parse_graph(print_graph(rich_graph()));
  auto attr = [&](int id, const char* k) { return back.node(id).attrs.at(k); };
  EXPECT_TRUE(std::holds_alternative<std::string>(attr(1, "name")));
  EXPECT_EQ(std::get<std::string>(attr(1, "name")), "w \"quoted\" \\ name");
  EXPECT_TRUE(std::holds_alternative<double>(attr(3, "value")));
  EXPECT_TRUE(std::holds_alternative<bool>(attr(3, "weak")));
  EXPECT_TRUE(std::holds_alternative<DType>(attr(6, "dtype")));
  EXPECT_TRUE(std::holds_alternative<Ints>(attr(8, "dims")));
  EXPECT_TRUE(std::holds_alternative<Shape>(attr(9, "shape")));  // all-constant, still a shape
  EXPECT_TRUE(std::holds_alternative<int64_t>(attr(11, "start")));
}

TEST(TextForm, SpecialFloatsRoundTripExactly) {
  Graph g;
  std::vector<double> values = {std::nan(""), INFINITY, -INFINITY, -0.0, 0.0, 1e-5, 0.1, 1.0 / 3,
                                1e300, 5e-324, 2.0, -2.5e-7, 123456789.0, std::numeric_limits<double>::max()};
  for (double v : values) g.add_scalar(v, DType::Float64);
  g.add_typed("scalar", {}, {{"value", int64_t{3}}}, DType::Int64, {});  // an integer, not a float
  g.outputs = {0};
  Graph back = parse_graph(print_graph(g));
  ASSERT_TRUE(graphs_equal(g, back)) << print_graph(g);
  for (size_t i = 0; i < values.size(); ++i) {
    double got = back.node(static_cast<int>(i)).get_float("value");
    EXPECT_TRUE(irtest::same_double(got, values[i])) << i << ": " << got;
  }
  EXPECT_TRUE(std::holds_alternative<int64_t>(back.node(static_cast<int>(values.size())).attrs.at("value")));
}

TEST(TextForm, GoldenText) {
  Graph g;
  int x = g.add_input("x", DType::Float32, {sym("s0"), cst(4096)});
  int h = g.add_scalar(0.5, DType::Float64);
  int m = g.add("mul", {x, h});
  int s = g.add("sum", {m}, {{"dims", Ints{1}}, {"keepdim", true}});
  int b = g.add("cast", {s}, {{"dtype", DType::BFloat16}});
  int e = g.add("expand", {b}, {{"shape", Shape{sym("s0"), cst(4096)}}});
  int sl = g.add("slice", {e}, {{"dim", int64_t{1}}, {"start", int64_t{1}}, {"step", int64_t{2}}});
  g.outputs = {m, sl};
  const char* golden =
      "graph {\n"
      "  %0 = input() {name=\"x\"} : f32[s0, 4096]\n"
      "  %1 = scalar() {value=0.5, weak=true} : f64[]\n"
      "  %2 = mul(%0, %1) : f32[s0, 4096]\n"
      "  %3 = sum(%2) {dims=[1], keepdim=true} : f32[s0, 1]\n"
      "  %4 = cast(%3) {dtype=bf16} : bf16[s0, 1]\n"
      "  %5 = expand(%4) {shape=<s0, 4096>} : bf16[s0, 4096]\n"
      "  %6 = slice(%5) {dim=1, start=1, step=2} : bf16[s0, 2048]\n"
      "  return (%2, %6)\n"
      "}\n";
  EXPECT_EQ(print_graph(g), golden);
  EXPECT_TRUE(graphs_equal(parse_graph(golden), g));
}

TEST(TextForm, ParserAcceptsCommentsAndSpacing) {
  const char* loose =
      "# a comment before the graph\n"
      "graph{\n"
      "   %0=input(){name=\"x\"}:f32[ s0 ,  3 ]   # trailing comment\n"
      "\n"
      "   %1 = sum( %0 ) { dims = [ 0 , 1 ] , keepdim = false } : f32[]\n"
      "   %2 = full() {shape=<>, value=2, dtype=f32} : f32[]\n"
      "   %3 = add(%1,%2) : f32[]\n"
      "   return(%3)\n"
      "}\n";
  Graph g = parse_graph(loose);
  EXPECT_NO_THROW(verify(g));
  ASSERT_EQ(g.nodes.size(), 4u);
  EXPECT_EQ(g.node(1).get_ints("dims"), (Ints{0, 1}));
  EXPECT_TRUE(g.node(2).get_shape("shape").empty());
  EXPECT_EQ(print_graph(parse_graph(print_graph(g))), print_graph(g));
  EXPECT_NE(print_graph(g), std::string(loose));  // it was not already canonical
}

TEST(TextForm, EmptyListsAndNoOutputs) {
  Graph g;
  int x = g.add_input("x", DType::Float64, shape_of({2, 1, 3}));
  g.add("squeeze", {x}, {{"dims", Ints{}}});
  std::string text = print_graph(g);
  EXPECT_NE(text.find("{dims=[]}"), std::string::npos) << text;
  EXPECT_NE(text.find("return ()"), std::string::npos) << text;
  Graph back = parse_graph(text);
  EXPECT_TRUE(graphs_equal(g, back));
  EXPECT_TRUE(back.outputs.empty());
}

}  // namespace
}  // namespace opfuse
