// cuBLASLt loaded at run time with dlopen (PyTorch's copy first), declared
// here with the few types and enum values opfuse uses, so that building
// opfuse needs no CUDA toolkit. Values from cublasLt.h (CUDA 12/13).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace opfuse {
namespace lt {

using Status = int;  // cublasStatus_t; 0 is success
using Handle = void*;
using MatmulDesc = void*;
using Layout = void*;
using Preference = void*;

struct Algo {
  uint64_t data[8];
};
struct HeuristicResult {
  Algo algo;
  size_t workspace_size;
  Status state;
  float waves_count;
  int reserved[4];
};

// cudaDataType_t
enum DataType : int { R_32F = 0, R_16F = 2, R_16BF = 14 };
// cublasComputeType_t
enum ComputeType : int { COMPUTE_32F = 68, COMPUTE_32F_FAST_TF32 = 77 };
enum Op : int { OP_N = 0, OP_T = 1 };
// cublasLtMatmulDescAttributes_t
enum DescAttr : int {
  DESC_COMPUTE_TYPE = 0, DESC_SCALE_TYPE = 1, DESC_TRANSA = 3, DESC_TRANSB = 4, DESC_EPILOGUE = 7,
  DESC_BIAS_POINTER = 8, DESC_AUX_POINTER = 11, DESC_AUX_LD = 12, DESC_BIAS_DATA_TYPE = 26,
};
// cublasLtEpilogue_t
enum Epilogue : int {
  EPI_DEFAULT = 1, EPI_RELU = 2, EPI_BIAS = 4, EPI_RELU_BIAS = 6, EPI_GELU = 32, EPI_GELU_AUX = 160,
  EPI_GELU_BIAS = 36, EPI_GELU_AUX_BIAS = 164, EPI_DGELU = 192, EPI_DGELU_BGRAD = 208, EPI_BGRADA = 256,
  EPI_BGRADB = 512,
};
// cublasLtMatrixLayoutAttribute_t
enum LayoutAttr : int { LAYOUT_BATCH_COUNT = 5, LAYOUT_STRIDED_BATCH_OFFSET = 6 };
// cublasLtMatmulPreferenceAttributes_t
enum PrefAttr : int {
  PREF_MAX_WORKSPACE_BYTES = 1, PREF_REDUCTION_SCHEME_MASK = 3, PREF_MIN_ALIGNMENT_A = 5, PREF_MIN_ALIGNMENT_B = 6, PREF_MIN_ALIGNMENT_C = 7,
  PREF_MIN_ALIGNMENT_D = 8,
};

// cublasLtMatmulAlgoConfigAttributes_t, cublasLtMatmulAlgoCapAttributes_t and
// cublasLtReductionScheme_t: a heuristic answer re-cut into more K splits.
enum AlgoConfigAttr : int { CONFIG_SPLITK_NUM = 2, CONFIG_REDUCTION_SCHEME = 3 };
enum AlgoCapAttr : int { CAP_SPLITK_SUPPORT = 0, CAP_REDUCTION_SCHEME_MASK = 1 };
enum ReductionScheme : uint32_t { REDUCE_NONE = 0, REDUCE_INPLACE = 1, REDUCE_COMPUTE_TYPE = 2, REDUCE_OUTPUT_TYPE = 4 };

struct Api {
  bool loaded = false;
  std::string path, error;
  Status (*Create)(Handle*) = nullptr;
  size_t (*GetVersion)() = nullptr;
  const char* (*GetStatusString)(Status) = nullptr;
  Status (*MatmulDescCreate)(MatmulDesc*, int compute, int scale) = nullptr;
  Status (*MatmulDescDestroy)(MatmulDesc) = nullptr;
  Status (*MatmulDescSetAttribute)(MatmulDesc, int attr, const void* buf, size_t size) = nullptr;
  Status (*MatrixLayoutCreate)(Layout*, int type, uint64_t rows, uint64_t cols, int64_t ld) = nullptr;
  Status (*MatrixLayoutDestroy)(Layout) = nullptr;
  Status (*MatrixLayoutSetAttribute)(Layout, int attr, const void* buf, size_t size) = nullptr;
  Status (*MatmulPreferenceCreate)(Preference*) = nullptr;
  Status (*MatmulPreferenceDestroy)(Preference) = nullptr;
  Status (*MatmulPreferenceSetAttribute)(Preference, int attr, const void* buf, size_t size) = nullptr;
  Status (*MatmulAlgoGetHeuristic)(Handle, MatmulDesc, Layout, Layout, Layout, Layout, Preference, int requested,
                                   HeuristicResult* results, int* returned) = nullptr;
  Status (*Matmul)(Handle, MatmulDesc, const void* alpha, const void* A, Layout, const void* B, Layout,
                   const void* beta, const void* C, Layout, void* D, Layout, const Algo* algo, void* workspace,
                   size_t workspace_bytes, void* stream) = nullptr;
  // Optional (nullptr where missing): re-configuring heuristic answers.
  Status (*AlgoConfigGetAttribute)(const Algo*, int attr, void* buf, size_t size, size_t* written) = nullptr;
  Status (*AlgoConfigSetAttribute)(Algo*, int attr, const void* buf, size_t size) = nullptr;
  Status (*AlgoCapGetAttribute)(const Algo*, int attr, void* buf, size_t size, size_t* written) = nullptr;
  Status (*AlgoCheck)(Handle, MatmulDesc, Layout, Layout, Layout, Layout, const Algo*, HeuristicResult* result) = nullptr;
};

}  // namespace lt

const lt::Api& cublaslt();  // loads on first use; .loaded false with .error when absent

}  // namespace opfuse
