#include "decode_chain.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "attention_decode.h"
#include "decode_ops.h"
#include "mla_decode.h"

namespace hmoe {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kGemv = 1 << 30;  // decode rows: the few-token paths at any count (rows_are)

// Adds the time since the last lap to a part, when profiling.
struct Laps {
    double* seconds;
    Clock::time_point t = Clock::now();
    void lap(ChainPart part) {
        if (!seconds) return;
        const auto now = Clock::now();
        seconds[part] += std::chrono::duration<double>(now - t).count();
        t = now;
    }
};

void add_into(float* x, const float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

}  // namespace

DecodeChain::DecodeChain(ChainShape shape, int max_rows) : s_(shape), max_rows_(max_rows) {
    if (max_rows < 1 || s_.Hkv < 1 || s_.Hq % s_.Hkv || s_.block < 1 || s_.k < 1 || s_.D > kMaxHeadDim ||
        s_.Dv > kMaxHeadDim || (s_.latent && (s_.Hkv != 1 || s_.Dv >= s_.D || s_.nope < 0 || s_.v < 1)))
        throw std::invalid_argument("bad chain shape");
    const size_t R = size_t(max_rows);
    h_.resize(R * size_t(s_.H));
    if (s_.latent) {
        qkv_.resize(R * size_t(s_.Hq * (s_.nope + s_.D - s_.Dv)));  // q
        kv_.resize(R * size_t(s_.D));
        att_.resize(R * size_t(s_.Hq * s_.v));
    } else {
        qkv_.resize(R * size_t(s_.Hq * s_.D + s_.Hkv * (s_.D + s_.Dv)));
        q_.resize(R * size_t(s_.Hq * s_.D));
        att_.resize(R * size_t(s_.Hq * s_.Dv));
    }
    lengths_.resize(R);
    tmp_.resize(R * size_t(s_.H));
    mlp_.resize(R * size_t(s_.H));
    gate_.resize(R);
    weights_.resize(R * size_t(s_.k));
}

void DecodeChain::add_layer(const ChainLayer& l) {
    const size_t R = size_t(max_rows_);
    if (s_.latent) {
        const int64_t rope = s_.D - s_.Dv;
        const bool q_fits = l.q_a ? l.q_a->cols() == s_.H && l.qkv->cols() == l.q_a->rows() && l.q_a_norm
                                  : l.qkv->cols() == s_.H;
        if (!q_fits || l.qkv->rows() != s_.Hq * (s_.nope + rope) || !l.kv_a || !l.kv_norm || !l.maps ||
            l.kv_a->cols() != s_.H || l.kv_a->rows() != s_.D || l.o->rows() != s_.H || l.o->cols() != s_.Hq * s_.v ||
            2 * l.rotary_half != rope || l.maps->H != s_.Hq || l.maps->nope != s_.nope || l.maps->v != s_.v ||
            l.maps->c != s_.Dv)
            throw std::invalid_argument("a layer's latent attention does not fit the chain's shape");
        if (l.q_a) qa_.resize(std::max(qa_.size(), R * size_t(l.q_a->rows())));
    } else {
        const int64_t width = s_.Hq * s_.D + s_.Hkv * (s_.D + s_.Dv);
        if (l.qkv->cols() != s_.H || l.qkv->rows() != width || l.o->rows() != s_.H || l.o->cols() != s_.Hq * s_.Dv ||
            2 * l.rotary_half > s_.D)
            throw std::invalid_argument("a layer's attention projections do not fit the chain's shape");
    }
    if (bool(l.router) != bool(l.experts) || bool(l.gate_up) != bool(l.down) || (!l.experts && !l.gate_up) ||
        (l.shared_gate && !(l.experts && l.gate_up)))
        throw std::invalid_argument("a layer needs routed experts with their router, a gated MLP, or both (shared)");
    if (l.experts && (l.router->cols() != s_.H || l.experts->hidden() != s_.H ||
                      l.router->rows() != l.experts->n_experts() || s_.k > l.router->rows()))
        throw std::invalid_argument("a layer's router or experts do not fit the chain's shape");
    if (l.gate_up && (l.gate_up->cols() != s_.H || l.gate_up->rows() % 2 || l.down->rows() != s_.H ||
                      l.down->cols() != l.gate_up->rows() / 2))
        throw std::invalid_argument("a layer's gated MLP does not fit the chain's shape");
    if (l.shared_gate && (l.shared_gate->rows() != 1 || l.shared_gate->cols() != s_.H))
        throw std::invalid_argument("a shared experts' gate must be [1, hidden]");
    if (l.experts) {
        moe_.push_back(layers_.size());
        logits_.resize(std::max(logits_.size(), R * size_t(l.router->rows())));
    }
    if (l.gate_up) {
        gu_.resize(std::max(gu_.size(), R * size_t(l.gate_up->rows())));
        act_.resize(std::max(act_.size(), R * size_t(l.down->cols())));
    }
    layers_.push_back(l);
}

void DecodeChain::gated_mlp(Executor& exec, const KernelTable& kt, const ChainLayer& l, int64_t T, float* out) {
    const int64_t I = l.down->cols();
    l.gate_up->forward(exec, kt, h_.data(), false, T, gu_.data(), kGemv);
    silu_mul_rows(kt, gu_.data(), T, I, act_.data());
    l.down->forward(exec, kt, act_.data(), false, T, out, kGemv);
}

void DecodeChain::run(Executor& exec, const KernelTable& kt, float* x, int64_t T, const int64_t* tables,
                      int64_t table_len, const int64_t* positions, int64_t* ids_out, double* seconds) {
    if (T <= 0 || T > max_rows_) throw std::invalid_argument("rows out of range");
    const ChainShape& s = s_;
    // Every row checked before anything is computed or written.
    for (int64_t t = 0; t < T; ++t) {
        const int64_t pos = positions[t];
        for (const ChainLayer& l : layers_) {
            if (pos < 0 || pos >= l.positions || pos / s.block >= table_len)
                throw std::invalid_argument("position out of range");
            for (int64_t b = 0; b <= pos / s.block; ++b)
                if (tables[t * table_len + b] < 0 || tables[t * table_len + b] >= l.n_blocks)
                    throw std::invalid_argument("block table entry out of range");
        }
    }
    const int64_t width = s.Hq * s.D + s.Hkv * (s.D + s.Dv);
    Laps laps{seconds};
    // What every row's cache write and attention share: the heads and the strides of the
    // block-allocated caches ([n_blocks, Hkv, B, D] and [n_blocks, Hkv, B, Dv]).
    const int64_t k_block = s.Hkv * s.block * s.D, v_block = s.Hkv * s.block * s.Dv;
    RopeStore store{};
    store.Hq = s.Hq;
    store.Hkv = s.Hkv;
    store.D = s.D;
    store.Dv = s.Dv;
    store.k_head = s.block * s.D;
    store.k_pos = s.D;
    store.v_head = s.block * s.Dv;
    store.v_pos = s.Dv;
    DecodeAttention attend{};
    attend.Hq = s.Hq;
    attend.Hkv = s.Hkv;
    attend.D = s.D;
    attend.Dv = s.Dv;
    attend.k_head = store.k_head;
    attend.k_pos = store.k_pos;
    attend.v_head = store.v_head;
    attend.v_pos = store.v_pos;
    attend.block_size = s.block;
    attend.k_block = k_block;
    attend.v_block = v_block;
    std::vector<DecodeAttention> rows(static_cast<size_t>(T));
    // Grouped-query attention of the normed input h_ into att_.
    auto grouped = [&](const ChainLayer& l) {
        const size_t esz = cache_elem_bytes(l.cache_type);
        l.qkv->forward(exec, kt, h_.data(), false, T, qkv_.data(), kGemv);
        if (l.qkv_bias) add_bias(qkv_.data(), l.qkv_bias, T, width);
        laps.lap(CP_QKV);
        store.q_norm = l.q_norm;
        store.k_norm = l.k_norm;
        store.eps = l.qk_eps;
        store.rotary_dim = 2 * l.rotary_half;
        store.pairs = l.pairs;
        store.cache_type = l.cache_type;
        attend.k = l.k_cache;
        attend.v = l.v_cache;
        attend.kv = l.cache_type;
        attend.scale = l.scale;
        for (int64_t t = 0; t < T; ++t) {
            const int64_t pos = positions[t];
            const int64_t* table = tables + t * table_len;
            const int64_t block = table[pos / s.block];
            store.qkv = qkv_.data() + t * width;
            store.cos = l.cos + pos * l.rotary_half;
            store.sin = l.sin + pos * l.rotary_half;
            store.k_cache = static_cast<uint8_t*>(l.k_cache) + size_t(block * k_block) * esz;
            store.v_cache = static_cast<uint8_t*>(l.v_cache) + size_t(block * v_block) * esz;
            store.pos = pos % s.block;
            store.q_out = q_.data() + t * s.Hq * s.D;
            rope_store(store);
            DecodeAttention& a = rows[size_t(t)];
            a = attend;
            a.q = store.q_out;
            a.S = pos + 1;
            a.out = att_.data() + t * s.Hq * s.Dv;
            a.blocks = table;
        }
        laps.lap(CP_SMALL);
        attend_decode_rows(exec, kt, rows.data(), int(T));
        laps.lap(CP_ATTEND);
    };
    // Latent attention of h_ into att_: the calls of cpu_decode's _MLAStep, in its order.
    auto latent = [&](const ChainLayer& l) {
        const size_t esz = cache_elem_bytes(l.cache_type);
        const int64_t rope = s.D - s.Dv, q_width = s.Hq * (s.nope + rope);
        if (l.q_a) {
            l.q_a->forward(exec, kt, h_.data(), false, T, qa_.data(), kGemv);
            rms_norm(qa_.data(), l.q_a_norm, l.q_a_eps, T, l.q_a->rows(), qa_.data());
            l.qkv->forward(exec, kt, qa_.data(), false, T, qkv_.data(), kGemv);
        } else {
            l.qkv->forward(exec, kt, h_.data(), false, T, qkv_.data(), kGemv);
        }
        l.kv_a->forward(exec, kt, h_.data(), false, T, kv_.data(), kGemv);
        laps.lap(CP_QKV);
        MlaRopeStore row{};
        row.H = s.Hq;
        row.nope = s.nope;
        row.rope = rope;
        row.c = s.Dv;
        row.kv_norm = l.kv_norm;
        row.eps = l.kv_eps;
        row.pairs = l.pairs;
        row.cache_type = l.cache_type;
        for (int64_t t = 0; t < T; ++t) {
            const int64_t pos = positions[t], block = tables[t * table_len + pos / s.block];
            row.q = qkv_.data() + t * q_width;
            row.kv = kv_.data() + t * s.D;
            row.cos = l.cos + pos * l.rotary_half;
            row.sin = l.sin + pos * l.rotary_half;
            row.cache_row = static_cast<uint8_t*>(l.k_cache) + size_t((block * s.block + pos % s.block) * s.D) * esz;
            mla_rope_store(row);
            lengths_[size_t(t)] = pos + 1;
        }
        laps.lap(CP_SMALL);
        const MlaDecode m{s.Hq, s.nope, rope, s.v, s.Dv, l.maps, l.k_cache, l.cache_type, s.block, l.scale};
        mla_attend_rows(exec, kt, m, qkv_.data(), T, tables, table_len, lengths_.data(), att_.data());
        laps.lap(CP_ATTEND);
    };
    int64_t moe = 0;  // the layers with experts so far: ids_out's index
    for (const ChainLayer& l : layers_) {
        rms_norm(x, l.attn_norm, l.attn_eps, T, s.H, h_.data());
        laps.lap(CP_SMALL);
        if (s.latent)
            latent(l);
        else
            grouped(l);
        l.o->forward(exec, kt, att_.data(), false, T, tmp_.data(), kGemv);
        if (l.o_bias) add_bias(tmp_.data(), l.o_bias, T, s.H);
        add_into(x, tmp_.data(), T * s.H);
        laps.lap(CP_O);
        // The feed-forward block.
        rms_norm(x, l.ffn_norm, l.ffn_eps, T, s.H, h_.data());
        laps.lap(CP_SMALL);
        if (!l.experts) {  // a dense layer
            gated_mlp(exec, kt, l, T, tmp_.data());
            add_into(x, tmp_.data(), T * s.H);
            laps.lap(CP_MLP);
            continue;
        }
        const int64_t E = l.router->rows();
        l.router->forward(exec, kt, h_.data(), false, T, logits_.data(), kGemv);
        if (l.router_bias) add_bias(logits_.data(), l.router_bias, T, E);
        laps.lap(CP_ROUTER);
        int64_t* ids = ids_out + moe * T * s.k;
        ++moe;
        for (int64_t t = 0; t < T; ++t)
            route_token(l.route, logits_.data() + t * E, E, int(s.k), ids + t * s.k, weights_.data() + t * s.k);
        laps.lap(CP_SMALL);
        l.experts->forward(exec, kt, h_.data(), false, T, ids, weights_.data(), int(s.k), tmp_.data(), Regime::Decode, 0);
        laps.lap(CP_EXPERTS);
        if (l.gate_up) {  // the shared experts, added to the routed ones' sum before the residual
            gated_mlp(exec, kt, l, T, mlp_.data());
            if (l.shared_gate) l.shared_gate->forward(exec, kt, h_.data(), false, T, gate_.data(), kGemv);
            add_gated(tmp_.data(), mlp_.data(), l.shared_gate ? gate_.data() : nullptr, T, s.H);
            laps.lap(CP_SHARED);
        }
        add_into(x, tmp_.data(), T * s.H);
        laps.lap(CP_EXPERTS);
    }
}

}  // namespace hmoe
