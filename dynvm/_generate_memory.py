"""`GeneratorMemory`: what a generator holds in tensors, by cause (Generator.memory()).

Note [A generator's resident memory]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A generator holds, in tensors:
- the weights, once. Its programs' constants are the model's own parameter tensors;
  where the frontend stacks Q/K/V or gate/up into one constant (Note [Parallel linears
  as one] in dynvm.vm.frontend.parallel_linears) the stacked tensor replaces the
  originals and the parameters become row views of it, so export adds no weight bytes
  (bench Llama, 2026-12-05: 63.0 MiB stacked, 63.0 MiB of originals freed; the live
  tensor storages of the process before and after export are 283.5 MiB both). The
  model stays correct to use: its parameters hold the same values, in the stacked
  storage. Tied weights (GPT-2's embedding and LM head) are one tensor.
- the KV state, allocated once at its planned size (max_batch x max_length per layer,
  keys and values; `KvState`). Its pages become resident as generations write them: one
  B=1 generation of 160 positions touches 1.3 of the bench Llama's 20.1 MiB.
- with the JIT on, the oneDNN-packed copies of the weights its kernels read (Note
  [Prepacked weights]): a second copy of those weights, since the interpreter, which
  any call may fall back to, reads the plain constant. After one B=1 bench Llama
  generation: 0, 9 MiB (the four attention output projections) or 48 MiB (the four
  stacked gate/up projections) in three runs, by which GEMMs calibrated faster on
  oneDNN (Note [Calibration]) and were compiled by then; after two B=4 generations
  189.8 MiB, every linear weight (67% of the weights a second time). Each JIT engine
  (each program) packs its own, so the pure prefill and decode programs may pack a
  weight twice.
- with the JIT on, the arena buffers its specializations keep for reuse (Note [Arena
  concurrency] in dynvm.arena.pool), bounded by JitConfig.arena_budget_bytes.

What it does not count, since it is no tensor (bench Llama, measured with gc and
malloc_trim(0) before each reading of the anonymous resident set):
- a generator's code: programs, kernels, their tables: +3.4 MiB for a second generator
  over the same programs in a warm process (+4.7 MiB with the KV pages its generation
  touched), all returned when it is closed and dropped.
- what the process pays once: torch.export's first use (617 modules imported by
  torch's export and AOT paths, its caches, the last export's graph and fake tensors,
  about 8.6 MiB of Python objects, which torch keeps until the next export): +58 MiB at
  the first compile_generator, +9 MiB at a second; the JIT's first generation (oneDNN
  and MKL's own state, the compile thread): +7 to +25 MiB.
- freed memory that glibc or Python's allocator keeps: a resident-set reading without
  gc and malloc_trim(0) counts it too.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GeneratorMemory:
    """Bytes a generator holds in tensors, by cause (Note [A generator's resident
    memory])."""

    weights: int
    """The distinct weight storages its programs hold (shared and tied ones once): the
    one copy, the model's own parameters where it was exported in this process."""
    cache: int
    """The KV state at its planned size (0 over plain caches, which grow with each
    generation and are freed with it)."""
    packed_weights: int = 0
    """oneDNN-packed copies of weights that its JIT kernels hold now (Note [Prepacked
    weights]): a second copy of those weights; 0 with the JIT off."""
    arenas: int = 0
    """Arena buffers its JIT engines hold for reuse (in use or idle); 0 with the JIT off."""

    @property
    def total(self) -> int:
        """Every byte above: what the generator holds in tensors."""
        return self.weights + self.cache + self.packed_weights + self.arenas

    @property
    def planned(self) -> int:
        """One copy of the weights and the planned cache: what a generator must hold."""
        return self.weights + self.cache


def generator_memory(weights: int, cache: int, runtimes) -> GeneratorMemory:
    """The memory of a generator whose programs hold `weights` bytes, whose KV state
    holds `cache`, running on `runtimes` (None entries skipped)."""
    packed = arenas = 0
    for runtime in runtimes:
        jit = getattr(runtime, "jit", None) if runtime is not None else None
        if jit is None:
            continue
        packed += jit.packed_weight_bytes()
        if jit.arena_pool is not None:
            arenas += jit.arena_pool.stats()["reserved_bytes"]
    return GeneratorMemory(weights, cache, packed, arenas)


def live_tensors() -> tuple[dict[int, int], dict[int, int]]:
    """What this process holds in CPU tensors, each storage once: (data_ptr -> bytes of
    each distinct storage a live tensor views, id -> bytes of each live opaque oneDNN
    tensor, the packed weights). Walks every object the collector tracks, so it is for
    tests and benchmarks, never a serving path."""
    gc.collect()
    storages, opaque = {}, {}
    for obj in gc.get_objects():
        # Subclasses (the fake tensors torch's export leaves behind) have no storage.
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.device.type != "cpu":
            continue
        if obj.layout == torch.strided:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif obj.layout == torch._mkldnn:
            opaque[id(obj)] = obj.numel() * obj.element_size()
    return storages, opaque
