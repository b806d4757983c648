// Float vectors of the widest kind the build targets (fastforward/native.py picks the flags): AVX-512
// (16 lanes) where the CPU has it, else AVX2 (8 lanes). The kernels are written once against these
// functions. Every reduction runs in a fixed order, so a result depends on its inputs alone.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace simd {

#if defined(__AVX512F__)

constexpr int64_t LANES = 16;
using Floats = __m512;

inline Floats zeros() { return _mm512_setzero_ps(); }
inline Floats broadcast(float x) { return _mm512_set1_ps(x); }
inline Floats load(const float* p) { return _mm512_loadu_ps(p); }
inline Floats load(const at::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline Floats load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store(float* p, Floats x) { _mm512_storeu_ps(p, x); }
inline Floats add(Floats a, Floats b) { return _mm512_add_ps(a, b); }
inline Floats sub(Floats a, Floats b) { return _mm512_sub_ps(a, b); }
inline Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline Floats max(Floats a, Floats b) { return _mm512_max_ps(a, b); }
inline Floats min(Floats a, Floats b) { return _mm512_min_ps(a, b); }
inline Floats abs(Floats x) { return _mm512_andnot_ps(_mm512_set1_ps(-0.0f), x); }
inline Floats round_even(Floats x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float sum(Floats x) { return _mm512_reduce_add_ps(x); }
inline float largest(Floats x) { return _mm512_reduce_max_ps(x); }
// x where x >= bound, else 0
inline Floats zero_below(Floats x, Floats test, Floats bound) {
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(test, bound, _CMP_LT_OQ)), x);
}
// 2^n for integral n in [-126, 127]
inline Floats power_of_two(Floats n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// Integral values in [-127, 127] to int8 at p (LANES bytes).
inline void store_int8(int8_t* p, Floats x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(x)));
}

#elif defined(__AVX2__)

constexpr int64_t LANES = 8;
using Floats = __m256;

inline Floats zeros() { return _mm256_setzero_ps(); }
inline Floats broadcast(float x) { return _mm256_set1_ps(x); }
inline Floats load(const float* p) { return _mm256_loadu_ps(p); }
inline Floats load(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline Floats load_half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store(float* p, Floats x) { _mm256_storeu_ps(p, x); }
inline Floats add(Floats a, Floats b) { return _mm256_add_ps(a, b); }
inline Floats sub(Floats a, Floats b) { return _mm256_sub_ps(a, b); }
inline Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
inline Floats max(Floats a, Floats b) { return _mm256_max_ps(a, b); }
inline Floats min(Floats a, Floats b) { return _mm256_min_ps(a, b); }
inline Floats abs(Floats x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
inline Floats round_even(Floats x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float sum(Floats x) {  // halves, then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float largest(Floats x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline Floats zero_below(Floats x, Floats test, Floats bound) {
  return _mm256_andnot_ps(_mm256_cmp_ps(test, bound, _CMP_LT_OQ), x);
}
inline Floats power_of_two(Floats n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline void store_int8(int8_t* p, Floats x) {
  const __m256i wide = _mm256_cvtps_epi32(x);
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
}

#else
#error "fastforward's native kernels need AVX2 or AVX-512"
#endif

// exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, times 2^n.
// Inputs below -87 give 0 (a weight e^-87 is below float32's normal range).
inline Floats exp_nonpositive(Floats x) {
  const Floats floor_x = broadcast(-87.0f);
  const Floats clamped = max(x, floor_x);
  const Floats n = round_even(mul(clamped, broadcast(1.44269504088896341f)));
  Floats r = sub(clamped, mul(n, broadcast(0.693359375f)));
  r = sub(r, mul(n, broadcast(-2.12194440e-4f)));
  Floats p = broadcast(1.9875691500e-4f);
  p = add(mul(p, r), broadcast(1.3981999507e-3f));
  p = add(mul(p, r), broadcast(8.3334519073e-3f));
  p = add(mul(p, r), broadcast(4.1665795894e-2f));
  p = add(mul(p, r), broadcast(1.6666665459e-1f));
  p = add(mul(p, r), broadcast(5.0000001201e-1f));
  p = add(mul(mul(p, r), r), add(r, broadcast(1.0f)));
  return zero_below(mul(p, power_of_two(n)), x, floor_x);
}

}  // namespace simd
