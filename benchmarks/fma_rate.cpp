// Vector FMA rate of one core, 512-bit against 256-bit: whether a CPU's AVX-512 doubles the
// float arithmetic per cycle or only widens it (one 512-bit FMA port fused from two 256-bit
// ones). The per-block scaling of the quantised matmul is float arithmetic on every (row,
// block, 16 outputs), so this rate bounds what extra verify rows cost (docs/native-forward.md).
//
//   g++ -O2 -mavx512f -mfma -o /tmp/fma_rate benchmarks/fma_rate.cpp && /tmp/fma_rate
#include <immintrin.h>

#include <chrono>
#include <cstdio>

int main() {
  constexpr int kChains = 12;  // independent accumulators: more than latency x ports
  constexpr long kSteps = 200000000;
  __m512 z[kChains];
  __m256 y[kChains];
  for (int i = 0; i < kChains; ++i) {
    z[i] = _mm512_set1_ps(1.0f + i * 1e-7f);
    y[i] = _mm256_set1_ps(1.0f + i * 1e-7f);
  }
  const __m512 zb = _mm512_set1_ps(0.999999f), zc = _mm512_set1_ps(1e-7f);
  const __m256 yb = _mm256_set1_ps(0.999999f), yc = _mm256_set1_ps(1e-7f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kSteps; ++n)
    for (int i = 0; i < kChains; ++i) z[i] = _mm512_fmadd_ps(z[i], zb, zc);
  const auto t1 = std::chrono::steady_clock::now();
  for (long n = 0; n < kSteps; ++n)
    for (int i = 0; i < kChains; ++i) y[i] = _mm256_fmadd_ps(y[i], yb, yc);
  const auto t2 = std::chrono::steady_clock::now();
  float keep = 0.0f;  // the results are used, so the loops stay
  for (int i = 0; i < kChains; ++i) keep += _mm512_reduce_add_ps(z[i]) + y[i][0];
  const double s512 = std::chrono::duration<double>(t1 - t0).count();
  const double s256 = std::chrono::duration<double>(t2 - t1).count();
  const double g512 = kSteps * kChains / s512 / 1e9, g256 = kSteps * kChains / s256 / 1e9;
  std::printf("512-bit: %.2f G FMA/s (%.1f G lanes/s); 256-bit: %.2f G FMA/s (%.1f G lanes/s)"
              "; 512/256 lanes: %.2f  [%g]\n", g512, 16 * g512, g256, 8 * g256,
              2 * g512 / g256, keep);
  return 0;
}
