#include "mla_decode.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_decode.h"
#include "scratch.h"
#include "thread_pool.h"

namespace hmoe {
namespace {

// Heads are the work units of both projections: a head's rows of the maps are read once for
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

// Q8 activations of up to kMaxGemvTokens rows, per thread.
struct Q8Scratch {
    std::vector<int8_t> q;
    std::vector<float> d, s;
};
thread_local Q8Scratch tls_q8;

// out[t * ldo + r] = row row0 + r of w . x[t] for r < nrows, t < T: the kernels' GEMV in
// groups of four rows of x, whose activations are quantized here for a quantized format.
void head_gemv(const KernelTable& kt, Format fmt, const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K,
               const float* const* x, int64_t T, float* out, int64_t ldo) {
    const FormatInfo& fi = kFormats[fmt];
    for (int64_t t0 = 0; t0 < T; t0 += kMaxGemvTokens) {
        const int n = int(std::min<int64_t>(kMaxGemvTokens, T - t0));
        if (fi.float_acts) {
            kt.gemv_f32[fmt](w, row0, nrows, K, x + t0, n, out + t0 * ldo, ldo);
            continue;
        }
        const int v = act_variant(fi);
        Q8Scratch& b = tls_q8;
        b.q.resize(size_t(kMaxGemvTokens * K));
        b.d.resize(size_t(kMaxGemvTokens * K / 32));
        b.s.resize(b.d.size());
        Q8Row acts[kMaxGemvTokens];
        for (int i = 0; i < n; ++i) {
            int8_t* q = b.q.data() + i * K;
            float *d = b.d.data() + i * (K / 32), *s = b.s.data() + i * (K / 32);
            kt.quantize(x[t0 + i], K, v, q, d, s);
            acts[i] = {q, d, s};
        }
        kt.gemv_q8[fmt](w, row0, nrows, K, acts, n, out + t0 * ldo, ldo);
    }
}

// q_latent[t, h] = [W_UK[h]^T q_nope[t, h] | q_rope[t, h]]. Joined maps hold W_UK[h]'s rows,
// whose sum the kernels' transposed GEMV streams once for all the step's rows (plain loops
// in this baseline-compiled file did it before: the kernel took the DeepSeek-shaped
// benchmark model's decode attention, 8 layers of 16 heads, from 2.43 to 2.08 ms a token,
// medians of 9 passes, the two builds in turn; 2-core Zen 4); split maps hold it transposed,
// an ordinary GEMV.
void phase_absorb(void* ctx, int, int) {
    Heads& a = *static_cast<Heads*>(ctx);
    const MlaDecode& m = *a.m;
    const LatentMaps& maps = *m.maps;
    const int64_t width = m.nope + m.rope, cr = m.c + m.rope;
    std::vector<const float*> x(size_t(a.T));
    std::vector<float*> out(size_t(a.T));
    for (int64_t h; (h = a.next.fetch_add(1, std::memory_order_relaxed)) < m.H;) {
        for (int64_t t = 0; t < a.T; ++t) {
            float* dst = a.q_latent + (t * m.H + h) * cr;
            if (!maps.split) std::fill(dst, dst + m.c, 0.f);
            std::memcpy(dst + m.c, a.q + t * m.H * width + h * width + m.nope, size_t(m.rope) * 4);
            x[size_t(t)] = a.q + t * m.H * width + h * width;
            out[size_t(t)] = dst;
        }
        if (maps.split) {
            head_gemv(*a.kt, maps.k_fmt, maps.k_map, h * m.c, m.c, m.nope, x.data(), a.T, a.q_latent + h * cr, m.H * cr);
        } else {
            const uint8_t* rows = maps.k_map.row(h * (m.nope + m.v));
            a.kt->rows_axpy(maps.k_fmt, rows, maps.k_map.row_stride, m.nope, m.c, x.data(), int(a.T), out.data());
        }
    }
}

// out[t, h] = W_UV[h] latent[t, h].
void phase_expand(void* ctx, int, int) {
    Heads& a = *static_cast<Heads*>(ctx);
    const MlaDecode& m = *a.m;
    const LatentMaps& maps = *m.maps;
    std::vector<const float*> x(size_t(a.T));
    for (int64_t h; (h = a.next.fetch_add(1, std::memory_order_relaxed)) < m.H;) {
        for (int64_t t = 0; t < a.T; ++t) x[size_t(t)] = a.latent + (t * m.H + h) * m.c;
        const int64_t row0 = maps.split ? h * m.v : h * (m.nope + m.v) + m.nope;
        head_gemv(*a.kt, maps.v_fmt, maps.v_map, row0, m.v, m.c, x.data(), a.T, a.out + h * m.v, m.H * m.v);
    }
}

int64_t row_bytes(Format fmt, int64_t K) { return K / kFormats[fmt].block * kFormats[fmt].block_bytes; }

// A quantized GEMV needs whole blocks and whole Q8 activation groups along K, the scales in
// the blocks, and a head's `rows` whole groups of a row-interleaved layout.
bool readable(Format fmt, int64_t K, int64_t rows) {
    const FormatInfo& f = kFormats[fmt];
    return rows % f.row_group == 0 && f.scale_bytes == 0 && K % f.block == 0 && (f.float_acts || K % f.act_group == 0);
}

}  // namespace

LatentMaps::LatentMaps(int64_t H_, int64_t nope_, int64_t v_, int64_t c_, bool split_, Format k_fmt_, MatrixRef k_map_,
                       Format v_fmt_, MatrixRef v_map_)
    : H(H_), nope(nope_), v(v_), c(c_), split(split_), k_fmt(k_fmt_), v_fmt(v_fmt_), k_map(k_map_), v_map(v_map_) {
    if (H < 1 || nope < 1 || v < 1 || c < 1 || !k_map.data || !v_map.data) throw std::invalid_argument("bad latent maps");
    if (!split && (!kFormats[k_fmt].float_acts || k_fmt != v_fmt || k_map.data != v_map.data))
        throw std::invalid_argument("joined latent maps are one float kv_b matrix");
    if (split && (!readable(k_fmt, nope, c) || !readable(v_fmt, c, v)))
        throw std::invalid_argument(std::string("latent maps in ") + kFormats[k_fmt].name + " / " + kFormats[v_fmt].name +
                                    " the kernels do not read at rows of " + std::to_string(nope) + " / " +
                                    std::to_string(c));
}

int64_t LatentMaps::bytes() const {
    if (!split) return H * (nope + v) * row_bytes(k_fmt, c);
    return H * c * row_bytes(k_fmt, nope) + H * v * row_bytes(v_fmt, c);
}

namespace {

struct Dense {
    const LatentMaps* m;
    const KernelTable* kt;
    void* out;
    bool bf16;
    std::atomic<int64_t> next{0};
};

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) { *p = f32_to_bf16(x); }

thread_local std::vector<float> tls_panel, tls_tmp;

// Rows [row0, row0 + n) of `w` (K columns) into out, through the kernels' k-major panels:
// transposed (out[k * ld + r], which the panels already are) or not (out[r * ld + k]).
template <class T>
void dequant_rows(const KernelTable& kt, Format fmt, const MatrixRef& w, int64_t row0, int64_t n, int64_t K,
                  bool transposed, T* out, int64_t ld) {
    const int P = kt.panel, kc_max = int(std::min<int64_t>(K, 512));
    tls_panel.resize(size_t(P) * kc_max);
    tls_tmp.resize(size_t(P) * (kc_max + 16));
    const float* panel = tls_panel.data();
    for (int64_t r0 = 0; r0 < n; r0 += P) {
        const int rows = int(std::min<int64_t>(P, n - r0));
        for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
            const int kc = int(std::min<int64_t>(kc_max, K - k0));
            kt.dequant_panel(fmt, w, row0 + r0, rows, k0, kc, tls_panel.data(), tls_tmp.data());
            if (transposed) {
                for (int k = 0; k < kc; ++k) {
                    T* dst = out + (k0 + k) * ld + r0;
                    for (int r = 0; r < rows; ++r) store(dst + r, panel[size_t(k) * P + r]);
                }
            } else {
                for (int r = 0; r < rows; ++r) {
                    T* dst = out + (r0 + r) * ld + k0;
                    for (int k = 0; k < kc; ++k) store(dst + k, panel[size_t(k) * P + r]);
                }
            }
        }
    }
}

// Head h's rows of kv_b_proj: W_UK[h] (k_b[h] [c, nope] transposed) then W_UV[h] (v_b[h] [v, c]).
template <class T>
void phase_dense(void* ctx, int, int) {
    Dense& d = *static_cast<Dense*>(ctx);
    const LatentMaps& m = *d.m;
    for (int64_t h; (h = d.next.fetch_add(1, std::memory_order_relaxed)) < m.H;) {
        T* head = static_cast<T*>(d.out) + h * (m.nope + m.v) * m.c;
        dequant_rows(*d.kt, m.k_fmt, m.k_map, h * m.c, m.c, m.nope, true, head, m.c);
        dequant_rows(*d.kt, m.v_fmt, m.v_map, h * m.v, m.v, m.c, false, head + m.nope * m.c, m.c);
    }
}

}  // namespace

void LatentMaps::to_dense(Executor& exec, const KernelTable& kt, void* out, bool bf16) const {
    if (!split) throw std::invalid_argument("joined maps are kv_b_proj already");
    Dense d{this, &kt, out, bf16};
    exec.run(bf16 ? phase_dense<uint16_t> : phase_dense<float>, &d);
}

void mla_attend_rows(Executor& exec, const KernelTable& kt, const MlaDecode& m, const float* q, int64_t T,
                     const int64_t* tables, int64_t table_len, const int64_t* lengths, float* out) {
    const int64_t cr = m.c + m.rope;
    // Kept between the calls of the thread, as decode attention keeps its buffers: new vectors
    // were zero-filled every call (0.5 MB a token and layer at DeepSeek-V3's 128 heads), and
    // every element is written before it is read.
    thread_local std::vector<float> q_latent, latent;
    Heads heads{&m, &kt, q, grow(q_latent, size_t(T * m.H * cr)), grow(latent, size_t(T * m.H * m.c)), out, T};
    exec.run(phase_absorb, &heads);
    std::vector<DecodeAttention> rows(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
        DecodeAttention& a = rows[size_t(t)];
        a.q = q_latent.data() + t * m.H * cr;
        a.k = a.v = m.cache;
        a.kv = m.cache_type;
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
