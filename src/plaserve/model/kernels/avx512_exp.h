// 2^t over 16 float32 lanes with AVX-512, shared by the native CPU kernels of this folder, whose
// results are rounded to bfloat16 (attention's P and output, SwiGLU, here too).
#pragma once

#include <immintrin.h>

namespace plaserve {

// 2^t, for results rounded to bfloat16 (whose rounding, 4e-3, dwarfs the error): p(f) * 2^floor(t),
// f = t - floor(t) in [0, 1) (vreduceps), p a degree-3 polynomial fitted for relative error (at most
// 7.5e-5); vscalefps takes the floor of its exponent itself, so no rounded copy of t is made. From 128
// up the result is +inf (SwiGLU relies on that). Below -126 the result is subnormal, and every
// subnormal result, or add or multiply that reads one, costs a microcode assist, unless the thread
// flushes them (FlushDenormals): without that, use exp2_p.
inline __m512 exp2_p_flushed(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(7.802452147e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.260671854e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.958335042e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999251962e-1f));
  return _mm512_scalef_ps(p, t);
}

// exp2_p_flushed with t held at -125 from below, so the result stays above 2^-126, the smallest normal
// float (without the hold, attention ran 16x and SwiGLU 15x slower on inputs of magnitude 30-100).
// max(-125, t), not max(t, -125): a NaN t stays NaN.
inline __m512 exp2_p(__m512 t) { return exp2_p_flushed(_mm512_max_ps(_mm512_set1_ps(-125.0f), t)); }

// SwiGLU's silu(x) * u = x / (1 + 2^(-x log2 e)) * u, for results rounded to bfloat16 (8 bits): 2^t to
// 8e-5 (exp2_p) and a 14-bit reciprocal (rcp14) do, where a 512-bit division alone costs more than
// the rest. Far below 0, 2^t is +inf and its reciprocal 0: x * 0, as torch's.
inline __m512 silu_times(__m512 x, __m512 u) {
  const __m512 e = exp2_p(_mm512_mul_ps(x, _mm512_set1_ps(-1.44269504088896341f)));
  return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_rcp14_ps(_mm512_add_ps(_mm512_set1_ps(1.0f), e))), u);
}

// While one lives, this thread's SSE/AVX arithmetic flushes subnormal results to zero and reads
// subnormal inputs as zero (MXCSR's FTZ and DAZ), so none of them costs an assist; the caller's MXCSR
// comes back when it goes.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_;
};

}  // namespace plaserve
