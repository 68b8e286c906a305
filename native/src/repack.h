// Row-interleaved copies of 4-bit and q8_0 matrices, made once at load (the x8 layouts of formats.h).
//
// Why copy at all, when everything else is read in place: a GEMV over one row at a time
// ends every block with a horizontal sum (a tree of vphaddd) and gathers its scales from
// 18-byte strides; with AVX2 that is more work per byte than a core can do while it streams
// its share of the memory bandwidth (measured on a Zen 3 core: q4_0 13 GB/s from L2, the
// core's DRAM share ~10). With eight rows interleaved four bytes at a time, a vector lane is
// a row: no horizontal sums, the eight scales are one load, and the same core runs 29-33 GB/s
// from L2 (q4_k: 24 against 12), i.e. memory-bound again. The same integer path, four tokens
// per pass over the weights, then also beats dequantizing into fp32 panels for a prompt
// (moe_layer.cpp and dense_linear.cpp have the tables). The copy has the stored size (q4_k:
// +2.8 %, its scales unpacked); the source pages are released after it (interleave_all), so
// host memory is not doubled. Formats without an x8 layout (q6_k, q5_k, f16, ...) are copied
// out of a file mapping as stored, for the huge pages of allocate_pages alone.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "formats.h"
#include "kernel_table.h"

namespace hmoe {

class Executor;
class ReadOnlyFileMappings;

// The x8 format `fmt` is copied into, or FMT_COUNT when it has none.
Format interleaved_format(Format fmt);

// Whether a prompt's rows take the GEMV path (the experts' decode regime) on a matrix stored
// as `fmt`, at any count: for the formats with an x8 layout, whose integer GEMV is the faster
// at every count, in that layout or as stored (rows not in groups of 8 stay so), so that a
// matrix computes the same whichever way it was sliced; and for the formats of
// gemv_at_every_count (formats.h): q2_k and q3_k, whose dequantizing costs the most bit work
// per weight (2-core Zen 4, AVX-512: a 4096 x 2048
// matrix's GEMV 2.0-2.5x faster than its GEMM at 16-32 tokens, 1.2x at 512; one expert 9x at
// 4 tokens, 1.4x at 64; the mid-size Qwen3 model in llama.cpp's Q2_K mix, prompts of 64 and
// 512 tokens 1.46x and 1.20x faster; q5_k/q6_k gained under 6 % there and lost on Zen 3's
// AVX2, so they stay), and q4_1/q5_1/iq4_nl/iq4_xs and the other i-quants (iq_prompt_gemv,
// formats.h). On kernels named "scalar" (portable), whose GEMM is the faster
// from one token, never.
bool prompt_takes_gemv(const KernelTable& kt, Format fmt);

// The layout a [rows, K] matrix of `fmt` is copied into at load: its x8 layout (rows in whole
// groups of 8), else, where `in_file` (its pages lie in a read-only file mapping, which
// the copy then releases), `fmt` itself row for row (a single array: the copy buys the huge
// pages of allocate_pages); else FMT_COUNT, read where it lies (a copy of memory the
// process holds anyway would double it; the split-scale formats).
Format copied_format(Format fmt, int64_t rows, bool in_file);

// Bytes of the copy (format xfmt, from copied_format) of a [rows, K] matrix.
int64_t interleaved_bytes(Format xfmt, int64_t rows, int64_t K);

// Copy the [rows, K] matrix `src` of format `fmt` into dst in layout `to` (from copied_format:
// fmt's x8 layout, rows a multiple of 8, or fmt itself); returns the MatrixRef that reads dst.
MatrixRef interleave_rows(Format fmt, Format to, const MatrixRef& src, int64_t rows, int64_t K, uint8_t* dst);

// Memory for copies: a mapping of its own (page-aligned, so NUMA binding and page release
// work per page), never touched before it is asked for transparent huge pages. From 2 MiB up
// it starts on a 2 MiB boundary with MADV_HUGEPAGE (honoured where THP is "always" or
// "madvise"): the decode GEMVs stream every weight once per token, and with 4 KiB pages each
// page is a TLB miss, a nested page walk in a VM. Not malloc: glibc serves large blocks from
// memory freed earlier (its mmap threshold grows as large blocks are freed), whose pages were
// already faulted in at 4 KiB and stay so. The bandwidth probe reads memory allocated the same
// way, so that the two stay comparable (on a 2-core Zen 3 VM, THP "madvise": the probe read
// ~20 % faster, the engine decoded ~6 % faster; on a 2-core Xeon VM a cold q4_0 GEMV read
// 11 GB/s a core from 4 KiB pages and 16 GB/s from huge pages).
struct UnmapBytes {
    size_t size = 0;
    void operator()(uint8_t* p) const;
};
using OwnedBytes = std::unique_ptr<uint8_t, UnmapBytes>;
OwnedBytes allocate_pages(int64_t bytes);  // throws std::bad_alloc

// One matrix to copy: *ref (a [rows, K] matrix of `fmt`) is replaced by its copy in layout
// `to` at dst.
struct InterleaveJob {
    Format fmt, to;
    MatrixRef* ref;
    int64_t rows, K;
    uint8_t* dst;
    int node;  // the pool node whose threads make the copy (first touch places its pages)
};

// Run the jobs on the pool's threads, then drop the sources' pages where they lie in a
// read-only file mapping (the copy replaces them: host memory holds the weights once).
// `files`: the process's read-only file mappings, as the caller read them to choose the layouts.
void interleave_all(Executor& exec, std::vector<InterleaveJob>& jobs, const ReadOnlyFileMappings& files);

}  // namespace hmoe
