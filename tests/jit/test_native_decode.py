"""A decode step's small ops in C (Note [A decode step's small ops in C],
jit/backends/cpu/native_decode.py): each kernel equal to the operations it replaces over
random shapes (views fall back to torch's operations), the one-row attention step
writing the interpreter's keys and values into the cache bit for bit, out-of-range
operands raising as the operations do; and in the JIT's dense kernels of tiny decoders
(cpu_fusion="dense", Note [Dense weights only]), every layer's attention step, RMS norm
and gated product on them, with greedy tokens equal to Hugging Face's.

Tolerance: the kernels sum in another order than ATen (vector lanes, then a lane sum)
and use their own exp (about 2 ulp): fp32 results agree to 1e-5 relative + 1e-6; the
attention's, whose scores over unit-scale operands reach tens (a sharp softmax), to
1e-4 relative + 2e-5 (measured worst 7e-6)."""

from __future__ import annotations

import random
import re

import pytest
import torch

import dynvm
from dynvm.jit.backends.cpu import native_decode, native_linear
from dynvm.vm.ops_fused import rotary_embed, silu_mul
from dynvm.vm.ops_kv import decode_attention, kv_append
from tests.generation._tiny import hf_greedy, left_padded, tiny_generator
from tests.jit._jit_helpers import eager_config
from tests.jit._kernel_run import views

needs_kernels = pytest.mark.skipif(not native_decode.available(),
                                   reason="dynvm's C library is not built or has no AVX-512F")


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _close_attention(got, want):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


@needs_kernels
def test_rms_norm_and_silu_mul_equal_torch_over_random_shapes_and_views():
    rng = random.Random(32)
    torch.manual_seed(32)
    for _ in range(40):
        rows, width = rng.randint(1, 20), rng.choice([2, 8, 17, 64, 100, 768, 2048])
        x = torch.randn(rows, 1, width) * rng.choice([0.1, 1.0, 8.0])
        weight = torch.randn(width) if rng.random() < 0.8 else None
        eps = rng.choice([1e-6, 1e-5, None])
        for view in views(x).values():
            _close(native_decode.rms_norm(view, [width], weight, eps),
                   torch.rms_norm(view, [width], weight, eps))
            if width % 2 == 0:
                _close(native_decode.silu_mul(view), silu_mul(view))


@needs_kernels
def test_silu_mul_at_large_magnitudes():
    # exp's clamped range: silu of -100 is -0 (a tiny negative in torch), of 100 is 100
    x = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0, 1e-3, -87.5, 88.0] * 2])
    _close(native_decode.silu_mul(x), silu_mul(x))


@needs_kernels
@pytest.mark.parametrize("input_major", [False, True], ids=["[N, K]", "[K, N]"])
def test_the_norm_and_the_gated_product_inside_the_gemm_call(input_major):
    rng = random.Random(5)
    torch.manual_seed(5)
    for _ in range(20):
        rows, k, n = rng.randint(1, 16), rng.choice([8, 17, 64, 768]), rng.choice([3, 64, 300])
        x, gated = torch.randn(rows, 1, k), torch.randn(rows, 1, 2 * k)
        norm_weight, eps = torch.randn(k), rng.choice([1e-6, None])
        w = torch.randn(n, k)
        stored = w.t().contiguous() if input_major else w
        bias = torch.randn(n) if rng.random() < 0.5 else None
        add = torch.randn(rows, 1, n) if rng.random() < 0.5 else None
        extra = (0 if bias is None else bias) + (0 if add is None else add)
        got = native_decode.norm_linear(x, [k], norm_weight, eps, stored, bias, add,
                                        input_major)
        want = torch.rms_norm(x, [k], norm_weight, eps) @ w.t() + extra
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * k ** 0.5)
        got = native_decode.silu_mul_linear(gated, stored, bias, add, input_major)
        want = silu_mul(gated) @ w.t() + extra
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * k ** 0.5)
    # more rows than the small-M kernel takes, or a view: the two calls run instead
    x = torch.randn(40, 64)
    w = torch.randn(32, 64)
    stored = w.t().contiguous() if input_major else w
    for view in (x, x[:, ::1][::2]):
        want = torch.rms_norm(view, [64], None, None) @ w.t()
        torch.testing.assert_close(
            native_decode.norm_linear(view, [64], None, None, stored, None, None,
                                      input_major), want, rtol=1e-4, atol=2e-4)


@needs_kernels
def test_the_norm_of_the_picked_rows_equals_index_after_the_norm():
    torch.manual_seed(9)
    for tokens, picks in ((1, [0]), (7, [6]), (9, [2, 5, 8]), (4, [-1, 0])):
        x, weight = torch.randn(1, tokens, 48), torch.randn(48)
        pick = torch.tensor(picks)
        _close(native_decode.rms_norm_rows(x, [48], weight, 1e-6, pick),
               torch.rms_norm(x, [48], weight, 1e-6)[:, pick])
    with pytest.raises(IndexError):
        native_decode.rms_norm_rows(x, [48], weight, 1e-6, torch.tensor([4]))


@needs_kernels
def test_the_rotary_table_equals_torchs_within_an_ulp():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    for positions in ([0], [5], [1, 2, 3, 160], [2047]):
        at = torch.tensor(positions)
        cos, sin = native_decode.rotary_table(at, inv_freq, 1.0, 0.5)
        freqs = at[None, :, None].float() * inv_freq
        both = torch.cat([freqs, freqs], -1)
        torch.testing.assert_close(cos, both.cos(), rtol=0, atol=1.2e-7)
        torch.testing.assert_close(sin, both.sin() * 0.5, rtol=0, atol=1.2e-7)


@needs_kernels
def test_a_decoder_layer_in_one_call_is_its_five_calls_bit_for_bit():
    torch.manual_seed(11)
    width, heads, kv_heads, dim, hidden = 96, 6, 2, 16, 80
    h = torch.randn(1, 1, width)
    norm1, norm2 = torch.randn(width), torch.randn(width)
    qkv_w = torch.randn((heads + 2 * kv_heads) * dim, width) / width ** 0.5
    o_w, o_b = torch.randn(width, heads * dim) / 10, torch.randn(width)
    gu_w, d_w = torch.randn(2 * hidden, width) / 10, torch.randn(width, hidden) / 10
    cos, sin = torch.randn(1, 1, dim), torch.randn(1, 1, dim)
    keys, values = torch.randn(3, kv_heads, 20, dim), torch.randn(3, kv_heads, 20, dim)
    at = (torch.tensor([1]), torch.tensor([7]), torch.tensor([8]))
    mine, theirs = [keys.clone(), values.clone()], [keys.clone(), values.clone()]
    h2, out = native_decode.decoder_layer_row(
        h, [width], norm1, 1e-6, qkv_w, None, cos, sin, *mine, *at, None, heads, kv_heads,
        o_w, o_b, [width], norm2, 1e-5, gu_w, None, d_w, None)
    qkv = native_decode.norm_linear(h, [width], norm1, 1e-6, qkv_w, None, None, False)
    attended = native_decode.attention_qkv(qkv, cos, sin, *theirs, *at, None, heads,
                                           kv_heads, True)
    want_h2 = native_linear.small_m_linear(attended, o_w, o_b, h, False)
    gated = native_decode.norm_linear(want_h2, [width], norm2, 1e-5, gu_w, None, None, False)
    want = native_decode.silu_mul_linear(gated, d_w, None, want_h2, False)
    assert torch.equal(h2, want_h2) and torch.equal(out, want)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    # and against torch's own operations, to float32 rounding
    fresh = [keys.clone(), values.clone()]
    q, k, v = (part.view(1, 1, -1, dim).permute(0, 2, 1, 3) for part in
               (torch.rms_norm(h, [width], norm1, 1e-6) @ qkv_w.t()).split(
                   [heads * dim, kv_heads * dim, kv_heads * dim], -1))
    attention = _reference(q, k, v, cos.unsqueeze(1), sin.unsqueeze(1), *fresh, *at, None)
    torch_h2 = h + attention.permute(0, 2, 1, 3).reshape(1, 1, -1) @ o_w.t() + o_b
    torch_out = torch_h2 + silu_mul(torch.rms_norm(torch_h2, [width], norm2, 1e-5)
                                    @ gu_w.t()) @ d_w.t()
    torch.testing.assert_close(h2, torch_h2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, torch_out, rtol=1e-4, atol=1e-4)
    # a slot past the state: the five calls run, and raise as the operations do
    with pytest.raises(IndexError):
        native_decode.decoder_layer_row(
            h, [width], norm1, 1e-6, qkv_w, None, cos, sin, *mine, torch.tensor([3]),
            *at[1:], None, heads, kv_heads, o_w, o_b, [width], norm2, 1e-5, gu_w, None,
            d_w, None)


def _layer_operands(heads, kv_heads, dim, slots, capacity, seed):
    torch.manual_seed(seed)
    qkv = torch.randn(1, 1, (heads + 2 * kv_heads) * dim)   # one LINEAR's row, split
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q, k, v = (t.view(1, 1, -1, dim).permute(0, 2, 1, 3) for t in (q, k, v))
    cos, sin = torch.randn(1, 1, 1, dim), torch.randn(1, 1, 1, dim)
    keys = torch.randn(slots, kv_heads, capacity, dim)
    values = torch.randn(slots, kv_heads, capacity, dim)
    return q, k, v, cos, sin, keys, values


def _reference(q, k, v, cos, sin, keys, values, slots, positions, lengths, scale):
    return decode_attention(rotary_embed(q, cos, sin),
                            kv_append(keys, rotary_embed(k, cos, sin), slots, positions),
                            kv_append(values, v, slots, positions), slots, lengths, scale)


@needs_kernels
@pytest.mark.parametrize("heads, kv_heads, dim", [(12, 4, 64), (4, 2, 8), (6, 6, 32),
                                                  (8, 1, 96), (3, 1, 130)])
def test_attention_row_equals_rotary_append_and_decode_attention(heads, kv_heads, dim):
    rng = random.Random(heads * dim)
    for trial in range(6):
        slots_n, capacity = rng.randint(1, 5), rng.randint(1, 300)
        slot, position = rng.randrange(slots_n), rng.randrange(capacity)
        scale = rng.choice([None, 0.125, 1.0])
        operands = _layer_operands(heads, kv_heads, dim, slots_n, capacity, trial)
        mine = [t.clone() for t in operands[5:]]
        theirs = [t.clone() for t in operands[5:]]
        at = (torch.tensor([slot]), torch.tensor([position]), torch.tensor([position + 1]))
        got = native_decode.attention_row(*operands[:5], *mine, *at, scale)
        want = _reference(*operands[:5], *theirs, *at, scale)
        assert got.shape == want.shape == (1, heads, 1, dim) and got.is_contiguous()
        _close_attention(got, want)
        assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])


@needs_kernels
@pytest.mark.parametrize("flat", [False, True], ids=["[1, H, 1, D]", "[1, 1, H*D]"])
def test_attention_qkv_reads_the_projections_row_as_its_views_would(flat):
    rng = random.Random(7)
    for heads, kv_heads, dim in ((12, 4, 64), (4, 2, 8), (6, 6, 32), (3, 1, 130)):
        torch.manual_seed(heads * dim)
        row = torch.randn(1, 1, (heads + 2 * kv_heads) * dim)
        q, k, v = (part.view(1, 1, -1, dim).permute(0, 2, 1, 3) for part in
                   row.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
        cos, sin = torch.randn(1, 1, dim), torch.randn(1, 1, dim)
        slots_n, capacity = rng.randint(1, 4), rng.randint(2, 200)
        keys, values = (torch.randn(slots_n, kv_heads, capacity, dim) for _ in range(2))
        theirs = [keys.clone(), values.clone()]
        position = rng.randrange(capacity)
        at = (torch.tensor([rng.randrange(slots_n)]), torch.tensor([position]),
              torch.tensor([position + 1]))
        got = native_decode.attention_qkv(row, cos, sin, keys, values, *at, 0.125, heads,
                                          kv_heads, flat)
        want = _reference(q, k, v, cos.unsqueeze(1), sin.unsqueeze(1), *theirs, *at, 0.125)
        if flat:
            want = want.permute(0, 2, 1, 3).clone().view(1, 1, heads * dim)
        assert got.shape == want.shape and got.is_contiguous()
        _close_attention(got, want)
        assert torch.equal(keys, theirs[0]) and torch.equal(values, theirs[1])
        # an offset row (not contiguous from its storage's start is fine; a strided one
        # runs the operations)
        wide = torch.zeros(1, 1, 2 * row.shape[-1])
        wide[..., ::2] = row
        again = native_decode.attention_qkv(wide[..., ::2], cos, sin, keys.clone(),
                                            values.clone(), *at, 0.125, heads, kv_heads, flat)
        _close_attention(again, want)


@needs_kernels
def test_attention_row_out_of_range_does_what_the_operations_do():
    q, k, v, cos, sin, keys, values = _layer_operands(4, 2, 8, 2, 10, 0)
    before = keys.clone()
    at = (torch.tensor([2]), torch.tensor([0]), torch.tensor([1]))   # no slot 2
    with pytest.raises(IndexError):
        _reference(q, k, v, cos, sin, keys.clone(), values.clone(), *at, None)
    with pytest.raises(IndexError):
        native_decode.attention_row(q, k, v, cos, sin, keys, values, *at, None)
    assert torch.equal(keys, before)
    # a position past the capacity: torch writes nothing (an empty slice) and attends
    # over the whole slot; the C kernel refuses it and the operations run instead
    at = (torch.tensor([0]), torch.tensor([10]), torch.tensor([11]))
    theirs = [keys.clone(), values.clone()]
    got = native_decode.attention_row(q, k, v, cos, sin, keys, values, *at, None)
    _close(got, _reference(q, k, v, cos, sin, *theirs, *at, None))
    assert torch.equal(keys, before)


@needs_kernels
def test_attention_row_over_a_non_contiguous_cache_runs_the_operations():
    q, k, v, cos, sin, keys, values = _layer_operands(4, 2, 8, 3, 12, 1)
    wide_k, wide_v = torch.zeros(3, 2, 12, 16), torch.zeros(3, 2, 12, 16)
    wide_k[..., :8], wide_v[..., :8] = keys, values
    at = (torch.tensor([1]), torch.tensor([4]), torch.tensor([5]))
    got = native_decode.attention_row(q, k, v, cos, sin, wide_k[..., :8], wide_v[..., :8],
                                      *at, None)
    want = _reference(q, k, v, cos, sin, keys, values, *at, None)
    _close_attention(got, want)
    assert torch.equal(wide_k[..., :8], keys)


def _dense_config():
    return eager_config(families=True, cpu_fusion="dense")


@needs_kernels
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt2"])
def test_dense_decode_kernels_use_them_and_tokens_equal_hf(kind):
    model, programs = tiny_generator(kind)
    with dynvm.Generator(programs, jit=_dense_config()) as generator:
        for lengths in ((6,), (7, 3, 5)):
            ids, mask = left_padded(lengths, seed=len(lengths))
            expected = hf_greedy(model, ids, mask, 6, eos_token_id=None)
            actual = generator.generate(ids, mask, max_new_tokens=6, stop_tokens=())
            assert torch.equal(actual, expected), kind
        assert generator.stats().specialized_steps > 0
        sources = [a.source for a in generator.step.jit.artifacts.values()]
    one_row = [s for s in sources if "native_attention_qkv" in s]
    if kind == "gpt2":   # no rotary, layer norm, GELU: nothing of this pass's
        assert not one_row and not any("native_rms_norm" in s for s in sources)
        return
    # the B=1 decode kernel: both layers' attention steps, every norm, both MLPs
    assert one_row, "no kernel ran a one-row attention step"
    source = one_row[0].split("\ndef ")[-1]   # one body (an arena's kernel has two)
    assert source.count("= native_attention_qkv") == 2   # from the QKV row, no views
    # tiny weights stay on torch's GEMMs, so every norm and product is a call of its own,
    # the last norm on the row the head reads
    assert len(re.findall(r"= native_rms_norm\d", source)) == 4
    assert source.count("= native_silu_mul") == 2
    assert source.count("= native_rms_norm_rows") == 1
    assert source.count("= native_rotary_table") == 1   # cos and sin, once a step
    calls = [line for line in source.splitlines() if not line.lstrip().startswith("#")]
    assert not any(f"= {name}" in line for line in calls
                   for name in ("ROTARY", "KV_APPEND", "DECODE_ATTN", "RMS_NORM", "SILU_MUL",
                                "SPLIT_WITH_SIZES", "PERMUTE", "CLONE", "COS", "CAT"))


@needs_kernels
def test_streamed_weights_take_the_norm_and_the_product_into_their_gemv_calls():
    """Weights past STREAMED_BYTES together (Note [Few rows over a streamed weight]) go
    to the small-M GEMM at batch 1, and each layer's norms and gated product are then
    computed inside the GEMV call that reads them."""
    import transformers as hf

    torch.manual_seed(1)
    model = hf.LlamaForCausalLM(hf.LlamaConfig(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=1024, vocab_size=512, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    model.config._attn_implementation = "sdpa"
    model.eval()
    programs = dynvm.compile_generator(model, max_batch=4, max_length=32, jit=False).programs
    ids = torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    with dynvm.Generator(programs, jit=_dense_config()) as generator:
        for _ in range(2):
            actual = generator.generate(ids, mask, max_new_tokens=8, stop_tokens=())
            assert torch.equal(actual, hf_greedy(model, ids, mask, 8, eos_token_id=None))
        sources = [a.source for a in generator.step.jit.artifacts.values()
                   if "(1, 1) int64" in a.source.splitlines()[1]]   # the B=1 decode step
    assert sources
    source = sources[0].split("\ndef ")[-1]
    # per layer one call: the QKV projection reading the input norm, the attention
    # step, the output projection with its residual, the gate/up projection reading the
    # post-attention norm, the down projection reading the gated product
    assert source.count("= native_decoder_layer_row") == 2
    assert "= native_norm_linear" not in source and "= native_attention" not in source
    # the final norm, read by the last-token pick before the head, on that row alone
    assert source.count("= native_rms_norm_rows") == 1
    assert not any("= INDEX" in line for line in source.splitlines()
                   if not line.lstrip().startswith("#"))
