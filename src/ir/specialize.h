// Fixing size symbols to values: a copy of a graph in which some symbols are
// constants. The compiled kernels skip a cat part (or a slice_scatter source)
// only when its size is a constant 0; a part of symbolic size that is 0 at
// run time is handled by compiling the graph with that size's symbols fixed
// (CompiledGraph::for_sizes).
#pragma once
#include <cstdint>
#include <map>
#include <string>

#include "ir/graph.h"

namespace opfuse {

// `g` with every symbol named in `values` replaced by its value, in node
// shapes and in shape-valued attributes (slice bounds, size scalars, full's
// and reshape's shapes). Symbols not named stay symbolic.
Graph fix_symbols(const Graph& g, const std::map<std::string, int64_t>& values);

}  // namespace opfuse
