// Code generation: the kernel IR (KernelIR::to_string()) and the CPU source
// (CpuEmitter) of the seed chain and of softmax against golden files under
// tests/cpp/golden/codegen/ (OPFUSE_UPDATE_GOLDEN=1 rewrites them), and whole
// graphs compiled by the host compiler and run on raw float buffers, with
// strided, broadcast and offset inputs, checked against the oracle.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "codegen/cpu_emitter.h"
#include "codegen/lower.h"
#include "fusion/plan.h"
#include "ir/evaluate.h"
#include "ir/graph.h"
#include "runtime/compiled_graph.h"
#include "test_graphs.h"

namespace opfuse::golden {
// Defined in test_planner.cpp.
::testing::AssertionResult matches_golden(const std::string& name, const std::string& actual);
}  // namespace opfuse::golden

namespace opfuse {
namespace {

using golden::matches_golden;

using testgraphs::kChain;
using testgraphs::kSoftmax;

// The only kernel of a one-kernel graph, lowered under a fixed name.
KernelIR only_kernel(const char* text, const char* name) {
  Graph g = parse_graph(text);
  verify(g);
  FusionPlan p = plan_fusion(g);
  EXPECT_EQ(p.kernels.size(), 1u);
  return lower_kernel(p, p.kernels.at(0), name);
}

TEST(Codegen, ChainKernelIR) {
  KernelIR k = only_kernel(kChain, "opfuse_chain");
  EXPECT_FALSE(k.row);
  ASSERT_EQ(k.stages.size(), 1u);
  ASSERT_EQ(k.buffers.size(), 4u);  // x, b1, b2 in; y out
  EXPECT_TRUE(k.buffers[0].strided && k.buffers[1].strided && k.buffers[2].strided);
  EXPECT_TRUE(k.buffers[3].written && !k.buffers[3].strided);
  EXPECT_EQ(k.symbols, std::vector<std::string>{"s0"});
  EXPECT_TRUE(matches_golden("codegen/chain.kir.txt", k.to_string()));
}

TEST(Codegen, ChainCpuSource) {
  KernelIR k = only_kernel(kChain, "opfuse_chain");
  // Contiguous x (row stride at run time, unit inner stride) and unit-stride biases.
  std::string contiguous = CpuEmitter().emit(k, StrideSignature{{"x1", "1", "1"}});
  EXPECT_NE(contiguous.find("extern \"C\" void opfuse_chain("), std::string::npos);
  EXPECT_NE(contiguous.find("#pragma omp simd"), std::string::npos);
  EXPECT_TRUE(matches_golden("codegen/chain.contiguous.cpu.txt", contiguous));
  // Transposed x (unit stride on the outer dim) and a broadcast (stride 0) b1:
  // a different specialisation.
  std::string strided = CpuEmitter().emit(k, StrideSignature{{"1x", "0", "1"}});
  EXPECT_NE(strided, contiguous);
  EXPECT_TRUE(matches_golden("codegen/chain.strided.cpu.txt", strided));
}

TEST(Codegen, SoftmaxKernelIR) {
  KernelIR k = only_kernel(kSoftmax, "opfuse_softmax");
  EXPECT_TRUE(k.row);
  EXPECT_EQ(k.reduce_axes, std::vector<int64_t>{1});
  // amax, then sum (which needs the max), then the stores: three stages.
  ASSERT_EQ(k.stages.size(), 3u);
  EXPECT_EQ(k.stages[0].accs.size(), 1u);
  EXPECT_EQ(k.stages[0].accs[0].combiner, "max");
  EXPECT_EQ(k.stages[1].accs.size(), 1u);
  EXPECT_EQ(k.stages[1].accs[0].combiner, "sum");
  EXPECT_TRUE(matches_golden("codegen/softmax.kir.txt", k.to_string()));
}

TEST(Codegen, SoftmaxCpuSource) {
  KernelIR k = only_kernel(kSoftmax, "opfuse_softmax");
  std::string src = CpuEmitter().emit(k, StrideSignature{{"x1"}});
  EXPECT_NE(src.find("#pragma omp parallel for"), std::string::npos);
  EXPECT_TRUE(matches_golden("codegen/softmax.cpu.txt", src));
}

// ---------------------------------------------------------------------------
// Compiled and run.

class CompiledGraphRun : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // A private kernel cache unless the caller chose one.
    const char* d = std::getenv("OPFUSE_CACHE_DIR");
    if (!d || !*d) {
      char tmpl[] = "/tmp/opfuse-cpp-tests-XXXXXX";
      ASSERT_NE(mkdtemp(tmpl), nullptr);
      setenv("OPFUSE_CACHE_DIR", tmpl, 1);
      private_cache() = tmpl;
    }
  }
  static void TearDownTestSuite() {
    if (private_cache().empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(private_cache(), ec);
    unsetenv("OPFUSE_CACHE_DIR");
    private_cache().clear();
  }
  static std::string& private_cache() {
    static std::string dir;
    return dir;
  }
};

// One input as the kernels see it: a base pointer, strides, and its logical
// (contiguous) values for the oracle.
struct Input {
  std::vector<float> storage;
  int64_t offset = 0;
  std::vector<int64_t> shape, strides;
  HostTensor logical;
};

// Random values of `shape`, stored through `strides` from `offset` in a
// buffer large enough for them.
Input make_input(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, int64_t offset, std::mt19937& rng) {
  Input in;
  in.shape = shape;
  in.strides = strides;
  in.offset = offset;
  int64_t extent = offset + 1, n = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    extent += (shape[d] - 1) * strides[d];
    n *= shape[d];
  }
  // No elements: no storage, so the kernels get a null pointer for it.
  if (n > 0) in.storage.assign(static_cast<size_t>(extent), NAN);
  std::normal_distribution<float> dist(0.f, 1.f);
  in.logical.dtype = DType::Float32;
  in.logical.shape = shape;
  in.logical.data.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, pos = offset;
    for (size_t d = shape.size(); d-- > 0;) {
      pos += (rem % shape[d]) * strides[d];
      rem /= shape[d];
    }
    // A broadcast (stride 0) element is written more than once: keep the first value.
    float& slot = in.storage[static_cast<size_t>(pos)];
    if (std::isnan(slot)) slot = dist(rng);
    in.logical.data[static_cast<size_t>(i)] = slot;
  }
  return in;
}

// Compiles `text`, runs it on `inputs` and compares every output with evaluate().
void run_and_check(CompiledGraph& cg, const Graph& g, std::vector<Input>& inputs, size_t expect_kernels) {
  ASSERT_EQ(cg.kernels().size(), expect_kernels);
  std::vector<std::vector<int64_t>> shapes, strides;
  for (auto& in : inputs) {
    shapes.push_back(in.shape);
    strides.push_back(in.strides);
  }
  std::vector<int64_t> syms = cg.bind(shapes);
  bool compiled = false, hit = false;
  int v = cg.variant(shapes, strides, &compiled, &hit);
  std::vector<std::vector<float>> stored;
  std::vector<void*> ptrs;
  for (size_t b = 0; b < cg.buffers().size(); ++b) {
    if (cg.buffers()[b].is_input) {
      ptrs.push_back(inputs[b].storage.empty() ? nullptr : inputs[b].storage.data() + inputs[b].offset);
      continue;
    }
    ASSERT_EQ(cg.buffers()[b].dtype, DType::Float32);
    int64_t n = 1;
    for (int64_t s : cg.buffer_shape(static_cast<int>(b), syms)) n *= s;
    stored.emplace_back(static_cast<size_t>(n), NAN);  // an unwritten element shows as NaN
  }
  size_t k = 0;
  for (size_t b = 0; b < cg.buffers().size(); ++b)
    if (!cg.buffers()[b].is_input) ptrs.push_back(stored[k++].data());
  cg.run(v, syms, ptrs, strides);

  std::vector<HostTensor> logical;
  for (auto& in : inputs) logical.push_back(in.logical);
  std::vector<HostTensor> want = evaluate(g, logical);
  ASSERT_EQ(want.size(), cg.output_buffers().size());
  const size_t n_in = inputs.size();
  for (size_t o = 0; o < want.size(); ++o) {
    const std::vector<float>& got = stored[static_cast<size_t>(cg.output_buffers()[o]) - n_in];
    ASSERT_EQ(got.size(), want[o].data.size()) << "output " << o;
    for (size_t i = 0; i < got.size(); ++i) {
      double w = want[o].data[i];
      ASSERT_NEAR(got[i], w, 1e-5 + 1e-5 * std::fabs(w)) << "output " << o << " element " << i;
    }
  }
}

// Cat parts and a slice_scatter source whose sizes are symbolic: x, y[2:]
// (s1 - 2 rows) and y again along dim 0, and y written into z at rows
// [1, s1 + 1). At sizes where a part is empty, for_sizes() gives the graph
// with that size fixed, which reads nothing of the part (its pointer is null).
const char* kCatParts = R"(graph {
  %0 = input() {name="x"} : f32[s0, 5]
  %1 = input() {name="y"} : f32[s1, 5]
  %2 = slice(%1) {dim=0, start=2, end=<s1>, inbounds=1} : f32[s1 + -2, 5]
  %3 = cat(%0, %2, %1) {dim=0} : f32[s0 + 2*s1 + -2, 5]
  %4 = exp(%3) : f32[s0 + 2*s1 + -2, 5]
  %5 = input() {name="z"} : f32[s1 + s2, 5]
  %6 = slice_scatter(%5, %1) {dim=0, start=1, end=<s1 + 1>, inbounds=1} : f32[s1 + s2, 5]
  return (%4, %6)
})";

TEST_F(CompiledGraphRun, EmptyCatPartsRunOnTheGraphWithTheirSizeFixed) {
  Graph g = parse_graph(kCatParts);
  CompiledGraph cg(g, CompileOptions{});
  std::mt19937 rng(11);
  auto inputs_for = [&](int64_t x_rows, int64_t y_rows, int64_t z_rows) {
    std::vector<Input> in;
    in.push_back(make_input({x_rows, 5}, {5, 1}, 0, rng));
    in.push_back(make_input({y_rows, 5}, {1, y_rows}, 3, rng));  // y transposed, at an offset
    in.push_back(make_input({z_rows, 5}, {5, 1}, 0, rng));
    return in;
  };
  auto shapes_of = [](const std::vector<Input>& in) {
    std::vector<std::vector<int64_t>> s;
    for (auto& i : in) s.push_back(i.shape);
    return s;
  };
  // Nothing empty: the graph itself.
  std::vector<Input> full = inputs_for(3, 4, 6);
  EXPECT_EQ(&cg.for_sizes(shapes_of(full)), &cg);
  run_and_check(cg, g, full, 2);
  // (x rows, y rows, z rows) and the symbols fixed: y[2:] empty (s1 = 2), x
  // empty (s0 = 0), both. (y itself cannot be empty here: y[2:] needs s1 >= 2.)
  struct Case {
    int64_t x, y, z;
    std::map<std::string, int64_t> fixed;
  };
  for (const Case& c : {Case{3, 2, 5, {{"s1", 2}}}, Case{0, 4, 6, {{"s0", 0}}}, Case{0, 2, 3, {{"s0", 0}, {"s1", 2}}}}) {
    SCOPED_TRACE("x=" + std::to_string(c.x) + " y=" + std::to_string(c.y));
    std::vector<Input> in = inputs_for(c.x, c.y, c.z);
    EXPECT_THROW(cg.bind(shapes_of(in)), GraphError);
    EXPECT_EQ(cg.empty_part_symbols(shapes_of(in)), c.fixed);
    CompiledGraph& fixed = cg.for_sizes(shapes_of(in));
    EXPECT_NE(&fixed, &cg);
    EXPECT_EQ(&cg.for_sizes(shapes_of(in)), &fixed);  // kept
    EXPECT_EQ(&fixed.for_sizes(shapes_of(in)), &fixed);
    run_and_check(fixed, g, in, 2);
  }
  // z too short for the rows y is written to ([1, 3) of 2): an error, not a write past z.
  std::vector<Input> short_z = inputs_for(1, 2, 2);
  EXPECT_THROW(cg.for_sizes(shapes_of(short_z)).bind(shapes_of(short_z)), GraphError);
}

// The chain, a softmax of it, and a layer_norm with its mean: several kernels
// and outputs, on a transposed x, a broadcast b2 and an offset weight.
const char* kMixed = R"(graph {
  %0 = input() {name="x"} : f32[s0, 37]
  %1 = input() {name="b1"} : f32[37]
  %2 = input() {name="b2"} : f32[37]
  %3 = input() {name="w"} : f32[37]
  %4 = add(%0, %1) : f32[s0, 37]
  %5 = relu(%4) : f32[s0, 37]
  %6 = scalar() {value=0.5, weak=true} : f64[]
  %7 = mul(%5, %6) : f32[s0, 37]
  %8 = add(%7, %2) : f32[s0, 37]
  %9 = softmax(%8) {dim=-1} : f32[s0, 37]
  %10 = layer_norm(%0, %3) {eps=1e-05, normalized_ndim=1} : f32[s0, 37]
  %11 = layer_norm_stats(%0) {eps=1e-05, normalized_ndim=1, which="mean"} : f32[s0, 1]
  %12 = sum(%0) {dims=[0], keepdim=false} : f32[37]
  return (%8, %9, %10, %11, %12)
})";

TEST_F(CompiledGraphRun, MixedGraphOnStridedBroadcastAndOffsetInputs) {
  Graph g = parse_graph(kMixed);
  CompiledGraph cg(g, CompileOptions{});
  std::mt19937 rng(7);
  for (int64_t rows : {13, 1, 70}) {  // one variant serves every size
    SCOPED_TRACE("rows=" + std::to_string(rows));
    std::vector<Input> inputs;
    inputs.push_back(make_input({rows, 37}, {1, rows}, 0, rng));  // x transposed
    inputs.push_back(make_input({37}, {1}, 0, rng));
    inputs.push_back(make_input({37}, {0}, 0, rng));              // b2 broadcast from one value
    inputs.push_back(make_input({37}, {1}, 5, rng));              // w at a storage offset
    // Two kernels: the row kernel over dim 1 (chain, softmax, layer_norm)
    // and the column sum over dim 0.
    run_and_check(cg, g, inputs, 2);
  }
}

TEST_F(CompiledGraphRun, SplitPlanPassesTheReductionThroughMemory) {
  // The reduction needed through a transpose: two kernels and an intermediate buffer.
  const char* text = R"(graph {
  %0 = input() {name="x"} : f32[s0, s0]
  %1 = sum(%0) {dims=[1], keepdim=true} : f32[s0, 1]
  %2 = sub(%0, %1) : f32[s0, s0]
  %3 = permute(%2) {dims=[1, 0]} : f32[s0, s0]
  %4 = mul(%3, %0) : f32[s0, s0]
  return (%4)
})";
  Graph g = parse_graph(text);
  CompiledGraph cg(g, CompileOptions{});
  std::mt19937 rng(11);
  std::vector<Input> inputs;
  inputs.push_back(make_input({9, 9}, {9, 1}, 0, rng));
  run_and_check(cg, g, inputs, 2);
}

TEST_F(CompiledGraphRun, UnfusedPlanGivesTheSameValues) {
  Graph g = parse_graph(kMixed);
  CompileOptions opt;
  opt.planner.fuse = false;
  CompiledGraph cg(g, opt);
  std::mt19937 rng(3);
  std::vector<Input> inputs;
  inputs.push_back(make_input({6, 37}, {37, 1}, 0, rng));
  inputs.push_back(make_input({37}, {1}, 0, rng));
  inputs.push_back(make_input({37}, {1}, 0, rng));
  inputs.push_back(make_input({37}, {1}, 0, rng));
  // One per realized node: the chain's output, softmax's amax, sum and div,
  // layer_norm's two means (the first one shared with the stats output) and
  // its output, and the column sum.
  run_and_check(cg, g, inputs, 8);
}

}  // namespace
}  // namespace opfuse
