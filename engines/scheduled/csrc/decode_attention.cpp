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
//
// A sequence's context is read in tiles of TILE positions, each tile once (its K, then its V while the rows
// are in L1), with the softmax kept online (running max and sum, the accumulator rescaled when the max
// grows), so no row is fetched twice. TILE is the paged policy's default block size: with 16-token blocks a
// tile is one block, a run of contiguous rows wherever the block lies. While a tile is computed the next
// tile's rows are prefetched: a block table's next block starts anywhere in the pool, where the hardware
// prefetcher (which follows one stream within a page) cannot guess it; a contiguous buffer loses nothing.
// The head size is a compile-time constant for the common 64 and 128 (the dot products and the accumulation
// unroll fully), a run-time one otherwise.
// Registered as a torch operator (torch.ops.fragbench.decode_attention) from ATen's core headers alone: a pybind
// module needs <torch/extension.h>, whose parsing was most of the build (50 s of g++ against 11 s, measured on the
// 2-core machine while it was loaded), and every venv builds it once.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t TILE = 16;

template <int64_t HEAD_DIM>  // 0: the head size read from q at run time
void attend(const at::Tensor& q, const at::Tensor& store, const at::Tensor& rows,
            const at::Tensor& lengths, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = HEAD_DIM > 0 ? HEAD_DIM : q.size(2);
  const int64_t KVH = store.size(2), G = H / KVH, L = rows.size(1);
  const int64_t row_floats = 2 * KVH * D;
  const float* qp = q.data_ptr<float>();
  const float* sp = store.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  // one sequence a task
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(H * TILE), acc(H * D), top(H), sum(H);
    const float* tile[TILE];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = lp[b];
      const float* qb = qp + b * H * D;
      const int64_t* rb = rp + b * L;
      std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int64_t tn = std::min(TILE, n - t0);
        for (int64_t j = 0, ahead = std::min(TILE, n - t0 - TILE); j < ahead; ++j) {  // the next tile's rows
          const char* row = reinterpret_cast<const char*>(sp + rb[t0 + TILE + j] * row_floats);
          for (int64_t byte = 0; byte < row_floats * 4; byte += 64) __builtin_prefetch(row + byte);
        }
        for (int64_t j = 0; j < tn; ++j) tile[j] = sp + rb[t0 + j] * row_floats;
        // scores of the tile, head by head (each head's query stays in registers)
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = qb + h * D;
          const int64_t k_at = (h / G) * D;  // K of every kv head, then V of every kv head
          float* sc = scores.data() + h * TILE;
          for (int64_t j = 0; j < tn; ++j) {
            const float* k = tile[j] + k_at;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
            sc[j] = dot * scale;
          }
        }
        // online softmax: what was accumulated under a smaller max is rescaled to the new one
        for (int64_t h = 0; h < H; ++h) {
          float* sc = scores.data() + h * TILE;
          float m = top[h];
          for (int64_t j = 0; j < tn; ++j) m = sc[j] > m ? sc[j] : m;
          if (m > top[h]) {
            const float c = std::exp(top[h] - m);  // 0 on the first tile (top is -inf)
            sum[h] *= c;
            float* a = acc.data() + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= c;
            top[h] = m;
          }
          float total = 0.f;
          for (int64_t j = 0; j < tn; ++j) {
            sc[j] = std::exp(sc[j] - m);
            total += sc[j];
          }
          sum[h] += total;
        }
        for (int64_t h = 0; h < H; ++h) {
          const int64_t v_at = KVH * D + (h / G) * D;
          const float* sc = scores.data() + h * TILE;
          float* a = acc.data() + h * D;
          for (int64_t j = 0; j < tn; ++j) {
            const float w = sc[j];
            const float* v = tile[j] + v_at;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* o = op + (b * H + h) * D;
        const float inv = 1.f / sum[h];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[h * D + d] * inv;
      }
    }
  });
}

}  // namespace

at::Tensor decode_attention(at::Tensor q, at::Tensor store, at::Tensor rows, at::Tensor lengths,
                               double scale) {
  // the kernel dereferences every input's data pointer on the host: a CUDA (or meta) tensor among them, a CPU
  // store with a GPU query say, would be read as host memory
  const std::pair<const char*, const at::Tensor*> inputs[] = {{"q", &q}, {"store", &store}, {"rows", &rows},
                                                                 {"lengths", &lengths}};
  for (const auto& [name, t] : inputs) {
    TORCH_CHECK(t->device().is_cpu(), "decode_attention: every input must be on the CPU; ", name, " is on ",
                t->device().str(), " (the runner attends through torch off the CPU)");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat && store.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && store.is_contiguous() && rows.is_contiguous() && lengths.is_contiguous(),
              "decode_attention: contiguous inputs only");
  auto out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  switch (q.size(2)) {
    case 64: attend<64>(q, store, rows, lengths, s, out); break;
    case 128: attend<128>(q, store, rows, lengths, s, out); break;
    default: attend<0>(q, store, rows, lengths, s, out);
  }
  return out;
}

TORCH_LIBRARY(fragbench, m) {
  m.def("decode_attention(Tensor q, Tensor store, Tensor rows, Tensor lengths, float scale) -> Tensor",
        &decode_attention);
}
