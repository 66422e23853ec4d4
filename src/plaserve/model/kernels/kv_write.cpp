// A step's new keys and values into the paged KV cache on CPU (built and loaded by
// plaserve/model/kernels; index_copy_ is the fallback and defines the result).
//
// Every layer of every step writes its new K and V rows: two index_copy_ calls cost ~10 us each in
// a decode step (their dispatch and checks, for a few hundred bytes a row), ~4 % of a 16-row decode
// step on the embedded model, and a prefill's thousands of rows run on one thread. Here both are one
// call: each token's K and V rows are copied to their slots, the tokens spread over torch's OpenMP
// threads once there are enough of them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// k, v [T, Hk, D] (each token's heads contiguous, any token stride) into k_cache, v_cache [S, Hk, D]
// (contiguous, the flat cache) at rows slots[t] (int64, each in [0, S)). Slots may repeat: a padded
// batch sends every padding row to the null block, which no request reads unmasked; which of the
// rows lands there is unspecified, as with index_copy_.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 3 &&
                  v_cache.sizes() == k_cache.sizes() && k.size(1) == k_cache.size(1) &&
                  k.size(2) == k_cache.size(2),
              "write_kv: k, v [T, Hk, D] and caches [S, Hk, D]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "write_kv: one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: contiguous caches");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2),
              "write_kv: each token's heads must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == k.size(0),
              "write_kv: int64 slots, one a token");
  const int64_t tokens = k.size(0), capacity = k_cache.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "write_kv: slot ", slot[t], " out of range");
  const int64_t element = k.element_size();
  const int64_t row = k.size(1) * k.size(2) * element;  // bytes of one token's K (or V)
  const auto* kd = static_cast<const char*>(k.data_ptr());
  const auto* vd = static_cast<const char*>(v.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * element, vs = v.stride(0) * element;
  // ~256 KB a task: a decode step's rows stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / (2 * row));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slot[t] * row, kd + t * ks, row);
      std::memcpy(vc + slot[t] * row, vd + t * vs, row);
    }
  });
}

}  // namespace

TORCH_LIBRARY(plaserve_kv, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(plaserve_kv, CPU, m) { m.impl("write_kv", &write_kv); }
