"""Note [Decomposing without a retrace]: where the frontend skips torch.export's
run_decompositions, the program is the one the retrace would have given, instruction
for instruction; where it cannot, it falls back and leaves the graph untouched."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from dynvm.vm.asm import disassemble
from dynvm.vm.frontend.decompose import decompose_in_place
from dynvm.vm.frontend.dims import user_dim_names
from dynvm.vm.frontend.kept_ops import decomposition_table
from dynvm.vm.frontend.lower import lower_exported
from tests.vm._programs import NAMES, demo

# The demo models whose training IR needs no retrace: the must-show workloads' Transformer
# among them, so the saving cannot silently disappear.
WITHOUT_RETRACE = {"branchy", "recommender", "transformer"}


def _export(module, inputs, dynamic_shapes):
    return torch.export.export(module.eval(), inputs, dynamic_shapes=dynamic_shapes,
                               strict=False)


def _lower(exported, module, inputs, dynamic_shapes):
    names = user_dim_names(module, inputs, dynamic_shapes)
    return lower_exported(exported, names, "m", inputs)


def _both_paths(module, inputs, dynamic_shapes):
    """(skipped the retrace?, program without it or after the fallback, program after
    run_decompositions)."""
    exported = _export(module, inputs, dynamic_shapes)
    skipped = decompose_in_place(exported)
    if not skipped:
        exported = exported.run_decompositions(decomposition_table())
    retraced = _export(module, inputs, dynamic_shapes).run_decompositions(
        decomposition_table())
    return (skipped, _lower(exported, module, inputs, dynamic_shapes),
            _lower(retraced, module, inputs, dynamic_shapes))


def _assert_same_program(ours, torchs) -> None:
    assert disassemble(ours) == disassemble(torchs)
    assert ours.content_hash == torchs.content_hash


@pytest.mark.parametrize("name", NAMES)
def test_demo_models_lower_to_the_retraced_program(name):
    dm = demo(name)
    skipped, ours, torchs = _both_paths(dm.module, tuple(dm.example_inputs),
                                        dm.dynamic_shapes)
    assert skipped == (name in WITHOUT_RETRACE)
    _assert_same_program(ours, torchs)


class _Attention(torch.nn.Module):
    """transpose + a reshape that torch resolves to a view, after a kept op."""

    def forward(self, q, k):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k)
        return out.transpose(1, -3).reshape(q.shape[0], q.shape[2], -1)


class _CopyingReshape(torch.nn.Module):
    """A reshape of a transposed tensor copies: only the retrace knows how to say so."""

    def forward(self, x):
        return x.transpose(0, 1).reshape(-1) * 2


class _InPlace(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        y.add_(1)
        return torch.relu(y)


BATCH = Dim("batch", min=2, max=64)


def test_view_shaped_reshape_and_transpose_skip_the_retrace():
    q, k = torch.randn(3, 4, 5, 8), torch.randn(3, 4, 5, 8)
    skipped, ours, torchs = _both_paths(_Attention(), (q, k), ({0: BATCH}, {0: BATCH}))
    assert skipped
    assert {"PERMUTE", "VIEW"} <= {instr.op for instr in ours.code}
    _assert_same_program(ours, torchs)


@pytest.mark.parametrize("module", [_CopyingReshape(), _InPlace()], ids=type)
def test_graphs_only_the_retrace_can_decompose_fall_back_untouched(module):
    inputs, shapes = (torch.randn(6, 5),), ({0: BATCH},)
    exported = _export(module, inputs, shapes)
    before = exported.graph_module.print_readable(print_output=False)
    assert not decompose_in_place(exported)
    assert exported.graph_module.print_readable(print_output=False) == before
    skipped, ours, torchs = _both_paths(module, inputs, shapes)
    assert not skipped
    _assert_same_program(ours, torchs)
