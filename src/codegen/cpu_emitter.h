// Host C++ for one kernel: OpenMP threads over rows (or over chunks of a
// pointwise domain) and a simd inner loop the host compiler vectorises.
#pragma once
#include <map>
#include <string>
#include <vector>
#include "codegen/c_emitter.h"

namespace opfuse {

class CpuEmitter : public CEmitter {
 public:
  std::string emit(const KernelIR& k, const StrideSignature& sig) override;

 private:
  void pointwise_body();
  void row_body();
  void stage_loop(const KStage& st, const std::vector<size_t>& axes, const std::string& count);
  // max/min vectorise as OpenMP max/min reductions plus a NaN count (OpenMP's
  // own max does not propagate NaN; a NaN seen makes the result NaN).
  void statement(const KStmt& s, const KStage& stage) override;

  // Row kernels: expensive values (exp, log, tanh, ...) a later stage would
  // recompute exactly as an earlier one did are stored to a per-thread
  // scratch row by the earlier stage and loaded by the later one.
  void plan_row_cache();
  std::map<int, int> cache_store_;  // value id -> scratch slot it is written to
  std::map<int, int> cache_load_;   // value id -> scratch slot it is read from
  std::vector<std::string> cache_types_;
  std::string row_index_;           // the loop variable indexing the scratch row
};

// The helper code every generated CPU source starts with.
const char* cpu_prelude();

}  // namespace opfuse
