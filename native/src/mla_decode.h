// Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) of one new token per sequence over
// the latent cache, on the CPU: the decode step's form, with kv_b_proj absorbed.
//
// A cache row is [latent (c) | rotary key (rope)], shared by all heads. Per head h, with
// W_UK[h] [nope, c] and W_UV[h] [v, c] the two parts of kv_b_proj's rows for that head:
//   q_latent = W_UK[h]^T q_nope,  scores_s = scale (q_latent . latent_s + q_rope . key_s),
//   out[h] = W_UV[h] (sum_s softmax(scores)_s latent_s).
// So attention is one KV head of width c + rope (values: its first c columns) read once for
// all query heads, by the grouped-query kernel (attention_decode.h); nothing per cached
// token is expanded. PyTorch ran this as some fifteen ops a layer, 2.6 ms a layer on a
// 16-head model on two cores (measured), more than the layer's experts.
#pragma once

#include <cstdint>

#include "formats.h"
#include "kernel_table.h"

namespace hmoe {

class Executor;

// kv_b's per-head maps of the latent, as the model file stores them (read in place):
// - joined, a checkpoint's kv_b_proj [H * (nope + v), c] in a float format: per head nope
//   rows of W_UK, then v rows of W_UV;
// - split, a GGUF's attn_k_b [H * c, nope] (W_UK[h] transposed, which the absorbed form
//   reads as rows) and attn_v_b [H * v, c] (W_UV[h]), each in any format the GEMVs read, the
//   row-interleaved copies included (a dense projection's: q4_0x8 reads the 128-long key rows
//   eight at a time): a Q4_0 file's decode reads them at 4.5 bits a weight instead of widened
//   to 16 (DeepSeek-V3: 0.58 GB a token instead of 2.05).
struct LatentMaps {
    int64_t H, nope, v, c;
    bool split;
    Format k_fmt, v_fmt;
    MatrixRef k_map, v_map;  // joined: both the kv_b matrix

    // Checks the shapes and formats (std::invalid_argument).
    LatentMaps(int64_t H, int64_t nope, int64_t v, int64_t c, bool split, Format k_fmt, MatrixRef k_map, Format v_fmt,
               MatrixRef v_map);
    int64_t bytes() const;  // what one token's attention reads of them
    // Split maps as kv_b_proj [H * (nope + v), c] in float32 or bf16 (the expanded form's, for
    // a long prompt), dequantized by the kernels on the pool's threads, a head at a time.
    void to_dense(Executor& exec, const KernelTable& kt, void* out, bool bf16) const;
};

struct MlaDecode {
    int64_t H, nope, rope, v, c;
    const LatentMaps* maps;
    const void* cache; // [n_blocks, block, c + rope]
    Format cache_type;  // FMT_F32, FMT_BF16 or FMT_F16
    int64_t block;
    float scale;
};

// q [T, H * (nope + rope)] (rotary parts rotated), each row over positions 0 .. lengths[t]-1
// of its block table (tables [T, table_len]) -> out [T, H * v].
void mla_attend_rows(Executor& exec, const KernelTable& kt, const MlaDecode& m, const float* q, int64_t T,
                     const int64_t* tables, int64_t table_len, const int64_t* lengths, float* out);

}  // namespace hmoe
