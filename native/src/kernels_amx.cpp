// The AVX-512 kernel set with its prompt GEMM on AMX tiles (Sapphire Rapids and later Xeons).
//
// Everything but the prompt kernels (the GEMM on dequantized panels, the i-quants' prompt GEMV)
// is the AVX-512 set's: the decode GEMV stays an integer dot product on Q8 activations (it is
// bound by memory, not by arithmetic). A prompt is bound by arithmetic,
// and one AMX tile product (16 x 16 outputs over 32 bf16 values, `tdpbf16ps`) does the work of
// 512 fp32 FMAs: a 512 x 2048 x 2048 product on one Xeon core took 3.7 ms in bf16 tiles
// (PyTorch's oneDNN matmul, measured) against 15.5 ms for the integer GEMV here and 25 ms
// for PyTorch's fp32 one.
//
// The weights are dequantized to fp32 panels exactly as for the AVX-512 GEMM (the same
// dequant_panel), then rounded to bf16 into the tiles' pair layout; the activations are the
// engine's bf16 rows as they are, so only the weights gain a rounding: 2^-9 of each weight,
// against llama.cpp's Q8 activations (2^-8 of a block's largest value). Sums are fp32.
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

// ---- the i-quants' prompt rows: bf16 tiles on the unpacked values ---------------------------
//
// The GEMV decodes each super-block once for all of a call's tokens, but then spends about
// 18 instructions per token and 256 values on vpmaddubsw / vpdpwssd (kernels_iq.inl), and an
// expert's share of a prompt is tens of tokens. Here each row's values are unpacked once
// (the GEMV's decoders), turned into bf16 with their scales (d x scale x v, one rounding:
// 2^-9 of the value, against 2^-2 to 2^-4 steps of these formats), and the tokens' Q8
// values likewise (q x d), and `tdpbf16ps` multiplies 16 rows x 16 tokens x 32 values at a
// time, summing in fp32 over the whole row. Integer tiles on the codes were tried first:
// each row's scale per 16 or 32 values forces every tile through registers, and at 32
// tokens an expert that was no faster than the GEMV. Calls of 32 tokens or more take it
// (kPromptTilesMinTokens, kernel_table.h).

// C tiles 0-1: 16 rows x 16 tokens (fp32) for two token groups; A tile 2: 16 rows x 32 values
// (bf16), shared by both; B tiles 4-5: 16 pairs of values x 16 tokens (bf16), one a group.
void configure_bf16_rows() {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t : {0, 1, 2, 4, 5}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// out[j][i] = in[i][j] for a 16 x 16 block of 32-bit values (rows `ld` values apart).
inline void transpose16(const int32_t* in, int64_t ld_in, int32_t* out, int64_t ld_out) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(in + i * ld_in);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // r[4q + m] holds, in each 128-bit lane L, column 4L + m of rows 4q .. 4q + 3; gather the
    // lanes across the four row quads.
    for (int m = 0; m < 4; ++m) {
        const __m512i a = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x88), b = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xDD);
        const __m512i c = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x88), e = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xDD);
        t[m] = _mm512_shuffle_i32x4(a, c, 0x88);       // column m
        t[8 + m] = _mm512_shuffle_i32x4(a, c, 0xDD);   // column 8 + m
        t[4 + m] = _mm512_shuffle_i32x4(b, e, 0x88);   // column 4 + m
        t[12 + m] = _mm512_shuffle_i32x4(b, e, 0xDD);  // column 12 + m
    }
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512(out + j * ld_out, t[j]);
}

// 32 floats to 32 bf16 (round to nearest even), in order.
inline __m512i bf16x32(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

struct IqScratch {
    std::vector<int32_t> xb;   // [token group][K / 2][16]: each token's pairs of bf16 values
    std::vector<uint16_t> wb;  // [16 rows][K + 32]: the rows in bf16
};
thread_local IqScratch tls_iq;

void iq_prompt(IqUnpackFn unpack, int block_bytes, const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K,
               const Q8Row* acts, int ntok, float* out, int64_t ldo) {
    const int64_t nsb = K / 256, np = K / 2;
    const int groups = (ntok + 15) / 16;
    int32_t* xb = grow(tls_iq.xb, size_t(groups) * np * 16);
    // Rows a cache line more than K apart: at a power-of-two stride (K = 2048: 4 KiB) the 16
    // rows of an A tile fall into one L1 set and evict one another.
    const int64_t ldw = K + 32;
    uint16_t* wb = grow(tls_iq.wb, size_t(16) * ldw);
    // The tokens: q x d in bf16, 16 tokens' pairs side by side (B tiles' layout).
    for (int g = 0; g < groups; ++g) {
        alignas(64) uint16_t rows[16][32];
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
            for (int l = 0; l < 16; ++l) {
                const int t = 16 * g + l;
                if (t >= ntok) {
                    _mm512_store_si512(rows[l], _mm512_setzero_si512());
                    continue;
                }
                const __m512 d = _mm512_set1_ps(acts[t].d[k0 / 32]);
                const __m128i* q = reinterpret_cast<const __m128i*>(acts[t].q + k0);
                const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
                const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
                _mm512_store_si512(rows[l], bf16x32(lo, hi));
            }
            transpose16(reinterpret_cast<const int32_t*>(rows), 16, xb + (int64_t(g) * np + k0 / 2) * 16, 16);
        }
    }
    alignas(64) int8_t v[256];
    alignas(64) int16_t scale[16];
    alignas(64) float cbuf[2][256];  // the two C tiles: 16 rows x 16 tokens each
    configure_bf16_rows();
    const int64_t astride = ldw * 2;
    for (int64_t rb = 0; rb < nrows; rb += 16) {
        const int rows = int(std::min<int64_t>(16, nrows - rb));
        // The rows in bf16: d x scale x v per value (rows past the matrix: zeros).
        for (int r = 0; r < 16; ++r) {
            uint16_t* dst = wb + int64_t(r) * ldw;
            if (r >= rows) {
                std::memset(dst, 0, size_t(K) * 2);
                continue;
            }
            const uint8_t* row = w.row(row0 + rb + r);
            for (int64_t sb = 0; sb < nsb; ++sb) {
                float d;
                unpack(row + sb * block_bytes, v, scale, &d);
                for (int j = 0; j < 8; ++j) {  // 32 values, two scales
                    const __m128i* q = reinterpret_cast<const __m128i*>(v + 32 * j);
                    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(q))),
                                                    _mm512_set1_ps(d * scale[2 * j]));
                    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(q + 1))),
                                                    _mm512_set1_ps(d * scale[2 * j + 1]));
                    _mm512_storeu_si512(dst + sb * 256 + 32 * j, bf16x32(lo, hi));
                }
            }
        }
        // Two token groups at a time, in C tiles 0 and 1.
        for (int g = 0; g < groups; g += 2) {
            const bool two = g + 1 < groups;
            const int32_t* b0 = xb + int64_t(g) * np * 16;
            const int32_t* b1 = b0 + np * 16;
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t k = 0; k < K; k += 32) {
                _tile_loadd(2, wb + k, astride);
                _tile_loadd(4, b0 + k / 2 * 16, 64);
                _tile_dpbf16ps(0, 2, 4);
                if (two) {
                    _tile_loadd(5, b1 + k / 2 * 16, 64);
                    _tile_dpbf16ps(1, 2, 5);
                }
            }
            _tile_stored(0, cbuf[0], 64);
            if (two) _tile_stored(1, cbuf[1], 64);
            for (int gi = 0; gi < (two ? 2 : 1); ++gi)
                for (int l = 0; l < 16; ++l) {
                    const int t = 16 * (g + gi) + l;
                    if (t >= ntok) break;
                    for (int r = 0; r < rows; ++r) out[t * ldo + rb + r] = cbuf[gi][r * 16 + l];
                }
        }
    }
    _tile_release();
}

template <Format F>
void prompt_iq(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok, float* out,
               int64_t ldo) {
    iq_prompt(avx512_table()->iq_unpack[F], kFormats[F].block_bytes, w, row0, nrows, K, acts, ntok, out, ldo);
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
        t.prompt_q8[FMT_IQ4_XS] = prompt_iq<FMT_IQ4_XS>;
        t.prompt_q8[FMT_IQ2_XXS] = prompt_iq<FMT_IQ2_XXS>;
        t.prompt_q8[FMT_IQ2_XS] = prompt_iq<FMT_IQ2_XS>;
        t.prompt_q8[FMT_IQ2_S] = prompt_iq<FMT_IQ2_S>;
        t.prompt_q8[FMT_IQ3_XXS] = prompt_iq<FMT_IQ3_XXS>;
        t.prompt_q8[FMT_IQ3_S] = prompt_iq<FMT_IQ3_S>;
        t.prompt_q8[FMT_IQ1_S] = prompt_iq<FMT_IQ1_S>;
        t.prompt_q8[FMT_IQ1_M] = prompt_iq<FMT_IQ1_M>;
        return t;
    }();
    return &table;
}

}  // namespace hmoe
