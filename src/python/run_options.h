// RunOptions from the arguments the Python bindings take (CompiledGraph.run
// and PreparedRun.run): raw stream and workspace addresses (cuBLASLt's, the
// decode MLP kernel's), TF32, and a
// Python callable for the CPU's matmuls, called with the GIL held.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/function.h>

#include <cstdint>

#include "runtime/compiled_graph.h"

namespace opfuse {

inline RunOptions run_options_from_python(uintptr_t stream, uintptr_t workspace, size_t workspace_bytes, bool allow_tf32,
                                          nanobind::object cpu_gemm, uintptr_t zeroed_workspace = 0,
                                          size_t zeroed_workspace_bytes = 0) {
  RunOptions o;
  o.zeroed_workspace = reinterpret_cast<void*>(zeroed_workspace);
  o.zeroed_workspace_bytes = zeroed_workspace_bytes;
  o.stream = reinterpret_cast<void*>(stream);
  o.workspace = reinterpret_cast<void*>(workspace);
  o.workspace_bytes = workspace_bytes;
  o.allow_tf32 = allow_tf32;
  if (!cpu_gemm.is_none())
    o.cpu_gemm = [cpu_gemm](int g) {
      nanobind::gil_scoped_acquire acquire;
      cpu_gemm(g);
    };
  return o;
}

}  // namespace opfuse
