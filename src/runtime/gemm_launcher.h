// One GEMM with its epilogue through cuBLASLt:
//   D = activation(A @ B + bias + C), aux = A @ B + bias + C, bias_grad
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
  DType dtype = DType::BFloat16;  // of A, B, C, D, bias, aux, bias_grad
  int64_t batch = 1, m = 0, n = 0, k = 0;
  GemmMatrix a, b;               // [m, k] and [k, n]
  void* d = nullptr;             // [batch, m, n], contiguous
  const void* bias = nullptr;    // [n]
  int64_t bias_stride = 1;
  GemmMatrix residual;           // [m, n], used when ptr is set
  std::string activation;        // "", "relu", "gelu_tanh"
  void* aux = nullptr;           // [m, n] contiguous: the activation's input
  void* bias_grad = nullptr;     // sum over the contracted dim of a (operand 0) or b (operand 1)
  int bias_grad_operand = -1;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool allow_tf32 = false;       // float32: TF32 tensor cores, as torch.backends.cuda.matmul.allow_tf32
  void* stream = nullptr;
};

// Enqueues the GEMM on args.stream. Throws GemmUnsupported (see above), or
// std::runtime_error when cuBLASLt is missing or fails.
void run_gemm(const GemmArgs& args);

// cuBLASLt's version, for reports; throws when it cannot be loaded.
size_t cublaslt_version();

}  // namespace opfuse
