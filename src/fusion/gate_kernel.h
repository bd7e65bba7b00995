// Recognising Llama's gate kernel in a plan: a pointwise kernel whose one
// root is exactly silu(a) * b. Used by the decode MLP pass (decode_mlp.cpp),
// which folds it into one kernel with the GEMMs around it, and by
// gated_gemm_input.cpp, which lets the GEMM after it read a and b instead.
#pragma once
#include <set>

#include "fusion/plan.h"

namespace opfuse {

// The node whose silu `node` computes, or -1: silu(a); a * sigmoid(a); or
// PyTorch's decomposition at 16 bits, cast(c * sigmoid(c)) with c a's
// float32 cast. `dt`: the element type of the product. Every node on the
// way is inlined (computed inside a kernel, realized nowhere).
int silu_input(const FusionPlan& plan, int node, DType dt);

// Kernel k computes exactly silu(a) * b (either order) as its one root
// `root`: returns true and sets a, b (distinct realized nodes). The kernel
// rounds once where the graph may round silu(a) first: one rounding fewer,
// as a GEMM would.
bool is_gate_kernel(const FusionPlan& plan, int k, int root, int* a, int* b);

// `node` is stored only for kernels in `inside`: no graph output (or output
// alias, either side), read by no other kernel.
bool private_to(const FusionPlan& plan, int node, const std::set<int>& inside);

}  // namespace opfuse
