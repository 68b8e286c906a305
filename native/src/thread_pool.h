// A persistent thread pool per NUMA node, one thread per physical core, pinned.
//
// A MoE layer call is three or four short parallel phases; creating threads per call, or
// waking them through a generic task queue, would cost more than a decode step's GEMVs on
// a small expert. Here a phase is one function pointer broadcast to every thread: each
// thread claims work units from counters in the caller's context until none are left.
//
// Waiting: after a phase a worker spins for a short while (HYBRIDMOE_SPIN_US, default 50
// microseconds) because the next phase or the next layer usually follows within
// microseconds; then it sleeps on a condition variable, so idle workers never steal the
// cores from PyTorch or the rest of the process between calls. A caller that knows its next
// phase comes after a longer gap (the decode step, between two tokens) asks them to stay awake.
//
// The calling thread takes part as worker 0 of node 0 (node 0's pool has one thread fewer
// than its cores): no core idles while the caller waits, and the caller never needs to be
// woken up at the end. It is not pinned (it is the application's thread).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "topology.h"

namespace hmoe {

// fn(ctx, node, worker): worker is 0 .. threads_on(node) - 1 within its node.
using PhaseFn = void (*)(void* ctx, int node, int worker);

class NodePool {
public:
    // `cpus`: the cores of this node to run on; the first `caller_slots` of them are left
    // to the calling thread (1 for node 0, else 0).
    NodePool(int node, std::vector<int> cpus, int caller_slots, bool pin, int spin_us,
             const std::atomic<int64_t>* awake_until);
    ~NodePool();
    NodePool(const NodePool&) = delete;
    NodePool& operator=(const NodePool&) = delete;

    void start(PhaseFn fn, void* ctx);  // wake every worker thread on fn
    void wait();                        // until every worker thread has returned from fn
    void rouse();                       // sleeping workers back to spinning (stay_awake)
    int threads() const { return int(workers_.size()) + caller_slots_; }

private:
    void loop(int worker, int cpu);

    const int node_;
    const int caller_slots_;
    const bool pin_;
    const int spin_us_;
    const std::atomic<int64_t>* awake_until_;  // the executor's (stay_awake)
    std::vector<std::thread> workers_;

    std::mutex mutex_;
    std::condition_variable wake_;
    std::condition_variable done_;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> remaining_{0};
    int sleepers_ = 0;  // guarded by mutex_
    bool stop_ = false; // guarded by mutex_
    PhaseFn fn_ = nullptr;
    void* ctx_ = nullptr;
};

class Executor {
public:
    // threads <= 0: one per physical core (within the affinity mask).
    Executor(const Topology& topo, int threads, bool pin, int spin_us);

    // Run fn on every thread of every node, the caller included, and return when all are done.
    void run(PhaseFn fn, void* ctx);

    // Keep the workers spinning, not sleeping, for the next `us` microseconds: for a caller
    // whose next phase follows a gap longer than the spin (a decode loop's Python between the
    // steps). Waking a sleeping worker takes a futex and, in a VM, an interrupt to a halted
    // virtual CPU: tens of microseconds in which the caller starts the phase alone.
    void stay_awake(int us);

    int nodes() const { return int(pools_.size()); }
    int threads_on(int node) const { return pools_[node]->threads(); }
    int threads() const;
    int node_id(int node) const { return node_ids_[node]; }  // the OS NUMA node number

private:
    std::atomic<int64_t> awake_until_{0};  // steady-clock nanoseconds
    std::vector<std::unique_ptr<NodePool>> pools_;
    std::vector<int> node_ids_;
    std::mutex run_mutex_;
};

}  // namespace hmoe
