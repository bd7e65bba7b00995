// Bindings of the skinny GEMM (runtime/skinny_gemm_launcher.h): a direct
// launch for tests and the microbenchmark, its NVRTC build for CI, its
// debug queries, and the float64 CPU reference. Tensors cross as raw
// pointers (integers) with element strides; python/opfuse/skinny_gemm.py
// wraps them for torch tensors.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/skinny_gemm/skinny_gemm_reference.h"
#include "runtime/skinny_gemm_launcher.h"
#include "runtime/small_m_launch.h"

namespace nb = nanobind;
using namespace opfuse;

namespace {

DType parse_elem(const std::string& name) { return small_m_parse_elem(name, "skinny GEMM"); }

// GemmArgs from the binding's integers: a [m, k] (row stride lda), w [n, k]
// (row stride ldw), i.e. B = w^T; bias [n] and residual [m, n] optional (0).
GemmArgs gemm_args(const std::string& dtype, int64_t m, int64_t n, int64_t k, uintptr_t a, int64_t lda, uintptr_t w,
                   int64_t ldw, uintptr_t d, uintptr_t bias, int64_t bias_stride, uintptr_t c, int64_t ldc,
                   const std::string& activation, uintptr_t aux, uintptr_t stream, uintptr_t a2 = 0, int64_t lda2 = 0) {
  GemmArgs g;
  g.dtype = parse_elem(dtype);
  g.m = m, g.n = n, g.k = k;
  g.a.ptr = reinterpret_cast<const void*>(a);
  g.a.row_stride = lda;
  g.a.col_stride = 1;
  g.b.ptr = reinterpret_cast<const void*>(w);
  g.b.row_stride = 1;  // B[k, n] = w[n, k]
  g.b.col_stride = ldw;
  g.d = reinterpret_cast<void*>(d);
  g.bias = reinterpret_cast<const void*>(bias);
  g.bias_stride = bias_stride;
  g.residual.ptr = reinterpret_cast<const void*>(c);
  g.residual.row_stride = ldc;
  g.residual.col_stride = 1;
  g.activation = activation;
  g.aux = reinterpret_cast<void*>(aux);
  g.stream = reinterpret_cast<void*>(stream);
  if (a2) {
    g.a_mul.ptr = reinterpret_cast<const void*>(a2);
    g.a_mul.row_stride = lda2;
    g.a_mul.col_stride = 1;
  }
  return g;
}

}  // namespace

void bind_skinny_gemm(nb::module_& m) {
  m.def(
      "skinny_gemm",
      [](const std::string& dtype, int64_t m_, int64_t n, int64_t k, uintptr_t a, int64_t lda, uintptr_t w, int64_t ldw,
         uintptr_t d, uintptr_t bias, int64_t bias_stride, uintptr_t c, int64_t ldc, const std::string& activation,
         uintptr_t aux, uintptr_t stream, uintptr_t a2, int64_t lda2) {
        GemmArgs g =
            gemm_args(dtype, m_, n, k, a, lda, w, ldw, d, bias, bias_stride, c, ldc, activation, aux, stream, a2, lda2);
        nb::gil_scoped_release release;
        return skinny::try_run(g);
      },
      nb::arg("dtype"), nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("a"), nb::arg("lda"), nb::arg("w"),
      nb::arg("ldw"), nb::arg("d"), nb::arg("bias") = 0, nb::arg("bias_stride") = 1, nb::arg("c") = 0,
      nb::arg("ldc") = 0, nb::arg("activation") = "", nb::arg("aux") = 0, nb::arg("stream") = 0, nb::arg("a2") = 0,
      nb::arg("lda2") = 0,
      "Enqueues D = act(a @ w^T + bias + c) with the skinny GEMM (a2: A = silu(a) * a2); False (nothing enqueued) "
      "when it does not apply, "
      "OPFUSE_SKINNY_GEMM=0, or, without OPFUSE_SKINNY_GEMM=1, outside skinny_gemm_default_takes.");
  m.def("skinny_gemm_default_takes", &skinny::default_takes, nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("arch"),
        nb::arg("sms"), "Whether the skinny GEMM takes a GEMM of this shape without OPFUSE_SKINNY_GEMM.");
  m.def(
      "skinny_gemm_unsupported_reason",
      [](const std::string& dtype, int64_t m_, int64_t n, int64_t k, uintptr_t a, int64_t lda, uintptr_t w, int64_t ldw,
         uintptr_t bias, uintptr_t c, const std::string& activation) {
        return skinny::unsupported_reason(gemm_args(dtype, m_, n, k, a, lda, w, ldw, 1, bias, 1, c, 0, activation, 0, 0));
      },
      nb::arg("dtype"), nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("a"), nb::arg("lda"), nb::arg("w"),
      nb::arg("ldw"), nb::arg("bias") = 0, nb::arg("c") = 0, nb::arg("activation") = "");
  m.def(
      "skinny_gemm_compile",
      [](const std::string& dtype, const std::string& config, int arch) {
        skinny::Compiled c = skinny::compile(parse_elem(dtype), skinny::SkinnyConfig::parse(config), arch, false);
        return nb::make_tuple(nb::bytes(c.cubin.data(), c.cubin.size()), c.log);
      },
      nb::arg("dtype"), nb::arg("config"), nb::arg("arch"), "NVRTC build of one instantiation (no cache): (cubin, log).");
  m.def("skinny_gemm_candidates", [](int arch) {
    std::vector<std::string> r;
    for (auto& c : skinny::candidate_configs(arch)) r.push_back(c.tag());
    return r;
  });
  m.def("skinny_gemm_choose_config", [](int64_t m_, int64_t n, int64_t k, int arch, int sms) {
    return skinny::choose_config(m_, n, k, arch, sms).tag();
  });
  m.def("skinny_gemm_choose_tma_config", [](int64_t m_, int64_t n, int64_t k, int sms) {
    return skinny::choose_tma_config(m_, n, k, sms).tag();
  });
  m.def(
      "skinny_gemm_device_dram_tbps", [] { return small_m_current_device().dram_tbps; },
      "The current context's device's peak DRAM bandwidth in TB/s as the skinny GEMM reads it (0: unknown).");
  m.def(
      "skinny_gemm_choose_gated_pair_config",
      [](int64_t m_, int64_t n, int64_t k, int sms, double dram_tbps) {
        return skinny::choose_gated_pair_config(m_, n, k, sms, dram_tbps).tag();
      },
      nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("sms"), nb::arg("dram_tbps") = 0.0);
  m.def(
      "skinny_gemm_set_trace_buffer", [](uintptr_t buffer) { skinny::set_trace_buffer(reinterpret_cast<uint64_t*>(buffer)); },
      nb::arg("buffer"),
      "Device buffer (6 int64 a CTA) that launches of a trace config (tag suffix 't', forced with "
      "OPFUSE_SKINNY_CONFIG) write their CTAs' %globaltimer stamps to; 0 for none.");
  m.def("skinny_gemm_launch_count", [] { return skinny::launch_count(); });
  m.def("skinny_gemm_last_error", [] { return skinny::last_error(); });
  m.def("skinny_gemm_last_config", [] { return skinny::last_config(); });
  m.def(
      "skinny_gemm_reference",
      [](const std::string& dtype, int64_t m_, int64_t n, int64_t k, uintptr_t a, int64_t lda, uintptr_t w, int64_t ldw,
         uintptr_t d, uintptr_t bias, int64_t bias_stride, uintptr_t c, int64_t ldc, const std::string& activation,
         uintptr_t aux, uintptr_t a2, int64_t lda2) {
        kernels::skinny_gemm::ReferenceArgs r;
        r.dtype = parse_elem(dtype);
        r.m = m_, r.n = n, r.k = k;
        r.a = reinterpret_cast<const double*>(a), r.lda = lda;
        r.w = reinterpret_cast<const double*>(w), r.ldw = ldw;
        r.d = reinterpret_cast<double*>(d);
        r.bias = reinterpret_cast<const double*>(bias), r.bias_stride = bias_stride;
        r.c = reinterpret_cast<const double*>(c), r.ldc = ldc;
        r.activation = activation;
        r.aux = reinterpret_cast<double*>(aux);
        r.a2 = reinterpret_cast<const double*>(a2), r.lda2 = lda2;
        nb::gil_scoped_release release;
        kernels::skinny_gemm::skinny_gemm_reference(r);
      },
      nb::arg("dtype"), nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("a"), nb::arg("lda"), nb::arg("w"),
      nb::arg("ldw"), nb::arg("d"), nb::arg("bias") = 0, nb::arg("bias_stride") = 1, nb::arg("c") = 0,
      nb::arg("ldc") = 0, nb::arg("activation") = "", nb::arg("aux") = 0, nb::arg("a2") = 0, nb::arg("lda2") = 0,
      "skinny_gemm_reference.h on float64 CPU tensors (pointers): D and aux rounded to the dtype's values.");
}
