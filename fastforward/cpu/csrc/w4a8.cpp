// int4 weights x int8 activations for x86 CPUs with AVX2 or AVX-512 VNNI: fastforward::w4a8_linear.
//
// Weights: 4-bit codes c in groups of 32 inputs, w = s * c + m with an fp16 scale s and minimum m per
// group. Activations: each row is quantized in blocks of 32, x = d * q with int8 q and a float d per
// block. The product of one group and one block is s * d * sum(c * q) + m * d * sum(q): an exact
// integer dot product (unsigned codes times signed activations: VPDPBUSD with VNNI, else VPMADDUBSW
// and VPMADDWD) and two multiplications.
//
// Why it exists: a row's result is computed by the same instructions in the same order whatever the
// number of rows in the call (rows are independent, each output column belongs to one thread), so a
// token's logits are the same bits in a 1-token and a 16-token forward, and the integer dot product
// makes each extra row cost a fraction of the first, which reads the weights. The integer sums are
// exact and the float operations per column run in one order, so both instruction sets give the
// same bits.
//
// Layout, for each tile of 16 output columns and each group of 32 inputs: 4 x 64 bytes of codes, byte
// 4 * column + j of block i holding input 4 * i + j in its low nibble and input 4 * (i + 4) + j in
// its high one; then 32 fp16 values, the 16 columns' scales and their 16 minimums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

using simd::Floats;

constexpr int64_t BLOCK = 32;        // inputs per weight group and per activation block
constexpr int64_t TILE = 16;         // output columns per tile
constexpr int64_t GROUP_BYTES = 256; // codes of one tile and one group
constexpr int64_t MIN_WORK = 512;    // group-tiles (group x tile x row products) worth a thread

// q = round-half-even(x / d) with d = max|x| / 127, clamped to [-127, 127]; dsum = d * sum(q).
void quantize_row(const float* x, int64_t blocks, int8_t* q, float* d, float* dsum) {
  constexpr int64_t parts = BLOCK / simd::LANES;
  const Floats low = simd::broadcast(-127.0f), high = simd::broadcast(127.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    Floats v[parts], amax = simd::zeros();
    for (int64_t i = 0; i < parts; ++i) {
      v[i] = simd::load(x + b * BLOCK + i * simd::LANES);
      amax = simd::max(amax, simd::abs(v[i]));
    }
    const float scale = simd::largest(amax) / 127.0f;
    const Floats inverse = simd::broadcast(scale > 0.0f ? 1.0f / scale : 0.0f);
    Floats total = simd::zeros();  // integers below 2^24: summed exactly in any order
    for (int64_t i = 0; i < parts; ++i) {
      const Floats r = simd::min(simd::max(simd::round_even(simd::mul(v[i], inverse)), low), high);
      simd::store_int8(q + b * BLOCK + i * simd::LANES, r);
      total = simd::add(total, r);
    }
    d[b] = scale;
    dsum[b] = scale * simd::sum(total);
  }
}

#if defined(__AVX512VNNI__)

constexpr int MAX_ROWS = 8;
template <int R>
constexpr int CHAINS = R >= 4 ? 1 : 4 / R;

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
    const __m512 s = simd::load_half(scales + g * 2 * TILE), m = simd::load_half(scales + g * 2 * TILE + TILE);
    // R x CHAINS independent VPDPBUSD chains hide its latency: with few rows each row's eight products
    // go to several partial sums, added after (integer sums: exact, so the bits do not depend on R).
    __m512i dot[R][CHAINS<R>];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < CHAINS<R>; ++j) dot[r][j] = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i)  // rows innermost
      for (int r = 0; r < R; ++r) {
        const int32_t* quad = reinterpret_cast<const int32_t*>(q + r * k + g * BLOCK);
        __m512i& sum = dot[r][i % CHAINS<R>];
        sum = _mm512_dpbusd_epi32(sum, c[i], _mm512_set1_epi32(quad[i]));
      }
    for (int r = 0; r < R; ++r) {
      const int64_t block = r * (k / BLOCK) + g;
      __m512i total = dot[r][0];
      for (int j = 1; j < CHAINS<R>; ++j) total = _mm512_add_epi32(total, dot[r][j]);
      const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(s, _mm512_set1_ps(d[block])));
      const __m512 v = _mm512_mul_ps(m, _mm512_set1_ps(dsum[block]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(u, v));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, acc[r]);
}

#else  // AVX2

constexpr int MAX_ROWS = 4;  // sixteen registers: 8 of codes, R sums and the rest

// R rows times one tile, one half of 8 columns after the other (a tile's codes stay in L1 between
// them). Products of codes and activations are summed in pairs by VPMADDUBSW into 16 bits, which
// cannot overflow (8 x 2 x 15 x 127 < 32768), then widened by VPMADDWD against ones.
template <int R>
void tile_rows(const uint8_t* codes, const uint16_t* scales, int64_t groups, const int8_t* q, const float* d,
               const float* dsum, int64_t k, float* y, int64_t n) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* packed = codes + g * GROUP_BYTES + 32 * half;
      __m256i c[8];
      for (int i = 0; i < 4; ++i) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 64 * i));
        c[i] = _mm256_and_si256(p, nibble);
        c[i + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), nibble);
      }
      const uint16_t* sm = scales + g * 2 * TILE + 8 * half;
      const __m256 s = simd::load_half(sm), m = simd::load_half(sm + TILE);
      __m256i pairs[R];
      for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
      for (int i = 0; i < 8; ++i)
        for (int r = 0; r < R; ++r) {
          const int32_t* quad = reinterpret_cast<const int32_t*>(q + r * k + g * BLOCK);
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(c[i], _mm256_set1_epi32(quad[i])));
        }
      for (int r = 0; r < R; ++r) {
        const int64_t block = r * (k / BLOCK) + g;
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[r], ones));
        const __m256 u = _mm256_mul_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(d[block])));
        const __m256 v = _mm256_mul_ps(m, _mm256_set1_ps(dsum[block]));
        acc[r] = _mm256_add_ps(acc[r], _mm256_add_ps(u, v));
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * n + 8 * half, acc[r]);
  }
}

#endif

// x: [..., in] of any layout and floating dtype, computed in float32; y: [..., out] in x's dtype. The
// layout and dtype are handled here rather than in the layer's Python forward: an eager one-token step
// of SmolLM2-135M makes 211 of these calls, and each Python-side view or check costs a dispatcher call.
at::Tensor w4a8_linear(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(input.dim() >= 1 && at::isFloatingType(input.scalar_type()), "x: floating point [..., in]");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(), "scales: contiguous float16");
  const at::Tensor x = input.scalar_type() == at::kFloat ? input.contiguous() : input.to(at::kFloat).contiguous();
  const int64_t k = x.size(-1), rows = k > 0 ? x.numel() / k : 0, tiles = codes.size(0), n = tiles * TILE, groups = k / BLOCK;
  TORCH_CHECK(k % BLOCK == 0 && codes.numel() == tiles * groups * GROUP_BYTES && scales.numel() == tiles * groups * 2 * TILE,
              "codes and scales do not match an input width of ", k);
  // The quantized rows live in the calling thread's scratch, which only grows: a one-token step of
  // SmolLM2-135M calls this 211 times, and its profile showed the tensor allocations
  // (docs/notes/2026-11-avx2-kernels.md).
  thread_local std::vector<int8_t> quantized;
  thread_local std::vector<float> block_scales;
  quantized.resize(std::max<size_t>(quantized.size(), rows * k));
  block_scales.resize(std::max<size_t>(block_scales.size(), 2 * rows * groups));
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = quantized.data();
  float *dp = block_scales.data(), *sump = dp + rows * groups, *yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * k, groups, qp + r * k, dp + r * groups, sump + r * groups);
  });
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  // A thread takes at least MIN_WORK group-tiles: waking the other thread costs more than a small
  // layer's whole product (measured: SmolLM2-135M's 576 -> 192 projection for one token).
  const int64_t grain = std::max<int64_t>(1, (MIN_WORK + groups * rows - 1) / std::max<int64_t>(1, groups * rows));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* c = cp + t * groups * GROUP_BYTES;
      const uint16_t* s = sp + t * groups * 2 * TILE;
      float* out = yp + t * TILE;
      int64_t r = 0;
      if constexpr (MAX_ROWS >= 8)
        for (; r + 8 <= rows; r += 8) tile_rows<8>(c, s, groups, qp + r * k, dp + r * groups, sump + r * groups, k, out + r * n, n);
      for (; r + 4 <= rows; r += 4) tile_rows<4>(c, s, groups, qp + r * k, dp + r * groups, sump + r * groups, k, out + r * n, n);
      for (; r + 2 <= rows; r += 2) tile_rows<2>(c, s, groups, qp + r * k, dp + r * groups, sump + r * groups, k, out + r * n, n);
      for (; r < rows; ++r) tile_rows<1>(c, s, groups, qp + r * k, dp + r * groups, sump + r * groups, k, out + r * n, n);
    }
  });
  return input.scalar_type() == at::kFloat ? y : y.to(input.scalar_type());
}

}  // namespace

// The schema is defined in fastforward/native.py, beside its shape function for torch.compile.
TORCH_LIBRARY_IMPL(fastforward, CPU, m) { m.impl("w4a8_linear", &w4a8_linear); }
