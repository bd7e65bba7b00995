// The reference oracle against closed forms: elementwise ops with PyTorch's
// broadcasting and promotion, NaN/inf propagation, integer semantics, every
// layout op, reductions with keepdim, size symbols, and the composite ops
// (their backward ops also against finite differences of the forward ones).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "ir/evaluate.h"
#include "ir/ops.h"
#include "ir_test_util.h"

namespace opfuse {
namespace {

using irtest::tensor;
using irtest::throws_graph_error;
using Ints = std::vector<int64_t>;
using Vals = std::vector<double>;
constexpr double kInf = std::numeric_limits<double>::infinity();
const double kNaN = std::nan("");
constexpr DType F32 = DType::Float32, F64 = DType::Float64, F16 = DType::Float16, BF16 = DType::BFloat16,
                I32 = DType::Int32, I64 = DType::Int64, B8 = DType::Bool;

Shape const_shape(const std::vector<int64_t>& dims) {
  Shape s;
  for (int64_t d : dims) s.push_back(cst(d));
  return s;
}

// One op applied to graph inputs holding `ins`; the graph must verify.
HostTensor apply(const std::string& op, const std::vector<HostTensor>& ins, Attrs attrs = {}) {
  Graph g;
  std::vector<int> ids;
  for (size_t i = 0; i < ins.size(); ++i)
    ids.push_back(g.add_input("in" + std::to_string(i), ins[i].dtype, const_shape(ins[i].shape)));
  g.outputs = {g.add(op, ids, std::move(attrs))};
  verify(g);
  return evaluate(g, ins).at(0);
}

// `op(x, scalar)` with a scalar node (weak: a Python number).
HostTensor apply_scalar(const std::string& op, const HostTensor& x, double value, DType t, bool weak) {
  Graph g;
  int in = g.add_input("x", x.dtype, const_shape(x.shape));
  g.outputs = {g.add(op, {in, g.add_scalar(value, t, weak)})};
  verify(g);
  return evaluate(g, {x}).at(0);
}

HostTensor vec(DType t, Vals v) {
  int64_t n = static_cast<int64_t>(v.size());
  return tensor(t, {n}, std::move(v));
}

// Elementwise equality where NaN matches NaN and the sign of zero is ignored.
::testing::AssertionResult values_are(const HostTensor& t, const Vals& expected) {
  if (t.data.size() != expected.size())
    return ::testing::AssertionFailure() << t.data.size() << " values, expected " << expected.size();
  for (size_t i = 0; i < expected.size(); ++i) {
    bool same = std::isnan(expected[i]) ? std::isnan(t.data[i]) : t.data[i] == expected[i];
    if (!same) return ::testing::AssertionFailure() << "element " << i << " is " << t.data[i] << ", expected " << expected[i];
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult near(const HostTensor& t, const Vals& expected, double tol) {
  if (t.data.size() != expected.size())
    return ::testing::AssertionFailure() << t.data.size() << " values, expected " << expected.size();
  for (size_t i = 0; i < expected.size(); ++i)
    if (!(std::fabs(t.data[i] - expected[i]) <= tol))
      return ::testing::AssertionFailure() << "element " << i << " is " << t.data[i] << ", expected " << expected[i];
  return ::testing::AssertionSuccess();
}

// ---- elementwise -------------------------------------------------------------

TEST(Evaluate, BroadcastingFollowsPyTorch) {
  HostTensor r = apply("add", {tensor(F64, {2, 1}, {1, 2}), tensor(F64, {1, 3}, {10, 20, 30})});
  EXPECT_EQ(r.shape, (Ints{2, 3}));
  EXPECT_TRUE(values_are(r, {11, 21, 31, 12, 22, 32}));
  r = apply("sub", {tensor(F64, {2, 3}, {1, 2, 3, 4, 5, 6}), vec(F64, {1, 1, 1})});
  EXPECT_TRUE(values_are(r, {0, 1, 2, 3, 4, 5}));
  r = apply("mul", {tensor(F64, {2, 1, 2}, {1, 2, 3, 4}), tensor(F64, {3, 1}, {1, 10, 100})});
  EXPECT_EQ(r.shape, (Ints{2, 3, 2}));
  EXPECT_TRUE(values_are(r, {1, 2, 10, 20, 100, 200, 3, 4, 30, 40, 300, 400}));
  r = apply("add", {tensor(F64, {}, {5}), vec(F64, {1, 2})});  // rank 0 with rank 1
  EXPECT_TRUE(values_are(r, {6, 7}));
}

TEST(Evaluate, Arithmetic) {
  HostTensor a = vec(F64, {1.5, -2, 8}), b = vec(F64, {0.5, 4, -2});
  EXPECT_TRUE(values_are(apply("sub", {a, b}), {1, -6, 10}));
  EXPECT_TRUE(values_are(apply("mul", {a, b}), {0.75, -8, -16}));
  EXPECT_TRUE(values_are(apply("div", {a, b}), {3, -0.5, -4}));
  EXPECT_TRUE(values_are(apply("neg", {a}), {-1.5, 2, -8}));
  EXPECT_TRUE(values_are(apply("abs", {a}), {1.5, 2, 8}));
  EXPECT_TRUE(values_are(apply("reciprocal", {a}), {1 / 1.5, -0.5, 0.125}));
  EXPECT_TRUE(values_are(apply("pow", {a, b}), {std::sqrt(1.5), 16, 1.0 / 64}));
  EXPECT_TRUE(values_are(apply("maximum", {a, b}), {1.5, 4, 8}));
  EXPECT_TRUE(values_are(apply("minimum", {a, b}), {0.5, -2, -2}));
  EXPECT_TRUE(values_are(apply("sign", {a}), {1, -1, 1}));
  EXPECT_TRUE(values_are(apply("clamp", {a}, {{"min", -1.0}, {"max", 2.0}}), {1.5, -1, 2}));
  EXPECT_TRUE(values_are(apply("clamp", {a}, {{"max", int64_t{0}}}), {0, -2, 0}));
  EXPECT_TRUE(values_are(apply("sqrt", {vec(F64, {4, 0.25})}), {2, 0.5}));
  EXPECT_TRUE(values_are(apply("rsqrt", {vec(F64, {4, 0.25})}), {0.5, 2}));
}

TEST(Evaluate, Transcendentals) {
  HostTensor one = vec(F64, {1.0});
  EXPECT_TRUE(near(apply("gelu", {one}), {0.8413447460685429}, 1e-15));
  EXPECT_TRUE(near(apply("gelu", {one}, {{"approximate", std::string("tanh")}}), {0.8411919906082768}, 1e-15));
  EXPECT_TRUE(near(apply("silu", {one}), {0.7310585786300049}, 1e-15));
  EXPECT_TRUE(near(apply("sigmoid", {vec(F64, {0, 2})}), {0.5, 0.8807970779778823}, 1e-15));
  EXPECT_TRUE(near(apply("tanh", {one}), {0.7615941559557649}, 1e-15));
  EXPECT_TRUE(near(apply("erf", {one}), {0.8427007929497149}, 1e-15));
  EXPECT_TRUE(near(apply("exp", {one}), {M_E}, 1e-15));
  EXPECT_TRUE(near(apply("log", {vec(F64, {M_E, 1})}), {1, 0}, 1e-15));
  EXPECT_TRUE(near(apply("sin", {vec(F64, {M_PI / 2})}), {1}, 1e-15));
  EXPECT_TRUE(near(apply("cos", {vec(F64, {M_PI})}), {-1}, 1e-15));
  // log1p and expm1 keep their accuracy near zero.
  EXPECT_TRUE(near(apply("log1p", {vec(F64, {1e-12})}), {1e-12 - 5e-25}, 1e-30));
  EXPECT_TRUE(near(apply("expm1", {vec(F64, {1e-12})}), {1e-12 + 5e-25}, 1e-30));
  // Integer inputs of a float op give float32.
  HostTensor e = apply("exp", {vec(I32, {0, 1})});
  EXPECT_EQ(e.dtype, F32);
  EXPECT_TRUE(values_are(e, {1, static_cast<float>(M_E)}));
}

TEST(Evaluate, GeluBackwardIsTheGradientTimesGelusDerivative) {
  // Against central differences of the gelu oracle itself, both approximations.
  Vals xs = {-4.5, -1.7, -0.3, 0.0, 0.2, 1.1, 3.9};
  for (std::string approximate : {"none", "tanh"}) {
    Attrs a = {{"approximate", approximate}};
    const double h = 1e-5;
    Vals plus = xs, minus = xs, grad, want;
    for (size_t i = 0; i < xs.size(); ++i) {
      plus[i] += h;
      minus[i] -= h;
      grad.push_back(0.5 + 0.25 * static_cast<double>(i));
    }
    HostTensor up = apply("gelu", {vec(F64, plus)}, a), down = apply("gelu", {vec(F64, minus)}, a);
    for (size_t i = 0; i < xs.size(); ++i) want.push_back(grad[i] * (up.data[i] - down.data[i]) / (2 * h));
    HostTensor got = apply("gelu_backward", {vec(F64, grad), vec(F64, xs)}, a);
    EXPECT_TRUE(near(got, want, 1e-9)) << approximate;
  }
  // The gradient's dtype (PyTorch computes half types in float, rounds once).
  EXPECT_EQ(apply("gelu_backward", {vec(BF16, {1.0}), vec(BF16, {0.5})}).dtype, BF16);
}

TEST(Evaluate, NaNAndInfPropagate) {
  HostTensor x = vec(F32, {kNaN, kInf, -kInf, 0.0, -1.0});
  EXPECT_TRUE(values_are(apply("relu", {x}), {kNaN, kInf, 0, 0, 0}));
  EXPECT_TRUE(values_are(apply("exp", {x}), {kNaN, kInf, 0, 1, static_cast<float>(std::exp(-1.0))}));
  EXPECT_TRUE(values_are(apply("log", {x}), {kNaN, kInf, kNaN, -kInf, kNaN}));
  EXPECT_TRUE(values_are(apply("sqrt", {x}), {kNaN, kInf, kNaN, 0, kNaN}));
  EXPECT_TRUE(values_are(apply("rsqrt", {x}), {kNaN, 0, kNaN, kInf, kNaN}));
  EXPECT_TRUE(values_are(apply("abs", {x}), {kNaN, kInf, kInf, 0, 1}));
  EXPECT_TRUE(values_are(apply("sign", {x}), {kNaN, 1, -1, 0, -1}));
  EXPECT_TRUE(values_are(apply("tanh", {x}), {kNaN, 1, -1, 0, static_cast<float>(std::tanh(-1.0))}));
  EXPECT_TRUE(values_are(apply("sigmoid", {x}), {kNaN, 1, 0, 0.5, static_cast<float>(1 / (1 + M_E))}));
  EXPECT_TRUE(values_are(apply("clamp", {x}, {{"min", 0.0}, {"max", 1.0}}), {kNaN, 1, 0, 0, 0}));
  HostTensor y = vec(F32, {1, -kInf, kInf, kInf, kNaN});
  EXPECT_TRUE(values_are(apply("maximum", {x, y}), {kNaN, kInf, kInf, kInf, kNaN}));
  EXPECT_TRUE(values_are(apply("minimum", {x, y}), {kNaN, -kInf, -kInf, 0, kNaN}));
  EXPECT_TRUE(values_are(apply("add", {x, y}), {kNaN, kNaN, kNaN, kInf, kNaN}));
  EXPECT_TRUE(values_are(apply("mul", {x, y}), {kNaN, -kInf, -kInf, kNaN, kNaN}));
  EXPECT_TRUE(values_are(apply("div", {vec(F32, {1, -1, 0}), vec(F32, {0, 0, 0})}), {kInf, -kInf, kNaN}));
  // Float32 overflows to inf where float64 would not.
  EXPECT_TRUE(values_are(apply("mul", {vec(F32, {1e30}), vec(F32, {1e30})}), {kInf}));
  EXPECT_TRUE(values_are(apply("mul", {vec(F64, {1e30}), vec(F64, {1e30})}), {1e30 * 1e30}));
}

TEST(Evaluate, IntegerSemantics) {
  HostTensor big = vec(I32, {2147483647, -2147483647 - 1});
  HostTensor r = apply("add", {big, vec(I32, {1, -1})});
  EXPECT_EQ(r.dtype, I32);
  EXPECT_TRUE(values_are(r, {-2147483648.0, 2147483647}));  // wraps around
  HostTensor a = vec(I32, {-7, 7, 7, -7}), b = vec(I32, {2, -2, 2, -2});
  r = apply("div", {a, b});
  EXPECT_EQ(r.dtype, F32);  // true division of integers is a float
  EXPECT_TRUE(values_are(r, {-3.5, -3.5, 3.5, 3.5}));
  r = apply("div", {a, b}, {{"rounding_mode", std::string("floor")}});
  EXPECT_EQ(r.dtype, I32);
  EXPECT_TRUE(values_are(r, {-4, -4, 3, 3}));
  r = apply("div", {a, b}, {{"rounding_mode", std::string("trunc")}});
  EXPECT_TRUE(values_are(r, {-3, -3, 3, 3}));
  EXPECT_TRUE(throws_graph_error(
      [&] { apply("div", {vec(I64, {1}), vec(I64, {0})}, {{"rounding_mode", std::string("floor")}}); },
      {"ZeroDivisionError"}));
  // i32 with i64 promotes to i64; the sum of ints is i64.
  r = apply("mul", {vec(I32, {3}), vec(I64, {5000000000})});
  EXPECT_EQ(r.dtype, I64);
  EXPECT_TRUE(values_are(r, {15000000000.0}));
  EXPECT_TRUE(values_are(apply("abs", {vec(I32, {-5, 5})}), {5, 5}));
  EXPECT_TRUE(values_are(apply("neg", {vec(I64, {3})}), {-3}));
}

TEST(Evaluate, ScalarPromotion) {
  // An int tensor times a Python float becomes the default float type.
  HostTensor r = apply_scalar("mul", vec(I32, {1, 2, 3}), 2.5, F64, true);
  EXPECT_EQ(r.dtype, F32);
  EXPECT_TRUE(values_are(r, {2.5, 5, 7.5}));
  // A bool tensor plus a Python int is int64.
  r = apply_scalar("add", vec(B8, {1, 0}), 2, I64, true);
  EXPECT_EQ(r.dtype, I64);
  EXPECT_TRUE(values_are(r, {3, 2}));
  // A float16 tensor keeps its type with a Python float, and the scalar
  // enters the arithmetic as float32: 3 * 0.1f = 0.30000000447 rounds to
  // 0.300048828125 in f16 (a float16 0.1 would give 0.2998046875).
  r = apply_scalar("mul", vec(F16, {3}), 0.1, F64, true);
  EXPECT_EQ(r.dtype, F16);
  EXPECT_TRUE(values_are(r, {0.300048828125}));
  // A zero-dim tensor of a higher category decides the type...
  r = apply_scalar("add", vec(I32, {1}), 0.5, F64, false);
  EXPECT_EQ(r.dtype, F64);
  EXPECT_TRUE(values_are(r, {1.5}));
  // ...but one of the same category does not.
  r = apply_scalar("add", vec(F16, {1}), 1e-4, F64, false);
  EXPECT_EQ(r.dtype, F16);
  EXPECT_TRUE(values_are(r, {1.0}));
}

TEST(Evaluate, LowPrecisionResultsAreRounded) {
  HostTensor r = apply("add", {vec(BF16, {1.0, 256}), vec(BF16, {std::ldexp(1, -8), 1})});
  EXPECT_EQ(r.dtype, BF16);
  EXPECT_TRUE(values_are(r, {1.0, 256}));  // ties to even
  r = apply("add", {vec(F16, {2048, 1}), vec(F16, {3, std::ldexp(1, -10)})});
  EXPECT_TRUE(values_are(r, {2052, 1 + std::ldexp(1, -10)}));
  r = apply("mul", {vec(F16, {300}), vec(F16, {300})});
  EXPECT_TRUE(values_are(r, {kInf}));  // 90000 overflows float16
  r = apply("add", {vec(F32, {1}), vec(F32, {std::ldexp(1, -24)})});
  EXPECT_TRUE(values_are(r, {1}));
}

TEST(Evaluate, Comparisons) {
  HostTensor a = vec(F32, {1, 2, kNaN, -kInf}), b = vec(F32, {2, 2, kNaN, -kInf});
  struct Case { const char* op; Vals want; };
  for (const Case& c : {Case{"eq", {0, 1, 0, 1}}, Case{"ne", {1, 0, 1, 0}}, Case{"lt", {1, 0, 0, 0}},
                        Case{"le", {1, 1, 0, 1}}, Case{"gt", {0, 0, 0, 0}}, Case{"ge", {0, 1, 0, 1}}}) {
    HostTensor r = apply(c.op, {a, b});
    EXPECT_EQ(r.dtype, B8) << c.op;
    EXPECT_TRUE(values_are(r, c.want)) << c.op;
  }
  // Operands meet in their common type: i32 3 equals f32 3.0, and a float16
  // 0.1 is not the float32 0.1.
  EXPECT_TRUE(values_are(apply("eq", {vec(I32, {3, 4}), vec(F32, {3.0, 4.5})}), {1, 0}));
  EXPECT_TRUE(values_are(apply("eq", {vec(F16, {0.1}), vec(F32, {0.1})}), {0}));
  EXPECT_TRUE(values_are(apply("lt", {vec(F16, {0.1}), vec(F32, {0.1})}), {1}));
  // A Python float meets a float16 tensor in float32, the compute type (the
  // rule the code generators follow; PyTorch's CPU kernel would round 0.1 to
  // float16 first and find the first ones equal).
  HostTensor r = apply_scalar("eq", vec(F16, {0.1, 0.2, 0.5}), 0.1, F64, true);
  EXPECT_EQ(r.dtype, B8);
  EXPECT_TRUE(values_are(r, {0, 0, 0}));
  EXPECT_TRUE(values_are(apply_scalar("eq", vec(F16, {0.5, 0.1}), 0.5, F64, true), {1, 0}));
  EXPECT_TRUE(values_are(apply_scalar("gt", vec(I32, {2, 3}), 2.5, F64, true), {0, 1}));  // int vs float: as float
}

TEST(Evaluate, LogicalWhereAndIsnan) {
  HostTensor p = vec(B8, {0, 0, 1, 1}), q = vec(B8, {0, 1, 0, 1});
  EXPECT_TRUE(values_are(apply("logical_and", {p, q}), {0, 0, 0, 1}));
  EXPECT_TRUE(values_are(apply("logical_or", {p, q}), {0, 1, 1, 1}));
  EXPECT_TRUE(values_are(apply("logical_xor", {p, q}), {0, 1, 1, 0}));
  EXPECT_TRUE(values_are(apply("logical_not", {p}), {1, 1, 0, 0}));
  EXPECT_TRUE(values_are(apply("logical_and", {vec(F32, {0.5, 0}), vec(I32, {-3, 3})}), {1, 0}));
  EXPECT_TRUE(values_are(apply("isnan", {vec(F32, {kNaN, kInf, 0})}), {1, 0, 0}));
  // where broadcasts all three operands and promotes the two branches.
  HostTensor r = apply("where", {tensor(B8, {2, 1}, {1, 0}), vec(I32, {1, 2, 3}), tensor(F32, {}, {-0.5})});
  EXPECT_EQ(r.dtype, F32);
  EXPECT_EQ(r.shape, (Ints{2, 3}));
  EXPECT_TRUE(values_are(r, {1, 2, 3, -0.5, -0.5, -0.5}));
}

TEST(Evaluate, Casts) {
  auto cast = [](const HostTensor& x, DType t) { return apply("cast", {x}, {{"dtype", t}}); };
  EXPECT_TRUE(values_are(cast(vec(F32, {-2.7, 2.7, kNaN, -0.5}), I32), {-2, 2, 0, 0}));  // truncation; NaN -> 0
  EXPECT_TRUE(values_are(cast(vec(F64, {1e12 + 0.75}), I64), {1e12}));
  EXPECT_TRUE(values_are(cast(vec(F32, {0, -0.5, kNaN, 3}), B8), {0, 1, 1, 1}));
  EXPECT_TRUE(values_are(cast(vec(F64, {0.1}), BF16), {0.10009765625}));
  EXPECT_TRUE(values_are(cast(vec(F64, {0.1}), F16), {0.0999755859375}));
  EXPECT_TRUE(values_are(cast(vec(I64, {70000, -70000}), F16), {kInf, -kInf}));
  EXPECT_TRUE(values_are(cast(vec(I64, {16777217}), F32), {16777216}));
  EXPECT_TRUE(values_are(cast(vec(B8, {1, 0}), F32), {1, 0}));
  EXPECT_EQ(cast(vec(F32, {1}), BF16).dtype, BF16);
}

TEST(Evaluate, SourcesFullAndScalar) {
  Graph g;
  int f = g.add("full", {}, {{"shape", Shape{cst(2), cst(2)}}, {"value", 7.9}, {"dtype", I32}});
  int s = g.add_scalar(0.1, F16);
  int h = g.add("full", {}, {{"shape", Shape{cst(3)}}, {"value", 0.1}, {"dtype", BF16}});
  g.outputs = {f, s, h};
  verify(g);
  auto r = evaluate(g, {});
  EXPECT_EQ(r[0].shape, (Ints{2, 2}));
  EXPECT_TRUE(values_are(r[0], {7, 7, 7, 7}));
  EXPECT_TRUE(r[1].shape.empty());
  EXPECT_TRUE(values_are(r[1], {0.0999755859375}));
  EXPECT_TRUE(values_are(r[2], {0.10009765625, 0.10009765625, 0.10009765625}));
}

// ---- reductions --------------------------------------------------------------

HostTensor x23() { return tensor(F64, {2, 3}, {1, 2, 3, 4, 5, 6}); }

TEST(Evaluate, SumOverDimsWithKeepdim) {
  HostTensor r = apply("sum", {x23()}, {{"dims", Ints{1}}, {"keepdim", true}});
  EXPECT_EQ(r.shape, (Ints{2, 1}));
  EXPECT_TRUE(values_are(r, {6, 15}));
  r = apply("sum", {x23()}, {{"dims", Ints{0}}});
  EXPECT_EQ(r.shape, (Ints{3}));
  EXPECT_TRUE(values_are(r, {5, 7, 9}));
  r = apply("sum", {x23()}, {{"dims", Ints{-1}}});
  EXPECT_TRUE(values_are(r, {6, 15}));
  r = apply("sum", {x23()});
  EXPECT_TRUE(r.shape.empty());
  EXPECT_TRUE(values_are(r, {21}));
  r = apply("sum", {x23()}, {{"keepdim", true}});
  EXPECT_EQ(r.shape, (Ints{1, 1}));
  // A 3-D reduction over the outer and inner dims keeps the middle one.
  HostTensor x = tensor(F64, {2, 2, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  r = apply("sum", {x}, {{"dims", Ints{0, 2}}, {"keepdim", true}});
  EXPECT_EQ(r.shape, (Ints{1, 2, 1}));
  EXPECT_TRUE(values_are(r, {1 + 2 + 5 + 6, 3 + 4 + 7 + 8}));
  r = apply("sum", {tensor(F64, {}, {4.5})});
  EXPECT_TRUE(values_are(r, {4.5}));
}

TEST(Evaluate, ReductionDtypes) {
  HostTensor r = apply("sum", {vec(I32, {2147483647, 1})});
  EXPECT_EQ(r.dtype, I64);
  EXPECT_TRUE(values_are(r, {2147483648.0}));  // no wrap: accumulated as int64
  r = apply("sum", {vec(B8, {1, 0, 1, 1})});
  EXPECT_EQ(r.dtype, I64);
  EXPECT_TRUE(values_are(r, {3}));
  r = apply("prod", {vec(I32, {-2, 3, 4})});
  EXPECT_EQ(r.dtype, I64);
  EXPECT_TRUE(values_are(r, {-24}));
  r = apply("amax", {vec(I32, {-2, 3, 4})});
  EXPECT_EQ(r.dtype, I32);
  EXPECT_TRUE(values_are(r, {4}));
  // float16 sums are rounded once, at the end (2048 + 1 + 1 would be 2048
  // if every partial sum were rounded).
  r = apply("sum", {vec(F16, {2048, 1, 1})});
  EXPECT_TRUE(values_are(r, {2050}));
  r = apply("sum", {vec(F16, {60000, 60000})}, {{"dtype", F32}});
  EXPECT_EQ(r.dtype, F32);
  EXPECT_TRUE(values_are(r, {120000}));
  EXPECT_TRUE(values_are(apply("sum", {vec(F16, {60000, 60000})}), {kInf}));
}

TEST(Evaluate, MeanAndVar) {
  HostTensor x = vec(F64, {1, 2, 3, 4});
  EXPECT_TRUE(values_are(apply("mean", {x}), {2.5}));
  EXPECT_TRUE(values_are(apply("var", {x}), {5.0 / 3}));
  EXPECT_TRUE(values_are(apply("var", {x}, {{"correction", int64_t{0}}}), {1.25}));
  EXPECT_TRUE(values_are(apply("var", {x}, {{"correction", 2.0}}), {2.5}));
  EXPECT_TRUE(values_are(apply("var", {vec(F64, {3})}), {kNaN}));  // one element, correction 1
  HostTensor r = apply("mean", {x23()}, {{"dims", Ints{1}}, {"keepdim", true}});
  EXPECT_TRUE(values_are(r, {2, 5}));
  r = apply("var", {x23()}, {{"dims", Ints{0}}});
  EXPECT_TRUE(values_are(r, {4.5, 4.5, 4.5}));
}

TEST(Evaluate, EmptyReductions) {
  HostTensor empty = tensor(F32, {0, 3}, {});
  HostTensor r = apply("sum", {empty}, {{"dims", Ints{0}}});
  EXPECT_EQ(r.shape, (Ints{3}));
  EXPECT_TRUE(values_are(r, {0, 0, 0}));
  EXPECT_TRUE(values_are(apply("prod", {empty}, {{"dims", Ints{0}}}), {1, 1, 1}));
  EXPECT_TRUE(values_are(apply("mean", {empty}, {{"dims", Ints{0}}}), {kNaN, kNaN, kNaN}));
  r = apply("sum", {empty}, {{"dims", Ints{1}}});
  EXPECT_EQ(r.shape, (Ints{0}));
  EXPECT_TRUE(r.data.empty());
  EXPECT_TRUE(throws_graph_error([&] { apply("amax", {empty}, {{"dims", Ints{0}}}); }, {"(amax)", "empty"}));
  EXPECT_TRUE(throws_graph_error([&] { apply("argmin", {empty}); }, {"(argmin)", "empty"}));
  r = apply("amax", {empty}, {{"dims", Ints{1}}});  // nothing to reduce: no error
  EXPECT_EQ(r.shape, (Ints{0}));
}

TEST(Evaluate, MaxMinPropagateNaN) {
  HostTensor x = tensor(F32, {2, 3}, {1, kNaN, 3, -kInf, -5, -kInf});
  EXPECT_TRUE(values_are(apply("amax", {x}, {{"dims", Ints{1}}}), {kNaN, -5}));
  EXPECT_TRUE(values_are(apply("amin", {x}, {{"dims", Ints{1}}}), {kNaN, -kInf}));
  EXPECT_TRUE(values_are(apply("amax", {x}, {{"dims", Ints{0}}}), {1, kNaN, 3}));
  EXPECT_TRUE(values_are(apply("sum", {x}, {{"dims", Ints{1}}}), {kNaN, -kInf}));
}

TEST(Evaluate, ArgmaxArgmin) {
  HostTensor x = tensor(F64, {2, 4}, {3, 7, 7, 1, -1, -1, -5, -5});
  HostTensor r = apply("argmax", {x}, {{"dims", Ints{1}}});
  EXPECT_EQ(r.dtype, I64);
  EXPECT_TRUE(values_are(r, {1, 0}));  // the first of equal maxima
  EXPECT_TRUE(values_are(apply("argmin", {x}, {{"dims", Ints{1}}}), {3, 2}));
  EXPECT_TRUE(values_are(apply("argmax", {x}, {{"dims", Ints{0}}}), {0, 0, 0, 0}));
  EXPECT_TRUE(values_are(apply("argmin", {x}, {{"dims", Ints{0}}, {"keepdim", true}}), {1, 1, 1, 1}));
  // Over everything: an index into the flattened tensor.
  r = apply("argmin", {x}, {{"keepdim", true}});
  EXPECT_EQ(r.shape, (Ints{1, 1}));
  EXPECT_TRUE(values_are(r, {6}));
  EXPECT_TRUE(values_are(apply("argmax", {x}), {1}));
  // NaN counts as the extreme for both, and the first NaN wins.
  HostTensor n = vec(F32, {1, kNaN, 5, kNaN});
  EXPECT_TRUE(values_are(apply("argmax", {n}), {1}));
  EXPECT_TRUE(values_are(apply("argmin", {n}, {{"dims", Ints{0}}}), {1}));
  EXPECT_TRUE(values_are(apply("argmax", {vec(F32, {-kInf, -kInf})}), {0}));
}

// ---- layout ------------------------------------------------------------------

TEST(Evaluate, CopyAndReshape) {
  HostTensor r = apply("copy", {x23()});
  EXPECT_EQ(r.shape, (Ints{2, 3}));
  EXPECT_TRUE(values_are(r, {1, 2, 3, 4, 5, 6}));
  r = apply("reshape", {x23()}, {{"shape", Shape{cst(3), cst(1), cst(2)}}});
  EXPECT_EQ(r.shape, (Ints{3, 1, 2}));
  EXPECT_TRUE(values_are(r, {1, 2, 3, 4, 5, 6}));  // row-major order is kept
}

TEST(Evaluate, Permute) {
  Vals data;
  for (int i = 0; i < 24; ++i) data.push_back(i);
  HostTensor x = tensor(F64, {2, 3, 4}, data);
  HostTensor r = apply("permute", {x}, {{"dims", Ints{2, 0, -2}}});
  ASSERT_EQ(r.shape, (Ints{4, 2, 3}));
  // out[i][j][k] = x[j][k][i]
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j)
      for (int k = 0; k < 3; ++k) EXPECT_EQ(r.data[static_cast<size_t>((i * 2 + j) * 3 + k)], (j * 3 + k) * 4 + i);
  r = apply("permute", {x23()}, {{"dims", Ints{1, 0}}});
  EXPECT_TRUE(values_are(r, {1, 4, 2, 5, 3, 6}));
}

TEST(Evaluate, Expand) {
  HostTensor r = apply("expand", {tensor(I32, {3, 1}, {1, 2, 3})}, {{"shape", Shape{cst(2), cst(3), cst(2)}}});
  EXPECT_EQ(r.dtype, I32);
  EXPECT_EQ(r.shape, (Ints{2, 3, 2}));
  EXPECT_TRUE(values_are(r, {1, 1, 2, 2, 3, 3, 1, 1, 2, 2, 3, 3}));
  r = apply("expand", {tensor(F64, {}, {9})}, {{"shape", Shape{cst(3)}}});
  EXPECT_TRUE(values_are(r, {9, 9, 9}));
}

TEST(Evaluate, SqueezeUnsqueeze) {
  HostTensor x = tensor(F64, {1, 3, 1}, {1, 2, 3});
  EXPECT_EQ(apply("squeeze", {x}).shape, (Ints{3}));
  EXPECT_EQ(apply("squeeze", {x}, {{"dims", Ints{0}}}).shape, (Ints{3, 1}));
  EXPECT_EQ(apply("squeeze", {x}, {{"dims", Ints{1}}}).shape, (Ints{1, 3, 1}));  // size 3: kept
  HostTensor r = apply("unsqueeze", {vec(F64, {1, 2, 3})}, {{"dim", int64_t{-1}}});
  EXPECT_EQ(r.shape, (Ints{3, 1}));
  EXPECT_TRUE(values_are(r, {1, 2, 3}));
  EXPECT_EQ(apply("unsqueeze", {vec(F64, {1, 2, 3})}, {{"dim", int64_t{0}}}).shape, (Ints{1, 3}));
}

TEST(Evaluate, Slice) {
  Vals ten;
  for (int i = 0; i < 10; ++i) ten.push_back(i);
  HostTensor x = vec(F64, ten);
  auto sl = [&](Attrs a) {
    a["dim"] = int64_t{0};
    return apply("slice", {x}, a);
  };
  EXPECT_TRUE(values_are(sl({{"start", int64_t{2}}, {"end", int64_t{8}}, {"step", int64_t{3}}}), {2, 5}));
  EXPECT_TRUE(values_are(sl({{"start", int64_t{-3}}}), {7, 8, 9}));
  EXPECT_TRUE(values_are(sl({{"start", int64_t{7}}, {"end", int64_t{100}}}), {7, 8, 9}));
  EXPECT_TRUE(values_are(sl({{"start", int64_t{-100}}, {"end", int64_t{2}}}), {0, 1}));
  EXPECT_TRUE(values_are(sl({{"end", int64_t{-8}}}), {0, 1}));
  EXPECT_TRUE(values_are(sl({{"start", int64_t{1}}, {"end", int64_t{-1}}, {"step", int64_t{4}}}), {1, 5}));
  EXPECT_TRUE(values_are(sl({{"end", int64_t{9223372036854775807}}, {"step", int64_t{5}}}), {0, 5}));
  HostTensor e = sl({{"start", int64_t{8}}, {"end", int64_t{3}}});
  EXPECT_EQ(e.shape, (Ints{0}));
  EXPECT_EQ(sl({{"start", int64_t{12}}}).shape, (Ints{0}));
  EXPECT_EQ(sl({{"end", int64_t{-20}}}).shape, (Ints{0}));
  // Along an inner dim of a 2-D tensor.
  HostTensor r = apply("slice", {tensor(F64, {2, 5}, {0, 1, 2, 3, 4, 10, 11, 12, 13, 14})},
                       {{"dim", int64_t{-1}}, {"start", int64_t{1}}, {"step", int64_t{2}}});
  EXPECT_EQ(r.shape, (Ints{2, 2}));
  EXPECT_TRUE(values_are(r, {1, 3, 11, 13}));
}

TEST(Evaluate, CatPromotes) {
  HostTensor r = apply("cat", {tensor(I32, {2, 1}, {1, 2}), tensor(F32, {2, 2}, {0.5, 1.5, 2.5, 3.5})},
                       {{"dim", int64_t{1}}});
  EXPECT_EQ(r.dtype, F32);
  EXPECT_EQ(r.shape, (Ints{2, 3}));
  EXPECT_TRUE(values_are(r, {1, 0.5, 1.5, 2, 2.5, 3.5}));
  r = apply("cat", {x23(), tensor(F64, {1, 3}, {7, 8, 9}), tensor(F64, {0, 3}, {})}, {{"dim", int64_t{0}}});
  EXPECT_EQ(r.shape, (Ints{3, 3}));
  EXPECT_TRUE(values_are(r, {1, 2, 3, 4, 5, 6, 7, 8, 9}));
  r = apply("cat", {vec(F64, {0.1}), vec(BF16, {1})}, {{"dim", int64_t{0}}});
  EXPECT_EQ(r.dtype, F64);
  EXPECT_TRUE(values_are(r, {0.1, 1}));
  r = apply("cat", {vec(F16, {0.1}), vec(BF16, {0.1})}, {{"dim", int64_t{0}}});
  EXPECT_EQ(r.dtype, F32);
  EXPECT_TRUE(values_are(r, {0.0999755859375, 0.10009765625}));
}

// ---- size symbols ------------------------------------------------------------

TEST(Evaluate, SymbolicShapes) {
  Graph g;
  int x = g.add_input("x", F64, {sym("s0"), cst(2)});
  int b = g.add_input("b", F64, {sym("s0"), cst(1)});
  int y = g.add("add", {x, b});
  int s = g.add("sum", {y}, {{"dims", Ints{0}}});
  int f = g.add("full", {}, {{"shape", Shape{sym("s0") * cst(2) + cst(1)}}, {"value", 1.0}, {"dtype", F64}});
  g.outputs = {y, s, f};
  verify(g);
  auto r = evaluate(g, {tensor(F64, {3, 2}, {1, 2, 3, 4, 5, 6}), tensor(F64, {3, 1}, {10, 20, 30})});
  EXPECT_EQ(r[0].shape, (Ints{3, 2}));
  EXPECT_TRUE(values_are(r[0], {11, 12, 23, 24, 35, 36}));
  EXPECT_TRUE(values_are(r[1], {69, 72}));
  EXPECT_EQ(r[2].shape, (Ints{7}));
  // The same graph at another size.
  r = evaluate(g, {tensor(F64, {1, 2}, {1, 2}), tensor(F64, {1, 1}, {5})});
  EXPECT_TRUE(values_are(r[1], {6, 7}));
  EXPECT_EQ(r[2].shape, (Ints{3}));
}

// A slice whose producer checked its bounds (PyTorch's guards on a symbolic
// size) has PyTorch's unclamped size; a binding out of those bounds is an
// error naming the slice, never a negative size.
TEST(Evaluate, InboundsSliceSizesAndTheirCheck) {
  Graph g;
  int x = g.add_input("x", F64, {sym("s0")});
  auto sl = [&](Attrs a) {
    a["dim"] = int64_t{0};
    a["inbounds"] = int64_t{1};
    return g.add("slice", {x}, a);
  };
  int from1 = sl({{"start", int64_t{1}}});
  int drop_last = sl({{"end", int64_t{-1}}});
  int odd = sl({{"start", int64_t{1}}, {"end", int64_t{9223372036854775807}}, {"step", int64_t{2}}});
  int mid = sl({{"start", int64_t{2}}, {"end", int64_t{-3}}});
  int head = sl({{"end", int64_t{5}}});
  g.outputs = {from1, drop_last, odd, mid, head};
  verify(g);
  auto size = [&](int id) { return to_string(g.node(id).shape[0]); };
  EXPECT_EQ(size(from1), "s0 + -1");
  EXPECT_EQ(size(drop_last), "s0 + -1");
  EXPECT_EQ(size(odd), "s0//2");
  EXPECT_EQ(size(mid), "s0 + -5");
  EXPECT_EQ(size(head), "5");
  std::vector<double> ten{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  auto r = evaluate(g, {tensor(F64, {10}, ten)});
  EXPECT_TRUE(values_are(r[2], {1, 3, 5, 7, 9}));
  EXPECT_TRUE(values_are(r[3], {2, 3, 4, 5, 6}));
  EXPECT_TRUE(values_are(r[4], {0, 1, 2, 3, 4}));
  EXPECT_NO_THROW(bind_symbols(g, {{5}}));
  EXPECT_TRUE(throws_graph_error([&] { bind_symbols(g, {{4}}); }, {"slice", "[2, 1)", "size 4"}));
  EXPECT_TRUE(throws_graph_error([&] { bind_symbols(g, {{0}}); }, {"slice", "out of the bounds"}));
}

// A slice bound may be a size expression (a cat's gradient sliced from
// <s0>, the first part's size): only an inbounds one, whose producer checked
// it; the oracle evaluates it at the bound sizes, and the bounds check holds
// a binding to it.
TEST(Evaluate, SymbolicSliceBounds) {
  Graph g;
  int x = g.add_input("g", F64, {sym("s0") + sym("s1")});
  g.add_input("carrier", B8, {sym("s0")});
  Attrs a{{"dim", int64_t{0}}, {"start", Shape{sym("s0")}}, {"end", Shape{sym("s0") + sym("s1")}}, {"inbounds", int64_t{1}}};
  int tail = g.add("slice", {x}, a);
  g.outputs = {tail};
  verify(g);
  EXPECT_EQ(to_string(g.node(tail).shape[0]), "s1");
  EXPECT_EQ(to_string(parse_graph(print_graph(g)).node(tail).get_shape("start")[0]), "s0");  // the text form keeps it
  auto r = evaluate(g, {tensor(F64, {5}, {0, 1, 2, 3, 4}), tensor(B8, {2}, {0, 0})});
  EXPECT_TRUE(values_are(r[0], {2, 3, 4}));
  EXPECT_TRUE(throws_graph_error([&] { bind_symbols(g, {{5}, {6}}); }, {"slice", "out of the bounds"}));
  Graph h;
  int y = h.add_input("x", F64, {sym("s0")});
  EXPECT_TRUE(throws_graph_error([&] { h.add("slice", {y}, {{"dim", int64_t{0}}, {"start", Shape{sym("s1")}}}); },
                                 {"symbolic slice bound needs inbounds"}));
}

// slice_scatter puts src at start, start + step, ... of base along dim (a
// strided slice's backward); src must have the slice's shape.
TEST(Evaluate, SliceScatterWithAStep) {
  Graph g;
  int base = g.add_input("base", F64, {cst(2), cst(7)});
  int src = g.add_input("src", F64, {cst(2), cst(2)});
  int out = g.add("slice_scatter", {base, src}, {{"dim", int64_t{1}}, {"start", int64_t{1}}, {"end", int64_t{-2}},
                                                 {"step", int64_t{3}}});
  g.outputs = {out};
  verify(g);
  auto r = evaluate(g, {tensor(F64, {2, 7}, {0, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13, 14, 15, 16}),
                        tensor(F64, {2, 2}, {-1, -2, -3, -4})});
  EXPECT_TRUE(values_are(r[0], {0, -1, 2, 3, -2, 5, 6, 10, -3, 12, 13, -4, 15, 16}));
  Graph h;
  int b2 = h.add_input("base", F64, {cst(7)});
  int s3 = h.add_input("src", F64, {cst(3)});
  EXPECT_TRUE(throws_graph_error([&] { h.add("slice_scatter", {b2, s3}, {{"dim", int64_t{0}}, {"step", int64_t{2}}}); },
                                 {"src has shape [3]", "the slice is [4]"}));
}

// A symbol no input dim is equal to, but one is linear in (a slice's
// gradient [s0 - 3]), is solved for; a size that fits no whole value is an
// error naming the dim.
TEST(Evaluate, BindSymbolsSolvesLinearDims) {
  Graph g;
  g.add_input("g", F32, {sym("s1"), sym("s0") + cst(-3)});
  g.add_input("h", F32, {cst(2) * sym("s2") + cst(1)});
  EXPECT_EQ(bind_symbols(g, {{4, 6}, {9}}), (SymbolValues{{"s0", 9}, {"s1", 4}, {"s2", 4}}));
  EXPECT_TRUE(throws_graph_error([&] { bind_symbols(g, {{4, 6}, {8}}); }, {"'h' dim 0", "no input dim binds"}));
  EXPECT_TRUE(linear_in(cst(3) * sym("s0") + sym("s1"), "s0"));
  EXPECT_FALSE(linear_in(sym("s0") * sym("s1"), "s0"));
  EXPECT_FALSE(linear_in(floordiv(sym("s0"), cst(2)), "s0"));
}

TEST(Evaluate, BindSymbols) {
  Graph g;
  g.add_input("y", F32, {cst(2) * sym("s0")});  // compound first: checked after s0 is bound
  g.add_input("x", F32, {sym("s0"), sym("s1"), cst(4)});
  g.add_input("z", F32, {sym("s1") + cst(1)});
  SymbolValues s = bind_symbols(g, {{6}, {3, 5, 4}, {6}});
  EXPECT_EQ(s, (SymbolValues{{"s0", 3}, {"s1", 5}}));
  EXPECT_TRUE(throws_graph_error([&] { bind_symbols(g, {{6}, {3, 5, 7}, {6}}); },
                                 {"%1 (input) 'x' dim 2", "size 4 = 4", "given size is 7"}));
  EXPECT_TRUE(throws_graph_error([&] { bind_symbols(g, {{8}, {3, 5, 4}, {6}}); },
                                 {"'y' dim 0", "2*s0 = 6", "given size is 8"}));
  EXPECT_TRUE(throws_graph_error([&] { bind_symbols(g, {{6}, {3, 5, 4}, {5}}); }, {"'z' dim 0", "s1 + 1 = 6"}));
  EXPECT_TRUE(throws_graph_error([&] { bind_symbols(g, {{6}, {3, 5}, {6}}); }, {"'x'", "expected 3 dims", "got 2"}));
  EXPECT_TRUE(throws_graph_error([&] { bind_symbols(g, {{6}, {3, 5, 4}}); }, {"3 inputs but 2 shapes"}));
  EXPECT_TRUE(throws_graph_error([&] { bind_symbols(g, {{6}, {-3, 5, 4}, {6}}); }, {"'x' dim 0", "negative"}));

  Graph h;
  h.add_input("a", F32, {sym("s0")});
  h.add_input("b", F32, {cst(2), sym("s0")});
  EXPECT_TRUE(throws_graph_error([&] { bind_symbols(h, {{3}, {2, 4}}); },
                                 {"'b' dim 1", "size 4 contradicts s0 = 3", "'a' dim 0"}));
  Graph k;
  k.add_input("a", F32, {sym("s0") * sym("s0")});  // not linear in s0: not solved for
  EXPECT_TRUE(throws_graph_error([&] { bind_symbols(k, {{9}}); }, {"'a' dim 0", "no input dim binds"}));
}

TEST(Evaluate, InputChecks) {
  Graph g;
  int x = g.add_input("x", BF16, {cst(2)});
  g.outputs = {g.add("copy", {x})};
  EXPECT_TRUE(throws_graph_error([&] { evaluate(g, {vec(F32, {1, 2})}); }, {"'x'", "given f32 values for a bf16 input"}));
  EXPECT_TRUE(throws_graph_error([&] { evaluate(g, {tensor(BF16, {2}, {1})}); }, {"'x'", "1 values for 2 elements"}));
  EXPECT_TRUE(throws_graph_error([&] { evaluate(g, {}); }, {"1 inputs but 0 shapes"}));
  // Values a bf16 tensor cannot hold become the ones it would store.
  EXPECT_TRUE(values_are(evaluate(g, {vec(BF16, {0.1, 1e10})})[0], {0.10009765625, 9999220736.0}));
  EXPECT_TRUE(throws_graph_error([&] { evaluate_node(g, g.node(0), {}, {}); }, {"%0 (input)"}));
}

// Only what the outputs need is evaluated: a dead node that would throw (an
// integer division by zero) is skipped, and an output another output reads
// is still returned after its last reader dropped the intermediates.
TEST(Evaluate, DeadNodesAreNotEvaluated) {
  Graph g;
  int a = g.add_input("a", I64, {cst(2)});
  int b = g.add_input("b", I64, {cst(2)});
  g.add("div", {a, b}, {{"rounding_mode", std::string("floor")}});  // dead
  int twice = g.add("add", {a, a});
  int sum = g.add("add", {twice, b});
  g.outputs = {sum, twice};
  verify(g);
  auto r = evaluate(g, {vec(I64, {1, 2}), vec(I64, {0, 5})});
  EXPECT_TRUE(values_are(r[0], {2, 9}));
  EXPECT_TRUE(values_are(r[1], {2, 4}));
  g.outputs.push_back(2);  // now the division is live, and it throws
  EXPECT_TRUE(throws_graph_error([&] { evaluate(g, {vec(I64, {1, 2}), vec(I64, {0, 5})}); }, {"ZeroDivisionError"}));
}

// ---- composite ops -----------------------------------------------------------

TEST(Evaluate, SoftmaxClosedForms) {
  HostTensor r = apply("softmax", {vec(F64, {0, std::log(3.0)})}, {{"dim", int64_t{0}}});
  EXPECT_TRUE(near(r, {0.25, 0.75}, 1e-15));
  r = apply("log_softmax", {vec(F64, {0, std::log(3.0)})}, {{"dim", int64_t{-1}}});
  EXPECT_TRUE(near(r, {std::log(0.25), std::log(0.75)}, 1e-15));
  // Over dim 0 of a [2, 2]: each column is normalised.
  r = apply("softmax", {tensor(F64, {2, 2}, {1, 5, 1, 5 + std::log(4.0)})}, {{"dim", int64_t{0}}});
  EXPECT_TRUE(near(r, {0.5, 0.2, 0.5, 0.8}, 1e-15));
  // Large inputs do not overflow; -inf gets probability 0; a NaN poisons its row.
  r = apply("softmax", {tensor(F32, {3, 2}, {1000, 1000, 0, -kInf, kNaN, 1})}, {{"dim", int64_t{1}}});
  EXPECT_TRUE(values_are(r, {0.5, 0.5, 1, 0, kNaN, kNaN}));
  r = apply("softmax", {vec(F32, {-kInf, -kInf})}, {{"dim", int64_t{0}}});
  EXPECT_TRUE(values_are(r, {kNaN, kNaN}));
  r = apply("log_softmax", {vec(F32, {0, -kInf})}, {{"dim", int64_t{0}}});
  EXPECT_TRUE(values_are(r, {0, -kInf}));
  // The result is rounded to the input's dtype.
  r = apply("softmax", {vec(BF16, {0, 0, 0})}, {{"dim", int64_t{0}}});
  EXPECT_EQ(r.dtype, BF16);
  EXPECT_TRUE(values_are(r, {round_to_dtype(1.0 / 3, BF16), round_to_dtype(1.0 / 3, BF16), round_to_dtype(1.0 / 3, BF16)}));
}

TEST(Evaluate, NormClosedForms) {
  HostTensor x = tensor(F64, {2, 4}, {1, 2, 3, 4, 10, 10, 10, 10});
  // Row 0: mean 2.5, biased variance 1.25.
  double r0 = 1 / std::sqrt(1.25 + 1e-5), r1 = 1 / std::sqrt(1e-5);
  HostTensor r = apply("layer_norm", {x}, {{"normalized_ndim", int64_t{1}}});
  EXPECT_TRUE(near(r, {-1.5 * r0, -0.5 * r0, 0.5 * r0, 1.5 * r0, 0, 0, 0, 0}, 1e-14));
  r = apply("layer_norm", {x, vec(F64, {1, 2, 3, 4}), vec(F64, {0, 0, 0, 1})},
            {{"normalized_ndim", int64_t{1}}, {"eps", 0.0}});
  double s = 1 / std::sqrt(1.25);
  // (x - mean) * rstd * weight + bias; with eps = 0 a constant row is 0/0.
  EXPECT_NEAR(r.data[0], -1.5 * s, 1e-14);
  EXPECT_NEAR(r.data[1], -1.0 * s, 1e-14);
  EXPECT_NEAR(r.data[2], 1.5 * s, 1e-14);
  EXPECT_NEAR(r.data[3], 6 * s + 1, 1e-14);
  EXPECT_TRUE(std::isnan(r.data[4]));
  // Over both dims: one mean and variance for the whole tensor.
  r = apply("layer_norm_stats", {x}, {{"normalized_ndim", int64_t{2}}, {"which", std::string("mean")}});
  EXPECT_EQ(r.shape, (Ints{1, 1}));
  EXPECT_TRUE(near(r, {50.0 / 8}, 1e-14));
  r = apply("layer_norm_stats", {x}, {{"normalized_ndim", int64_t{1}}, {"which", std::string("rstd")}});
  EXPECT_EQ(r.shape, (Ints{2, 1}));
  EXPECT_TRUE(near(r, {r0, r1}, 1e-9));
  r = apply("rms_norm", {vec(F64, {3, 4})}, {{"normalized_ndim", int64_t{1}}, {"eps", 0.0}});
  EXPECT_TRUE(near(r, {3 / std::sqrt(12.5), 4 / std::sqrt(12.5)}, 1e-15));
  r = apply("rms_norm", {vec(F64, {3, 4}), vec(F64, {2, -1})}, {{"normalized_ndim", int64_t{1}}});
  double q = 1 / std::sqrt(12.5 + 1e-6);
  EXPECT_TRUE(near(r, {6 * q, -4 * q}, 1e-15));
  r = apply("rms_norm_rstd", {vec(F64, {3, 4})}, {{"normalized_ndim", int64_t{1}}});
  EXPECT_EQ(r.shape, (Ints{1}));
  EXPECT_TRUE(near(r, {q}, 1e-15));
  // Statistics of half inputs are float32; results of the norm keep x's dtype.
  r = apply("rms_norm_rstd", {vec(F16, {3, 4})}, {{"normalized_ndim", int64_t{1}}});
  EXPECT_EQ(r.dtype, F32);
  EXPECT_TRUE(values_are(r, {static_cast<float>(q)}));
  r = apply("layer_norm", {vec(BF16, {1, 2, 3, 4})}, {{"normalized_ndim", int64_t{1}}});
  EXPECT_EQ(r.dtype, BF16);
  for (double v : r.data) EXPECT_EQ(v, round_to_dtype(v, BF16));
  EXPECT_NEAR(r.data[3], 1.5 * r0, 1e-2);
}

TEST(Evaluate, BackwardClosedForms) {
  HostTensor y = vec(F64, {0.25, 0.75});
  HostTensor r = apply("softmax_backward", {vec(F64, {1, 0}), y}, {{"dim", int64_t{0}}});
  EXPECT_TRUE(near(r, {0.1875, -0.1875}, 1e-15));  // y * (dy - Σ dy*y)
  r = apply("log_softmax_backward", {vec(F64, {1, 1}), vec(F64, {std::log(0.25), std::log(0.75)})}, {{"dim", int64_t{0}}});
  EXPECT_TRUE(near(r, {0.5, -0.5}, 1e-15));  // dy - exp(y) * Σ dy
}

// d/dx of Σ dy * f(x), by central differences in float64.
Vals numeric_grad(const std::function<HostTensor(const HostTensor&)>& f, const HostTensor& x, const HostTensor& dy) {
  Vals g;
  for (size_t i = 0; i < x.data.size(); ++i) {
    const double h = 1e-6;
    HostTensor up = x, down = x;
    up.data[i] += h;
    down.data[i] -= h;
    HostTensor fu = f(up), fd = f(down);
    double d = 0;
    for (size_t k = 0; k < dy.data.size(); ++k) d += dy.data[k] * (fu.data[k] - fd.data[k]);
    g.push_back(d / (2 * h));
  }
  return g;
}

TEST(Evaluate, BackwardOpsAreGradients) {
  std::mt19937_64 rng(7);
  HostTensor x = irtest::random_tensor(F64, {3, 5}, rng);
  HostTensor dy = irtest::random_tensor(F64, {3, 5}, rng);
  HostTensor w = irtest::random_tensor(F64, {5}, rng);
  Attrs norm{{"normalized_ndim", int64_t{1}}, {"eps", 1e-3}};

  for (int64_t dim : {0, 1}) {
    Attrs d{{"dim", dim}};
    for (const char* op : {"softmax", "log_softmax"}) {
      HostTensor y = apply(op, {x}, d);
      HostTensor dx = apply(std::string(op) + "_backward", {dy, y}, d);
      Vals want = numeric_grad([&](const HostTensor& v) { return apply(op, {v}, d); }, x, dy);
      EXPECT_TRUE(near(dx, want, 1e-7)) << op << " dim " << dim;
    }
  }

  Attrs mean_attrs = norm, rstd_attrs = norm;
  mean_attrs["which"] = std::string("mean");
  rstd_attrs["which"] = std::string("rstd");
  HostTensor mean = apply("layer_norm_stats", {x}, mean_attrs);
  HostTensor rstd = apply("layer_norm_stats", {x}, rstd_attrs);
  HostTensor dx = apply("layer_norm_backward", {dy, x, mean, rstd, w}, norm);
  EXPECT_TRUE(near(dx, numeric_grad([&](const HostTensor& v) { return apply("layer_norm", {v, w}, norm); }, x, dy), 1e-7));
  dx = apply("layer_norm_backward", {dy, x, mean, rstd}, norm);
  EXPECT_TRUE(near(dx, numeric_grad([&](const HostTensor& v) { return apply("layer_norm", {v}, norm); }, x, dy), 1e-7));

  HostTensor rms_rstd = apply("rms_norm_rstd", {x}, norm);
  dx = apply("rms_norm_backward", {dy, x, rms_rstd, w}, norm);
  EXPECT_TRUE(near(dx, numeric_grad([&](const HostTensor& v) { return apply("rms_norm", {v, w}, norm); }, x, dy), 1e-7));
  dx = apply("rms_norm_backward", {dy, x, rms_rstd}, norm);
  EXPECT_TRUE(near(dx, numeric_grad([&](const HostTensor& v) { return apply("rms_norm", {v}, norm); }, x, dy), 1e-7));
}

TEST(Evaluate, EveryRegisteredOpHasARule) {
  // Each op, on a small float64 input, evaluates without "no rule" errors.
  for (const std::string& name : op_names()) {
    const OpDef* d = find_op(name);
    ASSERT_TRUE(d);
    if (d->kind == OpKind::Source || d->kind == OpKind::Opaque) continue;
    int arity = std::max(d->min_inputs, 1);
    if (name == "full") continue;  // covered by SourcesFullAndScalar
    if (d->kind == OpKind::Gemm) continue;  // covered by MatmulAndBatchedMatmul
    Graph g;
    std::vector<int> ins;
    bool is_where = name == "where";
    for (int i = 0; i < arity; ++i)
      ins.push_back(g.add_input("x" + std::to_string(i), is_where && i == 0 ? B8 : F64, {cst(2), cst(3)}));
    Attrs a;
    if (name == "cast") a["dtype"] = F32;
    if (name == "reshape") a["shape"] = Shape{cst(3), cst(2)};
    if (name == "permute") a["dims"] = Ints{1, 0};
    if (name == "expand") a["shape"] = Shape{cst(2), cst(3)};
    if (name == "unsqueeze" || name == "slice" || name == "slice_scatter" || name == "cat" ||
        name.find("softmax") != std::string::npos)
      a["dim"] = int64_t{1};
    if (name.find("norm") != std::string::npos) a["normalized_ndim"] = int64_t{1};
    if (name == "argmax" || name == "argmin") a["dims"] = Ints{1};
    if (name == "column_partials") {
      a["dims"] = Ints{0};
      a["parts"] = int64_t{2};
    }
    g.outputs = {g.add(name, ins, a)};
    verify(g);
    std::vector<HostTensor> vals;
    for (int i = 0; i < arity; ++i)
      vals.push_back(tensor(is_where && i == 0 ? B8 : F64, {2, 3}, {1, 0.5, 2, 0.25, 3, 1.5}));
    auto r = evaluate(g, vals);
    EXPECT_EQ(r[0].numel(), static_cast<int64_t>(r[0].data.size())) << name;
  }
}

TEST(Evaluate, MatmulAndBatchedMatmul) {
  Graph g;
  int a = g.add_input("a", F64, {cst(2), cst(3)});
  int b = g.add_input("b", F64, {cst(3), cst(2)});
  g.outputs = {g.add("matmul", {a, b})};
  auto r = evaluate(g, {tensor(F64, {2, 3}, {1, 2, 3, 4, 5, 6}), tensor(F64, {3, 2}, {1, 0, 0, 1, 1, 1})});
  EXPECT_EQ(r[0].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(r[0].data, (std::vector<double>{4, 5, 10, 11}));
  Graph h;
  int x = h.add_input("x", F64, {cst(2), cst(1), cst(2)});
  int y = h.add_input("y", F64, {cst(2), cst(2), cst(1)});
  h.outputs = {h.add("matmul", {x, y})};
  auto s = evaluate(h, {tensor(F64, {2, 1, 2}, {1, 2, 3, 4}), tensor(F64, {2, 2, 1}, {5, 6, 7, 8})});
  EXPECT_EQ(s[0].data, (std::vector<double>{17, 53}));  // 1*5+2*6, 3*7+4*8
}

}  // namespace
}  // namespace opfuse
