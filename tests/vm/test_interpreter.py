"""Regions and the interpreter on hand-assembled programs: branches, loops, MOVE swaps,
run-time failures, instruction counts, concurrent calls and region cache slots."""

from __future__ import annotations

import random
import threading

import pytest
import torch

import dynvm
from dynvm.vm.interpreter import Interpreter
from dynvm.vm.operands import Reg
from dynvm.vm.regions import live_in_sets, successors
from tests.vm._programs import DATA_LOOP, DATA_LOOP_INPUTS, build, compiled, demo

# if n > 4: h = relu(x) else: h = -x;  then n times: h = h + 1.0;  return h
BRANCH_AND_LOOP = """
    0  %1 = DIM %0, 0
    1  %2 = SGT %1, 4
    2  JUMP_IF_FALSE %2, @6
    3  %3 = RELU %0
    4  %4 = MOVE %3
    5  JUMP @8
    6  %5 = NEG %0
    7  %4 = MOVE %5
    8  %6 = MOVE %1
    9  %7 = SGT %6, 0
    10  JUMP_IF_FALSE %7, @14
    11  %4 = ADD %4, 1.0
    12  %6 = SSUB %6, 1
    13  JUMP @9
    14  RETURN {%4}
"""

DATA_LOOP_BODY = 2  # region index of instructions 5..7


def branch_and_loop():
    return build(BRANCH_AND_LOOP, regs=8)


def data_loop():
    return build(DATA_LOOP, regs=8, inputs=DATA_LOOP_INPUTS, outputs=2)


# ---------------------------------------------------------------- regions --------------


def test_region_boundaries_at_labels_and_control_instructions():
    program = branch_and_loop()
    bounds = [(r.index, r.start, r.stop) for r in program.regions]
    # Control instructions (2, 5, 10, 13, 14) end regions and belong to none; the jump
    # targets 6, 8, 9 and 14 start new ones (8 -> 9 splits a straight run in two).
    assert bounds == [(0, 0, 2), (1, 3, 5), (2, 6, 8), (3, 8, 9), (4, 9, 10), (5, 11, 13)]
    assert [len(r) for r in program.regions] == [2, 2, 2, 1, 1, 2]


def test_region_live_in_and_live_out():
    program = branch_and_loop()
    live = [(r.live_in, r.live_out) for r in program.regions]
    R = Reg
    assert live == [
        ((R(0),), (R(1), R(2))),        # %1 survives to the loop, %2 to the branch
        ((R(0),), (R(4),)),             # %3 is dead after the MOVE
        ((R(0),), (R(4),)),
        ((R(1),), (R(6),)),
        ((R(6),), (R(7),)),
        ((R(4), R(6)), (R(4), R(6))),   # loop-carried: read, written, read again
    ]


def test_successors_and_liveness():
    code = branch_and_loop().code
    assert successors(code, 2) == (3, 6)
    assert successors(code, 5) == (8,)
    assert successors(code, 13) == (9,)
    assert successors(code, 14) == ()
    assert successors(code, 0) == (1,)
    live = live_in_sets(code)
    assert live[0] == {Reg(0)}
    assert live[9] == {Reg(4), Reg(6)}
    assert live[14] == {Reg(4)}


def test_demo_program_regions_cover_straight_line_code():
    program = compiled("transformer")
    (region,) = program.regions
    assert (region.start, region.stop) == (0, len(program.code) - 1)
    assert region.live_in == (Reg(0),)
    assert region.live_out  # what RETURN reads


# ---------------------------------------------------------------- execution ------------


@pytest.mark.parametrize("n", [1, 4, 5, 9])
def test_branch_taken_both_ways_and_shape_dependent_loop(n):
    x = torch.randn(n, 3)
    (out,) = Interpreter(branch_and_loop()).run([x])
    branch = torch.relu(x) if n > 4 else -x
    torch.testing.assert_close(out, branch + n, rtol=0, atol=1e-6)


@pytest.mark.parametrize("trips", [0, 1, 3, 7])
def test_loop_with_data_dependent_trip_count(trips):
    x = torch.randn(4)
    h, count = Interpreter(data_loop()).run([torch.tensor(trips), x])
    assert count.item() == trips and count.dtype == torch.int64
    assert torch.equal(h, x * 2.0**trips)


@pytest.mark.parametrize("trips", [0, 1, 2, 6])
def test_instruction_count_for_a_loop(trips):
    interpreter = Interpreter(data_loop())
    interpreter.run([torch.tensor(trips), torch.randn(2)])
    # 3 before the loop; per trip header 1 + branch 1 + body 3 + jump 1; the last
    # header + branch; then SCALAR_TENSOR + RETURN.
    expected = 3 + 6 * trips + 2 + 2
    assert interpreter.instructions_executed == expected
    interpreter.run([torch.tensor(trips), torch.randn(2)])
    assert interpreter.instructions_executed == 2 * expected


def test_move_swaps_through_a_temporary():
    # n times: (a, b) = (b, a), with the staging MOVEs the frontend emits for loops.
    program = build("""
        0  %2 = ITEM %0
        1  %3 = MOVE 0
        2  %4 = MOVE %1
        3  %5 = NEG %1
        4  %6 = SLT %3, %2
        5  JUMP_IF_FALSE %6, @12
        6  %7 = MOVE %5
        7  %8 = MOVE %4
        8  %4 = MOVE %7
        9  %5 = MOVE %8
        10  %3 = SADD %3, 1
        11  JUMP @4
        12  RETURN {%4, %5}
    """, regs=9, inputs=DATA_LOOP_INPUTS, outputs=2)
    x = torch.randn(3)
    interpreter = Interpreter(program)
    for trips in range(5):
        a, b = interpreter.run([torch.tensor(trips), x])
        if trips % 2:
            assert torch.equal(a, -x) and torch.equal(b, x)
        else:
            assert torch.equal(a, x) and torch.equal(b, -x)


def test_move_of_literals_and_constants():
    program = build("""
        0  %1 = MOVE c0
        1  %2 = MOVE 2.5
        2  %3 = MUL %1, %2
        3  RETURN {%3}
    """, constants=(torch.arange(3.0),), regs=4, consts=('"c" float32 [3]',))
    (out,) = Interpreter(program).run([torch.zeros(1)])
    assert torch.equal(out, torch.arange(3.0) * 2.5)


def test_op_failing_at_run_time_raises_execution_error():
    program = build("""
        0  %1 = DIM %0, 0
        1  %2 = RELU c0
        2  %3 = EMBEDDING c0, %0, -1
        3  RETURN {%3}
    """, constants=(torch.randn(10, 4),), regs=4, inputs=('"idx" int64 [n:1..64]',),
        consts=('"table" float32 [10, 4]',))
    interpreter = Interpreter(program)
    (ok,) = interpreter.run([torch.tensor([0, 9])])
    assert ok.shape == (2, 4)
    with pytest.raises(dynvm.ExecutionError) as info:
        interpreter.run([torch.tensor([3, 12])])
    message = str(info.value)
    assert message.startswith("instruction 2 (") and "EMBEDDING" in message
    assert "index out of range" in message
    assert isinstance(info.value.__cause__, IndexError)


def test_failing_branch_condition_raises_execution_error():
    program = build("""
        0  %1 = GT %0, 0
        1  JUMP_IF_FALSE %1, @3
        2  RETURN {%0}
        3  RETURN {%1}
    """, regs=2)
    interpreter = Interpreter(program)
    assert interpreter.run([torch.ones(1)])[0] is not None
    with pytest.raises(dynvm.ExecutionError, match=r"instruction 1 \(JUMP_IF_FALSE"):
        interpreter.run([torch.ones(3)])  # a 3-element condition has no truth value


def test_execution_error_from_a_demo_model():
    runtime = dynvm.Runtime(compiled("recommender"))
    inputs = list(demo("recommender").sample_inputs(random.Random(0)))
    inputs[1] = inputs[1].clone()
    inputs[1][0, 0] = 1000  # table 0 has 1000 rows
    with pytest.raises(dynvm.ExecutionError, match=r"instruction \d+ \(%\d+ = EMBEDDING c4"):
        runtime(*inputs)


def test_registers_are_per_call():
    interpreter = Interpreter(data_loop())
    x = torch.randn(2)
    first = interpreter.run([torch.tensor(2), x])
    second = interpreter.run([torch.tensor(1), x])
    assert first[1].item() == 2 and second[1].item() == 1
    assert torch.equal(first[0], x * 4) and torch.equal(second[0], x * 2)


def test_concurrent_calls_on_one_runtime():
    runtime = dynvm.Runtime(compiled("looping"))
    dm = demo("looping")
    cases = []
    for seed in range(16):
        (x,) = dm.sample_inputs(random.Random(seed))
        x = x[:32]
        with torch.inference_mode():
            cases.append((x, dm.module(x)))
    n_threads, repeats = 8, 3
    barrier = threading.Barrier(n_threads)
    failures: list[str] = []

    def work(t: int) -> None:
        barrier.wait()
        for r in range(repeats):
            for i in range(len(cases)):
                x, expected = cases[(i + t + r) % len(cases)]
                try:
                    torch.testing.assert_close(runtime(x), expected, rtol=1e-5, atol=1e-5)
                except Exception as exc:  # pragma: no cover - reported below
                    failures.append(f"thread {t}: {exc}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:3]
    assert runtime.stats()["calls"] == n_threads * repeats * len(cases)


# ---------------------------------------------------------------- region slots ---------


class CountingSlot:
    """Profiles only: counts entries and hands out tickets; the interpreter runs the
    region and reports back through `leave`."""

    def __init__(self) -> None:
        self.enters = 0
        self.leaves: list[tuple[object, float]] = []
        self.live_in_seen: list[object] = []

    def enter(self, regs: list) -> object | None:
        self.enters += 1
        self.live_in_seen.append(regs[4])
        return ("ticket", self.enters)

    def leave(self, ticket: object, seconds: float) -> None:
        self.leaves.append((ticket, seconds))


class RunsRegionSlot:
    """Runs the region itself (as specialized code would), then returns None so the
    interpreter skips it. With `scale` set it computes something else instead, which
    shows in the output only if the interpreter really skipped its own run."""

    def __init__(self, interpreter: Interpreter, region_index: int, scale: float = 0) -> None:
        self.steps = interpreter.region_steps(region_index)
        self.scale = scale
        self.runs = 0

    def enter(self, regs: list) -> object | None:
        self.runs += 1
        if self.scale:
            regs[4] = regs[4] * self.scale  # live-outs of instructions 5..7: %4 and %3
            regs[3] = regs[3] + 1
        else:
            for step in self.steps:
                step(regs)
        return None

    def leave(self, ticket: object, seconds: float) -> None:
        raise AssertionError("leave() after enter() returned None")


def test_region_steps_are_the_region_instructions():
    interpreter = Interpreter(data_loop())
    region = interpreter.program.regions[DATA_LOOP_BODY]
    assert (region.start, region.stop) == (5, 8)
    assert len(interpreter.region_steps(DATA_LOOP_BODY)) == 3


def test_counting_slot_sees_enter_and_leave_per_region_entry():
    interpreter = Interpreter(data_loop())
    slot = CountingSlot()
    interpreter.install_slot(DATA_LOOP_BODY, slot)
    x = torch.randn(3)
    h, count = interpreter.run([torch.tensor(4), x])
    assert torch.equal(h, x * 16) and count.item() == 4
    assert slot.enters == 4
    assert [ticket for ticket, _ in slot.leaves] == [("ticket", i) for i in range(1, 5)]
    assert all(seconds >= 0 for _, seconds in slot.leaves)
    # enter() sees the live-ins already in place: h before each doubling.
    for i, h_in in enumerate(slot.live_in_seen):
        assert torch.equal(h_in, x * 2**i)
    # Zero trips: the region is never entered.
    interpreter.run([torch.tensor(0), x])
    assert slot.enters == 4
    # Detached: no more calls.
    interpreter.install_slot(DATA_LOOP_BODY, None)
    interpreter.run([torch.tensor(3), x])
    assert slot.enters == 4 and len(slot.leaves) == 4


def test_slot_that_runs_the_region_itself():
    interpreter = Interpreter(data_loop())
    slot = RunsRegionSlot(interpreter, DATA_LOOP_BODY)
    interpreter.install_slot(DATA_LOOP_BODY, slot)
    x = torch.randn(3)
    h, count = interpreter.run([torch.tensor(5), x])
    assert torch.equal(h, x * 32) and count.item() == 5
    assert slot.runs == 5


def test_region_is_skipped_when_enter_returns_none():
    interpreter = Interpreter(data_loop())
    slot = RunsRegionSlot(interpreter, DATA_LOOP_BODY, scale=3.0)
    interpreter.install_slot(DATA_LOOP_BODY, slot)
    x = torch.randn(3)
    h, count = interpreter.run([torch.tensor(3), x])
    # Had the interpreter also run the region, h would be x * 6**3 and the loop would
    # have counted twice per trip.
    assert torch.allclose(h, x * 27.0) and count.item() == 3
    assert slot.runs == 3


def test_slots_on_several_regions_of_a_demo_model():
    program = compiled("looping")
    runtime = dynvm.Runtime(program)
    slots = [CountingProbe() for _ in program.regions]
    for index, slot in enumerate(slots):
        runtime.interpreter.install_slot(index, slot)
    dm = demo("looping")
    (x,) = dm.sample_inputs(random.Random(3))
    trips = int(torch.clamp(torch.round(x.abs().mean() * 4.0), 1, 8))
    with torch.inference_mode():
        expected = dm.module(x)
    torch.testing.assert_close(runtime(x), expected, rtol=1e-5, atol=1e-5)
    entries = [slot.enters for slot in slots]
    # prologue once, loop header trips + 1 times, body trips times, epilogue once.
    assert entries == [1, trips + 1, trips, 1]
    assert all(slot.enters == slot.leaves for slot in slots)


class CountingProbe:
    def __init__(self) -> None:
        self.enters = self.leaves = 0

    def enter(self, regs: list) -> object | None:
        self.enters += 1
        return self.enters

    def leave(self, ticket: object, seconds: float) -> None:
        assert ticket == self.enters
        self.leaves += 1
