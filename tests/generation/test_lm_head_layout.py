"""Note [LM head stored input-major] in dynvm._lm_head_layout: after export the untied
LM head is one input-major tensor shared by the model and the programs, a tied one
(GPT-2) stays row-major for its gathers, a .dvm round trip keeps the values, and a
second export of the same model shares the head instead of copying it."""

from __future__ import annotations

import torch

import dynvm
from dynvm._lm_head_layout import store_lm_head_input_major
from dynvm.vm.dvm_file import dumps, loads
from tests.generation._tiny import MAX_BATCH, MAX_LENGTH, tiny_causal_lm, tiny_generator


def _head_indices(program, head):
    return [i for i, t in enumerate(program.constants)
            if t.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()]


def test_untied_head_is_input_major_and_the_models_own():
    model, programs = tiny_generator("llama")
    head = model.get_output_embeddings().weight
    assert head.t().is_contiguous() and not head.is_contiguous()
    (index,) = _head_indices(programs.step, head)
    constant = programs.step.constants[index]
    assert constant.data_ptr() == head.data_ptr() and constant.stride() == head.stride()
    # Same values as a model exported without the pass would hold: the model's logits
    # through the head equal those through a contiguous copy of it.
    x = torch.randn(3, head.shape[1])
    assert torch.allclose(x @ head.t(), x @ head.contiguous().t(), atol=1e-6)
    loaded = loads(dumps(programs.step))
    assert torch.equal(loaded.constants[index], constant)


def test_tied_head_keeps_its_layout():
    """GPT-2's LM head is its token embedding, which EMBEDDING gathers rows of: the
    pass leaves it (and the programs) as they are."""
    model = tiny_causal_lm("gpt2")
    table = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() == table.data_ptr()
    programs = object()   # never looked at: a tied head returns before reading them
    assert store_lm_head_input_major(programs, model) is programs
    assert table.is_contiguous()


def test_a_second_export_of_the_model_shares_its_input_major_head():
    """The first export leaves the model's head input-major; export copies a
    non-contiguous parameter, so the second export's programs are given the model's
    tensor back in place of that copy: one copy of the head, its layout kept."""
    model = tiny_causal_lm("llama")
    dynvm.compile_generator(model, max_batch=MAX_BATCH, max_length=MAX_LENGTH, jit=False)
    head = model.get_output_embeddings().weight
    assert head.t().is_contiguous() and not head.is_contiguous()
    again = dynvm.compile_generator(model, max_batch=MAX_BATCH, max_length=MAX_LENGTH,
                                    jit=False).programs
    (index,) = _head_indices(again.step, head)
    assert again.step.constants[index].stride() == head.stride()
    copies = [t for t in again.step.constants if t.shape == head.shape
              and t.untyped_storage().data_ptr() != head.untyped_storage().data_ptr()
              and torch.equal(t, head)]
    assert not copies
    assert model.get_output_embeddings().weight is head   # not converted a second time
