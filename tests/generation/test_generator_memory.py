"""What a generator holds, counted as distinct live tensor storages (never the resident
set, so a loaded host cannot change the result): export adds no copy of the weights,
and a generator adds exactly its planned KV state and what Generator.memory() states
beside it, all freed when it is dropped (Note [A generator's resident memory] in
dynvm._generate_memory)."""

from __future__ import annotations

import pytest

import dynvm
from dynvm._generate_memory import live_tensors
from tests.generation._tiny import MAX_BATCH, MAX_LENGTH, left_padded, tiny_causal_lm
from tests.jit._jit_helpers import eager_config

EXTRAS_BYTES = 4096
"""Tensors a generator may hold beside its stated ones (a step's small index tensors,
compile-ahead's example inputs): measured 0 bytes on these models; a weight or cache
copy is tens of KiB here."""


def _live() -> tuple[dict[int, int], dict[int, int]]:
    """(data_ptr -> bytes of each distinct live storage, id -> bytes of each live opaque
    oneDNN tensor: packed weights)."""
    return live_tensors()


def _new(after: dict[int, int], before: dict[int, int]) -> dict[int, int]:
    return {key: n for key, n in after.items() if key not in before}


def _distinct(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def exported(request):
    """A fresh tiny model exported to the step over the KV state, with the storages that
    were live before and after the export."""
    model = tiny_causal_lm(request.param)
    before, _ = _live()
    state_before = _distinct([*model.parameters(), *model.buffers()])
    programs = dynvm.compile_generator(model, max_batch=MAX_BATCH, max_length=MAX_LENGTH,
                                       jit=False).programs
    after, _ = _live()
    return request.param, model, programs, before, after, state_before


def test_export_adds_no_weight_copy(exported):
    """The programs hold the model's own storages: the stacked Q/K/V and gate/up
    constants replace the parameters' storages (the parameters become row views of
    them), and nothing else of weight size appears."""
    kind, model, programs, before, after, state_before = exported
    state = _distinct([*model.parameters(), *model.buffers()])
    constants = _distinct(programs.step.constants)
    assert set(constants) <= set(state), f"{kind}: a constant that is no model storage"
    assert programs.weights_bytes == sum(constants.values())
    assert sum(state.values()) == sum(state_before.values()), kind
    new = _new(after, before)
    replaced = {ptr: n for ptr, n in state_before.items() if ptr not in after}
    assert sum(new.values()) <= sum(replaced.values()) + EXTRAS_BYTES, (
        f"{kind}: export left {sum(new.values())} new bytes, replaced "
        f"{sum(replaced.values())}")


@pytest.mark.parametrize("jit", [False, "always", "dense"],
                         ids=["interpreter", "jit", "jit without packed copies"])
def test_generator_holds_weights_cache_and_stated_extras(exported, jit):
    """Live storages after a generation: the weights once (memory().weights, the
    programs' constants), and new since the generator was made exactly its KV state,
    its arenas and its packed weights (memory()) within EXTRAS_BYTES; all of it gone
    once it is dropped."""
    kind, model, programs, *_ = exported
    ids, mask = left_padded((7, 3, 5))
    before, opaque_before = _live()
    # Fusion forced on: every linear runs on a packed weight, so the packed copies
    # (a second copy of those weights) are there to be counted; "dense" is what
    # Generator(jit=True) runs (Note [Dense weights only]): none.
    config = eager_config(families=True, cpu_fusion=jit) if jit else False
    generator = dynvm.Generator(programs, jit=config)
    with generator:
        tokens = generator.generate(ids, mask, max_new_tokens=6, stop_tokens=())
        memory = generator.memory()
        after, opaque_after = _live()
    assert memory.weights == programs.weights_bytes
    assert memory.cache == generator.state.nbytes > 0
    if jit == "always":
        assert memory.packed_weights > 0 and memory.arenas > 0, memory
    elif jit == "dense":
        assert memory.packed_weights == 0 and memory.arenas > 0, memory
    else:
        assert memory.packed_weights == memory.arenas == 0
    assert memory.total == memory.planned + memory.packed_weights + memory.arenas
    ours = _distinct([tokens])
    new = {ptr: n for ptr, n in _new(after, before).items() if ptr not in ours}
    held = sum(new.values())
    stated = memory.cache + memory.arenas
    assert stated <= held <= stated + EXTRAS_BYTES, (
        f"{kind}: {held} new bytes in {len(new)} storages, stated cache {memory.cache} + "
        f"arenas {memory.arenas}: {sorted(new.values(), reverse=True)[:8]}")
    assert sum(_new(opaque_after, opaque_before).values()) == memory.packed_weights
    del generator
    gone, opaque_gone = _live()
    assert not set(new) & set(gone), f"{kind}: the generator's storages outlive it"
    assert not set(_new(opaque_after, opaque_before)) & set(opaque_gone)
