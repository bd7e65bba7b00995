// CUDA C++ for one kernel, as a subclass of the C-like emitter.
//
// Pointwise: a grid-stride loop in which each thread takes V consecutive
// elements of the innermost dim, loading and storing them with 128-bit
// accesses where every access is unit-stride along that dim (a scalar twin,
// V = 1, serves inputs whose alignment or strides do not allow it; the
// runtime picks per launch).
// Row: a warp per row for rows of at most 1024 elements (8 rows a block), a
// block per row otherwise; when the row length is known and each thread's
// share is small, the row's loads are kept in registers after the first
// stage, so every later stage (softmax's second and third pass, a norm's
// normalise pass) reads no memory.
#pragma once
#include "codegen/c_emitter.h"

namespace opfuse {

struct CudaLaunch {
  bool row = false;
  int threads = 256;
  int rows_per_block = 1;  // row kernels: 8 with a warp per row
  int vec = 1;             // pointwise: elements per thread access
  std::vector<int> vec_buffers;  // kernel buffers accessed with vectors
  int items = 0;           // row kernels: per-thread register cache length (0: none)
  int vec_threads = 0, vec_rows_per_block = 0;  // row kernels: geometry of the vector twin
  Expr numel, rows, cols;  // launch geometry in terms of size symbols
  std::string name, vec_name;  // scalar and vector entry points
};

class CudaEmitter : public CEmitter {
 public:
  std::string emit(const KernelIR& k, const StrideSignature& sig) override;
  const CudaLaunch& launch() const { return launch_; }

 private:
  CudaLaunch launch_;
  int vec_ = 1;                  // the V of the function being printed
  bool in_lanes_ = false;
  std::vector<bool> vec_buffer_;  // by kernel buffer
  std::map<std::string, int> cache_slot_;  // row kernels: (buffer, index) -> register array
  std::vector<std::string> cache_types_;
  bool caching_ = false;
  int stage_index_ = 0;
  std::string smem_ = "opf_smem";
  bool warp_rows_ = false;

  std::map<std::string, std::string> lane_of_;  // access (buffer@offset) -> lane array
  std::string last_var_;                        // the innermost loop variable
  bool row_vectorisable_ = false;

  void statement(const KStmt& s, const KStage& stage) override;
  void pointwise(const std::string& name, int vec);
  void row_kernel(const std::string& name, int vec);
  std::string access_key(const KStmt& s) const;
  // Declares lane arrays and issues the vector loads of `stmts` at lane 0's
  // index (`lane0` replaces the innermost variable); skips cached loads.
  void vector_loads(const std::vector<KStmt>& stmts, const std::string& lane0);
  void vector_stores(const std::vector<KStmt>& stmts, const std::string& lane0);
  void reduce_across_threads(const KAccumulator& a);
  int choose_vec(bool all_stages);
  std::string header(const std::string& name, int threads);
};

const char* cuda_prelude();

}  // namespace opfuse
