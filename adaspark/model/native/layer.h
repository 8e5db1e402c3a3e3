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
  qmatmul_into(ly.gate_up, a, gu, 2 * ffn);
  mark(2);
  prepare_rows(n, ffn, a);
  for_rows(n, [&](int64_t r) {
    const float* g = gu + r * 2 * ffn;
    if (parts.act == Act::gelu_tanh)
      gelu_tanh_mul_row(g, g + ffn, act + r * ffn, ffn);
    else
      silu_mul_row(g, g + ffn, act + r * ffn, ffn);
    quantize_row(act + r * ffn, r, a);
  });
  mark(3);
  qmatmul_into(ly.down, a, y, dim);
  for_rows(n, [&](int64_t r) {
    if (parts.post_ffn_norm) rms_norm_row(y + r * dim, parts.post_ffn_norm, y + r * dim, dim, eps);
    add_into(x + r * dim, y + r * dim, dim);
  });
  mark(4);
}

}  // namespace adaspark
