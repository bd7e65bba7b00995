// The C-like emitter: prints a kernel's statements as C++. The CPU emitter
// subclasses it with OpenMP loops and host types; the CUDA emitter (next)
// with thread indexing and device types. Statement printing is shared.
#pragma once
#include <sstream>
#include <string>
#include <vector>

#include "codegen/kernel_ir.h"

namespace opfuse {

// How each stride of each strided (graph-input) buffer is specialised:
// '0' (broadcast or size 1), '1' (unit) or 'x' (passed at run time).
struct StrideSignature {
  std::vector<std::string> classes;  // per strided buffer, one char per dim
  std::string key() const;
};

// A row kernel's domain split into kept axes (one row each) and reduced
// axes; `loop` drops size-1 reduced axes, which have no loop variable.
struct RowSplit {
  std::vector<size_t> kept, reduced, loop;
  Expr rows, cols;
};
RowSplit split_rows(const KernelIR& k);

class CEmitter {
 public:
  virtual ~CEmitter() = default;
  // The whole kernel as one function.
  virtual std::string emit(const KernelIR& k, const StrideSignature& sig) = 0;

 protected:
  const KernelIR* k_ = nullptr;
  const StrideSignature* sig_ = nullptr;
  std::ostringstream out_;
  int indent_ = 0;

  void line(const std::string& s);
  virtual std::string storage_type(DType t) const;  // element type in memory
  virtual std::string value_type(DType t) const;    // type of a compute value
  virtual std::string load(int buffer, const std::string& offset) const;
  virtual std::string store(int buffer, const std::string& offset, const std::string& v) const;
  virtual std::string literal(double v, DType t) const;
  std::string value(int id) const { return "v" + std::to_string(id); }
  std::string size_c(const Expr& e) const;          // a size or index expression in C
  Expr offset_expr(int buffer, const std::vector<Expr>& idx) const;
  // (Virtual: the CUDA row emitter prints 32-bit offsets where they fit, OPFUSE_ROW_INDEX32.)
  virtual std::string offset(int buffer, const std::vector<Expr>& idx) const { return size_c(offset_expr(buffer, idx)); }
  virtual void statement(const KStmt& s, const KStage& stage);
  // How an Update folds a value into an accumulator (per thread on GPUs).
  void update(const KStmt& s, const KStage& stage);
  // A column partial's update (KStmt::Partial); only the CUDA row emitter has them.
  virtual void partial(const KStmt& s);
  void accumulator_init(const KAccumulator& a);
  void accumulator_finish(const KAccumulator& a);
  std::string acc_name(const KAccumulator& a, const char* part = "") const;
  // Sets the loop variables of `axes` (last fastest) from a linear index.
  // Declares x<axis> (prefix + axis) for each axis of `linear`, row-major.
  void decompose(const std::string& linear, const std::vector<size_t>& axes, const std::string& prefix = "x");
  // The type decompose declares them with (the CUDA row emitter's int where
  // every index fits 31 bits, OPFUSE_ROW_INDEX32).
  std::string index_type_ = "int64_t";
  // Shared preamble of a kernel body: size symbols and buffer pointers.
  void bind_arguments();
};

}  // namespace opfuse
