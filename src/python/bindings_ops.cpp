// Bindings of the hand-written kernels behind opfuse.ops: the attention
// forward kernel's launcher (NVRTC + driver) and the CPU attention paths.
// Tensors cross as raw pointers (integers), sizes and element strides; the
// Python side (python/opfuse/ops/attention.py) checks dtypes and devices.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/attention/attention_cpu.h"
#include "kernels/attention/attention_reference.h"
#include "python/bindings_attention.h"
#include "runtime/attention_launcher.h"
#include "runtime/attention_launcher_sm90.h"

namespace nb = nanobind;
namespace at = opfuse::attention;
namespace ka = opfuse::kernels::attention;

namespace {

using namespace opfuse::attention_bindings;  // Ptrs, Sizes, Strides, need, set_mask

// ptrs: q, k, v, o, lse (0 = none); sizes: B, Hq, Hkv, Sq, Sk, D;
// strides: q, k, v, o (dims 0..2 each), lse (b, h).
at::AttnForwardArgs cuda_args(const std::string& elem, const Ptrs& ptrs, const Sizes& sizes, const Strides& strides,
                              bool causal, double scale, const std::string& tile) {
  need(ptrs.size() == 5, "ptrs: q, k, v, o, lse");
  need(sizes.size() == 6, "sizes: B, Hq, Hkv, Sq, Sk, D");
  need(strides.size() == 5, "strides: q, k, v, o, lse");
  for (int i = 0; i < 4; ++i) need(strides[static_cast<size_t>(i)].size() >= 3, "q/k/v/o strides need 3 entries");
  need(strides[4].size() >= 2, "lse strides need 2 entries");
  at::AttnForwardArgs a;
  a.elem = at::parse_attn_elem(elem);
  a.q = reinterpret_cast<const void*>(ptrs[0]);
  a.k = reinterpret_cast<const void*>(ptrs[1]);
  a.v = reinterpret_cast<const void*>(ptrs[2]);
  a.o = reinterpret_cast<void*>(ptrs[3]);
  a.lse = reinterpret_cast<float*>(ptrs[4]);
  int64_t* dst[] = {a.q_strides, a.k_strides, a.v_strides, a.o_strides};
  for (int i = 0; i < 4; ++i)
    for (int d = 0; d < 3; ++d) dst[i][d] = strides[static_cast<size_t>(i)][static_cast<size_t>(d)];
  a.lse_strides[0] = strides[4][0];
  a.lse_strides[1] = strides[4][1];
  a.batch = sizes[0], a.heads_q = sizes[1], a.heads_kv = sizes[2], a.seqlen_q = sizes[3], a.seqlen_k = sizes[4],
  a.head_dim = sizes[5];
  a.causal = causal;
  a.softmax_scale = scale;
  a.tile = tile;
  return a;
}

ka::AttentionShape shape_of(const Sizes& sizes) {
  need(sizes.size() == 6, "sizes: B, Hq, Hkv, Sq, Sk, D");
  ka::AttentionShape s;
  s.batch = sizes[0], s.heads_q = sizes[1], s.heads_kv = sizes[2], s.seqlen_q = sizes[3], s.seqlen_k = sizes[4],
  s.head_dim = sizes[5];
  return s;
}

// The float32 references of attention_reference.h (no mask).
ka::AttentionForwardArgs reference_args(const Ptrs& ptrs, const Sizes& sizes, const Strides& strides, bool causal,
                                        double scale) {
  need(ptrs.size() == 5 && strides.size() == 5, "ptrs and strides: q, k, v, o, lse");
  for (int i = 0; i < 4; ++i) need(strides[static_cast<size_t>(i)].size() >= 3, "q/k/v/o strides need 3 entries");
  need(strides[4].size() >= 2, "lse strides need 2 entries");
  ka::AttentionForwardArgs a;
  auto c4 = [&](int i) {
    return ka::ConstTensor4{reinterpret_cast<const float*>(ptrs[static_cast<size_t>(i)]), strides[static_cast<size_t>(i)][0],
                            strides[static_cast<size_t>(i)][1], strides[static_cast<size_t>(i)][2]};
  };
  a.q = c4(0);
  a.k = c4(1);
  a.v = c4(2);
  a.o = ka::Tensor4{reinterpret_cast<float*>(ptrs[3]), strides[3][0], strides[3][1], strides[3][2]};
  a.lse = ka::Tensor3{reinterpret_cast<float*>(ptrs[4]), strides[4][0], strides[4][1]};
  a.shape = shape_of(sizes);
  a.causal = causal;
  a.softmax_scale = scale;
  return a;
}

}  // namespace

void bind_ops(nb::module_& m) {
  // --- CUDA: the FA2-style forward kernel -------------------------------------
  m.def(
      "attention_cuda",
      [](const std::string& elem, const Ptrs& ptrs, const Sizes& sizes, const Strides& strides, bool causal, double scale,
         uintptr_t stream, const std::string& tile, int device, const std::string& mask_kind, uintptr_t mask,
         const std::vector<int64_t>& mask_strides, uintptr_t workspace, int64_t workspace_bytes) {
        at::AttnForwardArgs a = cuda_args(elem, ptrs, sizes, strides, causal, scale, tile);
        a.device = device;
        set_mask(a, mask_kind, mask, mask_strides);
        a.split_ws = reinterpret_cast<void*>(workspace);
        a.split_ws_bytes = workspace_bytes;
        nb::gil_scoped_release release;
        at::attn_forward_cuda(a, reinterpret_cast<opfuse::CUstream>(stream));
      },
      nb::arg("elem"), nb::arg("ptrs"), nb::arg("sizes"), nb::arg("strides"), nb::arg("causal"), nb::arg("scale"),
      nb::arg("stream"), nb::arg("tile") = "", nb::arg("device") = -1, nb::arg("mask_kind") = "",
      nb::arg("mask") = 0, nb::arg("mask_strides") = std::vector<int64_t>{}, nb::arg("workspace") = 0,
      nb::arg("workspace_bytes") = 0,
      "Launches the attention forward kernel on `stream` (an integer cudaStream_t).\n"
      "elem: 'bf16' | 'f16'; ptrs: q, k, v, o, lse (0 = no LSE); sizes: B, Hq, Hkv, Sq, Sk, D;\n"
      "strides: element strides of dims 0..2 of q, k, v, o and dims 0..1 of lse; scale <= 0: 1/sqrt(D);\n"
      "device >= 0: the tensors' CUDA device (its primary context is made current if the thread has none);\n"
      "mask_kind: '' | 'full-bool' | 'full-bf16' | 'full-f16' | 'full-f32' | 'keypad', mask: its data pointer,\n"
      "mask_strides: its 4 element strides over [B, Hq, Sq, Sk] (0 on broadcast dims, key stride 1).");
  m.def(
      "attention_cuda_workspace",
      [](const std::string& elem, const Ptrs& ptrs, const Sizes& sizes, const Strides& strides, bool causal, double scale,
         const std::string& tile, int device, const std::string& mask_kind, uintptr_t mask,
         const std::vector<int64_t>& mask_strides) {
        at::AttnForwardArgs a = cuda_args(elem, ptrs, sizes, strides, causal, scale, tile);
        a.device = device;
        set_mask(a, mask_kind, mask, mask_strides);
        const at::AttnWorkspace w = at::attn_forward_workspace(a);
        return std::make_tuple(w.bytes, w.zero_bytes);
      },
      nb::arg("elem"), nb::arg("ptrs"), nb::arg("sizes"), nb::arg("strides"), nb::arg("causal"), nb::arg("scale"),
      nb::arg("tile") = "", nb::arg("device") = -1, nb::arg("mask_kind") = "", nb::arg("mask") = 0,
      nb::arg("mask_strides") = std::vector<int64_t>{},
      "(bytes, zero_bytes) of the workspace attention_cuda's `workspace` needs for this call (same\n"
      "arguments; (0, 0): none): the Hopper kernel's split tail, whose first zero_bytes must be zero.");
  m.def(
      "attention_cuda_unsupported_reason",
      [](const std::string& elem, const Ptrs& ptrs, const Sizes& sizes, const Strides& strides, bool causal, double scale,
         const std::string& mask_kind, uintptr_t mask, const std::vector<int64_t>& mask_strides) {
        at::AttnForwardArgs a = cuda_args(elem, ptrs, sizes, strides, causal, scale, "");
        set_mask(a, mask_kind, mask, mask_strides);
        return at::attn_unsupported_reason(a);
      },
      nb::arg("elem"), nb::arg("ptrs"), nb::arg("sizes"), nb::arg("strides"), nb::arg("causal"), nb::arg("scale"),
      nb::arg("mask_kind") = "", nb::arg("mask") = 0, nb::arg("mask_strides") = std::vector<int64_t>{},
      "Empty when the CUDA kernel covers the problem, else the reason.");
  m.def(
      "attention_tile",
      [](int head_dim, int64_t seqlen_q, int64_t seqlen_k, bool causal, int arch, int smem_limit) {
        return at::attn_choose_tile(head_dim, seqlen_q, seqlen_k, causal, arch, smem_limit).tag();
      },
      nb::arg("head_dim"), nb::arg("seqlen_q"), nb::arg("seqlen_k"), nb::arg("causal"), nb::arg("arch"),
      nb::arg("smem_limit") = 0);
  m.def(
      "attention_candidate_tiles",
      [](int head_dim, int arch, int smem_limit) {
        std::vector<std::string> r;
        for (auto& t : at::attn_candidate_tiles(head_dim, arch, smem_limit)) r.push_back(t.tag());
        return r;
      },
      nb::arg("head_dim"), nb::arg("arch"), nb::arg("smem_limit") = 0);
  m.def(
      "attention_name_expression",
      [](const std::string& elem, int head_dim, bool causal, const std::string& tile, const std::string& mask) {
        return at::attn_name_expression(at::parse_attn_elem(elem), head_dim, causal, at::AttnTile::parse(tile),
                                        at::parse_attn_mask(mask));
      },
      nb::arg("elem"), nb::arg("head_dim"), nb::arg("causal"), nb::arg("tile"), nb::arg("mask") = "");
  m.def(
      "attention_compile",
      [](const std::string& elem, int head_dim, bool causal, const std::string& tile, int arch, bool use_cache,
         const std::string& mask) {
        at::AttnCompiled c;
        {
          nb::gil_scoped_release release;
          c = at::attn_compile(at::parse_attn_elem(elem), head_dim, causal, at::AttnTile::parse(tile), arch, use_cache,
                               at::parse_attn_mask(mask));
        }
        return std::make_tuple(c.expression, c.lowered, nb::bytes(c.cubin.data(), c.cubin.size()), c.log, c.cache_hit);
      },
      nb::arg("elem"), nb::arg("head_dim"), nb::arg("causal"), nb::arg("tile"), nb::arg("arch"), nb::arg("use_cache") = true,
      nb::arg("mask") = "",
      "NVRTC-compiles one attention kernel instantiation for sm_<arch> (no GPU needed):\n"
      "(expression, lowered name, cubin, log, cache_hit).");
  m.def(
      "attention_sm90_compile",
      [](const std::string& elem, int head_dim, bool causal, const std::string& tile, bool use_cache,
         const std::string& mask) {
        at::AttnCompiled c;
        {
          nb::gil_scoped_release release;
          c = at::attn_sm90_compile(at::parse_attn_elem(elem), head_dim, causal, at::AttnSm90Tile::parse(tile), use_cache,
                                    at::parse_attn_mask(mask));
        }
        return std::make_tuple(c.expression, c.lowered, nb::bytes(c.cubin.data(), c.cubin.size()), c.log, c.cache_hit);
      },
      nb::arg("elem"), nb::arg("head_dim"), nb::arg("causal"), nb::arg("tile"), nb::arg("use_cache") = true,
      nb::arg("mask") = "",
      "NVRTC-compiles one Hopper attention instantiation for sm_90a (no GPU needed): as attention_compile.");
  m.def("attention_smem_bytes",
        [](int head_dim, const std::string& tile) { return at::attn_smem_bytes(head_dim, at::AttnTile::parse(tile)); });
  m.def(
      "attention_sm90_default_tile",
      [](int head_dim, bool causal, bool masked) { return at::attn_sm90_default_tile(head_dim, causal, masked).tag(); },
      nb::arg("head_dim"), nb::arg("causal"), nb::arg("masked") = false,
      "The Hopper kernel's default tile tag for a call at this head dim.");
  m.def("attention_sm90_stored_dim", &at::attn_sm90_stored_dim, nb::arg("head_dim"));
  m.def("attention_sm90_smem_bytes", [](int head_dim, const std::string& tile) {
    return at::attn_sm90_smem_bytes(head_dim, at::AttnSm90Tile::parse(tile));
  });
  m.def("attention_sm90_causal_split_cuts", &at::attn_sm90_causal_split_cuts, nb::arg("seqlen_q"), nb::arg("seqlen_k"),
        nb::arg("block_m"), nb::arg("block_n"), nb::arg("heads_batch"), nb::arg("grid"), nb::arg("shift"),
        "Whether the Hopper forward's causal split cuts a call (the launcher's rule; the harness mirrors it).");

  // --- CPU ------------------------------------------------------------------
  m.def(
      "attention_cpu_tiled",
      [](const Ptrs& ptrs, const Sizes& sizes, const Strides& strides, bool causal, double scale, int block_m, int block_n) {
        ka::AttentionForwardArgs a = reference_args(ptrs, sizes, strides, causal, scale);
        nb::gil_scoped_release release;
        ka::attention_forward_tiled(a, block_m, block_n);
      },
      nb::arg("ptrs"), nb::arg("sizes"), nb::arg("strides"), nb::arg("causal"), nb::arg("scale"), nb::arg("block_m") = 128,
      nb::arg("block_n") = 64,
      "attention_reference's tiled float32 online-softmax forward (float32 pointers, no mask; scale <= 0: 1/sqrt(D)).");
  m.def(
      "attention_cpu_plain",
      [](const Ptrs& ptrs, const Sizes& sizes, const Strides& strides, bool causal, double scale) {
        ka::AttentionForwardArgs a = reference_args(ptrs, sizes, strides, causal, scale);
        nb::gil_scoped_release release;
        ka::attention_forward_plain(a);
      },
      "attention_reference's plain forward (float64 arithmetic on float32 tensors, no mask).");
  m.def(
      "attention_cpu",
      [](const std::string& dtype, const Ptrs& ptrs, const Sizes& sizes, const Strides& strides, bool causal, double scale,
         const std::string& mask_kind, uintptr_t mask, const std::vector<int64_t>& mask_strides, int threads) {
        need(dtype == "f32" || dtype == "f64", "dtype must be f32 or f64");
        need(ptrs.size() == 5 && strides.size() == 5, "ptrs and strides: q, k, v, o, lse");
        for (int i = 0; i < 4; ++i) need(strides[static_cast<size_t>(i)].size() >= 3, "q/k/v/o strides need 3 entries");
        need(strides[4].size() >= 3, "lse strides need 3 entries (b, h, i)");
        ka::CpuAttentionArgs a;
        a.f64 = dtype == "f64";
        a.q = reinterpret_cast<const void*>(ptrs[0]);
        a.k = reinterpret_cast<const void*>(ptrs[1]);
        a.v = reinterpret_cast<const void*>(ptrs[2]);
        a.o = reinterpret_cast<void*>(ptrs[3]);
        a.lse = reinterpret_cast<void*>(ptrs[4]);
        int64_t* dst[] = {a.q_strides, a.k_strides, a.v_strides, a.o_strides, a.lse_strides};
        for (int i = 0; i < 5; ++i)
          for (int d = 0; d < 3; ++d) dst[i][d] = strides[static_cast<size_t>(i)][static_cast<size_t>(d)];
        a.shape = shape_of(sizes);
        a.causal = causal;
        a.softmax_scale = scale;
        if (mask_kind == "none") a.mask_kind = ka::MaskKind::None;
        else if (mask_kind == "bool") a.mask_kind = ka::MaskKind::Bool;
        else if (mask_kind == "additive") a.mask_kind = ka::MaskKind::Additive;
        else throw std::invalid_argument("mask_kind must be none, bool or additive");
        a.mask = reinterpret_cast<const void*>(mask);
        if (a.mask_kind != ka::MaskKind::None) {
          need(mask_strides.size() == 4, "mask strides: 4 entries over [B, Hq, Sq, Sk]");
          for (int d = 0; d < 4; ++d) a.mask_strides[d] = mask_strides[static_cast<size_t>(d)];
        }
        a.threads = threads;
        nb::gil_scoped_release release;
        ka::attention_forward_cpu(a);
      },
      nb::arg("dtype"), nb::arg("ptrs"), nb::arg("sizes"), nb::arg("strides"), nb::arg("causal"), nb::arg("scale"),
      nb::arg("mask_kind") = "none", nb::arg("mask") = 0, nb::arg("mask_strides") = std::vector<int64_t>{},
      nb::arg("threads") = 0,
      "CPU attention in float32 or float64 with an optional bool (True = attend) or additive mask over\n"
      "[B, Hq, Sq, Sk] (element strides, 0 for broadcast dims); fully masked rows give O = 0, LSE = -inf.");
}
