// CPU attention with masks, in float32 or float64: the CPU path of
// opfuse.ops.attention for what attention_reference's tiled float32 kernel
// does not cover (an additive or boolean mask, float64 inputs).
//
//   s_ij   = scale * q_i . k_j  (+ mask_ij when the mask is additive)
//   s_ij   = -inf  where causal hides key j from query i (bottom-right aligned:
//                  j > i + Sk - Sq) or a boolean mask is false at (i, j)
//   O_i    = sum_j softmax_j(s_i) v_j,   LSE_i = log sum_j exp(s_ij)
//
// k, v of head h / (Hq / Hkv) (GQA/MQA). A row whose scores are all -inf
// (fully masked) gets O = 0 and LSE = -inf, never NaN. The mask is indexed
// [b, h, i, j] with element strides (0 for broadcast dims), so a key-padding
// mask [B, 1, 1, Sk] is never materialised. Exact two-pass softmax per block
// of query rows; accumulation in the element type (float or double).
// Work is spread over (batch, head) pairs on std::threads.
#pragma once

#include <cstdint>

#include "attention_reference.h"

namespace opfuse::kernels::attention {

enum class MaskKind { None, Bool, Additive };

struct CpuAttentionArgs {
  bool f64 = false;  // elements are double (else float); the mask (additive) and LSE too
  const void* q = nullptr;  // [B, Hq, Sq, D], last dim contiguous
  const void* k = nullptr;  // [B, Hkv, Sk, D]
  const void* v = nullptr;  // [B, Hkv, Sk, D]
  void* o = nullptr;        // [B, Hq, Sq, D]
  void* lse = nullptr;      // [B, Hq, Sq] (optional)
  int64_t q_strides[3] = {}, k_strides[3] = {}, v_strides[3] = {}, o_strides[3] = {};
  int64_t lse_strides[3] = {};  // b, h, i
  AttentionShape shape;
  bool causal = false;
  double softmax_scale = 0.0;  // used as given (any finite value; the caller applies the default)
  MaskKind mask_kind = MaskKind::None;
  const void* mask = nullptr;    // bool (1 byte) or the element type
  int64_t mask_strides[4] = {};  // over [B, Hq, Sq, Sk]
  int threads = 0;               // <= 0: hardware concurrency
};

// Throws std::invalid_argument naming the problem.
void attention_forward_cpu(const CpuAttentionArgs& args);

}  // namespace opfuse::kernels::attention
