// The reference oracle for composite ops, written directly in float64 from
// the textbook formulas rather than through decompose_rules.cpp, so that a
// test can hold the decompositions against it. Only the final result is
// rounded (to the node's dtype).
//
// Every op here works on "rows": the elements that one softmax or one norm
// sees. Row r's element j sits at base(r) + j * stride.
#include <cmath>
#include <limits>

#include "ir/evaluate_internal.h"
#include "ir/ops.h"

namespace opfuse::eval_detail {
namespace {

using Values = std::vector<double>;

struct Rows {
  int64_t outer = 1, len = 1, inner = 1;  // element (o, j, i) at (o * len + j) * inner + i
  int64_t count() const { return outer * inner; }
  int64_t base(int64_t r) const { return (r / inner) * len * inner + r % inner; }
  int64_t stride() const { return inner; }
};

// Rows along one dim (softmax and its backward ops).
Rows rows_along(const std::vector<int64_t>& shape, int64_t dim) {
  Rows r;
  for (size_t k = 0; k < shape.size(); ++k) {
    int64_t s = shape[k];
    if (static_cast<int64_t>(k) < dim) r.outer *= s;
    else if (static_cast<int64_t>(k) == dim) r.len = s;
    else r.inner *= s;
  }
  return r;
}

// Rows over the trailing `ndim` dims (the norms).
Rows rows_over_last(const std::vector<int64_t>& shape, int64_t ndim) {
  Rows r;
  r.len = 1;
  for (size_t k = 0; k < shape.size(); ++k) (static_cast<int64_t>(k) + ndim < static_cast<int64_t>(shape.size()) ? r.outer : r.len) *= shape[k];
  return r;
}

double max_propagating_nan(const Values& x, const Rows& r, int64_t b) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < r.len; ++j) {
    double v = x[static_cast<size_t>(b + j * r.stride())];
    if (std::isnan(v)) return v;
    m = std::max(m, v);
  }
  return m;
}

double row_sum(const Values& x, const Rows& r, int64_t b) {
  double s = 0;
  for (int64_t j = 0; j < r.len; ++j) s += x[static_cast<size_t>(b + j * r.stride())];
  return s;
}

template <class F>
void for_each_row(const Rows& r, F f) {
  for (int64_t k = 0; k < r.count(); ++k) f(k, r.base(k));
}

void store_rounded(HostTensor& out, Values v) {
  for (double& x : v) x = round_to_dtype(x, out.dtype);
  out.data = std::move(v);
}

// softmax, log_softmax, softmax_backward, log_softmax_backward over `dim`.
Values softmax_family(const Node& n, const std::vector<Values>& in, const std::vector<int64_t>& shape) {
  int64_t dim = shape.empty() ? 0 : normalize_dim(n.get_int("dim"), static_cast<int64_t>(shape.size()), n);
  Rows r = rows_along(shape, dim);
  const Values& a = in[0];
  Values out(a.size());
  auto at = [&](int64_t b, int64_t j) { return static_cast<size_t>(b + j * r.stride()); };
  for_each_row(r, [&](int64_t, int64_t b) {
    if (n.op == "softmax" || n.op == "log_softmax") {
      double m = max_propagating_nan(a, r, b), s = 0;
      for (int64_t j = 0; j < r.len; ++j) s += std::exp(a[at(b, j)] - m);
      for (int64_t j = 0; j < r.len; ++j)
        out[at(b, j)] = n.op == "softmax" ? std::exp(a[at(b, j)] - m) / s : a[at(b, j)] - m - std::log(s);
    } else if (n.op == "softmax_backward") {  // a = dy, in[1] = y: dx = y * (dy - Σ dy*y)
      double dot = 0;
      for (int64_t j = 0; j < r.len; ++j) dot += a[at(b, j)] * in[1][at(b, j)];
      for (int64_t j = 0; j < r.len; ++j) out[at(b, j)] = in[1][at(b, j)] * (a[at(b, j)] - dot);
    } else {  // log_softmax_backward: dx = dy - exp(y) * Σ dy
      double s = row_sum(a, r, b);
      for (int64_t j = 0; j < r.len; ++j) out[at(b, j)] = a[at(b, j)] - std::exp(in[1][at(b, j)]) * s;
    }
  });
  return out;
}

// layer_norm, layer_norm_stats, rms_norm, rms_norm_rstd over the trailing
// normalized_ndim dims. The stats have one value per row.
Values norm_forward(const Node& n, const std::vector<Values>& in, const std::vector<int64_t>& shape) {
  Rows r = rows_over_last(shape, n.get_int("normalized_ndim"));
  bool rms = n.op == "rms_norm" || n.op == "rms_norm_rstd";
  bool stats_only = n.op == "layer_norm_stats" || n.op == "rms_norm_rstd";
  double eps = n.get_float("eps", rms ? 1e-6 : 1e-5);
  const Values& x = in[0];
  Values out(stats_only ? static_cast<size_t>(r.count()) : x.size());
  for_each_row(r, [&](int64_t row, int64_t b) {
    double len = static_cast<double>(r.len);
    double mean = rms ? 0.0 : row_sum(x, r, b) / len;
    double ss = 0;
    for (int64_t j = 0; j < r.len; ++j) ss += (x[static_cast<size_t>(b + j)] - mean) * (x[static_cast<size_t>(b + j)] - mean);
    double rstd = 1.0 / std::sqrt(ss / len + eps);  // biased variance, or the mean square for rms
    if (stats_only) {
      out[static_cast<size_t>(row)] = (n.op == "layer_norm_stats" && n.get_str("which", "mean") == "mean") ? mean : rstd;
      return;
    }
    for (int64_t j = 0; j < r.len; ++j) {
      size_t i = static_cast<size_t>(b + j);
      double y = (x[i] - mean) * rstd;
      if (in.size() > 1) y *= in[1][i];
      if (in.size() > 2) y += in[2][i];
      out[i] = y;
    }
  });
  return out;
}

// layer_norm_backward(dy, x, mean, rstd[, weight]) and
// rms_norm_backward(dy, x, rstd[, weight]):
//   g = dy * weight, xhat = (x - mean) * rstd (mean 0 for rms)
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (no mean(g) for rms)
Values norm_backward(const Node& n, const std::vector<Values>& in, const std::vector<int64_t>& shape) {
  Rows r = rows_over_last(shape, n.get_int("normalized_ndim"));
  bool rms = n.op == "rms_norm_backward";
  const Values& dy = in[0];
  const Values& x = in[1];
  const Values* mean = rms ? nullptr : &in[2];
  const Values& rstd = in[rms ? 2 : 3];
  size_t weight_at = rms ? 3 : 4;
  const Values* weight = in.size() > weight_at ? &in[weight_at] : nullptr;
  Values out(x.size());
  for_each_row(r, [&](int64_t, int64_t b) {
    double len = static_cast<double>(r.len), mean_g = 0, mean_gx = 0;
    auto g = [&](size_t i) { return weight ? dy[i] * (*weight)[i] : dy[i]; };
    auto xhat = [&](size_t i) { return (x[i] - (mean ? (*mean)[i] : 0.0)) * rstd[i]; };
    for (int64_t j = 0; j < r.len; ++j) {
      size_t i = static_cast<size_t>(b + j);
      mean_g += g(i);
      mean_gx += g(i) * xhat(i);
    }
    mean_g = rms ? 0.0 : mean_g / len;
    mean_gx /= len;
    for (int64_t j = 0; j < r.len; ++j) {
      size_t i = static_cast<size_t>(b + j);
      out[i] = rstd[i] * (g(i) - mean_g - xhat(i) * mean_gx);
    }
  });
  return out;
}

}  // namespace

void evaluate_composite(const Node& n, const std::vector<const HostTensor*>& inputs, HostTensor& out) {
  // Every operand broadcasts to the first one's shape (the op's shape rule
  // guarantees it); working on full-size copies keeps the formulas plain.
  const std::vector<int64_t>& shape = inputs[0]->shape;
  std::vector<Values> in;
  for (const HostTensor* t : inputs) in.push_back(broadcast_values(*t, shape, n));
  const std::string& op = n.op;
  Values result;
  if (op == "softmax" || op == "log_softmax" || op == "softmax_backward" || op == "log_softmax_backward")
    result = softmax_family(n, in, shape);
  else if (op == "layer_norm" || op == "layer_norm_stats" || op == "rms_norm" || op == "rms_norm_rstd")
    result = norm_forward(n, in, shape);
  else if (op == "layer_norm_backward" || op == "rms_norm_backward")
    result = norm_backward(n, in, shape);
  else
    throw GraphError(n.where() + ": the oracle has no rule for this composite op");
  if (static_cast<int64_t>(result.size()) != out.numel())
    throw GraphError(n.where() + ": oracle produced " + std::to_string(result.size()) + " values for " +
                     std::to_string(out.numel()) + " elements");
  store_rounded(out, std::move(result));
}

}  // namespace opfuse::eval_detail
