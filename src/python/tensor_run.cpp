// The run of a prepared layout on PyTorch tensors (tensor_run.h).
#include "python/tensor_run.h"

#include <nanobind/stl/function.h>

#include <stdexcept>
#include <string>

namespace opfuse::py {

std::atomic<int64_t> g_kernel_launches{0};
std::atomic<int64_t> g_library_calls{0};

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
// For a plain torch.Tensor (every output, most inputs) the method
// descriptor is called directly, without the attribute lookup per call;
// a subclass gets the lookup, so an override of data_ptr is respected.
void* data_ptr_of(PyObject* tensor) {
  static PyObject* name = PyUnicode_InternFromString("data_ptr");
  static PyTypeObject* tensor_type = nullptr;
  static PyObject* method = nullptr;
  if (!tensor_type) {
    nb::object t = nb::module_::import_("torch").attr("Tensor");
    method = nb::getattr(t, "data_ptr").release().ptr();  // kept for the process, as the type is
    tensor_type = reinterpret_cast<PyTypeObject*>(t.release().ptr());
  }
  PyObject* r = Py_TYPE(tensor) == tensor_type ? PyObject_Vectorcall(method, &tensor, 1, nullptr)
                                               : PyObject_CallMethodNoArgs(tensor, name);
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

namespace {

// block.as_strided(sizes, strides, offset): a GEMM result inside its pair's block.
nb::object view_in_block(const nb::object& block, const nb::tuple& view) {
  static PyObject* method = nullptr;
  if (!method) method = nb::getattr(nb::module_::import_("torch").attr("Tensor"), "as_strided").release().ptr();
  PyObject* a[4] = {block.ptr(), view[0].ptr(), view[1].ptr(), view[2].ptr()};
  nb::object v = nb::steal(PyObject_Vectorcall(method, a, 4, nullptr));
  if (!v.is_valid()) throw nb::python_error();
  return v;
}

nb::object allocate(const PreparedRunRef& r, const nb::tuple& spec) {
  nb::object t = nb::steal(PyObject_Call(r.empty.ptr(), spec.ptr(), nullptr));
  if (!t.is_valid()) throw nb::python_error();
  return t;
}

}  // namespace

nb::object run_on_tensors(const PreparedRunRef& r, PyObject* const* in, size_t n_in, void* const* in_ptrs,
                          uintptr_t stream, bool finish, const LibraryArgs* lib) {
  if (r.empty.is_none()) throw std::logic_error("PreparedRun.call: built without an allocator");
  const size_t n_gemms = r.graph->gemms().size();
  const bool cuda = r.graph->target() == Target::CUDA;
  if (n_gemms && (cuda ? lib == nullptr : r.cpu_gemm.is_none()))
    throw std::logic_error(cuda ? "PreparedRun.call: a graph with library calls needs cuBLASLt's workspace"
                                : "PreparedRun.call: a graph with library calls needs set_library's cpu_gemm");
  size_t n_out = r.out_args.size();
  if (n_in + n_out != r.graph->buffers().size())
    throw std::invalid_argument("PreparedRun.call: " + std::to_string(n_in) + " inputs and " + std::to_string(n_out) +
                                " outputs for " + std::to_string(r.graph->buffers().size()) + " buffers");
  std::vector<void*> p(n_in + n_out);
  for (size_t i = 0; i < n_in; ++i) p[i] = in_ptrs ? in_ptrs[i] : data_ptr_of(in[i]);
  // Written buffers in a stack array for the usual few (no allocation of our own per call).
  nb::object local[8];
  std::vector<nb::object> heap;
  nb::object* bufs = local;
  if (n_out > 8) {
    heap.resize(n_out);
    bufs = heap.data();
  }
  for (const PreparedRunRef::Pair& pair : r.pairs) {
    // Both results of one batched GEMM call in one block, the second at
    // the next 256-byte boundary (CompiledGraph::paired_buffers).
    nb::object block = allocate(r, pair.block);
    bufs[pair.first] = view_in_block(block, pair.views[0]);
    bufs[pair.second] = view_in_block(block, pair.views[1]);
  }
  for (size_t j = 0; j < n_out; ++j) {
    if (!bufs[j].is_valid()) bufs[j] = allocate(r, r.out_args[j]);
    p[n_in + j] = data_ptr_of(bufs[j].ptr());
  }
  RunOptions o;
  o.stream = reinterpret_cast<void*>(stream);
  if (cuda && lib) {  // the zeroed workspace: the decode MLP's and the row groups' (row steps want it without GEMMs)
    o.zeroed_workspace = reinterpret_cast<void*>(lib->zeroed_workspace);
    o.zeroed_workspace_bytes = lib->zeroed_workspace_bytes;
  }
  int gemm_kernels = 0, gemm_merged = 0, folded = 0;
  nb::object everything;  // the CPU GEMM callback's buffers: inputs, then written ones
  if (n_gemms) {
    o.gemm_kernels = &gemm_kernels;
    o.gemm_merged = &gemm_merged;
    o.kernels_folded = &folded;
    if (cuda) {
      o.workspace = reinterpret_cast<void*>(lib->workspace);
      o.workspace_bytes = lib->workspace_bytes;
      o.allow_tf32 = lib->allow_tf32;
    } else {
      everything = nb::steal(PyList_New(static_cast<Py_ssize_t>(n_in + n_out)));
      if (!everything.is_valid()) throw nb::python_error();
      for (size_t i = 0; i < n_in + n_out; ++i)
        PyList_SET_ITEM(everything.ptr(), static_cast<Py_ssize_t>(i), Py_NewRef(i < n_in ? in[i] : bufs[i - n_in].ptr()));
      o.cpu_gemm = [fn = r.cpu_gemm.ptr(), all = everything.ptr()](int g) {
        nb::gil_scoped_acquire acquire;
        nb::object index = nb::int_(g);
        PyObject* a[2] = {index.ptr(), all};
        PyObject* done = PyObject_Vectorcall(fn, a, 2, nullptr);
        if (!done) throw nb::python_error();
        Py_DECREF(done);
      };
    }
  }
  {
    nb::gil_scoped_release release;
    r.graph->run_prepared(r.run, p, o);
  }
  // GEMM steps run as opfuse's skinny GEMM kernel are kernel launches, not
  // library calls; those run inside a paired step's batched call are neither;
  // generated kernels a GEMM took in (a gated A) did not run.
  g_kernel_launches.fetch_add(static_cast<int64_t>(r.graph->kernels().size()) + gemm_kernels - folded,
                              std::memory_order_relaxed);
  if (n_gemms)
    g_library_calls.fetch_add(static_cast<int64_t>(n_gemms) - gemm_kernels - gemm_merged, std::memory_order_relaxed);
  if (r.direct >= 0 && finish) return std::move(bufs[r.direct]);
  if (!finish || r.kind == kBuffers) {
    nb::list l;
    for (size_t j = 0; j < n_out; ++j) l.append(bufs[j]);
    return l;
  }
  static PyObject* view = PyUnicode_InternFromString("view");
  auto value = [&](size_t k) -> PyObject* {  // a new reference
    const auto& [i, shape] = r.outs[k];
    PyObject* t = i < n_in ? in[i] : bufs[i - n_in].ptr();
    if (shape.is_none()) return Py_NewRef(t);
    PyObject* v = PyObject_CallMethodOneArg(t, view, shape.ptr());
    if (!v) throw nb::python_error();
    return v;
  };
  size_t n = r.outs.size();
  if (r.kind == kOne) {
    if (n != 1) throw std::logic_error("PreparedRun: one result expected, " + std::to_string(n) + " set");
    return nb::steal(value(0));
  }
  nb::object result = nb::steal(r.kind == kTuple ? PyTuple_New(static_cast<Py_ssize_t>(n))
                                                 : PyList_New(static_cast<Py_ssize_t>(n)));
  if (!result.is_valid()) throw nb::python_error();
  for (size_t k = 0; k < n; ++k) {
    PyObject* v = value(k);
    if (r.kind == kTuple)
      PyTuple_SET_ITEM(result.ptr(), static_cast<Py_ssize_t>(k), v);
    else
      PyList_SET_ITEM(result.ptr(), static_cast<Py_ssize_t>(k), v);
  }
  return result;
}

nb::object call_on(const PreparedRunRef& r, nb::handle tensors, uintptr_t stream, bool finish, const LibraryArgs* lib) {
  PyObject* in = tensors.ptr();
  size_t n_in = sequence_size(in);
  std::vector<PyObject*> items(n_in);
  for (size_t i = 0; i < n_in; ++i) items[i] = sequence_item(in, i);
  return run_on_tensors(r, items.data(), n_in, nullptr, stream, finish, lib);
}

}  // namespace opfuse::py
