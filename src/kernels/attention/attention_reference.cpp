#include "attention_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <stdexcept>
#include <string>
#include <vector>

namespace opfuse::kernels::attention {

namespace {

double effective_scale(const AttentionForwardArgs& a) {
  return a.softmax_scale > 0 ? a.softmax_scale : 1.0 / std::sqrt(static_cast<double>(a.shape.head_dim));
}

// Keys [0, key_end(i)) are visible to query i.
int64_t key_end(const AttentionForwardArgs& a, int64_t i) {
  const int64_t Sq = a.shape.seqlen_q, Sk = a.shape.seqlen_k;
  if (!a.causal) return Sk;
  return std::clamp<int64_t>(i + Sk - Sq + 1, 0, Sk);
}

const float* row_ptr(const ConstTensor4& t, int64_t b, int64_t h, int64_t s) {
  return t.data + b * t.stride_b + h * t.stride_h + s * t.stride_s;
}
float* row_ptr(const Tensor4& t, int64_t b, int64_t h, int64_t s) {
  return t.data + b * t.stride_b + h * t.stride_h + s * t.stride_s;
}

void write_lse(const AttentionForwardArgs& a, int64_t b, int64_t h, int64_t i, float value) {
  if (a.lse.data) a.lse.data[b * a.lse.stride_b + h * a.lse.stride_h + i] = value;
}

}  // namespace

void validate(const AttentionForwardArgs& a) {
  const AttentionShape& s = a.shape;
  auto fail = [](const std::string& msg) { throw std::invalid_argument("attention: " + msg); };
  if (s.batch < 0 || s.heads_q < 0 || s.heads_kv < 0 || s.seqlen_q < 0 || s.seqlen_k < 0)
    fail("sizes must be non-negative");
  if (s.head_dim < 1) fail("head_dim must be at least 1");
  if (s.heads_kv == 0 && s.heads_q != 0) fail("heads_kv is 0 but heads_q is not");
  if (s.heads_kv != 0 && s.heads_q % s.heads_kv != 0)
    fail("heads_q (" + std::to_string(s.heads_q) + ") must be a multiple of heads_kv (" +
         std::to_string(s.heads_kv) + ")");
  if (std::isnan(a.softmax_scale)) fail("softmax_scale is NaN");
  const bool any_q = s.batch * s.heads_q * s.seqlen_q > 0;
  const bool any_k = s.batch * s.heads_kv * s.seqlen_k > 0;
  if (any_q && (!a.q.data || !a.o.data)) fail("q and o must not be null");
  if (any_q && any_k && (!a.k.data || !a.v.data)) fail("k and v must not be null");
}

void attention_forward_plain(const AttentionForwardArgs& a) {
  validate(a);
  const AttentionShape& s = a.shape;
  const int64_t D = s.head_dim;
  const double scale = effective_scale(a);
  std::vector<double> scores(static_cast<size_t>(std::max<int64_t>(s.seqlen_k, 1)));
  std::vector<double> acc(static_cast<size_t>(D));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h) {
      const int64_t hk = h / (s.heads_q / s.heads_kv);
      for (int64_t i = 0; i < s.seqlen_q; ++i) {
        const float* q = row_ptr(a.q, b, h, i);
        float* o = row_ptr(a.o, b, h, i);
        const int64_t n = key_end(a, i);
        if (n == 0) {
          std::fill(o, o + D, 0.f);
          write_lse(a, b, h, i, -std::numeric_limits<float>::infinity());
          continue;
        }
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          const float* k = row_ptr(a.k, b, hk, j);
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * k[d];
          scores[j] = dot * scale;
          mx = std::max(mx, scores[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < n; ++j) sum += (scores[j] = std::exp(scores[j] - mx));
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < n; ++j) {
          const float* v = row_ptr(a.v, b, hk, j);
          for (int64_t d = 0; d < D; ++d) acc[d] += scores[j] * v[d];
        }
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<float>(acc[d] / sum);
        write_lse(a, b, h, i, static_cast<float>(mx + std::log(sum)));
      }
    }
}

void attention_forward_tiled(const AttentionForwardArgs& a, int block_m, int block_n) {
  validate(a);
  if (block_m < 1 || block_n < 1) throw std::invalid_argument("attention: block sizes must be positive");
  const AttentionShape& s = a.shape;
  const int64_t D = s.head_dim, Sq = s.seqlen_q, Sk = s.seqlen_k;
  const float scale = static_cast<float>(effective_scale(a));
  const float scale_log2 = scale * std::numbers::log2e_v<float>;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  constexpr float kRescaleThreshold = 0.f;  // as in the kernel

  std::vector<float> row_max(block_m), row_sum(block_m), acc(static_cast<size_t>(block_m) * D),
      p(static_cast<size_t>(block_m) * block_n);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h) {
      const int64_t hk = h / (s.heads_q / s.heads_kv);
      for (int64_t m_start = 0; m_start < Sq; m_start += block_m) {
        const int64_t m_end = std::min<int64_t>(m_start + block_m, Sq);
        const int64_t rows = m_end - m_start;
        // Keys [0, block_key_end) are visible to some row of this block;
        // keys [0, full_end) to every row.
        const int64_t block_key_end = a.causal ? std::min(Sk, m_end + Sk - Sq) : Sk;
        if (block_key_end <= 0) {
          for (int64_t i = m_start; i < m_end; ++i) {
            float* o = row_ptr(a.o, b, h, i);
            std::fill(o, o + D, 0.f);
            write_lse(a, b, h, i, neg_inf);
          }
          continue;
        }
        const int64_t full_end = a.causal ? std::min(Sk, m_start + Sk - Sq + 1) : Sk;
        const int64_t n_blocks = (block_key_end + block_n - 1) / block_n;
        const int64_t n_mask_start = full_end > 0 ? full_end / block_n : 0;

        std::fill(row_max.begin(), row_max.end(), neg_inf);
        std::fill(row_sum.begin(), row_sum.end(), 0.f);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t nb = n_blocks - 1; nb >= 0; --nb) {
          const int64_t n0 = nb * block_n;
          const bool masked = nb >= n_mask_start;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = m_start + r;
            const float* q = row_ptr(a.q, b, h, i);
            const int64_t col_end = masked ? key_end(a, i) : Sk;
            float mx = neg_inf;
            for (int64_t c = 0; c < block_n; ++c) {
              const int64_t j = n0 + c;
              float sc = neg_inf;
              if (j < col_end && j < Sk) {
                const float* k = row_ptr(a.k, b, hk, j);
                float dot = 0.f;
                for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
                sc = dot;
              }
              p[r * block_n + c] = sc;
              mx = std::max(mx, sc);
            }
            // As in the kernel, row_max is the running max in log2 units,
            // moved (and O rescaled) only when the row max grows by more than
            // kRescaleThreshold; a row at -inf has seen only masked keys, so
            // exp2(-inf - 0) = 0 avoids inf - inf.
            const float m_new = mx * scale_log2;
            float corr = 1.f;
            if (m_new > row_max[r] + kRescaleThreshold) {
              corr = row_max[r] == neg_inf ? 0.f : std::exp2(row_max[r] - m_new);
              row_max[r] = m_new;
            }
            const float m_ref = row_max[r] == neg_inf ? 0.f : row_max[r];
            float sum = 0.f;
            for (int64_t c = 0; c < block_n; ++c) {
              const float e = std::exp2(p[r * block_n + c] * scale_log2 - m_ref);
              p[r * block_n + c] = e;
              sum += e;
            }
            row_sum[r] = row_sum[r] * corr + sum;
            float* acc_r = &acc[r * D];
            for (int64_t d = 0; d < D; ++d) acc_r[d] *= corr;
            for (int64_t c = 0; c < block_n && n0 + c < Sk; ++c) {
              const float e = p[r * block_n + c];
              if (e == 0.f) continue;
              const float* v = row_ptr(a.v, b, hk, n0 + c);
              for (int64_t d = 0; d < D; ++d) acc_r[d] += e * v[d];
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = m_start + r;
          float* o = row_ptr(a.o, b, h, i);
          const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
          for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
          write_lse(a, b, h, i,
                    row_sum[r] > 0.f ? (row_max[r] + std::log2(row_sum[r])) * std::numbers::ln2_v<float> : neg_inf);
        }
      }
    }
}

}  // namespace opfuse::kernels::attention
