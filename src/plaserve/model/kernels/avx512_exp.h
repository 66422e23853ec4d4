// exp over 16 float32 lanes with AVX-512, shared by the native CPU kernels of this folder: exact to
// ~1 ulp (exp_ps), or to 8e-5 where the result is rounded to bfloat16 anyway (exp2_p).
#pragma once

#include <immintrin.h>

namespace plaserve {

// exp(x): 2^n * p(r), r = x - n ln 2, |r| <= ln 2 / 2, p a degree-6 polynomial (Cephes' expf
// coefficients, ~1 ulp); x is clamped to [-87, 88], so the result is a normal float, 0-ish below and
// large but finite above.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// 2^t, for results rounded to bfloat16 (whose rounding, 4e-3, dwarfs the error): p(f) * 2^floor(t),
// f = t - floor(t) in [0, 1) (vreduceps), p a degree-3 polynomial fitted for relative error (at most
// 7.5e-5); vscalefps takes the floor of its exponent itself, so no rounded copy of t is made. From 128
// up the result is +inf (SwiGLU relies on that). t is held at -125 from below, so the result stays
// above 2^-126, the smallest normal float: a subnormal result, and every add or multiply that reads
// one, costs a microcode assist, and scores or gates far below 0 are common enough that attention ran
// 16x and SwiGLU 15x slower on inputs of magnitude 30-100 without it. max(-125, t), not
// max(t, -125): a NaN t stays NaN.
inline __m512 exp2_p(__m512 t) {
  t = _mm512_max_ps(_mm512_set1_ps(-125.0f), t);
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(7.802452147e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.260671854e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.958335042e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999251962e-1f));
  return _mm512_scalef_ps(p, t);
}

}  // namespace plaserve
