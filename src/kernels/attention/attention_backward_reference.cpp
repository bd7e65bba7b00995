#include "attention_backward_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace opfuse::kernels::attention {

namespace {

const double* row(const ConstTensor4d& t, int64_t b, int64_t h, int64_t s) {
  return t.data + b * t.stride_b + h * t.stride_h + s * t.stride_s;
}
double* row(const Tensor4d& t, int64_t b, int64_t h, int64_t s) {
  return t.data + b * t.stride_b + h * t.stride_h + s * t.stride_s;
}

void validate_backward(const AttentionBackwardArgs& a) {
  const AttentionShape& s = a.shape;
  auto fail = [](const std::string& msg) { throw std::invalid_argument("attention backward: " + msg); };
  if (s.batch < 0 || s.heads_q < 0 || s.heads_kv < 0 || s.seqlen_q < 0 || s.seqlen_k < 0)
    fail("sizes must be non-negative");
  if (s.head_dim < 1) fail("head_dim must be at least 1");
  if (s.heads_kv == 0 ? s.heads_q != 0 : s.heads_q % s.heads_kv != 0)
    fail("heads_q (" + std::to_string(s.heads_q) + ") must be a multiple of heads_kv (" +
         std::to_string(s.heads_kv) + ")");
  if (std::isnan(a.softmax_scale)) fail("softmax_scale is NaN");
  const bool any_q = s.batch * s.heads_q * s.seqlen_q > 0;
  const bool any_k = s.batch * s.heads_kv * s.seqlen_k > 0;
  if (any_q && (!a.q.data || !a.o.data || !a.dout.data || !a.dq.data)) fail("q, o, dout and dq must not be null");
  if (any_k && (!a.k.data || !a.v.data || !a.dk.data || !a.dv.data)) fail("k, v, dk and dv must not be null");
}

}  // namespace

void attention_backward_reference(const AttentionBackwardArgs& a) {
  validate_backward(a);
  const AttentionShape& s = a.shape;
  const int64_t D = s.head_dim, Sq = s.seqlen_q, Sk = s.seqlen_k;
  const double scale = a.softmax_scale > 0 ? a.softmax_scale : 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t hk = 0; hk < s.heads_kv; ++hk)
      for (int64_t j = 0; j < Sk; ++j) {
        std::fill(row(a.dk, b, hk, j), row(a.dk, b, hk, j) + D, 0.0);
        std::fill(row(a.dv, b, hk, j), row(a.dv, b, hk, j) + D, 0.0);
      }
  std::vector<double> p(static_cast<size_t>(std::max<int64_t>(Sk, 1)));
  std::vector<double> ds(p.size());
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h) {
      const int64_t hk = h / (s.heads_q / s.heads_kv);
      for (int64_t i = 0; i < Sq; ++i) {
        const double* q = row(a.q, b, h, i);
        const double* g = row(a.dout, b, h, i);
        const double* o = row(a.o, b, h, i);
        double* dq = row(a.dq, b, h, i);
        std::fill(dq, dq + D, 0.0);
        const int64_t n = a.causal ? std::clamp<int64_t>(i + Sk - Sq + 1, 0, Sk) : Sk;
        if (n == 0) continue;  // sees no key: P = 0
        // P: the two-pass softmax of the visible scores.
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          const double* k = row(a.k, b, hk, j);
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
          p[j] = dot * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - mx));
        for (int64_t j = 0; j < n; ++j) p[j] /= sum;
        double delta = 0;
        for (int64_t d = 0; d < D; ++d) delta += g[d] * o[d];
        for (int64_t j = 0; j < n; ++j) {
          const double* v = row(a.v, b, hk, j);
          double dp = 0;
          for (int64_t d = 0; d < D; ++d) dp += g[d] * v[d];
          ds[j] = p[j] * (dp - delta);
          double* dv = row(a.dv, b, hk, j);
          for (int64_t d = 0; d < D; ++d) dv[d] += p[j] * g[d];
        }
        for (int64_t j = 0; j < n; ++j) {
          const double* k = row(a.k, b, hk, j);
          double* dk = row(a.dk, b, hk, j);
          for (int64_t d = 0; d < D; ++d) {
            dq[d] += scale * ds[j] * k[d];
            dk[d] += scale * ds[j] * q[d];
          }
        }
      }
    }
}

}  // namespace opfuse::kernels::attention
