// Helpers shared by the two halves of the reference oracle (evaluate.cpp for
// primitives, evaluate_composite.cpp for composite ops). Not an interface:
// everything outside src/ir uses evaluate.h.
#pragma once
#include <vector>

#include "ir/evaluate.h"

namespace opfuse::eval_detail {

std::vector<int64_t> row_major_strides(const std::vector<int64_t>& shape);

// The values of `t` broadcast (PyTorch's rules) to `shape`, row-major; throws
// GraphError naming `n` when t's shape does not broadcast to it.
std::vector<double> broadcast_values(const HostTensor& t, const std::vector<int64_t>& shape, const Node& n);

// Evaluates a composite op directly in float64 (not through its
// decomposition, so that tests can compare the two). `out` arrives with its
// dtype and shape set.
void evaluate_composite(const Node& n, const std::vector<const HostTensor*>& inputs, HostTensor& out);

}  // namespace opfuse::eval_detail
