// Lowering: one kernel group of a fusion plan to the kernel IR, inlining
// every non-realized node as an index expression (views become index maps,
// broadcasts zero an index, cat selects between clamped loads).
#pragma once
#include <stdexcept>

#include "codegen/kernel_ir.h"
#include "fusion/plan.h"

namespace opfuse {

// Thrown when a group cannot be one kernel: a reduction of the kernel is
// needed at another row than the one being computed.
struct LoweringConflict : std::runtime_error {
  using std::runtime_error::runtime_error;
};

KernelIR lower_kernel(const FusionPlan& plan, const KernelGroup& group, const std::string& name);

// Whether lower_kernel succeeds for this group (the planner's last check).
bool can_lower(const FusionPlan& plan, const KernelGroup& group);

}  // namespace opfuse
