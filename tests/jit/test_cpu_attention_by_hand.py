"""Attention written by hand on dynvm's kernel (Note [Attention written by hand on our
kernel] in jit/backends/cpu/attention_native.py): the contiguous version equals torch's
SDPA and lays its result out contiguously, on operands the kernel reads and on those it
does not; runtimes of a layer written as the held-out encoder writes it (separate
q / k / v projections, matmul, scale, softmax, matmul, heads merged by transpose +
contiguous + view) put its attention on the kernel from the Q/K/V result in one call
(Note [Attention without its views]), or alone where the merge differs, and stay equal
to eager over random shapes and offset inputs, families off and on.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import attention_native
from dynvm.jit.backends.cpu.attention_native import MIN_KEYS, masked_attention_contiguous
from tests.jit import _jit_helpers as h

pytestmark = pytest.mark.skipif(not attention_native.available(),
                                reason="dynvm's attention library is not built or no AVX-512F")
F = torch.nn.functional
TAKEN = "on dynvm's masked attention"
ONE_CALL = "in one call (Note [Attention without its views])"
BELOW = MIN_KEYS // 2 + 1    # keys the pass leaves to torch's SDPA on every CPU


class HandLayer(nn.Module):
    """A pre-norm layer with attention written out by hand; `merge` says how the heads
    come back together: "contiguous" (transpose, contiguous, view), "reshape"
    (transpose, reshape: export's clone and view, the same chain) or "leak" (as
    "contiguous", with the attention's result also read after the layer: the kernel
    runs alone and its views stay)."""

    def __init__(self, d: int = 64, heads: int = 2, merge: str = "contiguous") -> None:
        super().__init__()
        self.heads, self.merge = heads, merge
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        b, s, d = x.shape
        y = self.norm(x)
        q, k, v = (p(y).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        attn = torch.matmul(torch.softmax(scores, dim=-1), v)
        merged = attn.transpose(1, 2)
        merged = merged.reshape(b, s, d) if self.merge == "reshape" \
            else merged.contiguous().view(b, s, d)
        out = x + self.o(merged)
        return out + attn.mean() if self.merge == "leak" else out


def _operands(gen, b, heads, s, d):
    """q, k, v as [B, H, S, D] views of one projection result, as a layer's are."""
    qkv = torch.randn(b, s + 1, 3 * heads * d, generator=gen)[:, 1:]
    return (t.view(b, s, heads, d).transpose(1, 2) for t in qkv.split(heads * d, -1))


def test_the_contiguous_version_equals_sdpa_and_is_contiguous():
    gen = torch.Generator().manual_seed(11)
    for case in range(12):
        b, heads = 1 + case % 3, (1, 2, 8)[case % 3]
        s, d = (MIN_KEYS, 33, 64, BELOW)[case % 4], (16, 32, 24)[case % 3]   # 24: not read
        q, k, v = _operands(gen, b, heads, s, d)
        got = masked_attention_contiguous(q, k, v, None, 0.0, False, 0.2)
        want = F.scaled_dot_product_attention(q, k, v, scale=0.2)
        assert got.is_contiguous() and got.shape == want.shape, case
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def _program(model):
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=160)
    return dynvm.compile(model, (torch.randn(2, 20, 64),), ({0: batch, 1: seq},))


@pytest.mark.parametrize("merge", ["contiguous", "reshape", "leak"])
def test_runtimes_run_hand_written_attention_on_the_kernel_and_equal_eager(merge):
    torch.manual_seed(0)
    model = HandLayer(merge=merge).eval()
    program = _program(model)
    gen = torch.Generator().manual_seed(31)
    for families in (False, True):
        config = h.eager_config(cpu_fusion="always", families=families)
        with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
            for step in range(8):
                batch = int(torch.randint(1, 4, (1,), generator=gen))
                seq = (BELOW, MIN_KEYS, 37, 150)[step % 4]
                x = torch.randn(batch, seq, 64, generator=gen)
                if step % 2:     # an offset input
                    x = torch.randn(batch, seq + 1, 64, generator=gen)[:, 1:]
                rt(x)
                torch.testing.assert_close(rt(x), model(x), rtol=1e-5, atol=1e-5)
            assert rt.stats()["specialized_region_calls"] > 0
            sources = [a.source for a in rt.jit.artifacts.values()]
        if families:
            continue
        short = [s for s in sources if f"(1, {BELOW}, 64)" in s or f", {BELOW}, 64)" in s]
        taken = [s for s in sources if TAKEN in s]
        assert taken and all(TAKEN not in s for s in short), sources
        if merge != "leak":         # the fold: no split or views left around it
            assert all(ONE_CALL in s and "qkv_attention" in s for s in taken), sources
        else:                       # the kernel alone, its result contiguous as the matmul's
            assert all(ONE_CALL not in s and "masked_attention_contiguous" in s
                       for s in taken), sources


class _Recording:
    """The attention library, recording the thread count of each fp32 call."""

    def __init__(self, library) -> None:
        self.library, self.threads = library, []

    def __getattr__(self, name):
        return getattr(self.library, name)

    def dynvm_attention(self, *args):
        self.threads.append(args[-1])
        return self.library.dynvm_attention(*args)


def test_small_fp32_calls_run_on_the_calling_thread_and_equal_the_teams(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    recording = _Recording(attention_native._LIBRARY)
    monkeypatch.setattr(attention_native, "_LIBRARY", recording)
    monkeypatch.setattr(attention_native, "_THREADS", lambda: 2)
    small = tuple(_operands(gen, 1, 8, 32, 32))      # 8,192 scores: the held-out batch 1
    large = tuple(_operands(gen, 4, 8, 32, 32))      # 32,768
    threshold = attention_native.FP32_ONE_THREAD_SCORES
    for q, k, v in (small, large):
        monkeypatch.setattr(attention_native, "FP32_ONE_THREAD_SCORES", threshold)
        alone = masked_attention_contiguous(q, k, v, None, 0.0, False, 0.2)
        monkeypatch.setattr(attention_native, "FP32_ONE_THREAD_SCORES", 0)
        team = masked_attention_contiguous(q, k, v, None, 0.0, False, 0.2)
        assert torch.equal(alone, team)      # each (batch, head) the same work either way
    assert recording.threads == [1, 2, 2, 2]
