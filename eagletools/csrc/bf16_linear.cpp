// A bf16 linear for few rows on x86 CPUs with AVX2 and FMA: y = x @ w.T (+ bias).
//
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

}  // namespace

TORCH_LIBRARY(eagletools_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagletools_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
}
