#include "decode_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernel_table.h"

namespace hmoe {
namespace {

// The mean of the squares as llama.cpp's RMS norm takes it: each square in float, their sum
// in double (ggml_float), then float. The double sum of float squares rounds to the same float
// in any order, so the norm's output is its bits: a Q8 code the next projection rounds on the
// last bit of its input flipped otherwise (on a trained model's prompt, one such flip in the
// first layer's query moved the logits 0.003 of their spread from llama.cpp's).
float mean_square(const float* x, int64_t n) {
    double s[4] = {};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; ++j) s[j] += double(x[i + j] * x[i + j]);
    double total = (s[0] + s[1]) + (s[2] + s[3]);
    for (; i < n; ++i) total += double(x[i] * x[i]);
    return float(total / double(n));
}

void norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
    const float inv = 1.f / std::sqrt(mean_square(x, n) + eps);
    if (!w) {
        for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
        return;
    }
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return uint16_t((u >> 16) | 0x40);  // quiet NaN
    u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
    return uint16_t(u >> 16);
}

// The rotary embedding of one head's first rotary_dim features in place (cos, sin:
// rotary_dim / 2 each, for the token's position); `pairs` as in RopeStore.
void rotate(float* h, const float* cos, const float* sin, int64_t rotary_dim, bool pairs) {
    const int64_t half = rotary_dim / 2;
    float rot[kMaxHeadDim];
    if (pairs) {
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = h[2 * i], x2 = h[2 * i + 1];
            rot[i] = x1 * cos[i] - x2 * sin[i];
            rot[half + i] = x2 * cos[i] + x1 * sin[i];
        }
    } else {
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = h[i], x2 = h[half + i];
            rot[i] = x1 * cos[i] - x2 * sin[i];
            rot[half + i] = x2 * cos[i] + x1 * sin[i];
        }
    }
    std::memcpy(h, rot, size_t(rotary_dim) * 4);
}

// Normalise (when w) and rotate one head in place.
void head(float* h, const float* w, float eps, const RopeStore& a) {
    if (w) norm_row(h, w, eps, a.D, h);
    rotate(h, a.cos, a.sin, a.rotary_dim, a.pairs);
}

void store(void* cache, Format kv, int64_t at, const float* src, int64_t n) {
    uint16_t* half = static_cast<uint16_t*>(cache) + at;
    if (kv == FMT_BF16)
        for (int64_t i = 0; i < n; ++i) half[i] = f32_to_bf16(src[i]);
    else if (kv == FMT_F16)
        for (int64_t i = 0; i < n; ++i) half[i] = f32_to_fp16(src[i]);
    else
        std::memcpy(static_cast<float*>(cache) + at, src, size_t(n) * 4);
}

// The k largest of v[0..E) by value (ties: the lower index first), in descending order.
void top_k(const float* v, int64_t E, int k, int64_t* ids) {
    std::vector<int64_t> order(static_cast<size_t>(E));
    for (int64_t i = 0; i < E; ++i) order[size_t(i)] = i;
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [v](int64_t a, int64_t b) {
        return v[a] > v[b] || (v[a] == v[b] && a < b);
    });
    std::copy(order.begin(), order.begin() + k, ids);
}

}  // namespace

void rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* out) {
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * n, w, eps, n, out + r * n);
}

void rope_store(const RopeStore& a) {
    float buf[kMaxHeadDim];
    for (int64_t h = 0; h < a.Hq; ++h) {
        float* q = a.q_out + h * a.D;
        std::memcpy(q, a.qkv + h * a.D, size_t(a.D) * 4);
        head(q, a.q_norm, a.eps, a);
    }
    const float* k = a.qkv + a.Hq * a.D;
    const float* v = k + a.Hkv * a.D;
    for (int64_t h = 0; h < a.Hkv; ++h) {
        std::memcpy(buf, k + h * a.D, size_t(a.D) * 4);
        head(buf, a.k_norm, a.eps, a);
        store(a.k_cache, a.cache_type, h * a.k_head + a.pos * a.k_pos, buf, a.D);
        store(a.v_cache, a.cache_type, h * a.v_head + a.pos * a.v_pos, v + h * a.Dv, a.Dv);
    }
}

void silu_mul_rows(const KernelTable& kt, const float* gu, int64_t rows, int64_t I, float* out) {
    for (int64_t r = 0; r < rows; ++r) kt.silu_mul(gu + r * 2 * I, gu + r * 2 * I + I, out + r * I, I);
}

void add_gated(float* out, const float* y, const float* gate, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
        float* o = out + r * n;
        const float* v = y + r * n;
        if (gate) {
            const float d = 1.f + std::exp(-gate[r]);
            for (int64_t i = 0; i < n; ++i) o[i] += v[i] / d;
        } else {
            for (int64_t i = 0; i < n; ++i) o[i] += v[i];
        }
    }
}

void add_bias(float* out, const float* bias, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < n; ++i) out[r * n + i] += bias[i];
}

void mla_rope_store(const MlaRopeStore& a) {
    const int64_t width = a.nope + a.rope;
    for (int64_t h = 0; h < a.H; ++h) rotate(a.q + h * width + a.nope, a.cos, a.sin, a.rope, a.pairs);
    float row[2 * kMaxHeadDim];
    norm_row(a.kv, a.kv_norm, a.eps, a.c, row);
    std::memcpy(row + a.c, a.kv + a.c, size_t(a.rope) * 4);
    rotate(row + a.c, a.cos, a.sin, a.rope, a.pairs);
    store(a.cache_row, a.cache_type, 0, row, a.c + a.rope);
}

void softmax_topk(const float* logits, int64_t E, int k, bool normalize, int64_t* ids, float* weights) {
    const float mx = *std::max_element(logits, logits + E);
    float denom = 0.f;
    for (int64_t e = 0; e < E; ++e) denom += std::exp(logits[e] - mx);
    top_k(logits, E, k, ids);  // softmax keeps the order
    float sum = 0.f;
    for (int i = 0; i < k; ++i) sum += weights[i] = std::exp(logits[ids[i]] - mx) / denom;
    if (normalize)
        for (int i = 0; i < k; ++i) weights[i] /= sum;
}

void sigmoid_group_topk(const float* logits, const float* bias, int64_t E, int k, int n_group, int topk_group,
                        bool normalize, float scaling, int64_t* ids, float* weights) {
    std::vector<float> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
        score[size_t(e)] = 1.f / (1.f + std::exp(-logits[e]));
        choice[size_t(e)] = bias ? score[size_t(e)] + bias[e] : score[size_t(e)];
    }
    if (n_group > 1 && topk_group < n_group) {
        const int64_t per = E / n_group;
        std::vector<float> group(static_cast<size_t>(n_group));
        for (int g = 0; g < n_group; ++g) {
            const float* c = choice.data() + g * per;
            int64_t best[2];
            top_k(c, per, 2, best);
            group[size_t(g)] = c[best[0]] + c[best[1]];
        }
        std::vector<int64_t> keep(static_cast<size_t>(topk_group));
        top_k(group.data(), n_group, topk_group, keep.data());
        std::vector<char> eligible(size_t(n_group), 0);
        for (int64_t g : keep) eligible[size_t(g)] = 1;
        for (int64_t e = 0; e < E; ++e)
            if (!eligible[size_t(e / per)]) choice[size_t(e)] = -std::numeric_limits<float>::infinity();
    }
    top_k(choice.data(), E, k, ids);
    float sum = 0.f;
    for (int i = 0; i < k; ++i) sum += weights[i] = score[size_t(ids[i])];
    for (int i = 0; i < k; ++i) weights[i] = (normalize ? weights[i] / (sum + 1e-20f) : weights[i]) * scaling;
}

void topk_softmax(const float* logits, int64_t E, int k, int64_t* ids, float* weights) {
    top_k(logits, E, k, ids);
    const float mx = logits[ids[0]];
    float sum = 0.f;
    for (int i = 0; i < k; ++i) sum += weights[i] = std::exp(logits[ids[i]] - mx);
    for (int i = 0; i < k; ++i) weights[i] /= sum;
}

}  // namespace hmoe
