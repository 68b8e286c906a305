// Which logical CPUs to run on: one per physical core (SMT siblings share a core's load
// ports and gain nothing on a memory-bound GEMV), grouped by NUMA node, restricted to the
// process's affinity mask (taskset, cgroup cpusets). Read from Linux sysfs; elsewhere, or
// when sysfs says nothing, every allowed CPU is one core on one node.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace hmoe {

struct NumaNode {
    int id = 0;
    std::vector<int> cpus;  // one logical CPU per physical core, ascending
};

struct Topology {
    std::vector<NumaNode> nodes;  // nodes with at least one allowed core
    int physical_cores() const;
};

// `sysfs_root` is "/sys" except in tests; `allowed` (tests) replaces the affinity mask.
Topology detect_topology(const char* sysfs_root = "/sys", const std::vector<int>* allowed = nullptr);

// The same cores regrouped into `n` nodes of consecutive cores: exercises the multi-node
// code (per-node pools and partial outputs) on a one-node machine, for tests.
Topology split_into_nodes(const Topology& topo, int n);

// Pin the calling thread to one logical CPU (no-op where unsupported). True on success.
bool pin_current_thread(int cpu);

// Ask the kernel to keep [addr, addr + len) on `node` (mbind MPOL_PREFERRED, moving pages
// already faulted in where the kernel allows it). Best effort: false when it could not.
bool bind_memory_to_node(const void* addr, size_t len, int node);

// The read-only file mappings of this process (/proc/self/maps at construction): their pages
// are clean copies of the file, so dropping them loses nothing (the next access reads the
// file, or the page cache, again). Writable mappings are never touched.
class ReadOnlyFileMappings {
public:
    ReadOnlyFileMappings();
    // Drop the whole pages of [addr, addr + len) that lie in one such mapping
    // (madvise MADV_DONTNEED); returns the bytes dropped.
    size_t release(const void* addr, size_t len) const;
    // Whether [addr, addr + len) lies wholly inside one such mapping.
    bool holds(const void* addr, size_t len) const;

private:
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges_;  // [begin, end), ascending
};

}  // namespace hmoe
