// Per-query building blocks shared by the forward and backward of both modes: the G main heads
// of one proxy group are processed together so that each tile of attended keys is read once
// per query for all of them. T is the compute type (kernels.h).
#pragma once

#include <cstdint>
#include <numeric>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/tensor.h"
#include "flash_msa/msa.h"

namespace flash_msa::cpu {

struct Dims {
  explicit Dims(const Problem& p)
      : B(p.batch),
        S(p.seqlen),
        H(p.heads),
        Hk(p.kv_heads),
        Hp(p.proxy_heads),
        Hpk(p.proxy_kv_heads),
        D(p.head_dim),
        Dp(p.proxy_head_dim),
        K(p.top_k),
        G(H / Hp),
        Sq(p.queries()),
        Q0(p.query_offset) {}
  int64_t kv_head(int64_t h) const { return h / (H / Hk); }
  int64_t proxy_key_head(int64_t p) const { return p / (Hp / Hpk); }
  int64_t rows() const { return B * Hp * Sq; }  // (b, p, i) query rows
  // The KL mean is over every row of the sequence, B * Hp * S, also for a query shard.
  int64_t kl_rows() const { return B * Hp * S; }

  // S key positions; Sq queries, query i at position Q0 + i (Problem::query_offset).
  int64_t B, S, H, Hk, Hp, Hpk, D, Dp, K, G, Sq, Q0;
};

// Heads g and g + 1 of the group from h0 read the same kv head, so they can share key loads.
inline bool same_kv(const Dims& d, int64_t h0, int64_t g) {
  return g + 1 < d.G && d.kv_head(h0 + g) == d.kv_head(h0 + g + 1);
}

// out[g * n + x] = <rows[g], key x of kv head kv_head(h0 + g)> for the G heads from h0, over the
// n attended keys.
template <class T>
void group_dots(const Dims& d, int64_t b, int64_t h0, const T* rows, const Packed<T>& keys,
                const KeyRange* ranges, int64_t num_ranges, T* out, int64_t n) {
  for_each_key_tile(ranges, num_ranges, [&](int64_t j, int64_t len, int64_t x) {
    for (int64_t g = 0; g < d.G;) {
      const T* k = keys.row(b, d.kv_head(h0 + g), j);
      if (same_kv(d, h0, g)) {
        dots2(rows + g * d.D, rows + (g + 1) * d.D, k, len, d.D, out + g * n + x,
              out + (g + 1) * n + x);
        g += 2;
      } else {
        dots(rows + g * d.D, k, len, d.D, out + g * n + x);
        g += 1;
      }
    }
  });
}

// acc[g] += sum_x coef[g * n + x] * (key x of kv head kv_head(h0 + g)).
template <class T>
void group_axpy(const Dims& d, int64_t b, int64_t h0, const T* coef, const Packed<T>& keys,
                const KeyRange* ranges, int64_t num_ranges, int64_t n, T* acc) {
  for_each_key_tile(ranges, num_ranges, [&](int64_t j, int64_t len, int64_t x) {
    for (int64_t g = 0; g < d.G;) {
      const T* k = keys.row(b, d.kv_head(h0 + g), j);
      const bool pair = same_kv(d, h0, g);
      axpy2(acc + g * d.D, pair ? acc + (g + 1) * d.D : nullptr, coef + g * n + x,
            coef + (g + 1) * n + x, 1, k, len, d.D);
      g += pair ? 2 : 1;
    }
  });
}

// key_acc[kv_head(h0 + g), key x] += sum_g coef[g * n + x] * rows[g]: the transpose of
// group_axpy into a [B, Hk, S, D] accumulator, all heads of a kv head per pass over two keys.
template <class T>
void group_scatter(const Dims& d, int64_t b, int64_t h0, const T* coef, const T* rows,
                   const KeyRange* ranges, int64_t num_ranges, int64_t n, T* key_acc) {
  for (int64_t g0 = 0; g0 < d.G;) {
    const int64_t kv = d.kv_head(h0 + g0);
    int64_t g1 = g0 + 1;
    while (g1 < d.G && d.kv_head(h0 + g1) == kv) ++g1;
    T* base = key_acc + (b * d.Hk + kv) * d.S * d.D;
    const T* c = coef + g0 * n;
    int64_t x = 0;
    for (int64_t r = 0; r < num_ranges; ++r)
      for (int64_t j = ranges[r].begin; j < ranges[r].end;) {
        const bool pair = j + 1 < ranges[r].end;
        axpy2(base + j * d.D, pair ? base + (j + 1) * d.D : nullptr, c + x, c + x + 1, n,
              rows + g0 * d.D, g1 - g0, d.D);
        const int64_t step = pair ? 2 : 1;
        j += step;
        x += step;
      }
    g0 = g1;
  }
}

// out[x] = <row, proxy key x> over the n attended keys of proxy key head `pk`.
template <class T>
void proxy_dots(const Dims& d, int64_t b, int64_t pk, const T* row, const Packed<T>& kp,
                const KeyRange* ranges, int64_t num_ranges, T* out) {
  for_each_key_tile(ranges, num_ranges, [&](int64_t j, int64_t len, int64_t x) {
    dots(row, kp.row(b, pk, j), len, d.Dp, out + x);
  });
}

// The forward (attention_forward.cc) and the backward (attention_backward.cc) of both modes in
// compute type T (float, or double for float64 tensors), also that of the statistics; entry.cc
// checks a call and runs it in its compute type.
template <class T>
void forward(const ForwardParams& params, bool warmup);
template <class T>
void backward(const BackwardParams& params, bool warmup);

// The KL value (SPEC section 3): the mean of the per-row terms over the B * Hp * S rows, summed
// in row order.
template <class T>
T kl_mean(const std::vector<double>& kl_rows, const Dims& d) {
  return static_cast<T>(std::accumulate(kl_rows.begin(), kl_rows.end(), 0.0) /
                        static_cast<double>(d.kl_rows()));
}

// Query row r = (b, p, i) of a call, in order: b, p, i, the group's first head h0 = p G, the
// query's position pos among the keys, then the key ranges it attends (its selected blocks in
// the documents, or every visible key in warmup) written to `ranges`, their number and their key
// count; the group's G query rows, scaled by the main scale, go to q [G, D].
struct QueryRow {
  int64_t b, p, i, h0, pos, ranges, keys;
};
template <class Params, class T>
QueryRow query_row(const Params& params, const Dims& d, int64_t r, bool warmup,
                   const std::vector<int32_t>& starts, KeyRange* ranges, T* q) {
  const Problem& pr = params.problem;
  const int64_t b = r / (d.Hp * d.Sq), p = r / d.Sq % d.Hp, i = r % d.Sq, pos = d.Q0 + i;
  const int64_t h0 = p * d.G;
  const int32_t* row = warmup ? nullptr : params.indices + r * d.K;
  const int64_t nr =
      attended_ranges(row, d.K, starts[static_cast<size_t>(b * d.S + pos)], pos, ranges);
  for (int64_t g = 0; g < d.G; ++g) {
    T* qg = q + g * d.D;
    load_row(pr.dtype, params.q.data, offset(params.q, b, h0 + g, i), d.D, qg);
    for (int64_t c = 0; c < d.D; ++c) qg[c] *= pr.scale;
  }
  return {b, p, i, h0, pos, nr, key_count(ranges, nr)};
}

// The largest attended-key count of any query: K blocks, or every key in warmup.
inline int64_t max_attended(const Dims& d, bool warmup) {
  const int64_t num_blocks = (d.S + kBlockSize - 1) / kBlockSize;
  return warmup ? d.S : std::min(d.K, num_blocks) * kBlockSize;
}

}  // namespace flash_msa::cpu
