#include "attention_decode.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <vector>

#include "scratch.h"
#include "thread_pool.h"

namespace hmoe {
namespace {

// Positions per work unit (a run): each KV head's positions in about one run per thread
// (so as many units per thread as KV heads), within [kMinRun, kMaxRun]. Each unit starts its
// reads of the cache cold, before its prefetching gets ahead: 512 positions instead of 256
// took 1024- and 4096-position attention from 0.90 to 0.95 of the time on 2 threads (cold, in
// turn); more threads need shorter runs to all get work. At most 512 keeps a run's scores,
// keys and values (bf16, 128-wide heads: 256 KiB) in L2. The length depends on the sequence's
// length and the thread count only, not on the heads or the other rows: a head gets the same
// bits whichever heads and rows share the call.
constexpr int64_t kMinRun = 64, kMaxRun = 512;

int64_t run_length(int64_t positions, int threads) {
    const int64_t even = (positions + threads - 1) / threads;
    return std::clamp((even + kMinRun - 1) / kMinRun * kMinRun, kMinRun, kMaxRun);
}

// Query heads per work unit when a call has fewer (KV head, run) pairs than threads: at
// short contexts with few KV heads (latent attention has one) one thread did all the work
// while the others waited. The group is then shared out in parts of whole multiples of the
// scores kernels' four heads. A head's arithmetic does not depend on which heads share its
// unit (the kernels' sums are per head), so the bits are the same split or not. (Latent
// attention of 16 heads over 64 positions, 2 cores, in turn in one process: 49.7 -> 41.1 us
// a call, with its two projections.)
constexpr int kPartHeads = 4;

// One row (one sequence's query) of a call: its slots are its KV heads x runs, each holding
// the group's partial results; its work units are its slots x the call's parts of the group.
struct Row {
    const DecodeAttention* a;
    int64_t run;         // positions per unit
    int64_t runs;        // per KV head
    int64_t first_slot;  // of the call's slots
    size_t q_at;         // offset of its scaled queries in Call::q
    size_t e_at;         // offset of its slots' softmax terms in Call::e (group x run a slot)
};

// Two phases: the scores (and their exponentials against each run's maximum), then, the runs'
// maxima and sums merged per head, the values weighted by the normalised softmax. Over an fp16
// cache (a GGUF's on the CPU) the queries and those weights are rounded to fp16 first
// (attention_rounded): llama.cpp's CPU attention multiplies its fp16 cache with the query and
// the weights converted to fp16 (its matrix product converts the second operand to the first's
// type), and in float32 the decode steps' attention sat 6-9e-4 of its size from llama.cpp's on
// a trained model, each layer; its greedy tokens left llama.cpp's at margins above 0.01.
//
// A call's buffers are kept between calls (one call at a time: g_mutex), grown when a call needs
// more: new vectors were zero-filled every call, which at a prompt's size (512 rows of 32 heads:
// ~25 MB of queries and partial sums a layer) meant fresh pages, faulted in and cleared by the
// kernel, then cleared again.
struct Scratch {
    std::vector<float> q;      // scaled queries
    std::vector<float> e;      // softmax terms, then weights, per slot [group, run]
    std::vector<float> m, l, w;  // per slot: [group] each (w: e's factor to the normalised weight)
    std::vector<float> acc;    // per slot: [group * Dv]
};
std::mutex g_mutex;  // the scratch of one call
Scratch g_scratch;

struct Call {
    const KernelTable* kt;
    int group;
    int part_heads = 0, parts = 1;  // query heads per unit, units per slot
    std::vector<Row> rows;
    int64_t slots = 0, units = 0;
    float *q = nullptr, *e = nullptr, *m = nullptr, *l = nullptr, *w = nullptr, *acc = nullptr;  // g_scratch's
    std::atomic<int64_t> next{0};
};

// The work of unit u: its row, KV head, run of positions and query heads.
struct UnitWork {
    const Row* row;
    int64_t h, s0, n, slot;  // slot: of the part's first head, in units of heads
    int g0, heads;
    int n_segs;
    KvSegment segs[kMaxRun];  // the run's stretches contiguous in memory (one per block touched)
};

void unit_work(const Call& c, int64_t u, UnitWork& w) {
    size_t r = 0;
    while (r + 1 < c.rows.size() && c.rows[r + 1].first_slot * c.parts <= u) ++r;
    const Row& row = c.rows[r];
    const DecodeAttention& a = *row.a;
    const size_t esz = cache_elem_bytes(a.kv);
    const auto* k = static_cast<const uint8_t*>(a.k);
    const auto* v = static_cast<const uint8_t*>(a.v);
    const int64_t ru = u - row.first_slot * c.parts, part = ru % c.parts, at = ru / c.parts;  // at: the row's slot
    w.row = &row;
    w.h = at / row.runs;
    w.s0 = (at % row.runs) * row.run;
    w.n = std::min(row.run, a.S - w.s0);
    w.g0 = int(part) * c.part_heads;
    w.heads = std::min(c.part_heads, c.group - w.g0);
    w.slot = (row.first_slot + at) * c.group + w.g0;
    w.n_segs = 0;
    for (int64_t s = w.s0; s < w.s0 + w.n;) {
        int64_t len = w.s0 + w.n - s, k_off = w.h * a.k_head + s * a.k_pos, v_off = w.h * a.v_head + s * a.v_pos;
        if (a.blocks) {
            const int64_t block = a.blocks[s / a.block_size], pos = s % a.block_size;
            len = std::min(len, a.block_size - pos);
            k_off = block * a.k_block + w.h * a.k_head + pos * a.k_pos;
            v_off = block * a.v_block + w.h * a.v_head + pos * a.v_pos;
        }
        w.segs[w.n_segs++] = {k + size_t(k_off) * esz, v + size_t(v_off) * esz, len};
        s += len;
    }
}

// The unit's softmax terms: group x run floats a slot, from the row's e_at on.
float* unit_terms(Call& c, const UnitWork& w) {
    const int64_t at = w.slot / c.group - w.row->first_slot;
    return c.e + w.row->e_at + size_t((at * c.group + w.g0) * w.row->run);
}

// The call's units taken in turn by this thread: fn(its work, its row's attention).
template <class Fn>
void each_unit(Call& c, Fn fn) {
    UnitWork w;
    for (int64_t u; (u = c.next.fetch_add(1, std::memory_order_relaxed)) < c.units;) {
        unit_work(c, u, w);
        fn(w, *w.row->a);
    }
}

void phase_scores(void* ctx, int, int) {
    Call& c = *static_cast<Call*>(ctx);
    each_unit(c, [&c](const UnitWork& w, const DecodeAttention& a) {
        c.kt->attend_scores(c.q + w.row->q_at + (w.h * c.group + w.g0) * a.D, w.heads, a.D, w.segs, w.n_segs, a.kv,
                            a.k_pos, a.v_pos, w.n, unit_terms(c, w), w.row->run, c.m + w.slot, c.l + w.slot);
    });
}

void phase_values(void* ctx, int, int) {
    Call& c = *static_cast<Call*>(ctx);
    each_unit(c, [&c](const UnitWork& w, const DecodeAttention& a) {
        c.kt->attend_values(unit_terms(c, w), c.w + w.slot, w.heads, w.row->run, a.Dv, w.segs, w.n_segs, a.kv,
                            a.v_pos, w.n, c.acc + w.slot * a.Dv);
    });
}

void run_phase(Executor& exec, Call& c, void (*phase)(void*, int, int)) {
    c.next.store(0, std::memory_order_relaxed);
    if (c.units == 1)
        phase(&c, 0, 0);  // one unit: not worth waking the pool
    else
        exec.run(phase, &c);
}

}  // namespace

void attend_decode_rows(Executor& exec, const KernelTable& kt, const DecodeAttention* rows, int n_rows) {
    if (n_rows <= 0) return;
    std::lock_guard<std::mutex> lock(g_mutex);
    Call c;
    c.kt = &kt;
    c.group = int(rows[0].Hq / rows[0].Hkv);
    size_t q_size = 0, e_size = 0;
    for (int i = 0; i < n_rows; ++i) {
        const DecodeAttention& a = rows[i];
        const int64_t run = run_length(a.S, exec.threads()), runs = (a.S + run - 1) / run;
        c.rows.push_back({&a, run, runs, c.slots, q_size, e_size});
        c.slots += a.Hkv * runs;
        q_size += size_t(a.Hq * a.D);
        e_size += size_t(a.Hkv * runs * c.group * run);
    }
    c.part_heads = c.group;
    if (c.slots < exec.threads() && c.group > kPartHeads) {
        const int64_t want = std::min<int64_t>((exec.threads() + c.slots - 1) / c.slots, (c.group + kPartHeads - 1) / kPartHeads);
        const int64_t per = (c.group + want - 1) / want;
        c.part_heads = int((per + kPartHeads - 1) / kPartHeads * kPartHeads);
        c.parts = (c.group + c.part_heads - 1) / c.part_heads;
    }
    c.units = c.slots * c.parts;
    const size_t per_slot = size_t(c.slots * c.group);
    c.q = grow(g_scratch.q, q_size);
    c.e = grow(g_scratch.e, e_size);
    c.m = grow(g_scratch.m, per_slot);
    c.l = grow(g_scratch.l, per_slot);
    c.w = grow(g_scratch.w, per_slot);
    c.acc = grow(g_scratch.acc, per_slot * size_t(rows[0].Dv));
    for (const Row& row : c.rows) kt.attend_queries(row.a->q, row.a->Hq * row.a->D, row.a->scale, row.a->kv, c.q + row.q_at);
    run_phase(exec, c, phase_scores);
    // Each query head's runs merged: its maximum and the sum of its terms over all positions,
    // and each run's factor from its terms (against its own maximum) to the normalised weights.
    for (const Row& row : c.rows)
        for (int64_t h = 0; h < row.a->Hkv; ++h)
            for (int g = 0; g < c.group; ++g) {
                const int64_t u0 = row.first_slot + h * row.runs;
                float mx = -INFINITY;
                for (int64_t r = 0; r < row.runs; ++r) mx = std::max(mx, c.m[size_t((u0 + r) * c.group + g)]);
                float denom = 0.f;
                for (int64_t r = 0; r < row.runs; ++r) {
                    const size_t i = size_t((u0 + r) * c.group + g);
                    c.w[i] = std::exp(c.m[i] - mx);
                    denom += c.w[i] * c.l[i];
                }
                for (int64_t r = 0; r < row.runs; ++r) c.w[size_t((u0 + r) * c.group + g)] /= denom;
            }
    run_phase(exec, c, phase_values);
    for (const Row& row : c.rows) {
        const DecodeAttention& a = *row.a;
        for (int64_t h = 0; h < a.Hkv; ++h)
            for (int g = 0; g < c.group; ++g) {
                float* o = a.out + (h * c.group + g) * a.Dv;
                std::fill(o, o + a.Dv, 0.f);
                for (int64_t r = 0; r < row.runs; ++r) {
                    const float* acc = c.acc + ((row.first_slot + h * row.runs + r) * c.group + g) * a.Dv;
                    for (int64_t j = 0; j < a.Dv; ++j) o[j] += acc[j];
                }
            }
    }
}

void attend_decode(Executor& exec, const KernelTable& kt, const DecodeAttention& a) { attend_decode_rows(exec, kt, &a, 1); }

}  // namespace hmoe
