// Shared arithmetic of the native forward, one header per concern (as ggml-cpu keeps SIMD
// mappings, quants and ops apart):
//   simd.h       vector names for every build, exp, fp16 K/V loads and stores
//   parallel.h   spreading rows and weight groups over torch's threads
//   floats.h     float32 dots, argmax, top-k
//   qweight.h    the packed weight layout and int8 activations
//   qdot.h       integer block dots (VNNI, AVX2) and the float steps ending every block
//   amx.h        the AMX tile path of the avx512 build
//   matmul.h     which path a matmul takes
//   rowops.h     RMSNorm, residual adds, RoPE, SiLU
//   attention.h  tree attention over the fp16 cache
//   layer.h      a decoder layer's tail after attention
// Every function gives a row the same instruction sequence whatever the other rows are.
#pragma once

#include "attention.h"
#include "floats.h"
#include "layer.h"
#include "matmul.h"
#include "rowops.h"
