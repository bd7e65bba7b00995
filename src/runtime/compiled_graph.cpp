#include "runtime/compiled_graph.h"

#include "ir/specialize.h"
#include "runtime/huge_pages.h"

#include <algorithm>
#include <cstdlib>
#include <set>
#include <stdexcept>

#include "codegen/cpu_emitter.h"
#include "codegen/lower.h"
#include "ir/ops.h"
#include "runtime/compile_cache.h"
#include "runtime/hash.h"

namespace opfuse {
namespace {

// The ops a kernel computes, for names and reports.
std::vector<std::string> member_ops(const FusionPlan& plan, const KernelGroup& k) {
  const Graph& g = plan.graph;
  std::set<int> seen;
  std::vector<int> stack(k.roots.begin(), k.roots.end());
  std::vector<int> members;
  while (!stack.empty()) {
    int id = stack.back();
    stack.pop_back();
    if (!seen.insert(id).second) continue;
    members.push_back(id);
    for (int i : g.node(id).inputs) {
      const Node& in = g.node(i);
      if (in.op == "input" || in.op == "scalar") continue;
      int ki = plan.kernel_of[static_cast<size_t>(i)];
      if (ki >= 0 && std::find(k.roots.begin(), k.roots.end(), i) == k.roots.end()) continue;
      stack.push_back(i);
    }
  }
  std::sort(members.begin(), members.end());
  std::vector<std::string> ops;
  for (int id : members) ops.push_back(g.node(id).op);
  return ops;
}

std::string kernel_name(size_t index, const std::vector<std::string>& ops) {
  std::string name = "opfuse_k" + std::to_string(index);
  std::vector<std::string> distinct;
  for (auto& o : ops)
    if (std::find(distinct.begin(), distinct.end(), o) == distinct.end() && o != "cast") distinct.push_back(o);
  for (size_t i = 0; i < distinct.size() && i < 4; ++i) name += "_" + distinct[i];
  return name;
}

}  // namespace

CompiledGraph::CompiledGraph(const Graph& g, const CompileOptions& opt) : source_(g), options_(opt), target_(opt.target) {
  verify(g);
  plan_ = plan_fusion(g, opt.planner);
  const Graph& pg = plan_.graph;
  input_nodes_ = pg.input_ids();
  for (int id : input_nodes_) {
    const Node& n = pg.node(id);
    buffers_.push_back({id, n.dtype, n.shape, true});
  }
  std::map<int, int> buffer_of;
  for (size_t i = 0; i < input_nodes_.size(); ++i) buffer_of[input_nodes_[i]] = static_cast<int>(i);
  for (auto& k : plan_.kernels)
    for (int s : k.stores) {
      buffer_of[s] = static_cast<int>(buffers_.size());
      const Node& n = pg.node(s);
      buffers_.push_back({s, n.dtype, n.shape, false});
    }
  // Written buffers that may be large enough for huge pages (huge_pages.h),
  // with their size in bytes: a constant, or an expression of size symbols.
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (buffers_[b].is_input) continue;
    Expr bytes = cst(dtype_size(buffers_[b].dtype));
    for (const Expr& d : buffers_[b].shape) bytes = bytes * d;
    int64_t c = 0;
    if (is_const(bytes, &c) && static_cast<size_t>(c) < kHugePagesMinBytes) continue;
    large_written_.push_back({static_cast<int>(b), bytes});
  }
  for (int o : pg.outputs) {
    auto alias = plan_.output_alias.find(o);
    output_buffers_.push_back(buffer_of.at(alias == plan_.output_alias.end() ? o : alias->second));
  }

  // Every size symbol must be the size of some input dim.
  std::set<std::string> bound;
  for (int id : input_nodes_)
    for (auto& d : pg.node(id).shape)
      if (d->kind == ExprNode::Sym) bound.insert(d->name);
  // ... or the one unbound symbol of a dim linear in it (s0 - 3: a slice's
  // gradient), which bind_symbols solves for.
  for (bool more = true; more;) {
    more = false;
    for (int id : input_nodes_)
      for (auto& d : pg.node(id).shape) {
        std::vector<std::string> syms;
        collect_symbols(d, &syms);
        std::vector<std::string> open;
        for (auto& s : syms)
          if (!bound.count(s)) open.push_back(s);
        if (open.size() == 1 && linear_in(d, open[0])) more = bound.insert(open[0]).second || more;
      }
  }
  std::set<std::string> all;
  for (auto& n : pg.nodes) {
    std::vector<std::string> syms;
    n.collect_symbols(&syms);  // shapes, size scalars, slice bounds
    for (auto& s : syms) all.insert(s);
  }
  for (auto& s : all)
    if (!bound.count(s)) throw GraphError("size symbol " + s + " is not the size of any input dim");
  symbols_.assign(all.begin(), all.end());
  for (auto& n : pg.nodes) {
    if (n.op != "cat" && n.op != "slice_scatter") continue;
    const size_t d = static_cast<size_t>(normalize_dim(n.get_int("dim"), n.rank(), n));
    const size_t first = n.op == "cat" ? 0 : 1;  // slice_scatter: the source, not the base
    for (size_t i = first; i < n.inputs.size(); ++i) {
      const Expr& size = pg.node(n.inputs[i]).shape[d];
      int64_t c = 0;
      if (!is_const(size, &c))
        part_sizes_.emplace_back(size, n.where() + (n.op == "cat" ? " part " + std::to_string(i) : " source") +
                                           " (%" + std::to_string(n.inputs[i]) + ")");
    }
  }

  const char* gated_env = std::getenv("OPFUSE_GATED_GEMM");
  const bool gated_gemm = gated_env && std::string(gated_env) == "1";  // see gate_gemm_of_ below
  for (size_t i = 0; i < plan_.kernels.size(); ++i) {
    const KernelGroup& k = plan_.kernels[i];
    if (k.kind == KernelGroup::Kind::Gemm) {
      GemmStep s;
      s.call = k.gemm;
      auto buf = [&](int node) { return node < 0 ? -1 : buffer_of.at(node); };
      s.a = buf(k.gemm.a.node);
      s.b = buf(k.gemm.b.node);
      s.out = buf(k.gemm.result);
      s.bias = buf(k.gemm.bias);
      s.residual = buf(k.gemm.residual);
      s.aux = buf(k.gemm.aux);
      s.bias_grad = buf(k.gemm.bias_grad);
      s.w1 = buf(k.gemm.decode_w1);
      s.w3 = buf(k.gemm.decode_w3);
      s.b1 = buf(k.gemm.decode_b1);
      s.gate_silu = buf(k.gemm.gate_silu);
      s.gate_mul = buf(k.gemm.gate_mul);
      // The plan marks a gated A only right after its gate kernel
      // (gated_gemm_input.cpp). Opt-in, OPFUSE_GATED_GEMM=1: on the H200 the
      // gated skinny GEMM cost more than the kernel it saves (docs/perf-notes.md,
      // "H200, session 15").
      if (s.gate_silu >= 0 && !steps_.empty() && !steps_.back().first) {
        s.gate_kernel = steps_.back().second;
        s.gate_step = static_cast<int>(steps_.size()) - 1;
        if (gated_gemm) gate_gemm_of_.at(static_cast<size_t>(s.gate_kernel)) = static_cast<int>(gemms_.size());
      }
      s.dtype = pg.node(k.gemm.matmul).dtype;
      s.name = "gemm" + std::to_string(gemms_.size());
      if (k.gemm.epilogue_name() != "none") s.name += "_" + k.gemm.epilogue_name();
      for (auto& ch : s.name)
        if (ch == '+') ch = '_';
      steps_.emplace_back(true, static_cast<int>(gemms_.size()));
      gemms_.push_back(s);
      continue;
    }
    KernelInfo info;
    info.ops = member_ops(plan_, k);
    info.name = kernel_name(kernels_.size(), info.ops);
    info.cost = estimate_cost(plan_, k, opt.planner);
    info.row = k.kind == KernelGroup::Kind::Row;
    kernels_.push_back(lower_kernel(plan_, k, info.name));
    Launch l;
    for (auto& b : kernels_.back().buffers) {
      l.buffers.push_back(buffer_of.at(b.node));
      if (b.strided) l.strided_inputs.push_back(buffer_of.at(b.node));
    }
    for (auto& s : kernels_.back().symbols)
      l.symbols.push_back(static_cast<int>(std::find(symbols_.begin(), symbols_.end(), s) - symbols_.begin()));
    launches_.push_back(l);
    gate_gemm_of_.push_back(-1);
    info_.push_back(info);
    steps_.emplace_back(false, static_cast<int>(kernels_.size()) - 1);
  }
  pair_gemms();
}

std::vector<int64_t> CompiledGraph::bind(const std::vector<std::vector<int64_t>>& shapes) const {
  if (shapes.size() != input_nodes_.size())
    throw std::invalid_argument("expected " + std::to_string(input_nodes_.size()) + " inputs, got " + std::to_string(shapes.size()));
  SymbolValues env = bind_symbols(plan_.graph, shapes);
  for (auto& [size, what] : part_sizes_)
    if (evaluate(size, env) == 0)
      throw GraphError(what + " is empty at these input sizes (" + to_string(size) +
                       " = 0): the kernels of this graph read every part; run these sizes on for_sizes(), which "
                       "compiles the graph with that size fixed");
  std::vector<int64_t> v;
  for (auto& s : symbols_) v.push_back(env.at(s));
  return v;
}

std::map<std::string, int64_t> CompiledGraph::empty_part_symbols(const std::vector<std::vector<int64_t>>& shapes) const {
  std::map<std::string, int64_t> fixed;
  if (part_sizes_.empty()) return fixed;
  if (shapes.size() != input_nodes_.size())
    throw std::invalid_argument("expected " + std::to_string(input_nodes_.size()) + " inputs, got " + std::to_string(shapes.size()));
  SymbolValues env = bind_symbols(plan_.graph, shapes);
  for (auto& [size, what] : part_sizes_) {
    if (evaluate(size, env) != 0) continue;
    std::vector<std::string> names;
    collect_symbols(size, &names);
    for (auto& s : names) fixed[s] = env.at(s);
  }
  return fixed;
}

CompiledGraph& CompiledGraph::for_sizes(const std::vector<std::vector<int64_t>>& shapes) {
  std::map<std::string, int64_t> fixed = empty_part_symbols(shapes);
  if (fixed.empty()) return *this;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = fixed_.find(fixed);
  if (it == fixed_.end()) {
    // Only symbols whose sizes are 0 are fixed, so the copy's parts that are
    // still symbolic are not empty at these sizes: its for_sizes() is itself.
    it = fixed_.emplace(fixed, std::make_unique<CompiledGraph>(fix_symbols(source_, fixed), options_)).first;
  }
  return *it->second;
}

std::vector<int64_t> CompiledGraph::output_shape(int output, const std::vector<int64_t>& values) const {
  std::map<std::string, int64_t> env;
  for (size_t i = 0; i < symbols_.size(); ++i) env[symbols_[i]] = values[i];
  std::vector<int64_t> shape;
  for (auto& d : plan_.graph.node(plan_.graph.outputs.at(static_cast<size_t>(output))).shape) shape.push_back(evaluate(d, env));
  return shape;
}

std::vector<int64_t> CompiledGraph::buffer_shape(int b, const std::vector<int64_t>& values) const {
  std::map<std::string, int64_t> env;
  for (size_t i = 0; i < symbols_.size(); ++i) env[symbols_[i]] = values[i];
  std::vector<int64_t> shape;
  for (auto& d : buffers_[static_cast<size_t>(b)].shape) shape.push_back(evaluate(d, env));
  return shape;
}

std::string CompiledGraph::signature(const std::vector<std::vector<int64_t>>& shapes,
                                     const std::vector<std::vector<int64_t>>& strides,
                                     std::vector<StrideSignature>* per_kernel) const {
  std::vector<std::string> cls;
  std::string key;
  for (size_t i = 0; i < shapes.size(); ++i) {
    std::string c;
    for (size_t d = 0; d < shapes[i].size(); ++d)
      c += (shapes[i][d] == 1 || strides[i][d] == 0) ? '0' : strides[i][d] == 1 ? '1' : 'x';
    cls.push_back(c);
    key += c + "/";
  }
  if (per_kernel) {
    per_kernel->clear();
    for (auto& l : launches_) {
      StrideSignature s;
      for (int b : l.strided_inputs) s.classes.push_back(cls[static_cast<size_t>(b)]);
      per_kernel->push_back(s);
    }
  }
  return key;
}

int CompiledGraph::variant(const std::vector<std::vector<int64_t>>& shapes, const std::vector<std::vector<int64_t>>& strides,
                           bool* compiled, bool* cache_hit) {
  if (compiled) *compiled = false;
  if (cache_hit) *cache_hit = false;
  std::string key = signature(shapes, strides, nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = variant_index_.find(key);
  if (it != variant_index_.end()) return it->second;
  std::vector<StrideSignature> sigs;
  signature(shapes, strides, &sigs);
  if (target_ == Target::CUDA) {
    auto v = std::make_unique<Variant>();
    v->key = key;
    bool hit = false;
    build_cuda_variant(*v, sigs, &hit);
    if (compiled) *compiled = true;
    if (cache_hit) *cache_hit = hit;
    variants_.push_back(std::move(v));
    int index = static_cast<int>(variants_.size()) - 1;
    variant_index_[key] = index;
    return index;
  }
  std::string src = cpu_prelude();
  src += "\n";
  for (size_t i = 0; i < kernels_.size(); ++i) {
    CpuEmitter e;
    src += e.emit(kernels_[i], sigs[i]) + "\n";
  }
  const HostCompiler& hc = host_compiler();
  std::string flags;
  for (auto& f : hc.flags) flags += f + " ";
  std::string entry = content_hash(src + "\n" + flags + "\n" + hc.identity);
  auto v = std::make_unique<Variant>();
  v->key = key;
  v->source = src;
  CacheLookup found = cache_get_or_build("cpu", entry, ".so", [&](const std::string& out) { compile_shared_object(src, out); });
  try {
    v->lib = load_library(found.path);
  } catch (const std::exception&) {
    // A cached file that passed its checksum but still does not load: rebuild once.
    cache_evict(found.path);
    found = cache_get_or_build("cpu", entry, ".so", [&](const std::string& out) { compile_shared_object(src, out); });
    v->lib = load_library(found.path);
  }
  for (auto& k : kernels_) v->fns.push_back(reinterpret_cast<KernelFn>(v->lib.symbol(k.name)));
  v->take_error = reinterpret_cast<int (*)()>(v->lib.symbol("opfuse_take_error"));
  if (compiled) *compiled = true;
  if (cache_hit) *cache_hit = found.hit;
  variants_.push_back(std::move(v));
  int index = static_cast<int>(variants_.size()) - 1;
  variant_index_[key] = index;
  return index;
}

std::string CompiledGraph::source(int variant) const { return variants_.at(static_cast<size_t>(variant))->source; }

void CompiledGraph::run(int variant, const std::vector<int64_t>& symbol_values, const std::vector<void*>& ptrs,
                        const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& options) const {
  run_prepared(prepare(variant, symbol_values, input_strides), ptrs, options);
}

CompiledGraph::PreparedRun CompiledGraph::prepare(int variant, const std::vector<int64_t>& symbol_values,
                                                  const std::vector<std::vector<int64_t>>& input_strides, int device) const {
  PreparedRun p;
  {
    std::lock_guard<std::mutex> lock(mu_);  // variant() may be adding to variants_
    p.variant = variants_.at(static_cast<size_t>(variant)).get();
  }
  p.variant_index = variant;
  if (symbol_values.size() != symbols_.size())
    throw std::invalid_argument("expected " + std::to_string(symbols_.size()) + " size symbols, got " +
                                std::to_string(symbol_values.size()));
  if (input_strides.size() != input_nodes_.size())
    throw std::invalid_argument("expected the strides of " + std::to_string(input_nodes_.size()) + " inputs, got " +
                                std::to_string(input_strides.size()));
  p.symbol_values = symbol_values;
  p.input_strides = input_strides;
  for (size_t i = 0; i < symbols_.size(); ++i) p.env[symbols_[i]] = symbol_values[i];
  p.device = device;
  if (target_ == Target::CUDA && device < 0) {
    p.device = 0;
    CUcontext ctx = nullptr;
    CUdevice dev = 0;
    const CudaApi& c = cuda();
    if (c.loaded && c.CtxGetCurrent(&ctx) == 0 && ctx && c.CtxGetDevice(&dev) == 0) p.device = static_cast<int>(dev);
  }
  for (auto [gemm, index] : steps_) {
    PreparedRun::Step st;
    size_t i = static_cast<size_t>(index);
    if (gemm) {
      st.gemm = index;
    } else if (target_ == Target::CUDA) {
      prepare_cuda_kernel(*p.variant, i, symbol_values, p.env, input_strides, &st);
    } else {
      const Launch& l = launches_[i];
      st.kernel = index;
      st.ptr_buffers = l.buffers;
      st.n_ptrs = l.buffers.size();
      for (int s : l.symbols) st.args.push_back(symbol_values[static_cast<size_t>(s)]);
      for (int b : l.strided_inputs) {
        auto& sv = input_strides.at(static_cast<size_t>(b));
        st.strides.insert(st.strides.end(), sv.begin(), sv.end());
      }
    }
    p.wants_zeroed_workspace = p.wants_zeroed_workspace || st.group_arg >= 0;
    p.steps.push_back(std::move(st));
  }
  // CPU: the buffers a run writes that are large enough for huge pages
  // (huge_pages.h), with their sizes for this layout.
  if (target_ == Target::CPU)
    for (const auto& [b, bytes] : large_written_) {
      int64_t n = evaluate(bytes, p.env);
      if (n > 0 && static_cast<size_t>(n) >= kHugePagesMinBytes) p.huge_pages.emplace_back(b, static_cast<size_t>(n));
    }
  return p;
}

void CompiledGraph::run_prepared(const PreparedRun& p, const std::vector<void*>& ptrs, const RunOptions& options) const {
  if (ptrs.size() != buffers_.size())
    throw std::invalid_argument("expected " + std::to_string(buffers_.size()) + " pointers, got " + std::to_string(ptrs.size()));
  const Variant& v = *p.variant;
  if (target_ == Target::CUDA) {
    const CudaApi& c = cuda();
    // A thread with no current context (autograd's backward threads) gets
    // the device's primary context, as PyTorch's runtime calls would.
    CUcontext ctx = nullptr;
    check_cuda(c.CtxGetCurrent(&ctx), "cuCtxGetCurrent");
    if (!ctx) ensure_cuda_context(p.device);
    int64_t local[64];
    std::vector<int64_t> heap;
    // Paired GEMM steps may swap their two result pointers (launch_gemm_pair):
    // every step then reads this run's copy.
    std::vector<void*> swapped;
    bool pairs = std::any_of(pair_of_.begin(), pair_of_.end(), [](int j) { return j >= 0; });
    if (pairs) swapped = ptrs;
    const std::vector<void*>& run_ptrs = pairs ? swapped : ptrs;
    // GEMM steps already run by an earlier step (a pair's second, a gated
    // GEMM run at its gate kernel's place); on the stack for the usual few.
    char done_local[32] = {};
    std::vector<char> done_heap;
    if (gemms_.size() > sizeof(done_local)) done_heap.assign(gemms_.size(), 0);
    char* done = done_heap.empty() ? done_local : done_heap.data();
    // Generated kernels a gated pair computed in its place.
    char skip_local[32] = {};
    std::vector<char> skip_heap;
    if (kernels_.size() > sizeof(skip_local)) skip_heap.assign(kernels_.size(), 0);
    char* skip = skip_heap.empty() ? skip_local : skip_heap.data();
    for (const PreparedRun::Step& st : p.steps) {
      if (st.gemm >= 0) {
        size_t gi = static_cast<size_t>(st.gemm);
        if (done[gi]) continue;
        int partner = pairs ? pair_of_[gi] : -1;
        const PairGate* gate = partner >= 0 && pair_gate_[gi].kernel >= 0 ? &pair_gate_[gi] : nullptr;
        bool folded = false;
        if (partner >= 0 && launch_gemm_pair(gemms_[gi], gemms_[static_cast<size_t>(partner)], p.env, swapped,
                                             p.input_strides, options, gate, &folded)) {
          done[static_cast<size_t>(partner)] = 1;
          if (options.gemm_merged) ++*options.gemm_merged;
          if (folded) {
            skip[static_cast<size_t>(gate->kernel)] = 1;
            if (options.kernels_folded) ++*options.kernels_folded;
          }
          continue;
        }
        launch_gemm(gemms_[gi], p.env, run_ptrs, p.input_strides, options);
        continue;
      }
      if (st.empty || skip[static_cast<size_t>(st.kernel)]) continue;
      // A gate kernel whose product the next GEMM can read in its place: that
      // GEMM runs now, and this kernel not at all.
      if (const int gg = gate_gemm_of_[static_cast<size_t>(st.kernel)];
          gg >= 0 && launch_gated_gemm(gemms_[static_cast<size_t>(gg)], p.env, run_ptrs, p.input_strides, options)) {
        done[static_cast<size_t>(gg)] = 1;
        if (options.kernels_folded) ++*options.kernels_folded;
        continue;
      }
      int64_t* args = local;
      if (st.args.size() > 64) {
        heap.assign(st.args.size(), 0);
        args = heap.data();
      }
      std::copy(st.args.begin(), st.args.end(), args);
      for (size_t a = 0; a < st.n_ptrs; ++a)
        args[a] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(run_ptrs[static_cast<size_t>(st.ptr_buffers[a])]));
      // The vector twin only when every vector access is aligned for every lane group.
      bool vec = st.vec_possible;
      for (size_t a = 0; a < st.vec_align.size() && vec; ++a)
        vec = reinterpret_cast<uintptr_t>(run_ptrs[static_cast<size_t>(st.vec_align[a].first)]) % st.vec_align[a].second == 0;
      if (vec && st.group_arg >= 0) {
        // Row groups without the zeroed workspace (a caller that passes
        // none) take the scalar twin, whose blocks do not wait for each other.
        if (options.zeroed_workspace && options.zeroed_workspace_bytes >= kZeroedWorkspaceBytes)
          args[st.group_arg] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(options.zeroed_workspace) + kDecodeRegionBytes);
        else
          vec = false;
      }
      if (vec ? st.vec_too_many_rows : st.too_many_rows)
        throw std::runtime_error("opfuse: too many rows for a cluster row kernel");
      size_t k = static_cast<size_t>(st.kernel);
      void* params[] = {args};
      // v.launches[k].pdl: the kernel waits for the one before it (sm_90 unless OPFUSE_PDL=0).
      launch_1d(vec ? v.cu_vector[k] : v.cu_scalar[k], vec ? st.vec_grid : st.grid, vec ? st.vec_threads : st.threads,
                vec ? st.vec_smem : 0, options.stream, params, v.launches[k].pdl, "cuLaunchKernel");
    }
    return;
  }
  // The buffers this run writes, before anything touches them: huge pages
  // for the large ones (see huge_pages.h).
  if (!p.huge_pages.empty() && huge_pages_enabled())
    for (const auto& [b, bytes] : p.huge_pages)
      advise_huge_pages(ptrs[static_cast<size_t>(b)], bytes);
  void* local[32];
  std::vector<void*> heap;
  for (const PreparedRun::Step& st : p.steps) {
    if (st.gemm >= 0) {
      if (!options.cpu_gemm)
        throw std::runtime_error("this graph has a GEMM, which on the CPU needs a matmul provider (RunOptions::cpu_gemm)");
      if (int e = v.take_error()) {  // a division by zero before the GEMM
        (void)e;
        throw std::domain_error("ZeroDivisionError");
      }
      options.cpu_gemm(st.gemm);
      continue;
    }
    void** bufs = local;
    if (st.n_ptrs > 32) {
      heap.resize(st.n_ptrs);
      bufs = heap.data();
    }
    for (size_t a = 0; a < st.n_ptrs; ++a) bufs[a] = ptrs[static_cast<size_t>(st.ptr_buffers[a])];
    v.fns[static_cast<size_t>(st.kernel)](bufs, st.args.data(), st.strides.data());
  }
  if (int e = v.take_error()) {
    (void)e;
    throw std::domain_error("ZeroDivisionError");
  }
}

}  // namespace opfuse

namespace opfuse {

std::string CompiledGraph::cuda_source_for(const std::vector<StrideSignature>& sigs, std::vector<CudaLaunch>* launches,
                                           int arch) const {
  std::string src = cuda_prelude();
  src += "\n";
  for (size_t i = 0; i < kernels_.size(); ++i) {
    CudaEmitter e(arch);
    src += e.emit(kernels_[i], sigs[i]) + "\n";
    if (launches) launches->push_back(e.launch());
  }
  return src;
}

std::string CompiledGraph::cuda_source(const std::vector<std::vector<int64_t>>& shapes,
                                       const std::vector<std::vector<int64_t>>& strides, int arch) const {
  std::vector<StrideSignature> sigs;
  signature(shapes, strides, &sigs);
  return cuda_source_for(sigs, nullptr, arch);
}

NvrtcOutput CompiledGraph::compile_cuda(const std::vector<std::vector<int64_t>>& shapes,
                                        const std::vector<std::vector<int64_t>>& strides, int arch, bool want_ptx) const {
  return nvrtc_compile(cuda_source(shapes, strides, arch), "opfuse_graph.cu", arch, false, want_ptx);
}

void CompiledGraph::build_cuda_variant(Variant& v, const std::vector<StrideSignature>& sigs, bool* cache_hit) {
  int arch = current_device_arch();
  v.source = cuda_source_for(sigs, &v.launches, arch);
  const NvrtcApi& n = nvrtc();
  if (!n.loaded) throw std::runtime_error("NVRTC not available: " + n.error);
  std::string entry = content_hash(v.source + "\nsm_" + std::to_string(arch) + "\nnvrtc " + std::to_string(n.major) + "." +
                                   std::to_string(n.minor));
  CacheLookup found = cache_get_or_build("cuda", entry, ".cubin", [&](const std::string& out) {
    NvrtcOutput o = nvrtc_compile(v.source, "opfuse_graph.cu", arch);
    write_file_atomic(out, o.cubin);
  });
  if (cache_hit) *cache_hit = found.hit;
  bool ok = false;
  std::string cubin = read_file(found.path, &ok);
  const CudaApi& c = cuda();
  if (!ok || c.ModuleLoadData(&v.module, cubin.data()) != 0) {
    // A cached cubin the driver refuses: rebuild once.
    cache_evict(found.path);
    found = cache_get_or_build("cuda", entry, ".cubin", [&](const std::string& out) {
      write_file_atomic(out, nvrtc_compile(v.source, "opfuse_graph.cu", arch).cubin);
    });
    cubin = read_file(found.path, &ok);
    check_cuda(c.ModuleLoadData(&v.module, cubin.data()), "cuModuleLoadData");
  }
  // OPFUSE_ROW_CARVEOUT=<percent> (an experiment): the shared-memory share
  // of the unified L1 the driver should pick for the staged row kernels, so
  // fewer blocks an SM leave L1 room for what every row re-reads (layer_norm's
  // weight and bias: 128 KB at 32768 16-bit columns). Read at each module
  // load, so a process can vary it.
  constexpr int kAttrPreferredCarveout = 9;  // CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
  const char* carveout_env = std::getenv("OPFUSE_ROW_CARVEOUT");
  const int carveout = carveout_env && *carveout_env ? std::atoi(carveout_env) : -1;
  for (auto& l : v.launches) {
    CUfunction f = nullptr, fv = nullptr;
    check_cuda(c.ModuleGetFunction(&f, v.module, l.name.c_str()), "cuModuleGetFunction");
    if (!l.vec_name.empty()) check_cuda(c.ModuleGetFunction(&fv, v.module, l.vec_name.c_str()), "cuModuleGetFunction");
    // Past 48 KB a kernel must opt into its dynamic shared memory.
    constexpr int kAttrMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if (fv && l.vec_smem > 0)
      check_cuda(c.FuncSetAttribute(fv, kAttrMaxDynamicSharedBytes, l.vec_smem), "cuFuncSetAttribute(max dynamic shared memory)");
    // Clusters of more than 8 blocks (staged rows with OPFUSE_ROW_SMEM_CLUSTER=16,
    // an experiment) are non-portable: the kernel must opt in before the
    // occupancy query and the launch.
    constexpr int kAttrNonPortableClusterSizeAllowed = 14;  // CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    if (fv && l.vec_cluster > 8 && !l.vec_group_exchange)
      check_cuda(c.FuncSetAttribute(fv, kAttrNonPortableClusterSizeAllowed, 1), "cuFuncSetAttribute(non-portable cluster size)");
    if (fv && l.vec_smem > 0 && carveout >= 0 && carveout <= 100)
      check_cuda(c.FuncSetAttribute(fv, kAttrPreferredCarveout, carveout), "cuFuncSetAttribute(preferred carveout)");
    v.cu_scalar.push_back(f);
    v.cu_vector.push_back(fv);
    if (fv && l.vec_ring && l.vec_group_exchange) {
      // Groups of vec_cluster blocks that are not clusters: as many whole
      // groups as the device holds blocks at once (every block of a group
      // must be resident while the others wait for it), at most the
      // kernel's counters.
      int groups = std::min(resident_groups(fv, l.vec_threads, l.vec_smem, 1) / l.vec_cluster, kRowGroupsMax);
      if (groups < 1)
        throw std::runtime_error("opfuse: the device holds fewer than " + std::to_string(l.vec_cluster) +
                                 " blocks of " + l.vec_name + " at once (OPFUSE_ROW_GROUP_EXCHANGE)");
      v.ring_groups.push_back(groups);
    } else {
      v.ring_groups.push_back(fv && l.vec_ring ? resident_groups(fv, l.vec_threads, l.vec_smem, l.vec_cluster) : 0);
    }
  }
}

void CompiledGraph::prepare_cuda_kernel(const Variant& v, size_t i, const std::vector<int64_t>& symbol_values,
                                        const SymbolEnv& env, const std::vector<std::vector<int64_t>>& input_strides,
                                        PreparedRun::Step* st) const {
  const Launch& l = launches_[i];
  const CudaLaunch& cl = v.launches[i];
  const KernelIR& k = kernels_[i];
  st->kernel = static_cast<int>(i);
  st->ptr_buffers = l.buffers;
  st->n_ptrs = l.buffers.size();
  std::vector<int64_t>& args = st->args;
  args.assign(l.buffers.size(), 0);  // pointer slots, filled per run
  for (int s : l.symbols) args.push_back(symbol_values[static_cast<size_t>(s)]);
  if (l.symbols.empty()) args.push_back(0);
  size_t nst = 0;
  for (int b : l.strided_inputs) {
    auto& sv = input_strides.at(static_cast<size_t>(b));
    args.insert(args.end(), sv.begin(), sv.end());
    nst += sv.size();
  }
  if (nst == 0) args.push_back(0);
  // What the vector twin needs of sizes and strides; pointer alignment is left to each run.
  bool vec_ok = v.cu_vector[i] != nullptr && !k.domain.empty() && evaluate(k.domain.back(), env) % cl.vec == 0;
  for (const Expr& off : cl.vec_offsets)  // a slice's or cat's shift in elements, at these sizes
    vec_ok = vec_ok && evaluate(off, env) % cl.vec == 0;
  for (int kb : cl.vec_buffers) {
    if (!vec_ok) break;
    const KBuffer& buf = k.buffers[static_cast<size_t>(kb)];
    int buffer = l.buffers[static_cast<size_t>(kb)];
    st->vec_align.emplace_back(buffer, static_cast<uintptr_t>(cl.vec) * static_cast<uintptr_t>(dtype_size(buf.dtype)));
    if (buf.strided) {
      auto& sv = input_strides.at(static_cast<size_t>(buffer));
      for (size_t d = 0; d + 1 < sv.size() && vec_ok; ++d) vec_ok = sv[d] % cl.vec == 0;
    } else if (!buf.shape.empty()) {
      vec_ok = evaluate(buf.shape.back(), env) % cl.vec == 0;
    }
  }
  st->vec_possible = vec_ok;
  if (vec_ok && cl.vec_group_exchange) {  // the workspace pointer, after the strides (the kernel's args struct)
    st->group_arg = static_cast<int>(args.size());
    args.push_back(0);
  }
  st->threads = static_cast<unsigned>(cl.threads);
  st->vec_smem = static_cast<unsigned>(cl.vec_smem);
  if (!cl.row) {
    int64_t n = evaluate(cl.numel, env);
    st->empty = n == 0;
    auto blocks = [&](int vec) {
      int64_t per_block = static_cast<int64_t>(cl.threads) * vec;
      return static_cast<unsigned>(std::min<int64_t>((n + per_block - 1) / per_block, 1 << 30));
    };
    st->grid = blocks(1);
    st->vec_grid = blocks(cl.vec);
    st->vec_threads = st->threads;
  } else {
    int64_t rows = evaluate(cl.rows, env);
    st->empty = rows == 0;
    st->vec_threads = static_cast<unsigned>(cl.vec_threads);
    auto blocks = [&](int rpb, int cluster, bool* too_many) {
      *too_many = false;
      if (cl.parts > 0) {
        // Column partials: block b (with its rpb row groups) owns parts
        // [b * rpb, (b + 1) * rpb) and steps through the rows modulo parts.
        return static_cast<unsigned>(cl.parts / rpb);
      }
      if (cluster > 1) {
        // Exactly one cluster per row (per 32 outputs of a column reduction): the kernel has no loop over rows.
        int64_t b = (rows + rpb - 1) / rpb * cluster;
        *too_many = b > (int64_t{1} << 31) - 1;
        return static_cast<unsigned>(*too_many ? 0 : b);
      }
      return static_cast<unsigned>(std::min<int64_t>((rows + rpb - 1) / rpb, 1 << 30));
    };
    st->grid = blocks(cl.rows_per_block, cl.cluster, &st->too_many_rows);
    if (st->vec_possible && cl.vec_ring) {
      // Persistent row groups (the staged ring; lane groups that loop over
      // rows), each stepping through row steps g, g + G, ... of
      // vec_rows_per_block rows. For lane groups G is evened out (at most
      // the blocks the device holds) so that every block takes the same
      // number of steps: 8192 steps on 528 resident blocks would leave half
      // of them a sixteenth step the others do not take. (The ring keeps
      // every resident group, as measured.)
      int64_t steps = std::max<int64_t>(1, (rows + cl.vec_rows_per_block - 1) / std::max(1, cl.vec_rows_per_block));
      int64_t groups = std::min<int64_t>(steps, std::max(1, v.ring_groups.at(i)));
      if (cl.vec_rows_per_block > 1) groups = (steps + (steps + groups - 1) / groups - 1) / ((steps + groups - 1) / groups);
      st->vec_grid = static_cast<unsigned>(groups * cl.vec_cluster);
    } else if (st->vec_possible) {
      st->vec_grid = blocks(cl.vec_rows_per_block, cl.vec_cluster, &st->vec_too_many_rows);
    }
  }
}

}  // namespace opfuse
