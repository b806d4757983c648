// Row-invariant attention for x86 CPUs with AVX2 or AVX-512: fastforward::exact_attention.
//
// Each (batch row, query, head) is one task that reads only the keys its query may see, in key order,
// and computes scores, softmax and the weighted sum of values with the same instructions in the same
// order whatever the other queries of the call are. So a query's result is the same bits in a 1-token
// forward (greedy AR) and in a block of drafts, and nothing is padded, gathered or copied: the
// chunked SDPA calls of fastforward/attention.py, which make each query's call shape depend on its
// key count alone, cost several small operations per layer and a copy of the cache.
//
// Two passes per task: scores (dot products reduced in a fixed order) and their maximum, then
// exp(score - max) (a polynomial, vectorized), their sum and the values weighted by them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

using simd::Floats;
using simd::LANES;  // floats per register; the head size must be a multiple of 16 (both widths)

struct Workspace {  // per thread, reused across tasks
  std::vector<int64_t> keys;
  std::vector<float> weights;
};

// One query of one head: out[0:dim] = softmax(scale * q . k_s) . v_s over keys s in `keys`.
template <typename T>
void attend_one(const T* q, const T* k, const T* v, int64_t key_stride, const std::vector<int64_t>& keys,
                int64_t dim, float scale, std::vector<float>& weights, float* out) {
  const int64_t count = static_cast<int64_t>(keys.size()), chunks = dim / LANES;
  if (count == 0) {  // nothing visible: zeros rather than SDPA's NaN
    for (int64_t i = 0; i < dim; ++i) out[i] = 0.0f;
    return;
  }
  weights.resize(((count + LANES - 1) / LANES) * LANES);
  Floats query[256 / LANES];
  for (int64_t c = 0; c < chunks; ++c) query[c] = simd::load(q + c * LANES);
  const Floats scale_v = simd::broadcast(scale);
  float top = -INFINITY;
  int64_t n = 0;
  // Four keys at a time, then one: four dot products side by side are independent chains of adds
  // (a one-key loop waited on its own). Each key's operations keep their order, so the same bits.
  // Written out key by key: the same loop over arrays of four measured no faster with GCC.
  for (; n + 4 <= count; n += 4) {
    const T *key0 = k + keys[n] * key_stride, *key1 = k + keys[n + 1] * key_stride;
    const T *key2 = k + keys[n + 2] * key_stride, *key3 = k + keys[n + 3] * key_stride;
    Floats dot0 = simd::mul(query[0], simd::load(key0)), dot1 = simd::mul(query[0], simd::load(key1));
    Floats dot2 = simd::mul(query[0], simd::load(key2)), dot3 = simd::mul(query[0], simd::load(key3));
    for (int64_t c = 1; c < chunks; ++c) {
      dot0 = simd::add(dot0, simd::mul(query[c], simd::load(key0 + c * LANES)));
      dot1 = simd::add(dot1, simd::mul(query[c], simd::load(key1 + c * LANES)));
      dot2 = simd::add(dot2, simd::mul(query[c], simd::load(key2 + c * LANES)));
      dot3 = simd::add(dot3, simd::mul(query[c], simd::load(key3 + c * LANES)));
    }
    const float score0 = simd::sum(simd::mul(dot0, scale_v)), score1 = simd::sum(simd::mul(dot1, scale_v));
    const float score2 = simd::sum(simd::mul(dot2, scale_v)), score3 = simd::sum(simd::mul(dot3, scale_v));
    weights[n] = score0;
    weights[n + 1] = score1;
    weights[n + 2] = score2;
    weights[n + 3] = score3;
    top = std::max({top, score0, score1, score2, score3});
  }
  for (; n < count; ++n) {
    const T* key = k + keys[n] * key_stride;
    Floats dot = simd::mul(query[0], simd::load(key));
    for (int64_t c = 1; c < chunks; ++c) dot = simd::add(dot, simd::mul(query[c], simd::load(key + c * LANES)));
    const float score = simd::sum(simd::mul(dot, scale_v));
    weights[n] = score;
    top = score > top ? score : top;
  }
  for (int64_t n = count; n < static_cast<int64_t>(weights.size()); ++n) weights[n] = -INFINITY;
  const Floats top_v = simd::broadcast(top);
  Floats total = simd::zeros();
  for (int64_t n = 0; n < static_cast<int64_t>(weights.size()); n += LANES) {
    const Floats w = simd::exp_nonpositive(simd::sub(simd::load(&weights[n]), top_v));
    simd::store(&weights[n], w);
    total = simd::add(total, w);
  }
  const Floats inverse = simd::broadcast(1.0f / simd::sum(total));
  Floats acc[256 / LANES];
  for (int64_t c = 0; c < chunks; ++c) acc[c] = simd::zeros();
  for (int64_t n = 0; n < count; ++n) {
    const T* value = v + keys[n] * key_stride;
    const Floats w = simd::broadcast(weights[n]);
    for (int64_t c = 0; c < chunks; ++c) acc[c] = simd::add(acc[c], simd::mul(w, simd::load(value + c * LANES)));
  }
  for (int64_t c = 0; c < chunks; ++c) simd::store(out + c * LANES, simd::mul(acc[c], inverse));
}

template <typename T>
void attend_all(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                const c10::optional<at::Tensor>& mask, double scale, at::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), length = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), total = key.size(2), groups = heads / kv_heads;
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  const bool* mp = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  const int64_t mask_batch = mask.has_value() && mask->size(0) > 1 ? mask->stride(0) : 0;  // one mask for all rows
  float* op = out.data_ptr<float>();
  at::parallel_for(0, batch * length * heads, 1, [&](int64_t begin, int64_t end) {
    Workspace work;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % heads, t = (task / heads) % length, b = task / (heads * length);
      work.keys.clear();
      if (mp == nullptr) {  // causal: query t sees keys [0, total - length + t]
        for (int64_t s = 0; s <= total - length + t; ++s) work.keys.push_back(s);
      } else {
        const bool* row = mp + b * mask_batch + t * mask->stride(2);
        for (int64_t s = 0; s < total; ++s)
          if (row[s * mask->stride(3)]) work.keys.push_back(s);
      }
      const int64_t kv = h / groups;
      attend_one<T>(qp + b * query.stride(0) + h * query.stride(1) + t * query.stride(2),
                    kp + b * key.stride(0) + kv * key.stride(1), vp + b * value.stride(0) + kv * value.stride(1),
                    key.stride(2), work.keys, dim, static_cast<float>(scale), work.weights,
                    op + ((b * length + t) * heads + h) * dim);
    }
  });
}

// query [B, H, T, d]; key, value [B, Hkv, S, d] (same strides); mask bool [B, 1, T, S] (true: may attend)
// or none (causal, the last T keys being the queries'). Returns float32 [B, T, H, d].
at::Tensor exact_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "query, key, value: [batch, heads, tokens, dim]");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "query, key and value need one dtype");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  const int64_t dim = query.size(3);
  TORCH_CHECK(dim % 16 == 0 && dim <= 256, "head size must be a multiple of 16, at most 256");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "last dimension must be contiguous");
  TORCH_CHECK(key.strides() == value.strides() && key.sizes() == value.sizes(), "key and value need one layout");
  TORCH_CHECK(query.size(1) % key.size(1) == 0 && key.size(2) >= query.size(2), "heads or lengths do not match");
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && (mask->size(0) == query.size(0) || mask->size(0) == 1) &&
                    mask->size(2) == query.size(2) && mask->size(3) == key.size(2),
                "mask: bool [batch, 1, queries, keys]");
  }
  at::Tensor out = at::empty({query.size(0), query.size(2), query.size(1), dim}, query.options().dtype(at::kFloat));
  if (query.scalar_type() == at::kFloat) {
    attend_all<float>(query, key, value, mask, scale, out);
  } else {
    attend_all<at::BFloat16>(query, key, value, mask, scale, out);
  }
  return out;
}

}  // namespace

// The schema is defined in fastforward/native.py, beside its shape function for torch.compile.
TORCH_LIBRARY_IMPL(fastforward, CPU, m) { m.impl("exact_attention", &exact_attention); }
