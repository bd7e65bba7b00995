// One GEMM with its epilogue through cuBLASLt:
//   D = activation(A @ B + bias + C), aux = A @ B + bias + C, bias_grad
// or, in a backward, D = gelu_backward(A @ B, aux), bias_grad = sum of D's rows,
// on row-major PyTorch tensors. cuBLASLt is column-major, so the call is
// made for D^T = B^T A^T; any operand whose rows or columns are unit-stride
// (a plain or a transposed view) is passed as it is, without a copy.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "ir/dtype.h"

namespace opfuse {

// The operation cannot run as asked (layout, alignment, no algorithm for the
// epilogue): the caller falls back to a plain GEMM with the epilogue in a
// generated kernel, or to PyTorch.
struct GemmUnsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A logical [rows, cols] matrix (per batch) in memory, strides in elements.
struct GemmMatrix {
  const void* ptr = nullptr;
  int64_t batch_stride = 0, row_stride = 0, col_stride = 1;
};

struct GemmArgs {
  DType dtype = DType::BFloat16;  // of A, B, C, D, aux, and of bias, bias_grad unless float32_bias
  int64_t batch = 1, m = 0, n = 0, k = 0;
  GemmMatrix a, b;               // [m, k] and [k, n]
  void* d = nullptr;             // [batch, m, n], rows contiguous
  int64_t d_batch_stride = 0;    // elements from one batch of D to the next (0: m * n, contiguous)
  const void* bias = nullptr;    // [n]
  int64_t bias_stride = 1;
  bool float32_bias = false;     // bias or bias_grad is float32 while dtype is 16-bit (BIAS_DATA_TYPE)
  GemmMatrix residual;           // [m, n], used when ptr is set
  // When ptr is set, A is silu(a) * a_mul (elementwise, [m, k] like a, both
  // 16-bit): Llama's gated product read in place of its own buffer. Only the
  // skinny GEMM takes it (run_gemm refuses it).
  GemmMatrix a_mul;
  std::string activation;        // "", "relu", "gelu_tanh"; "dgelu_tanh": D = gelu_backward(A @ B, aux)
  void* aux = nullptr;           // [m, n] row-major: the gelu's input, written (gelu_tanh) or read (dgelu_tanh)
  int64_t aux_ld = 0;            // aux's row stride in elements (0: n, contiguous)
  void* bias_grad = nullptr;     // sum over the contracted dim of a or b, or over D's rows (dgelu_tanh)
  int bias_grad_operand = -1;    // GemmCall::kBiasGradOf{A,B,Result}
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool allow_tf32 = false;       // float32: TF32 tensor cores, as torch.backends.cuda.matmul.allow_tf32
  void* stream = nullptr;
  // Algorithm search, done once per problem: how many answers to ask of
  // cuBLASLt's heuristic and time; split_k_max > 1 also times each answer
  // that supports split-K re-cut into 2 .. split_k_max K splits (decode
  // shapes: m <= kSplitKMaxRows only), checked by cublasLtMatmulAlgoCheck.
  int candidates = 8;
  int split_k_max = 0;
  static constexpr int64_t kSplitKMaxRows = 64;
};

// Enqueues the GEMM on args.stream. Throws GemmUnsupported (see above), or
// std::runtime_error when cuBLASLt is missing or fails.
void run_gemm(const GemmArgs& args);

// cuBLASLt's version, for reports; throws when it cannot be loaded.
size_t cublaslt_version();

}  // namespace opfuse
