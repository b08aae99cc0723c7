"""A Calibrator that answers from a script instead of the clock, for tests of what a
backend does with an answer (tests/jit/test_row_gate.py, test_arena_choice.py)."""

from __future__ import annotations

from dynvm.jit.calibration import Calibrator, Choice


class ScriptedCalibrator(Calibrator):
    """Answers `choose(op, key, candidates)` with `script(op, key) -> {candidate:
    seconds}` (only the candidates offered are kept; one the script leaves out takes
    1 s), after building the candidates and
    running each once (the real forms on real operands, so they must at least run).
    The choice follows the real rule: the fastest, if it beats the default (the first
    candidate) by the margin. Records every question in `asked`."""

    def __init__(self, script) -> None:
        super().__init__("cpu")
        self.script = script
        self.asked: list[tuple[str, tuple]] = []

    def choose(self, op, size_class_key, candidates):
        self.asked.append((op, size_class_key))
        forms = candidates() if callable(candidates) else candidates
        for form in forms.values():
            form()
        scripted = self.script(op, size_class_key)
        seconds = {name: scripted.get(name, 1.0) for name in forms}
        default = next(iter(forms))
        best = min(seconds, key=seconds.__getitem__)
        if seconds[best] >= seconds[default] * (1 - self.margin):
            best = default
        return Choice(best, seconds, default)
