// Python bindings: backend.engine._native.
//
// The Python side (backend/engine/native_experts.py) describes a layer's experts by
// addresses into tensors it keeps alive (the mmap'd checkpoint views), so no weight byte
// is copied or converted at load. forward() releases the GIL for the whole computation:
// the Python thread that drives the GPU keeps running while the CPU experts are computed.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <algorithm>
#include <vector>

#include "attention_decode.h"
#include "decode_chain.h"
#include "decode_ops.h"
#include "dense_linear.h"
#include "dispatch.h"
#include "mla_decode.h"
#include "moe_layer.h"
#include "repack.h"
#include "thread_pool.h"
#include "topology.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace hmoe {
namespace {

int env_int(const char* name, int fallback) {
    const char* v = std::getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    return (end && *end == '\0') ? int(x) : fallback;
}

// The process-wide pool, created on first use (importing the module starts no thread).
std::mutex g_exec_mutex;
std::unique_ptr<Executor> g_exec;
int g_requested_threads = -1;
int g_simulated_nodes = 0;  // tests: regroup the cores into this many nodes

Executor& executor() {
    std::lock_guard<std::mutex> lock(g_exec_mutex);
    if (!g_exec) {
        const int threads = g_requested_threads >= 0 ? g_requested_threads : env_int("HYBRIDMOE_CPU_THREADS", 0);
        Topology topo = detect_topology();
        if (g_simulated_nodes > 0) topo = split_into_nodes(topo, g_simulated_nodes);
        g_exec = std::make_unique<Executor>(topo, threads, env_int("HYBRIDMOE_PIN", 1) != 0,
                                            env_int("HYBRIDMOE_SPIN_US", 50));
    }
    return *g_exec;
}

Format parse_format(const std::string& name) {
    for (int i = 0; i < FMT_COUNT; ++i)  // the x8 layouts are made here, never handed in
        if (name == kFormats[i].name && kFormats[i].row_group == 1) return Format(i);
    throw nb::value_error(("unsupported format for the native kernels: " + name).c_str());
}

bool is_bf16(const nb::dlpack::dtype& d) {
    return d.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && d.bits == 16 && d.lanes == 1;
}

// bf16, or its bits in uint16, which is how a NumPy view carries it: NumPy has no bfloat16, and
// the decode step passes NumPy views because a torch tensor crosses into an extension through
// DLPack, several microseconds an argument.
bool is_bf16_or_bits(const nb::dlpack::dtype& d) {
    return is_bf16(d) || (d.code == uint8_t(nb::dlpack::dtype_code::UInt) && d.bits == 16 && d.lanes == 1);
}

// A float matrix's format from its dtype: float32, float16, or bfloat16 (or its bits).
Format half_format(const nb::dlpack::dtype& dt, const char* what) {
    if (dt == nb::dtype<float>()) return FMT_F32;
    if (is_bf16_or_bits(dt)) return FMT_BF16;
    if (dt.code == uint8_t(nb::dlpack::dtype_code::Float) && dt.bits == 16 && dt.lanes == 1) return FMT_F16;
    throw nb::type_error((std::string(what) + " must be float32, float16 or bfloat16").c_str());
}

// Keys and values of a KV cache: their element type (float32, bfloat16 or float16; one for both).
Format cache_format(const nb::dlpack::dtype& k, const nb::dlpack::dtype& v) {
    if (k != v) throw nb::type_error("keys and values must have one dtype");
    return half_format(k, "the cache");
}

using I64Array = nb::ndarray<const int64_t, nb::c_contig, nb::device::cpu>;
using F32Array = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;

// refs: int64 [E, 3, 4] = (data address, scale address, row stride, scale row stride) of
// gate, up, down; biases: int64 [E, 3] fp32 addresses (0: none).
MoELayer make_layer(const std::string& format, const std::string& down_format, int64_t hidden, int64_t inter, I64Array refs,
                     nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> cpu, const std::string& act,
                     float alpha, float limit, I64Array biases) {
    const Format fmt = parse_format(format);
    const Format dfmt = parse_format(down_format.empty() ? format : down_format);
    const FormatInfo& f = kFormats[fmt];
    const FormatInfo& fd = kFormats[dfmt];
    if (refs.ndim() != 3 || refs.shape(1) != 3 || refs.shape(2) != 4)
        throw nb::value_error("refs must be int64 [E, 3, 4]");
    const int64_t E = int64_t(refs.shape(0));
    if (int64_t(cpu.shape(0)) != E) throw nb::value_error("cpu mask must have one entry per expert");
    if (biases.ndim() != 2 || int64_t(biases.shape(0)) != E || biases.shape(1) != 3)
        throw nb::value_error("biases must be int64 [E, 3]");
    if (hidden <= 0 || inter <= 0) throw nb::value_error("hidden and intermediate sizes must be positive");
    // Rows are whole blocks (K of gate/up is the hidden size, K of down the intermediate one).
    if (hidden % f.block || inter % fd.block)
        throw nb::value_error(("formats " + std::string(f.name) + "/" + fd.name + " need hidden size a multiple of " +
                               std::to_string(f.block) + " and intermediate size a multiple of " +
                               std::to_string(fd.block)).c_str());
    Activation a;
    if (act == "silu")
        a = Activation::SwiGLU;
    else if (act == "gpt_oss")
        a = Activation::GptOss;
    else
        throw nb::value_error(("unsupported activation: " + act).c_str());

    const int64_t* r = refs.data();
    const int64_t* b = biases.data();
    std::vector<ExpertWeights> experts(static_cast<size_t>(E));
    std::vector<uint8_t> mask(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
        mask[size_t(e)] = cpu.data()[e] ? 1 : 0;
        if (!mask[size_t(e)]) continue;
        MatrixRef* m[3] = {&experts[size_t(e)].gate, &experts[size_t(e)].up, &experts[size_t(e)].down};
        for (int j = 0; j < 3; ++j) {
            const int64_t* q = r + (e * 3 + j) * 4;
            *m[j] = MatrixRef{reinterpret_cast<const uint8_t*>(q[0]), reinterpret_cast<const uint8_t*>(q[1]), q[2], q[3]};
            if (!q[0] || (kFormats[j == 2 ? dfmt : fmt].scale_bytes && !q[1]))
                throw nb::value_error(("expert " + std::to_string(e) + ": missing weight address").c_str());
        }
        experts[size_t(e)].gate_bias = reinterpret_cast<const float*>(b[e * 3 + 0]);
        experts[size_t(e)].up_bias = reinterpret_cast<const float*>(b[e * 3 + 1]);
        experts[size_t(e)].down_bias = reinterpret_cast<const float*>(b[e * 3 + 2]);
    }
    return MoELayer(fmt, dfmt, hidden, inter, std::move(experts), std::move(mask), a, alpha, limit);
}

void layer_forward(const MoELayer& layer, nb::ndarray<nb::ndim<2>, nb::c_contig, nb::device::cpu> x,
                   nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> ids, F32Array weights,
                   nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out, int regime, int prefill_min_tokens) {
    const int64_t T = int64_t(x.shape(0));
    const bool bf16 = is_bf16(x.dtype());
    if (!bf16 && x.dtype() != nb::dtype<float>()) throw nb::type_error("x must be float32 or bfloat16");
    if (int64_t(x.shape(1)) != layer.hidden()) throw nb::value_error("x has the wrong hidden size");
    if (int64_t(ids.shape(0)) != T) throw nb::value_error("topk_ids must have one row per token");
    const int k = int(ids.shape(1));
    if (weights.ndim() != 2 || int64_t(weights.shape(0)) != T || int(weights.shape(1)) != k)
        throw nb::value_error("topk_weights must have the shape of topk_ids");
    if (int64_t(out.shape(0)) != T || int64_t(out.shape(1)) != layer.hidden())
        throw nb::value_error("out must be float32 [T, hidden]");
    if (regime < 0 || regime > 3) throw nb::value_error("regime must be 0 (auto), 1 (decode), 2 (prefill) or 3 (prompt)");
    const KernelTable& kt = *current_table();
    const int threshold = prefill_min_tokens > 0 ? prefill_min_tokens : default_prefill_min_tokens(kt, layer.format());
    Executor& exec = executor();
    const void* xp = x.data();
    const int64_t* idp = ids.data();
    const float* wp = weights.data();
    float* op = out.data();
    nb::gil_scoped_release release;
    layer.forward(exec, kt, xp, bf16, T, idp, wp, k, op, Regime(regime), threshold);
}

// parts: [(rows, (data address, scale address, row stride, scale row stride))], each a
// [rows, cols] matrix; the outputs side by side.
DenseLinear make_dense(const std::string& format, int64_t cols,
                       const std::vector<std::pair<int64_t, std::vector<int64_t>>>& parts) {
    const Format fmt = parse_format(format);
    const FormatInfo& f = kFormats[fmt];
    if (cols <= 0 || parts.empty()) throw nb::value_error("a projection needs columns and at least one matrix");
    if (cols % f.block || (!f.float_acts && cols % 32))
        throw nb::value_error((std::string(f.name) + " rows must be a multiple of " + std::to_string(std::max(f.block, 32)) +
                               " long").c_str());
    std::vector<DensePart> out;
    for (const auto& [rows, ref] : parts) {
        if (rows <= 0) throw nb::value_error("a matrix needs rows");
        if (ref.size() != 4) throw nb::value_error("ref must be (data, scales, row stride, scale row stride)");
        if (!ref[0] || (f.scale_bytes && !ref[1])) throw nb::value_error("missing weight address");
        out.push_back(DensePart{fmt,
                                MatrixRef{reinterpret_cast<const uint8_t*>(ref[0]), reinterpret_cast<const uint8_t*>(ref[1]),
                                          ref[2], ref[3]},
                                rows});
    }
    return DenseLinear(cols, std::move(out));
}

void dense_forward(const DenseLinear& lin, nb::ndarray<nb::ndim<2>, nb::c_contig, nb::device::cpu> x,
                   nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out, int prefill_min_tokens) {
    const int64_t T = int64_t(x.shape(0));
    const bool bf16 = is_bf16(x.dtype());
    if (!bf16 && x.dtype() != nb::dtype<float>()) throw nb::type_error("x must be float32 or bfloat16");
    if (int64_t(x.shape(1)) != lin.cols()) throw nb::value_error("x has the wrong number of columns");
    if (int64_t(out.shape(0)) != T || int64_t(out.shape(1)) != lin.rows())
        throw nb::value_error("out must be float32 [T, rows]");
    const KernelTable& kt = *current_table();
    Executor& exec = executor();
    const void* xp = x.data();
    float* op = out.data();
    nb::gil_scoped_release release;
    lin.forward(exec, kt, xp, bf16, T, op, prefill_min_tokens);
}

using QueryRows = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using AttendOut = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// The end both decode-attention bindings share once they have described the cache in `a`:
// the queries, the scale, the output, the call without the GIL.
void run_attend_decode(DecodeAttention& a, const QueryRows& q, float scale, AttendOut& out) {
    a.q = q.data();
    a.scale = scale;
    a.out = out.data();
    const KernelTable& kt = *current_table();
    Executor& exec = executor();
    nb::gil_scoped_release release;
    attend_decode(exec, kt, a);
}

// q [Hq, D] fp32; k, v [Hkv, >= S, D] views of the cache (bf16 or fp32, rows contiguous);
// out [Hq, Dv] fp32.
void attend_decode_py(QueryRows q,
                      nb::ndarray<nb::ndim<3>, nb::device::cpu> k, nb::ndarray<nb::ndim<3>, nb::device::cpu> v,
                      int64_t length, float scale, AttendOut out) {
    DecodeAttention a;
    a.Hq = int64_t(q.shape(0));
    a.D = int64_t(q.shape(1));
    a.Hkv = int64_t(k.shape(0));
    a.Dv = int64_t(v.shape(2));
    a.S = length;
    if (a.Hkv <= 0 || a.Hq % a.Hkv || int64_t(v.shape(0)) != a.Hkv) throw nb::value_error("query heads must be a multiple of KV heads");
    if (int64_t(k.shape(2)) != a.D) throw nb::value_error("keys and queries differ in head size");
    if (length <= 0 || length > int64_t(k.shape(1)) || length > int64_t(v.shape(1))) throw nb::value_error("length out of range");
    if (k.stride(2) != 1 || v.stride(2) != 1) throw nb::value_error("cache rows must be contiguous");
    if (int64_t(out.shape(0)) != a.Hq || int64_t(out.shape(1)) != a.Dv) throw nb::value_error("out must be float32 [Hq, Dv]");
    a.k = k.data();
    a.v = v.data();
    a.kv = cache_format(k.dtype(), v.dtype());
    a.k_head = k.stride(0);
    a.k_pos = k.stride(1);
    a.v_head = v.stride(0);
    a.v_pos = v.stride(1);
    run_attend_decode(a, q, scale, out);
}

using KvBlocks = nb::ndarray<nb::ndim<4>, nb::device::cpu>;

// A block-allocated cache (k_blocks [n_blocks, Hkv, B, D], v_blocks [n_blocks, Hkv, B, Dv],
// bf16 or fp32, rows contiguous) as a DecodeAttention of Hq query heads over the first
// `length` positions of the sequence whose block ids are table[0 .. table_len).
DecodeAttention paged_attention(int64_t Hq, int64_t D, const KvBlocks& k_blocks, const KvBlocks& v_blocks,
                                const int64_t* table, int64_t table_len, int64_t length) {
    DecodeAttention a;
    a.kv = cache_format(k_blocks.dtype(), v_blocks.dtype());
    a.Hq = Hq;
    a.D = D;
    const int64_t n_blocks = int64_t(k_blocks.shape(0));
    a.Hkv = int64_t(k_blocks.shape(1));
    a.block_size = int64_t(k_blocks.shape(2));
    a.Dv = int64_t(v_blocks.shape(3));
    a.S = length;
    if (int64_t(v_blocks.shape(0)) != n_blocks || int64_t(v_blocks.shape(1)) != a.Hkv ||
        int64_t(v_blocks.shape(2)) != a.block_size)
        throw nb::value_error("k_blocks and v_blocks must have the same number of blocks, KV heads and block size "
                              "([n_blocks, Hkv, B, D] and [n_blocks, Hkv, B, Dv])");
    if (a.block_size <= 0) throw nb::value_error("the block size (axis 2 of k_blocks) must be at least 1");
    if (a.Hkv <= 0 || a.Hq % a.Hkv) throw nb::value_error("query heads must be a multiple of KV heads");
    if (int64_t(k_blocks.shape(3)) != a.D) throw nb::value_error("keys and queries differ in head size");
    if (k_blocks.stride(3) != 1 || v_blocks.stride(3) != 1) throw nb::value_error("cache rows must be contiguous");
    const int64_t used = length > 0 ? (length - 1) / a.block_size + 1 : 0;
    if (length <= 0 || used > table_len)
        throw nb::value_error(("length " + std::to_string(length) + " out of range: the table's " +
                               std::to_string(table_len) + " blocks of " + std::to_string(a.block_size) +
                               " hold 1 to " + std::to_string(table_len * a.block_size) + " positions")
                                  .c_str());
    for (int64_t i = 0; i < used; ++i)
        if (table[i] < 0 || table[i] >= n_blocks)
            throw nb::value_error(("block table entry " + std::to_string(i) + " is " + std::to_string(table[i]) +
                                   ", not a block of the cache (0 to " + std::to_string(n_blocks - 1) + ")")
                                      .c_str());
    a.k = k_blocks.data();
    a.v = v_blocks.data();
    a.blocks = table;
    a.k_block = k_blocks.stride(0);
    a.k_head = k_blocks.stride(1);
    a.k_pos = k_blocks.stride(2);
    a.v_block = v_blocks.stride(0);
    a.v_head = v_blocks.stride(1);
    a.v_pos = v_blocks.stride(2);
    return a;
}

// q [Hq, D] fp32; table int64 [>= ceil(length / B)], the sequence's block ids in order;
// out [Hq, Dv] fp32.
void attend_decode_paged_py(QueryRows q, KvBlocks k_blocks, KvBlocks v_blocks,
                            nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> table, int64_t length,
                            float scale, AttendOut out) {
    DecodeAttention a = paged_attention(int64_t(q.shape(0)), int64_t(q.shape(1)), k_blocks, v_blocks, table.data(),
                                        int64_t(table.shape(0)), length);
    if (int64_t(out.shape(0)) != a.Hq || int64_t(out.shape(1)) != a.Dv) throw nb::value_error("out must be float32 [Hq, Dv]");
    run_attend_decode(a, q, scale, out);
}

// One query per sequence of a decode step: q [T, Hq, D] fp32, tables int64 [T, >= the
// longest's blocks] (row t: sequence t's block ids), lengths int64 [T], out [T, Hq, Dv].
void attend_decode_rows_py(nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> q, KvBlocks k_blocks,
                           KvBlocks v_blocks, nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> tables,
                           nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> lengths, float scale,
                           nb::ndarray<float, nb::ndim<3>, nb::c_contig, nb::device::cpu> out) {
    const int64_t T = int64_t(q.shape(0)), Hq = int64_t(q.shape(1)), D = int64_t(q.shape(2));
    if (int64_t(tables.shape(0)) != T || int64_t(lengths.shape(0)) != T || int64_t(out.shape(0)) != T)
        throw nb::value_error("q, tables, lengths and out must have one row per sequence");
    std::vector<DecodeAttention> rows;
    for (int64_t t = 0; t < T; ++t) {
        DecodeAttention a = paged_attention(Hq, D, k_blocks, v_blocks, tables.data() + t * int64_t(tables.shape(1)),
                                            int64_t(tables.shape(1)), lengths.data()[t]);
        if (int64_t(out.shape(1)) != Hq || int64_t(out.shape(2)) != a.Dv)
            throw nb::value_error("out must be float32 [T, Hq, Dv]");
        a.q = q.data() + t * Hq * D;
        a.scale = scale;
        a.out = out.data() + t * Hq * a.Dv;
        rows.push_back(a);
    }
    const KernelTable& kt = *current_table();
    Executor& exec = executor();
    nb::gil_scoped_release release;
    attend_decode_rows(exec, kt, rows.data(), int(rows.size()));
}

// ---- the small decode steps (decode_ops.h); tensors are float32 unless said --------------

using F32Out = nb::ndarray<float, nb::c_contig, nb::device::cpu>;
using I64Out = nb::ndarray<int64_t, nb::c_contig, nb::device::cpu>;

void rms_norm_py(F32Array x, std::optional<F32Array> w, float eps, F32Out out) {
    const int64_t n = x.ndim() < 1 ? 0 : int64_t(x.shape(x.ndim() - 1));
    if (n <= 0 || (w && int64_t(w->size()) != n)) throw nb::value_error("x rows must be as long as w");
    if (out.size() != x.size()) throw nb::value_error("out must have x's shape");
    rms_norm(x.data(), w ? w->data() : nullptr, eps, int64_t(x.size()) / n, n, out.data());
}

// out[i] = table[tokens[i]] widened to float32; the table is float32, float16, or bfloat16 (or its
// bits). A decode step's embedding in one call: NumPy's fancy index and widening shift took
// ~0.1 ms a token on caches the weights had just streamed through.
void embed_rows_py(nb::ndarray<nb::ndim<2>, nb::c_contig, nb::device::cpu> table, const std::vector<int64_t>& tokens,
                   nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out) {
    const int64_t V = int64_t(table.shape(0)), H = int64_t(table.shape(1));
    if (int64_t(out.shape(0)) < int64_t(tokens.size()) || int64_t(out.shape(1)) != H)
        throw nb::value_error("out must have a row of the table's width per token");
    const nb::dlpack::dtype dt = table.dtype();
    const bool f32 = dt == nb::dtype<float>();
    const bool half = dt.code == uint8_t(nb::dlpack::dtype_code::Float) && dt.bits == 16 && dt.lanes == 1;
    const bool bf16 = is_bf16_or_bits(dt);
    if (!f32 && !half && !bf16) throw nb::type_error("the table must be float32, float16 or bfloat16");
    for (const int64_t t : tokens)
        if (t < 0 || t >= V) throw nb::index_error(("token id " + std::to_string(t) + " is outside the vocabulary").c_str());
    for (size_t i = 0; i < tokens.size(); ++i) {
        float* o = out.data() + int64_t(i) * H;
        const uint16_t* row = static_cast<const uint16_t*>(table.data()) + tokens[i] * H;
        if (f32)
            std::memcpy(o, static_cast<const float*>(table.data()) + tokens[i] * H, size_t(H) * sizeof(float));
        else if (bf16)
            for (int64_t j = 0; j < H; ++j) o[j] = bf16_to_f32(row[j]);
        else
            for (int64_t j = 0; j < H; ++j) o[j] = fp16_to_f32(row[j]);
    }
}

// qkv [Hq*D + Hkv*D + Hkv*Dv]; cos, sin [positions, rotary_dim / 2]; caches [Hkv, capacity, D].
void rope_store_py(F32Array qkv, int64_t n_heads, int64_t n_kv_heads, std::optional<F32Array> q_norm, std::optional<F32Array> k_norm,
                   float eps, F32Array cos, F32Array sin, bool pairs, nb::ndarray<nb::ndim<3>, nb::device::cpu> k_cache,
                   nb::ndarray<nb::ndim<3>, nb::device::cpu> v_cache, int64_t pos, F32Out q_out) {
    RopeStore a;
    a.Hq = n_heads;
    a.Hkv = n_kv_heads;
    a.D = int64_t(k_cache.shape(2));
    a.Dv = int64_t(v_cache.shape(2));
    a.cache_type = cache_format(k_cache.dtype(), v_cache.dtype());
    if (a.Hkv <= 0 || a.Hq % a.Hkv || int64_t(k_cache.shape(0)) != a.Hkv || int64_t(v_cache.shape(0)) != a.Hkv)
        throw nb::value_error("the caches must hold n_kv_heads heads, a divisor of n_heads");
    if (a.D > kMaxHeadDim || a.Dv > kMaxHeadDim) throw nb::value_error("head size over 1024");
    if (int64_t(qkv.size()) != a.Hq * a.D + a.Hkv * (a.D + a.Dv)) throw nb::value_error("qkv has the wrong size");
    if (int64_t(q_out.size()) != a.Hq * a.D) throw nb::value_error("q_out must hold n_heads * head_dim floats");
    if (cos.ndim() != 2 || sin.ndim() != 2 || cos.shape(1) != sin.shape(1)) throw nb::value_error("cos and sin must be [positions, rotary_dim / 2]");
    a.rotary_dim = 2 * int64_t(cos.shape(1));
    if (a.rotary_dim > a.D) throw nb::value_error("rotary_dim exceeds the head size");
    if (pos < 0 || pos >= int64_t(cos.shape(0)) || pos >= int64_t(sin.shape(0)) || pos >= int64_t(k_cache.shape(1)) ||
        pos >= int64_t(v_cache.shape(1)))
        throw nb::value_error("position out of range");
    if (k_cache.stride(2) != 1 || v_cache.stride(2) != 1) throw nb::value_error("cache rows must be contiguous");
    for (const auto* w : {&q_norm, &k_norm})
        if (*w && int64_t((*w)->size()) != a.D) throw nb::value_error("q/k norm weights must have head_dim entries");
    a.qkv = qkv.data();
    a.q_norm = q_norm ? q_norm->data() : nullptr;
    a.k_norm = k_norm ? k_norm->data() : nullptr;
    a.eps = eps;
    a.cos = cos.data() + pos * int64_t(cos.shape(1));
    a.sin = sin.data() + pos * int64_t(sin.shape(1));
    a.pairs = pairs;
    a.k_cache = k_cache.data();
    a.v_cache = v_cache.data();
    a.k_head = k_cache.stride(0);
    a.k_pos = k_cache.stride(1);
    a.v_head = v_cache.stride(0);
    a.v_pos = v_cache.stride(1);
    a.pos = pos;
    a.q_out = q_out.data();
    rope_store(a);
}

// Multi-head latent attention's small steps for one token (decode_ops.h): q [H, nope + rope]
// and the compressed kv [c + rope] of the token; the cache row it goes to; cos, sin [rope / 2].
void mla_rope_store_py(F32Out q, F32Array kv, F32Array kv_norm, float eps, F32Array cos, F32Array sin, bool pairs,
                       nb::ndarray<nb::ndim<1>, nb::c_contig, nb::device::cpu> cache_row, int64_t n_heads, int64_t rope) {
    MlaRopeStore a;
    a.H = n_heads;
    a.rope = rope;
    a.c = int64_t(kv_norm.size());
    a.nope = n_heads > 0 ? int64_t(q.size()) / n_heads - rope : 0;
    if (n_heads <= 0 || rope <= 0 || rope % 2 || a.nope < 0 || int64_t(q.size()) != n_heads * (a.nope + rope))
        throw nb::value_error("q must hold n_heads heads of nope + rope features (rope even)");
    if (int64_t(kv.size()) != a.c + rope || int64_t(cache_row.shape(0)) != a.c + rope)
        throw nb::value_error("kv and the cache row must hold the latent (kv_norm's size) and the rotary key");
    if (a.c + rope > 2 * kMaxHeadDim || rope > kMaxHeadDim) throw nb::value_error("latent or rotary key over the limit");
    if (int64_t(cos.size()) != rope / 2 || int64_t(sin.size()) != rope / 2)
        throw nb::value_error("cos and sin must hold rope / 2 entries (the token's position)");
    a.q = q.data();
    a.kv = kv.data();
    a.kv_norm = kv_norm.data();
    a.eps = eps;
    a.cos = cos.data();
    a.sin = sin.data();
    a.pairs = pairs;
    a.cache_row = cache_row.data();
    a.cache_type = cache_format(cache_row.dtype(), cache_row.dtype());
    mla_rope_store(a);
}

// kv_b_proj [H * (nope + v), c] (float32, float16, bfloat16 or its bits) as joined maps.
LatentMaps joined_maps(nb::ndarray<nb::ndim<2>, nb::c_contig, nb::device::cpu> kv_b, int64_t n_heads, int64_t nope,
                       int64_t v) {
    const Format fmt = half_format(kv_b.dtype(), "kv_b");
    if (n_heads < 1 || nope < 1 || v < 1 || int64_t(kv_b.shape(0)) != n_heads * (nope + v))
        throw nb::value_error("kv_b must be [n_heads * (nope + v), c]");
    const int64_t c = int64_t(kv_b.shape(1));
    MatrixRef ref{static_cast<const uint8_t*>(kv_b.data()), nullptr, c * int64_t(kFormats[fmt].block_bytes), 0};
    return LatentMaps(n_heads, nope, v, c, false, fmt, ref, fmt, ref);
}

// GGUF's attn_k_b [H * c, nope] and attn_v_b [H * v, c] as the matrices of two one-part dense
// projections (their stored form or row-interleaved copy), which the caller keeps alive.
LatentMaps split_maps(const DenseLinear& k, const DenseLinear& v, int64_t n_heads, int64_t nope, int64_t v_dim,
                      int64_t c) {
    if (k.parts().size() != 1 || v.parts().size() != 1 || k.rows() != n_heads * c || k.cols() != nope ||
        v.rows() != n_heads * v_dim || v.cols() != c)
        throw nb::value_error("the maps must be [n_heads * c, nope] and [n_heads * v, c]");
    const DensePart &kp = k.parts()[0], &vp = v.parts()[0];
    try {
        return LatentMaps(n_heads, nope, v_dim, c, true, kp.fmt, kp.w, vp.fmt, vp.w);
    } catch (const std::invalid_argument& e) {
        throw nb::value_error(e.what());
    }
}

std::string maps_format(const LatentMaps& maps) {
    const std::string k = kFormats[maps.k_fmt].name, v = kFormats[maps.v_fmt].name;
    return k == v ? k : k + "+" + v;
}

// q [T, H * (nope + rope)], maps (LatentMaps), cache [n_blocks, B, c + rope], tables [T, L],
// lengths [T] -> out [T, H * v].
void mla_attend_rows_py(nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> q, const LatentMaps& maps,
                        nb::ndarray<nb::ndim<3>, nb::c_contig, nb::device::cpu> cache,
                        nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> tables,
                        nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> lengths, int64_t rope,
                        float scale, nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out) {
    MlaDecode m;
    m.H = maps.H;
    m.nope = maps.nope;
    m.rope = rope;
    m.v = maps.v;
    m.c = maps.c;
    m.maps = &maps;
    const int64_t T = int64_t(q.shape(0)), L = int64_t(tables.shape(1));
    if (rope <= 0 || int64_t(q.shape(1)) != m.H * (m.nope + rope) || int64_t(out.shape(0)) != T ||
        int64_t(out.shape(1)) != m.H * m.v)
        throw nb::value_error("q [T, H*(nope+rope)] and out [T, H*v] do not agree with the maps");
    if (int64_t(cache.shape(2)) != m.c + rope || m.c + rope > kMaxHeadDim)
        throw nb::value_error("cache rows must be [latent | rotary key], at most 1024 wide");
    if (int64_t(tables.shape(0)) != T || int64_t(lengths.shape(0)) != T)
        throw nb::value_error("tables and lengths need one row per query");
    m.block = int64_t(cache.shape(1));
    const int64_t n_blocks = int64_t(cache.shape(0));
    for (int64_t t = 0; t < T; ++t) {
        const int64_t S = lengths(t);
        if (S < 1 || (S + m.block - 1) / m.block > L) throw nb::value_error("a length is outside its block table");
        for (int64_t b = 0; b < (S + m.block - 1) / m.block; ++b)
            if (tables(t, b) < 0 || tables(t, b) >= n_blocks) throw nb::value_error("block table entry out of range");
    }
    m.cache = cache.data();
    m.cache_type = cache_format(cache.dtype(), cache.dtype());
    m.scale = scale;
    const float* qp = q.data();
    const int64_t* tp = tables.data();
    const int64_t* lp = lengths.data();
    float* op = out.data();
    const KernelTable& kt = *current_table();
    Executor& exec = executor();
    nb::gil_scoped_release release;
    mla_attend_rows(exec, kt, m, qp, T, tp, L, lp, op);
}

void check_route(F32Array logits, int k, I64Out ids, F32Out weights) {
    if (k <= 0 || int64_t(k) > int64_t(logits.size())) throw nb::value_error("k must be between 1 and the number of experts");
    if (int64_t(ids.size()) != k || int64_t(weights.size()) != k) throw nb::value_error("ids and weights must hold k entries");
}

// A native probe of host read bandwidth with the kernels' own threads: each thread sums
// its slice of a buffer far larger than the caches. Best of `passes`, bytes per second.
struct ProbeCtx {
    const uint64_t* data;
    int64_t words;
    int total_threads;
    std::vector<int> base;  // first global thread index of each node
    std::vector<uint64_t> sink;
};

void probe_phase(void* ctx, int node, int worker) {
    auto& c = *static_cast<ProbeCtx*>(ctx);
    const int id = c.base[size_t(node)] + worker;
    const int64_t per = (c.words / c.total_threads) & ~int64_t(7);
    const uint64_t* p = c.data + per * id;
    const int64_t n = id == c.total_threads - 1 ? c.words - per * id : per;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += p[i];
        s1 += p[i + 1];
        s2 += p[i + 2];
        s3 += p[i + 3];
    }
    for (; i < n; ++i) s0 += p[i];
    c.sink[size_t(id)] = s0 + s1 + s2 + s3;
}

double measure_read_bandwidth(int64_t nbytes, int passes) {
    Executor& exec = executor();
    // Allocated as the weights' copies are (allocate_pages: huge pages where granted).
    const size_t words = size_t(std::max<int64_t>(nbytes / 8, 1024));
    const OwnedBytes owned = allocate_pages(int64_t(words * 8));
    uint64_t* buf = reinterpret_cast<uint64_t*>(owned.get());
    ProbeCtx c{buf, int64_t(words), exec.threads(), {}, std::vector<uint64_t>(size_t(exec.threads()))};
    for (int n = 0, acc = 0; n < exec.nodes(); ++n) {
        c.base.push_back(acc);
        acc += exec.threads_on(n);
    }
    {
        nb::gil_scoped_release release;
        // Fault the pages in from the threads that will read them (first touch places them).
        for (size_t i = 0; i < words; i += 512) buf[i] = i;
        exec.run(probe_phase, &c);
    }
    double best = 1e30;
    for (int i = 0; i < std::max(1, passes); ++i) {
        nb::gil_scoped_release release;
        const auto t0 = std::chrono::steady_clock::now();
        exec.run(probe_phase, &c);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, s);
    }
    return double(words) * 8.0 / best;
}

// ---- the decode chain's bindings: what a grouped-query and a latent layer share ----------

void chain_common(ChainLayer& l, const ChainShape& s, F32Array attn_norm, float attn_eps, F32Array cos, F32Array sin,
                  bool pairs, float scale, const DenseLinear& o, std::optional<F32Array> o_bias) {
    if (int64_t(attn_norm.size()) != s.H) throw nb::value_error("norm weights must have one entry per hidden feature");
    if (cos.ndim() != 2 || sin.ndim() != 2 || cos.shape(0) != sin.shape(0) || cos.shape(1) != sin.shape(1))
        throw nb::value_error("cos and sin must be [positions, rotary_dim / 2]");
    if (o_bias && int64_t(o_bias->size()) != o.rows()) throw nb::value_error("o_bias must have o's rows");
    l.attn_norm = attn_norm.data();
    l.attn_eps = attn_eps;
    l.cos = cos.data();
    l.sin = sin.data();
    l.positions = int64_t(cos.shape(0));
    l.rotary_half = int64_t(cos.shape(1));
    l.pairs = pairs;
    l.scale = scale;
    l.o = &o;
    l.o_bias = o_bias ? o_bias->data() : nullptr;
}

// A route from its description's fields (Python's cpu_decode.route_fields): the chain's layers
// and the per-call path's `route` take the same. E experts, k chosen.
ChainRoute make_route(const std::string& route, bool normalize, std::optional<F32Array> correction_bias, int n_group,
                      int topk_group, float scaling, int64_t E, int64_t k) {
    ChainRoute r;
    if (!route_kind(route, r.kind)) {
        std::string names;
        for (const RouteName& n : kRouteNames) names += std::string(names.empty() ? "" : ", ") + n.name;
        throw nb::value_error(("route must be one of " + names + ", not " + route).c_str());
    }
    if (correction_bias && int64_t(correction_bias->size()) != E)
        throw nb::value_error("a router's bias must have one entry per expert");
    if (r.kind == ChainRoute::SigmoidGroupTopK &&
        (n_group < 1 || E % n_group || (n_group > 1 && E / n_group < 2) || topk_group < 1 || topk_group > n_group ||
         k > int64_t(topk_group) * (E / n_group)))
        throw nb::value_error("n_group must divide the experts into groups of two or more, and topk_group of them hold k");
    r.normalize = normalize;
    r.bias = correction_bias ? correction_bias->data() : nullptr;
    r.n_group = n_group;
    r.topk_group = topk_group;
    r.scaling = scaling;
    return r;
}

void chain_ffn(ChainLayer& l, const ChainShape& s, F32Array ffn_norm, float ffn_eps, const DenseLinear* router,
               std::optional<F32Array> router_bias, const std::string& route, bool normalize,
               std::optional<F32Array> correction_bias, int n_group, int topk_group, float scaling,
               const MoELayer* experts, const DenseLinear* gate_up, const DenseLinear* down,
               const DenseLinear* shared_gate) {
    if (int64_t(ffn_norm.size()) != s.H) throw nb::value_error("norm weights must have one entry per hidden feature");
    const int64_t E = router ? router->rows() : 0;
    if (router_bias && int64_t(router_bias->size()) != E)
        throw nb::value_error("a router's bias must have one entry per expert");
    l.ffn_norm = ffn_norm.data();
    l.ffn_eps = ffn_eps;
    l.router = router;
    l.router_bias = router_bias ? router_bias->data() : nullptr;
    if (router) l.route = make_route(route, normalize, correction_bias, n_group, topk_group, scaling, E, s.k);
    l.experts = experts;
    l.gate_up = gate_up;
    l.down = down;
    l.shared_gate = shared_gate;
}

// The feed-forward block's arguments, as chain_ffn takes them (after ffn_norm and ffn_eps).
#define CHAIN_FFN_ARGS                                                                                              \
    "router"_a.none() = nb::none(), "router_bias"_a.none() = nb::none(), "route"_a = "softmax_topk",                \
        "normalize"_a = false, "correction_bias"_a.none() = nb::none(), "n_group"_a = 1, "topk_group"_a = 1,        \
        "scaling"_a = 1.f, "experts"_a.none() = nb::none(), "gate_up"_a.none() = nb::none(),                        \
        "down"_a.none() = nb::none(), "shared_gate"_a.none() = nb::none()

}  // namespace
}  // namespace hmoe

NB_MODULE(_native, m) {
    using namespace hmoe;
    m.doc() = "Native CPU kernels for quantized MoE experts (see native/ in the source tree).";

    m.def("isa", [] { return std::string(current_table()->name); },
          "The kernel set in use: 'avx512_amx', 'avx512_vnni', 'avx2' or 'scalar'.");
    m.def(
        "set_isa",
        [](const std::string& name) {
            if (name.empty()) return use_table(nullptr);
            for (const KernelTable* t : supported_tables())
                if (name == t->name) return use_table(t);
            throw nb::value_error(("kernel set not supported on this CPU: " + name).c_str());
        },
        "name", "Use another supported kernel set ('' restores the automatic choice); for tests and benchmarks.");
    m.def(
        "isa_info",
        [] {
            nb::dict d;
            d["isa"] = std::string(current_table()->name);
            d["note"] = active_isa().note;
            std::vector<std::string> names;
            for (const KernelTable* t : supported_tables()) names.push_back(t->name);
            d["supported"] = names;
            Executor& ex = executor();
            d["threads"] = ex.threads();
            d["numa_nodes"] = ex.nodes();
            // The measured switch points by stored format, for the layout the kernels read it
            // in (the x8 copy where one is made); None: the GEMV path at every count.
            nb::dict experts, dense;
            nb::list prompt_gemv;  // formats whose prompts take the GEMV at every count
            for (int i = 0; i < FMT_COUNT; ++i) {
                const Format f = Format(i);
                if (kFormats[f].row_group != 1 || kFormats[f].float_acts) continue;
                const Format used = interleaved_format(f) == FMT_COUNT ? f : interleaved_format(f);
                if (prompt_takes_gemv(*current_table(), used)) prompt_gemv.append(kFormats[f].name);
                const int e = default_prefill_min_tokens(*current_table(), used);
                const int l = dense_prefill_min_tokens(*current_table(), used);
                experts[kFormats[f].name] = e >= kNeverPrefill ? nb::none() : nb::cast(e);
                dense[kFormats[f].name] = l >= kNeverPrefill ? nb::none() : nb::cast(l);
            }
            d["prefill_min_tokens"] = experts;
            d["dense_prefill_min_tokens"] = dense;
            d["prompt_gemv"] = prompt_gemv;
            // The GEMM on bf16 tiles for bf16 activations and every format but f32 and f16 (on_tiles).
            d["gemm_bf16"] = current_table()->gemm_panels_bf16 != nullptr;
            return d;
        },
        "The kernel set, why a better one was refused, the CPU's variants, threads, NUMA nodes, the "
        "decode/prefill switch points by stored format and where the set multiplies on bf16 tiles.");
    m.def("formats", [] {
        std::vector<std::string> v;
        for (const auto& f : kFormats) v.push_back(f.name);
        return v;
    });
    m.def(
        "dequantize",
        [](const std::string& name, nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> data,
           int64_t K, nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out) {
            int fi = 0;
            while (fi < FMT_COUNT && name != kFormats[fi].name) ++fi;
            if (fi == FMT_COUNT || kFormats[fi].row_group != 1 || kFormats[fi].scale_bytes != 0)
                throw nb::value_error(("not a format stored in rows: " + name).c_str());
            const Format fmt = Format(fi);
            const FormatInfo& f = kFormats[fmt];
            const int64_t rows = int64_t(data.shape(0));
            if (K <= 0 || K % f.block || int64_t(data.shape(1)) != K / f.block * f.block_bytes ||
                int64_t(out.shape(0)) != rows || int64_t(out.shape(1)) != K)
                throw nb::value_error("dequantize: data must be [rows, K / block * block_bytes], out [rows, K]");
            const KernelTable* t = current_table();
            const int panel = t->panel;
            const MatrixRef w{data.data(), nullptr, int64_t(data.shape(1)), 0};
            std::vector<float> dst(size_t(K * panel)), tmp(size_t(panel * (K + 16)));
            nb::gil_scoped_release release;
            for (int64_t r0 = 0; r0 < rows; r0 += panel) {
                const int n = int(std::min<int64_t>(panel, rows - r0));
                t->dequant_panel(fmt, w, r0, n, 0, int(K), dst.data(), tmp.data());
                for (int r = 0; r < n; ++r)
                    for (int64_t k = 0; k < K; ++k) out.data()[(r0 + r) * K + k] = dst[size_t(k * panel + r)];
            }
        },
        "format"_a, "data"_a, "K"_a, "out"_a,
        "Dequantize rows stored as `format` with the kernel set in use (its prefill panels), for tests.");
    m.def("self_test", [](const std::string& name) {
        for (const KernelTable* t : supported_tables())
            if (name == t->name) return self_test(t);
        throw nb::value_error(("kernel set not supported on this CPU: " + name).c_str());
    }, "Compare a kernel set with the portable one; '' when they agree.");
    m.def("num_threads", [] { return executor().threads(); });
    m.def("stay_awake", [](int us) { executor().stay_awake(us); }, "microseconds"_a,
          "Keep the pool's threads spinning, not sleeping, for this long: the caller's next call follows a gap "
          "longer than their spin (a decode loop between two steps).");
    m.def(
        "set_num_threads",
        [](int n) {
            std::lock_guard<std::mutex> lock(g_exec_mutex);
            g_requested_threads = n;
            g_exec.reset();  // the next call builds a pool of the new size
        },
        "n", "Threads for the CPU experts (0: one per physical core). Takes effect on the next call.");
    m.def("physical_cores", [] { return detect_topology().physical_cores(); });
    m.def(
        "topology",
        [](const std::string& sysfs_root, std::optional<std::vector<int>> allowed) {
            const Topology t = detect_topology(sysfs_root.c_str(), allowed ? &*allowed : nullptr);
            std::vector<std::pair<int, std::vector<int>>> nodes;
            for (const auto& n : t.nodes) nodes.emplace_back(n.id, n.cpus);
            return nodes;
        },
        "sysfs_root"_a = "/sys", "allowed"_a = nb::none(),
        "[(NUMA node, [one logical CPU per physical core])] as the pool sees them.");
    m.def(
        "simulate_nodes",
        [](int n) {
            std::lock_guard<std::mutex> lock(g_exec_mutex);
            g_simulated_nodes = n;
            g_exec.reset();
        },
        "n", "Tests: regroup the cores into n NUMA nodes (0: the real topology) from the next call.");
    m.def("measure_read_bandwidth", &measure_read_bandwidth, "nbytes"_a, "passes"_a = 3,
          "Host read bandwidth (bytes/s) with the kernels' threads, best of `passes`.");

    m.def("attend_decode", &attend_decode_py, "q"_a, "k"_a, "v"_a, "length"_a, "scale"_a, "out"_a,
          "out[Hq, Dv] = softmax(scale q k^T) v over the first `length` cache positions (one query per head).");
    m.def("attend_decode_paged", &attend_decode_paged_py, "q"_a, "k_blocks"_a, "v_blocks"_a, "table"_a, "length"_a,
          "scale"_a, "out"_a,
          "attend_decode over a block-allocated cache: position s in block table[s // B], row s % B.");
    m.def("attend_decode_rows", &attend_decode_rows_py, "q"_a, "k_blocks"_a, "v_blocks"_a, "tables"_a, "lengths"_a,
          "scale"_a, "out"_a,
          "attend_decode_paged for one query per sequence of a decode step, in one pass of the threads: q [T, Hq, D], "
          "tables [T, blocks], lengths [T], out [T, Hq, Dv].");

    m.def("rms_norm", &rms_norm_py, "x"_a, "w"_a.none(), "eps"_a, "out"_a,
          "out = x / sqrt(mean(x^2) + eps) * w over the last axis, float32 (out may be x; w None: unweighted).");
    m.def(
        "silu_mul_rows",
        [](nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> gu,
           nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out) {
            if (gu.shape(0) != out.shape(0) || gu.shape(1) != 2 * out.shape(1))
                throw nb::value_error("gu must be [T, 2 I] and out [T, I]");
            silu_mul_rows(*current_table(), gu.data(), int64_t(out.shape(0)), int64_t(out.shape(1)), out.data());
        },
        "gu"_a, "out"_a, "A gated MLP's activation: out = silu(gu[:, :I]) * gu[:, I:], with the experts' silu.");
    m.def(
        "add_gated",
        [](nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out,
           nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> y, std::optional<F32Array> gate) {
            if (out.shape(0) != y.shape(0) || out.shape(1) != y.shape(1) || (gate && gate->size() != out.shape(0)))
                throw nb::value_error("out and y must be [T, n], gate [T]");
            add_gated(out.data(), y.data(), gate ? gate->data() : nullptr, int64_t(out.shape(0)), int64_t(out.shape(1)));
        },
        "out"_a, "y"_a, "gate"_a.none(), "out += y / (1 + exp(-gate)) row by row (a sigmoid-gated shared expert), or out += y.");
    m.def("mla_rope_store", &mla_rope_store_py, "q"_a, "kv"_a, "kv_norm"_a, "eps"_a, "cos"_a, "sin"_a, "pairs"_a,
          "cache_row"_a, "n_heads"_a, "rope"_a,
          "Latent attention, one token: each head's rotary part of q rotated in place; the latent normalised and the "
          "rotary key rotated, stored as the cache row.");
    nb::class_<LatentMaps>(m, "LatentMaps")
        .def_static("joined", &joined_maps, "kv_b"_a, "n_heads"_a, "nope"_a, "v"_a,
                    "A checkpoint's kv_b_proj [n_heads * (nope + v), c] in a float dtype; the caller keeps it alive.")
        .def_static("split", &split_maps, "k"_a, "v"_a, "n_heads"_a, "nope"_a, "v_dim"_a, "c"_a,
                    "A GGUF's attn_k_b [n_heads * c, nope] and attn_v_b [n_heads * v, c] as the matrices of two "
                    "DenseLinear; the caller keeps them alive.")
        .def_ro("n_heads", &LatentMaps::H)
        .def_ro("nope", &LatentMaps::nope)
        .def_ro("v", &LatentMaps::v)
        .def_ro("c", &LatentMaps::c)
        .def(
            "to_dense",
            [](const LatentMaps& maps, nb::ndarray<nb::ndim<2>, nb::c_contig, nb::device::cpu> out) {
                if (int64_t(out.shape(0)) != maps.H * (maps.nope + maps.v) || int64_t(out.shape(1)) != maps.c)
                    throw nb::value_error("out must be [n_heads * (nope + v), c]");
                const bool bf16 = is_bf16_or_bits(out.dtype());
                if (!bf16 && out.dtype() != nb::dtype<float>()) throw nb::type_error("out must be float32 or bfloat16");
                void* o = out.data();
                const KernelTable& kt = *current_table();
                Executor& exec = executor();
                nb::gil_scoped_release release;
                maps.to_dense(exec, kt, o, bf16);
            },
            "out"_a, "Split maps as kv_b_proj [n_heads * (nope + v), c] in float32 or bfloat16 (GIL released).")
        .def_prop_ro("bytes", &LatentMaps::bytes, "Stored bytes of both maps (what one token's attention reads).")
        .def_prop_ro("format", &maps_format, "The maps' format, \"k+v\" when they differ.");
    m.def("mla_attend_rows", &mla_attend_rows_py, "q"_a, "maps"_a, "cache"_a, "tables"_a, "lengths"_a, "rope"_a,
          "scale"_a, "out"_a,
          "Latent attention of each query row over its sequence's latent cache, kv_b absorbed (mla_decode.h); a row "
          "reads positions 0 .. lengths[t] - 1.");
    m.def("embed_rows", &embed_rows_py, "table"_a, "tokens"_a, "out"_a,
          "out[i] = table[tokens[i]] as float32 (table float32, float16, or bfloat16 or its uint16 bits).");
    m.def("rope_store", &rope_store_py, "qkv"_a, "n_heads"_a, "n_kv_heads"_a, "q_norm"_a.none(), "k_norm"_a.none(),
          "eps"_a, "cos"_a, "sin"_a, "pairs"_a, "k_cache"_a, "v_cache"_a, "pos"_a, "q_out"_a,
          "One token's q|k|v: per-head q/k RMSNorm, the rotary embedding at `pos`, k and v written to the cache, q to q_out.");
    m.def(
        "softmax_topk",
        [](F32Array logits, int k, bool normalize, I64Out ids, F32Out weights) {
            check_route(logits, k, ids, weights);
            softmax_topk(logits.data(), int64_t(logits.size()), k, normalize, ids.data(), weights.data());
        },
        "logits"_a, "k"_a, "normalize"_a, "ids"_a, "weights"_a, "Softmax over all experts, the top k, optionally renormalised.");
    m.def(
        "sigmoid_group_topk",
        [](F32Array logits, std::optional<F32Array> bias, int k, int n_group, int topk_group, bool normalize, float scaling,
           I64Out ids, F32Out weights) {
            check_route(logits, k, ids, weights);
            const int64_t E = int64_t(logits.size());
            if (bias && int64_t(bias->size()) != E) throw nb::value_error("bias must have one entry per expert");
            if (n_group < 1 || E % n_group || (n_group > 1 && E / n_group < 2) || topk_group < 1 || topk_group > n_group ||
                int64_t(k) > int64_t(topk_group) * (E / n_group))
                throw nb::value_error("n_group must divide the experts into groups of two or more, and topk_group of them hold k");
            sigmoid_group_topk(logits.data(), bias ? bias->data() : nullptr, E, k, n_group, topk_group, normalize, scaling,
                               ids.data(), weights.data());
        },
        "logits"_a, "bias"_a.none(), "k"_a, "n_group"_a, "topk_group"_a, "normalize"_a, "scaling"_a, "ids"_a, "weights"_a,
        "DeepSeek-V3 routing: sigmoid scores, the best groups by their two best biased scores, the top k in them.");
    m.def(
        "route",
        [](F32Array logits, int k, const std::string& route, bool normalize, std::optional<F32Array> correction_bias,
           int n_group, int topk_group, float scaling, I64Out ids, F32Out weights) {
            check_route(logits, k, ids, weights);
            const int64_t E = int64_t(logits.size());
            route_token(make_route(route, normalize, correction_bias, n_group, topk_group, scaling, E, k), logits.data(), E,
                        k, ids.data(), weights.data());
        },
        "logits"_a, "k"_a, "route"_a, "normalize"_a, "correction_bias"_a.none(), "n_group"_a, "topk_group"_a,
        "scaling"_a, "ids"_a, "weights"_a,
        "One token's choice under the route a description names (ROUTE_KINDS; the fields the chain's layers take).");
    {
        nb::list names;
        for (const RouteName& r : kRouteNames) names.append(r.name);
        m.attr("ROUTE_KINDS") = nb::tuple(names);
    }
    m.def(
        "topk_softmax",
        [](F32Array logits, int k, I64Out ids, F32Out weights) {
            check_route(logits, k, ids, weights);
            topk_softmax(logits.data(), int64_t(logits.size()), k, ids.data(), weights.data());
        },
        "logits"_a, "k"_a, "ids"_a, "weights"_a, "GPT-OSS routing: the top k logits, softmax over them.");

    nb::class_<DenseLinear>(m, "DenseLinear")
        .def("__init__",
             [](DenseLinear* self, const std::string& format, int64_t cols,
                const std::vector<std::pair<int64_t, std::vector<int64_t>>>& parts, bool interleave) {
                 new (self) DenseLinear(make_dense(format, cols, parts));
                 if (interleave) {
                     nb::gil_scoped_release release;
                     self->interleave(executor());
                 }
             },
             "format"_a, "cols"_a, "parts"_a, "interleave"_a = true,
             "interleave: copy q4_0 / iq4_nl / iq4_xs / int4_g32 / q4_k / q8_0 matrices into the row-interleaved layout (see MoELayer).")
        .def_static(
            "join",
            [](const std::vector<const DenseLinear*>& lins) {
                if (lins.empty()) throw nb::value_error("nothing to join");
                try {
                    return DenseLinear::join(lins);
                } catch (const std::invalid_argument& e) {
                    throw nb::value_error(e.what());
                }
            },
            "linears"_a,
            "One projection over the matrices of `linears` (same width, any formats; kept alive by the caller), outputs side by side.")
        .def("forward", &dense_forward, "x"_a, "out"_a, "prefill_min_tokens"_a = 0,
             "out[T, rows] = x[T, cols] W^T in float32 (GIL released). prefill_min_tokens: from how many tokens "
             "the GEMM path; 0 each part's measured switch point; -1 (prompt rows) each part's path by its format.")
        .def(
            "dequantize_rows",
            [](const DenseLinear& lin, const std::vector<int64_t>& ids,
               nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out) {
                if (int64_t(out.shape(0)) < int64_t(ids.size()) || int64_t(out.shape(1)) != lin.cols())
                    throw nb::value_error("out must have a row of the matrix's width per id");
                for (const int64_t r : ids)
                    if (r < 0 || r >= lin.rows())
                        throw nb::index_error(("row " + std::to_string(r) + " is outside the matrix").c_str());
                const KernelTable& kt = *current_table();
                float* op = out.data();
                nb::gil_scoped_release release;
                lin.dequantize_rows(kt, ids.data(), int64_t(ids.size()), op);
            },
            "ids"_a, "out"_a, "out[i] = row ids[i] in float32, dequantized as stored (an embedding lookup).")
        .def_prop_ro("format", &format_names, "The stored format, or a joined projection's formats (\"q4_kx8+q6_k\").")
        .def_prop_ro("rows", &DenseLinear::rows)
        .def_prop_ro("cols", &DenseLinear::cols)
        .def_prop_ro("bytes", &DenseLinear::bytes, "Stored bytes of the matrix (what one token reads).")
        .def_prop_ro("interleaved_bytes", &DenseLinear::copied_bytes, "Bytes of the copy it owns (row-interleaved, or as stored out of a file mapping).")
        .def_prop_ro("prefill_min_tokens",
                     [](const DenseLinear& l) {
                         int most = 0;
                         for (const DensePart& p : l.parts()) most = std::max(most, dense_prefill_min_tokens(*current_table(), p.fmt));
                         return most;
                     },
                     "Tokens from which a call takes the GEMM path for every part (the kernel set in use, the layouts).");

    using Cache4 = nb::ndarray<nb::ndim<4>, nb::c_contig, nb::device::cpu>;
    using I64Rows = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
    using I64Vec = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
    nb::class_<DecodeChain>(m, "DecodeChain")
        .def("__init__",
             [](DecodeChain* self, int64_t hidden, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                int64_t value_dim, int64_t block, int64_t k, int max_rows, int64_t latent_nope, int64_t latent_v) {
                 ChainShape s{hidden, n_heads, n_kv_heads, head_dim, value_dim, block, k};
                 s.latent = latent_v > 0;
                 s.nope = latent_nope;
                 s.v = latent_v;
                 new (self) DecodeChain(s, max_rows);
             },
             "hidden"_a, "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "value_dim"_a, "block"_a, "k"_a, "max_rows"_a,
             "latent_nope"_a = 0, "latent_v"_a = 0,
             "A chain of grouped-query layers; with latent_v > 0, of latent-attention layers (n_kv_heads 1, head_dim "
             "c + rope, value_dim c; queries of latent_nope + rope features, value heads of latent_v).")
        .def(
            "add_layer",
            [](DecodeChain& c, F32Array attn_norm, float attn_eps, const DenseLinear& qkv,
               std::optional<F32Array> qkv_bias, std::optional<F32Array> q_norm, std::optional<F32Array> k_norm,
               float qk_eps, F32Array cos, F32Array sin, bool pairs, Cache4 k_cache, Cache4 v_cache, float scale,
               const DenseLinear& o, std::optional<F32Array> o_bias, F32Array ffn_norm, float ffn_eps,
               const DenseLinear* router, std::optional<F32Array> router_bias, const std::string& route, bool normalize,
               std::optional<F32Array> correction_bias, int n_group, int topk_group, float scaling,
               const MoELayer* experts, const DenseLinear* gate_up, const DenseLinear* down,
               const DenseLinear* shared_gate) {
                const ChainShape& s = c.shape();
                if (s.latent) throw nb::value_error("a latent-attention chain takes add_latent_layer");
                if (k_cache.shape(0) != v_cache.shape(0) || int64_t(k_cache.shape(1)) != s.Hkv ||
                    int64_t(v_cache.shape(1)) != s.Hkv || int64_t(k_cache.shape(2)) != s.block ||
                    int64_t(v_cache.shape(2)) != s.block || int64_t(k_cache.shape(3)) != s.D ||
                    int64_t(v_cache.shape(3)) != s.Dv)
                    throw nb::value_error("the caches must be [n_blocks, n_kv_heads, block, head_dim / value_dim]");
                for (const auto* w : {&q_norm, &k_norm})
                    if (*w && int64_t((*w)->size()) != s.D) throw nb::value_error("q/k norm weights must have head_dim entries");
                if (qkv_bias && int64_t(qkv_bias->size()) != qkv.rows()) throw nb::value_error("qkv_bias must have qkv's rows");
                ChainLayer l{};
                l.qkv = &qkv;
                l.qkv_bias = qkv_bias ? qkv_bias->data() : nullptr;
                l.q_norm = q_norm ? q_norm->data() : nullptr;
                l.k_norm = k_norm ? k_norm->data() : nullptr;
                l.qk_eps = qk_eps;
                l.k_cache = k_cache.data();
                l.v_cache = v_cache.data();
                l.cache_type = cache_format(k_cache.dtype(), v_cache.dtype());
                l.n_blocks = int64_t(k_cache.shape(0));
                chain_common(l, s, attn_norm, attn_eps, cos, sin, pairs, scale, o, o_bias);
                chain_ffn(l, s, ffn_norm, ffn_eps, router, router_bias, route, normalize, correction_bias, n_group,
                          topk_group, scaling, experts, gate_up, down, shared_gate);
                c.add_layer(l);
            },
            "attn_norm"_a, "attn_eps"_a, "qkv"_a, "qkv_bias"_a.none(), "q_norm"_a.none(), "k_norm"_a.none(), "qk_eps"_a,
            "cos"_a, "sin"_a, "pairs"_a, "k_cache"_a, "v_cache"_a, "scale"_a, "o"_a, "o_bias"_a.none(), "ffn_norm"_a,
            "ffn_eps"_a, CHAIN_FFN_ARGS,
            "One decoder layer: grouped-query attention, then routed experts (router and experts), a gated MLP "
            "(gate_up and down: a dense layer's, or the shared experts' beside routed ones), or both. The caller "
            "keeps every argument alive as long as the chain.")
        .def(
            "add_latent_layer",
            [](DecodeChain& c, F32Array attn_norm, float attn_eps, const DenseLinear* q_a, std::optional<F32Array> q_a_norm,
               float q_a_eps, const DenseLinear& q, const DenseLinear& kv_a, F32Array kv_norm, float kv_eps,
               const LatentMaps& kv_b, F32Array cos, F32Array sin, bool pairs,
               nb::ndarray<nb::ndim<3>, nb::c_contig, nb::device::cpu> cache, float scale, const DenseLinear& o,
               std::optional<F32Array> o_bias, F32Array ffn_norm, float ffn_eps, const DenseLinear* router,
               std::optional<F32Array> router_bias, const std::string& route, bool normalize,
               std::optional<F32Array> correction_bias, int n_group, int topk_group, float scaling,
               const MoELayer* experts, const DenseLinear* gate_up, const DenseLinear* down,
               const DenseLinear* shared_gate) {
                const ChainShape& s = c.shape();
                if (!s.latent) throw nb::value_error("a grouped-query chain takes add_layer");
                if (int64_t(cache.shape(1)) != s.block || int64_t(cache.shape(2)) != s.D)
                    throw nb::value_error("the latent cache must be [n_blocks, block, c + rope]");
                if (int64_t(kv_norm.size()) != s.Dv || (q_a && (!q_a_norm || int64_t(q_a_norm->size()) != q_a->rows())))
                    throw nb::value_error("kv_norm must have c entries, q_a_norm one per q_a row");
                ChainLayer l{};
                l.qkv = &q;
                l.q_a = q_a;
                l.q_a_norm = q_a_norm ? q_a_norm->data() : nullptr;
                l.q_a_eps = q_a_eps;
                l.kv_a = &kv_a;
                l.kv_norm = kv_norm.data();
                l.kv_eps = kv_eps;
                l.maps = &kv_b;
                l.k_cache = cache.data();
                l.cache_type = cache_format(cache.dtype(), cache.dtype());
                l.n_blocks = int64_t(cache.shape(0));
                chain_common(l, s, attn_norm, attn_eps, cos, sin, pairs, scale, o, o_bias);
                chain_ffn(l, s, ffn_norm, ffn_eps, router, router_bias, route, normalize, correction_bias, n_group,
                          topk_group, scaling, experts, gate_up, down, shared_gate);
                c.add_layer(l);
            },
            "attn_norm"_a, "attn_eps"_a, "q_a"_a.none(), "q_a_norm"_a.none(), "q_a_eps"_a, "q"_a, "kv_a"_a, "kv_norm"_a,
            "kv_eps"_a, "kv_b"_a, "cos"_a, "sin"_a, "pairs"_a, "cache"_a, "scale"_a, "o"_a, "o_bias"_a.none(),
            "ffn_norm"_a, "ffn_eps"_a, CHAIN_FFN_ARGS,
            "One decoder layer with latent attention (DeepSeek, Kimi: mla_decode.h), then its feed-forward block as "
            "add_layer's. The caller keeps every argument alive as long as the chain.")
        .def(
            "run",
            [](DecodeChain& c, nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> x, I64Rows tables,
               I64Vec positions, nb::ndarray<int64_t, nb::ndim<3>, nb::c_contig, nb::device::cpu> ids_out,
               std::optional<nb::ndarray<double, nb::ndim<1>, nb::c_contig, nb::device::cpu>> seconds,
               std::optional<nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>> counts,
               std::optional<I64Vec> count_cells) {
                const int64_t T = int64_t(x.shape(0));
                if (int64_t(tables.shape(0)) != T || int64_t(positions.shape(0)) != T || int64_t(ids_out.shape(1)) != T ||
                    int64_t(ids_out.shape(0)) != c.moe_layers() || int64_t(ids_out.shape(2)) != c.shape().k)
                    throw nb::value_error("x, tables, positions and ids_out must have one row per sequence "
                                          "(ids_out: [layers with experts, T, k])");
                static_assert(CP_COUNT == 8, "the message below counts the parts");
                if (seconds && int64_t(seconds->size()) < CP_COUNT) throw nb::value_error("seconds needs 8 entries");
                if (bool(counts) != bool(count_cells) || (count_cells && int64_t(count_cells->size()) != c.moe_layers()))
                    throw nb::value_error("counts and count_cells go together, count_cells one per layer with experts");
                for (int64_t li = 0; count_cells && li < c.moe_layers(); ++li) {
                    const int64_t cell = (*count_cells)(li);
                    if (cell < 0 || cell + c.experts(li) > int64_t(counts->size()))
                        throw nb::value_error("a layer's counts lie outside the counts table");
                }
                float* xp = x.data();
                const int64_t* tp = tables.data();
                const int64_t* pp = positions.data();
                int64_t* ip = ids_out.data();
                double* sp = seconds ? seconds->data() : nullptr;
                const int64_t L = int64_t(tables.shape(1));
                const KernelTable& kt = *current_table();
                Executor& exec = executor();
                nb::gil_scoped_release release;
                c.run(exec, kt, xp, T, tp, L, pp, ip, sp);
                if (counts) {  // each layer's choices counted at count_cells[layer] + expert
                    const int64_t k = c.shape().k;
                    for (int64_t li = 0; li < c.moe_layers(); ++li)
                        for (int64_t i = 0; i < T * k; ++i) (*counts)((*count_cells)(li) + ip[li * T * k + i]) += 1;
                }
            },
            "x"_a, "tables"_a, "positions"_a, "ids_out"_a, "seconds"_a.none(), "counts"_a.none() = nb::none(),
            "count_cells"_a.none() = nb::none(),
            "Every layer of a decode step on x [T, H] in place; the experts chosen go to ids_out [layers with "
            "experts, T, k] and, given counts, are counted there (the l-th such layer's expert e at count_cells[l] "
            "+ e); seconds (if given) adds each part's time: experts, qkv, o, router, attend, small, shared, mlp.");

    nb::class_<MoELayer>(m, "MoELayer")
        .def("__init__",
             [](MoELayer* self, const std::string& format, const std::string& down_format, int64_t hidden, int64_t inter, I64Array refs,
                nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> cpu, const std::string& act,
                float alpha, float limit, I64Array biases, bool interleave) {
                 new (self) MoELayer(make_layer(format, down_format, hidden, inter, refs, cpu, act, alpha, limit, biases));
                 if (interleave) {
                     nb::gil_scoped_release release;
                     self->interleave(executor());
                 }
                 // With several NUMA nodes, keep each expert's pages on the node that computes it.
                 if (executor().nodes() > 1 && env_int("HYBRIDMOE_NUMA_BIND", 1)) self->bind_to_nodes(executor());
             },
             "format"_a, "down_format"_a, "hidden"_a, "intermediate"_a, "refs"_a, "cpu"_a, "activation"_a = "silu", "alpha"_a = 1.702f,
             "limit"_a = 7.0f, "biases"_a, "interleave"_a = true,
             "interleave: copy q4_0 / iq4_nl / iq4_xs / int4_g32 / q4_k / q8_0 experts into the row-interleaved layout the integer GEMV reads fastest "
             "(see repack.h); the source pages are released when they are a read-only file mapping.")
        .def("forward", &layer_forward, "x"_a, "topk_ids"_a, "topk_weights"_a, "out"_a, "regime"_a = 0,
             "prefill_min_tokens"_a = 0, "out[T, H] = the weighted sum over the CPU-resident experts (GIL released).")
        .def_prop_ro("format", [](const MoELayer& l) { return std::string(kFormats[l.format()].name); })
        .def_prop_ro("down_format", [](const MoELayer& l) { return std::string(kFormats[l.down_format()].name); })
        .def_prop_ro("hidden", &MoELayer::hidden)
        .def_prop_ro("intermediate", &MoELayer::inter)
        .def_prop_ro("n_experts", &MoELayer::n_experts)
        .def_prop_ro("n_cpu_experts", &MoELayer::n_cpu_experts)
        .def_prop_ro("expert_bytes", &MoELayer::expert_bytes, "Stored bytes of one expert's gate, up and down.")
        .def_prop_ro("interleaved_bytes", &MoELayer::copied_bytes, "Bytes of the copies the layer owns (row-interleaved, or as stored out of a file mapping).")
        .def_prop_ro("prefill_min_tokens", [](const MoELayer& l) { return default_prefill_min_tokens(*current_table(), l.format()); },
                     "Tokens per expert from which an expert takes the prefill regime (the kernel set in use, the layout).");
}
