// A bfloat16 linear layer y = x W^T (+ b) on AMX tiles, for steps of up to a few hundred rows: decode
// batches and short prefills (built and loaded by plaserve/model/kernels; plaserve/model/layers.py's
// Projection uses it where it loads, oneDNN's packed linear elsewhere).
//
// Why: oneDNN's packed linear spends ~14 us a call before it multiplies (measured single-threaded on a
// 16 x 128 x 128 product), and a decode step makes 4 such calls a layer. This kernel keeps its own
// layout of W, packed once: [N/16][K/32] tiles of 16 K-pairs x 16 outputs x 2 (AMX's B operand), each
// block of 16 outputs' tiles contiguous, so a thread streams its outputs' weights in order. Each thread
// takes groups of 4 blocks (64 outputs; C tiles 0-3), and for each 16 rows of x (the A tile, 4) runs down
// K: the weights cross memory once a step whatever the row count up to 16, and from cache after.
// Products accumulate in float32 and are rounded to bfloat16 once, with the bias added before.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include "amx.h"

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

constexpr int kGroup = 4;  // 16-output blocks a thread takes at a time (C tiles 0-3)

bool available() {
  static const bool ok = plaserve::amx_available();
  return ok;
}

using plaserve::TileConfig;

// C tiles 0-3 (rows x 16 float32) and the A tile 4 (rows x 32 bfloat16) hold `rows` rows of x; the B
// tiles 5-7, 16 K-pairs.
void load_config(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t < 5 ? rows : 16;
  }
  _tile_loadconfig(&cfg);
}

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "amx_linear: a contiguous bfloat16 weight [N, K]");
  TORCH_CHECK(w.size(0) % 16 == 0 && w.size(1) % 32 == 0,
              "amx_linear: N a multiple of 16 and K of 32, not ", w.sizes());
}

// W [N, K] -> [N/16][K/32][16 K-pairs][16 outputs][2], flat.
at::Tensor pack(const at::Tensor& w) {
  check_weight(w);
  const int64_t n = w.size(0), k = w.size(1), k_blocks = k / 32;
  at::Tensor out = at::empty({n * k}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, n / 16, 1, [&](int64_t first, int64_t last) {
    for (int64_t nb = first; nb < last; ++nb)
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        uint16_t* tile = dst + (nb * k_blocks + kb) * 512;
        for (int p = 0; p < 16; ++p)
          for (int o = 0; o < 16; ++o)
            for (int e = 0; e < 2; ++e)
              tile[p * 32 + o * 2 + e] = src[(nb * 16 + o) * k + kb * 32 + p * 2 + e];
      }
  });
  return out;
}

inline void store_tile(int t, float* c) {
  switch (t) {  // tile numbers are immediates
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
}

// x [M, K] (rows at any stride) times the packed weight of `n` outputs, plus bias [n] where given.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  int64_t n) {
  TORCH_CHECK(available(), "amx_linear: no AMX here");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "amx_linear: x [M, K] bfloat16, each row contiguous");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0 && n % 16 == 0 && packed.numel() == n * k &&
                  packed.scalar_type() == at::kBFloat16,
              "amx_linear: the packed weight of [", n, ", ", k, "]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->numel() == n &&
                                    bias->is_contiguous()),
              "amx_linear: a contiguous bfloat16 bias [N]");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const auto* xd = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wd = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* bd = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t xs = x.stride(0), k_blocks = k / 32, n_blocks = n / 16;
  const int64_t block_step = k_blocks * 512;  // from one output block's tiles to the next's
  const int64_t groups = (n_blocks + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    int configured = -1;
    alignas(64) float c[16 * 16];
    for (int64_t g = first; g < last; ++g) {
      const int64_t nb0 = g * kGroup;
      const int blocks = static_cast<int>(std::min<int64_t>(kGroup, n_blocks - nb0));
      for (int64_t r0 = 0; r0 < m; r0 += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, m - r0));
        if (rows != configured) load_config(rows), configured = rows;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t* xr = xd + r0 * xs;
        for (int64_t kb = 0; kb < k_blocks; ++kb) {
          _tile_loadd(4, xr + kb * 32, xs * 2);
          const uint16_t* w = wd + (nb0 * k_blocks + kb) * 512;
          _tile_loadd(5, w, 64);
          _tile_dpbf16ps(0, 4, 5);
          if (blocks > 1) {
            _tile_loadd(6, w + block_step, 64);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (blocks > 2) {
            _tile_loadd(7, w + 2 * block_step, 64);
            _tile_dpbf16ps(2, 4, 7);
          }
          if (blocks > 3) {
            _tile_loadd(5, w + 3 * block_step, 64);
            _tile_dpbf16ps(3, 4, 5);
          }
        }
        for (int j = 0; j < blocks; ++j) {
          store_tile(j, c);
          const int64_t o0 = (nb0 + j) * 16;
          const __m512 b = bd == nullptr
                               ? _mm512_setzero_ps()
                               : _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(bd + o0))),
                                     16));
          for (int r = 0; r < rows; ++r)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(od + (r0 + r) * n + o0),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c + r * 16), b)));
        }
      }
    }
    _tile_release();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(plaserve_linear, m) {
  m.def("available() -> bool", &available);
  m.def("pack(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(plaserve_linear, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
}
