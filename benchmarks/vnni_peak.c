// The CPU's peak rate of int8 multiply-adds with AVX-512 VNNI (VPDPBUSD), the instruction the native
// int4 kernel (fastforward/csrc/w4a8.cpp) spends its time in: twelve independent accumulator chains per
// thread, so the rate is the instruction's throughput, not its latency. The ceiling that kernel's time
// per extra row cannot beat (docs/results.md, "Native int4 kernel"). Prints the best of 3 runs.
//
//   gcc -O2 -mavx512f -mavx512bw -mavx512vnni -fopenmp benchmarks/vnni_peak.c -o /tmp/vnni_peak
//   OMP_NUM_THREADS=2 /tmp/vnni_peak
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#define CHAINS 12

int main(void) {
  const long rounds = 200000000L / CHAINS;
  double best = 0.0;
  for (int run = 0; run < 3; ++run) {
    const double started = omp_get_wtime();
    long checksum = 0;
#pragma omp parallel reduction(+ : checksum)
    {
      const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
      __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
      __m512i c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
      for (long i = 0; i < rounds; ++i) {  // named registers: an array would be kept in memory
        c0 = _mm512_dpbusd_epi32(c0, a, b), c1 = _mm512_dpbusd_epi32(c1, a, b), c2 = _mm512_dpbusd_epi32(c2, a, b);
        c3 = _mm512_dpbusd_epi32(c3, a, b), c4 = _mm512_dpbusd_epi32(c4, a, b), c5 = _mm512_dpbusd_epi32(c5, a, b);
        c6 = _mm512_dpbusd_epi32(c6, a, b), c7 = _mm512_dpbusd_epi32(c7, a, b), c8 = _mm512_dpbusd_epi32(c8, a, b);
        c9 = _mm512_dpbusd_epi32(c9, a, b), c10 = _mm512_dpbusd_epi32(c10, a, b), c11 = _mm512_dpbusd_epi32(c11, a, b);
        __asm__ volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5));
        __asm__ volatile("" : "+v"(c6), "+v"(c7), "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11));
      }
      __m512i sum = _mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3));
      sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
      sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)));
      checksum += _mm512_reduce_add_epi32(sum) & 1;  // keeps the work observable
    }
    const double seconds = omp_get_wtime() - started;
    const double gmacs = (double)rounds * CHAINS * 64 * omp_get_max_threads() / seconds / 1e9;
    if (gmacs > best) best = gmacs;
    printf("%d threads: %.1f billion int8 multiply-adds per second (checksum %ld)\n", omp_get_max_threads(), gmacs, checksum);
  }
  printf("peak: %.1f\n", best);
  return 0;
}
