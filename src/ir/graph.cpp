#include "ir/graph.h"

#include "ir/ops.h"

namespace opfuse {

static const AttrValue& need(const Node& n, const std::string& k) {
  auto it = n.attrs.find(k);
  if (it == n.attrs.end()) throw GraphError(n.where() + ": missing attribute '" + k + "'");
  return it->second;
}

template <class T>
static const T& as(const Node& n, const std::string& k, const char* what) {
  const AttrValue& v = need(n, k);
  if (auto p = std::get_if<T>(&v)) return *p;
  throw GraphError(n.where() + ": attribute '" + k + "' must be " + what);
}

int64_t Node::get_int(const std::string& k) const { return as<int64_t>(*this, k, "an integer"); }
int64_t Node::get_int(const std::string& k, int64_t d) const { return has(k) ? get_int(k) : d; }
double Node::get_float(const std::string& k) const {
  const AttrValue& v = need(*this, k);
  if (auto p = std::get_if<double>(&v)) return *p;
  if (auto p = std::get_if<int64_t>(&v)) return static_cast<double>(*p);
  if (auto p = std::get_if<bool>(&v)) return *p ? 1.0 : 0.0;
  throw GraphError(where() + ": attribute '" + k + "' must be a number");
}
double Node::get_float(const std::string& k, double d) const { return has(k) ? get_float(k) : d; }
bool Node::get_bool(const std::string& k, bool d) const { return has(k) ? as<bool>(*this, k, "true or false") : d; }
std::string Node::get_str(const std::string& k, const std::string& d) const {
  return has(k) ? as<std::string>(*this, k, "a string") : d;
}
std::vector<int64_t> Node::get_ints(const std::string& k) const {
  const AttrValue& v = need(*this, k);
  if (auto p = std::get_if<std::vector<int64_t>>(&v)) return *p;
  if (auto p = std::get_if<int64_t>(&v)) return {*p};
  if (auto p = std::get_if<Shape>(&v)) {  // an all-constant list parses as a shape
    std::vector<int64_t> r;
    for (auto& e : *p) {
      int64_t c;
      if (!is_const(e, &c)) throw GraphError(where() + ": attribute '" + k + "' must be integers");
      r.push_back(c);
    }
    return r;
  }
  throw GraphError(where() + ": attribute '" + k + "' must be a list of integers");
}
Shape Node::get_shape(const std::string& k) const {
  const AttrValue& v = need(*this, k);
  if (auto p = std::get_if<Shape>(&v)) return *p;
  if (auto p = std::get_if<std::vector<int64_t>>(&v)) {
    Shape s;
    for (auto x : *p) s.push_back(cst(x));
    return s;
  }
  throw GraphError(where() + ": attribute '" + k + "' must be a shape");
}
DType Node::get_dtype(const std::string& k) const { return as<DType>(*this, k, "a dtype"); }
std::string Node::where() const { return "%" + std::to_string(id) + " (" + op + ")"; }

int Graph::add_input(const std::string& name, DType dtype, Shape shape) {
  return add_typed("input", {}, {{"name", name}}, dtype, std::move(shape));
}

Expr Node::scalar_size() const {
  if (op != "scalar" || !has("size")) return nullptr;
  Shape s = get_shape("size");
  return s.size() == 1 ? s[0] : nullptr;
}

void Node::collect_symbols(std::vector<std::string>* out) const {
  for (const Expr& d : shape) opfuse::collect_symbols(d, out);
  for (const auto& [key, value] : attrs)
    if (auto p = std::get_if<Shape>(&value))
      for (const Expr& e : *p) opfuse::collect_symbols(e, out);
}

int Graph::add_size_scalar(const Expr& size) {
  return add_typed("scalar", {}, {{"size", Shape{size}}, {"weak", true}}, DType::Int64, {});
}

int Graph::add_scalar(double value, DType dtype, bool weak) {
  Attrs a{{"value", value}};
  if (weak) a["weak"] = true;
  return add_typed("scalar", {}, a, dtype, {});
}

int Graph::add(const std::string& op, std::vector<int> inputs, Attrs attrs) {
  Node n;
  n.id = static_cast<int>(nodes.size());
  n.op = op;
  n.inputs = std::move(inputs);
  n.attrs = std::move(attrs);
  for (int i : n.inputs)
    if (i < 0 || i >= n.id) throw GraphError(n.where() + ": input %" + std::to_string(i) + " is not defined before it");
  infer_type(*this, n);
  nodes.push_back(std::move(n));
  return nodes.back().id;
}

int Graph::add_typed(const std::string& op, std::vector<int> inputs, Attrs attrs, DType dtype, Shape shape) {
  Node n;
  n.id = static_cast<int>(nodes.size());
  n.op = op;
  n.inputs = std::move(inputs);
  n.attrs = std::move(attrs);
  n.dtype = dtype;
  n.shape = std::move(shape);
  nodes.push_back(std::move(n));
  return nodes.back().id;
}

std::vector<int> Graph::input_ids() const {
  std::vector<int> r;
  for (auto& n : nodes)
    if (n.op == "input") r.push_back(n.id);
  return r;
}

std::vector<std::vector<int>> Graph::users() const {
  std::vector<std::vector<int>> u(nodes.size());
  for (auto& n : nodes)
    for (int i : n.inputs) u[static_cast<size_t>(i)].push_back(n.id);
  return u;
}

void verify(const Graph& g) {
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    if (n.id != static_cast<int>(i)) throw GraphError(n.where() + ": id does not match its position " + std::to_string(i));
    for (int in : n.inputs)
      if (in < 0 || in >= n.id)
        throw GraphError(n.where() + ": input %" + std::to_string(in) + " is not defined before it");
    if (n.op == "input" || n.op == "scalar") {
      if (n.op == "scalar" && !n.shape.empty()) throw GraphError(n.where() + ": a scalar has shape []");
      if (n.op == "scalar" && n.has("size") && (n.get_shape("size").size() != 1 || n.dtype != DType::Int64))
        throw GraphError(n.where() + ": a size scalar has one size expression and dtype i64");
      if (n.op == "scalar" && !n.has("size") && !n.has("value")) throw GraphError(n.where() + ": a scalar needs a value or a size");
      if (!n.inputs.empty()) throw GraphError(n.where() + ": takes no inputs");
      continue;
    }
    Node check = n;
    infer_type(g, check);
    if (check.dtype != n.dtype)
      throw GraphError(n.where() + ": declared dtype " + dtype_name(n.dtype) + " but the op gives " + dtype_name(check.dtype));
    bool same = check.shape.size() == n.shape.size();
    for (size_t d = 0; same && d < n.shape.size(); ++d) same = expr_equal(check.shape[d], n.shape[d]);
    if (!same)
      throw GraphError(n.where() + ": declared shape " + shape_to_string(n.shape) + " but the op gives " +
                       shape_to_string(check.shape));
  }
  if (g.outputs.empty()) throw GraphError("graph has no outputs");
  for (int o : g.outputs)
    if (o < 0 || o >= static_cast<int>(g.nodes.size()))
      throw GraphError("output %" + std::to_string(o) + " is not a node of the graph");
}

}  // namespace opfuse
