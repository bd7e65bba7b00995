// The launch path as Python sees it: a PreparedRun (CompiledGraph::prepare,
// once per input layout of a partition) and a Launcher, the callable the
// compiled code calls. A Launcher call is the whole hot path in one C++
// call, with no Python frame: the checks of the recent layouts (PyTorch's
// TensorGuards, called with the argument tuple's own items), the current
// device and stream, the outputs from the allocator Python gave, every
// tensor's data_ptr(), the launch, the count and the result. Graphs with
// library calls (GEMM steps) take the same path with what their run needs
// besides: cuBLASLt's alignment checked on the inputs' pointers, GEMM pairs
// allocated as one block, the workspaces (asked once per device and stream)
// and the TF32 setting on CUDA, PyTorch's matmul as a callback on the CPU.
// Anything else (a layout no recent check accepts, another current device,
// a GEMM cuBLASLt refuses) goes to the Python subclass's _miss /
// _other_device / _gemm_refused.
//
// No libtorch is linked (product.md), so tensors are read through their
// Python methods; nanobind's ndarray would go through DLPack, whose
// Tensor.__dlpack__ is a Python function that builds a capsule per tensor.
#include <nanobind/nanobind.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "runtime/compiled_graph.h"
#include "runtime/gemm_launcher.h"
#include "runtime/launch_floor.h"
#include "python/run_options.h"
#include "python/tensor_run.h"

namespace nb = nanobind;
using namespace opfuse;
using namespace opfuse::py;

namespace {
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
    // cuBLASLt's layouts depend on each input's address modulo 16: where
    // set, the residues the layout was prepared with (checked on the
    // pointers the launch reads anyway).
    std::vector<uint8_t> align;
  };
  bool cuda = false;
  bool all_tensors = true;  // the call's arguments are the tensors, in order
  std::vector<Py_ssize_t> positions;  // else: which arguments are
  nb::object get_device, raw_stream;  // CUDA: () -> current device, (device) -> current stream handle
  // CUDA graphs with library calls: (device, stream) -> (cuBLASLt's
  // workspace, the decode MLP's or None), asked once per (device, stream)
  // (the tensors are kept for the process on both sides); () -> PyTorch's
  // TF32 setting for cuBLAS, asked every call.
  nb::object workspaces, allow_tf32;
  struct Workspaces {
    long device;
    uintptr_t stream;
    nb::object keep;  // the (workspace, decode workspace) tuple
    LibraryArgs args;
  };
  std::vector<Workspaces> workspace_cache;  // most recent first, kWorkspaces at most
  static constexpr size_t kWorkspaces = 16;
  std::vector<Entry> recent;
  uint64_t version = 0;  // bumped by every change to `recent`
};

// Workspace pointers for (device, stream), from the cache or, the first
// time, from the Python callable; and the TF32 setting of this call.
LibraryArgs library_args(Launcher& L, long device, uintptr_t stream) {
  LibraryArgs a;
  bool found = false;
  for (const Launcher::Workspaces& w : L.workspace_cache)
    if (w.device == device && w.stream == stream) {
      a = w.args;
      found = true;
      break;
    }
  if (!found) {
    nb::object both = L.workspaces(device, stream);
    nb::object ws = both[0], dws = both[1];
    if (!ws.is_none()) {  // (None: a launcher without library calls)
      a.workspace = reinterpret_cast<uintptr_t>(data_ptr_of(ws.ptr()));
      a.workspace_bytes = nb::cast<size_t>(ws.attr("nbytes"));
    }
    if (!dws.is_none()) {
      a.zeroed_workspace = reinterpret_cast<uintptr_t>(data_ptr_of(dws.ptr()));
      a.zeroed_workspace_bytes = nb::cast<size_t>(dws.attr("nbytes"));
    }
    L.workspace_cache.insert(L.workspace_cache.begin(), Launcher::Workspaces{device, stream, both, a});
    if (L.workspace_cache.size() > Launcher::kWorkspaces) L.workspace_cache.pop_back();
  }
  PyObject* tf32 = PyObject_CallNoArgs(L.allow_tf32.ptr());
  if (!tf32) throw nb::python_error();
  int yes = PyObject_IsTrue(tf32);
  Py_DECREF(tf32);
  if (yes < 0) throw nb::python_error();
  a.allow_tf32 = yes != 0;
  return a;
}

PyObject* call_named(PyObject* self, const char* name, PyObject* args, PyObject* kwargs) {
  PyObject* f = PyObject_GetAttrString(self, name);
  if (!f) return nullptr;
  PyObject* r = PyObject_Call(f, args, kwargs);
  Py_DECREF(f);
  return r;
}

// The hot path (tp_call of Launcher and its subclasses), and Launcher.launch:
// `forced` a PreparedRun to run without asking any check (the layout _miss
// has just prepared), else null.
PyObject* launch_call(PyObject* self, PyObject* args, PyObject* kwargs, PyObject* forced) noexcept {
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
    // The inputs' pointers, read once where a check of alignment needs them
    // (and then handed to the run).
    void* ptrs_local[16];
    std::vector<void*> ptrs_heap;
    void** in_ptrs = nullptr;
    const uint64_t version = L.version;
    nb::object keep;  // the layout stays alive while the GIL is released
    const PreparedRunRef* run = nullptr;
    if (forced) {
      keep = nb::borrow(forced);
      run = nb::cast<const PreparedRunRef*>(keep);
      if (run->graph->buffers().size() - run->out_args.size() != n)
        throw std::invalid_argument("Launcher.launch: the layout has another count of inputs");
    }
    for (const Launcher::Entry& e : L.recent) {
      if (forced) break;
      if (e.n_inputs != n) continue;
      PyObject* ok = PyObject_Vectorcall(e.check.ptr(), tensors, n, nullptr);
      if (!ok) return nullptr;
      int yes = ok == Py_True ? 1 : ok == Py_False ? 0 : PyObject_IsTrue(ok);
      Py_DECREF(ok);
      if (yes < 0) return nullptr;
      if (L.version != version) break;  // the check ran code that changed the list: `e` may be gone
      if (yes && !e.align.empty()) {
        if (!in_ptrs) {
          in_ptrs = ptrs_local;
          if (n > 16) {
            ptrs_heap.resize(n);
            in_ptrs = ptrs_heap.data();
          }
          for (size_t i = 0; i < n; ++i) in_ptrs[i] = data_ptr_of(tensors[i]);
          if (L.version != version) break;  // a subclass's data_ptr ran code that changed the list
        }
        for (size_t i = 0; i < n && yes; ++i) yes = reinterpret_cast<uintptr_t>(in_ptrs[i]) % 16 == e.align[i];
      }
      if (yes) {
        keep = e.prepared;
        run = e.run;
        break;
      }
    }
    if (!run) return call_named(self, "_miss", args, nullptr);
    uintptr_t stream = 0;
    LibraryArgs lib;
    if (L.cuda) {
      // Read at every call, so the caller's device, stream and CUDA graph capture are respected.
      nb::object dev = nb::steal(PyObject_CallNoArgs(L.get_device.ptr()));
      if (!dev.is_valid()) return nullptr;
      long d = PyLong_AsLong(dev.ptr());
      if (d == -1 && PyErr_Occurred()) return nullptr;
      if (d != run->run.device) return call_named(self, "_other_device", args, nullptr);
      PyObject* dev_arg = dev.ptr();
      nb::object s = nb::steal(PyObject_Vectorcall(L.raw_stream.ptr(), &dev_arg, 1, nullptr));
      if (!s.is_valid()) return nullptr;
      stream = reinterpret_cast<uintptr_t>(as_pointer(s.ptr()));
      // Workspaces for library calls, and the zeroed one for row groups (a
      // launcher without `workspaces` runs such rows on their scalar twin).
      if (!run->graph->gemms().empty() || (run->run.wants_zeroed_workspace && !L.workspaces.is_none()))
        lib = library_args(L, d, stream);
    }
    try {
      return run_on_tensors(*run, tensors, n, in_ptrs, stream, true, L.cuda ? &lib : nullptr).release().ptr();
    } catch (const GemmUnsupported& e) {
      // cuBLASLt refused a GEMM of this layout: the Python side forgets the
      // layout and runs the call with fewer epilogues (or eagerly).
      nb::object reason = nb::str(e.what());
      return PyObject_CallMethod(self, "_gemm_refused", "OOO", keep.ptr(), reason.ptr(), args);
    } catch (nb::python_error& e) {
      // The same raised as _C.GemmUnsupported by Python code the run called
      // (the CPU's GEMM callback), as Python's `except _C.GemmUnsupported` would catch it.
      static PyObject* unsupported = 
          nb::getattr(nb::module_::import_("opfuse._C"), "GemmUnsupported").release().ptr();
      if (!e.matches(unsupported)) throw;
      nb::object reason = nb::str(e.value());
      return PyObject_CallMethod(self, "_gemm_refused", "OOO", keep.ptr(), reason.ptr(), args);
    }
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

PyObject* launcher_call(PyObject* self, PyObject* args, PyObject* kwargs) noexcept {
  return launch_call(self, args, kwargs, nullptr);
}

PyType_Slot launcher_slots[] = {{Py_tp_call, reinterpret_cast<void*>(launcher_call)}, {0, nullptr}};

// PreparedRun.call and .finish: the run on a list or tuple of tensors,
// returning the written buffers or (finish) what set_result asked for.
template <class Class>
void def_call(Class& c, const char* name, bool finish, const char* doc) {
  c.def(
      name,
      [finish](const PreparedRunRef& r, nb::handle tensors, uintptr_t stream, uintptr_t workspace,
               size_t workspace_bytes, bool allow_tf32, uintptr_t zeroed_workspace, size_t zeroed_workspace_bytes) {
        LibraryArgs lib{workspace, workspace_bytes, zeroed_workspace, zeroed_workspace_bytes, allow_tf32};
        return call_on(r, tensors, stream, finish, workspace || zeroed_workspace ? &lib : nullptr);
      },
      nb::arg("tensors"), nb::arg("stream") = 0, nb::arg("workspace") = 0, nb::arg("workspace_bytes") = 0,
      nb::arg("allow_tf32") = false, nb::arg("zeroed_workspace") = 0, nb::arg("zeroed_workspace_bytes") = 0, doc);
}

}  // namespace

void bind_launch(nb::module_& m) {
  m.def("launch_counts", [] { return g_kernel_launches.load(); },
        "Kernel launches made by PreparedRun.call and Launcher calls since the last reset_launch_counts().");
  m.def("library_call_counts", [] { return g_library_calls.load(); },
        "GEMM steps run as library calls by PreparedRun.call and Launcher calls since the last reset_launch_counts().");
  m.def("reset_launch_counts", [] {
    g_kernel_launches.store(0);
    g_library_calls.store(0);
  });
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

  auto prepared_run = nb::class_<PreparedRunRef>(m, "PreparedRun",
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
      .def_prop_ro("wants_zeroed_workspace", [](const PreparedRunRef& r) { return r.run.wants_zeroed_workspace; },
                   "A row step's groups exchange through the zeroed workspace (else it runs its scalar twin).")
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
          "set_library",
          [](PreparedRunRef& r, const std::vector<std::tuple<size_t, size_t, nb::tuple, nb::tuple, nb::tuple>>& pairs,
             nb::object cpu_gemm) {
            size_t n_out = r.out_args.size();
            r.pairs.clear();
            for (const auto& [first, second, block, view0, view1] : pairs) {
              if (first >= n_out || second >= n_out || first == second)
                throw std::invalid_argument("set_library: a pair is two written buffers");
              if (view0.size() != 3 || view1.size() != 3)
                throw std::invalid_argument("set_library: a view is (sizes, strides, storage offset)");
              r.pairs.push_back({first, second, block, {view0, view1}});
            }
            r.cpu_gemm = cpu_gemm;
          },
          nb::arg("pairs"), nb::arg("cpu_gemm") = nb::none(),
          "For a graph with library calls: pairs of written buffers allocated as one block, as (first, second, the "
          "block's (sizes, strides, dtype), each one's (sizes, strides, storage offset) in it); on the CPU, "
          "cpu_gemm(g, inputs + written buffers) runs GEMM step g.")
      .def(
          "run",
          [](const PreparedRunRef& r, nb::handle ptrs, uintptr_t stream, uintptr_t workspace, size_t workspace_bytes,
             bool allow_tf32, nb::object cpu_gemm, uintptr_t zeroed_workspace, size_t zeroed_workspace_bytes) {
            std::vector<void*> p = pointers_from(ptrs);
            RunOptions o = run_options_from_python(stream, workspace, workspace_bytes, allow_tf32, cpu_gemm, zeroed_workspace,
                                                   zeroed_workspace_bytes);
            int gemm_kernels = 0, gemm_merged = 0, folded = 0;
            o.gemm_kernels = &gemm_kernels;
            o.gemm_merged = &gemm_merged;
            o.kernels_folded = &folded;
            {
              nb::gil_scoped_release release;
              r.graph->run_prepared(r.run, p, o);
            }
            // GEMM steps run as opfuse kernels, and those run inside another's batched call: not library
            // calls; generated kernels a GEMM took in (a gated A): not launched
            return nb::make_tuple(gemm_kernels, gemm_merged, folded);
          },
          nb::arg("ptrs"), nb::arg("stream") = 0, nb::arg("workspace") = 0, nb::arg("workspace_bytes") = 0,
          nb::arg("allow_tf32") = false, nb::arg("cpu_gemm") = nb::none(), nb::arg("zeroed_workspace") = 0,
          nb::arg("zeroed_workspace_bytes") = 0,
          "Any graph (GEMM steps too) on raw pointers; returns (GEMM steps run as opfuse kernels, GEMM steps run "
          "inside a paired step's batched call). Not counted.");
  def_call(prepared_run, "call", false,
           "The partition's launch: allocates the written buffers, runs on the inputs' and their pointers, counts "
           "the launches and library calls; returns the written buffers. A CUDA graph with library calls needs "
           "cuBLASLt's workspace (and the decode MLP's where it has one).");
  def_call(prepared_run, "finish", true, "call(), returning what set_result asked for (what a Launcher call returns).");

  nb::class_<Launcher>(m, "Launcher", nb::type_slots(launcher_slots),
                       "The launch path's callable, subclassed in Python: a call tries the checks of the recent "
                       "layouts (push) and runs the first that accepts; else calls self._miss(*args); CUDA, where "
                       "the current device is not the layout's, self._other_device(*args).")
      .def(
          "__init__",
          [](Launcher* self, bool cuda, std::optional<std::vector<Py_ssize_t>> positions, nb::object get_device,
             nb::object raw_stream, nb::object workspaces, nb::object allow_tf32) {
            if (cuda && (get_device.is_none() || raw_stream.is_none()))
              throw std::invalid_argument("Launcher: CUDA needs get_device and raw_stream");
            if (workspaces.is_none() != allow_tf32.is_none())
              throw std::invalid_argument("Launcher: workspaces and allow_tf32 come together");
            Launcher* l = new (self) Launcher();
            l->cuda = cuda;
            l->all_tensors = !positions.has_value();
            if (positions) l->positions = *positions;
            l->get_device = get_device;
            l->raw_stream = raw_stream;
            l->workspaces = workspaces;
            l->allow_tf32 = allow_tf32;
          },
          nb::arg("cuda"), nb::arg("positions").none() = nb::none(), nb::arg("get_device") = nb::none(),
          nb::arg("raw_stream") = nb::none(), nb::arg("workspaces") = nb::none(), nb::arg("allow_tf32") = nb::none())
      .def(
          "push",
          [](Launcher& l, nb::object check, nb::object prepared, std::optional<std::vector<int>> align) {
            const PreparedRunRef* run = nb::cast<const PreparedRunRef*>(prepared);
            if (!run->graph->gemms().empty()) {
              if (l.cuda ? l.workspaces.is_none() : run->cpu_gemm.is_none())
                throw std::invalid_argument(l.cuda ? "Launcher.push: library calls need a Launcher with workspaces"
                                                   : "Launcher.push: library calls need set_library's cpu_gemm");
            }
            if (run->empty.is_none()) throw std::invalid_argument("Launcher.push: a PreparedRun without an allocator");
            size_t n_inputs = run->graph->buffers().size() - run->out_args.size();
            Launcher::Entry e{check, prepared, run, n_inputs, {}};
            if (align) {
              if (align->size() != n_inputs) throw std::invalid_argument("Launcher.push: one alignment per input");
              for (int a : *align) {
                if (a < 0 || a >= 16) throw std::invalid_argument("Launcher.push: an alignment is an address modulo 16");
                e.align.push_back(static_cast<uint8_t>(a));
              }
            }
            l.recent.insert(l.recent.begin(), std::move(e));
            if (l.recent.size() > Launcher::kRecent) l.recent.resize(Launcher::kRecent);
            ++l.version;
          },
          nb::arg("check"), nb::arg("prepared"), nb::arg("align").none() = nb::none(),
          "Makes (check, prepared) the most recent layout; `align`: each input's address modulo 16 that the "
          "layout also requires.")
      .def(
          "launch",
          [](nb::handle self, nb::handle prepared, nb::tuple args) {
            PyObject* r = launch_call(self.ptr(), args.ptr(), nullptr, prepared.ptr());
            if (!r) throw nb::python_error();
            return nb::steal(r);
          },
          nb::arg("prepared"), nb::arg("args"),
          "A call's run of `prepared` on `args` (the call's arguments) without asking any layout check: the "
          "current device and stream, workspaces, allocation, launch, count, result.")
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
