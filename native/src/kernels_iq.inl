// Decode GEMV of the i-quant super-blocks (iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq1_s,
// iq1_m): the low-bit experts of the community GGUFs of DeepSeek, Kimi, Qwen3 and GLM.
// Included by kernels_x86.inl (inside each ISA's namespace, after its helpers). iq4_xs has a
// decoder here too (IqBlock: the dequantizing), but its GEMV is the 32-block one of
// kernels_x86.inl (gemv_b32_n: iq4_nl's codes, a scale per block).
//
// Every value of these formats is an integer w times an integer scale per 16 or 32 values
// times one float per super-block (formats.h), so one GEMV serves them all: a decoder turns
// each 32 values of a super-block into their magnitudes |w| (unsigned bytes), their signs
// and the scale multipliers; per token, the signs go onto the activations, |w| x a into
// int16 pairs (vpmaddubsw: at most 2 * 127 * 127, no saturation), one vpmaddwd with the
// scales into the super-block's int32 lanes (AVX-512: vpdpwssd), and one FMA per super-block
// and token applies the float. A super-block is decoded once for all of a call's tokens: the
// grid look-ups, the costly part of these formats, are shared (decode: up to four tokens in
// registers; prompts: any number, below).
//
// The grids (iq_grids.h) hold magnitudes (iq2: 8, 25, 43; iq3: odd or even steps), their
// sign bits come apart; iq1's grid values are -1, 0, 1 plus a delta of +-1/8, taken as the
// integer 8g +- 1 with the float divided by 8, and iq4_xs's non-linear values are signed: for
// those two the signs are the values' own.

#if defined(HMOE_AVX512)
using Signs = __mmask32;  // bit i set: value i is negative
static inline Signs signs_from_bits(uint32_t bits) { return __mmask32(bits); }
static inline Signs signs_of(__m256i v) { return _mm256_movepi8_mask(v); }
static inline __m256i with_signs(__m256i a, Signs s) { return _mm256_mask_sub_epi8(a, s, _mm256_setzero_si256(), a); }
static inline __m256i add_scaled_pairs(__m256i acc, __m256i pairs, __m256i scale) {
    return _mm256_dpwssd_epi32(acc, pairs, scale);
}
#else
using Signs = __m256i;  // +1 or -1 per byte, for vpsignb
// bytes: sign byte k of a quarter in bytes 8k .. 8k + 7, each tested against its own bit.
static inline Signs signs_from_spread_bytes(__m256i bytes) {
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
    return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(1));
}
// Byte k of the 16 at sign_bytes + 4j (j < 4, both 128-bit lanes holding the same 16) to bytes
// 8k .. 8k + 7.
static inline Signs signs_of_quarter_bytes(__m256i sign_bytes, int j) {
    const __m256i pick = _mm256_add_epi8(_mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                                          2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
                                         _mm256_set1_epi8(char(4 * j)));
    return signs_from_spread_bytes(_mm256_shuffle_epi8(sign_bytes, pick));
}
static inline Signs signs_from_bits(uint32_t bits) { return signs_of_quarter_bytes(_mm256_set1_epi32(int(bits)), 0); }
static inline Signs signs_of(__m256i v) { return v; }
static inline __m256i with_signs(__m256i a, Signs s) { return _mm256_sign_epi8(a, s); }
static inline __m256i add_scaled_pairs(__m256i acc, __m256i pairs, __m256i scale) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scale));
}
#endif

// A super-block's precomputed indices, sign words and scales (iq1: also its table rows) stay
// in memory, each read back with a load (gemv_iq_ahead_n: a super-block after the store): GCC
// otherwise keeps the vectors in registers and takes every index out with vpextrw, two
// micro-ops each on Zen 4. The AVX2 set keeps its code.
template <typename T>
static inline void index_in_memory(T& index) {
#if defined(HMOE_AVX512)
    asm("" : "+m"(index));
#else
    (void)index;
#endif
}

// 32 values of a super-block: magnitudes, signs, and the int16 multipliers of the vpmaddubsw
// pairs (lanes 0-7 the first 16 values' scale, 8-15 the second 16's).
struct IqQuarter {
    __m256i mag;
    Signs sign;
    __m256i scale;
    int lo, hi;  // the scale's two multipliers as integers (the prompt kernel's panels)
};

static inline __m256i scale_pair(int lo, int hi) {
    return _mm256_set_m128i(_mm_set1_epi16(short(hi)), _mm_set1_epi16(short(lo)));
}

// Grid entries by index: loaded one by one and inserted, or (AVX-512 set) gathered with the
// indices computed in a vector. Measured per format on the 2-core Xeon with AVX-512 and AMX
// here (GEMV of 1.2 GB, one token, both builds in turn, twice): gathering wins where an
// index takes its high bits from a shared byte or eight 4-value entries make a quarter
// (iq2_s 24 -> 33, iq3_xxs 31 -> 35, iq3_s 17 -> 27 G weights/s) and loses where the
// indices are plain bytes or words (iq2_xxs 37 -> 33, iq2_xs 36 -> 31, iq1_m 19 -> 17;
// iq1_s even), so only those three gather. The AVX2 set, which also runs on older cores
// whose gathers are slow, never does.
static inline __m256i grid4(const uint64_t* grid, int i0, int i1, int i2, int i3) {
    return _mm256_set_epi64x(int64_t(grid[i3]), int64_t(grid[i2]), int64_t(grid[i1]), int64_t(grid[i0]));
}
template <typename I>  // byte indices (iq3_xxs) or word indices a decoder computed (iq3_s)
static inline __m256i grid8(const uint32_t* grid, const I* i) {
    return _mm256_setr_epi32(int(grid[i[0]]), int(grid[i[1]]), int(grid[i[2]]), int(grid[i[3]]), int(grid[i[4]]),
                             int(grid[i[5]]), int(grid[i[6]]), int(grid[i[7]]));
}
#if defined(HMOE_AVX512) && !defined(HMOE_NO_GRID_GATHER)
#define HMOE_GRID_GATHER 1
constexpr bool kGatherByDefault = true;
static inline __m256i gather4(const uint64_t* grid, __m128i idx) {
    return _mm256_i32gather_epi64(reinterpret_cast<const long long*>(grid), idx, 8);
}
static inline __m256i gather8(const uint32_t* grid, __m256i idx) {
    return _mm256_i32gather_epi32(reinterpret_cast<const int*>(grid), idx, 4);
}
static inline __m256i bytes8(const uint8_t* q) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
}
#else
constexpr bool kGatherByDefault = false;
#endif

#if defined(HMOE_AVX512)
// grid4 / grid8 on AVX-512 by the word indices a decoder stored a super-block ahead (iq1_s,
// iq1_m, iq2_xs, iq2_s, iq3_s) or by the block's own index bytes (iq3_xxs), written out (now for
// iq1_m's decode GEMV and the prompt panels, kernels_planes.inl doing the others' decode): in the unrolled
// decode GEMV GCC parks indices in vector registers between their load and the look-up
// (vmovq there and back, two more micro-ops each). Four indices come in with one 64-bit
// load and are taken apart in registers (fewer loads: the look-ups are most of the decode's).
// In each group of four entries the first is a vmovq / vmovd, the others merge-masked
// broadcasts (one instruction each, no vpinsr / vmovhps shuffle), the constant masks in
// three mask registers.
#define HMOE_SPLIT_WORDS                      \
    "movzwl %w[w], %k[a]\n\t"                 \
    "shrq $16, %q[w]\n\t"                     \
    "movzwl %w[w], %k[b]\n\t"                 \
    "shrq $16, %q[w]\n\t"                     \
    "movzwl %w[w], %k[c]\n\t"                 \
    "shrq $16, %q[w]\n\t"                     \
    "movq %q[w], %q[d]\n\t"

// Four 8-byte entries by the four words at i.
static inline __m256i grid4_words(const uint64_t* grid, const uint16_t* i) {
    __m256i out;
    uint64_t w, a, b, c, d;
    asm("movq %[i], %q[w]\n\t" HMOE_SPLIT_WORDS
        "vmovq (%[g],%[a],8), %x[o]\n\t"
        "vpbroadcastq (%[g],%[b],8), %t[o]%{%[k1]%}\n\t"
        "vpbroadcastq (%[g],%[c],8), %t[o]%{%[k2]%}\n\t"
        "vpbroadcastq (%[g],%[d],8), %t[o]%{%[k3]%}"
        : [o] "=&v"(out), [w] "=&r"(w), [a] "=&r"(a), [b] "=&r"(b), [c] "=&r"(c), [d] "=&r"(d)
        : [g] "r"(grid), [i] "m"(*reinterpret_cast<const uint64_t*>(i)), [k1] "Yk"(__mmask8(2)),
          [k2] "Yk"(__mmask8(4)), [k3] "Yk"(__mmask8(8)));
    return out;
}

// Eight 4-byte entries by the eight words at i: two halves of four as grid4_words does them
// (lanes 1-3 merge-masked vpbroadcastd), the upper one put in place with a vinserti128
// (L2-resident iq3_s, one token: 12.7 with seven vpbroadcastd + vpblendd, 13.9 so).
static inline __m256i grid8_words(const uint32_t* grid, const uint16_t* i) {
    __m256i out, tmp;
    uint64_t w, a, b, c, d;
    asm("movq %[i], %q[w]\n\t" HMOE_SPLIT_WORDS
        "vmovd (%[g],%[a],4), %x[o]\n\t"
        "vpbroadcastd (%[g],%[b],4), %x[o]%{%[k1]%}\n\t"
        "vpbroadcastd (%[g],%[c],4), %x[o]%{%[k2]%}\n\t"
        "vpbroadcastd (%[g],%[d],4), %x[o]%{%[k3]%}\n\t"
        "movq %[j], %q[w]\n\t" HMOE_SPLIT_WORDS
        "vmovd (%[g],%[a],4), %x[h]\n\t"
        "vpbroadcastd (%[g],%[b],4), %x[h]%{%[k1]%}\n\t"
        "vpbroadcastd (%[g],%[c],4), %x[h]%{%[k2]%}\n\t"
        "vpbroadcastd (%[g],%[d],4), %x[h]%{%[k3]%}\n\t"
        "vinserti128 $1, %x[h], %t[o], %t[o]"
        : [o] "=&x"(out), [h] "=&x"(tmp), [w] "=&r"(w), [a] "=&r"(a), [b] "=&r"(b), [c] "=&r"(c), [d] "=&r"(d)
        : [g] "r"(grid), [i] "m"(*reinterpret_cast<const uint64_t*>(i)),
          [j] "m"(*reinterpret_cast<const uint64_t*>(i + 4)), [k1] "Yk"(__mmask8(2)), [k2] "Yk"(__mmask8(4)),
          [k3] "Yk"(__mmask8(8)));
    return out;
}
// The same by eight byte indices at i (iq3_xxs: the block's own bytes, in gemv_iq_n's loop),
// taken apart with movzbl of the low and high byte registers (which take no REX prefix: w, b
// and d among rax, rbx, rcx, rdx). L2-resident iq3_xxs at 1/2/3/4 tokens: 14.1/23.5/31.9/36.8
// with grid8 -> 14.0/25.2/33.4/39.1 G weights/s.
#define HMOE_SPLIT_BYTES                      \
    "movzbl %b[w], %k[a]\n\t"                 \
    "movzbl %h[w], %k[b]\n\t"                 \
    "shrq $16, %q[w]\n\t"                     \
    "movzbl %b[w], %k[c]\n\t"                 \
    "movzbl %h[w], %k[d]\n\t"                 \
    "shrq $16, %q[w]\n\t"
static inline __m256i grid8_bytes(const uint32_t* grid, const uint8_t* i) {
    __m256i out, tmp;
    uint64_t w, a, b, c, d;
    asm("movq %[i], %q[w]\n\t" HMOE_SPLIT_BYTES
        "vmovd (%[g],%[a],4), %x[o]\n\t"
        "vpbroadcastd (%[g],%[b],4), %x[o]%{%[k1]%}\n\t"
        "vpbroadcastd (%[g],%[c],4), %x[o]%{%[k2]%}\n\t"
        "vpbroadcastd (%[g],%[d],4), %x[o]%{%[k3]%}\n\t"
        HMOE_SPLIT_BYTES
        "vmovd (%[g],%[a],4), %x[h]\n\t"
        "vpbroadcastd (%[g],%[b],4), %x[h]%{%[k1]%}\n\t"
        "vpbroadcastd (%[g],%[c],4), %x[h]%{%[k2]%}\n\t"
        "vpbroadcastd (%[g],%[d],4), %x[h]%{%[k3]%}\n\t"
        "vinserti128 $1, %x[h], %t[o], %t[o]"
        : [o] "=&x"(out), [h] "=&x"(tmp), [w] "=&Q"(w), [a] "=&r"(a), [b] "=&Q"(b), [c] "=&r"(c), [d] "=&Q"(d)
        : [g] "r"(grid), [i] "m"(*reinterpret_cast<const uint64_t*>(i)), [k1] "Yk"(__mmask8(2)),
          [k2] "Yk"(__mmask8(4)), [k3] "Yk"(__mmask8(8)));
    return out;
}
#undef HMOE_SPLIT_BYTES
#undef HMOE_SPLIT_WORDS
#endif

// Eight sign bytes from seven-bit fields, for all eight quarters of a super-block at once:
// each 32-bit lane holds four 7-bit fields in its low 28 bits (iq2_xxs, iq3_xxs); each
// becomes a byte with an eighth bit for even parity (kSignsIq2, without the look-ups).
static inline __m256i sign_bytes_of_fields(__m256i w) {
    __m256i t = _mm256_and_si256(w, _mm256_set1_epi32(0x7F));
    t = _mm256_or_si256(t, _mm256_and_si256(_mm256_slli_epi32(w, 1), _mm256_set1_epi32(0x7F00)));
    t = _mm256_or_si256(t, _mm256_and_si256(_mm256_slli_epi32(w, 2), _mm256_set1_epi32(0x7F0000)));
    t = _mm256_or_si256(t, _mm256_and_si256(_mm256_slli_epi32(w, 3), _mm256_set1_epi32(0x7F000000)));
    // Bit 0 of each byte becomes the parity of the byte: fold halves, quarters, pairs.
    __m256i parity = _mm256_xor_si256(t, _mm256_srli_epi32(t, 4));
    parity = _mm256_xor_si256(parity, _mm256_srli_epi32(parity, 2));
    parity = _mm256_xor_si256(parity, _mm256_srli_epi32(parity, 1));
    return _mm256_or_si256(t, _mm256_slli_epi32(_mm256_and_si256(parity, _mm256_set1_epi32(0x01010101)), 7));
}

// The same for 16-bit words whose top seven bits are the field (iq2_xs: grid index in the
// low nine): 32 words in, their 32 sign bytes out in order.
static inline __m256i sign_bytes_of_words(const uint8_t* q) {
    __m256i lo = _mm256_srli_epi16(load32(q), 9), hi = _mm256_srli_epi16(load32(q + 32), 9);
    const auto with_parity = [](__m256i t) {
        __m256i parity = _mm256_xor_si256(t, _mm256_srli_epi16(t, 4));
        parity = _mm256_xor_si256(parity, _mm256_srli_epi16(parity, 2));
        parity = _mm256_xor_si256(parity, _mm256_srli_epi16(parity, 1));
        return _mm256_or_si256(t, _mm256_slli_epi16(_mm256_and_si256(parity, _mm256_set1_epi16(1)), 7));
    };
    lo = with_parity(lo);
    hi = with_parity(hi);
    return _mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), 0xD8);  // packus interleaves the halves
}

// iq2_xxs / iq3_xxs: each quarter's 32-bit word w holds four 7-bit sign fields and, in its
// top four bits, the scale s: the sign words and the multipliers 2s + 1 of all eight quarters.
struct XxsWords {
    alignas(32) uint32_t sign[8];
    alignas(32) int32_t scale[8];
    explicit XxsWords(__m256i w) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(sign), sign_bytes_of_fields(w));
        const __m256i s = _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(w, 28), 1), _mm256_set1_epi32(1));
        _mm256_store_si256(reinterpret_cast<__m256i*>(scale), s);
    }
};

// One decoder per format: the super-block's float (d()) and its 32-value quarters. `Gather`
// picks the gathered grid look-ups where a format has them (iq2_s, iq3_xxs, iq3_s); the
// values are the same either way.
template <Format F, bool Gather = kGatherByDefault>
struct IqBlock;

template <bool Gather>
struct IqBlock<FMT_IQ2_XXS, Gather> {
    const uint8_t* p;
    XxsWords words;
    // The eight words sit after each quarter's four index bytes: the odd 32-bit words of the
    // 64 bytes of codes.
    explicit IqBlock(const uint8_t* blk)
        : p(blk),
          words(_mm256_permute4x64_epi64(
              _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(load32(blk + 2)),
                                                    _mm256_castsi256_ps(load32(blk + 34)), 0xDD)),
              0xD8)) {}
    float d() const { return h2f(p) * 0.125f; }  // d (0.5 + s) / 4 = d (2s + 1) / 8
    IqQuarter quarter(int ib) const {
        const uint8_t* q = p + 2 + 8 * ib;
        const __m256i g = grid4(kIq2xxsGrid, q[0], q[1], q[2], q[3]);
        const int s = words.scale[ib];
        return {g, signs_from_bits(words.sign[ib]), _mm256_set1_epi16(short(s)), s, s};
    }
};

// Sub-block scales of iq2_xs / iq2_s (a byte per quarter, a nibble per 16 values) as
// multipliers, on AVX2: all sixteen of the super-block in one vector (byte 2 ib: 2 lo + 1 of
// quarter ib, byte 2 ib + 1: 2 hi + 1), from which each quarter's pair (lanes 0-7 its first,
// 8-15 its second) is a shuffle and a widening. Per quarter two vector operations, where
// computing the pair from its scale byte took five. One core of an Ice Lake Xeon under
// HYBRIDMOE_NATIVE_ISA=avx2 against llama.cpp's AVX2 build on the same bytes
// (benchmarks/expert_decode_rates.py --llama-cpp --ggml-lib, two runs, builds alternating):
// iq2_s 1.08/1.12x -> 1.22/1.23x, iq2_xs 1.18/1.19x -> 1.25/1.29x (1.32/1.35x with its sign
// bytes kept in registers, below); iq1_m's scale fields the same way 1.15/1.14x -> 1.27/1.23x.
static inline __m128i nibble_scales(__m128i b) {
    const __m128i m = _mm_unpacklo_epi8(_mm_and_si128(b, _mm_set1_epi8(15)), _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)));
    return _mm_or_si128(_mm_add_epi8(m, m), _mm_set1_epi8(1));
}
static inline __m256i nibble_scale_pair(__m128i scales, int ib) {
    const __m128i pick = _mm_add_epi8(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm_set1_epi8(char(2 * ib)));
    return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(scales, pick));
}

#if defined(HMOE_AVX512)
// Word k of 128-bit lane L holds L: vpermw / vpshufb indices that spread four items over the
// four lanes (plus a per-call offset).
static inline __m512i lane_numbers_epi16() {
    return _mm512_set_epi64(0x0003000300030003, 0x0003000300030003, 0x0002000200020002, 0x0002000200020002,
                            0x0001000100010001, 0x0001000100010001, 0, 0);
}

// nibble_scale_pair of all eight scale bytes at sc at once, into pair[ib] (the AVX-512 decode
// GEMV: per quarter a load instead of five vector operations on its critical path).
static inline void nibble_scale_pairs(const uint8_t* sc, int16_t (*pair)[16]) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    // Word 2 ib: 2 lo + 1 of byte ib, word 2 ib + 1: 2 hi + 1.
    __m512i m = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_unpacklo_epi8(lo, hi)));
    m = _mm512_or_si512(_mm512_slli_epi16(m, 1), _mm512_set1_epi16(1));
    // Quarters 2z, 2z + 1 per vector: words 4z (x8), 4z + 1 (x8), 4z + 2 (x8), 4z + 3 (x8).
    const __m512i spread = lane_numbers_epi16();
    for (int z = 0; z < 4; ++z)
        _mm512_store_si512(pair[2 * z],
                           _mm512_permutexvar_epi16(_mm512_add_epi16(spread, _mm512_set1_epi16(short(4 * z))), m));
}
#endif

template <bool Gather>
struct IqBlock<FMT_IQ2_XS, Gather> {
    const uint8_t* p;
#if defined(HMOE_AVX512)
    alignas(32) uint32_t sign[8];
    // The 32 nine-bit grid indices and the quarters' scale pairs, for the whole super-block.
    alignas(64) uint16_t index[32];
    alignas(64) int16_t pair[8][16];
#else
    // nibble_scales, and the sign bytes of quarters 0-3 / 4-7 in both 128-bit lanes: each
    // quarter's signs a shuffle away. Stored and read back as words, as AVX-512 does, they
    // (and the grid indices stored so: 1.33 -> 1.08x, a super-block ahead 1.34 -> 1.18x) wait
    // on the stores.
    __m128i scales;
    __m256i sign_lo, sign_hi;
#endif
    explicit IqBlock(const uint8_t* blk) : p(blk) {
#if !defined(HMOE_AVX512)
        scales = nibble_scales(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 66)));
        const __m256i signs = sign_bytes_of_words(blk + 2);
        sign_lo = _mm256_permute2x128_si256(signs, signs, 0x00);
        sign_hi = _mm256_permute2x128_si256(signs, signs, 0x11);
#else
        _mm256_store_si256(reinterpret_cast<__m256i*>(sign), sign_bytes_of_words(blk + 2));
        index_in_memory(sign);
        _mm512_store_si512(index, _mm512_and_si512(_mm512_loadu_si512(blk + 2), _mm512_set1_epi16(511)));
        index_in_memory(index);
        nibble_scale_pairs(blk + 66, pair);
        index_in_memory(pair);
#endif
    }
    float d() const { return h2f(p) * 0.125f; }
    IqQuarter quarter(int ib) const {
        const uint8_t sc = p[66 + ib];
#if defined(HMOE_AVX512)
        return {grid4_words(kIq2xsGrid, index + 4 * ib), signs_from_bits(sign[ib]),
                _mm256_load_si256(reinterpret_cast<const __m256i*>(pair[ib])), 2 * (sc & 15) + 1, 2 * (sc >> 4) + 1};
#else
        const uint8_t* q = p + 2 + 8 * ib;
        const __m256i g = grid4(kIq2xsGrid, load_u16(q) & 511, load_u16(q + 2) & 511, load_u16(q + 4) & 511,
                                load_u16(q + 6) & 511);
        return {g, signs_of_quarter_bytes(ib < 4 ? sign_lo : sign_hi, ib & 3), nibble_scale_pair(scales, ib),
                2 * (sc & 15) + 1, 2 * (sc >> 4) + 1};
#endif
    }
};

template <bool Gather>
struct IqBlock<FMT_IQ2_S, Gather> {
    const uint8_t* p;
    // The 32 ten-bit grid indices, computed for the whole super-block at once in vectors (low
    // eight bits in qs, two more per index in the quarter's qh byte): one by one they cost
    // three scalar operations each, more than the look-up itself.
    alignas(32) uint16_t index[32];
#if defined(HMOE_AVX512)
    alignas(64) int16_t pair[8][16];  // the quarters' scale pairs (nibble_scale_pairs)
#else
    __m128i scales;  // nibble_scales
#endif
    explicit IqBlock(const uint8_t* blk) : p(blk) {
#if defined(HMOE_AVX512)
        nibble_scale_pairs(blk + 74, pair);
        index_in_memory(pair);
#else
        scales = nibble_scales(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 74)));
#endif
        if constexpr (!Gather) {
            // qh byte of quarter ib to index lanes 4 ib .. 4 ib + 3, shifted so that its bits
            // 2k, 2k + 1 land on bits 8, 9 of lane k (a multiply by 256, 64, 16, 4).
            const __m128i qh = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 66));
            const __m256i mul = _mm256_setr_epi16(256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4);
            for (int half = 0; half < 2; ++half) {
                const __m128i spread = _mm_shuffle_epi8(
                    qh, _mm_add_epi8(_mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm_set1_epi8(char(4 * half))));
                const __m256i high =
                    _mm256_and_si256(_mm256_mullo_epi16(_mm256_cvtepu8_epi16(spread), mul), _mm256_set1_epi16(0x300));
                const __m256i low = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * half)));
                _mm256_store_si256(reinterpret_cast<__m256i*>(index + 16 * half), _mm256_or_si256(low, high));
            }
            index_in_memory(index);
        }
    }
    float d() const { return h2f(p) * 0.125f; }
    IqQuarter quarter(int ib) const {
        const uint8_t sc = p[74 + ib];
#if defined(HMOE_AVX512)
        const __m256i scale = _mm256_load_si256(reinterpret_cast<const __m256i*>(pair[ib]));
#else
        const __m256i scale = nibble_scale_pair(scales, ib);
#endif
        return {grid(ib), signs_from_bits(load_u32(p + 34 + 4 * ib)), scale, 2 * (sc & 15) + 1, 2 * (sc >> 4) + 1};
    }
    __m256i grid(int ib) const {
#if defined(HMOE_GRID_GATHER)
        if constexpr (Gather) {
            const int h = p[66 + ib];
            const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(h << 8), _mm_setr_epi32(0, 2, 4, 6)),
                                               _mm_set1_epi32(0x300));
            return gather4(kIq2sGrid, _mm_or_si128(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(int(load_u32(p + 2 + 4 * ib)))), high));
        }
#endif
        const uint16_t* i = index + 4 * ib;
#if defined(HMOE_AVX512)
        return grid4_words(kIq2sGrid, i);
#else
        return grid4(kIq2sGrid, i[0], i[1], i[2], i[3]);
#endif
    }
};

template <bool Gather>
struct IqBlock<FMT_IQ3_XXS, Gather> {
    const uint8_t* p;
    XxsWords words;
    explicit IqBlock(const uint8_t* blk) : p(blk), words(load32(blk + 66)) {}
    float d() const { return h2f(p) * 0.25f; }  // d (0.5 + s) / 2 = d (2s + 1) / 4
    IqQuarter quarter(int ib) const {
        const uint8_t* qs = p + 2 + 8 * ib;
        const int s = words.scale[ib];
        return {grid(qs), signs_from_bits(words.sign[ib]), _mm256_set1_epi16(short(s)), s, s};
    }
    static __m256i grid(const uint8_t* qs) {
#if defined(HMOE_GRID_GATHER)
        if constexpr (Gather) return gather8(kIq3xxsGrid, bytes8(qs));
#endif
#if defined(HMOE_AVX512)
        return grid8_bytes(kIq3xxsGrid, qs);
#else
        return grid8(kIq3xxsGrid, qs);
#endif
    }
};

template <bool Gather>
struct IqBlock<FMT_IQ3_S, Gather> {
    const uint8_t* p;
    // The 64 nine-bit grid indices (index 8 ib + k: qs byte 8 ib + k, bit k of qh byte ib as
    // bit 8) and (AVX-512) the quarters' scales (s in both halves of a dword: a broadcast is a
    // load), for the whole super-block in vectors: one by one the index costs four scalar
    // operations, the scale five.
    alignas(64) uint16_t index[64];
#if defined(HMOE_AVX512)
    alignas(32) int32_t scale[8];
#endif
    explicit IqBlock(const uint8_t* blk) : p(blk) {
#if !defined(HMOE_AVX512)
        // qh byte of quarter 2 z (words 0-7) and 2 z + 1 (words 8-15), each word's bit k brought
        // to bit 8 by a multiply by 2^(8 - k) (AVX2 has no variable 16-bit shift).
        const __m128i qh = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 66));
        const __m256i mul = _mm256_setr_epi16(256, 128, 64, 32, 16, 8, 4, 2, 256, 128, 64, 32, 16, 8, 4, 2);
        for (int z = 0; z < 4; ++z) {
            const __m128i spread = _mm_shuffle_epi8(
                qh, _mm_add_epi8(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm_set1_epi8(char(2 * z))));
            const __m256i high = _mm256_and_si256(_mm256_mullo_epi16(_mm256_cvtepu8_epi16(spread), mul), _mm256_set1_epi16(0x100));
            const __m256i low = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * z)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(index + 16 * z), _mm256_or_si256(low, high));
        }
        index_in_memory(index);
#else
        if constexpr (!Gather) {
            // qh byte of quarter 4 z + L into the eight words of 128-bit lane L (pshufb, high
            // byte zeroed), each shifted so that its bit k lands on bit 8 of word k.
            const __m512i qh = _mm512_broadcast_i32x4(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 66)));
            const __m512i lane = lane_numbers_epi16();
            const __m512i shift = _mm512_broadcast_i32x4(_mm_setr_epi16(8, 7, 6, 5, 4, 3, 2, 1));
            for (int z = 0; z < 2; ++z) {
                const __m512i spread =
                    _mm512_shuffle_epi8(qh, _mm512_add_epi16(lane, _mm512_set1_epi16(short(0x8000 + 4 * z))));
                const __m512i high = _mm512_and_si512(_mm512_sllv_epi16(spread, shift), _mm512_set1_epi16(0x100));
                const __m512i low = _mm512_cvtepu8_epi16(load32(blk + 2 + 32 * z));
                _mm512_store_si512(index + 32 * z, _mm512_or_si512(low, high));
            }
            index_in_memory(index);
        }
        // Scale nibbles in quarter order (byte 106 + j: quarters 2 j, 2 j + 1), then 2 s + 1.
        const __m128i b = _mm_cvtsi32_si128(int(load_u32(blk + 106)));
        const __m128i nib =
            _mm_unpacklo_epi8(_mm_and_si128(b, _mm_set1_epi8(15)), _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)));
        const __m256i s = _mm256_or_si256(_mm256_slli_epi32(_mm256_cvtepu8_epi32(nib), 1), _mm256_set1_epi32(1));
        _mm256_store_si256(reinterpret_cast<__m256i*>(scale), _mm256_or_si256(s, _mm256_slli_epi32(s, 16)));
        index_in_memory(scale);
#endif
    }
    float d() const { return h2f(p); }
    IqQuarter quarter(int ib) const {
        const Signs sign = signs_from_bits(load_u32(p + 74 + 4 * ib));
#if defined(HMOE_AVX512)
        const int s = scale[ib] & 0xFFFF;
        return {grid(ib), sign, _mm256_set1_epi32(scale[ib]), s, s};
#else
        const int s = 1 + 2 * ((p[106 + ib / 2] >> (4 * (ib % 2))) & 15);
        return {grid(ib), sign, _mm256_set1_epi16(short(s)), s, s};
#endif
    }
    __m256i grid(int ib) const {
#if defined(HMOE_GRID_GATHER)
        if constexpr (Gather) {
            const uint8_t* qs = p + 2 + 8 * ib;
            const __m256i hi = _mm256_slli_epi32(
                _mm256_and_si256(
                    _mm256_srlv_epi32(_mm256_set1_epi32(p[66 + ib]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                    _mm256_set1_epi32(1)),
                8);
            return gather8(kIq3sGrid, _mm256_or_si256(bytes8(qs), hi));
        }
#endif
#if defined(HMOE_AVX512)
        return grid8_words(kIq3sGrid, index + 8 * ib);
#else
        return grid8(kIq3sGrid, index + 8 * ib);
#endif
    }
};

// iq1: 8g + delta with g in {-1, 0, 1} and delta = +-1 per group of 8. The grid with its delta
// applied, 8g + 1 at entry e and 8g - 1 at entry 2048 + e (the delta bit as index bit 11), so
// that a quarter's values are its four look-ups as they come: per quarter three vector
// operations fewer than the grid's g with the delta added (32 KB against the grid's 16). One
// core of an Ice Lake under HYBRIDMOE_NATIVE_ISA=avx2 against llama.cpp's AVX2 build, same
// bytes, two runs (benchmarks/expert_decode_rates.py --llama-cpp --ggml-lib): iq1_s
// 1.08/1.14x -> 1.22/1.24x, iq1_m 1.00/0.99x -> 1.17/1.20x; its AVX-512 set against llama.cpp's
// (iq1_m's Iq1Dot from these values) iq1_m 1.34/1.34x -> 1.44/1.53x.
struct Iq1ValueTable {
    alignas(64) uint64_t entry[4096];
    constexpr Iq1ValueTable() : entry{} {
        for (int e = 0; e < 4096; ++e) {
            uint64_t v = 0;
            for (int j = 0; j < 8; ++j) {
                const int g = int(int8_t(uint8_t(kIq1sGrid[e & 2047] >> (8 * j))));
                v |= uint64_t(uint8_t(int8_t(8 * g + (e & 2048 ? -1 : 1)))) << (8 * j);
            }
            entry[e] = v;
        }
    }
};
inline constexpr Iq1ValueTable kIq1Values{};
static inline IqQuarter iq1_values_quarter(const uint64_t* table, const uint16_t* i, __m256i scale, int lo, int hi) {
    const __m256i v = grid4(table, i[0], i[1], i[2], i[3]);
    return {_mm256_abs_epi8(v), signs_of(v), scale, lo, hi};
}

template <bool Gather>
struct IqBlock<FMT_IQ1_S, Gather> {
    const uint8_t* p;
    // The 32 eleven-bit grid indices in vectors, as iq2_s's: the three high bits of entry k
    // are bits 3k .. 3k + 2 of the quarter's qh word, which a multiply by 2^(8 - 3k) brings
    // to bits 8-10 (k = 3: a shift right by one, the high half of a multiply by 2^15).
    alignas(32) uint16_t index[32];
    explicit IqBlock(const uint8_t* blk) : p(blk) {
        const __m128i qh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 34));
        const __m256i up = _mm256_setr_epi16(256, 32, 4, 0, 256, 32, 4, 0, 256, 32, 4, 0, 256, 32, 4, 0);
        const __m256i down = _mm256_setr_epi16(0, 0, 0, short(0x8000), 0, 0, 0, short(0x8000), 0, 0, 0, short(0x8000), 0,
                                               0, 0, short(0x8000));
        for (int half = 0; half < 2; ++half) {
            // qh word of quarter 4 half + q to lanes 4q .. 4q + 3
            const __m128i first = _mm_add_epi8(_mm_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3),
                                               _mm_set1_epi8(char(8 * half)));
            const __m256i w = _mm256_set_m128i(_mm_shuffle_epi8(qh, _mm_add_epi8(first, _mm_set1_epi8(4))),
                                               _mm_shuffle_epi8(qh, first));
            const __m256i high = _mm256_and_si256(_mm256_or_si256(_mm256_mullo_epi16(w, up), _mm256_mulhi_epu16(w, down)),
                                                  _mm256_set1_epi16(0x700));
            const __m256i low = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * half)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(index + 16 * half), _mm256_or_si256(low, high));
        }
        index_in_memory(index);
    }
    float d() const { return h2f(p) * 0.125f; }
    IqQuarter quarter(int ib) const {
        const int qh = load_u16(p + 34 + 2 * ib);
        const uint16_t* i = index + 4 * ib;
        const int s = 2 * (qh >> 12 & 7) + 1;
        return iq1_values_quarter(kIq1Values.entry + (qh >> 4 & 2048), i, _mm256_set1_epi16(short(s)), s, s);
    }
};

// iq1_m's d (times 1/8, the delta's unit): a float16 in the top nibbles of its four scale words.
static inline float iq1m_d(const uint8_t* p) {
    const uint16_t s0 = load_u16(p + 48), s1 = load_u16(p + 50), s2 = load_u16(p + 52), s3 = load_u16(p + 54);
    const uint16_t bits = uint16_t((s0 >> 12) | ((s1 >> 8) & 0x00F0) | ((s2 >> 4) & 0x0F00) | (s3 & 0xF000));
    return _cvtsh_ss(bits) * 0.125f;
}

template <bool Gather>
struct IqBlock<FMT_IQ1_M, Gather> {
    const uint8_t* p;
    // The 32 indices into kIq1Values (a nibble of qh each gives the grid index's high three
    // bits and, fourth, the delta's: a multiply by 256 or 16) in vectors, for the whole super-block.
    alignas(32) uint16_t index[32];
#if !defined(HMOE_AVX512)
    __m128i scales;  // iq1m_scales: a shuffle and a widening per quarter (nibble_scale_pair)

    // The sixteen 3-bit scale fields of the four words at sc as 2 s + 1, byte 2 ib + h (h = 0:
    // the quarter's first 16 values), as nibble_scales lays out iq2's: field 2 ib + h sits at
    // bit 6 (ib % 2) + 3 h of word ib / 2, i.e. field f = 4 w + k at bit 3k of word w, brought to
    // bits 9-11 of 16-bit lane f by a multiply by 2^(9 - 3k) (AVX2 has no variable 16-bit shift).
    static __m128i iq1m_scales(const uint8_t* sc) {
        const __m256i words = _mm256_shuffle_epi8(
            _mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))),
            _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7));
        const __m256i field = _mm256_and_si256(
            _mm256_srli_epi16(
                _mm256_mullo_epi16(words, _mm256_setr_epi16(512, 64, 8, 1, 512, 64, 8, 1, 512, 64, 8, 1, 512, 64, 8, 1)), 9),
            _mm256_set1_epi16(7));
        const __m256i s = _mm256_or_si256(_mm256_add_epi16(field, field), _mm256_set1_epi16(1));
        return _mm_packus_epi16(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    }
#endif
    explicit IqBlock(const uint8_t* blk) : p(blk) {
#if !defined(HMOE_AVX512)
        scales = iq1m_scales(blk + 48);
#endif
        const __m128i qh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32));
        const __m256i mul = _mm256_setr_epi16(256, 16, 256, 16, 256, 16, 256, 16, 256, 16, 256, 16, 256, 16, 256, 16);
        for (int half = 0; half < 2; ++half) {
            const __m128i nibbles = _mm_shuffle_epi8(
                qh, _mm_add_epi8(_mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm_set1_epi8(char(8 * half))));
            const __m256i high =
                _mm256_and_si256(_mm256_mullo_epi16(_mm256_cvtepu8_epi16(nibbles), mul), _mm256_set1_epi16(0xF00));
            const __m256i low = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * half)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(index + 16 * half), _mm256_or_si256(low, high));
        }
        index_in_memory(index);
    }
    float d() const { return iq1m_d(p); }
    IqQuarter quarter(int ib) const {
        const uint16_t* i = index + 4 * ib;
        const int sc = load_u16(p + 48 + 2 * (ib / 2)) >> (6 * (ib % 2));
        const int lo = 2 * (sc & 7) + 1, hi = 2 * (sc >> 3 & 7) + 1;
#if defined(HMOE_AVX512)
        return iq1_values_quarter(kIq1Values.entry, i, scale_pair(lo, hi), lo, hi);
#else
        return iq1_values_quarter(kIq1Values.entry, i, nibble_scale_pair(scales, ib), lo, hi);
#endif
    }
};

template <bool Gather>
struct IqBlock<FMT_IQ4_XS, Gather> {
    const uint8_t* p;
    explicit IqBlock(const uint8_t* blk) : p(blk) {}
    float d() const { return h2f(p); }
    IqQuarter quarter(int ib) const {
        const __m256i v = _mm256_shuffle_epi8(iq4nl_table(), nibbles32(p + 8 + 16 * ib));
        const int ls = ((p[4 + ib / 2] >> (4 * (ib % 2))) & 15) | ((load_u16(p + 2) >> (2 * ib)) & 3) << 4;
        return {_mm256_sign_epi8(v, v), signs_of(v), _mm256_set1_epi16(short(ls - 32)), ls - 32, ls - 32};
    }
};

// One decoded super-block (its eight quarters and float d) against N tokens, into each token's
// float lanes: the decode GEMV's per-token body (AVX2's many-token GEMV below computes the same
// integers in its offset form).
template <int N>
static inline void iq_tokens(const IqQuarter* q, float d, const Q8Row* acts, int64_t sb, __m256* acc) {
    __m256i sums[N];
    for (int t = 0; t < N; ++t) sums[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ++ib) {
        for (int t = 0; t < N; ++t) {
            const __m256i a = with_signs(load32(acts[t].q + 256 * sb + 32 * ib), q[ib].sign);
            sums[t] = add_scaled_pairs(sums[t], _mm256_maddubs_epi16(q[ib].mag, a), q[ib].scale);
        }
    }
    for (int t = 0; t < N; ++t)
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * acts[t].d[8 * sb]), _mm256_cvtepi32_ps(sums[t]), acc[t]);
}

// The decode GEMV on AVX-512 of iq1_m (iq1_s's and the iq2 / iq3 formats' is kernels_planes.inl's;
// it served iq1_s, iq2_xs / iq2_s / iq3_s before, figures below), and on AVX2 of iq2_s and iq3_s
// (gemv_iq_n), whose decoders store per-super-block arrays (indices, signs, scales, table
// rows): each super-block's IqBlock
// built one super-block ahead (across rows too), into one of two fixed slots in turn, so that
// the decode's narrow loads of those arrays find the constructor's vector stores long done.
// Read back right after the stores, they held the loop up (apparently no store-to-load
// forwarding from a vector store to a narrower load at an offset on Zen 4): iq1_s one token,
// L2-resident 768 x 2048, 12.3 -> 16.3 G weights/s from the slots alone (no PMU on the VM to
// say more); iq2_xs / iq2_s / iq3_s with their arrays in the old loop 14.3 / 13.5 / 10.0, here
// 18 / 19 / 13. (iq2_xxs and iq3_xxs, whose indices are the block's own bytes, gain nothing
// from it and keep the loop below.) flatten: GCC otherwise calls iq_tokens out of line, the
// quarters passed through memory.
template <Format F, bool G, int N>
[[gnu::flatten]] static void gemv_iq_ahead_n(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K,
                                             const Q8Row* acts, float* out, int64_t ldo) {
    using Blk = IqBlock<F, G>;
    constexpr int kBytes = kFormats[F].block_bytes;
    const int64_t nsb = K / 256;
    alignas(64) unsigned char slot0[(sizeof(Blk) + 63) / 64 * 64], slot1[sizeof(slot0)];
    int64_t r = 0, sb = 0;            // the super-block being multiplied
    int64_t next_r = 0, next_sb = 0;  // the one being built
    const auto advance = [&]() -> const uint8_t* {
        if (++next_sb == nsb) next_sb = 0, ++next_r;
        return w.row(row0 + (next_r < nrows ? next_r : 0)) + next_sb * kBytes;
    };
    __m256 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
    const auto step = [&](const Blk& b) {
        prefetch_span<_MM_HINT_T0>(b.p + kPrefetchAheadIq, kBytes);
        IqQuarter q[8];
#pragma GCC unroll 8
        for (int ib = 0; ib < 8; ++ib) q[ib] = b.quarter(ib);
        iq_tokens<N>(q, b.d(), acts, sb, acc);
        if (++sb == nsb) {
            for (int t = 0; t < N; ++t) out[t * ldo + r] = hsum_ps(acc[t]), acc[t] = _mm256_setzero_ps();
            sb = 0;
            ++r;
            _mm_prefetch(reinterpret_cast<const char*>(w.row(row0 + r + 1)), _MM_HINT_T0);
        }
    };
    _mm_prefetch(reinterpret_cast<const char*>(w.row(row0 + 1)), _MM_HINT_T0);
    const Blk* b0 = new (slot0) Blk(w.row(row0));
    const int64_t total = nrows * nsb;
    for (int64_t i = 0; i < total; i += 2) {
        const Blk* b1 = new (slot1) Blk(advance());
        step(*b0);
        if (i + 1 == total) break;
        b0 = new (slot0) Blk(advance());
        step(*b1);
    }
}

// n elements of v's storage from a 64-byte boundary on.
template <typename E>
static E* aligned64(std::vector<E>& v, int64_t n) {
    v.resize(size_t(n) + 64 / sizeof(E));
    const uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
    return reinterpret_cast<E*>((p + 63) & ~uintptr_t(63));
}

#if defined(HMOE_AVX512)
// Whether kernel `a` of format F is faster on this CPU than `b`, two ways to the same values:
// each timed on a small matrix of the format (64 x 2048, L2-resident, random blocks with d = 1),
// `tokens` tokens a call, the better of seven tries each. Decided once per process where it is
// first needed; the environment variable `env` = 0 or 1 decides instead (tests take both).
template <Format F, typename A, typename B>
static bool first_is_faster(const char* env, A a, B b, int tokens) {
    if (const char* v = std::getenv(env); v && (*v == '0' || *v == '1')) return *v == '1';
    constexpr int64_t kRows = 64, kK = 2048;
    constexpr int kBytes = kFormats[F].block_bytes;
    std::vector<uint8_t> blocks(size_t(kRows * (kK / 256) * kBytes));
    uint32_t x = 0x9E3779B9u;
    for (uint8_t& byte : blocks) byte = uint8_t((x = x * 1664525u + 1013904223u) >> 24);
    for (size_t i = 0; i < blocks.size(); i += kBytes) {  // d = 1 (no subnormals)
        if constexpr (F == FMT_IQ1_M) {  // float16 1.0, 0x3C00, a nibble in each scale word's top
            constexpr uint8_t kNibble[4] = {0x0, 0x0, 0xC, 0x3};
            for (int w = 0; w < 4; ++w) blocks[i + 49 + 2 * w] = uint8_t((blocks[i + 49 + 2 * w] & 0x0F) | kNibble[w] << 4);
        } else {
            blocks[i] = 0x00, blocks[i + 1] = 0x3C;
        }
    }
    int8_t q[kK];
    float d[kK / 32], sums[kK / 32] = {};
    for (int64_t k = 0; k < kK; ++k) q[k] = int8_t(k % 17 - 8);
    for (float& v : d) v = 1.0f;
    MatrixRef w;
    w.data = blocks.data();
    w.row_stride = kK / 256 * kBytes;
    std::vector<Q8Row> acts(size_t(tokens), Q8Row{q, d, sums});
    std::vector<float> out(size_t(kRows * tokens));
    const auto time_of = [&](auto gemv) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int rep = 0; rep < 2; ++rep) gemv(w, 0, kRows, kK, acts.data(), tokens, out.data(), kRows);
        return std::chrono::steady_clock::now() - t0;
    };
    auto ta = std::chrono::steady_clock::duration::max(), tb = ta;
    for (int trial = 0; trial < 7; ++trial) {
        ta = std::min(ta, time_of(a));
        tb = std::min(tb, time_of(b));
    }
    return ta < tb;
}

#include "kernels_planes.inl"

// The byte-plane GEMV of an iq2 / iq3 format, N tokens, with one-table or two-table look-ups
// (look_up_256).
template <Format F, int N, bool kOneTable>
static void gemv_planes(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, float* out,
                        int64_t ldo) {
    if constexpr (F == FMT_IQ3_XXS || F == FMT_IQ3_S)
        gemv_iq3_planes<F, N, kOneTable>(w, row0, nrows, K, acts, out, ldo);
    else
        gemv_iq2_planes<F, N, kOneTable>(w, row0, nrows, K, acts, out, ldo);
}
// Its one-token form in the signature first_is_faster times.
template <Format F, bool kOneTable>
static void gemv_planes_1(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int,
                          float* out, int64_t ldo) {
    gemv_planes<F, 1, kOneTable>(w, row0, nrows, K, acts, out, ldo);
}
template <Format F>
static bool one_table_look_ups() {
    static const bool faster =
        first_is_faster<F>("HYBRIDMOE_ONE_TABLE_LOOKUPS", gemv_planes_1<F, true>, gemv_planes_1<F, false>, 1);
    return faster;
}
#endif

// Decode: up to four tokens, their float lanes in registers (iq2_xxs and iq3_xxs on AVX-512:
// kernels_planes.inl).
template <Format F, bool G, int N>
static void gemv_iq_n(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, float* out,
                      int64_t ldo) {
#if defined(HMOE_AVX512)
    if constexpr (F == FMT_IQ1_S || F == FMT_IQ1_M || F == FMT_IQ2_XXS || F == FMT_IQ2_XS || F == FMT_IQ2_S || F == FMT_IQ3_XXS ||
                  F == FMT_IQ3_S) {
        if (one_table_look_ups<F>()) return gemv_planes<F, N, true>(w, row0, nrows, K, acts, out, ldo);
        return gemv_planes<F, N, false>(w, row0, nrows, K, acts, out, ldo);
    }
#else
    // AVX2: iq2_s and iq3_s, whose decoders store the super-block's indices in vectors, also
    // build each super-block one ahead. One core of an Ice Lake Xeon under HYBRIDMOE_NATIVE_ISA=avx2,
    // against llama.cpp's AVX2 build on the same bytes (benchmarks/expert_decode_rates.py
    // --llama-cpp --ggml-lib, two runs each): iq2_s 1.07/1.10x -> 1.19/1.21x, iq3_s (its
    // indices had been computed one by one) 0.85/0.96x -> 1.09/1.09x; iq2_xs (1.20 -> 1.00x)
    // and iq1_s lost, iq1_m was even.
    if constexpr (F == FMT_IQ2_S || F == FMT_IQ3_S)
        if (nrows > 0 && K >= 256) return gemv_iq_ahead_n<F, G, N>(w, row0, nrows, K, acts, out, ldo);
#endif
    constexpr int kBytes = kFormats[F].block_bytes;
    const int64_t nsb = K / 256;
    for (int64_t r = 0; r < nrows; ++r) {
        const uint8_t* row = w.row(row0 + r);
        __m256 acc[N];
        for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
        _mm_prefetch(reinterpret_cast<const char*>(w.row(row0 + r + 1)), _MM_HINT_T0);
        for (int64_t sb = 0; sb < nsb; ++sb) {
            const IqBlock<F, G> blk(row + sb * kBytes);
            prefetch_span<_MM_HINT_T0>(blk.p + kPrefetchAheadIq, kBytes);
            IqQuarter q[8];
#pragma GCC unroll 8
            for (int ib = 0; ib < 8; ++ib) q[ib] = blk.quarter(ib);
            iq_tokens<N>(q, blk.d(), acts, sb, acc);
        }
        for (int t = 0; t < N; ++t) out[t * ldo + r] = hsum_ps(acc[t]);
    }
}

#if !defined(HMOE_AVX512)
// Calls of more than four tokens on AVX2 (AVX-512's: gemm_iq_512 below), prompts' and a busy
// decode step's: each super-block decoded once for a block of tokens (the GEMV above decodes it
// again for every four), four rows at a time, and the signs put on its 32-value quarters once,
// not on every token's activations. vpmaddubsw takes the activations as its unsigned side
// instead, offset by 128 (x ^ 0x80, once per block of tokens): (x + 128) w in int16 pairs, at
// most 2 x 255 x 62 (these formats' values stay within +-62), and the offset's share, 128 x the
// pair's weights times the quarter's scale pair, is the same for every token, so each lane
// starts from minus its sum over the super-block. The lane's integer is then exactly
// gemv_iq_n's (whose vpsignb gives the same products: a q8 activation is never -128), and so
// are its FMA per super-block and hsum_ps: the decode GEMV's bits, per token, for any count.
// Per token and quarter that is a vpmaddubsw, a vpmaddwd and an add, where the GEMV has a
// vpsignb more, and each activation load serves four rows.
//
// Every row reads all of its block's activations, so a block is as many tokens as keep them in
// L2 (kIqTokenBlockBytes; q8 bytes and a d and a sum a 32: 1.25 bytes a column). Unblocked, an
// expert that a real prompt's uneven routing hands most of a chunk streamed them from L3 for
// every row. A layer of 128 experts of 2048 x 768, top 8, 2048 tokens routed Zipf-like (one
// expert 1725 of them), two threads on Ice Lake under HYBRIDMOE_NATIVE_ISA=avx2, iq2_xs, ms
// against the dequantized GEMM's: one row and token at a time, unblocked, 1838 / 1078;
// blocked, 1314 / 1091; offset, 1124 / 1069; four rows, 782 / 1053 (iq1_s alike); with
// uniform routing at 512 tokens, 193 / 345. Blocks of 64 KiB and 400 KiB ran within 10%.
// (The sums are held in order with an empty asm: GCC otherwise reassociated the adds, storing
// each product to the stack to add later, 15 against 17-20 multiply-adds a cycle.)
constexpr int64_t kIqTokenBlockBytes = 160 * 1024;

// A super-block of R rows, decoded for the offset activations: each row's signed quarters and
// their scale pairs, the lane sums' start (minus the offset's share) and the float d.
template <int R>
struct OffsetPanel {
    __m256i w[8][R];
    __m256i scale[8][R];
    __m256i start[R];
    float d[R];
};

template <Format F, bool G, int R>
static inline void decode_offset_panel(const MatrixRef& w, int64_t row0, int64_t sb, OffsetPanel<R>& P) {
    constexpr int kBytes = kFormats[F].block_bytes;
    const __m256i offset = _mm256_set1_epi8(char(0x80));
    for (int r = 0; r < R; ++r) {
        const IqBlock<F, G> blk(w.row(row0 + r) + sb * kBytes);
        prefetch_span<_MM_HINT_T0>(blk.p + kPrefetchAheadIq, kBytes);
        __m256i share = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ++ib) {
            const IqQuarter q = blk.quarter(ib);
            P.w[ib][r] = with_signs(q.mag, q.sign);
            P.scale[ib][r] = q.scale;
            share = add_scaled_pairs(share, _mm256_maddubs_epi16(offset, P.w[ib][r]), q.scale);
        }
        P.start[r] = _mm256_sub_epi32(_mm256_setzero_si256(), share);
        P.d[r] = blk.d();
    }
}

// The panel's super-block against N tokens' offset activations (token t's at ux + t * K), into
// each token's and row's float lanes (acc[t * R + r]): each activation load serves the R rows.
template <int R, int N>
static inline void offset_tokens(const OffsetPanel<R>& P, const Q8Row* acts, const uint8_t* ux, int64_t K, int64_t sb,
                                 __m256* acc) {
    __m256i sums[N][R];
    for (int t = 0; t < N; ++t)
        for (int r = 0; r < R; ++r) sums[t][r] = P.start[r];
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ++ib)
        for (int t = 0; t < N; ++t) {
            const __m256i a = load32(ux + t * K + 256 * sb + 32 * ib);
            for (int r = 0; r < R; ++r) {
                sums[t][r] = add_scaled_pairs(sums[t][r], _mm256_maddubs_epi16(a, P.w[ib][r]), P.scale[ib][r]);
                asm("" : "+x"(sums[t][r]));
            }
        }
    for (int t = 0; t < N; ++t) {
        const float dt = acts[t].d[8 * sb];
        for (int r = 0; r < R; ++r)
            acc[t * R + r] = _mm256_fmadd_ps(_mm256_set1_ps(P.d[r] * dt), _mm256_cvtepi32_ps(sums[t][r]), acc[t * R + r]);
    }
}

// R rows from row r against a block's nt tokens (their activations offset in ux) into out.
template <Format F, bool G, int R>
static inline void offset_rows(const MatrixRef& w, int64_t r, int64_t nsb, int64_t K, const Q8Row* a, const uint8_t* ux,
                               int nt, __m256* acc, float* out, int64_t ldo) {
    for (int i = 0; i < nt * R; ++i) acc[i] = _mm256_setzero_ps();
    _mm_prefetch(reinterpret_cast<const char*>(w.row(r + R)), _MM_HINT_T0);
    for (int64_t sb = 0; sb < nsb; ++sb) {
        OffsetPanel<R> P;
        decode_offset_panel<F, G, R>(w, r, sb, P);
        constexpr int kN = R == 1 ? 4 : 8 / R;  // the tokens a pass: at most 8 sums in registers
        int t = 0;
        for (; t + kN <= nt; t += kN) offset_tokens<R, kN>(P, a + t, ux + t * K, K, sb, acc + t * R);
        for (; t < nt; ++t) offset_tokens<R, 1>(P, a + t, ux + t * K, K, sb, acc + t * R);
    }
    for (int t = 0; t < nt; ++t)
        for (int i = 0; i < R; ++i) out[t * ldo + i] = hsum_ps(acc[t * R + i]);
}

constexpr int kIqOffsetRows = 4;

template <Format F, bool G>
static void gemv_iq_many(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                         float* out, int64_t ldo) {
    static_assert(F != FMT_IQ4_XS, "iq4_xs's values reach 127: (x + 128) w would saturate vpmaddubsw's pairs");
    const int64_t nsb = K / 256;
    const int block = int(std::max<int64_t>(4, kIqTokenBlockBytes / (K + K / 4) / 4 * 4));
    thread_local std::vector<__m256> acc_buf;
    thread_local std::vector<uint8_t> ux_buf;
    const int most = std::min(ntok, block);
    if (acc_buf.size() < size_t(most * kIqOffsetRows)) acc_buf.resize(size_t(most * kIqOffsetRows));
    if (ux_buf.size() < size_t(most * K)) ux_buf.resize(size_t(most * K));
    __m256* acc = acc_buf.data();
    uint8_t* ux = ux_buf.data();
    const __m256i offset = _mm256_set1_epi8(char(0x80));
    for (int t0 = 0; t0 < ntok; t0 += block) {
        const int nt = std::min(block, ntok - t0);
        const Q8Row* a = acts + t0;
        for (int t = 0; t < nt; ++t)
            for (int64_t k = 0; k < K; k += 32)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(ux + t * K + k), _mm256_xor_si256(load32(a[t].q + k), offset));
        int64_t r = 0;
        for (; r + kIqOffsetRows <= nrows; r += kIqOffsetRows)
            offset_rows<F, G, kIqOffsetRows>(w, row0 + r, nsb, K, a, ux, nt, acc, out + t0 * ldo + r, ldo);
        for (; r < nrows; ++r) offset_rows<F, G, 1>(w, row0 + r, nsb, K, a, ux, nt, acc, out + t0 * ldo + r, ldo);
    }
}
#endif

#if defined(HMOE_AVX512)
// Prompts on AVX-512, formats whose values stay within +-62 (all that come here; iq4_xs,
// which reaches 127, takes the 32-block GEMV): a GEMM micro-kernel with 16 rows in the vector
// lanes and the tokens broadcast, computing the integers of the decode GEMV (kernels_planes.inl:
// one per quarter and super-block) and applying them alike, one FMA per quarter and super-block
// (d x the token's d, times it, into the quarter's float lane), the super-blocks in order, then
// hsum_ps's additions of the lanes: the same bits as the decode GEMV, per token. vpdpbusd gives
// a four-value dot for 16 rows in one instruction: activations offset to unsigned bytes (x +
// 128: x ^ 0x80, once per call) against the signed weights, each scale group's chain starting
// from the offset's share -128 x the group's weights' sum, so that it holds sum x w exactly;
// times the group's scale (vpmulld), added per quarter (QuarterPanel).
//
// The weights are decoded once per call and super-block into a panel of 16 rows (the dwords
// transposed to [k][row], the offsets' shares, the scales as pairs, ~8.5 KB), which stays in L1
// while every token passes (sixteen at a time, their int32 lanes in registers; each token's
// float lanes in memory between super-blocks); the activations are transposed once per call
// to [super-block][k][token], so that a token's dword is one broadcast from a constant offset.
// Measured on Zen 4 (one core, 768 x 2048 and 2048 x 768 matrices, 32 tokens, both paths in one
// process in turn, an earlier form with eight lanes per super-block): 1.45-1.55x the
// token-at-a-time loop's speed; in a whole MoE layer, whose
// weights come cold from memory and whose super-block decoding (the grid look-ups, the same
// work in both) then takes a third to half of the time, less (see docs/architecture.md).
constexpr int kIqTileTokens = 16;  // tokens whose int32 lanes stay in registers

// One row block's super-block, decoded: token t's lane q is quarter q's 32 values .
// activations, each scale group's (kGroups in the super-block: 8, a scale per quarter, for
// iq1_s / iq2_xxs / iq3_xxs / iq3_s; 16, per 16 values, for iq1_m / iq2_xs / iq2_s) one chain of
// vpdpbusd from the offset's share, times its scale (vpmulld), added (exact: at most 32 x 62 x
// 127 x 31 < 2^24, so the conversion to float is too). Rows past the block's are zero.
template <int kGroups>
struct alignas(64) QuarterPanel {
    int32_t wq[64][16];          // the 16 rows' dwords k = 8 q + i: values 4i .. 4i + 3 of quarter q (signed bytes)
    int32_t corr[kGroups][16];   // -128 x the sum of group g's values
    int32_t scale[kGroups][16];  // group g's multiplier
    float d[16];
};

template <int kGroups, int N>
static inline void quarter_panel_tokens(const QuarterPanel<kGroups>& P, const int32_t* x, const float* xd, __m512* f) {
    constexpr int kPer = kGroups / 8, kDwords = 8 / kPer;  // groups a quarter, dwords a group
    alignas(64) __m512 dx[N];
    const __m512 d = _mm512_load_ps(P.d);
    for (int t = 0; t < N; ++t) dx[t] = _mm512_mul_ps(d, _mm512_set1_ps(xd[t]));
#pragma GCC unroll 1
    for (int q = 0; q < 8; ++q) {
        __m512i L[N];
#pragma GCC unroll 2
        for (int h = 0; h < kPer; ++h) {
            const int g = q * kPer + h;
            __m512i G[N];
            const __m512i c = _mm512_load_si512(P.corr[g]);
            for (int t = 0; t < N; ++t) G[t] = c;
#pragma GCC unroll 8
            for (int i = 0; i < kDwords; ++i) {
                const int k = 8 * q + kDwords * h + i;
                const __m512i wv = _mm512_load_si512(P.wq[k]);
#pragma GCC unroll 16
                for (int t = 0; t < N; ++t) G[t] = _mm512_dpbusd_epi32(G[t], _mm512_set1_epi32(x[16 * k + t]), wv);
            }
            const __m512i s = _mm512_load_si512(P.scale[g]);
            for (int t = 0; t < N; ++t) {
                const __m512i v = _mm512_mullo_epi32(G[t], s);
                L[t] = h == 0 ? v : _mm512_add_epi32(L[t], v);
            }
        }
        for (int t = 0; t < N; ++t) f[t * 8 + q] = _mm512_fmadd_ps(dx[t], _mm512_cvtepi32_ps(L[t]), f[t * 8 + q]);
    }
}

// body(std::integral_constant<int, N>{}) for N = n, 1 .. kIqTileTokens: a panel GEMM's tokens
// of one group as a compile-time count (their int32 accumulators stay in registers).
template <class Body>
static inline void with_tile_tokens(int n, Body&& body) {
    switch (n) {
        case 16: return body(std::integral_constant<int, 16>{});
        case 15: return body(std::integral_constant<int, 15>{});
        case 14: return body(std::integral_constant<int, 14>{});
        case 13: return body(std::integral_constant<int, 13>{});
        case 12: return body(std::integral_constant<int, 12>{});
        case 11: return body(std::integral_constant<int, 11>{});
        case 10: return body(std::integral_constant<int, 10>{});
        case 9: return body(std::integral_constant<int, 9>{});
        case 8: return body(std::integral_constant<int, 8>{});
        case 7: return body(std::integral_constant<int, 7>{});
        case 6: return body(std::integral_constant<int, 6>{});
        case 5: return body(std::integral_constant<int, 5>{});
        case 4: return body(std::integral_constant<int, 4>{});
        case 3: return body(std::integral_constant<int, 3>{});
        case 2: return body(std::integral_constant<int, 2>{});
        default: return body(std::integral_constant<int, 1>{});
    }
}
static_assert(kIqTileTokens == 16, "with_tile_tokens covers 1 .. 16 tokens");

// The end of a panel GEMM's block of 16 rows (nr of them real): token t's eight float lanes
// f[t * 8 + j] (the rows in the vector lanes) added in hsum_ps's order, ((x0 + x4) + (x2 +
// x6)) + ((x1 + x5) + (x3 + x7)), the decode GEMVs' (gemv_iq_n's hsum_ps, gemv_b32_n's
// hsum8_ps), into out[t * ldo + r].
static inline void store_panel_sums(const __m512* f, int ntok, int nr, float* out, int64_t ldo) {
    const __mmask16 mask = __mmask16((1u << nr) - 1);
    for (int t = 0; t < ntok; ++t) {
        const __m512* l = f + t * 8;
        const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6])),
                                       _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7])));
        _mm512_mask_storeu_ps(out + t * ldo, mask, s);
    }
}

// m[i][j] <- m[j][i], sixteen vectors of sixteen dwords.
static inline void transpose16x16_epi32(__m512i* m) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        m[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        m[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        m[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        m[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // m[4a + b]: per 128-bit block c, rows 4a .. 4a + 3 of column 4c + b.
    for (int a = 0; a < 4; a += 2)
        for (int b = 0; b < 4; ++b) {
            t[4 * a + b] = _mm512_shuffle_i32x4(m[4 * a + b], m[4 * a + 4 + b], 0x88);
            t[4 * a + 4 + b] = _mm512_shuffle_i32x4(m[4 * a + b], m[4 * a + 4 + b], 0xDD);
        }
    for (int b = 0; b < 4; ++b) {
        m[b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0x88);
        m[8 + b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0xDD);
        m[4 + b] = _mm512_shuffle_i32x4(t[4 + b], t[12 + b], 0x88);
        m[12 + b] = _mm512_shuffle_i32x4(t[4 + b], t[12 + b], 0xDD);
    }
}

// Super-block sb of rows r0 .. r0 + nr - 1 (nr <= 16; the others zero), with the same
// super-block of the next `next` rows prefetched: the values with their signs transposed to
// wq[k][row] (dword k = 8 q + i holds values 4i .. 4i + 3 of quarter q), the rows' d, and each
// row's quarter multipliers handed to scales(r, lo, hi) (zeros for the rows past nr).
template <Format F, bool G, class Scales>
static void decode_panel_rows(const MatrixRef& w, int64_t r0, int nr, int next, int64_t sb, int32_t (*wq)[16], float* d,
                              Scales&& scales) {
    constexpr int kBytes = kFormats[F].block_bytes;
    alignas(64) int32_t rows[16][64];
    for (int r = 0; r < 16; ++r) {
        int lo[8] = {}, hi[8] = {};
        if (r >= nr) {
            for (int k = 0; k < 64; k += 16) _mm512_store_si512(rows[r] + k, _mm512_setzero_si512());
            d[r] = 0.0f;
        } else {
            const IqBlock<F, G> blk(w.row(r0 + r) + sb * kBytes);
            if (r < next) prefetch_span<_MM_HINT_T0>(w.row(r0 + 16 + r) + sb * kBytes, kBytes);
            for (int q = 0; q < 8; ++q) {
                const IqQuarter a = blk.quarter(q);
                _mm256_store_si256(reinterpret_cast<__m256i*>(rows[r] + 8 * q), with_signs(a.mag, a.sign));
                lo[q] = a.lo, hi[q] = a.hi;
            }
            d[r] = blk.d();
        }
        scales(r, lo, hi);
    }
    for (int c = 0; c < 4; ++c) {
        __m512i m[16];
        for (int r = 0; r < 16; ++r) m[r] = _mm512_load_si512(rows[r] + 16 * c);
        transpose16x16_epi32(m);
        for (int k = 0; k < 16; ++k) _mm512_store_si512(wq[16 * c + k], m[k]);
    }
}

// -128 x the sum of dwords wq[k0 .. k0 + n) of each row: the activations' offset's share.
static inline __m512i offset_share(const int32_t (*wq)[16], int k0, int n) {
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < n; ++i) sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(char(0x80)), _mm512_load_si512(wq[k0 + i]));
    return _mm512_sub_epi32(_mm512_setzero_si512(), sum);
}

// A row block's super-block into the panel.
template <Format F, bool G, int kGroups>
static void quarter_decode_panel(const MatrixRef& w, int64_t r0, int nr, int next, int64_t sb, QuarterPanel<kGroups>& P) {
    constexpr int kPer = kGroups / 8, kDwords = 8 / kPer;
    decode_panel_rows<F, G>(w, r0, nr, next, sb, P.wq, P.d, [&](int r, const int* lo, const int* hi) {
        for (int q = 0; q < 8; ++q) {
            P.scale[kPer * q][r] = lo[q];
            if (kPer == 2) P.scale[kPer * q + 1][r] = hi[q];
        }
    });
    for (int g = 0; g < kGroups; ++g) _mm512_store_si512(P.corr[g], offset_share(P.wq, kDwords * g, kDwords));
}

// The activations of the 16-row panel GEMMs (gemm_iq_512, gemm_b32_512), once per call: in
// groups of 16 tokens, each super-block's dwords k of the group's tokens side by side,
// X[((sb * ngroups + g) * 64 + k) * 16 + t] (the tokens past ntok in the last group zero), so
// that a token's dword is one broadcast; offset to unsigned bytes (x + 128, as x ^ 0x80) where
// kOffset (gemm_iq_512's, whose weights are vpdpbusd's signed operand). In a per-thread
// buffer, valid until the thread's next call.
template <bool kOffset>
static const int32_t* transposed_acts(const Q8Row* acts, int ntok, int64_t K) {
    const int64_t nsb = K / 256;
    const int ngroups = (ntok + kIqTileTokens - 1) / kIqTileTokens;
    thread_local std::vector<int32_t> x_buf;
    int32_t* const X = aligned64(x_buf, nsb * ngroups * 64 * 16);
    for (int g = 0; g < ngroups; ++g) {
        const int t0 = g * kIqTileTokens, n = std::min(kIqTileTokens, ntok - t0);
        for (int64_t k = 0; k < K; k += 64) {
            __m512i m[16];
            for (int t = 0; t < 16; ++t) m[t] = _mm512_setzero_si512();
            for (int t = 0; t < n; ++t) {
                m[t] = _mm512_loadu_si512(acts[t0 + t].q + k);
                if constexpr (kOffset) m[t] = _mm512_xor_si512(m[t], _mm512_set1_epi8(char(0x80)));
            }
            transpose16x16_epi32(m);
            int32_t* dst = X + ((k / 256 * ngroups + g) * 64 + k % 256 / 4) * 16;
            for (int kk = 0; kk < 16; ++kk) _mm512_store_si512(dst + 16 * kk, m[kk]);
        }
    }
    return X;
}

template <Format F, bool G>
static void gemm_iq_512(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                        float* out, int64_t ldo) {
    const int64_t nsb = K / 256;
    const int ngroups = (ntok + kIqTileTokens - 1) / kIqTileTokens;
    thread_local std::vector<float> f_buf;
    thread_local std::vector<float> xds;
    const int32_t* const X = transposed_acts<true>(acts, ntok, K);
    // Each super-block's token d's.
    xds.resize(size_t(ntok) * size_t(nsb));
    for (int t = 0; t < ntok; ++t)
        for (int64_t sb = 0; sb < nsb; ++sb) xds[size_t(sb * ntok + t)] = acts[t].d[8 * sb];
    __m512* const f = reinterpret_cast<__m512*>(aligned64(f_buf, int64_t(ntok) * 8 * 16));
    constexpr int kGroups = F == FMT_IQ1_M || F == FMT_IQ2_XS || F == FMT_IQ2_S ? 16 : 8;
    alignas(64) QuarterPanel<kGroups> P;
    // The blocks are read super-block by super-block across 16 rows, not along a row, which
    // the hardware's stream prefetch follows less well: each row's super-block is decoded
    // with the same one of the row 16 further on prefetched (decode_panel_rows), the first row
    // block's all at the start.
    constexpr int kBytes = kFormats[F].block_bytes;
    for (int r = 0; r < std::min<int64_t>(16, nrows); ++r) prefetch_span<_MM_HINT_T0>(w.row(row0 + r), int(nsb) * kBytes);
    for (int64_t rb = 0; rb < nrows; rb += 16) {
        const int nr = int(std::min<int64_t>(16, nrows - rb));
        const int next = int(std::min<int64_t>(16, nrows - rb - 16));
        for (int64_t i = 0; i < int64_t(ntok) * 8; ++i) f[i] = _mm512_setzero_ps();
        for (int64_t sb = 0; sb < nsb; ++sb) {
            quarter_decode_panel<F, G>(w, row0 + rb, nr, next, sb, P);
            const float* xd = xds.data() + sb * ntok;
            for (int g = 0; g < ngroups; ++g) {
                const int t0 = g * kIqTileTokens;
                const int32_t* x = X + (sb * ngroups + g) * 64 * 16;
                with_tile_tokens(std::min(kIqTileTokens, ntok - t0),
                                 [&](auto n) { quarter_panel_tokens<kGroups, decltype(n)::value>(P, x, xd + t0, f + t0 * 8); });
            }
        }
        store_panel_sums(f, ntok, nr, out + rb, ldo);
    }
}

// iq4_nl's values + 128 (as x ^ 0x80), the panel's unsigned bytes.
struct Iq4nlOffsetTable {
    alignas(16) int8_t v[16];
    constexpr Iq4nlOffsetTable() : v{} {
        for (int i = 0; i < 16; ++i) v[i] = int8_t(kIq4nlValues[i] ^ 0x80);
    }
};
inline constexpr Iq4nlOffsetTable kIq4nlOffset{};

// iq4_xs's prompts on AVX-512 (calls of more than four tokens; kernels_x86.inl's
// gemv_q8_b32_any): gemm_iq_512's form for the 32-block GEMV's arithmetic. 16 rows in the
// lanes, a super-block's values (iq4_nl's table, as Block32::codes) offset to unsigned bytes
// (w + 128) and transposed to [k][row] dwords; the tokens' signed activations transposed
// (transposed_acts), a token's dword the embedded broadcast of vpdpbusd's memory operand (no
// broadcast instruction of its own). Block j of a super-block is one vpdpbusd chain over its
// eight dwords per token, starting from the offset's share -128 x the token's sum over the
// block: gemv_b32_n's block integer (hsum8's lane j; exact, at most 32 x 255 x 127 in size).
// Each block then takes gemv_b32_n's float step, the same operands in the same order:
// (d * (ls - 32)) x the token's d of the block, times the integer, into the token's float
// lane j (fma), the lanes kept in memory between super-blocks, and at the end of the row
// block hsum_ps's (hsum8_ps's) additions of the eight lanes: the same bits as the decode GEMV,
// per token, however the tokens are grouped. Per token and 16 x 256 values: 64 vpdpbusd (64
// multiply-adds each) and 8 x (broadcast, cvt, mul, fma), where gemv_b32_many spends per row
// 8 signs + 8 dpbusd (32 each) + a hsum8.
struct alignas(64) B32Panel {
    uint32_t wq[64][16];  // dword k (values 4k .. 4k + 3 of the super-block) of the 16 rows, + 128
    float dws[8][16];     // block j: d * (ls_j - 32), as scales8 computes it
};

// Super-block sb of rows r0 .. r0 + nr - 1 (nr <= 16; the others zero) into a panel, with
// the same super-block of the next `next` rows prefetched.
template <Format F>
static void b32_decode_panel(const MatrixRef& w, int64_t r0, int nr, int next, int64_t sb, B32Panel& P) {
    static_assert(F == FMT_IQ4_XS, "iq4_xs's super-blocks only");
    constexpr int kBytes = kFormats[F].block_bytes;
    const uint8_t* p[16];
    alignas(64) uint16_t dh[16], sh[16];
    alignas(64) uint32_t sl[16];
    for (int r = 0; r < 16; ++r) {
        if (r >= nr) {
            p[r] = nullptr;
            dh[r] = sh[r] = 0;
            sl[r] = 0;
            continue;
        }
        p[r] = w.row(r0 + r) + sb * kBytes;
        if (r < next) prefetch_span<_MM_HINT_T0>(w.row(r0 + 16 + r) + sb * kBytes, kBytes);
        dh[r] = load_u16(p[r]);
        sh[r] = load_u16(p[r] + 2);
        sl[r] = load_u32(p[r] + 4);
    }
    // Blocks 2c and 2c + 1 of a row (32 bytes of nibbles) as one vector of its 64 values,
    // [low nibbles of 2c, high of 2c, low of 2c + 1, high of 2c + 1] (Block32::codes' order),
    // through the table offset by 128.
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4nlOffset.v)));
    const __m512i halves = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
        __m512i m[16];
        for (int r = 0; r < 16; ++r) {
            if (r >= nr) {
                m[r] = _mm512_setzero_si512();
                continue;
            }
            __m512i v = _mm512_permutexvar_epi64(halves, _mm512_castsi256_si512(load32(p[r] + 8 + 32 * c)));
            v = _mm512_mask_srli_epi16(v, __mmask32(0xFF00FF00u), v, 4);
            m[r] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
        }
        transpose16x16_epi32(m);
        for (int k = 0; k < 16; ++k) _mm512_store_si512(P.wq[16 * c + k], m[k]);
    }
    // scales8<FMT_IQ4_XS>'s arithmetic with the rows in the lanes: ls_j's low nibble at bit 4j
    // of scales_l, its high two bits at bit 2j of scales_h; h2f(d) x float(ls_j - 32).
    const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh)));
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(sh)));
    const __m512i l = _mm512_load_si512(sl);
    for (int j = 0; j < 8; ++j) {
        const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(l, unsigned(4 * j)), _mm512_set1_epi32(0x0F));
        const __m512i hi = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, unsigned(2 * j)), _mm512_set1_epi32(3)), 4);
        const __m512i ls = _mm512_sub_epi32(_mm512_or_si512(lo, hi), _mm512_set1_epi32(32));
        _mm512_store_ps(P.dws[j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(ls)));
    }
}

// acc + vpdpbusd of the unsigned bytes u and the signed dword at s broadcast, as the
// instruction's embedded broadcast (GCC issues a vpbroadcastd of its own for the intrinsic
// on _mm512_set1_epi32(*s): a second instruction per multiply, 1.1x the time at 32 tokens).
static inline __m512i dpbusd_bcast(__m512i acc, __m512i u, const int32_t* s) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*s));
    return acc;
}

// N tokens against a panel, into f[t * 8 + j], token t's float lane j over the 16 rows. x:
// their activations at this super-block (dword k of token t at x[16 k + t]); xc[16 j + t]:
// token t's -128 x sum over block j; xd[16 j + t]: token t's d of block j.
template <int N>
static inline void b32_panel_tokens(const B32Panel& P, const int32_t* x, const int32_t* xc, const float* xd,
                                    __m512* f) {
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
        __m512i I[N];
        for (int t = 0; t < N; ++t) I[t] = _mm512_set1_epi32(xc[16 * j + t]);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
            const __m512i wv = _mm512_load_si512(P.wq[8 * j + i]);
            const int32_t* xk = x + 16 * (8 * j + i);
#pragma GCC unroll 16
            for (int t = 0; t < N; ++t) I[t] = dpbusd_bcast(I[t], wv, xk + t);
        }
        const __m512 dw = _mm512_load_ps(P.dws[j]);
#pragma GCC unroll 16
        for (int t = 0; t < N; ++t)
            f[t * 8 + j] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xd[16 * j + t])), _mm512_cvtepi32_ps(I[t]),
                                           f[t * 8 + j]);
    }
}

template <Format F>
static void gemm_b32_512(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                         float* out, int64_t ldo) {
    const int64_t nsb = K / 256;
    const int ngroups = (ntok + kIqTileTokens - 1) / kIqTileTokens;
    thread_local std::vector<float> f_buf;
    thread_local std::vector<int32_t> xc_buf;
    thread_local std::vector<float> xd_buf;
    const int32_t* const X = transposed_acts<false>(acts, ntok, K);
    // The offset's shares, -128 x each token's sum over each block, the group's tokens side by
    // side: XC[((sb * ngroups + g) * 8 + j) * 16 + t].
    int32_t* const XC = aligned64(xc_buf, nsb * ngroups * 8 * 16);
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t q = 0; q < nsb * ngroups * 8; ++q) {
        __m512i s = _mm512_setzero_si512();
        for (int i = 0; i < 8; ++i) s = _mm512_dpbusd_epi32(s, ones, _mm512_load_si512(X + (8 * q + i) * 16));
        _mm512_store_si512(XC + 16 * q, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 7)));
    }
    // And their d's the same way: XD[((sb * ngroups + g) * 8 + j) * 16 + t] (of 32-block 8 sb + j).
    float* const XD = aligned64(xd_buf, nsb * ngroups * 8 * 16);
    for (int t = 0; t < ntok; ++t) {
        const float* d = acts[t].d;
        float* dst = XD + (t / kIqTileTokens) * 8 * 16 + t % kIqTileTokens;
        for (int64_t b = 0; b < nsb * 8; ++b) dst[(b / 8 * ngroups * 8 + b % 8) * 16] = d[b];
    }
    __m512* const f = reinterpret_cast<__m512*>(aligned64(f_buf, int64_t(ntok) * 8 * 16));
    alignas(64) B32Panel P;
    constexpr int kBytes = kFormats[F].block_bytes;
    for (int r = 0; r < std::min<int64_t>(16, nrows); ++r) prefetch_span<_MM_HINT_T0>(w.row(row0 + r), int(nsb) * kBytes);
    for (int64_t rb = 0; rb < nrows; rb += 16) {
        const int nr = int(std::min<int64_t>(16, nrows - rb));
        const int next = int(std::min<int64_t>(16, nrows - rb - 16));
        for (int64_t i = 0; i < int64_t(ntok) * 8; ++i) f[i] = _mm512_setzero_ps();
        for (int64_t sb = 0; sb < nsb; ++sb) {
            b32_decode_panel<F>(w, row0 + rb, nr, next, sb, P);
            for (int g = 0; g < ngroups; ++g) {
                const int t0 = g * kIqTileTokens;
                const int64_t q = (sb * ngroups + g) * 8 * 16;
                with_tile_tokens(std::min(kIqTileTokens, ntok - t0), [&](auto n) {
                    b32_panel_tokens<decltype(n)::value>(P, X + q * 8, XC + q, XD + q, f + t0 * 8);
                });
            }
        }
        store_panel_sums(f, ntok, nr, out + rb, ldo);
    }
}

// q3_k's and q2_k's prompts on AVX-512 (calls of more than four tokens; kernels_x86.inl's
// gemv_q8_q3k / gemv_q8_q2k): gemm_b32_512's form for gemv_q23k_n's arithmetic, the same bits
// per token. That GEMV's int32 lane L of a super-block (per token) is the sum over the eight
// quarters q of s(q, L) x (codes . activations of the quarter's dword L), s the scale of the
// 16 the dword lies in (L < 4: group 2q, else 2q + 1); q3_k's (6-bit, less 32, codes 0 .. 7)
// less 4 x (s_2L A_2L + s_2L+1 A_2L+1) (A_g: the token's sum over group g; the codes' offset
// of 4, taken off in lanes other than the ones its products fell in); q2_k's (4-bit, codes 0
// .. 3) with no offset, its mins apart: lane L of a second float sum is dmin x d times m_2L
// A_2L + m_2L+1 A_2L+1. Here 16 rows in the lanes, a super-block's values decoded once per
// 16 rows for all of the call's tokens as bytes through a vpshufb table per 16 (q2_k: s x
// code, 0 .. 45; q3_k: u = 128 - s x (code - 4), 0 .. 252, as s x code does not fit a byte)
// and transposed to [k][row] dwords; lane L is one chain of eight vpdpbusd over dwords 8q + L,
// each token's dword the embedded broadcast. q3_k's chain starts from -128 x the token's sum
// over those dwords, which leaves -(sum s (code - 4) a), and five vpdpwssd of the row's scale
// pairs with the token's coefficients (x -4) per group add -4 x (sum s a over the lane's
// dwords - s_2L A_2L - s_2L+1 A_2L+1): J = -I, I the GEMV's lane integer, exactly (at most
// ~2^21 in size); its float step, the GEMV's fma(d x d_t, I, acc), is fma(-d x d_t, J, acc):
// the same product (negation is exact), the same bits. q2_k's chain from zero is the GEMV's
// integer itself; its mins' integer one vpdpwssd of the row's (m_2L, m_2L+1) with the token's
// (A_2L, A_2L+1). The lanes stay in memory between super-blocks; at the end of a row block
// (q2_k: acc - accm per lane, as the GEMV) hsum_ps's additions. The activations' sums come
// from the transposed activations, 16 tokens a vector, once per call.
struct alignas(64) Q23Panel {
    uint32_t wq[64][16];  // dword k (values 4k .. 4k + 3) of the 16 rows: the bytes above
    uint32_t sp[8][16];   // q3_k's scale pairs (s_g1, s_g2) as int16: 0-3 (4p, 4p + 2), 4-7 (4p + 1,
                          // 4p + 3); q2_k's min pairs (m_2L, m_2L+1)
    float d[16];          // q3_k: -d; q2_k: d
    float dmin[16];       // q2_k
};

// q3_k's scale pair p (0 .. 4) of lane L: the four of the lane's parity and the other
// parity's pair that holds group 2L or 2L + 1.
static constexpr int q3k_pair(int L, int p) { return p < 4 ? (L < 4 ? p : 4 + p) : (L < 4 ? 4 + L / 2 : L / 2); }

template <bool kThree>
static constexpr int kQ23Bytes = kFormats[kThree ? FMT_Q3_K : FMT_Q2_K].block_bytes;

template <bool kThree>
static void q23k_decode_panel(const MatrixRef& w, int64_t r0, int nr, int next, int64_t sb, Q23Panel& P) {
    constexpr int kBytes = kQ23Bytes<kThree>;
    alignas(64) int32_t rows[16][64];
    alignas(64) int32_t sp_rows[16][16];
    const __m512i low2 = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4), k128 = _mm512_set1_epi16(kThree ? 128 : 0);
    // Chunk c = values 64c .. 64c + 63: half c / 2, quarters 2 (c & 1) and 2 (c & 1) + 1.
    const __m512i shift[2] = {_mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1),
                              _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)};
    __m512i bit[4], idx[4];
    for (int c = 0; c < 4; ++c) {
        const int b = 4 * (c / 2) + 2 * (c & 1);
        bit[c] = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << b)), _mm256_set1_epi8(char(1 << (b + 1))), 1);
        alignas(64) int16_t ix[32];
        for (int p = 0; p < 32; ++p) ix[p] = int16_t(4 * c + p / 8);
        idx[c] = _mm512_load_si512(ix);
    }
    // Table entry i of a 16's lane: q3_k 128 + s (4 - i), q2_k s i.
    alignas(64) int16_t mc[32];
    for (int p = 0; p < 32; ++p) mc[p] = int16_t(kThree ? 4 - p % 8 : p % 8);
    const __m512i mul = _mm512_load_si512(mc);
    const __m256i pairs = _mm256_setr_epi16(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int r = 0; r < 16; ++r) {
        if (r >= nr) {
            for (int k = 0; k < 64; k += 16) _mm512_store_si512(rows[r] + k, _mm512_setzero_si512());
            _mm512_store_si512(sp_rows[r], _mm512_setzero_si512());
            P.d[r] = P.dmin[r] = 0.0f;
            continue;
        }
        const uint8_t* b = w.row(r0 + r) + sb * kBytes;
        if (r < next) prefetch_span<_MM_HINT_T0>(w.row(r0 + 16 + r) + sb * kBytes, kBytes);
        __m256i s16;
        if constexpr (kThree) {
            s16 = _mm256_cvtepi8_epi16(q3k_scales16(b + 96));
            _mm512_store_si512(sp_rows[r], _mm512_zextsi256_si512(_mm256_permutexvar_epi16(pairs, s16)));
        } else {
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), m4 = _mm_set1_epi8(0x0F);
            s16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m4));
            _mm512_store_si512(sp_rows[r],
                               _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4))));
        }
        const __m512i s512 = _mm512_zextsi256_si512(s16);
        const __m512i hm = kThree ? _mm512_broadcast_i64x4(load32(b)) : _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
            const __m512i qs = _mm512_broadcast_i64x4(load32(b + (kThree ? 32 : 16) + 32 * (c / 2)));
            __m512i code = _mm512_and_si512(_mm512_srlv_epi16(qs, shift[c & 1]), low2);
            if constexpr (kThree) code = _mm512_mask_add_epi8(code, _mm512_test_epi8_mask(hm, bit[c]), code, four);
            const __m512i tw = _mm512_add_epi16(_mm512_mullo_epi16(_mm512_permutexvar_epi16(idx[c], s512), mul), k128);
            _mm512_store_si512(rows[r] + 16 * c, _mm512_shuffle_epi8(_mm512_packus_epi16(tw, tw), code));
        }
        if constexpr (kThree) {
            P.d[r] = -h2f(b + 108);
        } else {
            P.d[r] = h2f(b + 80);
            P.dmin[r] = h2f(b + 82);
        }
    }
    for (int c = 0; c < 4; ++c) {
        __m512i m[16];
        for (int r = 0; r < 16; ++r) m[r] = _mm512_load_si512(rows[r] + 16 * c);
        transpose16x16_epi32(m);
        for (int k = 0; k < 16; ++k) _mm512_store_si512(P.wq[16 * c + k], m[k]);
    }
    __m512i m[16];
    for (int r = 0; r < 16; ++r) m[r] = _mm512_load_si512(sp_rows[r]);
    transpose16x16_epi32(m);
    for (int k = 0; k < 8; ++k) _mm512_store_si512(P.sp[k], m[k]);
}

static inline __m512i dpwssd_bcast(__m512i acc, __m512i u, const int32_t* s) {
    asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*s));
    return acc;
}

// N tokens against a panel, into f[t * 8 + L] (q2_k's mins into fm[t * 8 + L]). x: their
// activations at this super-block (dword k of token t at x[16 k + t]); xc[16 L + t]: q3_k's
// -128 x token t's sum over lane L's dwords; xe[16 (5 L + p) + t]: q3_k's coefficient pair
// of token t for the lane's scale pair p, q2_k's (A_2L, A_2L+1) at xe[16 L + t]; xd[t]:
// token t's d of the super-block.
template <bool kThree, int N>
static inline void q23k_panel_tokens(const Q23Panel& P, const int32_t* x, const int32_t* xc, const int32_t* xe,
                                     const float* xd, __m512* f, __m512* fm) {
    alignas(64) __m512 dx[N];
    const __m512 d = _mm512_load_ps(P.d);
    for (int t = 0; t < N; ++t) dx[t] = _mm512_mul_ps(d, _mm512_set1_ps(xd[t]));
    if constexpr (!kThree) {
        alignas(64) __m512 dmx[N];
        const __m512 dmin = _mm512_load_ps(P.dmin);
        for (int t = 0; t < N; ++t) dmx[t] = _mm512_mul_ps(dmin, _mm512_set1_ps(xd[t]));
#pragma GCC unroll 1
        for (int L = 0; L < 8; ++L) {
            const __m512i sv = _mm512_load_si512(P.sp[L]);
#pragma GCC unroll 16
            for (int t = 0; t < N; ++t) {
                const __m512i M = dpwssd_bcast(_mm512_setzero_si512(), sv, xe + 16 * L + t);
                fm[t * 8 + L] = _mm512_fmadd_ps(dmx[t], _mm512_cvtepi32_ps(M), fm[t * 8 + L]);
            }
        }
    }
#pragma GCC unroll 1
    for (int L = 0; L < 8; ++L) {
        __m512i J[N];
        for (int t = 0; t < N; ++t) J[t] = kThree ? _mm512_set1_epi32(xc[16 * L + t]) : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
            const __m512i wv = _mm512_load_si512(P.wq[8 * q + L]);
            const int32_t* xk = x + 16 * (8 * q + L);
#pragma GCC unroll 16
            for (int t = 0; t < N; ++t) J[t] = dpbusd_bcast(J[t], wv, xk + t);
        }
        if constexpr (kThree) {
#pragma GCC unroll 5
            for (int p = 0; p < 5; ++p) {
                const __m512i sv = _mm512_load_si512(P.sp[q3k_pair(L, p)]);
                const int32_t* xk = xe + 16 * (5 * L + p);
#pragma GCC unroll 16
                for (int t = 0; t < N; ++t) J[t] = dpwssd_bcast(J[t], sv, xk + t);
            }
        }
#pragma GCC unroll 16
        for (int t = 0; t < N; ++t) f[t * 8 + L] = _mm512_fmadd_ps(dx[t], _mm512_cvtepi32_ps(J[t]), f[t * 8 + L]);
    }
}

template <bool kThree>
static void gemm_q23k_512(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                          float* out, int64_t ldo) {
    const int64_t nsb = K / 256;
    const int ngroups = (ntok + kIqTileTokens - 1) / kIqTileTokens;
    constexpr int kPairs = kThree ? 5 : 1;
    thread_local std::vector<float> f_buf, fm_buf;
    thread_local std::vector<int32_t> xc_buf, xe_buf;
    thread_local std::vector<float> xd_buf;
    const int32_t* const X = transposed_acts<false>(acts, ntok, K);
    // Per super-block and group of 16 tokens, the tokens side by side: XC[((sb * ngroups + g)
    // * 8 + L) * 16 + t], XE[(((sb * ngroups + g) * 8 + L) * kPairs + p) * 16 + t], XD[(sb *
    // ngroups + g) * 16 + t]; from the transposed activations, 16 tokens a vector: a4[k], the
    // sums of dwords k, and A[g], of the 16s.
    int32_t* const XC = aligned64(xc_buf, nsb * ngroups * 8 * 16);
    int32_t* const XE = aligned64(xe_buf, nsb * ngroups * 8 * kPairs * 16);
    float* const XD = aligned64(xd_buf, nsb * ngroups * 16);
    const __m512i ones = _mm512_set1_epi8(1), low16 = _mm512_set1_epi32(0xFFFF);
    for (int64_t q0 = 0; q0 < nsb * ngroups; ++q0) {
        const int32_t* x = X + q0 * 64 * 16;
        __m512i a4[64], A[16];
        for (int k = 0; k < 64; ++k) a4[k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_load_si512(x + 16 * k));
        for (int g = 0; g < 16; ++g)
            A[g] = _mm512_add_epi32(_mm512_add_epi32(a4[4 * g], a4[4 * g + 1]), _mm512_add_epi32(a4[4 * g + 2], a4[4 * g + 3]));
        for (int L = 0; L < 8; ++L) {
            if constexpr (!kThree) {
                _mm512_store_si512(XE + (q0 * 8 + L) * 16,
                                   _mm512_or_si512(_mm512_and_si512(A[2 * L], low16), _mm512_slli_epi32(A[2 * L + 1], 16)));
                continue;
            }
            __m512i S = _mm512_setzero_si512();
            for (int q = 0; q < 8; ++q) S = _mm512_add_epi32(S, a4[8 * q + L]);
            _mm512_store_si512(XC + (q0 * 8 + L) * 16, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(S, 7)));
            // Group g's coefficient in lane L: the lane's dword of g's quarter where the lane
            // takes g's scale, less A_g where g is 2L or 2L + 1; times -4.
            auto coef = [&](int g) {
                __m512i v = _mm512_setzero_si512();
                if ((g & 1) == (L < 4 ? 0 : 1)) v = a4[8 * (g / 2) + L];
                if (g == 2 * L || g == 2 * L + 1) v = _mm512_sub_epi32(v, A[g]);
                return _mm512_mullo_epi32(v, _mm512_set1_epi32(-4));
            };
            for (int p = 0; p < kPairs; ++p) {
                const int i = q3k_pair(L, p), g1 = i < 4 ? 4 * i : 4 * (i - 4) + 1;
                _mm512_store_si512(XE + ((q0 * 8 + L) * kPairs + p) * 16,
                                   _mm512_or_si512(_mm512_and_si512(coef(g1), low16), _mm512_slli_epi32(coef(g1 + 2), 16)));
            }
        }
    }
    for (int t = 0; t < ntok; ++t) {
        const int g = t / kIqTileTokens, tt = t % kIqTileTokens;
        for (int64_t sb = 0; sb < nsb; ++sb) XD[(sb * ngroups + g) * 16 + tt] = acts[t].d[8 * sb];
    }
    __m512* const f = reinterpret_cast<__m512*>(aligned64(f_buf, int64_t(ntok) * 8 * 16));
    __m512* const fm = kThree ? nullptr : reinterpret_cast<__m512*>(aligned64(fm_buf, int64_t(ntok) * 8 * 16));
    alignas(64) Q23Panel P;
    constexpr int kBytes = kQ23Bytes<kThree>;
    for (int r = 0; r < std::min<int64_t>(16, nrows); ++r) prefetch_span<_MM_HINT_T0>(w.row(row0 + r), int(nsb) * kBytes);
    for (int64_t rb = 0; rb < nrows; rb += 16) {
        const int nr = int(std::min<int64_t>(16, nrows - rb));
        const int next = int(std::min<int64_t>(16, nrows - rb - 16));
        for (int64_t i = 0; i < int64_t(ntok) * 8; ++i) f[i] = _mm512_setzero_ps();
        if constexpr (!kThree)
            for (int64_t i = 0; i < int64_t(ntok) * 8; ++i) fm[i] = _mm512_setzero_ps();
        for (int64_t sb = 0; sb < nsb; ++sb) {
            q23k_decode_panel<kThree>(w, row0 + rb, nr, next, sb, P);
            for (int g = 0; g < ngroups; ++g) {
                const int t0 = g * kIqTileTokens;
                const int64_t q0 = sb * ngroups + g;
                with_tile_tokens(std::min(kIqTileTokens, ntok - t0), [&](auto n) {
                    q23k_panel_tokens<kThree, decltype(n)::value>(P, X + q0 * 64 * 16, XC + q0 * 8 * 16,
                                                                  XE + q0 * 8 * kPairs * 16, XD + q0 * 16, f + t0 * 8,
                                                                  kThree ? nullptr : fm + t0 * 8);
                });
            }
        }
        if constexpr (!kThree)  // the GEMV's acc - accm, lane by lane
            for (int64_t i = 0; i < int64_t(ntok) * 8; ++i) f[i] = _mm512_sub_ps(f[i], fm[i]);
        store_panel_sums(f, ntok, nr, out + rb, ldo);
    }
}

static void gemm_q3k_512(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                         float* out, int64_t ldo) {
    gemm_q23k_512<true>(w, row0, nrows, K, acts, ntok, out, ldo);
}
static void gemm_q2k_512(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                         float* out, int64_t ldo) {
    gemm_q23k_512<false>(w, row0, nrows, K, acts, ntok, out, ldo);
}
#endif

template <Format F, bool G>
struct IqG {
    template <int N>
    struct Gemv {
        static void run(const MatrixRef& w, int64_t r0, int64_t n, int64_t K, const Q8Row* a, float* o, int64_t l) {
            gemv_iq_n<F, G, N>(w, r0, n, K, a, o, l);
        }
    };
};

template <Format F, bool G>
static void gemv_q8_iq_with(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                            float* out, int64_t ldo) {
#if defined(HMOE_AVX512)
    if (ntok > kMaxGemvTokens) return gemm_iq_512<F, G>(w, row0, nrows, K, acts, ntok, out, ldo);
#else
    if (ntok > kMaxGemvTokens) return gemv_iq_many<F, G>(w, row0, nrows, K, acts, ntok, out, ldo);
#endif
    by_tokens<IqG<F, G>::template Gemv>(w, row0, nrows, K, acts, ntok, out, ldo);
}

#if defined(HMOE_GRID_GATHER)
// Whether gathering the grid look-ups is faster on this CPU than loading them one by one:
// timed once per format, on first use (first_is_faster). It depends on the core, not on the
// format's bytes: on the Xeon (AVX-512, AMX) gathering won for all three formats (iq2_s 24 ->
// 33, iq3_xxs 31 -> 35, iq3_s 17 -> 27 G weights/s), on an AMD EPYC (Zen 4) it lost for two
// (iq3_xxs 13.5 -> 8.9, iq2_s 11.4 -> 9.9) and won for iq3_s (7.5 -> 8.9): one token, one thread; since iq3_s's
// indices are computed per super-block in vectors and loaded a super-block ahead
// (gemv_iq_ahead_n) loading wins there too (L2-resident, one token: 9.1 gathered, 13 loaded).
// Both give the same values. HYBRIDMOE_GRID_GATHER=0 or 1 decides instead (tests take both).
// Since their decode GEMV takes no grid look-ups (kernels_planes.inl) only the prompt panels'
// decoding does: timed at 16 tokens.
template <Format F>
static bool gather_is_faster() {
    return first_is_faster<F>("HYBRIDMOE_GRID_GATHER", gemv_q8_iq_with<F, true>, gemv_q8_iq_with<F, false>, 16);
}
#endif

template <Format F>
static void gemv_q8_iq(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, int ntok,
                       float* out, int64_t ldo) {
#if defined(HMOE_GRID_GATHER)
    if constexpr (F == FMT_IQ2_S || F == FMT_IQ3_XXS || F == FMT_IQ3_S) {
        static const bool gather = gather_is_faster<F>();
        if (!gather) return gemv_q8_iq_with<F, false>(w, row0, nrows, K, acts, ntok, out, ldo);
    }
#endif
    gemv_q8_iq_with<F, kGatherByDefault>(w, row0, nrows, K, acts, ntok, out, ldo);
}

