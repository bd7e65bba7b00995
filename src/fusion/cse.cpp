#include <map>
#include <sstream>

#include "fusion/passes.h"

namespace opfuse {

Graph eliminate_common_subexpressions(const Graph& g) {
  // Which nodes the outputs need.
  std::vector<bool> live(g.nodes.size(), false);
  for (int o : g.outputs) live[static_cast<size_t>(o)] = true;
  for (size_t k = g.nodes.size(); k-- > 0;) {
    if (!live[k] && g.nodes[k].op != "input") continue;
    for (int i : g.nodes[k].inputs) live[static_cast<size_t>(i)] = true;
  }
  Graph out;
  std::vector<int> remap(g.nodes.size(), -1);
  std::map<std::string, int> seen;
  for (const Node& n : g.nodes) {
    if (!live[static_cast<size_t>(n.id)] && n.op != "input") continue;
    std::vector<int> ins;
    for (int i : n.inputs) ins.push_back(remap[static_cast<size_t>(i)]);
    // The key: the node printed without its id, over remapped inputs.
    Graph one;
    std::ostringstream key;
    key << n.op << "(";
    for (int i : ins) key << i << ",";
    key << ")";
    Node tmp = n;
    tmp.id = 0;
    tmp.inputs.clear();
    one.nodes.push_back(tmp);
    one.outputs.push_back(0);
    key << print_graph(one);
    if (n.op != "input") {
      auto it = seen.find(key.str());
      if (it != seen.end()) { remap[static_cast<size_t>(n.id)] = it->second; continue; }
    }
    int id = out.add_typed(n.op, ins, n.attrs, n.dtype, n.shape);
    remap[static_cast<size_t>(n.id)] = id;
    if (n.op != "input") seen[key.str()] = id;
  }
  for (int o : g.outputs) out.outputs.push_back(remap[static_cast<size_t>(o)]);
  return out;
}

const std::vector<GraphPass>& graph_passes() {
  static const std::vector<GraphPass> passes = {
      {"decompose_composites", decompose_composites},
      {"eliminate_common_subexpressions", eliminate_common_subexpressions},
  };
  return passes;
}

}  // namespace opfuse
