// Paged attention whose every output row is computed the same way, whatever else is in the batch.
//
// One work item is one query token: scores, softmax and the weighted sum of V for each of its
// heads, in loops whose shape depends on the token's position and nothing else. No reduction is split or blocked by batch size, query count or context length,
// so a token's output bits depend only on its own query and its sequence's cached K/V -- not on
// its companions, its place in the batch, or how its prompt was chunked. Threads split the work
// items, never a reduction.
//
// Built by engine/fixed_order_attention.py with -ffp-contract=off: without it the compiler may
// fuse a*b+c into an FMA in one inlined copy of a loop and not in another. Fused multiply-adds
// are written out (std::fma) only in exp, where they are one rounding, the same in vector and
// scalar code; in the dot products and the V sums a plain multiply and add measured faster.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;  // the fixed lane split of every sum: one AVX-512 register of floats

// The lanes' total, in a fixed tree.
inline float lanes_sum(const float* lane) {
  float half[kLanes / 2];
  for (int l = 0; l < kLanes / 2; ++l) half[l] = lane[l] + lane[l + kLanes / 2];
  float quarter[kLanes / 4];
  for (int l = 0; l < kLanes / 4; ++l) quarter[l] = half[l] + half[l + kLanes / 4];
  return ((quarter[0] + quarter[2]) + (quarter[1] + quarter[3]));
}

// A cache element as float: float32 as is, bfloat16 (its bits in a uint16_t) shifted into the
// high half of a float32 -- exact.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}

// kD is the head dimension when known at compile time (64, 128: fully unrolled), else 0 and the
// runtime `dim` rules; either way the lanes and their sum follow the dimension alone.
template <int64_t kD, typename T>
inline float dot(const float* a, const T* b, int64_t dim) {
  const int64_t D = kD ? kD : dim;
  float lane[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += a[d + l] * to_float(b[d + l]);
  for (int l = 0; d < D && l < kLanes; ++d, ++l) lane[l] += a[d] * to_float(b[d]);
  return lanes_sum(lane);
}

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

struct Layout {
  const void* kv;  // float or bfloat16 elements
  int64_t block_size, slot_stride, v_offset, kv_heads, max_blocks;
  const int32_t* tables;
};

// Attention of one query token, all heads, over its keys 0..position, in three passes (scores,
// softmax, weighted sum of V) whose loops depend only on the position. Heads are the inner loop
// so each key slot (K, then V, of every KV head) is read front to back once per pass.
template <int64_t kD, typename T>
void attend(const Layout& L, const float* q, float* out, const int32_t* table, int64_t position,
            int64_t group, int64_t dim, float scale, std::vector<float>& buf) {
  const int64_t D = kD ? kD : dim;
  const int64_t n = position + 1, heads = L.kv_heads * group;
  buf.resize(heads * (n + D));
  float* scores = buf.data();  // [heads][n]
  float* acc = scores + heads * n;  // [heads][D]
  // Keys are visited block by block: a division per key would cost more than its dot product.
  auto for_each_key = [&](auto&& visit) {
    for (int64_t first = 0, b = 0; first < n; first += L.block_size, ++b) {
      const T* slot = static_cast<const T*>(L.kv) + (int64_t)table[b] * L.block_size * L.slot_stride;
      const int64_t last = std::min(n, first + L.block_size);
      for (int64_t j = first; j < last; ++j, slot += L.slot_stride) visit(j, slot);
    }
  };
  for_each_key([&](int64_t j, const T* k) {
    for (int64_t h = 0; h < heads; ++h)
      scores[h * n + j] = dot<kD>(q + h * D, k + h / group * D, D) * scale;
  });
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * n;
    float top = s[0];  // a maximum is exact in any order: lanes only make it vectorize
    float peak[kLanes];
    std::fill(peak, peak + kLanes, top);
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
      for (int l = 0; l < kLanes; ++l) peak[l] = peak[l] < s[j + l] ? s[j + l] : peak[l];
    for (; j < n; ++j) top = std::max(top, s[j]);
    for (int l = 0; l < kLanes; ++l) top = std::max(top, peak[l]);
    for (int64_t j = 0; j < n; ++j) s[j] = exp_nonpositive(s[j] - top);
    float lane[kLanes] = {};
    for (j = 0; j + kLanes <= n; j += kLanes)
      for (int l = 0; l < kLanes; ++l) lane[l] += s[j + l];
    for (int l = 0; j < n && l < kLanes; ++j, ++l) lane[l] += s[j];
    const float total =
        lanes_sum(lane);
    const float inv = 1.f / total;
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;
  }
  std::fill(acc, acc + heads * D, 0.f);
  for_each_key([&](int64_t j, const T* k) {
    const T* v = k + L.v_offset;
    for (int64_t h = 0; h < heads; ++h) {
      const float w = scores[h * n + j];
      const T* vh = v + h / group * D;
      float* a = acc + h * D;
      for (int64_t d = 0; d < D; ++d) a[d] += w * to_float(vh[d]);
    }
  });
  std::copy(acc, acc + heads * D, out);
}

}  // namespace

// q: [T, num_heads * head_dim] float32, rows may be strided; cache: [blocks, block_size, 2,
// kv_heads, head_dim] float32 or bfloat16, contiguous; block_tables: [B, max_blocks] int32; token_seq: [T]
// int32, each query row's sequence; positions: [T] int64, each row attends keys 0..position.
// Returns [T, num_heads * head_dim].
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                              torch::Tensor token_seq, torch::Tensor positions, double scale) {
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
  const int64_t group = heads / L.kv_heads;

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
    std::vector<float> buf;
    for (int64_t t = bounds[first_part]; t < bounds[end_part]; ++t) {
      const float* qt = q_data + t * q_stride;
      float* o = out_data + t * heads * head_dim;
      const int32_t* table = L.tables + seq_of[t] * L.max_blocks;
      const int64_t p = pos_of[t];
      if (bf16 && head_dim == 64)
        attend<64, uint16_t>(L, qt, o, table, p, group, head_dim, fscale, buf);
      else if (bf16)
        attend<0, uint16_t>(L, qt, o, table, p, group, head_dim, fscale, buf);
      else if (head_dim == 64)
        attend<64, float>(L, qt, o, table, p, group, head_dim, fscale, buf);
      else if (head_dim == 128)
        attend<128, float>(L, qt, o, table, p, group, head_dim, fscale, buf);
      else
        attend<0, float>(L, qt, o, table, p, group, head_dim, fscale, buf);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "fixed-order paged attention (CPU; float32 or bfloat16 cache)");
}
