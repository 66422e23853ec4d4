// A matmul whose rows are split between the OpenMP threads, each thread multiplying its block with one
// single-threaded oneDNN call (built and loaded by plaserve/model/kernels; plaserve/model/layers.py
// decides, by timing it once a process, for which row counts a projection uses it).
//
// Why: for some row counts oneDNN's own split of one call between threads leaves them idle or
// working on blocks too small for the matrix units (on an AMX Xeon with 2 threads, a [512..1024 x
// 1536] x [1536 x 512] bfloat16 product ran at one thread's speed). Calls made inside a parallel
// region run on one thread each, so row blocks of at least a few hundred rows keep both threads busy
// at their full single-thread rate. The blocks are multiples of 32 rows (two AMX tiles).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>

namespace {

at::Tensor row_split_mm(const at::Tensor& x, const at::Tensor& w, int64_t parts) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(0),
              "row_split_mm: x [M, K] and w [K, N]");
  TORCH_CHECK(parts >= 1, "row_split_mm: parts >= 1");
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, w.size(1)}, x.options());
  const int64_t block = ((rows + parts - 1) / parts + 31) / 32 * 32;
  const int64_t blocks = (rows + block - 1) / block;
  // The OpenMP threads do not inherit the caller's thread-local state: inference mode (writing to
  // an inference tensor outside it is an error) goes with the work.
  const at::ThreadLocalState caller;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    at::ThreadLocalStateGuard guard(caller);
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = b * block, n = std::min(block, rows - start);
      at::Tensor dst = out.narrow(0, start, n);
      at::mm_out(dst, x.narrow(0, start, n), w);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(plaserve_matmul, m) { m.def("row_split_mm(Tensor x, Tensor w, int parts) -> Tensor"); }

TORCH_LIBRARY_IMPL(plaserve_matmul, CPU, m) { m.impl("row_split_mm", &row_split_mm); }
