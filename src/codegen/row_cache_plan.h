// Which values of a row kernel stay in registers from one stage to the next.
//
// A row kernel walks its row once per stage (softmax: max, then sum of exp,
// then the normalised output). Later stages recompute what earlier stages
// already computed per element: the loads, and often more (softmax's
// exp(x - max) in the output stage is the same value the sum stage made).
// The plan keys every loop statement by its structure, finds in each later
// stage the frontier of values an earlier stage already computed, and keeps
// exactly those in registers; what lies behind the frontier is not emitted.
// Caching the frontier instead of the loads saves work (one exp per element
// for softmax instead of two) at the same register cost when the frontier
// has as many values as there are loads; the emitter takes whichever of the
// two plans needs fewer registers.
#pragma once
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "codegen/kernel_ir.h"

namespace opfuse {

struct RowCachePlan {
  std::vector<DType> slot_types;          // one register array per slot
  std::vector<std::map<int, int>> read;   // per stage: value id -> slot it is read from
  std::vector<std::map<int, int>> write;  // per stage: value id -> slot it is saved into
  std::vector<std::set<int>> skip;        // per stage: loop values that are not needed
  int slots() const { return static_cast<int>(slot_types.size()); }
};

// The structural key of a loop statement given its operands' keys (values
// defined outside the loop are keyed by their id).
using StatementKey = std::function<std::string(const KStmt&, const std::vector<std::string>& arg_keys)>;

// loads_only: cache only loads (the plan when the frontier is wider).
// cache_row_invariant: also cache values that are the same for every row
// (weights, biases), which are otherwise reloaded from L1 in each stage.
RowCachePlan plan_row_cache(const KernelIR& k, const StatementKey& key, bool loads_only, bool cache_row_invariant = false);

std::string to_string(const RowCachePlan& p);

}  // namespace opfuse
