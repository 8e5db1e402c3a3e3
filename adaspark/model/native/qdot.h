// Integer block dots of packed weights with int8 activations on the VNNI and AVX2 builds,
// and the float steps that end every block on every path.
#pragma once

#include "fdot.h"
#include "qweight.h"

namespace adaspark {

inline int32_t chunk_of(const int8_t* p) {  // 4 int8 inputs as one 32-bit lane value
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// acc + block b's contribution to row r from its integer sums s = sum(u*q) over W outputs
// whose scales are dw, mw: d*dx*(s - zero*sum(q)), or d*dx*s + m*dx*sum(q) without a zero.
// Every path (VNNI, AVX2, AMX) ends a block here, so a row's float steps are one sequence.
// centred: s already holds sum((u - zero)*q) (plain AVX2's Q8_0 dot), the same integer as
// s - zero*sum(q), so the float steps that follow are the same too.
inline vf add_block(vf acc, vi s, vf dw, vf mw, const QPart& w, const QAct& a, int64_t r,
                    int64_t b, bool centred = false) {
  const int64_t at = r * a.nb + b;
  const vf scale = vmul(dw, vset1(a.dx[at]));
  if (centred) return vfma(vfloat(s), scale, acc);
  if (w.zero)
    return vfma(vfloat(vsub_i(s, vset1_i(static_cast<int32_t>(w.zero) * a.qs[at]))), scale, acc);
  return vfma(mw, vset1(a.xs[at]), vfma(vfloat(s), scale, acc));
}

// The same for a block whose halves of 16 inputs have their own scales d0, d1 (Q6_K), from
// the integer sums s0, s1 of its halves (|s - zero*sum(q)| < 2^18: exact in float32).
inline vf add_halves(vf acc, vi s0, vi s1, vf d0, vf d1, const QPart& w, const QAct& a,
                     int64_t r, int64_t b) {
  const int64_t at = r * a.nb + b;
  const vf dx = vset1(a.dx[at]);
  const int32_t z = static_cast<int32_t>(w.zero), q0 = a.qh[at], q1 = a.qs[at] - q0;
  acc = vfma(vfloat(vsub_i(s0, vset1_i(z * q0))), vmul(d0, dx), acc);
  return vfma(vfloat(vsub_i(s1, vset1_i(z * q1))), vmul(d1, dx), acc);
}

// A block's scales: d, and m (free minimums), or the second half's d (halves 2). A struct,
// not std::pair: vector types lose their alignment attributes as template arguments.
struct Scales {
  vf d, m;
};
inline Scales block_scales(const QPart& w, int64_t g, int64_t b, int64_t lane) {
  const vf dw = load_scales(w, w.dp, w.dsp, w.d_signed, g, b, 0, lane);
  if (w.halves == 2) return {dw, load_scales(w, w.dp, w.dsp, w.d_signed, g, b, 1, lane)};
  return {dw, w.zero ? dw : load_scales(w, w.mp, w.msp, w.m_signed, g, b, 0, lane)};
}

// acc + a block from its integer sums: first (the block's first 16 inputs) and all of it.
inline vf end_block(vf acc, vi first, vi all, vf dw, vf mw, const QPart& w, const QAct& a,
                    int64_t r, int64_t b) {
  if (w.halves == 2) return add_halves(acc, first, vsub_i(all, first), dw, mw, w, a, r, b);
  return add_block(acc, all, dw, mw, w, a, r, b);
}

// A block's 8 chunks of codes u as bytes (qweight.h's layout): 8 bits as stored; else the low
// nibbles from their 256 bytes, and for 5 and 6 bits the high bits from the planes after them.
#ifdef ADASPARK_AVX512
inline void unpack_block(const QPart& w, const uint8_t* qb, __m512i u[8]) {
  if (w.bits == 8) {
    for (int i = 0; i < 8; ++i) u[i] = _mm512_loadu_si512(qb + 64 * i);
    return;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m512i v = _mm512_loadu_si512(qb + 64 * i);
    u[2 * i] = _mm512_and_si512(v, low4);
    u[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
  if (w.bits == 5) {  // bit j of a plane byte: chunk j's fifth bit in that lane
    const __m512i h = _mm512_loadu_si512(qb + 256), sixteen = _mm512_set1_epi8(16);
    for (int j = 0; j < 8; ++j)
      u[j] = _mm512_mask_add_epi8(u[j], _mm512_test_epi8_mask(h, _mm512_set1_epi8(1 << j)), u[j],
                                  sixteen);
  } else if (w.bits == 6) {  // bits 2j, 2j+1 of plane p: chunk 4p+j's two high bits
    const __m512i three = _mm512_set1_epi8(3);
    for (int p = 0; p < 2; ++p) {
      const __m512i h = _mm512_loadu_si512(qb + 256 + 64 * p);
      for (int j = 0; j < 4; ++j)
        u[4 * p + j] = _mm512_or_si512(
            u[4 * p + j], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * j), three), 4));
    }
  }
}
#else
// The same for half a group (8 outputs: qb already points 32 bytes into each 64-byte row).
inline void unpack_half(const QPart& w, const uint8_t* qb, __m256i u[8]) {
  auto load = [qb](int64_t at) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + at));
  };
  if (w.bits == 8) {
    for (int i = 0; i < 8; ++i) u[i] = load(64 * i);
    return;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m256i v = load(64 * i);
    u[2 * i] = _mm256_and_si256(v, low4);
    u[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  }
  if (w.bits == 5) {
    const __m256i h = load(256), one = _mm256_set1_epi8(1);
    for (int j = 0; j < 8; ++j)
      u[j] = _mm256_or_si256(u[j], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, j), one), 4));
  } else if (w.bits == 6) {
    const __m256i three = _mm256_set1_epi8(3);
    for (int p = 0; p < 2; ++p) {
      const __m256i h = load(256 + 64 * p);
      for (int j = 0; j < 4; ++j)
        u[4 * p + j] = _mm256_or_si256(
            u[4 * p + j], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j), three), 4));
    }
  }
}
#endif

// The fast paths, for the three types every layer and the head of a Q4_0 / Q4_1 / Q8_0 file
// have (fp16 scales, one scale per block), and Q4_K, the bulk of a Q4_K_M file (its small
// integer scales times their fp16 factors, as load_scales forms them): group_rows' integer
// sums and add_block's float steps, the same integers and float operations in the same
// order, so the same bits. What differs is the code around them: the type's tests and the
// scales' addressing leave the block loop, each weight vector is loaded and unpacked where it
// is used (chunks outer, rows inner: R integer sums live, not 8 unpacked chunks), so up to 8
// rows share a pass with their sums in registers (group_rows spilled its sums at 4 and
// unpacked the weights again every 4 rows).
inline bool fast_packing(const QPart& w, int64_t rows) {
  if (w.f32) return false;
  if (!w.factors) return w.halves == 1 && (w.bits == 4 || (w.bits == 8 && w.zero == 128));
#ifdef ADASPARK_AVX512
  // A lone Q4_K row timed 2-9% slower here on the fast path (a second accumulator did not
  // help): the generic one keeps it; from 2 rows the fast path is as fast or faster. Q6_K on
  // a fast path of this build timed 0.97-1.11x the generic one (docs/results/spr-s27).
  return rows > 1 && w.bits == 4 && !w.zero;  // Q4_K
#else
#ifdef ADASPARK_AVXVNNI
  if (w.halves == 2 && rows >= 8) return false;  // a 256-row Q6_K prefill timed 1.06x here
#endif
  if (w.halves == 2) return w.bits == 6 && w.zero == 32;  // Q6_K
  return (w.bits == 4 || w.bits == 5) && !w.zero;          // Q4_K, Q5_K
#endif
}

// v computed here, in a register: keeps gcc from reassociating a row's sum across chunks,
// which hoisted every product of a block and spilled them all (64 stores a block at 8 rows).
template <class V>
inline void pin(V& v) { asm("" : "+x"(v)); }

// A fast kernel's next-group prefetch: prefetch_block's requests, a block at a time.
struct Ahead {
  const Next next;
  explicit Ahead(const Next& n) : next(n) {}
  void block(int64_t b) const {
    if (next.w) prefetch_block_call(*next.w, next.g, b);
  }
};

// f(integral_constant<n>) for the n in 1..Max that equals `rows` (a pass's row count).
template <class F, int... Rs>
inline void with_rows(int64_t rows, const F& f, std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? (f(std::integral_constant<int, Rs + 1>{}), 0) : 0), ...);
}
template <int Max, class F>
inline void with_rows(int64_t rows, const F& f) {
  with_rows(rows, f, std::make_integer_sequence<int, Max>{});
}

// f(Bits, Zero, K) as integral constants for a fast packing: Q8_0 (8, its zero of 128), Q4_0
// (4, a zero), Q4_1 (4, free minimums), Q4_K (4, free minimums, K-quant scales), Q5_K (5, the
// same) and Q6_K (6, its zero of 32, K-quant scales per half block).
template <class F>
inline void with_packing(const QPart& w, const F& f) {
  using std::bool_constant, std::integral_constant;
  if (w.bits == 8) f(integral_constant<int, 8>{}, bool_constant<true>{}, bool_constant<false>{});
#ifndef ADASPARK_AVX512  // fast_packing takes 5 and 6 bits on the 256-bit builds only
  else if (w.bits == 6)
    f(integral_constant<int, 6>{}, bool_constant<true>{}, bool_constant<true>{});
  else if (w.bits == 5)
    f(integral_constant<int, 5>{}, bool_constant<false>{}, bool_constant<true>{});
#endif
  else if (w.zero) f(integral_constant<int, 4>{}, bool_constant<true>{}, bool_constant<false>{});
  else if (w.factors)
    f(integral_constant<int, 4>{}, bool_constant<false>{}, bool_constant<true>{});
  else f(integral_constant<int, 4>{}, bool_constant<false>{}, bool_constant<false>{});
}

// What a fast kernel reads for group g and the rows from r0: the group's packed codes, its
// fp16 scales d and m (m is d where a zero stands for it; K-quant scales are read by
// load_scales instead) and the rows' activations, their scales dx, dx * sum(q) and sum(q) per
// block, and qh = sum(q) over its first 16 inputs (Q6_K's halves).
struct FastStreams {
  const uint8_t* q;
  const uint16_t *d, *m;
  const int8_t* x;
  const float *dx, *xs;
  const int32_t *qs, *qh;
  int32_t zero;
};
template <int Bits, bool Zero>
inline FastStreams fast_streams(const QPart& w, const QAct& a, int64_t g, int64_t r0) {
  const int64_t nb = w.nb;
  const uint16_t* d = static_cast<const uint16_t*>(w.dp) + g * nb * 16;
  return {w.qp + g * nb * (16 * kBlock * Bits / 8), d,
          Zero ? d : static_cast<const uint16_t*>(w.mp) + g * nb * 16, a.q.data() + r0 * a.k,
          a.dx.data() + r0 * nb, a.xs.data() + r0 * nb, a.qs.data() + r0 * nb,
          a.qh.data() + r0 * nb, static_cast<int32_t>(w.zero)};
}

// Shifts of a plane of high bits that bring chunk ch's high bits (one for 5-bit codes, two for
// 6) to bit 4 of each byte, masked there: OR-ed onto the chunk's low nibbles they give its
// codes (unpack_block's bytes). Bits shifted across a byte's edge fall outside the mask.
template <int Bits>
constexpr int high_shift(int ch) {  // > 0: left, < 0: right
  return Bits == 5 ? 4 - ch : 4 - 2 * (ch % 4);
}
template <int Bits>
constexpr int plane_of(int ch) {  // the plane's byte offset in a block (two planes for 6 bits)
  return Bits == 5 ? 256 : 256 + 64 * (ch / 4);
}
constexpr char kHighMask5 = 0x10, kHighMask6 = 0x30;

#ifdef ADASPARK_AVX512
// 16 outputs a register, R rows a pass: per chunk of 4 inputs one vpdpbusd a row (its 4
// activations broadcast), each unpacked weight vector serving every row of the pass.
template <int R, int Bits, bool Zero, bool K>
inline void group_rows_512(const QPart& w, const QAct& a, int64_t g, int64_t r0, float* y,
                           int64_t ldy, Next next) {
  const int64_t nb = w.nb, k = a.k;
  const Ahead ahead(next);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  constexpr int64_t bytes = 16 * kBlock * Bits / 8;  // a block of 16 outputs
  const auto [qg, dg, mg, xq, dx, xs, qs, qh, zero] = fast_streams<Bits, Zero>(w, a, g, r0);
  (void)qh;  // Q6_K's halves: the 256-bit kernel's alone
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    ahead.block(b);
    const uint8_t* qb = qg + b * bytes;
    const int8_t* xb = xq + b * kBlock;
    __m512i s[R];
    for (int i = 0; i < R; ++i) s[i] = _mm512_setzero_si512();
    auto chunk = [&](__m512i u, int j) {  // chunk j: inputs 4j .. 4j+3
      for (int i = 0; i < R; ++i) {
        s[i] = _mm512_dpbusd_epi32(s[i], u, _mm512_set1_epi32(chunk_of(xb + i * k + 4 * j)));
        pin(s[i]);
      }
    };
    if constexpr (Bits == 4) {
      #pragma GCC unroll 8  // a loop kept the sums in memory
      for (int c = 0; c < 4; ++c) {  // chunks 2c (low nibbles) and 2c+1 (high)
        const __m512i v = _mm512_loadu_si512(qb + 64 * c);
        chunk(_mm512_and_si512(v, low4), 2 * c);
        chunk(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), 2 * c + 1);
      }
    } else {
      #pragma GCC unroll 8  // a loop kept the sums in memory
      for (int j = 0; j < 8; ++j) chunk(_mm512_loadu_si512(qb + 64 * j), j);
    }
    auto halves16 = [](const uint16_t* p) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    };
    const __m512 dw = K ? load_scales(w, w.dp, w.dsp, w.d_signed, g, b, 0, 0)
                        : halves16(dg + b * 16);
    const __m512 mw = Zero ? dw
                      : K  ? load_scales(w, w.mp, w.msp, w.m_signed, g, b, 0, 0)
                           : halves16(mg + b * 16);
    for (int i = 0; i < R; ++i) {  // add_block's steps
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[i * nb + b]));
      if constexpr (Zero) {
        const __m512i t = _mm512_sub_epi32(s[i], _mm512_set1_epi32(zero * qs[i * nb + b]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, acc[i]);
      } else {
        acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[i * nb + b]),
                                 _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), scale, acc[i]));
      }
    }
  }
  const int64_t valid = std::min<int64_t>(16, w.n - 16 * g);
  for (int i = 0; i < R; ++i) vstore_first(y + (r0 + i) * ldy + 16 * g, acc[i], valid);
}

// Every row of a in passes of up to 8 (the first pass asks for the thread's next group).
inline void fast_part_rows(const QPart& w, const QAct& a, int64_t g, float* y, int64_t ldy,
                           Next ahead) {
  constexpr int kRows = 8;
  for (int64_t r = 0; r < a.rows; r += kRows, ahead = {}) {
    with_rows<kRows>(std::min<int64_t>(kRows, a.rows - r), [&](auto n) {
      with_packing(w, [&](auto bits, auto zero, auto k) {
        group_rows_512<decltype(n)::value, bits, zero, k>(w, a, g, r, y, ldy, ahead);
      });
    });
  }
}
#else
inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(chunk_of(p)); }

// H halves of the group (8H outputs, from half h0) a pass, R rows. H = 2 for calls of few
// rows: each broadcast of a row's activations feeds both halves' products, and a row's dx and
// xs are broadcast once a block (on Zen 3 the broadcasts, not the multiplies, held back 8 rows
// x one half a pass: benchmarks/int8_rate.cpp). H = 1, 8 rows, for wide calls (a prefill, a
// wide verify): each unpacked weight vector serves 8 rows (docs/results/zen3/native_ab-*).
// s[H i + h], acc[H i + h]: row i, outputs 8 (h0 + h) .. +7. The AVX-VNNI build forms the same
// integer sums with one 256-bit vpdpbusd a chunk (Q8_0: sum(u*q) - 128 sum(q), the centred
// sum plain AVX2 forms with its signs).
template <int R, int H, int Bits, bool Zero, bool K>
inline void group_rows_avx2(const QPart& w, const QAct& a, int64_t g, int64_t r0, float* y,
                            int64_t ldy, Next next, int h0 = 0) {
  const int64_t nb = w.nb, k = a.k;
  const Ahead ahead(next);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
#ifndef ADASPARK_AVXVNNI
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
#endif
  constexpr int64_t bytes = 16 * kBlock * Bits / 8;  // a block of 16 outputs
  const auto [qg, dg, mg, xq, dx, xs, qs, qh, zero] = fast_streams<Bits, Zero>(w, a, g, r0);
  auto load = [](const void* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  __m256 acc[H * R];
  for (int i = 0; i < H * R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (h0 == 0) ahead.block(b);
    const uint8_t* qb = qg + b * bytes + 32 * h0;
    const int8_t* xb = xq + b * kBlock;
    __m256i s[H * R];
    // chunks 2c (low nibbles) and 2c+1 (high) of the H halves, with their high bits (5 and 6
    // bits) from the planes, moved to bit 4 of each byte
    auto codes = [&](int c, __m256i* lo, __m256i* hi) {
      auto high = [&](int h, int ch) {
        const __m256i v = load(qb + plane_of<Bits>(ch) + 32 * h);
        const int by = high_shift<Bits>(ch);
        return _mm256_and_si256(by >= 0 ? _mm256_slli_epi16(v, by) : _mm256_srli_epi16(v, -by),
                                _mm256_set1_epi8(Bits == 5 ? kHighMask5 : kHighMask6));
      };
      for (int h = 0; h < H; ++h) {
        const __m256i v = load(qb + 64 * c + 32 * h);
        lo[h] = _mm256_and_si256(v, low4);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if constexpr (Bits == 5 || Bits == 6) {
          lo[h] = _mm256_or_si256(lo[h], high(h, 2 * c));
          hi[h] = _mm256_or_si256(hi[h], high(h, 2 * c + 1));
        }
      }
    };
    // Q6_K: each half block (chunks 0-3, 4-7) ends as add_halves ends it, from its own sums
    auto end_half = [&](int half) {
      __m256 dh[H];
      for (int h = 0; h < H; ++h)
        dh[h] = load_scales(w, w.dp, w.dsp, w.d_signed, g, b, half, 8 * (h0 + h));
      for (int i = 0; i < R; ++i) {
        const __m256 dxv = _mm256_set1_ps(dx[i * nb + b]);
        const int32_t q = half == 0 ? qh[i * nb + b] : qs[i * nb + b] - qh[i * nb + b];
        const __m256i zq = _mm256_set1_epi32(zero * q);
        for (int h = 0; h < H; ++h) {
          const __m256i t = _mm256_sub_epi32(s[H * i + h], zq);
          acc[H * i + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dh[h], dxv),
                                           acc[H * i + h]);
        }
      }
    };
#ifdef ADASPARK_AVXVNNI
    for (int i = 0; i < H * R; ++i) s[i] = _mm256_setzero_si256();
    auto chunk = [&](const __m256i* u, int j) {  // chunk j (inputs 4j .. 4j+3) of H halves
      for (int i = 0; i < R; ++i) {
        const __m256i x = bcast4(xb + i * k + 4 * j);
        for (int h = 0; h < H; ++h) {
          s[H * i + h] = _mm256_dpbusd_avx_epi32(s[H * i + h], u[h], x);
          pin(s[H * i + h]);
        }
      }
    };
    if constexpr (Bits < 8) {
      #pragma GCC unroll 8  // a loop kept the sums in memory
      for (int c = 0; c < 4; ++c) {  // chunks 2c (low nibbles) and 2c+1 (high)
        __m256i lo[H], hi[H];
        codes(c, lo, hi);
        chunk(lo, 2 * c);
        chunk(hi, 2 * c + 1);
        if (Bits == 6 && c % 2 == 1) {
          end_half(c / 2);
          for (int i = 0; i < H * R; ++i) s[i] = _mm256_setzero_si256();
        }
      }
      if constexpr (Bits == 6) continue;
    } else {
      #pragma GCC unroll 8  // a loop kept the sums in memory
      for (int j = 0; j < 8; ++j) {
        __m256i u[H];
        for (int h = 0; h < H; ++h) u[h] = load(qb + 64 * j + 32 * h);
        chunk(u, j);
      }
      for (int i = 0; i < R; ++i)
        for (int h = 0; h < H; ++h)
          s[H * i + h] = _mm256_sub_epi32(s[H * i + h], _mm256_set1_epi32(128 * qs[i * nb + b]));
    }
#else
    if constexpr (Bits < 8) {
      // 4 bits: int16 sums over the 8 chunks (<= 30480), widened once; 5 and 6 bits: the two
      // chunks' int16 sum (<= 2*2*63*127 = 32004) widened at once, int32 sums
      auto pairs = [&](int c, bool first) {  // chunks 2c (low nibbles) and 2c+1 (high)
        __m256i lo[H], hi[H];
        codes(c, lo, hi);
        for (int i = 0; i < R; ++i) {
          const int8_t* x = xb + i * k + 8 * c;
          const __m256i xl = bcast4(x), xh = bcast4(x + 4);
          for (int h = 0; h < H; ++h) {
            __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                         _mm256_maddubs_epi16(hi[h], xh));
            if constexpr (Bits == 4) {
              s[H * i + h] = first ? p : _mm256_add_epi16(s[H * i + h], p);
            } else {
              p = _mm256_madd_epi16(p, ones);
              s[H * i + h] = first ? p : _mm256_add_epi32(s[H * i + h], p);
            }
            pin(s[H * i + h]);
          }
        }
      };
      pairs(0, true);
      pairs(1, false);
      if constexpr (Bits == 6) {
        end_half(0);
        pairs(2, true);
        pairs(3, false);
        end_half(1);
        continue;
      }
      pairs(2, false);
      pairs(3, false);
      if constexpr (Bits == 4)
        for (int i = 0; i < H * R; ++i) s[i] = _mm256_madd_epi16(s[i], ones);
    } else {  // Q8_0: |c| times q carrying c's sign, int32 sums
      auto chunk = [&](int j, bool first) {
        __m256i c[H], mag[H];
        for (int h = 0; h < H; ++h) {
          c[h] = _mm256_xor_si256(load(qb + 64 * j + 32 * h), flip);
          mag[h] = _mm256_abs_epi8(c[h]);
        }
        for (int i = 0; i < R; ++i) {
          const __m256i x = bcast4(xb + i * k + 4 * j);
          for (int h = 0; h < H; ++h) {
            const __m256i sq = _mm256_sign_epi8(x, c[h]);
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(mag[h], sq), ones);
            s[H * i + h] = first ? p : _mm256_add_epi32(s[H * i + h], p);
            pin(s[H * i + h]);
          }
        }
      };
      chunk(0, true);  // unrolled by hand: a loop kept the sums in memory
      chunk(1, false);
      chunk(2, false);
      chunk(3, false);
      chunk(4, false);
      chunk(5, false);
      chunk(6, false);
      chunk(7, false);
    }
#endif
    __m256 dw[H], mw[H];
    for (int h = 0; h < H; ++h) {
      const int64_t lane = 8 * (h0 + h);
      if constexpr (K) {
        dw[h] = load_scales(w, w.dp, w.dsp, w.d_signed, g, b, 0, lane);
        mw[h] = load_scales(w, w.mp, w.msp, w.m_signed, g, b, 0, lane);
      } else {
        dw[h] = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(dg + b * 16 + lane)));
        if constexpr (Bits == 4 && !Zero)
          mw[h] = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(mg + b * 16 + lane)));
      }
    }
    for (int i = 0; i < R; ++i) {  // add_block's steps
      const __m256 dxv = _mm256_set1_ps(dx[i * nb + b]);
      for (int h = 0; h < H; ++h) {
        __m256& o = acc[H * i + h];
        const __m256 scale = _mm256_mul_ps(dw[h], dxv);
        if constexpr (Bits == 8) {  // centred: s is already sum((u - 128) * q)
          o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[H * i + h]), scale, o);
        } else if constexpr (Zero) {
          const __m256i t =
              _mm256_sub_epi32(s[H * i + h], _mm256_set1_epi32(zero * qs[i * nb + b]));
          o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), scale, o);
        } else {
          o = _mm256_fmadd_ps(mw[h], _mm256_set1_ps(xs[i * nb + b]),
                              _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[H * i + h]), scale, o));
        }
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    const int64_t valid = std::min<int64_t>(8, w.n - 16 * g - 8 * (h0 + h));
    for (int i = 0; i < R && valid > 0; ++i)
      vstore_first(y + (r0 + i) * ldy + 16 * g + 8 * (h0 + h), acc[H * i + h], valid);
  }
}

template <int R, int H>
inline void fast_rows_avx2(const QPart& w, const QAct& a, int64_t g, int64_t r0, float* y,
                           int64_t ldy, Next next) {
  with_packing(w, [&](auto bits, auto zero, auto k) {
    for (int h0 = 0; h0 < 2; h0 += H)
      group_rows_avx2<R, H, bits, zero, k>(w, a, g, r0, y, ldy, next, h0);
  });
}

// Calls of fewer than kWideRows rows: up to 4 rows a pass over both halves; wider calls: up to
// 8 rows a pass over one half (the sums in registers, the float accumulators in L1). Either
// way each (row, output) gets the same sums and float steps, so the same bits.
constexpr int kWideRows = 8;
template <int H, int Rows>
inline void fast_rows_all(const QPart& w, const QAct& a, int64_t g, float* y, int64_t ldy,
                          Next ahead) {
  int64_t r = 0;
  for (; r + Rows <= a.rows; r += Rows, ahead = {})
    fast_rows_avx2<Rows, H>(w, a, g, r, y, ldy, ahead);
  if (r < a.rows)
    with_rows<Rows - 1>(a.rows - r, [&](auto n) {
      fast_rows_avx2<decltype(n)::value, H>(w, a, g, r, y, ldy, ahead);
    });
}
inline void fast_part_rows(const QPart& w, const QAct& a, int64_t g, float* y, int64_t ldy,
                           Next ahead) {
  if (a.rows >= kWideRows) return fast_rows_all<1, 8>(w, a, g, y, ldy, ahead);
  fast_rows_all<2, 4>(w, a, g, y, ldy, ahead);
}
#endif

// y[r, 16g .. 16g+15] for rows [r0, r0+R): the group's weights are unpacked once per block
// for all R rows; each (row, output) adds its blocks in order, in its own lane.
template <int R>
inline void group_rows(const QPart& w, const QAct& a, int64_t g, int64_t r0, float* y,
                       int64_t ldy, Next ahead = {}) {
#ifdef ADASPARK_AVX512
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    if (ahead.w) prefetch_block(*ahead.w, ahead.g, b);
    __m512i u[8];
    unpack_block(w, w.qp + (g * w.nb + b) * w.block_bytes(), u);
    const auto [dw, mw] = block_scales(w, g, b, 0);
    for (int i = 0; i < R; ++i) {
      const int64_t r = r0 + i;
      const int8_t* xb = a.q.data() + r * a.k + b * kBlock;
      // two chains of four, one per half block: vpdpbusd's latency is not the limit (integer
      // sums are exact, so the split changes nothing in the result)
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        s0 = _mm512_dpbusd_epi32(s0, u[j], _mm512_set1_epi32(chunk_of(xb + 4 * j)));
        s1 = _mm512_dpbusd_epi32(s1, u[j + 4], _mm512_set1_epi32(chunk_of(xb + 4 * j + 16)));
      }
      acc[i] = end_block(acc[i], s0, _mm512_add_epi32(s0, s1), dw, mw, w, a, r, b);
    }
  }
  const int64_t valid = std::min<int64_t>(16, w.n - 16 * g);
  for (int i = 0; i < R; ++i) vstore_first(y + (r0 + i) * ldy + 16 * g, acc[i], valid);
#else
  // 8 outputs a register, so two halves of the group, each over all blocks (a half's 8 chunk
  // registers loaded once for R rows). Per row and chunk of 4 inputs, the integer sums (exact,
  // so every way of forming them gives the same result):
  // - AVX-VNNI: one vpdpbusd (u unsigned, q signed, 4 products into each int32 lane);
  // - AVX2, 4 bits: vpmaddubsw pairs (|u*q + u'*q'| <= 2*15*127) summed in int16 over the 8
  //   chunks (<= 30480, no saturation), widened once a block by vpmaddwd;
  // - AVX2, 5 and 6 bits (u <= 63): vpmaddubsw pairs (<= 2*63*127) summed in int16 over two
  //   chunks (<= 32004), widened by vpmaddwd;
  // - AVX2, 8 bits around zero 128 (Q8_0): c = u - 128 as signed bytes, |c| (<= 128, read
  //   unsigned) times q carrying c's sign (|q| <= 127) in vpmaddubsw, pairs <= 2*128*127;
  // - AVX2, other 8-bit codes: u as two nibbles.
  // One pass over both halves at once (each broadcast serving 16 outputs) was faster with the
  // weights in cache and slower streaming them, as a verify does (docs/native-forward.md).
  const __m256i low4 = _mm256_set1_epi8(0x0F);
#ifndef ADASPARK_AVXVNNI
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const bool centred = w.bits == 8 && w.zero == 128 && w.halves == 1;
#else
  constexpr bool centred = false;
#endif
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.nb; ++b) {
      if (ahead.w && half == 0) prefetch_block(*ahead.w, ahead.g, b);
      __m256i u[8];
      unpack_half(w, w.qp + (g * w.nb + b) * w.block_bytes() + 32 * half, u);
      const auto [dw, mw] = block_scales(w, g, b, 8 * half);
      __m256i s[R], first[R];  // the block's sums, and those of its first 16 inputs (halves 2)
      const int8_t* xb[R];
      for (int i = 0; i < R; ++i) xb[i] = a.q.data() + (r0 + i) * a.k + b * kBlock;
      auto x_of = [&](int i, int j) { return _mm256_set1_epi32(chunk_of(xb[i] + 4 * j)); };
#ifdef ADASPARK_AVXVNNI
      for (int i = 0; i < R; ++i) {  // two chains, one per half block, as on the avx512 path
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          s0 = _mm256_dpbusd_avx_epi32(s0, u[j], x_of(i, j));
          s1 = _mm256_dpbusd_avx_epi32(s1, u[j + 4], x_of(i, j + 4));
        }
        first[i] = s0;
        s[i] = _mm256_add_epi32(s0, s1);
      }
#else
      if (w.bits == 4) {
        for (int i = 0; i < R; ++i) s[i] = _mm256_maddubs_epi16(u[0], x_of(i, 0));
        for (int j = 1; j < 8; ++j)
          for (int i = 0; i < R; ++i)
            s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(u[j], x_of(i, j)));
        for (int i = 0; i < R; ++i) s[i] = _mm256_madd_epi16(s[i], ones);
      } else if (w.bits < 8) {
        for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) {
          for (int i = 0; i < R; ++i) {
            const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(u[j], x_of(i, j)),
                                               _mm256_maddubs_epi16(u[j + 1], x_of(i, j + 1)));
            s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(t, ones));
          }
          if (j == 2)
            for (int i = 0; i < R; ++i) first[i] = s[i];
        }
      } else if (centred) {
        for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i c = _mm256_xor_si256(u[j], flip);  // the signed c = u - 128
          const __m256i mag = _mm256_abs_epi8(c);          // -128 gives 0x80: 128 unsigned
          for (int i = 0; i < R; ++i) {
            const __m256i sq = _mm256_sign_epi8(x_of(i, j), c);
            s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, sq), ones));
          }
        }
      } else {
        for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {  // u = 16*hi + lo, each part in 0..15: no saturation
          const __m256i lo = _mm256_and_si256(u[j], low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(u[j], 4), low4);
          for (int i = 0; i < R; ++i) {
            const __m256i sl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x_of(i, j)), ones);
            const __m256i sh = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x_of(i, j)), ones);
            s[i] = _mm256_add_epi32(s[i], _mm256_add_epi32(sl, _mm256_slli_epi32(sh, 4)));
          }
          if (j == 3)
            for (int i = 0; i < R; ++i) first[i] = s[i];
        }
      }
#endif
      for (int i = 0; i < R; ++i)
        acc[i] = w.halves == 2 ? add_halves(acc[i], first[i], _mm256_sub_epi32(s[i], first[i]), dw,
                                            mw, w, a, r0 + i, b)
                               : add_block(acc[i], s[i], dw, mw, w, a, r0 + i, b, centred);
    }
    const int64_t valid = std::min<int64_t>(8, w.n - 16 * g - 8 * half);
    for (int i = 0; i < R && valid > 0; ++i)
      vstore_first(y + (r0 + i) * ldy + 16 * g + 8 * half, acc[i], valid);
  }
#endif
}

// One group of a part for every row of a: R rows a pass (the first pass asks for the
// thread's next group), integer or dense.
inline void part_rows(const QPart& w, const QAct& a, int64_t g, float* y, int64_t ldy,
                      Next ahead) {
  if (fast_packing(w, a.rows)) return fast_part_rows(w, a, g, y, ldy, ahead);
  constexpr int R = 4;
  auto rows = [&](auto r_const, int64_t r, Next next) {
    constexpr int n = decltype(r_const)::value;
    if (w.bits) group_rows<n>(w, a, g, r, y, ldy, next);
    else dense_rows<n>(w, a, g, r, y, ldy, next);
  };
  int64_t r = 0;
  for (; r + R <= a.rows; r += R, ahead = {}) rows(std::integral_constant<int, R>{}, r, ahead);
  switch (a.rows - r) {
    case 3: rows(std::integral_constant<int, 3>{}, r, ahead); break;
    case 2: rows(std::integral_constant<int, 2>{}, r, ahead); break;
    case 1: rows(std::integral_constant<int, 1>{}, r, ahead); break;
    default: break;
  }
}

}  // namespace adaspark
