// Planner decisions: exact kernel counts, and each plan's text (the graph
// after the passes, then FusionPlan::to_string()) against a golden file under
// tests/cpp/golden/planner/. OPFUSE_UPDATE_GOLDEN=1 rewrites the goldens
// (then review the diff).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "codegen/lower.h"
#include "fusion/plan.h"
#include "ir/graph.h"
#include "ir/ops.h"
#include "test_graphs.h"

namespace opfuse::golden {

// Shared with test_codegen.cpp.
::testing::AssertionResult matches_golden(const std::string& name, const std::string& actual) {
  const std::filesystem::path path = std::filesystem::path(OPFUSE_TEST_DATA) / name;
  const char* update = std::getenv("OPFUSE_UPDATE_GOLDEN");
  if (update && std::string(update) == "1") {
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path, std::ios::binary) << actual;
    return ::testing::AssertionSuccess() << "rewrote " << path;
  }
  std::ifstream f(path, std::ios::binary);
  if (!f)
    return ::testing::AssertionFailure() << "missing golden file " << path
                                         << " (OPFUSE_UPDATE_GOLDEN=1 writes it); actual:\n" << actual;
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string expected = ss.str();
  if (expected == actual) return ::testing::AssertionSuccess();
  std::istringstream e(expected), a(actual);
  std::string le, la;
  int line = 1;
  while (true) {
    bool he = static_cast<bool>(std::getline(e, le)), ha = static_cast<bool>(std::getline(a, la));
    if (!he && !ha) break;
    if (!he || !ha || le != la) {
      return ::testing::AssertionFailure() << path << " differs at line " << line << ":\n  expected: "
                                           << (he ? le : "<end of file>") << "\n  actual:   " << (ha ? la : "<end of text>")
                                           << "\n(OPFUSE_UPDATE_GOLDEN=1 rewrites it) actual text:\n" << actual;
    }
    ++line;
  }
  return ::testing::AssertionFailure() << path << " differs in line endings";
}

}  // namespace opfuse::golden

namespace opfuse {
namespace {

using golden::matches_golden;

FusionPlan plan(const std::string& text, bool fuse = true) {
  Graph g = parse_graph(text);
  verify(g);
  PlannerOptions opt;
  opt.fuse = fuse;
  return plan_fusion(g, opt);
}

std::string plan_text(const FusionPlan& p) {
  return "# graph after the passes\n" + print_graph(p.graph) + "# plan\n" + p.to_string();
}

// What every plan must satisfy, whatever the grouping.
::testing::AssertionResult well_formed(const FusionPlan& p) {
  const Graph& g = p.graph;
  std::set<int> outputs(g.outputs.begin(), g.outputs.end());
  std::vector<int> owner(g.nodes.size(), -1);
  for (size_t k = 0; k < p.kernels.size(); ++k) {
    const KernelGroup& kg = p.kernels[k];
    if (kg.roots.empty()) return ::testing::AssertionFailure() << "kernel " << k << " has no roots";
    for (int r : kg.roots) {
      if (owner[static_cast<size_t>(r)] >= 0) return ::testing::AssertionFailure() << "%" << r << " is in two kernels";
      owner[static_cast<size_t>(r)] = static_cast<int>(k);
      if (p.kernel_of[static_cast<size_t>(r)] != static_cast<int>(k))
        return ::testing::AssertionFailure() << "kernel_of[%" << r << "] is not " << k;
    }
    for (int s : kg.stores)
      if (std::find(kg.roots.begin(), kg.roots.end(), s) == kg.roots.end())
        return ::testing::AssertionFailure() << "kernel " << k << " stores %" << s << " that it does not compute";
    // Kernels come in dependency order: every read is an input or an earlier kernel's store.
    for (int r : kg.reads) {
      if (g.node(r).op == "input") continue;
      int kr = p.kernel_of[static_cast<size_t>(r)];
      if (kr < 0 || kr >= static_cast<int>(k))
        return ::testing::AssertionFailure() << "kernel " << k << " reads %" << r << " from kernel " << kr;
      const auto& st = p.kernels[static_cast<size_t>(kr)].stores;
      if (std::find(st.begin(), st.end(), r) == st.end())
        return ::testing::AssertionFailure() << "kernel " << kr << " does not store %" << r << " that kernel " << k << " reads";
    }
  }
  for (const Node& n : g.nodes) {
    bool realized = outputs.count(n.id) || op_def(n).kind == OpKind::Reduction;
    if (n.op == "input" || !realized) continue;
    if (owner[static_cast<size_t>(n.id)] < 0) return ::testing::AssertionFailure() << "realized %" << n.id << " has no kernel";
  }
  for (int o : g.outputs) {
    if (g.node(o).op == "input") continue;
    const auto& st = p.kernels[static_cast<size_t>(p.kernel_of[static_cast<size_t>(o)])].stores;
    if (std::find(st.begin(), st.end(), o) == st.end()) return ::testing::AssertionFailure() << "output %" << o << " is not stored";
  }
  return ::testing::AssertionSuccess();
}

size_t count_kind(const FusionPlan& p, KernelGroup::Kind kind) {
  size_t n = 0;
  for (auto& k : p.kernels) n += k.kind == kind;
  return n;
}

// ---------------------------------------------------------------------------
// The graphs.

using testgraphs::kChain;  // the seed's chain
using testgraphs::kSoftmax;

// What the frontend sees when PyTorch has already decomposed softmax.
const char* kSoftmaxByHand = R"(graph {
  %0 = input() {name="x"} : f32[s0, 37]
  %1 = amax(%0) {dims=[1], keepdim=true} : f32[s0, 1]
  %2 = sub(%0, %1) : f32[s0, 37]
  %3 = exp(%2) : f32[s0, 37]
  %4 = sum(%3) {dims=[1], keepdim=true} : f32[s0, 1]
  %5 = div(%3, %4) : f32[s0, 37]
  return (%5)
})";

const char* kLogSoftmaxF16 = R"(graph {
  %0 = input() {name="x"} : f16[s0, 5, 37]
  %1 = log_softmax(%0) {dim=1} : f16[s0, 5, 37]
  return (%1)
})";

// layer_norm with the mean and rstd its backward needs: one kernel, three outputs.
const char* kLayerNormWithStats = R"(graph {
  %0 = input() {name="x"} : f32[s0, 37]
  %1 = input() {name="w"} : f32[37]
  %2 = input() {name="b"} : f32[37]
  %3 = layer_norm(%0, %1, %2) {eps=1e-05, normalized_ndim=1} : f32[s0, 37]
  %4 = layer_norm_stats(%0) {eps=1e-05, normalized_ndim=1, which="mean"} : f32[s0, 1]
  %5 = layer_norm_stats(%0) {eps=1e-05, normalized_ndim=1, which="rstd"} : f32[s0, 1]
  return (%3, %4, %5)
})";

const char* kLayerNormByHand = R"(graph {
  %0 = input() {name="x"} : f32[s0, 37]
  %1 = input() {name="w"} : f32[37]
  %2 = input() {name="b"} : f32[37]
  %3 = mean(%0) {dims=[1], keepdim=true} : f32[s0, 1]
  %4 = sub(%0, %3) : f32[s0, 37]
  %5 = mul(%4, %4) : f32[s0, 37]
  %6 = mean(%5) {dims=[1], keepdim=true} : f32[s0, 1]
  %7 = scalar() {value=1e-05, weak=true} : f64[]
  %8 = add(%6, %7) : f32[s0, 1]
  %9 = rsqrt(%8) : f32[s0, 1]
  %10 = mul(%4, %9) : f32[s0, 37]
  %11 = mul(%10, %1) : f32[s0, 37]
  %12 = add(%11, %2) : f32[s0, 37]
  return (%12, %3, %9)
})";

const char* kRmsNormBf16 = R"(graph {
  %0 = input() {name="x"} : bf16[s0, 37]
  %1 = input() {name="w"} : bf16[37]
  %2 = rms_norm(%0, %1) {eps=1e-06, normalized_ndim=1} : bf16[s0, 37]
  return (%2)
})";

const char* kRmsNormByHand = R"(graph {
  %0 = input() {name="x"} : f32[s0, 37]
  %1 = input() {name="w"} : f32[37]
  %2 = mul(%0, %0) : f32[s0, 37]
  %3 = mean(%2) {dims=[1], keepdim=true} : f32[s0, 1]
  %4 = scalar() {value=1e-06, weak=true} : f64[]
  %5 = add(%3, %4) : f32[s0, 1]
  %6 = rsqrt(%5) : f32[s0, 1]
  %7 = mul(%0, %6) : f32[s0, 37]
  %8 = mul(%7, %1) : f32[s0, 37]
  return (%8)
})";

// A pointwise chain whose result feeds a softmax.
const char* kChainIntoSoftmax = R"(graph {
  %0 = input() {name="x"} : f32[s0, 37]
  %1 = input() {name="b"} : f32[37]
  %2 = add(%0, %1) : f32[s0, 37]
  %3 = gelu(%2) {approximate="tanh"} : f32[s0, 37]
  %4 = scalar() {value=0.125, weak=true} : f64[]
  %5 = mul(%3, %4) : f32[s0, 37]
  %6 = softmax(%5) {dim=-1} : f32[s0, 37]
  return (%6)
})";

const char* kTwoAxes = R"(graph {
  %0 = input() {name="x"} : f32[9, 37]
  %1 = sum(%0) {dims=[0], keepdim=false} : f32[37]
  %2 = sum(%0) {dims=[1], keepdim=false} : f32[9]
  return (%1, %2)
})";

// The row sums of x are needed through a transpose: the value at (i, j)
// needs the sum of row j. The shape is square, so the pointwise consumer has
// the same domain as the reduction; fusing them would read another row's
// sum, which lowering refuses (LoweringConflict), so the planner must split.
const char* kReductionThroughTranspose = R"(graph {
  %0 = input() {name="x"} : f32[7, 7]
  %1 = sum(%0) {dims=[1], keepdim=true} : f32[7, 1]
  %2 = sub(%0, %1) : f32[7, 7]
  %3 = permute(%2) {dims=[1, 0]} : f32[7, 7]
  %4 = mul(%3, %0) : f32[7, 7]
  return (%4)
})";

const char* kReductionThroughTransposeSymbolic = R"(graph {
  %0 = input() {name="x"} : f32[s0, s0]
  %1 = amax(%0) {dims=[1], keepdim=true} : f32[s0, 1]
  %2 = sub(%0, %1) : f32[s0, s0]
  %3 = permute(%2) {dims=[1, 0]} : f32[s0, s0]
  return (%3)
})";

// Siblings: two pointwise outputs and two row reductions of the same input.
const char* kSiblings = R"(graph {
  %0 = input() {name="x"} : f32[s0, 37]
  %1 = exp(%0) : f32[s0, 37]
  %2 = scalar() {value=2.0, weak=true} : f64[]
  %3 = mul(%0, %2) : f32[s0, 37]
  %4 = sum(%0) {dims=[1], keepdim=false} : f32[s0]
  %5 = amax(%0) {dims=[1], keepdim=false} : f32[s0]
  return (%1, %3, %4, %5)
})";

// An intermediate that is also an output is stored by the kernel that computes it.
const char* kIntermediateOutput = R"(graph {
  %0 = input() {name="x"} : f32[s0, 37]
  %1 = input() {name="b"} : f32[37]
  %2 = add(%0, %1) : f32[s0, 37]
  %3 = relu(%2) : f32[s0, 37]
  %4 = scalar() {value=2.0, weak=true} : f64[]
  %5 = mul(%3, %4) : f32[s0, 37]
  return (%3, %5)
})";

// ---------------------------------------------------------------------------

TEST(Planner, SeedChainIsOnePointwiseKernel) {
  FusionPlan p = plan(kChain);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 1u);
  EXPECT_EQ(p.kernels[0].kind, KernelGroup::Kind::Pointwise);
  EXPECT_EQ(p.kernels[0].stores.size(), 1u);  // nothing but y reaches memory
  EXPECT_EQ(p.kernels[0].reads.size(), 3u);
  EXPECT_TRUE(matches_golden("planner/chain.txt", plan_text(p)));
}

TEST(Planner, SoftmaxIsOneRowKernel) {
  FusionPlan p = plan(kSoftmax);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 1u);
  EXPECT_EQ(p.kernels[0].kind, KernelGroup::Kind::Row);
  EXPECT_EQ(p.kernels[0].reduce_axes, std::vector<int64_t>{1});
  EXPECT_EQ(p.kernels[0].stores.size(), 1u);  // the row max and sum stay in registers
  EXPECT_TRUE(matches_golden("planner/softmax.txt", plan_text(p)));
}

TEST(Planner, HandDecomposedSoftmaxPlansLikeTheCompositeOp) {
  FusionPlan composite = plan(kSoftmax), by_hand = plan(kSoftmaxByHand);
  EXPECT_TRUE(well_formed(by_hand));
  ASSERT_EQ(by_hand.kernels.size(), 1u);
  EXPECT_EQ(by_hand.to_string(), composite.to_string());
  EXPECT_EQ(print_graph(by_hand.graph), print_graph(composite.graph));
}

TEST(Planner, LogSoftmaxHalfOverAMiddleDimIsOneRowKernel) {
  FusionPlan p = plan(kLogSoftmaxF16);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 1u);
  EXPECT_EQ(p.kernels[0].reduce_axes, std::vector<int64_t>{1});
  EXPECT_TRUE(matches_golden("planner/log_softmax_f16.txt", plan_text(p)));
}

TEST(Planner, LayerNormWithItsStatsIsOneThreeOutputKernel) {
  FusionPlan p = plan(kLayerNormWithStats);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 1u);
  EXPECT_EQ(p.kernels[0].kind, KernelGroup::Kind::Row);
  EXPECT_EQ(p.kernels[0].stores.size(), 3u);  // y, mean and rstd
  // The stats were merged with the norm's own mean and rstd (CSE), not recomputed.
  size_t reductions = 0;
  for (const Node& n : p.graph.nodes) reductions += op_def(n).kind == OpKind::Reduction;
  EXPECT_EQ(reductions, 2u);
  EXPECT_TRUE(matches_golden("planner/layer_norm_with_stats.txt", plan_text(p)));
}

TEST(Planner, HandDecomposedLayerNormIsOneKernel) {
  FusionPlan p = plan(kLayerNormByHand);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 1u);
  EXPECT_EQ(p.kernels[0].stores.size(), 3u);
}

TEST(Planner, RmsNormBf16IsOneRowKernel) {
  FusionPlan p = plan(kRmsNormBf16);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 1u);
  EXPECT_EQ(p.kernels[0].kind, KernelGroup::Kind::Row);
  EXPECT_EQ(p.kernels[0].stores.size(), 1u);
  EXPECT_TRUE(matches_golden("planner/rms_norm_bf16.txt", plan_text(p)));
}

TEST(Planner, HandDecomposedRmsNormIsOneKernel) {
  FusionPlan p = plan(kRmsNormByHand);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 1u);
  EXPECT_EQ(p.kernels[0].kind, KernelGroup::Kind::Row);
}

TEST(Planner, ChainFeedingSoftmaxIsOneKernel) {
  FusionPlan p = plan(kChainIntoSoftmax);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 1u);
  EXPECT_EQ(p.kernels[0].stores.size(), 1u);
  EXPECT_TRUE(matches_golden("planner/chain_into_softmax.txt", plan_text(p)));
}

TEST(Planner, ReductionsOverDifferentAxesAreTwoKernels) {
  FusionPlan p = plan(kTwoAxes);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 2u);
  EXPECT_EQ(count_kind(p, KernelGroup::Kind::Row), 2u);
  EXPECT_NE(p.kernels[0].reduce_axes, p.kernels[1].reduce_axes);
  EXPECT_TRUE(matches_golden("planner/two_axes.txt", plan_text(p)));
}

TEST(Planner, ReductionNeededThroughATransposeIsNotFusedIntoItsRowKernel) {
  FusionPlan p = plan(kReductionThroughTranspose);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 2u);
  EXPECT_EQ(p.kernels[0].kind, KernelGroup::Kind::Row);
  EXPECT_EQ(p.kernels[1].kind, KernelGroup::Kind::Pointwise);
  EXPECT_TRUE(matches_golden("planner/reduction_through_transpose.txt", plan_text(p)));

  // The fusion it refused: both roots in the row kernel. Lowering must raise
  // LoweringConflict (and can_lower say no) rather than read the wrong row.
  FusionPlan forced = p;
  KernelGroup merged = p.kernels[0];
  for (int r : p.kernels[1].roots) {
    merged.roots.push_back(r);
    forced.kernel_of[static_cast<size_t>(r)] = 0;
  }
  merged.stores = {p.graph.outputs[0]};
  merged.reads = {p.graph.input_ids()[0]};
  EXPECT_FALSE(can_lower(forced, merged));
  EXPECT_THROW(lower_kernel(forced, merged, "forced"), LoweringConflict);
}

TEST(Planner, ReductionNeededThroughATransposeWithSymbolicSizesIsSplit) {
  FusionPlan p = plan(kReductionThroughTransposeSymbolic);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 2u);
}

TEST(Planner, SiblingOutputsFuseHorizontally) {
  FusionPlan p = plan(kSiblings);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 1u);  // one pass over x for all four
  EXPECT_EQ(p.kernels[0].stores.size(), 4u);
  EXPECT_TRUE(matches_golden("planner/siblings.txt", plan_text(p)));
}

TEST(Planner, IntermediateOutputIsStoredByTheKernelThatComputesIt) {
  FusionPlan p = plan(kIntermediateOutput);
  EXPECT_TRUE(well_formed(p));
  ASSERT_EQ(p.kernels.size(), 1u);
  EXPECT_EQ(p.kernels[0].stores.size(), 2u);
  EXPECT_TRUE(matches_golden("planner/intermediate_output.txt", plan_text(p)));
}

// fuse=false: one kernel per realized node (graph outputs and reductions).
TEST(Planner, FuseFalseGivesOneKernelPerRealizedNode) {
  struct Case {
    const char* name;
    const char* text;
    size_t kernels;
  };
  const Case cases[] = {
      {"chain", kChain, 1},                       // the output only
      {"softmax", kSoftmax, 3},                   // amax, sum, div
      {"layer_norm_with_stats", kLayerNormWithStats, 4},  // mean, mean, rsqrt (an output), y
      {"rms_norm_bf16", kRmsNormBf16, 2},
      {"siblings", kSiblings, 4},
      {"intermediate_output", kIntermediateOutput, 2},
      {"two_axes", kTwoAxes, 2},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    FusionPlan p = plan(c.text, /*fuse=*/false);
    EXPECT_TRUE(well_formed(p));
    EXPECT_EQ(p.kernels.size(), c.kernels);
    std::set<int> realized(p.graph.outputs.begin(), p.graph.outputs.end());
    for (const Node& n : p.graph.nodes)
      if (op_def(n).kind == OpKind::Reduction) realized.insert(n.id);
    EXPECT_EQ(p.kernels.size(), realized.size());
    for (const KernelGroup& k : p.kernels) EXPECT_EQ(k.roots.size(), 1u);
    EXPECT_GE(p.kernels.size(), plan(c.text, true).kernels.size());
  }
  EXPECT_TRUE(matches_golden("planner/softmax_unfused.txt", plan_text(plan(kSoftmax, false))));
  EXPECT_TRUE(matches_golden("planner/layer_norm_with_stats_unfused.txt", plan_text(plan(kLayerNormWithStats, false))));
}

// The planner's last check keeps every kernel it emits lowerable.
TEST(Planner, EveryPlannedKernelLowers) {
  for (const char* text : {kChain, kSoftmax, kSoftmaxByHand, kLogSoftmaxF16, kLayerNormWithStats, kLayerNormByHand,
                           kRmsNormBf16, kRmsNormByHand, kChainIntoSoftmax, kTwoAxes, kReductionThroughTranspose,
                           kReductionThroughTransposeSymbolic, kSiblings, kIntermediateOutput}) {
    for (bool fuse : {true, false}) {
      FusionPlan p = plan(text, fuse);
      for (const KernelGroup& k : p.kernels) EXPECT_NO_THROW(lower_kernel(p, k, "k")) << text;
    }
  }
}

}  // namespace
}  // namespace opfuse
