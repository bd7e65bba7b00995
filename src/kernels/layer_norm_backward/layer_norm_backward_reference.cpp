#include "kernels/layer_norm_backward/layer_norm_backward_reference.h"

#include <stdexcept>

namespace opfuse::kernels::layer_norm_backward {

void layer_norm_backward_reference(const ReferenceArgs& a) {
  if (!a.dy || !a.x || !a.mean || !a.rstd) throw std::invalid_argument("layer_norm_backward_reference: a null input");
  if (a.rows < 1 || a.n < 1 || a.ld_dy < a.n || a.ld_x < a.n)
    throw std::invalid_argument("layer_norm_backward_reference: sizes or row strides out of range");
  for (int64_t c = 0; c < a.n; ++c) {
    if (a.dw) a.dw[c] = 0.0;
    if (a.db) a.db[c] = 0.0;
  }
  for (int64_t r = 0; r < a.rows; ++r) {
    const double* dy = a.dy + r * a.ld_dy;
    const double* x = a.x + r * a.ld_x;
    const double mean = a.mean[r], rstd = a.rstd[r];
    double s1 = 0.0, s2 = 0.0;
    for (int64_t c = 0; c < a.n; ++c) {
      const double xhat = (x[c] - mean) * rstd, g = dy[c] * (a.w ? a.w[c] : 1.0);
      s1 += g;
      s2 += g * xhat;
      if (a.dw) a.dw[c] += dy[c] * xhat;
      if (a.db) a.db[c] += dy[c];
    }
    if (!a.dx) continue;
    const double m1 = s1 / static_cast<double>(a.n), m2 = s2 / static_cast<double>(a.n);
    for (int64_t c = 0; c < a.n; ++c) {
      const double xhat = (x[c] - mean) * rstd, g = dy[c] * (a.w ? a.w[c] : 1.0);
      a.dx[r * a.n + c] = rstd * (g - m1 - xhat * m2);
    }
  }
}

}  // namespace opfuse::kernels::layer_norm_backward
