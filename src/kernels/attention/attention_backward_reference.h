// CPU reference of the attention backward (attention_bwd.cu): plain C++ in
// float64, no CUDA, no torch. The definition the kernels are checked against.
//
// Given q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D], the forward output o and its
// gradient dout ([B, Hq, Sq, D]), with P the softmax of scale * q k^T over the
// keys each query may see (causal: query i sees key j iff j <= i + Sk - Sq,
// bottom-right as the forward), it writes
//   dv = P^T dout,  dP = dout v^T,  Delta_i = sum_d dout_id o_id,
//   dS = P * (dP - Delta),  dq = scale dS k,  dk = scale dS^T q,
// with dk and dv summed over the Hq / Hkv query heads that share a KV head.
// Delta uses the o passed in (as the kernel does); for the exact forward
// output it equals sum_j P_ij dP_ij, which is what autograd computes. A row that
// sees no key has P = 0: dq = 0 and nothing flows to dk, dv (never NaN).
#pragma once

#include <cstdint>

#include "attention_reference.h"

namespace opfuse::kernels::attention {

// A [B, H, S, D] float64 tensor (StridedTensor4, attention_reference.h).
using ConstTensor4d = StridedTensor4<const double>;
using Tensor4d = StridedTensor4<double>;

struct AttentionBackwardArgs {
  ConstTensor4d q, k, v;  // forward inputs
  ConstTensor4d o;        // forward output [B, Hq, Sq, D]
  ConstTensor4d dout;     // gradient of o
  Tensor4d dq;            // [B, Hq, Sq, D]
  Tensor4d dk, dv;        // [B, Hkv, Sk, D]
  AttentionShape shape;
  bool causal = false;
  double softmax_scale = 0.0;  // <= 0 means 1 / sqrt(head_dim)
};

// Throws std::invalid_argument naming the problem (as validate() of the forward).
void attention_backward_reference(const AttentionBackwardArgs& args);

}  // namespace opfuse::kernels::attention
