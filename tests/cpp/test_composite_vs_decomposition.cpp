// Every composite op, evaluated directly by the oracle, against the graph of
// primitives its OpDef::decompose builds, on the same random inputs, over
// several shapes (symbolic ones included) and every floating dtype. The two
// round differently (the decomposition rounds each float32 intermediate),
// so they are compared with PyTorch's assert_close tolerances for the dtype.
#include <gtest/gtest.h>

#include <set>

#include "ir/evaluate.h"
#include "ir/ops.h"
#include "ir_test_util.h"

namespace opfuse {
namespace {

using irtest::all_close;
using irtest::random_tensor;
using Ints = std::vector<int64_t>;

struct Operand {
  DType dtype;
  Ints shape;
  bool positive = false;  // rstd
  double scale = 1, offset = 0;
};

struct Case {
  std::string op;
  Ints shape;              // of x (and of dy)
  int64_t axis;            // `dim` for the softmax family, `normalized_ndim` for the norms
  int affine = 0;          // how many of weight, bias to pass
  bool symbolic = false;   // dim 0 is the size symbol s0
  Attrs extra = {};
};

std::string describe(const Case& c, DType t) {
  std::string s = c.op + " " + dtype_name(t) + " [";
  for (size_t i = 0; i < c.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(c.shape[i]);
  s += "] axis " + std::to_string(c.axis) + " affine " + std::to_string(c.affine) + (c.symbolic ? " symbolic" : "");
  return s;
}

bool is_softmax_family(const std::string& op) { return op.find("softmax") != std::string::npos; }

Ints stats_shape(const Ints& x, int64_t nd) {
  Ints s = x;
  for (size_t k = x.size() - static_cast<size_t>(nd); k < x.size(); ++k) s[k] = 1;
  return s;
}
Ints trailing(const Ints& x, int64_t nd) { return Ints(x.end() - nd, x.end()); }

// The operands each op takes, in order.
std::vector<Operand> operands_for(const Case& c, DType t) {
  DType acc = t == DType::Float64 ? DType::Float64 : DType::Float32;
  const Ints& x = c.shape;
  const std::string& op = c.op;
  std::vector<Operand> v;
  if (op == "softmax" || op == "log_softmax") return {{t, x, false, 3.0}};
  if (op == "softmax_backward") return {{t, x}, {t, x, false, 0.3, 0.4}};
  if (op == "log_softmax_backward") return {{t, x}, {t, x, false, 1.0, -2.0}};
  if (op == "layer_norm_stats" || op == "rms_norm_rstd") return {{t, x, false, 2.0, 0.5}};
  if (op == "layer_norm" || op == "rms_norm") {
    v = {{t, x, false, 2.0, 0.5}};
  } else if (op == "layer_norm_backward") {
    v = {{t, x}, {t, x, false, 2.0, 0.5}, {acc, stats_shape(x, c.axis), false, 0.5, 0.5},
         {acc, stats_shape(x, c.axis), true}};
  } else if (op == "rms_norm_backward") {
    v = {{t, x}, {t, x, false, 2.0, 0.5}, {acc, stats_shape(x, c.axis), true}};
  }
  for (int i = 0; i < c.affine; ++i) v.push_back({t, trailing(x, c.axis), false, 1.0, i == 0 ? 1.0 : 0.0});
  return v;
}

// PyTorch's assert_close defaults, loosened a little for float32 (the
// decomposition rounds several float32 intermediates in a row).
void tolerance(DType t, double* rtol, double* atol) {
  switch (t) {
    case DType::Float64: *rtol = 1e-10; *atol = 1e-12; break;
    case DType::Float32: *rtol = 1e-5; *atol = 1e-5; break;
    case DType::Float16: *rtol = 1e-3; *atol = 1e-5; break;
    default: *rtol = 1.6e-2; *atol = 1e-5; break;  // bf16
  }
}

struct Pair {
  Graph composite, decomposed;
  std::vector<HostTensor> inputs;
};

// Builds the composite graph, the decomposed graph over the same inputs, and
// random input values.
Pair build(const Case& c, DType t, uint64_t seed) {
  Pair p;
  std::vector<Operand> ops = operands_for(c, t);
  Attrs attrs = c.extra;
  attrs[is_softmax_family(c.op) ? "dim" : "normalized_ndim"] = c.axis;
  std::mt19937_64 rng(seed);
  for (Graph* g : {&p.composite, &p.decomposed}) {
    for (size_t i = 0; i < ops.size(); ++i) {
      Shape s;
      for (size_t k = 0; k < ops[i].shape.size(); ++k) {
        bool symbolic = c.symbolic && k == 0 && ops[i].shape.size() == c.shape.size();
        s.push_back(symbolic ? sym("s0") : cst(ops[i].shape[k]));
      }
      g->add_input("in" + std::to_string(i), ops[i].dtype, s);
    }
  }
  std::vector<int> ids = p.composite.input_ids();
  int out = p.composite.add(c.op, ids, attrs);
  p.composite.outputs = {out};
  const Node& node = p.composite.node(out);
  p.decomposed.outputs = {op_def(node).decompose(p.decomposed, node)};
  for (const Operand& o : ops) {
    HostTensor h = random_tensor(o.dtype, o.shape, rng, o.scale, o.offset);
    if (o.positive)
      for (double& v : h.data) v = round_to_dtype(std::fabs(v) + 0.5, o.dtype);
    p.inputs.push_back(std::move(h));
  }
  return p;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  const std::vector<std::pair<Ints, int64_t>> softmax_shapes = {
      {{7}, 0}, {{3, 5}, 1}, {{3, 5}, 0}, {{2, 3, 17}, 1}, {{2, 3, 17}, -1}, {{4, 1, 9}, 1}, {{2, 300}, 1}};
  for (const char* op : {"softmax", "log_softmax", "softmax_backward", "log_softmax_backward"}) {
    for (auto& [shape, dim] : softmax_shapes) cases.push_back({op, shape, dim});
    cases.push_back({op, {6, 10}, -1, 0, true});
    cases.push_back({op, {6, 10}, 0, 0, true});
  }
  const std::vector<std::pair<Ints, int64_t>> norm_shapes = {
      {{7}, 1}, {{3, 5}, 1}, {{2, 3, 17}, 2}, {{2, 3, 17}, 3}, {{4, 1, 9}, 1}, {{2, 300}, 1}};
  struct NormOp { const char* op; int max_affine; };
  for (NormOp n : {NormOp{"layer_norm", 2}, NormOp{"rms_norm", 1}, NormOp{"layer_norm_backward", 1},
                   NormOp{"rms_norm_backward", 1}}) {
    for (auto& [shape, nd] : norm_shapes)
      for (int affine = 0; affine <= n.max_affine; ++affine) cases.push_back({n.op, shape, nd, affine});
    cases.push_back({n.op, {6, 10}, 1, n.max_affine, true});
    cases.push_back({n.op, {3, 5}, 1, n.max_affine, false, {{"eps", 0.25}}});
  }
  for (const char* which : {"mean", "rstd"})
    for (auto& [shape, nd] : norm_shapes) cases.push_back({"layer_norm_stats", shape, nd, 0, false, {{"which", std::string(which)}}});
  cases.push_back({"layer_norm_stats", {6, 10}, 1, 0, true, {{"which", std::string("rstd")}, {"eps", 0.5}}});
  for (auto& [shape, nd] : norm_shapes) cases.push_back({"rms_norm_rstd", shape, nd});
  cases.push_back({"rms_norm_rstd", {6, 10}, 1, 0, true, {{"eps", 0.5}}});
  return cases;
}

constexpr DType kFloatTypes[] = {DType::Float64, DType::Float32, DType::Float16, DType::BFloat16};

TEST(CompositeVsDecomposition, EveryCompositeOpIsCovered) {
  std::set<std::string> composite, covered;
  for (const std::string& name : op_names())
    if (find_op(name)->kind == OpKind::Composite) composite.insert(name);
  for (const Case& c : all_cases()) covered.insert(c.op);
  EXPECT_EQ(covered, composite);
  EXPECT_GE(composite.size(), 10u);
}

TEST(CompositeVsDecomposition, DecompositionsAreWellTyped) {
  for (const Case& c : all_cases()) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(describe(c, t));
      Pair p = build(c, t, 1);
      ASSERT_NO_THROW(verify(p.composite));
      ASSERT_NO_THROW(verify(p.decomposed));
      const Node& a = p.composite.node(p.composite.outputs[0]);
      const Node& b = p.decomposed.node(p.decomposed.outputs[0]);
      EXPECT_EQ(a.dtype, b.dtype);
      ASSERT_EQ(a.shape.size(), b.shape.size());
      for (size_t k = 0; k < a.shape.size(); ++k) EXPECT_TRUE(expr_equal(a.shape[k], b.shape[k])) << k;
      // Only primitives are left, and there is real work in them.
      for (const Node& n : p.decomposed.nodes) EXPECT_NE(op_def(n).kind, OpKind::Composite) << n.where();
      EXPECT_GE(p.decomposed.nodes.size(), p.decomposed.input_ids().size() + 3);
    }
  }
}

TEST(CompositeVsDecomposition, SameValuesOnRandomInputs) {
  int compared = 0;
  uint64_t seed = 100;
  for (const Case& c : all_cases()) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(describe(c, t));
      Pair p = build(c, t, ++seed);
      std::vector<HostTensor> want = evaluate(p.composite, p.inputs);
      std::vector<HostTensor> got = evaluate(p.decomposed, p.inputs);
      double rtol, atol;
      tolerance(want[0].dtype, &rtol, &atol);
      EXPECT_TRUE(all_close(got[0], want[0], rtol, atol));
      for (double v : want[0].data) ASSERT_TRUE(std::isfinite(v));  // the inputs avoid NaN-producing corners
      compared += static_cast<int>(want[0].data.size());
    }
  }
  EXPECT_GT(compared, 10000);
}

// The comparison is sharp enough to see a wrong formula: the float64
// decomposition of a subtly different op does not pass for the original.
TEST(CompositeVsDecomposition, DetectsWrongVariants) {
  auto mismatch = [](Case right, Case wrong) {
    Pair a = build(right, DType::Float64, 5), b = build(wrong, DType::Float64, 5);
    std::vector<HostTensor> want = evaluate(a.composite, a.inputs);
    std::vector<HostTensor> got = evaluate(b.decomposed, a.inputs);  // same inputs
    return !all_close(got[0], want[0], 1e-10, 1e-12);
  };
  EXPECT_TRUE(mismatch({"softmax", {3, 5}, 1}, {"softmax", {3, 5}, 0}));
  EXPECT_TRUE(mismatch({"layer_norm", {3, 5}, 1}, {"layer_norm", {3, 5}, 1, 0, false, {{"eps", 1e-4}}}));
  EXPECT_TRUE(mismatch({"rms_norm", {3, 5}, 1}, {"rms_norm", {3, 5}, 1, 0, false, {{"eps", 1e-5}}}));
  EXPECT_TRUE(mismatch({"layer_norm_stats", {2, 3, 4}, 1, 0, false, {{"which", std::string("rstd")}}},
                       {"layer_norm_stats", {2, 3, 4}, 2, 0, false, {{"which", std::string("rstd")}}}));
  // Same inputs, a mean treated as zero: layer norm backward is not rms backward.
  Pair ln = build({"layer_norm_backward", {3, 5}, 1}, DType::Float64, 9);
  std::vector<HostTensor> in = ln.inputs;
  for (double& v : in[2].data) v = 0;
  Pair rms = build({"rms_norm_backward", {3, 5}, 1}, DType::Float64, 9);
  std::vector<HostTensor> rms_in = {in[0], in[1], in[3]};
  EXPECT_FALSE(all_close(evaluate(rms.composite, rms_in)[0], evaluate(ln.composite, in)[0], 1e-10, 1e-12));
  // ...while with the mean term removed from the inputs they agree where the
  // mean of g is zero: check the sharper identity dx_ln - dx_rms = -rstd * mean(g).
  HostTensor a = evaluate(ln.composite, in)[0], b = evaluate(rms.composite, rms_in)[0];
  for (int64_t r = 0; r < 3; ++r) {
    double mean_g = 0;
    for (int64_t j = 0; j < 5; ++j) mean_g += in[0].data[static_cast<size_t>(r * 5 + j)] / 5;
    for (int64_t j = 0; j < 5; ++j) {
      size_t i = static_cast<size_t>(r * 5 + j);
      EXPECT_NEAR(a.data[i] - b.data[i], -in[3].data[static_cast<size_t>(r)] * mean_g, 1e-12);
    }
  }
}

}  // namespace
}  // namespace opfuse
