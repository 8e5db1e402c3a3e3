// The AMX tile path of the avx512 build.
#pragma once

#include "qdot.h"

namespace adaspark {

#ifdef ADASPARK_AVX512
// --- AMX tiles (Sapphire Rapids and later, where the OS grants the tile state) ------------------
//
// One tile multiply (tdpbsud: int8 activations x uint8 weights, int32 sums) does a block of 32
// inputs for up to 16 rows x 16 outputs. The weights' packed layout is already the B tile's
// (8 chunks of 4 inputs x 16 outputs, 64 bytes each), loaded straight from the weight: a tile
// load of bytes just stored waits for the stores to retire, which costs more than the multiply
// (so 8-bit blocks are never rewritten first); narrower codes are unpacked into bytes in L1. The
// integer sums equal vpdpbusd's and the float steps per (row, 16 outputs) are group_rows' own,
// so a row comes out bit-identical on either path: which path a call takes (by its row count)
// cannot change a row.

// Whether this process may use AMX: the CPU has AMX-TILE and AMX-INT8, ADASPARK_AMX is not
// "off", and Linux grants the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1))
      return false;
    const char* env = std::getenv("ADASPARK_AMX");
    if (env && std::strcmp(env, "off") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// Rows at least this many go through the tiles: below, vpdpbusd is as fast; from 5 rows it
// takes two passes over each group (4 + 1 rows) where one row tile takes them all.
constexpr int64_t kAmxMinRows = 5;

// Whether calls use the tiles: amx_usable() unless turned off (tests and benchmarks compare).
inline bool& amx_on() {
  static bool on = amx_usable();
  return on;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: sums [R rows x 16 outputs] int32 of four blocks; 4/5: activations [R x 32
// bytes]; 6/7: weights [8 x 64 bytes]. Four blocks in flight: the tile registers are not
// renamed, so fewer would leave each multiply and store waiting on the one before.
inline void amx_configure(int64_t R) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(R);
    cfg.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(R);
    cfg.colsb[t] = kBlock;
    cfg.rows[t + 2] = 8;
    cfg.colsb[t + 2] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Group g's B tiles, one per block (512 bytes each): the packed weight itself for 8 bits; else
// every block's codes unpacked into bytes in `bytes` [nb * 1024] first, all before the first
// tile load reads them (a tile load waits for the stores before it to retire). Halves 2: two
// tiles a block, its first 16 inputs' chunks with the others zero, then the reverse, so that
// two multiplies give the two halves' sums.
inline const uint8_t* weight_tiles(const QPart& w, int64_t g, uint8_t* bytes) {
  const uint8_t* qg = w.qp + g * w.nb * w.block_bytes();
  if (w.bits == 8 && w.halves == 1) return qg;
  for (int64_t b = 0; b < w.nb; ++b) {
    __m512i u[8];
    unpack_block(w, qg + b * w.block_bytes(), u);
    if (w.halves == 1) {
      for (int j = 0; j < 8; ++j) _mm512_store_si512(bytes + 512 * b + 64 * j, u[j]);
      continue;
    }
    for (int j = 0; j < 8; ++j) {
      _mm512_store_si512(bytes + 1024 * b + 64 * j, j < 4 ? u[j] : _mm512_setzero_si512());
      _mm512_store_si512(bytes + 1024 * b + 512 + 64 * j, j < 4 ? _mm512_setzero_si512() : u[j]);
    }
  }
  return bytes;
}

// acc[i] += block b's contribution to row r0+i, from its integer sums (group_rows' steps).
template <int R>
inline void scale_block(const QPart& w, const QAct& a, int64_t g, int64_t b, int64_t r0,
                        const int32_t* sums, __m512* acc) {
  const auto [dw, mw] = block_scales(w, g, b, 0);
  for (int i = 0; i < R; ++i)
    acc[i] = add_block(acc[i], _mm512_load_si512(sums + 16 * i), dw, mw, w, a, r0 + i, b);
}

// Block b's integer sums into tile C: activations through tile A, weights through tile B.
#define ADASPARK_AMX_BLOCK(C, A, B, b)            \
  do {                                            \
    _tile_zero(C);                                \
    _tile_loadd(A, x + (b) * kBlock, a.k);        \
    _tile_loadd(B, tiles + (b) * 512, 64);        \
    _tile_dpbsud(C, A, B);                        \
  } while (0)

// y[r, 16g .. 16g+15] for rows [r0, r0+R), R <= 16, tiles configured for R rows, the group's
// B tiles from weight_tiles. Blocks are added to each accumulator in order, as in group_rows.
template <int R>
void group_rows_amx(const QPart& w, const QAct& a, int64_t g, const uint8_t* tiles,
                    int64_t r0, float* y, int64_t ldy, Next ahead) {
  alignas(64) int32_t sums[4][16 * 16];
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* x = a.q.data() + r0 * a.k;
  int64_t b = 0;
  for (; b + 4 <= w.nb; b += 4) {
    if (ahead.w)
      for (int j = 0; j < 4; ++j) prefetch_block(*ahead.w, ahead.g, b + j);
    ADASPARK_AMX_BLOCK(0, 4, 6, b);
    ADASPARK_AMX_BLOCK(1, 5, 7, b + 1);
    ADASPARK_AMX_BLOCK(2, 4, 6, b + 2);
    ADASPARK_AMX_BLOCK(3, 5, 7, b + 3);
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    for (int j = 0; j < 4; ++j) scale_block<R>(w, a, g, b + j, r0, sums[j], acc);
  }
  const int64_t left = w.nb - b;
  for (int64_t j = b; ahead.w && j < w.nb; ++j) prefetch_block(*ahead.w, ahead.g, j);
  if (left > 0) ADASPARK_AMX_BLOCK(0, 4, 6, b);
  if (left > 1) ADASPARK_AMX_BLOCK(1, 5, 7, b + 1);
  if (left > 2) ADASPARK_AMX_BLOCK(2, 4, 6, b + 2);
  if (left > 0) _tile_stored(0, sums[0], 64);
  if (left > 1) _tile_stored(1, sums[1], 64);
  if (left > 2) _tile_stored(2, sums[2], 64);
  for (int j = 0; j < left; ++j) scale_block<R>(w, a, g, b + j, r0, sums[j], acc);
  const int64_t valid = std::min<int64_t>(16, w.n - 16 * g);
  for (int i = 0; i < R; ++i) vstore_first(y + (r0 + i) * ldy + 16 * g, acc[i], valid);
}

// The same for halves 2 (Q6_K): per block two multiplies (one tile of A, the block's two B
// tiles), two blocks in flight; each block ends as group_rows ends it, from the same two sums.
template <int R>
void group_rows_amx_halves(const QPart& w, const QAct& a, int64_t g, const uint8_t* tiles,
                           int64_t r0, float* y, int64_t ldy, Next ahead) {
  alignas(64) int32_t sums[4][16 * 16];
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* x = a.q.data() + r0 * a.k;
  auto end = [&](int64_t b, const int32_t* s0, const int32_t* s1) {
    const auto [d0, d1] = block_scales(w, g, b, 0);
    for (int i = 0; i < R; ++i)
      acc[i] = add_halves(acc[i], _mm512_load_si512(s0 + 16 * i), _mm512_load_si512(s1 + 16 * i),
                          d0, d1, w, a, r0 + i, b);
  };
  int64_t b = 0;
  for (; b + 2 <= w.nb; b += 2) {
    if (ahead.w) {
      prefetch_block(*ahead.w, ahead.g, b);
      prefetch_block(*ahead.w, ahead.g, b + 1);
    }
    _tile_zero(0);
    _tile_loadd(4, x + b * kBlock, a.k);
    _tile_loadd(6, tiles + 2 * b * 512, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_zero(1);
    _tile_loadd(7, tiles + (2 * b + 1) * 512, 64);
    _tile_dpbsud(1, 4, 7);
    _tile_zero(2);
    _tile_loadd(5, x + (b + 1) * kBlock, a.k);
    _tile_loadd(6, tiles + (2 * b + 2) * 512, 64);
    _tile_dpbsud(2, 5, 6);
    _tile_zero(3);
    _tile_loadd(7, tiles + (2 * b + 3) * 512, 64);
    _tile_dpbsud(3, 5, 7);
    _tile_stored(0, sums[0], 64);  // tile numbers must be immediates
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    end(b, sums[0], sums[1]);
    end(b + 1, sums[2], sums[3]);
  }
  if (b < w.nb) {
    if (ahead.w) prefetch_block(*ahead.w, ahead.g, b);
    _tile_zero(0);
    _tile_loadd(4, x + b * kBlock, a.k);
    _tile_loadd(6, tiles + 2 * b * 512, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_zero(1);
    _tile_loadd(7, tiles + (2 * b + 1) * 512, 64);
    _tile_dpbsud(1, 4, 7);
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    end(b, sums[0], sums[1]);
  }
  const int64_t valid = std::min<int64_t>(16, w.n - 16 * g);
  for (int i = 0; i < R; ++i) vstore_first(y + (r0 + i) * ldy + 16 * g, acc[i], valid);
}
#undef ADASPARK_AMX_BLOCK

template <int... Rs>
void amx_rows_dispatch(int64_t R, const QPart& w, const QAct& a, int64_t g,
                       const uint8_t* tiles, int64_t r0, float* y, int64_t ldy, Next ahead,
                       std::integer_sequence<int, Rs...>) {
  if (w.halves == 2)
    ((R == Rs + 1 ? (group_rows_amx_halves<Rs + 1>(w, a, g, tiles, r0, y, ldy, ahead), 0) : 0),
     ...);
  else
    ((R == Rs + 1 ? (group_rows_amx<Rs + 1>(w, a, g, tiles, r0, y, ldy, ahead), 0) : 0), ...);
}

// Whether a part goes through the tiles: every integer one; dense parts are float and take
// their own path inside the tile path's threads.
inline bool amx_takes(const QPart& w) { return w.bits > 0; }

// Every row through the tiles: ceil(rows / 16) row tiles of R = ceil(rows / tiles) rows, the
// last one ending at the last row (rows two tiles share come out the same from both).
void qmatmul_amx(const QWeight& w, const QAct& a, float* y, int64_t ldy) {
  const int64_t count = (a.rows + 15) / 16, R = (a.rows + count - 1) / count;
  thread_local std::vector<uint8_t> raw;  // the group's narrow codes as bytes, 64-aligned
  auto group = [&](int64_t i, int64_t ahead, bool first) {
    const int64_t p = w.part_of(i), g = i - w.first[p];
    const QPart& pt = w.parts[p];
    float* yp = y + w.col[p];
    if (first) prefetch_group(pt, g);
    const Next next = next_of(w, ahead);
    if (!amx_takes(pt)) return part_rows(pt, a, g, yp, ldy, next);
    uint8_t* bytes = raw.data() + (-reinterpret_cast<uintptr_t>(raw.data()) & 63);
    const uint8_t* tiles = weight_tiles(pt, g, bytes);
    for (int64_t t = 0; t < count; ++t)
      amx_rows_dispatch(R, pt, a, g, tiles, std::min(t * R, a.rows - R), yp, ldy,
                        t == 0 ? next : Next{}, std::make_integer_sequence<int, 16>{});
  };
  for_claimed(w.groups, group, [&] {
    amx_configure(R);  // tile state is per thread
    raw.resize(w.nb * 1024 + 64);
  }, [] { _tile_release(); });
}
#endif

}  // namespace adaspark
