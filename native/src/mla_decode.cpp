#include "mla_decode.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "attention_decode.h"
#include "thread_pool.h"

namespace hmoe {
namespace {

// Heads are the work units of both projections: a head's rows of kv_b are read once for
// all the step's rows.
struct Heads {
    const MlaDecode* m;
    const KernelTable* kt;
    const float* q;
    float* q_latent;  // [T, H, c + rope]
    float* latent;    // [T, H, c]
    float* out;
    int64_t T;
    std::atomic<int64_t> next{0};
};

// q_latent[t, h] = [W_UK[h]^T q_nope[t, h] | q_rope[t, h]]: a sum of W_UK[h]'s rows, which the
// kernels' transposed GEMV streams once for all the step's rows. (Plain loops in this
// baseline-compiled file did it before: the kernel took the DeepSeek-shaped benchmark model's
// decode attention, 8 layers of 16 heads, from 2.43 to 2.08 ms a token, medians of 9 passes,
// the two builds in turn; 2-core Zen 4.)
void phase_absorb(void* ctx, int, int) {
    Heads& a = *static_cast<Heads*>(ctx);
    const MlaDecode& m = *a.m;
    const int64_t esz = m.kv_b_fmt == FMT_F32 ? 4 : 2, width = m.nope + m.rope, cr = m.c + m.rope;
    std::vector<const float*> x(size_t(a.T));
    std::vector<float*> out(size_t(a.T));
    for (int64_t h; (h = a.next.fetch_add(1, std::memory_order_relaxed)) < m.H;) {
        for (int64_t t = 0; t < a.T; ++t) {
            float* dst = a.q_latent + (t * m.H + h) * cr;
            std::fill(dst, dst + m.c, 0.f);
            std::memcpy(dst + m.c, a.q + t * m.H * width + h * width + m.nope, size_t(m.rope) * 4);
            x[size_t(t)] = a.q + t * m.H * width + h * width;
            out[size_t(t)] = dst;
        }
        const auto* rows = static_cast<const uint8_t*>(m.kv_b) + h * (m.nope + m.v) * m.c * esz;
        a.kt->rows_axpy(m.kv_b_fmt, rows, m.c * esz, m.nope, m.c, x.data(), int(a.T), out.data());
    }
}

// out[t, h] = W_UV[h] latent[t, h], by the kernels' float GEMV (up to kMaxGemvTokens rows a call).
void phase_expand(void* ctx, int, int) {
    Heads& a = *static_cast<Heads*>(ctx);
    const MlaDecode& m = *a.m;
    const int64_t esz = m.kv_b_fmt == FMT_F32 ? 4 : 2;
    MatrixRef w;
    w.data = static_cast<const uint8_t*>(m.kv_b);
    w.row_stride = m.c * esz;
    for (int64_t h; (h = a.next.fetch_add(1, std::memory_order_relaxed)) < m.H;) {
        for (int64_t t0 = 0; t0 < a.T; t0 += kMaxGemvTokens) {
            const int n = int(std::min<int64_t>(kMaxGemvTokens, a.T - t0));
            const float* x[kMaxGemvTokens];
            for (int i = 0; i < n; ++i) x[i] = a.latent + ((t0 + i) * m.H + h) * m.c;
            a.kt->gemv_f32[m.kv_b_fmt](w, h * (m.nope + m.v) + m.nope, m.v, m.c, x, n, a.out + t0 * m.H * m.v + h * m.v,
                                       m.H * m.v);
        }
    }
}

}  // namespace

void mla_attend_rows(Executor& exec, const KernelTable& kt, const MlaDecode& m, const float* q, int64_t T,
                     const int64_t* tables, int64_t table_len, const int64_t* lengths, float* out) {
    const int64_t cr = m.c + m.rope;
    std::vector<float> q_latent(size_t(T * m.H * cr)), latent(size_t(T * m.H * m.c));
    Heads heads{&m, &kt, q, q_latent.data(), latent.data(), out, T};
    exec.run(phase_absorb, &heads);
    std::vector<DecodeAttention> rows(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
        DecodeAttention& a = rows[size_t(t)];
        a.q = q_latent.data() + t * m.H * cr;
        a.k = a.v = m.cache;
        a.kv_bf16 = m.cache_bf16;
        a.Hq = m.H;
        a.Hkv = 1;
        a.D = cr;
        a.Dv = m.c;
        a.S = lengths[t];
        a.k_head = a.v_head = 0;
        a.k_pos = a.v_pos = cr;
        a.scale = m.scale;
        a.out = latent.data() + t * m.H * m.c;
        a.blocks = tables + t * table_len;
        a.block_size = m.block;
        a.k_block = a.v_block = m.block * cr;
    }
    attend_decode_rows(exec, kt, rows.data(), int(T));
    heads.next = 0;
    exec.run(phase_expand, &heads);
}

}  // namespace hmoe
