"""`dynvm.Runtime` validates its inputs against the program's signature (the
SHAPE_ASSERT / DIMS_EQUAL instructions at the program's entry) with errors that name the
input, the dim, the expected and the actual value; `stats()` counts calls and work; and
the frontend rejects operators it has no instruction for, naming the user's source line.
"""

from __future__ import annotations

import inspect
import random
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import dynvm
from tests.vm import _programs

compiled, demo = _programs.compiled, _programs.demo


@pytest.fixture(scope="module")
def transformer():
    return dynvm.Runtime(compiled("transformer"))


@pytest.fixture(scope="module")
def recommender():
    return dynvm.Runtime(compiled("recommender"))


def raises_naming(exc_types, call, *fragments: str) -> str:
    with pytest.raises(exc_types) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


INPUT_ERRORS = (dynvm.ShapeError, dynvm.InputError)


# ---------------------------------------------------------------- the transformer ------
# x: float32 [batch 1..64, seq 2..512, 256]


def test_valid_input_runs(transformer):
    x = torch.randn(2, 3, 256)
    with torch.inference_mode():
        expected = demo("transformer").module(x)
    torch.testing.assert_close(transformer(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 256), (1, 2, 3, 256), ()])
def test_wrong_rank(transformer, shape):
    raises_naming(dynvm.ShapeError, lambda: transformer(torch.randn(shape)),
                  "input 'x'", "expected rank 3", f"has rank {len(shape)}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64])
def test_wrong_dtype(transformer, dtype):
    x = torch.zeros(2, 4, 256, dtype=dtype)
    raises_naming(dynvm.ShapeError, lambda: transformer(x),
                  "input 'x'", "expected dtype torch.float32", f"got {dtype}")


def test_dynamic_dim_above_its_max(transformer):
    raises_naming(dynvm.ShapeError, lambda: transformer(torch.randn(65, 2, 256)),
                  "input 'x'", "dim 0", "batch", "[1, 64]", "is 65")


def test_dynamic_dim_below_its_min(transformer):
    raises_naming(dynvm.ShapeError, lambda: transformer(torch.randn(2, 1, 256)),
                  "input 'x'", "dim 1", "seq", "[2, 512]", "is 1")


def test_dynamic_dim_of_zero(transformer):
    raises_naming(dynvm.ShapeError, lambda: transformer(torch.randn(0, 4, 256)),
                  "input 'x'", "dim 0", "[1, 64]", "is 0")


def test_static_dim_wrong(transformer):
    raises_naming(dynvm.ShapeError, lambda: transformer(torch.randn(2, 4, 128)),
                  "input 'x'", "dim 2", "expected 256", "is 128")


def test_bounds_are_inclusive(transformer):
    assert transformer(torch.randn(1, 2, 256)).shape == (1, 2, 256)
    assert transformer(torch.randn(64, 2, 256)).shape == (64, 2, 256)


@pytest.mark.parametrize("inputs", [(), (torch.randn(2, 4, 256), torch.randn(2, 4, 256))])
def test_wrong_number_of_inputs(transformer, inputs):
    raises_naming(dynvm.InputError, lambda: transformer(*inputs),
                  "takes 1 inputs", "(x)", f"got {len(inputs)}")


@pytest.mark.parametrize("value", [3.0, "x", None, [[1.0]]])
def test_non_tensor_input(transformer, value):
    raises_naming(INPUT_ERRORS, lambda: transformer(value),
                  "input 'x'", "expected a tensor", f"got {type(value).__name__}")


def test_errors_are_value_and_type_errors(transformer):
    # Callers that catch the builtin families still catch dynvm's errors.
    with pytest.raises(ValueError):
        transformer(torch.randn(2, 4, 128))
    with pytest.raises(TypeError):
        transformer()


# ---------------------------------------------------------------- the recommender ------
# dense float32 [batch, 13], sparse0..3 int64 [batch, 3/5/1/4], one shared batch dim.


def _recommender_inputs(batch: int = 4) -> list[torch.Tensor]:
    dm = demo("recommender")
    inputs = list(dm.sample_inputs(random.Random(0)))
    return [x[:1].expand(batch, *x.shape[1:]).contiguous() for x in inputs]


def test_recommender_valid_inputs_run(recommender):
    inputs = _recommender_inputs()
    with torch.inference_mode():
        expected = demo("recommender").module(*inputs)
    torch.testing.assert_close(recommender(*inputs), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", [1, 4])
def test_mismatched_shared_dim(recommender, which):
    inputs = _recommender_inputs(4)
    inputs[which] = inputs[which][:3]
    raises_naming(dynvm.ShapeError, lambda: recommender(*inputs),
                  f"input 'sparse{which - 1}' dim 0", "input 'dense' dim 0", "batch",
                  "got 3", "expected 4")


def test_dense_batch_differs_from_all_sparse(recommender):
    inputs = _recommender_inputs(4)
    inputs[0] = torch.randn(5, 13)
    raises_naming(dynvm.ShapeError, lambda: recommender(*inputs),
                  "input 'sparse0' dim 0", "'dense'", "got 4", "expected 5")


def test_wrong_dtype_of_a_later_input(recommender):
    inputs = _recommender_inputs()
    inputs[2] = inputs[2].to(torch.int32)
    raises_naming(dynvm.ShapeError, lambda: recommender(*inputs),
                  "input 'sparse1'", "expected dtype torch.int64", "got torch.int32")


def test_static_bag_dim_wrong(recommender):
    inputs = _recommender_inputs()
    inputs[2] = torch.zeros(4, 6, dtype=torch.int64)
    raises_naming(dynvm.ShapeError, lambda: recommender(*inputs),
                  "input 'sparse1'", "dim 1", "expected 5", "is 6")


def test_recommender_wrong_number_of_inputs(recommender):
    inputs = _recommender_inputs()
    raises_naming(dynvm.InputError, lambda: recommender(*inputs[:3]),
                  "takes 5 inputs", "dense, sparse0, sparse1, sparse2, sparse3", "got 3")


# ---------------------------------------------------------------- the gnn ------------
# x float32 [num_nodes 2..4096, 64], edge_index int64 [2, num_edges 2..16384]


def test_gnn_dims_named_after_the_users_dims():
    runtime = dynvm.Runtime(compiled("gnn"))
    edges = torch.zeros(2, 5, dtype=torch.int64)
    raises_naming(dynvm.ShapeError, lambda: runtime(torch.randn(1, 64), edges),
                  "input 'x'", "dim 0", "num_nodes", "[2, 4096]", "is 1")
    raises_naming(dynvm.ShapeError,
                  lambda: runtime(torch.randn(3, 64), torch.zeros(2, 1, dtype=torch.int64)),
                  "input 'edge_index'", "dim 1", "num_edges", "[2, 16384]", "is 1")
    raises_naming(dynvm.ShapeError,
                  lambda: runtime(torch.randn(3, 64), torch.zeros(3, 5, dtype=torch.int64)),
                  "input 'edge_index'", "dim 0", "expected 2", "is 3")


# ---------------------------------------------------------------- jit=False, stats ---


def test_jit_false_runs_the_pure_interpreter_and_counts():
    program = compiled("branchy")
    runtime = dynvm.Runtime(program, jit=False)
    stats = runtime.stats()
    assert stats["calls"] == 0 and stats["instructions_executed"] == 0
    assert stats["region_count"] == len(program.regions)
    assert stats["instructions"] == len(program.code)
    assert stats["device"] == "cpu"
    dm = demo("branchy")
    previous = 0
    for calls in range(1, 6):
        (x,) = dm.sample_inputs(random.Random(calls))
        with torch.inference_mode():
            expected = dm.module(x)
        torch.testing.assert_close(runtime(x), expected, rtol=1e-5, atol=1e-5)
        stats = runtime.stats()
        assert stats["calls"] == calls
        grown = stats["instructions_executed"] - previous
        # One path through the code: more than the entry check, at most all of it.
        assert 1 < grown <= len(program.code)
        previous = stats["instructions_executed"]


def test_straight_line_program_executes_every_instruction_per_call():
    program = compiled("recommender")
    runtime = dynvm.Runtime(program, jit=False)
    inputs = _recommender_inputs(2)
    for calls in range(1, 4):
        runtime(*inputs)
        assert runtime.stats()["calls"] == calls
        assert runtime.stats()["instructions_executed"] == calls * len(program.code)


def test_rejected_inputs_are_not_counted_as_calls():
    runtime = dynvm.Runtime(compiled("recommender"))
    with pytest.raises(dynvm.ShapeError):
        runtime(*_recommender_inputs()[:4], torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(dynvm.InputError):
        runtime()
    assert runtime.stats()["calls"] == 0


# ---------------------------------------------------------------- unsupported ops ----


class UsesBessel(torch.nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x).sum(0)  # the line the error must point at


class UsesDet(torch.nn.Module):
    def forward(self, x):
        return torch.linalg.det(x.view(-1, 2, 4)[..., :2])  # the line the error must point at


def _line_of(cls) -> int:
    lines, first = inspect.getsourcelines(cls.forward)
    offset = next(i for i, line in enumerate(lines) if "must point at" in line)
    return first + offset


@pytest.mark.parametrize("module, op", [(UsesBessel, "aten.special_bessel_j0"),
                                        (UsesDet, "aten._linalg_det")])
def test_unsupported_op_names_op_source_line_and_supported_ops(module, op):
    batch = Dim("batch", min=1, max=64)
    with pytest.raises(dynvm.UnsupportedOpError) as info:
        dynvm.compile(module(), (torch.randn(4, 8),), ({0: batch},))
    message = str(info.value)
    assert op in message
    assert f"{Path(__file__).resolve()}:{_line_of(module)}" in message, message
    assert "in forward" in message
    assert "Supported ATen operators:" in message
    supported = message.split("Supported ATen operators:", 1)[1]
    assert "aten.linear.default" in supported and "aten.embedding.default" in supported
    assert op not in supported
