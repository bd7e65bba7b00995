// Host C++ for one kernel: OpenMP threads over rows (or over chunks of a
// pointwise domain) and a simd inner loop the host compiler vectorises.
#pragma once
#include <set>
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
  bool in_row_loop_ = false;
  std::set<int> loop_varying_;  // values the current row loop defines per element
};

// The helper code every generated CPU source starts with.
const char* cpu_prelude();

}  // namespace opfuse
