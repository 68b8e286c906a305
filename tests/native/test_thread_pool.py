"""The native kernels' threads: which cores they take, NUMA grouping, the GIL, determinism."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from hybridmoe.backend.bench.synthetic_experts import make_host_experts, random_routing
from hybridmoe.backend.engine import native_experts, native_kernels

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")
_native = native_kernels._native


def fake_sysfs(root, cpus: dict[int, tuple[int, int]], nodes: dict[int, str]) -> str:
    """cpus: logical cpu -> (package, core id); nodes: node -> cpulist text."""
    for cpu, (pkg, core) in cpus.items():
        d = root / "devices/system/cpu" / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{pkg}\n")
        (d / "core_id").write_text(f"{core}\n")
    node_dir = root / "devices/system/node"
    node_dir.mkdir(parents=True)
    (node_dir / "online").write_text(",".join(str(n) for n in nodes) + "\n")
    for n, cpulist in nodes.items():
        (node_dir / f"node{n}").mkdir()
        (node_dir / f"node{n}" / "cpulist").write_text(cpulist + "\n")
    return str(root)


def test_one_thread_per_physical_core_grouped_by_node(tmp_path):
    # Two sockets = two nodes, two cores each, SMT siblings cpu i and i + 4.
    cpus = {i: (i % 4 // 2, i % 2) for i in range(8)}
    root = fake_sysfs(tmp_path, cpus, {0: "0-1,4-5", 1: "2-3,6-7"})
    assert _native.topology(root, list(range(8))) == [(0, [0, 1]), (1, [2, 3])]
    # The affinity mask decides which sibling represents a core, and drops cores.
    assert _native.topology(root, [5, 2, 3, 6]) == [(0, [5]), (1, [2, 3])]


def test_without_numa_information_all_cores_are_one_node(tmp_path):
    cpus = {i: (0, i) for i in range(3)}
    for cpu, (pkg, core) in cpus.items():
        d = tmp_path / "devices/system/cpu" / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{pkg}\n")
        (d / "core_id").write_text(f"{core}\n")
    assert _native.topology(str(tmp_path), [0, 1, 2]) == [(0, [0, 1, 2])]


def _layer(seed=8, E=9, H=256, I=256, fmt="q4_k"):
    rng = np.random.default_rng(seed)
    experts = make_host_experts(rng, fmt, E, H, I, range(E))
    ids, w = random_routing(rng, 40, E, 4)
    return native_experts.native_for(experts), torch.randn(40, H), ids, w


@pytest.fixture
def restore_pool():
    yield
    _native.simulate_nodes(0)
    _native.set_num_threads(0)


def test_result_does_not_depend_on_the_thread_count(restore_pool):
    """Every output element is summed by one thread in a fixed order (units never share an
    output element): bit-identical results whatever the number of threads."""
    native, x, ids, w = _layer()
    for regime in ("decode", "prefill"):
        outs = []
        for threads in (1, 2):
            _native.set_num_threads(threads)
            outs.append(native.forward(x, ids, w, regime=regime))
        assert torch.equal(outs[0], outs[1]), regime


@pytest.mark.parametrize("fmts", [("q4_0", "q4_0"), ("q4_k", "q6_k"), ("bf16", "bf16")])
def test_whole_experts_give_the_bits_of_the_phases(restore_pool, fmts):
    """A decode step with two or more experts per thread computes each expert whole in one
    unit; with fewer it splits their rows into two phases. The sums are the same either way:
    one token, three experts, is the first on one thread and the second on two."""
    if _native.physical_cores() < 2:
        pytest.skip("needs two cores")
    rng = np.random.default_rng(12)
    fmt, down = fmts
    E, H, I = 6, 512, 256
    experts = make_host_experts(rng, fmt, E, H, I, range(E), down_fmt=down, layout="per_expert")
    native = native_experts.native_for(experts)
    for T, k in ((1, 3), (2, 2), (3, 1)):
        x = torch.randn(T, H)
        ids, w = random_routing(rng, T, E, k)
        outs = []
        for threads in (1, 2):
            _native.set_num_threads(threads)
            outs.append(native.forward(x, ids, w, regime="decode"))
        assert torch.equal(outs[0], outs[1]), (fmts, T, k)


def test_multi_node_split_matches_one_node(restore_pool):
    """Experts spread over two (simulated) nodes, each with its own pool and partial output."""
    native, x, ids, w = _layer(seed=9, fmt="q8_0")
    for regime in ("decode", "prefill"):
        _native.simulate_nodes(0)
        one = native.forward(x, ids, w, regime=regime)
        _native.simulate_nodes(2)
        assert _native.isa_info()["numa_nodes"] == 2
        two = native.forward(x, ids, w, regime=regime)
        # Each node sums its own experts, then the partial outputs are added: the same
        # terms in another order, equal to rounding.
        assert torch.allclose(one, two, rtol=1e-5, atol=1e-5), regime


def test_the_call_releases_the_gil():
    """While one Python thread is in the kernels, another runs Python code. With a switch
    interval far longer than the test, a thread holding the GIL keeps it until it blocks or
    lets go: the main thread gets to run while the worker is inside the call only if the
    call releases it."""
    native, _, _, _ = _layer(seed=10, E=16, H=1024, I=1024, fmt="q8_0")
    x = torch.randn(64, 1024)
    ids, w = random_routing(np.random.default_rng(0), 64, 16, 8)
    ids, w = ids.to(torch.int64).contiguous(), w.to(torch.float32).contiguous()
    out = torch.empty(64, 1024)
    state = {"inside": False, "seen_inside": False}

    def work():
        for _ in range(50):  # bounded: with the GIL held, the main thread never sees "inside"
            state["inside"] = True
            native.layer.forward(x, ids, w, out, native_experts.REGIMES["auto"], 0)  # no torch op between the flags
            state["inside"] = False
            if state["seen_inside"]:
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        th = threading.Thread(target=work)
        th.start()
        while th.is_alive() and not state["seen_inside"]:
            state["seen_inside"] = state["inside"]
            time.sleep(0.0005)  # lets the worker take the GIL back when it leaves the call
        th.join()
    finally:
        sys.setswitchinterval(interval)
    assert state["seen_inside"]


def _thread_state(tid: int) -> str:
    """The scheduler's state of one of this process's threads: R running or runnable (a
    spinning worker, also while preempted), S sleeping (a worker waiting on its futex)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _becomes(tid: int, want: str, timeout: float = 60.0) -> bool:
    """Whether the thread reaches `want`; the timeout only bounds a failing test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _thread_state(tid) == want:
            return True
        time.sleep(0.001)
    return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread states from /proc")
def test_the_pool_stays_awake_when_asked(restore_pool):
    """After a phase the workers spin for 50 us, then sleep; stay_awake keeps them spinning for
    as long as asked (a decode loop's Python between two steps), and no longer; asked after
    they went to sleep (the caller's Python took longer than their spin), it wakes them to spin.
    Checked on the worker's scheduler state, not on CPU time (a loaded machine runs it late)."""
    if _native.physical_cores() < 2:
        pytest.skip("needs a worker thread")
    native, x, ids, w = _layer(seed=13)
    _native.set_num_threads(1)
    native.forward(x, ids, w)  # the caller alone: no worker
    before = set(os.listdir("/proc/self/task"))
    _native.set_num_threads(2)
    native.forward(x, ids, w)  # a new pool: one worker thread
    (worker,) = [int(t) for t in set(os.listdir("/proc/self/task")) - before]

    assert _becomes(worker, "S"), "the worker did not go to sleep after its spin"
    _native.stay_awake(600_000_000)  # asleep when asked: roused to spin
    assert _becomes(worker, "R"), "stay_awake did not wake a sleeping worker"
    assert all(_thread_state(worker) == "R" for _ in range(200)), "the worker slept while asked to spin"
    _native.stay_awake(0)  # the time asked for is over: back to sleep
    assert _becomes(worker, "S"), "the worker kept spinning after the time asked for"

    native.forward(x, ids, w)
    _native.stay_awake(600_000_000)  # right after a phase, still spinning: keeps spinning
    assert _becomes(worker, "R") and all(_thread_state(worker) == "R" for _ in range(200))
    _native.stay_awake(50_000)  # a window that ends by itself
    assert _becomes(worker, "S"), "the worker kept spinning past the time asked for"


_HANDOFF_SCRIPT = """
import time, numpy as np, torch
from hybridmoe.backend.bench.synthetic_experts import make_host_experts, random_routing
from hybridmoe.backend.engine import native_experts
rng = np.random.default_rng(14)
native = native_experts.native_for(make_host_experts(rng, "q8_0", 4, 256, 256, range(4)))
x = torch.randn(1, 256)
ids, w = random_routing(rng, 1, 4, 2)
want = native.forward(x, ids, w, regime="decode")
for i in range(4000):
    assert torch.equal(native.forward(x, ids, w, regime="decode"), want), i
    if i % 7 == 0:
        time.sleep(20e-6)  # now and then long enough for a worker to start falling asleep
print("ok")
"""


@pytest.mark.parametrize("spin_us", [0, 3])
def test_phase_handoff_never_loses_a_wakeup(spin_us):
    """Thousands of short phases while the workers fall asleep and wake between them (no spin
    at all, or a spin of a few microseconds, as long as a phase): a lost wake-up on either
    side (worker or caller) would hang here, a worker running a stale phase would change the sums."""
    if _native.physical_cores() < 2:
        pytest.skip("needs a worker thread")
    env = {**os.environ, "HYBRIDMOE_SPIN_US": str(spin_us), "HYBRIDMOE_CPU_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _HANDOFF_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
