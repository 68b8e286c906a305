// The AVX-512 kernel set with its prompt GEMM on AMX tiles (Sapphire Rapids and later Xeons).
//
// Everything but the GEMM on dequantized panels is the AVX-512 set's: the GEMVs stay integer
// dot products on Q8 activations (a decode step's are bound by memory, not by arithmetic; the
// many-token forms that serve prompts of the x8 formats and the i-quants were as fast or
// faster than tiles on unpacked values, which this set had for the i-quants until the GEMVs
// caught up: one MoE layer's 512-token prompt, one Xeon core, IQ2_XXS 251 ms on tiles against
// 195 ms, IQ4_XS 229 against 160; benchmarks/moe_prompt_regimes.py). A GEMM is bound by arithmetic,
// and one AMX tile product (16 x 16 outputs over 32 bf16 values, `tdpbf16ps`) does the work of
// 512 fp32 FMAs: a 512 x 2048 x 2048 product on one Xeon core took 3.7 ms in bf16 tiles
// (PyTorch's oneDNN matmul, measured) against 15.5 ms for the integer GEMV here and 25 ms
// for PyTorch's fp32 one.
//
// The weights are dequantized to fp32 panels exactly as for the AVX-512 GEMM (the same
// dequant_panel), then rounded to bf16 into the tiles' pair layout; the activations are the
// engine's bf16 rows as they are (a GPU run's compute dtype; a float32 model's rows never come
// here: on_tiles), so only the weights gain a rounding: 2^-9 of each weight, against
// llama.cpp's Q8 activations (2^-8 of a block's largest value). Sums are fp32.
//
// Compiled with the AMX flags in this translation unit only; dispatch.cpp offers this set
// only where the CPU has AMX-BF16 and the kernel grants this process the tile state.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "formats.h"
#include "kernel_table.h"

namespace hmoe {
namespace {

constexpr int kPanel = 32;  // the AVX-512 set's panel: 32 rows, two tiles of 16 output columns
constexpr int kTileK = 32;  // bf16 values per tile row (64 bytes)

// The tile configuration (palette 1): C tiles 0-3 (two token groups x two column halves),
// A tiles 4-5 (the two token groups), B tiles 6-7 (the two column halves).
struct alignas(64) TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

void configure(int ra, int rb) {
    TileConfig cfg{};
    cfg.palette = 1;
    const int rows[8] = {ra, ra, rb, rb, ra, rb, kTileK / 2, kTileK / 2};
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = uint8_t(rows[t]);
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

template <typename T>
T* grow(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

struct Scratch {
    std::vector<uint16_t> a, w;
};
thread_local Scratch tls;

const KernelTable* avx512_table() {
    static const KernelTable* t = kernels_avx512();
    return t;
}

// Panels of 32 k-major fp32 rows (w[p][k * 32 + j], k < kc) to the B tiles' layout: for
// each half h of the panel's columns and each pair of k, 32 bf16 (w[2kk][16h + j],
// w[2kk + 1][16h + j]) for j < 16, so that one 64-byte tile row holds the pairs `tdpbf16ps`
// multiplies; k from kc up to kc32 (a whole number of tiles) is zero.
void pack_weights(const float* w, int npanels, int kc, int kc32, uint16_t* out) {
    alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_load_si512(order);
    const int kp = kc32 / 2;
    const auto row = [&](const float* panel, int k, int h) {
        return k < kc ? _mm512_loadu_ps(panel + int64_t(k) * kPanel + 16 * h) : _mm512_setzero_ps();
    };
    for (int p = 0; p < npanels; ++p) {
        const float* src = w + int64_t(p) * kc * kPanel;
        uint16_t* dst0 = out + int64_t(2 * p) * kp * 32;
        uint16_t* dst1 = dst0 + int64_t(kp) * 32;
        for (int kk = 0; kk < kp; ++kk)
            for (int h = 0; h < 2; ++h) {
                const __m512bh both = _mm512_cvtne2ps_pbh(row(src, 2 * kk + 1, h), row(src, 2 * kk, h));
                const __m512i pairs = _mm512_permutexvar_epi16(interleave, (__m512i)both);
                _mm512_storeu_si512(reinterpret_cast<__m512i*>((h ? dst1 : dst0) + int64_t(kk) * 32), pairs);
            }
    }
}

// gemm_panels_bf16 (kernel_table.h): C[i][p * 32 + j] += sum_k a[i][k] W[p][k * 32 + j], a in
// bf16, W rounded to bf16. Token groups of 32 (two A tiles) against one panel (two B
// tiles) at a time, the four C tiles held over the whole of kc.
void gemm_panels_amx(const uint16_t* const* a, int m, const float* w, int npanels, int kc, float* c, int64_t ldc) {
    const int kc32 = (kc + kTileK - 1) / kTileK * kTileK;
    const int kp = kc32 / 2;
    uint16_t* wb = grow(tls.w, size_t(npanels) * 2 * kp * 32);
    pack_weights(w, npanels, kc, kc32, wb);
    // The tokens' rows side by side (the A tiles' stride), zeros up to a whole tile.
    uint16_t* ab = grow(tls.a, size_t(m) * kc32);
    for (int i = 0; i < m; ++i) {
        uint16_t* dst = ab + int64_t(i) * kc32;
        std::memcpy(dst, a[i], size_t(kc) * 2);
        std::memset(dst + kc, 0, size_t(kc32 - kc) * 2);
    }
    const int64_t cstride = ldc * int64_t(sizeof(float)), astride = int64_t(kc32) * 2;
    int configured = -1;
    for (int t0 = 0; t0 < m; t0 += 32) {
        const int ra = std::min(16, m - t0), rb = std::max(0, std::min(16, m - t0 - 16));
        if (configured != ra * 32 + rb) {
            configure(ra, rb);
            configured = ra * 32 + rb;
        }
        const uint16_t* a0 = ab + int64_t(t0) * kc32;
        const uint16_t* a1 = a0 + int64_t(16) * kc32;
        for (int p = 0; p < npanels; ++p) {
            float* c0 = c + int64_t(t0) * ldc + p * kPanel;
            float* c1 = c0 + 16 * ldc;
            const uint16_t* b0 = wb + int64_t(2 * p) * kp * 32;
            const uint16_t* b1 = b0 + int64_t(kp) * 32;
            _tile_loadd(0, c0, cstride);
            _tile_loadd(1, c0 + 16, cstride);
            if (rb) {
                _tile_loadd(2, c1, cstride);
                _tile_loadd(3, c1 + 16, cstride);
            }
            for (int k = 0; k < kc32; k += kTileK) {
                _tile_loadd(4, a0 + k, astride);
                _tile_loadd(6, b0 + int64_t(k) * 16, 64);
                _tile_loadd(7, b1 + int64_t(k) * 16, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (rb) {
                    _tile_loadd(5, a1 + k, astride);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c0, cstride);
            _tile_stored(1, c0 + 16, cstride);
            if (rb) {
                _tile_stored(2, c1, cstride);
                _tile_stored(3, c1 + 16, cstride);
            }
        }
    }
    _tile_release();
}

}  // namespace

bool amx_usable() {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
    // The set converts its rows with AVX512-BF16 (every AMX CPU has it; checked all the same).
    if (!amx_bf16 || !amx_tile || !__builtin_cpu_supports("avx512bf16")) return false;
    // Linux hands out the tile state (8 KiB of registers) per process, on request; without
    // it the first tile instruction kills the process. ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA.
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

const KernelTable* kernels_avx512_amx() {
    static const KernelTable table = [] {
        KernelTable t = *avx512_table();
        t.name = "avx512_amx";
        t.gemm_panels_bf16 = gemm_panels_amx;
        return t;
    }();
    return &table;
}

}  // namespace hmoe
