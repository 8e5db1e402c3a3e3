// Read bandwidth one and two threads get, by buffer size: the ceiling of a dense (F16, BF16)
// matmul at one row, which reads every weight byte once per call and does little arithmetic on
// it (issue 25: the F16 model's decode step streams ~270 MB). Each thread sums its own half of
// the buffer with 512-bit loads (an AVX-512 CPU), passes repeated, the
// best pass reported. "cvt" instead widens each 16 halves with vcvtph2ps into one of two fma
// chains per 64 bytes, as fdot.h's one-row loop does; "cvt+pf" also asks for each line into L2
// (prefetcht1) 8 KiB ahead, as fdot.h does since issue 25: whether the loop's own misses in
// flight, rather than memory, set the rate.
//
//   g++ -O2 -mavx512f -mf16c -mfma -fopenmp -o /tmp/read_rate benchmarks/read_rate.cpp
//   nice -n 10 /tmp/read_rate
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

// Sum of the 32-bit words of [p, p + bytes) (bytes a multiple of 256): four chains, so the
// adds never limit the loads.
__m512i read_sum(const char* p, int64_t bytes) {
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  for (int64_t i = 0; i < bytes; i += 256) {
    a = _mm512_add_epi32(a, _mm512_load_si512(p + i));
    b = _mm512_add_epi32(b, _mm512_load_si512(p + i + 64));
    c = _mm512_add_epi32(c, _mm512_load_si512(p + i + 128));
    d = _mm512_add_epi32(d, _mm512_load_si512(p + i + 192));
  }
  return _mm512_add_epi32(_mm512_add_epi32(a, b), _mm512_add_epi32(c, d));
}

// The one-row dense loop's arithmetic: per 64 bytes two vcvtph2ps and two fma, two chains;
// `ahead`: bytes ahead to prefetch into L2 (0: none).
__m512 cvt_fma(const char* p, int64_t bytes, int64_t ahead) {
  __m512 even = _mm512_setzero_ps(), odd = even;
  const __m512 x = _mm512_set1_ps(1e-3f);
  for (int64_t i = 0; i < bytes; i += 64) {
    if (ahead && i + ahead < bytes) _mm_prefetch(p + i + ahead, _MM_HINT_T1);
    const __m512 w0 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    const __m512 w1 =
        _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    even = _mm512_fmadd_ps(x, w0, even);
    odd = _mm512_fmadd_ps(x, w1, odd);
  }
  return _mm512_add_ps(even, odd);
}

enum class Mode { read, cvt, cvt_pf };

// Best GB/s over `passes` passes of `threads` threads each reading its contiguous share.
double rate(const char* buf, int64_t bytes, int threads, int passes, Mode mode, double* keep) {
  double best = 0;
  for (int pass = 0; pass < passes; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      const int64_t share = bytes / threads / 256 * 256;
      const char* p = buf + t * share;
      const int64_t ahead = mode == Mode::cvt_pf ? 8192 : 0;
      const float s =
          mode == Mode::read ? static_cast<float>(_mm512_reduce_add_epi32(read_sum(p, share)))
                             : _mm512_reduce_add_ps(cvt_fma(p, share, ahead));
#pragma omp atomic
      *keep += s;
    }
    const double sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, bytes / sec / 1e9);
  }
  return best;
}

}  // namespace

int main() {
  const int64_t sizes_mb[] = {2, 16, 64, 128, 270, 1024};
  const int64_t most = sizes_mb[sizeof(sizes_mb) / sizeof(*sizes_mb) - 1] << 20;
  char* buf = static_cast<char*>(std::aligned_alloc(4096, most));
  for (int64_t i = 0; i < most; i += 2) {  // fp16 1.0 .. small values, every page touched
    const uint16_t h = 0x3c00 ^ static_cast<uint16_t>(i & 0x3ff);
    std::memcpy(buf + i, &h, 2);
  }
  double keep = 0;
  std::printf("| MB | read, 1 thread GB/s | 2 threads | cvt, 1 thread | 2 threads | cvt+pf, "
              "1 thread | 2 threads |\n|---|---|---|---|---|---|---|\n");
  for (const int64_t mb : sizes_mb) {
    const int64_t bytes = mb << 20;
    const int passes = mb <= 16 ? 200 : mb <= 270 ? 12 : 4;
    std::printf("| %lld |", static_cast<long long>(mb));
    for (const Mode mode : {Mode::read, Mode::cvt, Mode::cvt_pf})
      for (const int threads : {1, 2})
        std::printf(" %.1f |", rate(buf, bytes, threads, passes, mode, &keep));
    std::printf("\n");
  }
  std::printf("[%g]\n", keep);
  std::free(buf);
  return 0;
}
