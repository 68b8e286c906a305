// Portable dequantizing of one row segment of any stored format to fp32, the plain statement of
// every layout in formats.h. Included *inside* each ISA translation unit's own namespace
// (never compiled as shared inline code, see kernel_table.h), so the compiler may vectorize
// it with that unit's instruction set and nothing leaks between units.
//
// The float operations follow ggml's reference dequantizers (and backend/formats/quant.py),
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

// The grid i-quants, one super-block of 256 to fp32, with ggml's float operations in ggml's
// order (so the values are bit for bit those of its dequantizers): a grid value times a sign
// times a scale, each 8 (iq3: 4) values one grid entry.
static inline float iq_sign(uint8_t signs, int j) { return (signs >> j) & 1 ? -1.f : 1.f; }

static inline void iq_dequant_superblock(Format fmt, const uint8_t* p, float* y) {
    switch (fmt) {
        case FMT_IQ2_XXS: {
            const float d = fp16_to_f32(load_u16(p));
            for (int ib = 0; ib < 8; ++ib) {
                const uint8_t* idx = p + 2 + 8 * ib;
                const uint32_t w = load_u32(idx + 4);
                const float db = d * (0.5f + float(w >> 28)) * 0.25f;
                for (int l = 0; l < 4; ++l) {
                    const uint64_t g = kIq2xxsGrid[idx[l]];
                    const uint8_t s = kSignsIq2[(w >> (7 * l)) & 127];
                    for (int j = 0; j < 8; ++j) y[32 * ib + 8 * l + j] = db * float((g >> (8 * j)) & 0xFF) * iq_sign(s, j);
                }
            }
            return;
        }
        case FMT_IQ2_XS: {
            const float d = fp16_to_f32(load_u16(p));
            for (int ib = 0; ib < 8; ++ib) {
                const uint8_t sc = p[66 + ib];
                const float db[2] = {d * (0.5f + float(sc & 0x0F)) * 0.25f, d * (0.5f + float(sc >> 4)) * 0.25f};
                for (int l = 0; l < 4; ++l) {
                    const uint16_t q = load_u16(p + 2 + 2 * (4 * ib + l));
                    const uint64_t g = kIq2xsGrid[q & 511];
                    const uint8_t s = kSignsIq2[q >> 9];
                    for (int j = 0; j < 8; ++j)
                        y[32 * ib + 8 * l + j] = db[l / 2] * float((g >> (8 * j)) & 0xFF) * iq_sign(s, j);
                }
            }
            return;
        }
        case FMT_IQ2_S: {
            const float d = fp16_to_f32(load_u16(p));
            const uint8_t *qs = p + 2, *signs = p + 34, *qh = p + 66, *scales = p + 74;
            for (int ib = 0; ib < 8; ++ib) {
                const float db[2] = {d * (0.5f + float(scales[ib] & 0x0F)) * 0.25f,
                                     d * (0.5f + float(scales[ib] >> 4)) * 0.25f};
                for (int l = 0; l < 4; ++l) {
                    const uint64_t g = kIq2sGrid[qs[4 * ib + l] | ((qh[ib] << (8 - 2 * l)) & 0x300)];
                    const uint8_t s = signs[4 * ib + l];
                    for (int j = 0; j < 8; ++j)
                        y[32 * ib + 8 * l + j] = db[l / 2] * float((g >> (8 * j)) & 0xFF) * iq_sign(s, j);
                }
            }
            return;
        }
        case FMT_IQ3_XXS: {
            const float d = fp16_to_f32(load_u16(p));
            const uint8_t* qs = p + 2;
            for (int ib = 0; ib < 8; ++ib) {
                const uint32_t w = load_u32(p + 66 + 4 * ib);
                const float db = d * (0.5f + float(w >> 28)) * 0.5f;
                for (int l = 0; l < 4; ++l) {
                    const uint8_t s = kSignsIq2[(w >> (7 * l)) & 127];
                    const uint32_t g1 = kIq3xxsGrid[qs[8 * ib + 2 * l]], g2 = kIq3xxsGrid[qs[8 * ib + 2 * l + 1]];
                    for (int j = 0; j < 4; ++j) {
                        y[32 * ib + 8 * l + j] = db * float((g1 >> (8 * j)) & 0xFF) * iq_sign(s, j);
                        y[32 * ib + 8 * l + j + 4] = db * float((g2 >> (8 * j)) & 0xFF) * iq_sign(s, j + 4);
                    }
                }
            }
            return;
        }
        case FMT_IQ3_S: {
            const float d = fp16_to_f32(load_u16(p));
            const uint8_t *qs = p + 2, *qh = p + 66, *signs = p + 74, *scales = p + 106;
            for (int ib = 0; ib < 8; ++ib) {
                const float db = d * float(1 + 2 * ((scales[ib / 2] >> (4 * (ib % 2))) & 0x0F));
                for (int l = 0; l < 4; ++l) {
                    const uint32_t g1 = kIq3sGrid[qs[8 * ib + 2 * l] | ((qh[ib] << (8 - 2 * l)) & 256)];
                    const uint32_t g2 = kIq3sGrid[qs[8 * ib + 2 * l + 1] | ((qh[ib] << (7 - 2 * l)) & 256)];
                    const uint8_t s = signs[4 * ib + l];
                    for (int j = 0; j < 4; ++j) {
                        y[32 * ib + 8 * l + j] = db * float((g1 >> (8 * j)) & 0xFF) * iq_sign(s, j);
                        y[32 * ib + 8 * l + j + 4] = db * float((g2 >> (8 * j)) & 0xFF) * iq_sign(s, j + 4);
                    }
                }
            }
            return;
        }
        case FMT_IQ1_S: {
            const float d = fp16_to_f32(load_u16(p));
            const uint8_t* qs = p + 2;
            for (int ib = 0; ib < 8; ++ib) {
                const uint16_t qh = load_u16(p + 34 + 2 * ib);
                const float dl = d * float(2 * ((qh >> 12) & 7) + 1);
                const float delta = qh & 0x8000 ? -0.125f : 0.125f;
                for (int l = 0; l < 4; ++l) {
                    const uint64_t g = kIq1sGrid[qs[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8)];
                    for (int j = 0; j < 8; ++j) y[32 * ib + 8 * l + j] = dl * (float(int8_t(g >> (8 * j))) + delta);
                }
            }
            return;
        }
        case FMT_IQ1_M: {
            const uint8_t *qs = p, *qh = p + 32, *sc8 = p + 48;
            uint16_t sc[4];
            for (int i = 0; i < 4; ++i) sc[i] = load_u16(sc8 + 2 * i);
            const uint16_t dbits = uint16_t((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000));
            const float d = fp16_to_f32(dbits);
            for (int ib = 0; ib < 8; ++ib) {
                const float dl1 = d * float(2 * ((sc[ib / 2] >> (6 * (ib % 2))) & 7) + 1);
                const float dl2 = d * float(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3)) & 7) + 1);
                const uint8_t h0 = qh[2 * ib], h1 = qh[2 * ib + 1];
                const int idx[4] = {qs[4 * ib] | ((h0 << 8) & 0x700), qs[4 * ib + 1] | ((h0 << 4) & 0x700),
                                    qs[4 * ib + 2] | ((h1 << 8) & 0x700), qs[4 * ib + 3] | ((h1 << 4) & 0x700)};
                const float delta[4] = {h0 & 0x08 ? -0.125f : 0.125f, h0 & 0x80 ? -0.125f : 0.125f,
                                        h1 & 0x08 ? -0.125f : 0.125f, h1 & 0x80 ? -0.125f : 0.125f};
                for (int l = 0; l < 4; ++l) {
                    const uint64_t g = kIq1sGrid[idx[l]];
                    const float dl = l < 2 ? dl1 : dl2;
                    for (int j = 0; j < 8; ++j) y[32 * ib + 8 * l + j] = dl * (float(int8_t(g >> (8 * j))) + delta[l]);
                }
            }
            return;
        }
        default:
            return;
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
        case FMT_Q4_1: {
            const uint8_t* p = row + b * 20;
            const float d = fp16_to_f32(load_u16(p)), m = fp16_to_f32(load_u16(p + 2));
            for (int j = 0; j < 16; ++j) {
                dst[j] = float(p[4 + j] & 0x0F) * d + m;
                dst[j + 16] = float(p[4 + j] >> 4) * d + m;
            }
            return;
        }
        case FMT_Q5_1: {
            const uint8_t* p = row + b * 24;
            const float d = fp16_to_f32(load_u16(p)), m = fp16_to_f32(load_u16(p + 2));
            const uint32_t qh = load_u32(p + 4);
            for (int j = 0; j < 16; ++j) {
                dst[j] = float((p[8 + j] & 0x0F) | (((qh >> j) & 1) << 4)) * d + m;
                dst[j + 16] = float((p[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) * d + m;
            }
            return;
        }
        case FMT_IQ4_NL: {
            const uint8_t* p = row + b * 18;
            const float d = fp16_to_f32(load_u16(p));
            for (int j = 0; j < 16; ++j) {
                dst[j] = d * float(kIq4nlValues[p[2 + j] & 0x0F]);
                dst[j + 16] = d * float(kIq4nlValues[p[2 + j] >> 4]);
            }
            return;
        }
        case FMT_IQ4_XS: {
            const uint8_t* p = row + b * 136;
            const float d = fp16_to_f32(load_u16(p));
            const uint16_t sh = load_u16(p + 2);
            for (int j = 0; j < 8; ++j) {
                const int ls = ((p[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((sh >> (2 * j)) & 3) << 4);
                const float dl = d * float(ls - 32);
                const uint8_t* qs = p + 8 + 16 * j;
                for (int l = 0; l < 16; ++l) {
                    dst[32 * j + l] = dl * float(kIq4nlValues[qs[l] & 0x0F]);
                    dst[32 * j + l + 16] = dl * float(kIq4nlValues[qs[l] >> 4]);
                }
            }
            return;
        }
        case FMT_IQ2_XXS:
        case FMT_IQ2_XS:
        case FMT_IQ2_S:
        case FMT_IQ3_XXS:
        case FMT_IQ3_S:
        case FMT_IQ1_S:
        case FMT_IQ1_M:
            iq_dequant_superblock(fmt, row + b * kFormats[fmt].block_bytes, dst);
            return;
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

// Block b of row r of an x8 matrix (q4_0 order, codes q + 8; iq4_nlx8: indices into the iq4_nl
// table; q8_0x8: signed codes) into dst[0 .. 32).
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
    const auto value = [fmt](int code) { return fmt == FMT_IQ4_NL_X8 ? int(kIq4nlValues[code]) : code - 8; };
    for (int j = 0; j < 16; ++j) {
        const uint8_t c = blk[x8_code_at(lane, j)];
        dst[j] = d * float(value(c & 0x0F));
        dst[j + 16] = d * float(value(c >> 4));
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

// Super-block sb of row r of an iq4_xsx8 matrix into dst[0 .. 256), as dequant_block does iq4_xs.
static inline void dequant_iq4xsx8_block(const MatrixRef& w, int64_t r, int64_t sb, float* dst) {
    const uint8_t* blk = w.data + (r / 8) * w.row_stride + sb * kIq4XsX8Bytes;
    const int lane = int(r % 8);
    const float d = fp16_to_f32(load_u16(blk + 2 * lane));
    const uint16_t sh = load_u16(blk + 16 + 2 * lane);
    const uint32_t sl = load_u32(blk + 32 + 4 * lane);
    for (int j = 0; j < 8; ++j) {
        const int ls = int((sl >> (4 * j)) & 0x0F) | (((sh >> (2 * j)) & 3) << 4);
        const float dl = d * float(ls - 32);
        for (int l = 0; l < 16; ++l) {
            const uint8_t c = blk[iq4xsx8_code_at(lane, j, l)];
            dst[32 * j + l] = dl * float(kIq4nlValues[c & 0x0F]);
            dst[32 * j + l + 16] = dl * float(kIq4nlValues[c >> 4]);
        }
    }
}

// Columns k0 .. k0+kc-1 of row r (k0, kc multiples of the block) to fp32.
static inline void dequant_row_portable(Format fmt, const MatrixRef& w, int64_t r, int64_t k0, int kc, float* dst) {
    if (unsigned(fmt) >= unsigned(FMT_COUNT)) return;
    if (fmt == FMT_Q4_K_X8 || fmt == FMT_IQ4_XS_X8) {
        for (int64_t sb = k0 / 256; sb < (k0 + kc) / 256; ++sb)
            (fmt == FMT_Q4_K_X8 ? dequant_q4kx8_block : dequant_iq4xsx8_block)(w, r, sb, dst + (sb * 256 - k0));
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
