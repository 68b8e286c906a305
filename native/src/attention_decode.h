// Attention of one new token over the KV cache, on the CPU (the decode step).
//
// PyTorch's attention kernels are built for many queries; for one query per head over a
// bf16 cache they convert the cache and pay their setup per call, which on a CPU main
// device cost more than the layer's projections (measured: 2.7 ms for 32 heads over 260
// positions in bf16). Here the cache is read in place (float32, bfloat16 or float16), each
// key and value row once per group of query heads that share it (grouped-query attention), split over
// the pool's threads by KV head and run of positions (and by query heads where those are
// fewer than the threads: a short context with one KV head), the runs merged by their softmax
// maxima (as flash-decoding does).
//
// The cache is either contiguous per head or block-allocated (paged): position s of the
// sequence then lives in block blocks[s / block_size], row s % block_size. A work unit is
// the same run of positions either way, handed to the kernel as the stretches of it that are
// contiguous in memory (its part in each block), so the result is the same bits for any block
// size and table as for the contiguous cache holding the same keys and values.
#pragma once

#include <cstdint>

#include "kernel_table.h"

namespace hmoe {

class Executor;

struct DecodeAttention {
    const float* q;   // [Hq, D], fp32
    // Contiguous (blocks == nullptr): key of head h, position s at k + h * k_head + s * k_pos
    // (elements). Paged: at k + blocks[s / block_size] * k_block + h * k_head
    // + (s % block_size) * k_pos. Values alike.
    const void* k;
    const void* v;
    Format kv;  // the cache's elements: FMT_F32, FMT_BF16 or FMT_F16
    int64_t Hq, Hkv, D, Dv, S;
    int64_t k_head, k_pos, v_head, v_pos;
    float scale;
    float* out;  // [Hq, Dv], fp32
    const int64_t* blocks = nullptr;  // the sequence's block table, ceil(S / block_size) ids
    int64_t block_size = 0;
    int64_t k_block = 0, v_block = 0;
};

void attend_decode(Executor& exec, const KernelTable& kt, const DecodeAttention& a);
// Several queries (one per sequence of a decode step, each over its own cache positions;
// all with the same heads) in one pass of the pool: their units share the threads, and each
// row gets the bits it gets alone (the same units, merged in the same order).
void attend_decode_rows(Executor& exec, const KernelTable& kt, const DecodeAttention* rows, int n_rows);

}  // namespace hmoe
