// LFM2's gated short convolution (llama.cpp's lfm2 graph, ggml_ssm_conv) over an fp16 cache of
// each slot's B*x, the native twin of shortconv.py: a row's conv reads the B*x of its own path
// (the slots `src` names, tree rows' ancestors and committed slots alike), so a tree row is
// bit-identical to the same row in its chain, and commit / truncate carry the conv state as
// they carry K/V.
#pragma once

#include "parallel.h"
#include "simd.h"

namespace adaspark {

// One conv layer's slots for one sequence: B*x rows of dim fp16 values, slot-major.
struct ConvSegment {
  uint16_t* bx;
  int64_t capacity;
};

// bcx [n, 3 * dim]: each row's in_proj output, B | C | x. First every row's B*x into its slot
// (slot_of[r] of its sequence's segment), rounded to fp16; then every row's
// y = C * sum_k taps[:, k] * bx[src[r, k]] (k from 0, the oldest, as ggml sums them; a slot
// of -1 reads 0), each B*x read back from the cache, into out [n, dim]. taps [L, dim] float32
// (the file's [dim, L] transposed: tap k's weights contiguous).
inline void shortconv_rows(const float* bcx, int64_t n, int64_t dim, const float* taps,
                           int64_t L, const int64_t* src, const std::vector<ConvSegment>& segs,
                           const int64_t* seq_of, const int64_t* slot_of, float* out) {
  for_rows(n, [&](int64_t r) {
    const float* row = bcx + r * 3 * dim;
    const ConvSegment& sg = segs[seq_of[r]];
    uint16_t* dst = sg.bx + slot_of[r] * dim;
    for (int64_t i = 0; i < dim; i += W)
      vstore_h(dst + i, vmul(vload(row + i), vload(row + 2 * dim + i)));
  });
  for_rows(n, [&](int64_t r) {
    const float* gate_c = bcx + r * 3 * dim + dim;
    const ConvSegment& sg = segs[seq_of[r]];
    float* y = out + r * dim;
    for (int64_t i = 0; i < dim; i += W) {
      vf sum = vzero();
      for (int64_t k = 0; k < L; ++k) {
        const int64_t s = src[r * L + k];
        if (s < 0) continue;  // 0 * w adds +0: the sum is the same without it
        sum = vadd(sum, vmul(vload_h(sg.bx + s * dim + i), vload(taps + k * dim + i)));
      }
      vstore(y + i, vmul(vload(gate_c + i), sum));
    }
  });
}

}  // namespace adaspark
