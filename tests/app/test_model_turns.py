"""The process's turn for model work, shared by the answers of a model that computes several
conversations together and exclusive for everything else (loading, a benchmark, a probe)."""

from __future__ import annotations

import threading

import pytest

from hybridmoe.app.services import Services
from hybridmoe.backend.session import Cancelled, CancelToken


def test_shared_turns_are_held_together_and_exclusive_ones_alone():
    services = Services()
    with services.model_turn("an answer", shared=True) as first:
        with services.model_turn("an answer", shared=True, wait=False) as second:
            assert first == second == ""  # both held
            with services.model_turn("a benchmark", wait=False) as busy:
                assert busy == "an answer"
        with services.model_turn("a benchmark", wait=False) as busy:
            assert busy == "an answer"  # one answer still holds it
    with services.model_turn("a benchmark") as held:
        assert held == ""
        with services.model_turn("an answer", shared=True, wait=False) as busy:
            assert busy == "a benchmark"
    with services.model_turn("an answer", shared=True, wait=False) as held:
        assert held == ""


def test_a_shared_turn_waiting_behind_a_benchmark_can_be_cancelled():
    services = Services()
    cancel = CancelToken()
    with services.model_turn("a benchmark"):
        threading.Timer(0.1, cancel.cancel).start()
        with pytest.raises(Cancelled, match="an answer was cancelled"):
            with services.model_turn("an answer", shared=True, cancel=cancel):
                pass
    with services.model_turn("a benchmark", wait=False) as busy:
        assert busy == ""  # the cancelled waiter holds nothing


def test_a_cancelled_exclusive_waiter_no_longer_holds_back_shared_turns():
    services = Services()
    cancel = CancelToken()
    with services.model_turn("an answer", shared=True):
        threading.Timer(0.1, cancel.cancel).start()
        with pytest.raises(Cancelled):
            with services.model_turn("a benchmark", cancel=cancel):
                pass
        with services.model_turn("an answer", shared=True, wait=False) as held:
            assert held == ""  # not held back by a benchmark that is no longer waiting
