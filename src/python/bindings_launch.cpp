// The launch path as Python sees it: a PreparedRun (CompiledGraph::prepare,
// once per input layout of a partition) and the per-call entries on it.
// `call` is the partition's whole hot path below its layout check: it
// allocates the written buffers with the allocator Python gave it, takes
// every tensor's data_ptr(), launches and counts, in one crossing; no
// sizes, strides or lists of lists cross per call.
#include <nanobind/nanobind.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "runtime/compiled_graph.h"

namespace nb = nanobind;
using namespace opfuse;

namespace {

// Kernel launches made by PreparedRun.call, added into opfuse.stats() (the
// Python side counts everything else); atomic, so no lock per call.
std::atomic<int64_t> g_kernel_launches{0};

struct PreparedRunRef {
  const CompiledGraph* graph = nullptr;  // kept alive by nb::keep_alive
  CompiledGraph::PreparedRun run;
  nb::object empty;                      // (sizes, strides, dtype) -> tensor, for call()
  std::vector<nb::tuple> out_args;       // its arguments, per written buffer
};

size_t sequence_size(PyObject* o) {
  if (PyList_Check(o)) return static_cast<size_t>(PyList_GET_SIZE(o));
  if (PyTuple_Check(o)) return static_cast<size_t>(PyTuple_GET_SIZE(o));
  throw nb::type_error("expected a list or tuple");
}

PyObject* sequence_item(PyObject* o, size_t i) {
  return PyList_Check(o) ? PyList_GET_ITEM(o, static_cast<Py_ssize_t>(i)) : PyTuple_GET_ITEM(o, static_cast<Py_ssize_t>(i));
}

void* as_pointer(PyObject* v) {
  void* p = PyLong_AsVoidPtr(v);
  if (!p && PyErr_Occurred()) throw nb::python_error();
  return p;
}

// A tensor's t.data_ptr(), called from here (no Python loop around it).
void* data_ptr_of(PyObject* tensor) {
  static PyObject* name = PyUnicode_InternFromString("data_ptr");
  PyObject* r = PyObject_CallMethodNoArgs(tensor, name);
  if (!r) throw nb::python_error();
  void* p = PyLong_AsVoidPtr(r);
  Py_DECREF(r);
  if (!p && PyErr_Occurred()) throw nb::python_error();
  return p;
}

std::vector<void*> pointers_from(nb::handle seq) {
  size_t n = sequence_size(seq.ptr());
  std::vector<void*> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = as_pointer(sequence_item(seq.ptr(), i));
  return p;
}

RunOptions run_options(uintptr_t stream, uintptr_t workspace, size_t workspace_bytes, bool allow_tf32, nb::object cpu_gemm) {
  RunOptions o;
  o.stream = reinterpret_cast<void*>(stream);
  o.workspace = reinterpret_cast<void*>(workspace);
  o.workspace_bytes = workspace_bytes;
  o.allow_tf32 = allow_tf32;
  if (!cpu_gemm.is_none())
    o.cpu_gemm = [cpu_gemm](int g) {
      nb::gil_scoped_acquire acquire;
      cpu_gemm(g);
    };
  return o;
}

}  // namespace

void bind_launch(nb::module_& m) {
  m.def("launch_counts", [] { return g_kernel_launches.load(); },
        "Kernel launches made by PreparedRun.call since the last reset_launch_counts().");
  m.def("reset_launch_counts", [] { g_kernel_launches.store(0); });

  nb::class_<PreparedRunRef>(m, "PreparedRun",
                             "CompiledGraph.run split in two: built once per input layout (variant, size symbols, "
                             "strides; CUDA device or -1 for the current context's), then run per call with pointers.")
      .def(
          "__init__",
          [](PreparedRunRef* self, const CompiledGraph& graph, int variant, const std::vector<int64_t>& syms,
             const std::vector<std::vector<int64_t>>& strides, int device, nb::object empty, std::vector<nb::tuple> out_specs) {
            new (self) PreparedRunRef{&graph, graph.prepare(variant, syms, strides, device), empty, std::move(out_specs)};
          },
          nb::arg("graph"), nb::arg("variant"), nb::arg("syms"), nb::arg("strides"), nb::arg("device") = -1,
          nb::arg("empty") = nb::none(), nb::arg("out_specs") = std::vector<nb::tuple>{}, nb::keep_alive<1, 2>())
      .def_prop_ro("variant", [](const PreparedRunRef& r) { return r.run.variant_index; })
      .def_prop_ro("syms", [](const PreparedRunRef& r) { return r.run.symbol_values; })
      .def_prop_ro("strides", [](const PreparedRunRef& r) { return r.run.input_strides; })
      .def(
          "launch",
          [](const PreparedRunRef& r, nb::handle ptrs, uintptr_t stream) {
            std::vector<void*> p = pointers_from(ptrs);
            RunOptions o;
            o.stream = reinterpret_cast<void*>(stream);
            nb::gil_scoped_release release;
            r.graph->run_prepared(r.run, p, o);
          },
          nb::arg("ptrs"), nb::arg("stream") = 0,
          "Runs a graph without library calls on raw pointers (one per buffer); not counted.")
      .def(
          "call",
          [](const PreparedRunRef& r, nb::handle tensors, uintptr_t stream) {
            if (!r.graph->gemms().empty()) throw std::logic_error("PreparedRun.call: the graph has library calls; use run()");
            if (r.empty.is_none()) throw std::logic_error("PreparedRun.call: built without an allocator");
            PyObject* in = tensors.ptr();
            size_t n_in = sequence_size(in), n_out = r.out_args.size();
            if (n_in + n_out != r.graph->buffers().size())
              throw std::invalid_argument("PreparedRun.call: " + std::to_string(n_in) + " inputs and " +
                                          std::to_string(n_out) + " outputs for " +
                                          std::to_string(r.graph->buffers().size()) + " buffers");
            std::vector<void*> p(n_in + n_out);
            for (size_t i = 0; i < n_in; ++i) p[i] = data_ptr_of(sequence_item(in, i));
            nb::list outs;
            for (size_t j = 0; j < n_out; ++j) {
              nb::object t = nb::steal(PyObject_Call(r.empty.ptr(), r.out_args[j].ptr(), nullptr));
              if (!t.is_valid()) throw nb::python_error();
              p[n_in + j] = data_ptr_of(t.ptr());
              outs.append(t);
            }
            RunOptions o;
            o.stream = reinterpret_cast<void*>(stream);
            {
              nb::gil_scoped_release release;
              r.graph->run_prepared(r.run, p, o);
            }
            g_kernel_launches.fetch_add(static_cast<int64_t>(r.graph->kernels().size()), std::memory_order_relaxed);
            return outs;
          },
          nb::arg("tensors"), nb::arg("stream") = 0,
          "The partition's launch: allocates the written buffers, runs on the inputs' and their pointers, counts "
          "the launches; returns the written buffers.")
      .def(
          "run",
          [](const PreparedRunRef& r, nb::handle ptrs, uintptr_t stream, uintptr_t workspace, size_t workspace_bytes,
             bool allow_tf32, nb::object cpu_gemm) {
            std::vector<void*> p = pointers_from(ptrs);
            RunOptions o = run_options(stream, workspace, workspace_bytes, allow_tf32, cpu_gemm);
            int gemm_kernels = 0;
            o.gemm_kernels = &gemm_kernels;
            {
              nb::gil_scoped_release release;
              r.graph->run_prepared(r.run, p, o);
            }
            return gemm_kernels;  // GEMM steps run as opfuse kernels, not library calls
          },
          nb::arg("ptrs"), nb::arg("stream") = 0, nb::arg("workspace") = 0, nb::arg("workspace_bytes") = 0,
          nb::arg("allow_tf32") = false, nb::arg("cpu_gemm") = nb::none(),
          "Any graph (GEMM steps too) on raw pointers; returns the GEMM steps run as opfuse kernels. Not counted.");
}
