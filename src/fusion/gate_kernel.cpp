#include "fusion/gate_kernel.h"

#include <algorithm>

namespace opfuse {

int silu_input(const FusionPlan& plan, int node, DType dt) {
  const Graph& g = plan.graph;
  auto inlined = [&](int id) { return plan.kernel_of[static_cast<size_t>(id)] < 0 && g.node(id).op != "input"; };
  const Node& n = g.node(node);
  if (!inlined(node)) return -1;
  if (n.op == "silu" && n.dtype == dt) return g.node(n.inputs[0]).dtype == dt ? n.inputs[0] : -1;
  int prod = node;
  if (n.op == "cast") {
    if (n.dtype != dt) return -1;
    prod = n.inputs[0];
    if (!inlined(prod)) return -1;
  }
  const Node& mul = g.node(prod);
  if (mul.op != "mul" || mul.inputs.size() != 2) return -1;
  for (int side = 0; side < 2; ++side) {
    const int c = mul.inputs[static_cast<size_t>(side)];
    const Node& sig = g.node(mul.inputs[static_cast<size_t>(1 - side)]);
    if (sig.op != "sigmoid" || sig.inputs[0] != c || !inlined(sig.id)) continue;
    const Node& cn = g.node(c);
    if (cn.dtype == dt && prod == node) return c;  // a * sigmoid(a) in the element type
    if (cn.op == "cast" && cn.dtype == DType::Float32 && mul.dtype == DType::Float32 && inlined(c) &&
        g.node(cn.inputs[0]).dtype == dt && prod != node)
      return cn.inputs[0];
  }
  return -1;
}

bool is_gate_kernel(const FusionPlan& plan, int k, int root, int* a, int* b) {
  const Graph& g = plan.graph;
  const KernelGroup& kg = plan.kernels[static_cast<size_t>(k)];
  if (kg.kind != KernelGroup::Kind::Pointwise || kg.roots.size() != 1 || kg.roots[0] != root) return false;
  const Node& mul = g.node(root);
  if (mul.op != "mul" || mul.inputs.size() != 2) return false;
  for (int side = 0; side < 2; ++side) {
    const int other = mul.inputs[static_cast<size_t>(1 - side)];
    const int x = silu_input(plan, mul.inputs[static_cast<size_t>(side)], mul.dtype);
    if (x < 0 || g.node(other).dtype != mul.dtype) continue;
    *a = x;
    *b = other;
    return plan.kernel_of[static_cast<size_t>(x)] >= 0 && plan.kernel_of[static_cast<size_t>(other)] >= 0 && x != other;
  }
  return false;
}

bool private_to(const FusionPlan& plan, int node, const std::set<int>& inside) {
  for (int o : plan.graph.outputs)
    if (o == node) return false;
  for (auto [o, src] : plan.output_alias)
    if (src == node || o == node) return false;
  for (size_t k = 0; k < plan.kernels.size(); ++k) {
    if (inside.count(static_cast<int>(k))) continue;
    const auto& r = plan.kernels[k].reads;
    if (std::find(r.begin(), r.end(), node) != r.end()) return false;
  }
  return true;
}

}  // namespace opfuse
