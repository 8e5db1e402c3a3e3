// The rest of a decoder layer after attention.
#pragma once

#include "matmul.h"
#include "rowops.h"

namespace adaspark {

// The gated FFN's activation on the gate.
enum class Act { silu, gelu_tanh };

// What a block has beyond llama's (Gemma 3's parts), per layer.
struct BlockParts {
  const float* post_attn_norm = nullptr;  // RMSNorm of o(attn) before its residual add
  const float* post_ffn_norm = nullptr;   // RMSNorm of down(...) before its residual add
  Act act = Act::silu;
};

// x += o(attn) (RMS-normed first where parts has post_attn_norm), then h = rms_norm(x) with
// the layer's ffn_norm, quantised into a: the FFN's input (steps 0 and 1 of mark).
template <class L, class Mark = Nothing>
void attn_out_and_norm(const L& ly, float* x, const float* attn, int64_t n, int64_t dim,
                       int64_t qw, float eps, QAct& a, float* h, float* y,
                       const BlockParts& parts = {}, const Mark& mark = {}) {
  const float* norm = ly.ffn_norm.template data_ptr<float>();
  quantize_rows(attn, n, qw, a);
  qmatmul_into(ly.o, a, y, dim);
  mark(0);
  prepare_rows(n, dim, a);
  for_rows(n, [&](int64_t r) {
    if (parts.post_attn_norm) rms_norm_row(y + r * dim, parts.post_attn_norm, y + r * dim, dim, eps);
    add_into(x + r * dim, y + r * dim, dim);
    rms_norm_row(x + r * dim, norm, h + r * dim, dim, eps);
    quantize_row(h + r * dim, r, a);
  });
  mark(1);
}

// y [n, dim] = down(act(gate(h)) * up(h)) for rows h already quantised in a (reused for the
// activations after gate_up); gate_up: gate | up fused, ffn outputs each. gu, act: scratch of
// n * 2 * ffn and n * ffn floats. mark(2) after gate_up, mark(3) after the gate.
template <class Mark = Nothing>
void gated_ffn(const QWeight& gate_up, const QWeight& down, QAct& a, float* y, int64_t n,
               int64_t dim, int64_t ffn, float* gu, float* act, Act kind, const Mark& mark = {}) {
  qmatmul_into(gate_up, a, gu, 2 * ffn);
  mark(2);
  prepare_rows(n, ffn, a);
  for_rows(n, [&](int64_t r) {
    const float* g = gu + r * 2 * ffn;
    if (kind == Act::gelu_tanh)
      gelu_tanh_mul_row(g, g + ffn, act + r * ffn, ffn);
    else
      silu_mul_row(g, g + ffn, act + r * ffn, ffn);
    quantize_row(act + r * ffn, r, a);
  });
  mark(3);
  qmatmul_into(down, a, y, dim);
}

// x += y over rows, y RMS-normed first where parts has post_ffn_norm.
inline void add_ffn_out(float* x, float* y, int64_t n, int64_t dim, float eps,
                        const BlockParts& parts) {
  for_rows(n, [&](int64_t r) {
    if (parts.post_ffn_norm) rms_norm_row(y + r * dim, parts.post_ffn_norm, y + r * dim, dim, eps);
    add_into(x + r * dim, y + r * dim, dim);
  });
}

// The rest of a pre-norm block after attention, on rows x [n, dim]: x += o(attn), then
// x += down(act(gate(h)) * up(h)) with h = rms_norm(x), each added output RMS-normed first
// where parts has that norm (ly: the target's or the drafter's layer). h, y, gu, act: scratch
// of n * dim, n * dim, n * 2 * ffn and n * ffn floats. mark(i) after each of its steps i:
// 0 o, 1 the FFN's norm, 2 gate_up, 3 the gate, 4 down and its residual add (the drafter's
// phase clock).
template <class L, class Mark = Nothing>
void attn_out_and_ffn(const L& ly, float* x, const float* attn, int64_t n, int64_t dim,
                      int64_t qw, int64_t ffn, float eps, QAct& a, float* h, float* y, float* gu,
                      float* act, const BlockParts& parts = {}, const Mark& mark = {}) {
  attn_out_and_norm(ly, x, attn, n, dim, qw, eps, a, h, y, parts, mark);
  gated_ffn(ly.gate_up, ly.down, a, y, n, dim, ffn, gu, act, parts.act, mark);
  add_ffn_out(x, y, n, dim, eps, parts);
  mark(4);
}

}  // namespace adaspark
