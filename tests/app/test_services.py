"""The services the terminal UI calls besides the backend verbs: turns for model work, the
per-model usage file (expert counts added up across sessions), what the benchmark runs."""

from __future__ import annotations

import threading
import time

import pytest

from hybridmoe.app.services import Services
from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.plan import ExpertStats
from hybridmoe.backend.session import Cancelled, CancelToken


@pytest.fixture(autouse=True)
def data_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("HYBRIDMOE_CONFIG", raising=False)


def counts(n_experts: int = 4, tokens: int = 3, **layers) -> ExpertStats:
    return ExpertStats(model="m", n_experts=n_experts, tokens=tokens,
                       layers={int(k.removeprefix("l")): v for k, v in layers.items()})


# ---- turns for model work ----------------------------------------------------------------------


def test_model_work_takes_turns():
    services = Services()
    held, release = threading.Event(), threading.Event()

    def answer():
        with services.model_turn("an answer") as busy:
            assert busy == ""
            held.set()
            release.wait(10)

    worker = threading.Thread(target=answer)
    worker.start()
    assert held.wait(10)
    with services.model_turn("a probe", wait=False) as busy:
        assert busy == "an answer"  # not held: told what holds it

    heard, got = [], []

    def waiting_probe():
        with services.model_turn("a probe", on_wait=heard.append) as busy:
            got.append((busy, release.is_set()))

    prober = threading.Thread(target=waiting_probe)
    prober.start()
    time.sleep(0.2)
    assert got == [] and heard == ["an answer"]
    release.set()
    worker.join(10)
    prober.join(10)
    assert got == [("", True)]  # its turn came after the answer let go


def test_waiting_for_a_turn_can_be_cancelled():
    services = Services()
    cancel = CancelToken()
    with services.model_turn("an answer"):
        threading.Timer(0.1, cancel.cancel).start()
        with pytest.raises(Cancelled):
            with services.model_turn("loading the model", cancel=cancel):
                pass
    with services.model_turn("loading the model", wait=False) as busy:
        assert busy == ""  # the cancelled waiter did not keep the turn


# ---- the usage file -------------------------------------------------------------------------------


def test_counts_add_up_and_snapshots_subtract():
    a = counts(l3=[1, 0, 2, 0], l4=[0, 0, 0, 5])
    b = counts(tokens=10, l3=[1, 1, 1, 1], l5=[2, 0, 0, 0])
    total = a.merged(b)
    assert total.tokens == 13
    assert total.layers == {3: [2, 1, 3, 1], 4: [0, 0, 0, 5], 5: [2, 0, 0, 0]}
    assert total.since(a).layers == {3: [1, 1, 1, 1], 4: [0, 0, 0, 0], 5: [2, 0, 0, 0]}
    assert total.since(a).tokens == 10 and total.since(None) == total
    assert a.layers == {3: [1, 0, 2, 0], 4: [0, 0, 0, 5]}  # merging made a new one
    with pytest.raises(ModelError):
        a.merged(counts(n_experts=8, l3=[0] * 8))
    with pytest.raises(ValueError):
        a.since(total)  # not an earlier snapshot


def test_the_usage_file_adds_up_across_sessions(tmp_path):
    services = Services()
    model = tmp_path / "model"
    path = services.expert_stats_path(model)
    assert path.parent == services.data_dir() / "expert-stats"
    assert services.expert_stats_path(tmp_path / "other") != path
    services.add_expert_counts(model, counts(l3=[1, 0, 0, 0]))
    services.add_expert_counts(model, counts(tokens=5, l3=[0, 2, 0, 0], l4=[1, 1, 1, 1]))
    kept = ExpertStats.load(path)
    assert kept.tokens == 8 and kept.layers == {3: [1, 2, 0, 0], 4: [1, 1, 1, 1]}


def test_a_damaged_or_foreign_usage_file_is_set_aside(tmp_path):
    services = Services()
    model = tmp_path / "model"
    path = services.expert_stats_path(model)
    path.parent.mkdir(parents=True)
    path.write_text("{ not json")
    services.add_expert_counts(model, counts(l3=[1, 0, 0, 0]))
    assert ExpertStats.load(path).layers == {3: [1, 0, 0, 0]}
    assert path.with_suffix(".json.damaged").read_text() == "{ not json"
    # The files at the path were replaced by another model with more experts per layer.
    services.add_expert_counts(model, counts(n_experts=8, l3=[1] * 8))
    assert ExpertStats.load(path).n_experts == 8


def test_a_backend_that_does_not_count_experts_has_no_counts():
    class LlamaCppLike:  # states that it does not count (the Session protocol's counts_experts)
        counts_experts = False

        def generate(self, *args):
            return iter(())

    assert Services().expert_counts(LlamaCppLike()) is None


# ---- the benchmark ----------------------------------------------------------------------------------


def test_llama_cpp_is_benchmarked_on_gguf_files_only(tmp_path, monkeypatch):
    import importlib.util

    services = Services()
    assert services.bench_backends(tmp_path / "checkpoint") == ("engine",)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "llama_cpp" else None)
    assert services.bench_backends(tmp_path / "model.gguf") == ("engine", "llamacpp")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert services.bench_backends(tmp_path / "model.gguf") == ("engine",)
