// y = x @ W.T with bfloat16 inputs, float32 accumulation and a float32 result, on AVX512-BF16:
// every matmul of a model whose matmuls run bf16.
//
// Against oneDNN's bf16 matmul (measured on 2 Zen 4 cores, SmolLM2-135M's 120 decoder matmuls,
// weights streaming from DRAM): 7.3 against 12.3 ms for one row, equal at 32 to 192 rows; its
// result is float32, where oneDNN's is rounded to bf16 (logits 0.125 apart near 25 tie often);
// and each output element is one fixed chain of vdpbf16ps over k, so it depends on its own row
// of x and column of W only: batch-invariant by construction, at any row count.
//
// Weights are packed once into panels of 16 output columns, k in pairs: [N/16][K/2][16][2], the
// layout vdpbf16ps reads (each 32-bit lane holds one column's pair). A row of x is rounded to
// bf16 pairs, each broadcast against a panel.
#include "kernels.h"

#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace inherent;

constexpr int64_t kPanel = 16;  // output columns per panel: one register of float32

#if defined(__AVX512BF16__)
constexpr bool kSupported = true;

// kRows rows of x (bf16 pairs, `pairs` per row) times panels p0, p0 + 1 into out[rows][columns].
template <int kRows>
void panel_pair(const uint32_t* x, int64_t pairs, const uint32_t* panels, int64_t p0,
                int64_t num_panels, float* out, int64_t columns) {
  const int64_t np = std::min<int64_t>(2, num_panels - p0);
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint32_t* w0 = panels + p0 * pairs * kPanel;
  const uint32_t* w1 = w0 + pairs * kPanel;
  for (int64_t k = 0; k < pairs; ++k) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + k * kPanel);
    const __m512bh b1 = np > 1 ? (__m512bh)_mm512_loadu_si512(w1 + k * kPanel) : b0;
    for (int r = 0; r < kRows; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * pairs + k]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
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

}  // namespace

bool bf16_linear_supported() { return kSupported; }

// w: [N, K] float32 or bfloat16. Returns the packed weight, [ceil(N/16), ceil(K/2), 16, 2]
// bfloat16 (zero padded).
torch::Tensor pack_bf16_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu(), "weight must be a 2-D CPU tensor");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel, pairs = (k + 1) / 2;
  auto padded = torch::zeros({panels * kPanel, pairs * 2}, w.options().dtype(torch::kBFloat16));
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(w);  // rounds to nearest even, as .to() does
  // [panels, 16, pairs, 2] -> [panels, pairs, 16, 2]
  return padded.view({panels, kPanel, pairs, 2}).transpose(1, 2).contiguous();
}

// x: [M, K] float32 or bfloat16, rows contiguous; packed from pack_bf16_weight; columns: N.
// Returns [M, N] float32.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t columns) {
  TORCH_CHECK(kSupported, "bf16_linear needs a CPU with AVX512-BF16");
  TORCH_CHECK((x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) &&
              x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(),
              "x must be a 2-D float32 or bfloat16 CPU tensor with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 4 &&
              packed.is_contiguous() && packed.size(2) == kPanel && packed.size(3) == 2,
              "packed must come from pack_bf16_weight");
  const int64_t rows = x.size(0), k = x.size(1), num_panels = packed.size(0),
                pairs = packed.size(1);
  TORCH_CHECK((k + 1) / 2 == pairs && columns <= num_panels * kPanel &&
              columns > (num_panels - 1) * kPanel, "x or columns do not match the packed weight");
  auto out = torch::empty({rows, columns}, x.options().dtype(torch::kFloat32));
#if defined(__AVX512BF16__)
  // x as bf16 pairs: one conversion (none when it already is that), an odd k padded with zero.
  torch::Tensor xb = x.to(torch::kBFloat16).contiguous();
  if (k % 2 != 0) xb = torch::constant_pad_nd(xb, {0, 1});
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb.data_ptr<at::BFloat16>());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  constexpr int64_t kRowBlock = 6;  // 6 rows x 2 panels: 12 accumulators
  // Threads split panel pairs; every thread runs all rows over its panels (the panel stays
  // in L1 while the rows, a few hundred KB of bf16, stream from L2).
  // panel_pair by row count: full blocks, then the remainder's instance
  using Block = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t, float*,
                         int64_t);
  constexpr Block by_rows[kRowBlock + 1] = {nullptr, panel_pair<1>, panel_pair<2>, panel_pair<3>,
                                            panel_pair<4>, panel_pair<5>, panel_pair<6>};
  at::parallel_for(0, (num_panels + 1) / 2, 16, [&](int64_t begin, int64_t end) {
    for (int64_t pp = begin; pp < end; ++pp)
      for (int64_t r = 0; r < rows; r += kRowBlock)
        by_rows[std::min(kRowBlock, rows - r)](xp + r * pairs, pairs, wp, 2 * pp, num_panels,
                                               op + r * columns, columns);
  });
#endif
  return out;
}
