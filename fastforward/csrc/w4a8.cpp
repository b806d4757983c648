// int4 weights x int8 activations for x86 CPUs with AVX-512 VNNI: fastforward::w4a8_linear.
//
// Weights: 4-bit codes c in groups of 32 inputs, w = s * c + m with an fp16 scale s and minimum m per
// group. Activations: each row is quantized in blocks of 32, x = d * q with int8 q and a float d per
// block. The product of one group and one block is s * d * sum(c * q) + m * d * sum(q): an exact
// integer dot product (VPDPBUSD: unsigned codes times signed activations) and two multiplications.
//
// Why it exists: a row's result is computed by the same instructions in the same order whatever the
// number of rows in the call (rows are independent, each output column belongs to one thread), so a
// token's logits are the same bits in a 1-token and a 16-token forward, and the integer dot product
// makes each extra row cost a fraction of the first, which reads the weights.
//
// Layout, for each tile of 16 output columns and each group of 32 inputs: 4 x 64 bytes of codes, byte
// 4 * column + j of register i holding input 4 * i + j in its low nibble and input 4 * (i + 4) + j in
// its high one; then 32 fp16 values, the 16 columns' scales and their 16 minimums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t BLOCK = 32;        // inputs per weight group and per activation block
constexpr int64_t TILE = 16;         // output columns per 512-bit register
constexpr int64_t GROUP_BYTES = 256; // codes of one tile and one group

// q = round-half-even(x / d) with d = max|x| / 127, clamped to [-127, 127]; dsum = d * sum(q).
void quantize_row(const float* x, int64_t blocks, int8_t* q, float* d, float* dsum) {
  const __m512 sign = _mm512_set1_ps(-0.0f), low = _mm512_set1_ps(-127.0f), high = _mm512_set1_ps(127.0f);
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * BLOCK), x1 = _mm512_loadu_ps(x + b * BLOCK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
    const float scale = amax / 127.0f;
    const __m512 inverse = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    const __m512 r0 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(x0, inverse), nearest), low), high);
    const __m512 r1 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(x1, inverse), nearest), low), high);
    const __m512i i0 = _mm512_cvtps_epi32(r0), i1 = _mm512_cvtps_epi32(r1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * BLOCK), _mm512_cvtsepi32_epi8(i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * BLOCK + 16), _mm512_cvtsepi32_epi8(i1));
    d[b] = scale;
    dsum[b] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
  }
}

// R rows times one tile: each group's codes are unpacked once and used for every row.
template <int R>
void tile_rows(const uint8_t* codes, const uint16_t* scales, int64_t groups, const int8_t* q, const float* d,
               const float* dsum, int64_t k, float* y, int64_t n) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* packed = codes + g * GROUP_BYTES;
    __m512i c[8];
    for (int i = 0; i < 4; ++i) {
      const __m512i p = _mm512_loadu_si512(packed + 64 * i);
      c[i] = _mm512_and_si512(p, nibble);
      c[i + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), nibble);
    }
    const __m256i* sm = reinterpret_cast<const __m256i*>(scales + g * 2 * TILE);
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(sm)), m = _mm512_cvtph_ps(_mm256_loadu_si256(sm + 1));
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i)  // rows innermost: R independent chains hide VPDPBUSD's latency
      for (int r = 0; r < R; ++r) {
        const int32_t* quad = reinterpret_cast<const int32_t*>(q + r * k + g * BLOCK);
        dot[r] = _mm512_dpbusd_epi32(dot[r], c[i], _mm512_set1_epi32(quad[i]));
      }
    for (int r = 0; r < R; ++r) {
      const int64_t block = r * (k / BLOCK) + g;
      const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(s, _mm512_set1_ps(d[block])));
      const __m512 v = _mm512_mul_ps(m, _mm512_set1_ps(dsum[block]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(u, v));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, acc[r]);
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [rows, in]");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(), "scales: contiguous float16");
  const int64_t rows = x.size(0), k = x.size(1), tiles = codes.size(0), n = tiles * TILE, groups = k / BLOCK;
  TORCH_CHECK(k % BLOCK == 0 && codes.numel() == tiles * groups * GROUP_BYTES && scales.numel() == tiles * groups * 2 * TILE,
              "codes and scales do not match an input width of ", k);
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kByte));
  at::Tensor block_scales = at::empty({2, rows, groups}, x.options());
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = reinterpret_cast<int8_t*>(q.data_ptr<uint8_t>());
  float *dp = block_scales.data_ptr<float>(), *sump = dp + rows * groups, *yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * k, groups, qp + r * k, dp + r * groups, sump + r * groups);
  });
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* c = cp + t * groups * GROUP_BYTES;
      const uint16_t* s = sp + t * groups * 2 * TILE;
      float* out = yp + t * TILE;
      int64_t r = 0;
      for (; r + 8 <= rows; r += 8) tile_rows<8>(c, s, groups, qp + r * k, dp + r * groups, sump + r * groups, k, out + r * n, n);
      for (; r + 4 <= rows; r += 4) tile_rows<4>(c, s, groups, qp + r * k, dp + r * groups, sump + r * groups, k, out + r * n, n);
      for (; r + 2 <= rows; r += 2) tile_rows<2>(c, s, groups, qp + r * k, dp + r * groups, sump + r * groups, k, out + r * n, n);
      for (; r < rows; ++r) tile_rows<1>(c, s, groups, qp + r * k, dp + r * groups, sump + r * groups, k, out + r * n, n);
    }
  });
  return y;
}

}  // namespace

// The schema is defined in fastforward/native.py, beside its shape function for torch.compile.
TORCH_LIBRARY_IMPL(fastforward, CPU, m) { m.impl("w4a8_linear", &w4a8_linear); }
