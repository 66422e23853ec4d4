// How fast this CPU's AMX unit multiplies bfloat16 tiles, and what loading tiles costs: the ceiling of
// a tiled linear layer (plaserve/model/kernels/packed_linear.cpp), from nothing but tile instructions.
//
// Each pattern runs 2,000,000 iterations of 4 tile products (16 x 32 by 32 x 16 bfloat16 into 16 x 16
// float32: 16,384 FLOP each) on every OpenMP thread, with 0, 2, 4 or 5 tile loads (1 KB each, from a few
// KB that stay in L1) around them, and prints each thread's GFLOP/s:
//
//   no loads   the 4 products alone: the multiply unit's own rate
//   2 loads    one A and one B tile reloaded an iteration, two tiles kept
//   2x2        two A and two B tiles loaded, each used twice: a 2 x 2 block of a linear layer
//   2x2 late   the same loads, each issued right after its tile's last product of the iteration
//   1x4        one A tile and four B tiles (one B tile register reused): packed_linear.cpp's AMX path
//
// Build and run (docs/BENCHMARKS.md, "The night of 2026-12-04"):
//
//   g++ -O2 -fopenmp -mamx-tile -mamx-bf16 benchmarks/amx_tile_loads.cpp -o /tmp/amx_tile_loads
//   OMP_NUM_THREADS=1 /tmp/amx_tile_loads; OMP_NUM_THREADS=2 /tmp/amx_tile_loads
#include <immintrin.h>
#include <omp.h>

#include "../src/plaserve/model/kernels/amx.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

constexpr long kIterations = 2000000;
constexpr int kRing = 4;  // tiles a stream cycles through: 4 KB a stream, in L1

const char* const kNames[] = {"no loads", "2 loads", "2x2", "2x2 late", "1x4"};

// The tile-instruction loop of `pattern` over `buf` (5 streams of kRing 1 KB tiles).
void run(int pattern, const uint16_t* buf) {
  auto tile = [&](int stream, long i) { return buf + (stream * kRing + (i % kRing)) * 512; };
  for (long i = 0; i < kIterations; ++i) {
    switch (pattern) {
      case 1:
        _tile_loadd(4, tile(0, i), 64);
        _tile_loadd(6, tile(1, i), 64);
        break;
      case 2:
        _tile_loadd(4, tile(0, i), 64);
        _tile_loadd(6, tile(1, i), 64);
        _tile_loadd(5, tile(2, i), 64);
        _tile_loadd(7, tile(3, i), 64);
        break;
      case 3:  // loads for the next iteration, each after its tile's last product in this one
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(4, tile(0, i + 1), 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(6, tile(1, i + 1), 64);
        _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(5, tile(2, i + 1), 64);
        _tile_loadd(7, tile(3, i + 1), 64);
        continue;
      case 4:  // C 0-3 = A 4 x B 5, 6, 7, 5 again; A reloaded once
        _tile_loadd(4, tile(0, i), 64);
        _tile_loadd(5, tile(1, i), 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, tile(2, i), 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, tile(3, i), 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, tile(4, i), 64);
        _tile_dpbf16ps(3, 4, 5);
        continue;
      default:
        break;
    }
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

}  // namespace

int main() {
  if (!plaserve::amx_available()) {
    std::printf("no AMX for this process\n");
    return 1;
  }
  std::vector<uint16_t> buf(5 * kRing * 512, 0x3f80);  // bfloat16 1.0
  for (int pattern = 0; pattern < 5; ++pattern) {
#pragma omp parallel
    {
      plaserve::TileConfig cfg;
      for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
      _tile_loadconfig(&cfg);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      _tile_loadd(4, buf.data(), 64);
      _tile_loadd(5, buf.data(), 64);
      _tile_loadd(6, buf.data(), 64);
      _tile_loadd(7, buf.data(), 64);
      const auto start = std::chrono::steady_clock::now();
      run(pattern, buf.data());
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      _tile_release();
#pragma omp critical
      std::printf("%-9s thread %d of %d: %5.0f GFLOP/s\n", kNames[pattern], omp_get_thread_num(),
                  omp_get_num_threads(), kIterations * 4 * 16384.0 / s / 1e9);
    }
  }
  return 0;
}
