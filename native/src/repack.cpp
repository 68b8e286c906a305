#include "repack.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>

#include "dispatch.h"
#include "thread_pool.h"
#include "topology.h"

namespace hmoe {

Format interleaved_format(Format fmt) {
    if (fmt == FMT_Q4_0) return FMT_Q4_0_X8;
    if (fmt == FMT_INT4_G32) return FMT_INT4_X8;
    if (fmt == FMT_Q4_K) return FMT_Q4_K_X8;
    if (fmt == FMT_Q8_0) return FMT_Q8_0_X8;
    if (fmt == FMT_IQ4_NL) return FMT_IQ4_NL_X8;
    if (fmt == FMT_IQ4_XS) return FMT_IQ4_XS_X8;
    return FMT_COUNT;
}

bool prompt_takes_gemv(const KernelTable& kt, Format fmt) {
    if (std::strcmp(kt.name, "scalar") == 0) return false;
    return kFormats[fmt].row_group == 8 || interleaved_format(fmt) != FMT_COUNT || gemv_at_every_count(fmt) ||
           iq_prompt_gemv(fmt);
}

Format copied_format(Format fmt, int64_t rows, bool in_file) {
    const Format x8 = interleaved_format(fmt);
    if (x8 != FMT_COUNT && rows % 8 == 0) return x8;
    return in_file && kFormats[fmt].scale_bytes == 0 ? fmt : FMT_COUNT;
}

int64_t interleaved_bytes(Format xfmt, int64_t rows, int64_t K) {
    if (kFormats[xfmt].row_group == 1) return rows * (K / kFormats[xfmt].block) * kFormats[xfmt].block_bytes;
    if (xfmt == FMT_Q4_K_X8) return rows / 8 * (K / 256) * kQ4KX8Bytes;
    if (xfmt == FMT_Q8_0_X8) return rows / 8 * (K / 32) * kQ8X8BlockBytes;
    if (xfmt == FMT_IQ4_XS_X8) return rows / 8 * (K / 256) * kIq4XsX8Bytes;
    return rows / 8 * (K / 32) * kX8BlockBytes;
}

namespace {

// The loop every x8 copy shares: for each group of eight rows and each of its `blocks` blocks
// (32 or 256 columns), copy(o, lane, r, b) writes row r = 8g + lane's share of block b into
// the group's `block_bytes` at o.
template <typename Copy>
MatrixRef interleave_groups(int64_t rows, int64_t blocks, int block_bytes, uint8_t* dst, Copy copy) {
    for (int64_t g = 0; g < rows / 8; ++g)
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t* o = dst + (g * blocks + b) * block_bytes;
            for (int lane = 0; lane < 8; ++lane) copy(o, lane, 8 * g + lane, b);
        }
    return MatrixRef{dst, nullptr, blocks * block_bytes, 0};
}

MatrixRef interleave_q4k(const MatrixRef& src, int64_t rows, int64_t K, uint8_t* dst) {
    return interleave_groups(rows, K / 256, kQ4KX8Bytes, dst, [&](uint8_t* o, int lane, int64_t r, int64_t sb) {
        const uint8_t* blk = src.row(r) + sb * 144;
        std::memcpy(o + 2 * lane, blk, 2);           // d
        std::memcpy(o + 16 + 2 * lane, blk + 2, 2);  // dmin
        uint8_t sc[8], mn[8];
        k_scales_mins(blk + 4, sc, mn);
        for (int j = 0; j < 8; ++j) {
            o[q4kx8_scale_at(lane, j)] = sc[j];
            o[q4kx8_min_at(lane, j)] = mn[j];
        }
        for (int c = 0; c < 4; ++c)
            for (int v = 0; v < 8; ++v)  // four bytes of a row lie together
                std::memcpy(o + q4kx8_code_at(lane, c, 4 * v), blk + 16 + 32 * c + 4 * v, 4);
    });
}

MatrixRef interleave_q8(const MatrixRef& src, int64_t rows, int64_t K, uint8_t* dst) {
    return interleave_groups(rows, K / 32, kQ8X8BlockBytes, dst, [&](uint8_t* o, int lane, int64_t r, int64_t b) {
        const uint8_t* blk = src.row(r) + b * 34;
        std::memcpy(o + 2 * lane, blk, 2);
        for (int c = 0; c < 8; ++c) std::memcpy(o + x8_code_at(lane, 4 * c), blk + 2 + 4 * c, 4);
    });
}

MatrixRef interleave_iq4xs(const MatrixRef& src, int64_t rows, int64_t K, uint8_t* dst) {
    return interleave_groups(rows, K / 256, kIq4XsX8Bytes, dst, [&](uint8_t* o, int lane, int64_t r, int64_t sb) {
        const uint8_t* blk = src.row(r) + sb * 136;
        std::memcpy(o + 2 * lane, blk, 2);           // d
        std::memcpy(o + 16 + 2 * lane, blk + 2, 2);  // scales_h
        std::memcpy(o + 32 + 4 * lane, blk + 4, 4);  // scales_l
        for (int j = 0; j < 8; ++j)
            for (int c = 0; c < 4; ++c)  // four code bytes of a row lie together
                std::memcpy(o + iq4xsx8_code_at(lane, j, 4 * c), blk + 8 + 16 * j + 4 * c, 4);
    });
}

// q4_0, iq4_nl and int4_g32 into 144-byte blocks of 32 columns (q4_0's code order).
MatrixRef interleave_b32(Format fmt, const MatrixRef& src, int64_t rows, int64_t K, uint8_t* dst) {
    return interleave_groups(rows, K / 32, kX8BlockBytes, dst, [&](uint8_t* o, int lane, int64_t r, int64_t b) {
        uint8_t codes[16];  // q4_0 order: low nibble element j, high nibble element 16 + j
        if (fmt == FMT_Q4_0 || fmt == FMT_IQ4_NL) {  // the same block: fp16 d, 16 code bytes
            const uint8_t* blk = src.row(r) + b * 18;
            std::memcpy(o + 2 * lane, blk, 2);
            std::memcpy(codes, blk + 2, 16);
        } else {  // int4_g32: byte j holds elements 2j (low) and 2j + 1 (high)
            const uint8_t* blk = src.row(r) + b * 16;
            std::memcpy(o + 2 * lane, src.scale_row(r) + 2 * b, 2);
            auto nib = [blk](int e) { return (blk[e / 2] >> (4 * (e & 1))) & 0x0F; };
            for (int j = 0; j < 16; ++j) codes[j] = uint8_t(nib(j) | (nib(16 + j) << 4));
        }
        for (int j = 0; j < 16; ++j) o[x8_code_at(lane, j)] = codes[j];
    });
}

}  // namespace

MatrixRef interleave_rows(Format fmt, Format to, const MatrixRef& src, int64_t rows, int64_t K, uint8_t* dst) {
    if (to == fmt) {  // as stored, row for row
        const int64_t row_bytes = interleaved_bytes(fmt, 1, K);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * row_bytes, src.row(r), size_t(row_bytes));
        return MatrixRef{dst, nullptr, row_bytes, 0};
    }
    if (fmt == FMT_Q4_K) return interleave_q4k(src, rows, K, dst);
    if (fmt == FMT_Q8_0) return interleave_q8(src, rows, K, dst);
    if (fmt == FMT_IQ4_XS) return interleave_iq4xs(src, rows, K, dst);
    return interleave_b32(fmt, src, rows, K, dst);
}

void UnmapBytes::operator()(uint8_t* p) const { munmap(p, size); }

OwnedBytes allocate_pages(int64_t bytes) {
    constexpr size_t kHuge = size_t(2) << 20;
    const size_t size = (size_t(std::max<int64_t>(bytes, 1)) + 4095) / 4096 * 4096;
    // Mapped with room to start on a 2 MiB boundary, the rest given back at once.
    const size_t slack = size >= kHuge ? kHuge : 0;
    void* m = mmap(nullptr, size + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    uint8_t* base = static_cast<uint8_t*>(m);
    uint8_t* p = slack ? reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(base) + slack - 1) & ~uintptr_t(slack - 1)) : base;
    const size_t before = size_t(p - base), after = slack - before;
    if (before) munmap(base, before);
    if (after) munmap(p + size, after);
    // Only whole huge pages: the tail stays in 4 KiB pages, so no copy takes more memory
    // than it holds (a hint: where it is refused, all of it does).
    if (size >= kHuge) madvise(p, size / kHuge * kHuge, MADV_HUGEPAGE);
    return OwnedBytes(p, UnmapBytes{size});
}

namespace {

struct JobsCtx {
    std::vector<InterleaveJob>* jobs;
    std::vector<std::vector<size_t>> of_node;
    std::unique_ptr<std::atomic<size_t>[]> next;
};

void interleave_phase(void* ctx, int node, int) {
    auto& c = *static_cast<JobsCtx*>(ctx);
    const std::vector<size_t>& mine = c.of_node[size_t(node)];
    for (;;) {
        const size_t i = c.next[node].fetch_add(1, std::memory_order_relaxed);
        if (i >= mine.size()) return;
        InterleaveJob& j = (*c.jobs)[mine[i]];
        *j.ref = interleave_rows(j.fmt, j.to, *j.ref, j.rows, j.K, j.dst);
    }
}

}  // namespace

void interleave_all(Executor& exec, std::vector<InterleaveJob>& jobs, const ReadOnlyFileMappings& files) {
    if (jobs.empty()) return;
    std::vector<MatrixRef> sources;
    for (const InterleaveJob& j : jobs) sources.push_back(*j.ref);
    const int nodes = exec.nodes();
    JobsCtx c{&jobs, std::vector<std::vector<size_t>>(size_t(nodes)),
              std::unique_ptr<std::atomic<size_t>[]>(new std::atomic<size_t>[size_t(nodes)])};
    for (size_t i = 0; i < jobs.size(); ++i) c.of_node[size_t(std::min(std::max(jobs[i].node, 0), nodes - 1))].push_back(i);
    for (int n = 0; n < nodes; ++n) c.next[n].store(0);
    exec.run(interleave_phase, &c);
    for (size_t i = 0; i < jobs.size(); ++i) {
        const MatrixRef& m = sources[i];
        files.release(m.data, size_t(jobs[i].rows * m.row_stride));
        if (m.scales) files.release(m.scales, size_t(jobs[i].rows * m.scale_row_stride));
    }
}

}  // namespace hmoe
