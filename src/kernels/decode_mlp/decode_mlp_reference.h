// CPU reference for decode_mlp.cu (plain C++, no CUDA, no torch), float64:
//   pre[m, j] = sum_k x[m, k] w1[j, k] + b1[j]
//   h[m, j]   = round(act(pre[m, j]))                       act: none, relu, gelu_tanh
//          or   round(silu(sum_k x w1[j]) * sum_k x w3[j])   (silu_gate)
//   out[m, n] = round(sum_j h[m, j] w2[n, j] + b2[n])
// with `round` to the element type (bf16 or f16, nearest even): h is
// rounded once, as the kernel stores it. Inputs are values representable in
// the dtype, as doubles, with element strides.
#pragma once
#include <cstdint>
#include <string>

#include "ir/dtype.h"

namespace opfuse::kernels::decode_mlp {

struct ReferenceArgs {
  DType dtype = DType::BFloat16;
  int64_t m = 0, k = 0, h = 0, n = 0;
  const double* x = nullptr;  // x[i * ldx + kk]
  int64_t ldx = 0;
  const double* w1 = nullptr;  // w1[j * ldw1 + kk]
  int64_t ldw1 = 0;
  const double* w3 = nullptr;  // silu_gate only
  int64_t ldw3 = 0;
  const double* b1 = nullptr;  // [h] with b1_stride, or null
  int64_t b1_stride = 1;
  const double* w2 = nullptr;  // w2[c * ldw2 + j]
  int64_t ldw2 = 0;
  const double* b2 = nullptr;  // [n] with b2_stride, or null
  int64_t b2_stride = 1;
  std::string activation;  // "", "relu", "gelu_tanh", "silu_gate"
  double* out = nullptr;   // [m, n] contiguous
  double* hidden = nullptr;  // [m, h] contiguous, or null: h as rounded
};

// Throws std::invalid_argument for null operands, negative sizes, an unknown activation.
void decode_mlp_reference(const ReferenceArgs& args);

}  // namespace opfuse::kernels::decode_mlp
