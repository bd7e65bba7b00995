// The tensor-graph IR: a list of nodes in topological order, each producing
// one tensor with a dtype and a (possibly symbolic) shape. Strides are not
// part of the graph: graph inputs may have any strides and storage offset,
// and kernels receive them at run time.
#pragma once
#include <map>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "ir/dtype.h"
#include "ir/expr.h"

namespace opfuse {

// Errors in a graph (bad shapes, unknown ops, ...). The message names the
// node as `%id (op)` and the problem.
struct GraphError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using AttrValue = std::variant<int64_t, double, bool, std::string, std::vector<int64_t>, Shape, DType>;
using Attrs = std::map<std::string, AttrValue>;

struct Node {
  int id = -1;
  std::string op;
  std::vector<int> inputs;
  Attrs attrs;
  DType dtype = DType::Float32;
  Shape shape;

  int rank() const { return static_cast<int>(shape.size()); }
  bool has(const std::string& k) const { return attrs.count(k) != 0; }
  int64_t get_int(const std::string& k) const;
  int64_t get_int(const std::string& k, int64_t dflt) const;
  double get_float(const std::string& k) const;
  double get_float(const std::string& k, double dflt) const;
  bool get_bool(const std::string& k, bool dflt) const;
  std::string get_str(const std::string& k, const std::string& dflt) const;
  std::vector<int64_t> get_ints(const std::string& k) const;
  Shape get_shape(const std::string& k) const;
  DType get_dtype(const std::string& k) const;
  std::string where() const;  // "%3 (add)", for messages
  // A scalar's size expression (add_size_scalar), else null.
  Expr scalar_size() const;
  // Every size symbol the node mentions: in its shape and in its size
  // attributes (a size scalar's, a slice's bounds, a reshape's shape).
  void collect_symbols(std::vector<std::string>* out) const;
};

class Graph {
 public:
  std::vector<Node> nodes;
  std::vector<int> outputs;

  // A graph input; `name` is the user's name for it.
  int add_input(const std::string& name, DType dtype, Shape shape);
  // A constant scalar; `weak` marks a Python number (it promotes only by category).
  int add_scalar(double value, DType dtype, bool weak = true);
  // A weak int64 scalar whose value is a size expression, bound at run time
  // (a SymInt used as a number: mean's backward divides by a symbolic size).
  int add_size_scalar(const Expr& size);
  // Adds a node and infers its dtype and shape with the op's rule; throws
  // GraphError naming the node when the inputs do not fit the op.
  int add(const std::string& op, std::vector<int> inputs, Attrs attrs = {});
  // Adds a node with a declared type (the parser's way); verify() checks it.
  int add_typed(const std::string& op, std::vector<int> inputs, Attrs attrs, DType dtype, Shape shape);

  const Node& node(int id) const { return nodes.at(static_cast<size_t>(id)); }
  std::vector<int> input_ids() const;
  std::vector<std::vector<int>> users() const;
};

// Canonical text form; parse_graph(print_graph(g)) reproduces g.
std::string print_graph(const Graph& g);
Graph parse_graph(const std::string& text);  // throws GraphError with a line number

// Checks topological order, known ops, arities, attributes, and that each
// node's declared dtype and shape equal what its op's rule infers.
void verify(const Graph& g);

}  // namespace opfuse
