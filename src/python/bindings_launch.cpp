// The launch path as Python sees it: a PreparedRun (CompiledGraph::prepare,
// once per input layout of a partition) and a Launcher, the callable the
// compiled code calls. A Launcher call is the whole hot path in one C++
// call, with no Python frame: the checks of the recent layouts (PyTorch's
// TensorGuards, called with the argument tuple's own items), the current
// device and stream, the outputs from the allocator Python gave, every
// tensor's data_ptr(), the launch, the count and the result. Anything else
// (a layout no recent check accepts, another current device) goes to the
// Python subclass's _miss / _other_device.
//
// No libtorch is linked (product.md), so tensors are read through their
// Python methods; nanobind's ndarray would go through DLPack, whose
// Tensor.__dlpack__ is a Python function that builds a capsule per tensor.
#include <nanobind/nanobind.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "runtime/compiled_graph.h"
#include "runtime/launch_floor.h"
#include "python/run_options.h"

namespace nb = nanobind;
using namespace opfuse;

namespace {

// Kernel launches made by PreparedRun.call and Launcher calls, added into
// opfuse.stats() (the Python side counts everything else); atomic, so no
// lock per call.
std::atomic<int64_t> g_kernel_launches{0};

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

// The run on tensors: allocates the written buffers, launches on every
// tensor's pointer, counts; returns the written buffers (kBuffers, or
// `finish` false) or what set_result asked for.
nb::object run_on_tensors(const PreparedRunRef& r, PyObject* const* in, size_t n_in, uintptr_t stream, bool finish) {
  if (!r.graph->gemms().empty()) throw std::logic_error("PreparedRun.call: the graph has library calls; use run()");
  if (r.empty.is_none()) throw std::logic_error("PreparedRun.call: built without an allocator");
  size_t n_out = r.out_args.size();
  if (n_in + n_out != r.graph->buffers().size())
    throw std::invalid_argument("PreparedRun.call: " + std::to_string(n_in) + " inputs and " + std::to_string(n_out) +
                                " outputs for " + std::to_string(r.graph->buffers().size()) + " buffers");
  std::vector<void*> p(n_in + n_out);
  for (size_t i = 0; i < n_in; ++i) p[i] = data_ptr_of(in[i]);
  // Written buffers in a stack array for the usual few (no allocation of our own per call).
  nb::object local[8];
  std::vector<nb::object> heap;
  nb::object* bufs = local;
  if (n_out > 8) {
    heap.resize(n_out);
    bufs = heap.data();
  }
  for (size_t j = 0; j < n_out; ++j) {
    bufs[j] = nb::steal(PyObject_Call(r.empty.ptr(), r.out_args[j].ptr(), nullptr));
    if (!bufs[j].is_valid()) throw nb::python_error();
    p[n_in + j] = data_ptr_of(bufs[j].ptr());
  }
  RunOptions o;
  o.stream = reinterpret_cast<void*>(stream);
  {
    nb::gil_scoped_release release;
    r.graph->run_prepared(r.run, p, o);
  }
  g_kernel_launches.fetch_add(static_cast<int64_t>(r.graph->kernels().size()), std::memory_order_relaxed);
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

// A callable over the recent layouts of one compiled graph; Python
// subclasses it (FusedPartition, GraphKernel) and provides _miss and
// _other_device.
struct Launcher {
  static constexpr size_t kRecent = 8;  // layout checks tried before _miss, most recent first
  struct Entry {
    nb::object check;     // callable(*tensors) -> bool
    nb::object prepared;  // the PreparedRun
    const PreparedRunRef* run = nullptr;
    size_t n_inputs = 0;  // a call with another count of tensors is not this layout's (the check is not asked)
  };
  bool cuda = false;
  bool all_tensors = true;  // the call's arguments are the tensors, in order
  std::vector<Py_ssize_t> positions;  // else: which arguments are
  nb::object get_device, raw_stream;  // CUDA: () -> current device, (device) -> current stream handle
  std::vector<Entry> recent;
  uint64_t version = 0;  // bumped by every change to `recent`
};

PyObject* call_named(PyObject* self, const char* name, PyObject* args, PyObject* kwargs) {
  PyObject* f = PyObject_GetAttrString(self, name);
  if (!f) return nullptr;
  PyObject* r = PyObject_Call(f, args, kwargs);
  Py_DECREF(f);
  return r;
}

// The hot path (tp_call of Launcher and its subclasses).
PyObject* launcher_call(PyObject* self, PyObject* args, PyObject* kwargs) noexcept {
  try {
    if (!nb::inst_ready(self)) {
      PyErr_SetString(PyExc_TypeError, "opfuse Launcher: __init__ was not called");
      return nullptr;
    }
    Launcher& L = *nb::inst_ptr<Launcher>(self);
    if (kwargs && PyDict_GET_SIZE(kwargs) != 0) return call_named(self, "_miss", args, kwargs);
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    PyObject* const* argv = reinterpret_cast<PyTupleObject*>(args)->ob_item;
    PyObject* gathered[16];
    std::vector<PyObject*> gathered_heap;
    PyObject* const* tensors = argv;
    size_t n = static_cast<size_t>(nargs);
    if (!L.all_tensors) {
      n = L.positions.size();
      PyObject** dst = gathered;
      if (n > 16) {
        gathered_heap.resize(n);
        dst = gathered_heap.data();
      }
      for (size_t i = 0; i < n; ++i) {
        if (L.positions[i] >= nargs) return call_named(self, "_miss", args, nullptr);
        dst[i] = argv[L.positions[i]];
      }
      tensors = dst;
    }
    const uint64_t version = L.version;
    const Launcher::Entry* hit = nullptr;
    for (const Launcher::Entry& e : L.recent) {
      if (e.n_inputs != n) continue;
      PyObject* ok = PyObject_Vectorcall(e.check.ptr(), tensors, n, nullptr);
      if (!ok) return nullptr;
      int yes = ok == Py_True ? 1 : ok == Py_False ? 0 : PyObject_IsTrue(ok);
      Py_DECREF(ok);
      if (yes < 0) return nullptr;
      if (L.version != version) break;  // the check ran code that changed the list: `e` may be gone
      if (yes) {
        hit = &e;
        break;
      }
    }
    if (!hit) return call_named(self, "_miss", args, nullptr);
    nb::object keep = hit->prepared;  // the layout stays alive while the GIL is released
    const PreparedRunRef& run = *hit->run;
    uintptr_t stream = 0;
    if (L.cuda) {
      // Read at every call, so the caller's device, stream and CUDA graph capture are respected.
      nb::object dev = nb::steal(PyObject_CallNoArgs(L.get_device.ptr()));
      if (!dev.is_valid()) return nullptr;
      long d = PyLong_AsLong(dev.ptr());
      if (d == -1 && PyErr_Occurred()) return nullptr;
      if (d != run.run.device) return call_named(self, "_other_device", args, nullptr);
      PyObject* dev_arg = dev.ptr();
      nb::object s = nb::steal(PyObject_Vectorcall(L.raw_stream.ptr(), &dev_arg, 1, nullptr));
      if (!s.is_valid()) return nullptr;
      stream = reinterpret_cast<uintptr_t>(as_pointer(s.ptr()));
    }
    return run_on_tensors(run, tensors, n, stream, true).release().ptr();
  } catch (nb::python_error& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    // As the Python launch path raised them: a RuntimeError (a division by
    // zero in integer arithmetic as eager's "ZeroDivisionError").
    const char* what = e.what();
    PyErr_SetString(PyExc_RuntimeError, std::strstr(what, "ZeroDivisionError") ? "ZeroDivisionError" : what);
    return nullptr;
  }
}

PyType_Slot launcher_slots[] = {{Py_tp_call, reinterpret_cast<void*>(launcher_call)}, {0, nullptr}};

}  // namespace

void bind_launch(nb::module_& m) {
  m.def("launch_counts", [] { return g_kernel_launches.load(); },
        "Kernel launches made by PreparedRun.call and Launcher calls since the last reset_launch_counts().");
  m.def("reset_launch_counts", [] { g_kernel_launches.store(0); });
  m.def("launch_floor_source", [] { return launch_floor_source(); },
        "CUDA C++ of the empty kernel time_empty_launches launches.");
  m.def(
      "time_empty_launches",
      [](uintptr_t stream, int launches) {
        nb::gil_scoped_release release;  // as around opfuse's own launches
        return time_empty_launches(stream, launches);
      },
      nb::arg("stream"), nb::arg("launches"),
      "Host ns of `launches` back-to-back cuLaunchKernel calls of an empty kernel with the seed chain's argument "
      "size: the driver's floor under any launcher's per-kernel cost.");

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
      .def_prop_ro("device", [](const PreparedRunRef& r) { return r.run.device; })
      .def(
          "set_result",
          [](PreparedRunRef& r, int kind, const std::vector<std::pair<size_t, nb::object>>& outs) {
            if (kind < kOne || kind > kBuffers) throw std::invalid_argument("set_result: kind is 0 to 3");
            size_t n_buf = r.graph->buffers().size(), n_in = n_buf - r.out_args.size();
            for (const auto& o : outs) {
              if (o.first >= n_buf) throw std::invalid_argument("set_result: buffer index out of range");
              if (!o.second.is_none() && !PyTuple_Check(o.second.ptr()))
                throw std::invalid_argument("set_result: a view shape is a tuple or None");
            }
            if (kind == kOne && outs.size() != 1) throw std::invalid_argument("set_result: kind 0 returns one value");
            r.kind = kind;
            r.outs = outs;
            r.direct = kind == kOne && outs[0].second.is_none() && outs[0].first >= n_in
                           ? static_cast<int>(outs[0].first - n_in) : -1;
          },
          nb::arg("kind"), nb::arg("outs"),
          "What a Launcher call returns: kind 0 one value, 1 a tuple, 2 a list, 3 the written buffers; outs holds "
          "per value (index into inputs + written buffers, view shape tuple or None).")
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
            PyObject* in = tensors.ptr();
            size_t n_in = sequence_size(in);
            std::vector<PyObject*> items(n_in);
            for (size_t i = 0; i < n_in; ++i) items[i] = sequence_item(in, i);
            return run_on_tensors(r, items.data(), n_in, stream, false);
          },
          nb::arg("tensors"), nb::arg("stream") = 0,
          "The partition's launch: allocates the written buffers, runs on the inputs' and their pointers, counts "
          "the launches; returns the written buffers.")
      .def(
          "finish",
          [](const PreparedRunRef& r, nb::handle tensors, uintptr_t stream) {
            PyObject* in = tensors.ptr();
            size_t n_in = sequence_size(in);
            std::vector<PyObject*> items(n_in);
            for (size_t i = 0; i < n_in; ++i) items[i] = sequence_item(in, i);
            return run_on_tensors(r, items.data(), n_in, stream, true);
          },
          nb::arg("tensors"), nb::arg("stream") = 0,
          "call(), returning what set_result asked for (what a Launcher call returns).")
      .def(
          "run",
          [](const PreparedRunRef& r, nb::handle ptrs, uintptr_t stream, uintptr_t workspace, size_t workspace_bytes,
             bool allow_tf32, nb::object cpu_gemm, uintptr_t decode_workspace, size_t decode_workspace_bytes) {
            std::vector<void*> p = pointers_from(ptrs);
            RunOptions o = run_options_from_python(stream, workspace, workspace_bytes, allow_tf32, cpu_gemm, decode_workspace,
                                                   decode_workspace_bytes);
            int gemm_kernels = 0, gemm_merged = 0;
            o.gemm_kernels = &gemm_kernels;
            o.gemm_merged = &gemm_merged;
            {
              nb::gil_scoped_release release;
              r.graph->run_prepared(r.run, p, o);
            }
            // GEMM steps run as opfuse kernels, and those run inside another's batched call: not library calls
            return nb::make_tuple(gemm_kernels, gemm_merged);
          },
          nb::arg("ptrs"), nb::arg("stream") = 0, nb::arg("workspace") = 0, nb::arg("workspace_bytes") = 0,
          nb::arg("allow_tf32") = false, nb::arg("cpu_gemm") = nb::none(), nb::arg("decode_workspace") = 0,
          nb::arg("decode_workspace_bytes") = 0,
          "Any graph (GEMM steps too) on raw pointers; returns (GEMM steps run as opfuse kernels, GEMM steps run "
          "inside a paired step's batched call). Not counted.");

  nb::class_<Launcher>(m, "Launcher", nb::type_slots(launcher_slots),
                       "The launch path's callable, subclassed in Python: a call tries the checks of the recent "
                       "layouts (push) and runs the first that accepts; else calls self._miss(*args); CUDA, where "
                       "the current device is not the layout's, self._other_device(*args).")
      .def(
          "__init__",
          [](Launcher* self, bool cuda, std::optional<std::vector<Py_ssize_t>> positions, nb::object get_device,
             nb::object raw_stream) {
            if (cuda && (get_device.is_none() || raw_stream.is_none()))
              throw std::invalid_argument("Launcher: CUDA needs get_device and raw_stream");
            Launcher* l = new (self) Launcher();
            l->cuda = cuda;
            l->all_tensors = !positions.has_value();
            if (positions) l->positions = *positions;
            l->get_device = get_device;
            l->raw_stream = raw_stream;
          },
          nb::arg("cuda"), nb::arg("positions").none() = nb::none(), nb::arg("get_device") = nb::none(),
          nb::arg("raw_stream") = nb::none())
      .def(
          "push",
          [](Launcher& l, nb::object check, nb::object prepared) {
            const PreparedRunRef* run = nb::cast<const PreparedRunRef*>(prepared);
            if (!run->graph->gemms().empty()) throw std::invalid_argument("Launcher.push: the graph has library calls");
            if (run->empty.is_none()) throw std::invalid_argument("Launcher.push: a PreparedRun without an allocator");
            size_t n_inputs = run->graph->buffers().size() - run->out_args.size();
            l.recent.insert(l.recent.begin(), Launcher::Entry{check, prepared, run, n_inputs});
            if (l.recent.size() > Launcher::kRecent) l.recent.resize(Launcher::kRecent);
            ++l.version;
          },
          nb::arg("check"), nb::arg("prepared"), "Makes (check, prepared) the most recent layout.")
      .def(
          "forget",
          [](Launcher& l, nb::handle prepared) {
            std::erase_if(l.recent, [&](const Launcher::Entry& e) { return e.prepared.ptr() == prepared.ptr(); });
            ++l.version;
          },
          nb::arg("prepared"))
      .def("clear_recent",
           [](Launcher& l) {
             l.recent.clear();
             ++l.version;
           })
      .def_prop_ro("recent", [](const Launcher& l) {
        nb::list r;
        for (const auto& e : l.recent) r.append(nb::make_tuple(e.check, e.prepared));
        return r;
      }, "(check, PreparedRun) pairs, most recent first.");
}
