#include "ir/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "ir/decompose_rules.h"

namespace opfuse {

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::Source: return "source";
    case OpKind::Elementwise: return "elementwise";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::Layout: return "layout";
    case OpKind::Reduction: return "reduction";
    case OpKind::Composite: return "composite";
    case OpKind::Gemm: return "gemm";
    case OpKind::Opaque: return "opaque";
  }
  return "?";
}

int64_t normalize_dim(int64_t d, int64_t rank, const Node& n) {
  int64_t r = std::max<int64_t>(rank, 1);
  if (d < -r || d >= r)
    throw GraphError(n.where() + ": dim " + std::to_string(d) + " out of range for rank " + std::to_string(rank));
  return d < 0 ? d + r : d;
}

namespace {

// A slice bound: an integer, or a size expression (`start=<s0>`: the
// gradient of a cat's second part starts at the first part's size).
Expr bound_attr(const Node& n, const std::string& key, const Expr& dflt) {
  if (!n.has(key)) return dflt;
  if (std::holds_alternative<int64_t>(n.attrs.at(key))) return cst(n.get_int(key));
  Shape s = n.get_shape(key);
  if (s.size() != 1) throw GraphError(n.where() + ": attribute '" + key + "' must be an integer or one size expression");
  return s[0];
}

}  // namespace

std::pair<Expr, Expr> slice_bounds(const Node& n, const Expr& size) {
  Expr start = bound_attr(n, "start", cst(0)), end = bound_attr(n, "end", size);
  int64_t c;
  if ((!is_const(start) || !is_const(end)) && !n.get_int("inbounds", 0))
    // A symbolic bound has no sign to clamp by: only a producer that has
    // checked it (PyTorch's guards) may give one.
    throw GraphError(n.where() + ": a symbolic slice bound needs inbounds");
  if (n.get_int("inbounds", 0)) {
    // The producer has checked 0 <= start <= end <= size once negative
    // bounds count from the end (PyTorch's guards on a symbolic size), so no
    // clamp: x[1:] of [s0] is [s0 - 1] as PyTorch says, not
    // [s0 - min(1, s0)]. check_slice_bounds holds a binding to it.
    if (is_const(start, &c) && c < 0) start = size + start;
    if (is_const(end, &c) && c < 0) end = size + end;
    if (is_const(end, &c) && c >= (int64_t(1) << 62)) end = size;
    return {start, end};
  }
  if (is_const(start, &c) && c < 0) start = emax(size + start, cst(0));
  if (is_const(end, &c) && c < 0) end = emax(size + end, cst(0));
  if (is_const(end, &c) && c >= (int64_t(1) << 62)) end = size;
  end = emin(end, size);
  start = emin(start, end);
  return {start, end};
}

std::vector<int64_t> reduction_dims(const Node& n, int64_t rank) {
  std::vector<int64_t> dims = n.has("dims") ? n.get_ints("dims") : std::vector<int64_t>{};
  if (dims.empty())
    for (int64_t i = 0; i < rank; ++i) dims.push_back(i);
  for (auto& d : dims) d = rank == 0 ? 0 : normalize_dim(d, rank, n);
  std::sort(dims.begin(), dims.end());
  if (std::adjacent_find(dims.begin(), dims.end()) != dims.end())
    throw GraphError(n.where() + ": a dim is repeated in 'dims'");
  if (rank == 0) dims.clear();
  return dims;
}

Shape broadcast_shapes(const std::vector<Shape>& shapes, const std::string& where) {
  size_t rank = 0;
  for (auto& s : shapes) rank = std::max(rank, s.size());
  Shape out(rank, cst(1));
  for (auto& s : shapes) {
    size_t off = rank - s.size();
    for (size_t i = 0; i < s.size(); ++i) {
      Expr& o = out[off + i];
      int64_t c;
      if (is_const(s[i], &c) && c == 1) continue;
      if (is_const(o, &c) && c == 1) { o = s[i]; continue; }
      if (!expr_equal(o, s[i]))
        throw GraphError(where + ": shapes cannot be broadcast: size " + to_string(o) + " against " + to_string(s[i]) +
                         " at dim " + std::to_string(off + i));
    }
  }
  return out;
}

DType result_type(const Graph& g, const std::vector<int>& inputs) {
  // Three tiers as in PyTorch's at::result_type.
  bool have[3] = {false, false, false};
  DType tier[3] = {DType::Bool, DType::Bool, DType::Bool};
  for (int i : inputs) {
    const Node& x = g.node(i);
    int t = (x.op == "scalar" && x.get_bool("weak", false)) ? 2 : x.shape.empty() ? 1 : 0;
    tier[t] = have[t] ? promote_types(tier[t], x.dtype) : x.dtype;
    have[t] = true;
  }
  DType r = DType::Bool;
  bool any = false;
  for (int t = 0; t < 3; ++t) {
    if (!have[t]) continue;
    if (!any) { r = tier[t]; any = true; continue; }
    if (dtype_category(tier[t]) > dtype_category(r)) {
      // A weak float scalar raises an integer tensor to the default float type.
      if (t == 2) r = dtype_category(tier[t]) == 2 ? DType::Float32 : DType::Int64;
      else r = tier[t];
    }
  }
  return r;
}

namespace {

using Args = std::vector<double>;
using CArgs = std::vector<std::string>;
std::map<std::string, OpDef>& registry() {
  static std::map<std::string, OpDef> r;
  return r;
}

std::vector<Shape> input_shapes(const Graph& g, const Node& n) {
  std::vector<Shape> s;
  for (int i : n.inputs) s.push_back(g.node(i).shape);
  return s;
}

// Dtype rules for elementwise ops.
enum class DRule { Promote, PromoteFloat, Float, Same, Bool, Cast, Where };

DType to_float(DType t) { return is_floating(t) ? t : DType::Float32; }

std::function<void(const Graph&, Node&)> elementwise_infer(DRule rule) {
  return [rule](const Graph& g, Node& n) {
    n.shape = broadcast_shapes(input_shapes(g, n), n.where());
    switch (rule) {
      case DRule::Promote: n.dtype = result_type(g, n.inputs); break;
      case DRule::PromoteFloat: n.dtype = to_float(result_type(g, n.inputs)); break;
      case DRule::Float: n.dtype = to_float(g.node(n.inputs[0]).dtype); break;
      case DRule::Same: n.dtype = g.node(n.inputs[0]).dtype; break;
      case DRule::Bool: n.dtype = DType::Bool; break;
      case DRule::Cast: n.dtype = n.get_dtype("dtype"); break;
      case DRule::Where: {
        if (g.node(n.inputs[0]).dtype != DType::Bool)
          throw GraphError(n.where() + ": the condition must be bool, not " + dtype_name(g.node(n.inputs[0]).dtype));
        n.dtype = result_type(g, {n.inputs[1], n.inputs[2]});
        break;
      }
    }
  };
}

void def_elementwise(const std::string& name, int arity, DRule rule,
                     std::function<double(const Args&, const Node&)> f,
                     std::function<std::string(const CArgs&, const Node&)> c, double flops = 1,
                     OperandType operands = OperandType::Result) {
  OpDef d;
  d.name = name;
  d.kind = OpKind::Elementwise;
  d.min_inputs = d.max_inputs = arity;
  d.infer = elementwise_infer(rule);
  d.scalar = std::move(f);
  d.c_expr = std::move(c);
  d.flops = flops;
  d.operands = operands;
  registry()[name] = d;
}

// "opf_name(a, b)" for a helper defined in both preludes.
std::function<std::string(const CArgs&, const Node&)> helper(const std::string& fn) {
  return [fn](const CArgs& a, const Node&) {
    std::string s = fn + "(";
    for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + a[i];
    return s + ")";
  };
}
std::function<std::string(const CArgs&, const Node&)> infix(const std::string& op) {
  return [op](const CArgs& a, const Node&) { return "(" + a[0] + " " + op + " " + a[1] + ")"; };
}

double gelu_erf(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
double gelu_tanh(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
// d/dx gelu(x): the backward of both approximations, as PyTorch's gelu_backward.
double gelu_erf_grad(double x) {
  return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
}
double gelu_tanh_grad(double x) {
  const double k = std::sqrt(2.0 / M_PI), c = 0.044715;
  double t = std::tanh(k * (x + c * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * c * x * x);
}
double fmax_nan(double a, double b) { return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b); }
double fmin_nan(double a, double b) { return (std::isnan(a) || std::isnan(b)) ? NAN : std::min(a, b); }

void register_elementwise() {
  def_elementwise("add", 2, DRule::Promote, [](const Args& a, const Node&) { return a[0] + a[1]; }, infix("+"));
  def_elementwise("sub", 2, DRule::Promote, [](const Args& a, const Node&) { return a[0] - a[1]; }, infix("-"));
  def_elementwise("mul", 2, DRule::Promote, [](const Args& a, const Node&) { return a[0] * a[1]; }, infix("*"));
  // div: rounding_mode "true" (default, float result), "floor" or "trunc".
  {
    OpDef d;
    d.name = "div";
    d.kind = OpKind::Elementwise;
    d.min_inputs = d.max_inputs = 2;
    d.infer = [](const Graph& g, Node& n) {
      n.shape = broadcast_shapes(input_shapes(g, n), n.where());
      std::string mode = n.get_str("rounding_mode", "true");
      if (mode != "true" && mode != "floor" && mode != "trunc")
        throw GraphError(n.where() + ": rounding_mode must be true, floor or trunc, not '" + mode + "'");
      DType t = result_type(g, n.inputs);
      n.dtype = mode == "true" ? to_float(t) : t;
    };
    d.scalar = [](const Args& a, const Node& n) {
      std::string mode = n.get_str("rounding_mode", "true");
      if (mode != "true" && !is_floating(n.dtype) && a[1] == 0) throw GraphError("ZeroDivisionError");
      double q = a[0] / a[1];
      if (mode == "floor") return is_floating(n.dtype) ? std::floor(q) : std::floor(q);
      if (mode == "trunc") return std::trunc(q);
      return q;
    };
    d.c_expr = [](const CArgs& a, const Node& n) {
      std::string mode = n.get_str("rounding_mode", "true");
      if (mode == "floor") return "opf_floordiv(" + a[0] + ", " + a[1] + ")";
      if (mode == "trunc") return "opf_truncdiv(" + a[0] + ", " + a[1] + ")";
      return "(" + a[0] + " / " + a[1] + ")";
    };
    registry()[d.name] = d;
  }
  def_elementwise("neg", 1, DRule::Same, [](const Args& a, const Node&) { return -a[0]; },
                  [](const CArgs& a, const Node&) { return "(-" + a[0] + ")"; });
  def_elementwise("abs", 1, DRule::Same, [](const Args& a, const Node&) { return std::fabs(a[0]); }, helper("opf_abs"));
  def_elementwise("reciprocal", 1, DRule::Float, [](const Args& a, const Node&) { return 1.0 / a[0]; },
                  [](const CArgs& a, const Node& n) { return std::string(n.dtype == DType::Float64 ? "(1.0 / " : "(1.0f / ") + a[0] + ")"; });
  def_elementwise("exp", 1, DRule::Float, [](const Args& a, const Node&) { return std::exp(a[0]); }, helper("opf_exp"), 8);
  def_elementwise("log", 1, DRule::Float, [](const Args& a, const Node&) { return std::log(a[0]); }, helper("opf_log"), 8);
  def_elementwise("log1p", 1, DRule::Float, [](const Args& a, const Node&) { return std::log1p(a[0]); }, helper("opf_log1p"), 8);
  def_elementwise("expm1", 1, DRule::Float, [](const Args& a, const Node&) { return std::expm1(a[0]); }, helper("opf_expm1"), 8);
  def_elementwise("sqrt", 1, DRule::Float, [](const Args& a, const Node&) { return std::sqrt(a[0]); }, helper("opf_sqrt"), 4);
  def_elementwise("rsqrt", 1, DRule::Float, [](const Args& a, const Node&) { return 1.0 / std::sqrt(a[0]); }, helper("opf_rsqrt"), 4);
  def_elementwise("pow", 2, DRule::Promote, [](const Args& a, const Node&) { return std::pow(a[0], a[1]); }, helper("opf_pow"), 16);
  def_elementwise("relu", 1, DRule::Same, [](const Args& a, const Node&) { return std::isnan(a[0]) ? a[0] : std::max(a[0], 0.0); }, helper("opf_relu"));
  def_elementwise("gelu", 1, DRule::Float,
                  [](const Args& a, const Node& n) { return n.get_str("approximate", "none") == "tanh" ? gelu_tanh(a[0]) : gelu_erf(a[0]); },
                  [](const CArgs& a, const Node& n) {
                    return (n.get_str("approximate", "none") == "tanh" ? "opf_gelu_tanh(" : "opf_gelu_erf(") + a[0] + ")";
                  }, 16);
  // gelu_backward(grad, x): grad * gelu'(x), kept whole (not decomposed) so
  // that the planner can give it to a GEMM's DGELU epilogue.
  def_elementwise("gelu_backward", 2, DRule::PromoteFloat,
                  [](const Args& a, const Node& n) {
                    return a[0] * (n.get_str("approximate", "none") == "tanh" ? gelu_tanh_grad(a[1]) : gelu_erf_grad(a[1]));
                  },
                  [](const CArgs& a, const Node& n) {
                    return (n.get_str("approximate", "none") == "tanh" ? "opf_gelu_tanh_backward(" : "opf_gelu_erf_backward(") +
                           a[0] + ", " + a[1] + ")";
                  }, 24);
  def_elementwise("silu", 1, DRule::Float, [](const Args& a, const Node&) { return a[0] / (1.0 + std::exp(-a[0])); }, helper("opf_silu"), 10);
  def_elementwise("sigmoid", 1, DRule::Float, [](const Args& a, const Node&) { return 1.0 / (1.0 + std::exp(-a[0])); }, helper("opf_sigmoid"), 10);
  def_elementwise("tanh", 1, DRule::Float, [](const Args& a, const Node&) { return std::tanh(a[0]); }, helper("opf_tanh"), 10);
  def_elementwise("erf", 1, DRule::Float, [](const Args& a, const Node&) { return std::erf(a[0]); }, helper("opf_erf"), 10);
  def_elementwise("sin", 1, DRule::Float, [](const Args& a, const Node&) { return std::sin(a[0]); }, helper("opf_sin"), 10);
  def_elementwise("cos", 1, DRule::Float, [](const Args& a, const Node&) { return std::cos(a[0]); }, helper("opf_cos"), 10);
  def_elementwise("sign", 1, DRule::Same, [](const Args& a, const Node&) { return std::isnan(a[0]) ? a[0] : (a[0] > 0) - (a[0] < 0); }, helper("opf_sign"));
  def_elementwise("maximum", 2, DRule::Promote, [](const Args& a, const Node&) { return fmax_nan(a[0], a[1]); }, helper("opf_maximum"));
  def_elementwise("minimum", 2, DRule::Promote, [](const Args& a, const Node&) { return fmin_nan(a[0], a[1]); }, helper("opf_minimum"));
  // clamp with optional scalar bounds in attributes `min` and `max`.
  def_elementwise("clamp", 1, DRule::Same,
                  [](const Args& a, const Node& n) {
                    double v = a[0];
                    if (std::isnan(v)) return v;
                    if (n.has("min")) v = std::max(v, n.get_float("min"));
                    if (n.has("max")) v = std::min(v, n.get_float("max"));
                    return v;
                  },
                  [](const CArgs& a, const Node& n) {
                    auto lit = [&](double v) {
                      char buf[64];
                      std::snprintf(buf, sizeof buf, "%.17g", v);
                      std::string s = buf;
                      if (!is_floating(n.dtype)) return "(" + s + ")";
                      if (s.find_first_of(".en") == std::string::npos) s += ".0";
                      return n.dtype == DType::Float64 ? s : s + "f";
                    };
                    std::string v = a[0];
                    if (n.has("min")) v = "opf_clamp_min(" + v + ", " + lit(n.get_float("min")) + ")";
                    if (n.has("max")) v = "opf_clamp_max(" + v + ", " + lit(n.get_float("max")) + ")";
                    return v;
                  });
  def_elementwise("where", 3, DRule::Where, [](const Args& a, const Node&) { return a[0] != 0 ? a[1] : a[2]; },
                  [](const CArgs& a, const Node&) { return "(" + a[0] + " ? " + a[1] + " : " + a[2] + ")"; }, 1,
                  OperandType::Own);
  const std::pair<const char*, const char*> cmps[] = {{"eq", "=="}, {"ne", "!="}, {"lt", "<"}, {"le", "<="}, {"gt", ">"}, {"ge", ">="}};
  for (auto& [name, op] : cmps) {
    std::string o = op;
    def_elementwise(name, 2, DRule::Bool,
                    [o](const Args& a, const Node&) {
                      if (o == "==") return double(a[0] == a[1]);
                      if (o == "!=") return double(a[0] != a[1]);
                      if (o == "<") return double(a[0] < a[1]);
                      if (o == "<=") return double(a[0] <= a[1]);
                      if (o == ">") return double(a[0] > a[1]);
                      return double(a[0] >= a[1]);
                    },
                    infix(o), 1, OperandType::Common);
  }
  def_elementwise("logical_and", 2, DRule::Bool, [](const Args& a, const Node&) { return double(a[0] != 0 && a[1] != 0); },
                  [](const CArgs& a, const Node&) { return "((" + a[0] + " != 0) && (" + a[1] + " != 0))"; }, 1, OperandType::Own);
  def_elementwise("logical_or", 2, DRule::Bool, [](const Args& a, const Node&) { return double(a[0] != 0 || a[1] != 0); },
                  [](const CArgs& a, const Node&) { return "((" + a[0] + " != 0) || (" + a[1] + " != 0))"; }, 1, OperandType::Own);
  def_elementwise("logical_xor", 2, DRule::Bool, [](const Args& a, const Node&) { return double((a[0] != 0) != (a[1] != 0)); },
                  [](const CArgs& a, const Node&) { return "((" + a[0] + " != 0) != (" + a[1] + " != 0))"; }, 1, OperandType::Own);
  def_elementwise("logical_not", 1, DRule::Bool, [](const Args& a, const Node&) { return double(a[0] == 0); },
                  [](const CArgs& a, const Node&) { return "(" + a[0] + " == 0)"; }, 1, OperandType::Own);
  def_elementwise("isnan", 1, DRule::Bool, [](const Args& a, const Node&) { return double(std::isnan(a[0])); },
                  helper("opf_isnan"), 1, OperandType::Own);
  // cast: to the dtype in attribute `dtype`; the emitter writes the conversion.
  def_elementwise("cast", 1, DRule::Cast, [](const Args& a, const Node&) { return a[0]; },
                  [](const CArgs& a, const Node&) { return a[0]; }, 0, OperandType::Own);
}

void def_source() {
  OpDef in;
  in.name = "input";
  in.kind = OpKind::Source;
  in.infer = [](const Graph&, Node&) {};
  registry()["input"] = in;
  OpDef sc = in;
  sc.name = "scalar";
  registry()["scalar"] = sc;
  // full: a tensor of `shape` filled with `value` (dtype in `dtype`).
  OpDef f;
  f.name = "full";
  f.kind = OpKind::Elementwise;
  f.infer = [](const Graph&, Node& n) {
    n.shape = n.get_shape("shape");
    n.dtype = n.get_dtype("dtype");
  };
  f.scalar = [](const Args&, const Node& n) { return n.get_float("value"); };
  f.c_expr = [](const CArgs&, const Node&) { return std::string("@value"); };  // the emitter writes the literal
  f.flops = 0;
  registry()["full"] = f;
}

void def_reductions() {
  for (const char* name : {"sum", "mean", "amax", "amin", "prod", "var", "argmax", "argmin"}) {
    OpDef d;
    d.name = name;
    d.kind = OpKind::Reduction;
    d.min_inputs = d.max_inputs = 1;
    std::string nm = name;
    d.infer = [nm](const Graph& g, Node& n) {
      const Node& x = g.node(n.inputs[0]);
      auto dims = reduction_dims(n, x.rank());
      if ((nm == "argmax" || nm == "argmin") && n.has("dims") && n.get_ints("dims").size() > 1)
        throw GraphError(n.where() + ": reduces at most one dim");
      bool keep = n.get_bool("keepdim", false);
      n.shape.clear();
      for (int64_t i = 0; i < x.rank(); ++i) {
        bool red = std::find(dims.begin(), dims.end(), i) != dims.end();
        if (!red) n.shape.push_back(x.shape[static_cast<size_t>(i)]);
        else if (keep) n.shape.push_back(cst(1));
      }
      if (nm == "argmax" || nm == "argmin") n.dtype = DType::Int64;
      else if (nm == "sum" || nm == "prod") n.dtype = dtype_category(x.dtype) < 2 ? DType::Int64 : x.dtype;
      else if (nm == "mean" || nm == "var") {
        if (!is_floating(x.dtype)) throw GraphError(n.where() + ": needs a floating input, got " + dtype_name(x.dtype));
        n.dtype = x.dtype;
      } else n.dtype = x.dtype;
      if (n.has("dtype")) n.dtype = n.get_dtype("dtype");
    };
    registry()[name] = d;
  }
}

// column_partials: the first step of a sum over the leading dims `dims`
// (= [0, k)) split in two. out[p, rest...] sums x over the leading index i
// (flattened) with i % parts == p; the sum over dim 0 of it finishes the
// reduction. Made by the split_column_sums pass so that a row kernel over
// the same domain can compute the partials while it reads the rows (a
// layer_norm backward's weight and bias gradients beside dx).
void def_column_partials() {
  OpDef d;
  d.name = "column_partials";
  d.kind = OpKind::Reduction;
  d.min_inputs = d.max_inputs = 1;
  d.infer = [](const Graph& g, Node& n) {
    const Node& x = g.node(n.inputs[0]);
    auto dims = reduction_dims(n, x.rank());
    for (size_t i = 0; i < dims.size(); ++i)
      if (dims[i] != static_cast<int64_t>(i)) throw GraphError(n.where() + ": 'dims' must be the leading dims");
    if (dims.empty() || static_cast<int64_t>(dims.size()) >= x.rank())
      throw GraphError(n.where() + ": needs at least one kept trailing dim and one reduced leading dim");
    int64_t parts = n.get_int("parts");
    if (parts < 1) throw GraphError(n.where() + ": 'parts' must be positive");
    if (!is_floating(x.dtype)) throw GraphError(n.where() + ": needs a floating input");
    n.shape = {cst(parts)};
    for (size_t i = dims.size(); i < x.shape.size(); ++i) n.shape.push_back(x.shape[i]);
    n.dtype = x.dtype == DType::Float64 ? DType::Float64 : DType::Float32;
  };
  registry()["column_partials"] = d;
}

void def_layout() {
  auto def = [](const std::string& name, OpKind kind, int lo, int hi, std::function<void(const Graph&, Node&)> f) {
    OpDef d;
    d.name = name;
    d.kind = kind;
    d.min_inputs = lo;
    d.max_inputs = hi;
    d.flops = 0;
    d.infer = [f](const Graph& g, Node& n) {
      f(g, n);
      if (n.op != "cat") n.dtype = g.node(n.inputs[0]).dtype;
    };
    registry()[name] = d;
  };
  def("copy", OpKind::Layout, 1, 1, [](const Graph& g, Node& n) { n.shape = g.node(n.inputs[0]).shape; });
  // A negative constant left in a shape attribute (a -1 where none is allowed).
  auto no_negative = [](const Node& n) {
    for (const Expr& d : n.shape) {
      int64_t c = 0;
      if (is_const(d, &c) && c < 0) throw GraphError(n.where() + ": size " + std::to_string(c) + " in 'shape' " + shape_to_string(n.shape));
    }
  };
  def("reshape", OpKind::Layout, 1, 1, [no_negative](const Graph& g, Node& n) {
    const Node& x = g.node(n.inputs[0]);
    n.shape = n.get_shape("shape");
    // One -1 dim, as in PyTorch: the elements the others leave, where that
    // quotient is exact for every size (4*s0 elements as [-1, 2]: 2*s0).
    int inferred = -1;
    for (size_t i = 0; i < n.shape.size(); ++i) {
      int64_t c = 0;
      if (!is_const(n.shape[i], &c) || c != -1) continue;
      if (inferred >= 0) throw GraphError(n.where() + ": only one dim of 'shape' may be -1");
      inferred = static_cast<int>(i);
    }
    if (inferred >= 0) {
      Expr rest = cst(1);
      for (size_t i = 0; i < n.shape.size(); ++i)
        if (static_cast<int>(i) != inferred) rest = rest * n.shape[i];
      n.shape[static_cast<size_t>(inferred)] = floordiv(numel(x.shape), rest);
    }
    no_negative(n);
    if (!expr_equal(numel(n.shape), numel(x.shape)))
      throw GraphError(n.where() + ": cannot reshape " + shape_to_string(x.shape) + " (" + to_string(numel(x.shape)) +
                       " elements) to " + shape_to_string(n.shape));
  });
  def("permute", OpKind::Layout, 1, 1, [](const Graph& g, Node& n) {
    const Node& x = g.node(n.inputs[0]);
    auto dims = n.get_ints("dims");
    if (static_cast<int>(dims.size()) != x.rank()) throw GraphError(n.where() + ": 'dims' must list every dim once");
    std::vector<bool> seen(dims.size(), false);
    n.shape.clear();
    for (auto d : dims) {
      d = normalize_dim(d, x.rank(), n);
      if (seen[static_cast<size_t>(d)]) throw GraphError(n.where() + ": 'dims' must list every dim once");
      seen[static_cast<size_t>(d)] = true;
      n.shape.push_back(x.shape[static_cast<size_t>(d)]);
    }
  });
  def("expand", OpKind::Broadcast, 1, 1, [no_negative](const Graph& g, Node& n) {
    const Node& x = g.node(n.inputs[0]);
    n.shape = n.get_shape("shape");
    if (n.shape.size() < x.shape.size()) throw GraphError(n.where() + ": cannot expand to fewer dims");
    size_t off = n.shape.size() - x.shape.size();
    for (size_t i = 0; i < x.shape.size(); ++i) {
      int64_t c;
      if (is_const(n.shape[off + i], &c) && c == -1) n.shape[off + i] = x.shape[i];  // -1 keeps the size, as in PyTorch
      if (is_const(x.shape[i], &c) && c == 1) continue;
      if (!expr_equal(x.shape[i], n.shape[off + i]))
        throw GraphError(n.where() + ": cannot expand size " + to_string(x.shape[i]) + " to " + to_string(n.shape[off + i]));
    }
    no_negative(n);
  });
  def("squeeze", OpKind::Layout, 1, 1, [](const Graph& g, Node& n) {
    const Node& x = g.node(n.inputs[0]);
    std::vector<int64_t> dims = n.has("dims") ? n.get_ints("dims") : std::vector<int64_t>{};
    for (auto& d : dims) d = normalize_dim(d, x.rank(), n);
    n.shape.clear();
    for (int64_t i = 0; i < x.rank(); ++i) {
      int64_t c = -1;
      bool one = is_const(x.shape[static_cast<size_t>(i)], &c) && c == 1;
      bool listed = dims.empty() || std::find(dims.begin(), dims.end(), i) != dims.end();
      if (!(one && listed)) n.shape.push_back(x.shape[static_cast<size_t>(i)]);
    }
  });
  def("unsqueeze", OpKind::Layout, 1, 1, [](const Graph& g, Node& n) {
    const Node& x = g.node(n.inputs[0]);
    int64_t d = normalize_dim(n.get_int("dim"), x.rank() + 1, n);
    n.shape = x.shape;
    n.shape.insert(n.shape.begin() + d, cst(1));
  });
  // slice along `dim` from `start` to `end` (clamped to the size) by `step`.
  def("slice", OpKind::Layout, 1, 1, [](const Graph& g, Node& n) {
    const Node& x = g.node(n.inputs[0]);
    int64_t d = normalize_dim(n.get_int("dim"), x.rank(), n);
    int64_t step = n.get_int("step", 1);
    if (step <= 0) throw GraphError(n.where() + ": step must be positive");
    auto [start, end] = slice_bounds(n, x.shape[static_cast<size_t>(d)]);
    n.shape = x.shape;
    n.shape[static_cast<size_t>(d)] = floordiv(end - start + cst(step - 1), cst(step));
  });
  // slice_scatter(base, src): base with the slice (dim, start, end, step)
  // replaced by src, which has that slice's shape (a strided slice's
  // backward; step 1 the frontend writes as a cat of base's parts).
  def("slice_scatter", OpKind::Layout, 2, 2, [](const Graph& g, Node& n) {
    const Node& base = g.node(n.inputs[0]);
    const Node& src = g.node(n.inputs[1]);
    int64_t d = normalize_dim(n.get_int("dim"), base.rank(), n);
    int64_t step = n.get_int("step", 1);
    if (step <= 0) throw GraphError(n.where() + ": step must be positive");
    auto [start, end] = slice_bounds(n, base.shape[static_cast<size_t>(d)]);
    Shape want = base.shape;
    want[static_cast<size_t>(d)] = floordiv(end - start + cst(step - 1), cst(step));
    if (!same_shape(src.shape, want))
      throw GraphError(n.where() + ": src has shape " + shape_to_string(src.shape) + " but the slice is " +
                       shape_to_string(want));
    n.shape = base.shape;
  });
  def("cat", OpKind::Layout, 1, -1, [](const Graph& g, Node& n) {
    const Node& x = g.node(n.inputs[0]);
    int64_t d = normalize_dim(n.get_int("dim"), x.rank(), n);
    n.shape = x.shape;
    Expr total = cst(0);
    std::vector<int> ins;
    for (int i : n.inputs) ins.push_back(i);
    for (int i : n.inputs) {
      const Node& y = g.node(i);
      if (y.rank() != x.rank()) throw GraphError(n.where() + ": inputs must have the same rank");
      for (int64_t k = 0; k < x.rank(); ++k)
        if (k != d && !expr_equal(y.shape[static_cast<size_t>(k)], x.shape[static_cast<size_t>(k)]))
          throw GraphError(n.where() + ": sizes differ outside the cat dim at dim " + std::to_string(k));
      total = total + y.shape[static_cast<size_t>(d)];
    }
    n.shape[static_cast<size_t>(d)] = total;
    n.dtype = result_type(g, ins);
  });
}

void def_composite() {
  auto def = [](const std::string& name, int lo, int hi, std::function<void(const Graph&, Node&)> f,
                std::function<int(Graph&, const Node&)> dec, double flops) {
    OpDef d;
    d.name = name;
    d.kind = OpKind::Composite;
    d.min_inputs = lo;
    d.max_inputs = hi;
    d.infer = f;
    d.decompose = dec;
    d.flops = flops;
    registry()[name] = d;
  };
  auto same_as_first = [](const Graph& g, Node& n) {
    const Node& x = g.node(n.inputs[0]);
    if (!is_floating(x.dtype)) throw GraphError(n.where() + ": needs a floating input, got " + dtype_name(x.dtype));
    n.shape = x.shape;
    n.dtype = x.dtype;
    for (size_t i = 1; i < n.inputs.size(); ++i) {
      const Node& y = g.node(n.inputs[i]);
      // Every further input must broadcast to the first one's shape.
      Shape b = broadcast_shapes({x.shape, y.shape}, n.where());
      if (b.size() != x.shape.size()) throw GraphError(n.where() + ": input " + std::to_string(i) + " has too many dims");
      for (size_t k = 0; k < b.size(); ++k)
        if (!expr_equal(b[k], x.shape[k]))
          throw GraphError(n.where() + ": input " + std::to_string(i) + " of shape " + shape_to_string(y.shape) +
                           " does not broadcast to " + shape_to_string(x.shape));
    }
    if (n.has("dim")) normalize_dim(n.get_int("dim"), x.rank(), n);
    if (n.has("normalized_ndim") && (n.get_int("normalized_ndim") < 1 || n.get_int("normalized_ndim") > x.rank()))
      throw GraphError(n.where() + ": normalized_ndim must be between 1 and the rank");
  };
  // The statistics of a norm (`layer_norm_stats` with which=mean|rstd,
  // `rms_norm_rstd`) keep the normalised dims as size 1.
  auto stats_shape = [same_as_first](const Graph& g, Node& n) {
    same_as_first(g, n);
    int64_t nd = n.get_int("normalized_ndim");
    for (int64_t k = n.rank() - nd; k < n.rank(); ++k) n.shape[static_cast<size_t>(k)] = cst(1);
    n.dtype = n.dtype == DType::Float64 ? DType::Float64 : DType::Float32;
    if (n.has("which") && n.get_str("which", "") != "mean" && n.get_str("which", "") != "rstd")
      throw GraphError(n.where() + ": 'which' must be mean or rstd");
  };
  def("softmax", 1, 1, same_as_first, decompose_softmax, 5);
  def("log_softmax", 1, 1, same_as_first, decompose_log_softmax, 5);
  def("layer_norm", 1, 3, same_as_first, decompose_layer_norm, 8);
  def("layer_norm_stats", 1, 1, stats_shape, decompose_layer_norm_stats, 5);
  def("rms_norm", 1, 2, same_as_first, decompose_rms_norm, 5);
  def("rms_norm_rstd", 1, 1, stats_shape, decompose_rms_norm_rstd, 3);
  def("softmax_backward", 2, 2, same_as_first, decompose_softmax_backward, 4);
  def("log_softmax_backward", 2, 2, same_as_first, decompose_log_softmax_backward, 4);
  def("layer_norm_backward", 4, 5, same_as_first, decompose_layer_norm_backward, 12);
  def("rms_norm_backward", 3, 4, same_as_first, decompose_rms_norm_backward, 10);
}

// matmul: [M, K] @ [K, N] -> [M, N], or batched [B, M, K] @ [B, K, N]
// (PyTorch's mm and bmm; linear and addmm reach the IR as mm plus adds).
// Both operands have one dtype, as PyTorch requires.
void def_gemm() {
  OpDef d;
  d.name = "matmul";
  d.kind = OpKind::Gemm;
  d.min_inputs = d.max_inputs = 2;
  d.flops = 0;  // 2*K per output element: estimate_cost counts it from the shapes
  d.infer = [](const Graph& g, Node& n) {
    const Node& a = g.node(n.inputs[0]);
    const Node& b = g.node(n.inputs[1]);
    if (a.rank() != b.rank() || (a.rank() != 2 && a.rank() != 3))
      throw GraphError(n.where() + ": needs two matrices or two batches of matrices, got " + shape_to_string(a.shape) +
                       " and " + shape_to_string(b.shape));
    if (a.dtype != b.dtype)
      throw GraphError(n.where() + ": operands have different dtypes (" + dtype_name(a.dtype) + ", " + dtype_name(b.dtype) + ")");
    if (!is_floating(a.dtype)) throw GraphError(n.where() + ": needs floating operands, got " + dtype_name(a.dtype));
    size_t r = a.shape.size();
    if (!expr_equal(a.shape[r - 1], b.shape[r - 2]))
      throw GraphError(n.where() + ": inner sizes differ: " + shape_to_string(a.shape) + " @ " + shape_to_string(b.shape));
    if (r == 3 && !expr_equal(a.shape[0], b.shape[0]))
      throw GraphError(n.where() + ": batch sizes differ: " + shape_to_string(a.shape) + " @ " + shape_to_string(b.shape));
    n.shape = a.shape;
    n.shape[r - 1] = b.shape[r - 1];
    n.dtype = a.dtype;
  };
  registry()["matmul"] = d;
}

bool registered = [] {
  def_source();
  def_gemm();
  register_elementwise();
  def_reductions();
  def_column_partials();
  def_layout();
  def_composite();
  return true;
}();

}  // namespace

const OpDef* find_op(const std::string& name) {
  (void)registered;
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : &it->second;
}

const OpDef& op_def(const Node& n) {
  const OpDef* d = find_op(n.op);
  if (!d) throw GraphError(n.where() + ": unknown op '" + n.op + "'");
  return *d;
}

std::vector<std::string> op_names() {
  (void)registered;
  std::vector<std::string> r;
  for (auto& [k, v] : registry()) r.push_back(k);
  return r;
}

void infer_type(const Graph& g, Node& n) {
  const OpDef& d = op_def(n);
  int k = static_cast<int>(n.inputs.size());
  if (k < d.min_inputs || (d.max_inputs >= 0 && k > d.max_inputs))
    throw GraphError(n.where() + ": takes " +
                     (d.min_inputs == d.max_inputs ? std::to_string(d.min_inputs)
                                                   : std::to_string(d.min_inputs) + " to " +
                                                         (d.max_inputs < 0 ? std::string("any") : std::to_string(d.max_inputs))) +
                     " inputs, got " + std::to_string(k));
  d.infer(g, n);
}

}  // namespace opfuse
