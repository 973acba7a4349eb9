// Shared by the CPU kernels (fixed_order_attention.cpp, layer_ops.cpp, quant_linear.cpp): the fixed-order sum
// every reduction uses, bf16 <-> float conversions, a vectorizable exp, and the entry points
// bindings.cpp exposes to Python.
#pragma once

// ATen's tensor and the two factories the kernels call, not torch/extension.h (the C++ frontend
// and pybind11, which only bindings.cpp needs): 7-11 s a file to compile instead of 35 (Zen 3).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace inherent {

constexpr int kLanes = 16;  // the fixed lane split of every sum: one AVX-512 register of floats

// The lanes' total, in a fixed tree.
inline float lanes_sum(const float* lane) {
  float half[kLanes / 2];
  for (int l = 0; l < kLanes / 2; ++l) half[l] = lane[l] + lane[l + kLanes / 2];
  float quarter[kLanes / 4];
  for (int l = 0; l < kLanes / 4; ++l) quarter[l] = half[l] + half[l + kLanes / 4];
  return ((quarter[0] + quarter[2]) + (quarter[1] + quarter[3]));
}

// An element as float: float32 as is, bfloat16 (its bits in a uint16_t) shifted into the high
// half of a float32 -- exact.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}

// Float to bfloat16 bits, rounding to nearest even, NaN kept a NaN: what torch's .to() does.
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return std::isnan(x) ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// Stores a float as the element type.
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) { *p = to_bf16(x); }

// e^x for x <= 0 (a score minus its row's maximum), Cephes' single-precision polynomial: about
// 1 ulp, branch-free, so a loop of it vectorizes (glibc's expf is a call per element).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // e^-87 ~ 1.6e-38: the smallest normal float, no denormals
  const float k = static_cast<float>(static_cast<int32_t>(x * 1.44269504088896341f - 0.5f));
  float r = std::fma(k, -0.693359375f, x);  // x - k ln 2, ln 2 split in two for accuracy
  r = std::fma(k, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

}  // namespace inherent

// `path`: "auto" or the implementation to force (simd.h).
std::vector<std::string> available_paths();

at::Tensor paged_attention(at::Tensor q, at::Tensor cache, at::Tensor block_tables,
                           at::Tensor token_seq, at::Tensor positions, double scale,
                           const std::string& path);

// Whether a lone decode's attention reads two cache blocks' keys in turn or one block at a time
// (fixed_order_attention.cpp's kKeysAtOnce): the same bits either way. On by default on Intel
// CPUs, where it measured faster, off elsewhere (slower on AMD Zen 4, no faster on Zen 5); tests
// set both. The setter returns the setting it replaced.
bool decode_blocks_in_turn();
bool set_decode_blocks_in_turn(bool on);

at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta,
                        at::Tensor weight, double eps, bool bf16_out,
                        const std::string& path);
at::Tensor rope_write(at::Tensor qkv, at::Tensor cos_sin, at::Tensor positions,
                      at::Tensor slots, at::Tensor cache, int64_t num_heads,
                      const std::string& path);
at::Tensor silu_mul(at::Tensor gate_up, const std::string& path);

// ggml's numbers of the GGUF block types the kernels read
constexpr int64_t kGgmlQ4_1 = 3, kGgmlQ8_0 = 8;

int64_t quant_block_bytes(int64_t qtype);
at::Tensor quant_linear(at::Tensor x, at::Tensor blocks, int64_t qtype,
                        const std::string& path);

// A BlockStack matrix's qtype when it is a weight packed for bf16_linear, not GGUF blocks; and
// the offset added to the blocks' qtype when they are packed for block_bf16_linear.
constexpr int64_t kPackedBf16 = -1, kBlockBf16 = 100;

// A decoder's layers on the kernels above, one call a step (block_stack.cpp): per layer, norms
// [input, post-attention] and matrices [qkv, o, gate_up, down], each GGUF blocks (its qtype),
// packed for bf16_linear (kPackedBf16) or for block_bf16_linear (kBlockBf16 + the blocks'
// qtype), with its output columns.
class BlockStack {
 public:
  BlockStack(std::vector<at::Tensor> norms, std::vector<at::Tensor> matrices,
             std::vector<int64_t> qtypes, std::vector<int64_t> columns, at::Tensor cos_sin,
             int64_t num_heads, double eps, double scale, bool bf16_norm_out);
  // x [T, hidden] float32, the residual stream, updated in place; returns the last layer's
  // output (the residual's next delta).
  at::Tensor forward(at::Tensor x, const std::vector<at::Tensor>& caches,
                     at::Tensor positions, at::Tensor slots, at::Tensor block_tables,
                     at::Tensor token_seq, const std::string& path) const;

 private:
  std::vector<at::Tensor> norms_, matrices_;
  std::vector<int64_t> qtypes_, columns_;
  at::Tensor cos_sin_;
  int64_t num_heads_;
  double eps_, scale_;
  bool bf16_norm_out_;
};

bool bf16_linear_supported();
std::vector<std::string> bf16_linear_paths();
at::Tensor pack_bf16_weight(at::Tensor w);
at::Tensor bf16_linear(at::Tensor x, at::Tensor packed, int64_t columns,
                       const std::string& path);
at::Tensor pack_block_bf16(at::Tensor blocks, int64_t qtype);
at::Tensor block_bf16_linear(at::Tensor x, at::Tensor packed, int64_t qtype, int64_t columns);
