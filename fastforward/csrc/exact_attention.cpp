// Row-invariant attention for x86 CPUs with AVX-512: fastforward::exact_attention.
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
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t LANES = 16;  // floats per 512-bit register; the head size must be a multiple

inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load(const at::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, times 2^n.
// Inputs below -87 give 0 (a weight e^-87 is below float32's normal range).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 floor_x = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, floor_x, _CMP_LT_OQ);
  x = _mm512_max_ps(x, floor_x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i power = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~tiny), p, _mm512_castsi512_ps(power));
}

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
  __m512 query[16];
  for (int64_t c = 0; c < chunks; ++c) query[c] = load(q + c * LANES);
  const __m512 scale_v = _mm512_set1_ps(scale);
  float top = -INFINITY;
  for (int64_t n = 0; n < count; ++n) {
    const T* key = k + keys[n] * key_stride;
    __m512 dot = _mm512_mul_ps(query[0], load(key));
    for (int64_t c = 1; c < chunks; ++c) dot = _mm512_add_ps(dot, _mm512_mul_ps(query[c], load(key + c * LANES)));
    const float score = _mm512_reduce_add_ps(_mm512_mul_ps(dot, scale_v));
    weights[n] = score;
    top = score > top ? score : top;
  }
  for (int64_t n = count; n < static_cast<int64_t>(weights.size()); ++n) weights[n] = -INFINITY;
  const __m512 top_v = _mm512_set1_ps(top);
  __m512 total = _mm512_setzero_ps();
  for (int64_t n = 0; n < static_cast<int64_t>(weights.size()); n += LANES) {
    const __m512 w = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(&weights[n]), top_v));
    _mm512_storeu_ps(&weights[n], w);
    total = _mm512_add_ps(total, w);
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  __m512 acc[16];
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t n = 0; n < count; ++n) {
    const T* value = v + keys[n] * key_stride;
    const __m512 w = _mm512_set1_ps(weights[n]);
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(w, load(value + c * LANES)));
  }
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + c * LANES, _mm512_mul_ps(acc[c], inverse));
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
  TORCH_CHECK(dim % LANES == 0 && dim <= 16 * LANES, "head size must be a multiple of 16, at most 256");
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
