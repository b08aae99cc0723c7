"""Inputs nested in lists keep the user's dim names (issue 32: a decoder's past
keys/values given as a list named their dims s25, s15), and `dynvm explain` and
`dynvm run` call a nested program in its own input structure."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import dynvm
from dynvm.cli import main


class _Nested(torch.nn.Module):
    def forward(self, x, pair, table):
        return x + pair[0] * pair[1] - table["bias"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    batch, seq = Dim("batch", min=1, max=16), Dim("seq", min=2, max=64)
    x = torch.randn(2, 8)
    pair = [torch.randn(2, 8), torch.randn(2, 8)]
    table = {"bias": torch.randn(2, 8)}
    shapes = ({0: batch, 1: seq}, [{0: batch, 1: seq}, {0: batch, 1: seq}],
              {"bias": {0: batch, 1: seq}})
    program = dynvm.compile(_Nested(), (x, pair, table), shapes, name="nested")
    path = tmp_path_factory.mktemp("nested") / "nested.dvm"
    dynvm.save(program, path)
    return program, path


def test_every_tensor_of_a_list_or_dict_input_keeps_the_users_dim_names(saved):
    program, _ = saved
    names = {spec.name: [d.name for d in spec.dims] for spec in program.inputs}
    assert names == {"x": ["batch", "seq"], "pair_0": ["batch", "seq"],
                     "pair_1": ["batch", "seq"], "table_bias": ["batch", "seq"]}, names


def test_a_list_input_named_only_in_its_list_names_the_shared_dim():
    """The user names the dims in the list alone: the first input, the same symbols to
    torch.export, takes those names too."""
    batch = Dim("rows", min=1, max=8)
    x, pair = torch.randn(3, 4), [torch.randn(3, 4), torch.randn(3, 4)]
    program = dynvm.compile(_Pair(), (x, pair), ({0: batch}, [{0: batch}, {0: batch}]),
                            name="pair")
    assert [spec.dims[0].name for spec in program.inputs] == ["rows"] * 3


class _Pair(torch.nn.Module):
    def forward(self, x, pair):
        return x * pair[0] + pair[1]


def test_explain_and_run_call_a_nested_program(saved, capsys):
    _, path = saved
    assert main(["explain", str(path), "--shape", "batch=3;seq=5"]) == 0
    out = capsys.readouterr().out
    assert "x=[3, 5], pair_0=[3, 5], pair_1=[3, 5], table_bias=[3, 5]" in out, out
    assert main(["run", str(path), "--schedule", "batch=1,4;seq=2..9", "--calls", "4",
                 "--no-jit"]) == 0
