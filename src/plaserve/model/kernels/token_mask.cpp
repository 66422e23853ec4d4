// Structured outputs' token masks applied to the logits straight from the grammar engine's bitmask, for
// CPUs with AVX-512 (built and loaded by plaserve/model/kernels; plaserve/grammar/masks.py has the
// numpy form it replaces).
//
// Row k of `bitmask` ([K, words] int32, bit j of word w is token 32 w + j, set where the token is
// allowed) belongs to logits row rows[k] ([N, vocab] float32): every banned token's logit becomes
// -inf, every allowed one stays exactly as it is. One masked store of -inf per 16 tokens, no
// [K, vocab] float mask made in between; the other rows are not touched.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

namespace {

void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "apply_token_bitmask: logits [N, vocab] float32, rows contiguous");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask [K, words] int32, contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: rows [K] int64, one per bitmask row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "apply_token_bitmask: the bitmask covers fewer tokens than vocab");
  const int64_t* row = rows.data_ptr<int64_t>();
  const auto* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr());
  float* base = logits.data_ptr<float>();
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t k = 0; k < bitmask.size(0); ++k)
    TORCH_CHECK(row[k] >= 0 && row[k] < logits.size(0), "apply_token_bitmask: row out of range");
  // Rows split across torch's threads: a row is 4 bytes a token, read and written back, so a batch
  // of constrained rows is megabytes of logits, most of them out of L2 when the step gets here.
  at::parallel_for(0, bitmask.size(0), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      float* out = base + row[k] * logits.stride(0);
      const uint32_t* b = bits + k * words;
      for (int64_t t = 0; t < vocab; t += 16) {
        const uint32_t word = b[t / 32] >> (t % 32);  // t is a multiple of 16: its half of the word
        __mmask16 banned = static_cast<__mmask16>(~word & 0xFFFFu);
        if (vocab - t < 16) banned &= static_cast<__mmask16>((1u << (vocab - t)) - 1u);
        if (banned) _mm512_mask_storeu_ps(out + t, banned, neg_inf);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(plaserve_sampling, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(plaserve_sampling, CPU, m) {
  m.impl("apply_token_bitmask", &apply_token_bitmask);
}
