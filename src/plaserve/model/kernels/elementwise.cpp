// A decoder layer's elementwise work in bfloat16, one pass each, for CPUs with AVX-512 (built and loaded
// by plaserve/model/kernels; plaserve/model/fused.py has the torch forms they replace, which define
// the arithmetic and its rounding):
//
//  * add_rms_norm: residual add, then RMSNorm of the sum (float32 statistics);
//  * rotary: the rotary embedding of a [T, heads, D] block, in place (half-split layout);
//  * silu_mul: SwiGLU's silu(gate) * up of the fused [T, 2 I] projection.
//
// Each reads bfloat16, computes in float32 and rounds once where the torch form does, so results
// equal the torch forms' to the last bit or one rounding step. Rows are spread over torch's OpenMP
// threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include "avx512_exp.h"
#include "bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using bf16 = uint16_t;

inline __m512 load16_masked(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline void store16_masked(bf16* p, __m512 x, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));
}

using plaserve::round_bf16;

inline __mmask16 lanes(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1u); }

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, ": bfloat16 only");
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

// Rows per parallel task: about 64 KB of bfloat16 each, so small steps stay on one thread.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

// x <- x + residual (rounded to bfloat16, as torch's add); returns rms_norm(x) * weight: the sum
// normalised in float32, rounded, then scaled by the bfloat16 weight and rounded again.
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_bf16(x, "add_rms_norm");
  check_bf16(residual, "add_rms_norm");
  check_bf16(weight, "add_rms_norm");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1) && weight.is_contiguous(),
              "add_rms_norm: x and residual [T, H], weight [H]");
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor out = at::empty({rows, width}, x.options());
  auto* xd = reinterpret_cast<bf16*>(x.data_ptr());
  const auto* rd = reinterpret_cast<const bf16*>(residual.data_ptr());
  const auto* wd = reinterpret_cast<const bf16*>(weight.data_ptr());
  auto* od = reinterpret_cast<bf16*>(out.data_ptr());
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      bf16* xr = xd + t * xs;
      const bf16* rr = rd + t * rs;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t c = 0; c < width; c += 16) {
        const __mmask16 m = lanes(width - c);
        const __m512 sum = round_bf16(_mm512_add_ps(load16_masked(xr + c, m), load16_masked(rr + c, m)));
        store16_masked(xr + c, sum, m);
        squares = _mm512_fmadd_ps(sum, sum, squares);
      }
      const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(width);
      const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(mean + static_cast<float>(eps)));
      bf16* o = od + t * width;
      for (int64_t c = 0; c < width; c += 16) {
        const __mmask16 m = lanes(width - c);
        const __m512 normed = round_bf16(_mm512_mul_ps(load16_masked(xr + c, m), inv));
        store16_masked(o + c, _mm512_mul_ps(normed, load16_masked(wd + c, m)), m);
      }
    }
  });
  return out;
}

// qk [T, heads, D] (each token's heads contiguous) rotated in place by cos, sin ([T, D/2] float32,
// any row stride): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, in float32, rounded once.
void rotary(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin) {
  check_bf16(qk, "rotary");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(1) == qk.size(2), "rotary: qk [T, heads, D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.stride(-1) == 1 && sin.stride(-1) == 1 && cos.size(0) == qk.size(0) &&
                  sin.size(0) == qk.size(0) && cos.size(-1) * 2 == qk.size(2) &&
                  sin.size(-1) * 2 == qk.size(2),
              "rotary: cos, sin [T, ..., D/2] float32");
  const int64_t rows = qk.size(0), heads = qk.size(1), half = qk.size(2) / 2;
  auto* base = reinterpret_cast<bf16*>(qk.data_ptr());
  const float* cd = cos.data_ptr<float>();
  const float* sd = sin.data_ptr<float>();
  const int64_t qs = qk.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, rows, grain(heads * half * 2), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c_row = cd + t * cs;
      const float* s_row = sd + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        bf16* x = base + t * qs + h * 2 * half;
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = lanes(half - i);
          const __m512 c = _mm512_maskz_loadu_ps(m, c_row + i), s = _mm512_maskz_loadu_ps(m, s_row + i);
          const __m512 x1 = load16_masked(x + i, m), x2 = load16_masked(x + half + i, m);
          store16_masked(x + i, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)), m);
          store16_masked(x + half + i, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)), m);
        }
      }
    }
  });
}

// [T, 2 I] -> [T, I]: silu(gate) * up, gate the first half of each row, in float32, rounded once.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_bf16(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [T, 2 I]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const auto* gd = reinterpret_cast<const bf16*>(gate_up.data_ptr());
  auto* od = reinterpret_cast<bf16*>(out.data_ptr());
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, rows, grain(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* g = gd + t * gs;
      const bf16* u = g + inter;
      bf16* o = od + t * inter;
      for (int64_t c = 0; c < inter; c += 16) {
        const __mmask16 m = lanes(inter - c);
        store16_masked(o + c, plaserve::silu_times(load16_masked(g + c, m), load16_masked(u + c, m)), m);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(plaserve_elementwise, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(plaserve_elementwise, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_mul", &silu_mul);
}
