"""The Triton backend as a backend of the JIT: Runtimes with JitConfig(backend="triton")
on the demo models, their kernels run by Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1, set in conftest.py), against eager PyTorch and the VM's interpreter,
on random shape sequences from two code families, strided and offset views included."""

from __future__ import annotations

import importlib
import random

import pytest
import torch

import dynvm
from dynvm.jit.backends.triton.run_interpreted import InterpretedRegion
from dynvm.jit.config import JitConfig

pytestmark = pytest.mark.interpreted   # kernels run in Triton's interpreter (conftest.py)

h = importlib.import_module("tests.jit._jit_helpers")
HIDDEN = h.SMALL_TRANSFORMER["hidden"]
BAGS = (3, 5, 1, 4)
ROWS = (1000, 800, 1200, 500)
VIEWS = ("contiguous", "strided", "offset")


def triton_runtime(name: str, **overrides) -> dynvm.Runtime:
    fields = {"backend": "triton", "families": True} | overrides
    return dynvm.Runtime(h.compiled(name), jit=h.eager_config(**fields))


def view(tensor: torch.Tensor, how: str) -> torch.Tensor:
    """`tensor`'s values as a contiguous tensor, a strided view or an offset view."""
    if how == "strided":
        wide = torch.zeros(*tensor.shape[:-1], tensor.shape[-1] * 2, dtype=tensor.dtype)
        wide[..., ::2] = tensor
        return wide[..., ::2]
    if how == "offset":
        bigger = torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:], dtype=tensor.dtype)
        bigger[1:] = tensor
        return bigger[1:]
    return tensor


def transformer_inputs(rng: random.Random, gen: torch.Generator, how: str):
    # Two families of the (batch, seq) buckets: short and longer sequences.
    seq = rng.choice((5, 6, 7)) if rng.random() < 0.5 else rng.choice((9, 12, 16))
    x = torch.randn(rng.randint(1, 3), seq, HIDDEN, generator=gen)
    return (view(x, how),)


def recommender_inputs(rng: random.Random, gen: torch.Generator, how: str):
    # Two families of the batch bucket: small and larger batches.
    batch = rng.choice((2, 3)) if rng.random() < 0.5 else rng.choice((5, 7, 9, 12))
    dense = view(torch.randn(batch, 13, generator=gen), how)
    sparse = tuple(torch.randint(0, rows, (batch, bag), generator=gen)
                   for rows, bag in zip(ROWS, BAGS))
    return (dense, *sparse)


def launches(runtime) -> int:
    return sum(spec.fn.launches for rj in runtime.jit.regions.values() for spec in rj.installed()
               if isinstance(spec.fn, InterpretedRegion))


@pytest.mark.parametrize("name, sample, calls", [
    pytest.param("transformer", transformer_inputs, 14, marks=pytest.mark.slow),
    ("recommender", recommender_inputs, 20),
])
def test_triton_runtime_matches_eager_and_the_interpreter(name, sample, calls):
    module = h.demo(name).module
    runtime = triton_runtime(name)
    interpreter = dynvm.Runtime(h.compiled(name), jit=False)
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    kinds = set()
    for call in range(calls):
        # Contiguous members first (they make the families), then views among them.
        how = "contiguous" if call < calls // 2 else rng.choice(VIEWS)
        inputs = sample(rng, gen, how)
        kinds.add("strided" if not inputs[0].is_contiguous() else
                  "offset" if inputs[0].storage_offset() else "contiguous")
        got = runtime(*inputs)
        h.assert_same(got, h.eager(module, inputs), what=f"{name} call {call} vs eager")
        h.assert_same(got, interpreter(*inputs), what=f"{name} call {call} vs interpreter")
    assert kinds == {"contiguous", "strided", "offset"}
    stats = runtime.stats()
    assert stats["backend"] == "triton"
    assert stats["triton_compiles"] >= 2 and stats["family_compiles"] >= 1, stats
    assert stats["specialized_region_calls"] > 0 and stats["deopts"] == 0, stats
    assert launches(runtime) > 0
    triton_artifacts = [a for a in runtime.jit.artifacts.values() if a.backend == "triton"]
    assert triton_artifacts
    for artifact in triton_artifacts:
        groups = artifact.metadata["groups"]
        assert any(g["kind"] == "matmul" for g in groups)
        assert [v["opcode"] for v in artifact.metadata["vendor_ops"]] == [
            op for g in groups if g["kind"] == "torch" for op in g["opcodes"]]
        assert "@triton.jit" in artifact.source
        assert any(n.startswith("triton (triton-interpreter)") for n in artifact.notes)


def test_a_region_triton_cannot_take_falls_back_to_the_cpu_backend_with_the_reason():
    runtime = triton_runtime("branchy", families=False)
    module = h.demo("branchy").module
    for seed in range(3):
        x = torch.randn(4 + seed, 32, generator=torch.Generator().manual_seed(seed))
        h.assert_same(runtime(x), h.eager(module, (x,)))
    stats = runtime.stats()
    assert stats["triton_fallbacks"] >= 1 and stats["triton_compiles"] >= 1, stats
    fallen = [a for a in runtime.jit.artifacts.values() if a.backend == "cpu"]
    assert fallen
    for artifact in fallen:
        assert any("compiled by the cpu backend instead (UnsupportedRegion" in note and
                   "no operation fuses into a Triton kernel" in note
                   for note in artifact.notes), artifact.notes
    assert any("UnsupportedRegion" in line for line in runtime.jit.event_log)


def test_the_backend_is_part_of_the_cache_key_and_auto_is_cpu_on_a_cpu():
    program = h.compiled("recommender")
    runtimes = {backend: dynvm.Runtime(program, jit=h.eager_config(backend=backend))
                for backend in ("cpu", "triton", "auto")}
    x = h.make_demo_inputs("recommender")
    keys = {}
    for backend, runtime in runtimes.items():
        runtime(*x)
        assert runtime.stats()["backend"] == ("triton" if backend == "triton" else "cpu")
        keys[backend] = set(runtime.jit.artifacts)
    assert keys["cpu"] == keys["auto"]
    assert keys["cpu"] and keys["triton"] and not keys["cpu"] & keys["triton"]
    assert runtimes["cpu"].stats()["triton_compiles"] == 0


def test_backend_values_are_checked():
    with pytest.raises(ValueError, match="backend must be one of auto, cpu, triton, got 'gpu'"):
        JitConfig(backend="gpu")
    assert JitConfig().backend_for(torch.device("cuda", 0)) == "triton"
    assert JitConfig().backend_for(torch.device("cpu")) == "cpu"
    assert JitConfig(backend="cpu").backend_for(torch.device("cuda")) == "cpu"
    assert JitConfig(backend="triton").backend_for(torch.device("cpu")) == "triton"
