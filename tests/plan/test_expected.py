"""The expected speed beside the bound (docs/sizing.md §6 "Expected speed"), llama.cpp's own
layout (§5), the advice that fits and the precision notes (#47)."""

from dataclasses import replace
from pathlib import Path

import pytest

from hybridmoe.backend.hardware import achieved, describe
from hybridmoe.backend.hardware.profile import CPU, HardwareProfile, Memory
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Workload, make
from hybridmoe.backend.plan.budget import activation_bytes
from hybridmoe.backend.plan.estimate import cpu_flops
from hybridmoe.backend.plan.expected import PROBE_OF_THEORETICAL, RATES

CONFIGS = Path(__file__).resolve().parents[2] / "assets" / "configs"
GIB = 1 << 30


@pytest.fixture(scope="module")
def qwen30():
    return inspect_model(CONFIGS / "Qwen__Qwen3-30B-A3B.json", expert_format="q4_k_m")


@pytest.fixture(scope="module")
def deepseek():
    return inspect_model(CONFIGS / "deepseek-ai__DeepSeek-R1.json", expert_format="q4_k_m")


# The flags of a CPU that runs the AVX-512 kernel set (the planner's compute rate follows the set:
# estimate.cpu_flops), and of one with AVX-512 that runs the AVX2 set.
ZEN4 = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
        "avx512vbmi", "avx512_bitalg", "gfni")
COOPER_LAKE = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16")


def xeon(sockets: int, **kw):
    return describe(host_ram="1000GiB", cpu_model="Intel Xeon Gold 6454S", sockets=sockets, cores=32 * sockets,
                    features=ZEN4, **kw)


def test_cpu_only_expected_is_the_bytes_at_the_stated_rate(qwen30):
    machine = xeon(1)
    plan = make(qwen30.spec, qwen30.inventory, machine, Workload(context=4096, strategy="cpu-only"))
    engine = RATES["engine"]
    rate = 8 * 4800e6 * 8 * PROBE_OF_THEORETICAL * engine.host_share
    assert plan.decode_tokens_per_s_expected == pytest.approx(rate / plan.host_bytes_per_token)
    assert plan.decode_tokens_per_s_upper_bound == pytest.approx(307.2e9 / plan.host_bytes_per_token)
    # It says how: the theoretical figure, the share a sustained read reaches, the engine's share.
    how = plan.decode_expected_how
    assert "307.2 GB/s" in how and f"{PROBE_OF_THEORETICAL:g}" in how and f"{engine.host_share:g}" in how
    assert plan.to_dict()["decode_tokens_per_s_expected"] == plan.decode_tokens_per_s_expected


def test_a_second_socket_counts_as_far_as_the_backend_reads_locally(deepseek):
    one, two = xeon(1), xeon(2)
    wl = Workload(context=4096, strategy="cpu-only")
    for backend in ("engine", "llamacpp"):
        a = make(deepseek.spec, deepseek.inventory, one, replace(wl, backend=backend))
        b = make(deepseek.spec, deepseek.inventory, two, replace(wl, backend=backend))
        local = 1 + RATES[backend].extra_socket_share
        assert b.decode_tokens_per_s_upper_bound == pytest.approx(2 * a.decode_tokens_per_s_upper_bound)
        assert b.decode_tokens_per_s_expected == pytest.approx(local * a.decode_tokens_per_s_expected)
        assert "of 2 sockets read locally" in b.decode_expected_how


def test_the_cpu_compute_limits_many_conversations(qwen30):
    """Two cores and 64 conversations: the CPU's multiply-adds, not the reads, set the step."""
    small = describe(host_ram="256GiB", cpu_model="Intel Xeon Gold 6454S", sockets=1, cores=2, features=["avx2"])
    plan = make(qwen30.spec, qwen30.inventory, small, Workload(context=1024, users=64, strategy="cpu-only"))
    # The weights a token multiplies: its 8 experts in each of the 48 MoE layers, and the
    # always-read ones (two flops a weight per prompt token, as the prefill counts them).
    weights = plan.prefill_cpu_flops_per_token / 2
    assert weights > 48 * 8 * qwen30.spec.params_per_expert
    flops = cpu_flops(2, ("avx2",))
    assert plan.decode_tokens_per_s_per_user_expected == pytest.approx(flops / (2 * 64 * weights))
    assert "compute" in plan.decode_expected_how_per_user


def test_the_cpu_compute_rate_is_the_kernel_sets_not_the_widest_isas():
    """A CPU with AVX-512 that lacks a flag of the AVX-512 kernel set runs the AVX2 set, whose
    kernels never use 512-bit registers: half the flops a cycle, as an AVX2 CPU; the portable
    set an eighth of AVX-512's."""
    assert cpu_flops(4, COOPER_LAKE) == cpu_flops(4, ("avx2", "fma", "f16c")) == cpu_flops(4, ZEN4) / 2
    assert cpu_flops(4, ("avx2", "avx512f")) == cpu_flops(4, ZEN4) / 8


def test_the_engines_rate_measured_here_is_kept_and_used(qwen30, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    here = HardwareProfile(cpu=CPU(model_name="Test CPU", physical_cores=4, sockets=1, features=("avx2", "fma", "f16c")),
                           memory=Memory(total_bytes=64 * GIB, available_bytes=64 * GIB,
                                         bandwidth_measured_bytes_per_s=40e9))
    wl = Workload(context=4096, strategy="cpu-only")
    before = make(qwen30.spec, qwen30.inventory, here, wl)
    assert before.decode_tokens_per_s_expected == pytest.approx(40e9 * RATES["engine"].host_share
                                                                / before.host_bytes_per_token)
    assert achieved.record(here, bytes_per_token=300e6, tokens_per_s=100.0, source="bench serve",
                           probe_bytes_per_s=40e9)
    # A model too small for its reads to time its tokens is not kept.
    assert achieved.record(here, bytes_per_token=20e6, tokens_per_s=20.0, source="a chat") is None
    after = make(qwen30.spec, qwen30.inventory, here, wl)
    # The engine's share of the probe (30 of 40 GB/s), against this process's probe reading.
    assert after.decode_tokens_per_s_expected == pytest.approx(0.75 * 40e9 / after.host_bytes_per_token)
    assert "× 0.75, the engine's share measured on this machine (bench serve" in after.decode_expected_how
    slower = make(qwen30.spec, qwen30.inventory, replace(here, memory=replace(here.memory,
                  bandwidth_measured_bytes_per_s=20e9)), wl)
    assert slower.decode_tokens_per_s_expected == pytest.approx(0.75 * 20e9 / slower.host_bytes_per_token)
    # The probe not run (headless `run`): the bound is unknown, the expected figure is not.
    unprobed = make(qwen30.spec, qwen30.inventory, replace(here, memory=replace(here.memory,
                    bandwidth_measured_bytes_per_s=None)), wl)
    assert unprobed.decode_tokens_per_s_upper_bound is None
    assert unprobed.decode_tokens_per_s_expected == pytest.approx(30e9 / unprobed.host_bytes_per_token)
    # Several runs: their medians, so that one run at a busy moment does not set the figure.
    for share in (0.5, 0.6):
        achieved.record(here, bytes_per_token=300e6, tokens_per_s=share * 40e9 / 300e6, source="a chat",
                        probe_bytes_per_s=40e9)
    rate, share, where = achieved.lookup(here)
    assert share == pytest.approx(0.6) and rate == pytest.approx(24e9) and where.startswith("the median of 3 runs")
    for _ in range(achieved.KEPT_RUNS):
        achieved.record(here, bytes_per_token=300e6, tokens_per_s=100.0, source="bench serve", probe_bytes_per_s=40e9)
    assert achieved.lookup(here)[1] == pytest.approx(0.75)  # the last KEPT_RUNS runs only
    # Another machine, or a described one, does not take it.
    assert achieved.lookup(replace(here, cpu=replace(here.cpu, physical_cores=8))) is None
    assert achieved.lookup(replace(here, described=True)) is None


def test_hybrid_expected_adds_the_gpu_and_the_hand_offs(qwen30):
    machine = describe(gpu_model="RTX 2080", host_ram="64GiB", cpu_model="Intel Core i9-10900X", sockets=1, cores=10,
                       features=ZEN4)
    plan = make(qwen30.spec, qwen30.inventory, machine, Workload(context=4096, backend="llamacpp"))
    rates = RATES["llamacpp"]
    cpu_layers = sum(1 for ids in plan.gpu_experts.values() if len(ids) < plan.n_routed_experts)
    host_rate = 4 * 2933e6 * 8 * PROBE_OF_THEORETICAL * rates.host_share
    gpu = plan.devices[0]
    step = (plan.host_bytes_per_token / host_rate + plan.gpu_bytes_per_token / gpu.bandwidth_bytes_per_s / rates.gpu_share
            + cpu_layers * rates.handoff_s)
    assert plan.decode_tokens_per_s_expected == pytest.approx(1 / step)
    assert "hand-offs" in plan.decode_expected_how and "GPU" in plan.decode_expected_how


# ---- llama.cpp's layout (docs/sizing.md §5) ----------------------------------------------------------


def test_a_llamacpp_plan_is_sized_as_llamacpp_holds_it(qwen30):
    machine = describe(gpu_model="RTX 2080", host_ram="64GiB", cpu_model="Intel Core i9-10900X", cores=10)
    plan = make(qwen30.spec, qwen30.inventory, machine, Workload(context=4096, backend="llamacpp"))
    card = plan.devices[0]
    # Whole layers of experts, as stored, the last layers first: blocks 0..N-1 stay on the CPU.
    n = plan.llama_cpp["n_cpu_moe"]
    assert all(len(ids) == (128 if layer >= n else 0) for layer, ids in plan.gpu_experts.items())
    assert plan.gpu_expert_format == "stored" and card.bytes_by_class["routed_experts"] == pytest.approx(
        sum(128 * plan.bytes_per_expert[layer] for layer in plan.gpu_experts if layer >= n), abs=1)
    # No prefill reserve; its compute buffer: a 2048-token micro-batch in float32 and one
    # expert tensor of a layer (gate, up or down of all experts) copied in for a large batch.
    assert card.bytes_by_class["prefill_reserve"] == 0
    assert card.bytes_by_class["activations"] == int(activation_bytes(qwen30.spec, 2048, 4)
                                                     + plan.bytes_per_expert[0] * 128 / 3)
    # Its budget: the card's memory less llama.cpp's 1 GiB margin, not the engine's rule.
    assert card.budget_bytes == 8192 * (1 << 20) - GIB
    # The next block's experts would not have fit.
    room = card.budget_bytes - sum(card.bytes_by_class[c] for c in ("always_read", "kv_cache", "activations"))
    assert card.bytes_by_class["routed_experts"] <= room < card.bytes_by_class["routed_experts"] + 128 * plan.bytes_per_expert[n - 1]


def test_a_given_n_cpu_moe_is_checked(qwen30):
    machine = describe(gpu_model="RTX 2080", host_ram="64GiB", cpu_model="Intel Core i9-10900X", cores=10)
    chosen = make(qwen30.spec, qwen30.inventory, machine, Workload(context=4096, backend="llamacpp"))
    n = chosen.llama_cpp["n_cpu_moe"]
    ran = make(qwen30.spec, qwen30.inventory, machine, Workload(context=4096, backend="llamacpp", n_cpu_moe=n + 4))
    assert ran.fits and ran.llama_cpp["n_cpu_moe"] == n + 4
    too_few = make(qwen30.spec, qwen30.inventory, machine, Workload(context=4096, backend="llamacpp", n_cpu_moe=n - 4))
    assert not too_few.fits and "(--n-cpu-moe " in too_few.reason
    # The smallest N that fits as given: llama.cpp then keeps free only the runtime's reserve,
    # not --fit's 1 GiB, so it may be below the N the plan chooses itself.
    advice = next(s for s in too_few.suggestions if "--n-cpu-moe " in s and " fits" in s)
    smallest = int(advice.split("--n-cpu-moe ")[1].split()[0])
    assert n - 4 < smallest <= n
    given = lambda m: make(qwen30.spec, qwen30.inventory, machine,  # noqa: E731
                           Workload(context=4096, backend="llamacpp", n_cpu_moe=m))
    assert given(smallest).fits and not given(smallest - 1).fits
    card = given(smallest).devices[0]
    assert card.budget_bytes == 8192 * (1 << 20) - GIB // 2


def test_amd_cards_are_described_and_driven_by_llamacpp_alone(qwen30):
    """An RX 6900 XT: a preset of its own (ROCm's memory figure), a card llama.cpp's ROCm or
    Vulkan build uses and the embedded engine (CUDA's) does not, which the engine's plan says."""
    machine = describe(gpu_model="RX 6900 XT", host_ram="64GiB", cpu_model="AMD Ryzen 9 7900", cores=12)
    card = machine.gpus[0]
    assert (card.vendor, card.total_bytes, card.memory_bandwidth_bytes_per_s) == ("amd", 16368 * (1 << 20), 512e9)
    llama = make(qwen30.spec, qwen30.inventory, machine, Workload(context=4096, backend="llamacpp"))
    assert llama.main_device == "cuda" and llama.devices[0].name == "gpu:0 AMD Radeon RX 6900 XT"
    assert llama.gpu_routed_expert_bytes > 0
    engine = make(qwen30.spec, qwen30.inventory, machine, Workload(context=4096, backend="engine"))
    assert engine.main_device == "cpu"
    assert any("llama.cpp's ROCm or Vulkan build uses it (--backend llamacpp)" in w for w in engine.warnings)
    other = describe(gpu_model="AMD Radeon PRO W9999", gpu_memory="32GiB", host_ram="64GiB")
    assert other.gpus[0].vendor == "amd" and not other.gpus[0].served


def test_n_cpu_moe_is_llamacpps_alone():
    with pytest.raises(Exception, match="--n-cpu-moe sizes llama.cpp's layout"):
        Workload(n_cpu_moe=3)


# ---- advice that fits, precision said aloud --------------------------------------------------------


def test_cpu_only_advice_never_suggests_what_is_in_force(qwen30):
    """A CPU-only machine short of RAM: the context that fits, never --strategy cpu-only."""
    box = describe(host_ram="24GiB", cpu_model="AMD Ryzen 9 7950X", cores=16)
    plan = make(qwen30.spec, qwen30.inventory, box, Workload(context=32768, users=8))
    assert not plan.fits
    text = " ".join(plan.suggestions)
    assert "--strategy cpu-only" not in text
    assert "--context" in text or "--users" in text
    # The context it names fits.
    context = next(int(s.split("--context ")[1].rstrip(").")) for s in plan.suggestions if "--context " in s)
    assert make(qwen30.spec, qwen30.inventory, box, Workload(context=context, users=8)).fits
    # The weights alone too large: said so, with no cache option that cannot help.
    tiny = describe(host_ram="16GiB", cpu_model="AMD Ryzen 9 7950X", cores=16)
    plan = make(qwen30.spec, qwen30.inventory, tiny, Workload(context=4096))
    assert any("weights alone" in s for s in plan.suggestions)
    assert not any("--context" in s or "cpu-only" in s for s in plan.suggestions)


def test_bf16_experts_narrowed_to_int8_are_said_aloud():
    bf16 = inspect_model(CONFIGS / "Qwen__Qwen3-30B-A3B.json")
    plan = make(bf16.spec, bf16.inventory, describe(gpu_model="RTX 4090", host_ram="128GiB"), Workload(context=4096))
    assert plan.gpu_expert_format == "int8"
    assert any("stored in bf16 and held as weight-only int8" in n for n in plan.precision_notes)
    dense = make(bf16.spec, bf16.inventory, describe(gpu_model="RTX 4090", host_ram="128GiB"),
                 Workload(context=4096, gpu_expert_form="dense"))
    assert dense.precision_notes == ()


def test_a_smaller_quantization_is_offered_with_the_context_that_fits_with_it(qwen30):
    q8 = inspect_model(CONFIGS / "Qwen__Qwen3-30B-A3B.json", expert_format="q8_0")
    box = describe(host_ram="24GiB", cpu_model="AMD Ryzen 9 7950X", cores=16)
    plan = make(q8.spec, q8.inventory, box, Workload(context=32768))
    advice = next(s for s in plan.suggestions if "Q4_K_M" in s)
    context = int(advice.split("--context ")[1].rstrip(")."))
    assert "would fit with a context of at most" in advice
    assert make(qwen30.spec, qwen30.inventory, box, Workload(context=context)).fits


def test_a_card_of_unknown_bandwidth_is_left_out_and_said_so(qwen30):
    # 16 GB: some experts stay on the CPU (a 24 GB card holds all of them as stored).
    box = describe(gpu_count=1, gpu_memory="16376MiB", host_ram="64GiB", cpu_model="AMD Ryzen 9 7950X", cores=16)
    plan = make(qwen30.spec, qwen30.inventory, box, Workload(context=4096))
    assert plan.decode_tokens_per_s_expected and "GPU not counted (its memory bandwidth is not known)" in (
        plan.decode_expected_how)


# ---- the engine's prompt rate and the i-quants' unpacking, measured here or stated (#47) ----------


# The flags of a Zen 4 CPU that the native kernel sets look at (all the AVX-512 set's), and a
# Cooper Lake's: AVX-512 with VNNI and BF16 but no VBMI, BITALG, GFNI, which takes the AVX2 set.


def _this_machine(cores=4, features=ZEN4, probe=40e9):
    return HardwareProfile(cpu=CPU(model_name="Test CPU", physical_cores=cores, sockets=1, features=features),
                           memory=Memory(total_bytes=64 * GIB, available_bytes=64 * GIB,
                                         bandwidth_measured_bytes_per_s=probe))


def test_expected_prefill_is_the_prompt_rate_measured_here_else_the_stated_model(qwen30, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    here = _this_machine()
    wl = Workload(context=4096, strategy="cpu-only")
    before = make(qwen30.spec, qwen30.inventory, here, wl)
    chunk = min(wl.prefill_chunk, wl.context)
    # Nothing measured: the CPU's multiply-adds at the stated model's rate, and it says so.
    flops = cpu_flops(4, here.cpu.features)
    assert before.prefill_tokens_per_s_expected == pytest.approx(flops / before.prefill_cpu_flops_per_token)
    assert "nothing measured on this machine yet" in before.prefill_expected_how
    assert before.prefill_cpu_flops_per_token * chunk / 1e12 == pytest.approx(
        float(before.prefill_expected_how.split(" TFLOP on")[0].split(": ")[-1]), rel=0.01)
    # A prompt rate measured on another format of this machine stands in, and says which it was.
    achieved.record_rate(here, "prefill_flops_per_s", expert_format="q4_0", value=0.6e12, source="bench generate")
    other = make(qwen30.spec, qwen30.inventory, here, wl)
    assert other.prefill_tokens_per_s_expected == pytest.approx(0.6e12 / other.prefill_cpu_flops_per_token)
    assert "measured on q4_0, not q4_k_m" in other.prefill_expected_how
    # This format's runs come first, their median.
    for value in (0.3e12, 0.5e12, 0.4e12):
        achieved.record_rate(here, "prefill_flops_per_s", expert_format="q4_k_m", value=value, source="a chat")
    after = make(qwen30.spec, qwen30.inventory, here, wl)
    assert after.prefill_tokens_per_s_expected == pytest.approx(0.4e12 / after.prefill_cpu_flops_per_token)
    assert "the engine's prompt rate measured on this machine (the median of 3 runs" in after.prefill_expected_how
    assert "not q4_k_m" not in after.prefill_expected_how
    # llama.cpp's plan does not take the engine's rate; a described machine never has one.
    llama = make(qwen30.spec, qwen30.inventory, here, replace(wl, backend="llamacpp"))
    assert llama.prefill_tokens_per_s_expected == pytest.approx(flops / llama.prefill_cpu_flops_per_token)
    assert achieved.lookup_rate(replace(here, described=True), "prefill_flops_per_s", "q4_k_m") is None
    # The decode read rate kept beside it is untouched by the compute rates, and theirs by it.
    achieved.record(here, bytes_per_token=300e6, tokens_per_s=100.0, source="bench serve", probe_bytes_per_s=40e9)
    assert achieved.lookup(here)[1] == pytest.approx(0.75)
    assert achieved.lookup_rate(here, "prefill_flops_per_s", "q4_k_m")[0] == pytest.approx(0.4e12)


def test_a_chat_keeps_its_prompt_rate_and_not_a_short_prompts(qwen30, tmp_path, monkeypatch):
    from hybridmoe.backend.plan.expected import MIN_PROMPT_TOKENS_TO_RECORD, remember_rates
    from hybridmoe.backend.session import Stats

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    here = _this_machine()
    monkeypatch.setattr("hybridmoe.backend.hardware.detect", lambda **_: here)
    plan = make(qwen30.spec, qwen30.inventory, here, Workload(context=4096, strategy="cpu-only"))
    short = Stats(prompt_tokens=MIN_PROMPT_TOKENS_TO_RECORD - 1, generated_tokens=4, time_to_first_token_s=0.1,
                  prefill_tokens_per_s=50.0, decode_tokens_per_s=10.0, backend="engine")
    remember_rates(plan, short)
    assert achieved.lookup_rate(here, "prefill_flops_per_s", plan.expert_format) is None
    long = replace(short, prompt_tokens=MIN_PROMPT_TOKENS_TO_RECORD)
    remember_rates(plan, long)
    rate, where, _ = achieved.lookup_rate(here, "prefill_flops_per_s", plan.expert_format)
    assert rate == pytest.approx(plan.prefill_cpu_flops_per_token * 50.0) and "prompt at 50.0 tokens/s" in where
    # The next plan expects exactly that prompt rate back.
    again = make(qwen30.spec, qwen30.inventory, here, Workload(context=4096, strategy="cpu-only"))
    assert again.prefill_tokens_per_s_expected == pytest.approx(50.0)


def test_an_i_quants_decode_is_set_by_its_unpacking_on_few_cores(tmp_path, monkeypatch):
    from hybridmoe.backend.plan.expected import EXPERT_UNPACK_RATES_PER_CORE

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    iq2 = inspect_model(CONFIGS / "Qwen__Qwen3-30B-A3B.json", expert_format="iq2_xxs")
    here = _this_machine(cores=2, features=ZEN4)
    wl = Workload(context=4096, strategy="cpu-only")
    plan = make(iq2.spec, iq2.inventory, here, wl)
    rate = 40e9 * RATES["engine"].host_share
    weights = 2 * 48 * 8 * iq2.spec.params_per_expert  # 48 MoE layers × 8 experts a token, 2 cores below
    expert_bytes = weights / 2 * iq2.inventory.expert_bits_per_weight / 8

    def unpack_bound(per_core):  # tokens/s when 2 cores unpacking at per_core set the experts' time
        return 1 / ((plan.host_bytes_per_token - expert_bytes) / rate + (weights / 2) / (2 * per_core))

    # The AVX-512 kernels' documented rate (a CPU with every flag they need).
    per_core = EXPERT_UNPACK_RATES_PER_CORE["avx512"]["iq2_xxs"]
    assert (weights / 2) / (2 * per_core) > expert_bytes / rate  # unpacking, not reading, sets the experts' time
    assert plan.decode_tokens_per_s_expected == pytest.approx(unpack_bound(per_core))
    assert (f"set by their unpacking, iq2_xxs unpacked at {per_core / 1e9:.1f} G weights/s a core, the documented "
            "rate for iq2_xxs with the AVX-512 kernels × 2 cores") in plan.decode_expected_how
    assert plan.decode_expected_source == ("the read probe × the engine's usual share, 0.65; "
                                           "iq2_xxs unpacking at its documented rate with the AVX-512 kernels")
    # An AVX2 CPU: the AVX2 kernels' own documented rate, not a scaling of the AVX-512 one.
    avx2_rate = EXPERT_UNPACK_RATES_PER_CORE["avx2"]["iq2_xxs"]
    avx2 = make(iq2.spec, iq2.inventory, _this_machine(cores=2, features=("avx2", "fma", "f16c")), wl)
    assert avx2.decode_tokens_per_s_expected == pytest.approx(unpack_bound(avx2_rate))
    assert (f"{avx2_rate / 1e9:.1f} G weights/s a core, the documented rate for iq2_xxs with the AVX2 kernels × 2 "
            "cores") in avx2.decode_expected_how
    assert avx2.decode_expected_source.endswith("iq2_xxs unpacking at its documented rate with the AVX2 kernels")
    # AVX-512 without the flags the AVX-512 kernels need (Cooper Lake) runs the AVX2 kernels, and says why.
    cooper = make(iq2.spec, iq2.inventory, _this_machine(cores=2, features=COOPER_LAKE), wl)
    assert cooper.decode_tokens_per_s_expected == pytest.approx(avx2.decode_tokens_per_s_expected)
    assert ("the documented rate for iq2_xxs with the AVX2 kernels (this CPU has AVX-512 but not avx512vbmi, "
            "avx512_bitalg, gfni, which the AVX-512 kernels need)") in cooper.decode_expected_how
    # The portable kernels: the AVX2 rate × their FMA width over AVX2's (stated, not measured).
    # Their compute, at the portable set's FMA width too, then sets the step (and the text still
    # says how the experts unpack).
    no_fma = ("avx2", "avx512f")
    portable = make(iq2.spec, iq2.inventory, _this_machine(cores=2, features=no_fma), wl)
    compute = portable.prefill_cpu_flops_per_token / cpu_flops(2, no_fma)
    assert compute > 1 / unpack_bound(avx2_rate / 4)
    assert portable.decode_tokens_per_s_expected == pytest.approx(1 / compute)
    assert (f"{avx2_rate / 4e9:.1f} G weights/s a core, the documented rate for iq2_xxs with the AVX2 kernels × 0.25 "
            "for the portable kernels (8 of 32 flops a cycle, assumed; this CPU has AVX2 but not fma, f16c, which the "
            "AVX2 kernels need)") in portable.decode_expected_how
    assert portable.decode_expected_source.endswith("with the portable kernels")
    # Measured here (bench generate of that format): the median of its runs.
    achieved.record_rate(here, "expert_weights_per_s_per_core", expert_format="iq2_xxs", value=10e9,
                         source="bench generate")
    measured = make(iq2.spec, iq2.inventory, here, wl)
    assert measured.decode_tokens_per_s_expected == pytest.approx(
        1 / ((plan.host_bytes_per_token - expert_bytes) / rate + (weights / 2) / (2 * 10e9)))
    assert "10.0 G weights/s a core, measured on this machine (bench generate" in measured.decode_expected_how
    assert measured.decode_expected_source.endswith("iq2_xxs unpacking measured on this machine")
    # Many cores: the reads set it again, as for any format.
    wide = make(iq2.spec, iq2.inventory, _this_machine(cores=64, features=ZEN4), wl)
    assert wide.decode_tokens_per_s_expected == pytest.approx(rate / wide.host_bytes_per_token)
    # Q4_0-class formats are never limited by their unpacking.
    q4 = inspect_model(CONFIGS / "Qwen__Qwen3-30B-A3B.json", expert_format="q4_0")
    plain = make(q4.spec, q4.inventory, here, wl)
    assert plain.decode_tokens_per_s_expected == pytest.approx(rate / plain.host_bytes_per_token)


def test_an_unpack_limited_formats_run_is_not_kept_as_the_read_rate(tmp_path, monkeypatch):
    from hybridmoe.backend.plan.expected import remember_rates
    from hybridmoe.backend.session import Stats

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    here = _this_machine()
    monkeypatch.setattr("hybridmoe.backend.hardware.detect", lambda **_: here)
    stats = Stats(prompt_tokens=8, generated_tokens=64, time_to_first_token_s=0.1, prefill_tokens_per_s=50.0,
                  decode_tokens_per_s=10.0, backend="engine")
    for fmt, kept in (("iq2_xxs", False), ("q4_0", True)):
        model = inspect_model(CONFIGS / "Qwen__Qwen3-30B-A3B.json", expert_format=fmt)
        remember_rates(make(model.spec, model.inventory, here, Workload(context=4096, strategy="cpu-only")), stats)
        assert (achieved.lookup(here) is not None) == kept, fmt


def test_everything_on_a_card_of_unknown_bandwidth_gives_no_figure(qwen30):
    big = describe(gpu_count=1, gpu_memory="97887MiB", host_ram="64GiB", cpu_model="AMD Ryzen 9 7950X", cores=16)
    plan = make(qwen30.spec, qwen30.inventory, big, Workload(context=4096))
    assert not plan.host_bytes_per_token
    assert plan.decode_tokens_per_s_expected is None and plan.decode_expected_how.startswith("unknown")
