"""How a generator picks the next token from the last logits: greedy, or sampling with
temperature, top-k and top-p from a seeded generator of its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvm.vm.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one generation (None instead of a Sampling: greedy).

    The filters apply in Hugging Face's order: temperature, then top-k, then top-p, then
    one draw per row from the renormalized distribution."""

    temperature: float = 1.0
    """Logits are divided by it before the filters; must be > 0."""
    top_k: int = 0
    """Keep only the k most likely tokens of each row; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p (the
    most likely one always stays); 1.0 keeps all."""
    seed: int | None = None
    """Seed of the generation's own torch.Generator: the same seed, prompt and settings
    give the same tokens. None: a fresh seed from torch's global generator."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"Sampling.temperature: expected > 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise ConfigError(f"Sampling.top_k: expected >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"Sampling.top_p: expected in (0, 1], got {self.top_p!r}")

    def torch_generator(self) -> torch.Generator:
        """A CPU generator seeded from `seed` (or from torch's global generator)."""
        seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item())
        return torch.Generator().manual_seed(seed)


def next_tokens(logits: torch.Tensor, sampling: Sampling | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row, [B] int64, from last-position logits [B, V]."""
    if sampling is None:
        # max's indices are argmax's (the first of equal maxima) at half its cost on a
        # [1, 32000] row (21 vs 48 us): one reduction kernel instead of argmax's.
        return logits.max(dim=-1).indices
    scores = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first stays.
        drop = (cumulative - ordered.softmax(dim=-1)) >= sampling.top_p
        drop[:, 0] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
