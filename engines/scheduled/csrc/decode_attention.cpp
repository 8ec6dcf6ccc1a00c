// Decode attention straight from the KV store (CPU, fp32): each sequence's one query against its context
// rows, read where they lie (block tables or a contiguous buffer), with no gathered copy. The runner's
// torch path gathers a bucket's rows (one copy of every live token's K and V per layer) and then reads the
// copy; this reads each row once.
//
//   out[b, h] = softmax_l(q[b, h] . K[rows[b, l]] * scale) @ V[rows[b, l]],   l < lengths[b]
//
// store: [rows, 2, kv_heads, head_dim] (one layer: K then V of each row); q: [B, heads, head_dim];
// rows: [B, L] int64 (padded past lengths[b]); grouped heads: query head h reads kv head h / (heads / kv_heads).
// Sequences are shared out over torch's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor store, torch::Tensor rows, torch::Tensor lengths,
                               double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && store.scalar_type() == torch::kFloat32,
              "decode_attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && store.is_contiguous() && rows.is_contiguous() && lengths.is_contiguous(),
              "decode_attention: contiguous inputs only");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = store.size(2), G = H / KVH, L = rows.size(1);
  const int64_t row_floats = 2 * KVH * D;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* sp = store.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  // one sequence a task: each of its rows is read once, every head's K (then V) of it at a time
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(H * L), acc(H * D), top(H), sum(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = lp[b];
      const float* qb = qp + b * H * D;
      const int64_t* rb = rp + b * L;
      for (int64_t h = 0; h < H; ++h) top[h] = -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < n; ++l) {
        const float* row = sp + rb[l] * row_floats;  // K of every kv head, then V of every kv head
        for (int64_t h = 0; h < H; ++h) {
          const float* k = row + (h / G) * D;
          const float* qh = qb + h * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
          dot *= s;
          scores[h * L + l] = dot;
          top[h] = dot > top[h] ? dot : top[h];
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float total = 0.f;
        for (int64_t l = 0; l < n; ++l) {
          const float e = std::exp(scores[h * L + l] - top[h]);
          scores[h * L + l] = e;
          total += e;
        }
        sum[h] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < n; ++l) {
        const float* values = sp + rb[l] * row_floats + KVH * D;
        for (int64_t h = 0; h < H; ++h) {
          const float w = scores[h * L + l];
          const float* v = values + (h / G) * D;
          float* a = acc.data() + h * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* o = op + (b * H + h) * D;
        const float inv = 1.f / sum[h];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[h * D + d] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention read straight from the KV store (CPU, fp32)");
}
