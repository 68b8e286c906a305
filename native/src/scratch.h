// Buffers kept between calls and grown on demand: the kernels' workspaces (a new vector per call
// is zero-filled, and at a prompt's size in fresh pages the kernel faults in and clears).
#pragma once

#include <cstddef>

namespace hmoe {

// v with room for at least n elements (grown, never shrunk); its data. Internal linkage: each
// translation unit keeps its own copy, as the kernel sets' units are compiled with other flags.
template <class V>
static inline typename V::value_type* grow(V& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

}  // namespace hmoe
