"""A program that never ends stops within its call budget (Note [Call budget]): a listing
edited to end in a backward JUMP, and a real `torch.while_loop` whose condition never
turns false, in the interpreter and with the JIT; legitimate loops are unaffected. The
HTTP side (a 500 with an error id, the worker free again, other requests served
meanwhile) is in test_hostile_http.py."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

import dynvm
from dynvm.vm.asm import assemble, disassemble
from tests.jit._jit_helpers import eager_config
from tests.vm._programs import build, compiled

SPIN = """
    0  %1 = NEG %0
    1  JUMP @0
"""


def test_a_backward_jump_forever_stops_at_its_time_budget():
    program = build(SPIN, regs=2)  # the assembler and the verifier accept it
    runtime = dynvm.Runtime(program, jit=False, budget=dynvm.CallBudget(seconds=0.3))
    start = time.monotonic()
    with pytest.raises(dynvm.CallBudgetError) as info:
        runtime(torch.randn(3))
    took = time.monotonic() - start
    assert 0.3 <= took < 1.3, took
    assert isinstance(info.value, dynvm.DynvmError)
    assert info.value.pc == 1 and info.value.iterations > 0
    assert "instruction 1 (JUMP @0)" in str(info.value)
    assert "past its budget of 0.3 s" in str(info.value)


def test_a_jump_to_itself_stops_at_the_iteration_budget():
    program = build("""
        0  %1 = NEG %0
        1  JUMP @1
    """, regs=2)
    runtime = dynvm.Runtime(program, jit=False,
                            budget=dynvm.CallBudget(loop_iterations=1000))
    with pytest.raises(dynvm.CallBudgetError, match=r"more than 1,000 loop iterations") as info:
        runtime(torch.randn(3))
    assert info.value.iterations == 1000
    # The runtime is not left in a bad state: a per-call budget still applies.
    with pytest.raises(dynvm.CallBudgetError, match=r"more than 10 loop"):
        runtime(torch.randn(3), budget=dynvm.CallBudget(loop_iterations=10))


def _never_ending_while_loop() -> dynvm.Program:
    """The `looping` demo (a torch.while_loop) with its counter's increment edited to 0,
    so that `i < trips` never turns false; the content hash is recomputed by saving."""
    program = compiled("looping")
    text = disassemble(program)
    edited, count = re.subn(r"= ADD (%\d+), 1\b", r"= ADD \1, 0", text)
    assert count == 1, text
    return assemble(edited, tuple(program.constants))


@pytest.mark.parametrize("jit", [False, True], ids=["interpreter", "jit"])
def test_a_while_loop_whose_condition_never_turns_false_stops(jit):
    program = _never_ending_while_loop()
    # Promotion forced and probation off: the point is that specialized loop bodies are
    # metered too, so the region must not be judged too cheap to compile (and detached).
    config = eager_config() if jit else False
    runtime = dynvm.Runtime(program, jit=config,
                            budget=dynvm.CallBudget(seconds=30, loop_iterations=300))
    x = torch.randn(4, 32)
    for _ in range(3):  # with the JIT, later calls run the specialized loop body
        with pytest.raises(dynvm.CallBudgetError, match=r"JUMP @\d+\): it would take more"):
            runtime(x)
    if jit:
        assert runtime.stats()["specialized_region_calls"] > 0, runtime.jit.event_log
    runtime.close()


def test_a_loop_within_its_budget_runs_to_the_end():
    program = compiled("looping")
    x = torch.full((2, 32), 2.0)  # trip count clamp(round(mean|x| * 4), 1, 8) = 8
    reference = dynvm.Runtime(program, jit=False)(x)
    exact = dynvm.Runtime(program, jit=False, budget=dynvm.CallBudget(loop_iterations=8))
    torch.testing.assert_close(exact(x), reference)
    with pytest.raises(dynvm.CallBudgetError):
        exact(x, budget=dynvm.CallBudget(loop_iterations=7))


def test_a_runaway_call_does_not_slow_a_concurrent_call():
    program = build(SPIN, regs=2)
    runtime = dynvm.Runtime(program, jit=False, budget=dynvm.CallBudget(seconds=1.0))
    errors: list[BaseException] = []

    def spin() -> None:
        try:
            runtime(torch.randn(3))
        except dynvm.CallBudgetError as exc:
            errors.append(exc)

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.1)
    # Each call has its own meter: a short call's budget is its own, not the spinner's.
    with pytest.raises(dynvm.CallBudgetError, match="more than 5 loop"):
        runtime(torch.randn(3), budget=dynvm.CallBudget(loop_iterations=5))
    thread.join(5)
    assert not thread.is_alive() and len(errors) == 1


@pytest.mark.parametrize("bad", [dict(seconds=0), dict(seconds=float("inf")),
                                 dict(seconds=float("nan")), dict(loop_iterations=0),
                                 dict(loop_iterations=1.5)])
def test_a_budget_is_finite_and_positive(bad):
    with pytest.raises(ValueError, match="CallBudget"):
        dynvm.CallBudget(**bad)


# n (per row) and x, batched along b: the loop runs sum(n) times, so one request with a
# huge n makes its whole batch run away.
BATCH_LOOP = """
    0  %2 = SUM_ALL %0, None
    1  %3 = ITEM %2
    2  %4 = MOVE 0
    3  %5 = MOVE %1
    4  %6 = SLT %4, %3
    5  JUMP_IF_FALSE %6, @10
    6  %7 = ADD %5, 1.0
    7  %5 = MOVE %7
    8  %4 = SADD %4, 1
    9  JUMP @4
    10  RETURN {%5}
"""


def test_a_runaway_batch_holds_its_replica_for_about_two_budgets(tmp_path):
    """The batched call runs away (1 s budget); its requests then re-run one by one
    sharing one more budget, so 4 runaway requests and a good one take <= ~2 s, not ~5."""
    from dynvm.cluster import ServingConfig
    from dynvm.cluster.protocol import _v2 as v2
    from dynvm.cluster.serving._limits import ServingLimits
    from dynvm.cluster.serving._replica import ReplicaServer

    path = tmp_path / "batch_loop.dvm"
    dynvm.save(build(BATCH_LOOP, regs=8, inputs=('"n" int64 [b:1..8]', '"x" float32 [b:1..8]'),
                     name="batch_loop"), path)
    cls = ReplicaServer  # the class itself, without Serve
    replica = cls("loop", str(path), ServingConfig(device="cpu", jit=False,
                                                   limits=ServingLimits(call_seconds=1.0)),
                  probe_outputs=False)
    assert replica.executor.batch_dim == ("b", 8)

    def request(n: int) -> v2.InferRequest:
        body = {"inputs": [{"name": "n", "datatype": "INT64", "shape": [1], "data": [n]},
                           {"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
        return v2.parse_infer_request(json.dumps(body).encode(), replica.program.inputs)

    requests = [request(2**40)] * 4 + [request(2)]
    start = time.monotonic()
    outcomes, counts = replica.executor.run_batch(requests, [None] * len(requests))
    took = time.monotonic() - start
    assert counts.unbatched_fallbacks == 1 and counts.vm_calls == len(requests)
    assert all(isinstance(o.error, dynvm.CallBudgetError) for o in outcomes[:4])
    assert outcomes[4].error is None and outcomes[4].outputs[0].tolist() == [3.0]
    print(f"\n4 runaway requests and a good one batched (budget 1 s): {took:.2f} s in all")
    assert 1.0 <= took < 3.0, took  # before the shared budget: 1 + 4 x 1 s
