#include "ir/specialize.h"

namespace opfuse {

Graph fix_symbols(const Graph& g, const std::map<std::string, int64_t>& values) {
  auto fix = [&](const Expr& e) {
    return substitute(e, [&](const ExprNode& leaf) -> Expr {
      if (leaf.kind != ExprNode::Sym) return nullptr;
      auto it = values.find(leaf.name);
      return it == values.end() ? nullptr : cst(it->second);
    });
  };
  Graph r = g;
  for (Node& n : r.nodes) {
    for (Expr& d : n.shape) d = fix(d);
    for (auto& [key, value] : n.attrs)
      if (auto* s = std::get_if<Shape>(&value))
        for (Expr& e : *s) e = fix(e);
  }
  return r;
}

}  // namespace opfuse
