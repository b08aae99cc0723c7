"""`SchedulerConfig`: the bounds and batching of a generator replica's continuous batching
(dynvm.cluster.serving._generate_scheduler), one field per `dynvm serve` generation flag
(Note [Flags from config fields])."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynvm.cluster.serving._config_flags import cli
from dynvm.vm.errors import ConfigError


@dataclass(frozen=True)
class SchedulerConfig:
    """Bounds and batching of a generator replica (0 in a size: the programs' own)."""

    max_sequences: int = field(default=0, metadata=cli("--max-batch-size", shared=True))
    """Rows decoded at once; 0: the programs' max_batch."""
    max_waiting: int = field(default=64, metadata=cli("--max-queued", shared=True))
    """Admitted sequences waiting for a row or for cache; one more is a 503."""
    cache_tokens: int = 0
    """Cache tokens reserved at once (prompt + max_tokens per sequence); 0: max_sequences
    x max_length."""
    step_token_budget: int = 16
    """Tokens per step: the running rows' one each plus the prompts prefilled in it.
    Over plain caches a prompt longer than the rest still runs alone in a step of its
    own; over the KV state prompts are written in chunks that fit (Note [Prompt chunks
    between decode steps] in dynvm.cluster.serving._generate_slots). 16 by measure
    (bench.serve_generate, 8 clients, the three budgets served in the same passes,
    docs/bench_log.md issue 33): ITL p99/p50 1.86 at 16, 2.15 at 32, 2.39 at 64, while
    tokens/s rose 1.38x -> 1.54x CTranslate2's and TTFT p50 fell 39 -> 14 ms; a larger
    budget buys time to first token with inter-token spikes, since a step carrying a
    long prompt chunk delays every running row's next token."""
    min_prompt_tokens: int = 8
    """Over the KV state: prompt tokens a step writes at least (when a prompt waits),
    however many rows decode: prompts always progress."""
    prefill_length_multiple: int = 8
    """Prompts prefilled together are left-padded to a multiple of this (1: not at all)."""
    max_prompt_tokens: int = 0
    """Longest prompt accepted; 0: max_length - 1."""
    max_tokens: int = 0
    """Largest max_tokens accepted; 0: max_length - 1 (prompt + max_tokens <= max_length
    always)."""
    request_seconds: float = 120.0
    """Wall-clock budget of one sequence from its arrival; past it, it ends in an error."""
    warm_seconds: float = 30.0
    """A replica whose JIT compiles locally (no fleet) runs synthetic sequences through
    its scheduler for at most this long before it is ready, until their steps run
    specialized (Note [Warm before ready] in dynvm.cluster.serving._generate_warm);
    0: not at all."""

    decode_pad_rows: int = field(default=1, metadata=cli("--decode-pad-rows"))
    """Over the packed step, a pure decode step at most this many rows short of a plateau
    row count (a power of two, Note [Decode plateaus before ready] in
    dynvm.cluster.serving._generate_warm) runs that count, the extra rows dummies in
    free slots whose logits are dropped: it runs the exact kernel the warm-up made
    instead of a family kernel, and traffic never makes that row count's own (Note
    [Decode rows padded to a plateau], the same file); 0: never padded."""

    thread_slice_s: float = field(default=0.0005, metadata=cli(
        "--thread-slice-ms", scale=0.001, unit="ms"))
    """The time slice the scheduler's thread and the replica's event loop ask the kernel
    for (Linux 6.12+ EEVDF custom slices, no privilege needed; elsewhere nothing
    changes): a short one puts the step's threads back on a core sooner when the host
    has more runnable threads than cores (Note [Short slices for the step's threads] in
    dynvm.cluster.serving._generate_slice); 0: the kernel's default. 0.5 ms by measure
    (served, 8 clients, load 1.5-3.1: the step's run-queue wait p99 1.38 against 4.24 ms
    at the default slice, ITL p99/p50 2.04-2.22 against 1.86-2.69; 0.2 ms no better;
    at load 1.3-1.7, where run-queue waits are not the tail, no difference)."""

    def __post_init__(self) -> None:
        for name in ("max_sequences", "max_waiting", "cache_tokens", "step_token_budget",
                     "prefill_length_multiple", "max_prompt_tokens", "max_tokens",
                     "min_prompt_tokens", "decode_pad_rows"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ConfigError(f"SchedulerConfig.{name}: expected an integer >= 0, got "
                                  f"{value!r}")
        if self.prefill_length_multiple < 1 or self.step_token_budget < 1 or \
                self.min_prompt_tokens < 1:
            raise ConfigError("SchedulerConfig: prefill_length_multiple, "
                              "step_token_budget and min_prompt_tokens must be >= 1")
        if not self.request_seconds > 0:
            raise ConfigError(f"SchedulerConfig.request_seconds: expected > 0, got "
                              f"{self.request_seconds!r}")
        if isinstance(self.thread_slice_s, bool) or \
                not isinstance(self.thread_slice_s, int | float) or not self.thread_slice_s >= 0:
            raise ConfigError(f"SchedulerConfig.thread_slice_s: expected >= 0, got "
                              f"{self.thread_slice_s!r}")
        if isinstance(self.warm_seconds, bool) or \
                not isinstance(self.warm_seconds, int | float) or not self.warm_seconds >= 0:
            raise ConfigError(f"SchedulerConfig.warm_seconds: expected >= 0, got "
                              f"{self.warm_seconds!r}")
