// CPU reference for skinny_gemm.cu (plain C++, no CUDA, no torch):
//   pre[m, n] = sum_k A[m, k] W[n, k] + bias[n] + C[m, n]   (float64)
//   D[m, n]   = round(act(pre[m, n])),  aux[m, n] = round(pre[m, n])
// with `round` to the output dtype (bf16 or f16, nearest even) and act none,
// relu or tanh-gelu, evaluated in float64. Inputs are values already
// representable in the dtype, as doubles, with element strides; the kernel
// rounds once at the end too, so it differs from this only by its float32
// accumulation.
//
// Gated form (a2 set): A[m, k] = round(silu(a[m, k]) * a2[m, k]), silu(x) =
// x / (1 + exp(-x)) in float64, rounded to the dtype once, as the kernel
// forms it in float32 before its MMAs.
#pragma once
#include <cstdint>
#include <string>

#include "ir/dtype.h"

namespace opfuse::kernels::skinny_gemm {

struct ReferenceArgs {
  DType dtype = DType::BFloat16;
  int64_t m = 0, n = 0, k = 0;
  const double* a = nullptr;  // [m, k]: a[i * lda + kk]
  int64_t lda = 0;
  const double* w = nullptr;  // [n, k]: w[j * ldw + kk]
  int64_t ldw = 0;
  const double* bias = nullptr;  // [n] with bias_stride, or null
  int64_t bias_stride = 1;
  const double* c = nullptr;  // [m, n] with ldc, or null
  int64_t ldc = 0;
  std::string activation;  // "", "relu", "gelu_tanh"
  double* d = nullptr;     // [m, n] contiguous
  double* aux = nullptr;   // [m, n] contiguous, or null
  const double* a2 = nullptr;  // gated: [m, k] with lda2 (A = silu(a) * a2), or null
  int64_t lda2 = 0;
};

// silu(x) * y rounded to dtype: one element of the gated A.
double gated_input(double x, double y, DType dtype);

// Throws std::invalid_argument for null operands, negative sizes, an unknown activation.
void skinny_gemm_reference(const ReferenceArgs& args);

double gelu_tanh(double x);

}  // namespace opfuse::kernels::skinny_gemm
