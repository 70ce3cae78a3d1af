// A bf16 linear for few rows on x86 CPUs with AVX2 and FMA: y = x @ w.T (+ bias).
//
// Decoding multiplies 1 to 64 rows by each weight. On CPUs without AVX-512 BF16
// (no oneDNN packing) torch's bf16 product of 4 rows takes 3x the time of one
// (docs/lab.md, Part 8); this one reads each tile of 4 weight rows once for all
// rows, widening bf16 to fp32 in registers (one row) or once into a small fp32
// copy (more rows). Every output is one fp32 sum in a fixed order, so a row's
// result never depends on how many rows share the call (exact decoding).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kBlock = 4;  // weight rows per tile
constexpr int64_t kRows = 3;   // input rows per tile once a tile is widened: 3 x 4 sums in registers

// The 8 weights at p as fp32: widened from bf16, or read from a widened copy.
inline __m256 lanes(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 lanes(const float* p) { return _mm256_loadu_ps(p); }

inline float total(__m256 s) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// out[r * ldo + j] = x[r] . w[j] for R input rows and B weight rows. Every output
// is one fp32 sum over the 8-lane chunks in order, then a fixed horizontal sum,
// then the tail: the same arithmetic whatever R, B or W's type.
template <int R, int B, typename W>
inline void dots(const float* x, const W* w, int64_t k, float* out, int64_t ldo) {
  __m256 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t vec = k / kLanes * kLanes;
  for (int64_t i = 0; i < vec; i += kLanes) {
    __m256 wv[B];
    for (int j = 0; j < B; ++j) wv[j] = lanes(w + j * k + i);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k + i);
      for (int j = 0; j < B; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) {
      float s = total(acc[r][j]);
      for (int64_t t = vec; t < k; ++t) s += x[r * k + t] * static_cast<float>(w[j * k + t]);
      out[r * ldo + j] = s;
    }
}

// Rows [0, m) against one tile of B weight rows: a lone row reads the bf16 weight,
// more rows share a widened fp32 copy of the tile (`wide`, B * k floats).
template <int B>
void tile(const float* x, int64_t m, const at::BFloat16* w, int64_t k, float* wide, float* out, int64_t ldo) {
  if (m == 1) return dots<1, B>(x, w, k, out, ldo);
  const int64_t size = B * k, vec = size / kLanes * kLanes;
  for (int64_t i = 0; i < vec; i += kLanes) _mm256_storeu_ps(wide + i, lanes(w + i));
  for (int64_t i = vec; i < size; ++i) wide[i] = static_cast<float>(w[i]);
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) dots<kRows, B>(x + r * k, wide, k, out + r * ldo, ldo);
  for (; r < m; ++r) dots<1, B>(x + r * k, wide, k, out + r * ldo, ldo);
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
  const int64_t tiles = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(kBlock * k), acc(m * kBlock);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = t * kBlock, width = std::min(kBlock, n - j0);
      if (width == kBlock) {
        tile<kBlock>(xp, m, wp + j0 * k, k, wide.data(), acc.data(), kBlock);
      } else {
        for (int64_t j = 0; j < width; ++j) tile<1>(xp, m, wp + (j0 + j) * k, k, wide.data(), acc.data() + j, kBlock);
      }
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < width; ++j)
          op[r * n + j0 + j] = at::BFloat16(acc[r * kBlock + j] + (bp ? bp[j0 + j] : 0.0f));
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
