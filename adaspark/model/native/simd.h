// One set of vector names for every build (AVX-512, AVX-VNNI, AVX2): float, int32 and double
// lanes, exp, fp16 loads and stores. Everything else is written on these names.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define ADASPARK_AVX512 1
static const char* kIsa = "avx512vnni";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
#define ADASPARK_AVXVNNI 1  // 256-bit vpdpbusd (Alder Lake and later, Zen 5): the avx2 path's
static const char* kIsa = "avxvnni";  // float steps, one integer instruction a chunk
#elif defined(__AVX2__) && defined(__FMA__)
static const char* kIsa = "avx2";
#else
#error "build with AVX2 and FMA at least (build.py sets the flags)"
#endif

namespace adaspark {

constexpr int kBlock = 32;  // inputs per quantisation block

// --- float vectors: one set of names for both builds ---------------------------------------------

#ifdef ADASPARK_AVX512
using vf = __m512;
constexpr int W = 16;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline float hmax(vf a) { return _mm512_reduce_max_ps(a); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2n(vf p, vf n) { return _mm512_scalef_ps(p, n); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline unsigned vgt_mask(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }  // lane bits
inline unsigned vge_mask(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
#else
using vf = __m256;
constexpr int W = 8;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline float hmax(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2n(vf p, vf n) {  // p * 2^n for n >= -126 (vexp clamps its input to keep it so)
  __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline unsigned vgt_mask(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
inline unsigned vge_mask(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
#endif

// int32 lanes: float -> int32 rounding to nearest even (the default MXCSR mode, as
// std::nearbyint), stores as int8 (values already in -127..127), sums.
#ifdef ADASPARK_AVX512
using vi = __m512i;
inline vf vabs(vf a) { return _mm512_abs_ps(a); }
inline vi vround_i(vf a) { return _mm512_cvtps_epi32(a); }
inline vi vadd_i(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi vsub_i(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vi vset1_i(int32_t x) { return _mm512_set1_epi32(x); }
inline vf vfloat(vi a) { return _mm512_cvtepi32_ps(a); }
inline int32_t vsum_i(vi a) { return _mm512_reduce_add_epi32(a); }
inline void vstore_i8(int8_t* p, vi a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(a));
}
#else
using vi = __m256i;
inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
inline vi vround_i(vf a) { return _mm256_cvtps_epi32(a); }
inline vi vadd_i(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi vsub_i(vi a, vi b) { return _mm256_sub_epi32(a, b); }
inline vi vset1_i(int32_t x) { return _mm256_set1_epi32(x); }
inline vf vfloat(vi a) { return _mm256_cvtepi32_ps(a); }
inline int32_t vsum_i(vi a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
inline void vstore_i8(int8_t* p, vi a) {
  const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w16, w16));
}
#endif

// exp by range reduction and a degree-6 polynomial (Cephes' expf), ~2 ulp; inputs below -87
// are clamped (their exp underflows softmax weights to nothing anyway).
inline vf vexp(vf x) {
  x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
  vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfma(n, vset1(-0.693359375f), x);
  r = vfma(n, vset1(2.12194440e-4f), r);
  vf p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vpow2n(p, n);
}

// fp16 <-> fp32 for the K/V cache (IEEE round to nearest even both ways).
#ifdef ADASPARK_AVX512
inline vf vload_h(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore_h(uint16_t* p, vf a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
}
#else
inline vf vload_h(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void vstore_h(uint16_t* p, vf a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
}
#endif

// bf16 -> fp32 (exact: the bf16 bits are the float's top half).
#ifdef ADASPARK_AVX512
inline vf vload_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#else
inline vf vload_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// W bytes, signed or unsigned, as floats (exact).
#ifdef ADASPARK_AVX512
inline vf vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf vload_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
inline vf vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf vload_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// Stores the first `valid` (<= W) lanes of a at p.
inline void vstore_first(float* p, vf a, int64_t valid) {
#ifdef ADASPARK_AVX512
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << valid) - 1), a);
#else
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, a);
  std::memcpy(p, tmp, valid * 4);
#endif
}

// Doubles, W/2 lanes: half a float vector widened, fma, the lanes summed by a fixed tree.
#ifdef ADASPARK_AVX512
using vd = __m512d;
inline vd vd_zero() { return _mm512_setzero_pd(); }
inline vd vd_widen(const float* p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
inline vd vd_fma(vd a, vd b, vd c) { return _mm512_fmadd_pd(a, b, c); }
inline double vd_sum(vd a) { return _mm512_reduce_add_pd(a); }
#else
using vd = __m256d;
inline vd vd_zero() { return _mm256_setzero_pd(); }
inline vd vd_widen(const float* p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
inline vd vd_fma(vd a, vd b, vd c) { return _mm256_fmadd_pd(a, b, c); }
inline double vd_sum(vd a) {
  const __m128d t = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
  return _mm_cvtsd_f64(_mm_add_sd(t, _mm_unpackhi_pd(t, t)));
}
#endif

inline vf reciprocal(vf a) {
#ifdef ADASPARK_AVX512
  return _mm512_div_ps(vset1(1.0f), a);
#else
  return _mm256_div_ps(vset1(1.0f), a);
#endif
}

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

}  // namespace adaspark
