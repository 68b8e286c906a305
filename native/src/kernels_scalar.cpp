// The portable kernel set: plain C++ for any CPU (aarch64, x86-64 without AVX2), and the
// reading of every format that the SIMD variants are tested against. Compiled with the
// baseline flags only. The arithmetic is deliberately simple: dequantize a block to fp32,
// dot it with the dequantized Q8 activations; no integer tricks to get wrong.
#include <cmath>
#include <utility>

#include "kernel_table.h"

namespace hmoe {
namespace scalar_isa {

#include "block_dequant.inl"

constexpr int kPanel = 8;

// Position of element e of a 32-block in the (possibly permuted) Q8 activation block.
static inline int act_pos(int e, bool deint) { return deint ? ((e & 1) ? 16 + (e >> 1) : (e >> 1)) : e; }

static void gemv_q8(Format fmt, const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                    float* out, int64_t ldo) {
    const int blk = kFormats[fmt].block;
    const bool deint = kFormats[fmt].deinterleave;
    float wf[256];
    for (int64_t r = 0; r < nrows; ++r) {
        double acc[kMaxGemvTokens] = {0, 0, 0, 0};
        for (int64_t b = 0; b < K / blk; ++b) {
            dequant_row_portable(fmt, w, row0 + r, b * blk, blk, wf);
            for (int t = 0; t < ntok; ++t) {
                for (int j = 0; j < blk / 32; ++j) {  // each 32-wide activation block
                    const int64_t ab = b * (blk / 32) + j;
                    const int8_t* q = acts[t].q + 32 * ab;
                    float s = 0.f;
                    for (int e = 0; e < 32; ++e) s += wf[32 * j + e] * float(q[act_pos(e, deint)]);
                    acc[t] += double(s) * double(acts[t].d[ab]);
                }
            }
        }
        for (int t = 0; t < ntok; ++t) out[t * ldo + r] = float(acc[t]);
    }
}

template <Format F>
static void gemv_q8_fmt(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                        float* out, int64_t ldo) {
    gemv_q8(F, w, row0, nrows, K, acts, ntok, out, ldo);
}

template <Format F>
static void gemv_f32_fmt(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const float* const* x, int ntok,
                         float* out, int64_t ldo) {
    float wf[256];
    for (int64_t r = 0; r < nrows; ++r) {
        float acc[kMaxGemvTokens] = {0, 0, 0, 0};
        for (int64_t k0 = 0; k0 < K; k0 += 256) {
            const int kc = int(K - k0 < 256 ? K - k0 : 256);
            dequant_row_portable(F, w, row0 + r, k0, kc, wf);
            for (int t = 0; t < ntok; ++t)
                for (int i = 0; i < kc; ++i) acc[t] += wf[i] * x[t][k0 + i];
        }
        for (int t = 0; t < ntok; ++t) out[t * ldo + r] = acc[t];
    }
}

static void dequant_panel(Format fmt, const MatrixRef& w, int64_t row0, int nrows, int64_t k0, int kc, float* dst,
                          float* tmp) {
    const int64_t ld = kc + 16;  // as the SIMD sets: rows of tmp staggered across cache sets
    for (int r = 0; r < nrows; ++r) dequant_row_portable(fmt, w, row0 + r, k0, kc, tmp + r * ld);
    for (int k = 0; k < kc; ++k) {
        for (int r = 0; r < kPanel; ++r) dst[k * kPanel + r] = r < nrows ? tmp[r * ld + k] : 0.f;
    }
}

static void gemm_panels(const float* const* a, int m, const float* w, int npanels, int kc, float* c, int64_t ldc) {
    for (int i = 0; i < m; ++i) {
        for (int p = 0; p < npanels; ++p) {
            const float* wp = w + int64_t(p) * kc * kPanel;
            float acc[kPanel] = {0};
            for (int k = 0; k < kc; ++k) {
                const float av = a[i][k];
                for (int j = 0; j < kPanel; ++j) acc[j] += av * wp[k * kPanel + j];
            }
            float* crow = c + i * ldc + p * kPanel;
            for (int j = 0; j < kPanel; ++j) crow[j] += acc[j];
        }
    }
}

static void quantize(const float* x, int64_t K, int v, int8_t* q, float* d, float* s) {
    const bool deint = act_variant_permuted(v);
    const int group = act_variant_group(v);
    ActScale a{};
    for (int64_t b = 0; b < K / 32; ++b) {
        const float* xb = x + 32 * b;
        if ((32 * b) % group == 0) a = act_scale(abs_max(xb, group), group);
        int sum = 0;
        for (int e = 0; e < 32; ++e) {
            const int v8 = int(std::nearbyint(xb[e] * a.id));  // half to even, as vcvtps2dq
            q[32 * b + act_pos(e, deint)] = int8_t(v8);
            sum += v8;
        }
        d[b] = a.d;
        s[b] = block_sum(a.d, a.d32, sum, act_variant_sum_f16(v));
    }
}

static void silu_mul(const float* g, const float* u, float* h, int64_t n) {
    for (int64_t i = 0; i < n; ++i) h[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

static void gptoss_glu(const float* g, const float* u, float* h, int64_t n, float alpha, float limit) {
    for (int64_t i = 0; i < n; ++i) {
        const float gc = std::fmin(g[i], limit);
        const float uc = std::fmin(std::fmax(u[i], -limit), limit);
        h[i] = (uc + 1.f) * (gc / (1.f + std::exp(-alpha * gc)));
    }
}

static void attend_queries(const float* q, int64_t n, float scale, Format kv, float* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = attention_rounded(q[i], kv) * scale;
}

static void attend_scores(const float* q, int group, int64_t D, const KvSegment* segs, int n_segs, Format kv,
                          int64_t ldk, int64_t, int64_t n, float* e, int64_t ld, float* m, float* l) {
    for (int g = 0; g < group; ++g) {
        float* sc = e + int64_t(g) * ld;
        float mx = -INFINITY;
        for (int i = 0, p = 0; i < n_segs; ++i)
            for (int64_t s = 0; s < segs[i].n; ++s, ++p) {
                float dot = 0.f;
                for (int64_t d = 0; d < D; ++d) dot += q[g * D + d] * cache_at(segs[i].k, kv, s * ldk + d);
                sc[p] = dot;
                mx = std::fmax(mx, dot);
            }
        float sum = 0.f;
        for (int64_t s = 0; s < n; ++s) sum += (sc[s] = std::exp(sc[s] - mx));
        m[g] = mx;
        l[g] = sum;
    }
}

static void attend_values(float* e, const float* w, int group, int64_t ld, int64_t Dv, const KvSegment* segs,
                          int n_segs, Format kv, int64_t ldv, int64_t n, float* acc) {
    for (int g = 0; g < group; ++g) {
        float* p = e + int64_t(g) * ld;
        for (int64_t s = 0; s < n; ++s) p[s] = attention_rounded(p[s] * w[g], kv);
        float* a = acc + int64_t(g) * Dv;
        for (int64_t j = 0; j < Dv; ++j) a[j] = 0.f;
        for (int i = 0, s0 = 0; i < n_segs; s0 += int(segs[i].n), ++i)
            for (int64_t s = 0; s < segs[i].n; ++s)
                for (int64_t j = 0; j < Dv; ++j) a[j] += p[s0 + s] * cache_at(segs[i].v, kv, s * ldv + j);
    }
}

static void rows_axpy(Format fmt, const uint8_t* rows, int64_t stride, int64_t m, int64_t n, const float* const* x,
                      int ntok, float* const* out) {
    const MatrixRef w{rows, nullptr, stride, 0};
    float wr[256];
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j0 = 0; j0 < n; j0 += 256) {
            const int kc = int(n - j0 < 256 ? n - j0 : 256);
            dequant_row_portable(fmt, w, i, j0, kc, wr);
            for (int t = 0; t < ntok; ++t)
                for (int j = 0; j < kc; ++j) out[t][j0 + j] += x[t][i] * wr[j];
        }
}

// Every format through the same dequantize-and-dot loops: format F's slot gets the loop for F.
template <Format F>
static void fill_gemv(KernelTable& t) {
    if (kFormats[F].float_acts)
        t.gemv_f32[F] = gemv_f32_fmt<F>;
    else
        t.gemv_q8[F] = gemv_q8_fmt<F>;
}
template <size_t... I>
static void fill_gemvs(KernelTable& t, std::index_sequence<I...>) {
    (fill_gemv<Format(I)>(t), ...);  // every enumerator
}

}  // namespace scalar_isa

const KernelTable* kernels_scalar() {
    using namespace scalar_isa;
    static const KernelTable table = [] {
        KernelTable t{};
        t.name = "scalar";
        t.panel = kPanel;
        t.quantize = quantize;
        fill_gemvs(t, std::make_index_sequence<FMT_COUNT>{});
        t.dequant_panel = dequant_panel;
        t.gemm_panels = gemm_panels;
        t.silu_mul = silu_mul;
        t.gptoss_glu = gptoss_glu;
        t.dequant_row = dequant_row_portable;
        t.attend_queries = attend_queries;
        t.attend_scores = attend_scores;
        t.attend_values = attend_values;
        t.rows_axpy = rows_axpy;
        return t;
    }();
    return &table;
}

}  // namespace hmoe
