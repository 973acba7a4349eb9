// y = x @ W.T with W stored as GGUF blocks (Q4_1, Q8_0) and read as stored: each block of 32
// weights is dequantized in registers, exactly as gguf's dequantize does it, and multiplied with
// float32 activations into float32 accumulators. Nothing is rounded but the products and sums
// of a float32 matmul: unlike llama.cpp, which rounds activations to 8 bits, the result is that
// of a float32 matmul on the dequantized weights.
//
// Why: a batch-1 decode reads every weight once, and the bundled model's Q4_1 blocks are 0.625
// bytes a weight against 2 in bf16 and 4 in float32.
//
// The arithmetic, fixed once (every path computes exactly this, at any row count):
//   w[k]    = d * q + m (Q4_1: 4-bit q, fp16 d and m) or d * q (Q8_0: int8 q) -- exact products,
//             so one rounding, as gguf's float32 dequantization;
//   y[r][n] = lanes_sum(lane), lane[l] = fma chain over k = l, l + 16, l + 32, ... (ascending)
//             of x[r][k] * w[n][k], from 0.
// An output depends on its own row of x and column of W only: row-invariant by construction
// (batch-invariant mode needs no probe for it). Paths: portable, AVX2 and AVX-512 (simd.h),
// bit-identical; tiles of several rows share each dequantized block, and from Outer::kMinRows rows
// a panel of columns is dequantized once into float32 for every row and multiplied as outer
// products, so prefill rows pay less dequantization per weight than decode rows, without
// changing any output's arithmetic.
#include "simd.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <vector>

namespace {

using namespace inherent;

constexpr int64_t kBlock = 32;  // weights per GGUF block (both types)

// ggml's type numbers and block sizes
struct Q4_1 {
  static constexpr int64_t kType = kGgmlQ4_1, kBytes = 20;  // fp16 d, fp16 m, 16 bytes: q[j] low nibble,
};                                                    // q[j + 16] high nibble of byte j
struct Q8_0 {
  static constexpr int64_t kType = kGgmlQ8_0, kBytes = 34;  // fp16 d, 32 int8
};

inline uint16_t bits16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return h;
}

// ---- Portable implementation ----------------------------------------------------------------

inline float half_at(const uint8_t* p) { return c10::detail::fp16_ieee_to_fp32_value(bits16(p)); }

inline void dequant(Q4_1, const uint8_t* b, float* w) {
  const float d = half_at(b), m = half_at(b + 2);
  for (int j = 0; j < 16; ++j) {
    w[j] = std::fma(d, static_cast<float>(b[4 + j] & 15), m);
    w[j + 16] = std::fma(d, static_cast<float>(b[4 + j] >> 4), m);
  }
}

inline void dequant(Q8_0, const uint8_t* b, float* w) {
  const float d = half_at(b);
  for (int j = 0; j < kBlock; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
}

template <class Q>
float dot_portable(const float* x, const uint8_t* blocks, int64_t num_blocks) {
  float lane[kLanes] = {}, w[kBlock];
  for (int64_t b = 0; b < num_blocks; ++b, x += kBlock) {
    dequant(Q{}, blocks + b * Q::kBytes, w);
    for (int l = 0; l < kLanes; ++l) lane[l] = std::fma(x[l], w[l], lane[l]);
    for (int l = 0; l < kLanes; ++l) lane[l] = std::fma(x[kLanes + l], w[kLanes + l], lane[l]);
  }
  return lanes_sum(lane);
}

// ---- Vector implementation ------------------------------------------------------------------
// A block as 2 kRegs registers: elements 0..15 (lanes of the first 16-lane group), then 16..31.

#if defined(INHERENT_AVX2)  // every vector path's CPU has F16C
// A block's first two halves (Q4_1: d, m; Q8_0: d, then its first weights) as floats, one
// conversion straight from memory: fewer instructions than converting d and m one at a time
// through a general register, and a decode row's pace is the instructions a block takes (one
// Zen 2 core, AMD EPYC family 23 model 49, a lone row on 8192 x 576 Q4_1 weights in L3,
// alternated builds: 475-497 against 523-531 us).
inline __m128 first_halves(const uint8_t* b) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
}
#endif

#if defined(INHERENT_AVX512)
// The 16 values a nibble stands for, fma(d, q, m) as every path computes them, in one register,
// and each weight looked up there by its nibble (a permute reads an index's low 4 bits): a
// third fewer instructions than converting and scaling each weight. On 2 Ice Lake cores (Intel
// Xeon family 6 model 106), where a lone row's blocks are bound by instructions, not memory, the
// bundled model's 120 decoder matmuls at 1 row took 5.6 ms so against 7.0, the engine's batch-1
// decode 10.8 against 12.6 (both alternated in one process).
inline void dequant(Avx512, Q4_1, const uint8_t* b, __m512* w) {
  const __m128 dm = first_halves(b);
  const __m512 d = _mm512_broadcastss_ps(dm),
               m = _mm512_permutexvar_ps(_mm512_set1_epi32(1), _mm512_castps128_ps512(dm));
  const __m512 values = _mm512_fmadd_ps(
      d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), m);
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
  w[0] = _mm512_permutexvar_ps(q, values);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), values);
}

inline void dequant(Avx512, Q8_0, const uint8_t* b, __m512* w) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(bits16(b)));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * i)))));
}
#endif

#if defined(INHERENT_AVX2)
inline void dequant(Avx2, Q4_1, const uint8_t* b, __m256* w) {
  const __m128 dm = first_halves(b);
  const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
  const __m256i nibble = _mm256_set1_epi32(15);
  for (int i = 0; i < 2; ++i) {  // bytes 8i..8i + 7: elements 8i.. (low), 16 + 8i.. (high)
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 4 + 8 * i)));
    w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q, nibble)), m);
    w[2 + i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), m);
  }
}

inline void dequant(Avx2, Q8_0, const uint8_t* b, __m256* w) {
  const __m256 d = _mm256_broadcastss_ps(first_halves(b));
  for (int i = 0; i < 4; ++i)
    w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i)))));
}
#endif

// How far ahead (bytes) a tile prefetches the weights it will read. A tile's rows are a few
// hundred bytes each, too short for the hardware prefetchers to learn them as streams: without
// this a decode row waited on every cache line. Measured on 2 Zen 3 cores (AVX2), batch-1 decode
// of the bundled model, 100 steps: median 24-30 ms without, 15 ms at 4 KB (8 and 16 KB the same
// within noise); the LM head's Q8_0 blocks alone read at 3.3 GB/s on one core without, 6.4 with,
// where a plain sum streams 14.
constexpr int64_t kPrefetchBytes = 4096;

// A block's weights in 2 kRegs registers, dequantized as they are read.
template <class V, class Q>
inline void load_block(const uint8_t* b, typename V::F* wv) {
  __builtin_prefetch(b + kPrefetchBytes);
  dequant(V{}, Q{}, b, wv);
}

// R rows of x times C weight columns (outputs) over num_blocks blocks of 32, each block
// dequantized once for all R rows. Pointers past the real rows/outputs repeat the last one;
// their results are not stored (nullptr).
template <class V, class Q, int R, int C>
void tile(const float* const* x, const uint8_t* const* w, int64_t num_blocks, float* const* out) {
  using F = typename V::F;
  constexpr int kRegs = V::kRegs;
  F acc[R][C][kRegs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < kRegs; ++i) acc[r][c][i] = V::zero();
  // Register j of a block (j < 2 kRegs) goes into accumulator register j % kRegs: lanes l, then
  // l + 16, of every block in turn.
  for (int64_t b = 0; b < num_blocks; ++b)
    for (int c = 0; c < C; ++c) {
      F wv[2 * kRegs];
      load_block<V, Q>(w[c] + b * Q::kBytes, wv);
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 2 * kRegs; ++j)
          acc[r][c][j % kRegs] =
              V::fma(V::load(x[r] + b * kBlock + V::W * j), wv[j], acc[r][c][j % kRegs]);
    }
  // W accumulators per transposing sum
  for (int first = 0; first < R * C; first += V::W) {
    F folded[V::W];
    for (int p = 0; p < V::W; ++p)
      folded[p] = first + p < R * C ? V::fold(acc[(first + p) / C][(first + p) % C]) : V::zero();
    alignas(64) float sums[V::W];
    V::store(sums, V::sum(folded));
    for (int p = 0; p < V::W && first + p < R * C; ++p)
      if (out[first + p] != nullptr) *out[first + p] = sums[p];
  }
}

// Rows [r0, r0 + R) x columns [c0, c0 + C) of out [rows, cols] as one tile, w[c] the blocks of
// column c0 + c; rows from `rows` and columns from `col_end` on are computed but not stored.
template <class V, class Q, int R, int C>
void run_tile(const float* x, int64_t x_stride, int64_t rows, int64_t r0,
              const uint8_t* const* w, int64_t c0, int64_t col_end, int64_t num_blocks,
              float* out, int64_t cols) {
  const float* xp[R];
  float* op[R * C];
  for (int r = 0; r < R; ++r) {
    const int64_t row = std::min<int64_t>(r0 + r, rows - 1);
    xp[r] = x + row * x_stride;
    for (int c = 0; c < C; ++c)
      op[r * C + c] = r0 + r < rows && c0 + c < col_end ? out + row * cols + c0 + c : nullptr;
  }
  tile<V, Q, R, C>(xp, w, num_blocks, op);
}

// Tile shapes. A lone row: a few columns, each block dequantized once. A few rows on the blocks:
// each dequantized block serves every row of the tile. A lone row on AVX-512 ran 16 columns a
// tile until measured on 2 Zen 5 cores (AMD EPYC family 26 model 2): a bundled-model decode step
// took 6.7-7.5 ms so, 4.3-4.6 with 4 columns (4.3-4.7 with 8).
template <class V>
struct Shapes {
  static constexpr int kLoneCols = 4;
  static constexpr int kRows = V::W == 16 ? 4 : 2, kCols = V::W == 16 ? 4 : 2;
};

// The last rows < kRows of a block matmul as one tile of `left` rows (R counts up to it).
template <class V, class Q, int R = 1>
void run_rest(int64_t left, const float* x, int64_t x_stride, int64_t rows, int64_t r0,
              const uint8_t* const* w, int64_t c0, int64_t cols, int64_t num_blocks, float* out) {
  if constexpr (R < Shapes<V>::kRows) {
    if (left == R)
      return run_tile<V, Q, R, Shapes<V>::kCols>(x, x_stride, rows, r0, w, c0, cols, num_blocks,
                                                 out, cols);
    run_rest<V, Q, R + 1>(left, x, x_stride, rows, r0, w, c0, cols, num_blocks, out);
  }
}

#if defined(INHERENT_AVX2)  // every vector path's CPU has AVX2
// ---- Many rows: outer products on a dequantized panel ---------------------------------------
// From kMinRows rows a matmul dequantizes a panel of columns once into float32 for all
// rows, instead of each block once per tile of kRows rows. The tiles above hold the 16 lanes of
// an output in registers and fold them at the end, so every FMA waits on a load of x and of a
// weight. Here a register holds one lane of W consecutive outputs: a weight register serves
// every row of the tile and a broadcast x element every output (12 FMAs to 8 loads on AVX2).
// The arithmetic stays the one fixed above: lane l of output (r, n) is still the FMA chain over
// k = l, l + 16, ... ascending (x * w and w * x are the same product), run one lane at a time
// with its partial sums kept, and the lanes are added in lanes_sum's tree, W outputs at once.
//
// Measured on 2 Zen 3 cores (AVX2, AMD EPYC family 25 model 1), a layer's four matmuls of the
// bundled model, against the panel of 16-lane tiles this replaced and oneDNN's float32 GEMM on
// the dequantized weights: at 8 rows 0.96-0.99 against 1.07-1.16 ms (oneDNN 0.9); 32 rows
// 1.99 against 2.31-2.38 (1.8-2.0); 192 rows 9.2 against 12.6-12.8 (8.6-9.3); 512 rows 24.5
// against 32.5-33.5 (22.8-23.5). The tiles took 0.80-1.09 ms at 6-7 rows, the panel 0.77-0.97.
// AVX-512 has 32 registers: tiles of 6 rows by 4 registers (24 sums, 24 FMAs to 10 loads), the
// chains' loop taking two steps a pass. On Ice Lake (Intel Xeon family 6 model 106, no bf16)
// they replaced tiles of 12 rows by 2 registers, a step a pass (24 FMAs to 14 loads), which had
// beaten 6 rows by 2: a layer's four matmuls, the two alternated in one process, medians of 12,
// one core 2.39, 6.25, 15.8 and 37.2 ms at 16, 64, 256 and 512 rows against 2.63, 6.99, 17.7 and
// 42.7 (oneDNN's float32 GEMM 2.27, 5.35, 14.7 and 32.5); two cores 2.20 and 11.5 ms at 32 and
// 256 rows against 2.42 and 13.0 (oneDNN 2.14 and 10.1); bits unchanged.
// A panel is built from the blocks' integers transposed 8 columns at a time, then dequantized
// with each column's d and m as vector lanes, straight into place. It was built from floats,
// each block dequantized, stored in column order and transposed from there: on 2 Zen 2 cores
// (AMD EPYC family 23 model 49, AVX2), the bundled model's 120 decoder matmuls with weights from
// memory, alternated builds: 16 rows 36.5-37.0 against 42.8-45.0 ms, 64 rows 109-113 against
// 111-135; the build had taken as long as the outer products at 8 rows. With it, the panel
// overtook AVX2's 2-row tiles from 5 rows (same runs' kind, alternated twice: 5 rows 16.9-18.9
// against 20.9-22.1 ms, 6 rows 18.4-19.1 against 23.1-24.6, 7 rows 24.5-28.3 against 28.2-29.2);
// AVX-512 keeps 8, the threshold the AVX2 family 23 model 1 EPYC measured for the old build.
// On 2 Zen 5 cores (AMD EPYC family 26 model 2), the same 120 matmuls: AVX-512 panels of the
// new build 10.6, 12.7, 14.7 and 22.9 ms at 8, 12, 16 and 32 rows against the old build's
// 14.3, 17.0, 19.3 and 29.7 (same bits), 4-row tiles 6.7-8.7, 10.0, 13.3 and 26.7. They cross
// near 20 rows there, but on that kind the engine runs the blocks below 8 rows only, and not
// at all in batch-invariant mode (the bf16 kernel takes the rest, engine/model.py); the
// AVX-512 kinds that run blocks from 8 rows, those without bf16 (Ice Lake), are unmeasured.
template <class Vec>
struct Outer {
  using V = Vec;
  static constexpr int64_t kMinRows = V::W == 16 ? 8 : 5;
  static constexpr int kRows = 6;                   // rows a tile
  static constexpr int kRegs = V::W == 16 ? 4 : 2;  // registers of outputs a row: 24 or 12 sums
  static constexpr int kCols = kRegs * V::W;        // outputs a tile
  static constexpr int kPanel = 4 * V::W;           // outputs a panel: x's rows serve its tiles
  // steps a pass of the chains' loop (k / 16 is even: blocks of 32); AVX2 has no registers for
  // a second step's weights
  static constexpr int kUnroll = V::W == 16 ? 2 : 1;
  // floats from one lane's weights to the next's: a step more than they hold, so that lanes a
  // multiple of 4 KB apart (12 KB at k = 1536) do not share L1 sets
  static int64_t lane_stride(int64_t steps) { return (steps + 1) * kPanel; }
};

// Lane l's chains for R rows x O::kCols outputs: xl[r] the lane's x elements of row r
// (x[k] for k = l, l + 16, ...), wl the panel's weights of those k, kPanel floats a step.
template <class O, int R>
void outer_lane(const float* const* xl, const float* wl, int64_t steps, float* partial) {
  using V = typename O::V;
  using F = typename V::F;
  F acc[R][O::kRegs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < O::kRegs; ++v) acc[r][v] = V::zero();
  for (int64_t m = 0; m < steps; m += O::kUnroll)
    for (int u = 0; u < O::kUnroll; ++u) {
      F w[O::kRegs];
      for (int v = 0; v < O::kRegs; ++v) w[v] = V::load(wl + (m + u) * O::kPanel + v * V::W);
      for (int r = 0; r < R; ++r) {
        const F xb = V::set1(xl[r][m + u]);
        for (int v = 0; v < O::kRegs; ++v) acc[r][v] = V::fma(xb, w[v], acc[r][v]);
      }
    }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < O::kRegs; ++v) V::store(partial + (O::kRegs * r + v) * V::W, acc[r][v]);
}

// Rows [r0, r0 + R) x the panel's outputs [t, t + kCols): all 16 lanes, then their sums.
// xt: x transposed per row to [lane][k / 16]; panel: [lane][k / 16][kPanel].
template <class O, int R>
void outer_tile(const float* xt, int64_t k, int64_t r0, const float* panel, int64_t t,
                int64_t c0, int64_t col_end, float* out, int64_t cols) {
  using V = typename O::V;
  using F = typename V::F;
  const int64_t steps = k / kLanes;
  alignas(64) float partial[kLanes][R * O::kCols];
  for (int l = 0; l < kLanes; ++l) {
    const float* xl[R];
    for (int r = 0; r < R; ++r) xl[r] = xt + (r0 + r) * k + l * steps;
    outer_lane<O, R>(xl, panel + l * O::lane_stride(steps) + t, steps, partial[l]);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < O::kRegs; ++v) {
      const int at = (O::kRegs * r + v) * V::W;
      F half[kLanes / 2], quarter[kLanes / 4];
      for (int l = 0; l < kLanes / 2; ++l)
        half[l] = V::add(V::load(partial[l] + at), V::load(partial[l + kLanes / 2] + at));
      for (int l = 0; l < kLanes / 4; ++l) quarter[l] = V::add(half[l], half[l + kLanes / 4]);
      alignas(64) float sums[V::W];
      V::store(sums, V::add(V::add(quarter[0], quarter[2]), V::add(quarter[1], quarter[3])));
      for (int p = 0; p < V::W; ++p) {
        const int64_t col = c0 + t + v * V::W + p;
        if (col < col_end) out[(r0 + r) * cols + col] = sums[p];
      }
    }
}

// A tile of `height` rows (R counts up to it).
template <class O, int R = 1>
void outer_rows(int64_t height, const float* xt, int64_t k, int64_t r0, const float* panel,
                int64_t t, int64_t c0, int64_t col_end, float* out, int64_t cols) {
  if constexpr (R <= O::kRows) {
    if (height == R) return outer_tile<O, R>(xt, k, r0, panel, t, c0, col_end, out, cols);
    outer_rows<O, R + 1>(height, xt, k, r0, panel, t, c0, col_end, out, cols);
  }
}

// r[i][j] <-> r[j][i]: 8 registers of 8 32-bit elements transposed (moves only, so integers
// and floats alike).
inline void transpose8x8(__m256i* r) {
  __m256 a[8], t[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_castsi256_ps(r[i]);
  for (int i = 0; i < 4; ++i) {  // pairs of rows, interleaved
    t[2 * i] = _mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // quadruples of rows
    a[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    a[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    a[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    a[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit halves: rows 0-3 with rows 4-7
    r[i] = _mm256_castps_si256(_mm256_permute2f128_ps(a[i], a[4 + i], 0x20));
    r[4 + i] = _mm256_castps_si256(_mm256_permute2f128_ps(a[i], a[4 + i], 0x31));
  }
}

// The first two fp16 of 8 columns' blocks (Q4_1: d and m; Q8_0: d and its first two weights)
// as floats, one column a lane: first[i] and second[i] of column i.
inline void halves_of(const uint8_t* const* block, __m256* first, __m256* second) {
  int32_t pair[8];
  for (int i = 0; i < 8; ++i) std::memcpy(&pair[i], block[i], sizeof pair[i]);
  const __m256i pairs = _mm256_setr_epi32(pair[0], pair[1], pair[2], pair[3], pair[4], pair[5],
                                          pair[6], pair[7]);
  // columns 0-3 and 4-7 as (first, second) float pairs
  const __m256 low = _mm256_cvtph_ps(_mm256_castsi256_si128(pairs)),
               high = _mm256_cvtph_ps(_mm256_extracti128_si256(pairs, 1));
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  *first = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(low, high, 0x88), order);
  *second = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(low, high, 0xDD), order);
}

// 8 columns' block b dequantized into the panel transposed: element e (k = 32 b + e) of the 8
// columns goes to to[e % 16 * lane_stride + e / 16 * step_stride], 8 consecutive floats. The
// blocks' integers are transposed, not their floats, so each weight is still fma(d, q, m) (or
// d * q) of its own column's d and m, now lanes of a vector: the panel holds the bits a block's
// dequant gives, without storing the blocks in column order first.
inline void dequant_transposed(Q4_1, const uint8_t* const* block, float* to, int64_t lane_stride,
                               int64_t step_stride) {
  __m256 d, m;
  halves_of(block, &d, &m);
  const __m256i nibble = _mm256_set1_epi32(15);
  for (int half = 0; half < 2; ++half) {  // bytes 8 half .. 8 half + 7: elements e and e + 16
    __m256i q[8];
    for (int i = 0; i < 8; ++i)
      q[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block[i] + 4 + 8 * half)));
    transpose8x8(q);
    for (int j = 0; j < 8; ++j) {
      const int e = 8 * half + j;  // < 16: lane e, steps 2 b (low nibble) and 2 b + 1 (high)
      _mm256_storeu_ps(to + e * lane_stride,
                       _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q[j], nibble)), m));
      _mm256_storeu_ps(to + e * lane_stride + step_stride,
                       _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q[j], 4)), m));
    }
  }
}

inline void dequant_transposed(Q8_0, const uint8_t* const* block, float* to, int64_t lane_stride,
                               int64_t step_stride) {
  __m256 d, unused;
  halves_of(block, &d, &unused);
  for (int group = 0; group < 4; ++group) {  // elements 8 group .. 8 group + 7
    __m256i q[8];
    for (int i = 0; i < 8; ++i)
      q[i] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block[i] + 2 + 8 * group)));
    transpose8x8(q);
    for (int j = 0; j < 8; ++j) {
      const int e = 8 * group + j;
      _mm256_storeu_ps(to + e % kLanes * lane_stride + e / kLanes * step_stride,
                       _mm256_mul_ps(d, _mm256_cvtepi32_ps(q[j])));
    }
  }
}

// Threads split the panels; each dequantizes its panel, then runs every row over it.
template <class V, class Q>
void matmul_outer(const float* x, int64_t x_stride, int64_t rows, const uint8_t* w,
                  int64_t w_stride, int64_t cols, int64_t num_blocks, float* out) {
  using O = Outer<V>;
  const int64_t k = num_blocks * kBlock, steps = k / kLanes;
  // each row's x by lane, so a lane's elements are adjacent; the calling thread's buffer (a
  // thread_local named in the lambdas below would be each worker's own)
  thread_local std::vector<float> by_lane;
  by_lane.resize(rows * k);
  float* const xt = by_lane.data();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* from = x + r * x_stride;
      float* to = xt + r * k;
      int64_t m = 0;
      // 8 steps of 8 lanes at a time (a loop over elements, with a modulo each, took 3.6 % of
      // a 192-row step on the Zen 2 kind)
      for (; m + 8 <= steps; m += 8)
        for (int lanes = 0; lanes < kLanes; lanes += 8) {
          __m256i v[8];
          for (int i = 0; i < 8; ++i)
            v[i] = _mm256_castps_si256(_mm256_loadu_ps(from + (m + i) * kLanes + lanes));
          transpose8x8(v);
          for (int l = 0; l < 8; ++l)
            _mm256_storeu_ps(to + (lanes + l) * steps + m, _mm256_castsi256_ps(v[l]));
        }
      for (; m < steps; ++m)
        for (int l = 0; l < kLanes; ++l) to[l * steps + m] = from[m * kLanes + l];
    }
  });
  const int64_t num_panels = (cols + O::kPanel - 1) / O::kPanel;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> panel;  // reused by the next call on this thread
    panel.resize(kLanes * O::lane_stride(steps));
    for (int64_t p = begin; p < end; ++p) {
      const int64_t c0 = p * O::kPanel, col_end = std::min(cols, c0 + O::kPanel);
      // Block by block, every column of the panel, so each cache line of the panel is filled
      // while in L1; the next panel's blocks are fetched meanwhile. Columns past the end repeat
      // the last one.
      const uint8_t* col[O::kPanel];
      for (int64_t c = 0; c < O::kPanel; ++c) col[c] = w + std::min(c0 + c, cols - 1) * w_stride;
      for (int64_t b = 0; b < num_blocks; ++b)
        for (int64_t c = 0; c < O::kPanel; c += 8) {
          const uint8_t* block[8];
          for (int i = 0; i < 8; ++i) {
            block[i] = col[c + i] + b * Q::kBytes;
            __builtin_prefetch(block[i] + O::kPanel * w_stride);
          }
          dequant_transposed(Q{}, block, panel.data() + 2 * b * O::kPanel + c,
                             O::lane_stride(steps), O::kPanel);
        }
      // rows in tiles of near-equal height: 8 rows as 4 + 4, not 6 + 2, whose 4 chains would
      // wait on the FMAs' latency
      const int64_t tiles = (rows + O::kRows - 1) / O::kRows;
      for (int64_t i = 0, r = 0; i < tiles; ++i) {
        const int64_t height = rows / tiles + (i < rows % tiles);
        for (int64_t t = 0; t < O::kPanel; t += O::kCols)
          outer_rows<O>(height, xt, k, r, panel.data(), t, c0, col_end, out, cols);
        r += height;
      }
    }
  });
}

template <class V, class Q>
void matmul_rows(const float* x, int64_t x_stride, int64_t rows, const uint8_t* w,
                 int64_t w_stride, int64_t cols, int64_t num_blocks, float* out) {
  using S = Shapes<V>;
  if (rows >= Outer<V>::kMinRows)
    return matmul_outer<V, Q>(x, x_stride, rows, w, w_stride, cols, num_blocks, out);
  // Two rows or more share each dequantized block: tiles of kRows rows, the rest in one tile of
  // as many rows. Dequantizing, not reading or multiplying, sets a tile's pace: measured on 2
  // Zen 5 cores (AVX-512, AMD EPYC family 26 model 2), a bundled-model decode step took 6.6 ms
  // at 1 row and at 4 (one 4-row tile), 10.2 at 2 and 13.2 at 3 while those ran a tile per row.
  const bool lone = rows == 1;
  const int64_t C = lone ? S::kLoneCols : S::kCols, col_tiles = (cols + C - 1) / C;
  // Threads split the outputs; each runs every row over its outputs' blocks (they stay in L1
  // while the rows stream from L2).
  at::parallel_for(0, col_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ct = begin; ct < end; ++ct) {
      const uint8_t* wp[std::max(S::kLoneCols, S::kCols)];
      for (int64_t c = 0; c < C; ++c) wp[c] = w + std::min(ct * C + c, cols - 1) * w_stride;
      if (lone) {
        run_tile<V, Q, 1, S::kLoneCols>(x, x_stride, rows, 0, wp, ct * C, cols, num_blocks, out,
                                       cols);
        continue;
      }
      int64_t r = 0;
      for (; r + S::kRows <= rows; r += S::kRows)
        run_tile<V, Q, S::kRows, S::kCols>(x, x_stride, rows, r, wp, ct * C, cols, num_blocks,
                                          out, cols);
      if (r < rows)
        run_rest<V, Q>(rows - r, x, x_stride, rows, r, wp, ct * C, cols, num_blocks, out);
    }
  });
}
#endif  // INHERENT_AVX2

template <class Q>
void matmul_rows_portable(const float* x, int64_t x_stride, int64_t rows, const uint8_t* w,
                          int64_t w_stride, int64_t cols, int64_t num_blocks, float* out) {
  at::parallel_for(0, cols, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = begin; n < end; ++n)
        out[r * cols + n] = dot_portable<Q>(x + r * x_stride, w + n * w_stride, num_blocks);
  });
}

template <class Q>
void matmul(Path path, const float* x, int64_t x_stride, int64_t rows, const uint8_t* w,
            int64_t w_stride, int64_t cols, int64_t num_blocks, float* out) {
  switch (path) {
#if defined(INHERENT_AVX512)
    case Path::kAvx512:
      return matmul_rows<Avx512, Q>(x, x_stride, rows, w, w_stride, cols, num_blocks, out);
#endif
#if defined(INHERENT_AVX2)
    case Path::kAvx2:
      return matmul_rows<Avx2, Q>(x, x_stride, rows, w, w_stride, cols, num_blocks, out);
#endif
    default:
      return matmul_rows_portable<Q>(x, x_stride, rows, w, w_stride, cols, num_blocks, out);
  }
}

}  // namespace

int64_t quant_block_bytes(int64_t qtype) {
  if (qtype == Q4_1::kType) return Q4_1::kBytes;
  if (qtype == Q8_0::kType) return Q8_0::kBytes;
  return 0;
}

// x: [M, K] float32, rows contiguous; blocks: [N, K / 32 * block bytes] uint8, the GGUF tensor's
// rows as stored; qtype: ggml's number (3 Q4_1, 8 Q8_0). Returns [M, N] float32.
at::Tensor quant_linear(at::Tensor x, at::Tensor blocks, int64_t qtype,
                        const std::string& path_name) {
  const Path path = resolve_path(path_name);
  const int64_t block_bytes = quant_block_bytes(qtype);
  TORCH_CHECK(block_bytes > 0, "GGUF block type ", qtype, " is not supported (Q4_1, Q8_0)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
              x.device().is_cpu(), "x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
              blocks.is_contiguous() && blocks.device().is_cpu(),
              "blocks must be a contiguous 2-D uint8 CPU tensor");
  const int64_t rows = x.size(0), k = x.size(1), cols = blocks.size(0);
  TORCH_CHECK(k % kBlock == 0 && blocks.size(1) == k / kBlock * block_bytes,
              "x's width does not match the blocks (", k, " columns, ", blocks.size(1),
              " bytes a row)");
  auto out = at::empty({rows, cols}, x.options());
  if (rows == 0 || cols == 0) return out;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  if (qtype == Q4_1::kType)
    matmul<Q4_1>(path, xp, x.stride(0), rows, wp, blocks.size(1), cols, k / kBlock, out.data_ptr<float>());
  else
    matmul<Q8_0>(path, xp, x.stride(0), rows, wp, blocks.size(1), cols, k / kBlock, out.data_ptr<float>());
  return out;
}
