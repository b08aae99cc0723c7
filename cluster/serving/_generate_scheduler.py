"""Continuous batching of a generator replica: sequences join and leave between decode
steps, an arrival's prefill is interleaved with the decode of the others under a token
budget per step, admission is bounded, and a cancelled sequence is freed at the next step.

    scheduler = GenerateScheduler(generator, SchedulerConfig())
    seq = scheduler.submit(GenerationRequest(prompt, max_tokens=32), sink)
    # sink(("token", id)) per token, then sink(("end", "stop" | "length")) or
    # sink(("error", exc)), called on the scheduler's thread; seq.cancel() from anywhere.
    seq = scheduler.submit(request, sink, loop=asyncio_loop)
    # the same events, called on that loop: one hop per step (Note [One hop per step]
    # in dynvm.cluster.serving._generate_outbox)

Note [Continuous batching over plain caches]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One thread runs the generator's two Runtimes (its `prefill` and `decode` programs, as
dynvm._generation_export lowers them). A step is: drop the rows that finished or were
cancelled; prefill the next arrivals as one batch (their prompts left-padded to a
multiple of `prefill_length_multiple`, so that prompt lengths fall on few shapes), as
many as fit the step's token budget beside the running rows' one token each; join them;
one decode step for every running row. The decode program takes the cache as plain
per-layer tensors [B, Hkv, L, D], left-padded, with a [B, L] mask, and returns it grown
by one column. So a join concatenates (left-padding the shorter side)
and a leave gathers the kept rows (cutting the leading columns no kept row uses): both
copy the whole cache. The scheduler counts those copies (`copies`, `copy_bytes`): they
are the cost a cache with per-sequence slots removes: when the generator decodes over
the KV cache as state (its programs have the `step`), the scheduler uses slots instead
and copies nothing (Note [Slots instead of copies] in dynvm.cluster.serving._generate_slots),
and writes each arrival's prompt in chunks between the running rows' decode steps under
the step's token budget (Note [Prompt chunks between decode steps], the same file).
Tokens equal `Generator.generate`'s for the same prompt and seed: each sequence
samples from its own seeded torch.Generator, one draw per token, as a generation of
batch 1 does.

Admission: a sequence reserves prompt + max_tokens cache tokens; it runs once its
reservation fits `cache_tokens` and a row is free (`max_sequences`), else it waits in
order; when `max_waiting` already wait, `submit` raises GenerateBusy (the replica's 503
+ Retry-After). Nothing is preempted, so nothing is recomputed or lost: every admitted
sequence ends with "end" or "error".

Note [Metrics off the step's path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The occupancy gauges and the samples for Ray's metrics are handed over at most every
PUBLISH_S seconds while sequences run, and whenever the scheduler goes idle (so a
reader after the last request sees its end), not after every step: through Ray's
metrics API each sample is a Python call on the step's thread (0.07-0.1 ms a step of 8
rows, measured in a served replica), for gauges a dashboard scrapes every few seconds.
The replica's own counters and histograms (`GenerateMetrics.token`) are updated per
token as before.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from dynvm._generation_ahead import LengthBucketsAhead
from dynvm._sampling import next_tokens
from dynvm.cluster.protocol._generate import GenerationRequest
from dynvm.cluster.serving._generate_config import SchedulerConfig
from dynvm.cluster.serving._generate_exit import close_at_exit
from dynvm.cluster.serving._generate_outbox import Outbox
from dynvm.cluster.serving._generate_slice import request_slice, thread_slice
from dynvm.cluster.serving._generate_slots import SlotCache
from dynvm.cluster.serving._generate_warm import padded_rows
from dynvm.vm.errors import ConfigError, DynvmError, InputError

PUBLISH_S = 0.1
"""Longest time between two hand-overs of the metrics while sequences run (Note
[Metrics off the step's path])."""


class GenerateBusy(DynvmError):
    """The replica's waiting room is full: the client should retry later (503)."""


class GenerateTimeout(DynvmError):
    """A sequence ran past its request's time budget (SchedulerConfig.request_seconds)."""


class Sequence:
    """A submitted sequence: its tokens so far and how it ended. `cancel()` from any
    thread frees its row at the scheduler's next step."""

    def __init__(self, sid: int, request: GenerationRequest, sink: Callable,
                 stops: frozenset, deadline: float, loop=None) -> None:
        self.id = sid
        self.request = request
        self.sink = sink
        self.loop = loop   # the sink's event loop (Note [One hop per step]), or None
        self.stops = stops
        self.deadline = deadline
        self.arrived = time.monotonic()
        self.tokens: list[int] = []
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finish_reason: str | None = None
        self.cancelled = False
        self.rng = (request.sampling.torch_generator() if request.sampling is not None
                    else None)
        self.reserved = len(request.prompt) + request.max_tokens
        self.reserving = False   # its reservation counts against cache_tokens

    def cancel(self) -> None:
        """Ask the scheduler to drop this sequence at its next step (idempotent)."""
        self.cancelled = True


class _BatchCache:
    """The running rows' cache as the decode program takes it, and the copies it cost
    (Note [Continuous batching over plain caches])."""

    def __init__(self, keys, values, mask) -> None:
        self.keys, self.values, self.mask = list(keys), list(values), mask
        self.copies = 0
        self.copy_bytes = 0

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def _count(self, tensors) -> None:
        self.copies += 1
        self.copy_bytes += sum(t.numel() * t.element_size() for t in tensors)

    def join(self, keys, values, mask) -> None:
        """Append rows (their cache left-padded, or ours, to the longer length)."""
        width = max(self.length, mask.shape[1])

        def left_pad(t, dim):
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            pad = [0, 0] * (t.dim() - 1 - dim) + [missing, 0]
            return torch.nn.functional.pad(t, pad)

        self.keys = [torch.cat([left_pad(a, 2), left_pad(b, 2)]) for a, b in zip(self.keys, keys)]
        self.values = [torch.cat([left_pad(a, 2), left_pad(b, 2)])
                       for a, b in zip(self.values, values)]
        self.mask = torch.cat([left_pad(self.mask, 1), left_pad(mask, 1)])
        self._count(self.keys + self.values)

    def keep(self, rows: list[int]) -> None:
        """Keep these rows, in this order, cutting leading columns none of them uses."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else 0
        self.mask = mask[:, start:].contiguous()
        self.keys = [k[:, :, start:].index_select(0, index) for k in self.keys]
        self.values = [v[:, :, start:].index_select(0, index) for v in self.values]
        self._count(self.keys + self.values)


class GenerateScheduler:
    """Continuous batching over one `Generator` on a thread of its own (Note
    [Continuous batching over plain caches])."""

    def __init__(self, generator, config: SchedulerConfig | None = None,
                 metrics=None) -> None:
        self.generator = generator
        self.config = config = config if config is not None else SchedulerConfig()
        programs = generator.programs
        self.max_length = programs.max_length
        self.max_sequences = min(config.max_sequences or programs.max_batch,
                                 programs.max_batch)
        self.cache_tokens = config.cache_tokens or self.max_sequences * self.max_length
        if self.cache_tokens < self.max_length:
            raise ConfigError(f"SchedulerConfig.cache_tokens: expected >= max_length "
                              f"{self.max_length}, got {self.cache_tokens}")
        self.max_prompt_tokens = min(config.max_prompt_tokens or self.max_length - 1,
                                     self.max_length - 1)
        self.max_new_tokens = min(config.max_tokens or self.max_length - 1,
                                  self.max_length - 1)
        self.metrics = metrics
        self.vocab_size = self._probe_vocab(generator)
        self._eos = frozenset(programs.eos_token_ids)
        self._pad = programs.pad_token_id
        self._ahead = (LengthBucketsAhead(generator.decode)
                       if getattr(generator, "decode", None) is not None else None)
        # Note [Slots instead of copies]: the generator's KV state, when it has one.
        self._slots = (SlotCache(generator, padded_rows(self.max_sequences, config))
                       if getattr(generator, "state", None) is not None else None)
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._joining: list[Sequence] = []   # taken from waiting, in this step's prefill
        self._prompting: list[Sequence] = []   # in a slot, prompt not all written yet
        self._batch: _BatchCache | None = None
        self._reserved = 0
        self._ids = itertools.count(1)
        self._closed = False
        self.held: set[int] = set()   # ids of sequences admitted and not yet freed
        self._outbox = Outbox()   # a step's events for sequences on loops
        self._published = 0.0
        self.thread_slice: float | None = None   # the scheduler thread's, once it runs
        self.counters = dict.fromkeys(
            ("admitted", "rejected", "finished", "cancelled", "errors", "timeouts", "freed",
             "prefill_calls", "decode_steps", "specialized_steps", "tokens", "copies",
             "copy_bytes"), 0)
        self._thread = threading.Thread(target=self._loop, name="dynvm-generate",
                                        daemon=True)
        close_at_exit(self)   # Note [Scheduler threads end before exit]
        self._thread.start()

    @staticmethod
    def _probe_vocab(generator) -> int:
        """The vocabulary size, from one prefill of one token (an id past it would fail
        the whole prefill batch it is in, so requests are checked against it)."""
        one = torch.ones((1, 1), dtype=torch.long, device=generator.device)
        if getattr(generator, "step", None) is not None:   # slot 0, zeroed after
            zero = one[0] - 1
            return int(generator.rows_call(one, zero, zero).shape[-1])
        logits, _, _ = generator.prefill(one, one, one - 1)
        return int(logits.shape[-1])

    # ------------------------------------------------------------------ any thread

    def check(self, request: GenerationRequest) -> None:
        """InputError when the request can never run here (a client fault)."""
        prompt, new = len(request.prompt), request.max_tokens
        if prompt < 1 or prompt > self.max_prompt_tokens:
            raise InputError(f"prompt: expected 1..{self.max_prompt_tokens} tokens, got "
                             f"{prompt}")
        if new < 1 or new > self.max_new_tokens:
            raise InputError(f"max_tokens: expected 1..{self.max_new_tokens}, got {new}")
        if prompt + new > self.max_length:
            raise InputError(f"max_tokens: prompt ({prompt} tokens) + max_tokens ({new}) "
                             f"exceeds the model's max_length {self.max_length}")
        bad = [t for t in request.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InputError(f"prompt: token ids must be in 0..{self.vocab_size - 1}, got "
                             f"{bad[0]}")

    def submit(self, request: GenerationRequest, sink: Callable, loop=None) -> Sequence:
        """Admit a sequence (InputError: never runnable; GenerateBusy: the waiting room is
        full). `sink` gets its events on the scheduler's thread, or with `loop` (an
        asyncio loop) on that loop, a step's events in one hop (Note [One hop per
        step])."""
        self.check(request)
        stops = self._eos if request.stop_token_ids is None else frozenset(
            request.stop_token_ids)
        with self._cond:
            if self._closed:
                raise GenerateBusy("the replica is shutting down")
            if len(self._waiting) >= self.config.max_waiting:
                self.counters["rejected"] += 1
                raise GenerateBusy(f"{len(self._running)} sequences running and "
                                   f"{len(self._waiting)} waiting, the limit is "
                                   f"{self.config.max_waiting}")
            seq = Sequence(next(self._ids), request, sink, stops,
                           time.monotonic() + self.config.request_seconds, loop)
            self._waiting.append(seq)
            self.held.add(seq.id)
            self.counters["admitted"] += 1
            self._cond.notify()
        return seq

    def wake(self) -> None:
        """Have the scheduler look at its sequences now (after a cancel while idle)."""
        with self._cond:
            self._cond.notify()

    def occupancy(self) -> dict:
        """Running and waiting sequences, reserved and held cache tokens, the batch."""
        with self._cond:
            batch, slots = self._batch, self._slots
            state = {"running": len(self._running), "waiting": len(self._waiting),
                     "prompting": len(self._prompting),
                     "held": len(self.held), "reserved_tokens": self._reserved,
                     "cache_tokens": self.cache_tokens, "cache": "plain",
                     "cache_rows": 0 if batch is None else int(batch.mask.shape[0]),
                     "cache_length": 0 if batch is None else batch.length,
                     "cache_used_tokens": 0 if batch is None else int(batch.mask.sum())}
            if slots is not None:
                state.update(cache="slots", cache_rows=len(slots), cache_length=0,
                             cache_used_tokens=slots.used_tokens())
            return state

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no sequence runs or waits (True), or `timeout` seconds (False)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._running and not self._waiting and not self._joining
                and not self._prompting,
                timeout)

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the thread; sequences still admitted end in an error. Whether the thread
        ended within `timeout` seconds (Note [Scheduler threads end before exit])."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ scheduler thread

    def _loop(self) -> None:
        # Note [Short slices for the step's threads]: what the kernel gave, for /stats.
        if self.config.thread_slice_s > 0:
            request_slice(self.config.thread_slice_s)
        self.thread_slice = thread_slice()
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._running and \
                        not self._prompting:
                    self._cond.wait()
                if self._closed:
                    break
                joining = self._joining = self._arrivals()
            try:
                self._step(joining)
            except Exception as exc:  # a failed call: its sequences get the error
                for seq in joining + self._running + self._prompting:
                    if seq.finish_reason is None:
                        self._end(seq, "error", exc)
                self._clear()
            self._outbox.flush()
            with self._cond:
                self._joining = []
                self._cond.notify_all()
            self._publish()
        failure = GenerateBusy("the replica shut down before the sequence finished")
        for seq in list(self._waiting) + self._running + self._prompting:
            self._end(seq, "error", failure)
        self._outbox.flush()
        self._waiting.clear()
        self._clear()

    def _clear(self) -> None:
        """No running rows any more (their slots given back)."""
        if self._slots is not None:
            for seq in self._running + self._joining + self._prompting:
                self._slots.release(seq)
        self._running, self._prompting, self._batch = [], [], None

    def _arrivals(self) -> list[Sequence]:
        """Waiting sequences that start in this step (called with the lock held)."""
        budget = self.config.step_token_budget - len(self._running)
        now = time.monotonic()
        for seq in [s for s in self._waiting if s.cancelled or now > s.deadline]:
            self._waiting.remove(seq)  # a waiting one is freed at the next step too
            if seq.cancelled:
                self._end(seq, "cancelled")
            else:
                self._end(seq, "error", self._timeout(seq))
        joining: list[Sequence] = []
        while self._waiting:
            seq = self._waiting[0]
            if len(self._running) + len(self._prompting) + len(joining) >= \
                    self.max_sequences:
                break
            if self._reserved + seq.reserved > self.cache_tokens:
                break
            # Over the KV state prompts are written in chunks: no width to fit here.
            width = self._prefill_width(joining + [seq]) * (len(joining) + 1)
            if joining and width > budget and self._slots is None:
                break
            self._waiting.popleft()
            self._reserved += seq.reserved
            seq.reserving = True
            joining.append(seq)
        return joining

    def _timeout(self, seq: Sequence) -> GenerateTimeout:
        return GenerateTimeout(f"the request ran past its budget of "
                               f"{self.config.request_seconds:g} s after {len(seq.tokens)} "
                               f"tokens")

    def _prefill_width(self, seqs: list[Sequence]) -> int:
        longest = max(len(s.request.prompt) for s in seqs)
        multiple = self.config.prefill_length_multiple
        return min(-(-longest // multiple) * multiple, self.max_length - 1)

    def _step(self, joining: list[Sequence]) -> None:
        if self._slots is not None:
            self._step_slots(joining)
            return
        self._drop_finished()
        if joining:
            self._prefill(joining)
        if self._running:
            self._decode()
        self._drop_finished()

    def _step_slots(self, joining: list[Sequence]) -> None:
        """Note [Prompt chunks between decode steps]: the running rows' decode call, then
        one call writing the next chunk of the waiting prompts within the budget left."""
        self._drop_finished()
        for seq in joining:
            self._slots.take(seq)
        self._prompting = self._prompting + joining
        budget = max(self.config.step_token_budget - len(self._running),
                     self.config.min_prompt_tokens)
        if self.generator.packed:
            self._step_packed(budget)
            return
        if self._running:
            self._choose(self._running, self._counted_slots())
        if self._prompting:
            done, logits = self._slots.prompt(self._prompting, budget)
            self.counters["prefill_calls"] += 1
            self._prompted(done, logits)
        self._drop_finished()

    def _prompted(self, done: list[Sequence], logits) -> None:
        """Sequences whose prompt is all written: their first token; then they decode."""
        if not done:
            return
        ids = {seq.id for seq in done}
        self._prompting = [s for s in self._prompting if s.id not in ids]
        self._choose(done, logits)
        for seq in done:   # ended at its first token: its slot is free again
            if seq.finish_reason is not None:
                self._slots.release(seq)
        self._running = self._slots.order(
            self._running + [s for s in done if s.finish_reason is None])

    def _step_packed(self, budget: int) -> None:
        """Note [One packed call per step] in dynvm._generation_kv: the running rows'
        tokens and the prompts' next tokens within the budget, one call."""
        runtime, running = self.generator.step, self._running
        before = runtime.region_calls()
        logits, done, first = self._slots.packed(running, self._prompting, budget)
        after = runtime.region_calls()
        if running:
            if after[0] > before[0] and after[1] == before[1]:
                self.counters["specialized_steps"] += 1
            self.counters["decode_steps"] += 1
            self._choose(running, logits)
        if self._prompting:
            self.counters["prefill_calls"] += 1
        self._prompted(done, first)
        self._drop_finished()

    def _drop_finished(self) -> None:
        now = time.monotonic()
        for seq in self._running + self._prompting:
            if seq.finish_reason is None and seq.cancelled:
                self._end(seq, "cancelled")
            elif seq.finish_reason is None and now > seq.deadline:
                self._end(seq, "error", self._timeout(seq))
        if self._slots is not None and self._prompting:
            for seq in self._prompting:
                if seq.finish_reason is not None:
                    self._slots.release(seq)
            self._prompting = [s for s in self._prompting if s.finish_reason is None]
        rows = [i for i, seq in enumerate(self._running) if seq.finish_reason is None]
        if len(rows) == len(self._running):
            return
        if self._slots is not None:  # Note [Slots instead of copies]
            for seq in self._running:
                if seq.finish_reason is not None:
                    self._slots.release(seq)
        self._running = [self._running[i] for i in rows]
        if self._slots is not None:
            return
        if not rows:
            self._batch = None
            return
        self._copying(lambda batch: batch.keep(rows))

    def _copying(self, change) -> None:
        batch = self._batch
        copies, copied = batch.copies, batch.copy_bytes
        change(batch)
        self.counters["copies"] += batch.copies - copies
        self.counters["copy_bytes"] += batch.copy_bytes - copied

    def _prefill(self, joining: list[Sequence]) -> None:
        width = self._prefill_width(joining)
        device = self.generator.device
        ids = torch.full((len(joining), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(joining), width), dtype=torch.long)
        for row, seq in enumerate(joining):
            prompt = seq.request.prompt
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        logits, keys, values = self.generator.prefill(ids, mask, positions)
        self.counters["prefill_calls"] += 1
        self._choose(joining, logits)
        rows = [i for i, seq in enumerate(joining) if seq.finish_reason is None]
        if not rows:
            return
        if len(rows) < len(joining):
            index = torch.tensor(rows, dtype=torch.long, device=mask.device)
            keys = [k.index_select(0, index) for k in keys]
            values = [v.index_select(0, index) for v in values]
            mask = mask.index_select(0, index)
        if self._batch is None:
            self._batch = _BatchCache(keys, values, mask)
        else:
            self._copying(lambda batch: batch.join(keys, values, mask))
        self._running.extend(joining[i] for i in rows)

    def _counted(self, runtime, *inputs):
        """One decode call, counted (specialized: every region ran specialized code)."""
        before = runtime.region_calls()
        outputs = runtime(*inputs)
        after = runtime.region_calls()
        if after[0] > before[0] and after[1] == before[1]:
            self.counters["specialized_steps"] += 1
        self.counters["decode_steps"] += 1
        return outputs

    def _decode(self) -> None:
        batch = self._batch
        if batch.length > self.max_length - 1:  # left padding only: cut it
            self._copying(lambda b: b.keep(list(range(len(self._running)))))
        tokens = torch.tensor([[seq.tokens[-1]] for seq in self._running], dtype=torch.long,
                              device=batch.mask.device)
        position = batch.mask.sum(dim=-1, keepdim=True)
        logits, batch.keys, batch.values = self._counted(
            self.generator.decode, tokens, batch.mask, position, batch.keys, batch.values)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(batch.mask.shape[0], 1)],
                               dim=1)
        if self._ahead is not None:
            self._ahead.after_step(batch.length - 1, batch.mask.shape[0])
        self._choose(self._running, logits)

    def _counted_slots(self) -> torch.Tensor:
        runtime = self.generator.step
        before = runtime.region_calls()
        logits = self._slots.decode(self._running)
        after = runtime.region_calls()
        if after[0] > before[0] and after[1] == before[1]:
            self.counters["specialized_steps"] += 1
        self.counters["decode_steps"] += 1
        return logits

    def _choose(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Each sequence's next token (greedy rows at once, sampled rows from their own
        generators), delivered; a sequence that stopped or reached max_tokens ends."""
        greedy = logits.argmax(dim=-1).tolist()
        now = time.monotonic()
        for row, seq in enumerate(seqs):
            sampling = seq.request.sampling
            token = (greedy[row] if sampling is None
                     else int(next_tokens(logits[row:row + 1], sampling, seq.rng)[0]))
            seq.tokens.append(token)
            self.counters["tokens"] += 1
            if self.metrics is not None:
                self.metrics.token(seq, now)
            seq.first_token_at = seq.first_token_at or now
            seq.last_token_at = now
            self._send(seq, ("token", token))
            if token in seq.stops:
                self._end(seq, "stop")
            elif len(seq.tokens) >= seq.request.max_tokens:
                self._end(seq, "length")

    def _send(self, seq: Sequence, event: tuple) -> None:
        if seq.loop is not None:   # Note [One hop per step]: sent after the step
            self._outbox.add(seq, event)
            return
        try:
            seq.sink(event)
        except Exception:  # its client's loop is gone: nobody reads it any more
            seq.cancelled = True

    def _end(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        """Free the sequence's reservation; its row leaves the cache at the next drop."""
        seq.finish_reason = reason
        with self._cond:
            if seq.id in self.held:
                self.held.discard(seq.id)
                self.counters["freed"] += 1
            if seq.reserving:
                self._reserved -= seq.reserved
                seq.reserving = False
        key = {"stop": "finished", "length": "finished", "cancelled": "cancelled"}.get(
            reason, "errors")
        if isinstance(error, GenerateTimeout):
            key = "timeouts"
        self.counters[key] += 1
        if self.metrics is not None:
            self.metrics.ended(seq, reason)
        self._send(seq, ("error", error) if error is not None else ("end", reason))

    def _publish(self) -> None:
        """Note [Metrics off the step's path]: every PUBLISH_S while busy, and when idle."""
        if self.metrics is None:
            return
        now = time.monotonic()
        busy = self._running or self._waiting or self._prompting
        if busy and now - self._published < PUBLISH_S:
            return
        self._published = now
        self.metrics.occupancy({**self.occupancy(), "copy_bytes": self.counters["copy_bytes"]})

