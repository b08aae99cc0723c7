"""`Generator`: the token loop over a prefill and a decode Runtime.

    generator = dynvm.compile_generator(hf_causal_lm, max_batch=16, max_length=512)
    tokens = generator.generate(input_ids, attention_mask, max_new_tokens=64)
    for step in generator.stream(input_ids, attention_mask, max_new_tokens=64): ...

Batches with prompts of different lengths are left-padded (attention_mask 0 on the
left), as Hugging Face's `generate` expects of a decoder. Greedy decoding gives Hugging
Face's tokens; a stopped row gets the pad token until every row has stopped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

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


class Generator:
    """Generates tokens with two Runtimes, prefill and decode, over one set of weights.

    Both programs hold the model's own weight tensors (the same storages), so a
    generator's weights are resident once. When the programs have a decode step over
    the KV cache as state (`programs.decode_kv`) and `kv_state` is not False, decoding
    runs it: the prompt's keys and values are written into a `KvState` allocated once
    (max_batch x max_length), each step appends in place and attends over per-row
    lengths (Note [KV cache as state] in dynvm.vm.ops_kv). Otherwise the cache is passed
    between steps as plain tensors per layer, grown by one position per step, and with
    the JIT on and `compile_ahead`, the decode step's family kernels for the growing
    length are asked for before the length gets there (Note [Compiling the next length
    bucket])."""

    def __init__(self, programs: GeneratorPrograms, device: str | torch.device = "cpu",
                 jit: bool | JitConfig = True, compile_ahead: bool = True,
                 kv_state: bool | None = None) -> None:
        self.programs = programs
        self.prefill = Runtime(programs.prefill, device, jit=jit)
        self.decode = Runtime(programs.decode, device, jit=jit)
        # Note [KV cache as state] in dynvm.vm.ops_kv: kv_state None uses it when the
        # programs have it.
        if kv_state and programs.decode_kv is None:
            raise ConfigError("Generator(kv_state=True): the programs have no decode step "
                              "over the cache state (compile_generator(..., kv_state=True))")
        self.decode_kv = self.state = None
        if programs.decode_kv is not None and kv_state is not False:
            self.decode_kv = Runtime(programs.decode_kv, device, jit=jit)
            self.state = KvState(programs.decode_kv, self.decode_kv.device)
        # Note [Compiling the next length bucket] (the state's step has no growing dim)
        self._ahead = LengthBucketsAhead(self.decode) if compile_ahead and \
            self.decode_kv is None else None
        self._step_ahead = StepAhead(self.decode_kv) if compile_ahead and \
            self.decode_kv is not None else None
        self.device = self.prefill.device
        self._generations = 0
        self._decode_steps = 0
        self._specialized_steps = 0

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
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        logits, keys, values = self.prefill(ids, mask, positions)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.device)
        pad = self.programs.pad_token_id
        if self.state is not None:
            lengths = mask.sum(dim=-1)
            slots = self.state.begin(ids.shape[0], ids.shape[1] + max_new_tokens)
            self.state.write_prompt(keys, values, lengths)
        for step in range(max_new_tokens):
            token = next_tokens(logits, sampling, rng).masked_fill(done, pad)
            done = done | torch.isin(token, stops)
            yield token
            if step + 1 == max_new_tokens or bool(done.all()):
                return
            if step == 0:
                self._generations += 1
            if self.state is not None:
                logits = self._counted(self.decode_kv, token[:, None], slots, lengths,
                                       self.state.keys, self.state.values)
                if self._step_ahead is not None:
                    self._step_ahead.after_step()
                lengths = lengths + 1
                continue
            position = mask.sum(dim=-1, keepdim=True)
            logits, keys, values = self._counted(self.decode, token[:, None], mask, position,
                                                 keys, values)
            if self._ahead is not None:
                self._ahead.after_step(mask.shape[1], mask.shape[0])
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)

    def _counted(self, runtime: Runtime, *inputs):
        """One decode step on `runtime`, counted in stats()."""
        before = runtime.region_calls()
        outputs = runtime(*inputs)
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
        return GenerationStats(self._generations, self._decode_steps, self._specialized_steps)

    def close(self) -> None:
        """Stop both runtimes' background compiles (they keep working, interpreted)."""
        self.prefill.close()
        self.decode.close()
        if self.decode_kv is not None:
            self.decode_kv.close()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def compile_generator(model: torch.nn.Module, *, max_batch: int = 64,
                      max_length: int = 2048, device: str | torch.device = "cpu",
                      jit: bool | JitConfig = True, compile_ahead: bool = True,
                      name: str | None = None, kv_state: bool = True) -> Generator:
    """Lower a Hugging Face causal LM to a prefill and a decode program (dynamic batch
    and lengths) and return a `Generator` running them (`jit`, `compile_ahead`: as
    Generator takes them). `kv_state`: also the decode step over the KV cache as state
    (Note [KV cache as state] in dynvm.vm.ops_kv), which the generator then runs."""
    programs = export_generator(model, max_batch=max_batch, max_length=max_length, name=name,
                                kv_state=kv_state)
    return Generator(programs, device, jit=jit, compile_ahead=compile_ahead)
