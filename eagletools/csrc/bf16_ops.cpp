// bf16 ops of a decoding step on x86 CPUs with AVX2 and FMA, for few rows.
//
// bf16_linear: y = x @ w.T (+ bias).
// Decoding multiplies 1 to 64 rows by each weight. On CPUs without AVX-512 BF16
// (no oneDNN packing) torch's bf16 product of 4 rows takes 3x the time of one
// (benchmarks/gemv.py); this one reads each weight row once for every 3 input
// rows, widening bf16 to fp32 in registers. Every output is one fp32 sum in a
// fixed order, so a row's result never depends on how many rows share the call
// (exact decoding: a token alone and in a draft tree get the same bits).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;
constexpr int kSums = 4;  // partial sums per output: chunk c goes to sum c % 4
constexpr int kRows = 3;  // input rows per pass over a weight row: 3 x 4 sums in registers

inline __m256 widen(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float total(const __m256* sums) {
  __m256 s = _mm256_add_ps(_mm256_add_ps(sums[0], sums[1]), _mm256_add_ps(sums[2], sums[3]));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// out[r] = x[r] . w for R input rows and one weight row, each widened 8-lane
// chunk of w read once for all R. Every output is the same arithmetic whatever R:
// chunk c into partial sum c % 4, the sums added in a fixed tree, then the tail.
template <int R>
inline void dots(const float* x, const at::BFloat16* w, int64_t k, float* out) {
  __m256 sums[R][kSums];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < kSums; ++s) sums[r][s] = _mm256_setzero_ps();
  const int64_t chunks = k / kLanes;
  int64_t c = 0;
  for (; c + kSums <= chunks; c += kSums)
    for (int s = 0; s < kSums; ++s) {
      const __m256 wv = widen(w + (c + s) * kLanes);
      for (int r = 0; r < R; ++r)
        sums[r][s] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + (c + s) * kLanes), wv, sums[r][s]);
    }
  for (int s = 0; c < chunks; ++c, ++s) {
    const __m256 wv = widen(w + c * kLanes);
    for (int r = 0; r < R; ++r)
      sums[r][s] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + c * kLanes), wv, sums[r][s]);
  }
  for (int r = 0; r < R; ++r) {
    float t = total(sums[r]);
    for (int64_t i = chunks * kLanes; i < k; ++i) t += x[r * k + i] * static_cast<float>(w[i]);
    out[r] = t;
  }
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dtype() == at::kBFloat16 && w.dtype() == at::kBFloat16, "bf16_linear: bf16 only");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "bf16_linear: shapes ", x.sizes(), " and ", w.sizes());
  const int64_t k = w.size(1), n = w.size(0);
  const at::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const at::Tensor weight = w.contiguous();
  const int64_t m = rows.size(0);
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = at::empty({m, n}, x.options());
  const float* xp = rows.data_ptr<float>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(m);
    for (int64_t j = begin; j < end; ++j) {
      const at::BFloat16* row = wp + j * k;
      int64_t r = 0;
      for (; r + kRows <= m; r += kRows) dots<kRows>(xp + r * k, row, k, acc.data() + r);
      for (; r < m; ++r) dots<1>(xp + r * k, row, k, acc.data() + r);
      for (r = 0; r < m; ++r) op[r * n + j] = at::BFloat16(acc[r] + (bp ? bp[j] : 0.0f));
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

// rms_norm: w * bf16(x * rsqrt(mean(x^2) + eps)) per row, in fp32 as Hugging Face's
// Llama norm computes it (two bf16 roundings). One call instead of torch's ~50 us
// of small ops per norm at one row, 61 norms a SmolLM2 token.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dtype() == at::kBFloat16 && w.dtype() == at::kBFloat16, "rms_norm: bf16 only");
  const int64_t d = w.numel();
  TORCH_CHECK(x.size(-1) == d, "rms_norm: shapes ", x.sizes(), " and ", w.sizes());
  const at::Tensor rows = x.contiguous(), weight = w.contiguous();
  at::Tensor out = at::empty_like(rows);
  const at::BFloat16* xp = rows.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t m = rows.numel() / d;
  for (int64_t r = 0; r < m; ++r) {
    const at::BFloat16* row = xp + r * d;
    float squares = 0.0f;
    for (int64_t i = 0; i < d; ++i) squares += static_cast<float>(row[i]) * static_cast<float>(row[i]);
    const float scale = 1.0f / std::sqrt(squares / static_cast<float>(d) + static_cast<float>(eps));
    for (int64_t i = 0; i < d; ++i) {
      const at::BFloat16 normed(static_cast<float>(row[i]) * scale);
      op[r * d + i] = at::BFloat16(static_cast<float>(wp[i]) * static_cast<float>(normed));
    }
  }
  return out;
}

// few_query_attention: softmax(q k^T * scale, masked) v for few queries over a KV
// cache, the query heads grouped over the KV heads. Each (query, key) score is
// one fp32 sum in a fixed order; the softmax and the value sum run in double over
// the visible keys in slot order, so a query's output does not depend on the
// other queries or on hidden keys between its visible ones (a draft tree's): the
// numerics of decode.model.attention's exact path, in one call per layer.
// x . y in fp32: 8-lane chunks into one sum in order, a fixed horizontal sum, the tail.
inline float dot(const float* x, const float* y, int64_t d) {
  __m256 sum = _mm256_setzero_ps();
  const int64_t vec = d / kLanes * kLanes;
  for (int64_t i = 0; i < vec; i += kLanes)
    sum = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), sum);
  const __m256 zero = _mm256_setzero_ps();
  const __m256 parts[kSums] = {sum, zero, zero, zero};
  float t = total(parts);
  for (int64_t i = vec; i < d; ++i) t += x[i] * y[i];
  return t;
}

template <typename V>
void attend_one(const float* q, const float* k, int64_t k_stride, const V* v,
                int64_t v_stride, const bool* mask, int64_t s, int64_t d, float scale,
                std::vector<double>& scores, double* out) {
  double top = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < s; ++j) {
    if (mask && !mask[j]) continue;
    scores[j] = static_cast<double>(dot(q, k + j * k_stride, d) * scale);
    top = std::max(top, scores[j]);
  }
  double total = 0.0;
  for (int64_t i = 0; i < d; ++i) out[i] = 0.0;
  for (int64_t j = 0; j < s; ++j) {
    if (mask && !mask[j]) continue;
    const double p = std::exp(scores[j] - top);
    total += p;
    const V* value = v + j * v_stride;
    for (int64_t i = 0; i < d; ++i) out[i] += p * static_cast<double>(value[i]);
  }
  for (int64_t i = 0; i < d; ++i) out[i] /= total;
}

at::Tensor few_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "few_query_attention: 4-d q, k, v");
  TORCH_CHECK(k.scalar_type() == at::kFloat, "few_query_attention: an fp32 K cache");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "few_query_attention: rows of K, V contiguous");
  const int64_t b = q.size(0), hq = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t hkv = k.size(1), s = k.size(2), group = hq / hkv;
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor m;  // [B, T, S] bool, or undefined: every key visible
  if (mask.has_value()) m = mask->expand({b, t, s}).contiguous();
  at::Tensor out = at::empty({b, hq, t, d}, q.options().dtype(at::kDouble));
  const float* qp = qf.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const bool* mp = m.defined() ? m.data_ptr<bool>() : nullptr;
  double* op = out.data_ptr<double>();
  const float fscale = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "few_query_attention", [&] {
    const scalar_t* vp = v.data_ptr<scalar_t>();
    at::parallel_for(0, b * hq * t, 1, [&](int64_t begin, int64_t end) {
      std::vector<double> scores(s);
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t bi = idx / (hq * t), h = idx / t % hq, ti = idx % t, kv = h / group;
        attend_one(qp + idx * d, kp + bi * k.stride(0) + kv * k.stride(1), k.stride(2),
                   vp + bi * v.stride(0) + kv * v.stride(1), v.stride(2),
                   mp ? mp + (bi * t + ti) * s : nullptr, s, d, fscale, scores, op + idx * d);
      }
    });
  });
  return out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY(eagletools_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("few_query_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagletools_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("few_query_attention", &few_query_attention);
}
