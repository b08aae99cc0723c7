"""Attention instructions beyond plain SDPA: grouped heads (SDPA_GQA).

Note [Grouped heads without copies]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`scaled_dot_product_attention(q, k, v, enable_gqa=True)` with H query heads over Hkv
key/value heads (H = g * Hkv) lowers to SDPA_GQA. Expanding K and V to every head
(repeat_kv, or the math kernel's repeat_interleave) copies the whole cache g times per
call: at L = 2,000 that copy was 81% of a Llama decode step. SDPA_GQA instead folds the
g query heads of a group into the query's length ([B, H, T, D] -> [B, Hkv, g * T, D], a
view whenever T = 1, as in every decode step) and runs one ordinary SDPA over the
unexpanded K and V; the mask follows the same fold (a view when its head dim is 1 and
T = 1, else a copy of the mask, never of K or V). The fold is exact: each folded query
row attends to the same keys with the same mask row as before. It does not hold for a
causal SDPA (is_causal aligns the causal band on the query's length, which the fold
changes), so a causal call, or one whose operands are not [B, H, T, D], runs torch's
own grouped-head kernel instead (the CPU flash kernel takes grouped heads without a
copy). The shape function runs the same decision on meta operands, so abstract and
real results agree stride for stride.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynvm.vm.isa import OpClass, op
from dynvm.vm.ops_tensor import _FLASH, _sdpa, _sdpa_abstract

aten = torch.ops.aten


def _fold(q, k, mask, is_causal):
    """(folded query, folded mask) for Note [Grouped heads without copies], or None when
    the fold does not apply."""
    if is_causal or q.dim() != 4 or k.dim() != 4:
        return None
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    if kv_heads == 0 or heads % kv_heads or heads == kv_heads:
        return None
    groups = heads // kv_heads
    folded_q = q.reshape(batch, kv_heads, groups * length, dim)
    if mask is None:
        return folded_q, None
    if mask.dim() > 4:
        return None
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    mask_batch, mask_heads = mask.shape[:2]
    keys = k.shape[2]
    mask = mask.expand(mask_batch, mask_heads, length, keys)
    if mask_heads == 1:
        mask = mask.unsqueeze(2).expand(mask_batch, kv_heads, groups, length, keys)
    elif mask_heads == heads:
        mask = mask.view(mask_batch, kv_heads, groups, length, keys) if mask.is_contiguous() \
            else mask.reshape(mask_batch, kv_heads, groups, length, keys)
    else:
        return None
    return folded_q, mask.reshape(mask_batch, kv_heads, groups * length, keys)


def _sdpa_gqa_with(inner, native):
    def run(q, k, v, mask, dropout_p, is_causal, scale):
        folded = _fold(q, k, mask, is_causal)
        if folded is None:
            return native(q, k, v, mask, dropout_p, is_causal, scale)
        folded_q, folded_mask = folded
        out = inner(folded_q, k, v, folded_mask, dropout_p, False, scale)
        return out.reshape(*q.shape[:-1], v.shape[-1])
    return run


def _native_gqa(q, k, v, mask, dropout_p, is_causal, scale):
    if q.shape[-3] == k.shape[-3]:
        return _sdpa(q, k, v, mask, dropout_p, is_causal, scale)
    return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale=scale,
                                          enable_gqa=True)


def _native_gqa_abstract(q, k, v, mask, dropout_p, is_causal, scale):
    if q.shape[-3] == k.shape[-3]:
        return _sdpa_abstract(q, k, v, mask, dropout_p, is_causal, scale)
    if q.device.type == "meta" and q.dim() == 4 and _choice(
            q, k, v, mask, dropout_p, is_causal, scale) == _FLASH:
        # The CPU flash kernel's meta function takes grouped heads and gives its layout.
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]
    return _native_gqa(q, k, v, mask, dropout_p, is_causal, scale)


def _choice(q, k, v, mask, dropout_p, is_causal, scale) -> int:
    def cpu(t):
        return None if t is None else torch.empty_strided(t.shape, t.stride(),
                                                          dtype=t.dtype)
    return torch._fused_sdp_choice(cpu(q), cpu(k), cpu(v), cpu(mask), dropout_p, is_causal,
                                   scale=scale, enable_gqa=True)


sdpa_gqa = _sdpa_gqa_with(_sdpa, _native_gqa)
"""SDPA_GQA's implementation (Note [Grouped heads without copies])."""
sdpa_gqa_abstract = _sdpa_gqa_with(_sdpa_abstract, _native_gqa_abstract)
"""SDPA_GQA's shape function: the same decision on meta operands."""


ATTENTION_OPS = (
    # Reached from aten.scaled_dot_product_attention with enable_gqa=True (the frontend's
    # keyword variants, vm/frontend/lower.py): no ATen overload of its own.
    op("SDPA_GQA", OpClass.TENSOR, "T,T,T,T?,S,K,K", "T",
       "SDPA with H query heads over fewer key/value heads, without copying K/V",
       impl=sdpa_gqa, custom_shape_fn=sdpa_gqa_abstract),
)
