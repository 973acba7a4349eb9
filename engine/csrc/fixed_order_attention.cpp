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
// Two implementations (engine/csrc/simd.h): a portable one (the reference, and the fallback for
// head sizes the other does not cover) and a vectorized one, written once over the vector type
// and built for AVX-512 (16 keys at a time) and AVX2 (8 keys, each 16-lane vector held in two
// registers): a tile's dot products' lane vectors are summed by one transposing tree whose
// additions are lanes_sum's, instead of a horizontal sum each, and V is accumulated in
// registers. Tests compare the paths bit for bit. Built with -ffp-contract=off so the compiler
// fuses nothing we did not write.
//
// A prefill chunk's tokens read the same keys: the vectorized path takes up to kRunTokens of
// them at consecutive positions as one run, converts each tile of keys once for the run, scores
// two tokens with each key register it loads (AVX-512) and adds V in blocks every token of the
// run takes while they are in L1. Only the loops around a token's operations change, never
// their order. The bundled model's heads, float32 cache, 2 threads, median of 60 calls (several
// alternations) before and with runs:
//   - AVX2 on 2 Zen 3 cores (AMD EPYC family 25 model 1): 176 tokens of one prompt at 200-375,
//     2.7-3.0 ms before, 1.6-1.9 ms with runs; a serving step's 16 decodes at 450 beside 40
//     prompt tokens, 1.5-1.6 ms before, 0.65-1.2 ms (with the thread split below); 16 decodes
//     alone the same (0.45-0.57 ms either way);
//   - AVX-512 on 2 Ice Lake cores (Intel Xeon family 6 model 106, no bf16), five alternations'
//     medians: 176 tokens 3.2 ms before, 2.2 ms; 512 tokens at 0-511 8.6 ms, 5.2 ms; 16 decodes
//     beside 40 prompt tokens 1.8 ms, 1.5 ms; 16 decodes alone 0.61 ms, 0.62 ms.
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <numeric>
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

// The slots of the work item a thread computes next, asked for into L2 while its current one
// sums V: that pass reads V from L2 (the scores' pass asked for it), and the memory would sit
// idle, where one core's outstanding misses, not the memory, bound how fast a lone token's
// scattered blocks arrive (one thread streamed 8.9 GB/s of them, two 15.6, where a sequential
// read ran at 35). One slot every `every` keys summed (upcoming_every). 16 decodes at 450-513
// over 30 layers' bf16 caches on shuffled blocks, 2 Zen 4 cores (AMD EPYC family 25 model 17),
// medians of 40 alternated in one process: 9.3-10.7 ms against 11.0-11.5 on 4 KB pages, 8.8-9.3
// against 10.5-10.8 on 2 MB pages; 64 decodes 41.9 against 46.9 ms; the AVX2 path there
// 10.8-11.2 against 11.6-12.4, 64 decodes 46.5 against 48.3; unchanged: 16 decodes beside a
// 176-token prompt chunk (compute-bound), one or two decodes (nothing to take ahead). Which
// keys are asked for never changes a bit of the result.
template <typename T>
struct Upcoming {
  std::vector<const T*> slots;  // of its keys 0..n-1, for the KV heads it computes
  int64_t next = 0, bytes = 0, v_offset = 0;
  int64_t item = -1;  // whose slots they are (-1: none); computing it takes them as its keys
  int64_t every_mask = 0;  // a slot is asked for at keys j with (j & every_mask) == 0
};

// Keys summed per slot asked for, a power of two. AMD's cores take many: on Zen 4 one a key
// (12 lines a few cycles apart) or one every 8 gained less than one every 4 (2 about the
// same); AVX2 sums V in four times as many passes over the keys (fewer heads and dimensions a
// pass), and asks one every 32 (every 4 as slow as none there, 16 and 32 faster). Intel's
// prefetches into L2 hold one of L1's fill buffers until their line arrives, and the V pass
// stalled on them (a profile of `bench.engine_throughput`: a third of its samples on the
// prefetch loop). On 2 Xeon cores (family 6 model 167), 16 decodes as above against none in
// the same alternation: every 4 2.7-5.4 % slower, 8 1.1 % slower, 16 0.7-2.8 % faster, 32
// 0.5-2.7 % faster, 64 1.9 % faster, 128 1.1 % slower (none 15.2-15.7 ms); 64 decodes 58.4 ms
// at 32, 59.9 with none, 61.9 at 4. Its AVX2 path measured within 2 % of none at 32 to 128.
inline int64_t upcoming_every(Path path) {
  return path == Path::kAvx512 && !intel_cpu() ? 4 : 32;
}

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

// Pulls a slot's K and V (of the KV heads a call computes) into L2 before key_tiles reads it:
// scattered blocks defeat the hardware prefetcher, and V is read again by the weighted sum.
// Measured, 64 decodes over a bf16 cache of 20 MB per layer on 2 cores: no prefetch 2.07 ms, into
// L1 2.20 ms (the prefetches stall on L1's few miss buffers), into L2 1.61 ms. The slots it reads
// next are asked for one per key as it converts the current ones, not all at once: a burst of 16
// slots (192 lines) stalled the core on the miss buffers too. 16 decodes at 450 over 30 layers'
// bf16 caches on shuffled blocks (2 Zen 4 cores): 10.6-11.9 ms against 13.0-13.5 with the burst,
// 12.9-13.9 against 17.0-18.1 on the AVX2 path (docs/architecture.md).
#if defined(INHERENT_AVX2) || defined(INHERENT_AVX512)
// `k`: the first K a call reads of a slot, `bytes` of them, and as many of V from k + v_offset
// (the whole slot, contiguous, when the call computes every KV head).
template <typename T>
inline void prefetch_slot(const T* k, int64_t v_offset, int64_t bytes) {
  for (const T* part : {k, k + v_offset}) {
    const char* p = reinterpret_cast<const char*>(part);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
  }
}
#endif

// ---- Vectorized implementation (head sizes 64 and 128), V = Avx2 or Avx512 (simd.h) ----------

#if defined(INHERENT_AVX2) || defined(INHERENT_AVX512)

// softmax's operations, W scores at a time: the same bits (a maximum is exact in any order;
// the exp is exp_nonpositive's, the sum softmax's 16 lanes). The compiler's own vectorization
// of softmax kept its maximum scalar and its exp 8 lanes wide. A 176-token chunk at positions
// 450-625 over 30 layers' bf16 caches on 2 Xeon cores (family 6 model 167): 57.5-58.0 ms
// against 62.0-62.5.
template <class V>
void softmax_vectorized(float* s, int64_t n) {
  using F = typename V::F;
  float top = s[0];
  F peak = V::set1(top);
  int64_t j = 0;
  for (; j + V::W <= n; j += V::W) peak = V::max_with(peak, V::load(s + j));
  for (; j < n; ++j) top = std::max(top, s[j]);
  float lane[kLanes];
  V::store(lane, peak);
  for (int l = 0; l < V::W; ++l) top = std::max(top, lane[l]);
  const F shift = V::set1(top);
  for (j = 0; j + V::W <= n; j += V::W)
    V::store(s + j, exp_nonpositive<V>(V::sub(V::load(s + j), shift)));
  for (; j < n; ++j) s[j] = exp_nonpositive(s[j] - top);
  F total[V::kRegs];
  for (int r = 0; r < V::kRegs; ++r) total[r] = V::zero();
  for (j = 0; j + kLanes <= n; j += kLanes)
    for (int r = 0; r < V::kRegs; ++r) total[r] = V::add(total[r], V::load(s + j + V::W * r));
  for (int r = 0; r < V::kRegs; ++r) V::store(lane + V::W * r, total[r]);
  for (int l = 0; j < n && l < kLanes; ++j, ++l) lane[l] += s[j];
  const float inv = 1.f / lanes_sum(lane);
  const F scale = V::set1(inv);
  for (j = 0; j + V::W <= n; j += V::W) V::store(s + j, V::mul(V::load(s + j), scale));
  for (; j < n; ++j) s[j] *= inv;
}

// Registers of dimensions a values() pass sums for each of its query heads.
constexpr int kValueRegs = 4;

// Weighted sums of V for `kHeads` query heads (first..) over dimensions d0..d0 + kValueRegs W
// - 1, keys j0..j1 - 1 added to the sums of keys 0..j0 - 1 (in t.out, kept there between calls).
template <class V, int kHeads, typename T>
void values(const Token<T>& t, int64_t first, int64_t v_offset, int64_t d0, int64_t j0,
            int64_t j1, Upcoming<T>& up) {
  using F = typename V::F;
  F acc[kHeads][kValueRegs];
  for (int h = 0; h < kHeads; ++h)
    for (int c = 0; c < kValueRegs; ++c)
      acc[h][c] = j0 == 0 ? V::zero() : V::load(t.out + (first + h) * t.D + d0 + V::W * c);
  const float* w = t.scores + first * t.padded;
  for (int64_t j = j0; j < j1; ++j) {
    if ((j & up.every_mask) == 0 && up.next < static_cast<int64_t>(up.slots.size()))
      prefetch_slot(up.slots[up.next++], up.v_offset, up.bytes);
    const T* v = t.keys[j] + v_offset + d0;
    F vj[kValueRegs];
    for (int c = 0; c < kValueRegs; ++c) vj[c] = V::load(v + V::W * c);
    for (int h = 0; h < kHeads; ++h) {
      const F wj = V::set1(w[h * t.padded + j]);
      for (int c = 0; c < kValueRegs; ++c) acc[h][c] = V::fma(wj, vj[c], acc[h][c]);
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int c = 0; c < kValueRegs; ++c)
      V::store(t.out + (first + h) * t.D + d0 + V::W * c, acc[h][c]);
}

// values() for `count` heads, 1..kMax, with the register count fixed at compile time.
template <class V, int kMax, typename T>
inline void values_of(int64_t count, const Token<T>& t, int64_t first, int64_t v_offset,
                      int64_t d0, int64_t j0, int64_t j1, Upcoming<T>& up) {
  if constexpr (kMax > 1)
    if (count < kMax) return values_of<V, kMax - 1>(count, t, first, v_offset, d0, j0, j1, up);
  values<V, kMax>(t, first, v_offset, d0, j0, j1, up);
}

// Keys first..first + kTiles W - 1 of every KV head as float, W keys a tile, each tile
// [head][key][D]: read once for every query head (and every token of a run) that scores them.
// Key j of every tile is read before key j + 1 of any (kKeysAtOnce says why). `ahead`: the
// first `asks` of the kTiles W slots that follow, asked for one as each key converts.
template <class V, int D, int kTiles, typename T>
inline void key_tiles(const T* const* keys, int64_t first, int64_t kv_heads, float* tiles,
                      const T* const* ahead, int64_t asks, int64_t v_offset) {
  for (int j = 0; j < V::W; ++j)
    for (int u = 0; u < kTiles; ++u) {
      if (u * V::W + j < asks)
        prefetch_slot(ahead[u * V::W + j], v_offset, kv_heads * D * sizeof(T));
      const T* key = keys[first + u * V::W + j];
      float* tile = tiles + u * V::W * kv_heads * D;
      for (int64_t g = 0; g < kv_heads; ++g)
        for (int c = 0; c < D / V::W; ++c)
          V::store(tile + (g * V::W + j) * D + V::W * c, V::load(key + g * D + V::W * c));
    }
}

// The scores of kTokens tokens of a run (t[0..]) for keys first..first + W - 1, every head,
// from their key tile. A key's 16 lanes are kRegs registers; kAtOnce keys at once keep 8
// independent FMA chains in flight per token, and each key register loaded serves every token.
template <class V, int D, int kTokens, typename T>
inline void scores(const Token<T>* const* t, const float* tile, int64_t first) {
  using F = typename V::F;
  constexpr int kRegs = V::kRegs, kAtOnce = 8 / kRegs;
  const F scale = V::set1(t[0]->scale);
  for (int64_t h = 0; h < t[0]->heads; ++h) {
    const float* k = tile + h / t[0]->group * V::W * D;
    F folded[kTokens][V::W];
    for (int j0 = 0; j0 < V::W; j0 += kAtOnce) {
      F acc[kTokens][kAtOnce][kRegs];
      for (int i = 0; i < kTokens; ++i)
        for (int j = 0; j < kAtOnce; ++j)
          for (int r = 0; r < kRegs; ++r) acc[i][j][r] = V::zero();
      for (int d = 0; d < D; d += kLanes)
        for (int r = 0; r < kRegs; ++r) {
          F qd[kTokens];
          for (int i = 0; i < kTokens; ++i) qd[i] = V::load(t[i]->q + h * D + d + V::W * r);
          for (int j = 0; j < kAtOnce; ++j) {
            const F kj = V::load(k + (j0 + j) * D + d + V::W * r);
            for (int i = 0; i < kTokens; ++i) acc[i][j][r] = V::fma(qd[i], kj, acc[i][j][r]);
          }
        }
      for (int i = 0; i < kTokens; ++i)
        for (int j = 0; j < kAtOnce; ++j) folded[i][j0 + j] = V::fold(acc[i][j]);
    }
    for (int i = 0; i < kTokens; ++i)
      V::store(t[i]->scores + h * t[i]->padded + first, V::mul(V::sum(folded[i]), scale));
  }
}

// Keys key_tiles reads at once, a tile's W after another's in turn. A decode's keys come from
// memory, a cache block (16 keys, 12 KB of K and V in bf16) after another in no order, and one
// block read at a time keeps one stream of lines in flight: the core's L2 prefetcher follows a
// stream a page at a time, and the asks ahead hold L1's few fill buffers. Two blocks read in
// turn keep two streams (AVX2's 8-key tiles: four tiles, two blocks). Summing 12 KB blocks in
// random order on 2 Xeon cores (family 6 model 167), one block ahead asked for: 18.7 GB/s one
// at a time, 23.4 two in turn, 27.8 four. 64 decodes at 300-500 over 30 layers' bf16 caches on
// shuffled blocks (medians of 16-20, alternated with the old in one process): 41.6-45.3 ms
// against 45.6-50.5 one tile at a time (AVX2 path 50.7-51.5 against 54.4-56.0); 48 keys at once
// or 64 no faster; 16 decodes 11.7-12.4 against 13.3-13.9. Where a fresh engine's allocator
// laid each prompt's blocks in order, 64 decodes gained 1.5-2 % (38.2-38.5 against 38.8-39.4):
// a long-lived server's blocks come back in no order. A token's arithmetic is unchanged: each
// tile's scores are computed as before, only the loads' order moved. On 2 Zen 4 cores (AMD
// family 25 model 17) the same 64 decodes took longer: 34.0-35.2 ms against 32.5-33.6 one tile at
// a time, the AVX2 path 39.1 against 36.0, and so did 32 keys read tile after tile (33.8 against
// 31.7). On 2 Zen 5 cores (family 26 model 2), whose L1 holds 48 KB as the Xeon's does, 64
// decodes ran 25.3 ms against 25.0, 16 decodes 7.97 against 7.85 (the AVX2 path 30.6 against 32.7,
// one decode alone 0.91 against 1.03); with caches of one KV head (an 8 KB tile) 8.8 against
// 11.6, yet the engine's own steps with the bundled model cut to one KV head (64 decodes at 400)
// ran 66.8 against 64.9 ms, and its batch-1 decodes at 2,000 ran even. So a decode reads blocks
// in turn on Intel CPUs only (decode_blocks_in_turn, kernels.h).
constexpr int kKeysAtOnce = 32;

// Keys a run's weighted sums take at a time: V of one KV head for 64 keys (16 KB at D = 64 in
// float32) stays in L1 while every token of the run adds them.
constexpr int64_t kRunValueKeys = 64;

// The scores of every token of a run (or a lone token) whose keys reach `first`, for the tile of
// keys first..first + W - 1. Two tokens at a time where the registers allow (AVX-512: 16 sums),
// the longest first: every key register loaded serves both. A 176-token chunk at positions
// 450-625 on 2 Xeon cores (family 6 model 167): 52.0 ms against 58.4-58.6 one at a time; three,
// the same.
template <class V, int D, typename T>
inline void scores_of_tile(const Token<T>* tokens, int64_t count, const float* tile,
                           int64_t first) {
  constexpr int kTogether = V::kRegs == 1 ? 2 : 1;
  int64_t i = count - 1;
  for (; i >= kTogether - 1 && first < tokens[i - kTogether + 1].n; i -= kTogether) {
    const Token<T>* together[kTogether];
    for (int p = 0; p < kTogether; ++p) together[p] = &tokens[i - p];
    scores<V, D, kTogether>(together, tile, first);
  }
  for (; i >= 0 && first < tokens[i].n; --i) {
    const Token<T>* one[1] = {&tokens[i]};
    scores<V, D, 1>(one, tile, first);
  }
}

// The tokens of a run (one sequence, consecutive positions; tokens[i].n grows with i, and the
// last token's keys serve all) or a lone token: each key tile is made once for all of them,
// and V is read in blocks that every token adds before the next. A token's arithmetic is the
// same whatever its run: its scores, softmax and sums are these operations in this order.
template <class V, int D, typename T>
void attend_vectorized(const Token<T>* tokens, int64_t count, std::vector<float>& tile,
                       Upcoming<T>& up) {
  // a values() pass: up to kHeads query heads, so 8 of AVX2's 16 registers or 16 of AVX-512's
  // 32 hold sums
  constexpr int kDims = kValueRegs * V::W, kHeads = V::W == 16 ? 4 : 2;
  const Token<T>& last = tokens[count - 1];
  const int64_t kv_heads = last.heads / last.group, kv_bytes = kv_heads * D * sizeof(T);
  constexpr int kTiles = kKeysAtOnce / V::W;
  // A run's keys a tile at a time: its tokens' scores read the tiles many times from L1 (a
  // 400-token chunk's attention took 1.3-1.9 % longer with two); so are the last keys, fewer
  // than kKeysAtOnce, and a decode's where blocks in turn are off (kKeysAtOnce says why).
  const int64_t at_once = count == 1 && decode_blocks_in_turn() ? kKeysAtOnce : V::W;
  // The asks stay at least kLanes keys ahead: AVX2's 8-key tiles asking 8 ahead made 64 decodes
  // 4.1 % slower, 16 decodes 6 %, a 450-token chunk 4.3 % on 2 Zen 4 cores (family 25 model 17).
  const int64_t distance = std::max<int64_t>(at_once, kLanes);
  tile.resize(kKeysAtOnce * kv_heads * D);
  for (int64_t j = 0; j < std::min(distance, last.padded); ++j)
    prefetch_slot(last.keys[j], last.v_offset, kv_bytes);
  for (int64_t first = 0; first < last.n;) {
    const bool several = at_once == kKeysAtOnce && first + kKeysAtOnce <= last.padded;
    const int64_t keys = several ? kKeysAtOnce : V::W, next = first + keys;
    const int64_t asks = std::clamp<int64_t>(last.padded - (first + distance), 0, keys);
    const T* const* ahead = asks > 0 ? last.keys + first + distance : nullptr;
    if (several)
      key_tiles<V, D, kTiles>(last.keys, first, kv_heads, tile.data(), ahead, asks,
                              last.v_offset);
    else
      key_tiles<V, D, 1>(last.keys, first, kv_heads, tile.data(), ahead, asks, last.v_offset);
    for (int64_t u = 0; first < next; ++u, first += V::W)
      scores_of_tile<V, D>(tokens, count, tile.data() + u * V::W * kv_heads * D, first);
  }
  for (int64_t i = 0; i < count; ++i)
    for (int64_t h = 0; h < last.heads; ++h)
      softmax_vectorized<V>(tokens[i].scores + h * tokens[i].padded, tokens[i].n);
  const int64_t block = count == 1 ? last.n : kRunValueKeys;
  for (int64_t g = 0; g < kv_heads; ++g)
    for (int64_t j0 = 0; j0 < last.n; j0 += block)
      for (int64_t i = 0; i < count; ++i) {
        const Token<T>& t = tokens[i];
        if (j0 >= t.n) continue;
        const int64_t j1 = std::min(j0 + block, t.n), v_offset = t.v_offset + g * D;
        for (int64_t h = g * t.group; h < (g + 1) * t.group; h += kHeads)
          for (int64_t d0 = 0; d0 < D; d0 += kDims)
            values_of<V, kHeads>(std::min<int64_t>(kHeads, (g + 1) * t.group - h), t, h,
                                 v_offset, d0, j0, j1, up);
      }
}
#endif

// Tokens a run holds at most: their scores ([tokens][heads][keys]) stay in L2. 16 measured
// slower than 8 (176 prompt tokens: 2.0-2.2 ms against 1.6-1.9).
constexpr int64_t kRunTokens = 8;

struct Layout {
  const void* kv;  // float or bfloat16 elements
  int64_t block_size, slot_stride, v_offset, kv_heads, max_blocks;
  const int32_t* tables;
};

// Keys 0..n - 1 of a sequence: each one's slot, from element `offset` (its first KV head's K).
template <typename T>
void key_slots(const Layout& L, const int32_t* table, int64_t n, int64_t offset, const T** keys) {
  for (int64_t j = 0, b = 0; j < n; ++b) {  // a division per key would cost more than its use
    const T* slot = static_cast<const T*>(L.kv) +
                    (int64_t)table[b] * L.block_size * L.slot_stride + offset;
    for (int64_t o = 0; o < L.block_size && j < n; ++o, ++j) keys[j] = slot + o * L.slot_stride;
  }
}

// The query heads an attend() call computes: those of KV heads kv_first..kv_first + kv_count - 1,
// `group` query heads each.
struct Heads {
  int64_t kv_first, kv_count, group;
};

// Tokens first..first + count - 1 of q and out, one sequence's at consecutive positions from
// `position` (count 1: a lone token), each attending its keys 0..its position, for the query
// heads `h` names (a head's arithmetic is the same whichever others a call computes beside it).
template <typename T>
void attend(const Layout& L, const float* q, int64_t q_stride, float* out, int64_t count,
            const int32_t* table, int64_t position, Heads h, int64_t D, float scale,
            Path path, std::vector<const T*>& keys, std::vector<Token<T>>& tokens,
            std::vector<float>& scores, std::vector<float>& scratch, Upcoming<T>& up,
            bool keys_known) {
  const auto pad = [](int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; };
  const int64_t n = position + count, padded = pad(n);  // the last token's
  const int64_t heads = h.kv_count * h.group, first_head = h.kv_first * h.group;
  const int64_t out_stride = L.kv_heads * h.group * D;
  if (!keys_known) {  // else keys 0..n - 1 hold them already
    keys.resize(n);
    key_slots(L, table, n, h.kv_first * D, keys.data());
  }
  keys.resize(padded);
  std::fill(keys.begin() + n, keys.end(), keys[n - 1]);
  scores.resize(count * heads * padded);
  tokens.clear();
  for (int64_t i = 0; i < count; ++i)  // an earlier token reads later keys only as padding
    tokens.push_back({q + i * q_stride + first_head * D, out + i * out_stride + first_head * D,
                      keys.data(), position + 1 + i, pad(position + 1 + i), heads, h.group, D,
                      L.v_offset, scale, scores.data() + i * heads * padded});
#if defined(INHERENT_AVX512)
  if (path == Path::kAvx512 && (D == 64 || D == 128))
    return D == 64 ? attend_vectorized<Avx512, 64>(tokens.data(), count, scratch, up)
                   : attend_vectorized<Avx512, 128>(tokens.data(), count, scratch, up);
#endif
#if defined(INHERENT_AVX2)
  if (path == Path::kAvx2 && (D == 64 || D == 128))
    return D == 64 ? attend_vectorized<Avx2, 64>(tokens.data(), count, scratch, up)
                   : attend_vectorized<Avx2, 128>(tokens.data(), count, scratch, up);
#endif
  for (const Token<T>& t : tokens) {
    if (D == 64) attend_portable<64>(t, scratch);
    else if (D == 128) attend_portable<128>(t, scratch);
    else attend_portable<0>(t, scratch);
  }
}

std::atomic<bool> blocks_in_turn{intel_cpu()};  // decode_blocks_in_turn (kernels.h)
}  // namespace

bool decode_blocks_in_turn() { return blocks_in_turn.load(std::memory_order_relaxed); }

bool set_decode_blocks_in_turn(bool on) { return blocks_in_turn.exchange(on); }

// q: [T, num_heads * head_dim] float32, rows may be strided; cache: [blocks, block_size, 2,
// kv_heads, head_dim] float32 or bfloat16, contiguous; block_tables: [B, max_blocks] int32;
// token_seq: [T] int32, each query row's sequence; positions: [T] int64, each row attends keys
// 0..position. `path_name`: "auto" or the implementation to force (simd.h; tests compare them).
// Returns [T, num_heads * head_dim].
at::Tensor paged_attention(at::Tensor q, at::Tensor cache, at::Tensor block_tables,
                           at::Tensor token_seq, at::Tensor positions, double scale,
                           const std::string& path_name) {
  const Path path = resolve_path(path_name);
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  const bool bf16 = cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || cache.scalar_type() == at::kFloat, "the cache must be float32 or bfloat16");
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1, "q must be [T, heads * head_dim], rows contiguous");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous(), "cache must be a contiguous 5-D tensor");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous());
  TORCH_CHECK(token_seq.scalar_type() == at::kInt && token_seq.is_contiguous());
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous());
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "fixed-order attention runs on CPU");
  const int64_t num_tokens = q.size(0), head_dim = cache.size(4);
  Layout L{cache.data_ptr(), cache.size(1), 2 * cache.size(3) * head_dim,
           cache.size(3) * head_dim, cache.size(3), block_tables.size(1),
           block_tables.data_ptr<int32_t>()};
  const int64_t heads = q.size(1) / head_dim;
  TORCH_CHECK(heads * head_dim == q.size(1) && heads % L.kv_heads == 0, "bad head layout");

  auto out = at::empty({num_tokens, heads * head_dim}, q.options());
  const float* q_data = q.data_ptr<float>();
  const int64_t q_stride = q.stride(0);
  const int32_t* seq_of = token_seq.data_ptr<int32_t>();
  const int64_t* pos_of = positions.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // Runs: a token and the next ones of its sequence at the next positions (a prefill chunk's),
  // kRunTokens at most, computed together (attend). On the vectorized path a run reads each key
  // once for all its tokens (on the portable one its later tokens find the keys in cache); a
  // lone token (a decode) reads every key it scores, mostly from memory. Threads take runs one
  // at a time from a shared counter, the costliest first by an estimate (keys read plus keys
  // scored), so each ends within about one run of the other whatever a key costs here: a fixed
  // split by that estimate left one thread a mixed step's decodes and 50 % more time (2 Zen 5
  // cores, where a decode's key costs 3.5 times a run token's, against the estimate's 1.8).
  // Taken so, 16 decodes at 404-532 beside 176 prompt tokens took 26.1-26.8 ms over the bundled
  // model's 30 layers against 27.8-29.9 (bf16 cache, medians of 40 steps, two alternations).
  // Fewer runs than threads (a decode alone): each run's KV heads are taken one at a time, or
  // the other threads would wait out the whole attention at every layer (each asks ahead for
  // its own heads' K and V only). A decode alone at 450 over 30 layers' bf16 caches (2 Xeon
  // cores, family 6 model 167; medians of 40, builds alternated twice): 0.63-0.64 ms against
  // 0.84-0.95, 0.80-0.84 against 1.02-1.18 on the AVX2 path; at 1,500, 2.03-2.20 against
  // 3.08-3.39; 16 decodes (not cut) unchanged. Which thread computes a run, or which heads
  // beside a head, never changes its bits.
  std::vector<int64_t> run_at, cost;  // each run's first token (then num_tokens), its estimate
  for (int64_t t = 0; t < num_tokens;) {
    int64_t count = 1;
    while (count < kRunTokens && t + count < num_tokens && seq_of[t + count] == seq_of[t] &&
           pos_of[t + count] == pos_of[t] + count)
      ++count;
    int64_t keys = pos_of[t + count - 1] + 1;
    for (int64_t i = 0; i < count; ++i) keys += pos_of[t + i] + 1;
    run_at.push_back(t);
    cost.push_back(keys);
    t += count;
  }
  const int64_t runs = static_cast<int64_t>(cost.size()), threads = at::get_num_threads();
  const int64_t parts = runs < threads ? L.kv_heads : 1;  // items a run is cut into
  const int64_t kv_count = L.kv_heads / parts;             // KV heads an item computes
  run_at.push_back(num_tokens);
  std::vector<int64_t> order(runs * parts);  // item i: run i / parts, its part i % parts
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a / parts] > cost[b / parts]; });
  const int64_t items = static_cast<int64_t>(order.size()), group = heads / L.kv_heads;
  const int64_t item_bytes = kv_count * head_dim * cache.element_size();  // of a slot's K
  const int64_t every_mask = upcoming_every(path) - 1;
  std::atomic<int64_t> next{0};
  const auto take = [&] { return next.fetch_add(1, std::memory_order_relaxed); };
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  // With more items than threads, each thread takes its next item before it computes one, so
  // that it can ask for the next one's keys meanwhile (Upcoming); with no more, each takes one,
  // or a thread that took two would leave another none.
  const bool ahead = items > workers;
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<const float*> keys32;
    std::vector<const uint16_t*> keys16;
    std::vector<Token<float>> tokens32;
    std::vector<Token<uint16_t>> tokens16;
    std::vector<float> scores, scratch;
    Upcoming<float> up32{{}, 0, item_bytes, L.v_offset, -1, every_mask};
    Upcoming<uint16_t> up16{{}, 0, item_bytes, L.v_offset, -1, every_mask};
    // Item i, then the slots of `following` asked for while it runs.
    const auto compute = [&](int64_t i, int64_t following, auto& keys, auto& tokens, auto& up) {
      const int64_t r = order[i] / parts, t = run_at[r], count = run_at[r + 1] - t;
      const Heads h{order[i] % parts * kv_count, kv_count, group};
      const int32_t* table = L.tables + seq_of[t] * L.max_blocks;
      const bool known = up.item == i;  // found for the prefetch while the item before ran
      if (known) std::swap(keys, up.slots);
      up.item = following < items ? following : -1;
      up.next = 0;
      up.slots.clear();
      if (following < items) {
        const int64_t r2 = order[following] / parts;
        up.slots.resize(pos_of[run_at[r2 + 1] - 1] + 1);  // the run's last token's keys serve all
        key_slots(L, L.tables + seq_of[run_at[r2]] * L.max_blocks, up.slots.size(),
                  order[following] % parts * kv_count * head_dim, up.slots.data());
      }
      attend(L, q_data + t * q_stride, q_stride, out_data + t * heads * head_dim, count, table,
             pos_of[t], h, head_dim, fscale, path, keys, tokens, scores, scratch, up, known);
    };
    for (int64_t i = take(); i < items;) {
      const int64_t following = ahead ? take() : items;
      if (bf16) compute(i, following, keys16, tokens16, up16);
      else compute(i, following, keys32, tokens32, up32);
      i = ahead ? following : take();
    }
  });
  return out;
}


