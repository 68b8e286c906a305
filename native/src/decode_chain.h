// Every decoder layer of one decode step in one native call, for the common layer shape:
// RMSNorm, a fused q|k|v projection, per-head q/k norm and rotary embedding, attention over a
// block-allocated cache, the output projection; RMSNorm, softmax top-k routing and the routed
// experts, all in host memory.
//
// The same kernels as the per-call path (cpu_decode.py), in the same order on the same
// buffers, so a token gets the same bits; what goes is the Python between the calls. That
// cost more than its instruction count: the weights streaming through the caches leave every
// Python step between two kernels running cold, about 2 ms a token on the 8-layer benchmark
// model (measured), a tenth of the token.
#pragma once

#include <cstdint>
#include <vector>

#include "dense_linear.h"
#include "moe_layer.h"

namespace hmoe {

class Executor;

struct ChainLayer {
    const float* attn_norm;
    float attn_eps;
    const DenseLinear* qkv;  // q (Hq * D), k (Hkv * D), v (Hkv * Dv) rows, joined (any formats)
    const float* q_norm;     // [D] or null
    const float* k_norm;
    float qk_eps;
    const float* cos;  // [positions, rotary_dim / 2]
    const float* sin;
    int64_t positions;
    int64_t rotary_half;
    bool pairs;
    void* k_cache;  // [n_blocks, Hkv, B, D]
    void* v_cache;  // [n_blocks, Hkv, B, Dv]
    bool cache_bf16;
    int64_t n_blocks;
    float scale;
    const DenseLinear* o;
    const float* ffn_norm;
    float ffn_eps;
    const DenseLinear* router;  // [E, H]
    bool normalize;             // renormalise the top k weights
    const MoELayer* experts;
};

// Per-part seconds a step adds to when profiling (step_profile.py's names).
enum ChainPart : int { CP_EXPERTS = 0, CP_QKV, CP_O, CP_ROUTER, CP_ATTEND, CP_SMALL, CP_COUNT };

struct ChainShape {
    int64_t H, Hq, Hkv, D, Dv, block, k;
};

class DecodeChain {
public:
    DecodeChain(ChainShape shape, int max_rows);
    void add_layer(const ChainLayer& layer);  // checks it against the shape

    // x [T, H] fp32, the residual stream, in place; tables [T, table_len] each row's block
    // ids; positions [T]; ids_out [layers, T, k] the experts chosen (for the statistics);
    // seconds (CP_COUNT doubles) or null.
    void run(Executor& exec, const KernelTable& kt, float* x, int64_t T, const int64_t* tables, int64_t table_len,
             const int64_t* positions, int64_t* ids_out, double* seconds);

    int64_t layers() const { return int64_t(layers_.size()); }
    int64_t experts(int64_t layer) const { return layers_[size_t(layer)].router->rows(); }
    const ChainShape& shape() const { return s_; }

private:
    ChainShape s_;
    std::vector<ChainLayer> layers_;
    int max_rows_;
    std::vector<float> h_, qkv_, q_, att_, tmp_, logits_, weights_;
};

}  // namespace hmoe
