"""Tied weights are stored once in the .dvm (Note [Tied constants] in
dynvm.vm.serialize): a model whose embedding is its output head writes that weight's
bytes once, loads it as one tensor, keeps its content hash, runs as before, and a file
whose tied list points anywhere but an earlier constant is refused."""

from __future__ import annotations

import pytest
import torch

import dynvm
from dynvm.vm.dvm_file import dumps, loads
from dynvm.vm.serialize import check_tied, tied_constants

VOCAB, WIDTH = 512, 64


class _TiedLm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.mix = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight   # GPT-2's tie

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


@pytest.fixture(scope="module")
def program():
    return dynvm.compile(_TiedLm().eval(), (torch.tensor([[3, 4, 5]]),))


def test_tied_weight_stored_once(program):
    weights = [t for t in program.constants if t.shape == (VOCAB, WIDTH)]
    assert len(weights) == 2 and weights[0].data_ptr() == weights[1].data_ptr()
    assert len(tied_constants(program)) == 1
    data = dumps(program)
    weight_bytes = VOCAB * WIDTH * 4
    # One copy of the table, the small layer and the code: well under two tables.
    assert weight_bytes < len(data) < 1.2 * weight_bytes, len(data)
    loaded = loads(data)
    assert loaded.content_hash == program.content_hash
    tables = [t for t in loaded.constants if t.shape == (VOCAB, WIDTH)]
    assert tables[0].data_ptr() == tables[1].data_ptr()   # resident once after loading
    ids = torch.tensor([[7, 1, 300]])
    with dynvm.Runtime(loaded, jit=False) as runtime:
        torch.testing.assert_close(runtime(ids), _TiedLm().eval()(ids))


def test_a_tie_must_point_at_an_earlier_untied_constant(program):
    names = list(program.constant_names)
    (name, first), = tied_constants(program)
    assert check_tied([[name, first]], names) == {name: first}
    for forged in ([[first, name]], [[name, name]], [[name, "nowhere"]], [[name]],
                   [[name, first], [name, first]], "tied"):
        with pytest.raises(dynvm.DvmFormatError):
            check_tied(forged, names)
