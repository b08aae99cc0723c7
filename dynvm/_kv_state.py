"""`KvState`: the KV cache a stateful step program writes in place (Note [KV cache as
state] in dynvm.vm.ops_kv), allocated once from the program's declared state inputs."""

from __future__ import annotations

import torch

from dynvm.vm.errors import InputError
from dynvm.vm.program import Program


class KvState:
    """One [slots, Hkv, capacity, D] tensor per layer for keys and one for values, at the
    upper bounds the program declares for its state inputs (max_batch slots of
    max_length positions): allocated once, reused by every generation. Row b of a batch
    lives in slot b (contiguous slots: DECODE_ATTN reads them as a view); the step
    program writes prompts and new tokens alike (dynvm._generation_kv)."""

    def __init__(self, program: Program, device: str | torch.device = "cpu") -> None:
        specs = [program.inputs[i] for i in program.state]
        if not specs or len(specs) % 2:
            raise InputError(f"{program.name}: expected keys and values state inputs, got "
                             f"{[s.name for s in specs]}")
        self.tensors = [torch.empty(tuple(d.high for d in spec.dims), dtype=spec.dtype,
                                    device=device) for spec in specs]
        half = len(self.tensors) // 2
        self.keys, self.values = self.tensors[:half], self.tensors[half:]
        self.slots, _, self.capacity, _ = self.tensors[0].shape

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: what a generator adds to one copy of the weights."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def begin(self, batch: int, span: int) -> torch.Tensor:
        """Slots 0..batch-1 for a generation that writes at most `span` positions; their
        first `span` positions are zeroed (DECODE_ATTN reads up to the longest row, and a
        masked position must hold a finite value: 0 x NaN is NaN). The slots tensor."""
        if batch > self.slots or span > self.capacity:
            raise InputError(f"KV state: a batch of {batch} rows of up to {span} tokens, "
                             f"expected at most {self.slots} rows of {self.capacity}")
        for tensor in self.tensors:
            tensor[:batch, :, :span].zero_()
        return torch.arange(batch, device=self.tensors[0].device)
