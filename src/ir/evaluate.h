// The reference oracle: every op evaluated on the CPU in float64, with each
// node's result rounded to its dtype (so a bf16 node holds bf16 values).
// Slow and simple on purpose; tests compare generated kernels against it.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "ir/graph.h"

namespace opfuse {

struct HostTensor {
  DType dtype = DType::Float32;
  std::vector<int64_t> shape;
  std::vector<double> data;  // contiguous, row-major

  int64_t numel() const;
};

using SymbolValues = std::map<std::string, int64_t>;

// Binds each size symbol from the shapes of the inputs (in input_ids()
// order); throws GraphError if a shape contradicts the graph.
SymbolValues bind_symbols(const Graph& g, const std::vector<std::vector<int64_t>>& input_shapes);
// Throws GraphError where a slice or slice_scatter marked `inbounds` (its
// bounds checked by the producer, so not clamped) is out of bounds at these sizes.
void check_slice_bounds(const Graph& g, const SymbolValues& syms);

// Evaluates one node given its inputs' values.
HostTensor evaluate_node(const Graph& g, const Node& n, const std::vector<const HostTensor*>& inputs,
                         const SymbolValues& syms);

// Evaluates the whole graph; returns the values of g.outputs.
std::vector<HostTensor> evaluate(const Graph& g, const std::vector<HostTensor>& inputs);

}  // namespace opfuse
