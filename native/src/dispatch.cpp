#include "dispatch.h"

#include "repack.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace hmoe {

std::vector<const KernelTable*> supported_tables() {
    std::vector<const KernelTable*> v;
#if defined(HMOE_HAVE_X86_VARIANTS)
    __builtin_cpu_init();
    // __builtin_cpu_supports also checks that the OS saves the vector state (XCR0), so a
    // kernel or hypervisor that disabled AVX-512 is respected.
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bitalg") && __builtin_cpu_supports("gfni") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
#if defined(HMOE_HAVE_AMX)
        if (amx_usable()) v.push_back(kernels_avx512_amx());
#endif
        v.push_back(kernels_avx512());
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        v.push_back(kernels_avx2());
#endif
    v.push_back(kernels_scalar());
    return v;
}

namespace {

// Random but valid stored rows of `fmt`: random code bytes, sane scales (no inf/nan).
void random_rows(Format fmt, int rows, int K, std::mt19937& rng, std::vector<uint8_t>& data, std::vector<uint8_t>& scales,
                 MatrixRef& ref) {
    const FormatInfo& f = kFormats[fmt];
    const int nb = K / f.block;
    const int64_t row_bytes = int64_t(nb) * f.block_bytes;
    data.resize(size_t(rows * row_bytes));
    for (auto& b : data) b = uint8_t(rng());
    std::uniform_real_distribution<float> small(0.001f, 0.05f);
    auto put_f16 = [&](uint8_t* p, float v) {
        // v is a normal half value range: round through the float bits (13 mantissa bits dropped).
        const uint32_t u = bits_from_f32(v);
        const uint16_t h = uint16_t(((u >> 16) & 0x8000) | ((((u >> 23) & 0xFF) - 112) << 10) | ((u >> 13) & 0x3FF));
        std::memcpy(p, &h, 2);
    };
    for (int r = 0; r < rows; ++r) {
        uint8_t* row = data.data() + r * row_bytes;
        for (int b = 0; b < nb; ++b) {
            uint8_t* blk = row + int64_t(b) * f.block_bytes;
            switch (fmt) {
                case FMT_Q8_0:
                case FMT_Q4_0:
                case FMT_Q5_0: put_f16(blk, small(rng)); break;
                case FMT_Q4_K:
                case FMT_Q5_K: put_f16(blk, small(rng)); put_f16(blk + 2, small(rng)); break;
                case FMT_Q6_K: put_f16(blk + 208, small(rng)); break;
                case FMT_Q3_K: put_f16(blk + 108, small(rng)); break;
                case FMT_Q2_K: put_f16(blk + 80, small(rng)); put_f16(blk + 82, small(rng)); break;
                case FMT_MXFP4: blk[0] = uint8_t(118 + rng() % 12); break;
                case FMT_Q4_1:
                case FMT_Q5_1: put_f16(blk, small(rng)); put_f16(blk + 2, -small(rng)); break;
                case FMT_IQ4_NL:
                case FMT_IQ4_XS:
                case FMT_IQ2_XXS:
                case FMT_IQ2_XS:
                case FMT_IQ2_S:
                case FMT_IQ3_XXS:
                case FMT_IQ3_S:
                case FMT_IQ1_S: put_f16(blk, small(rng)); break;
                case FMT_IQ1_M: {  // d is the top nibbles of the four 16-bit scale words
                    uint8_t h[2];
                    put_f16(h, small(rng));
                    const uint16_t d = uint16_t(h[0] | h[1] << 8);
                    for (int i = 0; i < 4; ++i) {
                        const uint16_t word = uint16_t((load_u16(blk + 48 + 2 * i) & 0x0FFF) | ((d >> (4 * i)) & 15) << 12);
                        std::memcpy(blk + 48 + 2 * i, &word, 2);
                    }
                    break;
                }
                default: break;
            }
        }
    }
    if (fmt == FMT_BF16 || fmt == FMT_F16) {
        for (int64_t i = 0; i < int64_t(data.size()) / 2; ++i) {
            const float v = small(rng) * ((rng() & 1) ? 1.f : -1.f);
            if (fmt == FMT_BF16) {
                const uint16_t h = uint16_t(bits_from_f32(v) >> 16);
                std::memcpy(&data[size_t(2 * i)], &h, 2);
            } else {
                put_f16(&data[size_t(2 * i)], v);
            }
        }
    }
    if (fmt == FMT_F32) {
        for (int64_t i = 0; i < int64_t(data.size()) / 4; ++i) {
            const float v = small(rng) * ((rng() & 1) ? 1.f : -1.f);
            std::memcpy(&data[size_t(4 * i)], &v, 4);
        }
    }
    ref = MatrixRef{data.data(), nullptr, row_bytes, 0};
    if (f.scale_bytes) {
        scales.resize(size_t(rows) * nb * f.scale_bytes);
        for (size_t i = 0; i < scales.size() / size_t(f.scale_bytes); ++i) {
            if (fmt == FMT_MXFP4_HF) {
                scales[i] = uint8_t(118 + rng() % 12);
            } else {  // bf16 scale
                const uint16_t h = uint16_t(bits_from_f32(small(rng)) >> 16);
                std::memcpy(&scales[2 * i], &h, 2);
            }
        }
        ref.scales = scales.data();
        ref.scale_row_stride = int64_t(nb) * f.scale_bytes;
    }
}

bool close(float a, float b, float scale, float tol) { return std::fabs(a - b) <= tol * scale + 1e-6f; }

}  // namespace

std::string self_test(const KernelTable* t) {
    const KernelTable* ref = kernels_scalar();
    if (t == ref) return "";
    std::mt19937 rng(1234);
    std::normal_distribution<float> normal(0.f, 1.f);
    constexpr int K = 512, NT = 3;

    // Activations: the quantizer itself, then shared Q8 inputs for the GEMV comparison.
    std::vector<float> x(size_t(NT) * K);
    for (auto& v : x) v = normal(rng);
    for (int v = 0; v < kActVariants; ++v) {  // the same arithmetic in every set: the same bits
        std::vector<int8_t> q1(K), q2(K);
        std::vector<float> d1(K / 32), d2(K / 32), s1(K / 32), s2(K / 32);
        ref->quantize(x.data(), K, v, q1.data(), d1.data(), s1.data());
        t->quantize(x.data(), K, v, q2.data(), d2.data(), s2.data());
        if (q1 != q2 || d1 != d2 || s1 != s2) return std::string(t->name) + ": quantize differs";
    }

    for (int fi = 0; fi < FMT_COUNT; ++fi) {
        const Format fmt = Format(fi);
        const FormatInfo& f = kFormats[fmt];
        std::vector<uint8_t> data, scales, copy;
        MatrixRef w;
        int ROWS = 5;
        if (f.row_group == 8) {  // the x8 layouts: interleave one group of random rows of their source format
            const Format src = fmt == FMT_Q4_0_X8   ? FMT_Q4_0
                               : fmt == FMT_INT4_X8 ? FMT_INT4_G32
                               : fmt == FMT_Q8_0_X8 ? FMT_Q8_0
                               : fmt == FMT_IQ4_NL_X8 ? FMT_IQ4_NL
                               : fmt == FMT_IQ4_XS_X8 ? FMT_IQ4_XS
                                                    : FMT_Q4_K;
            ROWS = 8;  // one group: fits the narrowest panel (the scalar one)
            random_rows(src, ROWS, K, rng, data, scales, w);
            copy.resize(size_t(interleaved_bytes(fmt, ROWS, K)));
            w = interleave_rows(src, fmt, w, ROWS, K, copy.data());
        } else {
            random_rows(fmt, ROWS, K, rng, data, scales, w);
        }
        const std::string what = std::string(t->name) + " " + f.name + ": ";

        // Decode.
        std::vector<float> o1(size_t(NT) * ROWS), o2(size_t(NT) * ROWS);
        float mag = 0.f;
        if (f.float_acts) {
            const float* xs[NT] = {x.data(), x.data() + K, x.data() + 2 * K};
            ref->gemv_f32[fmt](w, 0, ROWS, K, xs, NT, o1.data(), ROWS);
            t->gemv_f32[fmt](w, 0, ROWS, K, xs, NT, o2.data(), ROWS);
        } else {
            std::vector<int8_t> q(size_t(NT) * K);
            std::vector<float> d(size_t(NT) * K / 32), s(size_t(NT) * K / 32);
            Q8Row acts[NT];
            for (int i = 0; i < NT; ++i) {
                ref->quantize(x.data() + i * K, K, act_variant(f), q.data() + i * K,
                              d.data() + i * K / 32, s.data() + i * K / 32);
                acts[i] = Q8Row{q.data() + i * K, d.data() + i * K / 32, s.data() + i * K / 32};
            }
            ref->gemv_q8[fmt](w, 0, ROWS, K, acts, NT, o1.data(), ROWS);
            t->gemv_q8[fmt](w, 0, ROWS, K, acts, NT, o2.data(), ROWS);
        }
        for (float v : o1) mag = std::fmax(mag, std::fabs(v));
        for (size_t i = 0; i < o1.size(); ++i)
            if (!close(o1[i], o2[i], mag, 1e-4f)) return what + "gemv differs";

        // Prefill: dequantized panels and the GEMM on them.
        const int P1 = ref->panel, P2 = t->panel;
        std::vector<float> p1(size_t(K) * P1), p2(size_t(K) * P2), tmp(size_t(K + 16) * (P1 > P2 ? P1 : P2));
        ref->dequant_panel(fmt, w, 0, ROWS, 0, 256, p1.data(), tmp.data());
        t->dequant_panel(fmt, w, 0, ROWS, 0, 256, p2.data(), tmp.data());
        for (int k = 0; k < 256; ++k)
            for (int r = 0; r < ROWS; ++r) {
                const float a = p1[size_t(k * P1 + r)], b = p2[size_t(k * P2 + r)];
                if (!close(a, b, std::fabs(a), 1e-6f)) return what + "dequantize differs";
            }
        for (int k = 0; k < 256; ++k)
            for (int r = ROWS; r < P2; ++r)
                if (p2[size_t(k * P2 + r)] != 0.f) return what + "panel padding is not zero";
        const float* as[NT] = {x.data(), x.data() + K, x.data() + 2 * K};
        // The bf16 GEMM is held to the reference on the same values rounded to bf16.
        std::vector<float> xr(x), p1r(p1);
        std::vector<uint16_t> xb(x.size());
        for (size_t i = 0; i < x.size(); ++i) xr[i] = bf16_to_f32(xb[i] = f32_to_bf16(x[i]));
        for (float& v : p1r) v = bf16_to_f32(f32_to_bf16(v));
        const float* asr[NT] = {xr.data(), xr.data() + K, xr.data() + 2 * K};
        const uint16_t* ab[NT] = {xb.data(), xb.data() + K, xb.data() + 2 * K};
        for (int bf16 = 0; bf16 < (t->gemm_panels_bf16 ? 2 : 1); ++bf16) {
            std::vector<float> c1(size_t(NT) * P1, 0.f), c2(size_t(NT) * P2, 0.f);
            ref->gemm_panels(bf16 ? asr : as, NT, (bf16 ? p1r : p1).data(), 1, 256, c1.data(), P1);
            if (bf16)
                t->gemm_panels_bf16(ab, NT, p2.data(), 1, 256, c2.data(), P2);
            else
                t->gemm_panels(as, NT, p2.data(), 1, 256, c2.data(), P2);
            float cm = 0.f;
            for (float v : c1) cm = std::fmax(cm, std::fabs(v));
            for (int i = 0; i < NT; ++i)
                for (int r = 0; r < ROWS; ++r)
                    if (!close(c1[size_t(i * P1 + r)], c2[size_t(i * P2 + r)], cm, 1e-5f))
                        return what + (bf16 ? "bf16 gemm differs" : "gemm differs");
        }
    }

    std::vector<float> h1(37), h2(37);
    ref->silu_mul(x.data(), x.data() + 64, h1.data(), 37);
    t->silu_mul(x.data(), x.data() + 64, h2.data(), 37);
    for (int i = 0; i < 37; ++i)
        if (!close(h1[size_t(i)], h2[size_t(i)], std::fabs(h1[size_t(i)]), 1e-5f)) return std::string(t->name) + ": silu differs";
    ref->gptoss_glu(x.data(), x.data() + 64, h1.data(), 37, 1.702f, 0.5f);
    t->gptoss_glu(x.data(), x.data() + 64, h2.data(), 37, 1.702f, 0.5f);
    for (int i = 0; i < 37; ++i)
        if (!close(h1[size_t(i)], h2[size_t(i)], std::fabs(h1[size_t(i)]), 1e-5f)) return std::string(t->name) + ": glu differs";
    // The transposed GEMV: 9 rows of 37 (a tail past the vectors) for two tokens, each float format.
    for (const Format fmt : {FMT_BF16, FMT_F16, FMT_F32}) {
        std::vector<uint8_t> rows;
        std::vector<uint8_t> unused;
        MatrixRef w;
        random_rows(fmt, 9, 37, rng, rows, unused, w);
        std::vector<float> o1(2 * 37, 0.5f), o2(2 * 37, 0.5f);
        const float* xs[2] = {x.data(), x.data() + 9};
        float* ref_out[2] = {o1.data(), o1.data() + 37};
        float* t_out[2] = {o2.data(), o2.data() + 37};
        ref->rows_axpy(fmt, w.data, w.row_stride, 9, 37, xs, 2, ref_out);
        t->rows_axpy(fmt, w.data, w.row_stride, 9, 37, xs, 2, t_out);
        float mag = 0.f;
        for (float v : o1) mag = std::fmax(mag, std::fabs(v));
        for (size_t i = 0; i < o1.size(); ++i)
            if (!close(o1[i], o2[i], mag, 1e-5f)) return std::string(t->name) + " " + kFormats[fmt].name + ": rows_axpy differs";
    }
    return "";
}

namespace {

IsaChoice choose() {
    std::vector<const KernelTable*> tables = supported_tables();
    IsaChoice choice{tables.back(), ""};
    size_t first = 0;
    if (const char* want = std::getenv("HYBRIDMOE_NATIVE_ISA"); want && *want) {
        // A name (or prefix: "avx512") caps the choice; unknown names are ignored.
        const std::string w(want);
        size_t i = 0;
        while (i < tables.size() && std::string(tables[i]->name).rfind(w, 0) != 0) ++i;
        if (i < tables.size()) {
            first = i;
            if (i > 0) choice.note = "limited to " + w + " by HYBRIDMOE_NATIVE_ISA";
        }
    }
    for (size_t i = first; i < tables.size(); ++i) {
        const std::string err = self_test(tables[i]);
        if (err.empty()) {
            choice.table = tables[i];
            return choice;
        }
        choice.note += (choice.note.empty() ? "" : "; ") + std::string("self-test failed, not used: ") + err;
    }
    return choice;
}

}  // namespace

const IsaChoice& active_isa() {
    static const IsaChoice choice = choose();
    return choice;
}

namespace {
std::atomic<const KernelTable*> g_override{nullptr};
}

const KernelTable* current_table() {
    const KernelTable* t = g_override.load(std::memory_order_acquire);
    return t ? t : active_isa().table;
}

void use_table(const KernelTable* t) { g_override.store(t, std::memory_order_release); }

}  // namespace hmoe
