// The kernel IR: one fused kernel as loops over a domain, in stages, with
// SSA statements. Both code generators (CPU C++, CUDA) print this same IR.
//
//   Pointwise kernel: one stage whose loop covers the whole domain.
//   Row kernel: the outer loops run over the kept axes (one row each); every
//   stage is a loop over the reduced axes of that row, ending in the row's
//   reductions; a last stage writes the row's full-shaped results.
#pragma once
#include <string>
#include <vector>

#include "ir/dtype.h"
#include "ir/expr.h"
#include "ir/graph.h"

namespace opfuse {

struct KBuffer {
  int node = -1;         // graph node whose value this buffer holds
  DType dtype = DType::Float32;
  Shape shape;
  bool strided = false;  // a graph input: strides come at run time; else contiguous
  bool written = false;  // an output of this kernel
  bool partials = false; // a column_partials node: filled by Partial statements
};

struct KStmt {
  // Partial: adds args[0] into this thread's running column partial of
  // `buffer` (a column_partials node; written once after the rows, by the
  // emitter).
  enum Kind { Load, Const, Compute, Cast, Store, Update, Partial } kind = Compute;
  int dst = -1;               // value defined (Load, Const, Compute, Cast)
  DType type = DType::Float32;  // type of dst (a compute type)
  int buffer = -1;            // Load / Store / Partial
  std::vector<Expr> index;    // Load / Store: the multi-index into the buffer
  Node node;                  // Compute: the op and its attributes
  std::vector<int> args;      // operand values
  double value = 0;           // Const
  Expr size;                  // Const: a size expression in place of value (a size scalar)
  int acc = -1;               // Update: which accumulator
  bool varying = false;       // depends on the stage's loop variables
};

struct KAccumulator {
  int id = -1;
  std::string combiner;  // sum, prod, max, min, argmax, argmin, welford
  DType type = DType::Float32;     // accumulation type
  DType result_type = DType::Float32;
  int result = -1;       // value holding the finished reduction
  Expr count;            // elements per row (mean, var)
  int64_t correction = 0;  // var
  bool mean = false;     // divide a sum by count
  Expr index;            // argmax/argmin: the element's index within its row (row-major over the reduced axes)
};

struct KStage {
  std::vector<KStmt> pre;    // once per row, before the loop
  std::vector<KStmt> loop;   // once per element of the row (per domain element for pointwise)
  std::vector<KAccumulator> accs;
  std::vector<KStmt> post;   // once per row, after the loop (finishing accumulators)
};

struct KernelIR {
  std::string name;
  bool row = false;
  Shape domain;                    // variables x0..x{n-1}
  std::vector<int64_t> reduce_axes;
  std::vector<KBuffer> buffers;    // inputs first, then outputs
  std::vector<KStage> stages;
  std::vector<DType> value_types;  // by value id
  std::vector<std::string> symbols;  // size symbols used, in order
  int64_t parts = 0;               // column_partials' parts (0: none); rows are dealt out modulo parts

  std::string to_string() const;
};

}  // namespace opfuse
