"""CUDA graphs (dynvm.jit.backends.triton.graphs, Note [CUDA graph outputs]): the output
pool's ownership rule and the capture policy on any machine; capture and replay, and the
JIT's use of them, on a GPU (gpu marker)."""

from __future__ import annotations

import importlib

import pytest
import torch

from dynvm.jit.backends.triton.graphs import (
    OutputPool,
    _use_count,
    graph_batch,
    maybe_capture,
    static_tensor,
)
from dynvm.jit.guards import GuardStrength, strong_signer

h = importlib.import_module("tests.jit._jit_helpers")


def _signature(*tensors):
    regs = list(tensors)
    return strong_signer(tuple(range(len(regs))))(regs)


def test_a_pooled_buffer_is_rewritten_only_once_nobody_refers_to_it():
    if _use_count(torch.empty(1)) is None:
        pytest.skip("this torch has no storage use count: the pool only copies out")
    pool = OutputPool()
    graph_output = torch.arange(6.0).reshape(2, 3)      # what a replay wrote
    first = pool.take(graph_output)
    torch.testing.assert_close(first, graph_output)
    assert first.untyped_storage().data_ptr() != graph_output.untyped_storage().data_ptr()
    graph_output.add_(100)                               # the next replay overwrites it
    assert first[0, 0].item() == 0.0                     # the caller's copy is its own
    held_row = first[1]                                  # a view keeps the buffer busy
    del first
    second = pool.take(graph_output)
    assert held_row.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert held_row.tolist() == [3.0, 4.0, 5.0] and pool.allocated == 2
    array = second.numpy()                               # so does a NumPy array over it
    del second
    third = pool.take(graph_output)
    assert pool.allocated == 3 and array[0, 0] == 100.0
    assert third.untyped_storage().data_ptr() not in (
        held_row.untyped_storage().data_ptr(), torch.from_numpy(array).data_ptr())
    del held_row, third
    fourth = pool.take(graph_output * 2)                  # a buffer nobody holds: reused
    assert pool.reused == 1 and pool.allocated == 3
    assert fourth[0, 0].item() == 200.0 and array[0, 0] == 100.0


def test_static_inputs_have_the_signatures_exact_layout():
    base = torch.randn(5, 8)
    view = base[1:, ::2]                                  # offset 8, strides (8, 2)
    (entry,) = _signature(view)
    static = static_tensor(entry)
    assert static.shape == view.shape and static.stride() == view.stride()
    assert static.storage_offset() == view.storage_offset() and static.dtype == view.dtype
    static.copy_(view)
    torch.testing.assert_close(static, view)
    assert _signature(static) == _signature(view)         # the same guard passes


def test_only_small_exact_cuda_specializations_are_captured():
    def fn(regs):
        return None

    class Ir:
        live_in, outputs, dead_live_ins = (0,), ((1, None),), ()

    small = _signature(torch.empty(4, 8))
    big = _signature(torch.empty(64, 8))
    assert graph_batch(small) == 4 and graph_batch(big) == 64
    for device, strength, signature, limit in (
            ("cpu", GuardStrength.STRONG, small, 16),       # not CUDA
            ("cuda", GuardStrength.FAMILY, small, 16),      # a family: shapes vary
            ("cuda", GuardStrength.STRONG, big, 16),        # past the batch limit
            ("cuda", GuardStrength.STRONG, small, 0)):      # off
        assert maybe_capture(fn, strength, signature, Ir, torch.device(device),
                             limit) == (fn, None)


@pytest.mark.gpu
def test_a_captured_region_replays_and_never_hands_out_graph_memory():
    from dynvm.jit.backends.triton.graphs import GraphedRegion

    weight = torch.randn(8, 8, device="cuda")

    def fn(regs):
        regs[1] = torch.relu(regs[0] @ weight) + 1.0
        regs[0] = None

    x = torch.randn(4, 8, device="cuda")
    graphed = GraphedRegion(fn, _signature(x), (0,), (1,), (0,), torch.device("cuda"))
    outs = []
    for i in range(3):
        regs = [x * (i + 1), None]
        graphed(regs)
        assert regs[0] is None
        outs.append(regs[1])
    for i, out in enumerate(outs):                        # earlier outputs survive replays
        torch.testing.assert_close(out, torch.relu((x * (i + 1)) @ weight) + 1.0)
    assert graphed.replays == 3 and len({o.data_ptr() for o in outs}) == 3


@pytest.mark.gpu
def test_the_jit_captures_small_exact_specializations_on_cuda():
    import dynvm

    program = h.compiled("transformer")
    config = h.eager_config(backend="triton", families=False)
    runtime = dynvm.Runtime(program, "cuda", jit=config)
    reference = dynvm.Runtime(program, "cpu", jit=False)
    x = torch.randn(2, 8, h.SMALL_TRANSFORMER["hidden"])
    outs = [runtime(x.cuda()) for _ in range(4)]
    notes = [n for a in runtime.jit.artifacts.values() for n in a.notes]
    assert any(n.startswith("cuda graph: captured") for n in notes), notes
    for out in outs:
        torch.testing.assert_close(out.cpu(), reference(x), rtol=1e-4, atol=1e-4)
