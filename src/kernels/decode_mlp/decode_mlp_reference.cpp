#include "kernels/decode_mlp/decode_mlp_reference.h"

#include <cmath>
#include <stdexcept>
#include <vector>

namespace opfuse::kernels::decode_mlp {
namespace {

double gelu_tanh(double x) {
  const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1.0 + std::tanh(u));
}

}  // namespace

void decode_mlp_reference(const ReferenceArgs& r) {
  if (r.m < 0 || r.k < 0 || r.h < 0 || r.n < 0) throw std::invalid_argument("decode_mlp_reference: negative size");
  const bool gated = r.activation == "silu_gate";
  if (!r.x || !r.w1 || !r.w2 || !r.out || (gated && !r.w3))
    throw std::invalid_argument("decode_mlp_reference: null operand");
  if (!r.activation.empty() && r.activation != "relu" && r.activation != "gelu_tanh" && !gated)
    throw std::invalid_argument("decode_mlp_reference: unknown activation " + r.activation);
  std::vector<double> h(static_cast<size_t>(r.m * r.h));
  for (int64_t i = 0; i < r.m; ++i)
    for (int64_t j = 0; j < r.h; ++j) {
      double s = 0, u = 0;
      for (int64_t kk = 0; kk < r.k; ++kk) s += r.x[i * r.ldx + kk] * r.w1[j * r.ldw1 + kk];
      if (gated) {
        for (int64_t kk = 0; kk < r.k; ++kk) u += r.x[i * r.ldx + kk] * r.w3[j * r.ldw3 + kk];
        s = s / (1.0 + std::exp(-s)) * u;
      } else {
        if (r.b1) s += r.b1[j * r.b1_stride];
        if (r.activation == "relu") s = s < 0 ? 0.0 : s;
        else if (r.activation == "gelu_tanh") s = gelu_tanh(s);
      }
      h[static_cast<size_t>(i * r.h + j)] = round_to_dtype(s, r.dtype);
    }
  for (int64_t i = 0; i < r.m; ++i)
    for (int64_t c = 0; c < r.n; ++c) {
      double s = 0;
      for (int64_t j = 0; j < r.h; ++j) s += h[static_cast<size_t>(i * r.h + j)] * r.w2[c * r.ldw2 + j];
      if (r.b2) s += r.b2[c * r.b2_stride];
      r.out[i * r.n + c] = round_to_dtype(s, r.dtype);
    }
  if (r.hidden)
    for (size_t i = 0; i < h.size(); ++i) r.hidden[i] = h[i];
}

}  // namespace opfuse::kernels::decode_mlp
