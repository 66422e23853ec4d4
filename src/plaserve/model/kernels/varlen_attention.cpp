// Causal varlen attention in bfloat16 for CPUs with AVX512-BF16, its products on AMX tiles where the
// CPU has them (built and loaded by plaserve/model/kernels; torch's SDPA is the fallback everywhere
// this is not built).
//
// One call attends every sequence of a packed batch. Sequence s has q_len new query tokens at rows
// [q_starts[s], q_starts[s+1]) of q and out, and k_len keys, the key tokens k_index[k_starts[s] ..
// k_starts[s+1]) of k and v (rows of a packed batch, or slots of the flat paged cache). Queries are
// aligned to the end of the keys: query i sees keys j <= k_len - q_len + i.
//
// Two passes, both over torch's intra-op thread pool:
//  1. each (sequence, K/V head)'s keys and values are copied once into the layouts the products
//     multiply, zero-padded to a multiple of 32 keys; the gather from the paged cache is this same
//     copy. AVX512-BF16: pair-interleaved for vdpbf16ps (K: 16 keys x 2 dims a register, V: 16 dims x
//     2 keys); its transposed form reads the keys where they are and packs only the values. AMX: K as
//     it is (rows of keys), V transposed (rows of dimensions). Without AMX, a sequence whose queries
//     make a single work item (decode rows, prompts of up to kBlockQ tokens) is packed in pass 2
//     instead, by that item, just before it reads the copy;
//  2. work items of kBlockQ query tokens of one K/V head, times the query heads that share it (so
//     one pass over a K/V block serves the whole GQA group), run online-softmax (flash) attention:
//     float32 accumulation and softmax, P rounded to bfloat16 for the second product. The
//     transposed form takes 16 rows (token x head) a vector: S^T = K Q^T and O^T += V^T P^T, so each
//     key's scores are one vector over the 16 rows and the softmax needs no horizontal reductions;
//     AMX runs every item so, as tile multiplies (attend_amx), AVX512-BF16 the items of 16 rows or
//     more, in vdpbf16ps (attend_t). Fewer rows (a decode token's query heads) would fill a fraction
//     of each vector: without AMX they take the plain form (attend), S = Q K^T and O += P V, 16 keys
//     a vector and the softmax row by row.
//     Decode rows (one query token) on AMX skip pass 1 and read K/V where they are (attend_direct).
//     Items are taken largest-first from a shared counter, which keeps the two ends of a causal
//     triangle balanced.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include "avx512_exp.h"
#include "bf16.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <memory>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"
#define PLASERVE_AMX 1
#endif

namespace {

constexpr int kBlockQ = 32;   // query tokens of a work item
constexpr int kBlockK = 128;  // keys of an online-softmax step (a multiple of 32)
constexpr int kMaxDirectGroup = 16;  // AMX decode rows: query heads per K/V head that fit 16 columns
// Calls with less work than this (query rows x keys seen) run on the calling thread alone. Handing
// work to a second thread cost ~40 us a call on the AMX Xeon (2 threads, a decode batch: 16 rows of
// 14/2 heads over 64 keys took 36 us on one thread, 50 on two), about one thread's time for this
// much work: a decode step of small batches and contexts is faster on one thread.
constexpr int64_t kParallelMinWork = 32768;

using plaserve::exp2_p_flushed;
using plaserve::FlushDenormals;

using plaserve::pair;

inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline __mmask16 first_lanes(int n) {  // lanes [0, n) of 16, n clamped to [0, 16]
  n = std::max(0, std::min(16, n));
  return static_cast<__mmask16>((1u << n) - 1u);
}

// S[r][0 .. 16 C) = Q[r] . K^T for R query rows and C 16-key chunks. kp: the chunks' packed keys,
// [C][D/2][16 keys][2 dims]; s: R rows of stride ldS.
template <int R, int C, int D>
inline void qk_tile(const uint16_t* const* q, const uint16_t* kp, float* s, int ldS) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int dp = 0; dp < D / 2; ++dp) {
    __m512bh k[C];
    for (int c = 0; c < C; ++c) k[c] = load_bh(kp + (c * D / 2 + dp) * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh qr = pair(q[r] + 2 * dp);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], k[c], qr);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(s + r * ldS + 16 * c, acc[r][c]);
}

// qk_tile over all `rows` rows, 6 at a time, then the rest in one tile.
template <int C, int D>
void qk_chunks(const uint16_t* const* q, int rows, const uint16_t* kp, float* s, int ldS) {
  int r = 0;
  for (; r + 6 <= rows; r += 6) qk_tile<6, C, D>(q + r, kp, s + r * ldS, ldS);
  q += r, s += r * ldS;
  switch (rows - r) {
    case 5: qk_tile<5, C, D>(q, kp, s, ldS); break;
    case 4: qk_tile<4, C, D>(q, kp, s, ldS); break;
    case 3: qk_tile<3, C, D>(q, kp, s, ldS); break;
    case 2: qk_tile<2, C, D>(q, kp, s, ldS); break;
    case 1: qk_tile<1, C, D>(q, kp, s, ldS); break;
    default: break;
  }
}

// S[r][0 .. 32 pairs32) for every row: 64 keys a pass over the rows (6 rows x 4 chunks, 24 of the 32
// vector registers accumulating: 24 dot products for every 10 loads), a last 32 with 2 chunks.
template <int D>
void qk_rows(const uint16_t* const* q, int rows, const uint16_t* kp, int pairs32, float* s,
             int ldS) {
  int c = 0;
  for (; c + 2 <= pairs32; c += 2) qk_chunks<4, D>(q, rows, kp + c * 32 * D, s + 32 * c, ldS);
  if (c < pairs32) qk_chunks<2, D>(q, rows, kp + c * 32 * D, s + 32 * c, ldS);
}

// O[r] += P[r] . V for R rows over n_pairs key pairs. vp: [pairs][D dims][2 keys]; p: bf16 rows of
// stride ldP; o: float32 rows of stride D.
template <int R, int D>
inline void pv_tile(const uint16_t* p, int ldP, const uint16_t* vp, int n_pairs, float* o) {
  constexpr int NV = D / 16;
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + c * 16);
  for (int jp = 0; jp < n_pairs; ++jp) {
    __m512bh v[NV];
    for (int c = 0; c < NV; ++c) v[c] = load_bh(vp + (jp * D + c * 16) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh pr = pair(p + r * ldP + 2 * jp);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], pr);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * D + c * 16, acc[r][c]);
}

// pv_tile over all `rows` rows, R at a time (R x D/16 accumulators <= 16), then the rest in one
// tile: each tile reads the values once, so a decode token's 7 query heads of one K/V head (Qwen2.5)
// read them twice, not 4 times as in tiles of 4 and then single rows.
template <int D>
void pv_rows(const uint16_t* p, int ldP, int rows, const uint16_t* vp, int n_pairs, float* o) {
  constexpr int R = D <= 32 ? 8 : D == 64 ? 4 : 2;
  int r = 0;
  for (; r + R <= rows; r += R) pv_tile<R, D>(p + r * ldP, ldP, vp, n_pairs, o + r * D);
  p += r * ldP, o += r * D;
  switch (rows - r) {
    case 7: if constexpr (R > 7) pv_tile<7, D>(p, ldP, vp, n_pairs, o); break;
    case 6: if constexpr (R > 6) pv_tile<6, D>(p, ldP, vp, n_pairs, o); break;
    case 5: if constexpr (R > 5) pv_tile<5, D>(p, ldP, vp, n_pairs, o); break;
    case 4: if constexpr (R > 4) pv_tile<4, D>(p, ldP, vp, n_pairs, o); break;
    case 3: if constexpr (R > 3) pv_tile<3, D>(p, ldP, vp, n_pairs, o); break;
    case 2: if constexpr (R > 2) pv_tile<2, D>(p, ldP, vp, n_pairs, o); break;
    case 1: pv_tile<1, D>(p, ldP, vp, n_pairs, o); break;
    default: break;
  }
}

struct Batch {
  const uint16_t* q;
  uint16_t* out;
  int64_t q_stride, out_stride;  // elements between tokens
  int64_t heads, kv_heads;
  const int64_t* q_starts;
  const int64_t* k_starts;
  const uint16_t* k;  // the keys and values as given (a batch's rows, or the flat cache)
  const uint16_t* v;
  int64_t k_stride, v_stride;
  const int64_t* index;            // k_index
  std::vector<int64_t> packed_at;  // per (sequence, K/V head): offset of its packed K (and V)
  const uint16_t* kp;
  const uint16_t* vp;
  float scale;
};

// The packed keys and values, and the work items' scratch, page-aligned, so that every row of D keys or
// values, and every vector of scores, starts on a cache line. new[] aligns to 16 bytes only: a 128-byte
// row then spans three lines, and where the buffer fell differed from process to process (one thread,
// 2,048 tokens: 8.4 ms in some processes, 12.4-13.4 in about half of them).
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using Aligned = std::unique_ptr<T[], FreeDeleter>;
using Packed = Aligned<uint16_t>;

template <typename T = uint16_t>
Aligned<T> aligned_buffer(size_t elements) {
  const size_t bytes = (elements * sizeof(T) + 4095) / 4096 * 4096;
  auto* p = static_cast<T*>(std::aligned_alloc(4096, bytes));
  TORCH_CHECK(p != nullptr, "varlen_attention: out of memory for ", bytes, " bytes");
  return Aligned<T>(p);
}

// An aligned_buffer kept from call to call by its owner, grown when a call needs more: freshly
// allocated, megabytes of it would page-fault in at every layer.
template <typename T = uint16_t>
struct KeptBuffer {
  Aligned<T> data;
  size_t size = 0;

  T* room(size_t elements) {
    if (size < elements) data = aligned_buffer<T>(elements), size = elements;
    return data.get();
  }
};

// Keys are read in chunk pairs of 32: a sequence's packed keys are padded to that, not to kBlockK.
int64_t padded_keys(int64_t k_len) { return (k_len + 31) / 32 * 32; }

// The row length (elements) of the AMX path's V^T and the room each packed (sequence, K/V head) takes:
// 32 more than its padded keys, so that no row length is a multiple of 4 KiB (2,048 keys): a tile
// load's 16 rows would all fall in one L1 set (12 ways) and evict one another.
int64_t packed_stride(int64_t k_len) { return padded_keys(k_len) + 32; }

// The 16 x 16 matrix of 32-bit elements in r (row i in r[i]) transposed in place: 64 shuffles, against
// the 32 eight-lane gathers per 16 keys and 16 dimension pairs that pack_kv takes otherwise.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // t[i]: lanes' elements 0, 1 of rows i, i + 1; t[i + 1]: 2, 3
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4 g + c]: 128-bit lane L holds element 4 L + c of rows 4 g .. 4 g + 3
  for (int g = 0; g < 4; ++g) {
    const __m512i* a = t + 4 * g;
    u[4 * g + 0] = _mm512_unpacklo_epi64(a[0], a[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(a[0], a[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(a[1], a[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(a[1], a[3]);
  }
  for (int c = 0; c < 4; ++c) {  // element 4 L + c of all 16 rows: lane L of u[c], u[4 + c], ...
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[0 + c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// How far ahead of the keys (and values) it packs the packing asks for their rows: a decode batch's
// K/V (the cache of a few dozen sequences) comes from memory, not cache, a few hundred bytes of each
// 4 KiB cache block at a time (64 decode rows of ~300 keys in 8 layers' caches, scattered blocks:
// 8.4 GB/s without, ~9.2 with; torch's own gather of those blocks reads 9.7).
constexpr int64_t kPrefetchKeys = 32;

// Rows [from, to) of one K/V head (index order) asked for into the cache.
template <int D>
inline void prefetch_rows(const uint16_t* x, int64_t stride, const int64_t* index, int64_t head,
                          int64_t from, int64_t to) {
  for (int64_t j = from; j < to; ++j) {
    const char* row = reinterpret_cast<const char*>(x + index[j] * stride + head * D);
    for (int line = 0; line < D * 2; line += 64) _mm_prefetch(row + line, _MM_HINT_T0);
  }
}

// Pass 1, keys: those of one (sequence, K/V head) into [chunk of 16][D/2][16 keys][2 dims], zero past
// the last key (P is zero there, but 0 x NaN would not be). A chunk of 16 consecutive slots (a whole
// cache block, or a prompt's own rows) is loaded row by row and transposed in registers, 16 dimension
// pairs at a time; any other chunk is gathered, one 32-bit pair of the 16 keys per dimension pair.
template <int D>
void pack_k(const uint16_t* k, int64_t k_stride, const int64_t* index, int64_t k_len, int64_t head,
            uint16_t* kp) {
  const int64_t padded = padded_keys(k_len);
  for (int64_t j0 = 0; j0 < padded; j0 += 16) {
    const int64_t ahead = j0 + kPrefetchKeys;
    prefetch_rows<D>(k, k_stride, index, head, ahead, std::min(ahead + 16, k_len));
    auto* dst = reinterpret_cast<int32_t*>(kp + j0 * D);  // chunk j0 / 16: (D / 2) x 16 pairs
    bool contiguous = D % 32 == 0 && j0 + 16 <= k_len;
    for (int i = 1; contiguous && i < 16; ++i) contiguous = index[j0 + i] == index[j0] + i;
    if (contiguous) {
      const uint16_t* first = k + index[j0] * k_stride + head * D;
      for (int c = 0; c < D / 32; ++c) {  // dimension pairs 16 c .. 16 c + 15
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(first + i * k_stride + 32 * c);
        transpose16(r);
        for (int x = 0; x < 16; ++x) _mm512_storeu_si512(dst + (16 * c + x) * 16, r[x]);
      }
      continue;
    }
    // byte offsets of the 16 keys' rows (0 for padding lanes, which the masks leave zero)
    alignas(64) int64_t off[16];
    for (int i = 0; i < 16; ++i)
      off[i] = j0 + i < k_len ? (index[j0 + i] * k_stride + head * D) * 2 : 0;
    const __mmask8 lo = first_lanes(static_cast<int>(k_len - j0)) & 0xFF;
    const __mmask8 hi = first_lanes(static_cast<int>(k_len - j0 - 8)) & 0xFF;
    const __m512i off_lo = _mm512_load_si512(off), off_hi = _mm512_load_si512(off + 8);
    for (int dp = 0; dp < D / 2; ++dp) {
      const __m512i step = _mm512_set1_epi64(4 * dp);
      const __m256i a = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), lo,
                                                    _mm512_add_epi64(off_lo, step), k, 1);
      const __m256i b = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), hi,
                                                    _mm512_add_epi64(off_hi, step), k, 1);
      _mm512_storeu_si512(dst + dp * 16, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
  }
}

// Pass 1, values: those of one (sequence, K/V head) into [key pair][D][2], zero past the last key: per
// key pair, the two rows interleaved by a permute, 32 dimensions at a time.
template <int D>
void pack_v(const uint16_t* v, int64_t v_stride, const int64_t* index, int64_t k_len, int64_t head,
            uint16_t* vp) {
  const int64_t padded = padded_keys(k_len);
  // lane i of the interleave: element i / 2 of the first row (even i) or of the second (odd i)
  alignas(64) uint16_t interleave[32];
  for (int i = 0; i < 32; ++i) interleave[i] = static_cast<uint16_t>((i & 1) * 32 + i / 2);
  const __m512i idx_lo = _mm512_loadu_si512(interleave);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < padded; j += 2) {
    const int64_t ahead = j + kPrefetchKeys;
    prefetch_rows<D>(v, v_stride, index, head, ahead, std::min(ahead + 2, k_len));
    const uint16_t* first = j < k_len ? v + index[j] * v_stride + head * D : nullptr;
    const uint16_t* second = j + 1 < k_len ? v + index[j + 1] * v_stride + head * D : nullptr;
    uint16_t* dst = vp + j * D;  // key pair j / 2
    for (int c = 0; c < D; c += 32) {
      const __mmask32 n = D - c >= 32 ? 0xFFFFFFFFu : (1u << (D - c)) - 1u;
      const __m512i a = first ? _mm512_maskz_loadu_epi16(n, first + c) : _mm512_setzero_si512();
      const __m512i b = second ? _mm512_maskz_loadu_epi16(n, second + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, idx_lo, b));
      if (D - c > 16) _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, idx_hi, b));
    }
  }
}

struct Scratch {
  KeptBuffer<float> s, o, m, l;
  KeptBuffer<uint16_t> p;
  std::vector<const uint16_t*> qrow;
  KeptBuffer<> own;  // the packed K/V of a (sequence, K/V head) packed inside its work item
  // attend_t's: Q^T, P^T ([.][16 rows] bfloat16 pairs), O^T, each row's last key, the key rows, the
  // output rows
  KeptBuffer<uint32_t> qt, pt;
  KeptBuffer<float> ot;
  KeptBuffer<int32_t> limit;
  std::vector<const uint16_t*> krow;
  std::vector<uint16_t*> orow;
};

// Where a work item's kBlockQ query tokens (from q0) of sequence `seq` lie.
struct ItemSpan {
  int group;        // query heads per K/V head
  int64_t offset;   // query i of the sequence sees keys [0, offset + i]
  int nq, rows;     // tokens; rows (row = token * group + head)
  int64_t k_end;    // keys the last token sees
  int64_t token0;   // the first token's row in q and out
};

ItemSpan item_span(const Batch& b, int64_t seq, int64_t q0) {
  const int group = static_cast<int>(b.heads / b.kv_heads);
  const int64_t q_len = b.q_starts[seq + 1] - b.q_starts[seq];
  const int64_t offset = (b.k_starts[seq + 1] - b.k_starts[seq]) - q_len;
  const int nq = static_cast<int>(std::min<int64_t>(kBlockQ, q_len - q0));
  return {group, offset, nq, nq * group, offset + q0 + nq, b.q_starts[seq] + q0};
}

// Pass 2: kBlockQ query tokens (from q0) of sequence `seq` and the query heads of K/V head `g`, over
// that pair's packed keys kp and values vp.
template <int D>
void attend(const Batch& b, int64_t seq, int64_t g, int64_t q0, const uint16_t* kp,
            const uint16_t* vp, Scratch& w) {
  const auto [group, offset, nq, rows, k_end, token0] = item_span(b, seq, q0);
  // Raw pointers, read once: the scratch is thread_local, and accesses through `w` inside the loops
  // went through __tls_get_addr each time (~3 % of a short prompt's attention in a profile).
  w.qrow.resize(rows);
  float* const S = w.s.room(static_cast<size_t>(rows) * kBlockK);
  uint16_t* const P = w.p.room(static_cast<size_t>(rows) * kBlockK);
  float* const O = w.o.room(static_cast<size_t>(rows) * D);
  float* const M = w.m.room(rows);
  float* const Lsum = w.l.room(rows);
  const uint16_t** const qrow = w.qrow.data();
  std::fill(O, O + static_cast<size_t>(rows) * D, 0.0f);
  std::fill(M, M + rows, -std::numeric_limits<float>::infinity());
  std::fill(Lsum, Lsum + rows, 0.0f);
  for (int t = 0, r = 0; t < nq; ++t)
    for (int h = 0; h < group; ++h, ++r)
      qrow[r] = b.q + (token0 + t) * b.q_stride + (g * group + h) * D;
  // Base-2 exponents (exp2_p_flushed, P is rounded to bfloat16): scores times scale log2 e, maxima in
  // base 2.
  const float scale = b.scale * 1.44269504088896341f;
  for (int64_t j0 = 0; j0 < k_end; j0 += kBlockK) {
    const int nk = static_cast<int>(std::min<int64_t>(kBlockK, k_end - j0));
    const int pairs32 = (nk + 31) / 32;  // chunk pairs of 32 keys
    qk_rows<D>(qrow, rows, kp + j0 * D, pairs32, S, kBlockK);
    // Online softmax, row by row: the new maximum, the rescale of what was summed so far, P.
    for (int t = 0, r = 0; t < nq; ++t) {
      const int valid = static_cast<int>(
          std::max<int64_t>(0, std::min<int64_t>(nk, offset + q0 + t + 1 - j0)));
      for (int h = 0; h < group; ++h, ++r) {
        const float* s = S + static_cast<size_t>(r) * kBlockK;
        uint16_t* p = P + static_cast<size_t>(r) * kBlockK;
        if (valid == 0) {
          std::memset(p, 0, sizeof(uint16_t) * 32 * pairs32);
          continue;
        }
        __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int c = 0; c < 2 * pairs32; ++c)
          vmax = _mm512_mask_max_ps(vmax, first_lanes(valid - 16 * c), vmax,
                                    _mm512_loadu_ps(s + 16 * c));
        const float m_new = std::max(M[r], _mm512_reduce_max_ps(vmax) * scale);
        if (M[r] != m_new) {  // rescale what was summed so far (nothing on the first block)
          const float alpha = std::exp2(M[r] - m_new);
          float* o = O + static_cast<size_t>(r) * D;
          const __m512 a = _mm512_set1_ps(alpha);
          for (int c = 0; c < D / 16; ++c)
            _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(a, _mm512_loadu_ps(o + 16 * c)));
          Lsum[r] *= alpha;
          M[r] = m_new;
        }
        const __m512 vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(m_new);
        __m512 vsum = _mm512_setzero_ps();
        for (int c = 0; c < 2 * pairs32; c += 2) {
          const __m512 e0 = _mm512_maskz_mov_ps(
              first_lanes(valid - 16 * c),
              exp2_p_flushed(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16 * c), vs, vm)));
          const __m512 e1 = _mm512_maskz_mov_ps(
              first_lanes(valid - 16 * (c + 1)),
              exp2_p_flushed(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16 * (c + 1)), vs, vm)));
          vsum = _mm512_add_ps(vsum, _mm512_add_ps(e0, e1));
          // cvtne2ps packs (second, first): lanes 0-15 come from e0
          _mm512_storeu_si512(p + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        Lsum[r] += _mm512_reduce_add_ps(vsum);
      }
    }
    pv_rows<D>(P, kBlockK, rows, vp + j0 * D, 16 * pairs32, O);
  }
  for (int t = 0, r = 0; t < nq; ++t) {
    uint16_t* dst = b.out + (token0 + t) * b.out_stride + g * group * D;
    for (int h = 0; h < group; ++h, ++r) {
      const __m512 inv = _mm512_set1_ps(1.0f / Lsum[r]);
      for (int c = 0; c < D / 16; ++c)
        plaserve::store16(dst + h * D + 16 * c,
                          _mm512_mul_ps(inv, _mm512_loadu_ps(O + r * D + 16 * c)));
    }
  }
}

// The transposed form of pass 2 without AMX (attend_t), for work items of 16 rows or more: vectors
// run over 16 rows (token x head) instead of 16 keys, as on the AMX tiles. S^T = K Q^T and O^T += V^T
// P^T in vdpbf16ps, Q^T and P^T the vector operands ([row group][D/2 or key pairs][16 rows][2]), K
// and V the broadcast pairs: K straight from its rows (no packing), V packed as pack_v lays it out.
// Each key's scores for 16 rows are one vector, so the softmax takes its maxima and sums down the keys
// with no horizontal reductions and no per-row scalar work: for short prompts, whose rows see a few
// dozen keys each, that per-row work cost as much as the exponentials.

// S^T[j][g] (16 rows) for J keys and G row groups: Q^T's groups qt (stride ldQ) against the keys'
// rows krow; st: stride ldS a key.
template <int J, int G, int D>
inline void qk_t(const uint32_t* qt, int ldQ, const uint16_t* const* krow, float* st, int ldS) {
  __m512 acc[J][G];
  for (int j = 0; j < J; ++j)
    for (int g = 0; g < G; ++g) acc[j][g] = _mm512_setzero_ps();
  for (int dp = 0; dp < D / 2; ++dp) {
    __m512bh qv[G];
    for (int g = 0; g < G; ++g) qv[g] = (__m512bh)_mm512_load_si512(qt + g * ldQ + dp * 16);
    for (int j = 0; j < J; ++j) {
      const __m512bh kb = pair(krow[j] + 2 * dp);
      for (int g = 0; g < G; ++g) acc[j][g] = _mm512_dpbf16_ps(acc[j][g], qv[g], kb);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int g = 0; g < G; ++g) _mm512_store_ps(st + j * ldS + g * 16, acc[j][g]);
}

// O^T[d][g] += V^T P^T for DN dimensions (from d0) and G row groups over n_pairs key pairs: P^T's
// groups pt (stride ldP a key pair), V's pairs vp ([key pair][D][2]); ot: [group][D][16].
template <int DN, int G, int D>
inline void pv_t(const uint32_t* pt, int ldP, const uint16_t* vp, int n_pairs, float* ot, int d0) {
  __m512 acc[DN][G];
  for (int n = 0; n < DN; ++n)
    for (int g = 0; g < G; ++g) acc[n][g] = _mm512_load_ps(ot + (g * D + d0 + n) * 16);
  for (int jp = 0; jp < n_pairs; ++jp) {
    __m512bh pv[G];
    for (int g = 0; g < G; ++g) pv[g] = (__m512bh)_mm512_load_si512(pt + jp * ldP + g * 16);
    for (int n = 0; n < DN; ++n) {
      const __m512bh vb = pair(vp + (jp * D + d0 + n) * 2);
      for (int g = 0; g < G; ++g) acc[n][g] = _mm512_dpbf16_ps(acc[n][g], pv[g], vb);
    }
  }
  for (int n = 0; n < DN; ++n)
    for (int g = 0; g < G; ++g) _mm512_store_ps(ot + (g * D + d0 + n) * 16, acc[n][g]);
}

// Pass 2 in the transposed form: kBlockQ query tokens (from q0) of sequence `seq` and the query heads
// of K/V head `g`, over the keys' rows where they are and the packed values vp.
template <int D>
void attend_t(const Batch& b, int64_t seq, int64_t g, int64_t q0, const uint16_t* vp, Scratch& w) {
  constexpr int kJ = 6, kG = 4;  // qk_t's keys x row groups: 24 accumulators, 10 loads a pair
  constexpr int kDN = 8, kPG = 3;  // pv_t's dimensions x row groups: 24 accumulators, 11 loads
  const auto [group, offset, nq, rows, k_end, token0] = item_span(b, seq, q0);
  const int groups = (rows + 15) / 16;
  const int64_t* index = b.index + b.k_starts[seq];
  constexpr int ldQ = D / 2 * 16;  // uint32 of a row group's Q^T
  const int ldS = groups * 16;     // floats of a key's S^T row, uint32 of a key pair's P^T
  uint32_t* const QT = w.qt.room(static_cast<size_t>(groups) * ldQ);
  float* const S = w.s.room(static_cast<size_t>(kBlockK + kJ) * ldS);
  uint32_t* const PT = w.pt.room(static_cast<size_t>(kBlockK / 2) * ldS);
  float* const OT = w.ot.room(static_cast<size_t>(groups) * D * 16);
  w.krow.resize(kBlockK + kJ);
  const uint16_t** const krow = w.krow.data();
  int32_t* const limit = w.limit.room(static_cast<size_t>(groups) * 16);
  float* const m_all = w.m.room(static_cast<size_t>(groups) * 16);
  float* const l_all = w.l.room(static_cast<size_t>(groups) * 16);
  w.orow.resize(rows);
  uint16_t** const orow = w.orow.data();
  // Each row's last key (its lane of `limit`), the padding rows' the last token's (they see every key:
  // their scores are 0, never NaN).
  w.qrow.resize(static_cast<size_t>(groups) * 16);
  const uint16_t** const qrow = w.qrow.data();
  for (int t = 0, r = 0; t < nq; ++t)
    for (int h = 0; h < group; ++h, ++r) {
      qrow[r] = b.q + (token0 + t) * b.q_stride + (g * group + h) * D;
      orow[r] = b.out + (token0 + t) * b.out_stride + (g * group + h) * D;
      limit[r] = static_cast<int32_t>(offset + q0 + t);
    }
  for (int r = rows; r < groups * 16; ++r) limit[r] = static_cast<int32_t>(k_end - 1);
  // Q^T, 16 rows x 16 dimension pairs at a time transposed in registers (the padding rows zero): the
  // 16 rows' loads go out together (one row at a time, each query row's first load missed the cache
  // in turn: ~18 % of a 128-token prompt's attention).
  for (int rg = 0; rg < groups; ++rg)
    for (int c = 0; c < (D + 31) / 32; ++c) {
      const __mmask32 n = D - 32 * c >= 32 ? 0xFFFFFFFFu : (1u << (D - 32 * c)) - 1u;
      __m512i x[16];
      for (int i = 0; i < 16; ++i)
        x[i] = rg * 16 + i < rows ? _mm512_maskz_loadu_epi16(n, qrow[rg * 16 + i] + 32 * c)
                                  : _mm512_setzero_si512();
      transpose16(x);
      for (int i = 0; i < 16 && 16 * c + i < D / 2; ++i)
        _mm512_store_si512(QT + rg * ldQ + (16 * c + i) * 16, x[i]);
    }
  std::fill(OT, OT + static_cast<size_t>(groups) * D * 16, 0.0f);
  // Base-2 exponents (exp2_p_flushed, P is rounded to bfloat16): scores times scale log2 e, maxima in
  // base 2.
  const __m512 vs = _mm512_set1_ps(b.scale * 1.44269504088896341f);
  // lane 2 i of the interleave: row i's P for the first key of a pair; lane 2 i + 1: the second's
  alignas(64) uint16_t interleave[32];
  for (int i = 0; i < 32; ++i) interleave[i] = static_cast<uint16_t>((i & 1) * 16 + i / 2);
  const __m512i pair_rows = _mm512_load_si512(interleave);
  for (int64_t j0 = 0; j0 < k_end; j0 += kBlockK) {
    const int nk = static_cast<int>(std::min<int64_t>(kBlockK, k_end - j0));
    const int n_pairs = (nk + 1) / 2;
    for (int j = 0; j < nk; ++j) krow[j] = b.k + index[j0 + j] * b.k_stride + g * D;
    for (int j = nk; j < nk + kJ; ++j) krow[j] = krow[0];  // a last tile's extra keys: never read
    for (int j = 0; j < nk; j += kJ)
      for (int rg = 0; rg < groups; rg += kG) {
        const uint32_t* q = QT + rg * ldQ;
        float* st = S + j * ldS + rg * 16;
        switch (std::min(kG, groups - rg)) {
          case 4: qk_t<kJ, 4, D>(q, ldQ, krow + j, st, ldS); break;
          case 3: qk_t<kJ, 3, D>(q, ldQ, krow + j, st, ldS); break;
          case 2: qk_t<kJ, 2, D>(q, ldQ, krow + j, st, ldS); break;
          default: qk_t<kJ, 1, D>(q, ldQ, krow + j, st, ldS); break;
        }
      }
    // The softmax of each row group, down the keys: a key's lanes are the rows that see it.
    for (int rg = 0; rg < groups; ++rg) {
      const __m512i lim = _mm512_load_si512(limit + rg * 16);
      auto seen = [&](int j) {  // the rows (lanes) that see key j0 + j
        return _mm512_cmpge_epi32_mask(lim, _mm512_set1_epi32(static_cast<int>(j0 + j)));
      };
      const float* s = S + rg * 16;
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int j = 0; j < nk; ++j)
        vmax = _mm512_mask_max_ps(vmax, seen(j), vmax, _mm512_load_ps(s + j * ldS));
      __m512 m = _mm512_mul_ps(vmax, vs), l = _mm512_setzero_ps();
      float* o = OT + rg * D * 16;
      if (j0 > 0) {  // rescale what was summed so far to the new maxima (every row saw key 0 before)
        const __m512 m_old = _mm512_load_ps(m_all + rg * 16);
        m = _mm512_max_ps(m, m_old);
        const __m512 alpha = exp2_p_flushed(_mm512_sub_ps(m_old, m));
        if (_mm512_cmpneq_ps_mask(alpha, _mm512_set1_ps(1.0f)) != 0)
          for (int d = 0; d < D; ++d)
            _mm512_store_ps(o + d * 16, _mm512_mul_ps(alpha, _mm512_load_ps(o + d * 16)));
        l = _mm512_mul_ps(alpha, _mm512_load_ps(l_all + rg * 16));
      }
      _mm512_store_ps(m_all + rg * 16, m);
      for (int jp = 0; jp < n_pairs; ++jp) {
        const int j = 2 * jp;  // the pair's second key past the block (nk odd): P zero
        const __m512 e0 = _mm512_maskz_mov_ps(
            seen(j), exp2_p_flushed(_mm512_fmsub_ps(_mm512_load_ps(s + j * ldS), vs, m)));
        const __m512 e1 = _mm512_maskz_mov_ps(
            j + 1 < nk ? seen(j + 1) : __mmask16{0},
            exp2_p_flushed(_mm512_fmsub_ps(_mm512_load_ps(s + (j + 1) * ldS), vs, m)));
        l = _mm512_add_ps(l, _mm512_add_ps(e0, e1));
        // cvtne2ps packs (second, first): lanes 0-15 e0's rows, 16-31 e1's; then row by row in pairs
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
        _mm512_store_si512(PT + jp * ldS + rg * 16, _mm512_permutexvar_epi16(pair_rows, both));
      }
      _mm512_store_ps(l_all + rg * 16, l);
    }
    const uint16_t* v = vp + j0 * D;
    for (int d0 = 0; d0 < D; d0 += kDN)
      for (int rg = 0; rg < groups; rg += kPG) {
        const uint32_t* pt = PT + rg * 16;
        float* ot = OT + rg * D * 16;
        switch (std::min(kPG, groups - rg)) {
          case 3: pv_t<kDN, 3, D>(pt, ldS, v, n_pairs, ot, d0); break;
          case 2: pv_t<kDN, 2, D>(pt, ldS, v, n_pairs, ot, d0); break;
          default: pv_t<kDN, 1, D>(pt, ldS, v, n_pairs, ot, d0); break;
        }
      }
  }
  // O^T / l, transposed back to rows 16 x 16 at a time, rounded to bfloat16.
  for (int rg = 0; rg < groups; ++rg) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_load_ps(l_all + rg * 16));
    const float* o = OT + rg * D * 16;
    const int n = std::min(16, rows - rg * 16);
    for (int c = 0; c < D / 16; ++c) {
      __m512i x[16];
      for (int i = 0; i < 16; ++i)
        x[i] = _mm512_castps_si512(_mm512_mul_ps(inv, _mm512_load_ps(o + (16 * c + i) * 16)));
      transpose16(x);
      for (int i = 0; i < n; ++i)
        plaserve::store16(orow[rg * 16 + i] + 16 * c, _mm512_castsi512_ps(x[i]));
    }
  }
}

#ifdef PLASERVE_AMX
using plaserve::amx_available;
using plaserve::TileConfig;

std::atomic<bool> g_use_amx{amx_available()};

// Each thread loads the configuration when it starts on a call's items (oneDNN's kernels, which run on
// the same threads, configure the tiles their own way in between) and releases the tiles after.
void load_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// Pass 1 on AMX: the keys of one (sequence, K/V head) as rows, [padded][D], and its values
// transposed, [D][packed_stride] (a row of V^T is an A tile's row: 32 keys of one dimension); zero
// past the last key.
template <int D>
void pack_kv_amx(const Batch& b, const int64_t* index, int64_t k_len, int64_t head, uint16_t* kn,
                 uint16_t* vt) {
  const int64_t padded = padded_keys(k_len), stride = packed_stride(k_len);
  for (int64_t j = 0; j < padded; ++j) {
    if (j < k_len)
      std::memcpy(kn + j * D, b.k + index[j] * b.k_stride + head * D, sizeof(uint16_t) * D);
    else
      std::memset(kn + j * D, 0, sizeof(uint16_t) * D);
  }
  // 32 keys at a time: their rows read once, each dimension's 32 values written as one row piece.
  for (int64_t j0 = 0; j0 < padded; j0 += 32) {
    const uint16_t* rows[32];
    for (int i = 0; i < 32; ++i)
      rows[i] = j0 + i < k_len ? b.v + index[j0 + i] * b.v_stride + head * D : nullptr;
    for (int d = 0; d < D; ++d) {
      uint16_t* dst = vt + d * stride + j0;
      for (int i = 0; i < 32; ++i) dst[i] = rows[i] ? rows[i][d] : 0;
    }
  }
}

// How large a block's sum of P (per row) may grow, P taken against a maximum that scores have since
// passed, before O and l are rescaled to the new maximum: every P stays <= 2^16, far from float's
// overflow, and most blocks after the first rescale nothing. The sum, which the softmax makes anyway,
// tells; the block's maximum, which takes two instructions a key pair, is found only then.
constexpr float kRescaleSum = 65536.0f;

// O^T chunk c (16 dimensions x 16 rows) += V^T chunk c (16 dims x 32 keys, tile 6) x P^T (tile 7). The
// first four chunks stay in tiles 0-3 for the whole key loop; chunks 4-7 (D = 128) go through tile 4 and
// `o_extra` ([c - 4][16][16] float32).
template <int D>
void pv_t(const uint16_t* vt, int64_t stride, int64_t j0, float* o_extra) {
  constexpr int NC = D / 16;
  _tile_loadd(6, vt + 0 * 16 * stride + j0, stride * 2);
  _tile_dpbf16ps(0, 6, 7);
  if constexpr (NC > 1) {
    _tile_loadd(6, vt + 1 * 16 * stride + j0, stride * 2);
    _tile_dpbf16ps(1, 6, 7);
  }
  if constexpr (NC > 2) {
    _tile_loadd(6, vt + 2 * 16 * stride + j0, stride * 2);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(6, vt + 3 * 16 * stride + j0, stride * 2);
    _tile_dpbf16ps(3, 6, 7);
  }
  for (int c = 4; c < NC; ++c) {
    _tile_loadd(4, o_extra + (c - 4) * 256, 64);
    _tile_loadd(6, vt + c * 16 * stride + j0, stride * 2);
    _tile_dpbf16ps(4, 6, 7);
    _tile_stored(4, o_extra + (c - 4) * 256, 64);
  }
}

// Tiles 0-3 (O^T chunks) to and from `o` ([chunk][16][16] float32). Two functions, not one: the tile
// intrinsics take their tile numbers as literals.
template <int NC>
void store_o(float* o) {
  _tile_stored(0, o, 64);
  if constexpr (NC > 1) _tile_stored(1, o + 256, 64);
  if constexpr (NC > 2) {
    _tile_stored(2, o + 512, 64);
    _tile_stored(3, o + 768, 64);
  }
}

template <int NC>
void load_o(const float* o) {
  _tile_loadd(0, o, 64);
  if constexpr (NC > 1) _tile_loadd(1, o + 256, 64);
  if constexpr (NC > 2) {
    _tile_loadd(2, o + 512, 64);
    _tile_loadd(3, o + 768, 64);
  }
}

// Pass 2 on AMX: kBlockQ query tokens (from q0) of sequence `seq`, the query heads of K/V head g, 16
// rows (token x head) at a time. Per 32 keys: S^T = K Q^T in tiles 4 and 5 (A: 16 key rows, tile 6;
// B: Q^T as [D/2 pairs][16 rows][2], tile 7), stored; P^T = 2^(S^T scale log2 e - m), one vector
// per key, the maximum m per row taken lazily (kRescaleSum); P^T interleaved by key pairs into a
// B tile; O^T += V^T P^T (pv_t). Scratch is on the stack: D <= 128.
template <int D>
void attend_amx(const Batch& b, int64_t seq, int64_t g, int64_t q0) {
  static_assert(D % 32 == 0 && D <= 128);
  constexpr int NC = D / 16;
  constexpr int kResident = NC < 4 ? NC : 4;
  const int group = static_cast<int>(b.heads / b.kv_heads);
  const int64_t q_len = b.q_starts[seq + 1] - b.q_starts[seq];
  const int64_t k_len = b.k_starts[seq + 1] - b.k_starts[seq];
  const int64_t offset = k_len - q_len;
  const int nq = static_cast<int>(std::min<int64_t>(kBlockQ, q_len - q0));
  const int rows = nq * group;  // row = token * group + head
  const int64_t stride = packed_stride(k_len);
  const int64_t base = b.packed_at[seq * b.kv_heads + g];
  const uint16_t* kn = b.kp + base;
  const uint16_t* vt = b.vp + base;
  const float scale2 = b.scale * 1.44269504088896341f;  // scores to base-2 exponents
  const __m512 vscale2 = _mm512_set1_ps(scale2);
  alignas(64) uint16_t qt[D * 16];
  alignas(64) float both_st[2 * 32 * 16];  // S^T of two blocks of 32 keys: this one, the next
  alignas(64) uint16_t both_pt[2][16 * 32];  // P^T of two blocks: this one, the one before
  alignas(64) float o[NC * 256];
  alignas(64) int32_t limit[16];
  // lane i of the pair interleave: lane i / 2 of the first key's scores (even i) or the second's
  alignas(64) uint16_t interleave[32];
  for (int i = 0; i < 32; ++i) interleave[i] = static_cast<uint16_t>((i & 1) * 16 + i / 2);
  const __m512i pair_idx = _mm512_load_si512(interleave);
  for (int r0 = 0; r0 < rows; r0 += 16) {
    const int n = std::min(16, rows - r0);
    // Q^T for rows r0 .. r0 + n (zero columns past them) and the last key each row sees.
    std::memset(qt, 0, sizeof qt);
    auto* qt32 = reinterpret_cast<uint32_t*>(qt);
    int64_t k_end = 0;
    for (int r = 0; r < 16; ++r) {
      if (r >= n) {
        limit[r] = std::numeric_limits<int32_t>::max();  // padding: sees everything, q = 0
        continue;
      }
      const int64_t t = q0 + (r0 + r) / group;
      const auto* q32 = reinterpret_cast<const uint32_t*>(
          b.q + (b.q_starts[seq] + t) * b.q_stride + (g * group + (r0 + r) % group) * D);
      for (int dp = 0; dp < D / 2; ++dp) qt32[dp * 16 + r] = q32[dp];
      limit[r] = static_cast<int32_t>(offset + t);
      k_end = std::max<int64_t>(k_end, offset + t + 1);
    }
    const __m512i vlimit = _mm512_load_si512(limit);
    const int32_t min_limit = _mm512_reduce_min_epi32(vlimit);
    for (int c = 0; c < kResident; ++c) std::memset(o + c * 256, 0, 256 * sizeof(float));
    std::memset(o + kResident * 256, 0, (NC - kResident) * 256 * sizeof(float));
    load_o<kResident>(o);
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());  // base-2, per row
    __m512 l = _mm512_setzero_ps();
    // S^T of the 32 keys from j0 into tiles 4 and 5.
    auto scores = [&](int64_t j0) {
      _tile_zero(4);
      _tile_zero(5);
      for (int dk = 0; dk < D / 32; ++dk) {
        _tile_loadd(7, qt + dk * 16 * 32, 64);
        _tile_loadd(6, kn + j0 * D + dk * 32, D * 2);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(6, kn + (j0 + 16) * D + dk * 32, D * 2);
        _tile_dpbf16ps(5, 6, 7);
      }
    };
    // Software-pipelined so that nothing the tile unit does in an iteration waits for the vector
    // units' work in it, or the other way round: the tile unit takes the next block's scores (stored
    // at once) and the previous block's P V while the vector units take this block's softmax, whose
    // scores were stored an iteration ago and whose P waits an iteration before a tile load reads it
    // (a tile load or store does not forward to or from the vector side: it waits for the memory).
    scores(0);
    _tile_stored(4, both_st, 64);
    _tile_stored(5, both_st + 256, 64);
    int64_t j0 = 0;
    int cur = 0;
    for (; j0 < k_end; j0 += 32, cur ^= 1) {
      const bool more = j0 + 32 < k_end;
      if (more) {
        scores(j0 + 32);
        _tile_stored(4, both_st + (cur ^ 1) * 512, 64);
        _tile_stored(5, both_st + (cur ^ 1) * 512 + 256, 64);
      }
      // The previous block's P V, taken against the maximum before this block: if this block raises
      // it, the rescale below scales that block's part with the rest.
      if (j0 > 0) {
        _tile_loadd(7, both_pt[cur ^ 1], 64);
        pv_t<D>(vt, stride, j0 - 32, o + 4 * 256);
      }
      uint16_t* pt = both_pt[cur];
      const float* st = both_st + cur * 512;
      // Key j of this block is visible to row r iff j0 + j <= limit[r]: all of them below the diagonal.
      const bool diagonal = j0 + 31 > min_limit;
      auto visible = [&](int j) -> __mmask16 {
        return diagonal ? _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(j0 + j)),
                                                vlimit, _MM_CMPINT_LE)
                        : static_cast<__mmask16>(0xFFFF);
      };
      // P^T into pt (B tile layout) against the running maximum m; returns the block's sum per row.
      // Below the diagonal every key is visible: no masks.
      auto exponentiate_as = [&]<bool kDiagonal>() {
        __m512 sum = _mm512_setzero_ps();
        for (int jp = 0; jp < 16; ++jp) {
          const __m512 t0 = _mm512_fmsub_ps(_mm512_load_ps(st + 2 * jp * 16), vscale2, m);
          const __m512 t1 = _mm512_fmsub_ps(_mm512_load_ps(st + (2 * jp + 1) * 16), vscale2, m);
          __m512 e0 = exp2_p_flushed(t0), e1 = exp2_p_flushed(t1);
          if constexpr (kDiagonal) {
            e0 = _mm512_maskz_mov_ps(visible(2 * jp), e0);
            e1 = _mm512_maskz_mov_ps(visible(2 * jp + 1), e1);
          }
          sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
          // cvtne2ps packs (second, first): lanes 0-15 are key 2 jp's rows, 16-31 key 2 jp + 1's;
          // the B tile wants them interleaved, row by row
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
          _mm512_store_si512(pt + jp * 32, _mm512_permutexvar_epi16(pair_idx, both));
        }
        return sum;
      };
      auto exponentiate = [&]() {
        return diagonal ? exponentiate_as.template operator()<true>()
                        : exponentiate_as.template operator()<false>();
      };
      // The block's largest score per row over its visible keys.
      auto block_max = [&]() {
        __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int j = 0; j < 32; ++j)
          top = _mm512_mask_max_ps(top, visible(j), top, _mm512_load_ps(st + j * 16));
        return top;
      };
      if (j0 == 0) m = _mm512_mul_ps(block_max(), vscale2);  // every row sees key 0; scale > 0
      __m512 sum = exponentiate();
      // Where scores rose far enough past the maximum to make the sum large (rare after the first
      // blocks): rescale what was summed so far to the block's maximum and take its P again.
      const __mmask16 rose = _mm512_cmp_ps_mask(sum, _mm512_set1_ps(kRescaleSum), _CMP_GT_OQ);
      if (rose) {
        const __m512 rise = _mm512_maskz_sub_ps(rose, _mm512_mul_ps(block_max(), vscale2), m);
        const __m512 alpha = exp2_p_flushed(_mm512_sub_ps(_mm512_setzero_ps(), rise));
        store_o<kResident>(o);
        for (int d = 0; d < D; ++d)
          _mm512_store_ps(o + d * 16, _mm512_mul_ps(alpha, _mm512_load_ps(o + d * 16)));
        load_o<kResident>(o);
        l = _mm512_mul_ps(l, alpha);
        m = _mm512_add_ps(m, rise);
        sum = exponentiate();
      }
      l = _mm512_add_ps(l, sum);
    }
    _tile_loadd(7, both_pt[cur ^ 1], 64);  // the last block's P V
    pv_t<D>(vt, stride, j0 - 32, o + 4 * 256);
    store_o<kResident>(o);
    // O = (O^T)^T / l, row by row: dimension d of row r is o[d / 16][d % 16][r].
    alignas(64) float inv_l[16];
    _mm512_store_ps(inv_l, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                               5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int r = 0; r < n; ++r) {
      const int64_t token = b.q_starts[seq] + q0 + (r0 + r) / group;
      uint16_t* dst = b.out + token * b.out_stride + (g * group + (r0 + r) % group) * D;
      const __m512 inv = _mm512_set1_ps(inv_l[r]);
      for (int c = 0; c < NC; ++c) {
        const __m512 x = _mm512_i32gather_ps(column, o + c * 256 + r, 4);
        plaserve::store16(dst + 16 * c, _mm512_mul_ps(inv, x));
      }
    }
  }
}

// A decode row's attention (one query token of sequence `seq`, the query heads of K/V head g), its
// keys and values read where they are, with no packing pass: a decode row reads each key once, so
// packing them would cost as much as attending to them. S^T = K Q^T on tiles, 16 keys a tile straight
// from the cache (a run of 16 consecutive slots is one cache block; other runs are copied first), Q^T
// the B tile ([D/2 pairs][16 columns][2], column r = query head r of the group); then the softmax down
// the keys (every row's scores are a column: no horizontal reductions), and O += p V in float32 FMAs
// with the accumulators in registers.
struct DirectScratch {
  std::vector<float> st;           // S^T, then P^T: [keys][16]
  std::vector<uint16_t> qt, rows;  // Q^T; a copied run of 16 keys
};

template <int D, int R>
void pv_direct(const Batch& b, const int64_t* index, int64_t k_len, int64_t g, const float* pt,
               int r0, const float* inv_l, uint16_t* out) {
  constexpr int NV = D / 16;
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k_len; ++j) {
    const uint16_t* row = b.v + index[j] * b.v_stride + g * D;
    if (j + 16 < k_len) {  // the row 16 keys on: the next cache block once this one is read
      const char* ahead = reinterpret_cast<const char*>(b.v + index[j + 16] * b.v_stride + g * D);
      for (int line = 0; line < D * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c)
      vv[c] = plaserve::widen16(row + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(pt[j * 16 + r0 + r]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(p, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(inv_l[r0 + r]);
    uint16_t* dst = out + (r0 + r) * D;
    for (int c = 0; c < NV; ++c)
      plaserve::store16(dst + 16 * c, _mm512_mul_ps(inv, acc[r][c]));
  }
}

template <int D>
void attend_direct(const Batch& b, int64_t seq, int64_t g, DirectScratch& w) {
  static_assert(D % 32 == 0);
  const int group = static_cast<int>(b.heads / b.kv_heads);
  const int64_t token = b.q_starts[seq];
  const int64_t k_len = b.k_starts[seq + 1] - b.k_starts[seq];
  const int64_t* index = b.index + b.k_starts[seq];
  w.qt.assign(D * 16, 0);
  auto* qt32 = reinterpret_cast<uint32_t*>(w.qt.data());
  for (int r = 0; r < group; ++r) {
    const auto* q32 =
        reinterpret_cast<const uint32_t*>(b.q + token * b.q_stride + (g * group + r) * D);
    for (int dp = 0; dp < D / 2; ++dp) qt32[dp * 16 + r] = q32[dp];
  }
  w.st.resize(static_cast<size_t>((k_len + 15) / 16 * 16) * 16);
  w.rows.resize(16 * D);
  for (int64_t j0 = 0; j0 < k_len; j0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, k_len - j0));
    bool run = n == 16;
    for (int i = 1; run && i < 16; ++i) run = index[j0 + i] == index[j0] + i;
    const uint16_t* src = w.rows.data();
    int64_t stride = D * 2;  // bytes
    if (run) {
      src = b.k + index[j0] * b.k_stride + g * D;
      stride = b.k_stride * 2;
    } else {
      for (int i = 0; i < 16; ++i) {
        uint16_t* dst = w.rows.data() + i * D;
        if (i < n)
          std::memcpy(dst, b.k + index[j0 + i] * b.k_stride + g * D, sizeof(uint16_t) * D);
        else
          std::memset(dst, 0, sizeof(uint16_t) * D);
      }
    }
    _tile_zero(0);
    for (int dk = 0; dk < D / 32; ++dk) {
      _tile_loadd(1, src + dk * 32, stride);
      _tile_loadd(2, w.qt.data() + dk * 16 * 32, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, w.st.data() + j0 * 16, 64);
  }
  // Softmax down the keys: lane r of every key's vector is query head r's score.
  float* st = w.st.data();
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < k_len; ++j) m = _mm512_max_ps(m, _mm512_loadu_ps(st + j * 16));
  // Base-2 exponents (exp2_p_flushed): the output is rounded to bfloat16, so P's 7.5e-5 is plenty.
  const __m512 vs = _mm512_set1_ps(b.scale * 1.44269504088896341f), ms = _mm512_mul_ps(m, vs);
  __m512 l = _mm512_setzero_ps();
  for (int64_t j = 0; j < k_len; ++j) {
    const __m512 e = exp2_p_flushed(_mm512_fmsub_ps(_mm512_loadu_ps(st + j * 16), vs, ms));
    _mm512_storeu_ps(st + j * 16, e);
    l = _mm512_add_ps(l, e);
  }
  alignas(64) float inv_l[16];
  _mm512_store_ps(inv_l, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
  uint16_t* out = b.out + token * b.out_stride + g * group * D;
  // Up to 6 rows a pass over V (6 x D/16 accumulators in registers for D <= 64; 3 for D = 128).
  constexpr int kRows = D <= 64 ? 6 : 3;
  for (int r0 = 0; r0 < group; r0 += kRows) {
    switch (std::min(group - r0, kRows)) {
      case 6: pv_direct<D, 6>(b, index, k_len, g, st, r0, inv_l, out); break;
      case 5: pv_direct<D, 5>(b, index, k_len, g, st, r0, inv_l, out); break;
      case 4: pv_direct<D, 4>(b, index, k_len, g, st, r0, inv_l, out); break;
      case 3: pv_direct<D, 3>(b, index, k_len, g, st, r0, inv_l, out); break;
      case 2: pv_direct<D, 2>(b, index, k_len, g, st, r0, inv_l, out); break;
      default: pv_direct<D, 1>(b, index, k_len, g, st, r0, inv_l, out); break;
    }
  }
}
#endif  // PLASERVE_AMX

bool amx_in_use() {
#ifdef PLASERVE_AMX
  return g_use_amx.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// AMX for this head size on this call: tiles take 32 dimensions a row.
template <int D>
bool amx_for(bool amx) {
  return amx && D % 32 == 0;
}

template <int D>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
         const at::Tensor& q_starts, const at::Tensor& k_index, const at::Tensor& k_starts,
         double scale) {
  const int64_t seqs = q_starts.size(0) - 1;
  Batch b;
  b.q = reinterpret_cast<const uint16_t*>(q.data_ptr());
  b.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  b.q_stride = q.stride(0);
  b.out_stride = out.stride(0);
  b.heads = q.size(1);
  b.kv_heads = k.size(1);
  b.q_starts = q_starts.data_ptr<int64_t>();
  b.k_starts = k_starts.data_ptr<int64_t>();
  b.scale = static_cast<float>(scale);
  b.k = reinterpret_cast<const uint16_t*>(k.data_ptr());
  b.v = reinterpret_cast<const uint16_t*>(v.data_ptr());
  b.k_stride = k.stride(0);
  b.v_stride = v.stride(0);
  b.index = k_index.data_ptr<int64_t>();
  const bool amx = amx_for<D>(amx_in_use());
  // Decode rows (one query token) are attended in place on AMX (attend_direct).
  auto direct = [&](int64_t s) {
    return amx && b.q_starts[s + 1] - b.q_starts[s] == 1 &&
           b.heads / b.kv_heads <= kMaxDirectGroup;
  };
  // Without AMX, a sequence whose queries are one work item (decode rows, prompts of up to kBlockQ
  // tokens) has each K/V head's keys packed by that item, just before it reads them, while they are in
  // its core's cache: packed ahead, a decode batch's packed keys went out to memory and back (60 rows of
  // 350 keys, 8/2 heads: 1.0 ms a call against ~0.3 packed in the item).
  auto packs_in_item = [&](int64_t s) { return !amx && b.q_starts[s + 1] - b.q_starts[s] <= kBlockQ; };
  // Without AMX, sequences of 16 query rows or more (every one packed ahead) take the transposed form,
  // which reads the keys where they are: only their values are packed.
  auto transposed = [&](int64_t s) {
    return !amx && (b.q_starts[s + 1] - b.q_starts[s]) * (b.heads / b.kv_heads) >= 16;
  };
  b.packed_at.assign(seqs * b.kv_heads, -1);
  std::vector<int64_t> to_pack;  // (sequence, K/V head) pairs packed ahead, in pass 1
  int64_t total = 0;
  for (int64_t s = 0; s < seqs; ++s)
    for (int64_t g = 0; g < b.kv_heads && !direct(s) && !packs_in_item(s); ++g) {
      b.packed_at[s * b.kv_heads + g] = total;
      to_pack.push_back(s * b.kv_heads + g);
      total += packed_stride(b.k_starts[s + 1] - b.k_starts[s]) * D;
    }
  // Uninitialised (not a vector's zero fill: packing writes every element the products read). Kept
  // by the calling thread from call to call, up to kKeptPacked elements; a larger batch (chunks after
  // very long prefixes) gets a buffer of its own.
  constexpr size_t kKeptPacked = size_t{64} << 20;  // 128 MiB of bfloat16
  thread_local KeptBuffer<> kept;
  Packed once;
  const auto need = static_cast<size_t>((amx ? 2 : 1) * total);
  uint16_t* packed;
  if (need <= kKeptPacked) {
    packed = kept.room(need);
  } else {
    once = aligned_buffer(need);
    packed = once.get();
  }
  b.kp = amx ? packed : nullptr;
  b.vp = amx ? packed + total : packed;
  at::parallel_for(0, static_cast<int64_t>(to_pack.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t i = to_pack[p], s = i / b.kv_heads, g = i % b.kv_heads;
      const int64_t* index = b.index + b.k_starts[s];
      const int64_t k_len = b.k_starts[s + 1] - b.k_starts[s];
      auto* vp = const_cast<uint16_t*>(b.vp) + b.packed_at[i];
#ifdef PLASERVE_AMX
      if constexpr (D % 32 == 0)
        if (amx) {
          pack_kv_amx<D>(b, index, k_len, g, const_cast<uint16_t*>(b.kp) + b.packed_at[i], vp);
          continue;
        }
#endif
      pack_v<D>(b.v, b.v_stride, index, k_len, g, vp);  // transposed: the keys stay where they are
    }
  });
  // Work items (sequence, K/V head, first query token), largest first (cost ~ keys seen). Without
  // AMX, where there are decode rows (fewer than 16 query rows a token) enough to keep every thread
  // busy, each makes one item of all its K/V heads (head -1): a cache slot holds the K (or V) of every
  // head side by side, and one thread reading them head after head ran ~12 % faster than two threads
  // reading one head each (64 decode rows of ~300 keys in 8 layers' caches, from memory).
  struct Item {
    int64_t seq, head, q0, cost;
  };
  int64_t few_rows = 0;
  for (int64_t s = 0; s < seqs; ++s) few_rows += packs_in_item(s) && !transposed(s);
  const bool merge_heads = few_rows >= 2 * at::get_num_threads();
  std::vector<Item> items;
  int64_t work = 0;  // query rows x keys seen, over all items
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t q_len = b.q_starts[s + 1] - b.q_starts[s];
    const int64_t offset = (b.k_starts[s + 1] - b.k_starts[s]) - q_len;
    for (int64_t q0 = 0; q0 < q_len; q0 += kBlockQ) {
      const int64_t cost =
          std::min<int64_t>(kBlockQ, q_len - q0) * (offset + std::min<int64_t>(q0 + kBlockQ, q_len));
      if (merge_heads && packs_in_item(s) && !transposed(s))  // one item for all K/V heads
        items.push_back({s, -1, q0, cost * b.kv_heads});
      else
        for (int64_t g = 0; g < b.kv_heads; ++g) items.push_back({s, g, q0, cost});
      work += cost * b.heads;  // every query head of every K/V head
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t workers = work < kParallelMinWork ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    // No subnormal costs an assist here (P below 2^-126, O and l rescaled by a tiny alpha, products
    // with them), so the exponentials need no hold at -125 either (one instruction of ~23 a key pair):
    // with queries x300, 2,048 tokens on one thread took 29.6 ms against 7.5 at unit scale, 8.6 now.
    const FlushDenormals flushed;
    // Kept by each thread from call to call: a fresh buffer for a long context's keys (a megabyte at
    // 4,096 keys) page-faulted in at every layer (one decode row: 0.69 ms a call against 0.07).
    thread_local Scratch w;
#ifdef PLASERVE_AMX
    DirectScratch dw;
    if (amx) load_tiles();
#endif
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i; (i = next.fetch_add(1)) < n;) {
#ifdef PLASERVE_AMX
        if constexpr (D % 32 == 0)
          if (amx) {
            if (direct(items[i].seq))
              attend_direct<D>(b, items[i].seq, items[i].head, dw);
            else
              attend_amx<D>(b, items[i].seq, items[i].head, items[i].q0);
            continue;
          }
#endif
        const Item& it = items[i];
        const int64_t at = it.head < 0 ? -1 : b.packed_at[it.seq * b.kv_heads + it.head];
        if (at >= 0) {
          attend_t<D>(b, it.seq, it.head, it.q0, b.vp + at, w);
          continue;
        }
        const int64_t k_len = b.k_starts[it.seq + 1] - b.k_starts[it.seq];
        const int64_t* index = b.index + b.k_starts[it.seq];
        const int64_t size = packed_stride(k_len) * D;
        uint16_t* own = w.own.room(static_cast<size_t>(2 * size));
        if (transposed(it.seq)) {  // only the values packed
          pack_v<D>(b.v, b.v_stride, index, k_len, it.head, own + size);
          attend_t<D>(b, it.seq, it.head, it.q0, own + size, w);
          continue;
        }
        // one K/V head, or all of them (head -1, see `Item`)
        const int64_t first = it.head < 0 ? 0 : it.head;
        const int64_t last = it.head < 0 ? b.kv_heads : it.head + 1;
        for (int64_t g = first; g < last; ++g) {
          pack_k<D>(b.k, b.k_stride, index, k_len, g, own);
          pack_v<D>(b.v, b.v_stride, index, k_len, g, own + size);
          attend<D>(b, it.seq, g, it.q0, own, own + size, w);
        }
      }
#ifdef PLASERVE_AMX
    if (amx) _tile_release();
#endif
  });
}

void varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      at::Tensor out, const at::Tensor& q_starts, const at::Tensor& k_index,
                      const at::Tensor& k_starts, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "varlen_attention: bfloat16 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(),
              "varlen_attention: q/out [T, H, D], k/v [N, Hk, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 &&
                  k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2) &&
                  out.stride(2) == 1 && out.stride(1) == out.size(2),
              "varlen_attention: each token's heads must be contiguous");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "varlen_attention: heads not a multiple of K/V heads");
  TORCH_CHECK(q_starts.scalar_type() == at::kLong && k_starts.scalar_type() == at::kLong &&
                  k_index.scalar_type() == at::kLong && q_starts.is_contiguous() &&
                  k_starts.is_contiguous() && k_index.is_contiguous() &&
                  q_starts.size(0) == k_starts.size(0),
              "varlen_attention: int64 q_starts/k_starts of one length, int64 k_index");
  switch (q.size(2)) {
    case 16: run<16>(q, k, v, out, q_starts, k_index, k_starts, scale); break;
    case 32: run<32>(q, k, v, out, q_starts, k_index, k_starts, scale); break;
    case 64: run<64>(q, k, v, out, q_starts, k_index, k_starts, scale); break;
    case 128: run<128>(q, k, v, out, q_starts, k_index, k_starts, scale); break;
    default: TORCH_CHECK(false, "varlen_attention: head_dim 16, 32, 64 or 128, not ", q.size(2));
  }
}

}  // namespace

// Whether the products run on AMX tiles: `use` true asks for them (granted where the CPU, the OS and
// the build allow), false turns them off (the AVX512-BF16 dot products then); returns the state after.
bool use_amx(bool use) {
#ifdef PLASERVE_AMX
  g_use_amx.store(use && amx_available());
#endif
  return amx_in_use();
}

TORCH_LIBRARY(plaserve_cpu, m) {
  m.def(
      "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor q_starts, "
      "Tensor k_index, Tensor k_starts, float scale) -> ()");
  m.def("use_amx(bool use) -> bool", &use_amx);
  m.def("amx_in_use() -> bool", &amx_in_use);
}

TORCH_LIBRARY_IMPL(plaserve_cpu, CPU, m) { m.impl("varlen_attention", &varlen_attention); }
