"""The scheduler's cache when the generator decodes over the KV cache as state (its
programs have `decode_kv`, Note [KV cache as state] in dynvm.vm.ops_kv): one slot of
the generator's `KvState` per running sequence, taken when its prompt is written and
given back when it leaves. A join writes the new prompt's keys and values into its slot
and a leave writes nothing: no running sequence's cache is copied (Note [Slots instead
of copies]).

Note [Slots instead of copies]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Over the plain caches (Note [Continuous batching over plain caches] in
dynvm.cluster.serving._generate_scheduler) every join and leave copies the whole batch's cache.
Over the state, a sequence's keys and values stay in their slot for its whole life:
the decode step takes each row's slot and length (DECODE_ATTN reads slot[b]'s first
lengths[b] positions), so rows can be any slots in any order and the batch changes
between steps with no copy. Slots are handed out lowest first, and the rows are kept in
slot order, so that a batch whose slots are consecutive is read as a view (DECODE_ATTN's
fast path) rather than gathered. The whole state is zeroed once, when the scheduler
takes it: DECODE_ATTN reads every row up to the longest row's length, and a masked
position must hold a finite value (0 x NaN is NaN; the state is allocated with
torch.empty), which a slot's stale keys from an earlier sequence are. The state is the
generator's own (`Generator.state`), allocated once at max_batch x max_length.
"""

from __future__ import annotations

import heapq

import torch


class SlotCache:
    """Slots of a generator's KV state for the scheduler's running sequences."""

    def __init__(self, generator) -> None:
        self.generator = generator
        self.state = generator.state
        for tensor in self.state.tensors:  # Note [Slots instead of copies]: finite
            tensor.zero_()
        self.free = list(range(self.state.slots))
        heapq.heapify(self.free)
        self.slot_of: dict[int, int] = {}     # sequence id -> slot
        self.length_of: dict[int, int] = {}   # sequence id -> tokens in its slot
        self.written_bytes = 0                # prompts written into slots
        self.used = 0   # tokens in all slots: read by other threads, so kept as one int

    def __len__(self) -> int:
        return len(self.slot_of)

    def admit(self, seqs, keys, values, mask: torch.Tensor) -> None:
        """Write each sequence's prompt keys and values (a row of the prefill's
        left-padded [B, Hkv, T, D] per layer) into a slot of its own."""
        width = mask.shape[1]
        lengths = mask.sum(dim=-1).tolist()
        for row, (seq, length) in enumerate(zip(seqs, lengths)):
            slot = heapq.heappop(self.free)
            self.slot_of[seq.id] = slot
            self.length_of[seq.id] = length
            self.used += length
            for cache, new in zip(self.state.tensors, (*keys, *values)):
                cache[slot, :, :length] = new[row, :, width - length:]
                self.written_bytes += new[row].numel() // width * length * new.element_size()

    def release(self, seq) -> None:
        """Give the sequence's slot back (nothing is copied)."""
        slot = self.slot_of.pop(seq.id, None)
        self.used -= self.length_of.pop(seq.id, 0)
        if slot is not None:
            heapq.heappush(self.free, slot)

    def order(self, seqs) -> list:
        """The running sequences in slot order (Note [Slots instead of copies])."""
        return sorted(seqs, key=lambda seq: self.slot_of[seq.id])

    def decode(self, seqs) -> torch.Tensor:
        """One decode step of these sequences (in slot order) on their last tokens:
        appends each one's key and value in its slot; the last logits [B, V]."""
        device = self.state.tensors[0].device
        tokens = torch.tensor([[seq.tokens[-1]] for seq in seqs], dtype=torch.long,
                              device=device)
        slots = torch.tensor([self.slot_of[seq.id] for seq in seqs], dtype=torch.long,
                             device=device)
        lengths = torch.tensor([self.length_of[seq.id] for seq in seqs], dtype=torch.long,
                               device=device)
        logits = self.generator.decode_kv(tokens, slots, lengths, self.state.keys,
                                          self.state.values)
        for seq in seqs:
            self.length_of[seq.id] += 1
        self.used += len(seqs)
        return logits

    def used_tokens(self) -> int:
        """Tokens the running sequences hold in their slots (any thread)."""
        return self.used
