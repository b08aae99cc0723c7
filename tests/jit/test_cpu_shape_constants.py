"""Ops over constants and literals run at compile time (Note [Shape constants in kernels]
in jit/backends/cpu/shape_constants.py): a BERT-style prologue's index arithmetic and
mask ops leave exact kernels, the results are the same bits as without the pass and
within bf16's tolerance of eager over random shape sequences, offset inputs and
families; a folded value that a remaining op writes in place, or a large one, is not
kept as a constant.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import precision, shape_constants
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.precision import PRECISION_VARIANT, precision_available
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.backends.cpu.shape_constants import MAX_BYTES, fold_shape_constants
from dynvm.jit.ir import ConstRef, SpecOp, Var
from dynvm.jit.specialize import specialize
from tests.jit.test_cpu_attention_primitives import (
    BF16_RELATIVE,
    Layer,
    _keep,
    _relative,
    run_kernel,
    serve_random_shapes,
)

pytestmark = pytest.mark.skipif(precision_available("bf16") is not None,
                                reason=str(precision_available("bf16")))
NOTE = "run at compile time"


class Prologue(nn.Module):
    """Token and position embeddings, a Hugging Face-style mask made from index
    arithmetic over the batch and sequence, and one BERT-style layer; `shifted` adds a
    position index that the model offsets by an input (an ADD that in-place reuse may
    write into the ARANGE's result)."""

    def __init__(self, shifted: bool = False, width: int = 32) -> None:
        super().__init__()
        self.shifted = shifted
        self.tokens, self.positions = nn.Embedding(50, width), nn.Embedding(128, width)
        self.register_buffer("position_ids", torch.arange(128)[None])
        self.layer = Layer(d=width)

    def forward(self, ids, keep):
        b, s = ids.shape
        x = self.tokens(ids) + self.positions(self.position_ids[:, :s])
        rows = torch.arange(b)[:, None, None, None]
        cols = torch.arange(s)[None, None, None, :]
        queries = torch.arange(s)[None, None, :, None] + 0
        mask = (queries >= 0) & keep.bool()[rows, cols]
        y = self.layer(x, keep, mask)
        if self.shifted:
            at = torch.arange(s) + keep[0, :1]
            y = y + at.to(y.dtype)[None, :, None] * 1e-2
        return y


def _program(**kwargs):
    torch.manual_seed(0)
    model = Prologue(**kwargs).eval()
    batch, seq = Dim("batch", min=1, max=16), Dim("seq", min=2, max=64)
    ids, keep = torch.randint(0, 50, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    return model, dynvm.compile(model, (ids, keep), ({0: batch, 1: seq}, {0: batch, 1: seq}))


def _kernel(program, ids, keep, fold=True, monkeypatch=None):
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: ids,
                                        region.live_in[1].index: keep})
    constants = [t.detach() for t in program.constants]
    if not fold:
        monkeypatch.setattr(precision, "fold_shape_constants",
                            lambda spec, *a, **k: (spec, ""))
    kernel = compile_kernel(spec, program, constants, torch.device("cpu"), "test", "strong",
                            CpuOptions(fusion="always", precision="bf16",
                                       prepacked=PrepackCache()))
    if not fold:
        monkeypatch.undo()
    return region, spec, kernel


@pytest.mark.parametrize("shifted", [False, True])
def test_the_prologues_index_ops_leave_the_kernel_with_the_same_bits(shifted, monkeypatch):
    model, program = _program(shifted=shifted)
    gen = torch.Generator().manual_seed(3)
    for batch, seq in ((1, 16), (3, 9), (2, 40)):
        ids, keep = torch.randint(0, 50, (batch, seq), generator=gen), _keep(batch, seq, gen)
        region, _, kernel = _kernel(program, ids, keep)
        _, _, plain = _kernel(program, ids, keep, fold=False, monkeypatch=monkeypatch)
        assert NOTE in kernel.source and NOTE not in plain.source, kernel.source
        assert kernel.source.count("ARANGE") < plain.source.count("ARANGE")
        assert kernel.source.count("UNSQUEEZE") < plain.source.count("UNSQUEEZE")
        with torch.no_grad():
            want = model(ids, keep)
        first = run_kernel(region, kernel.fn, ids, keep)
        # twice: nothing the kernel keeps as a constant was changed by its first call
        for got in (first, run_kernel(region, kernel.fn, ids, keep)):
            assert torch.equal(got, run_kernel(region, plain.fn, ids, keep)), (batch, seq)
            assert _relative(got, want) < BF16_RELATIVE, (batch, seq)
        other = _keep(batch, seq, gen)
        assert torch.equal(run_kernel(region, kernel.fn, ids, other),
                           run_kernel(region, plain.fn, ids, other))


def test_a_value_written_in_place_by_a_remaining_op_is_not_a_constant():
    # `arange(s) + keep[0, :1]`: in-place reuse writes the ADD into the ARANGE's result,
    # so the ARANGE runs on each call; the other ARANGEs are folded.
    _, program = _program(shifted=True)
    ids, keep = torch.randint(0, 50, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: ids,
                                        region.live_in[1].index: keep})
    aranges = {op.dsts[0] for op in spec.ops if op.opcode == "ARANGE"}
    written = {op.args[0].reg for op in spec.ops if op.variant == "inplace"
               and op.args[0] in [Var(r) for r in aranges] and op.opcode == "ADD"
               and isinstance(op.args[1], Var) and op.args[1].reg not in aranges}
    assert written and len(aranges) > len(written)
    folded, note = fold_shape_constants(spec, [t.detach() for t in program.constants],
                                        torch.device("cpu"), variant=PRECISION_VARIANT)
    assert note
    assert {op.dsts[0] for op in folded.ops if op.opcode == "ARANGE"} == written


def test_large_folded_values_run_on_each_call(monkeypatch):
    # The position embedding of a constant index is a [1, s, width] value: over the cap
    # it stays an EMBEDDING op reading folded ids; under it, a constant (here taken as
    # a gather, not as a view of its table: Note [Embeddings of constant ids as views]).
    monkeypatch.setattr(shape_constants, "_rows_view", lambda *a: None)
    _, program = _program(width=512)
    ids, keep = torch.randint(0, 50, (2, 64)), torch.ones(2, 64, dtype=torch.long)
    assert MAX_BYTES < 64 * 512 * 4
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: ids,
                                        region.live_in[1].index: keep})
    constants = [t.detach() for t in program.constants]
    folded, _ = fold_shape_constants(spec, constants, torch.device("cpu"),
                                     variant=PRECISION_VARIANT)
    assert [op.opcode for op in folded.ops].count("EMBEDDING") == 2
    monkeypatch.setattr("dynvm.jit.backends.cpu.shape_constants.MAX_BYTES", 1 << 20)
    folded, _ = fold_shape_constants(spec, constants, torch.device("cpu"),
                                     variant=PRECISION_VARIANT)
    assert [op.opcode for op in folded.ops].count("EMBEDDING") == 1


def test_runtimes_serve_random_shape_sequences_and_families():
    model, program = _program(shifted=True)

    def inputs(batch, seq, step, gen):
        ids, keep = torch.randint(0, 50, (batch, seq), generator=gen), _keep(batch, seq, gen)
        if step % 2:       # offset ids and a strided mask
            ids = torch.randint(0, 50, (batch + 1, seq), generator=gen)[1:]
            keep = keep.t().contiguous().t()
        return ids, keep

    sources = serve_random_shapes(program, model, inputs, seed=17)
    assert sources and all(NOTE in s for s in sources), sources


def test_embeddings_of_constant_ids_are_views_of_their_table(monkeypatch):
    # Note [Embeddings of constant ids as views]: the position embedding of a constant
    # index, over MAX_BYTES, is kept as a view of the table; the kernel gives the bits
    # of the kernel that gathers it on each call, twice, over offset ids.
    model, program = _program(width=512)
    gen = torch.Generator().manual_seed(9)
    table = program.constants[[i for i, c in enumerate(program.constants)
                               if tuple(c.shape) == (128, 512)][0]]
    for batch, seq in ((1, 64), (3, 17)):
        ids = torch.randint(0, 50, (batch + 1, seq), generator=gen)[1:]
        keep = _keep(batch, seq, gen)
        region, spec, kernel = _kernel(program, ids, keep)
        assert "1 embedding(s) of constant ids as views" in kernel.source, kernel.source
        folded, _ = fold_shape_constants(spec, [t.detach() for t in program.constants],
                                         torch.device("cpu"), variant=PRECISION_VARIANT)
        views = [op.args[0].value for op in folded.ops if op.opcode == "SHAPE_CONSTANT"
                 and op.args[0].value.dim() == 3]
        assert [v.untyped_storage().data_ptr() for v in views] == \
            [table.untyped_storage().data_ptr()]
        assert views[0].nbytes > MAX_BYTES or seq < 64   # kept whatever its size
        monkeypatch.setattr(shape_constants, "_rows_view", lambda *a: None)
        _, _, gathered = _kernel(program, ids, keep)
        monkeypatch.undo()
        assert "as views" not in gathered.source
        with torch.no_grad():
            want = model(ids, keep)
        for _ in range(2):
            got = run_kernel(region, kernel.fn, ids, keep)
            assert torch.equal(got, run_kernel(region, gathered.fn, ids, keep)), (batch, seq)
            assert _relative(got, want) < BF16_RELATIVE


@pytest.mark.parametrize("ids, strides", [
    (torch.arange(5)[None], (0, 4, 1)),                  # positions 0..4
    (torch.arange(2, 7)[None].expand(3, 5), (0, 4, 1)),  # offset, expanded over a batch
    (torch.zeros(1, 5, dtype=torch.long).expand(3, 5), (0, 0, 1)),   # token types, all 0
    (torch.tensor([[0, 2, 1]]), None),                   # not a fixed step
    (torch.arange(4, -1, -1)[None], None),               # a negative step
])
def test_a_gather_is_a_view_only_where_its_ids_step_through_rows(ids, strides):
    table = torch.randn(8, 4)
    op = SpecOp("EMBEDDING", (2,), (ConstRef(0), Var(1), -1), 0)
    gathered = torch.nn.functional.embedding(ids, table)
    view = shape_constants._rows_view(op, gathered, {1: ids}, [table])
    if strides is None:
        assert view is None
    else:
        assert view.stride() == strides and torch.equal(view, gathered)
        assert view.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()


def test_a_table_view_is_taken_only_beside_a_dense_operand():
    dense = torch.empty(2, 5, 4, device="meta")
    strided = dense.transpose(0, 1)
    ops = [SpecOp("ADD", (3,), (Var(1), Var(2)), 0, variant="inplace"),
           SpecOp("ADD", (4,), (Var(2), Var(1)), 0, variant="inplace"),
           SpecOp("CAT", (5,), ([Var(1), Var(2)], 0), 0)]
    probes = [{1: dense, 2: dense.clone()}]
    assert shape_constants._dense_partner(2, [0], ops, probes)       # writes into 1
    assert not shape_constants._dense_partner(2, [1], ops, probes)   # writes into 2
    assert not shape_constants._dense_partner(2, [2], ops, probes)   # not elementwise
    assert not shape_constants._dense_partner(2, [0], ops, [{1: strided, 2: dense}])
