#include "kernels/skinny_gemm/skinny_gemm_reference.h"

#include <cmath>
#include <stdexcept>
#include <vector>

namespace opfuse::kernels::skinny_gemm {

double gelu_tanh(double x) {
  const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1.0 + std::tanh(u));
}

double gated_input(double x, double y, DType dtype) { return round_to_dtype(x / (1.0 + std::exp(-x)) * y, dtype); }

void skinny_gemm_reference(const ReferenceArgs& r) {
  if (r.m < 0 || r.n < 0 || r.k < 0) throw std::invalid_argument("skinny_gemm_reference: negative size");
  if (!r.a || !r.w || !r.d) throw std::invalid_argument("skinny_gemm_reference: null operand");
  if (!r.activation.empty() && r.activation != "relu" && r.activation != "gelu_tanh")
    throw std::invalid_argument("skinny_gemm_reference: unknown activation " + r.activation);
  // The gated A, formed once (the kernel forms it per CTA, the same values).
  std::vector<double> gated;
  if (r.a2) {
    gated.resize(static_cast<size_t>(r.m * r.k));
    for (int64_t i = 0; i < r.m; ++i)
      for (int64_t kk = 0; kk < r.k; ++kk)
        gated[static_cast<size_t>(i * r.k + kk)] = gated_input(r.a[i * r.lda + kk], r.a2[i * r.lda2 + kk], r.dtype);
  }
  for (int64_t i = 0; i < r.m; ++i)
    for (int64_t j = 0; j < r.n; ++j) {
      double s = 0;
      for (int64_t kk = 0; kk < r.k; ++kk)
        s += (r.a2 ? gated[static_cast<size_t>(i * r.k + kk)] : r.a[i * r.lda + kk]) * r.w[j * r.ldw + kk];
      if (r.bias) s += r.bias[j * r.bias_stride];
      if (r.c) s += r.c[i * r.ldc + j];
      if (r.aux) r.aux[i * r.n + j] = round_to_dtype(s, r.dtype);
      if (r.activation == "relu") s = s < 0 ? 0.0 : s;
      else if (r.activation == "gelu_tanh") s = gelu_tanh(s);
      r.d[i * r.n + j] = round_to_dtype(s, r.dtype);
    }
}

}  // namespace opfuse::kernels::skinny_gemm
