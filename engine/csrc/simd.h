// The instruction-set paths of the CPU kernels, and the vector types their shared code is
// written against.
//
// Every kernel has a portable path (plain C++, the reference) and, where the build has them, an
// AVX2 path (8 floats per register; AVX2 + FMA, so also AMD Zen 2/3 and AVX-512 CPUs without
// bf16) and an AVX-512 path (16 floats). The paths compute the same bits: each sum is the fixed
// 16-lane split of kernels.h whatever the register width (an AVX2 path holds the 16 lanes in two
// registers), every multiply-add is an explicit FMA and nothing else is fused
// (-ffp-contract=off). Tests force each path and compare them bit for bit.
//
// Which paths exist: the build targets the CPU it runs on (-march=native), so a path is compiled
// when that CPU has its instructions; it is also checked at run time (__builtin_cpu_supports),
// so a build copied to a lesser CPU refuses the path instead of faulting. "auto" takes the
// widest available.
#pragma once

#include "kernels.h"

#include <string>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INHERENT_AVX2 1
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define INHERENT_AVX512 1
#include <immintrin.h>
#endif

namespace inherent {

enum class Path { kPortable, kAvx2, kAvx512 };

inline bool path_available(Path p) {
  switch (p) {
    case Path::kPortable: return true;
    case Path::kAvx2:
#if defined(INHERENT_AVX2)
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
      return false;
#endif
    case Path::kAvx512:
#if defined(INHERENT_AVX512)
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
      return false;
#endif
  }
  return false;
}

// Whether the CPU is Intel's: where the kernels' memory asks measured apart on Intel and AMD
// cores, they follow the vendor (fixed_order_attention.cpp). False off x86.
inline bool intel_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return intel;
#else
  return false;
#endif
}

// "auto", "avx512", "avx2" or "portable" -> the path to run; a named path this build or CPU
// lacks is an error, never a silent substitute (a test forcing it must not pass vacuously).
inline Path resolve_path(const std::string& name) {
  if (name == "auto") {
    if (path_available(Path::kAvx512)) return Path::kAvx512;
    if (path_available(Path::kAvx2)) return Path::kAvx2;
    return Path::kPortable;
  }
  Path p;
  if (name == "portable") p = Path::kPortable;
  else if (name == "avx2") p = Path::kAvx2;
  else if (name == "avx512") p = Path::kAvx512;
  else TORCH_CHECK(false, "unknown kernel path '", name, "' (auto, avx512, avx2, portable)");
  TORCH_CHECK(path_available(p), "kernel path '", name, "' is not available on this CPU/build");
  return p;
}

// ---- Vector types: the same operations at two widths ----------------------------------------
// load/store of float32 and of bfloat16 (uint16_t bits; widening is exact, narrowing rounds to
// nearest even with NaN -> 0x7FC0, as to_bf16), arithmetic, and exp_nonpositive with the
// scalar version's exact operation sequence.
//
// Fixed-order sums: a 16-lane accumulator is kRegs registers (lanes 0..W-1 first). fold() does
// lanes_sum's first stage (lane l + lane l + 8: nothing at W = 16, where a register holds all
// 16), sum() the rest for W accumulators at once, lane j of its result being the total of
// accumulator j, by lanes_sum's additions: one transposing tree instead of W horizontal sums.

#if defined(INHERENT_AVX512)
struct Avx512 {
  using F = __m512;
  using I = __m512i;
  static constexpr int W = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const uint16_t* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void store(uint16_t* p, F x) {
    const I bits = _mm512_castps_si512(x);
    const I odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    I r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // std::max(x, lo): x unless x < lo (a NaN x stays NaN)
  static F max_with(F x, F lo) {
    return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), lo);
  }
  static F neg_abs(F x) { return _mm512_or_ps(x, _mm512_set1_ps(-0.0f)); }
  // where x >= 0: a, else b
  static F select_nonneg(F x, F a, F b) {
    return _mm512_mask_mov_ps(b, _mm512_cmp_ps_mask(x, zero(), _CMP_GE_OQ), a);
  }
  static I trunc_i32(F x) { return _mm512_cvttps_epi32(x); }
  static F to_f32(I x) { return _mm512_cvtepi32_ps(x); }
  static F exp2_int(I k) {  // 2^k as float bits ((k + 127) << 23)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k, _mm512_set1_epi32(127)), 23));
  }
  // RoPE helpers on adjacent (even, odd) pairs
  static F swap_pairs(F x) { return _mm512_permute_ps(x, 0xB1); }
  static F dup_even(F x) { return _mm512_moveldup_ps(x); }
  static F dup_odd(F x) { return _mm512_movehdup_ps(x); }
  static F negate_even(F x) {
    const I sign = _mm512_set_epi32(0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0,
                                    INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN);
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
  }
  static constexpr int kRegs = 1;
  static F fold(const F* acc) { return acc[0]; }
  // each stage adds lane l to lane l + 8 (then + 4, + 2, + 1) of every vector, two vectors
  // packed into one
  static F sum(const F* v) {
    F w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i)  // w[i] = halves of v[2i], v[2i+1]
      w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                           _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)  // x[i]: 128-bit chunk c holds the quarter of v[4i + c]
      x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)  // y[i], chunk c: pairs of v[8i + c] and v[8i + 4 + c]
      y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    const F r = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88),
                              _mm512_shuffle_ps(y[0], y[1], 0xDD));
    // lane 4c + m now holds v[4m + c]: transpose back
    const I order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, r);
  }
};
#endif

#if defined(INHERENT_AVX2)
struct Avx2 {
  using F = __m256;
  using I = __m256i;
  static constexpr int W = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const uint16_t* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void store(uint16_t* p, F x) {
    const I bits = _mm256_castps_si256(x);
    const I odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    I r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const I nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // 8 x 32 -> 8 x 16 bits: pack within 128-bit halves, then put the halves' words in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max_with(F x, F lo) { return _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ)); }
  static F neg_abs(F x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.0f)); }
  static F select_nonneg(F x, F a, F b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, zero(), _CMP_GE_OQ));
  }
  static I trunc_i32(F x) { return _mm256_cvttps_epi32(x); }
  static F to_f32(I x) { return _mm256_cvtepi32_ps(x); }
  static F exp2_int(I k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
  }
  static F swap_pairs(F x) { return _mm256_permute_ps(x, 0xB1); }
  static F dup_even(F x) { return _mm256_moveldup_ps(x); }
  static F dup_odd(F x) { return _mm256_movehdup_ps(x); }
  static F negate_even(F x) {
    const I sign = _mm256_set_epi32(0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN);
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(x), sign));
  }
  static constexpr int kRegs = 2;
  static F fold(const F* acc) { return _mm256_add_ps(acc[0], acc[1]); }
  // lane l + 4, then + 2, then + 1 of 8 folded accumulators h at once
  static F sum(const F* h) {
    F w[4], x[2];
    for (int i = 0; i < 4; ++i)  // 128-bit half c of w[i]: quarter sums of h[2i + c]
      w[i] = _mm256_add_ps(_mm256_permute2f128_ps(h[2 * i], h[2 * i + 1], 0x20),
                           _mm256_permute2f128_ps(h[2 * i], h[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i)  // half c: pairs of h[4i + c] (lanes 0-1), h[4i + 2 + c] (2-3)
      x[i] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                           _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
    const F r = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], 0x88),
                              _mm256_shuffle_ps(x[0], x[1], 0xDD));
    // r holds h0 h2 h4 h6 | h1 h3 h5 h7: back in order
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
};
#endif

// exp_nonpositive (kernels.h), the same operations on W lanes at once.
template <class V>
inline typename V::F exp_nonpositive(typename V::F x) {
  using F = typename V::F;
  x = V::max_with(x, V::set1(-87.0f));
  const auto ki = V::trunc_i32(V::sub(V::mul(x, V::set1(1.44269504088896341f)), V::set1(0.5f)));
  const F k = V::to_f32(ki);
  F r = V::fma(k, V::set1(-0.693359375f), x);
  r = V::fma(k, V::set1(2.12194440e-4f), r);
  F p = V::set1(1.9875691500e-4f);
  p = V::fma(p, r, V::set1(1.3981999507e-3f));
  p = V::fma(p, r, V::set1(8.3334519073e-3f));
  p = V::fma(p, r, V::set1(4.1665795894e-2f));
  p = V::fma(p, r, V::set1(1.6666665459e-1f));
  p = V::fma(p, r, V::set1(5.0000001201e-1f));
  const F y = V::add(V::fma(p, V::mul(r, r), r), V::set1(1.0f));
  return V::mul(y, V::exp2_int(ki));
}

}  // namespace inherent
