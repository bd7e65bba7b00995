// Bindings of the attention backward kernels' launcher (runtime/attention_bwd_launcher.h)
// and its CPU float64 reference. Tensors cross as raw pointers (integers),
// sizes and element strides; python/opfuse/ops/attention.py checks dtypes,
// devices and layouts and allocates the outputs and workspaces.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/attention/attention_backward_reference.h"
#include "python/bindings_attention.h"
#include "runtime/attention_bwd_launcher.h"
#include "runtime/attention_bwd_launcher_sm90.h"

namespace nb = nanobind;
namespace at = opfuse::attention;
namespace ka = opfuse::kernels::attention;

namespace {

using namespace opfuse::attention_bindings;  // Ptrs, Sizes, Strides, need, set_mask

// ptrs: q, k, v, o, dout, dq, dk, dv, lse, delta, lse_log2, dq_accum (0 = none);
// sizes: B, Hq, Hkv, Sq, Sk, D; strides: q, k, v, o, dout, dq, dk, dv (dims 0..2), lse (b, h).
at::AttnBackwardArgs backward_args(const std::string& elem, const Ptrs& ptrs, const Sizes& sizes,
                                   const Strides& strides, bool causal, double scale, bool deterministic) {
  need(ptrs.size() == 12, "ptrs: q, k, v, o, dout, dq, dk, dv, lse, delta, lse_log2, dq_accum");
  need(sizes.size() == 6, "sizes: B, Hq, Hkv, Sq, Sk, D");
  need(strides.size() == 9, "strides: q, k, v, o, dout, dq, dk, dv, lse");
  for (size_t i = 0; i < 8; ++i) need(strides[i].size() >= 3, "tensor strides need 3 entries");
  need(strides[8].size() >= 2, "lse strides need 2 entries");
  at::AttnBackwardArgs a;
  a.elem = at::parse_attn_elem(elem);
  auto cp = [&](size_t i) { return reinterpret_cast<const void*>(ptrs[i]); };
  auto mp = [&](size_t i) { return reinterpret_cast<void*>(ptrs[i]); };
  a.q = cp(0), a.k = cp(1), a.v = cp(2), a.o = cp(3), a.dout = cp(4);
  a.dq = mp(5), a.dk = mp(6), a.dv = mp(7);
  a.lse = reinterpret_cast<const float*>(ptrs[8]);
  a.delta = reinterpret_cast<float*>(ptrs[9]);
  a.lse_log2 = reinterpret_cast<float*>(ptrs[10]);
  a.dq_accum = reinterpret_cast<float*>(ptrs[11]);
  int64_t* dst[] = {a.q_strides, a.k_strides, a.v_strides, a.o_strides, a.do_strides, a.dq_strides, a.dk_strides,
                    a.dv_strides};
  for (size_t i = 0; i < 8; ++i)
    for (size_t d = 0; d < 3; ++d) dst[i][d] = strides[i][d];
  a.lse_strides[0] = strides[8][0], a.lse_strides[1] = strides[8][1];
  a.batch = sizes[0], a.heads_q = sizes[1], a.heads_kv = sizes[2], a.seqlen_q = sizes[3], a.seqlen_k = sizes[4],
  a.head_dim = sizes[5];
  a.causal = causal;
  a.softmax_scale = scale;
  a.deterministic = deterministic;
  return a;
}

}  // namespace

void bind_attention_bwd(nb::module_& m) {
  m.def(
      "attention_backward_cuda",
      [](const std::string& elem, const Ptrs& ptrs, const Sizes& sizes, const Strides& strides, bool causal,
         double scale, bool deterministic, uintptr_t stream, int device, const std::string& mask_kind, uintptr_t mask,
         const std::vector<int64_t>& mask_strides) {
        at::AttnBackwardArgs a = backward_args(elem, ptrs, sizes, strides, causal, scale, deterministic);
        a.device = device;
        set_mask(a, mask_kind, mask, mask_strides);
        nb::gil_scoped_release release;
        at::attn_backward_cuda(a, reinterpret_cast<opfuse::CUstream>(stream));
      },
      nb::arg("elem"), nb::arg("ptrs"), nb::arg("sizes"), nb::arg("strides"), nb::arg("causal"), nb::arg("scale"),
      nb::arg("deterministic"), nb::arg("stream"), nb::arg("device") = -1, nb::arg("mask_kind") = "",
      nb::arg("mask") = 0, nb::arg("mask_strides") = std::vector<int64_t>{},
      "Launches the attention backward kernels on `stream` (an integer cudaStream_t).\n"
      "ptrs: q, k, v, o, dout, dq, dk, dv, lse, delta, lse_log2, dq_accum (workspaces: float32,\n"
      "contiguous, attention_backward_padded_rows(Sq) rows per (b, h); lse_log2 twice that with a mask;\n"
      "dq_accum [.., attention_backward_accum_cols(D)], unused when\n"
      "deterministic); sizes: B, Hq, Hkv, Sq, Sk, D; strides: dims 0..2 of the eight tensors, 0..1 of lse.");
  m.def(
      "attention_backward_unsupported_reason",
      [](const std::string& elem, const Ptrs& ptrs, const Sizes& sizes, const Strides& strides, bool causal,
         double scale, bool deterministic) {
        return at::attn_bwd_unsupported_reason(backward_args(elem, ptrs, sizes, strides, causal, scale, deterministic));
      },
      "Empty when the backward kernels cover the problem, else the reason.");
  m.def("attention_backward_padded_rows", &at::attn_bwd_padded_rows);
  m.def("attention_backward_accum_cols", &at::attn_bwd_accum_cols, nb::arg("head_dim"),
        "Floats of a dq_accum row for this head dim (128 for 96: the Hopper backward runs it as 128).");
  m.def(
      "attention_backward_tiles",
      [](int head_dim, int arch, int smem_limit, bool masked) {
        const at::AttnBwdTiles t = at::attn_bwd_choose_tiles(head_dim, arch, smem_limit, masked);
        return std::make_tuple(t.dkdv.tag(), t.dq.tag());
      },
      nb::arg("head_dim"), nb::arg("arch"), nb::arg("smem_limit") = 0, nb::arg("masked") = false,
      "(dK/dV tile, deterministic dQ tile) the launcher uses, as tags such as '64x128w8b1'.");
  m.def(
      "attention_backward_sm90_tiles",
      [](int head_dim) {
        std::vector<std::string> tags{at::attn_bwd_sm90_default_tile(head_dim).tag()};
        for (const at::AttnBwdSm90Tile& t : at::attn_bwd_sm90_candidate_tiles(head_dim)) tags.push_back(t.tag());
        return tags;
      },
      nb::arg("head_dim"),
      "The Hopper backward's tile (honouring OPFUSE_ATTN_BWD_SM90_DQ), then its candidate tiles, as tags such as "
      "'wgb64s2w_ub'.");
  m.def(
      "attention_backward_compile",
      [](const std::string& elem, int head_dim, bool causal, int arch, bool use_cache, const std::string& mask) {
        at::AttnBwdCompiled c;
        {
          nb::gil_scoped_release release;
          const at::AttnBwdTiles t = at::attn_bwd_choose_tiles(head_dim, arch, 0, at::parse_attn_mask(mask) != at::AttnMaskKind::None);
          c = at::attn_bwd_compile(at::parse_attn_elem(elem), head_dim, causal, t, arch, use_cache,
                                   at::parse_attn_mask(mask));
        }
        return std::make_tuple(c.expressions, c.lowered, nb::bytes(c.cubin.data(), c.cubin.size()), c.log,
                               c.cache_hit);
      },
      nb::arg("elem"), nb::arg("head_dim"), nb::arg("causal"), nb::arg("arch"), nb::arg("use_cache") = true,
      nb::arg("mask") = "",
      "NVRTC-compiles the backward kernels of one problem for sm_<arch> (no GPU needed):\n"
      "(expressions, lowered names, cubin, log, cache_hit).");
  m.def(
      "attention_backward_reference",
      [](const Ptrs& ptrs, const Sizes& sizes, const Strides& strides, bool causal, double scale) {
        need(ptrs.size() == 8 && strides.size() == 8, "ptrs and strides: q, k, v, o, dout, dq, dk, dv");
        for (const auto& s : strides) need(s.size() >= 3, "strides need 3 entries");
        auto c4 = [&](size_t i) {
          return ka::ConstTensor4d{reinterpret_cast<const double*>(ptrs[i]), strides[i][0], strides[i][1], strides[i][2]};
        };
        auto m4 = [&](size_t i) {
          return ka::Tensor4d{reinterpret_cast<double*>(ptrs[i]), strides[i][0], strides[i][1], strides[i][2]};
        };
        ka::AttentionBackwardArgs a;
        a.q = c4(0), a.k = c4(1), a.v = c4(2), a.o = c4(3), a.dout = c4(4);
        a.dq = m4(5), a.dk = m4(6), a.dv = m4(7);
        need(sizes.size() == 6, "sizes: B, Hq, Hkv, Sq, Sk, D");
        a.shape = {sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5]};
        a.causal = causal;
        a.softmax_scale = scale;
        nb::gil_scoped_release release;
        ka::attention_backward_reference(a);
      },
      "The float64 CPU reference of the attention backward (attention_backward_reference.h).");
}
