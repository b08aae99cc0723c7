"""Which operations write into the arena: chosen by measurement on this device.

Note [Arena by measurement]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
An `out=` form exists for most operations (Note [Arena layout]), but whether writing a
result into a planned arena block is cheaper than letting the kernel allocate depends on
the device, the operation and its size, not on the form existing. Measured on this
2-core CPU, the demo encoder's family kernel ran at 0.946x eager without the arena and
1.064x with it: the CPU allocator hands back the cache-warm block of the size just
freed almost for free, and `linear(..., out=)` / `native_layer_norm.out` take slower
paths through ATen than their allocating forms. On a GPU, where an allocation may
synchronize, the answer differs.

So, when `CpuOptions.arena_ops` is "measured", each operation planned into the arena is
first calibrated (Note [Calibration]): the allocating form (the default) against the
`out=` form writing into zero-size tensors over one buffer, resized per call as a
family kernel's are, on zero-filled operands of the planning probe's shapes, dtypes and
strides (zeros are valid indices for the gathers; the program's constants are used as
they are). The out= form is planned only where it measures faster by the calibrator's
margin. The answer is cached per device and (opcode, dtype, size classes of the result
and of the operands), so a process calibrates each kind of operation once, at its first
compile, on the compile thread.

A family kernel runs each op at every size of its bucket, and the answer changes with
size (gnn's LINEARs, one calibration at load 5: 32K-64K-element results, allocate 98 us
and out= 49 us; 16K-32K, 41.2 and 41.4 us; 4K-8K, 18.0 and 18.1 us: a tie, where the
default stays). So a family's op is asked at both ends of its sizes, the planning
probe and the probe where its result is smallest, and written into the arena only where
out= pays at both (cpu.plan_arena_layout).
"""

from __future__ import annotations

import torch

from dynvm.jit.calibration import Calibrator, size_class
from dynvm.vm.opcodes import opcode

ALLOCATE, OUT = "allocate", "out"


def _key(result: torch.Tensor, operands: list) -> tuple:
    numel = sum(t.numel() for t in tensors_in(operands))
    return (str(result.dtype), size_class(result.numel()), size_class(numel))


def tensors_in(values):
    """The tensors among `values`, lists and tuples of them opened, in order."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list | tuple):
            yield from tensors_in(value)


def out_form_pays(name: str, form, meta_operands: list, result: torch.Tensor,
                  real_operands, device: torch.device, calibrator: Calibrator) -> bool:
    """Whether op `name` should write its result into the arena (Note [Arena by
    measurement]). `real_operands()` builds runnable operands; it is called only when
    the answer is not cached yet."""
    key = _key(result, meta_operands)
    choice = calibrator.known("arena:" + name, key)
    if choice is None:
        operands = real_operands()
        scratch = list(form.scratch(*meta_operands)) if form.scratch is not None else []
        outs = _out_tensors([result, *scratch], device)
        impl = opcode(name).impl

        def allocate():
            impl(*operands)

        def into_out():
            for out in outs:
                out.resize_(0)
            form.fn(*operands, *outs)

        choice = calibrator.choose("arena:" + name, key, {ALLOCATE: allocate,
                                                          OUT: into_out})
    return choice.name == OUT


def _out_tensors(like: list, device: torch.device) -> list:
    """Zero-size tensors over one buffer, at aligned offsets, as an arena lease has."""
    sizes = [t.numel() * t.element_size() for t in like]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += (size + 63) // 64 * 64
    storage = torch.empty(max(total, 1), dtype=torch.uint8, device=device).untyped_storage()
    outs = []
    for template, offset in zip(like, offsets):
        out = torch.empty(0, dtype=template.dtype, device=device)
        out.set_(storage, offset // template.element_size(), (0,), (1,))
        outs.append(out)
    return outs


def zeros_like_abstract(value, device: torch.device):
    """A real zero-filled tensor with a meta tensor's shape, dtype and strides."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                               device=device).zero_()
