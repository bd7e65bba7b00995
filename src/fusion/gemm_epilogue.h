// Planning matmuls as library calls: which buffer each operand is read from
// (absorbing a transpose or a reshape of a contiguous buffer as a view), and
// the epilogue cuBLASLt can carry (bias, relu or tanh-gelu, the gelu input
// for the backward, a residual add, the bias gradient, the gelu backward).
#pragma once
#include <functional>
#include <vector>

#include "fusion/plan.h"

namespace opfuse {

// The buffer behind a matmul operand: the first node along its view chain
// that is `in_memory`. A permute of the last two dims becomes `transposed`;
// a reshape becomes the matrix shape when its source is not a graph input
// (realized nodes are contiguous, so any reshape of them is a view).
// Anything else is its own buffer (the planner realizes it).
GemmOperand resolve_gemm_operand(const Graph& g, int operand, const std::function<bool(int)>& in_memory);

// Users of every node, and which nodes are graph outputs.
struct UseInfo {
  std::vector<std::vector<int>> users;
  std::vector<bool> is_output;
  explicit UseInfo(const Graph& g);
  bool only_use(int node, int user) const;  // `user` is the node's one use and it is no output
};

// Grows `call` (whose matmul, a and b are set) by the nodes after the matmul
// that its epilogue can compute; returns them in order. `available(n)`
// tells whether node n (a bias, residual or saved gelu input) is in memory
// before the call. opt.gemm_float32_bias admits a float32 bias.
std::vector<int> match_gemm_epilogue(const Graph& g, const UseInfo& use, GemmCall& call,
                                     const std::function<bool(int)>& available, const PlannerOptions& opt);

// The bias gradient the call can write on the side: a sum over dim 0 of one
// operand's matrix where that dim is contracted (a weight-gradient GEMM:
// BGRADA/BGRADB), or of the call's result after a gelu backward
// (DGELU_BGRAD); with opt.gemm_float32_bias, through a reshape to the sum's
// float32 cast. `free(n)`: node n is not computed by another library call.
// Returns the nodes the call takes (and sets call.bias_grad*), or none.
std::vector<int> match_gemm_bias_grad(const Graph& g, const UseInfo& use, GemmCall& call,
                                      const std::function<bool(int)>& free, const PlannerOptions& opt);

}  // namespace opfuse
