"""Helpers shared by the JIT tests: demo programs (built once per session), configs that
make promotion happen on cue, and waiting for the background compile queue.

Not a conftest on purpose (as tests/vm/_programs.py): import what you need.
"""

from __future__ import annotations

import functools
import time

import torch

import dynvm
from dynvm.jit.config import JitConfig
from dynvm.models import transformer
from tests.vm import _programs

build = _programs.build
torch_threads = _programs.torch_threads

SMALL_TRANSFORMER = {"layers": 2, "hidden": 64, "heads": 4, "ffn": 128}


@functools.lru_cache(maxsize=8)
def demo(name: str):
    """The demo model `name`; the transformer in a small configuration (fast to run)."""
    if name == "transformer":
        return transformer(**SMALL_TRANSFORMER)
    return _programs.demo(name)


@functools.lru_cache(maxsize=8)
def compiled(name: str) -> dynvm.Program:
    """`dynvm.compile` of `demo(name)`, lowered once per session."""
    if name != "transformer":
        return _programs.compiled(name)
    dm = demo(name)
    return dynvm.compile(dm.module, dm.example_inputs, dm.dynamic_shapes, name="transformer_s")


def compile_module(module, example_inputs, dynamic_shapes=None) -> dynvm.Program:
    return dynvm.compile(module.eval(), example_inputs, dynamic_shapes)


def eager_config(**overrides) -> JitConfig:
    """A config that promotes a signature on its first (or second) interpreted call.

    K=1 for every region size (a huge recurrence step), and a horizon so long that the
    benefit always beats the compile cost, even after the first compile in the process
    measured torch's one-time import of its meta kernels (about a second). Code families
    are off unless asked for: every promotion is an exact specialization. Probation is
    off unless asked for, and every op with an out= form writes into the arena: both
    would otherwise come from timings, and these tests count what is installed, hit and
    allocated (tests/jit/test_probation.py and test_arena_choice.py turn them on).
    """
    fields = {"sync": True, "min_recurrence": 1, "max_recurrence": 2,
              "expected_speedup": 1.0, "instructions_per_recurrence_step": 10**6,
              "horizon_calls": 10**9, "families": False, "probation": False,
              "arena_ops": "all"}
    fields.update(overrides)
    return JitConfig(**fields)


def make_demo_inputs(name: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Fixed, small inputs for the demo model `name`."""
    gen = torch.Generator().manual_seed(seed)
    if name == "transformer":
        return (torch.randn(2, 8, SMALL_TRANSFORMER["hidden"], generator=gen),)
    if name == "gnn":
        return (torch.randn(12, 64, generator=gen), torch.randint(0, 12, (2, 30), generator=gen))
    if name == "recommender":
        sparse = tuple(torch.randint(0, rows, (8, bag), generator=gen)
                       for rows, bag in ((1000, 3), (800, 5), (1200, 1), (500, 4)))
        return (torch.randn(8, 13, generator=gen), *sparse)
    return (torch.randn(8, 32, generator=gen),)


def pending(runtime) -> int:
    return sum(len(rj.pending) for rj in runtime.jit.regions.values())


def wait_drained(runtime, timeout: float = 30.0) -> None:
    """Wait until the compile queue is empty and no promoted signature is pending."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if runtime.stats()["queue_length"] == 0 and pending(runtime) == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"compile queue did not drain in {timeout} s: "
                         f"queue {runtime.stats()['queue_length']}, pending {pending(runtime)}")


def eager(module, inputs):
    with torch.inference_mode():
        return module(*inputs)


def assert_same(actual, expected, rtol: float = 1e-4, atol: float = 1e-5, what: str = ""):
    if isinstance(expected, tuple | list):
        assert isinstance(actual, tuple | list) and len(actual) == len(expected), what
        for a, e in zip(actual, expected):
            assert_same(a, e, rtol, atol, what)
        return
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}"
                               f"\n{m}")
