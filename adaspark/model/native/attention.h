// Tree attention over the fp16 K/V cache.
#pragma once

#include <tuple>

#include "parallel.h"
#include "simd.h"

namespace adaspark {

// Attention geometry: query heads share kv heads in groups (GQA).
struct Heads {
  int64_t heads, kv_heads, hd;
  float scale = 0.0f;  // scores = q.k * scale; 0: 1/sqrt(hd)
};

// K and V rows (float, kv_heads * hd each) into their fp16 cache slot `slot` of one layer.
inline void store_kv(const Heads& hs, const float* k, const float* v, uint16_t* kl, uint16_t* vl,
                     int64_t slot, int64_t capacity) {
  for (int64_t g = 0; g < hs.kv_heads; ++g) {
    uint16_t* kd = kl + (g * capacity + slot) * hs.hd;
    uint16_t* vd = vl + (g * capacity + slot) * hs.hd;
    for (int64_t i = 0; i < hs.hd; i += W) {
      vstore_h(kd + i, vload(k + g * hs.hd + i));
      vstore_h(vd + i, vload(v + g * hs.hd + i));
    }
  }
}

// W dot products at once: p[j] holds slot j's lane-wise partial sums; lane j of the result is
// their total, by one fixed tree per slot (pairs inside each 128-bit lane, then across lanes)
// whatever the other slots are.
#ifdef ADASPARK_AVX512
inline vf sum_lanes(const vf* p) {
  vf a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j)
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * j], p[2 * j + 1]),
                         _mm512_unpackhi_ps(p[2 * j], p[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(a[2 * j]), y = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int j = 0; j < 2; ++j)  // 128-bit lanes (0,1) and (2,3) of each b
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#else
inline vf sum_lanes(const vf* p) {
  vf a[4], b[2];
  for (int j = 0; j < 4; ++j)
    a[j] = _mm256_add_ps(_mm256_unpacklo_ps(p[2 * j], p[2 * j + 1]),
                         _mm256_unpackhi_ps(p[2 * j], p[2 * j + 1]));
  for (int j = 0; j < 2; ++j) {
    const __m256d x = _mm256_castps_pd(a[2 * j]), y = _mm256_castps_pd(a[2 * j + 1]);
    b[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
                       _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
#endif

// Softmax attention over each query's visible slots: the committed ones, then its row's
// ancestors in the call in row order (parents precede children, so the i-th visible slot holds
// position i). A task takes one kv head and a block of the queries that share it (row-major
// over (row, head in the group); a segment's last block only the rest, each query computed
// once), so each committed K/V slot is converted from fp16 once for them all (block_sizes
// sizes the blocks). Scores come W
// slots at a time (sum_lanes); every query sums its dots, exps and weighted values in one
// fixed order per slot, so a row's result is the same in any call:
// tree, chain, step or prefill. C: head_dim / W, a constant so accumulators stay in registers.
//
// A sliding window (Segment::window) hides the keys at positions <= p - window from a row at
// position p: committed slot s sits at position s, a row of the call at its own. Hidden keys
// keep their index with a weight of exactly 0 (sums and maxima untouched), and a query's sums
// start at the W-group holding its first visible slot, so a row still comes out the same in
// any call: the groups before that one would only add zeros.
constexpr int kMaxQueries = 32;  // a block's queries at most (their scores stay in L2)

// Whether attend() takes this head_dim: 2, 4, 8, 16 or 32 vectors.
inline bool attend_takes(int64_t hd) {
  const int64_t c = hd / W;
  return hd % W == 0 && (c == 2 || c == 4 || c == 8 || c == 16 || c == 32);
}

//
// A call may hold the rows of several sequences, each over its own cache (Segment); a row
// sees only its own sequence, so it comes out the same batched or alone.
struct Segment {
  const uint16_t *kl, *vl;  // this layer's K and V of the sequence's cache
  int64_t start, capacity;  // committed slots, slots in all
  int64_t row0, n;          // its rows of the call: [row0, row0 + n)
  const bool* anc;          // anc[r * anc_stride + t]: its row r sees its row t
  int64_t anc_stride;
  const int64_t* pos = nullptr;  // its rows' positions (read with a window)
  int64_t window = 0;            // a row sees keys at positions > its own - window; 0: all
  bool chain = false;  // anc is causal and row r sits at position start + r (is_chain)
  bool block = false;  // every row sees all n rows and row r sits at position start + r
};

// Whether a segment's n rows are a plain chain from `start`: row r sees rows t <= r and sits at
// position start + r, so its visible slots are the cache's [0, start + r] (a prefill chunk).
inline bool is_chain(const bool* anc, int64_t stride, const int64_t* pos, int64_t start,
                     int64_t n) {
  for (int64_t r = 0; r < n; ++r) {
    if (pos[r] != start + r) return false;
    for (int64_t t = 0; t < n; ++t)
      if (anc[r * stride + t] != (t <= r)) return false;
  }
  return true;
}

// Chains of at least this many rows take attend_chain (shorter ones, verify chains and steps,
// keep attend_c's task shape): a row's result is the same on either path.
constexpr int64_t kChainRows = 17;

// One query's softmax weights over its scores sc[from, m), the order both attention paths keep:
// slots [from, hide) and those `hidden(f)` passes to f are -inf, the max over whole W-groups
// then the tail, the exps of the W-groups padded to m with -inf, then the hidden slots and the
// padding set to exactly 0; returns 1 / their lane sum.
template <class Hidden>
inline float softmax_weights(float* sc, int64_t from, int64_t hide, int64_t m, Hidden hidden) {
  for (int64_t s = from; s < hide; ++s) sc[s] = -INFINITY;
  hidden([&](int64_t s) { sc[s] = -INFINITY; });
  vf top = vset1(-INFINITY);
  for (int64_t s = from; s + W <= m; s += W) top = vmax(top, vload(sc + s));
  float mx = hmax(top);
  for (int64_t s = m / W * W; s < m; ++s) mx = std::max(mx, sc[s]);
  const int64_t padded = round_up(m, W);
  for (int64_t s = m; s < padded; ++s) sc[s] = -INFINITY;
  const vf shift = vset1(mx);
  for (int64_t s = from; s < padded; s += W)  // exp(-inf - mx) clamps to ~0 ...
    vstore(sc + s, vexp(vsub(vload(sc + s), shift)));
  for (int64_t s = m; s < padded; ++s) sc[s] = 0.0f;  // ... so padding and hidden
  for (int64_t s = from; s < hide; ++s) sc[s] = 0.0f;  // keys are set to add nothing
  hidden([&](int64_t s) { sc[s] = 0.0f; });
  vf lanes = vzero();
  for (int64_t s = from; s < padded; s += W) lanes = vadd(lanes, vload(sc + s));
  return 1.0f / vsum(lanes);
}

// Scores of W slots whose keys (float32) are in `keys`, for the query at qp: slot j's dot
// sums its C products in order (c outer, so the W independent sums use C + W registers
// instead of holding the query's C vectors and the sums at once), then sum_lanes.
template <int C>
inline vf score_keys(const float* qp, const float (*keys)[C * W], float scale) {
  vf p[W];
  const vf q0 = vload(qp);
  for (int j = 0; j < W; ++j) p[j] = vmul(q0, vload(keys[j]));
  for (int c = 1; c < C; ++c) {
    const vf qc = vload(qp + c * W);
    for (int j = 0; j < W; ++j) p[j] = vfma(qc, vload(keys[j] + c * W), p[j]);
  }
  return vmul(sum_lanes(p), vset1(scale));
}

// acc_of(i) += w_s v_s for each query i < qn over its slots [max(s0, lo[i]), min(s0 + W,
// end[i])) of a value tile (slots s0 .. s0 + W - 1 in float32), in slot order; w_s =
// scores[i * stride + s]. The accumulators stay in registers for the tile (8 vectors at a
// time), and two queries that both cover the whole tile share its loads: with C < 8 one
// query's C fma chains are too few to hide the fma latency. Each query's own additions keep
// their order, so the result is the same however the queries are grouped.
template <int C, class AccOf>
inline void add_value_tile(const float (*tile)[C * W], int64_t s0, int qn, const int64_t* lo,
                           const int64_t* end, const float* scores, int64_t stride,
                           const AccOf& acc_of) {
  constexpr int P = C < 8 ? C : 8;  // vectors a pass
  auto whole = [&](int i) { return lo[i] <= s0 && s0 + W <= end[i]; };
  for (int i = 0; i < qn;) {
    if (C < 8 && i + 1 < qn && whole(i) && whole(i + 1)) {
      const float *sa = scores + i * stride, *sb = sa + stride;
      float *oa = acc_of(i), *ob = acc_of(i + 1);
      vf acc[2][C];
      for (int c = 0; c < C; ++c) {
        acc[0][c] = vload(oa + c * W);
        acc[1][c] = vload(ob + c * W);
      }
      for (int j = 0; j < W; ++j) {
        const vf wa = vset1(sa[s0 + j]), wb = vset1(sb[s0 + j]);
        for (int c = 0; c < C; ++c) {
          const vf v = vload(tile[j] + c * W);
          acc[0][c] = vfma(wa, v, acc[0][c]);
          acc[1][c] = vfma(wb, v, acc[1][c]);
        }
      }
      for (int c = 0; c < C; ++c) {
        vstore(oa + c * W, acc[0][c]);
        vstore(ob + c * W, acc[1][c]);
      }
      i += 2;
      continue;
    }
    const int64_t a = std::max(s0, lo[i]), b = std::min(s0 + W, end[i]);
    if (a < b) {
      const float* sc = scores + i * stride;
      float* o = acc_of(i);
      for (int c0 = 0; c0 < C; c0 += P) {
        vf acc[P];
        for (int c = 0; c < P; ++c) acc[c] = vload(o + (c0 + c) * W);
        for (int64_t s = a; s < b; ++s) {
          const vf w = vset1(sc[s]);
          for (int c = 0; c < P; ++c) acc[c] = vfma(w, vload(tile[s - s0] + (c0 + c) * W), acc[c]);
        }
        for (int c = 0; c < P; ++c) vstore(o + (c0 + c) * W, acc[c]);
      }
    }
    ++i;
  }
}

// `count` fp16 K or V rows (row j at row(j)) into a float32 tile of W slots; slots from
// `count` on are zeros.
template <int C, class Row>
inline void load_rows(float (*tile)[C * W], int64_t count, const Row& row) {
  for (int j = 0; j < W; ++j)
    for (int c = 0; c < C; ++c)
      vstore(tile[j] + c * W, j < count ? vload_h(row(j) + c * W) : vzero());
}

// W slots of one kv head's fp16 K or V rows from slot s0 (slot s at base + s * hd).
template <int C>
inline void load_tile(float (*tile)[C * W], const uint16_t* base, int64_t s0, int64_t count) {
  load_rows<C>(tile, count, [&](int j) { return base + (s0 + j) * C * W; });
}

// Asks for the cache lines of `count` K or V rows (hd fp16 each) from slot s0 (into L1 by
// default). A step of many one-row sequences reads each one's cache once, tens of KiB a kv
// head, from memory: the hardware prefetchers barely start on streams that short, so the reads
// ask ahead themselves (a prefetch changes no value). 32 sequences x 1 row on Zen 5 took
// 0.84-0.94x the time at contexts 300-600 (docs/results/zen5-s30; 8 KiB ahead into L2: 0.93-0.96x).
template <int Hint = _MM_HINT_T0>
inline void prefetch_slots(const uint16_t* base, int64_t s0, int64_t count, int64_t hd) {
  const char* p = reinterpret_cast<const char*>(base + s0 * hd);
  for (int64_t b = 0; b < count * hd * 2; b += 64)
    _mm_prefetch(p + b, static_cast<_mm_hint>(Hint));
}

// How far ahead of its tile the key loop asks for keys: 16 KiB, whole tiles (32 KiB timed
// no better).
inline int64_t ahead_slots(int64_t hd) { return std::max<int64_t>(1, 16384 / (2 * hd * W)) * W; }

// The first committed slot a segment's rows can see (0 without a window), what its tasks
// read first: the next task's first keys are asked for while the current one runs.
inline int64_t first_slot(const Segment& sg) {
  if (!sg.window) return 0;
  const int64_t p = *std::min_element(sg.pos, sg.pos + sg.n);
  return std::max<int64_t>(0, p - sg.window + 1) / W * W;
}

// One task of attend_c: kv head g and the Q queries from q0 of segment sg (Q <= kMaxQueries).
// scores: Q * stride floats. Each committed key and value tile is converted from fp16 once
// for the Q queries; a query's value sums live in its rows of `out` between tiles.
template <int C>
void attend_block(const Heads& hs, const float* q_rows, int64_t q_stride, const Segment& sg,
                  int64_t g, int64_t q0, int Q, float scale, std::vector<float>& scores,
                  float* out) {
  const int64_t heads = hs.heads, hd = hs.hd, group = hs.heads / hs.kv_heads;
  const int64_t start = sg.start, n = sg.n, stride = round_up(start + n, W);
  alignas(64) float tile[W][C * W];  // W slots' keys, then values, in float32
  const uint16_t* kg = sg.kl + g * sg.capacity * hd;
  const uint16_t* vg = sg.vl + g * sg.capacity * hd;
  int64_t row[kMaxQueries], head[kMaxQueries], m[kMaxQueries], lo[kMaxQueries],
      from[kMaxQueries], committed[kMaxQueries];
  const float* qp[kMaxQueries];
  float* o[kMaxQueries];
  float inv[kMaxQueries];
  for (int i = 0; i < Q; ++i) {
    const int64_t qi = q0 + i;
    row[i] = qi / group;
    head[i] = g * group + qi % group;
    // the first visible position, and the W-group where the query's sums start
    lo[i] = sg.window ? std::max<int64_t>(0, sg.pos[row[i]] - sg.window + 1) : 0;
    from[i] = std::min(lo[i], start) / W * W;
    committed[i] = start;
    qp[i] = q_rows + (sg.row0 + row[i]) * q_stride + head[i] * hd;
    o[i] = out + (sg.row0 + row[i]) * heads * hd + head[i] * hd;
  }
  auto score = [&](int i, int64_t s0) {
    vstore(scores.data() + i * stride + s0, score_keys<C>(qp[i], tile, scale));
  };
  auto load_keys = [&](const uint16_t* const* ks, int64_t count) {
    load_rows<C>(tile, count, [&](int j) { return ks[j]; });
  };
  // calls f(index) for each ancestor of query i the window hides
  auto hidden_ancestors = [&](int i, auto f) {
    if (!sg.window) return;
    for (int64_t j = 0, s = start; j < n; ++j) {
      if (!sg.anc[row[i] * sg.anc_stride + j]) continue;
      if (sg.pos[j] < lo[i]) f(s);
      ++s;
    }
  };
  const int64_t from_all = *std::min_element(from, from + Q);
  // whole groups of committed slots, shared by the queries; a partial last group is
  // scored per query below, together with the row's ancestors that follow it
  const int64_t ahead = ahead_slots(hd);
  for (int64_t s0 = from_all; s0 + W <= start; s0 += W) {
    if (s0 + ahead < start)
      prefetch_slots(kg, s0 + ahead, std::min<int64_t>(W, start - s0 - ahead), hd);
    // the same slots' values, for the value pass below: into L2, as they are read only after
    // every key (a long context's values would push the keys asked for ahead out of L1)
    prefetch_slots<_MM_HINT_T1>(vg, s0, W, hd);
    load_tile<C>(tile, kg, s0, W);
    for (int i = 0; i < Q; ++i) score(i, s0);
  }
  const uint16_t* ks[W];
  for (int i = 0; i < Q; ++i) {  // the row's ancestors, then its softmax
    float* sc = scores.data() + i * stride;
    int64_t s0 = start / W * W, count = start - s0;
    for (int j = 0; j < count; ++j) ks[j] = kg + (s0 + j) * hd;
    m[i] = start;
    for (int64_t j = 0; j < n; ++j) {
      if (!sg.anc[row[i] * sg.anc_stride + j]) continue;
      ks[count++] = kg + (start + j) * hd;
      ++m[i];
      if (count == W) {
        load_keys(ks, count);
        score(i, s0);
        s0 += W;
        count = 0;
      }
    }
    if (count) {
      load_keys(ks, count);
      score(i, s0);
    }
    const int64_t hide = std::min(lo[i], start);  // committed slots [from, hide) hidden
    inv[i] = softmax_weights(sc, from[i], hide, m[i], [&](auto f) { hidden_ancestors(i, f); });
    for (int c = 0; c < C; ++c) vstore(o[i] + c * W, vzero());
  }
  // committed values, one tile at a time for all the queries; hidden slots are skipped, not
  // weighted by 0 (an fp16 inf stays out)
  const int64_t lo_all = *std::min_element(lo, lo + Q);
  for (int64_t s0 = lo_all / W * W; s0 < start; s0 += W) {
    load_tile<C>(tile, vg, s0, std::min<int64_t>(W, start - s0));
    add_value_tile<C>(tile, s0, Q, lo, committed, scores.data(), stride,
                      [&](int i) { return o[i]; });
  }
  for (int i = 0; i < Q; ++i) {  // the row's ancestors' values, then 1 / sum
    const float* sc = scores.data() + i * stride;
    int64_t s = start;
    vf acc[C];
    for (int c = 0; c < C; ++c) acc[c] = vload(o[i] + c * W);
    for (int64_t j = 0; j < n; ++j) {
      if (!sg.anc[row[i] * sg.anc_stride + j]) continue;
      if (sg.window && sg.pos[j] < lo[i]) {
        ++s;
        continue;
      }
      const uint16_t* vj = vg + (start + j) * hd;
      const vf w = vset1(sc[s++]);
      for (int c = 0; c < C; ++c) acc[c] = vfma(w, vload_h(vj + c * W), acc[c]);
    }
    for (int c = 0; c < C; ++c) vstore(o[i] + c * W, vmul(acc[c], vset1(inv[i])));
  }
}

// Queries a block for each segment (n rows, group queries a row over each kv head): as few
// blocks as kMaxQueries allows, since every block converts the head's committed K/V from fp16
// again; then, while the tasks (kv heads x blocks) do not split evenly over the threads, one
// more block for the segment with the most queries a block, as long as its blocks keep two
// rows' queries or more (a one-row step's three tasks on two threads stay: splitting its
// queries would convert each head's K/V twice, which costs more than one thread's wait).
inline std::vector<int64_t> block_sizes(const std::vector<Segment>& segs, int64_t kv_heads,
                                        int64_t group, int64_t threads) {
  std::vector<int64_t> blocks(segs.size()), size(segs.size());
  int64_t tasks = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    blocks[i] = (segs[i].n * group + kMaxQueries - 1) / kMaxQueries;
    tasks += kv_heads * blocks[i];
  }
  auto per_block = [&](size_t i) { return (segs[i].n * group + blocks[i] - 1) / blocks[i]; };
  while (threads > 1 && tasks % threads != 0) {
    size_t widest = 0;
    for (size_t i = 1; i < segs.size(); ++i)
      if (per_block(i) > per_block(widest)) widest = i;
    if (per_block(widest) < 2 * group) break;
    ++blocks[widest];
    tasks += kv_heads;
  }
  for (size_t i = 0; i < segs.size(); ++i) size[i] = per_block(i);
  return size;
}

template <int C>
void attend_c(const Heads& hs, const float* q_rows, int64_t q_stride,
              const std::vector<Segment>& segs, float* out) {
  const int64_t hd = hs.hd, group = hs.heads / hs.kv_heads;
  const std::vector<int64_t> per =
      block_sizes(segs, hs.kv_heads, group, at::get_num_threads());
  std::vector<int64_t> first(segs.size() + 1, 0);  // a segment's tasks: kv heads x query blocks
  int64_t most = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    first[i + 1] = first[i] + hs.kv_heads * ((segs[i].n * group + per[i] - 1) / per[i]);
    most = std::max(most, per[i] * round_up(segs[i].start + segs[i].n, W));
  }
  const float scale = hs.scale ? hs.scale : 1.0f / std::sqrt(static_cast<float>(hd));
  // task t: its segment, kv head and first query
  auto task = [&](int64_t t) {
    const size_t si = std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1;
    const int64_t blocks = (segs[si].n * group + per[si] - 1) / per[si];
    return std::tuple<size_t, int64_t, int64_t>{si, (t - first[si]) / blocks,
                                                (t - first[si]) % blocks * per[si]};
  };
  // claimed rather than split in halves: sequences of unequal lengths make unequal tasks
  for_claimed(first.back(), [&](int64_t t, int64_t next, bool) {
    thread_local std::vector<float> scores;
    scores.resize(most);
    if (next >= 0) {  // the next task's first keys, while this one runs
      const auto ahead = task(next);
      const Segment& nx = segs[std::get<0>(ahead)];
      const int64_t s0 = first_slot(nx);
      prefetch_slots(nx.kl + std::get<1>(ahead) * nx.capacity * hd, s0,
                     std::max<int64_t>(0, std::min(ahead_slots(hd), nx.start - s0)), hd);
    }
    const auto [si, g, q0] = task(t);
    const Segment& sg = segs[si];
    const int qn = static_cast<int>(std::min<int64_t>(per[si], sg.n * group - q0));
    attend_block<C>(hs, q_rows, q_stride, sg, g, q0, qn, scale, scores, out);
  });
}

// A chain segment's queries (attend_c's order: row-major over (row, head in the group)) over
// the cache alone: its rows' K/V are in their slots already and row r's visible slots are
// [0, start + r] ([0, start + n) for a block segment: the drafter's), so a block of up to
// kChainQueries queries shares every key and value tile, each converted from fp16 once for
// the block, and no mask is read. Per query the arithmetic is
// attend_c's: the same per-slot scores (sum_lanes), max, exps, lane sums from a W-group before
// its first visible slot (earlier groups would add only zeros) and values added in slot order,
// so a row comes out bit for bit as attend_c computes it, over a cached prefix or not.
constexpr int kChainQueries = 32;

template <int C>
void attend_chain(const Heads& hs, const float* q_rows, int64_t q_stride, const Segment& sg,
                  float* out) {
  const int64_t heads = hs.heads, hd = hs.hd, group = hs.heads / hs.kv_heads;
  const int64_t start = sg.start, n = sg.n, nq = n * group;
  // a block segment's few queries in two blocks a kv head: tasks for both threads
  const int64_t per = sg.block ? std::min<int64_t>(kChainQueries, (nq + 1) / 2) : kChainQueries;
  const int64_t blocks = (nq + per - 1) / per;
  const int64_t stride = round_up(start + n, W);
  const float scale = hs.scale ? hs.scale : 1.0f / std::sqrt(static_cast<float>(hd));
  // tasks (block, kv head), the longest rows first so that claiming them keeps both busy
  for_claimed(blocks * hs.kv_heads, [&](int64_t t, int64_t, bool) {
    thread_local std::vector<float> scores;
    scores.resize(kChainQueries * stride);
    alignas(64) float tile[W][C * W];  // W slots' keys, then values, in float32
    const int64_t g = t % hs.kv_heads, q0 = (blocks - 1 - t / hs.kv_heads) * per;
    const int qn = static_cast<int>(std::min<int64_t>(per, nq - q0));
    const uint16_t* kg = sg.kl + g * sg.capacity * hd;
    const uint16_t* vg = sg.vl + g * sg.capacity * hd;
    int64_t row[kChainQueries], head[kChainQueries], m[kChainQueries], lo[kChainQueries],
        from[kChainQueries];
    float inv[kChainQueries];
    for (int i = 0; i < qn; ++i) {
      const int64_t qi = q0 + i;
      row[i] = qi / group;
      head[i] = g * group + qi % group;
      m[i] = start + (sg.block ? n : row[i] + 1);  // visible slots [lo, m)
      lo[i] = sg.window ? std::max<int64_t>(0, start + row[i] - sg.window + 1) : 0;
      from[i] = lo[i] / W * W;
    }
    const int64_t lo_all = *std::min_element(lo, lo + qn);
    const int64_t end = *std::max_element(m, m + qn);
    for (int64_t s0 = lo_all / W * W; s0 < end; s0 += W) {  // scores, one key tile at a time
      load_tile<C>(tile, kg, s0, std::min<int64_t>(W, end - s0));  // slots past `end` stay out
      for (int i = 0; i < qn; ++i) {
        if (s0 >= m[i] || s0 < from[i]) continue;
        const float* qp = q_rows + (sg.row0 + row[i]) * q_stride + head[i] * hd;
        vstore(scores.data() + i * stride + s0, score_keys<C>(qp, tile, scale));
      }
    }
    for (int i = 0; i < qn; ++i)  // softmax: attend_c's, hidden slots being [from, lo)
      inv[i] = softmax_weights(scores.data() + i * stride, from[i], lo[i], m[i], [](auto) {});
    // values: per query acc += w_s v_s over its slots in slot order, one value tile at a time;
    // the accumulators live in `out` between tiles
    auto out_of = [&](int i) { return out + (sg.row0 + row[i]) * heads * hd + head[i] * hd; };
    for (int i = 0; i < qn; ++i)
      for (int c = 0; c < C; ++c) vstore(out_of(i) + c * W, vzero());
    for (int64_t s0 = lo_all / W * W; s0 < end; s0 += W) {
      load_tile<C>(tile, vg, s0, std::min<int64_t>(W, end - s0));
      add_value_tile<C>(tile, s0, qn, lo, m, scores.data(), stride, out_of);
    }
    for (int i = 0; i < qn; ++i) {
      float* o = out_of(i);
      for (int c = 0; c < C; ++c) vstore(o + c * W, vmul(vload(o + c * W), vset1(inv[i])));
    }
  });
}

// Long chain segments on attend_chain, the rest on attend_c.
template <int C>
void attend_segments(const Heads& hs, const float* q_rows, int64_t q_stride,
                     const std::vector<Segment>& segs, float* out) {
  std::vector<Segment> rest;
  for (const Segment& sg : segs) {
    if ((sg.chain && sg.n >= kChainRows) || sg.block)
      attend_chain<C>(hs, q_rows, q_stride, sg, out);
    else
      rest.push_back(sg);
  }
  if (!rest.empty()) attend_c<C>(hs, q_rows, q_stride, rest, out);
}

void attend(const Heads& hs, const float* q_rows, int64_t q_stride,
            const std::vector<Segment>& segs, float* out) {
  switch (hs.hd / W) {
    case 2: return attend_segments<2>(hs, q_rows, q_stride, segs, out);
    case 4: return attend_segments<4>(hs, q_rows, q_stride, segs, out);
    case 8: return attend_segments<8>(hs, q_rows, q_stride, segs, out);
    case 16: return attend_segments<16>(hs, q_rows, q_stride, segs, out);
    case 32: return attend_segments<32>(hs, q_rows, q_stride, segs, out);
    default: TORCH_CHECK(false, "head_dim must be 2, 4, 8, 16 or 32 vectors");
  }
}

// One sequence's n rows over one cache, anc [n, n].
void attend(const Heads& hs, const float* q_rows, int64_t q_stride, const uint16_t* kl,
            const uint16_t* vl, int64_t start, int64_t capacity, const bool* anc, int64_t n,
            float* out) {
  attend(hs, q_rows, q_stride, {Segment{kl, vl, start, capacity, 0, n, anc, n}}, out);
}

}  // namespace adaspark
