// The run of a prepared layout on PyTorch tensors, shared by
// PreparedRun.call / .finish and the Launcher's hot path
// (bindings_launch.cpp): the written buffers from the allocator Python gave
// (a GEMM pair's two results in one block), every tensor's data_ptr(), the
// run, the counts and the result. Tensors are read through their Python
// methods (no libtorch, product.md).
#pragma once
#include <nanobind/nanobind.h>

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "runtime/compiled_graph.h"

namespace opfuse::py {

namespace nb = nanobind;

// Kernel launches made by PreparedRun.call and Launcher calls, added into
// opfuse.stats() (the Python side counts everything else); atomic, so no
// lock per call.
extern std::atomic<int64_t> g_kernel_launches;
// GEMM steps run as library calls by the same paths (cuBLASLt on the GPU,
// PyTorch's matmul on the CPU).
extern std::atomic<int64_t> g_library_calls;

// What a finished call returns (PreparedRun.set_result).
enum ResultKind : int { kOne = 0, kTuple = 1, kList = 2, kBuffers = 3 };

struct PreparedRunRef {
  const CompiledGraph* graph = nullptr;  // kept alive by nb::keep_alive
  CompiledGraph::PreparedRun run;
  nb::object empty;                      // (sizes, strides, dtype) -> tensor, for call()
  std::vector<nb::tuple> out_args;       // its arguments, per written buffer
  int kind = kBuffers;
  // Per value returned: index into inputs + written buffers, and the shape
  // it is viewed as (None: as it is).
  std::vector<std::pair<size_t, nb::object>> outs;
  int direct = -1;  // kOne of a written buffer as it is: its index among the written ones
  // Graphs with library calls (set_library): GEMM result pairs allocated as
  // one block, and on the CPU the callable running GEMM step g as
  // cpu_gemm(g, inputs + written buffers).
  struct Pair {
    size_t first, second;  // indices among the written buffers
    nb::tuple block;       // the block's (sizes, strides, dtype) for `empty`
    nb::tuple views[2];    // (sizes, strides, storage offset) of each result in it
  };
  std::vector<Pair> pairs;
  nb::object cpu_gemm = nb::none();
};

// What a CUDA run of a graph with library calls takes from PyTorch: the
// workspaces of the current (device, stream) and the TF32 setting.
struct LibraryArgs {
  uintptr_t workspace = 0;
  size_t workspace_bytes = 0;
  uintptr_t zeroed_workspace = 0;
  size_t zeroed_workspace_bytes = 0;
  bool allow_tf32 = false;
};

size_t sequence_size(PyObject* o);                 // a list's or tuple's
PyObject* sequence_item(PyObject* o, size_t i);    // borrowed
void* as_pointer(PyObject* v);                     // a Python int as an address
void* data_ptr_of(PyObject* tensor);               // t.data_ptr()
std::vector<void*> pointers_from(nb::handle seq);  // a list of Python ints

// The run on tensors: allocates the written buffers (a pair of GEMM
// results as one block), launches on every tensor's pointer (`in_ptrs`:
// the inputs' where the caller has them already, else null), counts;
// returns the written buffers (kBuffers, or `finish` false) or what
// set_result asked for. A graph with library calls takes `lib` on CUDA
// (workspaces, TF32) and set_library's cpu_gemm on the CPU.
nb::object run_on_tensors(const PreparedRunRef& r, PyObject* const* in, size_t n_in, void* const* in_ptrs,
                          uintptr_t stream, bool finish, const LibraryArgs* lib);

// run_on_tensors on a list or tuple of tensors (PreparedRun.call / finish).
nb::object call_on(const PreparedRunRef& r, nb::handle tensors, uintptr_t stream, bool finish, const LibraryArgs* lib);

}  // namespace opfuse::py
