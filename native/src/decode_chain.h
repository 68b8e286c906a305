// Every decoder layer of one decode step in one native call: RMSNorm, a fused q|k|v projection
// (with or without bias), per-head q/k norm and rotary embedding (whole or partial), attention
// over a block-allocated cache, the output projection; RMSNorm and the feed-forward block: a
// dense gated MLP, or a router (softmax top-k, DeepSeek-V3's sigmoid groups, or top-k softmax),
// the routed experts in host memory and optional shared experts (optionally sigmoid-gated).
// Or, in place of the grouped-query attention, multi-head latent attention (mla_decode.h). That
// is Qwen3-MoE, Mixtral, GLM-4.5, Qwen2-MoE, DeepSeek-V3 and Kimi K2; sliding windows and
// attention sinks (GPT-OSS) keep the per-call path.
//
// The same kernels as the per-call path (cpu_decode.py), in the same order on the same
// buffers, so a token gets the same bits; what goes is the Python between the calls. That
// cost more than its instruction count: the weights streaming through the caches leave every
// Python step between two kernels running cold, about 2 ms a token on the 8-layer benchmark
// model (measured), a tenth of the token.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "decode_ops.h"
#include "dense_linear.h"
#include "formats.h"
#include "mla_decode.h"
#include "moe_layer.h"

namespace hmoe {

class Executor;

// How a layer's router turns its logits into experts and weights (decode_ops.h).
struct ChainRoute {
    enum Kind { SoftmaxTopK, SigmoidGroupTopK, TopKSoftmax } kind = SoftmaxTopK;
    bool normalize = false;      // renormalise the top k weights (not TopKSoftmax)
    const float* bias = nullptr; // SigmoidGroupTopK: the choice's correction bias [E] or null
    int n_group = 1, topk_group = 1;
    float scaling = 1.f;
};

// The routers by the names a layer's description gives them (Python's Router.kind): the one
// mapping from a description to a kind. The binding parses the chain's and the per-call
// path's routes through it and exports the names (ROUTE_KINDS) for the planner's test.
struct RouteName {
    const char* name;
    ChainRoute::Kind kind;
};
inline constexpr RouteName kRouteNames[] = {
    {"softmax_topk", ChainRoute::SoftmaxTopK},
    {"sigmoid_group_topk", ChainRoute::SigmoidGroupTopK},
    {"topk_softmax", ChainRoute::TopKSoftmax},
};

// The kind called `name`; false when no router has it.
inline bool route_kind(std::string_view name, ChainRoute::Kind& kind) {
    for (const RouteName& r : kRouteNames)
        if (name == r.name) {
            kind = r.kind;
            return true;
        }
    return false;
}

// One token's k experts and weights from its logits [E], as `r` says (decode_ops.h).
inline void route_token(const ChainRoute& r, const float* logits, int64_t E, int k, int64_t* ids, float* weights) {
    switch (r.kind) {
    case ChainRoute::SoftmaxTopK: softmax_topk(logits, E, k, r.normalize, ids, weights); break;
    case ChainRoute::SigmoidGroupTopK:
        sigmoid_group_topk(logits, r.bias, E, k, r.n_group, r.topk_group, r.normalize, r.scaling, ids, weights);
        break;
    case ChainRoute::TopKSoftmax: topk_softmax(logits, E, k, ids, weights); break;
    }
}

struct ChainLayer {
    const float* attn_norm;
    float attn_eps;
    const DenseLinear* qkv;  // q (Hq * D), k (Hkv * D), v (Hkv * Dv) rows, joined (any formats)
    const float* qkv_bias;   // [rows of qkv] or null
    const float* q_norm;     // [D] or null
    const float* k_norm;
    float qk_eps;
    const float* cos;  // [positions, rotary_dim / 2]
    const float* sin;
    int64_t positions;
    int64_t rotary_half;
    bool pairs;
    void* k_cache;  // [n_blocks, Hkv, B, D]; latent attention: [n_blocks, B, c + rope]
    void* v_cache;  // [n_blocks, Hkv, B, Dv]; latent attention: unused
    Format cache_type;  // the KV cache's elements: FMT_F32, FMT_BF16 or FMT_F16
    int64_t n_blocks;
    float scale;
    // Latent attention (ChainShape::latent) in place of q|k|v: `qkv` is then q (q_proj, or q_b
    // after q_a and its norm), kv_a the compressed kv [c + rope], normalised by kv_norm, and
    // maps kv_b's per-head key and value maps of the latent.
    const DenseLinear* q_a;  // or null
    const float* q_a_norm;
    float q_a_eps;
    const DenseLinear* kv_a;
    const float* kv_norm;
    float kv_eps;
    const LatentMaps* maps;
    const DenseLinear* o;
    const float* o_bias;  // [H] or null
    const float* ffn_norm;
    float ffn_eps;
    // The feed-forward block: routed experts with their router, and/or a gated MLP (gate|up
    // joined, then down), which is the layer's own when there are no experts and the shared
    // experts' when there are.
    const DenseLinear* router;  // [E, H], or null for a dense layer
    const float* router_bias;   // [E] or null: added to the logits
    ChainRoute route;
    const MoELayer* experts;
    const DenseLinear* gate_up;      // [2 I, H] or null
    const DenseLinear* down;         // [H, I]
    const DenseLinear* shared_gate;  // [1, H] or null: sigmoid(h . g) scales the shared experts
};

// Per-part seconds a step adds to when profiling (step_profile.py's names).
enum ChainPart : int { CP_EXPERTS = 0, CP_QKV, CP_O, CP_ROUTER, CP_ATTEND, CP_SMALL, CP_SHARED, CP_MLP, CP_COUNT };

struct ChainShape {
    int64_t H, Hq, Hkv, D, Dv, block, k;
    // Latent attention: one KV head (Hkv 1) of D = c + rope features, values its first Dv = c;
    // q heads of nope + rope features, v the value head size after kv_b.
    bool latent = false;
    int64_t nope = 0, v = 0;
};

class DecodeChain {
public:
    DecodeChain(ChainShape shape, int max_rows);
    void add_layer(const ChainLayer& layer);  // checks it against the shape

    // x [T, H] fp32, the residual stream, in place; tables [T, table_len] each row's block
    // ids; positions [T]; ids_out [MoE layers, T, k] the experts chosen by each layer with
    // experts, in order (for the statistics); seconds (CP_COUNT doubles) or null.
    void run(Executor& exec, const KernelTable& kt, float* x, int64_t T, const int64_t* tables, int64_t table_len,
             const int64_t* positions, int64_t* ids_out, double* seconds);

    // The layers with routed experts, in order, and the experts of the i-th of them.
    int64_t moe_layers() const { return int64_t(moe_.size()); }
    int64_t experts(int64_t i) const { return layers_[moe_[size_t(i)]].router->rows(); }
    const ChainShape& shape() const { return s_; }

private:
    ChainShape s_;
    std::vector<ChainLayer> layers_;
    std::vector<size_t> moe_;  // the indices of the layers with routed experts
    int max_rows_;
    std::vector<float> h_, qkv_, q_, att_, tmp_, logits_, weights_, gu_, act_, mlp_, gate_, qa_, kv_;
    std::vector<int64_t> lengths_;

    // down(silu(gate(h)) * up(h)) of the first T rows of h_ into out.
    void gated_mlp(Executor& exec, const KernelTable& kt, const ChainLayer& l, int64_t T, float* out);
};

}  // namespace hmoe
