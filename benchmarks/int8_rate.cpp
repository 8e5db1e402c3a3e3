// Integer multiply-accumulate rate of one core for the quantised matmul's instruction mixes
// (kernels.h group_rows_both), against which benchmarks/qmatmul_rate.py's GMAC/s per extra row
// is read. Each mix runs as written in assembly (no compiler spills or hoisting), with more
// independent accumulators than latency x ports; no loads, broadcasts or per-block float
// steps, so this is the issue rate of the integer work alone, an upper bound for the matmul:
// - avx2 4-bit: vpmaddubsw + vpaddw (int16 sums; 32 MACs a vpmaddubsw);
// - avx2 8-bit (Q8_0): vpsignb + vpmaddubsw + vpmaddwd + vpaddd (32 MACs);
// - avx-vnni: 256-bit vpdpbusd (32 MACs), where the CPU has it (cpuid 7.1 eax bit 4);
// - avx512 vnni: 512-bit vpdpbusd (64 MACs; the avx512 build's path below 5 rows), where the CPU
//   has it (cpuid 7.0 ecx bit 11).
// Then the avx2 Q4_1 kernel's whole mix (below): the ceiling of its arithmetic on this core.
//
//   g++ -O2 -o /tmp/int8_rate benchmarks/int8_rate.cpp && /tmp/int8_rate
#include <cpuid.h>

#include <chrono>
#include <cstdio>

constexpr long kRounds = 50000000;

// ymm0-7: accumulators; ymm8-11: temporaries; ymm12: weights; ymm13: activations; ymm14: ones.
#define FOUR(a, t) "vpmaddubsw %%ymm13, %%ymm12, %%ymm" #t "\n vpaddw %%ymm" #t ", %%ymm" #a ", %%ymm" #a "\n"
#define EIGHT(a, t)                                                        \
  "vpsignb %%ymm12, %%ymm13, %%ymm" #t "\n"                                \
  "vpmaddubsw %%ymm" #t ", %%ymm12, %%ymm" #t "\n"                         \
  "vpmaddwd %%ymm14, %%ymm" #t ", %%ymm" #t "\n"                           \
  "vpaddd %%ymm" #t ", %%ymm" #a ", %%ymm" #a "\n"
#define VNNI(a, t) "%{vex%} vpdpbusd %%ymm13, %%ymm12, %%ymm" #a "\n"  // t unused
#define VNNI512(a) "vpdpbusd %%zmm13, %%zmm12, %%zmm" #a "\n"
#define VNNI512_CHAINS \
  VNNI512(0) VNNI512(1) VNNI512(2) VNNI512(3) VNNI512(4) VNNI512(5) VNNI512(6) VNNI512(7) \
  VNNI512(8) VNNI512(9) VNNI512(10) VNNI512(11)
#define EIGHT_CHAINS(M) M(0, 8) M(1, 9) M(2, 10) M(3, 11) M(4, 8) M(5, 9) M(6, 10) M(7, 11)
#define VNNI_CHAINS \
  VNNI(0, 0) VNNI(1, 0) VNNI(2, 0) VNNI(3, 0) VNNI(4, 0) VNNI(5, 0) VNNI(6, 0) VNNI(7, 0) \
  VNNI(8, 0) VNNI(9, 0) VNNI(10, 0) VNNI(11, 0)

#define CLOBBERS "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", \
                 "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "cc"
#define LOOP(BODY)                                                                            \
  "vpcmpeqw %%ymm14, %%ymm14, %%ymm14\n vpsrlw $15, %%ymm14, %%ymm14\n" /* ones */          \
  "vpxor %%ymm12, %%ymm12, %%ymm12\n vpxor %%ymm13, %%ymm13, %%ymm13\n"                     \
  "1:\n" BODY "dec %0\n jnz 1b\n vzeroupper\n"

// The avx2 Q4_1 block as qdot.h group_rows_avx2 issues it (loads from L1, a group's 48 blocks
// walked as the kernel walks them, 8 rows' activations 1536 bytes apart, its float steps and
// accumulators in memory as gcc keeps them), two shapes of 2048 MACs a block:
// - 8 rows x 8 outputs (one half of the group a pass, before issue 22); ymm0-7: the rows' sums,
//   ymm8, 9: a chunk pair's low and high nibbles; ymm10-11: temporaries; ymm14, 15: d and m;
// - 4 rows x 16 outputs (both halves a pass, each broadcast feeding two halves): ymm i and i+4
//   row i's halves; ymm14, 15 the second half's nibbles; ymm12, 13 temporaries.
// %1: a group's weights, %2: activations, %3: f32 d and m scales of both halves, %4: dx (0..7)
// and xs (16..23) floats, %5: accumulators, %6: 0x0F bytes and int16 ones (32 bytes each).
#define UNPACK(c, at, L, H)                                                                \
  "vmovdqu " #c "*64+" #at "(%1), %%ymm" #L "\n vpsrlw $4, %%ymm" #L ", %%ymm" #H "\n"     \
  "vpand (%6), %%ymm" #L ", %%ymm" #L "\n vpand (%6), %%ymm" #H ", %%ymm" #H "\n"
#define BCAST(c, i) "vpbroadcastd " #c "*8+1536*" i "(%2), %%ymm10\n vpbroadcastd " #c "*8+4+1536*" i "(%2), %%ymm11\n"
#define NO_BCAST(c, i) ""  // ymm10, 11 as they are
#define PAIR8(c, FIRST, B) ".irp i,0,1,2,3,4,5,6,7\n" B(c, "\\i") \
  "vpmaddubsw %%ymm10, %%ymm8, %%ymm12\n vpmaddubsw %%ymm11, %%ymm9, %%ymm13\n" FIRST(12, 13, \\i) ".endr\n"
#define SET(a, b, s) "vpaddw %%ymm" #b ", %%ymm" #a ", %%ymm" #s "\n"
#define ADD(a, b, s) "vpaddw %%ymm" #b ", %%ymm" #a ", %%ymm" #a "\n vpaddw %%ymm" #a ", %%ymm" #s ", %%ymm" #s "\n"
#define WIDEN ".irp i,0,1,2,3,4,5,6,7\n vpmaddwd 32(%6), %%ymm\\i, %%ymm\\i\n .endr\n"
#define INTS8(B) UNPACK(0, 0, 8, 9) PAIR8(0, SET, B) UNPACK(1, 0, 8, 9) PAIR8(1, ADD, B) \
  UNPACK(2, 0, 8, 9) PAIR8(2, ADD, B) UNPACK(3, 0, 8, 9) PAIR8(3, ADD, B) WIDEN
#define TAIL8                                                                              \
  "vcvtph2ps (%3), %%ymm14\n vcvtph2ps 16(%3), %%ymm15\n"                                   \
  ".irp i,0,1,2,3,4,5,6,7\n vcvtdq2ps %%ymm\\i, %%ymm\\i\n vbroadcastss 4*\\i(%4), %%ymm10\n" \
  "vmulps %%ymm14, %%ymm10, %%ymm10\n vfmadd213ps 32*\\i(%5), %%ymm10, %%ymm\\i\n"           \
  "vbroadcastss 64+4*\\i(%4), %%ymm11\n vfmadd231ps %%ymm11, %%ymm15, %%ymm\\i\n"            \
  "vmovaps %%ymm\\i, 32*\\i(%5)\n .endr\n"
#define ROW16(c, i, j, F) BCAST(c, #i)                                                      \
  "vpmaddubsw %%ymm10, %%ymm8, %%ymm12\n vpmaddubsw %%ymm11, %%ymm9, %%ymm13\n" F(12, 13, i) \
  "vpmaddubsw %%ymm10, %%ymm14, %%ymm10\n vpmaddubsw %%ymm11, %%ymm15, %%ymm11\n" F(10, 11, j)
#define PAIR16(c, F) UNPACK(c, 0, 8, 9) UNPACK(c, 32, 14, 15) \
  ROW16(c, 0, 4, F) ROW16(c, 1, 5, F) ROW16(c, 2, 6, F) ROW16(c, 3, 7, F)
#define INTS16 PAIR16(0, SET) PAIR16(1, ADD) PAIR16(2, ADD) PAIR16(3, ADD) WIDEN
#define HALF16(s, h) "vcvtdq2ps %%ymm" s ", %%ymm" s "\n vmulps 32*" h "(%3), %%ymm10, %%ymm12\n" \
  "vfmadd213ps 32*" s "(%5), %%ymm12, %%ymm" s "\n vfmadd231ps 64+32*" h "(%3), %%ymm11, %%ymm" s "\n" \
  "vmovaps %%ymm" s ", 32*" s "(%5)\n"
#define TAIL16 "vcvtph2ps (%3), %%ymm13\n vcvtph2ps 16(%3), %%ymm13\n" /* the d, m loads */ \
  "vcvtph2ps 32(%3), %%ymm13\n vcvtph2ps 48(%3), %%ymm13\n"                                  \
  TAIL_ROW16("0", "4") TAIL_ROW16("1", "5") TAIL_ROW16("2", "6") TAIL_ROW16("3", "7")
#define TAIL_ROW16(i, j) "vbroadcastss 4*" i "(%4), %%ymm10\n vbroadcastss 64+4*" i "(%4), %%ymm11\n" \
  HALF16(i, "0") HALF16(j, "1")
#define WALK(BODY)                                                                         \
  "1:\n mov %1, %%r8\n mov %2, %%r9\n mov $48, %%r10d\n 2:\n" BODY                          \
  "add $256, %1\n add $32, %2\n dec %%r10d\n jnz 2b\n mov %%r8, %1\n mov %%r9, %2\n"        \
  "sub $48, %0\n jg 1b\n vzeroupper\n"
#define ALL_YMM "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", \
                "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15", "cc", "memory", "r8", "r9", "r10"

alignas(64) unsigned char q_group[48 * 256];
alignas(64) signed char x_rows[8 * 1536];
alignas(64) float scales[32], x_scales[32], accs[64];
alignas(64) unsigned char consts[64];

enum class Shape { rows8, rows8_ints, rows8_ints_no_bcast, rows4x16, rows4x16_ints };
template <Shape S>
__attribute__((target("avx2,fma,f16c"))) void q4_1_blocks() {
  long n = kRounds / 16;  // blocks: each ~16x the rounds above
  const unsigned char* q = q_group;
  const signed char* x = x_rows;
#define RUN(BODY) asm volatile(WALK(BODY) : "+r"(n), "+r"(q), "+r"(x) \
                               : "r"(scales), "r"(x_scales), "r"(accs), "r"(consts) : ALL_YMM)
  if constexpr (S == Shape::rows8) RUN(INTS8(BCAST) TAIL8);
  else if constexpr (S == Shape::rows8_ints) RUN(INTS8(BCAST));
  else if constexpr (S == Shape::rows8_ints_no_bcast) RUN(INTS8(NO_BCAST));
  else if constexpr (S == Shape::rows4x16) RUN(INTS16 TAIL16);
  else RUN(INTS16);
#undef RUN
}

template <class F>
double gmacs(F run, int macs_per_round) {
  const auto t0 = std::chrono::steady_clock::now();
  run();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(macs_per_round) * kRounds / s / 1e9;
}

__attribute__((target("avx2"))) void four_bit() {
  long n = kRounds;
  asm volatile(LOOP(EIGHT_CHAINS(FOUR)) : "+r"(n) : : CLOBBERS);
}
__attribute__((target("avx2"))) void eight_bit() {
  long n = kRounds;
  asm volatile(LOOP(EIGHT_CHAINS(EIGHT)) : "+r"(n) : : CLOBBERS);
}
__attribute__((target("avx2,avxvnni"))) void vnni() {
  long n = kRounds;
  asm volatile(LOOP(VNNI_CHAINS) : "+r"(n) : : CLOBBERS);
}

__attribute__((target("avx512f,avx512vnni"))) void vnni512() {
  long n = kRounds;
  asm volatile("vpxord %%zmm12, %%zmm12, %%zmm12\n vpxord %%zmm13, %%zmm13, %%zmm13\n"
               "1:\n" VNNI512_CHAINS "dec %0\n jnz 1b\n vzeroupper\n"
               : "+r"(n) : : CLOBBERS);
}

int main() {
  for (int rep = 0; rep < 3; ++rep) {  // three passes: a busy machine shows as spread
    std::printf("avx2 4-bit (vpmaddubsw + vpaddw): %.1f GMAC/s; ", gmacs(four_bit, 8 * 32));
    std::printf("avx2 8-bit (vpsignb + vpmaddubsw + vpmaddwd + vpaddd): %.1f GMAC/s; ",
                gmacs(eight_bit, 8 * 32));
    unsigned a, b, c, d;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 4) & 1))
      std::printf("avx-vnni (vpdpbusd ymm): %.1f GMAC/s; ", gmacs(vnni, 12 * 32));
    else
      std::printf("avx-vnni: not on this CPU; ");
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && ((c >> 11) & 1))
      std::printf("avx512 vnni (vpdpbusd zmm): %.1f GMAC/s\n", gmacs(vnni512, 12 * 64));
    else
      std::printf("avx512 vnni: not on this CPU\n");
    const int block = 2048 / 16;  // MACs a round
    std::printf("  Q4_1 blocks, 8 rows x 8 outputs: %.1f GMAC/s (integer part only %.1f, and "
                "without broadcasts %.1f); 4 rows x 16 outputs: %.1f (integer part only %.1f)\n",
                gmacs(q4_1_blocks<Shape::rows8>, block), gmacs(q4_1_blocks<Shape::rows8_ints>, block),
                gmacs(q4_1_blocks<Shape::rows8_ints_no_bcast>, block),
                gmacs(q4_1_blocks<Shape::rows4x16>, block), gmacs(q4_1_blocks<Shape::rows4x16_ints>, block));
  }
  return 0;
}
