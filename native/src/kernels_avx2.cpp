// The AVX2 + FMA + F16C kernel set (x86-64 since Haswell and Zen 1). This translation unit
// alone is compiled with those -m flags (see native/CMakeLists.txt); dispatch.cpp calls it
// only after __builtin_cpu_supports said yes.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernel_table.h"

namespace hmoe {
namespace avx2_isa {
#include "kernels_x86.inl"
}  // namespace avx2_isa

const KernelTable* kernels_avx2() { return avx2_isa::make_table("avx2"); }

}  // namespace hmoe
