// The nanobind module opfuse._C: the C++ core as Python sees it. Tensors
// cross as raw pointers, shapes and strides, so no libtorch is linked.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "codegen/cpu_emitter.h"
#include "fusion/passes.h"
#include "ir/evaluate.h"
#include "ir/ops.h"
#include "runtime/compile_cache.h"
#include "runtime/compiled_graph.h"

namespace nb = nanobind;
using namespace opfuse;

namespace {

nb::dict kernel_dict(const CompiledGraph& cg, size_t i) {
  nb::dict d;
  const KernelInfo& k = cg.kernel_info()[i];
  d["name"] = k.name;
  d["ops"] = k.ops;
  d["bytes"] = k.cost.bytes;
  d["flops"] = k.cost.flops;
  d["seconds"] = k.cost.seconds;
  d["kind"] = k.row ? "row" : "pointwise";
  d["ir"] = cg.kernels()[i].to_string();
  return d;
}

// The oracle from Python: inputs as float64 arrays with dtype names.
std::vector<std::pair<std::string, nb::ndarray<nb::numpy, double>>> py_evaluate(
    const std::string& text, const std::vector<nb::ndarray<double, nb::c_contig, nb::device::cpu>>& inputs) {
  Graph g = parse_graph(text);
  verify(g);
  auto ids = g.input_ids();
  if (ids.size() != inputs.size()) throw std::invalid_argument("wrong number of inputs");
  std::vector<HostTensor> in;
  for (size_t i = 0; i < inputs.size(); ++i) {
    HostTensor t;
    t.dtype = g.node(ids[i]).dtype;
    for (size_t d = 0; d < inputs[i].ndim(); ++d) t.shape.push_back(static_cast<int64_t>(inputs[i].shape(d)));
    t.data.assign(inputs[i].data(), inputs[i].data() + inputs[i].size());
    in.push_back(std::move(t));
  }
  std::vector<HostTensor> out = evaluate(g, in);
  std::vector<std::pair<std::string, nb::ndarray<nb::numpy, double>>> r;
  for (size_t o = 0; o < out.size(); ++o) {
    auto* data = new std::vector<double>(std::move(out[o].data));
    nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<double>*>(p); });
    std::vector<size_t> shape(out[o].shape.begin(), out[o].shape.end());
    r.emplace_back(dtype_name(out[o].dtype),
                   nb::ndarray<nb::numpy, double>(data->data(), shape.size(), shape.data(), owner));
  }
  return r;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "opfuse core: graph IR, fusion planner, code generation and runtime";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const GraphError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("op_names", &op_names);
  m.def("op_kind", [](const std::string& name) {
    const OpDef* d = find_op(name);
    if (!d) throw std::invalid_argument("unknown op '" + name + "'");
    return std::string(op_kind_name(d->kind));
  });
  m.def("normalize", [](const std::string& text) { return print_graph(parse_graph(text)); },
        "Parses the text form and prints it canonically.");
  m.def("verify", [](const std::string& text) { verify(parse_graph(text)); });
  m.def("run_passes", [](const std::string& text) {
    Graph g = parse_graph(text);
    verify(g);
    std::vector<std::pair<std::string, std::string>> r;
    for (const GraphPass& p : graph_passes()) {
      g = p.run(g);
      r.emplace_back(p.name, print_graph(g));
    }
    return r;
  });
  m.def("evaluate", &py_evaluate, "The float64 reference oracle.");
  m.def("cache_dir", &cache_dir);
  m.def("cpu_prelude", [] { return std::string(cpu_prelude()); });

  nb::class_<CompiledGraph>(m, "CompiledGraph")
      .def("__init__",
           [](CompiledGraph* self, const std::string& text, bool fuse, double bandwidth, double flops) {
             CompileOptions opt;
             opt.planner.fuse = fuse;
             if (bandwidth > 0) opt.planner.bandwidth_bytes_per_s = bandwidth;
             if (flops > 0) opt.planner.flops_per_s = flops;
             Graph g = parse_graph(text);
             new (self) CompiledGraph(g, opt);
           },
           nb::arg("text"), nb::arg("fuse") = true, nb::arg("bandwidth") = 0.0, nb::arg("flops") = 0.0)
      .def_prop_ro("num_kernels", [](const CompiledGraph& c) { return c.kernels().size(); })
      .def("plan_text", [](const CompiledGraph& c) { return c.plan().to_string(); })
      .def("graph_text", [](const CompiledGraph& c) { return print_graph(c.plan().graph); })
      .def("kernels", [](const CompiledGraph& c) {
        nb::list l;
        for (size_t i = 0; i < c.kernels().size(); ++i) l.append(kernel_dict(c, i));
        return l;
      })
      .def("buffers", [](const CompiledGraph& c) {
        std::vector<std::tuple<int, std::string, bool>> r;
        for (auto& b : c.buffers()) r.emplace_back(b.node, dtype_name(b.dtype), b.is_input);
        return r;
      })
      .def("output_buffers", &CompiledGraph::output_buffers)
      .def("symbols", &CompiledGraph::symbols)
      .def("bind", &CompiledGraph::bind)
      .def("buffer_shape", &CompiledGraph::buffer_shape)
      .def("variant",
           [](CompiledGraph& c, const std::vector<std::vector<int64_t>>& shapes,
              const std::vector<std::vector<int64_t>>& strides) {
             bool compiled = false, hit = false;
             int v;
             {
               nb::gil_scoped_release release;
               v = c.variant(shapes, strides, &compiled, &hit);
             }
             return std::make_tuple(v, compiled, hit);
           })
      .def("source", &CompiledGraph::source)
      .def("run",
           [](const CompiledGraph& c, int variant, const std::vector<int64_t>& syms, const std::vector<uintptr_t>& ptrs,
              const std::vector<std::vector<int64_t>>& strides) {
             std::vector<void*> p;
             p.reserve(ptrs.size());
             for (auto x : ptrs) p.push_back(reinterpret_cast<void*>(x));
             nb::gil_scoped_release release;
             c.run(variant, syms, p, strides);
           });
}
