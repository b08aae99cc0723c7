"""dynvm.compile_generator over tiny Hugging Face causal LMs: greedy tokens equal to
Hugging Face's `generate` (interpreter and JIT, batches of different prompt lengths, the
pure decode step and the one step program over the KV cache as state, prompts written
in chunks smaller than them), seeded sampling, stop tokens, streaming, and one resident
copy of the weights. Generators run the state's step where the programs have it (the
default, in its default packed form), so every test but the greedy one's "pure" case and
compile-ahead's runs it."""

from __future__ import annotations

import pytest
import torch

import dynvm
from dynvm.vm.dvm_file import dumps, loads
from dynvm.vm.serialize import tied_constants
from tests.generation._tiny import ARCHITECTURES, hf_greedy, left_padded, tiny_generator
from tests.jit._jit_helpers import eager_config

NEW = 6
LENGTHS = (7, 3, 5)  # a batch with three prompt lengths, left-padded


@pytest.fixture(scope="module", params=ARCHITECTURES)
def built(request):
    model, programs = tiny_generator(request.param)
    return request.param, model, programs


@pytest.mark.parametrize("kv_state, chunk", [(False, None), (True, None), (True, 4)],
                         ids=["pure", "state", "state-chunk4"])
@pytest.mark.parametrize("jit", [False, True], ids=["interpreter", "jit"])
def test_greedy_matches_hf_generate(built, jit, kv_state, chunk):
    """Prompts of 6 and of 7, 3 and 5 tokens over the default packed step: written whole
    (the three prompts' 15 tokens in one call), or at most 4 tokens a call (6 = 4 + 2;
    15 = 4 + 4 + 4 + 3, rows sharing calls and boundaries mid-prompt); the rows form is
    checked in test_generate_packed."""
    kind, model, programs = built
    config = eager_config(families=True) if jit else False
    with dynvm.Generator(programs, jit=config, kv_state=kv_state, chunk=chunk) as generator:
        assert (generator.state is not None) == kv_state
        assert (generator.prefill is None) == kv_state
        for lengths in ((6,), LENGTHS):
            ids, mask = left_padded(lengths, seed=len(lengths))
            expected = hf_greedy(model, ids, mask, NEW, eos_token_id=None)
            actual = generator.generate(ids, mask, max_new_tokens=NEW, stop_tokens=())
            assert torch.equal(actual, expected), (
                f"{kind} ({'JIT' if jit else 'interpreter'}), prompt lengths {lengths}: "
                f"dynvm {actual[:, ids.shape[1]:].tolist()} != "
                f"HF {expected[:, ids.shape[1]:].tolist()}")
        stats = generator.stats()
        assert stats.decode_steps == 2 * (NEW - 1)
        if kv_state:   # (6,): 1 call or 4 + 2; (7, 3, 5): 1 call of 15, or 4 calls
            assert generator.packed
            assert stats.prompt_calls == (1 + 1 if chunk is None else 2 + 4)
        if jit:
            assert stats.specialized_steps > 0, stats


def test_stream_yields_generate_tokens(built):
    _, _, programs = built
    ids, mask = left_padded(LENGTHS, seed=3)
    with dynvm.Generator(programs, jit=False) as generator:
        whole = generator.generate(ids, mask, max_new_tokens=NEW, stop_tokens=())
        steps = list(generator.stream(ids, mask, max_new_tokens=NEW, stop_tokens=()))
    assert len(steps) == NEW and all(step.shape == (len(LENGTHS),) for step in steps)
    assert torch.equal(torch.stack(steps, dim=1), whole[:, ids.shape[1]:])


def test_stop_tokens_match_hf(built):
    """Each row stops at its first stop token and is padded after it, as Hugging Face
    pads it; the loop ends once every row has stopped."""
    kind, model, programs = built
    ids, mask = left_padded(LENGTHS, seed=5)
    with dynvm.Generator(programs, jit=False) as generator:
        free = generator.generate(ids, mask, max_new_tokens=NEW, stop_tokens=())
        new = free[:, ids.shape[1]:]
        row = new[0].tolist()
        # Row 0 stops at the first of its tokens (past the first) not seen before in it.
        at = next((j for j in range(1, NEW - 1) if row[j] not in row[:j]), 0)
        stop = row[at]
        stopped = generator.generate(ids, mask, max_new_tokens=NEW, stop_tokens=(stop,))
    expected = hf_greedy(model, ids, mask, NEW, eos_token_id=stop)
    assert torch.equal(stopped, expected), (kind, stopped.tolist(), expected.tolist())
    assert stopped[0, ids.shape[1]:ids.shape[1] + at + 1].tolist() == row[:at + 1]
    assert (stopped[0, ids.shape[1] + at + 1:] == 0).all()


def test_sampling_reproducible_with_a_seed(built):
    _, _, programs = built
    ids, mask = left_padded(LENGTHS, seed=7)
    sampling = dynvm.Sampling(temperature=1.5, top_k=40, top_p=0.9, seed=1234)
    with dynvm.Generator(programs, jit=False) as generator:
        first = generator.generate(ids, mask, max_new_tokens=NEW, sampling=sampling,
                                   stop_tokens=())
        again = generator.generate(ids, mask, max_new_tokens=NEW, sampling=sampling,
                                   stop_tokens=())
        other = [generator.generate(ids, mask, max_new_tokens=NEW, stop_tokens=(),
                                    sampling=dynvm.Sampling(temperature=1.5, seed=seed))
                 for seed in range(3)]
        greedy = generator.generate(ids, mask, max_new_tokens=NEW, stop_tokens=())
    assert torch.equal(first, again)
    # High temperature over 128 tokens: three other seeds all giving the greedy tokens
    # would be a sampler that does not sample.
    assert any(not torch.equal(tokens, greedy) for tokens in other)


def test_weights_resident_once(built):
    """Every program holds the model's own weight storages: no second copy; the step
    over the state holds them all by itself, and a generator running it has one Runtime
    and plans one copy of the weights plus its KV state (Generator.memory)."""
    _, model, programs = built
    def storages(program):
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in program.constants}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters()
                       if p.data_ptr() == p.untyped_storage().data_ptr())
    step = storages(programs.step)
    every = {**storages(programs.prefill), **storages(programs.decode), **step}
    for held in (every, step):
        shared = {ptr for ptr in held if ptr in params}
        assert sum(held[ptr] for ptr in shared) >= 0.99 * weight_bytes
        # Whatever is not a parameter is small (rotary tables, masks' constants).
        assert sum(n for ptr, n in held.items() if ptr not in params) < 0.05 * weight_bytes
    with dynvm.Generator(programs, jit=False) as generator:
        assert generator.prefill is None and generator.decode is None
        memory = generator.memory()
        assert weight_bytes <= memory.weights < 1.05 * weight_bytes
        assert memory.cache == generator.state.nbytes == sum(
            t.numel() * t.element_size() for t in generator.state.tensors)
        assert memory.total == memory.planned == memory.weights + memory.cache


def test_tied_weights_stored_once(built):
    """GPT-2's token embedding is its LM head: each program's .dvm stores it once (Note
    [Tied constants] in dynvm.vm.serialize) and loads it as one tensor."""
    kind, model, programs = built
    if kind != "gpt2":
        pytest.skip("only GPT-2 of the tiny models ties its embedding and LM head")
    table = model.get_input_embeddings().weight
    for program in (programs.prefill, programs.decode, programs.step):
        (name, first), = tied_constants(program)
        constants = dict(zip(program.constant_names, program.constants))
        assert constants[first].data_ptr() == table.data_ptr(), program.name
        loaded = loads(dumps(program))
        constants = dict(zip(loaded.constant_names, loaded.constants))
        assert constants[name].data_ptr() == constants[first].data_ptr()
        assert loaded.content_hash == program.content_hash


def test_refusals_name_the_input(built):
    _, _, programs = built
    ids, mask = left_padded(LENGTHS)
    with dynvm.Generator(programs, jit=False) as generator:
        with pytest.raises(dynvm.InputError, match="max_new_tokens"):
            generator.generate(ids, mask, max_new_tokens=64)
        right = mask.flip(1)
        with pytest.raises(dynvm.ShapeError, match="left padding"):
            generator.generate(ids, right, max_new_tokens=2)
    with pytest.raises(dynvm.ConfigError, match="top_p"):
        dynvm.Sampling(top_p=0.0)


def test_length_buckets_compiled_ahead(built):
    """Note [Compiling the next length bucket]: with a recurrence threshold no decode
    step ever reaches, only the generator's requests compile anything; they cover the
    first generation from its second step on (the first shows no varying dim yet). The
    rule does not depend on the architecture: one of them is enough."""
    kind, _, programs = built
    if kind != "llama":
        pytest.skip("the compile-ahead rule is checked on llama (grouped heads) alone")
    never = eager_config(families=True, min_recurrence=1000, max_recurrence=1000,
                         window=1000)
    ids, mask = left_padded((6,), seed=9)
    new = 20   # L = 6..24: the buckets 5..16 and 17..64
    counts = {}
    for ahead in (False, True):
        with dynvm.Generator(programs, jit=never, compile_ahead=ahead,
                             kv_state=False) as generator:
            tokens = generator.generate(ids, mask, max_new_tokens=new, stop_tokens=())
            counts[ahead] = generator.stats()
            assert generator.decode.stats().family_compiles == (2 if ahead else 0), kind
        with dynvm.Generator(programs, jit=False) as interpreter:
            assert torch.equal(tokens, interpreter.generate(ids, mask, max_new_tokens=new,
                                                            stop_tokens=()))
    assert counts[False].specialized_steps == 0, counts
    assert counts[True].specialized_steps >= counts[True].decode_steps - 2, counts


def test_state_step_promoted_after_its_first_call(built):
    """The KV-state step at T = 1 has no growing dim: compile-ahead promotes its exact
    signature after the first decode step (StepAhead), so with a recurrence threshold no
    step reaches, the first generation runs every decode step but the first
    specialized."""
    kind, _, programs = built
    if kind != "llama":
        pytest.skip("the rule does not depend on the architecture: checked on llama")
    never = eager_config(families=True, min_recurrence=1000, max_recurrence=1000,
                         window=1000)
    ids, mask = left_padded((6,), seed=9)
    counts = {}
    for ahead in (False, True):
        with dynvm.Generator(programs, jit=never, compile_ahead=ahead) as generator:
            tokens = generator.generate(ids, mask, max_new_tokens=12, stop_tokens=())
            counts[ahead] = generator.stats()
        with dynvm.Generator(programs, jit=False) as interpreter:
            assert torch.equal(tokens, interpreter.generate(ids, mask, max_new_tokens=12,
                                                            stop_tokens=()))
    assert counts[False].specialized_steps == 0, counts
    assert counts[True].specialized_steps == counts[True].decode_steps - 1, counts


def test_regions_writing_the_cache_have_no_probation(built):
    """Note [Probation]: a shadow sample runs its region again later, on the compile
    worker, so a region with KV_APPEND (writes_state) is never on probation (the step
    over the state is one such region); the pure prefill's regions, under the same
    config, are; the tokens stay the interpreter's."""
    kind, _, programs = built
    if kind != "llama":
        pytest.skip("the rule does not depend on the architecture: checked on llama")
    config = eager_config(families=True, probation=True)
    ids, mask = left_padded(LENGTHS, seed=4)
    with dynvm.Generator(programs, jit=config) as generator:
        tokens = generator.generate(ids, mask, max_new_tokens=NEW, stop_tokens=())
        regions = generator.step.jit.regions.values()
        stateful = [rj for rj in regions if rj._writes_state]
        assert stateful, "the step has no region that writes the cache"
        installed = [spec for rj in stateful for spec in rj.installed()]
        assert installed and all(spec.probation is None for spec in installed)
    with dynvm.Generator(programs, jit=config, kv_state=False) as pure:
        pure.generate(ids, mask, max_new_tokens=2, stop_tokens=())
        others = [spec for rj in pure.prefill.jit.regions.values() for spec in rj.installed()]
        assert any(spec.probation is not None or spec.ratio is not None for spec in others)
    with dynvm.Generator(programs, jit=False) as interpreter:
        assert torch.equal(tokens, interpreter.generate(ids, mask, max_new_tokens=NEW,
                                                        stop_tokens=()))


def test_prompt_chunks_run_in_families_and_decode_exact(built):
    """The step's T is one more dim to the JIT: whole chunks recur at T = chunk (exact),
    the prompts' last chunks of other lengths fall in a family kernel over T, and the
    decode shape T = 1 is exact; after a few prompts of different lengths, every call
    of a new prompt runs specialized. Tokens stay the interpreter's."""
    kind, _, programs = built
    if kind != "llama":
        pytest.skip("the rule does not depend on the architecture: checked on llama")
    lengths = (40, 37, 21, 45, 33, 29, 43)
    with dynvm.Generator(programs, jit=eager_config(families=True), chunk=16) as generator:
        for seed, length in enumerate(lengths):
            ids, mask = left_padded((length,), seed=seed)
            before = generator.step.region_calls()
            tokens = generator.generate(ids, mask, max_new_tokens=3, stop_tokens=())
            after = generator.step.region_calls()
        assert after[1] == before[1], "the last prompt's calls were not all specialized"
        stats = generator.step.stats()
        assert stats["family_compiles"] >= 1 and stats["compiles"] >= 3, stats
        assert generator.stats().prompt_calls == sum(-(-n // 16) for n in lengths)
    with dynvm.Generator(programs, jit=False) as interpreter:
        assert torch.equal(tokens, interpreter.generate(ids, mask, max_new_tokens=3,
                                                        stop_tokens=()))

