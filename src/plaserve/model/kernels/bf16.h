// AVX512-BF16 helpers shared by the native CPU kernels of this folder.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace plaserve {

// Two bfloat16 values (p[0], p[1]) broadcast to every 32-bit lane: vdpbf16ps's pair operand.
inline __m512bh pair(const uint16_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(bits);
}

// 16 bfloat16 values widened to float32 (exact: a bfloat16 is a float32's upper half).
inline __m512 widen16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// 16 float32 values rounded to bfloat16 (to nearest even, as torch rounds: vcvtneps2bf16) and stored.
inline void store16(uint16_t* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}

// 16 float32 values rounded to bfloat16 and widened back: what storing and reloading them would give.
inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

}  // namespace plaserve
