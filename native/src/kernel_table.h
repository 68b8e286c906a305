// The per-ISA kernel set. Each instruction-set variant is its own translation unit compiled
// with its own -m flags (kernels_scalar.cpp, kernels_avx2.cpp, kernels_avx512.cpp) and
// exports exactly one function returning its table; dispatch.cpp picks one at load time
// from what the CPU supports. Nothing else in the extension is compiled with ISA flags.
#pragma once

#include <cstdint>

#include "formats.h"

namespace hmoe {

// Decode: out[t * ldo + r] = dot(row row0 + r of w, acts[t]) for r < nrows, t < ntok
// (ntok <= kMaxGemvTokens, or any number where the table's gemv_any_tokens says so).
// Weights are unpacked once per block and used for all ntok tokens. K is the row length in
// weights.
using GemvQ8Fn = void (*)(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                          float* out, int64_t ldo);
// The same for float formats, with fp32 activations (x[t] points at K floats).
using GemvF32Fn = void (*)(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const float* const* x, int ntok,
                           float* out, int64_t ldo);
// Columns k0 .. k0+kc-1 (multiples of the format's block) of row r to fp32 (an embedding lookup).
using DequantRowFn = void (*)(Format fmt, const MatrixRef& w, int64_t r, int64_t k0, int kc, float* dst);
// Prefill: dequantize rows row0 .. row0+nrows-1 (nrows <= panel), columns k0 .. k0+kc-1
// (multiples of the format's block) into a k-major panel dst[k * panel + r]; rows past
// nrows are zero. tmp holds panel * (kc + 16) floats of scratch.
using DequantPanelFn = void (*)(Format fmt, const MatrixRef& w, int64_t row0, int nrows, int64_t k0, int kc, float* dst,
                                float* tmp);
// Prefill: C[i * ldc + p * panel + j] += sum_k a[i][k] * W[p][k * panel + j] for i < m tokens,
// p < npanels, j < panel. a[i] points at the token's k0-th activation; W panels are
// consecutive blocks of kc * panel floats.
using GemmPanelsFn = void (*)(const float* const* a, int m, const float* w, int npanels, int kc, float* c, int64_t ldc);
// The same product with bf16 activations (a[i] points at the token's k0-th bf16 value) on
// bf16-rounded weights, fp32 sums (AMX tiles).
using GemmBf16Fn = void (*)(const uint16_t* const* a, int m, const float* w, int npanels, int kc, float* c, int64_t ldc);
// Activations to Q8 blocks of 32 in act variant `v` (formats.h's act_variant: order, scale group
// and rounding), K a multiple of its group.
using QuantizeFn = void (*)(const float* x, int64_t K, int v, int8_t* q, float* d, float* s);
// h[i] = silu(g[i]) * u[i]
using SiluMulFn = void (*)(const float* g, const float* u, float* h, int64_t n);
// GPT-OSS: g = min(g, limit), u = clamp(u, -limit, limit), h = (u + 1) * g * sigmoid(alpha g)
using GptOssGluFn = void (*)(const float* g, const float* u, float* h, int64_t n, float alpha, float limit);

// Decode attention, one KV head over a run of n positions (see attention_decode.cpp), stored
// as segments contiguous in memory (one for a contiguous cache, one per block touched for a
// paged one): position s of segment i has key row segs[i].k + s * ldk and value row
// segs[i].v + s * ldv (D and Dv elements of the cache type kv: FMT_F32, FMT_BF16 or FMT_F16);
// the segments' n add up to n. In two calls, the run's softmax weights normalised between them
// over all the runs of the head (attention_decode.cpp). For query heads g < group (q[g * D],
// rounded and scaled as that file says), over the run's positions s:
//   scores: m[g] = max_s q_g . k_s, e[g * ld + s] = e^(q_g . k_s - m[g]), l[g] = sum_s e[g * ld + s]
//           (ldv: where the values the next call reads lie, to prefetch them);
//   values: p = e[g * ld + s] * w[g] (attention_rounded, in place in e), then
//           acc[g * Dv + j] = sum_s p[g * ld + s] v_s[j].
// Each in position order whatever the segments, so a run gives the same bits however it is split.
struct KvSegment {
    const void* k;
    const void* v;
    int64_t n;
};
// The queries of a decode attention call as the scores read them: out[i] = q[i], rounded to
// fp16 over an fp16 cache (attention_rounded), times scale.
using AttendQueriesFn = void (*)(const float* q, int64_t n, float scale, Format kv, float* out);
using AttendScoresFn = void (*)(const float* q, int group, int64_t D, const KvSegment* segs, int n_segs, Format kv,
                                int64_t ldk, int64_t ldv, int64_t n, float* e, int64_t ld, float* m, float* l);
using AttendValuesFn = void (*)(float* e, const float* w, int group, int64_t ld, int64_t Dv, const KvSegment* segs,
                                int n_segs, Format kv, int64_t ldv, int64_t n, float* acc);

// A GEMV with the matrix's transpose, streaming its rows: out[t][j] += sum_{i < m} x[t][i] *
// row_i[j] for j < n, t < ntok, row i at rows + i * stride bytes in a float format (bf16,
// f16, f32). Latent attention folds kv_b's key maps into the queries with it.
using RowsAxpyFn = void (*)(Format fmt, const uint8_t* rows, int64_t stride, int64_t m, int64_t n, const float* const* x,
                            int ntok, float* const* out);

constexpr int kMaxGemvTokens = 4;

// A prefill switch point no call reaches: the GEMV path at every token count.
constexpr int kNeverPrefill = 1 << 30;

struct KernelTable {
    const char* name;  // "avx512_amx", "avx512_vnni", "avx2", "scalar"
    int panel;         // rows per prefill panel (one or two vector widths)
    QuantizeFn quantize;
    GemvQ8Fn gemv_q8[FMT_COUNT];     // null for float formats
    // The format's gemv_q8 takes any number of tokens in one call, unpacking each block once
    // for all of them (the i-quants, whose unpacking costs more than their dot products).
    bool gemv_any_tokens[FMT_COUNT];
    GemvF32Fn gemv_f32[FMT_COUNT];   // null for quantized formats
    DequantPanelFn dequant_panel;    // all formats
    DequantRowFn dequant_row;        // all formats
    GemmPanelsFn gemm_panels;
    GemmBf16Fn gemm_panels_bf16;  // null where the CPU has no bf16 tiles; see on_tiles
    SiluMulFn silu_mul;
    GptOssGluFn gptoss_glu;
    AttendQueriesFn attend_queries;
    AttendScoresFn attend_scores;
    AttendValuesFn attend_values;
    RowsAxpyFn rows_axpy;
};

// Tokens one GEMV call of `fmt` takes out of the `n` a caller has (float formats: four).
inline int64_t gemv_step(const KernelTable& kt, Format fmt, int64_t n) {
    return kt.gemv_any_tokens[fmt] ? n : kMaxGemvTokens;
}

// Whether a call may multiply on bf16 tiles: where the table has them, the activations came
// in bf16 (so rounding them loses nothing: a float32 model keeps float32 sums of float32
// values) and rounding a weight to bf16 loses nothing the format holds (bf16 itself) or far
// less than its quantization did (every quantized format: 2^-9 of a weight against 2^-3 to
// 2^-8 steps); never for f32 and f16 weights, which llama.cpp multiplies at their own precision.
inline bool on_tiles(const KernelTable& kt, Format fmt, bool bf16_acts) {
    return bf16_acts && kt.gemm_panels_bf16 && fmt != FMT_F32 && fmt != FMT_F16;
}

const KernelTable* kernels_scalar();
#if defined(HMOE_HAVE_X86_VARIANTS)
const KernelTable* kernels_avx2();
const KernelTable* kernels_avx512();
#if defined(HMOE_HAVE_AMX)
const KernelTable* kernels_avx512_amx();  // only where amx_usable()
bool amx_usable();                        // AMX-BF16 present and its tile state granted to this process
#endif
#endif

}  // namespace hmoe
