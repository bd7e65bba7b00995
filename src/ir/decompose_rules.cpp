#include "ir/decompose_rules.h"

namespace opfuse {
namespace {

// Half types are widened to float32 for the whole op and rounded once at the
// end, as PyTorch's own kernels do.
DType acc_type(DType t) { return t == DType::Float64 ? DType::Float64 : DType::Float32; }

int widen(Graph& g, int x) {
  DType t = g.node(x).dtype;
  return t == acc_type(t) ? x : g.add("cast", {x}, {{"dtype", acc_type(t)}});
}
int narrow(Graph& g, int x, DType t) { return g.node(x).dtype == t ? x : g.add("cast", {x}, {{"dtype", t}}); }

std::vector<int64_t> last_dims(const Node& n, int rank) {
  std::vector<int64_t> d;
  for (int64_t k = rank - n.get_int("normalized_ndim"); k < rank; ++k) d.push_back(k);
  return d;
}
std::vector<int64_t> one_dim(const Graph& g, const Node& n) {
  int64_t r = g.node(n.inputs[0]).rank();
  int64_t d = n.get_int("dim");
  return {r == 0 ? 0 : (d < 0 ? d + r : d)};
}
int reduce(Graph& g, const char* op, int x, const std::vector<int64_t>& dims) {
  return g.add(op, {x}, {{"dims", dims}, {"keepdim", true}});
}
int scalar_like(Graph& g, double v, int like) { return g.add_scalar(v, g.node(like).dtype); }

struct NormStats {
  int x, mean, centered, rstd;
};

// mean, x - mean and 1/sqrt(var + eps) over the last normalized_ndim dims.
NormStats layer_norm_stats(Graph& g, const Node& n) {
  int x = widen(g, n.inputs[0]);
  auto dims = last_dims(n, g.node(x).rank());
  int mean = reduce(g, "mean", x, dims);
  int xc = g.add("sub", {x, mean});
  int var = reduce(g, "mean", g.add("mul", {xc, xc}), dims);
  int rstd = g.add("rsqrt", {g.add("add", {var, scalar_like(g, n.get_float("eps", 1e-5), var)})});
  return {x, mean, xc, rstd};
}

int rms_rstd(Graph& g, const Node& n, int x) {
  auto dims = last_dims(n, g.node(x).rank());
  int ms = reduce(g, "mean", g.add("mul", {x, x}), dims);
  return g.add("rsqrt", {g.add("add", {ms, scalar_like(g, n.get_float("eps", 1e-6), ms)})});
}

}  // namespace

int decompose_softmax(Graph& g, const Node& n) {
  int x = widen(g, n.inputs[0]);
  auto d = one_dim(g, n);
  int e = g.add("exp", {g.add("sub", {x, reduce(g, "amax", x, d)})});
  return narrow(g, g.add("div", {e, reduce(g, "sum", e, d)}), n.dtype);
}

int decompose_log_softmax(Graph& g, const Node& n) {
  int x = widen(g, n.inputs[0]);
  auto d = one_dim(g, n);
  int shifted = g.add("sub", {x, reduce(g, "amax", x, d)});
  int lse = g.add("log", {reduce(g, "sum", g.add("exp", {shifted}), d)});
  return narrow(g, g.add("sub", {shifted, lse}), n.dtype);
}

int decompose_layer_norm(Graph& g, const Node& n) {
  NormStats s = layer_norm_stats(g, n);
  int y = g.add("mul", {s.centered, s.rstd});
  if (n.inputs.size() > 1) y = g.add("mul", {y, widen(g, n.inputs[1])});
  if (n.inputs.size() > 2) y = g.add("add", {y, widen(g, n.inputs[2])});
  return narrow(g, y, n.dtype);
}

int decompose_layer_norm_stats(Graph& g, const Node& n) {
  NormStats s = layer_norm_stats(g, n);
  return n.get_str("which", "mean") == "mean" ? s.mean : s.rstd;
}

int decompose_rms_norm(Graph& g, const Node& n) {
  int x = widen(g, n.inputs[0]);
  int y = g.add("mul", {x, rms_rstd(g, n, x)});
  if (n.inputs.size() > 1) y = g.add("mul", {y, widen(g, n.inputs[1])});
  return narrow(g, y, n.dtype);
}

int decompose_rms_norm_rstd(Graph& g, const Node& n) { return rms_rstd(g, n, widen(g, n.inputs[0])); }

int decompose_softmax_backward(Graph& g, const Node& n) {
  // dx = y * (dy - sum(dy * y))
  int dy = widen(g, n.inputs[0]), y = widen(g, n.inputs[1]);
  int dot = reduce(g, "sum", g.add("mul", {dy, y}), one_dim(g, n));
  return narrow(g, g.add("mul", {y, g.add("sub", {dy, dot})}), n.dtype);
}

int decompose_log_softmax_backward(Graph& g, const Node& n) {
  // dx = dy - exp(y) * sum(dy)
  int dy = widen(g, n.inputs[0]), y = widen(g, n.inputs[1]);
  int s = reduce(g, "sum", dy, one_dim(g, n));
  return narrow(g, g.add("sub", {dy, g.add("mul", {g.add("exp", {y}), s})}), n.dtype);
}

int decompose_layer_norm_backward(Graph& g, const Node& n) {
  // inputs: dy, x, mean, rstd[, weight]
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * weight
  int dy = widen(g, n.inputs[0]), x = widen(g, n.inputs[1]);
  int mean = widen(g, n.inputs[2]), rstd = widen(g, n.inputs[3]);
  auto dims = last_dims(n, g.node(x).rank());
  int xhat = g.add("mul", {g.add("sub", {x, mean}), rstd});
  int gr = n.inputs.size() > 4 ? g.add("mul", {dy, widen(g, n.inputs[4])}) : dy;
  int a = reduce(g, "mean", gr, dims);
  int b = reduce(g, "mean", g.add("mul", {gr, xhat}), dims);
  int inner = g.add("sub", {g.add("sub", {gr, a}), g.add("mul", {xhat, b})});
  return narrow(g, g.add("mul", {rstd, inner}), n.dtype);
}

int decompose_rms_norm_backward(Graph& g, const Node& n) {
  // inputs: dy, x, rstd[, weight]; dx = rstd * (g - xhat * mean(g * xhat))
  int dy = widen(g, n.inputs[0]), x = widen(g, n.inputs[1]), rstd = widen(g, n.inputs[2]);
  auto dims = last_dims(n, g.node(x).rank());
  int xhat = g.add("mul", {x, rstd});
  int gr = n.inputs.size() > 3 ? g.add("mul", {dy, widen(g, n.inputs[3])}) : dy;
  int b = reduce(g, "mean", g.add("mul", {gr, xhat}), dims);
  int inner = g.add("sub", {gr, g.add("mul", {xhat, b})});
  return narrow(g, g.add("mul", {rstd, inner}), n.dtype);
}

}  // namespace opfuse
