"""The zoo's harness, shared by tests/zoo/test_zoo.py and `dynvm bench zoo`: compile a
zoo entry through the public path (dynvm.compile -> save -> load), run it in the
interpreter or the JIT, and compare with eager.

Note [Zoo tolerance]
~~~~~~~~~~~~~~~~~~~~
Outputs are compared in fp32 with rtol = atol = 1e-4 (an entry may widen it, saying why
in its note). The interpreter runs core ATen ops after torch.export's decompositions,
and the JIT may fuse or reorder them, so results differ from eager by rounding only;
hidden states of these tiny models are O(1), where 1e-4 is ~1000 ulps of slack and a
wrong mask, index or stride still fails by orders of magnitude.

Note [Zoo JIT forcing]
~~~~~~~~~~~~~~~~~~~~~~
The JIT runs with promotion forced (tests/jit/_jit_helpers.eager_config: K = 1, every
promotion worth its compile, compiles on the calling thread) and code families on, as a
server runs: the first call of a shape is interpreted and promotes it, the second runs
specialized code. The CPU backend's measured choices are forced too: oneDNN fusion and
channels-last chains wherever they apply ("always"), so every zoo model runs the fused
code on every run, where "measured" would pick it by timing on a shared host; their
calibration (two thirds of a zoo JIT test's time when measured) is tested in
tests/jit/test_cpu_fusion.py, test_cpu_conv.py and test_cpu_layout.py. That the second
call really ran specialized code is checked from the runtime's counters, as is that no
specializer, compile or run-time fallback failure happened (the JIT's stats contract:
specialize_failures_total, deopts).
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

import dynvm
from tests.jit._jit_helpers import eager_config
from tests.zoo._zoo import Built, ZooEntry, by_name


@dataclass(frozen=True)
class Compiled:
    entry: ZooEntry
    built: Built
    program: dynvm.Program
    """The program as `dynvm.load` read it back from its .dvm file."""

    compile_seconds: float
    """Wall time of dynvm.compile (torch.export, decompositions, lowering)."""

    @property
    def opcodes(self) -> Counter:
        return Counter(instr.op for instr in self.program.code)


def compile_entry(entry: ZooEntry, folder: Path | None = None) -> Compiled:
    """Build `entry`, dynvm.compile it on its export point, save and load it back."""
    built = entry.build()
    example = built.make_inputs(entry.export_point, 0)
    start = time.perf_counter()
    program = dynvm.compile(built.module, example, built.dynamic_shapes, name=entry.name)
    seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(folder or scratch) / f"{entry.name}.dvm"
        dynvm.save(program, path)
        loaded = dynvm.load(path)
    return Compiled(entry, built, loaded, seconds)


@functools.cache
def compiled(name: str) -> Compiled:
    """compile_entry of the zoo entry `name`, once per process: tests/zoo and
    tests/jit/test_abstract_zoo.py share it, since a zoo test's time is mostly its export
    (torch.export and its decompositions), not its calls. Programs are read-only to the
    Runtimes that run them, so sharing one between tests changes nothing they check.
    The export comes from the second process when one runs (Note [Zoo exports ahead])."""
    from tests.zoo import _zoo_exports

    ahead = _zoo_exports.running()
    made = ahead.take(name) if ahead is not None else None
    if made is None:
        return compile_entry(by_name(name))
    entry = by_name(name)
    program, seconds = made
    return Compiled(entry, entry.build(), program, seconds)


def jit_config() -> dynvm.JitConfig:
    """Note [Zoo JIT forcing]."""
    return eager_config(families=True, cpu_fusion="always", cpu_channels_last="always")


def as_tuple(outputs) -> tuple[torch.Tensor, ...]:
    return tuple(outputs) if isinstance(outputs, tuple | list) else (outputs,)


def eager(built: Built, inputs: tuple) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode():
        return as_tuple(built.module(*inputs))


def assert_matches(entry: ZooEntry, actual, expected, what: str) -> None:
    """Note [Zoo tolerance]; `what` names the model, the system and the shape point."""
    actual = as_tuple(actual)
    assert len(actual) == len(expected), f"{what}: {len(actual)} outputs, eager gives " \
                                         f"{len(expected)}"
    for index, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, rtol=entry.rtol, atol=entry.atol,
                                   msg=lambda m, i=index: f"{what}, output {i}:\n{m}")


def jit_failures(stats: dict) -> str:
    """'' when the JIT counted no failure, else what it counted (Note [Zoo JIT forcing]):
    the JIT's contract is specialize_failures_total (specializer or backend failures,
    by reason in specialize_failures) and deopts, both zero on every zoo model;
    compile_failures also counts input-check rejections, which are not bugs."""
    problems = []
    if stats["specialize_failures_total"]:
        problems.append(f"specialize failures {stats['specialize_failures']}")
    if stats["deopts"]:
        problems.append(f"deopts {stats['deopts']}")
    if stats["compile_timeouts"]:
        problems.append(f"compile timeouts {stats['compile_timeouts']}")
    return "; ".join(problems)
