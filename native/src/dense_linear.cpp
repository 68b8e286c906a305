#include "dense_linear.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "scratch.h"
#include "thread_pool.h"
#include "topology.h"

namespace hmoe {

// The GEMV/GEMM switch point for a whole matrix: the GEMV path costs a pass of integer dot
// products over the weights per four tokens, the GEMM path one dequantization plus the fp32
// GEMM. CPU time of one thread for a 4096 x 2048 matrix, ms (AMD EPYC Zen 3, AVX2):
//
//   T            8      16     24     32     48     64
//   q4_0  gemv  2.61   4.96   7.70  10.36  16.04  20.86
//         gemm  5.24   7.28   9.08  11.63  15.07  14.61
//   q8_0  gemv  2.59   4.99   7.90  11.08  14.82  21.39
//         gemm  4.63   5.75   7.29  10.12  11.97  19.97
//   q4_k  gemv  3.21   6.20   9.18  11.83  15.21  20.78
//         gemm  5.50   7.57   9.26  11.44  13.87  19.49
//   q6_k  gemv  4.24   8.17  10.63  16.88  25.25  29.09
//         gemm  5.59   6.07   7.99  11.88  14.81  17.69
//   bf16  gemv  4.16   6.83  11.08  14.58  17.79  21.79
//         gemm  5.30   8.33   9.98  11.13  15.92  18.86
//
// The paths meet at about 24 tokens (16 for q6_k, whose GEMV unpacks the most bits per
// weight). AVX-512 widens the GEMM more than VNNI speeds the GEMV, so it switches earlier
// there (an estimate: no AVX-512 machine was at hand). The portable kernels dequantize a
// block per token group in the GEMV, so their GEMM is cheaper from the first token.
//
// The row-interleaved copies (repack.h) have the faster GEMV at every count (CPU ms, both
// threads, same matrix; "stored": the layout read in place):
//
//   T                       8      32     128     512
//   q4_0x8  gemv          0.8     3.6    21.1    83.1
//           gemm          1.9     8.9    29.8   123.9
//   q4_0    stored gemm   4.8    14.3    37.1   128.3
//   q4_kx8  gemv          0.9     5.3    27.4   118.2
//           gemm          1.8     7.4    31.9   125.3
//
// and q8_0x8 (wall ms, 5120 x 2048, T = 8 / 32 / 128): gemv 1.2 / 4.1 / 16.2, gemm 2.9 / 5.5 / 20.2.
int dense_prefill_min_tokens(const KernelTable& kt, Format fmt) {
    if (std::strcmp(kt.name, "scalar") == 0) return 1;
    if (kFormats[fmt].row_group == 8) return kNeverPrefill;  // see prefill_min_tokens (moe_layer.cpp)
    if (gemv_at_every_count(fmt)) return kNeverPrefill;  // as for prompts: see prompt_takes_gemv
    if (const int iq = iq_prefill_min_tokens(fmt)) return iq;
    if (std::strncmp(kt.name, "avx512", 6) == 0) return 16;
    return 24;
}

namespace {

constexpr int kMaxKc = 512;  // columns dequantized at a time (as in moe_layer.cpp)

// Q8 activations of the call's tokens in one of the variants the formats read (order and
// scale group, see act_variant).
struct Q8Acts {
    std::vector<int8_t> q;
    std::vector<float> d, s;
};
struct Workspace {
    std::vector<float> xf;     // x as fp32 when it came as bf16
    Q8Acts q8[kActVariants];
    std::vector<float> xr[2];  // x rounded to its Q8 values for the GEMM (round_to_q8): groups of 32, 256
};
std::mutex g_mutex;  // one call at a time uses the workspace
Workspace g_ws;

struct Scratch {
    std::vector<float> w, tmp, c, y;
    std::vector<const float*> a;
    std::vector<const uint16_t*> ab;  // the same rows in bf16 (on tiles)
};
thread_local Scratch tls;

// A run of rows of one part; its output columns start at `col`.
struct Unit {
    Format fmt;
    const MatrixRef* w;
    int64_t r0, col;
    int rows;
};

struct Call {
    const KernelTable* kt;
    std::vector<Unit> work;
    int64_t N, K, T;
    const void* x;
    bool x_bf16;
    bool quantize[kActVariants];  // the Q8 variants the GEMV parts of quantized formats read
    bool round[2];                // the roundings the GEMM parts read (Workspace::xr)
    const float* x32;
    float* out;
    int unit_rows;  // the most rows of a unit
    std::atomic<int64_t> next{0};

    Q8Row q8(int64_t t, int variant) const {
        const Q8Acts& a = g_ws.q8[variant];
        return {a.q.data() + t * K, a.d.data() + t * (K / 32), a.s.data() + t * (K / 32)};
    }
};

void prepare_token(const Call& c, int64_t t) {
    if (c.x_bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(c.x) + t * c.K;
        float* dst = g_ws.xf.data() + t * c.K;
        for (int64_t i = 0; i < c.K; ++i) dst[i] = bf16_to_f32(src[i]);
    }
    for (int v = 0; v < kActVariants; ++v) {
        if (!c.quantize[v]) continue;
        const Q8Row q = c.q8(t, v);
        c.kt->quantize(c.x32 + t * c.K, c.K, v, const_cast<int8_t*>(q.q), const_cast<float*>(q.d),
                       const_cast<float*>(q.s));
    }
    for (int r = 0; r < 2; ++r)
        if (c.round[r]) round_to_q8(c.x32 + t * c.K, c.K, r ? 256 : 32, g_ws.xr[r].data() + t * c.K);
}

// The fp32 rows a GEMM part of `fmt` multiplies: x's Q8 values for a GGUF type (prompt_rounds_acts).
const float* gemm_input(const Call& c, Format fmt) {
    return prompt_rounds_acts(fmt) ? g_ws.xr[kFormats[fmt].act_group == 256].data() : c.x32;
}

void phase_prepare(void* ctx, int, int) {
    Call& c = *static_cast<Call*>(ctx);
    for (;;) {
        const int64_t t = c.next.fetch_add(1, std::memory_order_relaxed);
        if (t >= c.T) return;
        prepare_token(c, t);
    }
}

// GEMV: each unit is a run of rows, computed for every token in groups of four while the
// rows stay in the core's L2.
void phase_gemv(void* ctx, int, int) {
    Call& c = *static_cast<Call*>(ctx);
    for (;;) {
        const int64_t u = c.next.fetch_add(1, std::memory_order_relaxed);
        if (u >= int64_t(c.work.size())) return;
        const Unit& w = c.work[size_t(u)];
        const FormatInfo& fi = kFormats[w.fmt];
        const int64_t step = gemv_step(*c.kt, w.fmt, c.T);
        thread_local std::vector<Q8Row> acts;
        for (int64_t t0 = 0; t0 < c.T; t0 += step) {
            const int nt = int(std::min<int64_t>(step, c.T - t0));
            float* y = c.out + t0 * c.N + w.col;
            if (fi.float_acts) {
                const float* xs[kMaxGemvTokens];
                for (int t = 0; t < nt; ++t) xs[t] = c.x32 + (t0 + t) * c.K;
                c.kt->gemv_f32[w.fmt](*w.w, w.r0, w.rows, c.K, xs, nt, y, c.N);
            } else {
                acts.resize(size_t(nt));
                for (int t = 0; t < nt; ++t) acts[size_t(t)] = c.q8(t0 + t, act_variant(fi));
                c.kt->gemv_q8[w.fmt](*w.w, w.r0, w.rows, c.K, acts.data(), nt, y, c.N);
            }
        }
    }
}

// GEMM: each unit is a few panels of rows, dequantized to fp32 over K (in chunks of up to
// kMaxKc columns) and multiplied with every token; results go through a small buffer so
// that a partial last panel never writes past its rows.
void phase_gemm(void* ctx, int, int) {
    Call& c = *static_cast<Call*>(ctx);
    const int P = c.kt->panel;
    const int kc_max = int(std::min<int64_t>(c.K, kMaxKc));
    const int np_max = c.unit_rows / P;
    float* W = grow(tls.w, size_t(np_max) * kc_max * P);
    float* tmp = grow(tls.tmp, size_t(P) * (kc_max + 16));
    const int64_t ldc = int64_t(np_max) * P;
    float* C = grow(tls.c, size_t(c.T) * ldc);
    const float** a = grow(tls.a, size_t(c.T));
    const uint16_t** ab = grow(tls.ab, size_t(c.T));
    for (;;) {
        const int64_t u = c.next.fetch_add(1, std::memory_order_relaxed);
        if (u >= int64_t(c.work.size())) return;
        const Unit& w = c.work[size_t(u)];
        const int rc = w.rows;
        const int np = (rc + P - 1) / P;
        const bool tiles = on_tiles(*c.kt, w.fmt, c.x_bf16);
        std::fill(C, C + size_t(c.T) * ldc, 0.f);
        for (int64_t k0 = 0; k0 < c.K; k0 += kc_max) {
            const int kc = int(std::min<int64_t>(kc_max, c.K - k0));
            for (int p = 0; p < np; ++p)
                c.kt->dequant_panel(w.fmt, *w.w, w.r0 + int64_t(p) * P, std::min(P, rc - p * P), k0, kc,
                                    W + int64_t(p) * kc * P, tmp);
            if (tiles) {  // the bf16 rows as they came
                for (int64_t t = 0; t < c.T; ++t) ab[t] = static_cast<const uint16_t*>(c.x) + t * c.K + k0;
                c.kt->gemm_panels_bf16(ab, int(c.T), W, np, kc, C, ldc);
            } else {
                const float* rows = gemm_input(c, w.fmt);
                for (int64_t t = 0; t < c.T; ++t) a[t] = rows + t * c.K + k0;
                c.kt->gemm_panels(a, int(c.T), W, np, kc, C, ldc);
            }
        }
        for (int64_t t = 0; t < c.T; ++t) std::memcpy(c.out + t * c.N + w.col, C + t * ldc, size_t(rc) * 4);
    }
}

}  // namespace

DenseLinear::DenseLinear(int64_t cols, std::vector<DensePart> parts)
    : rows_(0), cols_(cols), parts_(std::move(parts)) {
    for (const DensePart& p : parts_) rows_ += p.rows;
}

std::string format_names(const DenseLinear& lin) {
    std::vector<Format> seen;
    std::string names;
    for (const DensePart& p : lin.parts()) {
        if (std::find(seen.begin(), seen.end(), p.fmt) != seen.end()) continue;
        names += (seen.empty() ? "" : "+") + std::string(kFormats[p.fmt].name);
        seen.push_back(p.fmt);
    }
    return names;
}

namespace {
// The rows of the parts that `take` (each part's own output columns kept) in runs of
// `unit_rows` (a part's last run may be shorter).
template <class Take>
void split(Call& c, const std::vector<DensePart>& parts, int unit_rows, Take take) {
    c.unit_rows = unit_rows;
    c.work.clear();
    int64_t col = 0;
    for (const DensePart& p : parts) {
        if (take(p))
            for (int64_t r0 = 0; r0 < p.rows; r0 += unit_rows)
                c.work.push_back(Unit{p.fmt, &p.w, r0, col + r0, int(std::min<int64_t>(unit_rows, p.rows - r0))});
        col += p.rows;
    }
}
}  // namespace

void DenseLinear::interleave(Executor& exec) {
    const Format fmt = parts_[0].fmt;  // a projection as constructed: one format
    int64_t rows = 0;
    bool in_file = true;
    const ReadOnlyFileMappings files;
    for (const DensePart& p : parts_) {
        rows |= p.rows;  // a multiple of 8 when every part's is
        in_file = in_file && files.holds(p.w.data, size_t(p.rows * p.w.row_stride));
    }
    const Format xfmt = copied_format(fmt, rows, in_file);
    if (xfmt == FMT_COUNT) return;
    int64_t total = 0;
    for (const DensePart& p : parts_) total += interleaved_bytes(xfmt, p.rows, cols_);
    OwnedBytes block = allocate_pages(total);
    // The sources in runs of 256 rows, one job each: enough jobs to share out among the threads.
    size_t n_runs = 0;
    for (const DensePart& p : parts_) n_runs += size_t((p.rows + 255) / 256);
    std::vector<MatrixRef> runs;
    runs.reserve(n_runs);  // the jobs point into it
    std::vector<InterleaveJob> jobs;
    uint8_t* d = block.get();
    for (const DensePart& p : parts_) {
        for (int64_t r0 = 0; r0 < p.rows; r0 += 256) {
            MatrixRef m = p.w;
            m.data += r0 * m.row_stride;
            if (m.scales) m.scales += r0 * m.scale_row_stride;
            runs.push_back(m);
            jobs.push_back({fmt, xfmt, &runs.back(), std::min<int64_t>(256, p.rows - r0), cols_,
                            d + interleaved_bytes(xfmt, r0, cols_), int(jobs.size()) % exec.nodes()});
        }
        d += interleaved_bytes(xfmt, p.rows, cols_);
    }
    interleave_all(exec, jobs, files);
    d = block.get();
    for (DensePart& p : parts_) {
        p.fmt = xfmt;
        p.w = MatrixRef{d, nullptr, interleaved_bytes(xfmt, kFormats[xfmt].row_group, cols_), 0};
        d += interleaved_bytes(xfmt, p.rows, cols_);
    }
    owned_ = std::move(block);
    owned_bytes_ = total;
}

DenseLinear DenseLinear::join(const std::vector<const DenseLinear*>& lins) {
    std::vector<DensePart> parts;
    for (const DenseLinear* l : lins) {
        if (l->cols_ != lins[0]->cols_) throw std::invalid_argument("projections of different widths cannot be joined");
        parts.insert(parts.end(), l->parts_.begin(), l->parts_.end());
    }
    return DenseLinear(lins[0]->cols_, std::move(parts));
}

void DenseLinear::dequantize_rows(const KernelTable& kt, const int64_t* ids, int64_t n, float* out) const {
    for (int64_t i = 0; i < n; ++i) {
        int64_t r = ids[i];
        const DensePart* p = parts_.data();
        while (r >= p->rows) r -= (p++)->rows;
        kt.dequant_row(p->fmt, p->w, r, 0, int(cols_), out + i * cols_);
    }
}

int64_t DenseLinear::bytes() const {
    int64_t total = 0;
    for (const DensePart& p : parts_) {
        const FormatInfo& f = kFormats[p.fmt];
        total += p.rows * (cols_ / f.block) * (f.block_bytes + f.scale_bytes);
    }
    return total;
}

void DenseLinear::forward(Executor& exec, const KernelTable& kt, const void* x, bool x_bf16, int64_t T, float* out,
                          int prefill_min_tokens) const {
    if (T <= 0) return;
    std::lock_guard<std::mutex> lock(g_mutex);
    Call c;
    c.kt = &kt;
    c.N = rows_;
    c.K = cols_;
    c.T = T;
    c.x = x;
    c.x_bf16 = x_bf16;
    c.out = out;
    auto gemm = [&](const DensePart& p) {
        if (prefill_min_tokens == kPromptRows) return !prompt_takes_gemv(kt, p.fmt);
        return T >= (prefill_min_tokens > 0 ? prefill_min_tokens : dense_prefill_min_tokens(kt, p.fmt));
    };
    int64_t gemv_rows = 0, gemm_rows = 0;
    std::fill(c.quantize, c.quantize + kActVariants, false);
    std::fill(c.round, c.round + 2, false);
    for (const DensePart& p : parts_) {
        const FormatInfo& f = kFormats[p.fmt];
        const bool on_gemm = gemm(p);
        (on_gemm ? gemm_rows : gemv_rows) += p.rows;
        if (!on_gemm && !f.float_acts) c.quantize[act_variant(f)] = true;
        if (on_gemm && prompt_rounds_acts(p.fmt) && !on_tiles(kt, p.fmt, x_bf16)) c.round[f.act_group == 256] = true;
    }
    if (x_bf16) grow(g_ws.xf, size_t(T * cols_));
    c.x32 = x_bf16 ? g_ws.xf.data() : static_cast<const float*>(x);
    bool any_q8 = false;
    for (int v = 0; v < kActVariants; ++v) {
        if (!c.quantize[v]) continue;
        any_q8 = true;
        Q8Acts& a = g_ws.q8[v];
        grow(a.q, size_t(T * cols_));
        grow(a.d, size_t(T * cols_ / 32));
        grow(a.s, size_t(T * cols_ / 32));
    }
    for (int r = 0; r < 2; ++r)
        if (c.round[r]) grow(g_ws.xr[r], size_t(T * cols_));
    // Activations to fp32 / Q8: inline for a few tokens (a phase costs a wake-up), else in parallel.
    if (x_bf16 || any_q8 || c.round[0] || c.round[1]) {
        if (T <= 4) {
            for (int64_t t = 0; t < T; ++t) prepare_token(c, t);
        } else {
            c.next.store(0, std::memory_order_relaxed);
            exec.run(phase_prepare, &c);
        }
    }
    const int threads = exec.threads();
    if (gemv_rows) {
        // Where one pass over the rows serves every token (T <= kMaxGemvTokens: a decode step),
        // long units, about two per thread: each unit starts a new stream whose first reads wait
        // the full memory latency (2-core Zen 5, Q4_0 decode, in turn in one process: q|k|v
        // projections 1.24 -> 1.08 ms a token, output projection and head 5-7 % faster, decode
        // 1.05-1.09x; Q4_K_M 1.04x). With more tokens a unit's rows are read again for every
        // four, from L2 if they fit: units of 32 or 64 rows (64 when there are enough to keep
        // every thread busy).
        const int unit_rows = T <= kMaxGemvTokens ? int(std::max<int64_t>(32, gemv_rows / (2 * threads) / 8 * 8))
                              : gemv_rows / 64 >= 8 * threads ? 64 : 32;
        split(c, parts_, unit_rows, [&](const DensePart& p) { return !gemm(p); });
        c.next.store(0, std::memory_order_relaxed);
        exec.run(phase_gemv, &c);
    }
    if (gemm_rows) {
        // Two panels per unit keep the dequantized rows (2 x kc x panel floats) within L2 and
        // reuse each group of activation rows twice; one panel when that leaves too few units.
        const int P = kt.panel;
        int panels = 8;
        while (panels > 1 && (gemm_rows + panels * P - 1) / (panels * P) < 4 * threads) panels /= 2;
        split(c, parts_, panels * P, gemm);
        c.next.store(0, std::memory_order_relaxed);
        exec.run(phase_gemm, &c);
    }
}

}  // namespace hmoe
