// CPU kernels of the embedded engine's step: the parts of a decoder layer that are not GEMMs.
//
// Built and loaded by tiderl/engine/kernels.py (g++ against the installed torch), registered as
// torch.ops.tiderl.*. The first four have plain-torch twins (TorchKernels in kernels.py) that
// compute the same thing (tests/unit/test_kernels.py holds them equal); they write in place and
// return nothing:
//
//   add_rms_norm           residual += x (when given); x = rms_norm(residual or x) * weight
//   silu_and_mul           out = silu(gate) * up, from the stacked [gate | up] GEMM output
//   rotary_write_kv        q and k of the stacked [q | k | v] GEMM output rotated in place
//                          (half-split convention), k and v stored at their cache slots
//   paged_decode_attention one query token per sequence against its paged keys and values,
//                          read where they lie in the cache (no gather), grouped-query heads
//                          sharing each key they read
//   decode_layers          a decode step's layer loop: the projections and the four above,
//                          no Python between them (ModelRunner._decode_layers)
//
// Arithmetic follows the torch twins: float32 accumulation, and rounding to the model's dtype
// where the torch code rounds (so bfloat16 agrees to the last bit wherever the order of float
// sums allows).

#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

template <typename T>
inline float f32(T v) {
  return static_cast<float>(v);
}

// e^x to within 2 float ulps, in plain arithmetic the compiler vectorises (std::exp is one
// scalar libm call per element: a decode step's softmax and SiLU need tens of thousands).
// x = n ln2 + f with |f| <= ln2 / 2; e^f by its Taylor series to degree 7 (remainder below
// 6e-9 relative); 2^n placed in the exponent bits. Inputs are clamped to the finite range.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float f = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// Rows per parallel task: enough elements that a task outweighs the fork (a few microseconds).
inline int64_t grain_rows(int64_t work_per_row) {
  constexpr int64_t kTaskWork = 1 << 15;
  return std::max<int64_t>(1, kTaskWork / std::max<int64_t>(1, work_per_row));
}

template <typename T>
void add_rms_norm_kernel(T* x, T* residual, const T* weight, int64_t rows, int64_t width,
                         float eps) {
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * width;
      const T* src = xr;
      if (residual != nullptr) {
        T* res = residual + r * width;
        for (int64_t i = 0; i < width; ++i) res[i] = round_to<T>(f32(res[i]) + f32(xr[i]));
        src = res;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < width; ++i) sum += f32(src[i]) * f32(src[i]);
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
      for (int64_t i = 0; i < width; ++i)
        xr[i] = round_to<T>(f32(round_to<T>(f32(src[i]) * scale)) * f32(weight[i]));
    }
  });
}

void add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                  const at::Tensor& weight, double eps) {
  const int64_t width = x.size(-1);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.numel() == width,
              "add_rms_norm: contiguous x and a weight of its width expected");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "add_rms_norm: weight dtype differs");
  if (residual) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "add_rms_norm: residual must match x");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(),
                                  residual ? residual->data_ptr<scalar_t>() : nullptr,
                                  weight.data_ptr<scalar_t>(), x.numel() / width, width,
                                  static_cast<float>(eps));
  });
}

template <typename T>
void silu_and_mul_kernel(T* out, const T* in, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain_rows(4 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = f32(gate[i]);
        o[i] = round_to<T>(f32(round_to<T>(g / (1.f + fast_exp(-g)))) * f32(up[i]));
      }
    }
  });
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  const int64_t width = out.size(-1);
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && x.size(-1) == 2 * width &&
                  x.numel() == 2 * out.numel() && x.scalar_type() == out.scalar_type(),
              "silu_and_mul: out [..., I] and x [..., 2I] of one dtype expected");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                                  out.numel() / width, width);
  });
}

template <typename T>
void rotary_write_kv_kernel(T* qkv, int64_t row_stride, const int64_t* positions, const T* cos,
                            const T* sin, T* cache, const int64_t* slots, int64_t tokens,
                            int64_t heads, int64_t kv_heads, int64_t dim, int64_t cache_slots) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, grain_rows(4 * (heads + 2 * kv_heads) * dim),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(dim);
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * row_stride;
      const T* c = cos + positions[t] * dim;
      const T* s = sin + positions[t] * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {  // x cos + swap_halves(x) sin
        T* x = row + h * dim;
        for (int64_t j = 0; j < dim; ++j) {
          const float other = f32(x[j < half ? j + half : j - half]);
          tmp[j] = f32(round_to<T>(f32(x[j]) * f32(c[j]))) + other * f32(s[j]);
        }
        for (int64_t j = 0; j < dim; ++j) x[j] = round_to<T>(tmp[j]);
      }
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < kv_heads; ++h) {
        const T* k = row + (heads + h) * dim;
        const T* v = row + (heads + kv_heads + h) * dim;
        T* k_dst = cache + (h * cache_slots + slot) * dim;
        T* v_dst = cache + ((kv_heads + h) * cache_slots + slot) * dim;
        std::copy(k, k + dim, k_dst);
        std::copy(v, v + dim, v_dst);
      }
    }
  });
}

void rotary_write_kv(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& layer_cache,
                     const at::Tensor& slot_mapping, int64_t heads, int64_t kv_heads) {
  // layer_cache: [2, Hkv, num_blocks, block_size, D]; qkv: [T, (H + 2 Hkv) D], rows may be
  // strided; cos, sin: [positions, D] (sin with its first half negated).
  TORCH_CHECK(layer_cache.dim() == 5 && layer_cache.is_contiguous() &&
                  layer_cache.size(1) == kv_heads,
              "rotary_write_kv: a contiguous [2, Hkv, blocks, block_size, D] cache expected");
  const int64_t dim = layer_cache.size(4), tokens = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "rotary_write_kv: qkv [T, (H + 2 Hkv) D] with contiguous rows expected");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == dim &&
                  sin.sizes() == cos.sizes(),
              "rotary_write_kv: cos and sin tables [positions, D] expected");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() &&
                  positions.numel() == tokens && slot_mapping.numel() == tokens,
              "rotary_write_kv: int64 positions and slots, one per token");
  TORCH_CHECK(qkv.scalar_type() == layer_cache.scalar_type() &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rotary_write_kv: qkv, tables and cache must share a dtype");
  const int64_t cache_slots = layer_cache.size(2) * layer_cache.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_write_kv",
                                  [&] {
    rotary_write_kv_kernel<scalar_t>(
        qkv.data_ptr<scalar_t>(), qkv.stride(0), positions.data_ptr<int64_t>(),
        cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), layer_cache.data_ptr<scalar_t>(),
        slot_mapping.data_ptr<int64_t>(), tokens, heads, kv_heads, dim, cache_slots);
  });
}

constexpr int64_t kMaxHeadDim = 512;

// Dot products of one query row with four keys at once: four independent sums keep the vector
// units busy (one at a time, each waits on its own horizontal reduction).
template <typename T, int64_t D>
inline void dot4(const float* q, const T* k0, int64_t dim, float* out) {
  const int64_t n = D > 0 ? D : dim;
  const T* k1 = k0 + n;
  const T* k2 = k1 + n;
  const T* k3 = k2 + n;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t d = 0; d < n; ++d) {
    s0 += q[d] * f32(k0[d]);
    s1 += q[d] * f32(k1[d]);
    s2 += q[d] * f32(k2[d]);
    s3 += q[d] * f32(k3[d]);
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

// One (sequence, KV head) pair at a time; within it one query head at a time: its scores
// against every key (block by block through the table), their softmax, then the weighted sum of
// the values into an accumulator of D floats (registers when D is a compile-time constant; 0:
// the head dimension is read at run time).
template <typename T, int64_t D>
void paged_decode_attention_kernel(T* out, const T* q, int64_t q_stride_seq, int64_t q_stride_head,
                                   const T* cache, const int64_t* block_tables, int64_t table_stride,
                                   const int64_t* context_lens, int64_t seqs, int64_t heads,
                                   int64_t kv_heads, int64_t dim_, int64_t num_blocks,
                                   int64_t block_size, float scale, int64_t longest) {
  const int64_t dim = D > 0 ? D : dim_;
  const int64_t groups = heads / kv_heads;
  const int64_t head_stride = num_blocks * block_size * dim;
  at::parallel_for(0, seqs * kv_heads, grain_rows(2 * groups * longest * dim),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> scores(longest + 4);
    float query[kMaxHeadDim], acc[kMaxHeadDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      const int64_t length = context_lens[s];
      const int64_t* table = block_tables + s * table_stride;
      const T* keys = cache + h * head_stride;
      const T* values = keys + kv_heads * head_stride;
      // The blocks lie anywhere in the cache, so the hardware cannot see the next one coming:
      // ask for all of this pair's keys and values before reading the first (a few KB each).
      const int64_t tile_bytes = block_size * dim * static_cast<int64_t>(sizeof(T));
      for (int64_t b = 0; b * block_size < length; ++b) {
        const char* k = reinterpret_cast<const char*>(keys + table[b] * block_size * dim);
        const char* v = reinterpret_cast<const char*>(values + table[b] * block_size * dim);
        for (int64_t off = 0; off < tile_bytes; off += 64) {
          __builtin_prefetch(k + off);
          __builtin_prefetch(v + off);
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        const T* row = q + s * q_stride_seq + (h * groups + g) * q_stride_head;
        for (int64_t d = 0; d < dim; ++d) query[d] = f32(row[d]) * scale;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t start = 0; start < length; start += block_size) {
          const T* block = keys + table[start / block_size] * block_size * dim;
          const int64_t n = std::min(block_size, length - start);
          float* out_scores = scores.data() + start;
          int64_t i = 0;
          for (; i + 4 <= n; i += 4) dot4<T, D>(query, block + i * dim, dim, out_scores + i);
          for (; i < n; ++i) {
            const T* key = block + i * dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += query[d] * f32(key[d]);
            out_scores[i] = dot;
          }
          for (int64_t j = 0; j < n; ++j) top = std::max(top, out_scores[j]);
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < length; ++i) {
          scores[i] = fast_exp(scores[i] - top);
          sum += scores[i];
        }
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < dim; ++d) acc[d] = 0.f;
        for (int64_t start = 0; start < length; start += block_size) {
          const T* block = values + table[start / block_size] * block_size * dim;
          const int64_t n = std::min(block_size, length - start);
          for (int64_t i = 0; i < n; ++i) {
            const T* value = block + i * dim;
            const float p = scores[start + i];
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) acc[d] += p * f32(value[d]);
          }
        }
        T* o = out + (s * heads + h * groups + g) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = round_to<T>(acc[d] * inv);
      }
    }
  });
}

void paged_decode_attention(const at::Tensor& out, const at::Tensor& q,
                            const at::Tensor& layer_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  // out: [B, H, D] contiguous; q: [B, H, D] with contiguous head rows (a view of the qkv GEMM
  // output); layer_cache: [2, Hkv, num_blocks, block_size, D]; block_tables: [B, W] int64 with
  // contiguous rows; context_lens: [B] int64, each at least 1.
  TORCH_CHECK(layer_cache.dim() == 5 && layer_cache.is_contiguous(),
              "paged_decode_attention: a contiguous [2, Hkv, blocks, block_size, D] cache expected");
  const int64_t seqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = layer_cache.size(1), block_size = layer_cache.size(3);
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && layer_cache.size(4) == dim &&
                  heads % kv_heads == 0,
              "paged_decode_attention: q [B, H, D] with H a multiple of the cache's KV heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() &&
                  out.scalar_type() == q.scalar_type() &&
                  layer_cache.scalar_type() == q.scalar_type(),
              "paged_decode_attention: out like q, one dtype for q, out and cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) == seqs && block_tables.stride(1) == 1 &&
                  context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == seqs,
              "paged_decode_attention: int64 block tables [B, W] and context lengths [B]");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= block_tables.size(1) * block_size,
                "paged_decode_attention: a context length outside its block table");
    longest = std::max(longest, lens[s]);
  }
  TORCH_CHECK(dim <= kMaxHeadDim, "paged_decode_attention: head dimension above 512");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "paged_decode_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), q.stride(0), q.stride(1),
             layer_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(),
             block_tables.stride(0), lens, seqs, heads, kv_heads, dim, layer_cache.size(2),
             block_size, static_cast<float>(scale), longest);
    };
    switch (dim) {  // the common head dimensions as constants, the loops over them unrolled
      case 32: run(paged_decode_attention_kernel<scalar_t, 32>); break;
      case 64: run(paged_decode_attention_kernel<scalar_t, 64>); break;
      case 128: run(paged_decode_attention_kernel<scalar_t, 128>); break;
      default: run(paged_decode_attention_kernel<scalar_t, 0>);
    }
  });
}

// The projections of decode_layers: oneDNN's linear on weights it reordered once
// (PackedLinears, tiderl/engine/packed_linear.py), on x's rows padded with zeros to gemm_rows
// (packed_linear.gemm_rows: oneDNN builds and caches a primitive per input shape), or
// at::linear on plain ones.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, bool onednn, int64_t gemm_rows) {
  if (!onednn) return at::linear(x, weight, bias);
  static const auto linear =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  const int64_t rows = x.size(0);
  const at::Tensor input = gemm_rows > rows ? at::constant_pad_nd(x, {0, 0, 0, gemm_rows - rows})
                                            : x;
  return linear
      .call(input, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt)
      .narrow(0, 0, rows);
}

at::Tensor decode_layers(const at::Tensor& hidden, const at::Tensor& residual,
                         at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                         at::TensorList norms, const at::Tensor& kv_cache,
                         const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t heads, int64_t kv_heads,
                         double eps, bool onednn, int64_t gemm_rows) {
  // A decode step's decoder layers in one call (one token per sequence): per layer the four
  // projections and the four kernels above, as ModelRunner._forward runs them from Python.
  // weights, biases: 4 a layer (q/k/v stacked, o, gate/up stacked, down); norms: 2 a layer
  // (post-attention, then the next layer's input norm or the final one). hidden: [B, hidden],
  // already through the first layer's input norm; residual: [B, hidden], updated in place.
  // gemm_rows: the row count each oneDNN projection runs at (B padded). Returns the hidden
  // states after the final norm.
  const int64_t layers = kv_cache.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers,
              "decode_layers: 4 weights, 4 biases and 2 norms a layer of the cache expected");
  const int64_t seqs = hidden.size(0), dim = kv_cache.size(-1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  at::Tensor x = hidden;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor cache = kv_cache.select(0, l);
    const at::Tensor qkv = project(x, weights[4 * l], biases.get(4 * l), onednn, gemm_rows);
    rotary_write_kv(qkv, positions, cos, sin, cache, slot_mapping, heads, kv_heads);
    const at::Tensor q = qkv.narrow(1, 0, heads * dim).view({seqs, heads, dim});
    const at::Tensor attended = at::empty({seqs, heads, dim}, qkv.options());
    paged_decode_attention(attended, q, cache, block_tables, context_lens, scale);
    x = project(attended.view({seqs, heads * dim}), weights[4 * l + 1], biases.get(4 * l + 1),
                onednn, gemm_rows);
    add_rms_norm(x, residual, norms[2 * l], eps);
    const at::Tensor gate_up =
        project(x, weights[4 * l + 2], biases.get(4 * l + 2), onednn, gemm_rows);
    const at::Tensor act = at::empty({seqs, gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul(act, gate_up);
    x = project(act, weights[4 * l + 3], biases.get(4 * l + 3), onednn, gemm_rows);
    add_rms_norm(x, residual, norms[2 * l + 1], eps);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY(tiderl, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "rotary_write_kv(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor(b!) layer_cache, Tensor slot_mapping, int heads, int kv_heads) -> ()");
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor layer_cache, Tensor block_tables, "
      "Tensor context_lens, float scale) -> ()");
  m.def(
      "decode_layers(Tensor hidden, Tensor(a!) residual, Tensor[] weights, Tensor?[] biases, "
      "Tensor[] norms, Tensor(b!) kv_cache, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int heads, int kv_heads, "
      "float eps, bool onednn, int gemm_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tiderl, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_write_kv", &rotary_write_kv);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("decode_layers", &decode_layers);
}

// decode_layers receives oneDNN-reordered weights (opaque MkldnnCPU tensors), which route the
// call by that dispatch key.
TORCH_LIBRARY_IMPL(tiderl, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
