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
// bit-identical; tiles of several rows share each dequantized block, and from kPanelMinRows rows
// a panel of columns is dequantized once into float32 for every row, so prefill rows pay less
// dequantization per weight than decode rows, without changing any output's arithmetic.
#include "simd.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <vector>

namespace {

using namespace inherent;

constexpr int64_t kBlock = 32;  // weights per GGUF block (both types)

// ggml's type numbers and block sizes
struct Q4_1 {
  static constexpr int64_t kType = 3, kBytes = 20;  // fp16 d, fp16 m, 16 bytes: q[j] low nibble,
};                                                    // q[j + 16] high nibble of byte j
struct Q8_0 {
  static constexpr int64_t kType = 8, kBytes = 34;  // fp16 d, 32 int8
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

#if defined(INHERENT_AVX512)
inline void dequant(Avx512, Q4_1, const uint8_t* b, __m512* w) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(bits16(b))), m = _mm512_set1_ps(_cvtsh_ss(bits16(b + 2)));
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
  w[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), m);
  w[1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), m);
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
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(bits16(b))), m = _mm256_set1_ps(_cvtsh_ss(bits16(b + 2)));
  const __m256i nibble = _mm256_set1_epi32(15);
  for (int i = 0; i < 2; ++i) {  // bytes 8i..8i + 7: elements 8i.. (low), 16 + 8i.. (high)
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 4 + 8 * i)));
    w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q, nibble)), m);
    w[2 + i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), m);
  }
}

inline void dequant(Avx2, Q8_0, const uint8_t* b, __m256* w) {
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(bits16(b)));
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

// Where a tile's weights come from: GGUF blocks dequantized in registers as they are read (a
// row or a few: every weight is read once), or float32 weights dequantized beforehand into a
// panel (many rows: the dequantization is paid once for all of them). Same values either way.
template <class V, class Q>
struct FromBlocks {
  static constexpr int64_t kStride = Q::kBytes;  // per block of 32 weights
  static constexpr bool kWhole = true;
  using T = uint8_t;
  static void load(const uint8_t* b, typename V::F* wv) {
    __builtin_prefetch(b + kPrefetchBytes);
    dequant(V{}, Q{}, b, wv);
  }
};

struct FromPanel {
  static constexpr bool kWhole = false;
  using T = float;
};

// R rows of x times C weight columns (outputs) over num_blocks blocks of 32. Pointers past the
// real rows/outputs repeat the last one; their results are not stored (nullptr).
template <class V, class Source, int R, int C>
void tile(const float* const* x, const typename Source::T* const* w, int64_t num_blocks,
          float* const* out) {
  using F = typename V::F;
  constexpr int kRegs = V::kRegs;
  F acc[R][C][kRegs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < kRegs; ++i) acc[r][c][i] = V::zero();
  // Register j of a block (j < 2 kRegs) goes into accumulator register j % kRegs: lanes l, then
  // l + 16, of every block in turn, whatever order the loops below visit the tile in.
  if constexpr (Source::kWhole) {  // a block dequantizes whole: all its registers at once
    for (int64_t b = 0; b < num_blocks; ++b)
      for (int c = 0; c < C; ++c) {
        F wv[2 * kRegs];
        Source::load(w[c] + b * Source::kStride, wv);
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 2 * kRegs; ++j)
            acc[r][c][j % kRegs] =
                V::fma(V::load(x[r] + b * kBlock + V::W * j), wv[j], acc[r][c][j % kRegs]);
      }
  } else {
    // A float panel: accumulator register i's chains (lanes of register i, then of kRegs + i,
    // in every block) are independent of the others', so each runs over all of k on its own,
    // R C accumulators live instead of R C kRegs. Each operand is loaded once; the empty asm
    // keeps it in its register, where the compiler would fold the load into every FMA that
    // reads it (and the loads, not the FMAs, would set the pace).
    for (int i = 0; i < kRegs; ++i)
      for (int64_t b = 0; b < num_blocks; ++b)
        for (int j = i; j < 2 * kRegs; j += kRegs) {
          F wv[C];
          for (int c = 0; c < C; ++c) {
            wv[c] = V::load(w[c] + b * kBlock + V::W * j);
            asm("" : "+x"(wv[c]));
          }
          for (int r = 0; r < R; ++r) {
            F xv = V::load(x[r] + b * kBlock + V::W * j);
            asm("" : "+x"(xv));
            for (int c = 0; c < C; ++c) acc[r][c][i] = V::fma(xv, wv[c], acc[r][c][i]);
          }
        }
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

// Rows [r0, r0 + R) x columns [c0, c0 + C) of out [rows, cols] as one tile, w[c] the source of
// column c0 + c; rows from `rows` and columns from `col_end` on are computed but not stored.
template <class V, class Source, int R, int C>
void run_tile(const float* x, int64_t x_stride, int64_t rows, int64_t r0,
              const typename Source::T* const* w, int64_t c0, int64_t col_end, int64_t num_blocks,
              float* out, int64_t cols) {
  const float* xp[R];
  float* op[R * C];
  for (int r = 0; r < R; ++r) {
    const int64_t row = std::min<int64_t>(r0 + r, rows - 1);
    xp[r] = x + row * x_stride;
    for (int c = 0; c < C; ++c)
      op[r * C + c] = r0 + r < rows && c0 + c < col_end ? out + row * cols + c0 + c : nullptr;
  }
  tile<V, Source, R, C>(xp, w, num_blocks, op);
}

// Tile shapes. A lone row: a few columns, each block dequantized once. A few rows on the blocks:
// each dequantized block serves every row of the tile. Many rows on a panel: rows x columns
// accumulators, one register each. A lone row on AVX-512 ran 16 columns a tile until measured on
// 2 Zen 5 cores (AMD EPYC family 26 model 2): a bundled-model decode step took 6.7-7.5 ms so,
// 4.3-4.6 with 4 columns (4.3-4.7 with 8).
template <class V>
struct Shapes {
  static constexpr int kLoneCols = 4;
  static constexpr int kRows = V::W == 16 ? 4 : 2, kCols = V::W == 16 ? 4 : 2;
  static constexpr int kPanelRows = 4, kPanelCols = V::W == 16 ? 4 : 2;
};

// The last rows < kRows of a block matmul as one tile of `left` rows (R counts up to it).
template <class V, class Q, int R = 1>
void run_rest(int64_t left, const float* x, int64_t x_stride, int64_t rows, int64_t r0,
              const uint8_t* const* w, int64_t c0, int64_t cols, int64_t num_blocks, float* out) {
  if constexpr (R < Shapes<V>::kRows) {
    if (left == R)
      return run_tile<V, FromBlocks<V, Q>, R, Shapes<V>::kCols>(x, x_stride, rows, r0, w, c0,
                                                                cols, num_blocks, out, cols);
    run_rest<V, Q, R + 1>(left, x, x_stride, rows, r0, w, c0, cols, num_blocks, out);
  }
}

// Rows from which a matmul dequantizes a panel of columns once for all rows, instead of each
// block once per tile of kRows rows; the panel's width (its float32 weights stay in L2 while the
// rows pass over them). Measured on 2 cores, a layer's four matmuls of the bundled model,
// against the block tiles. AVX2 kind as first measured (reported as Zen 3): equal at 8 rows,
// 1968 against 2321 us at 16, 6.7 against 7.6 ms at 64, 18.3 against 29.8 ms at 192, 52
// against 79 ms at 512 (oneDNN's float32 on the dequantized weights: 2.5, 5.5, 11.6 and 27
// ms). AVX2 kind with half-rate 256-bit arithmetic (AMD EPYC family 23 model 1), two runs
// each: equal at 6 rows (2.0 ms), 1.9-2.0 against 2.7 ms at 8, 2.4-2.6 against 4.0-4.1 at 12;
// the tiles win at 2 rows (0.7 against 1.2-1.5 ms).
constexpr int64_t kPanelMinRows = 8, kPanelWidth = 32;

template <class V, class Q>
void matmul_rows(const float* x, int64_t x_stride, int64_t rows, const uint8_t* w,
                 int64_t w_stride, int64_t cols, int64_t num_blocks, float* out) {
  using S = Shapes<V>;
  if (rows >= kPanelMinRows) {
    const int64_t k = num_blocks * kBlock, num_panels = (cols + kPanelWidth - 1) / kPanelWidth;
    at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> panel;  // reused by the next call on this thread
      panel.resize(kPanelWidth * k);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t c0 = p * kPanelWidth, width = std::min(kPanelWidth, cols - c0);
        for (int64_t c = 0; c < width; ++c)
          for (int64_t b = 0; b < num_blocks; ++b) {
            typename V::F wv[2 * V::kRegs];
            FromBlocks<V, Q>::load(w + (c0 + c) * w_stride + b * Q::kBytes, wv);
            for (int i = 0; i < 2 * V::kRegs; ++i)
              V::store(&panel[c * k + b * kBlock + V::W * i], wv[i]);
          }
        // a tile's rows stay in L1 while they pass over the panel (in L2)
        for (int64_t r = 0; r < rows; r += S::kPanelRows)
          for (int64_t t = 0; t < width; t += S::kPanelCols) {
            const float* wp[S::kPanelCols];
            for (int c = 0; c < S::kPanelCols; ++c) wp[c] = &panel[std::min(t + c, width - 1) * k];
            if (r + S::kPanelRows <= rows)
              run_tile<V, FromPanel, S::kPanelRows, S::kPanelCols>(
                  x, x_stride, rows, r, wp, c0 + t, c0 + width, num_blocks, out, cols);
            else
              for (int64_t rr = r; rr < rows; ++rr)
                run_tile<V, FromPanel, 1, S::kPanelCols>(x, x_stride, rows, rr, wp, c0 + t,
                                                            c0 + width, num_blocks, out, cols);
          }
      }
    });
    return;
  }
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
        run_tile<V, FromBlocks<V, Q>, 1, S::kLoneCols>(x, x_stride, rows, 0, wp, ct * C, cols,
                                                       num_blocks, out, cols);
        continue;
      }
      int64_t r = 0;
      for (; r + S::kRows <= rows; r += S::kRows)
        run_tile<V, FromBlocks<V, Q>, S::kRows, S::kCols>(x, x_stride, rows, r, wp, ct * C,
                                                          cols, num_blocks, out, cols);
      if (r < rows)
        run_rest<V, Q>(rows - r, x, x_stride, rows, r, wp, ct * C, cols, num_blocks, out);
    }
  });
}

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
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor blocks, int64_t qtype,
                           const std::string& path_name) {
  const Path path = resolve_path(path_name);
  const int64_t block_bytes = quant_block_bytes(qtype);
  TORCH_CHECK(block_bytes > 0, "GGUF block type ", qtype, " is not supported (Q4_1, Q8_0)");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1 &&
              x.device().is_cpu(), "x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 &&
              blocks.is_contiguous() && blocks.device().is_cpu(),
              "blocks must be a contiguous 2-D uint8 CPU tensor");
  const int64_t rows = x.size(0), k = x.size(1), cols = blocks.size(0);
  TORCH_CHECK(k % kBlock == 0 && blocks.size(1) == k / kBlock * block_bytes,
              "x's width does not match the blocks (", k, " columns, ", blocks.size(1),
              " bytes a row)");
  auto out = torch::empty({rows, cols}, x.options());
  if (rows == 0 || cols == 0) return out;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  if (qtype == Q4_1::kType)
    matmul<Q4_1>(path, xp, x.stride(0), rows, wp, blocks.size(1), cols, k / kBlock, out.data_ptr<float>());
  else
    matmul<Q8_0>(path, xp, x.stride(0), rows, wp, blocks.size(1), cols, k / kBlock, out.data_ptr<float>());
  return out;
}
