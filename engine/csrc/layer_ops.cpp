// The element-wise work between a decoder layer's matmuls, fused so that each activation is read
// and written once, converted where it is produced, and never dispatched op by op:
//
//   add_rms_norm  x += delta (the previous matmul's output); out = x / rms(x) * weight, in the
//                 next matmul's dtype;
//   rope_write    RoPE on the q and k heads of a fused qkv projection; q out as float32, k and v
//                 written straight into their paged-cache slots;
//   silu_mul      silu(gate) * up of a fused gate_up projection, rounded once.
//
// Each output row depends on its own input row only, through sums in the fixed 16-lane order of
// kernels.h: the ops are batch-invariant by construction. Each op has a portable implementation
// and one written once against the vector types of simd.h (AVX-512, AVX2), computing the same
// bits (tests compare them); threads split rows.
#include "simd.h"

#include <ATen/Parallel.h>

namespace {

using namespace inherent;

// Rows per thread task: enough elements that a task outweighs waking a thread.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

// ---- Portable implementation ----------------------------------------------------------------

struct Portable {};

// The element-wise parts, one element at a time: what the vector code computes W at a time.
template <typename D>
inline void add_row(float* x, const D* delta, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) x[i] = x[i] + to_float(delta[i]);
}

template <typename O>
inline void scale_row(const float* x, float inv, const float* weight, O* out, int64_t begin,
                      int64_t end) {
  for (int64_t i = begin; i < end; ++i) store(out + i, (x[i] * inv) * weight[i]);
}

// (a, b) rotated by the angle whose (cos, sin) is cs: RoPE on adjacent pairs, elements begin..end.
// Not auto-vectorized: GCC 12 recognizes this as a complex multiply and emits
// vfmaddsub, fusing a product despite -ffp-contract=off (the tests caught the changed bits).
template <typename In, typename Out>
__attribute__((optimize("no-tree-vectorize"))) void rotate(const In* in, const float* cs, Out* out,
                                                          int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 2) {
    const float a = to_float(in[i]), b = to_float(in[i + 1]), c = cs[i], s = cs[i + 1];
    store(out + i, a * c - b * s);
    store(out + i + 1, a * s + b * c);
  }
}

template <typename In, typename Out>
inline void copy_row(const In* in, Out* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) store(out + i, to_float(in[i]));
}

template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = to_float(gate[i]);
    const float e = exp_nonpositive(-std::fabs(g));  // e^-|g|: never overflows
    const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    store(out + i, g * sigmoid * to_float(up[i]));
  }
}

// Sum of squares in the 16 lanes, elements begin..end (begin a multiple of 16).
inline void square_lanes(const float* x, float* lane, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] = std::fma(x[i + l], x[i + l], lane[l]);
  for (int l = 0; i < end; ++i, ++l) lane[l] = std::fma(x[i], x[i], lane[l]);
}

// Each op's vector part covers a prefix of the row (whole registers; for the sum of squares,
// whole 16-lane groups) and returns where it stopped; the portable part does the rest.
template <typename D>
int64_t add_vec(Portable, float*, const D*, int64_t) { return 0; }
inline int64_t square_vec(Portable, const float*, float*, int64_t) { return 0; }
template <typename O>
int64_t scale_vec(Portable, const float*, float, const float*, O*, int64_t) { return 0; }
template <typename In, typename Out>
int64_t rotate_vec(Portable, const In*, const float*, Out*, int64_t) { return 0; }
template <typename In, typename Out>
int64_t copy_vec(Portable, const In*, Out*, int64_t) { return 0; }
template <typename T>
int64_t silu_mul_vec(Portable, const T*, const T*, T*, int64_t) { return 0; }

// ---- Vector implementation (simd.h's Avx512, Avx2) ------------------------------------------

#if defined(INHERENT_AVX2) || defined(INHERENT_AVX512)
template <class V, typename D>
int64_t add_vec(V, float* x, const D* delta, int64_t width) {
  int64_t i = 0;
  for (; i + V::W <= width; i += V::W) V::store(x + i, V::add(V::load(x + i), V::load(delta + i)));
  return i;
}

template <class V>
int64_t square_vec(V, const float* x, float* lane, int64_t width) {
  constexpr int R = kLanes / V::W;  // registers per 16 lanes
  typename V::F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V::load(lane + r * V::W);
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes)
    for (int r = 0; r < R; ++r) {
      const auto v = V::load(x + i + r * V::W);
      acc[r] = V::fma(v, v, acc[r]);
    }
  for (int r = 0; r < R; ++r) V::store(lane + r * V::W, acc[r]);
  return i;
}

template <class V, typename O>
int64_t scale_vec(V, const float* x, float inv, const float* weight, O* out, int64_t width) {
  const auto s = V::set1(inv);
  int64_t i = 0;
  for (; i + V::W <= width; i += V::W)
    V::store(out + i, V::mul(V::mul(V::load(x + i), s), V::load(weight + i)));
  return i;
}

// a*c - b*s and a*s + b*c as [a c, b c] + -[b s, a s]: the same products and one rounding
// each (x - y is x + -y exactly; a*s + b*c == b*c + a*s).
template <class V, typename In, typename Out>
int64_t rotate_vec(V, const In* in, const float* cs, Out* out, int64_t dim) {
  int64_t i = 0;
  for (; i + V::W <= dim; i += V::W) {
    const auto v = V::load(in + i), c = V::load(cs + i);
    const auto straight = V::mul(v, V::dup_even(c));
    const auto crossed = V::mul(V::swap_pairs(v), V::dup_odd(c));
    V::store(out + i, V::add(straight, V::negate_even(crossed)));
  }
  return i;
}

template <class V, typename In, typename Out>
int64_t copy_vec(V, const In* in, Out* out, int64_t width) {
  int64_t i = 0;
  for (; i + V::W <= width; i += V::W) V::store(out + i, V::load(in + i));
  return i;
}

template <class V, typename T>
int64_t silu_mul_vec(V, const T* gate, const T* up, T* out, int64_t width) {
  const auto one = V::set1(1.f);
  int64_t i = 0;
  for (; i + V::W <= width; i += V::W) {
    const auto g = V::load(gate + i);
    const auto e = exp_nonpositive<V>(V::neg_abs(g));
    const auto denom = V::add(one, e);
    const auto sigmoid = V::select_nonneg(g, V::div(one, denom), V::div(e, denom));
    V::store(out + i, V::mul(V::mul(g, sigmoid), V::load(up + i)));
  }
  return i;
}
#endif

// ---- The ops, on either implementation ------------------------------------------------------

template <class P, typename D, typename O>
void add_rms_norm_rows(P p, float* x, const D* delta, int64_t delta_stride, const float* weight,
                       O* out, int64_t width, float eps, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    float* xr = x + r * width;
    if (delta != nullptr) {
      const D* dr = delta + r * delta_stride;
      add_row(xr, dr, add_vec(p, xr, dr, width), width);
    }
    float lane[kLanes] = {};
    square_lanes(xr, lane, square_vec(p, xr, lane, width), width);
    const float inv = 1.f / std::sqrt(lanes_sum(lane) / static_cast<float>(width) + eps);
    O* o = out + r * width;
    scale_row(xr, inv, weight, o, scale_vec(p, xr, inv, weight, o, width), width);
  }
}

template <class P, typename In, typename C>
void rope_write_rows(P p, const In* qkv, int64_t qkv_stride, const float* cos_sin,
                     const int64_t* positions, const int64_t* slots, C* cache,
                     int64_t slot_stride, float* q, int64_t heads, int64_t kv_heads, int64_t dim,
                     int64_t begin, int64_t end) {
  auto rotate_head = [&](const In* in, const float* cs, auto* out) {
    rotate(in, cs, out, rotate_vec(p, in, cs, out, dim), dim);
  };
  for (int64_t t = begin; t < end; ++t) {
    const In* row = qkv + t * qkv_stride;
    const float* cs = cos_sin + positions[t] * dim;  // dim / 2 pairs of (cos, sin)
    for (int64_t h = 0; h < heads; ++h) rotate_head(row + h * dim, cs, q + (t * heads + h) * dim);
    C* slot = cache + slots[t] * slot_stride;  // [2][kv_heads][dim]: K, then V
    for (int64_t h = 0; h < kv_heads; ++h) rotate_head(row + (heads + h) * dim, cs, slot + h * dim);
    const In* v = row + (heads + kv_heads) * dim;
    C* v_out = slot + kv_heads * dim;
    copy_row(v, v_out, copy_vec(p, v, v_out, kv_heads * dim), kv_heads * dim);
  }
}

template <class P, typename T>
void silu_mul_rows(P p, const T* gate_up, int64_t stride, T* out, int64_t width, int64_t begin,
                   int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = gate_up + r * stride;
    const T* up = gate + width;
    T* o = out + r * width;
    silu_mul_row(gate, up, o, silu_mul_vec(p, gate, up, o, width), width);
  }
}

// Runs fn with the implementation's tag.
template <typename Fn>
void with_path(Path path, Fn&& fn) {
  switch (path) {
#if defined(INHERENT_AVX512)
    case Path::kAvx512: return fn(Avx512{});
#endif
#if defined(INHERENT_AVX2)
    case Path::kAvx2: return fn(Avx2{});
#endif
    default: return fn(Portable{});
  }
}

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a 2-D CPU tensor with contiguous rows");
  TORCH_CHECK(t.scalar_type() == at::kFloat || is_bf16(t), name,
              " must be float32 or bfloat16");
}

}  // namespace

// x: [T, H] float32, contiguous, updated in place; delta: [T, H] float32 or bfloat16, or None;
// weight: [H] float32. Returns [T, H], bfloat16 if bf16_out else float32.
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta,
                        at::Tensor weight, double eps, bool bf16_out,
                        const std::string& path_name) {
  const Path path = resolve_path(path_name);
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
              weight.numel() == x.size(1), "weight must be [H] float32");
  if (delta) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "delta must have x's shape");
  }
  const int64_t rows = x.size(0), width = x.size(1);
  auto out = at::empty({rows, width}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    with_path(path, [&](auto p) {
    auto run = [&](auto* delta_data, int64_t delta_stride) {
      if (bf16_out)
        add_rms_norm_rows(p, xp, delta_data, delta_stride, w,
                          reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), width, e, begin, end);
      else
        add_rms_norm_rows(p, xp, delta_data, delta_stride, w, out.data_ptr<float>(), width, e, begin, end);
    };
    if (!delta)
      run(static_cast<const float*>(nullptr), 0);
    else if (is_bf16(*delta))
      run(reinterpret_cast<const uint16_t*>(delta->data_ptr<at::BFloat16>()), delta->stride(0));
    else
      run(delta->data_ptr<float>(), delta->stride(0));
    });
  });
  return out;
}

// qkv: [T, (heads + 2 kv_heads) * D] float32 or bfloat16, q and k rows RoPE-interleaved (pairs
// side by side); cos_sin: [positions, D / 2, 2] float32; positions, slots: [T] int64; cache:
// [blocks, block_size, 2, kv_heads, D] float32 or bfloat16. Writes k (rotated) and v into each
// token's slot; returns q (rotated) as [T, heads * D] float32.
at::Tensor rope_write(at::Tensor qkv, at::Tensor cos_sin, at::Tensor positions,
                      at::Tensor slots, at::Tensor cache, int64_t num_heads,
                      const std::string& path_name) {
  const Path path = resolve_path(path_name);
  check_rows(qkv, "qkv");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.device().is_cpu() &&
              (cache.scalar_type() == at::kFloat || is_bf16(cache)),
              "cache must be a contiguous 5-D float32 or bfloat16 CPU tensor");
  const int64_t kv_heads = cache.size(3), dim = cache.size(4), tokens = qkv.size(0);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * kv_heads) * dim, "qkv width does not match the heads");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() &&
              cos_sin.size(-1) == 2 && cos_sin.numel() % dim == 0, "cos_sin must be [P, D / 2, 2] float32");
  for (const auto* t : {&positions, &slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == tokens,
                "positions and slots must be [T] int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin.numel() / dim, num_slots = cache.size(0) * cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos && slot[t] >= 0 && slot[t] < num_slots,
                "position or slot out of range");
  auto q = at::empty({tokens, num_heads * dim}, qkv.options().dtype(at::kFloat));
  const float* cs = cos_sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t slot_stride = 2 * kv_heads * dim;
  at::parallel_for(0, tokens, grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
    with_path(path, [&](auto p) {
    auto run = [&](const auto* in) {
      if (is_bf16(cache))
        rope_write_rows(p, in, qkv.stride(0), cs, pos, slot,
                        reinterpret_cast<uint16_t*>(cache.data_ptr<at::BFloat16>()), slot_stride,
                        qp, num_heads, kv_heads, dim, begin, end);
      else
        rope_write_rows(p, in, qkv.stride(0), cs, pos, slot, cache.data_ptr<float>(), slot_stride,
                        qp, num_heads, kv_heads, dim, begin, end);
    };
    if (is_bf16(qkv))
      run(reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>()));
    else
      run(qkv.data_ptr<float>());
    });
  });
  return q;
}

// gate_up: [T, 2 I] float32 or bfloat16 (gate, then up). Returns silu(gate) * up, [T, I], same dtype.
at::Tensor silu_mul(at::Tensor gate_up, const std::string& path_name) {
  const Path path = resolve_path(path_name);
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = at::empty({rows, width}, gate_up.options());
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    with_path(path, [&](auto p) {
    if (is_bf16(gate_up))
      silu_mul_rows(p, reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>()),
                    gate_up.stride(0), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                    width, begin, end);
    else
      silu_mul_rows(p, gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(), width,
                    begin, end);
    });
  });
  return out;
}
