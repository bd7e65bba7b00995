#include "fusion/passes.h"
#include "ir/ops.h"

namespace opfuse {

Graph decompose_composites(const Graph& g) {
  Graph out;
  std::vector<int> remap(g.nodes.size(), -1);
  for (const Node& n : g.nodes) {
    std::vector<int> ins;
    for (int i : n.inputs) ins.push_back(remap[static_cast<size_t>(i)]);
    const OpDef& d = op_def(n);
    if (n.op == "input" || n.op == "scalar") {
      remap[static_cast<size_t>(n.id)] = out.add_typed(n.op, {}, n.attrs, n.dtype, n.shape);
    } else if (d.kind == OpKind::Composite) {
      Node copy = n;
      copy.inputs = ins;
      remap[static_cast<size_t>(n.id)] = d.decompose(out, copy);
    } else {
      remap[static_cast<size_t>(n.id)] = out.add(n.op, ins, n.attrs);
    }
  }
  for (int o : g.outputs) out.outputs.push_back(remap[static_cast<size_t>(o)]);
  return out;
}

}  // namespace opfuse
