// The reference oracle for primitive ops (composite ops: evaluate_composite.cpp).
//
// Every value is a double; every node's result is rounded to the node's
// dtype with round_to_dtype, so a bf16 node holds exactly what a bf16 tensor
// could. Elementwise ops convert their operands first (OpDef::operands): to
// the compute type of the result (half types compute in float32, as
// PyTorch's kernels do, so a Python float meets a float16 tensor as a
// float32), to the compute type of the inputs' common type (comparisons),
// or not at all (casts, where, logical ops). codegen/lower.cpp converts the
// same way. (PyTorch's CPU comparison kernels differ in one corner: they
// round a Python float to float16 before comparing it with a float16 tensor.)
#include "ir/evaluate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ir/evaluate_internal.h"
#include "ir/ops.h"

namespace opfuse {

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace eval_detail {
namespace {

int64_t product(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

// The offsets Σ idx[k] * strides[k] of every index of `sizes`, row-major.
std::vector<int64_t> offsets(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  std::vector<int64_t> out(static_cast<size_t>(product(sizes)));
  std::vector<int64_t> idx(sizes.size(), 0);
  int64_t off = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = off;
    for (size_t k = sizes.size(); k-- > 0;) {
      if (++idx[k] < sizes[k]) { off += strides[k]; break; }
      off -= strides[k] * (sizes[k] - 1);
      idx[k] = 0;
    }
  }
  return out;
}

// in[base + Σ idx[k] * strides[k]] for every index of `sizes`: the one
// index map behind permute, expand, slice and broadcasting.
std::vector<double> gather(const std::vector<double>& in, const std::vector<int64_t>& sizes,
                           const std::vector<int64_t>& strides, int64_t base) {
  std::vector<int64_t> offs = offsets(sizes, strides);
  std::vector<double> out(offs.size());
  for (size_t i = 0; i < offs.size(); ++i) out[i] = in[static_cast<size_t>(base + offs[i])];
  return out;
}

}  // namespace

std::vector<int64_t> row_major_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (size_t k = shape.size(); k-- > 1;) s[k - 1] = s[k] * shape[k];
  return s;
}

std::vector<double> broadcast_values(const HostTensor& t, const std::vector<int64_t>& shape, const Node& n) {
  auto fail = [&] {
    std::string a, b;
    for (int64_t d : t.shape) a += (a.empty() ? "" : ", ") + std::to_string(d);
    for (int64_t d : shape) b += (b.empty() ? "" : ", ") + std::to_string(d);
    throw GraphError(n.where() + ": a value of shape [" + a + "] does not broadcast to [" + b + "]");
  };
  if (t.shape.size() > shape.size()) fail();
  std::vector<int64_t> in_strides = row_major_strides(t.shape);
  std::vector<int64_t> strides(shape.size(), 0);
  size_t off = shape.size() - t.shape.size();
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (t.shape[i] == shape[off + i]) strides[off + i] = in_strides[i];
    else if (t.shape[i] != 1) fail();
  }
  return gather(t.data, shape, strides, 0);
}

}  // namespace eval_detail

namespace {

using eval_detail::broadcast_values;
using eval_detail::gather;
using eval_detail::offsets;
using eval_detail::product;
using eval_detail::row_major_strides;
using Values = std::vector<double>;

// Rounds every value to out's dtype and stores it.
void store(HostTensor& out, Values values) {
  if (static_cast<int64_t>(values.size()) != out.numel())
    throw GraphError("internal error: oracle produced " + std::to_string(values.size()) + " values for " +
                     std::to_string(out.numel()) + " elements");
  for (double& v : values) v = round_to_dtype(v, out.dtype);
  out.data = std::move(values);
}

std::vector<int64_t> concrete_shape(const Node& n, const Shape& s, const SymbolValues& syms) {
  std::vector<int64_t> r;
  for (const Expr& e : s) {
    try {
      r.push_back(evaluate(e, syms));
    } catch (const std::runtime_error& err) {
      throw GraphError(n.where() + ": cannot evaluate size " + to_string(e) + ": " + err.what());
    }
    if (r.back() < 0) throw GraphError(n.where() + ": size " + to_string(e) + " is negative (" + std::to_string(r.back()) + ")");
  }
  return r;
}

// ---- elementwise -----------------------------------------------------------

void eval_elementwise(const Graph& g, const Node& n, const OpDef& def, const std::vector<const HostTensor*>& in,
                      HostTensor& out) {
  if (n.op == "full") {
    store(out, Values(static_cast<size_t>(out.numel()), n.get_float("value")));
    return;
  }
  bool convert = def.operands != OperandType::Own;
  DType operand_type = compute_dtype(def.operands == OperandType::Common ? result_type(g, n.inputs) : n.dtype);
  std::vector<Values> args;
  for (const HostTensor* t : in) args.push_back(broadcast_values(*t, out.shape, n));
  Values result(static_cast<size_t>(out.numel()));
  std::vector<double> a(args.size());
  for (size_t i = 0; i < result.size(); ++i) {
    for (size_t k = 0; k < args.size(); ++k) a[k] = convert ? round_to_dtype(args[k][i], operand_type) : args[k][i];
    result[i] = def.scalar(a, n);
  }
  store(out, std::move(result));
}

// ---- reductions ------------------------------------------------------------

double reduce_one(const std::string& op, const Node& n, const Values& x) {
  double count = static_cast<double>(x.size());
  if (op == "sum" || op == "mean") {
    double s = 0;
    for (double v : x) s += v;
    return op == "sum" ? s : s / count;  // mean of nothing: 0/0 = NaN, as in PyTorch
  }
  if (op == "prod") {
    double p = 1;
    for (double v : x) p *= v;
    return p;
  }
  if (op == "var") {
    double mean = 0;
    for (double v : x) mean += v;
    mean /= count;
    double ss = 0;
    for (double v : x) ss += (v - mean) * (v - mean);
    return ss / std::max(0.0, count - n.get_float("correction", 1));
  }
  if (x.empty()) throw GraphError(n.where() + ": " + op + " of an empty set of elements is undefined");
  bool is_max = op == "amax" || op == "argmax";
  // The first NaN wins; otherwise the first strictly better value.
  size_t best = 0;
  for (size_t i = 1; i < x.size() && !std::isnan(x[best]); ++i)
    if (std::isnan(x[i]) || (is_max ? x[i] > x[best] : x[i] < x[best])) best = i;
  if (op == "argmax" || op == "argmin") return static_cast<double>(best);
  return x[best];
}

void eval_reduction(const Node& n, const HostTensor& x, HostTensor& out) {
  int64_t rank = static_cast<int64_t>(x.shape.size());
  std::vector<int64_t> dims = reduction_dims(n, rank);
  std::vector<int64_t> strides = row_major_strides(x.shape);
  std::vector<int64_t> kept_sizes, kept_strides, red_sizes, red_strides;
  for (int64_t k = 0; k < rank; ++k) {
    bool reduced = std::find(dims.begin(), dims.end(), k) != dims.end();
    (reduced ? red_sizes : kept_sizes).push_back(x.shape[static_cast<size_t>(k)]);
    (reduced ? red_strides : kept_strides).push_back(strides[static_cast<size_t>(k)]);
  }
  std::vector<int64_t> outer = offsets(kept_sizes, kept_strides), inner = offsets(red_sizes, red_strides);
  Values result(outer.size()), group(inner.size());
  for (size_t o = 0; o < outer.size(); ++o) {
    for (size_t r = 0; r < inner.size(); ++r) group[r] = x.data[static_cast<size_t>(outer[o] + inner[r])];
    result[o] = reduce_one(n.op, n, group);
  }
  store(out, std::move(result));
}

// column_partials (ops.cpp): leading index i goes to part i % parts.
void eval_column_partials(const Node& n, const HostTensor& x, HostTensor& out) {
  int64_t rank = static_cast<int64_t>(x.shape.size());
  size_t lead = reduction_dims(n, rank).size();
  int64_t outer = 1, inner = 1;
  for (size_t i = 0; i < x.shape.size(); ++i) (i < lead ? outer : inner) *= x.shape[i];
  int64_t parts = n.get_int("parts");
  Values result(static_cast<size_t>(parts * inner), 0.0);
  for (int64_t i = 0; i < outer; ++i)
    for (int64_t c = 0; c < inner; ++c)
      result[static_cast<size_t>((i % parts) * inner + c)] += x.data[static_cast<size_t>(i * inner + c)];
  store(out, std::move(result));
}

// ---- layout ----------------------------------------------------------------

void eval_layout(const Node& n, const std::vector<const HostTensor*>& in, HostTensor& out, const SymbolValues& syms) {
  const HostTensor& x = *in[0];
  int64_t rank = static_cast<int64_t>(x.shape.size());
  const std::string& op = n.op;
  if (op == "copy" || op == "reshape" || op == "squeeze" || op == "unsqueeze") {
    // Row-major data is unchanged by these; only the shape differs.
    if (out.numel() != x.numel())
      throw GraphError(n.where() + ": " + std::to_string(x.numel()) + " elements cannot become " +
                       std::to_string(out.numel()));
    store(out, x.data);
  } else if (op == "permute") {
    std::vector<int64_t> in_strides = row_major_strides(x.shape), strides;
    for (int64_t d : n.get_ints("dims")) strides.push_back(in_strides[static_cast<size_t>(normalize_dim(d, rank, n))]);
    store(out, gather(x.data, out.shape, strides, 0));
  } else if (op == "expand") {
    store(out, broadcast_values(x, out.shape, n));
  } else if (op == "slice") {
    // The same clamping as the shape rule in ops.cpp, on concrete numbers.
    size_t d = static_cast<size_t>(normalize_dim(n.get_int("dim"), rank, n));
    int64_t size = x.shape[d], step = n.get_int("step", 1);
    auto [start_expr, end_expr] = slice_bounds(n, cst(size));  // bounds may be size expressions
    int64_t start = evaluate(start_expr, syms), end = evaluate(end_expr, syms);
    int64_t len = (end - start + step - 1) / step;
    if (len != out.shape[d])
      throw GraphError(n.where() + ": slice gives " + std::to_string(len) + " elements but the node's size is " +
                       std::to_string(out.shape[d]));
    std::vector<int64_t> strides = row_major_strides(x.shape);
    int64_t base = start * strides[d];
    strides[d] *= step;
    store(out, gather(x.data, out.shape, strides, base));
  } else if (op == "slice_scatter") {
    // base's values, then src's at start, start + step, ... along dim.
    const HostTensor& src = *in[1];
    size_t d = static_cast<size_t>(normalize_dim(n.get_int("dim"), rank, n));
    int64_t step = n.get_int("step", 1);
    int64_t start = evaluate(slice_bounds(n, cst(x.shape[d])).first, syms);
    const int64_t len = src.shape.empty() ? 1 : src.shape[d];
    if (src.numel() > 0 && (start < 0 || start + (len - 1) * step >= x.shape[d]))
      throw GraphError(n.where() + ": the slice written (start " + std::to_string(start) + ", " + std::to_string(len) +
                       " elements, step " + std::to_string(step) + ") is out of the base's " +
                       std::to_string(x.shape[d]) + " at dim " + std::to_string(d));
    std::vector<int64_t> strides = row_major_strides(x.shape);
    Values result = x.data;
    std::vector<int64_t> pos(src.shape.size(), 0);
    for (int64_t k = 0; k < src.numel(); ++k) {
      int64_t off = 0;
      for (size_t a = 0; a < pos.size(); ++a) off += (a == d ? start + pos[a] * step : pos[a]) * strides[a];
      result[static_cast<size_t>(off)] = src.data[static_cast<size_t>(k)];
      for (size_t a = pos.size(); a-- > 0;) {  // the next index of src, row-major
        if (++pos[a] < src.shape[a]) break;
        pos[a] = 0;
      }
    }
    store(out, std::move(result));
  } else if (op == "cat") {
    size_t d = static_cast<size_t>(normalize_dim(n.get_int("dim"), rank, n));
    int64_t outer = product(std::vector<int64_t>(out.shape.begin(), out.shape.begin() + static_cast<long>(d)));
    Values result;
    result.reserve(static_cast<size_t>(out.numel()));
    for (int64_t o = 0; o < outer; ++o)
      for (const HostTensor* t : in) {
        // Each input contributes one contiguous block per outer index.
        int64_t block = outer == 0 ? 0 : t->numel() / outer;
        auto first = t->data.begin() + static_cast<long>(o * block);
        result.insert(result.end(), first, first + static_cast<long>(block));
      }
    store(out, std::move(result));
  } else {
    throw GraphError(n.where() + ": the oracle has no rule for this layout op");
  }
}

}  // namespace

SymbolValues bind_symbols(const Graph& g, const std::vector<std::vector<int64_t>>& input_shapes) {
  std::vector<int> ids = g.input_ids();
  if (input_shapes.size() != ids.size())
    throw GraphError("the graph has " + std::to_string(ids.size()) + " inputs but " +
                     std::to_string(input_shapes.size()) + " shapes were given");
  auto who = [&](const Node& x, size_t d) {
    return x.where() + " '" + x.get_str("name", "") + "' dim " + std::to_string(d);
  };
  SymbolValues syms;
  std::map<std::string, std::string> bound_at;
  // A dim that is a plain symbol binds it; every other dim is checked once
  // all symbols are bound, so that [2*s0] may come before [s0].
  for (size_t k = 0; k < ids.size(); ++k) {
    const Node& x = g.node(ids[k]);
    const std::vector<int64_t>& s = input_shapes[k];
    if (s.size() != x.shape.size())
      throw GraphError(x.where() + " '" + x.get_str("name", "") + "': expected " + std::to_string(x.shape.size()) +
                       " dims " + shape_to_string(x.shape) + ", got " + std::to_string(s.size()));
    for (size_t d = 0; d < s.size(); ++d) {
      if (s[d] < 0) throw GraphError(who(x, d) + ": negative size " + std::to_string(s[d]));
      if (x.shape[d]->kind != ExprNode::Sym) continue;
      const std::string& name = x.shape[d]->name;
      auto [it, fresh] = syms.emplace(name, s[d]);
      if (fresh) bound_at[name] = who(x, d);
      else if (it->second != s[d])
        throw GraphError(who(x, d) + ": size " + std::to_string(s[d]) + " contradicts " + name + " = " +
                         std::to_string(it->second) + " from " + bound_at[name]);
    }
  }
  // A dim whose one unbound symbol it is linear in (s0 - 3) binds it:
  // s0 = (size - f(0)) / (f(1) - f(0)), checked with every dim below.
  for (bool more = true; more;) {
    more = false;
    for (size_t k = 0; k < ids.size(); ++k) {
      const Node& x = g.node(ids[k]);
      for (size_t d = 0; d < x.shape.size(); ++d) {
        std::vector<std::string> names;
        collect_symbols(x.shape[d], &names);
        std::vector<std::string> open;
        for (auto& s : names)
          if (!syms.count(s)) open.push_back(s);
        if (open.size() != 1 || !linear_in(x.shape[d], open[0])) continue;
        SymbolValues at = syms;
        at[open[0]] = 0;
        int64_t f0 = evaluate(x.shape[d], at);
        at[open[0]] = 1;
        int64_t slope = evaluate(x.shape[d], at) - f0, rest = input_shapes[k][d] - f0;
        if (slope == 0 || rest % slope != 0) continue;  // the check below names the dim
        syms[open[0]] = rest / slope;
        bound_at[open[0]] = who(x, d);
        more = true;
      }
    }
  }
  for (size_t k = 0; k < ids.size(); ++k) {
    const Node& x = g.node(ids[k]);
    for (size_t d = 0; d < x.shape.size(); ++d) {
      if (x.shape[d]->kind == ExprNode::Sym) continue;
      int64_t v;
      try {
        v = evaluate(x.shape[d], syms);
      } catch (const std::runtime_error& e) {
        throw GraphError(who(x, d) + ": size " + to_string(x.shape[d]) + " uses a symbol that no input dim binds (" +
                         e.what() + ")");
      }
      if (v != input_shapes[k][d])
        throw GraphError(who(x, d) + ": size " + to_string(x.shape[d]) + " = " + std::to_string(v) +
                         " but the given size is " + std::to_string(input_shapes[k][d]));
    }
  }
  check_slice_bounds(g, syms);
  return syms;
}

void check_slice_bounds(const Graph& g, const SymbolValues& syms) {
  for (const Node& n : g.nodes) {
    // A slice_scatter's bounds are those of the slice of its base it writes.
    if ((n.op != "slice" && n.op != "slice_scatter") || !n.get_int("inbounds", 0)) continue;
    const Node& x = g.node(n.inputs[0]);
    size_t d = static_cast<size_t>(normalize_dim(n.get_int("dim"), x.rank(), n));
    const Expr& size = x.shape[d];
    auto [start, end] = slice_bounds(n, size);
    int64_t s = evaluate(size, syms), a = evaluate(start, syms), b = evaluate(end, syms);
    if (!(0 <= a && a <= b && b <= s))
      throw GraphError(n.where() + ": " + (n.op == "slice" ? "slice [" : "the slice written [") + std::to_string(a) + ", " + std::to_string(b) +
                       ") is out of the bounds it was built for (size " + std::to_string(s) + " at dim " +
                       std::to_string(d) + ")");
  }
}

// matmul in float64 (the operands are already rounded to their dtype).
void eval_matmul(const HostTensor& a, const HostTensor& b, HostTensor& out) {
  size_t r = a.shape.size();
  int64_t batch = r == 3 ? a.shape[0] : 1, m = a.shape[r - 2], k = a.shape[r - 1], n = b.shape[r - 1];
  Values v(static_cast<size_t>(batch * m * n), 0.0);
  for (int64_t p = 0; p < batch; ++p)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t q = 0; q < k; ++q) {
        double x = a.data[static_cast<size_t>((p * m + i) * k + q)];
        const double* brow = &b.data[static_cast<size_t>((p * k + q) * n)];
        double* orow = &v[static_cast<size_t>((p * m + i) * n)];
        for (int64_t j = 0; j < n; ++j) orow[j] += x * brow[j];
      }
  store(out, std::move(v));
}

HostTensor evaluate_node(const Graph& g, const Node& n, const std::vector<const HostTensor*>& inputs,
                         const SymbolValues& syms) {
  const OpDef& def = op_def(n);
  if (inputs.size() != n.inputs.size())
    throw GraphError(n.where() + ": given " + std::to_string(inputs.size()) + " input values for " +
                     std::to_string(n.inputs.size()) + " inputs");
  for (const HostTensor* t : inputs)
    if (!t || static_cast<int64_t>(t->data.size()) != t->numel())
      throw GraphError(n.where() + ": an input value is missing or its data does not match its shape");
  HostTensor out;
  out.dtype = n.dtype;
  out.shape = concrete_shape(n, n.shape, syms);
  switch (def.kind) {
    case OpKind::Source:
      if (n.op != "scalar") throw GraphError(n.where() + ": graph inputs are given, not evaluated");
      if (Expr size = n.scalar_size()) store(out, {static_cast<double>(evaluate(size, syms))});
      else store(out, {n.get_float("value")});
      break;
    case OpKind::Elementwise: eval_elementwise(g, n, def, inputs, out); break;
    case OpKind::Reduction:
      if (n.op == "column_partials") eval_column_partials(n, *inputs[0], out);
      else eval_reduction(n, *inputs[0], out);
      break;
    case OpKind::Broadcast:
    case OpKind::Layout: eval_layout(n, inputs, out, syms); break;
    case OpKind::Composite: eval_detail::evaluate_composite(n, inputs, out); break;
    case OpKind::Gemm: eval_matmul(*inputs[0], *inputs[1], out); break;
    case OpKind::Opaque: throw GraphError(n.where() + ": an opaque op has no reference evaluation");
  }
  return out;
}

std::vector<HostTensor> evaluate(const Graph& g, const std::vector<HostTensor>& inputs) {
  std::vector<int> ids = g.input_ids();
  std::vector<std::vector<int64_t>> shapes;
  for (const HostTensor& t : inputs) shapes.push_back(t.shape);
  SymbolValues syms = bind_symbols(g, shapes);  // also checks the number of inputs

  std::vector<HostTensor> values(g.nodes.size());
  for (size_t k = 0; k < ids.size(); ++k) {
    const Node& x = g.node(ids[k]);
    HostTensor t = inputs[k];
    if (t.dtype != x.dtype)
      throw GraphError(x.where() + " '" + x.get_str("name", "") + "': given " + dtype_name(t.dtype) +
                       " values for a " + dtype_name(x.dtype) + " input");
    if (static_cast<int64_t>(t.data.size()) != t.numel())
      throw GraphError(x.where() + " '" + x.get_str("name", "") + "': " + std::to_string(t.data.size()) +
                       " values for " + std::to_string(t.numel()) + " elements");
    // Values the dtype cannot hold (0.1 for a bf16 input) become the ones it
    // would store, so the oracle sees what a real tensor holds.
    for (double& v : t.data) v = round_to_dtype(v, t.dtype);
    values[static_cast<size_t>(ids[k])] = std::move(t);
  }
  for (int o : g.outputs)
    if (o < 0 || o >= static_cast<int>(g.nodes.size()))
      throw GraphError("output %" + std::to_string(o) + " is not a node of the graph");
  // Only the nodes an output needs are evaluated, and each value is dropped
  // after its last reader: a dead branch (a fuzzer's, or one the planner has
  // not removed yet) costs nothing, and the float64 oracle holds the live
  // values only, not every intermediate of the graph at once.
  // An output's last reader is past every node, so it is never dropped.
  const int past_end = static_cast<int>(g.nodes.size());
  std::vector<bool> live(g.nodes.size(), false);
  std::vector<int> last_reader(g.nodes.size(), -1);
  for (int o : g.outputs) {
    live[static_cast<size_t>(o)] = true;
    last_reader[static_cast<size_t>(o)] = past_end;
  }
  for (size_t k = g.nodes.size(); k-- > 0;) {
    if (!live[k]) continue;
    for (int i : g.nodes[k].inputs) {
      live[static_cast<size_t>(i)] = true;
      last_reader[static_cast<size_t>(i)] = std::max(last_reader[static_cast<size_t>(i)], static_cast<int>(k));
    }
  }
  for (const Node& n : g.nodes) {
    if (n.op == "input" || !live[static_cast<size_t>(n.id)]) continue;
    std::vector<const HostTensor*> in;
    for (int i : n.inputs) in.push_back(&values[static_cast<size_t>(i)]);
    values[static_cast<size_t>(n.id)] = evaluate_node(g, n, in, syms);
    for (int i : n.inputs)
      if (last_reader[static_cast<size_t>(i)] == n.id)
        values[static_cast<size_t>(i)] = HostTensor{};
  }
  std::vector<HostTensor> out;
  for (int o : g.outputs) out.push_back(values[static_cast<size_t>(o)]);
  return out;
}

}  // namespace opfuse
