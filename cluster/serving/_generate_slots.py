"""The scheduler's cache when the generator runs over the KV cache as state (its
programs have the `step`, Note [KV cache as state] in dynvm.vm.ops_kv): one slot of
the generator's `KvState` per sequence, taken when it joins and given back when it
leaves. Its prompt is written into its slot by the step program itself, chunk by chunk
(Note [Prompt chunks between decode steps]); a leave writes nothing: no running
sequence's cache is copied (Note [Slots instead of copies]).

Note [Prompt chunks between decode steps]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The step program takes T new tokens per row (Note [One step program for prompt and
decode] in dynvm._generation_kv), so a joining sequence's prompt need not be prefilled
whole in the step it joins: every scheduler step runs one decode call for the running
rows (T = 1) and at most one prompt call, whose rows and T fit what the step's token
budget leaves beside the running rows (at least `min_prompt_tokens`, so prompts always
progress; at most the program's chunk per row). The first prompting sequence in arrival
order fixes T (the rest of its prompt, the chunk or the budget, whichever is least);
the others whose rest is at least T ride along with T tokens each while the budget
lasts. A sequence whose prompt is complete gets its first token from that call's
logits and decodes from the next step on. So a long prompt costs every running
sequence a bounded delay per step instead of one step as long as the whole prompt
(inter-token latency p99 at 3-4x its p50 when prompts were prefilled whole), and no
call pads a row: rows of one call share T. A step is still two calls, though; with the
packed step (Note [One packed call per step] in dynvm._generation_kv) it is one
(`SlotCache.packed`): the running rows' tokens, then the prompting sequences' next
tokens in arrival order, each its whole rest while the budget lasts, so prompts of
different lengths share the call and the last one is cut wherever the budget ends.

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
    """Slots of a generator's KV state for the scheduler's sequences: prompts written in
    chunks (Note [Prompt chunks between decode steps]), then decoded."""

    def __init__(self, generator, pad_to: list[int] | None = None) -> None:
        self.generator = generator
        # Note [Decode rows padded to a plateau]: rows a pure decode step of n runs as
        # (pad_to[n]); only where a JIT made the plateaus' exact kernels.
        self.pad_to = pad_to if getattr(generator.step, "jit", None) is not None else None
        self.padded = 0   # pure decode calls run with dummy rows
        self.state = generator.state
        self.chunk = generator.chunk
        for tensor in self.state.tensors:  # Note [Slots instead of copies]: finite
            tensor.zero_()
        self.free = list(range(self.state.slots))
        heapq.heapify(self.free)
        self.slot_of: dict[int, int] = {}     # sequence id -> slot
        self.length_of: dict[int, int] = {}   # sequence id -> tokens in its slot
        self.prompt_tokens = 0                # prompt tokens written into slots
        self.used = 0   # tokens in all slots: read by other threads, so kept as one int

    def __len__(self) -> int:
        return len(self.slot_of)

    def take(self, seq) -> None:
        """A free slot for a joining sequence, empty until its prompt is written."""
        self.slot_of[seq.id] = heapq.heappop(self.free)
        self.length_of[seq.id] = 0

    def rest(self, seq) -> int:
        """Prompt tokens of the sequence not yet in its slot."""
        return len(seq.request.prompt) - self.length_of[seq.id]

    def prompt(self, seqs, budget: int) -> tuple[list, torch.Tensor | None]:
        """One step call writing the next chunk of the prompting sequences (in arrival
        order) within `budget` tokens (Note [Prompt chunks between decode steps]): the
        sequences whose prompt it completed and their last logits [n, V]."""
        steps = max(1, min(self.chunk, self.rest(seqs[0]), budget))
        rows = [seqs[0]] + [s for s in seqs[1:] if self.rest(s) >= steps]
        rows = rows[:max(1, budget // steps)]
        device = self.state.tensors[0].device
        tokens = torch.tensor([seq.request.prompt[self.length_of[seq.id]:][:steps]
                               for seq in rows], dtype=torch.long, device=device)
        logits = self._call(rows, tokens)
        for seq in rows:
            self.length_of[seq.id] += steps
        self.used += steps * len(rows)
        self.prompt_tokens += steps * len(rows)
        done = [i for i, seq in enumerate(rows) if self.rest(seq) == 0]
        if not done:
            return [], None
        return [rows[i] for i in done], logits[torch.tensor(done, device=logits.device)]

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
        logits = self._call(seqs, tokens)
        for seq in seqs:
            self.length_of[seq.id] += 1
        self.used += len(seqs)
        return logits

    def _call(self, seqs, tokens: torch.Tensor) -> torch.Tensor:
        device = tokens.device
        slots = torch.tensor([self.slot_of[seq.id] for seq in seqs], dtype=torch.long,
                             device=device)
        lengths = torch.tensor([self.length_of[seq.id] for seq in seqs], dtype=torch.long,
                               device=device)
        return self.generator.step(tokens, slots, lengths, self.state.keys,
                                   self.state.values)

    def packed(self, running, prompting, budget: int):
        """One packed call (Note [One packed call per step] in dynvm._generation_kv): the
        running sequences' (in slot order) last tokens and the next prompt tokens of the
        prompting ones in arrival order, each as many as the `budget` left allows (its
        whole rest when it fits). Returns the running rows' logits [B, V], the sequences
        whose prompt it completed, and their last logits."""
        tokens, slots, positions = [], [], []
        for seq in running:
            tokens.append(seq.tokens[-1])
            slots.append(self.slot_of[seq.id])
            positions.append(self.length_of[seq.id])
        room = min(budget, self.generator.max_tokens - len(running))
        pieces = []
        for seq in prompting:
            if room <= 0:
                break
            start, take = self.length_of[seq.id], min(self.rest(seq), room)
            tokens.extend(seq.request.prompt[start:start + take])
            slots.extend([self.slot_of[seq.id]] * take)
            positions.extend(range(start, start + take))
            pieces.append((seq, take, len(tokens) - 1))
            room -= take
        done = [(seq, end) for seq, take, end in pieces if take == self.rest(seq)]
        last = list(range(len(running))) + [end for _, end in done]
        if not pieces and self.pad_to is not None and self.pad_to[len(running)] > len(running):
            tokens, slots, positions, last = self._padded(tokens, slots, positions,
                                                          self.pad_to[len(running)])
        logits = self.generator.packed_call(
            torch.tensor(tokens), torch.tensor(slots), torch.tensor(positions),
            torch.tensor(last or [len(tokens) - 1]))
        for seq in running:
            self.length_of[seq.id] += 1
        for seq, take, _ in pieces:
            self.length_of[seq.id] += take
            self.prompt_tokens += take
        self.used += len(running) + sum(take for _, take, _ in pieces)
        return (logits[:len(running)], [seq for seq, _ in done],
                logits[len(running):len(running) + len(done)])

    def _padded(self, tokens, slots, positions, rows: int):
        """Note [Decode rows padded to a plateau]: a pure decode call's rows (in slot
        order) with dummy rows in the lowest free slots, up to `rows` if enough slots are
        free, merged in slot order: a dummy writes its key and value at position 0 of a
        free slot (the next sequence there writes its prompt over it) and attends to that
        alone. The call's tokens, slots and positions, and `last`: the real rows first,
        in their order, then the dummies (whose logits are dropped)."""
        extra = rows - len(tokens)
        if extra > len(self.free):
            return tokens, slots, positions, list(range(len(tokens)))
        self.padded += 1
        merged = sorted([(slot, i) for i, slot in enumerate(slots)] +
                        [(slot, -1) for slot in heapq.nsmallest(extra, self.free)])
        real, dummies = [0] * len(tokens), []
        for at, (_, i) in enumerate(merged):
            if i >= 0:
                real[i] = at
            else:
                dummies.append(at)
        return ([tokens[i] if i >= 0 else tokens[0] for _, i in merged],
                [slot for slot, _ in merged],
                [positions[i] if i >= 0 else 0 for _, i in merged], real + dummies)

    def used_tokens(self) -> int:
        """Tokens the sequences hold in their slots (any thread)."""
        return self.used
