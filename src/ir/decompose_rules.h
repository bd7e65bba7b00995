// How each composite op is built from primitives. The decomposition pass
// (fusion/decompose.cpp) applies these; the fusion planner then sees only
// primitives, so `softmax` and a hand-written softmax plan the same way.
#pragma once
#include "ir/graph.h"

namespace opfuse {

int decompose_softmax(Graph& g, const Node& n);
int decompose_log_softmax(Graph& g, const Node& n);
int decompose_layer_norm(Graph& g, const Node& n);
int decompose_layer_norm_stats(Graph& g, const Node& n);
int decompose_rms_norm(Graph& g, const Node& n);
int decompose_rms_norm_rstd(Graph& g, const Node& n);
int decompose_softmax_backward(Graph& g, const Node& n);
int decompose_log_softmax_backward(Graph& g, const Node& n);
int decompose_layer_norm_backward(Graph& g, const Node& n);
int decompose_rms_norm_backward(Graph& g, const Node& n);

}  // namespace opfuse
