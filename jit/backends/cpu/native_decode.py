"""A decode step's small operations as single calls of dynvm's C library.

Note [A decode step's small ops in C]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At batch 1 a decode step of the bench Llama (768 wide, 4 layers) is bound by its GEMVs
(~12.3 of 13.3 ms, the weights streamed once); what is left is ~100 small operations
whose cost is ATen's per-call overhead, not arithmetic. Measured in the JIT's B=1 decode
kernel, per step (2026-12-05 14:46 UTC, load 1.3, one thread, bench/decode_breakdown.py):
RMS_NORM 9 calls 0.475 ms (53 us each over 768 floats: torch.rms_norm is pow, mean,
add, rsqrt, mul, mul), DECODE_ATTN 4 x 84 us, ROTARY 8 x 28 us, SILU_MUL 4 x 43 us,
KV_APPEND 8 x 17 us, SPLIT_WITH_SIZES 4 x 27 us: ~1.0 ms, 7.5% of the step, and the
whole of the margin to CTranslate2 at batch 1.

So under cpu_fusion="dense" (a generator's JIT, Note [Dense weights only]) the CPU
backend (decode_fusion) rewrites, where the native library runs (AVX-512F):
- RMS_NORM (last-dim weight, float32) and SILU_MUL of at most `MAX_ROWS` rows into one
  C call each (`rms_norm`, `silu_mul`), and where the one reader of either is a GEMM on
  the small-M kernel, into that GEMM's call (`norm_linear`, `silu_mul_linear`: the rows
  into a scratch buffer, then the GEMM);
- one row's attention step, ROTARY of the query and of the new key, KV_APPEND of the key
  and of the value, and DECODE_ATTN (batch 1, one new token), into one C call
  (`attention_row`) that embeds the two, writes them into the cache at the row's slot
  and position, and attends the query heads over the slot's first `length` keys
  (grouped heads read their shared key/value head, no copy); where the three come from
  one projection's row by SPLIT_WITH_SIZES, VIEW and PERMUTE, and the result goes on by
  PERMUTE, CLONE and VIEW, the call reads the row and writes the flat result itself
  (`attention_qkv`), and cos and sin's UNSQUEEZEs go too;
- the rotary cos/sin table (positions -> float -> times the inverse frequencies -> cat
  -> COS and SIN, each times the scaling: 9 ops) into one call (`rotary_table`), and the
  final norm with the INDEX that picks the rows the head reads into one
  (`rms_norm_rows`);
- and a decoder layer's five calls that result (norm + QKV GEMV, attention step, output
  GEMV + residual, norm + gate/up GEMV, gated product + down GEMV + residual) into one
  (`decoder_layer_row`, the same C functions in the same order: equal bit for bit). Each
  return to Python between two GEMVs ran cold, its GEMV having streamed 2-13 MB of
  weight through the caches: the same ops as 16 calls took 0.8 ms a step more than as 4.
The bench Llama's B=1 decode kernel goes from 119 operations to 10 calls (the step's
ADD and EMBEDDING, the rotary table, 4 layers, the picked norm, the head's GEMV on
MKL, SELECT); beside its GEMVs 0.13 ms is left (bench.decode_breakdown, 15:39 UTC,
load 2.8). A/B in one process (two generators over the same programs, this pass off
and on, 8 generations interleaved), step p50 and tokens/s: 14.05 -> 13.36 ms (1.056x)
with the first three kernels (14:52, load ~1.1), 12.98 -> 11.80 (1.095x) with the norms
and products inside the GEMV calls (15:06, load 2.8-3.9), 12.46 -> 10.56 (1.175x) with
the layer calls (15:36, load 2.6); tokens equal. B=4 1.016x, B=16 1.012x (15:15-15:20,
load 1.6-2.2, before the layer calls, which take one row only). Against CTranslate2,
generations interleaved (`dynvm bench generate --systems dynvm-jit-vs-ct2,ctranslate2`,
15:42-15:47, load 2.9 -> 1.0): B=1 1.074 (A/A 0.998), B=4 2.048, B=16 1.548.
Each wrapper checks what the C code assumes (float32, contiguous rows, operands in
range) and otherwise runs the original operations, which compute (or raise) exactly as
the interpreter does. Results agree with torch's to float32 rounding, not bit for bit:
the sums are ordered differently (tests/jit/test_native_decode.py).
"""

from __future__ import annotations

import ctypes
import math

import torch

from dynvm.jit.backends.cpu.native_linear import NATIVE_ROWS, library, small_m_linear
from dynvm.vm.ops_fused import rotary_embed
from dynvm.vm.ops_fused import silu_mul as torch_silu_mul
from dynvm.vm.ops_kv import decode_attention, kv_append

MAX_ROWS = 256
"""RMS_NORM and SILU_MUL over at most this many rows go to C (one thread; above it
torch's kernels, spread over the team, are the better choice)."""

_LIBRARY = library()
if _LIBRARY is not None:
    _P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    _LIBRARY.dynvm_rms_norm.argtypes = [_P, _L, _L, _L, _P, _F, _P, _L]
    _LIBRARY.dynvm_rms_norm.restype = None
    _LIBRARY.dynvm_silu_mul.argtypes = [_P, _L, _L, _L, _P, _L]
    _LIBRARY.dynvm_silu_mul.restype = None
    _LIBRARY.dynvm_attention_row.argtypes = [_P, _L, _P, _L, _P, _L, _P, _P, _P, _P, _L, _L,
                                             _L, _L, _L, _P, _P, _P, _F, _P]
    _LIBRARY.dynvm_attention_row.restype = ctypes.c_int
    _LIBRARY.dynvm_prologue_linear.argtypes = [ctypes.c_int, _P, _L, _L, _L, _P, _F,
                                               ctypes.c_int, _P, _L, _L, _P, _P, _L, _P, _L]
    _LIBRARY.dynvm_prologue_linear.restype = ctypes.c_int
    _LIBRARY.dynvm_rms_norm_rows.argtypes = [_P, _L, _P, _L, _L, _P, _F, _P]
    _LIBRARY.dynvm_rms_norm_rows.restype = ctypes.c_int
    _LIBRARY.dynvm_rotary_table.argtypes = [_P, _L, _P, _L, _F, _F, _P, _P]
    _LIBRARY.dynvm_rotary_table.restype = None
    _LIBRARY.dynvm_decoder_layer_row.argtypes = [
        _P, _L, _P, _F, _P, _P, _P, _P, _P, _P, _L, _L, _L, _L, _L, _P, _P, _P, _F, _P, _P,
        _P, _F, _P, _L, _P, _P, _P, _P, _P]
    _LIBRARY.dynvm_decoder_layer_row.restype = ctypes.c_int


def available() -> bool:
    """Whether the C kernels can run in this process."""
    return _LIBRARY is not None


def rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None,
             eps: float | None) -> torch.Tensor:
    """torch.rms_norm over the last dim, in C for contiguous float32 rows."""
    n = x.shape[-1]
    if (x.dtype != torch.float32 or not x.is_contiguous() or len(normalized_shape) != 1
            or x.numel() > MAX_ROWS * n or n == 0):
        return torch.rms_norm(x, normalized_shape, weight, eps)
    y = torch.empty_like(x)
    _LIBRARY.dynvm_rms_norm(x.data_ptr(), n, x.numel() // n, n,
                            None if weight is None else weight.data_ptr(),
                            torch.finfo(torch.float32).eps if eps is None else eps,
                            y.data_ptr(), n)
    return y


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SILU_MUL (silu of the first half of the last dim times the second), in C for
    contiguous float32 rows."""
    width = x.shape[-1]
    if (x.dtype != torch.float32 or not x.is_contiguous() or width % 2
            or x.numel() > MAX_ROWS * width or width == 0):
        return torch_silu_mul(x)
    half = width // 2
    y = x.new_empty((*x.shape[:-1], half))
    _LIBRARY.dynvm_silu_mul(x.data_ptr(), width, x.numel() // width, half, y.data_ptr(),
                            half)
    return y


def _rows_ok(t: torch.Tensor, heads: int, dim: int) -> bool:
    return (t.dtype == torch.float32 and t.shape == (1, heads, 1, dim)
            and t.stride(-1) == 1)


def _cache_operands_fit(keys, values, cos, sin, slots, positions, lengths, kv_heads: int,
                        dim: int) -> bool:
    """What the C attention step assumes of the cache, the rotary table and the row's
    slot, position and length (the C code checks their values)."""
    return (keys.dtype == torch.float32 and values.dtype == torch.float32
            and keys.dim() == 4 and keys.shape == values.shape and keys.shape[1] == kv_heads
            and keys.shape[-1] == dim and keys.is_contiguous() and values.is_contiguous()
            and cos.dtype == torch.float32 and sin.dtype == torch.float32
            and cos.numel() == dim and sin.numel() == dim
            and cos.stride(-1) == 1 and sin.stride(-1) == 1
            and all(t.dtype == torch.int64 and t.shape == (1,)
                    for t in (slots, positions, lengths)))


def attention_row(query, key, value, cos, sin, keys, values, slots, positions, lengths,
                  scale):
    """ROTARY(query), ROTARY(key), KV_APPEND of both into `keys`/`values`, DECODE_ATTN:
    one row's decode step (query [1, H, 1, D], key and value [1, Hkv, 1, D]) in one C
    call; the attention's result [1, H, 1, D]. Anything else runs those operations."""
    heads, dim = query.shape[1], query.shape[-1]
    kv_heads = key.shape[1] if key.dim() == 4 else 0
    if (_cache_operands_fit(keys, values, cos, sin, slots, positions, lengths, kv_heads, dim)
            and _rows_ok(query, heads, dim) and _rows_ok(key, kv_heads, dim)
            and _rows_ok(value, kv_heads, dim)):
        out = query.new_empty((1, heads, 1, dim))
        failed = _LIBRARY.dynvm_attention_row(
            query.data_ptr(), query.stride(1), key.data_ptr(), key.stride(1),
            value.data_ptr(), value.stride(1), cos.data_ptr(), sin.data_ptr(),
            keys.data_ptr(), values.data_ptr(), keys.shape[0], kv_heads, keys.shape[2],
            dim, heads, slots.data_ptr(), positions.data_ptr(), lengths.data_ptr(),
            1.0 / math.sqrt(dim) if scale is None else scale, out.data_ptr())
        if not failed:
            return out
    return decode_attention(rotary_embed(query, cos, sin),
                            kv_append(keys, rotary_embed(key, cos, sin), slots, positions),
                            kv_append(values, value, slots, positions), slots, lengths,
                            scale)


def attention_qkv(row, cos, sin, keys, values, slots, positions, lengths, scale,
                  heads: int, kv_heads: int, flat: bool):
    """`attention_row` over the query, key and value as one projection's row
    ([1, 1, (H + 2 Hkv) D]: H query heads, then Hkv key heads, then Hkv value heads) and
    cos and sin as any tensors of D floats; the result [1, 1, H*D] when `flat`, else
    [1, H, 1, D]. The C call reads the row where it is, without its views."""
    dim = keys.shape[-1] if keys.dim() == 4 else 0
    width = (heads + 2 * kv_heads) * dim
    if (dim and row.dtype == torch.float32 and row.is_contiguous() and row.numel() == width
            and _cache_operands_fit(keys, values, cos, sin, slots, positions, lengths,
                                    kv_heads, dim)):
        out = row.new_empty((1, 1, heads * dim) if flat else (1, heads, 1, dim))
        base, size = row.data_ptr(), row.element_size()
        failed = _LIBRARY.dynvm_attention_row(
            base, dim, base + heads * dim * size, dim, base + (heads + kv_heads) * dim * size,
            dim, cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
            keys.shape[0], kv_heads, keys.shape[2], dim, heads, slots.data_ptr(),
            positions.data_ptr(), lengths.data_ptr(),
            1.0 / math.sqrt(dim) if scale is None else scale, out.data_ptr())
        if not failed:
            return out
    # the operations the call stands for: the row's views, then attention_row's
    dim = row.shape[-1] // (heads + 2 * kv_heads)
    query, key, value = (part.view(1, row.shape[1], -1, dim).permute(0, 2, 1, 3) for part in
                         row.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    out = attention_row(query, key, value, cos.reshape(1, 1, 1, dim),
                        sin.reshape(1, 1, 1, dim), keys, values, slots, positions, lengths,
                        scale)
    return out.permute(0, 2, 1, 3).reshape(1, row.shape[1], heads * dim) if flat else out


_RMS_NORM, _SILU_MUL = 0, 1


def _prologue_linear(prologue: int, x, width: int, norm_weight, eps, weight, bias, add,
                     input_major: bool):
    """The small-M GEMM over the prologue's rows (Note [A small-M GEMM of our own]) in
    one C call, or None when the operands are not what the call reads."""
    rows = x.numel() // max(1, x.shape[-1])
    if (x.dtype != torch.float32 or not x.is_contiguous() or not 1 <= rows <= NATIVE_ROWS[1]
            or weight.stride(-1) != 1):
        return None
    n = weight.shape[1] if input_major else weight.shape[0]
    if weight.shape[0 if input_major else 1] != width:
        return None
    lda = 0
    if add is not None:
        add = add.reshape(rows, n)
        if add.stride(-1) != 1 or (rows > 1 and add.stride(0) < n):
            add = add.contiguous()
        lda = add.stride(0)
    y = torch.empty(rows, n, dtype=torch.float32)
    failed = _LIBRARY.dynvm_prologue_linear(
        prologue, x.data_ptr(), x.shape[-1], rows, width,
        None if norm_weight is None else norm_weight.data_ptr(),
        torch.finfo(torch.float32).eps if eps is None else eps, int(input_major),
        weight.data_ptr(), weight.stride(0), n, None if bias is None else bias.data_ptr(),
        None if add is None else add.data_ptr(), lda, y.data_ptr(), n)
    return None if failed else y.view(*x.shape[:-1], n)


def norm_linear(x, normalized_shape, norm_weight, eps, weight, bias, add, input_major):
    """RMS_NORM then the small-M GEMM over the normalized rows (`small_m_linear`'s
    operands after the norm's), in one C call."""
    width = x.shape[-1]
    if len(normalized_shape) == 1 and normalized_shape[0] == width and (
            norm_weight is None or (norm_weight.dtype == torch.float32
                                    and norm_weight.is_contiguous()
                                    and norm_weight.numel() == width)):
        y = _prologue_linear(_RMS_NORM, x, width, norm_weight, eps, weight, bias, add,
                             input_major)
        if y is not None:
            return y
    return small_m_linear(rms_norm(x, normalized_shape, norm_weight, eps), weight, bias, add,
                          input_major)


def silu_mul_linear(x, weight, bias, add, input_major):
    """SILU_MUL then the small-M GEMM over its rows, in one C call."""
    if x.shape[-1] % 2 == 0:
        y = _prologue_linear(_SILU_MUL, x, x.shape[-1] // 2, None, None, weight, bias, add,
                             input_major)
        if y is not None:
            return y
    return small_m_linear(silu_mul(x), weight, bias, add, input_major)


def rms_norm_rows(x, normalized_shape, weight, eps, pick):
    """`rms_norm(x)[:, pick]` for x [1, N, W] and pick [R] int64 (INDEX over dim 1 of the
    normed rows: the rows whose logits a step returns), normalizing only the picked rows,
    in one C call."""
    width = x.shape[-1]
    if (x.dim() == 3 and x.shape[0] == 1 and x.dtype == torch.float32 and x.is_contiguous()
            and len(normalized_shape) == 1 and normalized_shape[0] == width
            and pick.dim() == 1 and pick.dtype == torch.int64 and pick.is_contiguous()
            and (weight is None or (weight.dtype == torch.float32 and weight.is_contiguous()
                                    and weight.numel() == width))):
        y = x.new_empty((1, pick.shape[0], width))
        failed = _LIBRARY.dynvm_rms_norm_rows(
            x.data_ptr(), x.shape[1], pick.data_ptr(), pick.shape[0], width,
            None if weight is None else weight.data_ptr(),
            torch.finfo(torch.float32).eps if eps is None else eps, y.data_ptr())
        if not failed:
            return y
    return rms_norm(x, normalized_shape, weight, eps)[:, pick]


def rotary_table(positions, inv_freq, cos_scale, sin_scale):
    """(cos, sin), each [1, N, D]: `cat(f, f).cos() * cos_scale` and the same with sin,
    for f = positions[None, :, None].float() * inv_freq (positions [N] int64, inv_freq
    D / 2 floats), in one C call."""
    half = inv_freq.numel()
    n = positions.shape[0] if positions.dim() == 1 else -1
    if (n >= 0 and positions.dtype == torch.int64 and positions.is_contiguous()
            and inv_freq.dtype == torch.float32 and inv_freq.is_contiguous()):
        cos = torch.empty(1, n, 2 * half)
        sin = torch.empty(1, n, 2 * half)
        _LIBRARY.dynvm_rotary_table(positions.data_ptr(), n, inv_freq.data_ptr(), half,
                                    cos_scale, sin_scale, cos.data_ptr(), sin.data_ptr())
        return cos, sin
    freqs = positions[None, :, None].float() * inv_freq
    both = torch.cat([freqs, freqs], -1)
    return both.cos() * cos_scale, both.sin() * sin_scale


def _rows_of(weight, rows: int, width: int) -> bool:
    return (weight.dtype == torch.float32 and weight.shape == (rows, width)
            and weight.is_contiguous())


def _vector(bias, size: int) -> bool:
    return bias is None or (bias.dtype == torch.float32 and bias.shape == (size,)
                            and bias.is_contiguous())


def decoder_layer_row(h, norm1_shape, norm1, eps1, qkv_weight, qkv_bias, cos, sin, keys,
                      values, slots, positions, lengths, scale, heads, kv_heads, o_weight,
                      o_bias, norm2_shape, norm2, eps2, gate_up_weight, gate_up_bias,
                      down_weight, down_bias):
    """One decoder layer of a one-token row in one C call (Note [A decode step's small
    ops in C]): (h2, out) with h2 = h + o_proj(attention_qkv(norm_linear(h)))
    and out = h2 + down(silu_mul(gate_up(rms_norm(h2)))), the calls it stands for."""
    width = h.shape[-1]
    dim = keys.shape[-1] if keys.dim() == 4 else 0
    inner = heads * dim
    hidden = gate_up_weight.shape[0] // 2
    if (dim and h.dtype == torch.float32 and h.is_contiguous() and h.numel() == width
            and list(norm1_shape) == [width] and list(norm2_shape) == [width]
            and _vector(norm1, width) and _vector(norm2, width)
            and _rows_of(qkv_weight, (heads + 2 * kv_heads) * dim, width)
            and _vector(qkv_bias, (heads + 2 * kv_heads) * dim)
            and _rows_of(o_weight, width, inner) and _vector(o_bias, width)
            and _rows_of(gate_up_weight, 2 * hidden, width) and _vector(gate_up_bias, 2 * hidden)
            and _rows_of(down_weight, width, hidden) and _vector(down_bias, width)
            and _cache_operands_fit(keys, values, cos, sin, slots, positions, lengths,
                                    kv_heads, dim)):
        h2, out = torch.empty_like(h), torch.empty_like(h)
        eps = torch.finfo(torch.float32).eps

        def ptr(t):
            return None if t is None else t.data_ptr()

        failed = _LIBRARY.dynvm_decoder_layer_row(
            h.data_ptr(), width, ptr(norm1), eps if eps1 is None else eps1,
            qkv_weight.data_ptr(), ptr(qkv_bias), cos.data_ptr(), sin.data_ptr(),
            keys.data_ptr(), values.data_ptr(), keys.shape[0], kv_heads, keys.shape[2], dim,
            heads, slots.data_ptr(), positions.data_ptr(), lengths.data_ptr(),
            1.0 / math.sqrt(dim) if scale is None else scale, o_weight.data_ptr(),
            ptr(o_bias), ptr(norm2), eps if eps2 is None else eps2,
            gate_up_weight.data_ptr(), hidden, ptr(gate_up_bias), down_weight.data_ptr(),
            ptr(down_bias), h2.data_ptr(), out.data_ptr())
        if not failed:
            return h2, out
    qkv = norm_linear(h, norm1_shape, norm1, eps1, qkv_weight, qkv_bias, None, False)
    attended = attention_qkv(qkv, cos, sin, keys, values, slots, positions, lengths, scale,
                             heads, kv_heads, True)
    h2 = small_m_linear(attended, o_weight, o_bias, h, False)
    gated = norm_linear(h2, norm2_shape, norm2, eps2, gate_up_weight, gate_up_bias, None,
                        False)
    return h2, silu_mul_linear(gated, down_weight, down_bias, h2, False)
