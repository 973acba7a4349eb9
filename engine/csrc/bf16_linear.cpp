// y = x @ W.T with bfloat16 inputs, float32 accumulation and a float32 result, on AVX512-BF16
// or AMX: every matmul of a model whose matmuls run bf16.
//
// Two paths, one packed weight. AVX512-BF16 (vdpbf16ps): against oneDNN's bf16 matmul (measured
// on 2 Zen 4 cores, SmolLM2-135M's 120 decoder matmuls, weights streaming from DRAM): 7.3
// against 12.3 ms for one row, equal at 32 to 192 rows. AMX (tdpbf16ps on 16x16 tiles), where
// the CPU has it: on 2 Xeon cores with AMX, vdpbf16ps ran a layer's four matmuls at 192 rows in
// 9.8 ms, slower than oneDNN's float32 GEMM (5.6 ms) and 5.6x oneDNN's AMX (1.8 ms); this path
// 0.26 against vdpbf16ps' 1.36 ms at 32 rows, 0.8-2.2 against 5.3-8.7 at 128-192 (a noisy
// host; oneDNN's AMX 0.36 and 1.5-2.1). Either
// path's result is float32, where oneDNN's is rounded to bf16 (logits 0.125 apart near 25 tie
// often); and each output element is one fixed chain over k, so it depends on its own row of x
// and column of W only: batch-invariant by construction, at any row count, on either path. The
// two paths add each pair's two products in opposite orders (the instructions' definitions), so
// their bits differ: a CPU runs one of them for every row count.
//
// Weights are packed once into panels of 16 output columns, k in pairs: [N/16][K/2][16][2], the
// layout vdpbf16ps reads (each 32-bit lane holds one column's pair) and an AMX B tile is (16 k
// pairs of a panel: 1 KB). Panels are padded to an even count and pairs to a multiple of 16
// (whole tiles). vdpbf16ps broadcasts a row of x's bf16 pairs against two panels (a lone row:
// four, for more streams from memory); AMX runs 32 rows x 32 columns (2 A tiles, 2 B tiles, 4
// accumulator tiles) per pass over k, or, for up to 16 rows, 16 x 64 (1 A tile, 4 panels, 4
// accumulator tiles: amx_quad).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define INHERENT_AMX 1
#endif

namespace {

using namespace inherent;

constexpr int64_t kPanel = 16;      // output columns per panel: one register of float32
constexpr int64_t kTilePairs = 16;  // k pairs in an AMX tile row block (64-byte tile rows)

#if defined(__AVX512BF16__) || defined(INHERENT_AMX)
// n floats as bf16 with c10::BFloat16's rounding, as torch's conversion rounds: to nearest even,
// a NaN as 0x7FC0.
inline void to_bf16(const float* src, int64_t n, at::BFloat16* dst) {
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF),
                nan = _mm512_set1_epi32(0x7FC0);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(src + j);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(half, lsb)), 16);
    rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), _mm512_cvtepi32_epi16(rounded));
  }
  for (; j < n; ++j) dst[j] = at::BFloat16(src[j]);
}

// x [rows, k] (float32 or bfloat16, rows contiguous) as bf16 rows of `ld` elements, zeros after
// k and in rows rows..padded_rows - 1, in a 64-byte aligned buffer the calling thread keeps
// (valid until its next call). Made with a tensor's zeros, narrows and copy (ten ATen calls a
// matmul), a layer's four AMX matmuls took 10-16 % longer at 1 and 16 rows and 5 % at 64, the
// AVX512-BF16 path's 8 % at 1 row (2 Xeon cores, family 6 model 207; medians of calls
// interleaved in one process, the same bits).
const at::BFloat16* bf16_rows(const at::Tensor& x, int64_t padded_rows, int64_t ld) {
  thread_local std::vector<at::BFloat16> buffer;
  buffer.resize(padded_rows * ld + 32);
  at::BFloat16* xb = reinterpret_cast<at::BFloat16*>(
      (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));  // whole tile rows
  const int64_t rows = x.size(0), k = x.size(1), row_bytes = x.stride(0) * x.element_size();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const char* x0 = static_cast<const char*>(x.data_ptr());
  // split only for prefill-sized inputs: 1-16 rows convert faster than threads wake
  at::parallel_for(0, padded_rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      at::BFloat16* row = xb + r * ld;
      const char* src = x0 + r * row_bytes;
      if (r < rows && bf16) std::copy_n(reinterpret_cast<const at::BFloat16*>(src), k, row);
      else if (r < rows) to_bf16(reinterpret_cast<const float*>(src), k, row);
      std::fill(row + (r < rows ? k : 0), row + ld, at::BFloat16(0.f));
    }
  });
  return xb;
}
#endif

#if defined(__AVX512BF16__)
constexpr bool kSupported = true;

// kRows rows of x (bf16 pairs, `pairs` per row) times kPanels panels from p0 (`stride` pairs
// each) into out[rows][columns]; k pairs ask_begin..ask_end - 1 of the kPanels panels at `ask`
// are asked for into L2 meanwhile (bf16_linear).
template <int kRows, int kPanels>
void panel_group(const uint32_t* x, int64_t pairs, const uint32_t* panels, int64_t stride,
                 int64_t p0, float* out, int64_t columns, const uint32_t* ask, int64_t ask_begin,
                 int64_t ask_end) {
  const int64_t np = std::min<int64_t>(kPanels, (columns - p0 * kPanel + kPanel - 1) / kPanel);
  __m512 acc[kRows][kPanels];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kPanels; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint32_t* w = panels + p0 * stride * kPanel;
  for (int64_t k = 0; k < pairs; ++k) {
    if (k >= ask_begin && k < ask_end) {
      for (int j = 0; j < kPanels; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(ask + (j * stride + k) * kPanel), _MM_HINT_T1);
    }
    __m512bh b[kPanels];
    for (int j = 0; j < kPanels; ++j)  // panels: even, so a group's are all there
      b[j] = (__m512bh)_mm512_loadu_si512(w + (j * stride + k) * kPanel);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * pairs + k]));
      for (int j = 0; j < kPanels; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int64_t p = 0; p < np; ++p) {
    const int64_t first = (p0 + p) * kPanel;
    const __mmask16 keep = first + kPanel <= columns ? __mmask16(0xFFFF)
                                                     : __mmask16((1u << (columns - first)) - 1);
    for (int r = 0; r < kRows; ++r)
      _mm512_mask_storeu_ps(out + r * columns + first, keep, acc[r][p]);
  }
}
#else
constexpr bool kSupported = false;
#endif

#if defined(INHERENT_AMX)
// Linux hands a process the AMX tile state only once it asks (arch_prctl), once per process.
bool amx_granted() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// Every tile 16 rows of 64 bytes, but for x and the accumulators of fewer than 16 rows of x:
// tiles 0-3 accumulate, 4 (and 5, for a second row block) hold x, the others panels.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int64_t x_rows) {
    for (int t = 0; t < 8; ++t) bytes_per_row[t] = 64, rows[t] = 16;
    if (x_rows < 16) rows[0] = rows[1] = rows[2] = rows[3] = rows[4] = uint8_t(x_rows);
  }
};

// A tile of a panel (1 KB: 16 lines) into L1.
inline void prefetch_tile(const uint32_t* tile) {
  const char* line = reinterpret_cast<const char*>(tile);
  for (int i = 0; i < 16; ++i) _mm_prefetch(line + i * 64, _MM_HINT_T0);
}

// kATiles * 16 rows of x (bf16, `ldx` elements a row, k padded to whole tiles) times panels w0,
// w1 (their tiles 1 KB apart) over `k_tiles` tiles into c [kATiles * 16][32], its rows `ldc`
// floats apart. The next step's panel tiles are asked into L1 a step ahead: tile registers are
// not renamed, so a tile load waits for the dot products that read its register, then they wait
// for it, and a load from L2 or memory stalls both. The bundled model's 120 decoder matmuls,
// asked against not asked (2 Xeon cores, family 6 model 207, medians of 12-14, variants
// alternated in one process after a 300 MB sweep each, the same bits): 17-32 rows 0.92-0.94x, 64
// rows 0.93-0.96x, 128-192 rows 0.98-1.0x on a quiet host; 0.72x, 0.77x and 0.88x at 32, 64 and
// 192 rows while a neighbour loaded it; up to 16 rows (amx_quad) unchanged. Not kept: two steps
// ahead (no better), x's tiles too (no better), the next panel pair into L2 (0.96-0.98x alone,
// no better beside this), blocking k so a chunk of the panels stays in L1 across row blocks
// (1.03-1.2x slower: the accumulators' store and reload cost more).
template <int kATiles>
void amx_block(const at::BFloat16* x, int64_t ldx, const uint32_t* w0, const uint32_t* w1,
               int64_t k_tiles, float* c, int64_t ldc) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kATiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = ldx * sizeof(at::BFloat16);
  for (int64_t t = 0; t < k_tiles; ++t) {
    const int64_t k = t * 2 * kTilePairs;
    if (t + 1 < k_tiles) {
      prefetch_tile(w0 + (t + 1) * kTilePairs * kPanel);
      prefetch_tile(w1 + (t + 1) * kTilePairs * kPanel);
    }
    _tile_loadd(6, w0 + t * kTilePairs * kPanel, 64);
    _tile_loadd(7, w1 + t * kTilePairs * kPanel, 64);
    _tile_loadd(4, x + k, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kATiles == 2) {
      _tile_loadd(5, x + 16 * ldx + k, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t c_stride = ldc * sizeof(float);
  _tile_stored(0, c, c_stride);
  _tile_stored(1, c + kPanel, c_stride);
  if constexpr (kATiles == 2) {
    _tile_stored(2, c + 16 * ldc, c_stride);
    _tile_stored(3, c + 16 * ldc + kPanel, c_stride);
  }
}

// Up to 16 rows of x (as amx_block) times four panels from w (their tiles 1 KB apart, the
// panels `panel` elements apart) into c [16][64]: four accumulator chains (tiles 0-3) in
// flight instead of two, x in tile 4, the panels taking turns in 5-7. Each chain adds the
// same products in the same order as amx_block's: the same bits. The bundled model's 120
// decoder matmuls against amx_block's pairs (2 Xeon cores, family 6 model 167, a noisy host;
// medians of 30, builds alternated twice): 1 row 7.6-8.6 against 8.4-8.9 ms, 4 rows 8.4-8.9
// against 8.5-9.3, 16 rows 8.9-9.4 against 9.5-10.3.
void amx_quad(const at::BFloat16* x, int64_t ldx, const uint32_t* w, int64_t panel,
              int64_t k_tiles, float* c) {
  _tile_zero(0);  // the tile intrinsics take constant tile numbers only
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t x_stride = ldx * sizeof(at::BFloat16);
  for (int64_t t = 0; t < k_tiles; ++t) {
    const uint32_t* wt = w + t * kTilePairs * kPanel;
    _tile_loadd(4, x + t * 2 * kTilePairs, x_stride);
    _tile_loadd(5, wt, 64);
    _tile_loadd(6, wt + panel, 64);
    _tile_loadd(7, wt + 2 * panel, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, wt + 3 * panel, 64);  // once the first dot product has read it
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  constexpr int64_t kCStride = 4 * kPanel * sizeof(float);
  _tile_stored(0, c, kCStride);
  _tile_stored(1, c + kPanel, kCStride);
  _tile_stored(2, c + 2 * kPanel, kCStride);
  _tile_stored(3, c + 3 * kPanel, kCStride);
}

// x [rows, k] (float32 or bfloat16) times the packed weight into out [rows, columns], on AMX.
void amx_linear(const at::Tensor& x, const uint32_t* wp, int64_t num_panels, int64_t stride,
                float* op, int64_t columns) {
  const int64_t rows = x.size(0);
  const int64_t a_tiles = rows <= 16 ? 1 : 2, block_rows = 16 * a_tiles;
  const int64_t padded_rows = (rows + block_rows - 1) / block_rows * block_rows;
  const int64_t ldx = stride * 2, k_tiles = stride / kTilePairs;
  const at::BFloat16* xp = bf16_rows(x, padded_rows, ldx);  // whole row blocks and k tiles
  const int64_t groups = num_panels / 2;
  // A thread takes whole panel pairs; every row block passes over a pair while it is in
  // cache (36 KB at k = 576). Every matmul splits across the threads, however few its rows: a
  // decode step's weights stream from memory, and one core reads them at half the rate two do
  // (the bundled model's decoder matmuls at 1 row on 2 Xeon cores: 8.5 against 12 ms with
  // matrices of up to 1,024 columns on one thread; docs/architecture.md).
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    const TileConfig config(rows);
    _tile_loadconfig(&config);
    alignas(64) float c[32 * 2 * kPanel];
    int64_t g = begin;
    for (; a_tiles == 1 && g + 1 < end; g += 2) {  // two pairs at once
      const int64_t first = 2 * g * kPanel, width = std::min(4 * kPanel, columns - first);
      amx_quad(xp, ldx, wp + 2 * g * stride * kPanel, stride * kPanel, k_tiles, c);
      for (int64_t i = 0; i < rows; ++i)
        std::copy_n(c + i * 4 * kPanel, width, op + i * columns + first);
    }
    // Blocks of 32 rows store their accumulators straight into out where they fill it (every
    // column of their panels, every row of the block), else through c. Copying every block out
    // of c took 5 % of a throughput run's time (perf). Straight, 30 layers' four matmuls took
    // 0.85-0.95x the time at 192 rows, 0.94-0.95x at 128 and 0.95-1.05x at 64; up to 16 rows
    // (amx_quad's tiles) 1.06-1.09x, so those keep c (2 Xeon cores, family 6 model 207, medians
    // of calls interleaved between two builds in one process, the same bits).
    for (; g < end; ++g) {
      const uint32_t* w0 = wp + 2 * g * stride * kPanel;
      const uint32_t* w1 = w0 + stride * kPanel;
      const int64_t first = 2 * g * kPanel, width = std::min(2 * kPanel, columns - first);
      for (int64_t r = 0; r < rows; r += block_rows) {
        const int64_t valid = std::min(block_rows, rows - r);
        const bool whole = a_tiles == 2 && width == 2 * kPanel && valid == block_rows;
        float* dst = whole ? op + r * columns + first : c;
        const int64_t ldc = whole ? columns : 2 * kPanel;
        if (a_tiles == 1)
          amx_block<1>(xp + r * ldx, ldx, w0, w1, k_tiles, dst, ldc);
        else
          amx_block<2>(xp + r * ldx, ldx, w0, w1, k_tiles, dst, ldc);
        for (int64_t i = 0; !whole && i < valid; ++i)
          std::copy_n(c + i * 2 * kPanel, width, op + (r + i) * columns + first);
      }
    }
    _tile_release();
  });
}
#endif

bool amx_available() {
#if defined(INHERENT_AMX)
  return amx_granted();
#else
  return false;
#endif
}

}  // namespace

bool bf16_linear_supported() { return kSupported || amx_available(); }

std::vector<std::string> bf16_linear_paths() {
  std::vector<std::string> paths;
  if (amx_available()) paths.emplace_back("amx");
  if (kSupported) paths.emplace_back("avx512");
  return paths;
}

// w: [N, K] float32 or bfloat16. Returns the packed weight, [panels, pairs, 16, 2] bfloat16 with
// panels = ceil(N/16) rounded up to even and pairs = ceil(K/2) up to a multiple of 16 (zeros).
at::Tensor pack_bf16_weight(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu(), "weight must be a 2-D CPU tensor");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = (n + 2 * kPanel - 1) / (2 * kPanel) * 2;
  const int64_t pairs = ((k + 1) / 2 + kTilePairs - 1) / kTilePairs * kTilePairs;
  auto padded = at::zeros({panels * kPanel, pairs * 2}, w.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(w);  // rounds to nearest even, as .to() does
  // [panels, 16, pairs, 2] -> [panels, pairs, 16, 2]
  return padded.view({panels, kPanel, pairs, 2}).transpose(1, 2).contiguous();
}

// x: [M, K] float32 or bfloat16, rows contiguous; packed from pack_bf16_weight; columns: N;
// path: "auto" (AMX where granted, else AVX512-BF16), "amx" or "avx512". Returns [M, N] float32.
at::Tensor bf16_linear(at::Tensor x, at::Tensor packed, int64_t columns,
                       const std::string& path) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(),
              "x must be a 2-D float32 or bfloat16 CPU tensor with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
              packed.is_contiguous() && packed.size(2) == kPanel && packed.size(3) == 2 &&
              packed.size(0) % 2 == 0 && packed.size(1) % kTilePairs == 0,
              "packed must come from pack_bf16_weight");
  const int64_t rows = x.size(0), k = x.size(1), num_panels = packed.size(0),
                stride = packed.size(1), pairs = (k + 1) / 2;
  TORCH_CHECK(stride == (pairs + kTilePairs - 1) / kTilePairs * kTilePairs &&
              columns <= num_panels * kPanel && columns > (num_panels - 2) * kPanel,
              "x or columns do not match the packed weight");
  TORCH_CHECK(path == "auto" || path == "amx" || path == "avx512",
              "unknown bf16_linear path '", path, "' (auto, amx, avx512)");
  const bool amx = path == "amx" || (path == "auto" && amx_available());
  TORCH_CHECK(amx ? amx_available() : kSupported, "bf16_linear: this CPU or build has no ",
              amx ? "AMX" : "AVX512-BF16", " path");
  auto out = at::empty({rows, columns}, x.options().dtype(at::kFloat));
  if (rows == 0) return out;
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
#if defined(INHERENT_AMX)
  if (amx) {
    amx_linear(x, wp, num_panels, stride, op, columns);
    return out;
  }
#endif
#if defined(__AVX512BF16__)
  // x as bf16 pairs, an odd k padded with zero
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(bf16_rows(x, rows, 2 * pairs));
  constexpr int64_t kRowBlock = 6;  // 6 rows x 2 panels: 12 accumulators
  constexpr int64_t kAheadLines = 16;  // how far one row asks ahead of its own loads
  // Threads split panel pairs; every thread runs all rows over its panels (the panel stays
  // in L1 while the rows, a few hundred KB of bf16, stream from L2).
  // While a thread's row blocks run over a panel pair, each asks for its share of the next
  // pair's lines into L2: the hardware prefetchers stop at every 4 KB page, and the panels'
  // reads from memory did not overlap the dot products. The bundled model's 120 decoder
  // matmuls, weights out of cache (2 Zen 5 cores, AMD EPYC family 26 model 2, medians of 9 calls
  // after a 320 MB sweep each, builds alternated six times): 4 rows 4.3-4.6 against 5.0-5.2 ms,
  // 16 rows 7.6-8.1 against 8.7-9.0 (the weights in cache: 4.8), 192 rows 51-54 against 55-56.
  // A later session there, on an hour when torch's matrix-vector product read 73-77 GB/s (the
  // 120 matmuls and the LM head, medians of 16-24 after a 400 MB sweep each, in one process):
  // 2 rows 6.9-7.2 against 7.7-8.1 ms, 3 rows 7.7-7.9 against 8.8-9.1; the engine's decode steps
  // of 2 and 3 sequences at 450, 12.0 against 12.5 ms and 14.1 against 15.3. One row's dot
  // products are too short to cover a whole pair's asks (7.10 against 7.02 ms): it asks for the
  // lines beyond its loads instead, 32 on: 5.85-6.17 against 6.27-6.75 without asks (16 lines
  // 6.59, 48 5.94, 64 5.81-6.22, 128 6.06); more rows asking so lost 4 % at 4, 6 and 16 rows.
  // On a Zen 4 (family 25 model 17, 2 cores; the 120 decoder matmuls as the engine fuses them
  // and the LM head, alternated in one process, medians of 12) one row reads two pairs at a
  // time, four streams of weights instead of two, each asked 16 lines on: 8.48, 8.04 and 9.14
  // ms in three runs against 9.49, 8.57 and 10.04 for one pair asking 32 on (8 lines 8.56, 24
  // 8.69, four pairs 8.62; two pairs asking for the next two 9.96); the engine's batch-1 decode
  // 10.01 against 10.54 ms, faster in 13 of 16. 2 and 3 rows read so tied or lost (8.46 against
  // 8.44, 8.55 against 8.22). Not measured on the Zen 5. Asking never changes a result's bits,
  // nor does the number of panels a pass (each column keeps its one chain over k).
  // by row count, one pair: full blocks, then the remainder's instance
  using Block = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t, float*,
                         int64_t, const uint32_t*, int64_t, int64_t);
  constexpr Block by_rows[kRowBlock + 1] = {nullptr,           panel_group<1, 2>,
                                            panel_group<2, 2>, panel_group<3, 2>,
                                            panel_group<4, 2>, panel_group<5, 2>,
                                            panel_group<6, 2>};
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, num_panels / 2, 16, [&](int64_t begin, int64_t end) {
    for (int64_t pp = begin, group; pp < end; pp += group) {
      // One row: two pairs at a time where this thread has them, asking for its own lines
      // kAheadLines on (past the group's end, the next group's; never past the weight's). More
      // rows: one pair at a time, asking for the next pair's lines within this thread's pairs.
      const bool one = rows == 1;
      group = one && pp + 1 < end ? 2 : 1;
      const uint32_t* pair = wp + 2 * pp * stride * kPanel;
      const uint32_t* ask = one ? pair + kAheadLines * kPanel : pair + 2 * stride * kPanel;
      const int64_t ask_pairs =
          one ? (pp + group < num_panels / 2
                     ? pairs
                     : std::clamp<int64_t>(stride - kAheadLines, 0, pairs))
              : (pp + 1 < end ? pairs : 0);
      if (group == 2) {
        panel_group<1, 4>(xp, pairs, wp, stride, 2 * pp, op, columns, ask, 0, ask_pairs);
        continue;
      }
      for (int64_t b = 0, r = 0; r < rows; ++b, r += kRowBlock)  // block b: its share
        by_rows[std::min(kRowBlock, rows - r)](xp + r * pairs, pairs, wp, stride, 2 * pp,
                                               op + r * columns, columns, ask,
                                               b * ask_pairs / blocks,
                                               (b + 1) * ask_pairs / blocks);
    }
  });
#endif
  return out;
}

// ---- The same products with the weight read as GGUF blocks ----------------------------------
//
// block_bf16_linear computes bf16_linear's AVX512-BF16 result bit for bit -- each column one
// vdpbf16ps chain over k pairs, ascending, from zero -- but reads the weight as GGUF blocks
// (Q4_1: 0.625 bytes a weight, Q8_0: 1.06, against bf16's 2) and rounds each dequantized weight
// to bf16 in registers. Dequantizing is exact in float32 (d * q has at most 19 significant
// bits), so a weight is the loader's float32 weight, and its bf16 rounding (to nearest even,
// as vcvtne2ps2bf16 rounds; with fp16 d and m a weight is 0 or at least 2^-24 in magnitude,
// never a denormal, which that instruction would flush) is what pack_bf16_weight stores: a
// step may take either kernel for any row and the answer's bits are the same. Batch-invariant
// mode thus reads the blocks for decode steps of up to 16 rows (8 on Zen 4) on CPUs without AMX:
// the bundled model's batch-1 decode 3.6-4.0 ms against 6.2-7.0 on the bf16 kernel (2 Zen 5
// cores; engine/model.py BLOCK_BF16_MAX_ROWS).
//
// Blocks are repacked once (pack_block_bf16) into records of one 16-column panel by one
// 32-weight block, each k pair's 32 weights in the lanes vdpbf16ps reads: per 32-bit lane i < 8
// column i's pair, from a first half of 8 columns, the second half the other 8, so one
// vcvtne2ps2bf16 of the halves' float32 weights makes the operand. A record:
//   Q4_1 (320 bytes): 16 fp16 d, 16 fp16 m, then for each two steps (k pairs 2t, 2t + 1) two
//     16-byte halves, byte 2c + e holding column c's weight k = 2 * 2t + e in its low nibble
//     and k = 2 * (2t + 1) + e in its high one;
//   Q8_0 (544 bytes): 16 fp16 d, then for each step two 16-byte halves of int8 weights.
// Columns past N are zero weights.

namespace {

constexpr int64_t kBlockWeights = 32, kPairsPerBlock = 16;  // a GGUF block: 16 k pairs

int64_t block_record_bytes(int64_t qtype) {
  if (qtype == kGgmlQ4_1) return 64 + 8 * 32;
  if (qtype == kGgmlQ8_0) return 32 + 16 * 32;
  return 0;
}

#if defined(__AVX512BF16__)
// A record's 16 fp16 scales at p as half h's lanes take them: lane 2c + e of a half is its
// column c (the first half's columns 0-7, the second's 8-15).
inline __m512 half_scales(const uint8_t* p, int h) {
  const __m512 per_column =
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i lanes = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                       _mm512_set1_epi32(16 * h)), 1);
  return _mm512_permutexvar_ps(lanes, per_column);
}

struct Q4_1Record {
  __m512 d[2], m[2];
  void load(const uint8_t* r) {
    for (int h = 0; h < 2; ++h) d[h] = half_scales(r, h), m[h] = half_scales(r + 32, h);
  }
  // steps 2t and 2t + 1 as vdpbf16ps operands
  void pair(const uint8_t* r, int t, __m512bh& first, __m512bh& second) const {
    const uint8_t* q = r + 64 + t * 32;
    const __m512i nibble = _mm512_set1_epi32(15);
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i b =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    const auto weight = [&](__m512i v, int h) {
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), d[h], m[h]);  // exact product: one rounding
    };
    first = _mm512_cvtne2ps_pbh(weight(_mm512_and_si512(b, nibble), 1),
                                weight(_mm512_and_si512(a, nibble), 0));
    second = _mm512_cvtne2ps_pbh(weight(_mm512_srli_epi32(b, 4), 1),
                                 weight(_mm512_srli_epi32(a, 4), 0));
  }
};

struct Q8_0Record {
  __m512 d[2];
  void load(const uint8_t* r) {
    for (int h = 0; h < 2; ++h) d[h] = half_scales(r, h);
  }
  void pair(const uint8_t* r, int t, __m512bh& first, __m512bh& second) const {
    const auto step = [&](int s) {
      const uint8_t* q = r + 32 + s * 32;
      const auto weight = [&](const uint8_t* half, int h) {
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(half)))),
                             d[h]);
      };
      return _mm512_cvtne2ps_pbh(weight(q + 16, 1), weight(q, 0));
    };
    first = step(2 * t);
    second = step(2 * t + 1);
  }
};

// How far a group asks for each panel's records ahead of its loads (into L1). The bundled
// model's 120 decoder matmuls and LM head at one row, weights out of cache (2 Zen 5 cores, AMD
// EPYC family 26 model 2; medians of 12, beside the float32 blocks kernel in the same run):
// without asks 4.7-4.8 ms where the float32 blocks took 3.3-3.4; asking 2 records ahead
// 3.78-3.79 against 3.41-3.45, 4 ahead 3.52-3.65 against 3.29-3.48, 8 ahead 3.93-4.06 against
// 3.47-3.65. Each panel's records are one stream, but the hardware's prefetchers stop at pages.
// A panel's last records ask for the first ones of the same panel in the thread's next group
// (the `next_panels` panels right after this group's), not of the panel after it, which this
// group reads already: a panel of the bundled model is 18-48 records, so each group began with
// all but one stream cold.
// Against asks that ran on into the next panel (2 Zen 5 cores, family 26 model 2, weights on
// huge pages, alternated builds): a 3,072 x 576 Q4_1 matmul at one row out of cache 27.2-27.6
// against 34.3-36.1 us (in cache 23.9-25.6 either way); the 120 decoder matmuls and the Q8_0 LM
// head 2.20-2.40 against 2.65-2.71 ms at one row, 2.89-3.03 against 3.40-3.84 at two, even at 8
// and 16 (4.37-4.97 against 4.41-4.66, 7.20-8.08 against 7.30-8.16); the engine's batch-1 decode
// after a 128-token prompt 2.94-3.14 against 3.37-3.73 ms (three alternations).
constexpr int64_t kAheadRecords = 4;

// kRows rows of x (bf16 pairs, `pairs` a row) times kPanels panels of records from `records`
// (`blocks` records a panel) into out[rows][columns] from column `first`; the thread's next
// group is the `next_panels` panels that follow them.
template <class Record, int kRows, int kPanels>
void block_panel_group(const uint32_t* x, int64_t pairs, const uint8_t* records,
                       int64_t blocks, int64_t record_bytes, float* out, int64_t columns,
                       int64_t first, int64_t next_panels) {
  __m512 acc[kRows][kPanels];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kPanels; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec[kPanels];
    Record scales[kPanels];
    for (int j = 0; j < kPanels; ++j) {
      rec[j] = records + (j * blocks + b) * record_bytes;
      scales[j].load(rec[j]);
      const int64_t ahead = b + kAheadRecords;
      const uint8_t* ask =
          ahead < blocks ? rec[j] + kAheadRecords * record_bytes
          : j < next_panels && ahead < 2 * blocks  // panels shorter than the asks' reach
              ? records + ((kPanels + j) * blocks + ahead - blocks) * record_bytes
              : nullptr;
      if (ask != nullptr)
        for (int64_t line = 0; line < record_bytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ask + line), _MM_HINT_T0);
    }
    for (int t = 0; t < kPairsPerBlock / 2; ++t) {
      __m512bh first_step[kPanels], second_step[kPanels];
      for (int j = 0; j < kPanels; ++j) scales[j].pair(rec[j], t, first_step[j], second_step[j]);
      const int64_t k = b * kPairsPerBlock + 2 * t;
      for (int r = 0; r < kRows; ++r) {
        const __m512bh a0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * pairs + k]));
        const __m512bh a1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * pairs + k + 1]));
        for (int j = 0; j < kPanels; ++j) {
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a0, first_step[j]);
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a1, second_step[j]);
        }
      }
    }
  }
  for (int j = 0; j < kPanels; ++j) {
    const int64_t col = first + j * kPanel;
    if (col >= columns) break;
    const __mmask16 keep = col + kPanel <= columns ? __mmask16(0xFFFF)
                                                   : __mmask16((1u << (columns - col)) - 1);
    for (int r = 0; r < kRows; ++r) _mm512_mask_storeu_ps(out + r * columns + col, keep, acc[r][j]);
  }
}

// Threads split the panels in pairs. One row reads four panels a pass (four weight streams:
// 4.7-4.8 ms against 5.4 for two in the run above, before the asks), two rows two; more rows one
// panel in blocks of up to 16 rows, so that dequantizing a record serves them all (the engine's
// decode steps of 16 rows 14.3 ms against 16.1 on the bf16 kernel, where blocks of 8 rows tied
// it; 3 and 4 rows 5.0 and 5.8 ms against 5.4-5.6 and 5.8-6.6 for two panels of 3 or 4 rows).
template <class Record>
void block_bf16_matmul(const uint32_t* xp, int64_t rows, int64_t pairs, const uint8_t* wp,
                       int64_t num_panels, int64_t blocks, int64_t record_bytes, float* op,
                       int64_t columns) {
  using Group = void (*)(const uint32_t*, int64_t, const uint8_t*, int64_t, int64_t, float*,
                         int64_t, int64_t, int64_t);
  constexpr Group two_panels[3] = {nullptr, block_panel_group<Record, 1, 2>,
                                   block_panel_group<Record, 2, 2>};
  constexpr int64_t kRowBlock = 16;
  constexpr Group one_panel[kRowBlock + 1] = {
      nullptr, block_panel_group<Record, 1, 1>, block_panel_group<Record, 2, 1>,
      block_panel_group<Record, 3, 1>, block_panel_group<Record, 4, 1>,
      block_panel_group<Record, 5, 1>, block_panel_group<Record, 6, 1>,
      block_panel_group<Record, 7, 1>, block_panel_group<Record, 8, 1>,
      block_panel_group<Record, 9, 1>, block_panel_group<Record, 10, 1>,
      block_panel_group<Record, 11, 1>, block_panel_group<Record, 12, 1>,
      block_panel_group<Record, 13, 1>, block_panel_group<Record, 14, 1>,
      block_panel_group<Record, 15, 1>, block_panel_group<Record, 16, 1>};
  const int64_t panel_bytes = blocks * record_bytes;
  at::parallel_for(0, (num_panels + 1) / 2, 8, [&](int64_t begin, int64_t end) {
    const int64_t last = std::min(2 * end, num_panels);
    for (int64_t p = 2 * begin, group; p < last; p += group) {
      const uint8_t* w = wp + p * panel_bytes;
      group = rows == 1 && p + 4 <= last ? 4 : rows <= 2 && p + 2 <= last ? 2 : 1;
      const int64_t next_panels = std::min<int64_t>(group, last - p - group);
      if (group == 4) {
        block_panel_group<Record, 1, 4>(xp, pairs, w, blocks, record_bytes, op, columns,
                                        p * kPanel, next_panels);
      } else if (group == 2) {
        two_panels[rows](xp, pairs, w, blocks, record_bytes, op, columns, p * kPanel, next_panels);
      } else {
        for (int64_t r = 0; r < rows; r += kRowBlock)
          one_panel[std::min(kRowBlock, rows - r)](xp + r * pairs, pairs, w, blocks,
                                                   record_bytes, op + r * columns, columns,
                                                   p * kPanel, next_panels);
      }
    }
  });
}
#endif

}  // namespace

// blocks: [N, K / 32 * block bytes] uint8, a GGUF tensor's rows as stored; qtype 3 (Q4_1) or 8
// (Q8_0). Returns the records block_bf16_linear reads, [ceil(N / 16), K / 32, record bytes].
at::Tensor pack_block_bf16(at::Tensor blocks, int64_t qtype) {
  const int64_t record_bytes = block_record_bytes(qtype);
  TORCH_CHECK(record_bytes > 0, "GGUF block type ", qtype, " is not supported (Q4_1, Q8_0)");
  const int64_t block_bytes = quant_block_bytes(qtype);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.device().is_cpu() &&
              blocks.size(1) % block_bytes == 0,
              "blocks must be a 2-D uint8 CPU tensor of whole blocks");
  const at::Tensor src = blocks.contiguous();
  const int64_t n = src.size(0), num_blocks = src.size(1) / block_bytes;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  auto packed = at::zeros({panels, num_blocks, record_bytes}, src.options());
  const uint8_t* in = src.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  for (int64_t col = 0; col < n; ++col) {
    const int64_t c = col % kPanel, h = c / 8, lane = 2 * (c % 8);
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* blk = in + (col * num_blocks + b) * block_bytes;
      uint8_t* rec = out + ((col / kPanel) * num_blocks + b) * record_bytes;
      std::memcpy(rec + 2 * c, blk, 2);  // d
      if (qtype == kGgmlQ4_1) {
        std::memcpy(rec + 32 + 2 * c, blk + 2, 2);  // m
        // the block's weights unpacked first: GCC 12.2 at -O3 vectorized a lookup picking the
        // low or high nibble per k into wrong bytes
        uint8_t q[kBlockWeights];
        for (int64_t j = 0; j < 16; ++j) q[j] = blk[4 + j] & 15, q[j + 16] = blk[4 + j] >> 4;
        for (int64_t t = 0; t < kPairsPerBlock / 2; ++t)
          for (int64_t e = 0; e < 2; ++e)
            rec[64 + t * 32 + h * 16 + lane + e] = uint8_t(q[4 * t + e] | q[4 * t + 2 + e] << 4);
      } else {
        for (int64_t s = 0; s < kPairsPerBlock; ++s)
          for (int64_t e = 0; e < 2; ++e) rec[32 + s * 32 + h * 16 + lane + e] = blk[2 + 2 * s + e];
      }
    }
  }
  return packed;
}

// x: [M, K] float32 or bfloat16, rows contiguous; packed from pack_block_bf16 (qtype as there);
// columns: N. bf16_linear's AVX512-BF16 result on the dequantized weight, bit for bit.
at::Tensor block_bf16_linear(at::Tensor x, at::Tensor packed, int64_t qtype, int64_t columns) {
  TORCH_CHECK(kSupported, "block_bf16_linear: this CPU or build has no AVX512-BF16 path");
  const int64_t record_bytes = block_record_bytes(qtype);
  TORCH_CHECK(record_bytes > 0, "GGUF block type ", qtype, " is not supported (Q4_1, Q8_0)");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(),
              "x must be a 2-D float32 or bfloat16 CPU tensor with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
              packed.size(2) == record_bytes, "packed must come from pack_block_bf16");
  const int64_t rows = x.size(0), k = x.size(1), num_panels = packed.size(0),
                blocks = packed.size(1);
  TORCH_CHECK(k == blocks * kBlockWeights && columns <= num_panels * kPanel &&
              columns > (num_panels - 1) * kPanel,
              "x or columns do not match the packed weight");
  auto out = at::empty({rows, columns}, x.options().dtype(at::kFloat));
  if (rows == 0) return out;
#if defined(__AVX512BF16__)
  const int64_t pairs = k / 2;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(bf16_rows(x, rows, k));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  if (qtype == kGgmlQ4_1)
    block_bf16_matmul<Q4_1Record>(xp, rows, pairs, wp, num_panels, blocks, record_bytes,
                                  out.data_ptr<float>(), columns);
  else
    block_bf16_matmul<Q8_0Record>(xp, rows, pairs, wp, num_panels, blocks, record_bytes,
                                  out.data_ptr<float>(), columns);
#endif
  return out;
}
