// The nanobind module opfuse._C: the C++ core as Python sees it. Tensors
// cross as raw pointers, shapes and strides, so no libtorch is linked.
#include <cstdlib>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "codegen/cpu_emitter.h"
#include "codegen/cuda_emitter.h"
#include "runtime/cuda_api.h"
#include "fusion/passes.h"
#include "ir/evaluate.h"
#include "ir/ops.h"
#include "runtime/compile_cache.h"
#include "runtime/compiled_graph.h"
#include "runtime/decode_mlp_launcher.h"
#include "runtime/gemm_launcher.h"
#include "runtime/cublaslt_api.h"
#include "python/run_options.h"

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

Shape parse_shape(const std::vector<std::string>& dims) {
  Shape s;
  for (auto& d : dims) {
    std::string err;
    Expr e = parse_expr(d, &err);
    if (!e) throw std::invalid_argument("bad size '" + d + "': " + err);
    s.push_back(e);
  }
  return s;
}

DType dtype_of(const std::string& name) {
  DType t;
  if (!parse_dtype(name, &t)) throw std::invalid_argument("unknown dtype '" + name + "'");
  return t;
}

// Attributes from Python: bool, int, float, str, list of ints, and tagged
// tuples ("dtype", "f32") and ("shape", ["s0", "4"]).
Attrs attrs_from(const nb::dict& d) {
  Attrs a;
  for (auto [k, v] : d) {
    std::string key = nb::cast<std::string>(k);
    if (nb::isinstance<nb::bool_>(v)) a[key] = nb::cast<bool>(v);
    else if (nb::isinstance<nb::int_>(v)) a[key] = nb::cast<int64_t>(v);
    else if (nb::isinstance<nb::float_>(v)) a[key] = nb::cast<double>(v);
    else if (nb::isinstance<nb::str>(v)) a[key] = nb::cast<std::string>(v);
    else if (nb::isinstance<nb::list>(v)) a[key] = nb::cast<std::vector<int64_t>>(v);
    else if (nb::isinstance<nb::tuple>(v)) {
      auto t = nb::cast<nb::tuple>(v);
      std::string tag = nb::cast<std::string>(t[0]);
      if (tag == "dtype") a[key] = dtype_of(nb::cast<std::string>(t[1]));
      else if (tag == "shape") a[key] = parse_shape(nb::cast<std::vector<std::string>>(t[1]));
      else throw std::invalid_argument("unknown attribute tag '" + tag + "'");
    } else throw std::invalid_argument("unsupported value for attribute '" + key + "'");
  }
  return a;
}

}  // namespace

// Hand-picked fused ops (opfuse.ops): bindings_ops.cpp.
void bind_ops(nb::module_& m);
void bind_attention_bwd(nb::module_& m);
// The skinny GEMM's launch, build and reference: bindings_skinny.cpp.
void bind_skinny_gemm(nb::module_& m);
void bind_decode_mlp(nb::module_& m);
void bind_lnbwd_wide(nb::module_& m);
// The launch path (PreparedRun, launch counters): bindings_launch.cpp.
void bind_launch(nb::module_& m);

NB_MODULE(_C, m) {
  m.doc() = "opfuse core: graph IR, fusion planner, code generation and runtime";
  // Compiled graphs live in Dynamo's caches until exit; that is not a leak.
  nb::set_leak_warnings(false);
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
  m.def("size_expr", [](const std::string& text) { return to_string(parse_shape({text})[0]); },
        "A size expression (`s0-1`, `((s0 + 1)//2)`) in the IR's canonical form (`s0 + -1`), so that "
        "PyTorch's sizes and the IR's compare as text.");
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

  // Builds a graph node by node; each node's dtype and shape come from the
  // op's own rule, so the frontend cannot declare a wrong type.
  nb::class_<Graph>(m, "GraphBuilder")
      .def(nb::init<>())
      .def("input", [](Graph& g, const std::string& name, const std::string& dtype, const std::vector<std::string>& shape) {
        return g.add_input(name, dtype_of(dtype), parse_shape(shape));
      })
      .def("size_scalar", [](Graph& g, const std::string& size) { return g.add_size_scalar(parse_shape({size})[0]); },
           nb::arg("size"), "A weak int64 scalar whose value is a size expression (a SymInt used as a number).")
      .def("scalar", [](Graph& g, double v, const std::string& dtype, bool weak) { return g.add_scalar(v, dtype_of(dtype), weak); },
           nb::arg("value"), nb::arg("dtype"), nb::arg("weak") = true)
      .def("add", [](Graph& g, const std::string& op, const std::vector<int>& inputs, const nb::dict& attrs) {
        return g.add(op, inputs, attrs_from(attrs));
      }, nb::arg("op"), nb::arg("inputs"), nb::arg("attrs") = nb::dict())
      .def("dtype", [](const Graph& g, int id) { return std::string(dtype_name(g.node(id).dtype)); })
      .def("shape", [](const Graph& g, int id) {
        std::vector<std::string> r;
        for (auto& d : g.node(id).shape) r.push_back(to_string(d));
        return r;
      })
      .def("set_outputs", [](Graph& g, const std::vector<int>& outs) { g.outputs = outs; })
      .def("text", [](const Graph& g) { return print_graph(g); });

  nb::class_<CompiledGraph>(m, "CompiledGraph")
      .def("__init__",
           [](CompiledGraph* self, const std::string& text, bool fuse, double bandwidth, double flops, const std::string& target,
              int gemm_epilogues) {
             CompileOptions opt;
             if (target == "cuda") opt.target = Target::CUDA;
             else if (target != "cpu") throw std::invalid_argument("target must be cpu or cuda, not " + target);
             opt.planner.fuse = fuse;
             // gemm_epilogues: 0 none, 1 epilogues in the GEMM's dtype, 2 also a float32 bias and bias
             // gradient beside 16-bit matrices (autocast). Default: 2 on the GPU (cuBLASLt); 0 on the
             // CPU, where PyTorch runs the GEMM plainly.
             // Default 1: cuBLASLt takes a bias only in D's type (cublasLt.h on
             // CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE; a float32 bias beside bf16 was refused
             // with status 7 at every shape tried on the H200), so level 2 is opt-in.
             int level = gemm_epilogues < 0 ? (opt.target == Target::CUDA ? 1 : 0) : gemm_epilogues;
             opt.planner.gemm_epilogues = level >= 1;
             opt.planner.gemm_float32_bias = level >= 2;
             // Column partials in row kernels on the GPU (OPFUSE_COLUMN_PARTIALS=0: off, for comparisons).
             const char* cp = std::getenv("OPFUSE_COLUMN_PARTIALS");
             opt.planner.column_partials = opt.target == Target::CUDA && fuse && !(cp && std::string(cp) == "0");
             // Rows of 8193 to 32768 elements split too, their kernel a cluster of blocks per row (sm_90; opt-in while measured).
             const char* wide = std::getenv("OPFUSE_COLUMN_PARTIALS_WIDE");
             if (wide && std::string(wide) == "1") opt.planner.column_partials_max_cols = 32768;
             // A decode-shaped MLP block as one kernel (sm_90; opt-in, OPFUSE_DECODE_MLP=1).
             opt.planner.decode_mlp = opt.target == Target::CUDA && fuse && level >= 1 && decode_mlp::planning_enabled();
             if (bandwidth > 0) opt.planner.bandwidth_bytes_per_s = bandwidth;
             if (flops > 0) opt.planner.flops_per_s = flops;
             Graph g = parse_graph(text);
             new (self) CompiledGraph(g, opt);
           },
           nb::arg("text"), nb::arg("fuse") = true, nb::arg("bandwidth") = 0.0, nb::arg("flops") = 0.0,
           nb::arg("target") = "cpu", nb::arg("gemm_epilogues") = -1)
      .def_prop_ro("target", [](const CompiledGraph& c) { return std::string(c.target() == Target::CUDA ? "cuda" : "cpu"); })
      .def("cuda_source", &CompiledGraph::cuda_source, nb::arg("shapes"), nb::arg("strides"), nb::arg("arch") = 90)
      .def("compile_cuda",
           [](const CompiledGraph& c, const std::vector<std::vector<int64_t>>& shapes,
              const std::vector<std::vector<int64_t>>& strides, int arch, bool want_ptx) {
             NvrtcOutput o = c.compile_cuda(shapes, strides, arch, want_ptx);
             return std::make_tuple(nb::bytes(o.cubin.data(), o.cubin.size()), o.ptx, o.log);
           })
      .def_prop_ro("num_kernels", [](const CompiledGraph& c) { return c.kernels().size(); })
      .def_prop_ro("num_library_calls", [](const CompiledGraph& c) { return c.gemms().size(); })
      // Whether a GEMM step is the decode MLP kernel (it needs RunOptions::zeroed_workspace).
      .def_prop_ro("uses_decode_mlp",
                   [](const CompiledGraph& c) {
                     for (const GemmStep& s : c.gemms())
                       if (s.call.is_decode_mlp()) return true;
                     return false;
                   })
      .def("gemms",
           [](const CompiledGraph& c, const std::vector<int64_t>& syms) {
             std::map<std::string, int64_t> env;
             for (size_t i = 0; i < c.symbols().size(); ++i) env[c.symbols()[i]] = syms.at(i);
             nb::list l;
             for (const GemmStep& s : c.gemms()) {
               nb::dict d;
               d["name"] = s.name;
               d["epilogue"] = s.call.epilogue_name();
               auto operand = [&](const char* key, const GemmOperand& op, int buffer) {
                 std::vector<int64_t> shape;
                 for (auto& e : op.shape) shape.push_back(evaluate(e, env));
                 d[key] = nb::make_tuple(buffer, shape, op.transposed);
               };
               operand("a", s.call.a, s.a);
               operand("b", s.call.b, s.b);
               d["out"] = s.out;
               d["bias"] = s.bias;
               d["residual"] = s.residual;
               d["aux"] = s.aux;
               d["bias_grad"] = s.bias_grad;
               d["dtype"] = dtype_name(s.dtype);
               l.append(d);
             }
             return l;
           },
           nb::arg("syms") = std::vector<int64_t>{})
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
      .def("gemm_pairs", &CompiledGraph::gemm_pairs)
      .def("paired_buffers", &CompiledGraph::paired_buffers)
      .def("pair_gates", &CompiledGraph::pair_gates)
      .def("symbols", &CompiledGraph::symbols)
      // Itself, or the graph compiled with the symbols fixed that make a cat
      // part or slice_scatter source empty at these sizes (kept by this one).
      .def("for_sizes", &CompiledGraph::for_sizes, nb::arg("shapes"), nb::rv_policy::reference_internal)
      .def("empty_part_symbols", &CompiledGraph::empty_part_symbols, nb::arg("shapes"))
      .def("bind", &CompiledGraph::bind)
      .def("buffer_shape", &CompiledGraph::buffer_shape)
      .def("output_shape", &CompiledGraph::output_shape)
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
              const std::vector<std::vector<int64_t>>& strides, uintptr_t stream, uintptr_t workspace, size_t workspace_bytes,
              bool allow_tf32, nb::object cpu_gemm, uintptr_t zeroed_workspace, size_t zeroed_workspace_bytes) {
             std::vector<void*> p;
             p.reserve(ptrs.size());
             for (auto x : ptrs) p.push_back(reinterpret_cast<void*>(x));
             RunOptions o = run_options_from_python(stream, workspace, workspace_bytes, allow_tf32, cpu_gemm, zeroed_workspace,
                                                    zeroed_workspace_bytes);
             int gemm_kernels = 0;
             o.gemm_kernels = &gemm_kernels;
             {
               nb::gil_scoped_release release;
               c.run(variant, syms, p, strides, o);
             }
             return gemm_kernels;  // GEMM steps run as opfuse kernels, not library calls
           },
           nb::arg("variant"), nb::arg("syms"), nb::arg("ptrs"), nb::arg("strides"), nb::arg("stream") = 0,
           nb::arg("workspace") = 0, nb::arg("workspace_bytes") = 0, nb::arg("allow_tf32") = false,
           nb::arg("cpu_gemm") = nb::none(), nb::arg("zeroed_workspace") = 0, nb::arg("zeroed_workspace_bytes") = 0);
  nb::exception<GemmUnsupported>(m, "GemmUnsupported");
  m.def("cublaslt_version", [] { return cublaslt_version(); });
  m.def("cublaslt_path", [] { return cublaslt().path; });
  m.def("ensure_cuda_context", &ensure_cuda_context, nb::arg("device"));
  m.def("nvrtc_version", [] {
    const NvrtcApi& n = nvrtc();
    if (!n.loaded) throw std::runtime_error(n.error);
    return std::make_pair(n.major, n.minor);
  });
  m.def("nvrtc_compile", [](const std::string& src, int arch, bool arch_specific) {
    NvrtcOutput o = nvrtc_compile(src, "kernel.cu", arch, arch_specific, true);
    return std::make_tuple(nb::bytes(o.cubin.data(), o.cubin.size()), o.ptx, o.log);
  });
  m.def("cuda_prelude", [] { return std::string(cuda_prelude()); });
  bind_ops(m);
  bind_attention_bwd(m);
  bind_skinny_gemm(m);
  bind_lnbwd_wide(m);
  bind_decode_mlp(m);
  bind_launch(m);
}
