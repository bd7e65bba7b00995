// The public C++ API over the internal graph, planner and runtime.
#include <opfuse/opfuse.h>

#include <cstring>
#include <type_traits>

#include "ir/graph.h"
#include "runtime/compiled_graph.h"

namespace opfuse {

struct Program::Impl {
  Graph graph;
};

struct Compiled::Impl {
  std::unique_ptr<CompiledGraph> graph;
  std::vector<int> input_buffers;
};

namespace {

DType dtype_or_throw(const std::string& s) {
  DType t;
  if (!parse_dtype(s, &t)) throw Error("unknown dtype '" + s + "'");
  return t;
}

template <class F>
auto guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(e.what());
  }
}

}  // namespace

Program::Program() : impl(std::make_unique<Impl>()) {}
Program::~Program() = default;
Program::Program(Program&&) noexcept = default;
Program& Program::operator=(Program&&) noexcept = default;

Value Program::input(const std::string& name, const std::string& dtype, const std::vector<std::string>& shape) {
  return guarded([&] {
    Shape s;
    for (auto& d : shape) {
      std::string err;
      Expr e = parse_expr(d, &err);
      if (!e) throw Error("input " + name + ": bad size '" + d + "': " + err);
      s.push_back(e);
    }
    return Value{impl->graph.add_input(name, dtype_or_throw(dtype), s)};
  });
}

Value Program::scalar(double value, const std::string& dtype) {
  return guarded([&] { return Value{impl->graph.add_scalar(value, dtype_or_throw(dtype), true)}; });
}

Value Program::op(const std::string& name, const std::vector<Value>& inputs, const Attributes& attrs) {
  return guarded([&] {
    Attrs a;
    for (auto& [k, v] : attrs) {
      if (auto s = std::get_if<std::string>(&v); s && k == "dtype") {
        a[k] = dtype_or_throw(*s);
      } else if (auto dims = std::get_if<std::vector<std::string>>(&v)) {
        Shape shape;
        for (auto& d : *dims) {
          std::string err;
          Expr e = parse_expr(d, &err);
          if (!e) throw Error(name + ": attribute '" + k + "': bad size '" + d + "': " + err);
          shape.push_back(e);
        }
        a[k] = shape;
      } else {
        std::visit([&](auto&& x) {
          if constexpr (!std::is_same_v<std::decay_t<decltype(x)>, std::vector<std::string>>) a[k] = x;
        }, v);
      }
    }
    std::vector<int> ids;
    for (auto v : inputs) ids.push_back(v.id);
    return Value{impl->graph.add(name, ids, a)};
  });
}

void Program::set_outputs(const std::vector<Value>& outputs) {
  impl->graph.outputs.clear();
  for (auto v : outputs) impl->graph.outputs.push_back(v.id);
}

std::string Program::text() const { return print_graph(impl->graph); }

Compiled::Compiled() : impl(std::make_unique<Impl>()) {}
Compiled::~Compiled() = default;
Compiled::Compiled(Compiled&&) noexcept = default;
Compiled& Compiled::operator=(Compiled&&) noexcept = default;

Compiled compile(const Program& program) {
  return guarded([&] {
    Compiled c;
    c.impl->graph = std::make_unique<CompiledGraph>(program.impl->graph, CompileOptions{});
    return c;
  });
}

int Compiled::num_kernels() const { return static_cast<int>(impl->graph->kernels().size()); }
std::string Compiled::plan() const { return impl->graph->plan().to_string(); }

std::vector<std::vector<int64_t>> Compiled::output_shapes(const std::vector<std::vector<int64_t>>& input_shapes) const {
  return guarded([&] {
    CompiledGraph& g = impl->graph->for_sizes(input_shapes);  // itself, unless a cat part is empty at these sizes
    auto syms = g.bind(input_shapes);
    std::vector<std::vector<int64_t>> r;
    for (size_t o = 0; o < g.output_buffers().size(); ++o) r.push_back(g.output_shape(static_cast<int>(o), syms));
    return r;
  });
}

void Compiled::run(const std::vector<TensorRef>& inputs, const std::vector<TensorRef>& outputs) {
  guarded([&] {
    const auto& given = impl->graph->buffers();  // the inputs: the same in every graph for_sizes() gives
    size_t n_in = 0;
    while (n_in < given.size() && given[n_in].is_input) ++n_in;
    if (inputs.size() != n_in) throw Error("expected " + std::to_string(n_in) + " inputs, got " + std::to_string(inputs.size()));
    std::vector<std::vector<int64_t>> shapes, strides;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const TensorRef& t = inputs[i];
      if (dtype_or_throw(t.dtype) != given[i].dtype)
        throw Error("input " + std::to_string(i) + " is " + t.dtype + ", the graph expects " + dtype_name(given[i].dtype));
      if (t.strides.size() != t.shape.size()) throw Error("input " + std::to_string(i) + ": strides and shape differ in rank");
      shapes.push_back(t.shape);
      strides.push_back(t.strides);
    }
    CompiledGraph& g = impl->graph->for_sizes(shapes);
    const auto& bufs = g.buffers();
    auto syms = g.bind(shapes);
    int v = g.variant(shapes, strides);
    // Every output: the shape output_shapes() gives, the graph's dtype,
    // row-major strides (a size-1 dim's stride is free).
    const auto& outs = g.output_buffers();
    if (outputs.size() != outs.size())
      throw Error("expected " + std::to_string(outs.size()) + " outputs, got " + std::to_string(outputs.size()));
    for (size_t o = 0; o < outs.size(); ++o) {
      const TensorRef& t = outputs[o];
      const auto want = g.output_shape(static_cast<int>(o), syms);
      if (t.shape != want) throw Error("output " + std::to_string(o) + " has the wrong shape");
      if (dtype_or_throw(t.dtype) != bufs[static_cast<size_t>(outs[o])].dtype)
        throw Error("output " + std::to_string(o) + " is " + t.dtype + ", the graph gives " +
                    dtype_name(bufs[static_cast<size_t>(outs[o])].dtype));
      if (t.strides.size() != t.shape.size()) throw Error("output " + std::to_string(o) + ": strides and shape differ in rank");
      int64_t expect = 1;
      for (size_t d = t.shape.size(); d-- > 0;) {
        if (t.shape[d] != 1 && t.strides[d] != expect)
          throw Error("output " + std::to_string(o) + " is not contiguous (stride " + std::to_string(t.strides[d]) +
                      " at dim " + std::to_string(d) + ", row-major wants " + std::to_string(expect) + ")");
        expect *= t.shape[d];
      }
    }
    // Stored nodes: a graph output's buffer is the caller's memory (the
    // first output it backs; an output that reshapes a buffer has the same
    // elements in the same order); intermediates are allocated here for the
    // duration of the run.
    std::vector<void*> ptrs;
    for (auto& t : inputs) ptrs.push_back(t.data);
    std::vector<std::vector<char>> scratch;
    for (size_t b = n_in; b < bufs.size(); ++b) {
      void* p = nullptr;
      for (size_t o = 0; o < outs.size() && !p; ++o)
        if (outs[o] == static_cast<int>(b)) p = outputs[o].data;
      if (!p) {
        int64_t n = 1;
        for (auto s : g.buffer_shape(static_cast<int>(b), syms)) n *= s;
        scratch.emplace_back(static_cast<size_t>(n * dtype_size(bufs[b].dtype)) + 1);
        p = scratch.back().data();
      }
      ptrs.push_back(p);
    }
    g.run(v, syms, ptrs, strides);
    // Outputs whose buffer is another output's (or a graph input) are copied into place.
    for (size_t o = 0; o < outs.size(); ++o) {
      const size_t b = static_cast<size_t>(outs[o]);
      if (ptrs[b] == outputs[o].data) continue;
      const size_t elem = static_cast<size_t>(dtype_size(bufs[b].dtype));
      const auto shape = g.buffer_shape(static_cast<int>(b), syms);
      int64_t n = 1;
      for (auto s : shape) n *= s;
      if (b >= n_in) {
        std::memcpy(outputs[o].data, ptrs[b], static_cast<size_t>(n) * elem);
        continue;
      }
      // A graph input, at its own strides: element by element, row-major.
      const auto& st = strides[b];
      std::vector<int64_t> idx(shape.size(), 0);
      char* dst = static_cast<char*>(outputs[o].data);
      const char* src = static_cast<const char*>(ptrs[b]);
      for (int64_t i = 0; i < n; ++i) {
        int64_t at = 0;
        for (size_t d = 0; d < idx.size(); ++d) at += idx[d] * st[d];
        std::memcpy(dst + static_cast<size_t>(i) * elem, src + at * static_cast<int64_t>(elem), elem);
        for (size_t d = idx.size(); d-- > 0;) {
          if (++idx[d] < shape[d]) break;
          idx[d] = 0;
        }
      }
    }
    return 0;
  });
}

}  // namespace opfuse
