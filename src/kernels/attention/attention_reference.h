// CPU references for attention_fwd.cu (plain C++, no CUDA, no torch).
//
// Same semantics as the GPU kernel:
//   O[b, h, i, :] = sum_j softmax_j(scale * q_i . k_j) v_j over the keys j that
//                   query i may see, with k, v of head h / (Hq / Hkv) (GQA/MQA);
//   LSE[b, h, i]  = log sum_j exp(scale * q_i . k_j)   (natural log)
// Causal masking is aligned to the bottom-right corner: query i sees key j iff
// j <= i + Sk - Sq (PyTorch, FlashAttention >= 2.1). A row that sees no key
// gets O = 0 and LSE = -inf (never NaN).
//
// Two implementations:
//   attention_forward_plain  - the definition: float64 scores, two-pass softmax.
//   attention_forward_tiled  - mirrors the kernel in float32: key blocks visited
//                              last to first, fully masked blocks skipped, masks
//                              applied only on boundary blocks, online softmax
//                              with exp2 on log2(e)-prescaled scores. It is the
//                              CPU backend's implementation and the oracle for
//                              the kernel's algorithm (not its bf16 rounding of P).
#pragma once

#include <cstdint>

namespace opfuse::kernels::attention {

// A [B, H, S, D] tensor of T: strides in elements for B, H and S; D is contiguous.
template <class T>
struct StridedTensor4 {
  T* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_s = 0;
};
// float32 here; the backward's reference (attention_backward_reference.h) takes float64.
using ConstTensor4 = StridedTensor4<const float>;
using Tensor4 = StridedTensor4<float>;
// LSE [B, H, S] float32 with strides for B and H; S is contiguous. data may be null.
struct Tensor3 {
  float* data = nullptr;
  int64_t stride_b = 0, stride_h = 0;
};

struct AttentionShape {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0;
};

struct AttentionForwardArgs {
  ConstTensor4 q;  // [B, Hq, Sq, D]
  ConstTensor4 k;  // [B, Hkv, Sk, D]
  ConstTensor4 v;  // [B, Hkv, Sk, D]
  Tensor4 o;       // [B, Hq, Sq, D]
  Tensor3 lse;     // [B, Hq, Sq], optional
  AttentionShape shape;
  bool causal = false;
  double softmax_scale = 0.0;  // <= 0 means 1 / sqrt(head_dim)
};

// Throws std::invalid_argument naming the problem (null pointers, Hq % Hkv != 0,
// negative sizes, head_dim < 1, NaN scale).
void validate(const AttentionForwardArgs& args);

void attention_forward_plain(const AttentionForwardArgs& args);

// block_m / block_n: the tile sizes to mirror (any positive values work).
void attention_forward_tiled(const AttentionForwardArgs& args, int block_m = 128, int block_n = 64);

}  // namespace opfuse::kernels::attention
