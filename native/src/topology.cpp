#include "topology.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hmoe {

int Topology::physical_cores() const {
    int n = 0;
    for (const auto& node : nodes) n += int(node.cpus.size());
    return n;
}

namespace {

bool read_line(const std::string& path, std::string& out) {
    std::ifstream f(path);
    if (!f) return false;
    std::getline(f, out);
    return true;
}

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}
std::vector<int> parse_cpulist(const std::string& text) {
    std::vector<int> cpus;
    std::stringstream ss(text);
    std::string part;
    while (std::getline(ss, part, ',')) {
        if (part.empty() || part == "\n") continue;
        const auto dash = part.find('-');
        try {
            if (dash == std::string::npos) {
                cpus.push_back(std::stoi(part));
            } else {
                const int a = std::stoi(part.substr(0, dash)), b = std::stoi(part.substr(dash + 1));
                for (int c = a; c <= b; ++c) cpus.push_back(c);
            }
        } catch (...) {
        }
    }
    return cpus;
}

std::set<int> allowed_cpus() {
    std::set<int> allowed;
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        for (int c = 0; c < CPU_SETSIZE; ++c)
            if (CPU_ISSET(c, &set)) allowed.insert(c);
    }
#endif
    if (allowed.empty()) {
        const unsigned n = std::max(1u, std::thread::hardware_concurrency());
        for (unsigned c = 0; c < n; ++c) allowed.insert(int(c));
    }
    return allowed;
}

}  // namespace

Topology detect_topology(const char* sysfs_root, const std::vector<int>* allowed_override) {
    const std::string root(sysfs_root);
    const std::set<int> allowed =
        allowed_override ? std::set<int>(allowed_override->begin(), allowed_override->end()) : allowed_cpus();

    // Physical core identity: (package, core_id); the first allowed sibling represents it.
    std::map<std::pair<int, int>, int> core_rep;
    for (int cpu : allowed) {
        const std::string base = root + "/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
        std::string pkg, core;
        if (!read_line(base + "physical_package_id", pkg) || !read_line(base + "core_id", core)) {
            core_rep[{-1, cpu}] = cpu;  // unknown: count the CPU as its own core
            continue;
        }
        try {
            const auto key = std::make_pair(std::stoi(pkg), std::stoi(core));
            auto it = core_rep.find(key);
            if (it == core_rep.end() || cpu < it->second) core_rep[key] = cpu;
        } catch (...) {
            core_rep[{-1, cpu}] = cpu;
        }
    }
    std::set<int> reps;
    for (const auto& kv : core_rep) reps.insert(kv.second);

    // NUMA nodes from /sys/devices/system/node/nodeN/cpulist.
    Topology topo;
    std::set<int> placed;
    std::string online;
    const std::vector<int> node_ids =
        read_line(root + "/devices/system/node/online", online) ? parse_cpulist(online) : std::vector<int>{};
    for (int n : node_ids) {
        std::string list;
        if (!read_line(root + "/devices/system/node/node" + std::to_string(n) + "/cpulist", list)) continue;
        NumaNode node;
        node.id = n;
        for (int c : parse_cpulist(list))
            if (reps.count(c) && !placed.count(c)) {
                node.cpus.push_back(c);
                placed.insert(c);
            }
        if (!node.cpus.empty()) topo.nodes.push_back(std::move(node));
    }
    // CPUs sysfs did not place (no NUMA info): one node 0 with all of them.
    std::vector<int> rest;
    for (int c : reps)
        if (!placed.count(c)) rest.push_back(c);
    if (!rest.empty()) {
        if (topo.nodes.empty()) {
            topo.nodes.push_back(NumaNode{0, rest});
        } else {
            auto& first = topo.nodes.front().cpus;
            first.insert(first.end(), rest.begin(), rest.end());
            std::sort(first.begin(), first.end());
        }
    }
    return topo;
}

Topology split_into_nodes(const Topology& topo, int n) {
    std::vector<int> cores;
    for (const auto& node : topo.nodes) cores.insert(cores.end(), node.cpus.begin(), node.cpus.end());
    n = std::max(1, std::min<int>(n, int(cores.size())));
    Topology out;
    for (int i = 0; i < n; ++i) {
        NumaNode node;
        node.id = topo.nodes.empty() ? 0 : topo.nodes.front().id;  // memory stays where it is
        const size_t a = cores.size() * size_t(i) / size_t(n), b = cores.size() * size_t(i + 1) / size_t(n);
        node.cpus.assign(cores.begin() + long(a), cores.begin() + long(b));
        out.nodes.push_back(std::move(node));
    }
    return out;
}

bool pin_current_thread(int cpu) {
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
#else
    (void)cpu;
    return false;
#endif
}

bool bind_memory_to_node(const void* addr, size_t len, int node) {
#if defined(__linux__) && defined(SYS_mbind)
    // Raw syscall: no libnuma dependency. Only whole pages inside the range are bound (a
    // shared boundary page belongs to a neighbour as much as to us).
    const long page = sysconf(_SC_PAGESIZE);
    uintptr_t a = (reinterpret_cast<uintptr_t>(addr) + page - 1) & ~uintptr_t(page - 1);
    uintptr_t b = (reinterpret_cast<uintptr_t>(addr) + len) & ~uintptr_t(page - 1);
    if (b <= a || node < 0 || node >= 1024) return false;
    unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {0};
    mask[node / (8 * sizeof(unsigned long))] = 1UL << (node % (8 * sizeof(unsigned long)));
    constexpr int kMpolPreferred = 1;
    constexpr unsigned kMpolMfMove = 1u << 1;
    return syscall(SYS_mbind, a, b - a, kMpolPreferred, mask, 1024UL, kMpolMfMove) == 0;
#else
    (void)addr, (void)len, (void)node;
    return false;
#endif
}

ReadOnlyFileMappings::ReadOnlyFileMappings() {
#if defined(__linux__)
    // Lines: "begin-end perms offset dev inode path"; inode 0 is anonymous memory.
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line)) {
        unsigned long begin = 0, end = 0, offset = 0, inode = 0;
        char perms[8] = {0}, dev[32] = {0};
        if (std::sscanf(line.c_str(), "%lx-%lx %7s %lx %31s %lu", &begin, &end, perms, &offset, dev, &inode) != 6)
            continue;
        if (inode != 0 && perms[0] == 'r' && perms[1] == '-') ranges_.emplace_back(begin, end);
    }
    std::sort(ranges_.begin(), ranges_.end());
#endif
}

bool ReadOnlyFileMappings::holds(const void* addr, size_t len) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(addr), b = a + len;
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), std::make_pair(a, ~uintptr_t(0)));
    return it != ranges_.begin() && a >= std::prev(it)->first && b <= std::prev(it)->second;
}

size_t ReadOnlyFileMappings::release(const void* addr, size_t len) const {
#if defined(__linux__)
    const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
    const uintptr_t a = (reinterpret_cast<uintptr_t>(addr) + page - 1) & ~(page - 1);
    const uintptr_t b = (reinterpret_cast<uintptr_t>(addr) + len) & ~(page - 1);
    if (b <= a || !holds(reinterpret_cast<const void*>(a), b - a)) return 0;  // not in one such mapping
    return madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED) == 0 ? size_t(b - a) : 0;
#else
    (void)addr, (void)len;
    return 0;
#endif
}

}  // namespace hmoe
