// A bfloat16 linear layer y = x W^T (+ b) over a weight packed once in its own layout. On AMX tiles
// where the CPU has them, for steps of up to a few hundred rows (decode batches and short prefills);
// else in AVX512-BF16's vdpbf16ps, for steps of up to 4,096 rows (built and loaded by
// plaserve/model/kernels; plaserve/model/layers.py's Projection uses it where it loads).
//
// Why: oneDNN's packed linear spends ~14 us a call before it multiplies (measured single-threaded on a
// 16 x 128 x 128 product), and a decode step makes 4 such calls a layer; without AMX, its decode-sized
// products also wait on memory, where this kernel prefetches the weights it streams
// (docs/BENCHMARKS.md).
//
// The layout: [N/16][K/32][16 K-pairs][16 outputs][2], flat. A 16 x 64-byte tile of it is AMX's B
// operand; each 64-byte row is one vdpbf16ps operand (16 outputs x one K-pair). Each block of 16
// outputs' rows is contiguous, so a thread streams its outputs' weights in order. Each thread takes
// groups of 4 blocks (64 outputs; 2 in some decode-sized calls, see kSmallGroupRows) and runs down K for
// each slice of rows of x (AMX: 16 rows, the A tile, into C tiles 0-3; AVX512-BF16: 8 rows into 8 x 2
// or 4 x 4 vector accumulators): the weights cross memory once a step whatever the row count up to
// that slice, and from cache after.
// Products accumulate in float32 and are rounded to bfloat16 once, with the bias added before.
//
// SwiGLU (`swiglu`): the fused gate and up projections of an MLP, packed with their 16-output blocks
// interleaved (gate block j, then up block j: `interleaved` in plaserve/model/kernels), give
// silu(gate) * up straight from the accumulators of each pair of blocks, rounded as the separate
// projection and elementwise kernel round them (gate and up to bfloat16 first): the [M, 2 I] product
// is never written out and read back.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include "avx512_exp.h"
#include "bf16.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"
#define PLASERVE_AMX 1
#endif

namespace {

constexpr int kGroup = 4;  // 16-output blocks a thread takes at a time (AVX512-BF16: at most)

// The operands of one call: x's rows at a stride, the packed weight, the bias (or null), the output;
// `swiglu`: the weight is SwiGLU's interleaved gate and up, and the output silu(gate) * up, n / 2 wide.
struct Operands {
  const uint16_t* x;
  int64_t x_stride;
  const uint16_t* w;
  const uint16_t* bias;
  uint16_t* out;
  int64_t n, k;
  bool swiglu;
  int64_t block_step() const { return k * 16; }  // from one output block's weights to the next's
};

// 16 float32 sums of output block `nb` plus its bias, rounded to bfloat16 into row r of the output.
inline void store_row(const Operands& o, int64_t r, int64_t nb, __m512 sums) {
  if (o.bias != nullptr) sums = _mm512_add_ps(sums, plaserve::widen16(o.bias + nb * 16));
  plaserve::store16(o.out + r * o.n + nb * 16, sums);
}

// SwiGLU: the sums of gate block nb (even) and of up block nb + 1, each rounded to bfloat16, into
// silu(gate) * up at columns [nb / 2 * 16, + 16) of row r.
inline void store_swiglu(const Operands& o, int64_t r, int64_t nb, __m512 gate, __m512 up) {
  const __m512 act = plaserve::silu_times(plaserve::round_bf16(gate), plaserve::round_bf16(up));
  plaserve::store16(o.out + r * (o.n / 2) + nb / 2 * 16, act);
}

#ifdef PLASERVE_AMX
bool amx() {
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

inline void store_tile(int t, float* c) {
  switch (t) {  // tile numbers are immediates
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
}

// Output blocks [first, last) of kGroup each, every row of x, on AMX tiles.
void amx_groups(const Operands& o, int64_t m, int64_t first, int64_t last) {
  const int64_t x_stride = o.x_stride, k_blocks = o.k / 32, n_blocks = o.n / 16;
  const int64_t block_step = o.block_step();
  int configured = -1;
  alignas(64) float c[16 * 16], c_up[16 * 16];
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
      const uint16_t* xr = o.x + r0 * x_stride;
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        _tile_loadd(4, xr + kb * 32, x_stride * 2);
        const uint16_t* w = o.w + (nb0 * k_blocks + kb) * 512;
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
        if (o.swiglu) {  // blocks j (gate) and j + 1 (up)
          store_tile(++j, c_up);
          for (int r = 0; r < rows; ++r)
            store_swiglu(o, r0 + r, nb0 + j - 1, _mm512_load_ps(c + r * 16),
                         _mm512_load_ps(c_up + r * 16));
          continue;
        }
        for (int r = 0; r < rows; ++r) store_row(o, r0 + r, nb0 + j, _mm512_load_ps(c + r * 16));
      }
    }
  }
  _tile_release();
}
#endif

// Weight rows (64 bytes, one K-pair of a block) read this far ahead are prefetched: left to the
// hardware prefetcher, a decode step's weights, streamed from memory, kept the products waiting on it
// (docs/BENCHMARKS.md).
constexpr int64_t kPrefetchPairs = 64;
constexpr int kSliceRows = 8;  // rows of x an AVX512-BF16 tile takes

// Calls of more than one row slice stream the next group's weights: in such a call a group's first
// slice waited on memory for its weights while the later slices multiplied them from cache, one after
// the other (a qwen05-sized decode step of 32 rows took the weights' time from memory plus 3/4 of its
// arithmetic). A thread now fetches its next group's weights into L2, a few lines at each K-pair step
// of every slice of the current group, so the two overlap. In calls of up to kSmallGroupRows rows,
// where the weights' time is a large part of the call's, a group is 2 blocks where two of kGroup
// blocks would not fit in L2 side by side (kGroupBytes each: an MLP's down projection); larger calls
// keep kGroup, as each group reads all of x again.
constexpr int64_t kSmallGroupRows = 128;
constexpr int64_t kGroupBytes = 384 << 10;

// The weights a thread multiplies next, fetched into L2 `lines` 64-byte lines at a K-pair step.
struct Stream {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t lines = 0;
  void step() {
    for (int64_t i = 0; i < lines && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// R rows of x (from row r0) times output blocks [nb0, nb0 + G): R x G float32 vectors of sums, one
// vdpbf16ps per K-pair each, kept in registers down the whole of K.
template <int R, int G>
void dot_tile(const Operands& o, int64_t r0, int64_t nb0, Stream& stream) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  const uint16_t* x = o.x + r0 * o.x_stride;
  const uint16_t* w = o.w + nb0 * o.block_step();
  const int64_t pairs = o.k / 2, step = o.block_step();
  for (int64_t p = 0; p < pairs; ++p) {
    stream.step();
    __m512bh wv[G];
    for (int g = 0; g < G; ++g) {
      const uint16_t* row = w + g * step + p * 32;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchPairs * 32), _MM_HINT_T0);
      wv[g] = (__m512bh)_mm512_loadu_si512(row);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = plaserve::pair(x + r * o.x_stride + 2 * p);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], xv, wv[g]);
    }
  }
  if constexpr (G % 2 == 0) {
    if (o.swiglu) {
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; g += 2) store_swiglu(o, r0 + r, nb0 + g, acc[r][g], acc[r][g + 1]);
      return;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) store_row(o, r0 + r, nb0 + g, acc[r][g]);
}

// The blocks of one tile for R rows: at most 16 accumulators, so that the weight vectors and the
// broadcast row of x stay in registers beside them.
constexpr int tile_blocks(int64_t rows) { return rows <= 4 ? 4 : 2; }

// R rows from r0 times `blocks` output blocks from nb0, tile_blocks(R) blocks a tile. Pairs of blocks
// stay in one tile (SwiGLU's gate and up: `blocks` and nb0 are even there).
template <int R>
void dot_rows(const Operands& o, int64_t r0, int64_t nb0, int blocks, Stream& stream) {
  constexpr int G = tile_blocks(R);
  int b = 0;
  for (; b + G <= blocks; b += G) dot_tile<R, G>(o, r0, nb0 + b, stream);
  if constexpr (G == 4)
    if (b + 2 <= blocks) dot_tile<R, 2>(o, r0, nb0 + b, stream), b += 2;
  for (; b < blocks; ++b) dot_tile<R, 1>(o, r0, nb0 + b, stream);
}

// The K-pair steps dot_rows takes for `rows` rows of `blocks` blocks.
int64_t dot_steps(int64_t rows, int blocks, int64_t pairs) {
  const int g = tile_blocks(rows);
  return (blocks / g + (g == 4 && blocks % 4 >= 2) + blocks % 2) * pairs;
}

using DotRows = void (*)(const Operands&, int64_t, int64_t, int, Stream&);
constexpr DotRows kDotRows[kSliceRows] = {&dot_rows<1>, &dot_rows<2>, &dot_rows<3>, &dot_rows<4>,
                                          &dot_rows<5>, &dot_rows<6>, &dot_rows<7>, &dot_rows<8>};

// Groups [first_group, last_group) of `group` output blocks each, every row of x, in vdpbf16ps.
void avx_groups(const Operands& o, int64_t m, int64_t first_group, int64_t last_group, int group) {
  const int64_t n_blocks = o.n / 16, pairs = o.k / 2;
  for (int64_t g = first_group; g < last_group; ++g) {
    const int64_t nb0 = g * group;
    const int blocks = static_cast<int>(std::min<int64_t>(group, n_blocks - nb0));
    Stream stream;  // none in a call of one slice: all of it waits on memory (streaming was slower)
    if (m > kSliceRows && g + 1 < last_group) {
      const int64_t next_lines = std::min<int64_t>(group, n_blocks - nb0 - group) * pairs;
      int64_t steps = 0;
      for (int64_t r0 = 0; r0 < m; r0 += kSliceRows)
        steps += dot_steps(std::min<int64_t>(kSliceRows, m - r0), blocks, pairs);
      stream.next = reinterpret_cast<const char*>(o.w + (nb0 + group) * o.block_step());
      stream.end = stream.next + next_lines * 64;
      stream.lines = (next_lines + steps - 1) / steps;
    }
    for (int64_t r0 = 0; r0 < m; r0 += kSliceRows)
      kDotRows[std::min<int64_t>(kSliceRows, m - r0) - 1](o, r0, nb0, blocks, stream);
  }
}

// Blocks a group (AVX512-BF16; see kSmallGroupRows).
int avx_group(int64_t m, int64_t k) {
  return m > kSliceRows && m <= kSmallGroupRows && kGroup * k * 32 > kGroupBytes ? 2 : kGroup;
}

// Which instructions `linear` multiplies with here.
std::string isa() {
#ifdef PLASERVE_AMX
  if (amx()) return "AMX";
#endif
  return "AVX512-BF16";
}

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "packed_linear: a contiguous bfloat16 weight [N, K]");
  TORCH_CHECK(w.size(0) % 16 == 0 && w.size(1) % 32 == 0,
              "packed_linear: N a multiple of 16 and K of 32, not ", w.sizes());
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

// x [M, K] (rows at any stride) times the packed weight of `n` outputs, plus bias [n] where given;
// `swiglu`: silu(gate) * up of an interleaved gate and up (see the top), [M, n / 2].
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
               int64_t n, bool swiglu) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "packed_linear: x [M, K] bfloat16, each row contiguous");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0 && n % 16 == 0 && packed.numel() == n * k &&
                  packed.scalar_type() == at::kBFloat16,
              "packed_linear: the packed weight of [", n, ", ", k, "]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->numel() == n &&
                                    bias->is_contiguous()),
              "packed_linear: a contiguous bfloat16 bias [N]");
  TORCH_CHECK(!swiglu || n % 32 == 0, "packed_linear: SwiGLU's gate and up, 2 x a multiple of 16");
  at::Tensor out = at::empty({m, swiglu ? n / 2 : n}, x.options());
  if (m == 0) return out;
  const Operands o{reinterpret_cast<const uint16_t*>(x.data_ptr()),
                   x.stride(0),
                   reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                   bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
                   reinterpret_cast<uint16_t*>(out.data_ptr()),
                   n,
                   k,
                   swiglu};
#ifdef PLASERVE_AMX
  if (amx()) {
    at::parallel_for(0, (n / 16 + kGroup - 1) / kGroup, 1,
                     [&](int64_t first, int64_t last) { amx_groups(o, m, first, last); });
    return out;
  }
#endif
  const int group = avx_group(m, k);
  at::parallel_for(0, (n / 16 + group - 1) / group, 1,
                   [&](int64_t first, int64_t last) { avx_groups(o, m, first, last, group); });
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  int64_t n) {
  return run(x, packed, bias, n, false);
}

// silu(gate) * up, [M, n / 2], from x and the packed interleaved gate and up of n outputs in all.
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return run(x, packed, std::nullopt, n, true);
}

}  // namespace

TORCH_LIBRARY(plaserve_linear, m) {
  m.def("isa() -> str", &isa);
  m.def("pack(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("swiglu(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(plaserve_linear, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
  m.impl("swiglu", &swiglu);
}
