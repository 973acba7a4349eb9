// Paged attention whose every output row is computed the same way, whatever else is in the batch.
//
// One work item is one query token: scores, softmax and the weighted sum of V for each of its
// heads, in loops whose shape depends on the token's position and nothing else. No reduction is
// split or blocked by batch size, query count or context length, so a token's output bits depend
// only on its own query and its sequence's cached K/V -- not on its companions, its place in the
// batch, or how its prompt was chunked. Threads split the work items, never a reduction.
//
// The arithmetic, fixed once (every path below computes exactly this):
//   score[h][j] = tree(lane) * scale, lane[l] = fma chain over d = l, l + 16, l + 32, ... of
//                 q[h][d] * k[j][d], tree = lanes_sum's fixed pairing of the 16 lanes;
//   softmax     = max, Cephes exp (explicit FMAs), a 16-lane sum, one multiply by 1 / total;
//   out[h][d]   = fma chain over keys j = 0..position of weight[h][j] * v[j][d].
// Three implementations (engine/csrc/simd.h): a portable one (the reference, and the fallback
// for head sizes the others do not cover), an AVX-512 one that handles 16 keys at a time (16 dot
// products' lane vectors are summed by one transposing tree whose additions are lanes_sum's,
// instead of 16 horizontal sums, and V is accumulated in registers) and an AVX2 one that does
// the same 8 keys at a time, each 16-lane vector held in two registers. Tests compare them bit
// for bit. Built with -ffp-contract=off so the compiler fuses nothing we did not write.
#include "simd.h"

#include <ATen/Parallel.h>

#include <vector>

namespace {

using namespace inherent;

// Scores of one head over keys 0..n-1, in place: softmax.
inline void softmax(float* s, int64_t n) {
  float top = s[0];  // a maximum is exact in any order: lanes only make it vectorize
  float peak[kLanes];
  std::fill(peak, peak + kLanes, top);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) peak[l] = peak[l] < s[j + l] ? s[j + l] : peak[l];
  for (; j < n; ++j) top = std::max(top, s[j]);
  for (int l = 0; l < kLanes; ++l) top = std::max(top, peak[l]);
  for (j = 0; j < n; ++j) s[j] = exp_nonpositive(s[j] - top);
  float lane[kLanes] = {};
  for (j = 0; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += s[j + l];
  for (int l = 0; j < n && l < kLanes; ++j, ++l) lane[l] += s[j];
  const float inv = 1.f / lanes_sum(lane);
  for (j = 0; j < n; ++j) s[j] *= inv;
}

// What one query token needs, shared by both implementations.
template <typename T>
struct Token {
  const float* q;  // [heads][D]
  float* out;  // [heads][D]
  const T* const* keys;  // [padded] slot of each key (its K; V is at + v_offset); the padding
                         // repeats the last slot, whose lanes are computed and never used
  int64_t n, padded, heads, group, D, v_offset;
  float scale;
  float* scores;  // [heads][padded]
};

// ---- Portable implementation ---------------------------------------------------------------

template <int64_t kD, typename T>
inline float dot(const float* a, const T* b, int64_t dim) {
  const int64_t D = kD ? kD : dim;  // kD: the head size when known at compile time (unrolled)
  float lane[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] = std::fma(a[d + l], to_float(b[d + l]), lane[l]);
  for (int l = 0; d < D; ++d, ++l) lane[l] = std::fma(a[d], to_float(b[d]), lane[l]);
  return lanes_sum(lane);
}

template <int64_t kD, typename T>
void attend_portable(const Token<T>& t, std::vector<float>& acc) {
  const int64_t D = kD ? kD : t.D;
  for (int64_t j = 0; j < t.n; ++j)
    for (int64_t h = 0; h < t.heads; ++h)
      t.scores[h * t.padded + j] = dot<kD>(t.q + h * D, t.keys[j] + h / t.group * D, D) * t.scale;
  for (int64_t h = 0; h < t.heads; ++h) softmax(t.scores + h * t.padded, t.n);
  acc.assign(t.heads * D, 0.f);
  for (int64_t j = 0; j < t.n; ++j)
    for (int64_t h = 0; h < t.heads; ++h) {
      const float w = t.scores[h * t.padded + j];
      const T* v = t.keys[j] + t.v_offset + h / t.group * D;
      float* a = acc.data() + h * D;
      for (int64_t d = 0; d < D; ++d) a[d] = std::fma(w, to_float(v[d]), a[d]);
    }
  std::copy(acc.begin(), acc.end(), t.out);
}

// Pulls a whole slot (K and V of every KV head) into L2, a tile of keys ahead: scattered
// blocks defeat the hardware prefetcher, and the V half is read again by the weighted sum.
// Measured, 64 decodes over a bf16 cache of 20 MB per layer on 2 cores: no prefetch 2.07 ms,
// into L1 2.20 ms (the prefetches stall on L1's few miss buffers), into L2 1.61 ms.
#if defined(INHERENT_AVX2) || defined(INHERENT_AVX512)
template <typename T>
inline void prefetch_slot(const T* slot, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(slot);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}
#endif

// ---- AVX-512 implementation (head sizes 64 and 128) -----------------------------------------

#if defined(INHERENT_AVX512)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Weighted sums of V for `kHeads` query heads (first..first + kHeads - 1) of one KV head,
// accumulated in registers over every key.
template <int kChunks, int kHeads, typename T>
void values(const Token<T>& t, int64_t first, int64_t v_offset) {
  __m512 acc[kHeads][kChunks];
  for (int h = 0; h < kHeads; ++h)
    for (int c = 0; c < kChunks; ++c) acc[h][c] = _mm512_setzero_ps();
  const float* w = t.scores + first * t.padded;
  for (int64_t j = 0; j < t.n; ++j) {
    const T* v = t.keys[j] + v_offset;
    __m512 vj[kChunks];
    for (int c = 0; c < kChunks; ++c) vj[c] = load16(v + 16 * c);
    for (int h = 0; h < kHeads; ++h) {
      const __m512 wj = _mm512_set1_ps(w[h * t.padded + j]);
      for (int c = 0; c < kChunks; ++c) acc[h][c] = _mm512_fmadd_ps(wj, vj[c], acc[h][c]);
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int c = 0; c < kChunks; ++c)
      _mm512_storeu_ps(t.out + (first + h) * t.D + 16 * c, acc[h][c]);
}


template <int kChunks, typename T>
void attend_avx512(const Token<T>& t, std::vector<float>& tile) {
  constexpr int D = 16 * kChunks;
  const int64_t kv_heads = t.heads / t.group, slot_bytes = 2 * t.v_offset * sizeof(T);
  tile.resize(kLanes * kv_heads * D);
  const __m512 scale = _mm512_set1_ps(t.scale);
  for (int j = 0; j < kLanes; ++j) prefetch_slot(t.keys[j], slot_bytes);
  for (int64_t first = 0; first < t.n; first += kLanes) {
    if (first + kLanes < t.padded)
      for (int j = 0; j < kLanes; ++j) prefetch_slot(t.keys[first + kLanes + j], slot_bytes);
    // these 16 keys of every KV head as float ([head][key][D]), read once for all query heads
    for (int j = 0; j < kLanes; ++j)
      for (int64_t g = 0; g < kv_heads; ++g)
        for (int c = 0; c < kChunks; ++c)
          _mm512_storeu_ps(tile.data() + (g * kLanes + j) * D + 16 * c,
                           load16(t.keys[first + j] + g * D + 16 * c));
    for (int64_t h = 0; h < t.heads; ++h) {
      const float* k = tile.data() + h / t.group * kLanes * D;
      __m512 qh[kChunks], lanes[kLanes];
      for (int c = 0; c < kChunks; ++c) qh[c] = _mm512_loadu_ps(t.q + h * D + 16 * c);
      for (int j = 0; j < kLanes; ++j) {
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < kChunks; ++c)
          a = _mm512_fmadd_ps(qh[c], _mm512_loadu_ps(k + j * D + 16 * c), a);
        lanes[j] = a;
      }
      _mm512_storeu_ps(t.scores + h * t.padded + first, _mm512_mul_ps(Avx512::sum(lanes), scale));
    }
  }
  for (int64_t h = 0; h < t.heads; ++h) softmax(t.scores + h * t.padded, t.n);
  // Query heads sharing a KV head in register-sized groups (16 accumulators at most).
  constexpr int kMaxHeads = 16 / kChunks;
  for (int64_t g = 0; g < kv_heads; ++g)
    for (int64_t h = g * t.group; h < (g + 1) * t.group; h += kMaxHeads) {
      const int64_t count = std::min<int64_t>(kMaxHeads, (g + 1) * t.group - h);
      const int64_t v_offset = t.v_offset + g * D;
      switch (count) {
        case 1: values<kChunks, 1>(t, h, v_offset); break;
        case 2: values<kChunks, 2>(t, h, v_offset); break;
        case 3: values<kChunks, 3>(t, h, v_offset); break;
        default: values<kChunks, 4>(t, h, v_offset); break;
      }
    }
}
#endif

// ---- AVX2 implementation (head sizes 64 and 128) --------------------------------------------

#if defined(INHERENT_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return Avx2::load(p); }

// Weighted sums of V for `kHeads` query heads (first..) over dimensions d0..d0 + 8 kChunks - 1.
template <int kChunks, int kHeads, typename T>
void values_avx2(const Token<T>& t, int64_t first, int64_t v_offset, int64_t d0) {
  __m256 acc[kHeads][kChunks];
  for (int h = 0; h < kHeads; ++h)
    for (int c = 0; c < kChunks; ++c) acc[h][c] = _mm256_setzero_ps();
  const float* w = t.scores + first * t.padded;
  for (int64_t j = 0; j < t.n; ++j) {
    const T* v = t.keys[j] + v_offset + d0;
    __m256 vj[kChunks];
    for (int c = 0; c < kChunks; ++c) vj[c] = load8(v + 8 * c);
    for (int h = 0; h < kHeads; ++h) {
      const __m256 wj = _mm256_set1_ps(w[h * t.padded + j]);
      for (int c = 0; c < kChunks; ++c) acc[h][c] = _mm256_fmadd_ps(wj, vj[c], acc[h][c]);
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int c = 0; c < kChunks; ++c)
      _mm256_storeu_ps(t.out + (first + h) * t.D + d0 + 8 * c, acc[h][c]);
}

template <int kChunks, typename T>  // kChunks: 16-float chunks of a head
void attend_avx2(const Token<T>& t, std::vector<float>& tile) {
  constexpr int D = 16 * kChunks, kKeys = 8;
  const int64_t kv_heads = t.heads / t.group, slot_bytes = 2 * t.v_offset * sizeof(T);
  tile.resize(kKeys * kv_heads * D);
  const __m256 scale = _mm256_set1_ps(t.scale);
  for (int j = 0; j < kLanes; ++j) prefetch_slot(t.keys[j], slot_bytes);
  for (int64_t first = 0; first < t.n; first += kKeys) {
    if (first % kLanes == 0 && first + kLanes < t.padded)
      for (int j = 0; j < kLanes; ++j) prefetch_slot(t.keys[first + kLanes + j], slot_bytes);
    for (int j = 0; j < kKeys; ++j)  // these 8 keys of every KV head as float: [head][key][D]
      for (int64_t g = 0; g < kv_heads; ++g)
        for (int c = 0; c < 2 * kChunks; ++c)
          _mm256_storeu_ps(tile.data() + (g * kKeys + j) * D + 8 * c,
                           load8(t.keys[first + j] + g * D + 8 * c));
    for (int64_t h = 0; h < t.heads; ++h) {
      const float* k = tile.data() + h / t.group * kKeys * D;
      const float* q = t.q + h * D;
      __m256 halves[kKeys];
      for (int j = 0; j < kKeys; ++j) {
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0-7, 8-15
        for (int c = 0; c < kChunks; ++c) {
          lo = _mm256_fmadd_ps(load8(q + 16 * c), load8(k + j * D + 16 * c), lo);
          hi = _mm256_fmadd_ps(load8(q + 16 * c + 8), load8(k + j * D + 16 * c + 8), hi);
        }
        halves[j] = _mm256_add_ps(lo, hi);
      }
      _mm256_storeu_ps(t.scores + h * t.padded + first, _mm256_mul_ps(Avx2::sum(halves), scale));
    }
  }
  for (int64_t h = 0; h < t.heads; ++h) softmax(t.scores + h * t.padded, t.n);
  // 32 dimensions of up to 2 query heads per pass: 8 accumulators, 4 V registers
  for (int64_t g = 0; g < kv_heads; ++g)
    for (int64_t h = g * t.group; h < (g + 1) * t.group; h += 2)
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        const int64_t v_offset = t.v_offset + g * D;
        if ((g + 1) * t.group - h >= 2)
          values_avx2<4, 2>(t, h, v_offset, d0);
        else
          values_avx2<4, 1>(t, h, v_offset, d0);
      }
}
#endif

struct Layout {
  const void* kv;  // float or bfloat16 elements
  int64_t block_size, slot_stride, v_offset, kv_heads, max_blocks;
  const int32_t* tables;
};

template <typename T>
void attend(const Layout& L, const float* q, float* out, const int32_t* table, int64_t position,
            int64_t heads, int64_t D, float scale, Path path, std::vector<const T*>& keys,
            std::vector<float>& scores, std::vector<float>& scratch) {
  const int64_t n = position + 1, padded = (n + kLanes - 1) / kLanes * kLanes;
  keys.resize(padded);
  for (int64_t j = 0, b = 0; j < n; ++b) {  // a division per key would cost more than its use
    const T* slot = static_cast<const T*>(L.kv) + (int64_t)table[b] * L.block_size * L.slot_stride;
    for (int64_t o = 0; o < L.block_size && j < n; ++o, ++j) keys[j] = slot + o * L.slot_stride;
  }
  std::fill(keys.begin() + n, keys.end(), keys[n - 1]);
  scores.resize(heads * padded);
  const Token<T> t{q, out, keys.data(), n, padded, heads, heads / L.kv_heads, D, L.v_offset,
                   scale, scores.data()};
#if defined(INHERENT_AVX512)
  if (path == Path::kAvx512 && D == 64) return attend_avx512<4>(t, scratch);
  if (path == Path::kAvx512 && D == 128) return attend_avx512<8>(t, scratch);
#endif
#if defined(INHERENT_AVX2)
  if (path == Path::kAvx2 && D == 64) return attend_avx2<4>(t, scratch);
  if (path == Path::kAvx2 && D == 128) return attend_avx2<8>(t, scratch);
#endif
  if (D == 64) return attend_portable<64>(t, scratch);
  if (D == 128) return attend_portable<128>(t, scratch);
  attend_portable<0>(t, scratch);
}

}  // namespace

// q: [T, num_heads * head_dim] float32, rows may be strided; cache: [blocks, block_size, 2,
// kv_heads, head_dim] float32 or bfloat16, contiguous; block_tables: [B, max_blocks] int32;
// token_seq: [T] int32, each query row's sequence; positions: [T] int64, each row attends keys
// 0..position. `path_name`: "auto" or the implementation to force (simd.h; tests compare them).
// Returns [T, num_heads * head_dim].
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                              torch::Tensor token_seq, torch::Tensor positions, double scale,
                              const std::string& path_name) {
  const Path path = resolve_path(path_name);
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "q must be float32");
  const bool bf16 = cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || cache.scalar_type() == torch::kFloat32, "the cache must be float32 or bfloat16");
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1, "q must be [T, heads * head_dim], rows contiguous");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous(), "cache must be a contiguous 5-D tensor");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous());
  TORCH_CHECK(token_seq.scalar_type() == torch::kInt32 && token_seq.is_contiguous());
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous());
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "fixed-order attention runs on CPU");
  const int64_t num_tokens = q.size(0), head_dim = cache.size(4);
  Layout L{cache.data_ptr(), cache.size(1), 2 * cache.size(3) * head_dim,
           cache.size(3) * head_dim, cache.size(3), block_tables.size(1),
           block_tables.data_ptr<int32_t>()};
  const int64_t heads = q.size(1) / head_dim;
  TORCH_CHECK(heads * head_dim == q.size(1) && heads % L.kv_heads == 0, "bad head layout");

  auto out = torch::empty({num_tokens, heads * head_dim}, q.options());
  const float* q_data = q.data_ptr<float>();
  const int64_t q_stride = q.stride(0);
  const int32_t* seq_of = token_seq.data_ptr<int32_t>();
  const int64_t* pos_of = positions.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // Threads take contiguous runs of tokens holding equal shares of the keys to read (a token's
  // work grows with its position): an even split by token count can leave one thread the long
  // contexts. Which thread computes a token never changes its bits.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tokens));
  std::vector<int64_t> bounds(parts + 1, num_tokens);
  bounds[0] = 0;
  int64_t total = 0, done = 0;
  for (int64_t t = 0; t < num_tokens; ++t) total += pos_of[t] + 1;
  for (int64_t t = 0, part = 1; t < num_tokens && part < parts; ++t) {
    done += pos_of[t] + 1;
    if (done * parts >= total * part) bounds[part++] = t + 1;
  }
  at::parallel_for(0, parts, 1, [&](int64_t first_part, int64_t end_part) {
    std::vector<const float*> keys32;
    std::vector<const uint16_t*> keys16;
    std::vector<float> scores, scratch;
    for (int64_t t = bounds[first_part]; t < bounds[end_part]; ++t) {
      const float* qt = q_data + t * q_stride;
      float* o = out_data + t * heads * head_dim;
      const int32_t* table = L.tables + seq_of[t] * L.max_blocks;
      if (bf16)
        attend(L, qt, o, table, pos_of[t], heads, head_dim, fscale, path, keys16, scores, scratch);
      else
        attend(L, qt, o, table, pos_of[t], heads, head_dim, fscale, path, keys32, scores, scratch);
    }
  });
  return out;
}


