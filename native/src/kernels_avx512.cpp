// The AVX-512 kernel set (Ice Lake / Sapphire Rapids / Zen 4 and later): the same kernels as
// AVX2 with VNNI integer dots (vpdpbusd replaces vpmaddubsw + vpmaddwd) and a 512-bit
// prefill GEMM on 32-row panels. Compiled with the AVX-512 F/BW/VL/DQ/VNNI/VBMI/BITALG and GFNI
// flags in this translation unit only; dispatch.cpp requires all of them at run time. Not BF16:
// nothing here multiplies bf16 (the AMX set does), so Ice Lake and Tiger Lake run this set too.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernel_table.h"

#define HMOE_AVX512 1

namespace hmoe {
namespace avx512_isa {
#include "kernels_x86.inl"
}  // namespace avx512_isa

const KernelTable* kernels_avx512() { return avx512_isa::make_table("avx512_vnni"); }

}  // namespace hmoe
