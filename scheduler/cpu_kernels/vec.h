// What the kernels here share: one float32 SIMD vector (AVX-512 where the CPU has it, else
// AVX2 with FMA), loads that widen bfloat16 and e4m3 to it, and exp. Built with
// -march=native (build.py), so the widest the build machine has is the one compiled.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace iris {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Vec = __m512;
using Ints = __m512i;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec broadcast(float v) { return _mm512_set1_ps(v); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float max_of(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec bits(Ints i) { return _mm512_castsi512_ps(i); }
inline Vec load(const c10::BFloat16* p) {  // bf16 is float32's upper half
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return bits(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline Ints sign_extended_bytes(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Ints shift_left(Ints i, int n) { return _mm512_slli_epi32(i, n); }
inline Ints and_(Ints a, uint32_t mask) { return _mm512_and_si512(a, _mm512_set1_epi32(mask)); }
inline Vec round_to_int(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT); }
inline Ints to_int(Vec v) { return _mm512_cvtps_epi32(v); }
inline Ints add_ints(Ints a, Ints b) { return _mm512_add_epi32(a, b); }
inline Ints int_broadcast(int32_t v) { return _mm512_set1_epi32(v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using Vec = __m256;
using Ints = __m256i;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec broadcast(float v) { return _mm256_set1_ps(v); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float max_of(Vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline Vec bits(Ints i) { return _mm256_castsi256_ps(i); }
inline Vec load(const c10::BFloat16* p) {
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return bits(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline Ints sign_extended_bytes(const uint8_t* p) {
  int64_t eight;
  std::memcpy(&eight, p, sizeof eight);
  return _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(eight));
}
inline Ints shift_left(Ints i, int n) { return _mm256_slli_epi32(i, n); }
inline Ints and_(Ints a, uint32_t mask) { return _mm256_and_si256(a, _mm256_set1_epi32(mask)); }
inline Vec round_to_int(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Ints to_int(Vec v) { return _mm256_cvtps_epi32(v); }
inline Ints add_ints(Ints a, Ints b) { return _mm256_add_epi32(a, b); }
inline Ints int_broadcast(int32_t v) { return _mm256_set1_epi32(v); }
#else
#error "Iris's CPU kernels need AVX2 and FMA or AVX-512"
#endif

// e^x for x <= 0 (scores minus their running maximum), within 2 ulp of float32's exp:
// x = n·ln2 + r with |r| <= ln2/2, e^r by its degree-7 Taylor polynomial (truncation
// below 1e-8 there), times 2^n built in the exponent bits; below -87.3 the result is 0.
inline Vec exp_nonpositive(Vec x) {
  const Vec low = broadcast(-87.3f);
  const Vec clamped = max(x, low);
  const Vec n = round_to_int(mul(clamped, broadcast(1.44269504088896341f)));
  Vec r = fma(n, broadcast(-0.693145751953125f), clamped);  // ln2 in two parts, exact first
  r = fma(n, broadcast(-1.428606765330187045e-06f), r);
  Vec p = broadcast(1.0f / 5040);
  p = fma(p, r, broadcast(1.0f / 720));
  p = fma(p, r, broadcast(1.0f / 120));
  p = fma(p, r, broadcast(1.0f / 24));
  p = fma(p, r, broadcast(1.0f / 6));
  p = fma(p, r, broadcast(0.5f));
  p = fma(p, r, broadcast(1.0f));
  p = fma(p, r, broadcast(1.0f));
  const Vec scale = bits(shift_left(add_ints(to_int(n), int_broadcast(127)), 23));
  const Vec result = mul(p, scale);
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_GE_OQ), result);
#else
  return _mm256_and_ps(result, _mm256_cmp_ps(x, low, _CMP_GE_OQ));
#endif
}

// Bfloat16 pair products: a vector of kLanes pairs (2·kLanes bfloat16 values), each lane's
// two products added to its float32 accumulator. With AVX512-BF16 one vdpbf16ps; elsewhere
// both halves widened to float32 (exact: a bf16 is a float32's upper half) and two FMAs.
#if defined(__AVX512BF16__)
using Pairs = __m512bh;
inline Pairs load_pairs(const c10::BFloat16* p) { return (Pairs)_mm512_loadu_si512(p); }
inline Pairs broadcast_pair(const c10::BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return (Pairs)_mm512_set1_epi32(pair);
}
inline Vec add_pair_products(Vec acc, Pairs a, Pairs b) { return _mm512_dpbf16_ps(acc, a, b); }
#else
using Pairs = Ints;
#if defined(__AVX512F__)
inline Pairs load_pairs(const c10::BFloat16* p) { return _mm512_loadu_si512(p); }
#else
inline Pairs load_pairs(const c10::BFloat16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#endif
inline Pairs broadcast_pair(const c10::BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return int_broadcast(pair);
}
inline Vec add_pair_products(Vec acc, Pairs a, Pairs b) {
  acc = fma(bits(shift_left(a, 16)), bits(shift_left(b, 16)), acc);  // the even elements
  return fma(bits(and_(a, 0xFFFF0000u)), bits(and_(b, 0xFFFF0000u)), acc);
}
#endif

// A vector rounded to bfloat16 (to nearest, ties to even, as c10::BFloat16 rounds) and
// stored as kLanes values.
inline void store_rounded(c10::BFloat16* p, Vec v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float lanes[kLanes];
  store(lanes, v);
  for (int i = 0; i < kLanes; ++i) p[i] = c10::BFloat16(lanes[i]);
#endif
}

// Calls `run` with a null pointer of the C++ type of `dtype` (float32 or bfloat16), so a
// generic lambda can take the element type from it.
template <typename Run>
void with_element_type(c10::ScalarType dtype, const char* kernel, Run&& run) {
  if (dtype == c10::ScalarType::Float)
    run(static_cast<float*>(nullptr));
  else if (dtype == c10::ScalarType::BFloat16)
    run(static_cast<c10::BFloat16*>(nullptr));
  else
    TORCH_CHECK(false, kernel, " computes float32 or bfloat16");
}

inline float exp_nonpositive(float x) {
  alignas(64) float lanes[kLanes] = {x};
  store(lanes, exp_nonpositive(load(lanes)));
  return lanes[0];
}

}  // namespace iris
