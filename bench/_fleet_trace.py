"""The fleet simulator's inputs: the programs a fleet serves and the shape trace its
replicas see (bench/fleet_sim.py).

The programs are one small transformer from dynvm.models, compiled once, under several
names: each name is a different program hash (as a redeploy with new weights would be),
chosen so that the programs fall on different shards of the compile service. The
observations a request makes are recorded once per shape from the real JIT: a Runtime
interprets one call of that shape with a recording fleet hook, which hears exactly the
(region, signature, seconds) that a replica's FleetLink hears. Replicas then draw
shapes from a Zipf distribution over batch x sequence whose ranking drifts over time.
"""

from __future__ import annotations

import bisect
import dataclasses
import random
from dataclasses import dataclass

import torch

BATCHES = (1, 2, 4, 8)
SEQUENCES = (16, 32, 64, 128)
HIDDEN = 16


@dataclass(frozen=True)
class Observation:
    """What one interpreted region call of a shape tells the fleet link."""

    region: int
    signature: tuple
    seconds: float


class _Recorder:
    """A fleet hook (Note [Fleet hooks] in dynvm.jit.engine) that keeps what it hears."""

    def __init__(self) -> None:
        self.heard: list[Observation] = []

    def observed(self, region: int, signature: tuple, seconds: float) -> None:
        self.heard.append(Observation(region, signature, seconds))

    def compiles_locally(self) -> bool:
        return False


def fleet_programs(count: int, shards: int) -> list[bytes]:
    """`count` .dvm files of the small transformer under different names, covering as
    many shards of `shards` as they can (one program per shard while count <= shards)."""
    import dynvm
    from dynvm.cluster.fleet._shards import shard_of
    from dynvm.models import transformer
    from dynvm.vm import dvm_file

    demo = transformer(layers=1, hidden=HIDDEN, heads=2, ffn=32, max_batch=64, max_seq=256)
    module = demo.module.eval()  # safe: nn.Module.eval, not Python's eval
    base = dynvm.compile(module, demo.example_inputs, demo.dynamic_shapes,
                         name="fleet")
    chosen: list[bytes] = []
    taken: set[int] = set()
    for variant in range(10_000):
        program = dataclasses.replace(base, name=f"fleet-{variant}", _cache={})
        shard = shard_of(program.content_hash, shards)
        if shard in taken and len(taken) < min(count, shards):
            continue
        taken.add(shard)
        chosen.append(dvm_file.dumps(program))
        if len(chosen) == count:
            return chosen
    raise RuntimeError("no program names spread over the shards")


def record_observations(dvm_bytes: bytes) -> dict[tuple[int, int], tuple[Observation, ...]]:
    """(batch, seq) -> the observations one interpreted call of that shape makes."""
    import dynvm
    from dynvm.jit.config import JitConfig
    from dynvm.vm import dvm_file

    program = dvm_file.loads(dvm_bytes)
    shapes = {}
    generator = torch.Generator().manual_seed(0)
    for batch in BATCHES:
        for seq in SEQUENCES:
            # A fresh JIT per shape: one that saw many calls could go cold and stop
            # profiling (Note [Cold regions]), which is not what a new shape meets.
            runtime = dynvm.Runtime(program, "cpu", jit=JitConfig())
            recorder = _Recorder()
            runtime.jit.connect(recorder)
            inputs = torch.randn(batch, seq, HIDDEN, generator=generator)
            for _ in range(2):   # the second call's time: no first-call warm-up in it
                recorder.heard.clear()
                runtime(inputs)
            if not recorder.heard:
                raise RuntimeError(f"shape {(batch, seq)}: the JIT heard no region call")
            shapes[(batch, seq)] = tuple(recorder.heard)
    return shapes


class ShapeTrace:
    """Zipf(`exponent`) over the batch x sequence grid, its ranking shuffled per program
    and rotated by `drift_step` ranks every `drift_period_s` (new shapes get hot)."""

    def __init__(self, seed: int, exponent: float = 1.2, drift_period_s: float = 10.0,
                 drift_step: int = 3) -> None:
        self.shapes = [(b, s) for b in BATCHES for s in SEQUENCES]
        random.Random(seed).shuffle(self.shapes)
        weights = [1.0 / (rank + 1) ** exponent for rank in range(len(self.shapes))]
        total = sum(weights)
        self._cdf = []
        acc = 0.0
        for w in weights:
            acc += w / total
            self._cdf.append(acc)
        self.drift_period_s = drift_period_s
        self.drift_step = drift_step

    def draw(self, rng: random.Random, elapsed_s: float) -> tuple[int, int]:
        rank = min(bisect.bisect_left(self._cdf, rng.random()), len(self._cdf) - 1)
        phase = int(elapsed_s // self.drift_period_s) * self.drift_step
        return self.shapes[(rank + phase) % len(self.shapes)]
