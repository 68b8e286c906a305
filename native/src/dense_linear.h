// One dense projection y = x W^T read from the stored matrix in place: the attention
// projections, shared experts, dense MLPs and the LM head when the main device is the CPU.
//
// They are read in full for every token, so on the CPU they are as bandwidth-bound as the
// routed experts: the same kernels serve them (Q8 activations and integer dot products for
// few tokens; dequantized panels and an fp32 GEMM for many), with the rows split across
// the pool's threads. Nothing is copied or converted at load: a 4-bit projection stays
// 4-bit in memory, where a dequantized copy would be four times larger and slower to read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "formats.h"
#include "kernel_table.h"
#include "repack.h"

namespace hmoe {

class Executor;

// One stored matrix of a projection; several (the query, key and value projections, or a
// gate and an up projection) can be computed in one call, their outputs side by side, so
// that the activations are converted once and the pool is woken once, also when they are
// stored in different formats (llama.cpp's K-quant mixes keep v in Q6_K beside a Q4_K q and k).
struct DensePart {
    Format fmt;
    MatrixRef w;
    int64_t rows;
};

class DenseLinear {
public:
    DenseLinear(int64_t cols, std::vector<DensePart> parts);
    DenseLinear(DenseLinear&&) = default;
    DenseLinear(const DenseLinear&) = delete;  // it may own a copy of its matrices

    // q4_0 / iq4_nl / iq4_xs / int4_g32 / q4_k / q8_0 matrices (every part's rows a multiple of 8): replace them by one
    // row-interleaved copy the projection owns (repack.h), made on the pool's threads.
    void interleave(Executor& exec);
    int64_t copied_bytes() const { return owned_bytes_; }

    // One projection computing `parts` (same width, any formats) together, outputs side by
    // side; it reads their matrices, which must outlive it.
    static DenseLinear join(const std::vector<const DenseLinear*>& parts);

    // x [T, cols] (fp32, or bf16 when x_bf16) -> out [T, rows] fp32 (overwritten; the parts'
    // rows one after the other). Up to prefill_min_tokens - 1 tokens take the GEMV path, more
    // the GEMM path; prefill_min_tokens 0: each part's measured switch point
    // (dense_prefill_min_tokens), so that a joined part computes what it computes alone;
    // kPromptRows: each part's path by its format alone, at any count (prompt_takes_gemv), so
    // that a prompt computes the same numbers however it was split into chunks.
    void forward(Executor& exec, const KernelTable& kt, const void* x, bool x_bf16, int64_t T, float* out,
                 int prefill_min_tokens) const;

    // out[i] = row ids[i] of the matrix (the parts' rows one after the other) in fp32, each
    // dequantized as stored: an embedding lookup on the table's blocks. ids must be rows.
    void dequantize_rows(const KernelTable& kt, const int64_t* ids, int64_t n, float* out) const;

    const std::vector<DensePart>& parts() const { return parts_; }
    int64_t rows() const { return rows_; }
    int64_t cols() const { return cols_; }
    int64_t bytes() const;  // stored bytes: what one token reads

private:
    int64_t rows_, cols_;
    std::vector<DensePart> parts_;
    OwnedBytes owned_;
    int64_t owned_bytes_ = 0;
};

// Token count from which a dense projection of `fmt` takes the GEMM path (measured, see the .cpp).
int dense_prefill_min_tokens(const KernelTable& kt, Format fmt);
constexpr int kPromptRows = -1;

// The formats of a projection's parts by name, "+" between different ones ("q4_kx8+q6_k").
std::string format_names(const DenseLinear& lin);

}  // namespace hmoe
