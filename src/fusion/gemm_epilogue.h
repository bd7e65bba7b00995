// Planning matmuls as library calls: which buffer each operand is read from
// (absorbing a transpose or a reshape of a contiguous buffer as a view), and
// the epilogue cuBLASLt can carry (bias, relu or tanh-gelu, the gelu input
// for the backward, a residual add, the bias gradient).
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
// tells whether node n (a bias or residual) is in memory before the call.
std::vector<int> match_gemm_epilogue(const Graph& g, const UseInfo& use, GemmCall& call,
                                     const std::function<bool(int)>& available);

// A sum over dim 0 of one operand's matrix, which is the contracted dim:
// the bias gradient a weight-gradient GEMM computes on the side. Returns the
// sum node (and sets call.bias_grad*), or -1.
int match_gemm_bias_grad(const Graph& g, GemmCall& call);

}  // namespace opfuse
