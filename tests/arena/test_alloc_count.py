"""Allocation counting: fresh storages count, in-place, out= and views do not, and the
counts are the same with and without inference mode."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dynvm.arena.alloc_count import AllocationCounter, count_allocations

GRAD_MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad,
              "inference": torch.inference_mode}


@pytest.fixture(params=sorted(GRAD_MODES))
def grad_mode(request) -> contextlib.AbstractContextManager:
    return GRAD_MODES[request.param]()


def test_out_of_place_op_counts_one(grad_mode):
    with grad_mode:
        a, b = torch.randn(4, 5), torch.randn(4, 5)
        result, count = count_allocations(lambda: a + b)
    assert count == 1
    assert torch.equal(result, a + b)


def test_in_place_op_counts_zero(grad_mode):
    with grad_mode:
        a, b = torch.randn(4, 5), torch.randn(4, 5)
        result, count = count_allocations(a.add_, b)
    assert count == 0 and result is a


def test_out_op_counts_zero(grad_mode):
    with grad_mode:
        a, b, c = torch.randn(4, 5), torch.randn(4, 5), torch.empty(4, 5)
        _, count = count_allocations(torch.add, a, b, out=c)
    assert count == 0


def test_out_op_into_a_view_of_a_buffer_counts_zero(grad_mode):
    # The JIT's shape of call: out= tensors are views into one preallocated arena.
    with grad_mode:
        arena = torch.empty(4096, dtype=torch.uint8)
        a, b = torch.randn(4, 5), torch.randn(5, 3)
        out = arena[256:256 + 4 * 3 * 4].view(torch.float32).view(4, 3)
        _, count = count_allocations(torch.matmul, a, b, out=out)
    assert count == 0
    assert torch.allclose(out, a @ b)


def test_out_op_that_must_resize_its_out_counts_one(grad_mode):
    with grad_mode:
        a, c = torch.randn(4, 5), torch.empty(0)
        _, count = count_allocations(torch.add, a, a, out=c)
    assert count == 1  # c was too small, so add moved it to new memory


def test_view_counts_zero(grad_mode):
    with grad_mode:
        a = torch.randn(4, 5)
        _, count = count_allocations(lambda: (a.view(-1), a.t(), a[1:], a.reshape(20)))
    assert count == 0


def test_reshape_that_must_copy_counts_one(grad_mode):
    with grad_mode:
        a = torch.randn(4, 5)
        _, count = count_allocations(lambda: a.t().reshape(-1))
    assert count == 1


def test_three_allocating_ops_count_three(grad_mode):
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)          # 1
        z = y * 2                  # 2
        z.add_(1)                  # in place: 0
        w = z.view(-1)             # view: 0
        return w.exp()             # 3

    with grad_mode:
        _, count = count_allocations(fn, torch.randn(8, 8))
    assert count == 3


def test_linear_forward(grad_mode):
    # Measured with torch 2.13 on CPU: nn.Linear is `linear` -> `t` (a view) + `addmm`
    # (`matmul` -> views + `mm` without bias), one allocation for a 2-D or 3-D input in
    # every grad mode; a ReLU after it adds one more.
    torch.manual_seed(0)
    with grad_mode:
        for bias in (True, False):
            linear = torch.nn.Linear(16, 32, bias=bias)
            for shape in ((4, 16), (2, 3, 16)):
                _, count = count_allocations(linear, torch.randn(shape))
                assert count == 1, (bias, shape)
        linear, x = torch.nn.Linear(16, 32), torch.randn(4, 16)
        counter = AllocationCounter()
        with counter:
            torch.relu(linear(x))
    assert counter.count == 2
    assert dict(counter.by_op) == {"aten.addmm.default": 1, "aten.relu.default": 1}


def test_composite_ops_count_the_same_in_every_grad_mode():
    # Note [Composite ops under inference mode]: without the decomposition the counter
    # saw scaled_dot_product_attention as 1 allocation under inference_mode, 5 otherwise.
    q = torch.randn(2, 3, 8)
    weight, bias = torch.ones(8), torch.zeros(8)

    def fn() -> torch.Tensor:
        x = torch.nn.functional.layer_norm(q, (8,), weight, bias)
        return torch.nn.functional.scaled_dot_product_attention(x, x, x)

    counts = {}
    for name, mode in GRAD_MODES.items():
        with mode():
            _, counts[name] = count_allocations(fn)
    assert len(set(counts.values())) == 1, counts
    assert counts["grad"] >= 2  # at least the norm's and the attention's outputs


def test_composite_out_op_writes_into_its_out(grad_mode):
    # matmul is composite; its C++ decomposition writes into `out` (mm.out). Torch's
    # Python decomposition would compute into a fresh tensor and copy: not what eager does.
    with grad_mode:
        a, b, out = torch.randn(2, 3, 4), torch.randn(4, 5), torch.empty(2, 3, 5)
        _, count = count_allocations(torch.matmul, a, b, out=out)
    assert count == 0


def test_nested_counters_each_count_once():
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x + 1).sin().mul(2)

    x = torch.randn(5)
    with AllocationCounter() as outer, AllocationCounter() as inner:
        fn(x)
    assert inner.count == 3 and outer.count == 3


def test_recursive_count_is_not_double_counted():
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1                      # 2 allocations

    def outer(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        y, n = count_allocations(inner, x)
        return y.neg(), n                     # 1 more

    (_, inner_count), outer_count = count_allocations(outer, torch.randn(5))
    assert inner_count == 2 and outer_count == 3


def test_op_whose_kernel_dispatches_more_ops_counts_its_outputs_once(grad_mode):
    # cdist's kernel runs further ops internally; only its result is a fresh storage
    # that escapes the op.
    with grad_mode:
        a = torch.randn(2, 6, 3)
        _, count = count_allocations(torch.cdist, a, a)
    assert count == 1


def test_op_with_several_outputs_counts_each_fresh_storage(grad_mode):
    with grad_mode:
        a = torch.randn(4, 6)
        (values, indices), count = count_allocations(torch.max, a, dim=1)
    assert count == 2
    assert values.shape == indices.shape == (4,)


def test_zero_byte_storages_are_not_counted(grad_mode):
    with grad_mode:
        _, count = count_allocations(lambda: (torch.empty(0), torch.zeros(3, 0) + 1))
    assert count == 0


def test_only_the_mode_scope_is_counted():
    counter = AllocationCounter()
    x = torch.randn(3)
    with counter:
        x + 1
    x + 2  # outside: not seen
    assert counter.count == 1
