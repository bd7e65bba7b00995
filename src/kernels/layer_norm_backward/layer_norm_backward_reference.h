// CPU reference for layer_norm_backward_wide.cu (plain C++, no CUDA, no
// torch), in float64, for rows of n columns (xhat = (x - mean) * rstd,
// g = dy * w, w = 1 without a weight):
//   dx[r, c] = rstd_r * (g - sum_c(g) / n - xhat * sum_c(g * xhat) / n)
//   dw[c]    = sum_r dy * xhat,   db[c] = sum_r dy
// unrounded (the kernel rounds each output once, after float32 math).
#pragma once
#include <cstdint>

namespace opfuse::kernels::layer_norm_backward {

struct ReferenceArgs {
  int64_t rows = 0, n = 0;
  const double* dy = nullptr;  // [rows, n]: dy[r * ld_dy + c]
  int64_t ld_dy = 0;
  const double* x = nullptr;
  int64_t ld_x = 0;
  const double* mean = nullptr;  // [rows]
  const double* rstd = nullptr;  // [rows]
  const double* w = nullptr;     // [n] or null
  double* dx = nullptr;          // [rows, n] contiguous, or null
  double* dw = nullptr;          // [n] or null
  double* db = nullptr;          // [n] or null
};

// Throws std::invalid_argument for null inputs, sizes below 1, row strides below n.
void layer_norm_backward_reference(const ReferenceArgs& a);

}  // namespace opfuse::kernels::layer_norm_backward
