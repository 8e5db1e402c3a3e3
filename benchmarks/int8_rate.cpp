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
  }
  return 0;
}
