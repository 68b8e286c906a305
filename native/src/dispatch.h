// Choosing the kernel set at load time: the best variant this CPU supports (and the OS has
// enabled: __builtin_cpu_supports checks both), unless HYBRIDMOE_NATIVE_ISA names a lower
// one. A chosen SIMD set must also agree with the portable set on a small self-test
// before it is used; a variant that cannot be tested where it was built (AVX-512 on an
// AVX2 build machine) is then at least checked on the machine that runs it.
#pragma once

#include <string>
#include <vector>

#include "kernel_table.h"

namespace hmoe {

struct IsaChoice {
    const KernelTable* table;
    std::string note;  // why a better variant was not used ("" when none was refused)
};

// The process-wide choice (made once, on first use).
const IsaChoice& active_isa();
// The kernel set calls use: the choice above unless a test or benchmark set another
// supported one with use_table (nullptr: back to the choice).
const KernelTable* current_table();
void use_table(const KernelTable* t);
// Variants this CPU can run, best first (the portable one always last).
std::vector<const KernelTable*> supported_tables();
// Compares `t` with the portable kernels on random data; "" when they agree, else what differs.
std::string self_test(const KernelTable* t);

}  // namespace hmoe
