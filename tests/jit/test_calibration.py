"""Note [Calibration]: measured choices, default kept on ties, cached per key."""

import time

import torch

from dynvm.jit.calibration import Calibrator, calibrator_for, size_class


def test_a_clearly_faster_candidate_wins_and_is_cached():
    calls = {"slow": 0, "fast": 0}

    def slow():
        calls["slow"] += 1
        time.sleep(0.002)

    def fast():
        calls["fast"] += 1

    calibrator = Calibrator("cpu", rounds=5)
    choice = calibrator.choose("OP", 3, {"slow": slow, "fast": fast})
    assert choice.name == "fast" and choice.default == "slow"
    assert choice.seconds["slow"] > choice.seconds["fast"]
    assert 0.5 < choice.gain <= 1.0
    before = dict(calls)
    again = calibrator.choose("OP", 3, {"slow": slow, "fast": fast})
    assert again is choice and calls == before        # cached: nothing re-measured
    assert calibrator.measurements == 1
    assert calibrator.known("OP", 3) is choice and calibrator.known("OP", 4) is None


def test_the_default_stays_unless_another_beats_it_by_the_margin():
    def work():
        time.sleep(0.001)

    # Two identical candidates: the default (first) must win whatever the noise (all
    # five rounds: three samples each can look decisive on a loaded host by chance).
    calibrator = Calibrator("cpu", rounds=5, margin=0.5, min_rounds=5)
    assert calibrator.choose("OP", 0, {"a": work, "b": work}).name == "a"


def test_size_classes_and_one_calibrator_per_device():
    assert [size_class(n) for n in (0, 1, 2, 3, 4, 1023, 1024)] == [0, 0, 1, 1, 2, 9, 10]
    assert calibrator_for("cpu") is calibrator_for(torch.device("cpu"))


def test_candidates_are_built_only_when_measured():
    built = []

    def candidates():
        built.append(1)
        return {"a": lambda: None, "b": lambda: None}

    calibrator = Calibrator("cpu", rounds=3)
    first = calibrator.choose("OP", 1, candidates)
    assert calibrator.choose("OP", 1, candidates) is first
    assert len(built) == 1 and calibrator.measurements == 1


def _sleepers(**seconds: float) -> tuple[dict, dict]:
    """Candidates that sleep the given seconds, and the count of each one's runs."""
    runs = dict.fromkeys(seconds, 0)

    def candidate(name):
        def run():
            runs[name] += 1
            time.sleep(seconds[name])
        return run
    return {name: candidate(name) for name in seconds}, runs


def test_a_decisive_difference_stops_after_min_rounds():
    calibrator = Calibrator("cpu", rounds=9, min_rounds=3, budget_s=10.0)
    candidates, runs = _sleepers(slow=0.003, fast=0.0)
    assert calibrator.choose("OP", 0, candidates).name == "fast"
    assert runs == {"slow": 1 + 3, "fast": 1 + 3}       # warm-up + min_rounds, not 9
    # a tie never stops early: more rounds run
    candidates, runs = _sleepers(a=0.001, b=0.001)
    calibrator.choose("TIE", 0, candidates)
    assert runs["a"] > 1 + 3 or runs["b"] > 1 + 3


def test_a_costly_question_stops_after_min_rounds_past_its_budget():
    candidates, runs = _sleepers(a=0.004, b=0.004)
    Calibrator("cpu", rounds=9, min_rounds=3, budget_s=0.001).choose("OP", 0, candidates)
    assert runs == {"a": 1 + 3, "b": 1 + 3}
