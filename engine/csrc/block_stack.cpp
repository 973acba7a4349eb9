// A decoder's layers in one call, for the steps where every call of a layer is one of our
// kernels: each row's attention on the fixed-order kernel and each matmul on the GGUF blocks
// (decode steps of few rows, and every step in batch-invariant mode), on the bf16 kernel, or on
// the blocks as bf16 products (block_bf16_linear). The
// layer is the nine calls engine/model.py makes, in its order and with its arguments, so the
// result is the same bits; what goes is Python between the calls -- the model's glue and the
// binding's per-call conversions and GIL hand-offs, 270 of each a step for the bundled model's
// 30 layers, while the other core's OpenMP worker waits for the next kernel.
#include "kernels.h"

BlockStack::BlockStack(std::vector<at::Tensor> norms, std::vector<at::Tensor> matrices,
                       std::vector<int64_t> qtypes, std::vector<int64_t> columns,
                       at::Tensor cos_sin, int64_t num_heads, double eps, double scale,
                       bool bf16_norm_out)
    : norms_(std::move(norms)), matrices_(std::move(matrices)), qtypes_(std::move(qtypes)),
      columns_(std::move(columns)), cos_sin_(std::move(cos_sin)), num_heads_(num_heads),
      eps_(eps), scale_(scale), bf16_norm_out_(bf16_norm_out) {
  TORCH_CHECK(norms_.size() % 2 == 0 && matrices_.size() == 2 * norms_.size() &&
              qtypes_.size() == matrices_.size() && columns_.size() == matrices_.size(),
              "a layer is 2 norms and 4 matrices (qkv, o, gate_up, down)");
  for (const int64_t qtype : qtypes_)
    TORCH_CHECK(qtype == kPackedBf16 || quant_block_bytes(qtype % kBlockBf16) > 0,
                "GGUF block type ", qtype, " is not supported");
}

at::Tensor BlockStack::forward(at::Tensor x, const std::vector<at::Tensor>& caches,
                               at::Tensor positions, at::Tensor slots,
                               at::Tensor block_tables, at::Tensor token_seq,
                               const std::string& path) const {
  const size_t layers = norms_.size() / 2;
  TORCH_CHECK(layers > 0 && caches.size() == layers, "one KV cache tensor per layer");
  const auto norm = [&](const c10::optional<at::Tensor>& delta, const at::Tensor& weight) {
    return add_rms_norm(x, delta, weight, eps_, bf16_norm_out_, path);
  };
  // As the model's linears take them: the bf16 kernel any float type (its own path choice),
  // the blocks float32 (QuantLinear's x.float())
  const auto matmul = [&](const at::Tensor& in, size_t layer, int which) {
    const size_t m = 4 * layer + which;
    if (qtypes_[m] == kPackedBf16) return bf16_linear(in, matrices_[m], columns_[m], "auto");
    if (qtypes_[m] > kBlockBf16)
      return block_bf16_linear(in, matrices_[m], qtypes_[m] - kBlockBf16, columns_[m]);
    return quant_linear(in.to(at::kFloat), matrices_[m], qtypes_[m], path);
  };
  c10::optional<at::Tensor> delta;  // the last sublayer's output, added inside the next norm
  for (size_t l = 0; l < layers; ++l) {
    at::Tensor h = norm(delta, norms_[2 * l]);
    const at::Tensor q =
        rope_write(matmul(h, l, 0), cos_sin_, positions, slots, caches[l], num_heads_, path);
    const at::Tensor attn =
        paged_attention(q, caches[l], block_tables, token_seq, positions, scale_, path);
    h = norm(matmul(attn, l, 1), norms_[2 * l + 1]);
    delta = matmul(silu_mul(matmul(h, l, 2), path), l, 3);
  }
  return *delta;
}
