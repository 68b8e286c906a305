// Portable decoding of one row segment of any stored format to fp32, the plain statement of
// every layout in formats.h. Included *inside* each ISA translation unit's own namespace
// (never compiled as shared inline code, see kernel_table.h), so the compiler may vectorize
// it with that unit's instruction set and nothing leaks between units.
//
// The float operations follow ggml's reference dequantizers (and backend/engine/quant.py),
// so for the GGUF formats the values are the ones the PyTorch reference sees.

// Q6_K: the 256 six-bit values of a super-block, minus 32, in element order.
static inline void q6k_values(const uint8_t* blk, int8_t q[256]) {
    for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = blk + 64 * h;
        const uint8_t* qh = blk + 128 + 32 * h;
        int8_t* o = q + 128 * h;
        for (int l = 0; l < 32; ++l) {
            o[l] = int8_t(((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
            o[l + 32] = int8_t(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
            o[l + 64] = int8_t(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            o[l + 96] = int8_t(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    }
}

// Q3_K: the sixteen 6-bit scales of a super-block, minus 32 (ggml's unpacking of its 12 bytes).
static inline void q3k_scales(const uint8_t* sc12, int8_t out[16]) {
    for (int i = 0; i < 16; ++i) {
        const int low = (sc12[i % 8] >> (4 * (i / 8))) & 0x0F;
        const int high = (sc12[8 + i % 4] >> (2 * (i / 4))) & 0x03;
        out[i] = int8_t((low | (high << 4)) - 32);
    }
}

// Dequantize block `b` of a row (block index along K) into dst[0 .. block). `row` and
// `srow` are the row's data and (split formats) scale pointers.
static inline void dequant_block(Format fmt, const uint8_t* row, const uint8_t* srow, int64_t b, float* dst) {
    switch (fmt) {
        case FMT_Q8_0: {
            const uint8_t* p = row + b * 34;
            const float d = fp16_to_f32(load_u16(p));
            for (int i = 0; i < 32; ++i) dst[i] = float(int8_t(p[2 + i])) * d;
            return;
        }
        case FMT_Q4_0: {
            const uint8_t* p = row + b * 18;
            const float d = fp16_to_f32(load_u16(p));
            for (int j = 0; j < 16; ++j) {
                dst[j] = d * float(int(p[2 + j] & 0x0F) - 8);
                dst[j + 16] = d * float(int(p[2 + j] >> 4) - 8);
            }
            return;
        }
        case FMT_Q5_0: {
            const uint8_t* p = row + b * 22;
            const float d = fp16_to_f32(load_u16(p));
            const uint32_t qh = load_u32(p + 2);
            for (int j = 0; j < 16; ++j) {
                dst[j] = d * float(int((p[6 + j] & 0x0F) | (((qh >> j) & 1) << 4)) - 16);
                dst[j + 16] = d * float(int((p[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
            }
            return;
        }
        case FMT_Q4_K:
        case FMT_Q5_K: {
            const bool five = fmt == FMT_Q5_K;
            const uint8_t* p = row + b * (five ? 176 : 144);
            const float d = fp16_to_f32(load_u16(p));
            const float dmin = fp16_to_f32(load_u16(p + 2));
            uint8_t sc[8], mn[8];
            k_scales_mins(p + 4, sc, mn);
            const uint8_t* qh = p + 16;
            const uint8_t* qs = p + (five ? 48 : 16);
            for (int j = 0; j < 8; ++j) {
                const float dl = d * float(sc[j]);
                const float ml = dmin * float(mn[j]);
                const uint8_t* chunk = qs + 32 * (j / 2);
                const int shift = 4 * (j & 1);
                for (int l = 0; l < 32; ++l) {
                    int q = (chunk[l] >> shift) & 0x0F;
                    if (five) q |= ((qh[l] >> j) & 1) << 4;
                    dst[32 * j + l] = dl * float(q) - ml;
                }
            }
            return;
        }
        case FMT_Q6_K: {
            const uint8_t* p = row + b * 210;
            const float d = fp16_to_f32(load_u16(p + 208));
            int8_t q[256];
            q6k_values(p, q);
            for (int i = 0; i < 256; ++i) dst[i] = d * float(int8_t(p[192 + i / 16])) * float(q[i]);
            return;
        }
        case FMT_Q3_K: {
            const uint8_t* p = row + b * 110;
            const float d = fp16_to_f32(load_u16(p + 108));
            int8_t sc[16];
            q3k_scales(p + 96, sc);
            for (int i = 0; i < 256; ++i) {
                const int h = i / 128, j = (i % 128) / 32, l = i % 32;
                const int low = (p[32 + 32 * h + l] >> (2 * j)) & 3;
                const int high = (p[l] >> (4 * h + j)) & 1;
                dst[i] = d * float(sc[i / 16]) * float(low - (high ? 0 : 4));
            }
            return;
        }
        case FMT_Q2_K: {
            const uint8_t* p = row + b * 84;
            const float d = fp16_to_f32(load_u16(p + 80));
            const float dmin = fp16_to_f32(load_u16(p + 82));
            for (int i = 0; i < 256; ++i) {
                const int h = i / 128, j = (i % 128) / 32, l = i % 32;
                const int q = (p[16 + 32 * h + l] >> (2 * j)) & 3;
                const uint8_t sm = p[i / 16];
                dst[i] = d * float(sm & 0x0F) * float(q) - dmin * float(sm >> 4);
            }
            return;
        }
        case FMT_MXFP4: {
            const uint8_t* p = row + b * 17;
            const float d = e8m0_half(p[0]);
            for (int j = 0; j < 16; ++j) {
                dst[j] = d * float(kMxfp4GridX2[p[1 + j] & 0x0F]);
                dst[j + 16] = d * float(kMxfp4GridX2[p[1 + j] >> 4]);
            }
            return;
        }
        case FMT_MXFP4_HF: {
            const uint8_t* p = row + b * 16;
            const float d = e8m0_half(srow[b]);
            for (int j = 0; j < 16; ++j) {
                dst[2 * j] = d * float(kMxfp4GridX2[p[j] & 0x0F]);
                dst[2 * j + 1] = d * float(kMxfp4GridX2[p[j] >> 4]);
            }
            return;
        }
        case FMT_INT4_G32: {
            const uint8_t* p = row + b * 16;
            const float d = bf16_to_f32(load_u16(srow + 2 * b));
            for (int j = 0; j < 16; ++j) {
                dst[2 * j] = float(int(p[j] & 0x0F) - 8) * d;
                dst[2 * j + 1] = float(int(p[j] >> 4) - 8) * d;
            }
            return;
        }
        case FMT_BF16:
            dst[0] = bf16_to_f32(load_u16(row + 2 * b));
            return;
        case FMT_F16:
            dst[0] = fp16_to_f32(load_u16(row + 2 * b));
            return;
        case FMT_F32:
            std::memcpy(dst, row + 4 * b, 4);
            return;
        default:
            return;
    }
}

// Block b of row r of an x8 matrix (q4_0 order, codes q + 8; q8_0x8: signed codes) into dst[0 .. 32).
static inline void dequant_x8_block(Format fmt, const MatrixRef& w, int64_t r, int64_t b, float* dst) {
    if (fmt == FMT_Q8_0_X8) {
        const uint8_t* blk = w.data + (r / 8) * w.row_stride + b * kQ8X8BlockBytes;
        const int lane = int(r % 8);
        const float d = fp16_to_f32(load_u16(blk + 2 * lane));
        for (int j = 0; j < 32; ++j) dst[j] = float(int8_t(blk[x8_code_at(lane, j)])) * d;
        return;
    }
    const uint8_t* blk = w.data + (r / 8) * w.row_stride + b * kX8BlockBytes;
    const int lane = int(r % 8);
    const uint16_t s = load_u16(blk + 2 * lane);
    const float d = fmt == FMT_INT4_X8 ? bf16_to_f32(s) : fp16_to_f32(s);
    for (int j = 0; j < 16; ++j) {
        const uint8_t c = blk[x8_code_at(lane, j)];
        dst[j] = d * float(int(c & 0x0F) - 8);
        dst[j + 16] = d * float(int(c >> 4) - 8);
    }
}

// Super-block sb of row r of a q4_kx8 matrix into dst[0 .. 256), as dequant_block does q4_k.
static inline void dequant_q4kx8_block(const MatrixRef& w, int64_t r, int64_t sb, float* dst) {
    const uint8_t* blk = w.data + (r / 8) * w.row_stride + sb * kQ4KX8Bytes;
    const int lane = int(r % 8);
    const float d = fp16_to_f32(load_u16(blk + 2 * lane)), dmin = fp16_to_f32(load_u16(blk + 16 + 2 * lane));
    for (int j = 0; j < 8; ++j) {
        const float dl = d * float(blk[q4kx8_scale_at(lane, j)]);
        const float ml = dmin * float(blk[q4kx8_min_at(lane, j)]);
        for (int l = 0; l < 32; ++l) {
            const uint8_t c = blk[q4kx8_code_at(lane, j / 2, l)];
            dst[32 * j + l] = dl * float((c >> (4 * (j & 1))) & 0x0F) - ml;
        }
    }
}

// Columns k0 .. k0+kc-1 of row r (k0, kc multiples of the block) to fp32.
static inline void dequant_row_portable(Format fmt, const MatrixRef& w, int64_t r, int64_t k0, int kc, float* dst) {
    if (unsigned(fmt) >= unsigned(FMT_COUNT)) return;
    if (fmt == FMT_Q4_K_X8) {
        for (int64_t sb = k0 / 256; sb < (k0 + kc) / 256; ++sb) dequant_q4kx8_block(w, r, sb, dst + (sb * 256 - k0));
        return;
    }
    if (kFormats[fmt].row_group == 8) {
        for (int64_t b = k0 / 32; b < (k0 + kc) / 32; ++b) dequant_x8_block(fmt, w, r, b, dst + (b * 32 - k0));
        return;
    }
    const int blk = kFormats[fmt].block;
    const uint8_t* row = w.row(r);
    const uint8_t* srow = w.scales ? w.scale_row(r) : nullptr;
    if (blk == 1) {  // float formats: a tight loop the compiler vectorizes
        if (fmt == FMT_F32) {
            std::memcpy(dst, row + 4 * k0, size_t(kc) * 4);
        } else if (fmt == FMT_BF16) {
            for (int i = 0; i < kc; ++i) dst[i] = bf16_to_f32(load_u16(row + 2 * (k0 + i)));
        } else {
            for (int i = 0; i < kc; ++i) dst[i] = fp16_to_f32(load_u16(row + 2 * (k0 + i)));
        }
        return;
    }
    for (int64_t b = k0 / blk; b < (k0 + kc) / blk; ++b) dequant_block(fmt, row, srow, b, dst + (b * blk - k0));
}
