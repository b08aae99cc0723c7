"""The zoo's full-width tier (bench/full_width_models.py): released widths, few layers,
random weights, through dynvm.compile, compared with eager in the interpreter and the
JIT (specialized at once, Note [Zoo JIT forcing]) at a shape the program was not
exported with. The tiny zoo configs never reach the sizes where oneDNN, prepacking and
the calibrations choose other forms; these do.

- BERT at bert-base width (768 hidden, 12 heads, FFN 3072, vocab 30522), 2 layers.
- ResNet-50's widths at 224x224 with one bottleneck block per stage (ResNet-50 has
  3, 4, 6, 3): every stage's widths and its strided downsampling block, a quarter of the
  convolutions. The whole ResNet-50's check took 50 s of a 2-core host under load; the
  benchmark (bench/full_width.py) runs all 16 blocks and checks its outputs.
- A Llama-style decoder at 2048 width (TinyLlama-1.1B's shape: 32 query heads over 4
  key/value heads, SwiGLU 5632, vocab 32000), 1 layer, the LM head's logits.
- ViT-B/16 at 224x224 (197 tokens), 1 layer.

One held-out shape per model, each dynamic dim off its export value: the first JIT call
interprets it and compiles (on the calling thread), the second runs specialized code.
Speed is bench/full_width.py's (Note [Full-width timing]), not this test's."""

from __future__ import annotations

import pytest
import torch

from tests.zoo import _zoo_harness as harness

pytestmark = pytest.mark.slow


def _bert():
    from bench import full_width_models as models

    return models.bert(layers=2, shapes=((2, 32), (3, 24)))


def _resnet():
    from bench import full_width_models as models

    return models.resnet50(batches=(2, 3), blocks=(1, 1, 1, 1))


def _llama():
    from bench import full_width_models as models

    return models.llama(layers=1, shapes=((2, 24), (1, 20)))


def _vit():
    from bench import full_width_models as models

    return models.vit(layers=1, batches=(2, 3))


@pytest.mark.parametrize("make", [_bert, _resnet, _llama, _vit],
                         ids=["bert-base", "resnet50-widths", "llama-2048", "vit-b16"])
def test_full_width_matches_eager_in_interpreter_and_jit(make):
    import dynvm

    model = make()
    assert model.export_index == 0
    program = dynvm.compile(model.module, model.inputs[0], model.dynamic_shapes,
                            name=model.name)
    interp = dynvm.Runtime(program, jit=False)
    jit = dynvm.Runtime(program, jit=harness.jit_config())
    x = model.inputs[1]
    try:
        with torch.inference_mode():
            expected = harness.as_tuple(model.module(*x))
        runs = (("interpreter", interp), ("JIT, first call", jit), ("JIT, second call", jit))
        for name, runtime in runs:
            outputs = harness.as_tuple(runtime(*x))
            assert len(outputs) == len(expected)
            for index, (out, want) in enumerate(zip(outputs, expected)):
                # Width 768-5632 sums long dot products: fp32 reassociation (oneDNN
                # against ATen, other blockings) moves the last bits more than at 32.
                where = f"{model.name} {name} at {model.labels[1]}, output {index}"
                torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3,
                                           msg=lambda m, w=where: f"{w}: {m}")
        stats = jit.stats()
        assert stats["specialized_region_calls"] > 0, stats
        assert harness.jit_failures(stats) == ""
    finally:
        interp.close()
        jit.close()
