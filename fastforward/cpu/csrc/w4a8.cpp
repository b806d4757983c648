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

// R rows times one tile: each group's codes are unpacked once and used for every row. ADD: the
// products are added to what y holds (one float addition per output) instead of replacing it.
template <int R, bool ADD>
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
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(y + r * n, ADD ? _mm512_add_ps(_mm512_loadu_ps(y + r * n), acc[r]) : acc[r]);
}

#else  // AVX2

constexpr int MAX_ROWS = 4;  // sixteen registers: 8 of codes, R sums and the rest

// R rows times one tile, one half of 8 columns after the other (a tile's codes stay in L1 between
// them). Products of codes and activations are summed in pairs by VPMADDUBSW into 16 bits, which
// cannot overflow (8 x 2 x 15 x 127 < 32768), then widened by VPMADDWD against ones. ADD: as above.
template <int R, bool ADD>
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
    for (int r = 0; r < R; ++r) {
      float* out = y + r * n + 8 * half;
      _mm256_storeu_ps(out, ADD ? _mm256_add_ps(_mm256_loadu_ps(out), acc[r]) : acc[r]);
    }
  }
}

#endif

// Rows of activations quantized per block of 32 (`quantize_row`), `width` inputs a row, kept in the calling
// thread's scratch, which only grows: a one-token step of SmolLM2-135M makes 211 calls, and its profile
// showed the tensor allocations (docs/notes/2026-11-avx2-kernels.md).
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> scales;  // every block's d, then every block's d * sum(q)
  int64_t width = 0, blocks = 0;
  const int8_t* rows = nullptr;
  const float *d = nullptr, *dsum = nullptr;

  void reserve(int64_t count, int64_t row_width) {
    width = row_width, blocks = row_width / BLOCK;
    q.resize(std::max<size_t>(q.size(), count * width));
    scales.resize(std::max<size_t>(scales.size(), 2 * count * blocks));
    rows = q.data(), d = scales.data(), dsum = scales.data() + count * blocks;
  }

  // Rows of k inputs at x (one after the other) into the inputs [at, at + k) of this scratch's `count` rows.
  void fill(const float* x, int64_t count, int64_t k, int64_t at) {
    int8_t* qp = q.data() + at;
    float *dp = scales.data() + at / BLOCK, *sump = dp + count * blocks;
    const int64_t stride = width, per_row = blocks;
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        quantize_row(x + r * k, k / BLOCK, qp + r * stride, dp + r * per_row, sump + r * per_row);
    });
  }
};

// One tile's `groups` groups (codes and scales from the first of them) times the inputs from block `block`
// on of every row of `a`, into y (ADD: added to it).
template <bool ADD>
void tile(const uint8_t* c, const uint16_t* s, int64_t groups, const Quantized& a, int64_t block, int64_t rows, float* y,
          int64_t n) {
  const int64_t k = a.width, blocks = a.blocks;
  const int8_t* q = a.rows + block * BLOCK;
  const float *d = a.d + block, *dsum = a.dsum + block;
  int64_t r = 0;
  if constexpr (MAX_ROWS >= 8)
    for (; r + 8 <= rows; r += 8) tile_rows<8, ADD>(c, s, groups, q + r * k, d + r * blocks, dsum + r * blocks, k, y + r * n, n);
  for (; r + 4 <= rows; r += 4) tile_rows<4, ADD>(c, s, groups, q + r * k, d + r * blocks, dsum + r * blocks, k, y + r * n, n);
  for (; r + 2 <= rows; r += 2) tile_rows<2, ADD>(c, s, groups, q + r * k, d + r * blocks, dsum + r * blocks, k, y + r * n, n);
  for (; r < rows; ++r) tile_rows<1, ADD>(c, s, groups, q + r * k, d + r * blocks, dsum + r * blocks, k, y + r * n, n);
}

void check_packed(const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(), "scales: contiguous float16");
}

// The input as contiguous float32 rows: any layout and floating dtype is taken here rather than in the
// layer's Python forward, where each view or check costs a dispatcher call.
at::Tensor float_rows(const at::Tensor& input) {
  TORCH_CHECK(input.dim() >= 1 && at::isFloatingType(input.scalar_type()), "x: floating point [..., in]");
  return input.scalar_type() == at::kFloat ? input.contiguous() : input.to(at::kFloat).contiguous();
}

// The float32 output [..., n] of a float32 x [..., k].
at::Tensor output_for(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return at::empty(shape, x.options());
}

// Tiles of `groups * rows` group-tiles each that a thread takes at least: MIN_WORK's worth, since waking the
// other thread costs more than a small layer's whole product (measured: SmolLM2-135M's 576 -> 192
// projection for one token).
int64_t grain(int64_t groups, int64_t rows) {
  const int64_t work = std::max<int64_t>(1, groups * rows);
  return std::max<int64_t>(1, (MIN_WORK + work - 1) / work);
}

// x: [..., in] of any layout and floating dtype, computed in float32; y: [..., out] in x's dtype.
at::Tensor w4a8_linear(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales) {
  const at::Tensor x = float_rows(input);
  const int64_t k = x.size(-1), rows = k > 0 ? x.numel() / k : 0, groups = k / BLOCK;
  check_packed(codes, scales);
  const int64_t tiles = codes.size(0), n = tiles * TILE;
  TORCH_CHECK(k % BLOCK == 0 && codes.numel() == tiles * groups * GROUP_BYTES && scales.numel() == tiles * groups * 2 * TILE,
              "codes and scales do not match an input width of ", k);
  thread_local Quantized scratch;
  const Quantized& activations = scratch;  // the caller's: a thread_local named in a lambda is the running thread's
  scratch.reserve(rows, k);
  scratch.fill(x.data_ptr<float>(), rows, k, 0);
  at::Tensor y = output_for(x, n);
  float* yp = y.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  at::parallel_for(0, tiles, grain(groups, rows), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      tile<false>(cp + t * groups * GROUP_BYTES, sp + t * groups * 2 * TILE, groups, activations, 0, rows, yp + t * TILE, n);
  });
  return input.scalar_type() == at::kFloat ? y : y.to(input.scalar_type());
}

// y = W x + B h with h = A x: a low-rank update beside int4 weights (fastforward/cpu/low_rank.py) in one
// call, the same bits, for float32 inputs, as w4a8_linear of [W; A], then w4a8_linear of B on the
// product's last `rank` columns, and their sum. h is quantized per row as that second call would, and
// each tile of y adds B's product to W's where it was computed, so B costs no call, slice, copy or
// addition of its own; and B's codes follow W's in each tile's stretch of the weights, which the CPU
// reads as one stream (read on their own, B's few bytes a tile cost as much as a tenth of W's).
//
// codes, scales: A's rank / 16 tiles of k / 32 groups, then for each tile of y's columns W's k / 32
// groups and B's groups [first, end) (up_groups, int32 [tiles, 2]); B's other groups are zero and left
// out (a fused group's B is block-diagonal: `LowRank.side_by_side`), which changes no bits.
at::Tensor w4a8_lowrank(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& up_groups, int64_t rank) {
  const at::Tensor x = float_rows(input);
  const int64_t k = x.size(-1), rows = k > 0 ? x.numel() / k : 0, groups = k / BLOCK;
  check_packed(codes, scales);
  TORCH_CHECK(k % BLOCK == 0 && rank > 0 && rank % BLOCK == 0, "input width and rank: whole blocks of ", BLOCK);
  TORCH_CHECK(up_groups.scalar_type() == at::kInt && up_groups.is_contiguous() && up_groups.dim() == 2 && up_groups.size(1) == 2,
              "up_groups: contiguous int32 [tiles, 2]");
  const int64_t tiles = up_groups.size(0), n = tiles * TILE, rank_blocks = rank / BLOCK;
  const int32_t* ranges = up_groups.data_ptr<int32_t>();
  std::vector<int64_t> start(tiles + 1);  // each tile's first group in codes
  start[0] = rank / TILE * groups;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t first = ranges[2 * t], end = ranges[2 * t + 1];
    TORCH_CHECK(0 <= first && first <= end && end <= rank_blocks, "up_groups out of range");
    start[t + 1] = start[t] + groups + end - first;
  }
  TORCH_CHECK(codes.numel() == start[tiles] * GROUP_BYTES && scales.numel() == start[tiles] * 2 * TILE,
              "codes and scales do not match an input width of ", k, ", a rank of ", rank, " and up_groups");
  thread_local Quantized scratch;  // x's quantized rows, then h's beside them
  thread_local std::vector<float> scratch_h;
  const Quantized& inputs = scratch;  // the caller's: a thread_local named in a lambda is the running thread's
  scratch.reserve(rows, k + rank);
  scratch.fill(x.data_ptr<float>(), rows, k, 0);
  scratch_h.resize(std::max<size_t>(scratch_h.size(), rows * rank));
  float* hp = scratch_h.data();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  at::parallel_for(0, rank / TILE, grain(groups, rows), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      tile<false>(cp + t * groups * GROUP_BYTES, sp + t * groups * 2 * TILE, groups, inputs, 0, rows, hp + t * TILE, rank);
  });
  scratch.fill(hp, rows, rank, k);
  at::Tensor y = output_for(x, n);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, grain(groups + rank_blocks, rows), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = start[t], first = ranges[2 * t], used = ranges[2 * t + 1] - first;
      tile<false>(cp + g * GROUP_BYTES, sp + g * 2 * TILE, groups, inputs, 0, rows, yp + t * TILE, n);
      if (used > 0)
        tile<true>(cp + (g + groups) * GROUP_BYTES, sp + (g + groups) * 2 * TILE, used, inputs, groups + first, rows, yp + t * TILE, n);
    }
  });
  return input.scalar_type() == at::kFloat ? y : y.to(input.scalar_type());
}

}  // namespace

// The schemas are defined in fastforward/native.py, beside their shape functions for torch.compile.
TORCH_LIBRARY_IMPL(fastforward, CPU, m) {
  m.impl("w4a8_linear", &w4a8_linear);
  m.impl("w4a8_lowrank", &w4a8_lowrank);
}
