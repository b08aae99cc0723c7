"""Indexing instructions: gathers, scatters (out of place), embedding lookups, sorting,
and the ops whose result size depends on data (see Note [Data-dependent sizes]).

Note [Data-dependent sizes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
NONZERO, MASKED_SELECT, UNIQUE(_CONSECUTIVE), BINCOUNT and INDEX with a boolean mask
return as many elements as the data says: no meta kernel can know their shape. Their
shape functions return None (Note [Shape functions]): abstract evaluation then knows
nothing of the result or of anything computed from it, so the JIT folds no shape and
plans no buffer past them, and the guard of a specialization never depends on them. The
exporter gives the result's size an unbacked symbol; the graph reads it with
`sym_size`, which lowers to DIM on the result register, a value read at run time.

Ops taking a list of optional tensors (`Tensor?[] indices` of INDEX and INDEX_PUT) carry
it as two operands: a literal tuple saying which positions hold a tensor, and the list
of those tensors (an operand list holds registers only).
"""

from __future__ import annotations

import torch

from dynvm.vm.isa import OutForm
from dynvm.vm.ops_common import tensor_op

aten = torch.ops.aten


def _embedding(weight, indices, padding_idx):
    return torch.embedding(weight, indices, padding_idx)


def _embedding_out(weight, indices, _padding_idx, out):
    rows = torch.index_select(weight, 0, indices.reshape(-1), out=out)
    return rows.view(*indices.shape, weight.shape[1])


def _optional_list(present, tensors) -> list:
    """Rebuild `Tensor?[]` from its two operands (Note [Data-dependent sizes])."""
    items = iter(tensors)
    return [next(items) if here else None for here in present]


def split_optional_list(values: list) -> tuple[tuple[bool, ...], list]:
    """`Tensor?[]` as its two operands: which positions hold a tensor, and those."""
    return (tuple(v is not None for v in values), [v for v in values if v is not None])


def _lower_index(x, indices):
    return (x, *split_optional_list(indices))


def _lower_index_put(x, indices, values, accumulate):
    return (x, *split_optional_list(indices), values, accumulate)


_aten_index = aten.index.Tensor


def _index(x, present, tensors):
    if present == (True,) and tensors[0].dim():
        # x[idx] through Tensor.__getitem__: the same advanced-indexing kernel, about
        # 3 us faster than the overload. Not for a 0-dim index, which __getitem__ reads
        # as an int (a view, where aten.index copies).
        return x[tensors[0]]
    return _aten_index(x, _optional_list(present, tensors))


def _has_mask(tensors) -> bool:
    return any(t.dtype in (torch.bool, torch.uint8) for t in tensors)


def _index_abstract(x, present, tensors):
    if _has_mask(tensors):
        return None   # as many rows as the mask has true values
    return _index(x, present, tensors)


_aten_index_put = aten.index_put.default


def _index_put(x, present, tensors, values, accumulate):
    if len(tensors) == len(present):   # torch's binding takes no None in the list
        return torch.index_put(x, tensors, values, accumulate)
    return _aten_index_put(x, _optional_list(present, tensors), values, accumulate)


def _embedding_bag_abstract(weight, indices, offsets, scale_grad, mode, sparse,
                            per_sample_weights, include_last_offset, padding_idx):
    # The meta kernel gets the bag results right but not the CPU kernel's bookkeeping
    # outputs: its fast sum path (fp32/fp16/bf16, no padding index) leaves offset2bag
    # empty, and max_indices has one entry per bag unless mode is max. The table test
    # holds this rule to the real kernel.
    out, offset2bag, bag_size, max_indices = torch._embedding_bag(
        weight, indices, offsets, scale_grad, mode, sparse, per_sample_weights,
        include_last_offset, padding_idx)
    if mode == 0 and padding_idx < 0 and weight.dtype in (torch.float32, torch.float16,
                                                          torch.bfloat16):
        offset2bag = offset2bag.new_empty((0,))
    if mode != 2:
        max_indices = bag_size.new_empty(bag_size.shape)
    return out, offset2bag, bag_size, max_indices


def _index_add(x, dim, index, source):
    return torch.index_add(x, dim, index, source)


def _index_add_out(x, dim, index, source, out):
    return torch.index_add(x, dim, index, source, out=out)


def _index_select_out(x, dim, index, out):
    return torch.index_select(x, dim, index, out=out)


INDEX_OPS = (
    tensor_op("EMBEDDING", aten.embedding.default, "rows of a table", n_args=3,
              impl=_embedding, out=OutForm(_embedding_out)),
    tensor_op("INDEX_SELECT", aten.index_select.default, "gather slices by index",
              impl=torch.index_select, out=OutForm(_index_select_out)),
    tensor_op("INDEX_ADD", aten.index_add.default, "out-of-place x.index_add(dim, index, "
              "source)", n_args=4, impl=_index_add, out=OutForm(_index_add_out)),
    tensor_op("SCATTER_ADD", aten.scatter_add.default, "out-of-place scatter-add",
              impl=torch.scatter_add),
    tensor_op("SCATTER_REDUCE", aten.scatter_reduce.two,
              "out-of-place scatter with a reduction ('sum', 'mean', 'amax', ...)"),
    tensor_op("GATHER", aten.gather.default, "gather along a dim", n_args=3,
              impl=torch.gather),
    tensor_op("SCATTER", aten.scatter.src, "out-of-place scatter of src",
              impl=torch.scatter),
    tensor_op("SCATTER_VALUE", aten.scatter.value, "out-of-place scatter of a value",
              impl=torch.scatter),
    tensor_op("INDEX", aten.index.Tensor, "x[i0, i1, ...] with index tensors or masks",
              args="T,K,TL", impl=_index, custom_shape_fn=_index_abstract,
              lower_operands=_lower_index),
    tensor_op("INDEX_PUT", aten.index_put.default,
              "out-of-place x[indices] = values (or += with accumulate)", args="T,K,TL,T,K",
              impl=_index_put, lower_operands=_lower_index_put),
    tensor_op("MASKED_SCATTER", aten.masked_scatter.default,
              "out-of-place: source's elements in order where mask is true",
              impl=torch.masked_scatter),
    tensor_op("EMBEDDING_BAG", (aten._embedding_bag.default,
                                aten._embedding_bag_forward_only.default),
              "sums, means or maxima of bags of table rows (with offset2bag, bag sizes, "
              "max indices)", impl=torch._embedding_bag,
              custom_shape_fn=_embedding_bag_abstract),
    tensor_op("INDEX_REDUCE", aten.index_reduce.default,
              "out-of-place reduction of source slices into x at an index"),
    tensor_op("BUCKETIZE", aten.bucketize.Tensor, "the bucket of each value among boundaries"),
    tensor_op("SEARCHSORTED", aten.searchsorted.Tensor,
              "insertion points of values into a sorted sequence"),
    # -- sorting -----------------------------------------------------------------------
    tensor_op("SORT", aten.sort.default, "sorted values and their indices",
              impl=torch.sort),
    tensor_op("TOPK", aten.topk.default, "k largest (or smallest) values and indices",
              impl=torch.topk),
    # -- data-dependent sizes (Note [Data-dependent sizes]) -----------------------------
    tensor_op("NONZERO", aten.nonzero.default, "indices of the nonzero elements",
              impl=torch.nonzero, data_dependent=True),
    tensor_op("MASKED_SELECT", aten.masked_select.default,
              "the elements where mask is true, flattened", impl=torch.masked_select,
              data_dependent=True),
    tensor_op("UNIQUE", aten._unique2.default,
              "the distinct values (with inverse indices and counts)",
              impl=torch._unique2, data_dependent=True),
    tensor_op("UNIQUE_CONSECUTIVE", aten.unique_consecutive.default,
              "values with consecutive repeats removed (with inverse and counts)",
              impl=torch.unique_consecutive, data_dependent=True),
    tensor_op("BINCOUNT", aten.bincount.default,
              "count of each value (as many bins as the largest value)", impl=torch.bincount,
              data_dependent=True),
)
