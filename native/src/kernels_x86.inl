// The x86 SIMD kernels, written once with 256-bit vectors and compiled twice:
//   kernels_avx2.cpp    -mavx2 -mfma -mf16c           (Haswell / Zen 1 and later)
//   kernels_avx512.cpp  + AVX-512 F/BW/VL/DQ/VNNI/BF16 (HMOE_AVX512: VNNI integer dots,
//                       512-bit prefill GEMM with 32-row panels)
// Each includer wraps this file in its own namespace, so the two builds never share a
// symbol (an inline function compiled with AVX-512 flags must not be picked by the linker
// for the AVX2 path).
//
// Decode GEMV, the memory-bound half. Every weight byte is loaded once, expanded to int8
// in registers and multiplied with Q8 activations (blocks of 32) in integers, for up to
// four tokens while the codes are in registers. Two integer tricks:
//  * u8 x s8: vpmaddubsw multiplies unsigned by signed bytes and adds neighbours into
//    int16, vpmaddwd by ones adds pairs into int32 (AVX-512 VNNI: vpdpbusd does both,
//    without the int16 step). 4-bit codes are unsigned (0..15) and go in directly; their
//    offset (-8 for q4_0 and int4) is taken out once per block as 8 * d_w * s_act, with
//    s_act = d_act * sum(q_act) precomputed when the activations were quantized.
//  * s8 x s8 (q8_0, MXFP4 after its table lookup, q6_k): vpsignb moves the weight's sign
//    onto the activation, |w| goes in as the unsigned operand. Activations stay in
//    [-127, 127], so no sign flip overflows and the int16 pairs cannot saturate
//    (2 * 128 * 127 < 32768).
// Eight blocks of 32 at a time (a K-quant super-block, or eight q4_0 / q8_0 / int4 /
// MXFP4 blocks): the eight int32 dot vectors reduce to one vector of eight block sums with
// a tree of vphaddd, and one multiply applies the eight (weight scale x activation scale)
// products: the float work is one FMA per 256 weights instead of eight.
//
// Prefill, the compute-bound half: a panel of 16 weight rows (AVX-512: 32) is dequantized
// to fp32 once, over whole rows, into k-major order, and a register-blocked fp32 GEMM runs
// every token of the expert against it: 6 tokens x 16 rows of accumulators on AVX2
// (12 ymm), 8 tokens x 32 rows on AVX-512 (16 zmm); each weight load feeds 6 or 8 FMAs,
// each broadcast activation 2.

#include <immintrin.h>

#include <type_traits>
#include <vector>

#include "block_dequant.inl"

#if defined(HMOE_AVX512)
constexpr int kPanel = 32;
constexpr int kMr = 8;
#else
constexpr int kPanel = 16;
constexpr int kMr = 6;
#endif

// Software prefetch distance of the decode GEMV, in bytes ahead of the weights being read.
// The rows a work unit reads are one contiguous run, but the hardware stream prefetcher
// stops at every 4 KiB page and has to re-detect the stream; asking for the bytes ahead
// keeps misses in flight across those boundaries. The right distance is "far enough to
// cover DRAM latency at one core's share of the bandwidth", so it grows with that share:
// ~1 KiB on a 2-core Zen 3 VM (AVX2, ~8 GB/s a core; q4_0x8 flat from 512 to 2048, q8_0x8
// best at 1024), 3 KiB on a 2-core Xeon VM with AVX-512 (~16 GB/s a core: the Q4_0 decode,
// distances in turn in one process, 1.04x at 1536, 1.08x at 2048, 1.10x at 3072 over 1024).
// AVX-512 is taken as the sign of the larger share: measured on that Xeon only (a Zen 5,
// which has AVX-512 too, is not).
//
// Where to: L2 (T1) at the longer distances. A core has far fewer L1 misses in flight than
// L2 misses (Golden Cove: 16 fill buffers against 48 L2 entries; Zen 4: 24 against 64), and
// a stream this far ahead keeps that many lines coming; the loads then hit L2 and the L1
// prefetchers. On the 2-core Xeon (AMX), cold GEMV of 4096 x 2048 matrices, 2 threads, L1
// against L2 in turn, three rounds, of the probe: q8_0x8 0.65-0.71 -> 0.78-0.79, q4_0x8
// 0.59-0.65 -> 0.68-0.73, q4_kx8 0.56-0.57 -> 0.65-0.68, bf16 0.55-0.59 -> 0.62-0.65 (q6_k,
// q5_k even); the decode chain's q|k|v and output projections 0.70-0.78 -> 0.79-0.89. The
// AVX2 set's 1 KiB stream on the same machine lost a little in L2 (q8_0x8 0.74 -> 0.70),
// its K-quants' 2 KiB one gained (q4_kx8 0.57 -> 0.69, q6_k 0.54 -> 0.60).
#if defined(HMOE_AVX512)
constexpr int kPrefetchAhead = 3072;
constexpr _mm_hint kPrefetchTo = _MM_HINT_T1;
#else
constexpr int kPrefetchAhead = 1024;
constexpr _mm_hint kPrefetchTo = _MM_HINT_T0;
#endif
// The K-quant kernels (q6_k, q4_kx8) are slower per byte, and twice that distance kept more
// of the probe's bandwidth: cold GEMV of 2048 x 2048 matrices, 2 threads, distances in turn
// against a probe per round, q6_k 0.82 -> 0.87 of the probe, q4_kx8 0.83 -> 0.86 (3072 and
// 4096 no better; q4_0x8 flat, q8_0x8 best at 1024). Into L2, in both sets (above).
constexpr int kPrefetchAheadK = 2048;
constexpr _mm_hint kPrefetchToK = _MM_HINT_T1;
// The i-quants' GEMVs (kernels_iq.inl, kernels_planes.inl) are bound by their look-ups and keep
// their prefetches in L1, twice as far ahead as the K-quants': one MoE layer of 8 experts of
// 2048 x 768 at one token, 2 threads, three rounds in turn, 4096 against 2048: iq2_xxs,
// iq3_xxs 1.00-1.02x, iq2_s 1.01-1.06x, iq1_m 1.04-1.07x (AVX2 set on the same Xeon 1.00-1.09x;
// 4096 into L2 no better, 1024 worse).
constexpr int kPrefetchAheadIq = 4096;

// Prefetch [p, p + bytes) (whole cache lines) into L1 (_MM_HINT_T0) or L2 (_MM_HINT_T1).
template <_mm_hint Hint>
static inline void prefetch_span(const uint8_t* p, int bytes) {
    // Unrolled (the sizes are constants): as a loop, its counter, compare and branch were
    // three instructions per prefetch, ~15 % of a q4_kx8 super-block's instructions.
#pragma GCC unroll 32
    for (int i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + i), Hint);
}

// ---- small helpers --------------------------------------------------------------------

static inline float h2f(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

static inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Eight float, fp16 or bf16 values from row + k elements on, as floats.
template <Format F>
static inline __m256 load8_as_ps(const uint8_t* row, int64_t k) {
    if constexpr (F == FMT_F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
    if constexpr (F == FMT_F16) return _mm256_cvtph_ps(h);
    // bf16 is the top half of an fp32: widen to 32 bits and shift into place.
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// hsum_ps of eight vectors at once, the same additions in the same order (the same bits):
// {x0, x2, x4, x6, x1, x3, x5, x7}. A third of the instructions of eight hsum_ps.
static inline __m256 hsum8_ps(__m256 x0, __m256 x1, __m256 x2, __m256 x3, __m256 x4, __m256 x5, __m256 x6,
                              __m256 x7) {
    // Each vector's low half plus its high half: {x_lo + x_hi, y_lo + y_hi} for pairs x, y.
    const auto halves = [](__m256 x, __m256 y) {
        return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    };
    const __m256 p01 = halves(x0, x1), p23 = halves(x2, x3), p45 = halves(x4, x5), p67 = halves(x6, x7);
    // s0 + s2 and s1 + s3 of each: lane 0 {x0, x0, x2, x2}, lane 1 {x1, x1, x3, x3} (then x4..x7).
    const __m256 t0 = _mm256_add_ps(_mm256_shuffle_ps(p01, p23, 0x44), _mm256_shuffle_ps(p01, p23, 0xEE));
    const __m256 t1 = _mm256_add_ps(_mm256_shuffle_ps(p45, p67, 0x44), _mm256_shuffle_ps(p45, p67, 0xEE));
    // And the two of each added.
    return _mm256_add_ps(_mm256_shuffle_ps(t0, t1, 0x88), _mm256_shuffle_ps(t0, t1, 0xDD));
}

// acc + (per int32 lane) the sum of four u8 x s8 products.
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(HMOE_AVX512)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Signed x signed through the unsigned-by-signed instruction: |w| * (a with w's sign).
static inline __m256i dot_s8s8(__m256i acc, __m256i w, __m256i a) {
    return dot_u8s8(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

// 16 bytes of packed nibbles -> 32 codes: low nibbles in bytes 0-15, high ones in 16-31
// (the GGUF element order, and the permuted activation order of the interleaved formats).
static inline __m256i nibbles32(__m128i b) {
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);  // the 16-bit shift leaks bits across
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));           // bytes; the mask drops them
}
static inline __m256i nibbles32(const uint8_t* p) { return nibbles32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// nibbles32's codes (low nibble = even element) back in byte order: low and high nibble of
// byte 0, then of byte 1, ... (the interleaved formats' element order; nibble-packed scales).
static inline __m256i interleave_nibbles(__m256i n) {
    const __m128i lo = _mm256_castsi256_si128(n), hi = _mm256_extracti128_si256(n, 1);
    return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

// Eight int32x8 vectors -> one int32x8 whose lane j is the sum of all lanes of v[j].
static inline __m256i hsum8(const __m256i v[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    // a = [v0 v1 v2 v3 (low 4 lanes) | v0 v1 v2 v3 (high 4 lanes)], partial sums per 128-bit half.
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// ---- decode: blocks of 32 (q8_0, q4_0/1, q5_0/1, iq4_nl, iq4_xs, mxfp4, mxfp4_hf, int4_g32) -

// q5_0's fifth bits: bit j of the 32-bit word at p as 0x10 in byte j. Byte j of the broadcast
// word is picked by j / 8 (a byte shuffle within each 128-bit half, where every byte of the
// word is at hand), then tested against a mask holding bit j % 8.
static inline __m256i fifth_bits32(const uint8_t* p) {
    const __m256i word = _mm256_set1_epi32(int(load_u32(p)));
    const __m256i bytes = _mm256_shuffle_epi8(word, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                      2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

// IQ4_NL's 16 values as a byte table for vpshufb, the same in both 128-bit lanes.
static inline __m256i iq4nl_table() {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)));
}

// One 32-weight block as int8 codes plus its scale. kUnsigned: codes are 0..15 (0..31 for
// q5_0) with an implicit -kOffset (q4_0, q5_0, int4), or with a stored min m (q4_1, q5_1:
// value d * code + m, so the dot gains m * s_act); otherwise signed values. iq4_xs is taken
// as 32-blocks too: block b is sub-block b % 8 of super-block b / 8, iq4_nl's codes with the
// scale d * (ls - 32) (its rows are whole super-blocks, so gemv_b32_n's blocks b .. b+7 are
// always one super-block).
template <Format F>
struct Block32 {
    static constexpr bool kMin = F == FMT_Q4_1 || F == FMT_Q5_1;
    static constexpr bool kUnsigned = F == FMT_Q4_0 || F == FMT_Q5_0 || F == FMT_INT4_G32 || kMin;
    static constexpr float kOffset = kMin ? 0.f : F == FMT_Q5_0 ? 16.f : 8.f;
    static inline __m256i codes(const uint8_t* row, int64_t b) {
        if constexpr (F == FMT_Q8_0) {
            return load32(row + b * 34 + 2);
        } else if constexpr (F == FMT_Q4_0) {
            return nibbles32(row + b * 18 + 2);
        } else if constexpr (F == FMT_Q4_1) {
            return nibbles32(row + b * 20 + 4);
        } else if constexpr (F == FMT_Q5_0) {
            return _mm256_or_si256(nibbles32(row + b * 22 + 6), fifth_bits32(row + b * 22 + 2));
        } else if constexpr (F == FMT_Q5_1) {
            return _mm256_or_si256(nibbles32(row + b * 24 + 8), fifth_bits32(row + b * 24 + 4));
        } else if constexpr (F == FMT_IQ4_NL) {
            return _mm256_shuffle_epi8(iq4nl_table(), nibbles32(row + b * 18 + 2));
        } else if constexpr (F == FMT_IQ4_XS) {
            return _mm256_shuffle_epi8(iq4nl_table(), nibbles32(row + b / 8 * 136 + 8 + 16 * (b % 8)));
        } else if constexpr (F == FMT_INT4_G32 || F == FMT_MXFP4_HF) {
            const __m256i n = nibbles32(row + b * 16);
            if constexpr (F == FMT_INT4_G32) return n;
            return _mm256_shuffle_epi8(mxfp4_table(), n);
        } else {  // FMT_MXFP4 (GGUF)
            return _mm256_shuffle_epi8(mxfp4_table(), nibbles32(row + b * 17 + 1));
        }
    }
    static inline float scale(const uint8_t* row, const uint8_t* srow, int64_t b) {
        if constexpr (F == FMT_Q8_0) return h2f(row + b * 34);
        if constexpr (F == FMT_Q4_0 || F == FMT_IQ4_NL) return h2f(row + b * 18);
        if constexpr (F == FMT_Q5_0) return h2f(row + b * 22);
        if constexpr (F == FMT_IQ4_XS) {
            const uint8_t* p = row + b / 8 * 136;
            const int ib = int(b % 8);
            const int ls = ((p[4 + ib / 2] >> (4 * (ib % 2))) & 15) | ((load_u16(p + 2) >> (2 * ib)) & 3) << 4;
            return h2f(p) * float(ls - 32);
        }
        if constexpr (kMin) return h2f(row + b * kFormats[F].block_bytes);
        if constexpr (F == FMT_INT4_G32) return bf16_to_f32(load_u16(srow + 2 * b));
        if constexpr (F == FMT_MXFP4_HF) return e8m0_half(srow[b]);
        return e8m0_half(row[b * 17]);
    }
    static inline float min(const uint8_t* row, int64_t b) { return h2f(row + b * kFormats[F].block_bytes + 2); }
    // The e2m1 grid (doubled) as a byte table for vpshufb, the same in both 128-bit lanes.
    static inline __m256i mxfp4_table() {
        return _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8, 12, 0, -1,
                                -2, -3, -4, -6, -8, -12);
    }
};

// The scales of blocks b .. b+7 as eight floats (one vector multiply applies them all).
template <Format F>
static inline __m256 scales8(const uint8_t* row, const uint8_t* srow, int64_t b) {
    if constexpr (F == FMT_Q8_0 || F == FMT_Q4_0 || F == FMT_Q5_0 || F == FMT_Q4_1 || F == FMT_Q5_1 ||
                  F == FMT_IQ4_NL) {
        constexpr int S = kFormats[F].block_bytes;  // fp16 d at the start of each block
        const uint8_t* p = row + b * S;
        const __m128i h = _mm_setr_epi16(short(load_u16(p)), short(load_u16(p + S)), short(load_u16(p + 2 * S)),
                                         short(load_u16(p + 3 * S)), short(load_u16(p + 4 * S)),
                                         short(load_u16(p + 5 * S)), short(load_u16(p + 6 * S)),
                                         short(load_u16(p + 7 * S)));
        return _mm256_cvtph_ps(h);
    } else if constexpr (F == FMT_INT4_G32) {  // eight consecutive bf16
        return load8_as_ps<FMT_BF16>(srow, b);
    } else if constexpr (F == FMT_IQ4_XS) {  // b / 8's super-block: d * (ls_i - 32), i = 0 .. 7
        // Block i's 6-bit ls: its low nibble at bit 4i of the 32-bit scales_l, its two high
        // bits at bit 2i of the 16-bit scales_h (taken pre-shifted by 4, so they land at 4-5).
        const uint8_t* p = row + b / 8 * 136;
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(load_u32(p + 4))),
                                                              _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                            _mm256_set1_epi32(0x0F));
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(load_u16(p + 2)) << 4),
                                                              _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                            _mm256_set1_epi32(0x30));
        const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(32));
        return _mm256_mul_ps(_mm256_set1_ps(h2f(p)), _mm256_cvtepi32_ps(ls));
    } else {
        __m256i e;
        if constexpr (F == FMT_MXFP4_HF) {
            e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(srow + b)));
        } else {  // GGUF MXFP4: the e8m0 byte heads each 17-byte block
            const uint8_t* p = row + b * 17;
            e = _mm256_setr_epi32(p[0], p[17], p[34], p[51], p[68], p[85], p[102], p[119]);
        }
        // e8m0_half: 2^(e-128) as float bits (e-1) << 23; e = 0, 1 are denormals 0x00200000 << e.
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i denorm = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        const __m256i is_denorm = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
        return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, denorm, is_denorm));
    }
}

// The mins of blocks b .. b+7 (q4_1, q5_1: the fp16 after each block's d).
template <Format F>
static inline __m256 mins8(const uint8_t* row, int64_t b) {
    constexpr int S = kFormats[F].block_bytes;
    const uint8_t* p = row + b * S + 2;
    const __m128i h = _mm_setr_epi16(short(load_u16(p)), short(load_u16(p + S)), short(load_u16(p + 2 * S)),
                                     short(load_u16(p + 3 * S)), short(load_u16(p + 4 * S)), short(load_u16(p + 5 * S)),
                                     short(load_u16(p + 6 * S)), short(load_u16(p + 7 * S)));
    return _mm256_cvtph_ps(h);
}

template <Format F, int N>
static void gemv_b32_n(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, float* out,
                       int64_t ldo) {
    using B = Block32<F>;
    constexpr int kBlockBytes = kFormats[F].block_bytes * 32 / kFormats[F].block;  // a 32-block's (iq4_xs: 17)
    const int64_t nb = K / 32;
    const int64_t nb8 = nb / 8 * 8;
    // Each row's sum vector waits here for seven more: one hsum8_ps adds up eight rows (the
    // same bits as eight hsum_ps, a third of the instructions; short rows spent a third of
    // their time in those sums).
    __m256 sums[N][8];
    float tails[N][8];
    for (int64_t r = 0; r < nrows; ++r) {
        const uint8_t* row = w.row(row0 + r);
        const uint8_t* srow = w.scales ? w.scale_row(row0 + r) : nullptr;
        __m256 acc[N], corr[N];
        for (int t = 0; t < N; ++t) acc[t] = corr[t] = _mm256_setzero_ps();
        _mm_prefetch(reinterpret_cast<const char*>(w.row(row0 + r + 1)), _MM_HINT_T0);
        // Eight blocks at a time: eight integer dot vectors reduce to one vector of eight
        // block sums (hsum8), and a single FMA applies the eight (weight x activation)
        // scales; the offset of unsigned codes is one more FMA with the activation sums.
        for (int64_t b = 0; b < nb8; b += 8) {
            prefetch_span<kPrefetchTo>(row + b * kBlockBytes + kPrefetchAhead, 8 * kBlockBytes);
            __m256i q[8];
            for (int j = 0; j < 8; ++j) q[j] = B::codes(row, b + j);
            const __m256 dw = scales8<F>(row, srow, b);
            [[maybe_unused]] __m256 mw;
            if constexpr (B::kMin) mw = mins8<F>(row, b);
            for (int t = 0; t < N; ++t) {
                const int8_t* a = acts[t].q + 32 * b;
                __m256i v[8];
                for (int j = 0; j < 8; ++j) {
                    if constexpr (B::kUnsigned)
                        v[j] = dot_u8s8(_mm256_setzero_si256(), q[j], load32(a + 32 * j));
                    else
                        v[j] = dot_s8s8(_mm256_setzero_si256(), q[j], load32(a + 32 * j));
                }
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(acts[t].d + b)), _mm256_cvtepi32_ps(hsum8(v)),
                                         acc[t]);
                if constexpr (B::kMin)
                    corr[t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(acts[t].s + b), corr[t]);
                else if constexpr (B::kUnsigned)
                    corr[t] = _mm256_fmadd_ps(dw, _mm256_loadu_ps(acts[t].s + b), corr[t]);
            }
        }
        // Rows whose length is not a multiple of 256 (all of a short one: latent attention's
        // key maps are 128 long): a block's dot vector goes into the same accumulator, lane by
        // lane, which the row's one horizontal sum below adds up (a sum per block cost more
        // than the block: 61 % of the DeepSeek-shaped model's latent attention).
        float tail[N];
        for (int t = 0; t < N; ++t) tail[t] = 0.f;
        for (int64_t b = nb8; b < nb; ++b) {
            const __m256i q = B::codes(row, b);
            const float dw = B::scale(row, srow, b);
            for (int t = 0; t < N; ++t) {
                const __m256i a = load32(acts[t].q + 32 * b);
                const __m256i isum = B::kUnsigned ? dot_u8s8(_mm256_setzero_si256(), q, a)
                                                  : dot_s8s8(_mm256_setzero_si256(), q, a);
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * acts[t].d[b]), _mm256_cvtepi32_ps(isum), acc[t]);
                if constexpr (B::kMin)
                    tail[t] += B::min(row, b) * acts[t].s[b];
                else if constexpr (B::kUnsigned)
                    tail[t] -= B::kOffset * dw * acts[t].s[b];
            }
        }
        const int j = int(r % 8);
        for (int t = 0; t < N; ++t) {
            sums[t][j] = B::kMin        ? _mm256_add_ps(acc[t], corr[t])
                         : B::kUnsigned ? _mm256_fnmadd_ps(_mm256_set1_ps(B::kOffset), corr[t], acc[t])
                                        : acc[t];
            tails[t][j] = tail[t];
        }
        if (j == 7 || r == nrows - 1) {
            const int64_t first = r - j;
            for (int t = 0; t < N; ++t) {
                __m256* v = sums[t];
                for (int i = j + 1; i < 8; ++i) v[i] = _mm256_setzero_ps();
                alignas(32) float total[8];
                _mm256_store_ps(total, hsum8_ps(v[0], v[4], v[1], v[5], v[2], v[6], v[3], v[7]));
                for (int i = 0; i <= j; ++i) out[t * ldo + first + i] = total[i] + tails[t][i];
            }
        }
    }
}

// ---- decode: K-quant super-blocks of 256 ------------------------------------------------

// The eight 6-bit scales and mins of a Q4_K/Q5_K super-block as 32-bit words of four bytes
// each (the bit layout of k_scales_mins, done on whole words).
static inline void k_scales_mins_words(const uint8_t* s, uint32_t sc[2], uint32_t mn[2]) {
    uint32_t w0, w1, w2;
    std::memcpy(&w0, s, 4);
    std::memcpy(&w1, s + 4, 4);
    std::memcpy(&w2, s + 8, 4);
    sc[0] = w0 & 0x3F3F3F3Fu;
    mn[0] = w1 & 0x3F3F3F3Fu;
    sc[1] = (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u);         // top two bits of bytes 0-3
    mn[1] = ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);  // go to bits 4-5
}

static inline __m256 u8x8_to_ps(const uint32_t w[2]) {
    const __m128i b = _mm_set_epi32(0, 0, int(w[1]), int(w[0]));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}

// Q5_K: the fifth bit of every element of sub-block j (bit j of its qh byte) as 16 or 0,
// moved to bit 4 of the byte by one 16-bit shift (at most 4 places: bit 4 of either byte
// takes a bit of the same byte) and one mask.
template <int j>
static inline __m256i q5k_fifth(__m256i qh) {
    const __m256i m16 = _mm256_set1_epi8(0x10);
    if constexpr (j < 4) return _mm256_and_si256(_mm256_slli_epi16(qh, 4 - j), m16);
    else if constexpr (j == 4) return _mm256_and_si256(qh, m16);
    else return _mm256_and_si256(_mm256_srli_epi16(qh, j - 4), m16);
}

// Q4_K / Q5_K: the codes (0..15, or 0..31) of code chunk c, sub-blocks 2c (q0) and 2c + 1
// (q1); qs points at the super-block's 4-bit codes, qh holds its fifth bits (Q5_K).
template <bool kFive, int c>
static inline void q45k_codes(const uint8_t* qs, __m256i qh, __m256i& q0, __m256i& q1) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i raw = load32(qs + 32 * c);
    q0 = _mm256_and_si256(raw, m4);
    q1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    if constexpr (kFive) {
        q0 = _mm256_or_si256(q0, q5k_fifth<2 * c>(qh));
        q1 = _mm256_or_si256(q1, q5k_fifth<2 * c + 1>(qh));
    }
}

// Where a Q4_K / Q5_K super-block's 4-bit codes start, and its fifth bits (Q5_K; else zeros).
static inline const uint8_t* q45k_qs(const uint8_t* blk, bool five) { return blk + (five ? 48 : 16); }
static inline __m256i q45k_qh(const uint8_t* blk, bool five) { return five ? load32(blk + 16) : _mm256_setzero_si256(); }

// Q4_K / Q5_K: codes of sub-block j (0..7) of a super-block (for dequantizing).
template <bool kFive>
static inline void kquant_codes(const uint8_t* blk, __m256i q[8]) {
    const uint8_t* qs = q45k_qs(blk, kFive);
    const __m256i qh = q45k_qh(blk, kFive);
    q45k_codes<kFive, 0>(qs, qh, q[0], q[1]);
    q45k_codes<kFive, 1>(qs, qh, q[2], q[3]);
    q45k_codes<kFive, 2>(qs, qh, q[4], q[5]);
    q45k_codes<kFive, 3>(qs, qh, q[6], q[7]);
}

// Q4_K / Q5_K code chunk c (sub-blocks 2c, 2c + 1) against every token: the codes times the
// activations into int16 pairs (at most 2 * 31 * 127) and one vpmaddwd with the sub-block's
// scale (sc16 holds the eight scales as int16 in both 128-bit halves; a byte shuffle spreads
// one over a vector) into the super-block's int32 sums.
template <bool kFive, int N, int c>
static inline void q45k_chunk(const uint8_t* qs, __m256i qh, __m256i sc16, const Q8Row* acts, int64_t k,
                              __m256i isum[N]) {
    __m256i q0, q1;
    q45k_codes<kFive, c>(qs, qh, q0, q1);
    const __m256i s0 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(short(4 * c | (4 * c + 1) << 8)));
    const __m256i s1 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(short((4 * c + 2) | (4 * c + 3) << 8)));
    for (int t = 0; t < N; ++t) {
        const int8_t* a = acts[t].q + k + 64 * c;
        isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(q0, load32(a)), s0),
                                                             _mm256_madd_epi16(_mm256_maddubs_epi16(q1, load32(a + 32)), s1)));
    }
}

// Per super-block: the integer dots of all eight sub-blocks, each times its 6-bit scale, in
// int32; one activation scale per super-block (act_group 256) leaves one conversion and FMA
// with d; the mins come off as dmin * m_j * s_act_j, one FMA for all eight. (The float form,
// eight dots reduced with vphaddd and scaled per sub-block, and a compare per fifth bit, ran
// q5_k at 7 GB/s a core on weights in cache, under the bandwidth it should keep up with.)
template <bool kFive, int N>
static void gemv_q45k_n(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, float* out,
                        int64_t ldo) {
    const int64_t nsb = K / 256;
    const int bytes = kFive ? 176 : 144;
    for (int64_t r = 0; r < nrows; ++r) {
        const uint8_t* row = w.row(row0 + r);
        __m256 acc[N], accm[N];
        for (int t = 0; t < N; ++t) acc[t] = accm[t] = _mm256_setzero_ps();
        _mm_prefetch(reinterpret_cast<const char*>(w.row(row0 + r + 1)), _MM_HINT_T0);
        for (int64_t sb = 0; sb < nsb; ++sb) {
            const uint8_t* blk = row + sb * bytes;
            prefetch_span<kPrefetchToK>(blk + kPrefetchAheadK, bytes);
            uint32_t scw[2], mnw[2];
            k_scales_mins_words(blk + 4, scw, mnw);
            const __m256i sc16 =
                _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, int(scw[1]), int(scw[0]))));
            const __m256 dmn = _mm256_mul_ps(_mm256_set1_ps(h2f(blk + 2)), u8x8_to_ps(mnw));
            const __m256i qh = q45k_qh(blk, kFive);
            const uint8_t* qs = q45k_qs(blk, kFive);
            __m256i isum[N];
            for (int t = 0; t < N; ++t) isum[t] = _mm256_setzero_si256();
            q45k_chunk<kFive, N, 0>(qs, qh, sc16, acts, 256 * sb, isum);
            q45k_chunk<kFive, N, 1>(qs, qh, sc16, acts, 256 * sb, isum);
            q45k_chunk<kFive, N, 2>(qs, qh, sc16, acts, 256 * sb, isum);
            q45k_chunk<kFive, N, 3>(qs, qh, sc16, acts, 256 * sb, isum);
            const float d = h2f(blk);
            for (int t = 0; t < N; ++t) {
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * acts[t].d[8 * sb]), _mm256_cvtepi32_ps(isum[t]), acc[t]);
                accm[t] = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(acts[t].s + 8 * sb), accm[t]);
            }
        }
        for (int t = 0; t < N; ++t) out[t * ldo + r] = hsum_ps(_mm256_sub_ps(acc[t], accm[t]));
    }
}

// Q6_K, one quarter (32 elements) at a time. In half h of a super-block (elements
// 128h .. 128h + 127), quarter i takes the low nibbles of ql bytes 0-31 (i = 0) or 32-63
// (i = 1), or their high nibbles (i = 2, 3), and bits 2i, 2i + 1 of the 32 qh bytes as bits
// 4-5. The 16-bit shifts stay inside each byte because of the masks.
template <int i>
static inline __m256i q6k_quarter(__m256i ql0, __m256i ql1, __m256i qh) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i ql = i % 2 == 0 ? ql0 : ql1;
    const __m256i lo = i < 2 ? _mm256_and_si256(ql, m4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
    const __m256i hb = i == 0   ? _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)
                       : i == 1 ? _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)
                       : i == 2 ? _mm256_and_si256(qh, m30)
                                : _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30);
    return _mm256_or_si256(lo, hb);
}

// The 32 codes (0..63) of each quarter j (0..7) of a super-block (for dequantizing).
static inline void q6k_codes(const uint8_t* blk, __m256i q[8]) {
    for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = load32(blk + 64 * h), ql1 = load32(blk + 64 * h + 32), qh = load32(blk + 128 + 32 * h);
        q[4 * h + 0] = q6k_quarter<0>(ql0, ql1, qh);
        q[4 * h + 1] = q6k_quarter<1>(ql0, ql1, qh);
        q[4 * h + 2] = q6k_quarter<2>(ql0, ql1, qh);
        q[4 * h + 3] = q6k_quarter<3>(ql0, ql1, qh);
    }
}

// The int16 multipliers of quarter i of a half from that half's eight scales, held in both
// 128-bit halves of `eight`: after vpmaddubsw, int16 lanes 0-7 of a quarter hold pairs of
// its elements 0-15 (scale 2i of the half) and lanes 8-15 its elements 16-31 (2i + 1).
template <int i>
static inline __m256i q6k_quarter_scale(__m256i eight) {
    constexpr char lo = char(4 * i), hi = char(4 * i + 2);
    const __m256i pick = _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo,
                                          lo + 1, lo, lo + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi,
                                          hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1);
    return _mm256_shuffle_epi8(eight, pick);
}

// The sums of each 16 of a token's activation codes (at most 16 * 127: int16), for Q6_K's
// offset below. u8 ones x s8 codes adds pairs, vpmaddwd by ones fours, two vphaddd eights
// and sixteens; per 64 codes, the four sums land in lanes 0, 4, 1, 5.
static inline void sums16(const int8_t* q, int64_t K, int16_t* out) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t k = 0; k < K; k += 64) {
        const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, load32(q + k)), ones16);
        const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, load32(q + k + 32)), ones16);
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_setzero_si256());
        out[k / 16 + 0] = int16_t(_mm256_extract_epi32(h, 0));
        out[k / 16 + 1] = int16_t(_mm256_extract_epi32(h, 4));
        out[k / 16 + 2] = int16_t(_mm256_extract_epi32(h, 1));
        out[k / 16 + 3] = int16_t(_mm256_extract_epi32(h, 5));
    }
}

// Per quarter: the codes (0..63) go in unsigned, |code| x a into int16 pairs (at most
// 2 * 63 * 127, no saturation), and one vpmaddwd with the sub-block scales adds them into
// the super-block's int32 lanes (at most 8 x 2 x 16002 x 128 < 2^26). The codes'
// offset of 32 comes off once per super-block: 32 * sum_j scale_j * (sum of sub-block j's
// activations), one vpmaddwd of the 16 scales with the 16 sums. One activation scale per
// super-block (act_group 256) leaves one int-to-float and one FMA per super-block.
// The signed form (code - 32, its sign moved onto the activation) cost three more
// instructions a quarter: ~20 % of the kernel (hot, one core: 14 -> 17 GB/s).
template <int N>
static inline void q6k_quarter_dot(__m256i code, __m256i scale, const Q8Row* acts, int64_t k, __m256i sums[N]) {
    for (int t = 0; t < N; ++t)
        sums[t] = _mm256_add_epi32(sums[t], _mm256_madd_epi16(_mm256_maddubs_epi16(code, load32(acts[t].q + k)), scale));
}

template <int N>
static void gemv_q6k_n(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, float* out,
                       int64_t ldo) {
    const int64_t nsb = K / 256;
    thread_local std::vector<int16_t> sums_buf;
    if (sums_buf.size() < size_t(N * K / 16)) sums_buf.resize(size_t(N * K / 16));
    const int16_t* asum[N];
    for (int t = 0; t < N; ++t) {
        sums16(acts[t].q, K, sums_buf.data() + t * K / 16);
        asum[t] = sums_buf.data() + t * K / 16;
    }
    for (int64_t r = 0; r < nrows; ++r) {
        const uint8_t* row = w.row(row0 + r);
        __m256 acc[N];
        for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
        _mm_prefetch(reinterpret_cast<const char*>(w.row(row0 + r + 1)), _MM_HINT_T0);
        for (int64_t sb = 0; sb < nsb; ++sb) {
            const uint8_t* blk = row + sb * 210;
            prefetch_span<kPrefetchToK>(blk + kPrefetchAheadK, 210);
            const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
            __m256i sums[N];  // the scaled integer dots less the offset, from -32 x the offset on
            for (int t = 0; t < N; ++t)
                sums[t] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                           _mm256_slli_epi32(_mm256_madd_epi16(s16, load32(asum[t] + 16 * sb)), 5));
            for (int h = 0; h < 2; ++h) {
                const __m256i ql0 = load32(blk + 64 * h), ql1 = load32(blk + 64 * h + 32);
                const __m256i qh = load32(blk + 128 + 32 * h);
                const __m256i eight = h == 0 ? _mm256_permute4x64_epi64(s16, 0x44) : _mm256_permute4x64_epi64(s16, 0xEE);
                const int64_t k = 256 * sb + 128 * h;
                q6k_quarter_dot<N>(q6k_quarter<0>(ql0, ql1, qh), q6k_quarter_scale<0>(eight), acts, k, sums);
                q6k_quarter_dot<N>(q6k_quarter<1>(ql0, ql1, qh), q6k_quarter_scale<1>(eight), acts, k + 32, sums);
                q6k_quarter_dot<N>(q6k_quarter<2>(ql0, ql1, qh), q6k_quarter_scale<2>(eight), acts, k + 64, sums);
                q6k_quarter_dot<N>(q6k_quarter<3>(ql0, ql1, qh), q6k_quarter_scale<3>(eight), acts, k + 96, sums);
            }
            const float dw = h2f(blk + 208);
            for (int t = 0; t < N; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * acts[t].d[8 * sb]), _mm256_cvtepi32_ps(sums[t]), acc[t]);
        }
        for (int t = 0; t < N; ++t) out[t * ldo + r] = hsum_ps(acc[t]);
    }
}

// Q3_K and Q2_K, the low-bit experts of DeepSeek/Kimi GGUFs: the same halves and quarters as
// Q6_K. Quarter j of half h takes bits 2j, 2j+1 of the half's 32 qs bytes (Q3_K: and bit
// 4h + j of the 32 hmask bytes as the third), one scale per 16 as Q6_K, so the quarter dot
// and its scale multipliers are Q6_K's. Q3_K's codes (0..7) are offset by 4, taken off per
// super-block with the activation sums as Q6_K's 32; Q2_K's unsigned codes (0..3) have a
// min per 16 instead, dmin * sum_j m_j * (sub-block j's activation sum), kept apart in float
// since dmin is not d. (llama.cpp's Q3_K subtracts 4 where the mask bit is clear: code 0..7
// here is q3 + 4.)
// Q3_K's sixteen 6-bit scales, less 32, as int8 in one register: four 32-bit words of masks
// and shifts (ggml's unpacking). Unpacked into bytes in memory and loaded back, they cost a
// failed store-to-load forwarding per super-block: the kernel ran at a third of the speed.
static inline __m128i q3k_scales16(const uint8_t* p) {
    uint32_t a0, a1, t;
    std::memcpy(&a0, p, 4);
    std::memcpy(&a1, p + 4, 4);
    std::memcpy(&t, p + 8, 4);
    constexpr uint32_t k4 = 0x0F0F0F0F, k2 = 0x03030303;
    const uint32_t s0 = (a0 & k4) | ((t & k2) << 4), s1 = (a1 & k4) | (((t >> 2) & k2) << 4);
    const uint32_t s2 = ((a0 >> 4) & k4) | (((t >> 4) & k2) << 4), s3 = ((a1 >> 4) & k4) | (((t >> 6) & k2) << 4);
    return _mm_sub_epi8(_mm_setr_epi32(int(s0), int(s1), int(s2), int(s3)), _mm_set1_epi8(32));
}

template <bool kThree, int j, int bit>
static inline __m256i q23k_quarter(__m256i qs, __m256i hm) {
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), _mm256_set1_epi8(3));
    if constexpr (!kThree) {
        return low;
    } else {
        const __m256i four = _mm256_set1_epi8(4);
        const __m256i high = bit >= 2 ? _mm256_and_si256(_mm256_srli_epi16(hm, bit >= 2 ? bit - 2 : 0), four)
                                      : _mm256_and_si256(_mm256_slli_epi16(hm, bit < 2 ? 2 - bit : 0), four);
        return _mm256_or_si256(low, high);
    }
}

// The 32 codes of each quarter j (0..3) of half h of a super-block (Q3_K: 0..7, q3 + 4; Q2_K: 0..3).
template <bool kThree, int h>
static inline void q23k_half_codes(const uint8_t* blk, __m256i q[4]) {
    const __m256i qs = load32(blk + (kThree ? 32 : 16) + 32 * h);
    const __m256i hm = kThree ? load32(blk) : _mm256_setzero_si256();
    q[0] = q23k_quarter<kThree, 0, 4 * h + 0>(qs, hm);
    q[1] = q23k_quarter<kThree, 1, 4 * h + 1>(qs, hm);
    q[2] = q23k_quarter<kThree, 2, 4 * h + 2>(qs, hm);
    q[3] = q23k_quarter<kThree, 3, 4 * h + 3>(qs, hm);
}

// All eight quarters (for dequantizing).
template <bool kThree>
static inline void q23k_codes(const uint8_t* blk, __m256i q[8]) {
    q23k_half_codes<kThree, 0>(blk, q);
    q23k_half_codes<kThree, 1>(blk, q + 4);
}

template <bool kThree, int h, int N>
static inline void q23k_half(const uint8_t* blk, __m256i s16, const Q8Row* acts, int64_t k, __m256i sums[N]) {
    __m256i q[4];
    q23k_half_codes<kThree, h>(blk, q);
    const __m256i eight = _mm256_permute4x64_epi64(s16, h == 0 ? 0x44 : 0xEE);
    q6k_quarter_dot<N>(q[0], q6k_quarter_scale<0>(eight), acts, k, sums);
    q6k_quarter_dot<N>(q[1], q6k_quarter_scale<1>(eight), acts, k + 32, sums);
    q6k_quarter_dot<N>(q[2], q6k_quarter_scale<2>(eight), acts, k + 64, sums);
    q6k_quarter_dot<N>(q[3], q6k_quarter_scale<3>(eight), acts, k + 96, sums);
}

template <bool kThree, int N>
static void gemv_q23k_n(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, float* out,
                        int64_t ldo) {
    constexpr int kBytes = kThree ? 110 : 84;
    const int64_t nsb = K / 256;
    thread_local std::vector<int16_t> sums_buf;
    if (sums_buf.size() < size_t(N * K / 16)) sums_buf.resize(size_t(N * K / 16));
    const int16_t* asum[N];
    for (int t = 0; t < N; ++t) {
        sums16(acts[t].q, K, sums_buf.data() + t * K / 16);
        asum[t] = sums_buf.data() + t * K / 16;
    }
    for (int64_t r = 0; r < nrows; ++r) {
        const uint8_t* row = w.row(row0 + r);
        __m256 acc[N], accm[N];
        for (int t = 0; t < N; ++t) acc[t] = accm[t] = _mm256_setzero_ps();
        _mm_prefetch(reinterpret_cast<const char*>(w.row(row0 + r + 1)), _MM_HINT_T0);
        for (int64_t sb = 0; sb < nsb; ++sb) {
            const uint8_t* blk = row + sb * kBytes;
            prefetch_span<kPrefetchToK>(blk + kPrefetchAheadK, kBytes);
            __m256i s16, sums[N];
            if constexpr (kThree) {
                s16 = _mm256_cvtepi8_epi16(q3k_scales16(blk + 96));
                for (int t = 0; t < N; ++t)  // the codes' offset of 4, as Q6_K's 32
                    sums[t] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                               _mm256_slli_epi32(_mm256_madd_epi16(s16, load32(asum[t] + 16 * sb)), 2));
            } else {
                const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
                const __m128i m4 = _mm_set1_epi8(0x0F);
                s16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m4));
                const __m256i m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
                const float dmin = h2f(blk + 82);
                for (int t = 0; t < N; ++t) {
                    sums[t] = _mm256_setzero_si256();
                    accm[t] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * acts[t].d[8 * sb]),
                                              _mm256_cvtepi32_ps(_mm256_madd_epi16(m16, load32(asum[t] + 16 * sb))),
                                              accm[t]);
                }
            }
            q23k_half<kThree, 0, N>(blk, s16, acts, 256 * sb, sums);
            q23k_half<kThree, 1, N>(blk, s16, acts, 256 * sb + 128, sums);
            const float dw = h2f(blk + (kThree ? 108 : 80));
            for (int t = 0; t < N; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * acts[t].d[8 * sb]), _mm256_cvtepi32_ps(sums[t]), acc[t]);
        }
        for (int t = 0; t < N; ++t) out[t * ldo + r] = hsum_ps(_mm256_sub_ps(acc[t], accm[t]));
    }
}

// ---- decode dispatch on the token count (a compile-time N keeps accumulators in registers)

template <template <int> class G>
static void by_tokens(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                      float* out, int64_t ldo) {
    switch (ntok) {
        case 1: return G<1>::run(w, row0, nrows, K, acts, out, ldo);
        case 2: return G<2>::run(w, row0, nrows, K, acts, out, ldo);
        case 3: return G<3>::run(w, row0, nrows, K, acts, out, ldo);
        default: return G<4>::run(w, row0, nrows, K, acts, out, ldo);
    }
}

template <Format F>
struct B32 {
    template <int N>
    struct G {
        static void run(const MatrixRef& w, int64_t r0, int64_t n, int64_t K, const Q8Row* a, float* o, int64_t l) {
            gemv_b32_n<F, N>(w, r0, n, K, a, o, l);
        }
    };
};
template <bool kFive>
struct KQ {
    template <int N>
    struct G {
        static void run(const MatrixRef& w, int64_t r0, int64_t n, int64_t K, const Q8Row* a, float* o, int64_t l) {
            gemv_q45k_n<kFive, N>(w, r0, n, K, a, o, l);
        }
    };
};
template <bool kThree>
struct Q23 {
    template <int N>
    struct G {
        static void run(const MatrixRef& w, int64_t r0, int64_t n, int64_t K, const Q8Row* a, float* o, int64_t l) {
            gemv_q23k_n<kThree, N>(w, r0, n, K, a, o, l);
        }
    };
};
template <int N>
struct Q6G {
    static void run(const MatrixRef& w, int64_t r0, int64_t n, int64_t K, const Q8Row* a, float* o, int64_t l) {
        gemv_q6k_n<N>(w, r0, n, K, a, o, l);
    }
};

template <Format F>
static void gemv_q8_b32(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                        float* out, int64_t ldo) {
    by_tokens<B32<F>::template G>(w, row0, nrows, K, acts, ntok, out, ldo);
}

// iq4_xs's calls of more than four tokens (prompts; the table's gemv_any_tokens) on AVX2 (on
// AVX-512 they take gemm_b32_512, kernels_iq.inl, the same bits and 2.4x as fast): gemv_b32_n's
// arithmetic per token, in the same order (the same bits however the tokens are grouped), but
// each eight blocks decoded once for all of the call's tokens (|w| too: dot_s8s8's first sign),
// the tokens' float lanes in memory between them, instead of decoded and read again for every
// four tokens. Signed formats whose rows are whole super-blocks (no tail blocks).
template <Format F>
static void gemv_b32_many(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                          float* out, int64_t ldo) {
    using B = Block32<F>;
    static_assert(!B::kUnsigned, "signed codes only");
    constexpr int kBlockBytes = kFormats[F].block_bytes * 32 / kFormats[F].block;
    const int64_t nb8 = K / 256 * 8;
    thread_local std::vector<__m256> acc_buf;
    if (acc_buf.size() < size_t(ntok)) acc_buf.resize(size_t(ntok));
    __m256* acc = acc_buf.data();
    for (int64_t r = 0; r < nrows; ++r) {
        const uint8_t* row = w.row(row0 + r);
        const uint8_t* srow = w.scales ? w.scale_row(row0 + r) : nullptr;
        for (int t = 0; t < ntok; ++t) acc[t] = _mm256_setzero_ps();
        _mm_prefetch(reinterpret_cast<const char*>(w.row(row0 + r + 1)), _MM_HINT_T0);
        for (int64_t b = 0; b < nb8; b += 8) {
            prefetch_span<kPrefetchTo>(row + b * kBlockBytes + kPrefetchAhead, 8 * kBlockBytes);
            __m256i q[8], m[8];
            for (int j = 0; j < 8; ++j) {
                q[j] = B::codes(row, b + j);
                m[j] = _mm256_sign_epi8(q[j], q[j]);
            }
            const __m256 dw = scales8<F>(row, srow, b);
            for (int t = 0; t < ntok; ++t) {
                const int8_t* a = acts[t].q + 32 * b;
                __m256i v[8];
                for (int j = 0; j < 8; ++j)
                    v[j] = dot_u8s8(_mm256_setzero_si256(), m[j], _mm256_sign_epi8(load32(a + 32 * j), q[j]));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(acts[t].d + b)), _mm256_cvtepi32_ps(hsum8(v)),
                                         acc[t]);
            }
        }
        for (int t = 0; t < ntok; ++t) out[t * ldo + r] = hsum_ps(acc[t]);  // hsum8_ps's additions
    }
}

#if defined(HMOE_AVX512)
// AVX-512: the same bits from a GEMM over panels of 16 rows (kernels_iq.inl).
template <Format F>
static void gemm_b32_512(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                         float* out, int64_t ldo);
#endif

template <Format F>
static void gemv_q8_b32_any(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                            float* out, int64_t ldo) {
#if defined(HMOE_AVX512)
    if (ntok > kMaxGemvTokens) return gemm_b32_512<F>(w, row0, nrows, K, acts, ntok, out, ldo);
#endif
    if (ntok > kMaxGemvTokens) {
        // Every row reads all of a pass's activations again: passes of up to ~256 KB of them
        // (L2), 8 to 64 tokens (a 2048 x 2048 matrix at 512 tokens in one pass read them from
        // memory for each row: 1.4x the time of passes of 64).
        const int step = int(std::clamp<int64_t>((256 << 10) / K, 8, 64));
        for (int t0 = 0; t0 < ntok; t0 += step)
            gemv_b32_many<F>(w, row0, nrows, K, acts + t0, std::min(step, ntok - t0), out + t0 * ldo, ldo);
        return;
    }
    by_tokens<B32<F>::template G>(w, row0, nrows, K, acts, ntok, out, ldo);
}
static void gemv_q8_q4k(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                        float* out, int64_t ldo) {
    by_tokens<KQ<false>::template G>(w, row0, nrows, K, acts, ntok, out, ldo);
}
static void gemv_q8_q5k(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                        float* out, int64_t ldo) {
    by_tokens<KQ<true>::template G>(w, row0, nrows, K, acts, ntok, out, ldo);
}
static void gemv_q8_q6k(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                        float* out, int64_t ldo) {
    by_tokens<Q6G>(w, row0, nrows, K, acts, ntok, out, ldo);
}
#if defined(HMOE_AVX512)
// AVX-512: q3_k's and q2_k's calls of more than four tokens (prompts) as a GEMM over panels
// of 16 rows, the same bits per token (kernels_iq.inl).
static void gemm_q3k_512(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                         float* out, int64_t ldo);
static void gemm_q2k_512(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                         float* out, int64_t ldo);
#endif
static void gemv_q8_q3k(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                        float* out, int64_t ldo) {
#if defined(HMOE_AVX512)
    if (ntok > kMaxGemvTokens) return gemm_q3k_512(w, row0, nrows, K, acts, ntok, out, ldo);
#endif
    by_tokens<Q23<true>::template G>(w, row0, nrows, K, acts, ntok, out, ldo);
}
static void gemv_q8_q2k(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                        float* out, int64_t ldo) {
#if defined(HMOE_AVX512)
    if (ntok > kMaxGemvTokens) return gemm_q2k_512(w, row0, nrows, K, acts, ntok, out, ldo);
#endif
    by_tokens<Q23<false>::template G>(w, row0, nrows, K, acts, ntok, out, ldo);
}

// ---- decode: the i-quant super-blocks ----------------------------------------------------

#include "kernels_iq.inl"

// ---- decode: the row-interleaved x8 layouts (q4_0x8, int4_g32x8, iq4_nlx8, iq4_xsx8) -----

// Four activation bytes in every 32-bit lane.
static inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// Eight rows' u8 values (q4_kx8 scales or mins) as floats.
static inline __m256 rows8_u8_ps(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The eight rows' scales of one x8 block as floats (int4_g32x8 keeps the source's bf16).
template <Format F>
static inline __m256 x8_scales(const uint8_t* blk) {
    return load8_as_ps<F == FMT_INT4_X8 ? FMT_BF16 : FMT_F16>(blk, 0);
}

// Eight rows at a time: a 32-bit lane of a code chunk is four code bytes of one row, so one
// broadcast of four activation bytes multiplies all eight rows and every sum stays in its
// row's lane. Per block and token: eight u8 x s8 products into int16 (at most
// 8 * 2 * 15 * 127 = 30480, no overflow) and one widening to int32 (AVX-512 VNNI: eight
// vpdpbusd straight into int32), then one FMA with the eight rows' scales. The q + 8
// offset is taken out at the end as 8 * sum(d_w * s_act), as in gemv_b32_n.
template <Format F, int N>
static void gemv_x8_n(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, float* out,
                      int64_t ldo) {
    const int64_t nb = K / 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t g = 0; g < nrows / 8; ++g) {
        const uint8_t* blk = w.data + (row0 / 8 + g) * w.row_stride;
        __m256 acc[N], corr[N];
        for (int t = 0; t < N; ++t) acc[t] = corr[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b, blk += kX8BlockBytes) {
            prefetch_span<kPrefetchTo>(blk + kPrefetchAhead, kX8BlockBytes);
            const __m256 dw = x8_scales<F>(blk);
            __m256i lo[4], hi[4];
            for (int c = 0; c < 4; ++c) {
                const __m256i raw = load32(blk + 16 + 32 * c);
                lo[c] = _mm256_and_si256(raw, m4);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            }
            for (int t = 0; t < N; ++t) {
                const int8_t* a = acts[t].q + 32 * b;
#if defined(HMOE_AVX512)
                __m256i s32 = _mm256_setzero_si256();
                for (int c = 0; c < 4; ++c) {
                    s32 = _mm256_dpbusd_epi32(s32, lo[c], bcast4(a + 4 * c));
                    s32 = _mm256_dpbusd_epi32(s32, hi[c], bcast4(a + 16 + 4 * c));
                }
#else
                __m256i s16 = _mm256_setzero_si256();
                for (int c = 0; c < 4; ++c) {
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[c], bcast4(a + 4 * c)));
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[c], bcast4(a + 16 + 4 * c)));
                }
                const __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(acts[t].d[b])), _mm256_cvtepi32_ps(s32), acc[t]);
                corr[t] = _mm256_fmadd_ps(dw, _mm256_set1_ps(acts[t].s[b]), corr[t]);
            }
        }
        for (int t = 0; t < N; ++t)
            _mm256_storeu_ps(out + t * ldo + 8 * g, _mm256_fnmadd_ps(_mm256_set1_ps(8.f), corr[t], acc[t]));
    }
}

#if defined(HMOE_AVX512)
// -128 times the sum of each 32-block of a token's Q8 activations (iq4_nlx8's offset, below).
static void offset_block_sums(const int8_t* q, int64_t nb, int32_t* out) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    const auto block_sum = [&](int64_t b) { return _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, load32(q + 32 * b)), ones16); };
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        __m256i v[8];
        for (int j = 0; j < 8; ++j) v[j] = block_sum(b + j);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b), _mm256_mullo_epi32(hsum8(v), _mm256_set1_epi32(-128)));
    }
    for (; b < nb; ++b) {
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), block_sum(b));
        int32_t sum = 0;
        for (int32_t x : lanes) sum += x;
        out[b] = -128 * sum;
    }
}
#endif

// The eight rows' scales of sub-block j of an iq4_xsx8 super-block: d x (ls - 32), ls's low
// four bits at bit 4j of the row's scales_l word, its high two at bit 2j of its scales_h.
static inline __m256 iq4xs_x8_scales(const uint8_t* sblk, __m256 d, int j) {
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(load32(sblk + 32), 4 * j), _mm256_set1_epi32(0x0F));
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sblk + 16)));
    const __m256i hi = _mm256_and_si256(_mm256_slli_epi32(_mm256_srli_epi32(h, 2 * j), 4), _mm256_set1_epi32(0x30));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(32))));
}

// Block b (32 columns) of an iq4_nlx8 / iq4_xsx8 group of eight rows: the rows' scales as
// floats, and in v the codes looked up in `table` (chunk c's low nibbles at 2c, its high
// nibbles at 2c + 1). The GEMV and the many-token GEMM decode through it alike.
template <Format F>
static inline __m256 x8nl_block(const uint8_t* group, int64_t b, __m256i table, __m256i v[8]) {
    const uint8_t* codes;
    __m256 dw;
    if constexpr (F == FMT_IQ4_XS_X8) {
        const uint8_t* sblk = group + (b / 8) * kIq4XsX8Bytes;
        dw = iq4xs_x8_scales(sblk, load8_as_ps<FMT_F16>(sblk, 0), int(b % 8));
        codes = sblk + 64 + 128 * (b % 8);
    } else {
        const uint8_t* blk = group + b * kX8BlockBytes;
        dw = x8_scales<F>(blk);
        codes = blk + 16;
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
        const __m256i raw = load32(codes + 32 * c);
        v[2 * c] = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, m4));
        v[2 * c + 1] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
    }
    return dw;
}

// iq4_nlx8 and iq4_xsx8: gemv_x8_n's eight rows a vector, the codes looked up in the iq4_nl
// table (one vpshufb a chunk and nibble half); iq4_xs's 32-value sub-blocks are iq4_nl's blocks
// with the scale d x (ls - 32). Each block's integer dot is exact, as in llama.cpp, and so the
// same on every kernel set. With AVX-512 VNNI a value goes in as value + 128 (1 .. 241:
// vpdpbusd's unsigned operand) and each block's sum starts from -128 times its activations'
// sum (offset_block_sums, once a call). Without VNNI vpmaddubsw would saturate on 241 x 127
// pairs, so the values stay signed, their signs go onto the activations (|w| x +-a, at most
// 2 x 127 x 127 a pair) and each chunk widens to int32 at once, as q8_0x8's do.
template <Format F, int N>
static void gemv_x8nl_n(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, float* out,
                        int64_t ldo) {
    const int64_t nb = K / 32;
#if defined(HMOE_AVX512)
    const __m256i table = _mm256_add_epi8(iq4nl_table(), _mm256_set1_epi8(char(0x80)));
    thread_local std::vector<int32_t> offsets_buf;
    offsets_buf.resize(size_t(N * nb));
    for (int t = 0; t < N; ++t) offset_block_sums(acts[t].q, nb, offsets_buf.data() + t * nb);
    const int32_t* offsets = offsets_buf.data();
#else
    const __m256i table = iq4nl_table();
#endif
    for (int64_t g = 0; g < nrows / 8; ++g) {
        const uint8_t* group = w.data + (row0 / 8 + g) * w.row_stride;
        __m256 acc[N];
        for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            if constexpr (F == FMT_IQ4_XS_X8) {
                if (b % 8 == 0) prefetch_span<kPrefetchToK>(group + (b / 8) * kIq4XsX8Bytes + kPrefetchAheadK, kIq4XsX8Bytes);
            } else {
                prefetch_span<kPrefetchTo>(group + b * kX8BlockBytes + kPrefetchAhead, kX8BlockBytes);
            }
            __m256i v[8];
            const __m256 dw = x8nl_block<F>(group, b, table, v);
#if !defined(HMOE_AVX512)
            __m256i mag[8];
            for (int i = 0; i < 8; ++i) mag[i] = _mm256_sign_epi8(v[i], v[i]);
#endif
            for (int t = 0; t < N; ++t) {
                const int8_t* a = acts[t].q + 32 * b;
#if defined(HMOE_AVX512)
                __m256i s32 = _mm256_set1_epi32(offsets[t * nb + b]);
                for (int c = 0; c < 4; ++c) {
                    s32 = _mm256_dpbusd_epi32(s32, v[2 * c], bcast4(a + 4 * c));
                    s32 = _mm256_dpbusd_epi32(s32, v[2 * c + 1], bcast4(a + 16 + 4 * c));
                }
#else
                __m256i s32 = _mm256_setzero_si256();
                for (int c = 0; c < 4; ++c) {
                    s32 = dot_u8s8(s32, mag[2 * c], _mm256_sign_epi8(bcast4(a + 4 * c), v[2 * c]));
                    s32 = dot_u8s8(s32, mag[2 * c + 1], _mm256_sign_epi8(bcast4(a + 16 + 4 * c), v[2 * c + 1]));
                }
#endif
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(acts[t].d[b])), _mm256_cvtepi32_ps(s32), acc[t]);
            }
        }
        for (int t = 0; t < N; ++t) _mm256_storeu_ps(out + t * ldo + 8 * g, acc[t]);
    }
}

// q4_kx8: the same eight-rows-per-vector scheme over q4_k super-blocks. A 32-byte code
// chunk of a row holds two sub-blocks (low and high nibbles), each with its own scale and
// min: per sub-block and token, eight u8 x s8 products into int16 (at most 16 * 15 * 127 =
// 30480), and one vpmaddwd with the eight rows' 6-bit scales sc_j into the super-block's
// int32 sums (at most 8 * 2 * 30480 * 63 < 2^25); then, activations having one scale per
// super-block, one FMA with d of the eight rows times that scale. The mins come off as
// dmin * m_j * s_act, per sub-block.
template <int N>
static void gemv_q4kx8_groups(const MatrixRef& w, int64_t row0, int64_t g0, int64_t g1, int64_t K, const Q8Row* acts,
                              float* out, int64_t ldo) {
    const int64_t nsb = K / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    // Byte r of a 128-bit lane (row r of that lane's four) into both bytes 0 and 2 of 32-bit
    // lane r, zeros between: (sc, sc) as int16 pairs. Indexes + 8 pick the next sub-block.
    constexpr char z = char(0x80);
    const __m256i kRowScalePairs = _mm256_setr_epi8(0, z, 0, z, 1, z, 1, z, 2, z, 2, z, 3, z, 3, z,  //
                                                    4, z, 4, z, 5, z, 5, z, 6, z, 6, z, 7, z, 7, z);
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* blk = w.data + (row0 / 8 + g) * w.row_stride;
        __m256 acc[N], corr[N];
        for (int t = 0; t < N; ++t) acc[t] = corr[t] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nsb; ++sb, blk += kQ4KX8Bytes) {
            const __m256 dmin = load8_as_ps<FMT_F16>(blk + 16, 0);
            // The mins: sum_j m_j * s_act_j in two independent chains, times dmin once (one
            // chain of eight dependent FMAs with dmin applied in each step held the super-block
            // back: hot, one core, A/B processes in turn, median 23.0 -> 24.9 GB/s).
            for (int t = 0; t < N; ++t) {
                const float* sa = acts[t].s + 8 * sb;
                __m256 m0 = _mm256_mul_ps(rows8_u8_ps(blk + 96), _mm256_set1_ps(sa[0]));
                __m256 m1 = _mm256_mul_ps(rows8_u8_ps(blk + 104), _mm256_set1_ps(sa[1]));
                for (int j = 2; j < 8; j += 2) {
                    m0 = _mm256_fmadd_ps(rows8_u8_ps(blk + 96 + 8 * j), _mm256_set1_ps(sa[j]), m0);
                    m1 = _mm256_fmadd_ps(rows8_u8_ps(blk + 104 + 8 * j), _mm256_set1_ps(sa[j + 1]), m1);
                }
                corr[t] = _mm256_fmadd_ps(dmin, _mm256_add_ps(m0, m1), corr[t]);
            }
            __m256i isum[N];  // sum_j sc_j * (sub-block j's integer dot), per row
            for (int t = 0; t < N; ++t) isum[t] = _mm256_setzero_si256();
            for (int c = 0; c < 4; ++c) {
                // A quarter of a later super-block per code chunk: its 19 prefetches at once, at
                // the top of the super-block, held the chunk's loads back behind them (cold, 2
                // threads: 0.72-0.78 -> 0.83-0.86 of the probe; decode of the Q4_K_M benchmark
                // model, with the distance above, 1.10x).
                prefetch_span<kPrefetchToK>(blk + kPrefetchAheadK + kQ4KX8Bytes / 4 * c, kQ4KX8Bytes / 4);
                __m256i lo16[N], hi16[N];
                for (int t = 0; t < N; ++t) lo16[t] = hi16[t] = _mm256_setzero_si256();
                for (int v = 0; v < 8; ++v) {
                    const __m256i raw = load32(blk + 160 + (8 * c + v) * 32);
                    const __m256i lo = _mm256_and_si256(raw, m4);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                    for (int t = 0; t < N; ++t) {
                        const int8_t* a = acts[t].q + 256 * sb + 64 * c + 4 * v;
                        lo16[t] = _mm256_add_epi16(lo16[t], _mm256_maddubs_epi16(lo, bcast4(a)));
                        hi16[t] = _mm256_add_epi16(hi16[t], _mm256_maddubs_epi16(hi, bcast4(a + 32)));
                    }
                }
                // The rows' scales of sub-blocks 2c and 2c + 1 as int16 pairs, (sc_r, sc_r) in
                // 32-bit lane r, so that vpmaddwd scales and adds each row's int16 pairs.
                const __m256i sc = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * c)));
                const __m256i sc_lo = _mm256_shuffle_epi8(sc, kRowScalePairs);
                const __m256i sc_hi = _mm256_shuffle_epi8(sc, _mm256_add_epi8(kRowScalePairs, _mm256_set1_epi8(8)));
                for (int t = 0; t < N; ++t)
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(_mm256_madd_epi16(lo16[t], sc_lo),
                                                                         _mm256_madd_epi16(hi16[t], sc_hi)));
            }
            // One activation scale per super-block (act_group 256): one conversion and FMA.
            const __m256 d = load8_as_ps<FMT_F16>(blk, 0);
            for (int t = 0; t < N; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(acts[t].d[8 * sb])), _mm256_cvtepi32_ps(isum[t]), acc[t]);
        }
        for (int t = 0; t < N; ++t) _mm256_storeu_ps(out + t * ldo + 8 * g, _mm256_sub_ps(acc[t], corr[t]));
    }
}

#if defined(HMOE_AVX512)
// Two groups of eight rows at once on 512-bit vectors (lanes 0-7 the first group's rows, 8-15
// the second's; both groups read the same activations): half the instructions per weight,
// vpdpbusd straight into each sub-block's int32 sums, which vpmulld scales by the rows' 6-bit
// scales. The integer sums are exact either way, and each row's float operations are those of
// gemv_q4kx8_groups in the same order: the same bits. For three or four tokens per pass, where
// the arithmetic is what limits (a prompt's experts; 2-core Zen 5, a 64-expert Qwen3-30B-A3B
// layer in turn in one process: 64 tokens 1.36-1.45x, 32 1.07x); with one or two the
// layer reads at the memory's pace either way, and the two streams of a pair, or at one token
// the chain of each sum's vpdpbusd, were slower (up to 1.2x at 8 tokens).
static inline __m512i pair_u8_epi32(const uint8_t* a, const uint8_t* b) {  // 8 bytes of each
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
}
static inline __m512 pair_f16_ps(const uint8_t* a, const uint8_t* b) {  // 8 fp16 of each
    return _mm512_insertf32x8(_mm512_castps256_ps512(load8_as_ps<FMT_F16>(a, 0)), load8_as_ps<FMT_F16>(b, 0), 1);
}

template <int N>
static void gemv_q4kx8_pairs(const MatrixRef& w, int64_t row0, int64_t pairs, int64_t K, const Q8Row* acts, float* out,
                             int64_t ldo) {
    const int64_t nsb = K / 256;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int64_t p = 0; p < pairs; ++p) {
        const uint8_t* b0 = w.data + (row0 / 8 + 2 * p) * w.row_stride;
        const uint8_t* b1 = b0 + w.row_stride;
        __m512 acc[N], corr[N];
        for (int t = 0; t < N; ++t) acc[t] = corr[t] = _mm512_setzero_ps();
        for (int64_t sb = 0; sb < nsb; ++sb, b0 += kQ4KX8Bytes, b1 += kQ4KX8Bytes) {
            const __m512 dmin = pair_f16_ps(b0 + 16, b1 + 16);
            for (int t = 0; t < N; ++t) {
                const float* sa = acts[t].s + 8 * sb;
                __m512 m0 = _mm512_mul_ps(_mm512_cvtepi32_ps(pair_u8_epi32(b0 + 96, b1 + 96)), _mm512_set1_ps(sa[0]));
                __m512 m1 = _mm512_mul_ps(_mm512_cvtepi32_ps(pair_u8_epi32(b0 + 104, b1 + 104)), _mm512_set1_ps(sa[1]));
                for (int j = 2; j < 8; j += 2) {
                    m0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_u8_epi32(b0 + 96 + 8 * j, b1 + 96 + 8 * j)),
                                         _mm512_set1_ps(sa[j]), m0);
                    m1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_u8_epi32(b0 + 104 + 8 * j, b1 + 104 + 8 * j)),
                                         _mm512_set1_ps(sa[j + 1]), m1);
                }
                corr[t] = _mm512_fmadd_ps(dmin, _mm512_add_ps(m0, m1), corr[t]);
            }
            __m512i isum[N];
            for (int t = 0; t < N; ++t) isum[t] = _mm512_setzero_si512();
            for (int c = 0; c < 4; ++c) {
                prefetch_span<kPrefetchToK>(b0 + kPrefetchAheadK + kQ4KX8Bytes / 4 * c, kQ4KX8Bytes / 4);
                prefetch_span<kPrefetchToK>(b1 + kPrefetchAheadK + kQ4KX8Bytes / 4 * c, kQ4KX8Bytes / 4);
                __m512i lo32[N], hi32[N];
                for (int t = 0; t < N; ++t) lo32[t] = hi32[t] = _mm512_setzero_si512();
                for (int v = 0; v < 8; ++v) {
                    const int64_t at = 160 + (8 * c + v) * 32;
                    const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(load32(b0 + at)), load32(b1 + at), 1);
                    const __m512i lo = _mm512_and_si512(raw, m4);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
                    for (int t = 0; t < N; ++t) {
                        const int8_t* a = acts[t].q + 256 * sb + 64 * c + 4 * v;
                        int32_t a_lo, a_hi;
                        std::memcpy(&a_lo, a, 4);
                        std::memcpy(&a_hi, a + 32, 4);
                        lo32[t] = _mm512_dpbusd_epi32(lo32[t], lo, _mm512_set1_epi32(a_lo));
                        hi32[t] = _mm512_dpbusd_epi32(hi32[t], hi, _mm512_set1_epi32(a_hi));
                    }
                }
                // The rows' scales of sub-blocks 2c (bytes 0-7 of the group's 16) and 2c + 1.
                const __m512i sc_lo = pair_u8_epi32(b0 + 32 + 16 * c, b1 + 32 + 16 * c);
                const __m512i sc_hi = pair_u8_epi32(b0 + 40 + 16 * c, b1 + 40 + 16 * c);
                for (int t = 0; t < N; ++t)
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(_mm512_mullo_epi32(lo32[t], sc_lo),
                                                                         _mm512_mullo_epi32(hi32[t], sc_hi)));
            }
            const __m512 d = pair_f16_ps(b0, b1);
            for (int t = 0; t < N; ++t)
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(acts[t].d[8 * sb])), _mm512_cvtepi32_ps(isum[t]), acc[t]);
        }
        for (int t = 0; t < N; ++t) _mm512_storeu_ps(out + t * ldo + 16 * p, _mm512_sub_ps(acc[t], corr[t]));
    }
}
#endif

template <int N>
static void gemv_q4kx8_n(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, float* out,
                         int64_t ldo) {
    int64_t g = 0;
#if defined(HMOE_AVX512)
    if constexpr (N >= 3) {
        g = nrows / 16 * 2;
        gemv_q4kx8_pairs<N>(w, row0, g / 2, K, acts, out, ldo);
    }
#endif
    gemv_q4kx8_groups<N>(w, row0, g, nrows / 8, K, acts, out, ldo);
}

// q8_0x8: eight rows per vector as above, signed codes. Per chunk (four codes of each row)
// and token: |w| x (a with w's sign) into int16 pairs and at once into int32 (two 8-bit
// products fill an int16: no room to add chunks first), then one FMA per block with the
// eight rows' scales.
template <int N>
static void gemv_x8q8_n(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, float* out,
                        int64_t ldo) {
    const int64_t nb = K / 32;
    for (int64_t g = 0; g < nrows / 8; ++g) {
        const uint8_t* blk = w.data + (row0 / 8 + g) * w.row_stride;
        __m256 acc[N];
        for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b, blk += kQ8X8BlockBytes) {
            prefetch_span<kPrefetchTo>(blk + kPrefetchAhead, kQ8X8BlockBytes);
            const __m256 dw = load8_as_ps<FMT_F16>(blk, 0);
            __m256i s32[N];
            for (int t = 0; t < N; ++t) s32[t] = _mm256_setzero_si256();
            for (int c = 0; c < 8; ++c) {
                const __m256i wc = load32(blk + 16 + 32 * c);
                const __m256i aw = _mm256_sign_epi8(wc, wc);
                for (int t = 0; t < N; ++t)
                    s32[t] = dot_u8s8(s32[t], aw, _mm256_sign_epi8(bcast4(acts[t].q + 32 * b + 4 * c), wc));
            }
            for (int t = 0; t < N; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(acts[t].d[b])), _mm256_cvtepi32_ps(s32[t]), acc[t]);
        }
        for (int t = 0; t < N; ++t) _mm256_storeu_ps(out + t * ldo + 8 * g, acc[t]);
    }
}

template <int N>
struct Q8X8G {
    static void run(const MatrixRef& w, int64_t r0, int64_t n, int64_t K, const Q8Row* a, float* o, int64_t l) {
        gemv_x8q8_n<N>(w, r0, n, K, a, o, l);
    }
};

static void gemv_q8_q8x8(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                         float* out, int64_t ldo) {
    by_tokens<Q8X8G>(w, row0, nrows, K, acts, ntok, out, ldo);
}

template <int N>
struct Q4KX8G {
    static void run(const MatrixRef& w, int64_t r0, int64_t n, int64_t K, const Q8Row* a, float* o, int64_t l) {
        gemv_q4kx8_n<N>(w, r0, n, K, a, o, l);
    }
};

static void gemv_q8_q4kx8(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                          float* out, int64_t ldo) {
    by_tokens<Q4KX8G>(w, row0, nrows, K, acts, ntok, out, ldo);
}

#if defined(HMOE_AVX512)
// T tokens over a decoded panel of sixteen rows (gemm_x8nl_512): each block's eight code
// vectors loaded once for the T tokens, whose sums and accumulators stay in registers; per
// token the GEMV's steps in the GEMV's order.
template <int T>
static inline void x8nl_panel_tokens(const __m512i* codes, const __m512* scales, int64_t nb, const Q8Row* acts,
                                     const int32_t* offsets, float* out, int64_t ldo, int64_t pair) {
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i v[8];
        for (int i = 0; i < 8; ++i) v[i] = _mm512_load_si512(codes + 8 * b + i);
        const __m512 dw = scales[b];
        for (int t = 0; t < T; ++t) {
            const int8_t* a = acts[t].q + 32 * b;
            const auto bcast = [](const int8_t* p) {
                int32_t x;
                std::memcpy(&x, p, 4);
                return _mm512_set1_epi32(x);
            };
            __m512i s32 = _mm512_set1_epi32(offsets[t * nb + b]);
            for (int c = 0; c < 4; ++c) {
                s32 = _mm512_dpbusd_epi32(s32, v[2 * c], bcast(a + 4 * c));
                s32 = _mm512_dpbusd_epi32(s32, v[2 * c + 1], bcast(a + 16 + 4 * c));
            }
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(acts[t].d[b])), _mm512_cvtepi32_ps(s32), acc[t]);
        }
    }
    for (int t = 0; t < T; ++t) {
        _mm256_storeu_ps(out + t * ldo, _mm512_castps512_ps256(acc[t]));
        if (pair == 2) _mm256_storeu_ps(out + t * ldo + 8, _mm512_extractf32x8_ps(acc[t], 1));
    }
}

// gemv_x8nl_n's many-token form (calls of more than four tokens: prompts), with its bits per
// token: two groups of eight rows a 512-bit vector, their blocks decoded once a call into a
// panel (K / 32 blocks of eight vectors and a scale vector, K x 16 bytes: 32 KiB at K = 2048),
// then per token and block the same offset, eight vpdpbusd and FMA as the GEMV, sixteen rows
// at a time and the activations broadcast from memory.
template <Format F>
static void gemm_x8nl_512(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                          float* out, int64_t ldo) {
    const int64_t nb = K / 32, groups = nrows / 8;
    const __m256i table = _mm256_add_epi8(iq4nl_table(), _mm256_set1_epi8(char(0x80)));
    thread_local std::vector<int32_t> offsets_buf;
    thread_local std::vector<__m512i> codes_buf;
    thread_local std::vector<__m512> scales_buf;
    offsets_buf.resize(size_t(ntok * nb));
    codes_buf.resize(size_t(8 * nb));
    scales_buf.resize(size_t(nb));
    for (int t = 0; t < ntok; ++t) offset_block_sums(acts[t].q, nb, offsets_buf.data() + t * nb);
    for (int64_t g = 0; g < groups; g += 2) {
        const int64_t pair = std::min<int64_t>(2, groups - g);
        // The panel: the low half of each vector group g's rows, the high half group g + 1's.
        for (int64_t b = 0; b < nb; ++b) {
            __m256i v[2][8];
            __m256 dw[2];
            for (int h = 0; h < 2; ++h) {
                if (h == pair) {  // one group left: zeros above it
                    for (int i = 0; i < 8; ++i) v[h][i] = _mm256_setzero_si256();
                    dw[h] = _mm256_setzero_ps();
                    continue;
                }
                dw[h] = x8nl_block<F>(w.data + (row0 / 8 + g + h) * w.row_stride, b, table, v[h]);
            }
            for (int i = 0; i < 8; ++i)
                codes_buf[size_t(8 * b + i)] = _mm512_inserti64x4(_mm512_castsi256_si512(v[0][i]), v[1][i], 1);
            scales_buf[size_t(b)] = _mm512_insertf32x8(_mm512_castps256_ps512(dw[0]), dw[1], 1);
        }
        int t0 = 0;
        for (; t0 + 4 <= ntok; t0 += 4)
            x8nl_panel_tokens<4>(codes_buf.data(), scales_buf.data(), nb, acts + t0, offsets_buf.data() + t0 * nb,
                                 out + t0 * ldo + 8 * g, ldo, pair);
        switch (ntok - t0) {
            case 1: x8nl_panel_tokens<1>(codes_buf.data(), scales_buf.data(), nb, acts + t0, offsets_buf.data() + t0 * nb,
                                         out + t0 * ldo + 8 * g, ldo, pair); break;
            case 2: x8nl_panel_tokens<2>(codes_buf.data(), scales_buf.data(), nb, acts + t0, offsets_buf.data() + t0 * nb,
                                         out + t0 * ldo + 8 * g, ldo, pair); break;
            case 3: x8nl_panel_tokens<3>(codes_buf.data(), scales_buf.data(), nb, acts + t0, offsets_buf.data() + t0 * nb,
                                         out + t0 * ldo + 8 * g, ldo, pair); break;
            default: break;
        }
    }
}
#endif

template <Format F>
struct X8NL {
    template <int N>
    struct G {
        static void run(const MatrixRef& w, int64_t r0, int64_t n, int64_t K, const Q8Row* a, float* o, int64_t l) {
            gemv_x8nl_n<F, N>(w, r0, n, K, a, o, l);
        }
    };
};

template <Format F>
static void gemv_q8_x8nl(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                         float* out, int64_t ldo) {
#if defined(HMOE_AVX512)
    if (ntok > kMaxGemvTokens) return gemm_x8nl_512<F>(w, row0, nrows, K, acts, ntok, out, ldo);
#endif
    by_tokens<X8NL<F>::template G>(w, row0, nrows, K, acts, ntok, out, ldo);
}

template <Format F>
struct X8 {
    template <int N>
    struct G {
        static void run(const MatrixRef& w, int64_t r0, int64_t n, int64_t K, const Q8Row* a, float* o, int64_t l) {
            gemv_x8_n<F, N>(w, r0, n, K, a, o, l);
        }
    };
};

template <Format F>
static void gemv_q8_x8(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                       float* out, int64_t ldo) {
    by_tokens<X8<F>::template G>(w, row0, nrows, K, acts, ntok, out, ldo);
}

// ---- decode: float formats with fp32 activations ----------------------------------------

template <Format F, int N>
static void gemv_float_n(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const float* const* x, float* out,
                         int64_t ldo) {
    const int64_t k16 = K / 16 * 16;
    for (int64_t r = 0; r < nrows; ++r) {
        const uint8_t* row = w.row(row0 + r);
        __m256 acc[N][2];
        for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k < k16; k += 16) {
            // 16-bit weights: a line 1 KiB ahead every other step (cold, 2048 x 2048 bf16, one
            // and two threads: 0.84-0.86 -> 0.94-0.99 of the probe). fp32 streams fast enough
            // without: prefetching made it slower (1.00 -> 0.92).
            if constexpr (F != FMT_F32)
                if (k % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(row + 2 * k + kPrefetchAhead), kPrefetchTo);
            const __m256 w0 = load8_as_ps<F>(row, k), w1 = load8_as_ps<F>(row, k + 8);
            for (int t = 0; t < N; ++t) {
                acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[t] + k), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[t] + k + 8), acc[t][1]);
            }
        }
        float wt[16];
        const int tail = int(K - k);
        if (tail) dequant_row_portable(F, w, row0 + r, k, tail, wt);
        for (int t = 0; t < N; ++t) {
            float v = hsum_ps(_mm256_add_ps(acc[t][0], acc[t][1]));
            for (int i = 0; i < tail; ++i) v += wt[i] * x[t][k + i];
            out[t * ldo + r] = v;
        }
    }
}

template <Format F>
static void gemv_float(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const float* const* x, int ntok,
                       float* out, int64_t ldo) {
    switch (ntok) {
        case 1: return gemv_float_n<F, 1>(w, row0, nrows, K, x, out, ldo);
        case 2: return gemv_float_n<F, 2>(w, row0, nrows, K, x, out, ldo);
        case 3: return gemv_float_n<F, 3>(w, row0, nrows, K, x, out, ldo);
        default: return gemv_float_n<F, 4>(w, row0, nrows, K, x, out, ldo);
    }
}

// out[t] += x[t][i] * row i, row by row: each row streams once for all tokens, the output
// stays in L1 (latent attention's kv_b halves: 512 floats a token).
template <Format F>
static void rows_axpy_t(const uint8_t* rows, int64_t stride, int64_t m, int64_t n, const float* const* x, int ntok,
                        float* const* out) {
    constexpr int64_t esz = F == FMT_F32 ? 4 : 2;
    const int64_t n8 = n / 8 * 8;
    for (int64_t i = 0; i < m; ++i) {
        const uint8_t* row = rows + i * stride;
        for (int64_t j = 0; j < n8; j += 8) {
            if ((j * esz) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(row + j * esz + kPrefetchAhead), _MM_HINT_T0);
            const __m256 w = load8_as_ps<F>(row, j);
            for (int t = 0; t < ntok; ++t)
                _mm256_storeu_ps(out[t] + j, _mm256_fmadd_ps(_mm256_set1_ps(x[t][i]), w, _mm256_loadu_ps(out[t] + j)));
        }
        if (n8 < n) {
            float wt[8];
            dequant_row_portable(F, MatrixRef{rows, nullptr, stride, 0}, i, n8, int(n - n8), wt);
            for (int t = 0; t < ntok; ++t)
                for (int64_t j = n8; j < n; ++j) out[t][j] += x[t][i] * wt[j - n8];
        }
    }
}

static void rows_axpy(Format fmt, const uint8_t* rows, int64_t stride, int64_t m, int64_t n, const float* const* x,
                      int ntok, float* const* out) {
    if (fmt == FMT_BF16) return rows_axpy_t<FMT_BF16>(rows, stride, m, n, x, ntok, out);
    if (fmt == FMT_F16) return rows_axpy_t<FMT_F16>(rows, stride, m, n, x, ntok, out);
    rows_axpy_t<FMT_F32>(rows, stride, m, n, x, ntok, out);
}

// ---- prefill: dequantize to a k-major panel ------------------------------------------------

// 32 int8 values (element order) times d, minus m, to 32 floats; d1 and m1 serve the second
// 16 (q6_k, q3_k have a scale per 16, q2_k a scale and a min; everyone else passes the same).
static inline void store32(float* dst, __m256i q, float d, float d1, float m, float m1) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m256 vd = _mm256_set1_ps(d), vd1 = _mm256_set1_ps(d1), vm = _mm256_set1_ps(m), vm1 = _mm256_set1_ps(m1);
    _mm256_storeu_ps(dst, _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), vd, vm));
    _mm256_storeu_ps(dst + 8, _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), vd, vm));
    _mm256_storeu_ps(dst + 16, _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), vd1, vm1));
    _mm256_storeu_ps(dst + 24, _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), vd1, vm1));
}
static inline void store32(float* dst, __m256i q, float d, float d1, float m) { store32(dst, q, d, d1, m, m); }

// The i-quant super-blocks through their GEMV's unpacking (kernels_iq.inl): value = (d x the
// integer scale) x w, which is ggml's float arithmetic (the block scale rounded once, then
// the product; iq1's 8g +- 1 against its d / 8 likewise): the bits of the portable dequantizing.
template <Format F>
static void dequant_iq_row(const uint8_t* row, int64_t k0, int kc, float* dst) {
    for (int64_t sb = k0 / 256; sb < (k0 + kc) / 256; ++sb) {
        const IqBlock<F> blk(row + sb * kFormats[F].block_bytes);
        const float d = blk.d();
        float* o = dst + (sb * 256 - k0);
        for (int ib = 0; ib < 8; ++ib) {
            const IqQuarter q = blk.quarter(ib);
            const float lo = d * float(int16_t(_mm256_extract_epi16(q.scale, 0)));
            const float hi = d * float(int16_t(_mm256_extract_epi16(q.scale, 8)));
            store32(o + 32 * ib, with_signs(q.mag, q.sign), lo, hi, 0.f);
        }
    }
}

static void dequant_row_simd(Format fmt, const MatrixRef& w, int64_t r, int64_t k0, int kc, float* dst) {
    const uint8_t* row = w.row(r);
    const uint8_t* srow = w.scales ? w.scale_row(r) : nullptr;
    switch (fmt) {
        case FMT_Q8_0:
        case FMT_Q4_0:
        case FMT_Q5_0:
        case FMT_INT4_G32:
        case FMT_MXFP4:
        case FMT_MXFP4_HF:
            for (int64_t b = k0 / 32; b < (k0 + kc) / 32; ++b) {
                float* o = dst + (b * 32 - k0);
                switch (fmt) {
                    case FMT_Q8_0: {
                        const float d = Block32<FMT_Q8_0>::scale(row, srow, b);
                        store32(o, Block32<FMT_Q8_0>::codes(row, b), d, d, 0.f);
                        break;
                    }
                    case FMT_Q4_0: {
                        const float d = Block32<FMT_Q4_0>::scale(row, srow, b);
                        store32(o, Block32<FMT_Q4_0>::codes(row, b), d, d, 8.f * d);
                        break;
                    }
                    case FMT_Q5_0: {
                        const float d = Block32<FMT_Q5_0>::scale(row, srow, b);
                        store32(o, Block32<FMT_Q5_0>::codes(row, b), d, d, 16.f * d);
                        break;
                    }
                    case FMT_INT4_G32: {
                        const float d = Block32<FMT_INT4_G32>::scale(row, srow, b);
                        store32(o, interleave_nibbles(Block32<FMT_INT4_G32>::codes(row, b)), d, d, 8.f * d);
                        break;
                    }
                    case FMT_MXFP4: {
                        const float d = Block32<FMT_MXFP4>::scale(row, srow, b);
                        store32(o, Block32<FMT_MXFP4>::codes(row, b), d, d, 0.f);
                        break;
                    }
                    default: {
                        const float d = Block32<FMT_MXFP4_HF>::scale(row, srow, b);
                        store32(o, interleave_nibbles(Block32<FMT_MXFP4_HF>::codes(row, b)), d, d, 0.f);
                        break;
                    }
                }
            }
            return;
        case FMT_Q4_K:
        case FMT_Q5_K: {
            const bool five = fmt == FMT_Q5_K;
            for (int64_t sb = k0 / 256; sb < (k0 + kc) / 256; ++sb) {
                const uint8_t* blk = row + sb * (five ? 176 : 144);
                const float d = h2f(blk), dmin = h2f(blk + 2);
                uint8_t sc[8], mn[8];
                k_scales_mins(blk + 4, sc, mn);
                __m256i q[8];
                if (five)
                    kquant_codes<true>(blk, q);
                else
                    kquant_codes<false>(blk, q);
                float* o = dst + (sb * 256 - k0);
                for (int j = 0; j < 8; ++j) {
                    const float dl = d * float(sc[j]);
                    store32(o + 32 * j, q[j], dl, dl, dmin * float(mn[j]));
                }
            }
            return;
        }
        case FMT_Q6_K:
            for (int64_t sb = k0 / 256; sb < (k0 + kc) / 256; ++sb) {
                const uint8_t* blk = row + sb * 210;
                const float d = h2f(blk + 208);
                const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
                __m256i q[8];
                q6k_codes(blk, q);
                float* o = dst + (sb * 256 - k0);
                for (int j = 0; j < 8; ++j)
                    store32(o + 32 * j, _mm256_sub_epi8(q[j], _mm256_set1_epi8(32)), d * float(sc[2 * j]),
                            d * float(sc[2 * j + 1]), 0.f);
            }
            return;
        case FMT_Q3_K:
        case FMT_Q2_K: {
            const bool three = fmt == FMT_Q3_K;
            for (int64_t sb = k0 / 256; sb < (k0 + kc) / 256; ++sb) {
                const uint8_t* blk = row + sb * (three ? 110 : 84);
                float* o = dst + (sb * 256 - k0);
                if (three) {
                    alignas(16) int8_t sc[16];
                    _mm_store_si128(reinterpret_cast<__m128i*>(sc), q3k_scales16(blk + 96));
                    const float d = h2f(blk + 108);
                    __m256i q[8];
                    q23k_codes<true>(blk, q);
                    for (int j = 0; j < 8; ++j)
                        store32(o + 32 * j, _mm256_sub_epi8(q[j], _mm256_set1_epi8(4)), d * float(sc[2 * j]),
                                d * float(sc[2 * j + 1]), 0.f);
                } else {
                    const float d = h2f(blk + 80), dmin = h2f(blk + 82);
                    __m256i q[8];
                    q23k_codes<false>(blk, q);
                    for (int j = 0; j < 8; ++j) {
                        const uint8_t lo = blk[2 * j], hi = blk[2 * j + 1];  // scale and min of each 16
                        store32(o + 32 * j, q[j], d * float(lo & 0x0F), d * float(hi & 0x0F), dmin * float(lo >> 4),
                                dmin * float(hi >> 4));
                    }
                }
            }
            return;
        }
        case FMT_BF16:
        case FMT_F16:
        case FMT_F32: {
            int i = 0;
            for (; i + 8 <= kc; i += 8) {
                __m256 v;
                if (fmt == FMT_BF16)
                    v = load8_as_ps<FMT_BF16>(row, k0 + i);
                else if (fmt == FMT_F16)
                    v = load8_as_ps<FMT_F16>(row, k0 + i);
                else
                    v = load8_as_ps<FMT_F32>(row, k0 + i);
                _mm256_storeu_ps(dst + i, v);
            }
            if (i < kc) dequant_row_portable(fmt, w, r, k0 + i, kc - i, dst + i);
            return;
        }
        case FMT_IQ4_XS: return dequant_iq_row<FMT_IQ4_XS>(row, k0, kc, dst);
        case FMT_IQ2_XXS: return dequant_iq_row<FMT_IQ2_XXS>(row, k0, kc, dst);
        case FMT_IQ2_XS: return dequant_iq_row<FMT_IQ2_XS>(row, k0, kc, dst);
        case FMT_IQ2_S: return dequant_iq_row<FMT_IQ2_S>(row, k0, kc, dst);
        case FMT_IQ3_XXS: return dequant_iq_row<FMT_IQ3_XXS>(row, k0, kc, dst);
        case FMT_IQ3_S: return dequant_iq_row<FMT_IQ3_S>(row, k0, kc, dst);
        case FMT_IQ1_S: return dequant_iq_row<FMT_IQ1_S>(row, k0, kc, dst);
        case FMT_IQ1_M: return dequant_iq_row<FMT_IQ1_M>(row, k0, kc, dst);
        default:
            dequant_row_portable(fmt, w, r, k0, kc, dst);
    }
}

// 8 rows of 8 floats -> 8 columns (the classic unpack / shuffle / lane-swap transpose).
static inline void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
    __m256 r[8], t[8], s[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        s[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
    }
}

// Code chunk c of an iq4_nl block of eight rows (iq4_nlx8, iq4_xsx8) into a panel's k-major
// rows: the table values, byte i sign-extended as in q8_0x8's, times the rows' scales.
static inline void nl_chunk_to_panel(__m256i raw, __m256 dw, float* o, int c) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_shuffle_epi8(iq4nl_table(), _mm256_and_si256(raw, nib));
    const __m256i hi = _mm256_shuffle_epi8(iq4nl_table(), _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib));
    for (int i = 0; i < 4; ++i) {
        const auto byte = [i](__m256i x) {
            return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sllv_epi32(x, _mm256_set1_epi32(24 - 8 * i)), 24));
        };
        _mm256_storeu_ps(o + int64_t(4 * c + i) * kPanel, _mm256_mul_ps(byte(lo), dw));
        _mm256_storeu_ps(o + int64_t(16 + 4 * c + i) * kPanel, _mm256_mul_ps(byte(hi), dw));
    }
}

static void dequant_panel_iq4xsx8(const MatrixRef& w, int64_t row0, int nrows, int64_t k0, int kc, float* dst) {
    for (int g = 0; g < kPanel / 8; ++g) {
        if (8 * g >= nrows) {
            for (int k = 0; k < kc; ++k) _mm256_storeu_ps(dst + int64_t(k) * kPanel + 8 * g, _mm256_setzero_ps());
            continue;
        }
        const uint8_t* sblk = w.data + (row0 / 8 + g) * w.row_stride + (k0 / 256) * kIq4XsX8Bytes;
        for (int sb = 0; sb < kc / 256; ++sb, sblk += kIq4XsX8Bytes) {
            const __m256 d = load8_as_ps<FMT_F16>(sblk, 0);
            for (int j = 0; j < 8; ++j) {
                const __m256 dw = iq4xs_x8_scales(sblk, d, j);
                float* o = dst + int64_t(256 * sb + 32 * j) * kPanel + 8 * g;
                for (int c = 0; c < 4; ++c) nl_chunk_to_panel(load32(sblk + 64 + 128 * j + 32 * c), dw, o, c);
            }
        }
    }
}

// The x8 layouts are already row-interleaved: byte i of a code chunk's lanes is one column
// of eight rows, so a shift, a mask and a convert give a k-major row of the panel directly
// (no transpose).
template <Format F>
static void dequant_panel_x8(const MatrixRef& w, int64_t row0, int nrows, int64_t k0, int kc, float* dst) {
    const __m256i m4 = _mm256_set1_epi32(0x0F);
    for (int g = 0; g < kPanel / 8; ++g) {
        if (8 * g >= nrows) {
            for (int k = 0; k < kc; ++k) _mm256_storeu_ps(dst + int64_t(k) * kPanel + 8 * g, _mm256_setzero_ps());
            continue;
        }
        const uint8_t* blk = w.data + (row0 / 8 + g) * w.row_stride + (k0 / 32) * kX8BlockBytes;
        for (int b = 0; b < kc / 32; ++b, blk += kX8BlockBytes) {
            const __m256 dw = x8_scales<F>(blk);
            const __m256 off = _mm256_mul_ps(dw, _mm256_set1_ps(8.f));
            float* o = dst + int64_t(32 * b) * kPanel + 8 * g;
            for (int c = 0; c < 4; ++c) {
                const __m256i raw = load32(blk + 16 + 32 * c);
                if constexpr (F == FMT_IQ4_NL_X8) {
                    nl_chunk_to_panel(raw, dw, o, c);
                    continue;
                }
                for (int i = 0; i < 4; ++i) {
                    const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(raw, 8 * i), m4);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(raw, 8 * i + 4), m4);
                    _mm256_storeu_ps(o + int64_t(4 * c + i) * kPanel, _mm256_fmsub_ps(_mm256_cvtepi32_ps(lo), dw, off));
                    _mm256_storeu_ps(o + int64_t(16 + 4 * c + i) * kPanel, _mm256_fmsub_ps(_mm256_cvtepi32_ps(hi), dw, off));
                }
            }
        }
    }
}

// q8_0x8: byte i of each 32-bit lane is code 4c + i of that lane's row; shifting it to the
// top and back down arithmetically sign-extends it.
static void dequant_panel_q8x8(const MatrixRef& w, int64_t row0, int nrows, int64_t k0, int kc, float* dst) {
    for (int g = 0; g < kPanel / 8; ++g) {
        if (8 * g >= nrows) {
            for (int k = 0; k < kc; ++k) _mm256_storeu_ps(dst + int64_t(k) * kPanel + 8 * g, _mm256_setzero_ps());
            continue;
        }
        const uint8_t* blk = w.data + (row0 / 8 + g) * w.row_stride + (k0 / 32) * kQ8X8BlockBytes;
        for (int b = 0; b < kc / 32; ++b, blk += kQ8X8BlockBytes) {
            const __m256 dw = load8_as_ps<FMT_F16>(blk, 0);
            float* o = dst + int64_t(32 * b) * kPanel + 8 * g;
            for (int c = 0; c < 8; ++c) {
                const __m256i raw = load32(blk + 16 + 32 * c);
                _mm256_storeu_ps(o + int64_t(4 * c) * kPanel,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(raw, 24), 24)), dw));
                _mm256_storeu_ps(o + int64_t(4 * c + 1) * kPanel,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(raw, 16), 24)), dw));
                _mm256_storeu_ps(o + int64_t(4 * c + 2) * kPanel,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(raw, 8), 24)), dw));
                _mm256_storeu_ps(o + int64_t(4 * c + 3) * kPanel,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(raw, 24)), dw));
            }
        }
    }
}

static void dequant_panel_q4kx8(const MatrixRef& w, int64_t row0, int nrows, int64_t k0, int kc, float* dst) {
    const __m256i m4 = _mm256_set1_epi32(0x0F);
    for (int g = 0; g < kPanel / 8; ++g) {
        if (8 * g >= nrows) {
            for (int k = 0; k < kc; ++k) _mm256_storeu_ps(dst + int64_t(k) * kPanel + 8 * g, _mm256_setzero_ps());
            continue;
        }
        const uint8_t* blk = w.data + (row0 / 8 + g) * w.row_stride + (k0 / 256) * kQ4KX8Bytes;
        for (int sb = 0; sb < kc / 256; ++sb, blk += kQ4KX8Bytes) {
            const __m256 d = load8_as_ps<FMT_F16>(blk, 0);
            const __m256 dmin = load8_as_ps<FMT_F16>(blk + 16, 0);
            for (int j = 0; j < 8; ++j) {
                const __m256 dl = _mm256_mul_ps(d, rows8_u8_ps(blk + 32 + 8 * j));
                const __m256 ml = _mm256_mul_ps(dmin, rows8_u8_ps(blk + 96 + 8 * j));
                float* o = dst + int64_t(256 * sb + 32 * j) * kPanel + 8 * g;
                for (int v = 0; v < 8; ++v) {
                    const __m256i raw = _mm256_srli_epi32(load32(blk + 160 + (8 * (j / 2) + v) * 32), 4 * (j & 1));
                    for (int i = 0; i < 4; ++i) {
                        const __m256i q = _mm256_and_si256(_mm256_srli_epi32(raw, 8 * i), m4);
                        _mm256_storeu_ps(o + int64_t(4 * v + i) * kPanel, _mm256_fmsub_ps(_mm256_cvtepi32_ps(q), dl, ml));
                    }
                }
            }
        }
    }
}

static void dequant_panel(Format fmt, const MatrixRef& w, int64_t row0, int nrows, int64_t k0, int kc, float* dst,
                          float* tmp) {
    if (fmt == FMT_Q4_K_X8) return dequant_panel_q4kx8(w, row0, nrows, k0, kc, dst);
    if (fmt == FMT_Q8_0_X8) return dequant_panel_q8x8(w, row0, nrows, k0, kc, dst);
    if (fmt == FMT_Q4_0_X8) return dequant_panel_x8<FMT_Q4_0_X8>(w, row0, nrows, k0, kc, dst);
    if (fmt == FMT_INT4_X8) return dequant_panel_x8<FMT_INT4_X8>(w, row0, nrows, k0, kc, dst);
    if (fmt == FMT_IQ4_NL_X8) return dequant_panel_x8<FMT_IQ4_NL_X8>(w, row0, nrows, k0, kc, dst);
    if (fmt == FMT_IQ4_XS_X8) return dequant_panel_iq4xsx8(w, row0, nrows, k0, kc, dst);
    // Rows of tmp are kc + 16 floats apart: with a power-of-two stride (kc = 2048: 8 KiB) all
    // rows would fall into the same L1 sets and the transpose's eight loads would evict one
    // another; one extra cache line per row staggers them.
    const int64_t ld = kc + 16;
    for (int r = 0; r < nrows; ++r) dequant_row_simd(fmt, w, row0 + r, k0, kc, tmp + r * ld);
    for (int r = nrows; r < kPanel; ++r) std::memset(tmp + r * ld, 0, size_t(kc) * 4);
    const int k8 = kc / 8 * 8;
    for (int k = 0; k < k8; k += 8)
        for (int g = 0; g < kPanel / 8; ++g) transpose8(tmp + 8 * g * ld + k, ld, dst + int64_t(k) * kPanel + 8 * g, kPanel);
    for (int k = k8; k < kc; ++k)
        for (int r = 0; r < kPanel; ++r) dst[int64_t(k) * kPanel + r] = tmp[r * ld + k];
}

// ---- prefill: the register-blocked GEMM ----------------------------------------------------

// The accumulators are named variables, not an array: GCC keeps an array of vectors in
// memory when it cannot prove the loops fully unrolled, and a store per FMA halves the
// kernel's speed. Rows beyond MR are compiled away by `if constexpr`.
#define HMOE_ACC_ROW(i) VEC c##i##a = VZERO(), c##i##b = VZERO()
#define HMOE_FMA_ROW(i)                                 \
    if constexpr (MR > i) {                             \
        const VEC av = VBCAST(a[i] + k);                \
        c##i##a = VFMADD(av, w0, c##i##a);              \
        c##i##b = VFMADD(av, w1, c##i##b);              \
    }
#define HMOE_STORE_ROW(i)                                                  \
    if constexpr (MR > i) {                                                \
        float* cr = c + i * ldc;                                           \
        VSTORE(cr, VADD(VLOAD(cr), c##i##a));                              \
        VSTORE(cr + VW, VADD(VLOAD(cr + VW), c##i##b));                    \
    }

#if defined(HMOE_AVX512)
#define VEC __m512
#define VZERO _mm512_setzero_ps
#define VBCAST(p) _mm512_set1_ps(*(p))
#define VFMADD _mm512_fmadd_ps
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VADD _mm512_add_ps
constexpr int VW = 16;
#else
#define VEC __m256
#define VZERO _mm256_setzero_ps
#define VBCAST(p) _mm256_broadcast_ss(p)
#define VFMADD _mm256_fmadd_ps
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VADD _mm256_add_ps
constexpr int VW = 8;
#endif

// C[0..MR) x [0..2 VW) += A[0..MR) x [k] * W[k] x [0..2 VW): one panel, kMr <= 8 tokens.
template <int MR>
static inline void micro(const float* const* a, const float* w, int kc, float* c, int64_t ldc) {
    HMOE_ACC_ROW(0); HMOE_ACC_ROW(1); HMOE_ACC_ROW(2); HMOE_ACC_ROW(3);
    HMOE_ACC_ROW(4); HMOE_ACC_ROW(5); HMOE_ACC_ROW(6); HMOE_ACC_ROW(7);
    for (int k = 0; k < kc; ++k) {
        const VEC w0 = VLOAD(w + 2 * VW * k), w1 = VLOAD(w + 2 * VW * k + VW);
        HMOE_FMA_ROW(0) HMOE_FMA_ROW(1) HMOE_FMA_ROW(2) HMOE_FMA_ROW(3)
        HMOE_FMA_ROW(4) HMOE_FMA_ROW(5) HMOE_FMA_ROW(6) HMOE_FMA_ROW(7)
    }
    HMOE_STORE_ROW(0) HMOE_STORE_ROW(1) HMOE_STORE_ROW(2) HMOE_STORE_ROW(3)
    HMOE_STORE_ROW(4) HMOE_STORE_ROW(5) HMOE_STORE_ROW(6) HMOE_STORE_ROW(7)
}

#undef HMOE_ACC_ROW
#undef HMOE_FMA_ROW
#undef HMOE_STORE_ROW
#undef VEC
#undef VZERO
#undef VBCAST
#undef VFMADD
#undef VLOAD
#undef VSTORE
#undef VADD

template <int MR>
static void micro_panels(const float* const* a, const float* w, int npanels, int kc, float* c, int64_t ldc) {
    for (int p = 0; p < npanels; ++p) micro<MR>(a, w + int64_t(p) * kc * kPanel, kc, c + p * kPanel, ldc);
}

static void gemm_panels(const float* const* a, int m, const float* w, int npanels, int kc, float* c, int64_t ldc) {
    // Token groups outside, panels inside: the group's kMr activation rows (kMr x kc floats)
    // stay in L1 while every panel of the block streams past them from L2.
    int i = 0;
    for (; i + kMr <= m; i += kMr) micro_panels<kMr>(a + i, w, npanels, kc, c + i * ldc, ldc);
    switch (m - i) {
        case 1: micro_panels<1>(a + i, w, npanels, kc, c + i * ldc, ldc); break;
        case 2: micro_panels<2>(a + i, w, npanels, kc, c + i * ldc, ldc); break;
        case 3: micro_panels<3>(a + i, w, npanels, kc, c + i * ldc, ldc); break;
        case 4: micro_panels<4>(a + i, w, npanels, kc, c + i * ldc, ldc); break;
        case 5: micro_panels<5>(a + i, w, npanels, kc, c + i * ldc, ldc); break;
#if defined(HMOE_AVX512)
        case 6: micro_panels<6>(a + i, w, npanels, kc, c + i * ldc, ldc); break;
        case 7: micro_panels<7>(a + i, w, npanels, kc, c + i * ldc, ldc); break;
#endif
        default: break;
    }
}

// ---- activations ----------------------------------------------------------------------------

// The largest |x[i]| of n (a multiple of 32) floats, NaN where one is (as abs_max).
static inline float amax_ps(const float* x, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return std::numeric_limits<float>::quiet_NaN();
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static void quantize(const float* x, int64_t K, int v, int8_t* q, float* d, float* s) {
    const bool deint = act_variant_permuted(v), sum_f16 = act_variant_sum_f16(v);
    const int group = act_variant_group(v);
    // Byte order after the two packs, fixed by one dword permute: packs work per 128-bit half.
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    // Even elements of each 16 first, then odd ones (within each 128-bit half) ...
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                                                12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    float db = 0.f, d32 = 0.f;
    __m256 id = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 32; ++b) {
        if ((32 * b) % group == 0) {
            const ActScale a = act_scale(amax_ps(x + 32 * b, group), group);
            db = a.d, d32 = a.d32;
            id = _mm256_set1_ps(a.id);
        }
        __m256i iv[4];
        for (int i = 0; i < 4; ++i)  // round to nearest even
            iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * b + 8 * i), id));
        const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
        const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
        __m256i q8 = _mm256_permutevar8x32_epi32(p16, order);
        if (deint) {
            // ... then the 8-byte groups as [even 0-15, even 16-31, odd 0-15, odd 16-31].
            q8 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(q8, evens_odds), 0xD8);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), q8);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        d[b] = db;
        s[b] = block_sum(db, d32, _mm_cvtsi128_si32(s4), sum_f16);
    }
}

// e^x for x in about [-87, 88]: 2^n * e^r with n = round(x / ln 2), |r| <= ln2 / 2 split off
// in two steps (Cody-Waite: ln 2 as a short high part plus a correction, so n * ln2_hi
// is exact), then a degree-6 Taylor polynomial (relative error < 2e-7 on that range).
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    // 2^n by building the exponent field directly (n is in [-126, 127] after the clamp).
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float exp_scalar(float x) {
    float v[8] = {x, 0, 0, 0, 0, 0, 0, 0};
    _mm256_storeu_ps(v, exp_ps(_mm256_loadu_ps(v)));
    return v[0];
}

static void silu_mul(const float* g, const float* u, float* h, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; ++i) h[i] = g[i] / (1.f + exp_scalar(-g[i])) * u[i];
}

static void gptoss_glu(const float* g, const float* u, float* h, int64_t n, float alpha, float limit) {
    const __m256 one = _mm256_set1_ps(1.f), lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit);
    const __m256 nalpha = _mm256_set1_ps(-alpha);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_min_ps(_mm256_loadu_ps(g + i), lim);
        const __m256 uv = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(u + i), nlim), lim);
        const __m256 glu = _mm256_div_ps(gv, _mm256_add_ps(one, exp_ps(_mm256_mul_ps(nalpha, gv))));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(_mm256_add_ps(uv, one), glu));
    }
    for (; i < n; ++i) {
        const float gc = g[i] < limit ? g[i] : limit;
        const float uc = u[i] < -limit ? -limit : (u[i] > limit ? limit : u[i]);
        h[i] = (uc + 1.f) * (gc / (1.f + exp_scalar(-alpha * gc)));
    }
}

// ---- decode attention -------------------------------------------------------------------

// Cache elements as floats: KV is the cache's type (FMT_F32, FMT_BF16 or FMT_F16).
template <Format KV>
static inline __m256 kv8(const void* base, int64_t i) {
    if constexpr (KV == FMT_F32) {
        return _mm256_loadu_ps(static_cast<const float*>(base) + i);
    } else {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
        if constexpr (KV == FMT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        else return _mm256_cvtph_ps(h);
    }
}

// Software prefetch spread over a loop: each step() asks for the next `per` cache lines of
// [p, p + 64 * lines).
struct PrefetchStream {
    const char* p = nullptr;
    int64_t lines = 0;
    int64_t per = 0;
    PrefetchStream() = default;
    PrefetchStream(const void* start, int64_t bytes, int64_t steps)
        : p(static_cast<const char*>(start)), lines((bytes + 63) / 64), per((lines + steps - 1) / steps) {}
    template <_mm_hint Hint>
    void step() {
        for (int64_t i = 0; i < per && lines > 0; ++i, --lines, p += 64) _mm_prefetch(p, Hint);
    }
};

// Two positions per step: 2 x G independent accumulator chains, enough to cover the FMA
// latency (with one position the G chains waited on each other's latency, measured 2x slower).
// Given `next_k` and `v`, each step also prefetches a share of the next stretch's keys into L1
// and of `v` (values) into L2 (see attend_scores_t).
template <Format KV, int G>
static void attend_scores(const float* q, int64_t D, const void* k, int64_t ldk, int64_t n, float* sc, int64_t ld_sc,
                          PrefetchStream* next_k = nullptr, PrefetchStream* v = nullptr) {
    const int64_t D8 = D / 8 * 8;
    int64_t s = 0;
    for (; s + 2 <= n; s += 2) {
        if (v) {
            next_k->step<_MM_HINT_T0>();
            v->step<_MM_HINT_T1>();
        }
        const int64_t r0 = s * ldk, r1 = r0 + ldk;
        __m256 a[G], b[G];
        for (int j = 0; j < G; ++j) a[j] = b[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D8; d += 8) {
            const __m256 k0 = kv8<KV>(k, r0 + d), k1 = kv8<KV>(k, r1 + d);
            for (int j = 0; j < G; ++j) {
                const __m256 qv = _mm256_loadu_ps(q + j * D + d);
                a[j] = _mm256_fmadd_ps(qv, k0, a[j]);
                b[j] = _mm256_fmadd_ps(qv, k1, b[j]);
            }
        }
        if constexpr (G == 4) {
            if (D8 == D) {
                alignas(32) float r[8];
                _mm256_store_ps(r, hsum8_ps(a[0], b[0], a[1], b[1], a[2], b[2], a[3], b[3]));
                for (int j = 0; j < 4; ++j) {
                    sc[j * ld_sc + s] = r[j];
                    sc[j * ld_sc + s + 1] = r[4 + j];
                }
                continue;
            }
        }
        for (int j = 0; j < G; ++j) {
            float d0 = hsum_ps(a[j]), d1 = hsum_ps(b[j]);
            for (int64_t d = D8; d < D; ++d) {
                d0 += q[j * D + d] * cache_at(k, KV, r0 + d);
                d1 += q[j * D + d] * cache_at(k, KV, r1 + d);
            }
            sc[j * ld_sc + s] = d0;
            sc[j * ld_sc + s + 1] = d1;
        }
    }
    for (; s < n; ++s) {
        const int64_t row = s * ldk;
        __m256 a[G];
        for (int j = 0; j < G; ++j) a[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D8; d += 8) {
            const __m256 kv = kv8<KV>(k, row + d);
            for (int j = 0; j < G; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + d), kv, a[j]);
        }
        for (int j = 0; j < G; ++j) {
            float dot = hsum_ps(a[j]);
            for (int64_t d = D8; d < D; ++d) dot += q[j * D + d] * cache_at(k, KV, row + d);
            sc[j * ld_sc + s] = dot;
        }
    }
}

// P V of one stretch of positions for G <= 2 heads, added to acc [G, Dv]: 32 value columns
// (one cache line of a bf16 row) x G heads of accumulators while the stretch's positions
// stream past, so every row segment read is a whole line. Loading and storing the float
// accumulators between stretches leaves each one's chain of FMAs as it was: the same bits
// as one pass over all the positions.
template <Format KV, int G>
static void attend_values(const float* p, int64_t ld_p, int64_t Dv, const void* v, int64_t n, int64_t ldv,
                          float* acc, PrefetchStream* pf) {
    int64_t j0 = 0;
    for (; j0 + 32 <= Dv; j0 += 32) {
        __m256 a[G][4];
        for (int j = 0; j < G; ++j)
            for (int c = 0; c < 4; ++c) a[j][c] = _mm256_loadu_ps(acc + j * Dv + j0 + 8 * c);
        for (int64_t s = 0; s < n; ++s) {
            if (pf && j0 == 0) pf->step<_MM_HINT_T0>();  // spread over the first columns' pass
            const int64_t row = s * ldv + j0;
            const __m256 v0 = kv8<KV>(v, row), v1 = kv8<KV>(v, row + 8), v2 = kv8<KV>(v, row + 16),
                         v3 = kv8<KV>(v, row + 24);
            for (int j = 0; j < G; ++j) {
                const __m256 w = _mm256_broadcast_ss(p + j * ld_p + s);
                a[j][0] = _mm256_fmadd_ps(w, v0, a[j][0]);
                a[j][1] = _mm256_fmadd_ps(w, v1, a[j][1]);
                a[j][2] = _mm256_fmadd_ps(w, v2, a[j][2]);
                a[j][3] = _mm256_fmadd_ps(w, v3, a[j][3]);
            }
        }
        for (int j = 0; j < G; ++j)
            for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + j * Dv + j0 + 8 * c, a[j][c]);
    }
    for (; j0 + 8 <= Dv; j0 += 8) {
        __m256 a[G];
        for (int j = 0; j < G; ++j) a[j] = _mm256_loadu_ps(acc + j * Dv + j0);
        for (int64_t s = 0; s < n; ++s) {
            const __m256 vv = kv8<KV>(v, s * ldv + j0);
            for (int j = 0; j < G; ++j) a[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j * ld_p + s), vv, a[j]);
        }
        for (int j = 0; j < G; ++j) _mm256_storeu_ps(acc + j * Dv + j0, a[j]);
    }
    for (; j0 < Dv; ++j0)
        for (int j = 0; j < G; ++j) {
            float t = acc[j * Dv + j0];
            for (int64_t s = 0; s < n; ++s) t += p[j * ld_p + s] * cache_at(v, KV, s * ldv + j0);
            acc[j * Dv + j0] = t;
        }
}

#if defined(HMOE_AVX512)
// AVX-512: the same two passes on 512-bit vectors: scores four heads x four positions a step,
// values eight heads a pass. At the group sizes of the target models (4 to 16 query heads per
// KV head) decode attention is bound by its multiply-adds, not by the cache reads: group x D
// of them per key row and per value row. With 256-bit vectors it ran nearly as fast hot as
// cold (bf16 cache, 1024 positions, group 8, 2 threads of a Zen 5: 16.4 GB/s hot, 13.9 cold, a
// third of the bandwidth probe); with twice the lanes, each key and value row converted once
// per pass (not once per two and four heads) and the registers for more heads' accumulators,
// about 128 -> 75 us hot (with the changes below, 151 -> 100 cold). Eight heads x two
// positions of scores a step was 10-18 % slower than four x four, two x eight slower still.

// Sixteen elements of a cache row (f32, bf16 or f16) from i on as floats; with a mask, those of
// its set bits (the rest zero: a row's tail, read without touching past its end).
template <Format KV>
static inline __m512 kv16(const void* base, int64_t i) {
    if constexpr (KV == FMT_F32) {
        return _mm512_loadu_ps(static_cast<const float*>(base) + i);
    } else {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
        if constexpr (KV == FMT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        else return _mm512_cvtph_ps(h);
    }
}
template <Format KV>
static inline __m512 kv16(const void* base, int64_t i, __mmask16 m) {
    if constexpr (KV == FMT_F32) {
        return _mm512_maskz_loadu_ps(m, static_cast<const float*>(base) + i);
    } else {
        const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + i);
        if constexpr (KV == FMT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        else return _mm512_cvtph_ps(h);
    }
}

// The sums of sixteen vectors' lanes, transposed: lane 4k + e of the result is the sum of
// x[4e + k] (sum16_lane). Each sum's additions depend on its own vector only, so a dot product
// gets the same bits whichever vectors share the call.
static inline __m512 hsum16_ps(const __m512* x) {
    __m512 z[8], w[4], u[2];
    for (int i = 0; i < 8; ++i)  // 256-bit halves added: x[2i] into 128-bit lanes 0-1, x[2i + 1] into 2-3
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; ++i)  // 128-bit lanes added: lane e of w[i] holds x[4i + e]
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i)  // pairs of floats in each lane
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44), _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
}
constexpr int sum16_lane(int i) { return 4 * (i % 4) + i / 4; }

// attend_scores for G <= 4 heads and P positions per step (G x P <= 16 accumulators of 16 lanes,
// x[P j + p]: head j at position s + p); positions past the stretch read its last row.
template <Format KV, int G, int P = 16 / G>
static void attend_scores16(const float* q, int64_t D, const void* k, int64_t ldk, int64_t n, float* sc, int64_t ld_sc,
                            PrefetchStream* next_k, PrefetchStream* v) {
    const int64_t D16 = D / 16 * 16;
    const __mmask16 tail = __mmask16((1u << (D - D16)) - 1);
    for (int64_t s = 0; s < n; s += P) {
        if (v) {
            for (int p = 0; p < P; p += 2) {
                next_k->step<_MM_HINT_T0>();
                v->step<_MM_HINT_T1>();
            }
        }
        int64_t r[P];
        for (int p = 0; p < P; ++p) r[p] = std::min(s + p, n - 1) * ldk;
        __m512 x[16];
        for (int i = 0; i < 16; ++i) x[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D16; d += 16) {
            __m512 kk[P];
            for (int p = 0; p < P; ++p) kk[p] = kv16<KV>(k, r[p] + d);
            for (int j = 0; j < G; ++j) {
                const __m512 qv = _mm512_loadu_ps(q + j * D + d);
                for (int p = 0; p < P; ++p) x[P * j + p] = _mm512_fmadd_ps(qv, kk[p], x[P * j + p]);
            }
        }
        if (tail) {
            __m512 kk[P];
            for (int p = 0; p < P; ++p) kk[p] = kv16<KV>(k, r[p] + D16, tail);
            for (int j = 0; j < G; ++j) {
                const __m512 qv = _mm512_maskz_loadu_ps(tail, q + j * D + D16);
                for (int p = 0; p < P; ++p) x[P * j + p] = _mm512_fmadd_ps(qv, kk[p], x[P * j + p]);
            }
        }
        alignas(64) float out[16];
        _mm512_store_ps(out, hsum16_ps(x));
        for (int j = 0; j < G; ++j)
            for (int p = 0; p < P && s + p < n; ++p) sc[j * ld_sc + s + p] = out[sum16_lane(P * j + p)];
    }
}

// attend_values for G <= 8 heads: C vectors of 16 value columns per head (8 to 16
// accumulators), the value rows converted once for all G heads; a masked last vector for
// Dv's tail. Every column's chain of FMAs is the same however the columns are grouped.
template <Format KV, int G>
static void attend_values16(const float* p, int64_t ld_p, int64_t Dv, const void* v, int64_t n, int64_t ldv,
                            float* acc, PrefetchStream* pf) {
    constexpr int C = G <= 4 ? 4 : 2;
    int64_t j0 = 0;
    for (; j0 + 16 * C <= Dv; j0 += 16 * C) {
        __m512 a[G][C];
        for (int j = 0; j < G; ++j)
            for (int c = 0; c < C; ++c) a[j][c] = _mm512_loadu_ps(acc + j * Dv + j0 + 16 * c);
        for (int64_t s = 0; s < n; ++s) {
            if (pf && j0 == 0) pf->step<_MM_HINT_T0>();  // spread over the first columns' pass
            __m512 vv[C];
            for (int c = 0; c < C; ++c) vv[c] = kv16<KV>(v, s * ldv + j0 + 16 * c);
            for (int j = 0; j < G; ++j) {
                const __m512 w = _mm512_set1_ps(p[j * ld_p + s]);
                for (int c = 0; c < C; ++c) a[j][c] = _mm512_fmadd_ps(w, vv[c], a[j][c]);
            }
        }
        for (int j = 0; j < G; ++j)
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * Dv + j0 + 16 * c, a[j][c]);
    }
    for (; j0 < Dv; j0 += 16) {
        const __mmask16 m = Dv - j0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (Dv - j0)) - 1);
        __m512 a[G];
        for (int j = 0; j < G; ++j) a[j] = _mm512_maskz_loadu_ps(m, acc + j * Dv + j0);
        for (int64_t s = 0; s < n; ++s) {
            const __m512 vv = kv16<KV>(v, s * ldv + j0, m);
            for (int j = 0; j < G; ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * ld_p + s]), vv, a[j]);
        }
        for (int j = 0; j < G; ++j) _mm512_mask_storeu_ps(acc + j * Dv + j0, m, a[j]);
    }
}

// g (at most kScoreHeads, kValueHeads) heads of a stretch: the kernels above for that many.
template <Format KV>
static void scores_heads(int g, const float* q, int64_t D, const void* k, int64_t ldk, int64_t n, float* sc,
                         int64_t ld_sc, PrefetchStream* next_k, PrefetchStream* v) {
    switch (g) {
        case 4: return attend_scores16<KV, 4>(q, D, k, ldk, n, sc, ld_sc, next_k, v);
        case 3: return attend_scores16<KV, 3>(q, D, k, ldk, n, sc, ld_sc, next_k, v);
        case 2: return attend_scores16<KV, 2>(q, D, k, ldk, n, sc, ld_sc, next_k, v);
        default: return attend_scores16<KV, 1>(q, D, k, ldk, n, sc, ld_sc, next_k, v);
    }
}
template <Format KV>
static void values_heads(int g, const float* p, int64_t ld_p, int64_t Dv, const void* v, int64_t n, int64_t ldv,
                         float* acc, PrefetchStream* pf) {
    switch (g) {
        case 8: return attend_values16<KV, 8>(p, ld_p, Dv, v, n, ldv, acc, pf);
        case 7: return attend_values16<KV, 7>(p, ld_p, Dv, v, n, ldv, acc, pf);
        case 6: return attend_values16<KV, 6>(p, ld_p, Dv, v, n, ldv, acc, pf);
        case 5: return attend_values16<KV, 5>(p, ld_p, Dv, v, n, ldv, acc, pf);
        case 4: return attend_values16<KV, 4>(p, ld_p, Dv, v, n, ldv, acc, pf);
        case 3: return attend_values16<KV, 3>(p, ld_p, Dv, v, n, ldv, acc, pf);
        case 2: return attend_values16<KV, 2>(p, ld_p, Dv, v, n, ldv, acc, pf);
        default: return attend_values16<KV, 1>(p, ld_p, Dv, v, n, ldv, acc, pf);
    }
}
constexpr int kScoreHeads = 4, kValueHeads = 8;  // heads per pass of the kernels
#else
template <Format KV>
static void scores_heads(int g, const float* q, int64_t D, const void* k, int64_t ldk, int64_t n, float* sc,
                         int64_t ld_sc, PrefetchStream* next_k, PrefetchStream* v) {
    switch (g) {
        case 4: return attend_scores<KV, 4>(q, D, k, ldk, n, sc, ld_sc, next_k, v);
        case 3: return attend_scores<KV, 3>(q, D, k, ldk, n, sc, ld_sc, next_k, v);
        case 2: return attend_scores<KV, 2>(q, D, k, ldk, n, sc, ld_sc, next_k, v);
        default: return attend_scores<KV, 1>(q, D, k, ldk, n, sc, ld_sc, next_k, v);
    }
}
template <Format KV>
static void values_heads(int g, const float* p, int64_t ld_p, int64_t Dv, const void* v, int64_t n, int64_t ldv,
                         float* acc, PrefetchStream* pf) {
    if (g >= 2) return attend_values<KV, 2>(p, ld_p, Dv, v, n, ldv, acc, pf);
    attend_values<KV, 1>(p, ld_p, Dv, v, n, ldv, acc, pf);
}
constexpr int kScoreHeads = 4, kValueHeads = 2;  // heads per pass of the kernels
#endif

// The largest of x[0 .. n) (-inf for none), in four independent chains of 8 lanes: one
// scalar chain waited out the latency of every max, a tenth of a 1024-position attention.
// A maximum is exact, so the order of comparisons does not change it.
static inline float max_of(const float* x, int64_t n) {
    __m256 m[4];
    for (int c = 0; c < 4; ++c) m[c] = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int c = 0; c < 4; ++c) m[c] = _mm256_max_ps(m[c], _mm256_loadu_ps(x + i + 8 * c));
    for (; i + 8 <= n; i += 8) m[0] = _mm256_max_ps(m[0], _mm256_loadu_ps(x + i));
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    for (; i < n; ++i) mx = std::max(mx, x[i]);
    return mx;
}

// Eight floats through fp16 and back, rounded to nearest even (attention_rounded's vector form).
static inline __m256 rounded_to_f16(__m256 v) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The queries rounded and scaled in vectors: a scalar fp16 round trip per element was a third
// of a 64-position decode attention call's time on the calling thread (32 heads of 128).
static void attend_queries(const float* q, int64_t n, float scale, Format kv, float* out) {
    const __m256 vs = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(q + i);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(kv == FMT_F16 ? rounded_to_f16(v) : v, vs));
    }
    for (; i < n; ++i) out[i] = attention_rounded(q[i], kv) * scale;
}

// A run of positions stretch by stretch (a stretch: the run's part of one cache block), every
// head of the group over a stretch while its keys (then its values) are in L1. Head group by
// head group, each pass read the whole run again from L2 (64 KiB of keys or values at 256
// positions): measured 7-9 % faster alone, 4 % in the decode chain at 1000 positions. The same
// operations per head in the same order as head by head: the same bits.
//
// The cache is read cold (a token's weights have streamed through the caches since the layer's
// last step), and a stretch is one block's rows of a head, 16 KiB at 64 positions: too short
// for the hardware prefetchers, which start again at every block. So each pass over a stretch
// prefetches what it will read next, in shares per step: the scores passes the next stretch's
// keys and this stretch's values, the values pass the next stretch's values. (Cold, 2 threads,
// without and with in turn, 1024 positions 482 -> 336 us a layer, 0.29 -> 0.43 of the
// bandwidth probe.)
template <Format KV>
static void attend_scores_t(const float* q, int group, int64_t D, const KvSegment* segs, int n_segs, int64_t ldk,
                            int64_t ldv, int64_t n, float* e, int64_t ld, float* m, float* l) {
    constexpr int64_t esz = KV == FMT_F32 ? 4 : 2;
    // Every pass over a stretch's keys (one per kScoreHeads heads of the group) issues its
    // share of the prefetches. (All of them in the first pass, before: with a group of 8, a
    // burst of three streams' misses, then a pass with none. Cold, 2 cores, in turn in one
    // process: the decode chain's attention 1.07x at 512 positions, 1.09x at 2048, 1.14x at
    // 4096; AVX2 1.11x at 2048.)
    const int passes = (group + kScoreHeads - 1) / kScoreHeads;
    for (int i = 0, off = 0; i < n_segs; off += int(segs[i].n), ++i) {
        const int64_t steps = std::max<int64_t>(1, segs[i].n / 2) * passes;
        PrefetchStream next_k = i + 1 < n_segs ? PrefetchStream(segs[i + 1].k, segs[i + 1].n * ldk * esz, steps)
                                               : PrefetchStream();
        // The stretch's values into L2 while its keys are scored: the values pass then reads
        // them from L2, not DRAM. (Only the first stretch's, during the last stretch's scores,
        // before: a 2048-position decode over a cold cache took 1.13-1.18x longer, 2 cores.)
        PrefetchStream this_v(segs[i].v, segs[i].n * ldv * esz, steps);
        for (int g0 = 0; g0 < group; g0 += kScoreHeads)
            scores_heads<KV>(std::min(kScoreHeads, group - g0), q + int64_t(g0) * D, D, segs[i].k, ldk, segs[i].n,
                             e + int64_t(g0) * ld + off, ld, &next_k, &this_v);
    }
    for (int g = 0; g < group; ++g) {
        float* sc = e + int64_t(g) * ld;
        const float mx = max_of(sc, n);
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        int64_t s = 0;
        for (; s + 8 <= n; s += 8) {
            const __m256 ex = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sc + s), vmx));
            _mm256_storeu_ps(sc + s, ex);
            vsum = _mm256_add_ps(vsum, ex);
        }
        float sum = hsum_ps(vsum);
        for (; s < n; ++s) sum += (sc[s] = exp_scalar(sc[s] - mx));
        m[g] = mx;
        l[g] = sum;
    }
}

template <Format KV>
static void attend_values_t(float* e, const float* w, int group, int64_t ld, int64_t Dv, const KvSegment* segs,
                            int n_segs, int64_t ldv, int64_t n, float* acc) {
    constexpr int64_t esz = KV == FMT_F32 ? 4 : 2;
    for (int g = 0; g < group; ++g) {  // the softmax weights (rounded: attention_rounded)
        float* p = e + int64_t(g) * ld;
        const __m256 wg = _mm256_set1_ps(w[g]);
        int64_t s = 0;
        for (; s + 8 <= n; s += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(p + s), wg);
            if constexpr (KV == FMT_F16) v = rounded_to_f16(v);
            _mm256_storeu_ps(p + s, v);
        }
        for (; s < n; ++s) p[s] = attention_rounded(p[s] * w[g], KV);
    }
    std::fill(acc, acc + int64_t(group) * Dv, 0.f);
    for (int i = 0, off = 0; i < n_segs; off += int(segs[i].n), ++i) {
        PrefetchStream next_v = i + 1 < n_segs ? PrefetchStream(segs[i + 1].v, segs[i + 1].n * ldv * esz, segs[i].n)
                                               : PrefetchStream();
        for (int g0 = 0; g0 < group; g0 += kValueHeads) {
            values_heads<KV>(std::min(kValueHeads, group - g0), e + int64_t(g0) * ld + off, ld, Dv, segs[i].v, segs[i].n,
                             ldv, acc + int64_t(g0) * Dv, g0 == 0 ? &next_v : nullptr);  // the first pass prefetches
        }
    }
}

static void attend_scores(const float* q, int group, int64_t D, const KvSegment* segs, int n_segs, Format kv,
                          int64_t ldk, int64_t ldv, int64_t n, float* e, int64_t ld, float* m, float* l) {
    if (kv == FMT_BF16)
        attend_scores_t<FMT_BF16>(q, group, D, segs, n_segs, ldk, ldv, n, e, ld, m, l);
    else if (kv == FMT_F16)
        attend_scores_t<FMT_F16>(q, group, D, segs, n_segs, ldk, ldv, n, e, ld, m, l);
    else
        attend_scores_t<FMT_F32>(q, group, D, segs, n_segs, ldk, ldv, n, e, ld, m, l);
}

static void attend_values(float* e, const float* w, int group, int64_t ld, int64_t Dv, const KvSegment* segs,
                          int n_segs, Format kv, int64_t ldv, int64_t n, float* acc) {
    if (kv == FMT_BF16)
        attend_values_t<FMT_BF16>(e, w, group, ld, Dv, segs, n_segs, ldv, n, acc);
    else if (kv == FMT_F16)
        attend_values_t<FMT_F16>(e, w, group, ld, Dv, segs, n_segs, ldv, n, acc);
    else
        attend_values_t<FMT_F32>(e, w, group, ld, Dv, segs, n_segs, ldv, n, acc);
}

static const KernelTable* make_table(const char* name) {
    static const KernelTable table = [name] {
        KernelTable t{};
        t.name = name;
        t.panel = kPanel;
        t.quantize = quantize;
        auto& q8 = t.gemv_q8;
        q8[FMT_Q8_0] = gemv_q8_b32<FMT_Q8_0>;
        q8[FMT_Q4_0] = gemv_q8_b32<FMT_Q4_0>;
        q8[FMT_Q4_1] = gemv_q8_b32<FMT_Q4_1>;
        q8[FMT_Q5_0] = gemv_q8_b32<FMT_Q5_0>;
        q8[FMT_Q5_1] = gemv_q8_b32<FMT_Q5_1>;
        q8[FMT_IQ4_NL] = gemv_q8_b32<FMT_IQ4_NL>;
        q8[FMT_IQ4_XS] = gemv_q8_b32_any<FMT_IQ4_XS>;
        q8[FMT_MXFP4] = gemv_q8_b32<FMT_MXFP4>;
        q8[FMT_MXFP4_HF] = gemv_q8_b32<FMT_MXFP4_HF>;
        q8[FMT_INT4_G32] = gemv_q8_b32<FMT_INT4_G32>;
        q8[FMT_Q2_K] = gemv_q8_q2k;
        q8[FMT_Q3_K] = gemv_q8_q3k;
        q8[FMT_Q4_K] = gemv_q8_q4k;
        q8[FMT_Q5_K] = gemv_q8_q5k;
        q8[FMT_Q6_K] = gemv_q8_q6k;
        q8[FMT_IQ2_XXS] = gemv_q8_iq<FMT_IQ2_XXS>;
        q8[FMT_IQ2_XS] = gemv_q8_iq<FMT_IQ2_XS>;
        q8[FMT_IQ2_S] = gemv_q8_iq<FMT_IQ2_S>;
        q8[FMT_IQ3_XXS] = gemv_q8_iq<FMT_IQ3_XXS>;
        q8[FMT_IQ3_S] = gemv_q8_iq<FMT_IQ3_S>;
        q8[FMT_IQ1_S] = gemv_q8_iq<FMT_IQ1_S>;
        q8[FMT_IQ1_M] = gemv_q8_iq<FMT_IQ1_M>;
        for (Format f : {FMT_IQ4_XS, FMT_IQ2_XXS, FMT_IQ2_XS, FMT_IQ2_S, FMT_IQ3_XXS, FMT_IQ3_S, FMT_IQ1_S, FMT_IQ1_M})
            t.gemv_any_tokens[f] = true;
#if defined(HMOE_AVX512)
        t.gemv_any_tokens[FMT_Q3_K] = t.gemv_any_tokens[FMT_Q2_K] = true;  // gemm_q3k_512 / gemm_q2k_512 past four
        t.gemv_any_tokens[FMT_IQ4_NL_X8] = t.gemv_any_tokens[FMT_IQ4_XS_X8] = true;  // gemm_x8nl_512 past four
#endif
        q8[FMT_Q4_0_X8] = gemv_q8_x8<FMT_Q4_0_X8>;
        q8[FMT_INT4_X8] = gemv_q8_x8<FMT_INT4_X8>;
        q8[FMT_Q4_K_X8] = gemv_q8_q4kx8;
        q8[FMT_Q8_0_X8] = gemv_q8_q8x8;
        q8[FMT_IQ4_NL_X8] = gemv_q8_x8nl<FMT_IQ4_NL_X8>;
        q8[FMT_IQ4_XS_X8] = gemv_q8_x8nl<FMT_IQ4_XS_X8>;
        t.gemv_f32[FMT_BF16] = gemv_float<FMT_BF16>;
        t.gemv_f32[FMT_F16] = gemv_float<FMT_F16>;
        t.gemv_f32[FMT_F32] = gemv_float<FMT_F32>;
        t.dequant_panel = dequant_panel;
        t.gemm_panels = gemm_panels;
        t.silu_mul = silu_mul;
        t.gptoss_glu = gptoss_glu;
        t.dequant_row = dequant_row_portable;
        t.attend_queries = attend_queries;
        t.attend_scores = attend_scores;
        t.attend_values = attend_values;
        t.rows_axpy = rows_axpy;
        return t;
    }();
    return &table;
}
