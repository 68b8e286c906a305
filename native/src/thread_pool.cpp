#include "thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HMOE_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define HMOE_PAUSE() asm volatile("yield")
#else
#define HMOE_PAUSE() ((void)0)
#endif

namespace hmoe {

namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Spin until pred(), or until `us` microseconds have passed and the time is past *until
// (steady-clock nanoseconds; none: no such bound); true if pred() became true. The clock is
// read every 64 polls: a poll is a few nanoseconds, a clock read a few tens.
template <class Pred>
bool spin_until(Pred pred, int us, const std::atomic<int64_t>* until = nullptr) {
    const int64_t deadline = now_ns() + int64_t(us) * 1000;
    auto over = [&](int64_t now) { return now >= deadline && (!until || now >= until->load(std::memory_order_relaxed)); };
    if (us <= 0 && over(deadline)) return pred();
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            if (pred()) return true;
            HMOE_PAUSE();
        }
        if (over(now_ns())) return pred();
    }
}

}  // namespace

NodePool::NodePool(int node, std::vector<int> cpus, int caller_slots, bool pin, int spin_us,
                   const std::atomic<int64_t>* awake_until)
    : node_(node), caller_slots_(caller_slots), pin_(pin), spin_us_(spin_us), awake_until_(awake_until) {
    for (size_t i = size_t(caller_slots); i < cpus.size(); ++i) {
        const int worker = int(i);
        const int cpu = cpus[i];
        workers_.emplace_back([this, worker, cpu] { loop(worker, cpu); });
    }
}

NodePool::~NodePool() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
}

void NodePool::start(PhaseFn fn, void* ctx) {
    if (workers_.empty()) return;
    bool notify;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        fn_ = fn;
        ctx_ = ctx;
        remaining_.store(int(workers_.size()), std::memory_order_relaxed);
        generation_.fetch_add(1, std::memory_order_release);
        notify = sleepers_ > 0;  // spinning workers see the generation change by themselves
    }
    if (notify) wake_.notify_all();
}

void NodePool::wait() {
    if (workers_.empty()) return;
    if (spin_until([this] { return remaining_.load(std::memory_order_acquire) == 0; }, spin_us_)) return;
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return remaining_.load(std::memory_order_acquire) == 0; });
}

void NodePool::loop(int worker, int cpu) {
    if (pin_) pin_current_thread(cpu);
    uint64_t seen = 0;
    for (;;) {
        const bool ready =
            spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; }, spin_us_, awake_until_);
        PhaseFn fn;
        void* ctx;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            if (!ready) {
                ++sleepers_;
                wake_.wait(lock, [&] {
                    return stop_ || generation_.load(std::memory_order_acquire) != seen ||
                           now_ns() < awake_until_->load(std::memory_order_relaxed);
                });
                --sleepers_;
                // Roused by stay_awake with no phase yet: back to spinning until its time is up.
                if (!stop_ && generation_.load(std::memory_order_acquire) == seen) continue;
            }
            if (stop_) return;
            seen = generation_.load(std::memory_order_acquire);
            fn = fn_;
            ctx = ctx_;
        }
        fn(ctx, node_, worker);
        if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
            // The last one out tells a sleeping waiter; taking the lock orders the notify
            // after the waiter's predicate check, so the wake-up cannot be lost.
            std::lock_guard<std::mutex> lock(mutex_);
            done_.notify_all();
        }
    }
}

Executor::Executor(const Topology& topo, int threads, bool pin, int spin_us) {
    int total = topo.physical_cores();
    if (threads <= 0 || threads > total) threads = total;
    // Threads per node in proportion to its cores, at least one per node that has any, so
    // that experts placed on a node always have a thread there.
    const int n_nodes = int(topo.nodes.size());
    std::vector<int> share(n_nodes, 0);
    int given = 0;
    for (int i = 0; i < n_nodes; ++i) {
        share[i] = std::max(1, int(int64_t(threads) * int64_t(topo.nodes[i].cpus.size()) / std::max(1, total)));
        share[i] = std::min<int>(share[i], int(topo.nodes[i].cpus.size()));
        given += share[i];
    }
    for (int i = 0; given < threads && i < n_nodes; ++i) {
        const int extra = std::min<int>(threads - given, int(topo.nodes[i].cpus.size()) - share[i]);
        share[i] += extra;
        given += extra;
    }
    for (int i = 0; i < n_nodes; ++i) {
        std::vector<int> cpus(topo.nodes[i].cpus.begin(), topo.nodes[i].cpus.begin() + share[i]);
        pools_.push_back(std::make_unique<NodePool>(i, std::move(cpus), i == 0 ? 1 : 0, pin, spin_us, &awake_until_));
        node_ids_.push_back(topo.nodes[i].id);
    }
    if (pools_.empty()) {  // no topology at all: the caller alone
        pools_.push_back(std::make_unique<NodePool>(0, std::vector<int>{0}, 1, false, spin_us, &awake_until_));
        node_ids_.push_back(0);
    }
}

int Executor::threads() const {
    int n = 0;
    for (const auto& p : pools_) n += p->threads();
    return n;
}

void NodePool::rouse() {
    std::lock_guard<std::mutex> lock(mutex_);  // orders the notify after a sleeper's predicate check
    if (sleepers_ > 0) wake_.notify_all();
}

// A worker that went to sleep before the call (its spin after the last phase ran out first:
// the caller's Python took longer than the spin) is woken to spin too.
void Executor::stay_awake(int us) {
    awake_until_.store(now_ns() + int64_t(us) * 1000, std::memory_order_relaxed);
    for (auto& p : pools_) p->rouse();
}

void Executor::run(PhaseFn fn, void* ctx) {
    // Callers on different Python threads (the MoE layers, the dense projections) take turns:
    // a pool runs one phase at a time.
    std::lock_guard<std::mutex> lock(run_mutex_);
    for (auto& p : pools_) p->start(fn, ctx);
    fn(ctx, 0, 0);  // the caller is worker 0 of node 0
    for (auto& p : pools_) p->wait();
}

}  // namespace hmoe
