// Bad graphs fail with a GraphError that names the node ("%3 (add)") and
// says what is wrong; bad text fails with its line number.
#include <gtest/gtest.h>

#include "ir/graph.h"
#include "ir_test_util.h"

namespace opfuse {
namespace {

using irtest::shape_of;
using irtest::throws_graph_error;
using Ints = std::vector<int64_t>;

// verify() on the parsed text must fail mentioning every needle.
::testing::AssertionResult verify_fails(const std::string& body, std::initializer_list<std::string> needles) {
  Graph g = parse_graph("graph {\n" + body + "}\n");
  return throws_graph_error([&] { verify(g); }, needles);
}

::testing::AssertionResult parse_fails(const std::string& text, std::initializer_list<std::string> needles) {
  return throws_graph_error([&] { parse_graph(text); }, needles);
}

TEST(Verifier, AcceptsAGoodGraph) {
  Graph g = parse_graph(
      "graph {\n"
      "  %0 = input() {name=\"x\"} : f32[s0, 4]\n"
      "  %1 = input() {name=\"b\"} : f32[4]\n"
      "  %2 = add(%0, %1) : f32[s0, 4]\n"
      "  %3 = amax(%2) {dims=[-1], keepdim=true} : f32[s0, 1]\n"
      "  return (%2, %3)\n"
      "}\n");
  EXPECT_NO_THROW(verify(g));
}

TEST(Verifier, ReshapeAndExpandTakeMinusOneAsPyTorchDoes) {
  // reshape: the one -1 is what the other dims leave, exactly for every
  // size; expand: -1 keeps the input's size.
  Graph g = parse_graph(
      "graph {\n"
      "  %0 = input() {name=\"x\"} : f32[s0, 6]\n"
      "  %1 = reshape(%0) {shape=<-1, 3>} : f32[2*s0, 3]\n"
      "  %2 = input() {name=\"y\"} : f32[1, 3]\n"
      "  %3 = expand(%2) {shape=<2*s0, -1>} : f32[2*s0, 3]\n"
      "  return (%1, %3)\n"
      "}\n");
  EXPECT_NO_THROW(verify(g));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[s0, 6]\n"
                           "  %1 = reshape(%0) {shape=<-1, -1>} : f32[2*s0, 3]\n  return (%1)\n",
                           {"%1 (reshape)", "only one dim", "-1"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[s0, 6]\n"
                           "  %1 = reshape(%0) {shape=<-1, 4>} : f32[2*s0, 3]\n  return (%1)\n",
                           {"%1 (reshape)", "cannot reshape"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[3]\n"
                           "  %1 = expand(%0) {shape=<-1, 3>} : f32[2, 3]\n  return (%1)\n",
                           {"%1 (expand)", "size -1"}));
}

TEST(Verifier, WrongDeclaredShape) {
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[3, 4]\n"
                           "  %1 = input() {name=\"y\"} : f32[4]\n"
                           "  %2 = add(%0, %1) : f32[3, 5]\n"
                           "  return (%2)\n",
                           {"%2 (add)", "declared shape [3, 5]", "gives [3, 4]"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[s0, 4]\n"
                           "  %1 = sum(%0) {dims=[1]} : f32[s0, 1]\n"
                           "  return (%1)\n",
                           {"%1 (sum)", "declared shape [s0, 1]", "gives [s0]"}));
}

TEST(Verifier, WrongDeclaredDtype) {
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : i32[3]\n"
                           "  %1 = input() {name=\"y\"} : f16[3]\n"
                           "  %2 = mul(%0, %1) : f32[3]\n"
                           "  return (%2)\n",
                           {"%2 (mul)", "declared dtype f32", "gives f16"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : i32[3]\n"
                           "  %1 = sum(%0) : i32[]\n"
                           "  return (%1)\n",
                           {"%1 (sum)", "declared dtype i32", "gives i64"}));
}

TEST(Verifier, UnknownOp) {
  Graph g;
  int x = g.add_input("x", DType::Float32, shape_of({2}));
  g.add_typed("frobnicate", {x}, {}, DType::Float32, shape_of({2}));
  g.outputs = {1};
  EXPECT_TRUE(throws_graph_error([&] { verify(g); }, {"%1 (frobnicate)", "unknown op 'frobnicate'"}));
  EXPECT_TRUE(throws_graph_error([&] { g.add("frobnicate", {x}); }, {"%2 (frobnicate)", "unknown op"}));
  EXPECT_TRUE(parse_fails("graph {\n  %0 = input() {name=\"x\"} : f32[2]\n  %1 = frobnicate(%0) : f32[2]\n  return (%1)\n}\n",
                          {"line 3", "unknown op 'frobnicate'"}));
}

TEST(Verifier, Arity) {
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2]\n"
                           "  %1 = add(%0) : f32[2]\n"
                           "  return (%1)\n",
                           {"%1 (add)", "takes 2 inputs, got 1"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2]\n"
                           "  %1 = layer_norm(%0, %0, %0, %0) {normalized_ndim=1} : f32[2]\n"
                           "  return (%1)\n",
                           {"%1 (layer_norm)", "takes 1 to 3 inputs, got 4"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2]\n"
                           "  %1 = cat() {dim=0} : f32[2]\n"
                           "  return (%1)\n",
                           {"%1 (cat)", "takes 1 to any inputs, got 0"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2]\n"
                           "  %1 = input(%0) {name=\"y\"} : f32[2]\n"
                           "  return (%1)\n",
                           {"%1 (input)", "takes no inputs"}));
}

TEST(Verifier, BadDims) {
  const std::string x = "  %0 = input() {name=\"x\"} : f32[3, 4]\n";
  EXPECT_TRUE(verify_fails(x + "  %1 = sum(%0) {dims=[2]} : f32[3]\n  return (%1)\n",
                           {"%1 (sum)", "dim 2 out of range for rank 2"}));
  EXPECT_TRUE(verify_fails(x + "  %1 = sum(%0) {dims=[0, -2]} : f32[4]\n  return (%1)\n",
                           {"%1 (sum)", "repeated"}));
  EXPECT_TRUE(verify_fails(x + "  %1 = argmax(%0) {dims=[0, 1]} : i64[]\n  return (%1)\n",
                           {"%1 (argmax)", "at most one dim"}));
  EXPECT_TRUE(verify_fails(x + "  %1 = permute(%0) {dims=[0, 0]} : f32[3, 3]\n  return (%1)\n",
                           {"%1 (permute)", "every dim once"}));
  EXPECT_TRUE(verify_fails(x + "  %1 = permute(%0) {dims=[1]} : f32[4]\n  return (%1)\n",
                           {"%1 (permute)", "every dim once"}));
  EXPECT_TRUE(verify_fails(x + "  %1 = softmax(%0) {dim=-3} : f32[3, 4]\n  return (%1)\n",
                           {"%1 (softmax)", "dim -3 out of range"}));
  EXPECT_TRUE(verify_fails(x + "  %1 = unsqueeze(%0) {dim=4} : f32[3, 4, 1]\n  return (%1)\n",
                           {"%1 (unsqueeze)", "dim 4 out of range for rank 3"}));
  EXPECT_TRUE(verify_fails(x + "  %1 = slice(%0) {dim=1, step=0} : f32[3, 4]\n  return (%1)\n",
                           {"%1 (slice)", "step must be positive"}));
  EXPECT_TRUE(verify_fails(x + "  %1 = layer_norm(%0) {normalized_ndim=3} : f32[3, 4]\n  return (%1)\n",
                           {"%1 (layer_norm)", "normalized_ndim"}));
}

TEST(Verifier, NonBroadcastableShapes) {
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[3, 4]\n"
                           "  %1 = input() {name=\"y\"} : f32[5]\n"
                           "  %2 = add(%0, %1) : f32[3, 4]\n"
                           "  return (%2)\n",
                           {"%2 (add)", "cannot be broadcast", "4 against 5"}));
  // Two different symbols do not broadcast: s0 may not equal s1.
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[s0]\n"
                           "  %1 = input() {name=\"y\"} : f32[s1]\n"
                           "  %2 = mul(%0, %1) : f32[s0]\n"
                           "  return (%2)\n",
                           {"%2 (mul)", "cannot be broadcast", "s0 against s1"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[3, 4]\n"
                           "  %1 = expand(%0) {shape=<3, 5>} : f32[3, 5]\n"
                           "  return (%1)\n",
                           {"%1 (expand)", "cannot expand size 4 to 5"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[3, 4]\n"
                           "  %1 = input() {name=\"w\"} : f32[3]\n"
                           "  %2 = layer_norm(%0, %1) {normalized_ndim=1} : f32[3, 4]\n"
                           "  return (%2)\n",
                           {"%2 (layer_norm)", "cannot be broadcast"}));
}

TEST(Verifier, ForwardReference) {
  Graph g;
  g.add_input("x", DType::Float32, shape_of({2}));
  g.add_typed("neg", {2}, {}, DType::Float32, shape_of({2}));
  g.add_typed("neg", {0}, {}, DType::Float32, shape_of({2}));
  g.outputs = {2};
  EXPECT_TRUE(throws_graph_error([&] { verify(g); }, {"%1 (neg)", "input %2 is not defined before it"}));
  EXPECT_TRUE(throws_graph_error([&] { g.add("neg", {7}); }, {"%3 (neg)", "input %7 is not defined before it"}));
  EXPECT_TRUE(parse_fails("graph {\n  %0 = input() {name=\"x\"} : f32[2]\n  %1 = add(%2, %0) : f32[2]\n  return (%1)\n}\n",
                          {"line 3", "%2 is used before it is defined"}));
  EXPECT_TRUE(parse_fails("graph {\n  %0 = input() {name=\"x\"} : f32[2]\n  return (%4)\n}\n",
                          {"line 3", "%4 is used before it is defined"}));
  EXPECT_TRUE(parse_fails("graph {\n  %0 = input() {name=\"x\"} : f32[2]\n  return (%99999999999999999999)\n}\n",
                          {"line 3", "node number 99999999999999999999 is too large"}));
}

TEST(Verifier, TypeRules) {
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2]\n"
                           "  %1 = where(%0, %0, %0) : f32[2]\n"
                           "  return (%1)\n",
                           {"%1 (where)", "condition must be bool, not f32"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : i32[2]\n"
                           "  %1 = mean(%0) : i32[]\n"
                           "  return (%1)\n",
                           {"%1 (mean)", "floating input, got i32"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : i64[2]\n"
                           "  %1 = softmax(%0) {dim=0} : i64[2]\n"
                           "  return (%1)\n",
                           {"%1 (softmax)", "floating input, got i64"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[s0, 3]\n"
                           "  %1 = reshape(%0) {shape=<s0, 4>} : f32[s0, 4]\n"
                           "  return (%1)\n",
                           {"%1 (reshape)", "cannot reshape [s0, 3]"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2, 3]\n"
                           "  %1 = input() {name=\"y\"} : f32[3]\n"
                           "  %2 = cat(%0, %1) {dim=0} : f32[5, 3]\n"
                           "  return (%2)\n",
                           {"%2 (cat)", "same rank"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2, 3]\n"
                           "  %1 = input() {name=\"y\"} : f32[2, 4]\n"
                           "  %2 = cat(%0, %1) {dim=0} : f32[4, 3]\n"
                           "  return (%2)\n",
                           {"%2 (cat)", "sizes differ outside the cat dim at dim 1"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2]\n"
                           "  %1 = div(%0, %0) {rounding_mode=\"round\"} : f32[2]\n"
                           "  return (%1)\n",
                           {"%1 (div)", "rounding_mode", "'round'"}));
}

TEST(Verifier, Attributes) {
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2]\n"
                           "  %1 = cast(%0) : f16[2]\n"
                           "  return (%1)\n",
                           {"%1 (cast)", "missing attribute 'dtype'"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2]\n"
                           "  %1 = sum(%0) {keepdim=1} : f32[1]\n"
                           "  return (%1)\n",
                           {"%1 (sum)", "attribute 'keepdim' must be true or false"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2]\n"
                           "  %1 = cast(%0) {dtype=\"f16\"} : f16[2]\n"
                           "  return (%1)\n",
                           {"%1 (cast)", "attribute 'dtype' must be a dtype"}));
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2, 3]\n"
                           "  %1 = permute(%0) {dims=1.5} : f32[3, 2]\n"
                           "  return (%1)\n",
                           {"%1 (permute)", "attribute 'dims' must be a list of integers"}));
}

TEST(Verifier, GraphLevelProblems) {
  EXPECT_TRUE(verify_fails("  %0 = input() {name=\"x\"} : f32[2]\n  return ()\n", {"graph has no outputs"}));
  Graph g;
  g.add_input("x", DType::Float32, shape_of({2}));
  g.outputs = {7};
  EXPECT_TRUE(throws_graph_error([&] { verify(g); }, {"output %7 is not a node"}));
  g.outputs = {0};
  g.add_typed("scalar", {}, {{"value", 1.0}}, DType::Float32, shape_of({1}));
  EXPECT_TRUE(throws_graph_error([&] { verify(g); }, {"%1 (scalar)", "a scalar has shape []"}));
  g.nodes.pop_back();
  g.add_typed("neg", {0}, {}, DType::Float32, shape_of({2}));
  g.nodes.back().id = 5;
  EXPECT_TRUE(throws_graph_error([&] { verify(g); }, {"%5 (neg)", "does not match its position 1"}));
}

TEST(Verifier, ParseErrorsCarryLineNumbers) {
  const std::string head = "graph {\n  %0 = input() {name=\"x\"} : f32[2]\n";
  EXPECT_TRUE(parse_fails(head + "  %1 = neg(%0) f32[2]\n  return (%1)\n}\n", {"line 3", "expected ':'"}));
  EXPECT_TRUE(parse_fails(head + "\n\n  %1 = neg(%0) : f8[2]\n  return (%1)\n}\n", {"line 5", "unknown dtype 'f8'"}));
  EXPECT_TRUE(parse_fails(head + "  %1 = neg(%0) : f32[s0 +]\n  return (%1)\n}\n", {"line 3", "bad size expression 's0 +'"}));
  EXPECT_TRUE(parse_fails(head + "  %2 = neg(%0) : f32[2]\n  return (%2)\n}\n", {"line 3", "expected %1, found %2"}));
  EXPECT_TRUE(parse_fails(head + "  %1 = neg(%0) {a=@} : f32[2]\n  return (%1)\n}\n", {"line 3"}));
  EXPECT_TRUE(parse_fails(head + "  %1 = neg(%0) {a=[1, 2.5]} : f32[2]\n  return (%1)\n}\n",
                          {"line 3", "integers only"}));
  EXPECT_TRUE(parse_fails(head + "  %1 = neg(%0) {a=\"open} : f32[2]\n  return (%1)\n}\n", {"unterminated string"}));
  EXPECT_TRUE(parse_fails(head + "  return (%0)\n}\nextra\n", {"line 5", "unexpected text after the graph"}));
  EXPECT_TRUE(parse_fails(head + "  return (%0)\n", {"line 4", "expected '}'"}));  // at the end of the text
  EXPECT_TRUE(parse_fails("grph {\n}\n", {"line 1", "expected 'graph'"}));
}

}  // namespace
}  // namespace opfuse
