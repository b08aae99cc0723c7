"""`Generator`: the token loop over the one step program over the KV cache as state
(prompt chunks and decode; Note [One step program for prompt and decode] in
dynvm._generation_kv), or over a prefill and a decode Runtime with plain caches.

    generator = dynvm.compile_generator(hf_causal_lm, max_batch=16, max_length=512)
    tokens = generator.generate(input_ids, attention_mask, max_new_tokens=64)
    for step in generator.stream(input_ids, attention_mask, max_new_tokens=64): ...

Batches with prompts of different lengths are left-padded (attention_mask 0 on the
left), as Hugging Face's `generate` expects of a decoder. Greedy decoding gives Hugging
Face's tokens; a stopped row gets the pad token until every row has stopped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from dynvm._generate_memory import GeneratorMemory, generator_memory
from dynvm._generation_ahead import LengthBucketsAhead, StepAhead
from dynvm._generation_export import GeneratorPrograms, export_generator
from dynvm._kv_state import KvState
from dynvm._runtime import Runtime
from dynvm._sampling import Sampling, next_tokens
from dynvm.jit.config import JitConfig
from dynvm.vm.errors import ConfigError, InputError, ShapeError


@dataclass(frozen=True)
class GenerationStats:
    """What a generator's decode steps ran as, since it was made."""

    generations: int
    """Calls of generate or stream that reached their first decode step."""
    decode_steps: int
    """Decode calls, over all generations and rows (one call per step per batch)."""
    specialized_steps: int
    """Decode calls in which every region ran specialized code (none interpreted)."""
    prompt_calls: int = 0
    """Calls that wrote prompt chunks into the KV state (T > 1, or a 1-token prompt)."""


CLOSE_WAIT_S = 10.0
"""How long `Generator.close` waits for a compile in flight (a step's exact kernel
with its calibration takes well under that) before leaving its thread to the queue's
exit hook."""


class Generator:
    """Generates tokens with the programs' step over the KV cache as state, or with a
    prefill and a decode Runtime over plain caches.

    When the programs have the step (`programs.step`) and `kv_state` is not False, one
    Runtime runs everything (Note [One step program for prompt and decode] in
    dynvm._generation_kv): the prompt is written into a `KvState` allocated once
    (max_batch x max_length) in chunks of at most `chunk` tokens per row, then each
    decode step appends in place and attends over per-row lengths (Note [KV cache as
    state] in dynvm.vm.ops_kv); the weights are held by that one program, and with the
    JIT on, compile-ahead promotes the decode step's signature after its first call.
    `jit=True` is JitConfig(cpu_fusion="dense"): the JIT packs no weight copy, so the
    generator holds one copy of its weights (Note [Dense weights only]); a JitConfig
    given is used as it is, without column halves (JitConfig.cpu_column_halves).
    Otherwise (`kv_state=False`, programs exported with `pure`)
    the cache is passed between a prefill and a decode step as plain tensors per layer, grown by one
    position per step, and compile-ahead asks for the decode step's family kernels for
    the growing length before the length gets there (Note [Compiling the next length
    bucket]); both programs hold the model's own weight tensors (the same storages)."""

    def __init__(self, programs: GeneratorPrograms, device: str | torch.device = "cpu",
                 jit: bool | JitConfig = True, compile_ahead: bool = True,
                 kv_state: bool | None = None, chunk: int | None = None) -> None:
        self.programs = programs
        if kv_state and programs.step is None:
            raise ConfigError("Generator(kv_state=True): the programs have no step over "
                              "the cache state (compile_generator(..., kv_state=True))")
        use_state = programs.step is not None and kv_state is not False
        if not use_state and (programs.prefill is None or programs.decode is None):
            raise ConfigError("Generator(kv_state=False): the programs have the state's "
                              "step alone; export them with compile_generator(..., "
                              "pure=True) for the plain-cache path")
        self.prefill = self.decode = self.step = self.state = None
        self._ahead = self._step_ahead = None
        if jit is True:   # one copy of the weights: no packed copies (Note [Dense weights only])
            jit = JitConfig(cpu_fusion="dense")
        if isinstance(jit, JitConfig):   # memory stated to the byte: no pieces' buffers
            jit = replace(jit, cpu_column_halves="off")
        if use_state:
            self.step = Runtime(programs.step, device, jit=jit)
            self.state = KvState(programs.step, self.step.device)
            self.chunk = min(chunk or programs.chunk, programs.chunk)
            self.packed = programs.packed   # Note [One packed call per step]
            self.max_tokens = programs.step.inputs[0].dims[-1].high
            self._lasts: dict[tuple[int, int], torch.Tensor] = {}
            if compile_ahead:
                self._step_ahead = StepAhead(self.step)
            self.device = self.step.device
        else:
            self.prefill = Runtime(programs.prefill, device, jit=jit)
            self.decode = Runtime(programs.decode, device, jit=jit)
            self.chunk = self.max_tokens = 0
            self.packed = False
            if compile_ahead:  # Note [Compiling the next length bucket]
                self._ahead = LengthBucketsAhead(self.decode)
            self.device = self.prefill.device
        self._generations = 0
        self._decode_steps = 0
        self._specialized_steps = 0
        self._prompt_calls = 0

    def memory(self) -> GeneratorMemory:
        """Bytes the generator holds in tensors, by cause: one copy of the weights (the
        distinct storages its programs hold), the KV state (0 over plain caches, which
        grow with each generation instead), and the JIT's packed weight copies and
        arenas (Note [A generator's resident memory] in dynvm._generate_memory)."""
        cache = self.state.nbytes if self.state is not None else 0
        return generator_memory(self.programs.weights_bytes, cache,
                                (self.step, self.prefill, self.decode))

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 32, sampling: Sampling | None = None,
                 stop_tokens: Sequence[int] | None = None) -> torch.Tensor:
        """The prompts followed by their new tokens, [B, P + n] with n <= max_new_tokens
        (fewer when every row stopped). `stop_tokens` None: the model's end-of-sequence
        tokens; () never stops early. `sampling` None: greedy."""
        steps = list(self.stream(input_ids, attention_mask, max_new_tokens, sampling,
                                 stop_tokens))
        new = torch.stack(steps, dim=1) if steps else input_ids.new_empty(
            (input_ids.shape[0], 0))
        return torch.cat([input_ids.to(new.device), new], dim=1)

    def stream(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               max_new_tokens: int = 32, sampling: Sampling | None = None,
               stop_tokens: Sequence[int] | None = None) -> Iterator[torch.Tensor]:
        """Yields each step's tokens, [B] int64, as soon as they are chosen (a stopped
        row yields the pad token); the same tokens `generate` returns."""
        mask = self._check(input_ids, attention_mask, max_new_tokens)
        stops = torch.tensor(self.programs.eos_token_ids if stop_tokens is None
                             else list(stop_tokens), dtype=torch.long, device=self.device)
        rng = sampling.torch_generator() if sampling is not None else None
        ids = input_ids.to(self.device)
        if self.state is not None:
            yield from self._stream_state(ids, mask, max_new_tokens, sampling, rng, stops)
            return
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        logits, keys, values = self.prefill(ids, mask, positions)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.device)
        pad = self.programs.pad_token_id
        for step in range(max_new_tokens):
            token = next_tokens(logits, sampling, rng).masked_fill(done, pad)
            done = done | torch.isin(token, stops)
            yield token
            if step + 1 == max_new_tokens or bool(done.all()):
                return
            if step == 0:
                self._generations += 1
            position = mask.sum(dim=-1, keepdim=True)
            logits, keys, values = self._counted(self.decode, token[:, None], mask, position,
                                                 keys, values)
            if self._ahead is not None:
                self._ahead.after_step(mask.shape[1], mask.shape[0])
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)

    def _stream_state(self, ids, mask, max_new_tokens, sampling, rng, stops):
        """stream() over the KV state: the prompts written chunk by chunk, then one
        decode step per token, all on the one step program."""
        slots = self.state.begin(ids.shape[0], ids.shape[1] + max_new_tokens)
        lengths = mask.sum(dim=-1)
        logits = self.write_prompts([row[row.shape[0] - n:] for row, n in
                                     zip(ids, lengths.tolist())], slots)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.device)
        pad = self.programs.pad_token_id
        # No stop tokens (stop_tokens=()): no row ever stops, so no per-step checks.
        stopping = stops.numel() > 0
        for step in range(max_new_tokens):
            token = next_tokens(logits, sampling, rng)
            if stopping:
                token = token.masked_fill(done, pad)
                done = done | torch.isin(token, stops)
            yield token
            if step + 1 == max_new_tokens or (stopping and bool(done.all())):
                return
            if step == 0:
                self._generations += 1
            logits = self._counted(self.step, token[:, None], slots, lengths)
            if self._step_ahead is not None:
                self._step_ahead.after_step()
            lengths = lengths + 1

    def write_prompts(self, prompts: Sequence[torch.Tensor], slots: torch.Tensor,
                      starts: Sequence[int] | None = None) -> torch.Tensor:
        """Write each prompt (1-d token ids) into its slot of the KV state from position
        starts[b] (default 0) with the step program, at most `chunk` tokens per row and
        call; rows of one call share T, so prompts of different lengths are written in
        calls of the lengths they share (Note [One step program for prompt and decode]
        in dynvm._generation_kv), without padding. The logits of each prompt's last
        token, [B, V]."""
        counts = [int(p.shape[0]) for p in prompts]
        written = [0] * len(prompts)
        starts = [0] * len(prompts) if starts is None else list(starts)
        last: list[torch.Tensor | None] = [None] * len(prompts)
        if self.packed:
            return self._write_packed(prompts, slots, starts)
        while True:
            active = [b for b, n in enumerate(counts) if written[b] < n]
            if not active:
                break
            steps = min(self.chunk, min(counts[b] - written[b] for b in active))
            tokens = torch.stack([prompts[b][written[b]:written[b] + steps] for b in active])
            rows = torch.tensor(active, device=slots.device)
            at = torch.tensor([starts[b] + written[b] for b in active], device=self.device)
            logits = self.rows_call(tokens.to(self.device), slots.index_select(0, rows), at)
            self._prompt_calls += 1
            for i, b in enumerate(active):
                written[b] += steps
                if written[b] == counts[b]:
                    last[b] = logits[i]
        return torch.stack(last)

    def _write_packed(self, prompts, slots, starts) -> torch.Tensor:
        """write_prompts over the packed step (Note [One packed call per step] in
        dynvm._generation_kv): each call takes the rows' next tokens in order, up to
        `chunk` tokens in all, so rows of different lengths share calls and a row's
        prompt may end mid-call or be cut mid-prompt at a call's end."""
        counts = [int(p.shape[0]) for p in prompts]
        written = [0] * len(prompts)
        last: list[torch.Tensor | None] = [None] * len(prompts)
        slot_ids = slots.tolist()
        row = 0
        while row < len(prompts):
            pieces, room = [], self.chunk
            while row < len(prompts) and room > 0:
                take = min(room, counts[row] - written[row])
                pieces.append((row, written[row], take))
                written[row] += take
                room -= take
                if written[row] == counts[row]:
                    row += 1
            ids = torch.cat([prompts[b][a:a + n] for b, a, n in pieces])
            tok_slots = torch.tensor([slot_ids[b] for b, _, n in pieces for _ in range(n)])
            positions = torch.cat([torch.arange(starts[b] + a, starts[b] + a + n)
                                   for b, a, n in pieces])
            ends = [(b, i) for i, (b, a, n) in enumerate(pieces) if a + n == counts[b]]
            offsets = torch.tensor([n for _, _, n in pieces]).cumsum(0) - 1
            picks = [int(offsets[i]) for _, i in ends] or [int(offsets[-1])]
            logits = self.packed_call(ids, tok_slots, positions, torch.tensor(picks))
            self._prompt_calls += 1
            for j, (b, _) in enumerate(ends):
                last[b] = logits[j]
        return torch.stack(last)

    def rows_call(self, tokens: torch.Tensor, slots: torch.Tensor,
                  lengths: torch.Tensor) -> torch.Tensor:
        """The step on rows of T new tokens each (tokens [B, T], the rows' slots [B] and
        lengths [B], their first new token's position): the logits of each row's last
        token, [B, V]. Over a packed step the rows are flattened into one call."""
        if not self.packed:
            return self.step(tokens, slots, lengths, self.state.keys, self.state.values)
        batch, steps = tokens.shape
        if steps == 1:
            positions = lengths
        else:
            slots = slots.repeat_interleave(steps)
            positions = (lengths[:, None] + torch.arange(steps, device=lengths.device)
                         ).reshape(-1)
        last = self._lasts.get((batch, steps))
        if last is None:
            last = self._lasts[(batch, steps)] = torch.arange(
                steps - 1, batch * steps, steps, device=tokens.device)
        return self.step(tokens.reshape(1, -1), slots, positions, last, self.state.keys,
                         self.state.values)

    def packed_call(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                    last: torch.Tensor) -> torch.Tensor:
        """The packed step (Note [One packed call per step] in dynvm._generation_kv): token
        i (tokens [N]) written into slot slots[i] at positions[i], attending its slot up
        to itself; the logits of the tokens `last` [R] picks, [R, V]."""
        if not self.packed:
            raise ConfigError("Generator.packed_call: the step takes rows; export it with "
                              "compile_generator(..., packed=True)")
        device = self.device
        return self.step(tokens.to(device)[None], slots.to(device), positions.to(device),
                         last.to(device), self.state.keys, self.state.values)

    def _counted(self, runtime: Runtime, *inputs):
        """One decode step on `runtime`, counted in stats()."""
        before = runtime.region_calls()
        outputs = (self.rows_call(*inputs) if runtime is self.step else runtime(*inputs))
        after = runtime.region_calls()
        self._decode_steps += 1
        if after[0] > before[0] and after[1] == before[1]:
            self._specialized_steps += 1
        return outputs

    def _check(self, input_ids, attention_mask, max_new_tokens: int) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ShapeError(f"input_ids: expected a [batch, prompt] tensor, got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        batch, prompt = input_ids.shape
        limit = self.programs.max_length
        if max_new_tokens < 1 or prompt + max_new_tokens > limit:
            raise InputError(f"max_new_tokens: expected 1..{limit - prompt} (prompt {prompt} "
                             f"+ new tokens <= max_length {limit}), got {max_new_tokens}")
        if attention_mask is None:
            return torch.ones(batch, prompt, dtype=torch.long, device=self.device)
        if tuple(attention_mask.shape) != (batch, prompt):
            raise ShapeError(f"attention_mask: expected shape {(batch, prompt)} (that of "
                             f"input_ids), got {tuple(attention_mask.shape)}")
        mask = attention_mask.to(self.device, torch.long)
        if not bool((mask[:, -1] == 1).all()):
            rows = (mask[:, -1] != 1).nonzero().flatten().tolist()
            raise ShapeError(f"attention_mask: expected left padding (every row's last "
                             f"column 1), got rows {rows[:8]} padded on the right")
        return mask

    def stats(self) -> GenerationStats:
        """How many decode steps ran specialized, since the generator was made."""
        return GenerationStats(self._generations, self._decode_steps,
                               self._specialized_steps, self._prompt_calls)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop the runtimes' background compiles (they keep working, interpreted), their
        compile threads joined for up to `wait_s` seconds (Note [Scheduler threads end
        before exit] in dynvm.cluster.serving._generate_exit)."""
        for runtime in (self.step, self.prefill, self.decode):
            if runtime is not None and runtime.jit is not None:
                runtime.jit.close(wait_s)

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def compile_generator(model: torch.nn.Module, *, max_batch: int = 64,
                      max_length: int = 2048, device: str | torch.device = "cpu",
                      jit: bool | JitConfig = True, compile_ahead: bool = True,
                      name: str | None = None, kv_state: bool = True, chunk: int = 128,
                      pure: bool | None = None, packed: bool = True) -> Generator:
    """Lower a Hugging Face causal LM (dynamic batch and lengths) and return a
    `Generator` running it (`jit`, `compile_ahead`: as Generator takes them).
    `kv_state`: one step program over the KV cache as state for prompt chunks and
    decoding (Note [One step program for prompt and decode] in dynvm._generation_kv),
    which the generator then runs; `packed` (the default): that step in its packed
    form, the tokens of any rows flat in one call of up to max(chunk, max_batch)
    tokens (Note [One packed call per step], the same file), the form a served
    generator's scheduler needs (Note [The packed step by default]); packed=False: the
    rows form, rows of T = 1..chunk tokens each per call. `pure` (default: not
    kv_state): the prefill and decode programs over plain caches too."""
    programs = export_generator(model, max_batch=max_batch, max_length=max_length, name=name,
                                kv_state=kv_state, chunk=chunk, pure=pure, packed=packed)
    return Generator(programs, device, jit=jit, compile_ahead=compile_ahead)
