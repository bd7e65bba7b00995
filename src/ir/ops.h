// The op registry: for every op its kind (the fusion lattice), its arity,
// its dtype and shape rule, its cost, and for elementwise ops the scalar
// function the oracle uses and the C expression both code generators emit.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "ir/graph.h"

namespace opfuse {

// The fusion lattice, after TVM's: what an op's loops look like decides what
// it may be fused with.
enum class OpKind {
  Source,       // input, scalar, full: no loops of their own
  Elementwise,  // one output element from the same-index elements of (broadcast) inputs
  Broadcast,    // expand: an index map that repeats
  Layout,       // reshape, permute, slice, cat, ...: an index map (injective)
  Reduction,    // sum, mean, amax, amin, var, argmax over some dims
  Composite,    // softmax, norms and their backward ops: decomposed before planning
  Gemm,         // matmul: a library call (cuBLASLt, or PyTorch on the CPU), never generated
  Opaque,       // anything left to PyTorch
};
const char* op_kind_name(OpKind k);

// Which type each operand of an elementwise op is converted to before the op.
enum class OperandType {
  Result,  // the result's compute type (add, exp, ...)
  Common,  // the promoted type of the inputs (comparisons, whose result is bool)
  Own,     // left as it is (casts, where's condition)
};

struct OpDef {
  std::string name;
  OpKind kind = OpKind::Opaque;
  int min_inputs = 0, max_inputs = 0;  // max -1: any number
  std::function<void(const Graph&, Node&)> infer;
  // Elementwise: the oracle's function, on values in double, and the C
  // expression with {0}, {1}, ... for the operands (already converted).
  std::function<double(const std::vector<double>&, const Node&)> scalar;
  std::function<std::string(const std::vector<std::string>&, const Node&)> c_expr;
  OperandType operands = OperandType::Result;
  double flops = 1;  // per output element (per input element for reductions)
  // Composite: builds the op out of primitives in g, returns the result node.
  std::function<int(Graph&, const Node&)> decompose;
};

const OpDef* find_op(const std::string& name);
const OpDef& op_def(const Node& n);  // throws GraphError for an unknown op
std::vector<std::string> op_names();

// Sets n.dtype and n.shape from its inputs in g; throws GraphError.
void infer_type(const Graph& g, Node& n);

// Broadcasts shapes the way PyTorch does (right-aligned; a literal 1 stretches).
Shape broadcast_shapes(const std::vector<Shape>& shapes, const std::string& where);

// PyTorch's result_type over inputs of a node: dimensioned tensors, then
// zero-dim tensors, then weak scalars, each tier raising only the category.
DType result_type(const Graph& g, const std::vector<int>& inputs);

// Normalises a (possibly negative) dim against rank; throws GraphError.
int64_t normalize_dim(int64_t d, int64_t rank, const Node& n);
std::vector<int64_t> reduction_dims(const Node& n, int64_t rank);
// A slice's [start, end) along a dim of `size`: negative values count from
// the end, ends past the size (or the 2^62 'to the end' marker) clamp.
std::pair<Expr, Expr> slice_bounds(const Node& n, const Expr& size);

}  // namespace opfuse
