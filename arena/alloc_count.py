"""Count the tensor allocations of a call: how many fresh storages its ATen ops create.

The point of an arena is to take allocations off the request path, so the test of a
planned specialization is that its forward allocates (almost) nothing. This module
measures that with a dispatch mode, which sees every ATen op that reaches the Python
dispatch key.

Note [What counts as an allocation]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An op's output counts when its storage is not the storage of any of the op's tensor
inputs, compared by the storage's data pointer *before* the op runs:

- in-place ops (`add_`) and `out=` ops write into an input's storage: not counted;
- views (`view`, `t`, slicing) share their input's storage: not counted;
- an `out=` tensor too small for the result is resized, which moves its storage to
  new memory: counted, because it really allocated;
- several outputs of one op that share one new storage count once.

Storages of zero bytes are never counted: they allocate nothing, and their data
pointer may be null (or shared), so it could not be compared anyway. The same goes for
storages with no memory behind them (meta and fake tensors, whose pointer is null).

Only ops dispatched on the calling thread while the mode is active are seen (dispatch
modes are thread-local). Temporaries that a kernel allocates inside its own C++ code
(below the dispatcher's Python key, e.g. a workspace) are not seen; everything an op
returns is. While a handler runs, torch takes the mode off the stack, so ops that the
kernel dispatches are not seen twice.

Note [Composite ops under inference mode]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Composite ops (CompositeImplicitAutograd: `linear`, `matmul`, `layer_norm`,
`scaled_dot_product_attention`, `reshape`, ...) are normally decomposed at the autograd
key, before a dispatch mode sees them, so the mode sees `t` + `addmm` for `linear`.
Under `torch.inference_mode()` the autograd keys are skipped and the mode receives the
composite op whole; run as one op with the mode popped, its internal allocations would
be invisible (measured with torch 2.13: scaled_dot_product_attention on CPU counted 1
instead of the 5 buffers its math path allocates, layer_norm 1 instead of 3). So the
counter runs the op's C++ decomposition itself, with the mode pushed again, and counts
the ops it dispatches; the composite's own outputs are those ops' outputs, so nothing is
counted twice. It calls the C++ kernel rather than `OpOverload.decompose`, which prefers
torch's Python decompositions: those are for tracing and may allocate differently (the
Python `matmul.out` computes into a fresh tensor and copies it into `out`, the C++ one
writes into `out`). With this, counts are the same with grad, no_grad and inference_mode.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


class AllocationCounter(TorchDispatchMode):
    """Counts fresh storages created by ATen ops while active (Note [What counts as an
    allocation]). `count` is the total; `by_op` breaks it down by op name, which is what
    to read when a count is higher than expected."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE):
            # Note [Composite ops under inference mode]: run the C++ decomposition with
            # this mode pushed again, so that its own ops are counted, not it.
            with self:
                return func._op_dk(_COMPOSITE, *args, **kwargs)
        inputs = {_pointer(t) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        result = func(*args, **kwargs)
        fresh = {_pointer(t) for t in pytree.tree_leaves(result)
                 if isinstance(t, torch.Tensor)} - inputs - {0}
        if fresh:
            self.count += len(fresh)
            self.by_op[str(func)] += len(fresh)
        return result


def count_allocations(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Run `fn(*args, **kwargs)` and return its result and the number of fresh tensor
    storages its ATen ops created. Works under `torch.inference_mode()` and no_grad."""
    with AllocationCounter() as counter:
        result = fn(*args, **kwargs)
    return result, counter.count


def _pointer(tensor: torch.Tensor) -> int:
    """The data pointer of the tensor's storage, or 0 when it has no bytes to compare."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return 0  # a tensor without a storage (sparse, some subclasses): nothing to count
    return storage.data_ptr() if storage.nbytes() > 0 else 0
