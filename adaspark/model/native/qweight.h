// The packed weight layout (the contract native/__init__.py repacks GGUF blocks into) and
// int8 activations per block of 32.
#pragma once

#include "simd.h"
#include "parallel.h"

namespace adaspark {

// One packed weight of one GGUF type ([n, k], k a multiple of 32, in groups of 16 outputs),
// of one of two kinds:
//
// Integer (bits 4, 5, 6 or 8: the codes' width): per group and block of 32 inputs, the 16
// outputs' unsigned integers u (value d*u + m) in 8 chunks of 4 inputs, each chunk 64 bytes
// (4 per output) once unpacked, so one vector op multiplies a chunk of 4 inputs into 16
// outputs at once and the outputs stay in separate lanes (no horizontal sums). 8 bits: the 8
// chunks as bytes (512 bytes a block). Fewer: chunks 2i and 2i+1 share 64 bytes as low and
// high nibbles (256 bytes), then for 5 bits one 64-byte plane whose byte l holds in bit j the
// fifth bit of chunk j's byte l, for 6 bits two planes whose bits 2j, 2j+1 hold the top two
// bits of chunk j's (plane 0) or chunk 4+j's (plane 1). d, m: [groups, blocks, halves, 16],
// fp16 where every scale is exactly an fp16 (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1: GGUF's own), float32
// otherwise, or for K-quants as GGUF keeps them: d and m are small integers (uint8 or int8) and
// d_super, m_super the fp16 factors per 8 blocks [groups, blocks / 8, 16], the kernel's scale
// their float32 product (exact: 11 bits times at most 8).
// zero: where every m is -zero*d (Q8_0: 128, Q4_0: 8, Q5_0: 16, Q6_K: 32) a block's dot is
// d*dx*(sum(u*q) - zero*sum(q)), all in integers but one product, and m is not read (may be
// empty); 0 where m is free (Q4_1, Q5_1, Q4_K, Q5_K): the m term in float. halves 2 (Q6_K's
// scales per 16 inputs, with a zero): each half of a block has its own d, and the block's dot
// is two integer sums.
//
// Dense (bits 0): float weights as stored (fp16, bf16 or float32) in q, [groups, k, 16]: the
// group's 16 outputs side by side per input, multiplied by float32 activations (fdot.h).
struct QPart {
  int64_t bits, n, k, nb, groups, zero, halves;
  bool f32 = false;      // integer: scales stored as float32
  bool factors = false;  // integer: scales as d_super * d (and m_super * m)
  torch::ScalarType dense = torch::kFloat;  // dense: the stored float type
  torch::Tensor q, d, m, d_super, m_super;
  const uint8_t* qp;  // raw pointers, read once: data_ptr() checks types on every call
  const void *dp = nullptr, *mp = nullptr;
  const uint16_t *dsp = nullptr, *msp = nullptr;
  bool d_signed = false, m_signed = false;

  QPart(int64_t bits_, int64_t n_, int64_t k_, torch::Tensor q_, torch::Tensor d_,
        torch::Tensor m_, int64_t zero_, int64_t halves_, torch::Tensor d_super_,
        torch::Tensor m_super_)
      : bits(bits_), n(n_), k(k_), zero(zero_), halves(halves_), q(q_.contiguous()),
        d(d_.contiguous()), m(m_.contiguous()), d_super(d_super_.contiguous()),
        m_super(m_super_.contiguous()) {
    TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8,
                "weight bits must be 4, 5, 6 or 8");
    TORCH_CHECK(zero >= 0 && zero < 1 << bits, "zero must be one of u's values, or 0");
    TORCH_CHECK(halves == 1 || (halves == 2 && bits > 4 && zero > 0),
                "scales per half block need codes over 4 bits and a zero");
    shape();
    TORCH_CHECK(q.scalar_type() == torch::kUInt8 && q.numel() == groups * nb * block_bytes(),
                "packed weight has the wrong size");
    f32 = d.scalar_type() == torch::kFloat;
    factors = d_super.numel() > 0;
    auto small = [](const torch::Tensor& t) {
      return t.scalar_type() == torch::kUInt8 || t.scalar_type() == torch::kInt8;
    };
    TORCH_CHECK((factors ? small(d) : f32 || d.scalar_type() == torch::kHalf) &&
                    d.numel() == groups * nb * halves * 16,
                "scales: wrong size");
    TORCH_CHECK((factors ? small(m) : m.scalar_type() == d.scalar_type()) &&
                    (m.numel() == d.numel() || (zero && m.numel() == 0)),
                "minimums: wrong size");
    if (factors) {
      TORCH_CHECK(nb % 8 == 0 && d_super.scalar_type() == torch::kHalf &&
                      d_super.numel() == groups * nb / 8 * 16 &&
                      m_super.scalar_type() == torch::kHalf &&
                      m_super.numel() == (m.numel() ? d_super.numel() : 0),
                  "scale factors: wrong size");
      dsp = reinterpret_cast<const uint16_t*>(d_super.data_ptr<at::Half>());
      msp = m.numel() ? reinterpret_cast<const uint16_t*>(m_super.data_ptr<at::Half>()) : nullptr;
      d_signed = d.scalar_type() == torch::kInt8;
      m_signed = m.scalar_type() == torch::kInt8;
    }
    qp = q.data_ptr<uint8_t>();
    dp = d.data_ptr();
    mp = m.numel() ? m.data_ptr() : nullptr;
  }

  QPart(int64_t n_, int64_t k_, torch::Tensor q_)  // dense
      : bits(0), n(n_), k(k_), zero(0), halves(1), dense(q_.scalar_type()), q(q_.contiguous()) {
    TORCH_CHECK(dense == torch::kHalf || dense == torch::kBFloat16 || dense == torch::kFloat,
                "dense weights must be float16, bfloat16 or float32");
    shape();
    TORCH_CHECK(q.numel() * q.element_size() == groups * nb * block_bytes(),
                "dense weight has the wrong size");
    qp = static_cast<const uint8_t*>(q.data_ptr());
  }

  void shape() {
    TORCH_CHECK(k % kBlock == 0, "weight inputs must be a multiple of 32");
    nb = k / kBlock;
    groups = (n + 15) / 16;
  }
  // one block of 32 inputs x 16 outputs, in bytes
  int64_t block_bytes() const {
    return bits ? 16 * kBlock * bits / 8 : 16 * kBlock * static_cast<int64_t>(q.element_size());
  }
};

// A weight whose outputs are parts of their own types one after another (q|k|v, gate|up): each
// part is multiplied as if alone, so fusing changes no bit. Groups are numbered across parts.
struct QWeight {
  std::vector<QPart> parts;
  std::vector<int64_t> col, first;  // part p: its outputs from col[p], its groups from first[p]
  int64_t n = 0, k = 0, nb = 0, groups = 0;

  QWeight() = default;  // none: a routed layer's dense FFN (moe.h runs its experts instead)
  explicit QWeight(std::vector<QPart> ps) : parts(std::move(ps)) {
    TORCH_CHECK(!parts.empty(), "a weight needs at least one part");
    k = parts[0].k;
    nb = parts[0].nb;
    for (const QPart& p : parts) {
      TORCH_CHECK(p.k == k, "fused parts must have the same inputs");
      col.push_back(n);
      first.push_back(groups);
      n += p.n;
      groups += p.groups;
    }
    first.push_back(groups);
  }
  // the part of global group i
  int64_t part_of(int64_t i) const {
    return std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
  }
  // Output row `row` ([0, n)) as k floats into out, the value gguf's dequantiser gives.
  void row(int64_t row, float* out) const;
};

// One scale (d or m, as load_scales reads them) of output `lane` of group g, block b, half h.
inline float scale_at(const QPart& w, const void* p, const uint16_t* f, bool is_signed, int64_t g,
                      int64_t b, int64_t h, int64_t lane) {
  const int64_t at = ((g * w.nb + b) * w.halves + h) * 16 + lane;
  if (w.factors) {
    const float small = is_signed ? static_cast<const int8_t*>(p)[at]
                                  : static_cast<const uint8_t*>(p)[at];
    return _cvtsh_ss(f[(g * (w.nb / 8) + b / 8) * 16 + lane]) * small;
  }
  return w.f32 ? static_cast<const float*>(p)[at]
               : _cvtsh_ss(static_cast<const uint16_t*>(p)[at]);
}

// Row r of one part, decoded from the packed layout above: dense floats as stored; integer
// codes as d*(u - zero) where a zero stands for m (gguf's d*q with q signed), else d*u + m.
// Every product is exact in float32 (an fp16 or K-quant scale times a code of at most 8 bits),
// so each value is gguf's own, whether or not the compiler fuses the multiply and add.
inline void part_row(const QPart& w, int64_t r, float* out) {
  const int64_t g = r / 16, lane = r % 16;
  if (!w.bits) {
    for (int64_t i = 0; i < w.k; ++i) {
      const int64_t at = (g * w.k + i) * 16 + lane;
      if (w.dense == torch::kFloat) {
        out[i] = reinterpret_cast<const float*>(w.qp)[at];
      } else {
        const uint16_t v = reinterpret_cast<const uint16_t*>(w.qp)[at];
        if (w.dense == torch::kHalf) {
          out[i] = _cvtsh_ss(v);
        } else {
          const uint32_t bits = static_cast<uint32_t>(v) << 16;  // bf16: float32's top half
          std::memcpy(&out[i], &bits, 4);
        }
      }
    }
    return;
  }
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* blk = w.qp + (g * w.nb + b) * w.block_bytes();
    for (int64_t e = 0; e < kBlock; ++e) {
      const int64_t c = e / 4, l = lane * 4 + e % 4;  // chunk of 4 inputs, byte in its 64
      int32_t u;
      if (w.bits == 8) {
        u = blk[c * 64 + l];
      } else {
        u = (blk[(c / 2) * 64 + l] >> (4 * (c % 2))) & 15;
        if (w.bits == 5) u |= ((blk[256 + l] >> c) & 1) << 4;
        if (w.bits == 6) u |= ((blk[256 + (c / 4) * 64 + l] >> (2 * (c % 4))) & 3) << 4;
      }
      const int64_t h = w.halves == 2 ? e / 16 : 0;
      const float d = scale_at(w, w.dp, w.dsp, w.d_signed, g, b, h, lane);
      out[b * kBlock + e] =
          w.zero ? d * static_cast<float>(u - w.zero)
                 : d * static_cast<float>(u) + scale_at(w, w.mp, w.msp, w.m_signed, g, b, h, lane);
    }
  }
}

inline void QWeight::row(int64_t r, float* out) const {
  TORCH_CHECK(r >= 0 && r < n, "row out of range");
  const int64_t p = std::upper_bound(col.begin(), col.end(), r) - col.begin() - 1;
  part_row(parts[p], r - col[p], out);
}

// Rows `ids` of w as float32 [ids, k] (embedding lookups, the head's float32 recompute).
inline torch::Tensor weight_rows(const QWeight& w, torch::Tensor ids) {
  ids = ids.to(torch::kLong).contiguous();
  const int64_t m = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < w.n, "row id out of range");
  auto out = torch::empty({m, w.k}, torch::kFloat);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, m, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) w.row(id[i], o + i * w.k);
  });
  return out;
}

// Where a thread goes next (a part and its group), for the prefetch; none: w == nullptr.
struct Next {
  const QPart* w = nullptr;
  int64_t g = -1;
};

inline Next next_of(const QWeight& w, int64_t i) {
  if (i < 0 || i >= w.groups) return {};
  const int64_t p = w.part_of(i);
  return {&w.parts[p], i - w.first[p]};
}

// W outputs' scales of group g, block b, half h, from lane `lane` (0, or 8 on 256-bit builds),
// of d (p = w.dp, f = w.dsp) or m (w.mp, w.msp), as stored: fp16, float32, or their factors.
// Always inlined: called per block in the kernels' loops (gcc kept it a call there).
__attribute__((always_inline)) inline vf load_scales(const QPart& w, const void* p,
                                                    const uint16_t* f, bool is_signed,
                                                    int64_t g, int64_t b, int64_t h,
                                                    int64_t lane) {
  const int64_t at = ((g * w.nb + b) * w.halves + h) * 16 + lane;
  if (w.factors)
    return vmul(vload_h(f + (g * (w.nb / 8) + b / 8) * 16 + lane),
                is_signed ? vload_i8(static_cast<const int8_t*>(p) + at)
                          : vload_u8(static_cast<const uint8_t*>(p) + at));
  return w.f32 ? vload(static_cast<const float*>(p) + at)
               : vload_h(static_cast<const uint16_t*>(p) + at);
}

// Block b of group g's packed weights and scales, asked for ahead of their use (into the
// cache level `Hint` names): the hardware prefetcher alone leaves the kernels waiting on
// memory between groups.
template <int Hint>
inline void prefetch_block_to(const QPart& w, int64_t g, int64_t b) {
  constexpr auto hint = static_cast<_mm_hint>(Hint);
  if (g >= w.groups) return;
  const char* q = reinterpret_cast<const char*>(w.qp + (g * w.nb + b) * w.block_bytes());
  for (int64_t i = 0; i < w.block_bytes(); i += 64) _mm_prefetch(q + i, hint);
  const int64_t at = (g * w.nb + b) * w.halves * 16 * (w.factors ? 1 : w.f32 ? 4 : 2);  // bytes
  if (w.dp) _mm_prefetch(static_cast<const char*>(w.dp) + at, hint);
  if (w.mp) _mm_prefetch(static_cast<const char*>(w.mp) + at, hint);
  if (w.dsp && b % 8 == 0)
    _mm_prefetch(reinterpret_cast<const char*>(w.dsp + (g * (w.nb / 8) + b / 8) * 16), hint);
  if (w.msp && b % 8 == 0)
    _mm_prefetch(reinterpret_cast<const char*>(w.msp + (g * (w.nb / 8) + b / 8) * 16), hint);
}
inline void prefetch_block(const QPart& w, int64_t g, int64_t b) {
  prefetch_block_to<_MM_HINT_T0>(w, g, b);
}

// The fast kernels' (qdot.h's Ahead): into L2 and never inlined. With the same requests
// inlined into the block loop, a one- or two-row verify of a Q4_0 file took 1.05-1.08x as
// long on the avx2 and avx512 builds (Q4_K with none at all: 1.15x); into L1 rather than L2,
// 1.01-1.15x at one row (docs/results/spr-s27/native_ab-prefetch-*). Why is not known: the
// profile puts the kernels' memory stall on the prefetch instructions either way.
__attribute__((noinline)) inline void prefetch_block_call(const QPart& w, int64_t g, int64_t b) {
  prefetch_block_to<_MM_HINT_T1>(w, g, b);
}

// All of group g at once (the tile path, and a thread's first group); the VNNI path asks for
// the next group a block at a time instead, which keeps the requests in flight few and steady.
inline void prefetch_group(const QPart& w, int64_t g) {
  for (int64_t b = 0; b < w.nb; ++b) prefetch_block(w, g, b);
}

// Rows of activations quantised per block of 32: q int8 [rows, k], dx [rows, nb], the integer
// sums qs = sum(q) and qh = sum(q) over a block's first 16 inputs [rows, nb], xs = dx * qs;
// x: the float rows themselves [rows, k] (dense weights multiply them).
struct QAct {
  int64_t rows = 0, k = 0, nb = 0;
  std::vector<int8_t> q;
  std::vector<int32_t> qs, qh;
  std::vector<float> dx, xs, x;
};

// Sizes a for rows x k activations (kept between calls: no page faults per call).
void prepare_rows(int64_t rows, int64_t k, QAct& a) {
  const int64_t nb = k / kBlock;
  a.rows = rows;
  a.k = k;
  a.nb = nb;
  a.q.resize(rows * k);
  a.x.resize(rows * k);
  a.dx.resize(rows * nb);
  a.qs.resize(rows * nb);
  a.qh.resize(rows * nb);
  a.xs.resize(rows * nb);
}

// Row r of a (prepared) from its k floats xr.
void quantize_row(const float* xr, int64_t r, QAct& a) {
  const int64_t nb = a.nb;
  std::memcpy(a.x.data() + r * a.k, xr, a.k * sizeof(float));
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = xr + b * kBlock;
    vf top = vzero();
    for (int i = 0; i < kBlock; i += W) top = vmax(top, vabs(vload(xb + i)));
    const float amax = hmax(top);
    const float d = amax / 127.0f;
    const vf id = vset1(d > 0.0f ? 127.0f / amax : 0.0f);
    int8_t* qb = a.q.data() + r * a.k + b * kBlock;
    vi sum[2] = {vround_i(vzero()), vround_i(vzero())};  // the block's two halves of 16
    for (int i = 0; i < kBlock; i += W) {  // clamping before rounding: the same integers
      const vi q = vround_i(vmin(vmax(vmul(vload(xb + i), id), vset1(-127.0f)), vset1(127.0f)));
      vstore_i8(qb + i, q);
      sum[i >= 16] = vadd_i(sum[i >= 16], q);
    }
    const int32_t first = vsum_i(sum[0]), total = first + vsum_i(sum[1]);
    a.dx[r * nb + b] = d;
    a.qs[r * nb + b] = total;
    a.qh[r * nb + b] = first;
    a.xs[r * nb + b] = d * static_cast<float>(total);
  }
}

void quantize_rows(const float* x, int64_t rows, int64_t k, QAct& a) {
  prepare_rows(rows, k, a);
  for_rows(rows, [&](int64_t r) { quantize_row(x + r * k, r, a); });
}

}  // namespace adaspark
