// The fusion plan: which graph nodes are computed by which kernel.
//
// A node is "realized" (has its own value in memory or in a kernel's
// registers) when it is a graph output or a reduction; every other node is
// inlined, i.e. recomputed inside each kernel that needs it. Each kernel
// iterates one domain: a Pointwise kernel its output shape, a Row kernel the
// input shape of its reductions with `reduce_axes` as the inner loops.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "ir/graph.h"

namespace opfuse {

// One operand of a library GEMM: a buffer (a graph input, or a realized node,
// which is contiguous) read as a matrix (or a batch of them) of `shape`;
// `transposed`: the operand is that matrix transposed (a view, no copy).
struct GemmOperand {
  int node = -1;
  Shape shape;  // the buffer's matrix view, before the transpose
  bool transposed = false;
};

// A matmul planned as one library call with the epilogue the library fuses:
//   result = activation(a @ b + bias + residual)
// plus, for training, the activation's input (aux) and the bias gradient
// (the sum over the contracted dim of one operand); or, in a backward,
//   result = gelu_backward(a @ b, aux)
// with aux the gelu input the forward saved, and the bias gradient of that
// result (its sum over rows).
struct GemmCall {
  int matmul = -1;
  GemmOperand a, b;
  int bias = -1;          // [N] added along the last dim: a graph input of the GEMM's dtype or float32
  int residual = -1;      // a node of the result's shape added (cuBLASLt's C with beta = 1)
  std::string activation;  // "", "relu", "gelu_tanh"; "dgelu_tanh": gelu_backward(a @ b, aux)
  int aux = -1;           // gelu_tanh: its input, also stored (GELU_AUX); dgelu_tanh: that input, read (DGELU)
  int bias_grad = -1;     // the [N] (or [1, N]) node the call writes as the bias gradient: a sum, or its float32 cast
  int bias_grad_operand = -1;  // which sum: kBiasGradOfA, kBiasGradOfB or kBiasGradOfResult
  int result = -1;        // the node the call writes as D
  // A whole decode-shaped MLP block run as one opfuse kernel
  // (src/fusion/decode_mlp.cpp, src/kernels/decode_mlp/): when decode_w1 >= 0
  // the call computes result = act(a @ w1^T + b1) @ b + bias, or with
  // decode_activation "silu_gate" (silu(a @ w1^T) * (a @ w3^T)) @ b + bias;
  // a is x [M, K], b is w2^T; w1, w3 [H, K] and b1 [H] are graph inputs.
  int decode_w1 = -1, decode_w3 = -1, decode_b1 = -1;
  std::string decode_activation;  // "", "relu", "gelu_tanh", "silu_gate"
  bool is_decode_mlp() const { return decode_w1 >= 0; }
  // A gated A (gated_gemm_input.cpp): the kernel just before this call
  // computes a as exactly silu(gate_silu) * gate_mul (Llama's gate), and a
  // is read nowhere else. A runtime whose GEMM can form that product as it
  // loads A (the skinny GEMM, OPFUSE_GATED_GEMM=1) may skip that kernel;
  // otherwise both run.
  int gate_silu = -1, gate_mul = -1;
  static constexpr int kBiasGradOfA = 0, kBiasGradOfB = 1, kBiasGradOfResult = 2;
  bool reads_aux() const { return activation == "dgelu_tanh"; }
  std::vector<int> written() const;   // result, aux when written, bias_grad (those set)
  std::string epilogue_name() const;  // e.g. "bias+gelu_tanh+aux"
};

struct KernelGroup {
  enum class Kind { Pointwise, Row, Gemm } kind = Kind::Pointwise;
  Shape domain;
  std::vector<int64_t> reduce_axes;  // Row only, sorted
  std::vector<int> roots;            // realized nodes computed here, ascending
  std::vector<int> stores;           // roots written to memory: outputs or read by other kernels
  std::vector<int> reads;            // realized nodes of other kernels and graph inputs it loads
  GemmCall gemm;                     // Gemm only
};

struct KernelCost {
  double bytes = 0, flops = 0, seconds = 0;
};

struct FusionPlan {
  Graph graph;                     // the graph after the passes
  std::vector<KernelGroup> kernels;  // in an order that respects dependencies
  std::vector<int> kernel_of;      // node id -> kernel index (realized nodes), else -1
  // Graph outputs that are a reshape of another node: that node is realized
  // and the output is a view of its (contiguous) buffer, not a copy.
  std::map<int, int> output_alias;

  std::string to_string() const;   // the groupings, one kernel a line (golden tests)
};

struct PlannerOptions {
  bool fuse = true;                 // false: one kernel per realized node (for comparisons)
  double bandwidth_bytes_per_s = 20e9;
  double flops_per_s = 100e9;
  double launch_seconds = 3e-6;
  int64_t symbol_hint = 1024;       // value assumed for size symbols when costing
  // Fold bias, activation, residual, aux and bias-gradient epilogues into
  // GEMM library calls (cuBLASLt). Off on the CPU, where PyTorch runs the
  // GEMM and the epilogue fuses into the next generated kernel instead.
  bool gemm_epilogues = false;
  // With gemm_epilogues: a 16-bit GEMM may take a float32 bias (a cast of a
  // float32 input, as autocast writes a linear layer) and write a float32
  // bias gradient (cuBLASLt's BIAS_DATA_TYPE). Off: those casts are kernels.
  bool gemm_float32_bias = false;
  // Split sums over leading dims into per-block partials that a row kernel
  // over the same rows computes (split_column_sums.cpp). CUDA only.
  bool column_partials = false;
  int64_t column_partials_max_cols = 8192;  // OPFUSE_COLUMN_PARTIALS_WIDE=1: 32768 (a cluster of blocks per row, sm_90)
  // Plan a decode-shaped MLP block (GEMM -> epilogue -> GEMM, static
  // shapes, M <= 16) as one decode MLP kernel (decode_mlp.cpp). CUDA sm_90
  // only, opt-in (OPFUSE_DECODE_MLP=1); needs gemm_epilogues.
  bool decode_mlp = false;
};

// Runs the graph passes and groups the realized nodes into kernels.
FusionPlan plan_fusion(const Graph& g, const PlannerOptions& opt = {});

// The roofline estimate of one kernel: bytes read and written, flops, and
// max(bytes / bandwidth, flops / rate) + launch overhead.
KernelCost estimate_cost(const FusionPlan& plan, const KernelGroup& k, const PlannerOptions& opt);

}  // namespace opfuse
