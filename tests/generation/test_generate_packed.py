"""The step's two forms (Note [One packed call per step] in dynvm._generation_kv): the
packed one, compile_generator's default (tokens of any rows flat in one call, each at its
own slot and position; test_generate checks its tokens against Hugging Face's on every
architecture), and the rows form (packed=False, rows of T tokens each). The rows form's
greedy tokens equal Hugging Face's `generate` with prompts of different lengths written
in calls of the lengths they share and in chunks (interpreter and JIT); one packed call
mixing decode rows of different lengths with prompt chunks gives the rows form's logits
and cache; the form survives save and load, and `dynvm serve` names a saved rows form."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dynvm
from dynvm._serve_generate_bundle import load_generator, save_generator, saved_packed
from dynvm._serve_generate_cmd import hint
from tests.generation._tiny import (
    hf_greedy,
    left_padded,
    tiny_generator,
    tiny_rows_programs,
)
from tests.jit._jit_helpers import eager_config

NEW = 6


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("jit", [False, True], ids=["interpreter", "jit"])
def test_rows_greedy_matches_hf_generate(kind, jit):
    """Prompts of 7, 3 and 5 and of 20, 3 and 17 tokens over the rows form: written in
    calls of the lengths the rows share (3 + 3 calls), or of at most 4 tokens a row
    (boundaries mid-prompt, 3 + 6 calls), then decoded 3 rows a call."""
    model = tiny_generator(kind)[0]
    programs = tiny_rows_programs(kind)
    assert not programs.packed and [i.name for i in programs.step.inputs[:3]] == [
        "input_ids", "slots", "lengths"]
    config = eager_config(families=True) if jit else False
    for chunk in (None, 4):
        with dynvm.Generator(programs, jit=config, chunk=chunk) as generator:
            assert not generator.packed
            for lengths in ((7, 3, 5), (20, 3, 17)):
                ids, mask = left_padded(lengths, seed=len(lengths) + lengths[0])
                expected = hf_greedy(model, ids, mask, NEW, eos_token_id=None)
                actual = generator.generate(ids, mask, max_new_tokens=NEW, stop_tokens=())
                assert torch.equal(actual, expected), (kind, jit, chunk, lengths)
            assert generator.stats().prompt_calls == (3 + 3 if chunk is None else 3 + 6)
            if jit:
                assert generator.stats().specialized_steps > 0


def test_one_call_mixes_decode_rows_and_prompt_chunks():
    """Slots 0 and 1 hold prompts of 9 and 5 tokens, slot 3 the first 3 of 7: one packed
    call then decodes slots 1 and 0 (lengths 5 and 9), writes slot 3's next 2 tokens
    (mid-prompt) and slot 2's whole 4-token prompt. Its logits and cache equal those of
    the rows form, one call per length (the tiny step Hugging Face's tokens are checked
    against in test_generate)."""
    gen = torch.Generator().manual_seed(7)
    p0, p1, p2, p3 = (torch.randint(3, 128, (n,), generator=gen) for n in (9, 5, 4, 7))
    with dynvm.Generator(tiny_rows_programs(), jit=False) as rows, \
            dynvm.Generator(tiny_generator("llama")[1], jit=False) as packed:
        for state in (rows.state, packed.state):
            state.begin(4, 20)
        for generator in (rows, packed):
            generator.write_prompts([p0, p1, p3[:3]], torch.tensor([0, 1, 3]))
        decode = rows.rows_call(torch.tensor([[11], [12]]), torch.tensor([1, 0]),
                                torch.tensor([5, 9]))
        chunk = rows.rows_call(p3[None, 3:5], torch.tensor([3]), torch.tensor([3]))
        prompt = rows.rows_call(p2[None], torch.tensor([2]), torch.tensor([0]))
        logits = packed.packed_call(
            torch.cat([torch.tensor([11, 12]), p3[3:5], p2]),
            torch.tensor([1, 0, 3, 3, 2, 2, 2, 2]),
            torch.tensor([5, 9, 3, 4, 0, 1, 2, 3]), torch.tensor([0, 1, 3, 7]))
        expected = torch.cat([decode, chunk, prompt])
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        for mine, theirs in zip(packed.state.tensors, rows.state.tensors):
            torch.testing.assert_close(mine[:4, :, :20], theirs[:4, :, :20])
        with pytest.raises(dynvm.ConfigError, match="packed=True"):
            rows.packed_call(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]),
                             torch.tensor([0]))


def test_packed_form_saved_and_loaded(tmp_path):
    """generator.json records the form; the loaded generator writes and decodes as the
    exported one; `dynvm serve`'s hint notes a saved rows form (a bundle from before
    packed was the default) and says nothing of a packed one."""
    programs = tiny_generator("llama")[1]
    packed_dir = save_generator(programs, tmp_path / "gen")
    rows_dir = save_generator(tiny_rows_programs(), tmp_path / "rows")
    loaded = load_generator(packed_dir).programs
    assert loaded.packed and not load_generator(rows_dir).programs.packed
    assert saved_packed(packed_dir) and not saved_packed(rows_dir)
    for directory, noted in ((packed_dir, False), (rows_dir, True)):
        options = SimpleNamespace(name="tiny", model_path=str(directory))
        text = hint(options, "http://127.0.0.1:8000", [])
        assert ("rows form" in text) == noted and "/v1/completions" in text
    ids, mask = left_padded((5, 2), seed=1)
    with dynvm.Generator(programs, jit=False) as a, dynvm.Generator(loaded, jit=False) as b:
        assert torch.equal(a.generate(ids, mask, max_new_tokens=3, stop_tokens=()),
                           b.generate(ids, mask, max_new_tokens=3, stop_tokens=()))
