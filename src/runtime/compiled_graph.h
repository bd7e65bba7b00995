// A graph compiled for the CPU: its fusion plan, its kernels in kernel IR,
// and one compiled variant per input stride signature (the in-memory cache;
// sizes are run-time arguments, so a variant serves every size).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "codegen/c_emitter.h"
#include "codegen/cuda_emitter.h"
#include "runtime/cuda_api.h"
#include "runtime/gemm_launcher.h"
#include "codegen/kernel_ir.h"
#include "fusion/plan.h"
#include "ir/evaluate.h"
#include "runtime/host_compiler.h"

namespace opfuse {

enum class Target { CPU, CUDA };

struct CompileOptions {
  PlannerOptions planner;
  Target target = Target::CPU;
};

// One buffer of a run: a graph input (any strides) or a stored node
// (contiguous, allocated by the caller).
struct BufferSpec {
  int node = -1;
  DType dtype = DType::Float32;
  Shape shape;
  bool is_input = false;
};

// A GEMM library call of the plan, in terms of buffers (indices into
// buffers()); -1 where absent.
struct GemmStep {
  GemmCall call;          // the plan's description (node ids)
  int a = -1, b = -1;     // operand buffers; the matrix views are call.a/b.shape, maybe transposed
  int out = -1, bias = -1, residual = -1, aux = -1, bias_grad = -1;
  int w1 = -1, w3 = -1, b1 = -1;  // a decode MLP call (call.is_decode_mlp()): the first layer's inputs
  // A gated A (call.gate_silu >= 0): a's buffer is silu(gate_silu) * gate_mul,
  // written by the kernel step just before this one, which the skinny GEMM
  // may take in (CompiledGraph::launch_gated_gemm).
  int gate_silu = -1, gate_mul = -1;
  // That gate kernel (with gate_silu >= 0): its index among the generated
  // kernels and its step (the plan's kernel index).
  int gate_kernel = -1, gate_step = -1;
  DType dtype = DType::Float32;
  std::string name;       // e.g. "gemm0_bias_relu"
};

// What a run needs besides pointers: the stream (CUDA), cuBLASLt's
// workspace, the TF32 setting, and on the CPU who computes GEMMs (the
// Python package passes PyTorch's matmul; opfuse has no BLAS of its own).
// RunOptions::zeroed_workspace: zeroed once per (device, stream) and left
// zeroed by every kernel that uses it; the decode MLP's region (its first
// kDecodeRegionBytes, decode_mlp::kWorkspaceBytes), then the row groups'
// counters and slots (kRowGroupWorkspaceBytes).
constexpr size_t kDecodeRegionBytes = size_t(16) << 20;
constexpr size_t kZeroedWorkspaceBytes = kDecodeRegionBytes + kRowGroupWorkspaceBytes;

struct RunOptions {
  void* stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // The zeroed workspace (kZeroedWorkspaceBytes, one per stream): the decode
  // MLP kernel's (decode_mlp::Args::workspace) and the row groups'.
  void* zeroed_workspace = nullptr;
  size_t zeroed_workspace_bytes = 0;
  bool allow_tf32 = false;
  std::function<void(int gemm)> cpu_gemm;
  // Out (CUDA): incremented for each GEMM step that ran as an opfuse kernel
  // (the skinny GEMM) instead of a cuBLASLt call.
  int* gemm_kernels = nullptr;
  // Out (CUDA): incremented for each GEMM step that ran inside another
  // step's batched call (a pair, CompiledGraph::gemm_pairs()): no call of its own.
  int* gemm_merged = nullptr;
  // Out (CUDA): incremented for each generated kernel not launched because
  // the GEMM step after it read its inputs in its place (a gated A).
  int* kernels_folded = nullptr;
};

struct KernelInfo {
  std::string name;
  std::vector<std::string> ops;  // the graph ops it computes
  KernelCost cost;
  bool row = false;
};

class CompiledGraph {
  struct Variant;

 public:
  // Everything a run derives from one input layout (the variant, size
  // symbols, strides, each kernel's argument block and launch geometry),
  // worked out once by prepare(), so that a run with that layout only puts
  // pointers into place and launches: the Python runtime's hot path.
  struct PreparedRun {
    const Variant* variant = nullptr;
    int variant_index = -1;
    int device = 0;  // CUDA: the device whose primary context a thread without one gets
    std::vector<int64_t> symbol_values;
    std::vector<std::vector<int64_t>> input_strides;
    std::map<std::string, int64_t> env;  // the size symbols by name, for GEMM steps
    struct Step {
      int gemm = -1;     // >= 0: this step is gemms()[gemm]
      int kernel = -1;   // else kernels()[kernel]
      bool empty = false;  // nothing to compute (no elements, no rows): not launched
      // The kernel's arguments: CUDA, one int64 block (pointers first, then
      // symbols, then strides; `n_ptrs` pointer slots filled per run); CPU,
      // the symbol and stride arrays (pointers are gathered per run).
      std::vector<int64_t> args, strides;
      std::vector<int> ptr_buffers;  // buffer index of each pointer slot
      size_t n_ptrs = 0;
      // CUDA: the vector twin is taken when the sizes and strides allow it
      // (known here) and every vector-accessed pointer is aligned (per run).
      bool vec_possible = false;
      std::vector<std::pair<int, uintptr_t>> vec_align;  // (buffer, bytes)
      unsigned grid = 1, threads = 1, vec_grid = 1, vec_threads = 1;
      unsigned vec_smem = 0;  // dynamic shared memory of the vector twin (rows staged there)
      bool too_many_rows = false, vec_too_many_rows = false;  // a cluster grid past the limit
      // The vector twin's row groups exchange through the zeroed workspace
      // (CudaLaunch::group_exchange): the index in args of its pointer, -1 if not.
      int group_arg = -1;
    };
    std::vector<Step> steps;
    // A step wants RunOptions::zeroed_workspace (without it, such a row
    // step runs its scalar twin).
    bool wants_zeroed_workspace = false;
    std::vector<std::pair<int, size_t>> huge_pages;  // CPU: (buffer, bytes) to advise before writing
  };

  CompiledGraph(const Graph& g, const CompileOptions& opt);

  const FusionPlan& plan() const { return plan_; }
  const std::vector<BufferSpec>& buffers() const { return buffers_; }
  const std::vector<int>& output_buffers() const { return output_buffers_; }  // per graph output
  const std::vector<KernelIR>& kernels() const { return kernels_; }
  const std::vector<KernelInfo>& kernel_info() const { return info_; }
  const std::vector<std::string>& symbols() const { return symbols_; }
  const std::vector<GemmStep>& gemms() const { return gemms_; }
  // GEMM steps that may run as one batched call (first, second): at most 64
  // rows of A by default, any size with OPFUSE_GEMM_PAIRS=1, none with =0.
  std::vector<std::pair<int, int>> gemm_pairs() const;
  // Their result buffers: a caller that allocates each pair in one block
  // (first, then second at the next 256-byte boundary) lets the pair run as one call.
  std::vector<std::pair<int, int>> paired_buffers() const;
  // Pairs whose launch may also form Llama's gate (PairGate): (first GEMM
  // step, gate kernel, h buffer, whether the first GEMM is the silu operand).
  std::vector<std::tuple<int, int, int, bool>> pair_gates() const;
  // The order of the work: (false, kernel index) or (true, gemm index).
  const std::vector<std::pair<bool, int>>& steps() const { return steps_; }

  // Size symbols from the inputs' shapes (in symbols() order). Throws where
  // those sizes make a cat part or slice_scatter source of symbolic size
  // empty: run such sizes on for_sizes(input_shapes).
  std::vector<int64_t> bind(const std::vector<std::vector<int64_t>>& input_shapes) const;
  // The graph to run these input sizes with: this one, or, where they make a
  // cat part or slice_scatter source of symbolic size empty, this graph
  // compiled with the symbols of those sizes fixed to their values (so the
  // part is a constant 0 and no kernel reads it), kept for later calls. Its
  // inputs are this graph's; its buffers and symbols may differ.
  CompiledGraph& for_sizes(const std::vector<std::vector<int64_t>>& input_shapes);
  // The symbols for_sizes fixes for these sizes, with their values (empty: none).
  std::map<std::string, int64_t> empty_part_symbols(const std::vector<std::vector<int64_t>>& input_shapes) const;
  std::vector<int64_t> buffer_shape(int buffer, const std::vector<int64_t>& symbol_values) const;
  // A graph output's shape: its buffer's, or a reshape of it (plan().output_alias).
  std::vector<int64_t> output_shape(int output, const std::vector<int64_t>& symbol_values) const;

  // The variant for these input strides, compiled (or loaded from the disk
  // cache) on first use. Returns its index; *cache_hit tells if it was on disk.
  int variant(const std::vector<std::vector<int64_t>>& input_shapes, const std::vector<std::vector<int64_t>>& input_strides,
              bool* compiled = nullptr, bool* cache_hit = nullptr);
  std::string source(int variant) const;

  // Runs every kernel. `ptrs` holds one pointer per buffer (buffers());
  // `input_strides` the strides of each graph input, in elements; `stream`
  // the CUDA stream to launch on (CUDA target).
  void run(int variant, const std::vector<int64_t>& symbol_values, const std::vector<void*>& ptrs,
           const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& options) const;
  void run(int variant, const std::vector<int64_t>& symbol_values, const std::vector<void*>& ptrs,
           const std::vector<std::vector<int64_t>>& input_strides, void* stream = nullptr) const {
    RunOptions o;
    o.stream = stream;
    run(variant, symbol_values, ptrs, input_strides, o);
  }

  // The same run split in two: prepare() once per input layout (variant
  // from variant(); sizes and strides as for run(); CUDA: the device, or -1
  // for the current context's), then run_prepared() per call with the
  // pointers (one per buffer, as for run()).
  PreparedRun prepare(int variant, const std::vector<int64_t>& symbol_values,
                      const std::vector<std::vector<int64_t>>& input_strides, int device = -1) const;
  void run_prepared(const PreparedRun& p, const std::vector<void*>& ptrs, const RunOptions& options) const;

  Target target() const { return target_; }
  // The CUDA source of all kernels for a stride signature, and compiling it
  // with NVRTC for an architecture (no GPU needed): for CI and inspection.
  std::string cuda_source(const std::vector<std::vector<int64_t>>& input_shapes,
                          const std::vector<std::vector<int64_t>>& input_strides, int arch = 90) const;
  NvrtcOutput compile_cuda(const std::vector<std::vector<int64_t>>& input_shapes,
                           const std::vector<std::vector<int64_t>>& input_strides, int arch, bool want_ptx) const;

 private:
  using KernelFn = void (*)(void* const*, const int64_t*, const int64_t*);
  struct Variant {
    std::string key;
    std::string source;
    LoadedLibrary lib;
    std::vector<KernelFn> fns;
    int (*take_error)() = nullptr;
    // CUDA
    CUmodule module = nullptr;
    std::vector<CudaLaunch> launches;
    std::vector<CUfunction> cu_scalar, cu_vector;
    std::vector<int> ring_groups;  // per kernel: row groups the vector twin's ring grid holds (0: no ring)
  };
  struct Launch {
    std::vector<int> buffers;       // global buffer index per kernel buffer
    std::vector<int> symbols;       // index into symbols_ per kernel symbol
    std::vector<int> strided_inputs;  // input number of each strided kernel buffer
  };

  FusionPlan plan_;
  std::vector<KernelIR> kernels_;
  std::vector<KernelInfo> info_;
  std::vector<Launch> launches_;
  std::vector<BufferSpec> buffers_;
  std::vector<int> output_buffers_;
  std::vector<std::pair<int, Expr>> large_written_;  // written buffers that may take huge pages: (buffer, bytes)
  std::vector<GemmStep> gemms_;
  std::vector<int> pair_of_;  // per GEMM step: the later step it runs with as one batched call (pair_gemms()), or -1
  std::vector<int> gate_gemm_of_;  // per generated kernel: the next step's GEMM, which may take it in (gated A), or -1
  // A pair whose two results only Llama's gate kernel reads (silu(one) *
  // other): the pair's launch may write the gate's product h itself
  // (skinny::try_run_gated_pair), and the gate kernel is then not launched.
  struct PairGate {
    int kernel = -1;             // the gate kernel (generated kernel index); -1: none
    int h = -1;                  // its output buffer
    bool first_is_gate = false;  // the pair's first GEMM is the silu operand
  };
  std::vector<PairGate> pair_gate_;  // per GEMM step (a pair's first), pair_gemms()
  int64_t gemm_pair_max_rows_ = kPairDefaultMaxRows;  // pairs run as one call up to this many rows of A
  static constexpr int64_t kPairDefaultMaxRows = 64;
  int gemm_candidates_ = 8, gemm_split_k_ = 0;  // GemmArgs::candidates, split_k_max (OPFUSE_GEMM_CANDIDATES, _SPLITK)
  std::vector<std::pair<bool, int>> steps_;
  std::vector<int> input_nodes_;
  std::vector<std::string> symbols_;
  // The symbolic sizes of cat parts and slice_scatter sources along their
  // dim, with the node that reads them: the kernels read such a part at a
  // clamped index without a guard (the select discards the value), which
  // would touch memory an empty part does not have, so bind() refuses 0 and
  // for_sizes() compiles the graph with that size fixed.
  std::vector<std::pair<Expr, std::string>> part_sizes_;
  Graph source_;            // the graph as given, and the options: for for_sizes()
  CompileOptions options_;
  std::map<std::map<std::string, int64_t>, std::unique_ptr<CompiledGraph>> fixed_;  // for_sizes(), under mu_
  std::map<std::string, int> variant_index_;
  std::vector<std::unique_ptr<Variant>> variants_;
  mutable std::mutex mu_;
  Target target_ = Target::CPU;

  std::string cuda_source_for(const std::vector<StrideSignature>& sigs, std::vector<CudaLaunch>* launches, int arch) const;
  void pair_gemms();
  void mark_pair_gates();  // pair_gate_, after pair_of_
  void build_cuda_variant(Variant& v, const std::vector<StrideSignature>& sigs, bool* cache_hit);
  // `env`: the size symbols' values, built once per layout for every step.
  using SymbolEnv = std::map<std::string, int64_t>;
  void prepare_cuda_kernel(const Variant& v, size_t i, const std::vector<int64_t>& symbol_values, const SymbolEnv& env,
                           const std::vector<std::vector<int64_t>>& input_strides, PreparedRun::Step* step) const;
  GemmArgs gemm_args(const GemmStep& s, const SymbolEnv& env, const std::vector<void*>& ptrs,
                     const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& o) const;
  // `gate`: the pair's gate kernel (or null); *gate_folded: h written, the kernel not to run.
  bool launch_gemm_pair(const GemmStep& x, const GemmStep& y, const SymbolEnv& env, std::vector<void*>& ptrs,
                        const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& o,
                        const PairGate* gate, bool* gate_folded) const;
  void launch_gemm(const GemmStep& s, const SymbolEnv& env, const std::vector<void*>& ptrs,
                   const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& o) const;
  void launch_decode_mlp(const GemmStep& s, const SymbolEnv& env, const std::vector<void*>& ptrs,
                         const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& o) const;
  bool launch_gated_gemm(const GemmStep& s, const SymbolEnv& env, const std::vector<void*>& ptrs,
                         const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& o) const;

  std::string signature(const std::vector<std::vector<int64_t>>& shapes, const std::vector<std::vector<int64_t>>& strides,
                        std::vector<StrideSignature>* per_kernel) const;
};

}  // namespace opfuse
