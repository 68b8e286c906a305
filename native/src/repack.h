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
// host memory is not doubled.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "formats.h"

namespace hmoe {

class Executor;

// The x8 format `fmt` is copied into, or FMT_COUNT when it is read as stored.
Format interleaved_format(Format fmt);

// Bytes of the x8 copy (format xfmt) of a [rows, K] matrix (rows a multiple of 8).
int64_t interleaved_bytes(Format xfmt, int64_t rows, int64_t K);

// Copy the [rows, K] matrix `src` of format `fmt` (q4_0, int4_g32, q4_k, q8_0) into dst in its
// x8 layout; returns the MatrixRef that reads dst.
MatrixRef interleave_rows(Format fmt, const MatrixRef& src, int64_t rows, int64_t K, uint8_t* dst);

// Memory for copies: page-aligned (NUMA binding and page release work per page), freed with
// free(). From 2 MiB up it starts on a 2 MiB boundary and asks for transparent huge pages
// (MADV_HUGEPAGE, honoured where THP is "always" or "madvise"): the decode GEMVs stream
// every weight once per token, and with 4 KiB pages each page is a TLB miss, a nested page
// walk in a VM. The bandwidth probe reads memory allocated the same way, so that the two
// stay comparable (on a 2-core Zen 3 VM, THP "madvise": the probe read ~20 % faster, the
// engine decoded ~6 % faster).
struct FreeBytes {
    void operator()(uint8_t* p) const { std::free(p); }
};
using OwnedBytes = std::unique_ptr<uint8_t, FreeBytes>;
OwnedBytes allocate_pages(int64_t bytes);  // throws std::bad_alloc

// One matrix to copy: *ref (a [rows, K] matrix of `fmt`) is replaced by its x8 copy at dst.
struct InterleaveJob {
    Format fmt;
    MatrixRef* ref;
    int64_t rows, K;
    uint8_t* dst;
    int node;  // the pool node whose threads make the copy (first touch places its pages)
};

// Run the jobs on the pool's threads, then drop the sources' pages where they lie in a
// read-only file mapping (the copy replaces them: host memory holds the weights once).
void interleave_all(Executor& exec, std::vector<InterleaveJob>& jobs);

}  // namespace hmoe
