// Graph-to-graph passes run before planning, in the order of `graph_passes()`.
// Each is a function from graph to graph; the pipeline can dump the graph
// after each one by name (OPFUSE_DUMP).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "ir/graph.h"

namespace opfuse {

// Replaces every composite op (softmax, norms, their backward ops) by its
// primitives, so that the planner sees one vocabulary.
Graph decompose_composites(const Graph& g);

// Merges nodes with the same op, inputs and attributes, and drops nodes no
// output depends on. Graph inputs are kept, in order, even when unused.
Graph eliminate_common_subexpressions(const Graph& g);

// CUDA only, after the passes above: sums over leading dims that a row
// reduction's kernel can compute as partials (split_column_sums.cpp).
// max_cols: the longest row split (8192; up to 32768 with clusters on sm_90).
Graph split_column_sums(const Graph& g, int64_t max_cols = 8192);

struct FusionPlan;
struct PlannerOptions;
// CUDA sm_90, after planning: a decode-shaped MLP block (two or three GEMM
// calls and the gate kernel between them) becomes one call of the decode
// MLP kernel (decode_mlp.cpp). Only with opt.decode_mlp and gemm_epilogues.
void fuse_decode_mlp(FusionPlan& plan, const PlannerOptions& opt);
// After planning, with GEMM library calls (CUDA): a GEMM whose A is the gate
// kernel's silu(x) * y, computed just before it and read nowhere else, is
// marked (GemmCall::gate_silu, gate_mul) so the runtime may read x and y in
// its place and skip that kernel (gated_gemm_input.cpp).
void mark_gated_gemm_inputs(FusionPlan& plan);

struct GraphPass {
  const char* name;
  Graph (*run)(const Graph&);
};
const std::vector<GraphPass>& graph_passes();

}  // namespace opfuse
