#include "attention_decode.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <vector>

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
};

struct Call {
    const KernelTable* kt;
    int group;
    int part_heads = 0, parts = 1;  // query heads per unit, units per slot
    std::vector<Row> rows;
    int64_t slots = 0, units = 0;
    std::vector<float> q;          // scaled queries
    std::vector<float> m, l, acc;  // per slot: [group], [group], [group * Dv]
    std::atomic<int64_t> next{0};
};

thread_local std::vector<float> tls_scores;

void phase_runs(void* ctx, int, int) {
    Call& c = *static_cast<Call*>(ctx);
    KvSegment segs[kMaxRun];  // at most one per position (blocks of one position)
    for (;;) {
        const int64_t u = c.next.fetch_add(1, std::memory_order_relaxed);
        if (u >= c.units) return;
        size_t r = 0;
        while (r + 1 < c.rows.size() && c.rows[r + 1].first_slot * c.parts <= u) ++r;
        const Row& row = c.rows[r];
        const DecodeAttention& a = *row.a;
        const size_t esz = cache_elem_bytes(a.kv);
        const auto* k = static_cast<const uint8_t*>(a.k);
        const auto* v = static_cast<const uint8_t*>(a.v);
        const int64_t ru = u - row.first_slot * c.parts, part = ru % c.parts, at = ru / c.parts;  // at: the row's slot
        const int64_t h = at / row.runs, s0 = (at % row.runs) * row.run, n = std::min(row.run, a.S - s0);
        const int g0 = int(part) * c.part_heads, heads = std::min(c.part_heads, c.group - g0);
        const int64_t slot = (row.first_slot + at) * c.group + g0;  // of the part's first head
        if (tls_scores.size() < size_t(heads * n)) tls_scores.resize(size_t(heads * n));
        // The run's stretches that are contiguous in memory: all of it, or its part in each block.
        int n_segs = 0;
        for (int64_t s = s0; s < s0 + n;) {
            int64_t len = s0 + n - s, k_off = h * a.k_head + s * a.k_pos, v_off = h * a.v_head + s * a.v_pos;
            if (a.blocks) {
                const int64_t block = a.blocks[s / a.block_size], pos = s % a.block_size;
                len = std::min(len, a.block_size - pos);
                k_off = block * a.k_block + h * a.k_head + pos * a.k_pos;
                v_off = block * a.v_block + h * a.v_head + pos * a.v_pos;
            }
            segs[n_segs++] = {k + size_t(k_off) * esz, v + size_t(v_off) * esz, len};
            s += len;
        }
        c.kt->attend_run(c.q.data() + row.q_at + (h * c.group + g0) * a.D, heads, a.D, a.Dv, segs, n_segs, a.kv,
                         a.k_pos, a.v_pos, n, tls_scores.data(), c.m.data() + slot, c.l.data() + slot,
                         c.acc.data() + slot * a.Dv);
    }
}

std::mutex g_mutex;  // the scratch of one call

}  // namespace

void attend_decode_rows(Executor& exec, const KernelTable& kt, const DecodeAttention* rows, int n_rows) {
    if (n_rows <= 0) return;
    std::lock_guard<std::mutex> lock(g_mutex);
    Call c;
    c.kt = &kt;
    c.group = int(rows[0].Hq / rows[0].Hkv);
    size_t q_size = 0;
    for (int i = 0; i < n_rows; ++i) {
        const DecodeAttention& a = rows[i];
        const int64_t run = run_length(a.S, exec.threads()), runs = (a.S + run - 1) / run;
        c.rows.push_back({&a, run, runs, c.slots, q_size});
        c.slots += a.Hkv * runs;
        q_size += size_t(a.Hq * a.D);
    }
    c.part_heads = c.group;
    if (c.slots < exec.threads() && c.group > kPartHeads) {
        const int64_t want = std::min<int64_t>((exec.threads() + c.slots - 1) / c.slots, (c.group + kPartHeads - 1) / kPartHeads);
        const int64_t per = (c.group + want - 1) / want;
        c.part_heads = int((per + kPartHeads - 1) / kPartHeads * kPartHeads);
        c.parts = (c.group + c.part_heads - 1) / c.part_heads;
    }
    c.units = c.slots * c.parts;
    c.q.resize(q_size);
    for (const Row& row : c.rows)
        for (int64_t i = 0; i < row.a->Hq * row.a->D; ++i) c.q[row.q_at + size_t(i)] = row.a->q[i] * row.a->scale;
    c.m.resize(size_t(c.slots * c.group));
    c.l.resize(size_t(c.slots * c.group));
    c.acc.resize(size_t(c.slots * c.group * rows[0].Dv));
    if (c.units == 1) {
        phase_runs(&c, 0, 0);  // one unit: not worth waking the pool
    } else {
        exec.run(phase_runs, &c);
    }
    // Merge the runs of each query head: rescale each by e^(m_run - max).
    for (const Row& row : c.rows) {
        const DecodeAttention& a = *row.a;
        for (int64_t h = 0; h < a.Hkv; ++h)
            for (int g = 0; g < c.group; ++g) {
                const int64_t u0 = row.first_slot + h * row.runs;
                float mx = -INFINITY;
                for (int64_t r = 0; r < row.runs; ++r) mx = std::max(mx, c.m[size_t((u0 + r) * c.group + g)]);
                float* o = a.out + (h * c.group + g) * a.Dv;
                std::fill(o, o + a.Dv, 0.f);
                float denom = 0.f;
                for (int64_t r = 0; r < row.runs; ++r) {
                    const int64_t u = u0 + r;
                    const float w = std::exp(c.m[size_t(u * c.group + g)] - mx);
                    denom += w * c.l[size_t(u * c.group + g)];
                    const float* acc = c.acc.data() + (u * c.group + g) * a.Dv;
                    for (int64_t j = 0; j < a.Dv; ++j) o[j] += w * acc[j];
                }
                const float inv = 1.f / denom;
                for (int64_t j = 0; j < a.Dv; ++j) o[j] *= inv;
            }
    }
}

void attend_decode(Executor& exec, const KernelTable& kt, const DecodeAttention& a) { attend_decode_rows(exec, kt, &a, 1); }

}  // namespace hmoe
