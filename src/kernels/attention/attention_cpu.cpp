#include "attention_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace opfuse::kernels::attention {
namespace {

template <class T>
void run(const CpuAttentionArgs& a) {
  const AttentionShape& s = a.shape;
  const int64_t B = s.batch, Hq = s.heads_q, Sq = s.seqlen_q, Sk = s.seqlen_k, D = s.head_dim;
  const int64_t G = s.heads_kv > 0 ? Hq / s.heads_kv : 1;
  const T scale = static_cast<T>(a.softmax_scale);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const T* Q = static_cast<const T*>(a.q);
  const T* K = static_cast<const T*>(a.k);
  const T* V = static_cast<const T*>(a.v);
  T* O = static_cast<T*>(a.o);
  T* L = static_cast<T*>(a.lse);
  const int64_t* ms = a.mask_strides;
  const auto* mask_b = static_cast<const unsigned char*>(a.mask);
  const T* mask_t = static_cast<const T*>(a.mask);

  auto one_head = [&](int64_t item, std::vector<T>& sc, std::vector<T>& acc) {
    const int64_t b = item / Hq, h = item % Hq, hk = h / G;
    const T* qb = Q + b * a.q_strides[0] + h * a.q_strides[1];
    const T* kb = K + b * a.k_strides[0] + hk * a.k_strides[1];
    const T* vb = V + b * a.v_strides[0] + hk * a.v_strides[1];
    T* ob = O + b * a.o_strides[0] + h * a.o_strides[1];
    for (int64_t i = 0; i < Sq; ++i) {
      const T* q = qb + i * a.q_strides[2];
      T* o = ob + i * a.o_strides[2];
      // Keys [0, end) are visible to query i before the mask.
      const int64_t end = a.causal ? std::clamp<int64_t>(i + Sk - Sq + 1, 0, Sk) : Sk;
      const int64_t mrow = b * ms[0] + h * ms[1] + i * ms[2];
      T mx = neg_inf;
      for (int64_t j = 0; j < end; ++j) {
        T val;
        if (a.mask_kind == MaskKind::Bool && !mask_b[mrow + j * ms[3]]) {
          val = neg_inf;
        } else {
          const T* k = kb + j * a.k_strides[2];
          T dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
          val = dot * scale;
          if (a.mask_kind == MaskKind::Additive) val += mask_t[mrow + j * ms[3]];
        }
        sc[static_cast<size_t>(j)] = val;
        mx = std::max(mx, val);
      }
      std::fill(acc.begin(), acc.end(), T(0));
      T sum = 0;
      if (mx != neg_inf) {  // a fully masked row keeps O = 0, LSE = -inf
        for (int64_t j = 0; j < end; ++j) {
          const T p = std::exp(sc[static_cast<size_t>(j)] - mx);
          if (p == T(0)) continue;
          sum += p;
          const T* v = vb + j * a.v_strides[2];
          for (int64_t d = 0; d < D; ++d) acc[static_cast<size_t>(d)] += p * v[d];
        }
      }
      const T inv = sum > 0 ? T(1) / sum : T(0);
      for (int64_t d = 0; d < D; ++d) o[d] = acc[static_cast<size_t>(d)] * inv;
      if (L) L[b * a.lse_strides[0] + h * a.lse_strides[1] + i * a.lse_strides[2]] = sum > 0 ? mx + std::log(sum) : neg_inf;
    }
  };

  const int64_t items = B * Hq;
  if (items == 0 || Sq == 0) return;
  const double flops = 4.0 * static_cast<double>(items) * static_cast<double>(Sq) * static_cast<double>(Sk) *
                       static_cast<double>(D);
  int threads = a.threads > 0 ? a.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = static_cast<int>(std::min<int64_t>(threads, items));
  if (flops < 4e6) threads = 1;
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    std::vector<T> sc(static_cast<size_t>(std::max<int64_t>(Sk, 1))), acc(static_cast<size_t>(D));
    for (int64_t it; (it = next.fetch_add(1)) < items;) one_head(it, sc, acc);
  };
  if (threads <= 1) {
    worker();
    return;
  }
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

}  // namespace

void attention_forward_cpu(const CpuAttentionArgs& a) {
  const AttentionShape& s = a.shape;
  auto fail = [](const std::string& msg) { throw std::invalid_argument("attention (cpu): " + msg); };
  if (s.batch < 0 || s.heads_q < 0 || s.heads_kv < 0 || s.seqlen_q < 0 || s.seqlen_k < 0) fail("sizes must be non-negative");
  if (s.head_dim < 1) fail("head_dim must be at least 1");
  if (s.heads_kv == 0 ? s.heads_q != 0 : s.heads_q % s.heads_kv != 0) fail("heads_q must be a multiple of heads_kv");
  if (std::isnan(a.softmax_scale)) fail("softmax_scale is NaN");
  const bool any_q = s.batch * s.heads_q * s.seqlen_q > 0;
  if (any_q && (!a.q || !a.o)) fail("q and o must not be null");
  if (any_q && s.seqlen_k > 0 && (!a.k || !a.v)) fail("k and v must not be null");
  if (any_q && s.seqlen_k > 0 && a.mask_kind != MaskKind::None && !a.mask) fail("mask must not be null");
  if (a.f64) run<double>(a);
  else run<float>(a);
}

}  // namespace opfuse::kernels::attention
