#include "moe_layer.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>

#include "repack.h"
#include "scratch.h"
#include "thread_pool.h"
#include "topology.h"

namespace hmoe {

// The decode/prefill switch point, measured with `hybridmoe bench kernels --switch`: CPU
// time per expert (both threads, best of 6) when each of a call's experts gets n tokens,
// Qwen3-30B-A3B expert shapes (H 2048, I 768), AMD EPYC Zen 3, 2 cores, AVX2:
//
//   n                8     16     24     32     48     64
//   q4_0   decode  1.47   2.78   3.68   4.48   6.46   8.83   ms
//          prefill 2.85   3.20   4.35   5.09   6.31   8.13
//   q4_k   decode  1.20   2.23   3.30   5.39   8.50  11.28
//          prefill 2.28   2.95   4.61   5.78   7.84   8.33
//   q8_0   decode  1.52   3.53   4.12   6.17   8.66  12.02
//          prefill 2.59   3.34   4.59   6.41   7.87   9.94
//   int4   decode  1.12   2.15   3.23   5.82   8.39   9.02
//          prefill 2.54   3.39   4.61   6.60   8.58   8.75
//
// Decode costs a pass of integer dot products per four tokens (the weights stay in L2
// between passes); prefill costs one dequantization of the expert plus an fp32 GEMM. On
// AVX2 the integer path does about as many multiply-adds per instruction as the FMA
// GEMM, so the crossover is late: 40 to 48 tokens per expert. (The machine was shared:
// wall times were 1.5-3x these CPU times and the ratios moved by ~10 % between runs.)
// AVX-512 doubles the GEMM's width but VNNI only merges two of the integer path's
// instructions, which moves the crossover down; 32 there is an estimate, not measured
// (no AVX-512 machine was at hand). The portable kernels dequantize a block per token
// group in decode, so their prefill is cheaper from the first token.
//
// The row-interleaved copies of q4_0, int4_g32 and q4_k (repack.h) change the picture: their
// integer GEMV needs no horizontal sums, and it stays cheaper than dequantizing plus the
// fp32 GEMM at every count measured (same machine and method; a 512-token prompt gives a
// Qwen3-30B-A3B expert 32 tokens on average):
//
//   n                  32     64    128    256
//   q4_0x8   decode  3.09   6.21  12.09  24.18   ms
//            prefill 5.12  10.17  18.87  36.52
//   int4x8   decode  3.26   6.60  12.92  23.28
//            prefill 5.29   9.14  17.22  32.31
//   q4_kx8   decode  4.30   8.31  17.07  27.35
//            prefill 4.88   8.71  16.70  33.50
//
// so they never take the prefill regime (q4_kx8's two paths are even within the noise from
// 64 tokens on). On AVX-512 the GEMM doubles its width, but VNNI also halves the integer
// path's instructions: an estimate, not measured.
int default_prefill_min_tokens(const KernelTable& kt, Format fmt) {
    if (std::strcmp(kt.name, "scalar") == 0) return 1;
    if (kFormats[fmt].row_group == 8) return kNeverPrefill;
    if (gemv_at_every_count(fmt)) return kNeverPrefill;  // as for prompts: see prompt_takes_gemv
    if (const int iq = iq_prefill_min_tokens(fmt)) return iq;
    if (std::strncmp(kt.name, "avx512", 6) == 0) return 32;
    return 40;
}

namespace {

// Columns dequantized at a time in the prefill regime: whole rows up to this length (a
// multiple of every block size). Gate and up panels of 16 rows x 4096 columns (AVX2) are
// 512 KB of fp32, about one core's L2.
constexpr int kMaxKc = 4096;

// The rows a prefill GEMM multiplies: fp32, or bf16 where it runs on tiles (on_tiles).
struct Rows {
    std::vector<const float*> f32;
    std::vector<const uint16_t*> bf16;
};

// Per-thread scratch, kept between calls (the pool threads are persistent), grown on demand.
struct Scratch {
    std::vector<float> f[6];
    std::vector<const float*> ptrs;
    std::vector<const uint16_t*> ptrs_bf16;
    Rows rows;                // a prefill call's tokens
    std::vector<Q8Row> acts;  // a GEMV call's tokens
    float* get(int slot, size_t n) {
        if (f[slot].size() < n) f[slot].resize(n);
        return f[slot].data();
    }
};
thread_local Scratch tls;

struct Entry {
    int64_t e;      // expert id
    int64_t begin;  // first pair (token, weight) of this expert
    int64_t n;      // number of pairs (tokens)
    bool prefill;
    int node;
};

struct Unit {
    int32_t entry;
    int32_t r0;
    int32_t rows;
};

// Buffers shared by one call's threads; one call runs at a time (the pool runs one phase at
// a time), so they live here and only grow.
struct Workspace {
    std::vector<float> xf;       // x as fp32 when it came as bf16, [T, H]
    std::vector<int8_t> xq;      // Q8 of x, [T, H]
    std::vector<float> xd, xs;   // [T, H / 32]
    std::vector<uint8_t> need_q; // tokens whose x must be quantized
    std::vector<float> xr;       // x rounded to its Q8 values for the prefill GEMM (round_x), [T, H]
    std::vector<float> hf;       // fp32 intermediate per pair, [P, I] (prefill, float formats, and
                                 // decode rows waiting for the rest of their scale group)
    std::vector<uint16_t> hb;    // the prefill intermediate in bf16, [P, I] (down on tiles)
    std::vector<int8_t> hq;      // Q8 intermediate per pair, [P, I] (decode)
    std::vector<float> hd, hs;   // [P, I / 32]
    // Decode, a down format with one activation scale per 256 (see finish_intermediate): the
    // rows of each (pair, group) finished so far, [P, I / 256].
    std::unique_ptr<std::atomic<int32_t>[]> h_done;
    size_t h_done_size = 0;
    std::vector<float> node_out; // partial outputs of nodes 1.., [(nodes - 1), T, H]
    std::vector<float> pair_out; // whole experts: each pair's down output, [P, H]
    std::vector<int64_t> pair_tok;
    std::vector<float> pair_w;
    std::vector<int64_t> counts;
    std::vector<Entry> entries;
    std::vector<std::vector<Unit>> units_b;       // per node
    std::vector<std::vector<int32_t>> entries_of; // per node: entries in that node's down phase
};

std::mutex g_call_mutex;
Workspace g_ws;

struct Call {
    const KernelTable* kt;
    Format fmt, fmt_dn;         // gate/up, down
    int q8, q8_dn;              // gate/up, down: the Q8 activation variant (formats.h's act_variant)
    bool float_fmt, float_dn;   // gate/up, down: fp32 activations instead
    bool round_x, round_h;      // the prefill GEMMs' rows rounded to their Q8 values (prompt_rounds_acts)
    int group, group_dn;        // elements per activation scale (FormatInfo::act_group)
    int64_t T, H, I;
    const std::vector<ExpertWeights>* experts;
    Activation act;
    float alpha, limit;
    const void* x;
    bool x_bf16;
    const float* x32;  // fp32 rows of x (x itself, or ws.xf)
    Workspace* ws;
    float* out;
    int nodes;
    int rows_c;  // H rows per down-phase unit
    int64_t a_units;
    std::unique_ptr<std::atomic<int64_t>[]> next;  // per node (phase A uses slot 0)

    float* out_of(int node) const {
        return node == 0 ? out : ws->node_out.data() + int64_t(node - 1) * T * H;
    }
    Q8Row x_q8(int64_t tok) const {
        return {ws->xq.data() + tok * H, ws->xd.data() + tok * (H / 32), ws->xs.data() + tok * (H / 32)};
    }
    Q8Row h_q8(int64_t pair) const {
        return {ws->hq.data() + pair * I, ws->hd.data() + pair * (I / 32), ws->hs.data() + pair * (I / 32)};
    }
};

// ---- phase A: activations to fp32 and Q8, once per token --------------------------------

void phase_prepare(void* ctx, int, int) {
    Call& c = *static_cast<Call*>(ctx);
    Workspace& ws = *c.ws;
    constexpr int64_t kChunk = 4;
    for (;;) {
        const int64_t u = c.next[0].fetch_add(1, std::memory_order_relaxed);
        if (u >= c.a_units) return;
        for (int64_t t = u * kChunk; t < std::min(c.T, (u + 1) * kChunk); ++t) {
            if (c.x_bf16) {
                const uint16_t* src = static_cast<const uint16_t*>(c.x) + t * c.H;
                float* dst = ws.xf.data() + t * c.H;
                for (int64_t i = 0; i < c.H; ++i) dst[i] = bf16_to_f32(src[i]);
            }
            if (c.round_x) round_to_q8(c.x32 + t * c.H, c.H, c.group, ws.xr.data() + t * c.H);
            if (ws.need_q[size_t(t)]) {
                const Q8Row q = c.x_q8(t);
                c.kt->quantize(c.x32 + t * c.H, c.H, c.q8, const_cast<int8_t*>(q.q),
                               const_cast<float*>(q.d), const_cast<float*>(q.s));
            }
        }
    }
}

// ---- phase B: gate and up, the activation, the intermediate ------------------------------

// Biases, the gated activation, then store the intermediate rows r0 .. r0+rc of one pair:
// fp32 for the prefill regime and float formats, Q8 (in the format's activation order)
// for the decode regime. A decode unit's rows are part of one group of a down format's
// activation scale (256 rows for the K-quants, a unit has 32 or 64): they wait in fp32, and
// the unit that finishes the group's last rows quantizes it (no phase in between).
void finish_intermediate(const Call& c, const ExpertWeights& w, bool prefill, int64_t pair, int r0, int rc, float* g,
                         float* u) {
    if (w.gate_bias)
        for (int i = 0; i < rc; ++i) g[i] += w.gate_bias[r0 + i];
    if (w.up_bias)
        for (int i = 0; i < rc; ++i) u[i] += w.up_bias[r0 + i];
    const bool store_f32 = prefill || c.float_dn;
    const bool part_of_group = !store_f32 && rc < c.group_dn;
    float* h = store_f32 || part_of_group ? c.ws->hf.data() + pair * c.I + r0 : g;  // in place is fine: elementwise
    if (c.act == Activation::GptOss)
        c.kt->gptoss_glu(g, u, h, rc, c.alpha, c.limit);
    else
        c.kt->silu_mul(g, u, h, rc);
    if (prefill && on_tiles(*c.kt, c.fmt_dn, c.x_bf16)) {  // down's tiles take it in bf16
        uint16_t* hb = c.ws->hb.data() + pair * c.I + r0;
        for (int i = 0; i < rc; ++i) hb[i] = f32_to_bf16(h[i]);
    }
    if (store_f32) return;
    if (part_of_group) {
        const int64_t g0 = r0 / c.group_dn * c.group_dn;  // units never straddle groups (see forward)
        std::atomic<int32_t>& done = c.ws->h_done[size_t(pair * (c.I / c.group_dn) + g0 / c.group_dn)];
        // acq_rel: the last unit of the group sees the other units' fp32 rows.
        if (done.fetch_add(rc, std::memory_order_acq_rel) + rc < c.group_dn) return;
        r0 = int(g0);
        rc = c.group_dn;
        h = c.ws->hf.data() + pair * c.I + r0;
    }
    const Q8Row q = c.h_q8(pair);
    c.kt->quantize(h, rc, c.q8_dn, const_cast<int8_t*>(q.q) + r0, const_cast<float*>(q.d) + r0 / 32,
                   const_cast<float*>(q.s) + r0 / 32);
}

void decode_gate_up(const Call& c, const Entry& en, int r0, int rc) {
    const ExpertWeights& w = (*c.experts)[size_t(en.e)];
    float* G = tls.get(0, size_t(en.n) * rc);
    float* U = tls.get(1, size_t(en.n) * rc);
    // All token groups through gate, then all through up: each matrix's rows are read from
    // memory once and stay in L2 for the next group of four tokens (interleaving gate and
    // up per group would need both in L2 at once, more than a core's L2 for large H).
    for (int mi = 0; mi < 2; ++mi) {
        const MatrixRef& m = mi == 0 ? w.gate : w.up;
        float* Y = mi == 0 ? G : U;
        const int64_t step = gemv_step(*c.kt, c.fmt, en.n);
        for (int64_t i = 0; i < en.n; i += step) {
            const int nt = int(std::min<int64_t>(step, en.n - i));
            if (c.float_fmt) {
                const float* xs[kMaxGemvTokens];
                for (int t = 0; t < nt; ++t) xs[t] = c.x32 + c.ws->pair_tok[size_t(en.begin + i + t)] * c.H;
                c.kt->gemv_f32[c.fmt](m, r0, rc, c.H, xs, nt, Y + i * rc, rc);
            } else {
                std::vector<Q8Row>& acts = tls.acts;
                acts.resize(size_t(nt));
                for (int t = 0; t < nt; ++t) acts[size_t(t)] = c.x_q8(c.ws->pair_tok[size_t(en.begin + i + t)]);
                c.kt->gemv_q8[c.fmt](m, r0, rc, c.H, acts.data(), nt, Y + i * rc, rc);
            }
        }
    }
    for (int64_t t = 0; t < en.n; ++t) finish_intermediate(c, w, false, en.begin + t, r0, rc, G + t * rc, U + t * rc);
}

// C[m, npanels * P] += A[m, K] W^T for rows r0 .. r0+rc of the `nmats` matrices (their
// panels side by side in C). Each panel's rows are dequantized over the whole of K (up to
// kMaxKc columns at a time) into k-major panels, then every token runs against them.
//
// Whole rows, not short column chunks: the rows of a panel are one contiguous run of the
// stored matrix, which the hardware prefetchers stream at full speed; sixteen segments of
// a few cache lines at a stride of a row each were mostly cache misses waited for one by
// one (measured: dequantizing took half as long as the GEMM at 32 tokens per expert with
// 256-column chunks, a fifth with whole rows).
void prefill_gemm(const Call& c, Format fmt, const MatrixRef* mats, int nmats, int64_t r0, int rc, int64_t K,
                  const Rows& a, int m, float* C, int64_t ldc) {
    const int P = c.kt->panel;
    const int np = (rc + P - 1) / P;
    const int kc_max = int(std::min<int64_t>(K, kMaxKc));
    float* W = tls.get(2, size_t(nmats) * np * kc_max * P);
    float* tmp = tls.get(3, size_t(P) * (kc_max + 16));
    if (tls.ptrs.size() < size_t(m)) tls.ptrs.resize(size_t(m));
    if (tls.ptrs_bf16.size() < size_t(m)) tls.ptrs_bf16.resize(size_t(m));
    const float** ak = tls.ptrs.data();
    const uint16_t** bk = tls.ptrs_bf16.data();
    for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
        const int kc = int(std::min<int64_t>(kc_max, K - k0));
        for (int mi = 0; mi < nmats; ++mi)
            for (int p = 0; p < np; ++p)
                c.kt->dequant_panel(fmt, mats[mi], r0 + int64_t(p) * P, std::min(P, rc - p * P), k0, kc,
                                    W + (int64_t(mi) * np + p) * kc * P, tmp);
        if (!a.bf16.empty()) {
            for (int i = 0; i < m; ++i) bk[i] = a.bf16[size_t(i)] + k0;
            c.kt->gemm_panels_bf16(bk, m, W, nmats * np, kc, C, ldc);
        } else {
            for (int i = 0; i < m; ++i) ak[i] = a.f32[size_t(i)] + k0;
            c.kt->gemm_panels(ak, m, W, nmats * np, kc, C, ldc);
        }
    }
}

// The m rows a prefill GEMM of `fmt` multiplies (tls.rows): row i's bf16 values where the call
// runs on tiles (on_tiles), else its fp32 ones.
template <class F32Row, class Bf16Row>
const Rows& gemm_rows(const Call& c, Format fmt, int m, F32Row f32_row, Bf16Row bf16_row) {
    Rows& a = tls.rows;
    const bool tiles = on_tiles(*c.kt, fmt, c.x_bf16);
    a.f32.resize(tiles ? 0 : size_t(m));
    a.bf16.resize(tiles ? size_t(m) : 0);
    for (int i = 0; i < m; ++i) {
        if (tiles)
            a.bf16[size_t(i)] = bf16_row(i);
        else
            a.f32[size_t(i)] = f32_row(i);
    }
    return a;
}

void prefill_gate_up(const Call& c, const Entry& en, int r0, int rc) {
    const ExpertWeights& w = (*c.experts)[size_t(en.e)];
    const int P = c.kt->panel;
    const int64_t cols = int64_t((rc + P - 1) / P) * P;  // gate panels, then up panels
    const int m = int(en.n);
    float* C = tls.get(4, size_t(m) * 2 * cols);
    std::fill(C, C + size_t(m) * 2 * cols, 0.f);
    const auto tok = [&](int i) { return c.ws->pair_tok[size_t(en.begin + i)]; };
    const float* x = c.round_x ? c.ws->xr.data() : c.x32;
    const Rows& a = gemm_rows(
        c, c.fmt, m, [&](int i) { return x + tok(i) * c.H; },
        [&](int i) { return static_cast<const uint16_t*>(c.x) + tok(i) * c.H; });
    const MatrixRef mats[2] = {w.gate, w.up};
    prefill_gemm(c, c.fmt, mats, 2, r0, rc, c.H, a, m, C, 2 * cols);
    for (int i = 0; i < m; ++i)
        finish_intermediate(c, w, true, en.begin + i, r0, rc, C + int64_t(i) * 2 * cols, C + int64_t(i) * 2 * cols + cols);
}

void phase_gate_up(void* ctx, int node, int) {
    Call& c = *static_cast<Call*>(ctx);
    const std::vector<Unit>& units = c.ws->units_b[size_t(node)];
    for (;;) {
        const int64_t u = c.next[node].fetch_add(1, std::memory_order_relaxed);
        if (u >= int64_t(units.size())) return;
        const Unit& unit = units[size_t(u)];
        const Entry& en = c.ws->entries[size_t(unit.entry)];
        if (en.prefill)
            prefill_gate_up(c, en, unit.r0, unit.rows);
        else
            decode_gate_up(c, en, unit.r0, unit.rows);
    }
}

// Between phases B and C (round_h): the prefill pairs' intermediates rounded to their Q8 values
// in place, an expert's pairs a unit (a group of the down format's scale spans units of B).
void phase_round_intermediate(void* ctx, int, int) {
    Call& c = *static_cast<Call*>(ctx);
    for (;;) {
        const int64_t u = c.next[0].fetch_add(1, std::memory_order_relaxed);
        if (u >= int64_t(c.ws->entries.size())) return;
        const Entry& en = c.ws->entries[size_t(u)];
        if (!en.prefill) continue;
        for (int64_t pair = en.begin; pair < en.begin + en.n; ++pair) {
            float* h = c.ws->hf.data() + pair * c.I;
            round_to_q8(h, c.I, c.group_dn, h);
        }
    }
}

// ---- phase C: down, weighted into the output ------------------------------------------

void accumulate(const Call& c, float* out, const ExpertWeights& w, int64_t pair, int r0, int rc, const float* y) {
    float* o = out + c.ws->pair_tok[size_t(pair)] * c.H + r0;
    const float wt = c.ws->pair_w[size_t(pair)];
    if (w.down_bias) {
        const float* b = w.down_bias + r0;
        for (int j = 0; j < rc; ++j) o[j] += wt * (y[j] + b[j]);
    } else {
        for (int j = 0; j < rc; ++j) o[j] += wt * y[j];
    }
}

// Y[t, 0 .. rc) = down rows r0 .. r0 + rc times the intermediate of pair `pair` + t, t < nt.
void decode_down(const Call& c, const MatrixRef& down, int64_t pair, int nt, int r0, int rc, float* Y, int64_t ldy) {
    if (c.float_dn) {
        const float* hs[kMaxGemvTokens];
        for (int t = 0; t < nt; ++t) hs[t] = c.ws->hf.data() + (pair + t) * c.I;
        c.kt->gemv_f32[c.fmt_dn](down, r0, rc, c.I, hs, nt, Y, ldy);
    } else {
        std::vector<Q8Row>& acts = tls.acts;
        acts.resize(size_t(nt));
        for (int t = 0; t < nt; ++t) acts[size_t(t)] = c.h_q8(pair + t);
        c.kt->gemv_q8[c.fmt_dn](down, r0, rc, c.I, acts.data(), nt, Y, ldy);
    }
}

void down_rows(const Call& c, int node, int r0, int rc) {
    float* out = c.out_of(node);
    for (int64_t t = 0; t < c.T; ++t) std::fill(out + t * c.H + r0, out + t * c.H + r0 + rc, 0.f);
    for (int32_t ei : c.ws->entries_of[size_t(node)]) {
        const Entry& en = c.ws->entries[size_t(ei)];
        const ExpertWeights& w = (*c.experts)[size_t(en.e)];
        if (en.prefill) {
            const int P = c.kt->panel;
            const int64_t cols = int64_t((rc + P - 1) / P) * P;
            const int m = int(en.n);
            float* C = tls.get(5, size_t(m) * cols);
            std::fill(C, C + size_t(m) * cols, 0.f);
            const Rows& a = gemm_rows(
                c, c.fmt_dn, m, [&](int i) { return c.ws->hf.data() + (en.begin + i) * c.I; },
                [&](int i) { return c.ws->hb.data() + (en.begin + i) * c.I; });
            prefill_gemm(c, c.fmt_dn, &w.down, 1, r0, rc, c.I, a, m, C, cols);
            for (int i = 0; i < m; ++i) accumulate(c, out, w, en.begin + i, r0, rc, C + int64_t(i) * cols);
            continue;
        }
        const int64_t step = gemv_step(*c.kt, c.fmt_dn, en.n);
        float* Y = tls.get(0, size_t(step) * rc);
        for (int64_t i = 0; i < en.n; i += step) {
            const int nt = int(std::min<int64_t>(step, en.n - i));
            decode_down(c, w.down, en.begin + i, nt, r0, rc, Y, rc);
            for (int t = 0; t < nt; ++t) accumulate(c, out, w, en.begin + i + t, r0, rc, Y + t * rc);
        }
    }
}

void phase_down(void* ctx, int node, int) {
    Call& c = *static_cast<Call*>(ctx);
    if (c.ws->entries_of[size_t(node)].empty()) return;  // nothing on this node: its output stays unused
    const int64_t n_units = (c.H + c.rows_c - 1) / c.rows_c;
    for (;;) {
        const int64_t u = c.next[node].fetch_add(1, std::memory_order_relaxed);
        if (u >= n_units) return;
        const int r0 = int(u * c.rows_c);
        down_rows(c, node, r0, int(std::min<int64_t>(c.rows_c, c.H - r0)));
    }
}

// ---- or phases B and C in one: whole experts ---------------------------------------------

// A decode step's expert in one unit: gate, up and the intermediate over all of I, then down
// over all of H into the pairs' rows of pair_out (weighted and added up after the phase).
void phase_whole_experts(void* ctx, int, int) {
    Call& c = *static_cast<Call*>(ctx);
    const std::vector<Entry>& entries = c.ws->entries;
    for (;;) {
        const int64_t u = c.next[0].fetch_add(1, std::memory_order_relaxed);
        if (u >= int64_t(entries.size())) return;
        const Entry& en = entries[size_t(u)];
        decode_gate_up(c, en, 0, int(c.I));
        const MatrixRef& down = (*c.experts)[size_t(en.e)].down;
        for (int64_t i = 0; i < en.n; i += kMaxGemvTokens)
            decode_down(c, down, en.begin + i, int(std::min<int64_t>(kMaxGemvTokens, en.n - i)), 0, int(c.H),
                        c.ws->pair_out.data() + (en.begin + i) * c.H, c.H);
    }
}

// ---- phase D (more than one node): add the other nodes' partial outputs ----------------

void phase_reduce(void* ctx, int, int) {
    Call& c = *static_cast<Call*>(ctx);
    for (;;) {
        const int64_t t = c.next[0].fetch_add(1, std::memory_order_relaxed);
        if (t >= c.T) return;
        float* o = c.out + t * c.H;
        for (int n = 1; n < c.nodes; ++n) {
            if (c.ws->entries_of[size_t(n)].empty()) continue;
            const float* p = c.out_of(n) + t * c.H;
            for (int64_t i = 0; i < c.H; ++i) o[i] += p[i];
        }
    }
}

void reset_counters(Call& c) {
    for (int n = 0; n < std::max(1, c.nodes); ++n) c.next[n].store(0, std::memory_order_relaxed);
}

}  // namespace

// ---- the layer -----------------------------------------------------------------------

MoELayer::MoELayer(Format fmt, Format down_fmt, int64_t hidden, int64_t inter, std::vector<ExpertWeights> experts, std::vector<uint8_t> cpu,
                   Activation act, float alpha, float limit)
    : fmt_(fmt), down_fmt_(down_fmt), H_(hidden), I_(inter), experts_(std::move(experts)), cpu_(std::move(cpu)), act_(act), alpha_(alpha),
      limit_(limit) {
    cpu_.resize(experts_.size(), 0);
    rank_.assign(experts_.size(), 0);
    int r = 0;
    for (size_t e = 0; e < experts_.size(); ++e)
        if (cpu_[e]) rank_[e] = r++;
}

int64_t MoELayer::n_cpu_experts() const {
    return int64_t(std::count(cpu_.begin(), cpu_.end(), uint8_t(1)));
}

int MoELayer::node_of(int64_t e, int n_nodes) const {
    return n_nodes <= 1 ? 0 : rank_[size_t(e)] % n_nodes;
}

int64_t MoELayer::expert_bytes() const {
    auto bytes = [](Format fmt, int64_t rows, int64_t K) {
        const FormatInfo& f = kFormats[fmt];
        return rows * (K / f.block) * (f.block_bytes + f.scale_bytes);
    };
    return 2 * bytes(fmt_, I_, H_) + bytes(down_fmt_, H_, I_);
}

namespace {
// Bytes from the start of m to the end of its last row (or group of rows).
int64_t span_bytes(Format fmt, const MatrixRef& m, int64_t rows) { return rows / kFormats[fmt].row_group * m.row_stride; }
}  // namespace

void MoELayer::interleave(Executor& exec) {
    // Gate and up have I rows, down has H (multiples of 32 whenever the other matrices are
    // quantized, but a float down projection allows any I).
    bool gu_in_file = true, down_in_file = true;
    const ReadOnlyFileMappings files;
    for (size_t e = 0; e < experts_.size(); ++e) {
        if (!cpu_[e]) continue;
        const ExpertWeights& w = experts_[e];
        gu_in_file = gu_in_file && files.holds(w.gate.data, size_t(span_bytes(fmt_, w.gate, I_))) &&
                     files.holds(w.up.data, size_t(span_bytes(fmt_, w.up, I_)));
        down_in_file = down_in_file && files.holds(w.down.data, size_t(span_bytes(down_fmt_, w.down, H_)));
    }
    const Format xfmt = copied_format(fmt_, I_, gu_in_file);
    const Format xdfmt = copied_format(down_fmt_, H_, down_in_file);
    if (xfmt == FMT_COUNT && xdfmt == FMT_COUNT) return;
    const int64_t gu_bytes = xfmt != FMT_COUNT ? interleaved_bytes(xfmt, I_, H_) : 0;
    const int64_t per_expert = 2 * gu_bytes + (xdfmt != FMT_COUNT ? interleaved_bytes(xdfmt, H_, I_) : 0);
    // One block per NUMA node for its experts, allocated before anything changes: contiguous,
    // so that all but its last partial huge page are huge pages (an expert of 2-3 MB alone
    // left a third of itself in 4 KiB pages).
    std::vector<int64_t> on_node(size_t(exec.nodes()), 0);
    for (int64_t e = 0; e < n_experts(); ++e)
        if (cpu_[size_t(e)]) ++on_node[size_t(node_of(e, exec.nodes()))];
    std::vector<OwnedBytes> blocks;
    std::vector<uint8_t*> next(on_node.size(), nullptr);
    for (size_t n = 0; n < on_node.size(); ++n)
        if (on_node[n]) {
            blocks.push_back(allocate_pages(on_node[n] * per_expert));
            next[n] = blocks.back().get();
        }
    std::vector<InterleaveJob> jobs;
    for (int64_t e = 0; e < n_experts(); ++e) {
        if (!cpu_[size_t(e)]) continue;
        const int node = node_of(e, exec.nodes());
        uint8_t* d = next[size_t(node)];
        next[size_t(node)] += per_expert;
        ExpertWeights& w = experts_[size_t(e)];
        if (xfmt != FMT_COUNT) {
            jobs.push_back({fmt_, xfmt, &w.gate, I_, H_, d, node});
            jobs.push_back({fmt_, xfmt, &w.up, I_, H_, d + gu_bytes, node});
        }
        if (xdfmt != FMT_COUNT) jobs.push_back({down_fmt_, xdfmt, &w.down, H_, I_, d + 2 * gu_bytes, node});
    }
    interleave_all(exec, jobs, files);
    owned_bytes_ += per_expert * std::accumulate(on_node.begin(), on_node.end(), int64_t(0));
    for (auto& b : blocks) owned_.push_back(std::move(b));
    if (xfmt != FMT_COUNT) fmt_ = xfmt;
    if (xdfmt != FMT_COUNT) down_fmt_ = xdfmt;
}

int MoELayer::bind_to_nodes(const Executor& exec) {
    if (exec.nodes() <= 1) return 0;
    int bound = 0;
    auto bind = [&](Format fmt, const MatrixRef& m, int64_t rows, int node) {
        if (m.data) bound += bind_memory_to_node(m.data, size_t(span_bytes(fmt, m, rows)), node);
        if (m.scales) bound += bind_memory_to_node(m.scales, size_t(rows * m.scale_row_stride), node);
    };
    for (size_t e = 0; e < experts_.size(); ++e) {
        if (!cpu_[e]) continue;
        const int node = exec.node_id(node_of(int64_t(e), exec.nodes()));
        bind(fmt_, experts_[e].gate, I_, node);
        bind(fmt_, experts_[e].up, I_, node);
        bind(down_fmt_, experts_[e].down, H_, node);
    }
    return bound;
}

void MoELayer::forward(Executor& exec, const KernelTable& kt, const void* x, bool x_bf16, int64_t T, const int64_t* ids,
                       const float* weights, int k, float* out, Regime regime, int prefill_min_tokens) const {
    if (T <= 0) return;
    if (regime == Regime::Prompt) regime = prompt_takes_gemv(kt, fmt_) ? Regime::Decode : Regime::Prefill;
    std::lock_guard<std::mutex> lock(g_call_mutex);
    Workspace& ws = g_ws;
    const int64_t E = n_experts();
    const int nodes = exec.nodes();
    const FormatInfo& fi = kFormats[fmt_];
    const FormatInfo& fd = kFormats[down_fmt_];

    // Route: pairs grouped by expert (tokens ascending within an expert), CPU experts only.
    ws.counts.assign(size_t(E), 0);
    int64_t P = 0;
    for (int64_t i = 0; i < T * k; ++i)
        if (is_cpu(ids[i])) {
            ++ws.counts[size_t(ids[i])];
            ++P;
        }
    if (P == 0) {
        std::fill(out, out + T * H_, 0.f);
        return;
    }
    grow(ws.pair_tok, size_t(P));
    grow(ws.pair_w, size_t(P));
    ws.entries.clear();
    std::vector<int64_t> cursor(static_cast<size_t>(E), 0);
    for (int64_t e = 0, begin = 0; e < E; ++e) {
        const int64_t n = ws.counts[size_t(e)];
        if (!n) continue;
        cursor[size_t(e)] = begin;
        const bool prefill = regime == Regime::Prefill || (regime == Regime::Auto && n >= prefill_min_tokens);
        ws.entries.push_back(Entry{e, begin, n, prefill, node_of(e, nodes)});
        begin += n;
    }
    for (int64_t i = 0; i < T * k; ++i) {
        const int64_t e = ids[i];
        if (!is_cpu(e)) continue;
        const int64_t p = cursor[size_t(e)]++;
        ws.pair_tok[size_t(p)] = i / k;
        ws.pair_w[size_t(p)] = weights[i];
    }

    // Which tokens need Q8 activations (those of decode-regime experts, quantized formats).
    ws.need_q.assign(size_t(T), 0);
    bool any_decode = false, any_prefill = false;
    for (const Entry& en : ws.entries) {
        any_decode |= !en.prefill;
        any_prefill |= en.prefill;
        if (!en.prefill && !fi.float_acts)
            for (int64_t i = 0; i < en.n; ++i) ws.need_q[size_t(ws.pair_tok[size_t(en.begin + i)])] = 1;
    }

    Call c;
    c.kt = &kt;
    c.fmt = fmt_;
    c.fmt_dn = down_fmt_;
    c.q8 = act_variant(fi);
    c.float_fmt = fi.float_acts;
    c.q8_dn = act_variant(fd);
    c.float_dn = fd.float_acts;
    c.round_x = any_prefill && prompt_rounds_acts(fmt_) && !on_tiles(kt, fmt_, x_bf16);
    c.round_h = any_prefill && prompt_rounds_acts(down_fmt_) && !on_tiles(kt, down_fmt_, x_bf16);
    c.group = fi.act_group;
    c.group_dn = fd.act_group;
    c.T = T;
    c.H = H_;
    c.I = I_;
    c.experts = &experts_;
    c.act = act_;
    c.alpha = alpha_;
    c.limit = limit_;
    c.x = x;
    c.x_bf16 = x_bf16;
    c.ws = &ws;
    c.out = out;
    c.nodes = nodes;
    c.next.reset(new std::atomic<int64_t>[size_t(std::max(1, nodes))]);
    if (x_bf16) grow(ws.xf, size_t(T * H_));
    c.x32 = x_bf16 ? ws.xf.data() : static_cast<const float*>(x);
    if (!fi.float_acts && any_decode) {
        grow(ws.xq, size_t(T * H_));
        grow(ws.xd, size_t(T * H_ / 32));
        grow(ws.xs, size_t(T * H_ / 32));
    }
    if (!fd.float_acts && any_decode) {
        grow(ws.hq, size_t(P * I_));
        grow(ws.hd, size_t(P * I_ / 32));
        grow(ws.hs, size_t(P * I_ / 32));
    }
    const bool group_dn_wide = !fd.float_acts && any_decode && fd.act_group > 32;
    if (any_prefill || fd.float_acts || group_dn_wide) grow(ws.hf, size_t(P * I_));
    if (any_prefill && on_tiles(kt, down_fmt_, x_bf16)) grow(ws.hb, size_t(P * I_));
    if (group_dn_wide) {
        const size_t n = size_t(P * I_ / fd.act_group);
        if (ws.h_done_size < n) {
            ws.h_done.reset(new std::atomic<int32_t>[n]);
            ws.h_done_size = n;
        }
        for (size_t i = 0; i < n; ++i) ws.h_done[i].store(0, std::memory_order_relaxed);  // the pool's start publishes
    }
    if (nodes > 1) grow(ws.node_out, size_t(int64_t(nodes - 1) * T * H_));

    if (c.round_x) grow(ws.xr, size_t(T * H_));
    c.a_units = (T + 3) / 4;
    if (x_bf16 || any_decode || c.round_x) {
        reset_counters(c);
        if (c.a_units == 1)
            phase_prepare(&c, 0, 0);  // one unit of work: a phase would only add a wake-up
        else
            exec.run(phase_prepare, &c);
    }

    const int threads = exec.threads();
    // A decode step (no expert with more than one group of tokens) reads each expert's rows once.
    bool one_pass = !any_prefill;
    for (const Entry& en : ws.entries) one_pass &= en.n <= kMaxGemvTokens;
    // Such a step with two or more experts per thread computes each expert whole in one unit,
    // without phase C: one stream through the expert's gate, up and down (one block in the
    // interleaved copy) instead of down rows in pieces of every expert, and one wait for the
    // threads fewer. The pairs' outputs are added up as phase C adds them, expert by expert, so
    // a token gets the same bits either way. A Qwen3-30B-A3B-shaped layer, 8 of 128 experts at
    // one token, 2-core Zen 5, in turn in one process: q4_0 1.04x, q4_k 1.02x, q8_0 1.015x;
    // decode of the 8-layer benchmark models 1.023x (Q4_0), 1.036x (Q4_K_M). Fewer experts
    // than that would leave threads idle; several NUMA nodes keep their own experts (phase C).
    if (one_pass && nodes == 1 && int64_t(ws.entries.size()) >= 2 * threads) {
        grow(ws.pair_out, size_t(P * H_));
        reset_counters(c);
        exec.run(phase_whole_experts, &c);
        std::fill(out, out + T * H_, 0.f);
        for (const Entry& en : ws.entries)
            for (int64_t i = 0; i < en.n; ++i)
                accumulate(c, out, experts_[size_t(en.e)], en.begin + i, 0, int(H_), ws.pair_out.data() + (en.begin + i) * H_);
        return;
    }

    // Work units. Phase B: (expert, rows) with prefill units first, so that the long ones
    // start early and the short decode units fill the gaps at the end. Decode rows come in
    // multiples of 32 (one Q8 block of the intermediate per 32 rows).
    ws.units_b.assign(size_t(nodes), {});
    ws.entries_of.assign(size_t(nodes), {});
    // Decode units: 64 rows when there are enough units to go round and 64 rows of one
    // matrix stay well inside L2 (reused by every group of four tokens), else 32. Where no
    // expert has more than one group of tokens (a decode step), its rows are read once: then
    // as many rows as leave each thread four units. Short units kept the reads well below the
    // wall on a 2-core Xeon VM, whose cores each need ~4 KiB in flight (the Q4_0 decode: 768-row
    // units instead of 64 and 256 down rows instead of 64, 1.12x; not their cold first lines
    // alone: prefetching the next unit's first lines while this one ran gained nothing).
    int64_t decode_rows_total = 0;
    for (const Entry& en : ws.entries)
        if (!en.prefill) decode_rows_total += I_;
    const int64_t row_bytes = H_ / fi.block * (fi.block_bytes + fi.scale_bytes);
    int decode_rows = (decode_rows_total / 64 >= 8 * threads && 64 * row_bytes <= 256 * 1024) ? 64 : 32;
    if (one_pass) {
        // Whole groups of the down format's activation scale: a unit never straddles one.
        const int64_t align = std::max<int64_t>(64, fd.act_group);
        const int64_t rows = decode_rows_total / (4 * threads) / align * align;
        if (rows > decode_rows) decode_rows = int(std::min<int64_t>(rows, I_));
    }
    for (int pass = 0; pass < 2; ++pass) {
        for (size_t ei = 0; ei < ws.entries.size(); ++ei) {
            const Entry& en = ws.entries[ei];
            if (en.prefill != (pass == 0)) continue;
            // A prefill unit is one panel of gate rows and one of up rows (dequantized over
            // all of H, see prefill_gemm): many small units keep the threads balanced.
            const int step = en.prefill ? kt.panel : decode_rows;
            for (int64_t r0 = 0; r0 < I_; r0 += step)
                ws.units_b[size_t(en.node)].push_back(
                    Unit{int32_t(ei), int32_t(r0), int32_t(std::min<int64_t>(step, I_ - r0))});
        }
    }
    for (size_t ei = 0; ei < ws.entries.size(); ++ei) ws.entries_of[size_t(ws.entries[ei].node)].push_back(int32_t(ei));
    // Phase C units: rows of H, sized so that each thread gets a few (a unit covers every
    // expert of its node, so units never write the same output element).
    {
        const int per_node_threads = std::max(1, threads / std::max(1, nodes));
        const int align = std::max(32, kt.panel);
        int rows = int(H_ / (4 * per_node_threads));
        rows = std::max(align, std::min(one_pass ? rows : 64, rows / align * align));
        c.rows_c = rows;
    }

    reset_counters(c);
    exec.run(phase_gate_up, &c);
    if (c.round_h) {
        reset_counters(c);
        exec.run(phase_round_intermediate, &c);
    }
    reset_counters(c);
    exec.run(phase_down, &c);
    if (nodes > 1) {
        // Node 0 may have had no experts: its output rows were then never zeroed.
        if (ws.entries_of[0].empty()) std::fill(out, out + T * H_, 0.f);
        reset_counters(c);
        exec.run(phase_reduce, &c);
    }
}

}  // namespace hmoe
