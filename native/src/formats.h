// Stored weight formats the kernels read in place, and how one matrix of them is addressed.
//
// Every format is a sequence of blocks along the input dimension K of each row (GGUF ne[0],
// the int4 group, the MXFP4 block); a row of an [out, in] matrix is K / block blocks. The
// kernels never copy weights: a MatrixRef points into the mmap'd checkpoint (or any host
// buffer) and says how far apart rows are, so per-expert tensors, slices of a merged
// [E, out, in] tensor and the rows of an interleaved gate/up matrix all look the same.
//
// Layouts (bytes of one block, in order):
//   q8_0   d:fp16 | q[32]:int8                                   value = d * q
//   q4_0   d:fp16 | qs[16]  element j in the low nibble of qs[j], element 16+j in the
//          high nibble                                           value = d * (nib - 8)
//   q5_0   d:fp16 | qh[4] | qs[16]  as q4_0, plus bit j of the little-endian 32-bit qh as
//          the fifth bit of element j                           value = d * (q5 - 16)
//          (llama.cpp's quantizer writes it where a row is not whole K-quant super-blocks:
//          a Q4_K_M DeepSeek's attn_k_b, rows of 128)
//   q4_k   d:fp16 | dmin:fp16 | scales[12] (eight 6-bit scales + eight 6-bit mins) |
//          qs[128]: 32-byte chunk c holds sub-block 2c in the low nibbles and 2c+1 in the
//          high nibbles                                          value = d*sc*nib - dmin*m
//   q5_k   as q4_k plus qh[32] before qs: bit j of qh[l] is the fifth bit of element l of
//          sub-block j
//   q6_k   ql[128] | qh[64] | scales[16]:int8 | d:fp16; two halves of 128, quarters of 32
//          take low/high nibbles of ql[0:32]/ql[32:64] and 2-bit pairs of qh (see
//          kernels_scalar.cpp)                                    value = d*sc16*(q6 - 32)
//   q3_k   hmask[32] | qs[64] | scales[12] | d:fp16; halves and quarters as q6_k: quarter j
//          of half h takes bits 2j, 2j+1 of qs[32h .. 32h+31] and bit 4h + j of hmask as the
//          third bit; sixteen 6-bit scales (low 4 bits in bytes 0-7, two a byte, high 2 in
//          bytes 8-11)                                             value = d*(sc - 32)*(q3 - 4)
//   q2_k   scales[16] (low nibble the scale, high the min of a 16) | qs[64] | d:fp16 |
//          dmin:fp16; quarters as q3_k's low bits                  value = d*sc*q2 - dmin*m
//          (q2_k and q3_k: the low-bit experts of DeepSeek/Kimi GGUFs, Q2_K and Q3_K mixes)
//   q4_1   d:fp16 | m:fp16 | qs[16] (q4_0's nibbles)             value = d * nib + m
//   q5_1   d:fp16 | m:fp16 | qh[4] | qs[16] (q5_0's bits)        value = d * q5 + m
//   iq4_nl d:fp16 | qs[16] (q4_0's nibbles)                      value = d * kIq4nlValues[nib]
//   iq4_xs d:fp16 | scales_h:u16 | scales_l[4] | qs[128]: eight sub-blocks of 32 as iq4_nl's
//          nibbles (16 bytes each), 6-bit scale ls = low nibble of scales_l[j/2] (j odd: high)
//          | bits 2j, 2j+1 of scales_h << 4                    value = d*(ls - 32)*kIq4nlValues[nib]
//   The i-quants (grids in iq_grids.h; a grid entry is 8 values, or 4 for iq3; eight sign
//   bits sgn of 8 values flip them; kSignsIq2[i] is i with an eighth bit for even parity):
//   iq2_xxs d:fp16 | 8 x (idx[4] bytes | w:u32): per 32 values, entries kIq2xxsGrid[idx[l]],
//          signs kSignsIq2[(w >> 7l) & 127], scale s = w >> 28   value = d*(0.5+s)/4 * g * sgn
//   iq2_xs  d:fp16 | qs[32]:u16 | scales[8]: per 8 values an entry qs & 511, signs
//          kSignsIq2[qs >> 9]; per 16 a 4-bit scale (low nibble first)  value as iq2_xxs
//   iq2_s   d:fp16 | qs[32] | signs[32] | qh[8] | scales[8]: entry qs[l] | bits 2l, 2l+1 of
//          the 32's qh byte << 8 (10 bits), signs a byte per 8 values, scales as iq2_xs
//   iq3_xxs d:fp16 | qs[64] | w[8]:u32: per 32 values eight 4-value entries kIq3xxsGrid[qs],
//          signs and scale as iq2_xxs's w                      value = d*(0.5+s)/2 * g * sgn
//   iq3_s   d:fp16 | qs[64] | qh[8] | signs[32] | scales[4]: entry qs | bit (k%8) of qh[k/8]
//          << 8 for the k-th entry, signs a byte per 8, a 4-bit scale per 32
//                                                              value = d*(1+2s) * g * sgn
//   iq1_s   d:fp16 | qs[32] | qh[8]:u16: per 32 values (qh word i) entries qs | 3 bits of
//          qh << 8 (11 bits), scale (qh >> 12) & 7, delta sign bit 15
//                                                              value = d*(2s+1)*(g +- 1/8)
//   iq1_m   qs[32] | qh[16] | scales[8]: entries as iq1_s with 3 high bits per nibble of qh,
//          a delta sign per 8 values (bit 3 of the nibble), a 3-bit scale per 16; d is the
//          fp16 made of the top nibbles of the four u16 scale words   value as iq1_s
//   (Every i-quant value is an integer times a per-16 or per-32 integer scale times one
//   float per super-block; iq1's g +- 1/8 is (8g +- 1)/8: the SIMD GEMVs take them so.)
//   mxfp4  e:e8m0 | qs[16] (GGUF: element j low nibble, 16+j high) value = e2m1(nib)*2^(e-127)
//   mxfp4_hf  blocks [out, K/32, 16] + scales [out, K/32] in separate arrays; in each byte
//          the low nibble is the even element, the high nibble the odd one
//   int4_g32  compressed-tensors: int32 words [out, K/8] (element i of a word in bits
//          4i..4i+3, stored as q + 8) + bf16 scales [out, K/32] in a separate array; per
//          byte: even element low nibble, odd element high nibble
//   bf16, f16, f32  plain rows
//   q4_0x8, int4_g32x8  row-interleaved copies of q4_0 / int4_g32 made at load (repack.h):
//          rows in groups of 8; per group, K / 32 blocks of 144 bytes: the eight rows'
//          scales (fp16 for q4_0x8, bf16 for int4_g32x8), then four chunks of 32 bytes,
//          chunk c holding code bytes 4c .. 4c+3 of row r at bytes 4r .. 4r+3 (q4_0 nibble
//          order: low nibble element j, high nibble element 16 + j; codes are q + 8). A
//          32-bit lane is one row, so the decode GEMV accumulates eight rows per vector with
//          no horizontal sums. MatrixRef.data is group 0 and row_stride the bytes from one
//          group to the next; row counts and first rows are multiples of 8.
//   iq4_nlx8  iq4_nl rows interleaved as q4_0x8 (fp16 scales, the same code places); a
//          code is an index into the iq4_nl table, not q + 8
//   iq4_xsx8  iq4_xs rows interleaved the same way, per group K / 256 super-blocks of 1088
//          bytes (the stored size): d[8] fp16 | scales_h[8] u16 | scales_l[8] u32 (each row's
//          fields as stored) | eight sub-blocks of 128 bytes, sub-block j's code byte l of row
//          r at 64 + 128 j + x8_code_at(r, l) - 16 (q4_0x8's places)
//   q8_0x8  q8_0 rows interleaved the same way: per group, K / 32 blocks of 272 bytes, the
//          eight rows' fp16 scales, then eight chunks of 32 bytes, chunk c holding code
//          bytes 4c .. 4c+3 (elements, signed) of row r at bytes 4r .. 4r+3. The GEMV still
//          needs one widening multiply per chunk and token (8-bit products overflow 16-bit
//          sums), but no horizontal sums: at four tokens, the rows' way costs half its time
//          in them.
//   q4_kx8  q4_k rows interleaved the same way, per group K / 256 super-blocks of 1184
//          bytes: d[8] fp16 | dmin[8] fp16 | the 6-bit scales as bytes sc[sub-block j][row]
//          (64) | mins m[j][row] (64) | 32 chunks of 32 bytes, chunk 8c + v holding bytes
//          4v .. 4v+3 of the rows' 32-byte code chunk c (sub-block 2c in the low nibbles,
//          2c + 1 in the high ones). The scales are unpacked at the copy: 148 bytes a row
//          and super-block instead of 144 (+2.8 %), for a kernel without bit fiddling.
//
// The two "pairs interleaved in a byte" layouts (mxfp4_hf, int4_g32) are read exactly like
// their GGUF cousins (q4_0, mxfp4): the activations are quantized in a permuted order
// instead (even elements of each 32-block first, then odd ones), so the low nibbles of the
// 16 bytes meet activations 0..15 of the permuted block and the high nibbles 16..31.
// Permuting activations costs nothing per weight; permuting weights would cost a copy.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "iq_grids.h"

namespace hmoe {

enum Format : int {
    FMT_Q8_0 = 0,
    FMT_Q4_0,
    FMT_Q4_K,
    FMT_Q5_K,
    FMT_Q6_K,
    FMT_MXFP4,     // GGUF block layout
    FMT_MXFP4_HF,  // GPT-OSS safetensors layout (separate scales, interleaved nibbles)
    FMT_INT4_G32,  // compressed-tensors pack-quantized, group 32, bf16 scales
    FMT_BF16,
    FMT_F16,
    FMT_F32,
    FMT_Q4_0_X8,   // q4_0 rows interleaved in groups of 8 (made at load)
    FMT_INT4_X8,   // int4_g32 rows interleaved in groups of 8, bf16 scales (made at load)
    FMT_Q4_K_X8,   // q4_k rows interleaved in groups of 8, scales unpacked (made at load)
    FMT_Q8_0_X8,   // q8_0 rows interleaved in groups of 8 (made at load)
    FMT_Q5_0,
    FMT_Q3_K,
    FMT_Q2_K,
    FMT_Q4_1,
    FMT_Q5_1,
    FMT_IQ4_NL,
    FMT_IQ4_XS,
    FMT_IQ2_XXS,
    FMT_IQ2_XS,
    FMT_IQ2_S,
    FMT_IQ3_XXS,
    FMT_IQ3_S,
    FMT_IQ1_S,
    FMT_IQ1_M,
    FMT_IQ4_NL_X8,  // iq4_nl rows interleaved in groups of 8 (made at load)
    FMT_IQ4_XS_X8,  // iq4_xs rows interleaved in groups of 8 (made at load)
    FMT_COUNT
};

struct FormatInfo {
    const char* name;
    int block;            // weights per block along K
    int block_bytes;      // bytes per block in the data array (separate scales excluded)
    int scale_bytes;      // bytes per block in the separate scale array (0: none)
    bool deinterleave;    // activations are quantized in the permuted (even, odd) order
    bool float_acts;      // decode reads fp32 activations (float formats) instead of Q8
    int row_group = 1;    // rows stored interleaved in groups of this many (the x8 layouts)
    int act_group = 32;   // Q8 activations share one scale over this many (see below)
    bool act_sum_f16 = false;  // the activations' block sums s in fp16, as llama.cpp's Q8_1 (act_variant)
};

// Indexed by Format, each entry set under its enumerator: reordering the enum moves no entry,
// and a format without one fails to compile. Q8 activation blocks are 32 wide for every
// quantized format (K-quant super-blocks of 256 are eight of them), which is why every
// quantized K must be a multiple of 32 (of 256 for the K-quants, which the format itself
// requires). The K-quants read activations quantized with one scale per 256 (every block of a
// super-block has the same d, as llama.cpp's Q8_K): their SIMD kernels then add a
// super-block's integer dots in int32 and convert once, instead of one int-to-float and FMA
// per 32 weights (hot GEMV, the old and new kernels in one process: q6_k 1.27-1.32x, q4_kx8
// 1.09-1.12x). The portable kernels read d per block as ever.
static constexpr std::array<FormatInfo, FMT_COUNT> format_infos() {
    std::array<FormatInfo, FMT_COUNT> f{};
    f[FMT_Q8_0] = {"q8_0", 32, 34, 0, false, false};
    f[FMT_Q4_0] = {"q4_0", 32, 18, 0, false, false};
    f[FMT_Q4_K] = {"q4_k", 256, 144, 0, false, false, 1, 256};
    f[FMT_Q5_K] = {"q5_k", 256, 176, 0, false, false, 1, 256};
    f[FMT_Q6_K] = {"q6_k", 256, 210, 0, false, false, 1, 256};
    f[FMT_MXFP4] = {"mxfp4", 32, 17, 0, false, false};
    f[FMT_MXFP4_HF] = {"mxfp4_hf", 32, 16, 1, true, false};
    f[FMT_INT4_G32] = {"int4_g32", 32, 16, 2, true, false};
    f[FMT_BF16] = {"bf16", 1, 2, 0, false, true};
    f[FMT_F16] = {"f16", 1, 2, 0, false, true};
    f[FMT_F32] = {"f32", 1, 4, 0, false, true};
    f[FMT_Q4_0_X8] = {"q4_0x8", 32, 18, 0, false, false, 8};
    f[FMT_INT4_X8] = {"int4_g32x8", 32, 18, 0, false, false, 8};
    f[FMT_Q4_K_X8] = {"q4_kx8", 256, 148, 0, false, false, 8, 256};
    f[FMT_Q8_0_X8] = {"q8_0x8", 32, 34, 0, false, false, 8};
    f[FMT_Q5_0] = {"q5_0", 32, 22, 0, false, false};
    f[FMT_Q3_K] = {"q3_k", 256, 110, 0, false, false, 1, 256};
    f[FMT_Q2_K] = {"q2_k", 256, 84, 0, false, false, 1, 256};
    f[FMT_Q4_1] = {"q4_1", 32, 20, 0, false, false, 1, 32, true};
    f[FMT_Q5_1] = {"q5_1", 32, 24, 0, false, false, 1, 32, true};
    f[FMT_IQ4_NL] = {"iq4_nl", 32, 18, 0, false, false};
    f[FMT_IQ4_XS] = {"iq4_xs", 256, 136, 0, false, false, 1, 256};
    f[FMT_IQ2_XXS] = {"iq2_xxs", 256, 66, 0, false, false, 1, 256};
    f[FMT_IQ2_XS] = {"iq2_xs", 256, 74, 0, false, false, 1, 256};
    f[FMT_IQ2_S] = {"iq2_s", 256, 82, 0, false, false, 1, 256};
    f[FMT_IQ3_XXS] = {"iq3_xxs", 256, 98, 0, false, false, 1, 256};
    f[FMT_IQ3_S] = {"iq3_s", 256, 110, 0, false, false, 1, 256};
    f[FMT_IQ1_S] = {"iq1_s", 256, 50, 0, false, false, 1, 256};
    f[FMT_IQ1_M] = {"iq1_m", 256, 56, 0, false, false, 1, 256};
    f[FMT_IQ4_NL_X8] = {"iq4_nlx8", 32, 18, 0, false, false, 8};
    f[FMT_IQ4_XS_X8] = {"iq4_xsx8", 256, 136, 0, false, false, 8, 256};
    return f;
}
static constexpr std::array<FormatInfo, FMT_COUNT> kFormats = format_infos();
static constexpr bool every_format_has_info() {
    for (const FormatInfo& f : kFormats)
        if (!f.name) return false;
    return true;
}
static_assert(every_format_has_info(), "a Format without its kFormats entry");

// Formats whose prompts take the decode GEMV at every token count (see prompt_takes_gemv in
// repack.h): q2_k and q3_k, whose dequantizing costs the most bit work per weight, and q4_1,
// q5_1, iq4_nl and iq4_xs, whose 32-block GEMV reads at the bandwidth's pace (iq4_xs is
// iq4_nl's codes with a 6-bit scale per 32 under one fp16 per 256: kernels_x86.inl's
// Block32). On AVX-512 the calls of more than four tokens of q2_k, q3_k and iq4_xs are panel
// GEMMs with the GEMV's bits per token (gemm_q3k_512 / gemm_q2k_512 / gemm_b32_512). The other
// i-quants' prompts: see iq_prompt_gemv below. (iq4_nl's and iq4_xs's matrices of rows in eights are
// copied into their x8 layouts, whose GEMV serves every count: gemm_x8nl_512 past four.)
static inline bool gemv_at_every_count(Format f) {
    return f == FMT_Q2_K || f == FMT_Q3_K || f == FMT_Q4_1 || f == FMT_Q5_1 || f == FMT_IQ4_NL || f == FMT_IQ4_XS;
}

// Where the i-quants' calls (a decode step's, regime "auto") switch from the GEMV to
// dequantized panels and the GEMM: the tokens a call needs for the GEMM to be the faster,
// measured per format and kernel set (1536 x 2048 matrices, hot, one thread's CPU time, GEMV
// and GEMM in turn at 16-256 tokens; the first count measured where the GEMM was the faster,
// or 256). The GEMV unpacks a super-block once for many tokens, its signs on the weights
// (kernels_iq.inl: gemm_iq_512 on AVX-512, gemv_iq_many on AVX2), and stays level with the
// GEMM or ahead up to 256 tokens and beyond: Xeon with AVX-512, ms at 32 / 128 / 256 tokens,
// iq2_xxs: GEMV 1.45 / 5.73 / 12.1, GEMM 2.40 / 6.56 / 12.7; Ice Lake under
// HYBRIDMOE_NATIVE_ISA=avx2, 768 x 2048, ms at 32 / 256 / 1024 tokens, GEMV against GEMM:
// iq2_xxs 1.28 / 6.92 / 29.0 against 1.78 / 9.47 / 35.5, iq1_m 0.93 / 7.03 / 31.2 against
// 1.57 / 8.90 / 37.2 (iq2_s, iq3_xxs, iq1_s alike). (iq4_xs is not one of these:
// gemv_at_every_count.) 0: not one of these i-quants.
static inline int iq_prefill_min_tokens(Format f) {
    switch (f) {
        case FMT_IQ1_M:
        case FMT_IQ1_S:
        case FMT_IQ2_XXS:
        case FMT_IQ2_XS:
        case FMT_IQ2_S:
        case FMT_IQ3_XXS:
        case FMT_IQ3_S: return 256;
        default: return 0;
    }
}

// Prompts (prompt_takes_gemv) take one path per format at any count, so that a token's result
// does not depend on the tokens beside it: for these i-quants the GEMV, the faster up to 256
// tokens a call and more, where an expert's share of a prompt chunk is far fewer (32 of 512
// tokens for 8 of 128 experts) and, with a real prompt's uneven routing, a few experts' many
// more (gemv_iq_many blocks its tokens for those).
static inline bool iq_prompt_gemv(Format f) { return iq_prefill_min_tokens(f) != 0; }

// Bytes of one block of a group of eight rows in the x8 layouts: 32 columns of q4_0x8 /
// int4_g32x8 / iq4_nlx8, a 256-column super-block of q4_kx8.
constexpr int kX8BlockBytes = 144;
constexpr int kQ4KX8Bytes = 1184;
constexpr int kQ8X8BlockBytes = 272;  // q8_0x8: 32 columns
constexpr int kIq4XsX8Bytes = 1088;   // iq4_xsx8: a 256-column super-block

// Where a row's bytes lie inside one such block (the layouts above; `lane` is the row within
// its group): the copy writes and the portable dequantizer reads through these, the SIMD kernels
// read whole 32-byte chunks at the same places.
static inline int x8_code_at(int lane, int j) { return 16 + 32 * (j / 4) + 4 * lane + j % 4; }  // q4_0 code byte j
// (q8_0x8: the same places for its 32 code bytes, eight chunks instead of four)
static inline int iq4xsx8_code_at(int lane, int j, int l) { return 48 + 128 * j + x8_code_at(lane, l); }
static inline int q4kx8_scale_at(int lane, int j) { return 32 + 8 * j + lane; }                 // sc of sub-block j
static inline int q4kx8_min_at(int lane, int j) { return 96 + 8 * j + lane; }                   // m of sub-block j
static inline int q4kx8_code_at(int lane, int c, int l) {  // byte l of the row's code chunk c
    return 160 + (8 * c + l / 4) * 32 + 4 * lane + l % 4;
}

// One [rows, K] weight matrix: where row 0 starts and how far apart rows are, in bytes.
struct MatrixRef {
    const uint8_t* data = nullptr;
    const uint8_t* scales = nullptr;  // split-scale formats only (mxfp4_hf, int4_g32)
    int64_t row_stride = 0;
    int64_t scale_row_stride = 0;

    const uint8_t* row(int64_t r) const { return data + r * row_stride; }  // not for the x8 layouts
    const uint8_t* scale_row(int64_t r) const { return scales + r * scale_row_stride; }
};

// The Q8 activation variants a call may need, each as llama.cpp quantizes the activations of
// the GGUF types that read it (their vec_dot_type), so that the integer dots are its integers
// and the scales its scales: on a Q8_0 file the engine's logits were 2e-3 of their size from
// llama.cpp's after every expert block, all of it the scale's rounding (measured against its
// own intermediate tensors), which put greedy differences at margins of 0.01.
//   0 Q8_0: one scale per 32, stored in fp16 (block_q8_0's d), codes rne(x * 127 / amax);
//   1 the same in the permuted (even, odd) order of the checkpoints' int4 / mxfp4 rows;
//   2 Q8_K: one float32 scale per 256, d = 1 / (127 / amax) (block_q8_K; the K- and i-quants);
//   3 Q8_1: Q8_0 with s = fp16(d * sum(q)), d before its rounding (block_q8_1; q4_1, q5_1).
constexpr int kActVariants = 4;
static inline int act_variant(const FormatInfo& f) {
    return f.deinterleave ? 1 : f.act_group == 256 ? 2 : f.act_sum_f16 ? 3 : 0;
}
static inline bool act_variant_permuted(int v) { return v == 1; }
static inline int act_variant_group(int v) { return v == 2 ? 256 : 32; }
static inline bool act_variant_sum_f16(int v) { return v == 3; }

// Q8 activations for one token (or one intermediate row): K int8 values in blocks of 32,
// the scale d of each block (the same for all blocks of a group of the format's act_group),
// and s = d * sum(q) of each block (formats with an offset or a min subtract it once per
// block instead of once per weight).
struct Q8Row {
    const int8_t* q;
    const float* d;
    const float* s;
};

// ---- scalar conversions (internal linkage: every translation unit, whatever its -m
// flags, gets its own copy, so no AVX-512 instruction can leak into a portable path
// through a merged inline function) ----

static inline float f32_from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t bits_from_f32(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }
static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as PyTorch's conversion
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// IEEE half to float without F16C (portable path; the SIMD paths use vcvtph2ps).
static inline float fp16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1F;
    const uint32_t man = h & 0x3FF;
    if (exp == 0x1F) return f32_from_bits(sign | 0x7F800000u | (man << 13));  // inf / nan
    if (exp != 0) return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
    if (man == 0) return f32_from_bits(sign);
    // Subnormal half: value = man * 2^-24, exact in float.
    float v = float(man) * (1.0f / 16777216.0f);
    return (h & 0x8000) ? -v : v;
}

// Float to IEEE half, rounded to nearest even as PyTorch's conversion (and vcvtps2ph) round:
// beyond the largest half (65504, up to where it rounds) infinity, below the smallest normal a
// subnormal.
static inline uint16_t f32_to_fp16(float f) {
    uint32_t u = bits_from_f32(f);
    const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN stays NaN
    if (u >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // |f| >= 65520 rounds to infinity
    if (u < 0x38800000u)                                     // below 2^-14: a multiple of 2^-24
        return uint16_t(sign | uint16_t(std::nearbyint(f32_from_bits(u) * 16777216.0f)));
    return uint16_t(sign | ((u + 0xfffu + ((u >> 13) & 1u) - (112u << 23)) >> 13));
}

// One Q8 activation group's scales from its largest |x| (see act_variant): the factor `id`
// that rounds x to its codes, the scale d the kernels read (fp16-rounded for Q8_0 / Q8_1's
// groups of 32; the reciprocal of id for Q8_K's 256), and d before the rounding, which Q8_1's
// block sums take.
struct ActScale {
    float id, d, d32;
};
// A NaN or an infinity (a damaged model's rows) carries through to the scales, so that the
// outputs are not numbers either and the model is found damaged (engine/session.py).
static inline ActScale act_scale(float amax, int group) {
    if (amax == 0.f) return {0.f, 0.f, 0.f};
    const float id = 127.f / amax, d32 = amax / 127.f;
    return {id, group == 32 ? fp16_to_f32(f32_to_fp16(d32)) : 1.f / id, d32};
}
// A block's s: d * sum(q), exact for d in fp16 (11 bits by at most 12); Q8_1's fp16(d32 * sum).
static inline float block_sum(float d, float d32, int sum, bool sum_f16) {
    return sum_f16 ? fp16_to_f32(f32_to_fp16(d32 * float(sum))) : d * float(sum);
}

// The prompt GEMMs of the GGUF types multiply the activations rounded to the values of their
// Q8 codes (round_to_q8), as llama.cpp computes those types at every token count: a prompt's
// rows are then a decode step's to float rounding, and llama.cpp's. Multiplied as they came,
// the prompt's cache rows sat 2e-3 of their size from llama.cpp's and the decode steps'
// attention a few 1e-4 from it. The checkpoints' int4 and mxfp4 keep fp32 rows: their
// reference, transformers, does not round them.
static inline bool prompt_rounds_acts(Format f) {
    return !kFormats[f].float_acts && !kFormats[f].deinterleave && f != FMT_INT4_X8;
}

// The largest |x[i]| of n, NaN where one is (a maximum's comparisons pass NaN over).
static inline float abs_max(const float* x, int n) {
    float amax = 0.f;
    bool nan = false;
    for (int i = 0; i < n; ++i) {
        amax = std::max(amax, std::fabs(x[i]));
        nan |= x[i] != x[i];
    }
    return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
}

// x (K values, whole groups of `group`, natural order) as its Q8 codes times their scale.
static inline void round_to_q8(const float* x, int64_t K, int group, float* out) {
    for (int64_t g = 0; g < K; g += group) {
        const ActScale a = act_scale(abs_max(x + g, group), group);
        for (int i = 0; i < group; ++i)  // the code, rounded half to even by the adder (|x id| <= 127)
            out[g + i] = ((x[g + i] * a.id + 12582912.f) - 12582912.f) * a.d;
    }
}

// A KV cache's elements: float32, bfloat16 or float16 (kv is FMT_F32, FMT_BF16 or FMT_F16).
static inline size_t cache_elem_bytes(Format kv) { return kv == FMT_F32 ? 4 : 2; }
static inline float cache_at(const void* base, Format kv, int64_t i) {
    if (kv == FMT_F32) return static_cast<const float*>(base)[i];
    const uint16_t h = static_cast<const uint16_t*>(base)[i];
    return kv == FMT_BF16 ? bf16_to_f32(h) : fp16_to_f32(h);
}

// Decode attention over an fp16 cache (a GGUF's on the CPU) rounds its queries and softmax
// weights to fp16, as llama.cpp's CPU attention does (attention_decode.cpp); other caches
// round neither.
static inline float attention_rounded(float x, Format kv) { return kv == FMT_F16 ? fp16_to_f32(f32_to_fp16(x)) : x; }

static inline uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}
static inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// e8m0 scale for MXFP4 with the e2m1 grid doubled to integers (see kMxfp4GridX2):
// 2^(e-128), built from bits so that it is exact also for the denormal e = 0, 1.
static inline float e8m0_half(uint8_t e) {
    if (e < 2) return f32_from_bits(0x00200000u << e);
    return f32_from_bits(uint32_t(e - 1) << 23);
}

// e2m1 values times two, so that they are int8 and the dot product stays in integers.
static constexpr int8_t kMxfp4GridX2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Q4_K / Q5_K: the eight 6-bit scales and mins packed into 12 bytes (sub-blocks 0-3 take
// the low 6 bits of bytes 0-3 / 4-7; sub-blocks 4-7 take a nibble of bytes 8-11 plus the
// top two bits of bytes 0-3 / 4-7).
static inline void k_scales_mins(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = uint8_t((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
        mn[j + 4] = uint8_t((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

}  // namespace hmoe
