// The decode GEMV of the iq1, iq2 and iq3 formats (iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs,
// iq3_s) on AVX-512 by byte planes: the grid look-ups done 64 entries at a time with vpermb /
// vpermi2b (VBMI) instead of one load per entry. Included by kernels_iq.inl in the AVX-512 set only
// (dispatch.cpp requires VBMI, GFNI and BITALG there).
//
// Why: one grid entry a load (8 values of iq2, 4 of iq3) held these formats at 14-18 G weights/s
// a core on Zen 4, a third of what memory gives a core; the look-ups were the decode. A vector
// look-up takes 64 indices at once but gives one byte per index, so the weights come out as
// planes: plane j holds value j of 64 entries (iq2: entries of two super-blocks; iq3: of one).
// The activations are put in the same order once per call (plane_acts), and vpdpbusd's dword
// lane m then adds the products of entries 4m .. 4m + 3, all in one quarter (32 values) of one
// super-block: a quarter's integer is one lane (iq2) or two (iq3), summed over the planes.
//
// So a super-block's integers here are per quarter, not gemv_iq_n's per dword of every quarter:
// the prompt GEMM of these formats (gemm_iq_512's quarter panels) computes the same per-quarter
// integers, and both apply them alike, one FMA per quarter and super-block into float lane q,
// the super-blocks in order, then hsum_ps: the same bits per token in decode and prompt.
//
// iq2 (values 8, 25 or 43: codes 0, 1, 2): four codes to a byte by a 256 / 512 / 1024-entry
// look-up (two vpermi2b per 256 and blends on the index's high bits); signs are seven stored
// bits per entry with an eighth for even parity (iq2_s: eight stored), which an affine map over
// GF(2) (gf2p8affineqb) computes with the bits it moves. Per pair of planes one byte per entry
// [code j, code j + 1, sign j, sign j + 1] indexes a 64-entry table of the signed value + 64:
// vpdpbusd's unsigned operand, the +64 taken off per quarter from the activations' sums. iq3's
// eight magnitudes (3-bit codes, two to a byte) go in as they are and the signs onto the
// activations (vpshufbitqmb picks each entry's sign bit of a plane from its quarter's 32 sign
// bits, a masked subtract applies it): 4 planes of 64 per super-block.
//
// iq1_s and iq1_m (values -1, 0, 1 and a delta of +-1/8 per quarter or per entry) are iq2's
// shape without signs: the codes g + 1 of a 2048-entry grid are vpdpbusd's unsigned operand as
// they are (Iq1sPlanes, Iq1mPlanes).
//
// One core of the 2-core Zen 4, L2-resident 768 x 2048, one token, before -> now: iq2_xxs 17.9
// -> 43, iq2_xs 16.9 -> 32, iq2_s 17.8 -> 27, iq3_xxs 14.0 -> 32, iq3_s 13.9 -> 29 G weights/s.
// On the Ice Lake, medians of four alternations of the builds: iq1_s 12.1 -> 18.4 (768 x 2048),
// 13.0 -> 16.4 (2048 x 768); iq1_m 10.8 -> 16.5, 8.6 -> 15.1.

static inline uint64_t load_u64(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
}

// vpmultishiftqb's control taking the four 7-bit fields of each 32-bit word of a qword (bits 0,
// 7, 14, 21 of each) into its bytes in order: the sign fields of iq2_xxs / iq3_xxs.
constexpr int64_t kSevenBitFields = 0x352E2720150E0700LL;

// ---- tables -----------------------------------------------------------------------------

// iq2_xxs / iq2_xs / iq2_s (grids of 256 / 512 / 1024 entries of eight values 8, 25 or 43):
// codes (0, 1, 2) of an entry's values 0-3 (lo) and 4-7 (hi), value j at bits 2j.
template <int kEntries>
struct alignas(64) Iq2PlaneCodes {
    uint8_t lo[kEntries], hi[kEntries];
    constexpr Iq2PlaneCodes(const uint64_t* grid) : lo{}, hi{} {
        const auto code = [](uint64_t v) { return v == 8 ? 0 : v == 25 ? 1 : 2; };
        for (int e = 0; e < kEntries; ++e)
            for (int j = 0; j < 4; ++j) {
                lo[e] = uint8_t(lo[e] | code(grid[e] >> (8 * j) & 255) << (2 * j));
                hi[e] = uint8_t(hi[e] | code(grid[e] >> (8 * (j + 4)) & 255) << (2 * j));
            }
    }
};
inline constexpr Iq2PlaneCodes<256> kIq2xxsCodes{kIq2xxsGrid};
inline constexpr Iq2PlaneCodes<512> kIq2xsCodes{kIq2xsGrid};
inline constexpr Iq2PlaneCodes<1024> kIq2sCodes{kIq2sGrid};
template <Format F>
constexpr const auto& iq2_plane_codes() {
    if constexpr (F == FMT_IQ2_XXS)
        return kIq2xxsCodes;
    else if constexpr (F == FMT_IQ2_XS)
        return kIq2xsCodes;
    else
        return kIq2sCodes;
}

// iq1_s (a grid of 2048 entries of eight values -1, 0 or 1): codes g + 1 (0, 1, 2) of an entry's
// values 0-3 (lo) and 4-7 (hi), value j at bits 2j: vpdpbusd's unsigned operand as they are (times
// 8, see Iq1sPlanes), the +1 taken off with the activations' sums.
struct alignas(64) Iq1sPlaneCodes {
    uint8_t lo[2048], hi[2048];
    constexpr Iq1sPlaneCodes() : lo{}, hi{} {
        for (int e = 0; e < 2048; ++e)
            for (int j = 0; j < 4; ++j) {
                lo[e] = uint8_t(lo[e] | (int(int8_t(uint8_t(kIq1sGrid[e] >> (8 * j)))) + 1) << (2 * j));
                hi[e] = uint8_t(hi[e] | (int(int8_t(uint8_t(kIq1sGrid[e] >> (8 * (j + 4))))) + 1) << (2 * j));
            }
    }
};
inline constexpr Iq1sPlaneCodes kIq1sCodes{};

// value[h]: the signed value + 64 of plane 2k + h by index bits [c_2k, c_2k+1, s_2k, s_2k+1].
struct alignas(64) Iq2PlaneValues {
    uint8_t value[2][64];
    constexpr Iq2PlaneValues() : value{} {
        const int mag[4] = {8, 25, 43, 0};
        for (int x = 0; x < 64; ++x) {
            value[0][x] = uint8_t(64 + ((x >> 4 & 1) ? -mag[x & 3] : mag[x & 3]));
            value[1][x] = uint8_t(64 + ((x >> 5 & 1) ? -mag[x >> 2 & 3] : mag[x >> 2 & 3]));
        }
    }
};
inline constexpr Iq2PlaneValues kIq2PlaneValues{};

// iq3_xxs / iq3_s: codes of an entry's values 0, 1 (lo) and 2, 3 (hi) at bits 0 and 3 (the
// grid's eight magnitudes in order: iq3_xxs 4, 12, .., 52, 62; iq3_s 1, 3, .., 15); value[h]
// the magnitude of the code at bits 3h.
template <int kEntries>
struct alignas(64) Iq3PlaneTables {
    uint8_t lo[kEntries], hi[kEntries];
    uint8_t value[2][64];
    constexpr Iq3PlaneTables(const uint32_t* grid, const uint8_t (&mag)[8]) : lo{}, hi{}, value{} {
        const auto code = [&](uint32_t v) {
            int c = 0;
            while (mag[c] != v) ++c;
            return c;
        };
        for (int e = 0; e < kEntries; ++e) {
            const uint32_t g = grid[e];
            lo[e] = uint8_t(code(g & 255) | code(g >> 8 & 255) << 3);
            hi[e] = uint8_t(code(g >> 16 & 255) | code(g >> 24) << 3);
        }
        for (int x = 0; x < 64; ++x) value[0][x] = mag[x & 7], value[1][x] = mag[x >> 3 & 7];
    }
};
inline constexpr uint8_t kIq3xxsMagnitudes[8] = {4, 12, 20, 28, 36, 44, 52, 62};
inline constexpr uint8_t kIq3sMagnitudes[8] = {1, 3, 5, 7, 9, 11, 13, 15};
inline constexpr Iq3PlaneTables<256> kIq3xxsPlanes{kIq3xxsGrid, kIq3xxsMagnitudes};
inline constexpr Iq3PlaneTables<512> kIq3sPlanes{kIq3sGrid, kIq3sMagnitudes};
template <Format F>
constexpr const auto& iq3_plane_tables() {
    if constexpr (F == FMT_IQ3_S)
        return kIq3sPlanes;
    else
        return kIq3xxsPlanes;
}

// The high codes of iq2_s (values 4-7) and iq3_s (values 2, 3) by their runs instead of a
// look-up of the whole index: the grids are sorted by the entries' values, the last the most
// significant, so equal high codes sit in runs (81 and 64: every combination once). Per group of
// eight indices a table holds the run of its first entry (`base`) and a bit per entry that
// starts a run (`steps`); an index's run is its group's plus the starts at or before it (a
// popcount under `prefix`), and `code` gives the run's codes (iq3_s: the run is its code). Any
// table of at most 128 runs comes out right (the limit checked where the table is built). iq2_s:
// eight one-cycle permutes in place of sixteen and seven blends. One core of the Ice Lake,
// L2-resident 768 x 2048, one token, medians of five alternations: iq2_s 21.0 -> 23.6, iq3_s
// 20.8 -> 21.9 G weights/s; iq2_xs (79 runs, its 512-entry look-up 8 permutes) 25.5 -> 25.1,
// so it keeps the look-up.
template <int kEntries>
struct alignas(64) HighRuns {
    uint8_t base[kEntries / 8], steps[kEntries / 8], code[128], prefix[64];
    bool run_is_code = true;
    constexpr HighRuns(const uint8_t (&hi)[kEntries]) : base{}, steps{}, code{}, prefix{} {
        int run = 0;
        for (int e = 0; e < kEntries; ++e) {
            const bool starts = e > 0 && hi[e] != hi[e - 1];
            run += starts;
            if (run > 127) throw "more than 128 runs of high codes";
            if (e % 8 == 0) base[e / 8] = uint8_t(run);
            else steps[e / 8] = uint8_t(steps[e / 8] | int(starts) << (e % 8));
            code[run] = hi[e];
            run_is_code = run_is_code && hi[e] == run;
        }
        for (int i = 0; i < 64; ++i) prefix[i] = uint8_t((2 << (i % 8)) - 1);
    }
};
inline constexpr HighRuns<512> kIq3sHighRuns{kIq3sPlanes.hi};
inline constexpr HighRuns<1024> kIq2sHighRuns{kIq2sCodes.hi};
inline constexpr HighRuns<2048> kIq1sHighRuns{kIq1sCodes.hi};

// gf2p8affineqb's matrix (the row of output bit i in byte 7 - i) moving the signs of values j and
// j + 1 of an entry to bits 4 and 5: from a byte of eight sign bits (iq2_s), or from seven
// stored bits (iq2_xxs, iq2_xs; bit 7 of the input, another field's, left out) whose parity is
// sign 7.
static constexpr uint64_t sign_pair_matrix(int j, bool parity) {
    const auto row = [&](int v) -> uint64_t { return v == 7 && parity ? 0x7F : uint64_t(1) << v; };
    return row(j) << (8 * (7 - 4)) | row(j + 1) << (8 * (7 - 5));
}

// 256 entries of bytes by 64 indices, two ways to the same bytes (one_table_look_ups picks, in
// kernels_iq.inl): two two-table vpermi2b over 128 entries each, the index's top bit picking
// (kOneTable false); or four one-table vpermb over 64 each, bit 6 picking by merge-masking the
// second of each pair, then the top bit. Ice Lake takes two cycles for a vpermi2b and one for a
// vpermb (1.66 against 0.82 TSC ticks each, eight independent chains), and the look-ups are a
// fifth to two fifths of these GEMVs' time there (iq2_xs / iq2_s without them: 24 -> 31 / 20
// -> 33 G weights/s). One table at a time there, L2-resident 768 x 2048, one token, medians of
// three alternations: iq2_xxs 33.5 -> 34.9, iq2_xs 24.4 -> 25.4, iq2_s 19.8 -> 20.8, iq3_xxs
// 22.0 -> 23.4, iq3_s 19.6 -> 20.8 G weights/s. On Zen 4 a vpermi2b costs what a vpermb does,
// so there the two-table form's fewer instructions should win: decided per CPU and format.
template <bool kOneTable>
static inline __m512i look_up_256(const uint8_t* table, __m512i idx, __mmask64 top) {
    if constexpr (kOneTable) {
        const __mmask64 b6 = _mm512_test_epi8_mask(idx, _mm512_set1_epi8(0x40));
        __m512i lo = _mm512_permutexvar_epi8(idx, _mm512_load_si512(table));
        lo = _mm512_mask_permutexvar_epi8(lo, b6, idx, _mm512_load_si512(table + 64));
        __m512i hi = _mm512_permutexvar_epi8(idx, _mm512_load_si512(table + 128));
        hi = _mm512_mask_permutexvar_epi8(hi, b6, idx, _mm512_load_si512(table + 192));
        return _mm512_mask_blend_epi8(top, lo, hi);
    } else {
        const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(table), idx, _mm512_load_si512(table + 64));
        const __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(table + 128), idx, _mm512_load_si512(table + 192));
        return _mm512_mask_blend_epi8(top, lo, hi);
    }
}

// 512 entries: the ninth index bit (`ninth`, one per byte) picks between two halves.
template <bool kOneTable>
static inline __m512i look_up_512(const uint8_t* table, __m512i idx, __mmask64 top, __mmask64 ninth) {
    return _mm512_mask_blend_epi8(ninth, look_up_256<kOneTable>(table, idx, top),
                                  look_up_256<kOneTable>(table + 256, idx, top));
}

// 1024 entries: the tenth bit picks between two 512.
template <bool kOneTable>
static inline __m512i look_up_1024(const uint8_t* table, __m512i idx, __mmask64 top, __mmask64 ninth, __mmask64 tenth) {
    return _mm512_mask_blend_epi8(tenth, look_up_512<kOneTable>(table, idx, top, ninth),
                                  look_up_512<kOneTable>(table + 512, idx, top, ninth));
}

// 2048 entries: the eleventh bit picks between two 1024.
template <bool kOneTable>
static inline __m512i look_up_2048(const uint8_t* table, __m512i idx, __mmask64 top, __mmask64 ninth, __mmask64 tenth,
                                   __mmask64 eleventh) {
    return _mm512_mask_blend_epi8(eleventh, look_up_1024<kOneTable>(table, idx, top, ninth, tenth),
                                  look_up_1024<kOneTable>(table + 1024, idx, top, ninth, tenth));
}

// The high codes of index idx (its low byte; ninth, tenth, eleventh: its bits 8, 9 and 10).
template <int kEntries>
static inline __m512i high_codes(const HighRuns<kEntries>& t, __m512i idx, __mmask64 ninth, __mmask64 tenth,
                                 __mmask64 eleventh = 0) {
    __m512i group = _mm512_and_si512(_mm512_srli_epi16(idx, 3), _mm512_set1_epi8(0x1F));
    group = _mm512_mask_add_epi8(group, ninth, group, _mm512_set1_epi8(0x20));
    if constexpr (kEntries == 2048) group = _mm512_mask_add_epi8(group, tenth, group, _mm512_set1_epi8(0x40));
    const auto look_up = [&](const uint8_t* table) {
        if constexpr (kEntries == 2048) {  // 256 groups: the eleventh bit is the group's top
            return look_up_256<true>(table, group, eleventh);
        } else {  // 512: 64 groups; 1024: 128, the tenth bit picking the table's half
            const __m512i low = _mm512_permutexvar_epi8(group, _mm512_load_si512(table));
            if constexpr (kEntries == 512) return low;
            return _mm512_mask_permutexvar_epi8(low, tenth, group, _mm512_load_si512(table + 64));
        }
    };
    const __m512i before = _mm512_and_si512(look_up(t.steps), _mm512_permutexvar_epi8(idx, _mm512_load_si512(t.prefix)));
    const __m512i run = _mm512_add_epi8(look_up(t.base), _mm512_popcnt_epi8(before));
    if (t.run_is_code) return run;
    return _mm512_permutex2var_epi8(_mm512_load_si512(t.code), run, _mm512_load_si512(t.code + 64));
}

// ---- the activations in plane order -------------------------------------------------------

// Per token, once per call, into a per-thread buffer: byte i of plane j = value j of entry i,
// entries of kWidth values (iq1 / iq2: 8, planes of a 512-value chunk; iq3: 4, of a 256-value
// one). An iq1 / iq2 row of an odd number of super-blocks ends on a chunk of its last
// super-block twice (see gemv_iq2_planes). These formats also get `sums`, each 16 values' sum
// as an int16 (32 a chunk): their offset's share (iq2's plane values + 64, iq1's codes g + 1).
struct PlaneActs {
    const int8_t* q;
    const int16_t* sums;
};

// One chunk in plane order: each 64-byte vector's entries first regrouped by value (vpermb:
// 64 / kWidth bytes of each value together), then those groups copied to their planes.
template <int kWidth, int kSpan>
static void chunk_to_planes(const int8_t* q, int8_t* out) {
    constexpr int kVecs = kSpan / 64, kGroup = 64 / kWidth;  // kGroup: entries of a vector
    alignas(64) uint8_t order[64];
    for (int j = 0; j < kWidth; ++j)
        for (int e = 0; e < kGroup; ++e) order[j * kGroup + e] = uint8_t(e * kWidth + j);
    const __m512i by_value = _mm512_load_si512(order);
    alignas(64) int8_t grouped[kVecs][64];
    for (int v = 0; v < kVecs; ++v)
        _mm512_store_si512(grouped[v], _mm512_permutexvar_epi8(by_value, _mm512_loadu_si512(q + 64 * v)));
    for (int j = 0; j < kWidth; ++j)
        for (int v = 0; v < kVecs; ++v) std::memcpy(out + j * 64 + v * kGroup, grouped[v] + j * kGroup, kGroup);
}

template <Format F>
static PlaneActs plane_acts(const Q8Row& a, int64_t K, int slot) {
    // Entries of 8 values: iq1 and iq2.
    constexpr bool kIq2 = F == FMT_IQ2_XXS || F == FMT_IQ2_XS || F == FMT_IQ2_S || F == FMT_IQ1_S || F == FMT_IQ1_M;
    constexpr int kSpan = kIq2 ? 512 : 256;
    const int64_t nchunks = (K + kSpan - 1) / kSpan;
    thread_local std::vector<int8_t> q_buf[kMaxGemvTokens];
    thread_local std::vector<int16_t> sums_buf[kMaxGemvTokens];
    int8_t* q = aligned64(q_buf[slot], nchunks * kSpan);
    for (int64_t c = 0; c < nchunks; ++c) {
        const int8_t* chunk = a.q + c * kSpan;
        alignas(64) int8_t twice[512];
        if (kIq2 && K - c * kSpan == 256) {  // an odd row's last super-block: twice (see gemv_iq2_planes)
            std::memcpy(twice, chunk, 256);
            std::memcpy(twice + 256, chunk, 256);
            chunk = twice;
        }
        chunk_to_planes<kIq2 ? 8 : 4, kSpan>(chunk, q + c * kSpan);
    }
    if constexpr (!kIq2) return {q, nullptr};
    // Entries 2g and 2g + 1 of every plane are the 16 values of group g: vpmaddubsw by ones.
    int16_t* sums = aligned64(sums_buf[slot], nchunks * 32);
    for (int64_t c = 0; c < nchunks; ++c) {
        __m512i s = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j)
            s = _mm512_add_epi16(s, _mm512_maddubs_epi16(_mm512_set1_epi8(1), _mm512_load_si512(q + 512 * c + 64 * j)));
        _mm512_store_si512(sums + 32 * c, s);
    }
    return {q, sums};
}

// ---- the GEMVs ----------------------------------------------------------------------------

// The 32 bytes at `at` of super-blocks p and p2 (null: zeros) in one vector.
static inline __m512i two_blocks(const uint8_t* p, const uint8_t* p2, int at) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load32(p + at)), p2 ? load32(p2 + at) : _mm256_setzero_si256(), 1);
}

// Two super-blocks of an iq2 format as plane indices: per pair of planes 2k, 2k + 1 a byte per
// entry [c_2k, c_2k+1, s_2k, s_2k+1] (x[k]; codes by a look-up of the grid index, signs moved
// by gf2p8affineqb), and the scales: iq2_xxs one per quarter (a dword lane), iq2_xs / iq2_s
// one per 16 values (int16 lane g: entries 2g, 2g + 1). Super-blocks p (entries 0-31) and p2
// (32-63: not necessarily the next one; if null, zeros).
template <Format F, bool kOneTable>
struct Iq2Planes {
    static constexpr bool kPerSixteen = F != FMT_IQ2_XXS;  // scales per 16 values, else per quarter
    __m512i x[4];
    __m512i scale;

    // The activations' sums' multiplier (int16 pairs): -64, the values' offset, times the scale
    // per 16 values where there is one.
    __m512i offset() const {
        return kPerSixteen ? _mm512_mullo_epi16(scale, _mm512_set1_epi16(-64)) : _mm512_set1_epi16(-64);
    }
    // Plane j's signed values + 64.
    __m512i value(int j) const {
        return _mm512_permutexvar_epi8(x[j / 2], _mm512_load_si512(kIq2PlaneValues.value[j % 2]));
    }

    Iq2Planes(const uint8_t* p, const uint8_t* p2) {
        constexpr bool kParity = F != FMT_IQ2_S;
        constexpr const auto& kCodes = iq2_plane_codes<F>();
        const bool two = p2 != nullptr;
        __m512i idx, signs;  // signs: a byte per entry, its sign bits (iq2_xxs / iq2_xs: the 7 stored)
        __mmask64 ninth = 0, tenth = 0;
        if constexpr (F == FMT_IQ2_XXS) {
            // Entry i's index: byte i % 4 of quarter i / 4's eight bytes (after d); quarter m's
            // sign-and-scale word: dword 2m + 1 of the codes; entry 8k + b's seven sign bits
            // start at bit 7b of qword k's two words (b < 4) or 32 + 7 (b - 4): kSevenBitFields.
            alignas(64) static constexpr struct Order {
                uint8_t index[64];
                int32_t word[16];
                constexpr Order() : index{}, word{} {
                    for (int i = 0; i < 64; ++i) index[i] = uint8_t((i < 32 ? 0 : 64) + 8 * (i % 32 / 4) + i % 4);
                    for (int m = 0; m < 16; ++m) word[m] = (m < 8 ? 0 : 16) + 2 * (m % 8) + 1;
                }
            } kOrder{};
            const __m512i a = _mm512_loadu_si512(p + 2);
            const __m512i b = two ? _mm512_loadu_si512(p2 + 2) : _mm512_setzero_si512();
            idx = _mm512_permutex2var_epi8(a, _mm512_load_si512(kOrder.index), b);
            const __m512i words = _mm512_permutex2var_epi32(a, _mm512_load_si512(kOrder.word), b);
            signs = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(kSevenBitFields), words);
            scale = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(words, 28), 1), _mm512_set1_epi32(1));
        } else {
            // Scale bytes j: nibbles of groups 2j (low) and 2j + 1, as 2s + 1 in int16 lanes.
            constexpr int kScales = F == FMT_IQ2_XS ? 66 : 74;
            const __m128i b = _mm_set_epi64x(two ? int64_t(load_u64(p2 + kScales)) : 0, int64_t(load_u64(p + kScales)));
            const __m256i nib = interleave_nibbles(nibbles32(b));
            scale = _mm512_add_epi16(_mm512_slli_epi16(_mm512_cvtepu8_epi16(nib), 1), _mm512_set1_epi16(1));
            if constexpr (F == FMT_IQ2_XS) {
                // 16-bit words: a nine-bit index, then the seven sign bits.
                alignas(64) static constexpr struct Order {
                    uint8_t low[64], high[64];
                    constexpr Order() : low{}, high{} {
                        for (int i = 0; i < 64; ++i) low[i] = uint8_t(2 * i), high[i] = uint8_t(2 * i + 1);
                    }
                } kOrder{};
                const __m512i a = _mm512_loadu_si512(p + 2);
                const __m512i b2 = two ? _mm512_loadu_si512(p2 + 2) : _mm512_setzero_si512();
                idx = _mm512_permutex2var_epi8(a, _mm512_load_si512(kOrder.low), b2);
                const __m512i high = _mm512_permutex2var_epi8(a, _mm512_load_si512(kOrder.high), b2);
                ninth = _mm512_test_epi8_mask(high, _mm512_set1_epi8(1));
                signs = _mm512_srli_epi16(high, 1);
            } else {
                // Index bytes, then a sign byte per entry; qh: entry e's ninth and tenth bits at 2e, 2e + 1.
                idx = two_blocks(p, p2, 2);
                signs = two_blocks(p, p2, 34);
                const uint64_t qh = load_u64(p + 66), qh2 = two ? load_u64(p2 + 66) : 0;
                constexpr uint64_t kEven = 0x5555555555555555ULL;
                ninth = _pext_u64(qh, kEven) | _pext_u64(qh2, kEven) << 32;
                tenth = _pext_u64(qh, kEven << 1) | _pext_u64(qh2, kEven << 1) << 32;
            }
        }
        const __mmask64 top = _mm512_movepi8_mask(idx);
        __m512i lo, hi;
        if constexpr (F == FMT_IQ2_XXS) {
            lo = look_up_256<kOneTable>(kCodes.lo, idx, top), hi = look_up_256<kOneTable>(kCodes.hi, idx, top);
        } else if constexpr (F == FMT_IQ2_XS) {
            lo = look_up_512<kOneTable>(kCodes.lo, idx, top, ninth), hi = look_up_512<kOneTable>(kCodes.hi, idx, top, ninth);
        } else {
            lo = look_up_1024<kOneTable>(kCodes.lo, idx, top, ninth, tenth);
            hi = high_codes(kIq2sHighRuns, idx, ninth, tenth);
        }
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        const auto pair = [&](__m512i codes, int j) {  // (codes & 15) | signs: ternary logic 0xEC = (A & C) | B
            const __m512i m = _mm512_set1_epi64(int64_t(sign_pair_matrix(j, kParity)));
            return _mm512_ternarylogic_epi32(codes, _mm512_gf2p8affine_epi64_epi8(signs, m, 0), low4, 0xEC);
        };
        x[0] = pair(lo, 0), x[1] = pair(_mm512_srli_epi16(lo, 4), 2);
        x[2] = pair(hi, 4), x[3] = pair(_mm512_srli_epi16(hi, 4), 6);
    }
};

// The 16 bytes at `at` of two super-blocks (p2 null: zeros) as four words: 16 entries' index-bit
// fields a word (iq1_s: three bits per entry in a quarter's 16-bit word; iq1_m: a nibble per entry).
struct FieldWords {
    uint64_t h[4];
    FieldWords(const uint8_t* p, const uint8_t* p2, int at)
        : h{load_u64(p + at), load_u64(p + at + 8), p2 ? load_u64(p2 + at) : 0, p2 ? load_u64(p2 + at + 8) : 0} {}
};

// The 64 entries' bits b of their fields (`first`: each field's bit 0 in a word), by pext.
static inline __mmask64 index_bits(const FieldWords& f, uint64_t first, int b) {
    return __mmask64(_pext_u64(f.h[0], first << b) | _pext_u64(f.h[1], first << b) << 16 |
                     _pext_u64(f.h[2], first << b) << 32 | _pext_u64(f.h[3], first << b) << 48);
}

// The iq1 formats' 64 entries as codes g + 1 (0, 1, 2) of values 0-3 and 4-7, four to a byte,
// by their eleven-bit grid indices (idx the low bytes, then index_bits).
template <bool kOneTable>
struct Iq1Codes {
    __m512i code[2];

    Iq1Codes(__m512i idx, const FieldWords& f, uint64_t first) {
        const __mmask64 ninth = index_bits(f, first, 0), tenth = index_bits(f, first, 1);
        const __mmask64 eleventh = index_bits(f, first, 2);
        code[0] = look_up_2048<kOneTable>(kIq1sCodes.lo, idx, _mm512_movepi8_mask(idx), ninth, tenth, eleventh);
        code[1] = high_codes(kIq1sHighRuns, idx, ninth, tenth, eleventh);
    }
    // Value j's codes times 8 (0, 8, 16): gf2p8affineqb moving bits 2 (j % 4) and 2 (j % 4) + 1
    // of the byte of values 0-3 or 4-7 to bits 3 and 4.
    __m512i times8(int j) const {
        const int b = 2 * (j % 4);
        const uint64_t matrix = uint64_t(1) << b << (8 * (7 - 3)) | uint64_t(1) << (b + 1) << (8 * (7 - 4));
        return _mm512_gf2p8affine_epi64_epi8(code[j / 4], _mm512_set1_epi64(int64_t(matrix)), 0);
    }
};

// Two super-blocks of iq1_s as planes, as Iq2Planes (p: entries 0-31, p2: 32-63; if null,
// zeros): value(j) = 8 (g + 1), per quarter lane (0-7: p's, 8-15: p2's) the scale 2s + 1, and
// the activations' sums' multiplier -(8 - delta) as an int16 pair. Quarter q's sum of
// (8g + delta) a is then the pairs' madd plus the planes' vpdpbusd: the prompt panel's
// (QuarterPanel, the values 8g + delta as they are) exactly, so both times 2s + 1 give the
// same floats.
template <bool kOneTable>
struct Iq1sPlanes {
    static constexpr bool kPerSixteen = false;
    Iq1Codes<kOneTable> codes;
    __m512i scale;  // int32 lanes
    __m512i multiplier;

    __m512i offset() const { return multiplier; }
    __m512i value(int j) const { return codes.times8(j); }

    // qh at 34: a 16-bit word per quarter, entry k's index bits 8-10 at its bits 3k .. 3k + 2,
    // the scale at 12-14 and the delta's sign at 15.
    static constexpr uint64_t kFirst = 0x0249024902490249ULL;
    Iq1sPlanes(const uint8_t* p, const uint8_t* p2) : codes(two_blocks(p, p2, 2), FieldWords(p, p2, 34), kFirst) {
        // The same 16 bytes again, as a vector (from the words, GPR-to-vector moves on port 5).
        const __m128i qa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 34));
        const __m128i qb = p2 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p2 + 34)) : _mm_setzero_si128();
        const __m512i words = _mm512_cvtepu16_epi32(_mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1));
        const __m512i field = _mm512_and_si512(_mm512_srli_epi32(words, 12), _mm512_set1_epi32(7));
        scale = _mm512_add_epi32(_mm512_slli_epi32(field, 1), _mm512_set1_epi32(1));
        const __m512i negative = _mm512_srli_epi32(words, 15);
        const __m512i m = _mm512_sub_epi32(_mm512_set1_epi32(-7), _mm512_add_epi32(negative, negative));  // -7 or -9
        multiplier = _mm512_or_si512(_mm512_and_si512(m, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(m, 16));
    }
};

// iq1_m, with a delta per entry and a scale per 16 values: value(j) = 8 (g + 1) + (delta + 1),
// 0 .. 18, whose products less 9 x the activations' sum per 16 values are those of 8g + delta
// (the prompt panel's values); `scale` holds each 16 values' 2s + 1 in int16 lane i, as
// iq2_xs's.
template <bool kOneTable>
struct Iq1mPlanes {
    static constexpr bool kPerSixteen = true;
    Iq1Codes<kOneTable> codes;
    __m512i delta;  // 2 where an entry's delta is +1, else 0
    __m512i scale;

    __m512i offset() const { return _mm512_mullo_epi16(scale, _mm512_set1_epi16(-9)); }
    __m512i value(int j) const { return _mm512_or_si512(codes.times8(j), delta); }

    // qh at 32: a nibble per entry (entry 2i low, 2i + 1 high), its index bits 8-10 and the
    // delta's sign.
    static constexpr uint64_t kFirst = 0x1111111111111111ULL;
    Iq1mPlanes(const uint8_t* p, const uint8_t* p2) : Iq1mPlanes(p, p2, FieldWords(p, p2, 32)) {}
    Iq1mPlanes(const uint8_t* p, const uint8_t* p2, const FieldWords& qh) : codes(two_blocks(p, p2, 0), qh, kFirst) {
        delta = _mm512_maskz_mov_epi8(~index_bits(qh, kFirst, 3), _mm512_set1_epi8(2));
        // The scales at 48: field i (of 16 values i) at bits 3 (i % 4) .. of word i / 4 (the words'
        // top nibbles are d's).
        const __m128i words = _mm_set_epi64x(p2 ? int64_t(load_u64(p2 + 48)) : 0, int64_t(load_u64(p + 48)));
        alignas(64) static constexpr struct Order {
            uint16_t word[32], shift[32];
            constexpr Order() : word{}, shift{} {
                for (int i = 0; i < 32; ++i) word[i] = uint16_t(i / 4), shift[i] = uint16_t(3 * (i % 4));
            }
        } kOrder{};
        const __m512i words32 = _mm512_permutexvar_epi16(_mm512_load_si512(kOrder.word), _mm512_castsi128_si512(words));
        const __m512i field = _mm512_srlv_epi16(words32, _mm512_load_si512(kOrder.shift));
        scale = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(field, _mm512_set1_epi16(7)), 1), _mm512_set1_epi16(1));
    }
};

// The plane decoder of an 8-value format.
template <Format F, bool kOneTable>
using Planes8 = std::conditional_t<F == FMT_IQ1_S, Iq1sPlanes<kOneTable>,
                                   std::conditional_t<F == FMT_IQ1_M, Iq1mPlanes<kOneTable>, Iq2Planes<F, kOneTable>>>;

// iq2_xxs / iq2_xs / iq2_s (and iq1_s / iq1_m), up to four tokens: two super-blocks a step,
// their 16 quarters in the 16 dword lanes, each quarter's integer from the offset's share -64 x
// (its activations' sum, times the scale per 16 for iq2_xs / iq2_s, whose per-plane pairs
// vpdpwssd scales; iq2_xxs's quarter scale goes on at the end; iq1's, see Iq1sPlanes). A row
// of an odd number of super-blocks (K = 768: Qwen3-30B's down projections) ends on a lone one,
// which shares a step with the next row's (even rows wait for odd ones with their sums put
// aside; the activations of that step are the last super-block's twice, plane_acts' last
// chunk); a last even row's takes a step alone.
template <Format F, int N, bool kOneTable>
static void gemv_iq2_planes(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, float* out,
                            int64_t ldo) {
    using Decoder = Planes8<F, kOneTable>;
    constexpr int kBytes = kFormats[F].block_bytes;
    const int64_t nsb = K / 256, full = nsb / 2, last = nsb - 1;
    const bool odd = nsb % 2 != 0;
    PlaneActs pa[N];
    for (int t = 0; t < N; ++t) pa[t] = plane_acts<F>(acts[t], K, t);
    // Super-blocks a (lanes 0-7) and b (8-15; zeros if null) against chunk c of the activations:
    // v[t], token t's 16 quarters' integers as floats.
    struct Products {
        __m512 v[N];
    };
    const auto products = [&](const uint8_t* a, const uint8_t* b, int64_t c) {
        Products out;
        prefetch_span<_MM_HINT_T0>(a + kPrefetchAheadIq, 2 * kBytes);
        const Decoder blk(a, b);
        // The offset's share: the activations' sums per 16 values (pairs added) times it.
        const __m512i offset = blk.offset();
        // Two chains (even and odd planes), added at the end: half the latency of one.
        __m512i sums[N], odd_sums[N];
        for (int t = 0; t < N; ++t) {
            sums[t] = _mm512_madd_epi16(_mm512_load_si512(pa[t].sums + 32 * c), offset);
            odd_sums[t] = _mm512_setzero_si512();
        }
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
            const __m512i v0 = blk.value(2 * k), v1 = blk.value(2 * k + 1);
            for (int t = 0; t < N; ++t) {
                const int8_t* q = pa[t].q + 512 * c + 128 * k;
                const __m512i a0 = _mm512_load_si512(q), a1 = _mm512_load_si512(q + 64);
                if constexpr (!Decoder::kPerSixteen) {
                    sums[t] = _mm512_dpbusd_epi32(sums[t], v0, a0);
                    odd_sums[t] = _mm512_dpbusd_epi32(odd_sums[t], v1, a1);
                } else {  // at most 2 x 107 x 127 a pair: no saturation
                    sums[t] = _mm512_dpwssd_epi32(sums[t], _mm512_maddubs_epi16(v0, a0), blk.scale);
                    odd_sums[t] = _mm512_dpwssd_epi32(odd_sums[t], _mm512_maddubs_epi16(v1, a1), blk.scale);
                }
            }
        }
        for (int t = 0; t < N; ++t) {  // a scale per quarter goes on at the end
            const __m512i i = _mm512_add_epi32(sums[t], odd_sums[t]);
            out.v[t] = _mm512_cvtepi32_ps(Decoder::kPerSixteen ? i : _mm512_mullo_epi32(i, blk.scale));
        }
        return out;
    };
    // acc + the super-block at p's (index sb) share, half h of v.
    const auto add = [&](__m256 acc, const __m512& v, int h, const uint8_t* p, int64_t sb, int t) {
        const __m256 half = h == 0 ? _mm512_castps512_ps256(v) : _mm512_extractf32x8_ps(v, 1);
        const float d = F == FMT_IQ1_M ? iq1m_d(p) : h2f(p) * 0.125f;
        return _mm256_fmadd_ps(_mm256_set1_ps(d * acts[t].d[8 * sb]), half, acc);
    };
    __m256 waiting[N];  // an even row's sums, waiting for the next row (odd K)
    for (int64_t r = 0; r < nrows; ++r) {
        const uint8_t* row = w.row(row0 + r);
        _mm_prefetch(reinterpret_cast<const char*>(w.row(row0 + r + 1)), _MM_HINT_T0);
        __m256 acc[N];
        for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t c = 0; c < full; ++c) {
            const uint8_t* p = row + 2 * kBytes * c;
            const Products v = products(p, p + kBytes, c);
            for (int t = 0; t < N; ++t)
                acc[t] = add(add(acc[t], v.v[t], 0, p, 2 * c, t), v.v[t], 1, p + kBytes, 2 * c + 1, t);
        }
        if (odd) {
            if (r % 2 == 0 && r + 1 < nrows) {
                for (int t = 0; t < N; ++t) waiting[t] = acc[t];
                continue;
            }
            const uint8_t* mine = row + kBytes * last;
            if (r % 2 == 1) {
                const uint8_t* before = w.row(row0 + r - 1) + kBytes * last;
                const Products v = products(before, mine, full);
                for (int t = 0; t < N; ++t) {
                    out[t * ldo + r - 1] = hsum_ps(add(waiting[t], v.v[t], 0, before, last, t));
                    acc[t] = add(acc[t], v.v[t], 1, mine, last, t);
                }
            } else {
                const Products v = products(mine, nullptr, full);
                for (int t = 0; t < N; ++t) acc[t] = add(acc[t], v.v[t], 0, mine, last, t);
            }
        }
        for (int t = 0; t < N; ++t) out[t * ldo + r] = hsum_ps(acc[t]);
    }
}

// iq3_xxs and iq3_s, up to four tokens: a super-block a step, its 64 entries of four values;
// quarter q's integer is lanes 2q and 2q + 1 added. iq3_s: ninth index bits in qh (bit e of
// the eight bytes: entry e), its signs stored as bits (value order), a scale nibble per quarter.
template <Format F, int N, bool kOneTable>
static void gemv_iq3_planes(const MatrixRef& w, int64_t row0, int64_t nrows, int64_t K, const Q8Row* acts, float* out,
                            int64_t ldo) {
    constexpr bool kS = F == FMT_IQ3_S;
    constexpr int kBytes = kFormats[F].block_bytes;
    constexpr const auto& kTables = iq3_plane_tables<F>();
    const int64_t nsb = K / 256;
    PlaneActs pa[N];
    for (int t = 0; t < N; ++t) pa[t] = plane_acts<F>(acts[t], K, t);
    const __m512i sign_fields = _mm512_set1_epi64(kSevenBitFields);
    const __m512i signs_lo = _mm512_loadu_si512(kSignsIq2), signs_hi = _mm512_loadu_si512(kSignsIq2 + 64);
    const __m512i mag0 = _mm512_load_si512(kTables.value[0]), mag1 = _mm512_load_si512(kTables.value[1]);
    // Entry b of a quarter holds its values 4b .. 4b + 3: plane j's sign is bit 4b + j of the
    // quarter's 32 sign bits.
    __m512i sign_bit[4];
    for (int j = 0; j < 4; ++j) sign_bit[j] = _mm512_set1_epi64(0x1C1814100C080400LL + 0x0101010101010101LL * j);
    const __m256i nibble_shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    for (int64_t r = 0; r < nrows; ++r) {
        const uint8_t* row = w.row(row0 + r);
        _mm_prefetch(reinterpret_cast<const char*>(w.row(row0 + r + 1)), _MM_HINT_T0);
        __m256 acc[N];
        for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nsb; ++sb) {
            const uint8_t* p = row + kBytes * sb;
            prefetch_span<_MM_HINT_T0>(p + kPrefetchAheadIq, kBytes);
            const __m512i idx = _mm512_loadu_si512(p + 2);
            const __mmask64 top = _mm512_movepi8_mask(idx);
            __m512i lo, hi, quarter_signs;
            __m256i scale;
            if constexpr (kS) {
                const __mmask64 ninth = _cvtu64_mask64(load_u64(p + 66));
                lo = look_up_512<kOneTable>(kTables.lo, idx, top, ninth);
                hi = high_codes(kIq3sHighRuns, idx, ninth, 0);
                quarter_signs = _mm512_cvtepu32_epi64(load32(p + 74));
                // byte 106 + j: quarters 2j (low nibble) and 2j + 1
                const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(load_u32(p + 106))), nibble_shift),
                                                     _mm256_set1_epi32(15));
                scale = _mm256_add_epi32(_mm256_slli_epi32(nib, 1), _mm256_set1_epi32(1));
            } else {
                lo = look_up_256<kOneTable>(kTables.lo, idx, top);
                hi = look_up_256<kOneTable>(kTables.hi, idx, top);
                const __m256i words = load32(p + 66);
                const __m512i fields = _mm512_multishift_epi64_epi8(sign_fields, _mm512_castsi256_si512(words));
                const __m512i signs = _mm512_permutex2var_epi8(signs_lo, fields, signs_hi);
                quarter_signs = _mm512_cvtepu32_epi64(_mm512_castsi512_si256(signs));
                scale = _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(words, 28), 1), _mm256_set1_epi32(1));
            }
            const __m512i mag[4] = {_mm512_permutexvar_epi8(lo, mag0), _mm512_permutexvar_epi8(lo, mag1),
                                    _mm512_permutexvar_epi8(hi, mag0), _mm512_permutexvar_epi8(hi, mag1)};
            __mmask64 neg[4];
            for (int j = 0; j < 4; ++j) neg[j] = _mm512_bitshuffle_epi64_mask(quarter_signs, sign_bit[j]);
            const float d = kS ? h2f(p) : h2f(p) * 0.25f;  // iq3_xxs: d (2s + 1) / 4
            for (int t = 0; t < N; ++t) {
                const int8_t* q = pa[t].q + 256 * sb;
                __m512i sums = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j) {
                    const __m512i a = _mm512_load_si512(q + 64 * j);
                    sums = _mm512_dpbusd_epi32(sums, mag[j], _mm512_mask_sub_epi8(a, neg[j], _mm512_setzero_si512(), a));
                }
                const __m256i quarters = _mm512_cvtepi64_epi32(_mm512_add_epi32(sums, _mm512_srli_epi64(sums, 32)));
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * acts[t].d[8 * sb]),
                                         _mm256_cvtepi32_ps(_mm256_mullo_epi32(quarters, scale)), acc[t]);
            }
        }
        for (int t = 0; t < N; ++t) out[t * ldo + r] = hsum_ps(acc[t]);
    }
}
