// The public C++ API over the internal graph, planner and runtime.
#include <opfuse/opfuse.h>

#include <cstring>

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
      if (auto s = std::get_if<std::string>(&v); s && k == "dtype") a[k] = dtype_or_throw(*s);
      else std::visit([&](auto&& x) { a[k] = x; }, v);
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
    // Stored nodes: graph outputs come from the caller; intermediates are
    // allocated here for the duration of the run.
    std::vector<void*> ptrs;
    for (auto& t : inputs) ptrs.push_back(t.data);
    std::vector<std::vector<char>> scratch;
    const auto& outs = g.output_buffers();
    if (outputs.size() != outs.size())
      throw Error("expected " + std::to_string(outs.size()) + " outputs, got " + std::to_string(outputs.size()));
    for (size_t b = n_in; b < bufs.size(); ++b) {
      auto shape = g.buffer_shape(static_cast<int>(b), syms);
      int64_t n = 1;
      for (auto s : shape) n *= s;
      void* p = nullptr;
      for (size_t o = 0; o < outs.size(); ++o)
        if (outs[o] == static_cast<int>(b)) {
          if (outputs[o].shape != shape) throw Error("output " + std::to_string(o) + " has the wrong shape");
          if (dtype_or_throw(outputs[o].dtype) != bufs[b].dtype) throw Error("output " + std::to_string(o) + " has the wrong dtype");
          p = outputs[o].data;
        }
      if (!p) {
        scratch.emplace_back(static_cast<size_t>(n * dtype_size(bufs[b].dtype)) + 1);
        p = scratch.back().data();
      }
      ptrs.push_back(p);
    }
    g.run(v, syms, ptrs, strides);
    // Outputs that are graph inputs (or repeated) are copied into place.
    for (size_t o = 0; o < outs.size(); ++o)
      if (ptrs[static_cast<size_t>(outs[o])] != outputs[o].data) {
        auto shape = g.buffer_shape(outs[o], syms);
        int64_t n = 1;
        for (auto s : shape) n *= s;
        if (static_cast<size_t>(outs[o]) < n_in) throw Error("an output that is a graph input is not supported by run()");
        std::memcpy(outputs[o].data, ptrs[static_cast<size_t>(outs[o])], static_cast<size_t>(n * dtype_size(bufs[static_cast<size_t>(outs[o])].dtype)));
      }
    return 0;
  });
}

}  // namespace opfuse
