// The small steps of one decode token on a CPU main device: RMSNorm, the per-head q/k norm
// with the rotary embedding and the cache write, and the routers' choice of experts.
//
// PyTorch runs each of these as five to fifteen ops, and at one token per call its per-op
// cost (3-40 us) is the step's cost: they took about a quarter of the CPU decode step,
// more than the attention projections read from memory (measured on the 8-layer
// model). Here each is one single-threaded pass over a few thousand floats, in float32.
#pragma once

#include <cstdint>

#include "formats.h"

namespace hmoe {

struct KernelTable;

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w for r < rows (out may be x; w null: no
// weight), the mean of the squares in double as llama.cpp's.
void rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* out);

constexpr int64_t kMaxHeadDim = 1024;  // the bindings refuse longer heads

// One token's fused q|k|v projection (Hq*D, then Hkv*D, then Hkv*Dv floats): q and k
// normalised per head (when q_norm / k_norm are given), rotated, q written to q_out [Hq, D],
// k and v stored at position `pos` of the cache (float32, or bfloat16 or float16 rounded to nearest even).
struct RopeStore {
    const float* qkv;
    int64_t Hq, Hkv, D, Dv;
    const float* q_norm;  // [D] or null
    const float* k_norm;
    float eps;
    const float* cos;     // [rotary_dim / 2] for this position
    const float* sin;
    int64_t rotary_dim;   // the first rotary_dim features of a head rotate, the rest pass
    bool pairs;           // (x0, x1), (x2, x3)... rotate, output de-interleaved; else halves
    void* k_cache;        // head h, position s at + h * k_head + s * k_pos elements
    void* v_cache;
    Format cache_type;  // FMT_F32, FMT_BF16 or FMT_F16
    int64_t k_head, k_pos, v_head, v_pos, pos;
    float* q_out;
};
void rope_store(const RopeStore& a);

// Multi-head latent attention's small steps for one token: each head's rotary part of q
// [H, nope + rope] rotated in place; the compressed kv [c + rope]: its latent (c) normalised
// by kv_norm, its rotary key rotated, both stored as one cache row [c + rope].
struct MlaRopeStore {
    float* q;
    const float* kv;
    int64_t H, nope, rope, c;  // c + rope <= 2 * kMaxHeadDim
    const float* kv_norm;      // [c]
    float eps;
    const float* cos;          // [rope / 2] for this position
    const float* sin;
    bool pairs;
    void* cache_row;
    Format cache_type;  // FMT_F32, FMT_BF16 or FMT_F16
};
void mla_rope_store(const MlaRopeStore& a);

// A gated MLP's activation (a dense layer's or the shared experts'): out[r, i] =
// silu(gu[r, i]) * gu[r, I + i] for i < I, with the kernels' silu (the one the experts use).
void silu_mul_rows(const KernelTable& kt, const float* gu, int64_t rows, int64_t I, float* out);

// out[r, :] += y[r, :] / (1 + exp(-gate[r])) (a sigmoid-gated shared expert, Qwen2-MoE), or
// out += y where gate is null.
void add_gated(float* out, const float* y, const float* gate, int64_t rows, int64_t n);

// out[r, :] += bias for each of `rows` rows (a projection's bias).
void add_bias(float* out, const float* bias, int64_t rows, int64_t n);

// Routers over one token's logits [E] -> ids [k], weights [k] (k <= E).
// softmax over all, top k, optionally renormalised (Qwen, Mixtral, OLMoE).
void softmax_topk(const float* logits, int64_t E, int k, bool normalize, int64_t* ids, float* weights);
// DeepSeek-V3 "noaux_tc": sigmoid scores; the choice adds `bias` (may be null) and keeps the
// topk_group groups whose two best biased scores sum highest; weights are the unbiased
// scores, optionally renormalised, times scaling.
void sigmoid_group_topk(const float* logits, const float* bias, int64_t E, int k, int n_group, int topk_group,
                        bool normalize, float scaling, int64_t* ids, float* weights);
// GPT-OSS: top k of the logits, softmax over those k.
void topk_softmax(const float* logits, int64_t E, int k, int64_t* ids, float* weights);

}  // namespace hmoe
